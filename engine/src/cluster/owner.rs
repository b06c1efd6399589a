//! A shard owned by a node: its validator, matcher and writer (and the writer of its rejected
//! messages) in process, on the shard's inbound queue, fenced by the shard's lease.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{AckRouter, ClusterLayout};
use crate::lease::{DeliveryBook, LeaseKeeper, Leased, Leases};
use crate::matcher::{MatcherMemory, ShardCounts};
use crate::network::{
    join, spawn, Ack, Aging, Envelope, Joined, OutboundEvent, PipelineError, RetryPolicy,
};
use crate::pipeline::{restore_matcher, BatchBound};
use crate::profile::Tolerances;
use crate::queue::jetstream::{JetStream, StopReceiving};
use crate::queue::{local, BatchReceiver, Tx};
use crate::refdata::RefData;
use crate::station::{RunClock, Station};
use crate::stations::exceptions::run_exception_writer;
use crate::stations::matcher::{run_matcher, Recall, RecallFrom};
use crate::stations::validator::{run_validator, Routes};
use crate::stations::writer::{run_writer, WriterContext};
use crate::stations::{RejectedItem, ToStore, Validated, WriterReport};
use crate::store::{PgStore, Store};

/// How a node owns a shard.
#[derive(Debug, Clone)]
pub struct ShardOwnerConfig {
    pub node_id: String,
    pub shard: u32,
    /// Shards of the cluster: a message naming another shard's trade is rejected.
    pub shards: u32,
    /// The shard's PostgreSQL database: where every node can reach it.
    pub database_url: String,
    pub tolerances: Tolerances,
    pub aging: Option<Aging>,
    pub batch_max: BatchBound,
    pub retry: RetryPolicy,
    /// What the shard's matcher keeps in memory ([`crate::matcher::Matcher::bounded`]).
    pub matcher_memory: MatcherMemory,
}

/// What a node's ownership of a shard ended with.
#[derive(Debug)]
pub struct OwnershipReport {
    pub shard: u32,
    /// The fencing token the shard was owned with.
    pub token: u64,
    pub counts: Result<ShardCounts, PipelineError>,
    pub writer: Result<(), PipelineError>,
}

/// A shard owned by this node: the stations that take its inbound queue to its database, the
/// thread that renews its lease and the one that follows its delivery watermark.
pub struct ShardOwner {
    shard: u32,
    keeper: LeaseKeeper,
    validator: Joined<()>,
    matcher: Joined<ShardCounts>,
    writer: Joined<WriterReport>,
    exceptions: Joined<WriterReport>,
    stopper: StopReceiving,
    follower: (Arc<AtomicBool>, std::thread::JoinHandle<()>),
    stations: Vec<Arc<Station>>,
    table_bytes: Arc<AtomicU64>,
}

/// Polls for a lease this many times per time to live while another node holds it.
pub(super) const LEASE_POLLS_PER_TTL: u32 = 4;
/// How often an owner reads its shard's delivery watermark.
const WATERMARK_POLL: Duration = Duration::from_millis(100);
/// Batches between an owner's matcher and its writer.
const STORE_QUEUE_BATCHES: usize = 128;
/// What an owner's writer commits in one transaction at most, unless its node is told
/// otherwise (`engine --batch-max`, `--batch-max-bytes`): 4,096 messages (about 6 MB at their
/// weight), or 10 MiB. The queue between an owner's matcher and its writer holds two such
/// transactions' bytes ([`BatchBound::queue_bytes`]): the next commit is ready when the last one
/// ends, and what waits beyond them waits in the shard's inbound queue, on disk, so that an
/// owner's memory does not follow the backlog of a load its writer cannot keep up with.
pub const OWNER_BATCH_MAX: BatchBound = BatchBound {
    messages: 4096,
    bytes: 10 << 20,
};
/// Batches between an owner's validator and its matcher, and its exception writer: what waits
/// beyond them waits in the shard's inbound queue, on disk.
const MATCH_QUEUE_BATCHES: usize = 256;
/// Bytes between an owner's validator and its matcher, and between it and its exception writer:
/// the matcher takes a batch in a fraction of the writer's time for it, so a few batches keep it
/// busy; the backlog of an unpaced load waits on disk rather than here.
const MATCH_QUEUE_BYTES: usize = 4 << 20;

