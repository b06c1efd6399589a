//! The roles a node of a cluster runs on JetStream queues (DESIGN.md section 1a). The stations
//! are the ones of the in-process network ([`crate::stations`]); only their queues differ.
//!
//! Queues of a cluster: `inbound.<p>` (P partitions, by the routing hash of the trade key),
//! `match.<k>` (one per shard), `exceptions`. Every one is a stream of its own with bounds in
//! batches and bytes ([`ClusterLayout`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::lease::{LeaseKeeper, Leased, Leases};
use crate::matcher::ShardCounts;
use crate::pipeline::{
    join, restore_matcher, spawn, Ack, Aging, Envelope, Joined, OutboundEvent, PipelineError,
    RetryPolicy,
};
use crate::profile::Tolerances;
use crate::queue::jetstream::{JetStream, QueueLimits, StopReceiving};
use crate::queue::local;
use crate::queue::{QueueError, Tx};
use crate::refdata::RefData;
use crate::station::RunClock;
use crate::stations::matcher::run_matcher;
use crate::stations::validator::run_validator;
use crate::stations::writer::{run_writer, WriterContext};
use crate::stations::{RejectedItem, ToStore, Validated, WriterReport};
use crate::store::{PgStore, Store};

/// The queues of a cluster and their bounds.
#[derive(Debug, Clone, Copy)]
pub struct ClusterLayout {
    pub partitions: u32,
    pub shards: u32,
    /// Bounds of each inbound partition.
    pub inbound: QueueLimits,
    /// Bounds of each shard's match queue: the backlog a stalled shard may hold on disk.
    pub shard_backlog: QueueLimits,
    /// Bounds of the exception queue.
    pub exceptions: QueueLimits,
}

impl ClusterLayout {
    /// The queue of inbound partition `partition`.
    pub fn inbound_queue(partition: u32) -> String {
        format!("inbound.{partition}")
    }

    /// The match queue of `shard`.
    pub fn match_queue(shard: u32) -> String {
        format!("match.{shard}")
    }

    /// The exception queue.
    pub const EXCEPTIONS_QUEUE: &'static str = "exceptions";

    /// Creates every queue's stream that does not exist yet.
    pub fn ensure(&self, jetstream: &JetStream) -> Result<(), QueueError> {
        for partition in 0..self.partitions {
            jetstream.ensure_queue(&Self::inbound_queue(partition), self.inbound)?;
        }
        for shard in 0..self.shards {
            jetstream.ensure_queue(&Self::match_queue(shard), self.shard_backlog)?;
        }
        jetstream.ensure_queue(Self::EXCEPTIONS_QUEUE, self.exceptions)
    }
}

/// Validators running on a node, one per inbound partition whose lease it holds.
pub struct Validators {
    partitions: Vec<u32>,
    handles: Vec<Joined<()>>,
    stoppers: Vec<StopReceiving>,
    keepers: Vec<LeaseKeeper>,
}

/// The durable consumer through which validators take an inbound partition.
fn validators_consumer(partition: u32) -> String {
    format!("validators-{partition}")
}

impl Validators {
    /// Starts a validator for each of `partitions` whose lease `node_id` wins (one validator
    /// per partition in the cluster at a time keeps a trade's messages in order): it takes
    /// batches of envelopes from the partition, hands what passes to the match queue of its
    /// shard and the rest to the exception queue, and acknowledges the batch once the server
    /// holds all of it. A validator whose lease is lost stops taking batches.
    pub fn start(
        jetstream: &JetStream,
        layout: &ClusterLayout,
        leases: &Arc<Leases>,
        node_id: &str,
        partitions: &[u32],
        refdata: Arc<RefData>,
    ) -> Result<Self, PipelineError> {
        let mut started = Self {
            partitions: Vec::new(),
            handles: Vec::new(),
            stoppers: Vec::new(),
            keepers: Vec::new(),
        };
        for &partition in partitions {
            let Some(lease) = leases
                .try_acquire(Leased::Partition(partition), node_id)
                .map_err(PipelineError::Queue)?
            else {
                continue;
            };
            let receiver = jetstream
                .receiver::<Envelope>(
                    &ClusterLayout::inbound_queue(partition),
                    &validators_consumer(partition),
                    true,
                )
                .map_err(PipelineError::Queue)?;
            let stopper = receiver.stopper();
            let on_lost = stopper.clone();
            started.keepers.push(LeaseKeeper::start(
                leases.clone(),
                lease,
                node_id.to_owned(),
                move || on_lost.stop(),
            ));
            started.stoppers.push(stopper);
            started.partitions.push(partition);
            let match_txs: Vec<Tx<Validated>> = (0..layout.shards)
                .map(|shard| {
                    Box::new(jetstream.sender::<Validated>(&ClusterLayout::match_queue(shard)))
                        as Tx<Validated>
                })
                .collect();
            let exception_tx: Tx<RejectedItem> =
                Box::new(jetstream.sender::<RejectedItem>(ClusterLayout::EXCEPTIONS_QUEUE));
            let refdata = refdata.clone();
            started
                .handles
                .push(spawn(format!("validator-{partition}"), move || {
                    run_validator(Box::new(receiver), &refdata, &match_txs, &exception_tx)
                }));
        }
        Ok(started)
    }

    /// The partitions this node validates.
    pub fn partitions(&self) -> &[u32] {
        &self.partitions
    }