impl ShardOwner {
    /// Waits until this node wins the shard's lease (or `give_up_after` passes: `None`), then
    /// fences the shard's database with the lease's token, rebuilds the matcher from it, emits
    /// again the CLS whose delivery was not confirmed, re-creates the shard's consumer of its
    /// inbound queue (so that batches nobody acknowledged come back in order) and consumes.
    /// After each commit, CLS and advices go to the CLS queue and each ACK to its gateway.
    pub fn take_over(
        jetstream: &JetStream,
        leases: Arc<Leases>,
        config: &ShardOwnerConfig,
        refdata: Arc<RefData>,
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
        let token = lease.token;
        tracing::info!(shard, node = %config.node_id, token, "won the shard");
        // Renewed from now on, however long the rebuild takes; dropped (renewals stopped) if
        // taking over fails half way. Once it is lost, the shard's consumer stops at once; the
        // writer checks the lease before its next commit, and the shard's fence refuses what
        // is already on its way.
        let stoppers: Arc<Mutex<Vec<StopReceiving>>> = Arc::default();
        let keeper = {
            let stoppers = stoppers.clone();
            LeaseKeeper::start(leases.clone(), lease, config.node_id.clone(), move || {
                if let Ok(stoppers) = stoppers.lock() {
                    stoppers.iter().for_each(StopReceiving::stop);
                }
            })
        };
        let book = Arc::new(DeliveryBook::open(jetstream).map_err(PipelineError::Queue)?);
        let mut store: Box<dyn Store> = Box::new(PgStore::open(&config.database_url)?);
        store.fence(token)?;
        let (matcher, _) = restore_matcher(
            store.as_mut(),
            shard as usize,
            &refdata,
            &config.tolerances,
            config.matcher_memory,
            None,
        )?;
        let redeliver = store.undelivered_cls()?;
        let mut exception_store: Box<dyn Store> = Box::new(PgStore::open(&config.database_url)?);
        exception_store.fence(token)?;
        let receiver = jetstream
            .placed(ClusterLayout::inbound_placement(shard))
            .receiver::<Envelope>(
                &ClusterLayout::inbound_queue(shard),
                &owner_consumer(shard),
                true,
            )
            .map_err(PipelineError::Queue)?;
        let stopper = receiver.stopper();
        if let Ok(mut stoppers) = stoppers.lock() {
            stoppers.push(stopper.clone());
        }
        if !keeper.held().load(Ordering::Acquire) {
            return Err(PipelineError::LeaseLost { shard });
        }
        let held = keeper.held();
        let ack_tx: Tx<Ack> = Box::new(AckRouter::new(jetstream));
        let out_tx: Tx<OutboundEvent> = Box::new(
            jetstream
                .placed(config.shards as usize)
                .sender::<OutboundEvent>(ClusterLayout::CLS_QUEUE),
        );
        let delivered = Arc::new(AtomicI64::new(
            book.delivered_through(shard).unwrap_or_default(),
        ));
        let follower = follow_watermark(book, shard, delivered.clone());
        let clock = RunClock::start();
        let batch_max = config.batch_max;
        let retry = config.retry;

        let (store_tx, store_rx) = local::bounded_bytes::<ToStore>(
            format!("store.{shard}"),
            STORE_QUEUE_BATCHES,
            batch_max.queue_bytes(),
            ToStore::weight_bytes,
            clock,
        );
        let (match_tx, match_rx) = local::bounded_bytes::<Validated>(
            format!("match.{shard}"),
            MATCH_QUEUE_BATCHES,
            MATCH_QUEUE_BYTES,
            Validated::weight_bytes,
            clock,
        );
        let (exception_tx, exception_rx) = local::bounded_bytes::<RejectedItem>(
            format!("exceptions.{shard}"),
            MATCH_QUEUE_BATCHES,
            MATCH_QUEUE_BYTES,
            RejectedItem::weight_bytes,
            clock,
        );
        let stations = vec![
            receiver.station().clone(),
            match_tx.station().clone(),
            store_tx.station().clone(),
            exception_tx.station().clone(),
        ];

        let exceptions = {
            let acks = ack_tx.clone();
            spawn(format!("exception-writer-{shard}"), move || {
                run_exception_writer(
                    Box::new(exception_rx),
                    exception_store,
                    acks,
                    batch_max,
                    retry,
                    Some(crate::pipeline::UNCHECKED_EXCEPTION_DAYS_DEFAULT),
                )
            })
        };
        let committed = Arc::new(AtomicU64::new(0));
        let recall = Recall {
            from: RecallFrom::Store(Box::new(PgStore::open(&config.database_url)?)),
            committed: committed.clone(),
            retry,
        };
        let context = WriterContext {
            shard,
            ack_tx,
            out_tx,
            batch_max,
            linger: Duration::ZERO,
            retry,
            delivered,
            delivery_in_use: Arc::new(AtomicBool::new(true)),
            retention_days: None,
            committed,
            lease_held: Some(held),
        };
        let writer = spawn(format!("writer-{shard}"), move || {
            run_writer(Box::new(store_rx), store, context, redeliver)
        });
        let aging = config.aging;
        let table_bytes = Arc::new(AtomicU64::new(0));
        let tables = table_bytes.clone();
        let matcher = spawn(format!("matcher-{shard}"), move || {
            run_matcher(
                Box::new(match_rx),
                matcher,
                Box::new(store_tx),
                aging,
                tables,
                Some(recall),
            )
        });
        let routes = Routes::Owner {
            shard,
            shards: config.shards.max(shard + 1),
            to_match: Box::new(match_tx),
        };
        let validator = spawn(format!("validator-{shard}"), move || {
            let exception_tx: Tx<RejectedItem> = Box::new(exception_tx);
            run_validator(Box::new(receiver), &refdata, &routes, &exception_tx)
        });
        Ok(Some(Self {
            shard,
            keeper,
            validator,
            matcher,
            writer,
            exceptions,
            stopper,
            follower,
            stations,
            table_bytes,
        }))
    }

    /// The size of this shard's matcher tables, as of its last batch.
    pub fn table_bytes(&self) -> &Arc<AtomicU64> {
        &self.table_bytes
    }

    /// The stations of this shard: its inbound queue (served by its validator), its match
    /// queue, its store queue and its exception queue.
    pub fn stations(&self) -> &[Arc<Station>] {
        &self.stations
    }

    /// The shard owned.
    pub fn shard(&self) -> u32 {
        self.shard
    }

    /// The fencing token of this ownership.
    pub fn token(&self) -> u64 {
        self.keeper.token()
    }

    /// Whether the ownership ended by itself: the lease was lost, the database fenced it off,
    /// or a station failed. [`ShardOwner::stop`] then says why.
    pub fn has_ended(&self) -> bool {
        self.validator.is_finished()
            || self.matcher.is_finished()
            || self.writer.is_finished()
            || self.exceptions.is_finished()
    }

    /// Stops consuming and renewing, lets the writers commit what the validator and the
    /// matcher handed them, and reports. The lease is not given back: it runs out, as a
    /// crashed node's would.
    pub fn stop(self) -> OwnershipReport {
        self.finish(false)
    }

    /// Stops consuming, lets the writers commit what they were handed, then gives the lease
    /// back at once, so that another node wins the shard without waiting for it to run out.
    /// What was not acknowledged is delivered to that node.
    pub fn hand_over(self) -> OwnershipReport {
        self.finish(true)
    }

    fn finish(self, give_back: bool) -> OwnershipReport {
        self.stopper.stop();
        let validated = join(self.validator);
        let counts = join(self.matcher);
        let writer = join(self.writer)
            .map(|_| ())
            .and(join(self.exceptions).map(|_| ()))
            .and(validated);
        let token = self.keeper.token();
        if give_back && writer.is_ok() {
            self.keeper.give_back();
        } else {
            self.keeper.stop();
        }
        let (stop, thread) = self.follower;
        stop.store(true, Ordering::Relaxed);
        let _ = thread.join();
        OwnershipReport {
            shard: self.shard,
            token,
            counts,
            writer,
        }
    }
}

/// Reads `shard`'s delivery watermark from the book into `delivered` until told to stop.
fn follow_watermark(
    book: Arc<DeliveryBook>,
    shard: u32,
    delivered: Arc<AtomicI64>,
) -> (Arc<AtomicBool>, std::thread::JoinHandle<()>) {
    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    let thread = std::thread::Builder::new()
        .name(format!("delivered-{shard}"))
        .spawn(move || {
            while !flag.load(Ordering::Relaxed) {
                std::thread::sleep(WATERMARK_POLL);
                match book.delivered_through(shard) {
                    Ok(through) => {
                        delivered.fetch_max(through, Ordering::Relaxed);
                    }
                    Err(error) => tracing::debug!(shard, %error, "reading the watermark failed"),
                }
            }
        })
        .expect("the operating system can start a thread");
    (stop, thread)
}

/// The durable consumer of a shard's owner on the shard's inbound queue.
pub(crate) fn owner_consumer(shard: u32) -> String {
    format!("owner-{shard}")
}