    /// Stops taking batches, lets each validator finish the one it holds, and waits for them.
    pub fn stop(self) -> Result<(), PipelineError> {
        for stopper in &self.stoppers {
            stopper.stop();
        }
        let mut result = Ok(());
        for keeper in self.keepers {
            keeper.stop();
        }
        for handle in self.handles {
            result = result.and(join(handle));
        }
        result
    }
}

/// How a node owns a shard.
#[derive(Debug, Clone)]
pub struct ShardOwnerConfig {
    pub node_id: String,
    pub shard: u32,
    /// The shard's PostgreSQL database: where every node can reach it.
    pub database_url: String,
    pub tolerances: Tolerances,
    pub aging: Option<Aging>,
    pub batch_max_messages: usize,
    pub retry: RetryPolicy,
}

/// What a node's ownership of a shard ended with.
#[derive(Debug)]
pub struct OwnershipReport {
    /// The fencing token the shard was owned with.
    pub token: u64,
    pub counts: Result<ShardCounts, PipelineError>,
    pub writer: Result<(), PipelineError>,
}

/// A shard owned by this node: its matcher and writer, and the thread that renews its lease.
pub struct ShardOwner {
    keeper: LeaseKeeper,
    matcher: Joined<ShardCounts>,
    writer: Joined<WriterReport>,
    stopper: StopReceiving,
}

/// Polls for a lease this many times per time to live while another node holds it.
const LEASE_POLLS_PER_TTL: u32 = 4;

impl ShardOwner {
    /// Waits until this node wins the shard's lease (or `give_up_after` passes: `None`), then
    /// fences the shard's database with the lease's token, rebuilds the matcher from it, emits
    /// again the CLS whose delivery was not confirmed, re-creates the shard's consumer (so that
    /// batches nobody acknowledged come back in order) and consumes. ACKs go to `ack_tx`, CLS
    /// and advices to `out_tx`, after each commit.
    pub fn take_over(
        jetstream: &JetStream,
        leases: Arc<Leases>,
        config: &ShardOwnerConfig,
        refdata: Arc<RefData>,
        ack_tx: Tx<Ack>,
        out_tx: Tx<OutboundEvent>,
        give_up_after: Duration,
    ) -> Result<Option<Self>, PipelineError> {
        let poll = leases.ttl() / LEASE_POLLS_PER_TTL;
        let waiting_since = Instant::now();
        let lease = loop {
            if let Some(lease) = leases
                .try_acquire(Leased::Shard(config.shard), &config.node_id)
                .map_err(PipelineError::Queue)?
            {
                break lease;
            }
            if waiting_since.elapsed() >= give_up_after {
                return Ok(None);
            }
            std::thread::sleep(poll);
        };
        let shard = config.shard;
        tracing::info!(shard, node = %config.node_id, token = lease.token, "won the shard");
        let mut store: Box<dyn Store> = Box::new(PgStore::open(&config.database_url)?);
        store.fence(lease.token)?;
        let matcher =
            restore_matcher(store.as_mut(), shard as usize, &refdata, &config.tolerances)?;
        let redeliver = store.undelivered_cls()?;
        let receiver = jetstream
            .receiver::<Validated>(
                &ClusterLayout::match_queue(shard),
                &owner_consumer(shard),
                true,
            )
            .map_err(PipelineError::Queue)?;
        let stopper = receiver.stopper();
        let keeper = {
            let stopper = stopper.clone();
            // Stop consuming at once; the writer checks the lease before its next commit, and
            // the shard's fence refuses what is already on its way.
            LeaseKeeper::start(leases.clone(), lease, config.node_id.clone(), move || {
                stopper.stop()
            })
        };
        let held = keeper.held();
        let clock = RunClock::start();
        let (store_tx, store_rx) =
            local::bounded::<ToStore>(format!("store.{shard}"), STORE_QUEUE_BATCHES, clock);
        let context = WriterContext {
            shard,
            ack_tx,
            out_tx,
            batch_max: config.batch_max_messages.max(1),
            linger: Duration::ZERO,
            retry: config.retry,
            // Confirmations do not cross nodes yet: the watermark stays where the shard had it.
            delivered: Arc::default(),
            delivery_in_use: Arc::default(),
            retention_days: None,
            lease_held: Some(held),
        };
        let writer = spawn(format!("writer-{shard}"), move || {
            run_writer(Box::new(store_rx), store, context, redeliver)
        });
        let aging = config.aging;
        let matcher = spawn(format!("matcher-{shard}"), move || {
            run_matcher(Box::new(receiver), matcher, Box::new(store_tx), aging)
        });
        Ok(Some(Self {
            keeper,
            matcher,
            writer,
            stopper,
        }))
    }

    /// The fencing token of this ownership.
    pub fn token(&self) -> u64 {
        self.keeper.token()
    }

    /// Stops consuming and renewing, lets the writer commit what the matcher handed it, and
    /// reports. The lease is not given back: it runs out, as a crashed node's would.
    pub fn stop(self) -> OwnershipReport {
        self.stopper.stop();
        let counts = join(self.matcher);
        let writer = join(self.writer).map(|_| ());
        let token = self.keeper.token();
        self.keeper.stop();
        OwnershipReport {
            token,
            counts,
            writer,
        }
    }
}

/// The durable consumer of a shard's owner.
fn owner_consumer(shard: u32) -> String {
    format!("owner-{shard}")
}

/// Batches between a shard owner's matcher and its writer.
const STORE_QUEUE_BATCHES: usize = 128;
