//! The roles a node of a cluster runs on JetStream queues (DESIGN.md section 1a). The stations
//! are the ones of the in-process network ([`crate::stations`]); only their queues differ.
//!
//! Queues of a cluster: `in.<p>` (P partitions, by the routing hash of the trade key),
//! `match.<k>` (one per shard), `exceptions`, `ack.<g>` (one per gateway number) and `cls`
//! (CLS and advices after commit, for the sink). Every one is a stream of its own with bounds
//! in batches and bytes ([`ClusterLayout`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::Mutex;

use crate::cluster_samples::{NodeSampler, StationBoard};
use crate::lease::{DeliveryBook, LeaseKeeper, Leased, Leases};
use crate::matcher::{MatcherMemory, ShardCounts};
use crate::pipeline::{
    join, restore_matcher, spawn, Ack, Aging, Delivery, Envelope, Joined, OutboundEvent,
    PipelineError, RetryPolicy, Submitter,
};
use crate::profile::Tolerances;
use crate::queue::jetstream::{
    JetStream, JetStreamReceiver, JetStreamSender, QueueLimits, StopReceiving,
};
use crate::queue::local;
use crate::queue::{BatchReceiver, BatchSender, QueueError, Receipt, Rx, Tx};
use crate::refdata::RefData;
use crate::station::{RunClock, Station};
use crate::stations::exceptions::run_exception_writer;
use crate::stations::matcher::{run_matcher, Recall};
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
    /// Bounds of each gateway's ACK queue.
    pub acks: QueueLimits,
    /// Bounds of the CLS queue: a sink that falls behind by this much holds the writers.
    pub cls: QueueLimits,
}

impl Default for ClusterLayout {
    fn default() -> Self {
        const MIB: i64 = 1 << 20;
        Self {
            partitions: 4,
            shards: 4,
            inbound: QueueLimits {
                batches_max: 16_384,
                bytes_max: 256 * MIB,
            },
            shard_backlog: QueueLimits {
                batches_max: 65_536,
                bytes_max: (crate::pipeline::SHARD_BACKLOG_BYTES_DEFAULT as i64),
            },
            exceptions: QueueLimits {
                batches_max: 16_384,
                bytes_max: 64 * MIB,
            },
            acks: QueueLimits {
                batches_max: 65_536,
                bytes_max: 64 * MIB,
            },
            cls: QueueLimits {
                batches_max: 65_536,
                bytes_max: 256 * MIB,
            },
        }
    }
}

impl ClusterLayout {
    /// The queue of inbound partition `partition`.
    pub fn inbound_queue(partition: u32) -> String {
        format!("in.{partition}")
    }

    /// The ACK queue of gateway number `gateway`.
    pub fn ack_queue(gateway: u32) -> String {
        format!("ack.{gateway}")
    }

    /// The queue of CLS and advices after commit.
    pub const CLS_QUEUE: &'static str = "cls";

    /// The match queue of `shard`.
    pub fn match_queue(shard: u32) -> String {
        format!("match.{shard}")
    }

    /// The exception queue.
    pub const EXCEPTIONS_QUEUE: &'static str = "exceptions";

    /// Every queue of the layout with its bounds (the gateways' ACK queues are made by the
    /// gateways).
    pub fn queues(&self) -> Vec<(String, QueueLimits)> {
        (0..self.partitions)
            .map(|partition| (Self::inbound_queue(partition), self.inbound))
            .chain((0..self.shards).map(|shard| (Self::match_queue(shard), self.shard_backlog)))
            .chain([
                (Self::EXCEPTIONS_QUEUE.to_owned(), self.exceptions),
                (Self::CLS_QUEUE.to_owned(), self.cls),
            ])
            .collect()
    }

    /// Creates every queue's stream that does not exist yet.
    pub fn ensure(&self, jetstream: &JetStream) -> Result<(), QueueError> {
        self.queues()
            .iter()
            .try_for_each(|(queue, limits)| jetstream.ensure_queue(queue, *limits))
    }
}

/// Validators running on a node, one per inbound partition whose lease it holds.
pub struct Validators {
    partitions: Vec<u32>,
    handles: Vec<Joined<()>>,
    stoppers: Vec<StopReceiving>,
    keepers: Vec<LeaseKeeper>,
    stations: Vec<Arc<Station>>,
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
            stations: Vec::new(),
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
            started.stations.push(receiver.station().clone());
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

    /// The stations of these validators: their inbound partitions.
    pub fn stations(&self) -> &[Arc<Station>] {
        &self.stations
    }

    /// Whether a validator ended by itself (its lease lost, or its queue failed).
    pub fn has_ended(&self) -> bool {
        self.handles.iter().any(|handle| handle.is_finished())
    }

    /// Stops taking batches, lets each validator finish the one it holds, and waits for them.
    pub fn stop(self) -> Result<(), PipelineError> {
        self.finish(false)
    }

    /// Stops taking batches, lets each validator finish the one it holds, then gives the
    /// partitions' leases back at once, so that another node takes them over without waiting
    /// for them to run out (and never while a batch of theirs is still being handed on here).
    pub fn hand_over(self) -> Result<(), PipelineError> {
        self.finish(true)
    }

    fn finish(self, give_back: bool) -> Result<(), PipelineError> {
        for stopper in &self.stoppers {
            stopper.stop();
        }
        let mut result = Ok(());
        for handle in self.handles {
            result = result.and(join(handle));
        }
        for keeper in self.keepers {
            if give_back && result.is_ok() {
                keeper.give_back();
            } else {
                keeper.stop();
            }
        }
        result
    }
}

/// Sends each ACK to the queue of the gateway its message came through (`ack.<origin>`). A
/// gateway whose queue stays full while nobody holds its number any more is gone, and so are
/// the connections its answers were for: those answers are dropped, with a warning, rather
/// than holding the shard's writer for ever.
#[derive(Clone)]
pub struct AckRouter {
    jetstream: JetStream,
    leases: Arc<Leases>,
    senders: Arc<Mutex<BTreeMap<u32, JetStreamSender<Ack>>>>,
}

impl AckRouter {
    /// A router publishing through `jetstream`, asking `leases` whether a gateway still lives.
    pub fn new(jetstream: &JetStream, leases: Arc<Leases>) -> Self {
        Self {
            jetstream: jetstream.clone(),
            leases,
            senders: Arc::default(),
        }
    }

    fn sender(&self, origin: u32) -> JetStreamSender<Ack> {
        let mut senders = self
            .senders
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        senders
            .entry(origin)
            .or_insert_with(|| {
                let leases = self.leases.clone();
                self.jetstream
                    .sender_giving_up(&ClusterLayout::ack_queue(origin), move || {
                        matches!(leases.holder(Leased::Gateway(origin)), Ok(None))
                    })
            })
            .clone()
    }
}

impl BatchSender<Ack> for AckRouter {
    fn forward(&self, items: Vec<Ack>, receipt: Receipt) -> Result<(), QueueError> {
        let mut by_origin: BTreeMap<u32, Vec<Ack>> = BTreeMap::new();
        for ack in items {
            by_origin.entry(ack.origin).or_default().push(ack);
        }
        for (origin, acks) in by_origin {
            let count = acks.len();
            if let Err(error) = self.sender(origin).send(acks) {
                tracing::warn!(gateway = origin, count, %error, "answers for a gateway that is gone were dropped");
            }
        }
        receipt.ack()
    }

    fn clone_sender(&self) -> Tx<Ack> {
        Box::new(self.clone())
    }
}

/// Gateway numbers a cluster has room for.
pub const GATEWAYS_MAX: u32 = 1024;

/// Where a gateway (or the driver) puts messages into a cluster and hears their answers: the
/// inbound partitions, and the ACK queue of the gateway number it holds a lease on.
pub struct Ingress {
    number: u32,
    keeper: LeaseKeeper,
    inbound: Vec<Tx<Envelope>>,
    acks: Option<JetStreamReceiver<Ack>>,
    stopper: StopReceiving,
}

impl Ingress {
    /// Takes the lowest free gateway number for `node_id`, empties its ACK queue (what it holds
    /// answered the connections of an earlier holder) and opens the inbound partitions.
    pub fn open(
        jetstream: &JetStream,
        layout: &ClusterLayout,
        leases: Arc<Leases>,
        node_id: &str,
    ) -> Result<Self, PipelineError> {
        let won = leases
            .take_lowest(Leased::Gateway, GATEWAYS_MAX, node_id)
            .map_err(PipelineError::Queue)?;
        let Some((number, lease)) = won else {
            return Err(PipelineError::Config(format!(
                "all {GATEWAYS_MAX} gateway numbers are taken"
            )));
        };
        let queue = ClusterLayout::ack_queue(number);
        jetstream
            .ensure_queue(&queue, layout.acks)
            .map_err(PipelineError::Queue)?;
        jetstream
            .purge_queue(&queue)
            .map_err(PipelineError::Queue)?;
        let acks = jetstream
            .receiver::<Ack>(&queue, "gateway", true)
            .map_err(PipelineError::Queue)?;
        let stopper = acks.stopper();
        let keeper = LeaseKeeper::start(leases, lease, node_id.to_owned(), || {
            tracing::error!("this gateway lost its number: answers may go to another one");
        });
        let inbound = (0..layout.partitions)
            .map(|partition| {
                Box::new(jetstream.sender::<Envelope>(&ClusterLayout::inbound_queue(partition)))
                    as Tx<Envelope>
            })
            .collect();
        tracing::info!(gateway = number, node = node_id, "gateway number taken");
        Ok(Self {
            number,
            keeper,
            inbound,
            acks: Some(acks),
            stopper,
        })
    }

    /// The gateway number: every envelope submitted here carries it, and its answers come back
    /// on `ack.<number>`.
    pub fn number(&self) -> u32 {
        self.number
    }

    /// A submitter onto the inbound partitions, stamping envelopes with this gateway's number.
    pub fn submitter(&self, clock: RunClock) -> Submitter {
        Submitter::new(self.inbound.clone(), clock, self.number)
    }

    /// The answers to what was submitted here (once; `None` afterwards). It ends once
    /// [`Ingress::stop`] is called.
    pub fn take_acks(&mut self) -> Option<Rx<Ack>> {
        self.acks.take().map(|acks| Box::new(acks) as Rx<Ack>)
    }

    /// Stops the ACK receiver and the renewal of the gateway number.
    pub fn stop(self) {
        self.stopper.stop();
        self.keeper.stop();
    }
}

/// The sink's side of a cluster: the CLS queue and the delivery book its confirmations go to.
pub struct ClsFeed {
    events: Option<JetStreamReceiver<OutboundEvent>>,
    stopper: StopReceiving,
    book: Arc<DeliveryBook>,
}

impl ClsFeed {
    /// Opens the CLS queue through the sink's durable consumer (one sink per cluster); the
    /// cluster's queues exist ([`ClusterLayout::ensure`]).
    pub fn open(jetstream: &JetStream) -> Result<Self, PipelineError> {
        let events = jetstream
            .receiver::<OutboundEvent>(ClusterLayout::CLS_QUEUE, "sink", true)
            .map_err(PipelineError::Queue)?;
        let stopper = events.stopper();
        let book = Arc::new(DeliveryBook::open(jetstream).map_err(PipelineError::Queue)?);
        Ok(Self {
            events: Some(events),
            stopper,
            book,
        })
    }

    /// The events (once), for the sink.
    pub fn take_events(&mut self) -> Option<Rx<OutboundEvent>> {
        self.events
            .take()
            .map(|events| Box::new(events) as Rx<OutboundEvent>)
    }

    /// Where the sink confirms delivery.
    pub fn delivery(&self) -> Delivery {
        Delivery::cluster(self.book.clone())
    }

    /// A handle that ends the events' receiver.
    pub fn stopper(&self) -> StopReceiving {
        self.stopper.clone()
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

/// A shard owned by this node: its matcher and writer (and for shard 0, the writer of the
/// validators' exceptions, which live in shard 0's database), the thread that renews its lease
/// and the one that follows its delivery watermark.
pub struct ShardOwner {
    shard: u32,
    keeper: LeaseKeeper,
    matcher: Joined<ShardCounts>,
    writer: Joined<WriterReport>,
    stopper: StopReceiving,
    exceptions: Option<(Joined<WriterReport>, StopReceiving)>,
    follower: (Arc<AtomicBool>, std::thread::JoinHandle<()>),
    stations: Vec<Arc<Station>>,
    table_bytes: Arc<AtomicU64>,
}

/// Polls for a lease this many times per time to live while another node holds it.
const LEASE_POLLS_PER_TTL: u32 = 4;
/// How often an owner reads its shard's delivery watermark.
const WATERMARK_POLL: Duration = Duration::from_millis(100);

impl ShardOwner {
    /// Waits until this node wins the shard's lease (or `give_up_after` passes: `None`), then
    /// fences the shard's database with the lease's token, rebuilds the matcher from it, emits
    /// again the CLS whose delivery was not confirmed, re-creates the shard's consumer (so that
    /// batches nobody acknowledged come back in order) and consumes. After each commit, CLS and
    /// advices go to the CLS queue and each ACK to its gateway's queue.
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
        // taking over fails half way. Once it is lost, every consumer of the shard stops at
        // once; the writer checks the lease before its next commit, and the shard's fence
        // refuses what is already on its way.
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
        let matcher = restore_matcher(
            store.as_mut(),
            shard as usize,
            &refdata,
            &config.tolerances,
            config.matcher_memory,
        )?;
        let redeliver = store.undelivered_cls()?;
        let receiver = jetstream
            .receiver::<Validated>(
                &ClusterLayout::match_queue(shard),
                &owner_consumer(shard),
                true,
            )
            .map_err(PipelineError::Queue)?;
        let stopper = receiver.stopper();
        let mut stations = vec![receiver.station().clone()];
        let exception_receiver = if shard == 0 {
            Some(
                jetstream
                    .receiver::<RejectedItem>(ClusterLayout::EXCEPTIONS_QUEUE, "exceptions", true)
                    .map_err(PipelineError::Queue)?,
            )
        } else {
            None
        };
        if let Ok(mut stoppers) = stoppers.lock() {
            stoppers.push(stopper.clone());
            stoppers.extend(exception_receiver.as_ref().map(|r| r.stopper()));
        }
        if !keeper.held().load(Ordering::Acquire) {
            return Err(PipelineError::LeaseLost { shard });
        }
        let held = keeper.held();
        let ack_tx: Tx<Ack> = Box::new(AckRouter::new(jetstream, leases));
        let out_tx: Tx<OutboundEvent> =
            Box::new(jetstream.sender::<OutboundEvent>(ClusterLayout::CLS_QUEUE));
        let delivered = Arc::new(AtomicI64::new(
            book.delivered_through(shard).unwrap_or_default(),
        ));
        let follower = follow_watermark(book, shard, delivered.clone());
        let exceptions = match exception_receiver {
            Some(receiver) => {
                let exception_stopper = receiver.stopper();
                stations.push(receiver.station().clone());
                let mut exception_store: Box<dyn Store> =
                    Box::new(PgStore::open(&config.database_url)?);
                exception_store.fence(token)?;
                let acks = ack_tx.clone();
                let batch_max = config.batch_max_messages.max(1);
                let retry = config.retry;
                let handle = spawn("exception-writer".to_owned(), move || {
                    run_exception_writer(
                        Box::new(receiver),
                        exception_store,
                        acks,
                        batch_max,
                        retry,
                        Some(crate::pipeline::UNCHECKED_EXCEPTION_DAYS_DEFAULT),
                    )
                });
                Some((handle, exception_stopper))
            }
            None => None,
        };
        let clock = RunClock::start();
        let committed = Arc::new(AtomicU64::new(0));
        let recall = Recall {
            store: Box::new(PgStore::open(&config.database_url)?),
            committed: committed.clone(),
            retry: config.retry,
        };
        let (store_tx, store_rx) =
            local::bounded::<ToStore>(format!("store.{shard}"), STORE_QUEUE_BATCHES, clock);
        stations.push(store_rx.station().clone());
        let context = WriterContext {
            shard,
            ack_tx,
            out_tx,
            batch_max: config.batch_max_messages.max(1),
            linger: Duration::ZERO,
            retry: config.retry,
            delivered,
            delivery_in_use: Arc::new(AtomicBool::new(true)),
            retention_days: None,
            committed: committed.clone(),
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
                Box::new(receiver),
                matcher,
                Box::new(store_tx),
                aging,
                tables,
                Some(recall),
            )
        });
        Ok(Some(Self {
            shard,
            keeper,
            matcher,
            writer,
            stopper,
            exceptions,
            follower,
            stations,
            table_bytes,
        }))
    }

    /// The size of this shard's matcher tables, as of its last batch.
    pub fn table_bytes(&self) -> &Arc<AtomicU64> {
        &self.table_bytes
    }

    /// The stations of this shard: its match queue, its store queue and (shard 0) the
    /// exception queue.
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
        self.writer.is_finished()
            || self.matcher.is_finished()
            || self
                .exceptions
                .as_ref()
                .is_some_and(|(handle, _)| handle.is_finished())
    }

    /// Stops consuming and renewing, lets the writer commit what the matcher handed it, and
    /// reports. The lease is not given back: it runs out, as a crashed node's would.
    pub fn stop(self) -> OwnershipReport {
        self.finish(false)
    }

    /// Stops consuming, lets the writer commit what the matcher handed it, then gives the
    /// lease back at once, so that another node wins the shard without waiting for it to run
    /// out. What was not acknowledged is delivered to that node.
    pub fn hand_over(self) -> OwnershipReport {
        self.finish(true)
    }

    fn finish(self, give_back: bool) -> OwnershipReport {
        self.stopper.stop();
        let mut exceptions_result = Ok(());
        if let Some((handle, stopper)) = self.exceptions {
            stopper.stop();
            exceptions_result = join(handle).map(|_| ());
        }
        let counts = join(self.matcher);
        let writer = join(self.writer).map(|_| ()).and(exceptions_result);
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

/// The durable consumer of a shard's owner.
fn owner_consumer(shard: u32) -> String {
    format!("owner-{shard}")
}

/// Batches between a shard owner's matcher and its writer.
const STORE_QUEUE_BATCHES: usize = 128;

/// What a node of a cluster runs besides its gateway.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    pub node_id: String,
    pub layout: ClusterLayout,
    /// Time to live of every lease, where this node makes the cluster's lease bucket (the
    /// first node's otherwise).
    pub lease_ttl: Duration,
    /// Inbound partitions this node validates at most.
    pub validators_max: u32,
    /// Shards this node owns at most.
    pub shards_max: u32,
    /// The database of each shard, in shard order.
    pub database_urls: Vec<String>,
    pub tolerances: Tolerances,
    pub aging: Option<Aging>,
    pub batch_max_messages: usize,
    pub retry: RetryPolicy,
    /// What each of its shards' matchers keeps in memory.
    pub matcher_memory: MatcherMemory,
    /// How often the node publishes its stations' counters (at least
    /// [`crate::cluster_samples::NODE_SAMPLE_INTERVAL_MIN`]); zero: never.
    pub sample_interval: Duration,
}

/// What a node holds right now.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Holdings {
    pub partitions: Vec<u32>,
    pub shards: Vec<u32>,
}

/// A node of a cluster: it contends for inbound partitions (up to
/// [`NodeConfig::validators_max`]) and shards (up to [`NodeConfig::shards_max`]) whose leases
/// nobody holds, runs what it wins, and contends again for whatever it loses or another node
/// leaves behind.
pub struct Node {
    stop: Arc<AtomicBool>,
    holdings: Arc<Mutex<Holdings>>,
    thread: Joined<()>,
    sampler: Option<NodeSampler>,
    jetstream: JetStream,
}

impl Node {
    /// Makes the cluster's queues where they do not exist and starts contending.
    pub fn start(
        jetstream: &JetStream,
        config: NodeConfig,
        refdata: Arc<RefData>,
    ) -> Result<Self, PipelineError> {
        if config.database_urls.len() != config.layout.shards as usize {
            return Err(PipelineError::Config(format!(
                "{} shards need {} database URLs, {} given",
                config.layout.shards,
                config.layout.shards,
                config.database_urls.len()
            )));
        }
        config
            .layout
            .ensure(jetstream)
            .map_err(PipelineError::Queue)?;
        let leases =
            Arc::new(Leases::open(jetstream, config.lease_ttl).map_err(PipelineError::Queue)?);
        let stop = Arc::new(AtomicBool::new(false));
        let holdings = Arc::new(Mutex::new(Holdings::default()));
        let board = StationBoard::default();
        let sampler = (!config.sample_interval.is_zero()).then(|| {
            NodeSampler::start(
                jetstream,
                &config.node_id,
                board.clone(),
                config.sample_interval,
            )
        });
        let thread = {
            let (jetstream, stop, holdings) = (jetstream.clone(), stop.clone(), holdings.clone());
            spawn(format!("node-{}", config.node_id), move || {
                supervise(
                    &jetstream, &config, &leases, &refdata, &stop, &holdings, &board,
                )
            })
        };
        Ok(Self {
            stop,
            holdings,
            thread,
            sampler,
            jetstream: jetstream.clone(),
        })
    }

    /// The partitions and shards this node holds now.
    pub fn holdings(&self) -> Holdings {
        self.holdings
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Stops contending, lets every station finish what it holds, and waits for them.
    pub fn stop(self) -> Result<(), PipelineError> {
        self.stop.store(true, Ordering::Relaxed);
        // What is in hand is finished while the server answers; an outage now is not waited
        // out (what is not acknowledged goes to the node that takes over).
        self.jetstream.stop_riding_out_outages();
        let result = join(self.thread);
        if let Some(sampler) = self.sampler {
            sampler.stop();
        }
        result
    }
}

/// The node's loop: reap what ended, contend for what is free, a few times per time to live.
fn supervise(
    jetstream: &JetStream,
    config: &NodeConfig,
    leases: &Arc<Leases>,
    refdata: &Arc<RefData>,
    stop: &AtomicBool,
    holdings: &Mutex<Holdings>,
    board: &StationBoard,
) -> Result<(), PipelineError> {
    let poll = leases.ttl() / LEASE_POLLS_PER_TTL;
    let mut validators: Vec<Validators> = Vec::new();
    let mut owners: Vec<ShardOwner> = Vec::new();
    let mut balance = Balance::default();
    // Nodes start their search at different shards and partitions, so that they spread.
    let offset = crate::routing::fnv1a_64(config.node_id.as_bytes());
    let rotated = |step: u32, count: u32| {
        let count = u64::from(count);
        ((offset % count + u64::from(step)) % count) as u32
    };
    while !stop.load(Ordering::Relaxed) {
        for ended in drain_where(&mut owners, ShardOwner::has_ended) {
            let report = ended.stop();
            tracing::warn!(shard = report.shard, token = report.token, writer = ?report.writer.err(), "stood down from the shard");
        }
        for ended in drain_where(&mut validators, Validators::has_ended) {
            let partitions = ended.partitions().to_vec();
            if let Err(error) = ended.stop() {
                tracing::warn!(?partitions, %error, "a validator ended");
            }
        }
        let shards = config.layout.shards;
        if balance.due() {
            let held_shards = owners.len() as u32;
            let held_partitions = validators.iter().map(|v| v.partitions().len() as u32).sum();
            balance.count(leases, config, held_shards, held_partitions);
            if balance.shards.should_give_up_one(held_shards) {
                if let Some(owner) = owners.pop() {
                    let report = owner.hand_over();
                    tracing::info!(
                        shard = report.shard,
                        held = held_shards,
                        "handed a shard over to a node with fewer"
                    );
                }
            }
            if balance.partitions.should_give_up_one(held_partitions) {
                if let Some(started) = validators.pop() {
                    let partitions = started.partitions().to_vec();
                    match started.hand_over() {
                        Ok(()) => tracing::info!(
                            ?partitions,
                            held = held_partitions,
                            "handed a partition over to a node with fewer"
                        ),
                        Err(error) => tracing::warn!(?partitions, %error, "a validator ended"),
                    }
                }
            }
        }
        for step in 0..shards {
            if owners.len() >= config.shards_max as usize
                || balance.shards.holds_enough(owners.len() as u32)
                || stop.load(Ordering::Relaxed)
            {
                break;
            }
            let shard = rotated(step, shards);
            if owners.iter().any(|owner| owner.shard() == shard) {
                continue;
            }
            let owner_config = ShardOwnerConfig {
                node_id: config.node_id.clone(),
                shard,
                database_url: config.database_urls[shard as usize].clone(),
                tolerances: config.tolerances.clone(),
                aging: config.aging,
                batch_max_messages: config.batch_max_messages,
                retry: config.retry,
                matcher_memory: config.matcher_memory,
            };
            match ShardOwner::take_over(
                jetstream,
                leases.clone(),
                &owner_config,
                refdata.clone(),
                Duration::ZERO,
            ) {
                Ok(Some(owner)) => {
                    owners.push(owner);
                    // One new shard a pass: nodes that start together share the shards.
                    break;
                }
                Ok(None) => {}
                Err(error) => {
                    tracing::warn!(shard, %error, "taking the shard over failed; trying again")
                }
            }
        }
        let mut partitions: Vec<u32> = validators
            .iter()
            .flat_map(|v| v.partitions().to_vec())
            .collect();
        for step in 0..config.layout.partitions {
            if partitions.len() >= config.validators_max as usize
                || balance.partitions.holds_enough(partitions.len() as u32)
                || stop.load(Ordering::Relaxed)
            {
                break;
            }
            let partition = rotated(step, config.layout.partitions);
            if partitions.contains(&partition) {
                continue;
            }
            match Validators::start(
                jetstream,
                &config.layout,
                leases,
                &config.node_id,
                &[partition],
                refdata.clone(),
            ) {
                Ok(started) if !started.partitions().is_empty() => {
                    partitions.extend_from_slice(started.partitions());
                    validators.push(started);
                }
                Ok(_) => {}
                Err(error) => tracing::warn!(partition, %error, "starting a validator failed"),
            }
        }
        if let Ok(mut shared) = holdings.lock() {
            partitions.sort_unstable();
            let mut shards: Vec<u32> = owners.iter().map(ShardOwner::shard).collect();
            shards.sort_unstable();
            *shared = Holdings { partitions, shards };
        }
        board.set(
            validators
                .iter()
                .flat_map(|v| v.stations().iter().cloned())
                .chain(owners.iter().flat_map(|o| o.stations().iter().cloned()))
                .collect(),
            owners.iter().map(|o| o.table_bytes().clone()).collect(),
        );
        std::thread::sleep(poll);
    }
    let mut result = Ok(());
    if let Some(member) = balance.member.take() {
        member.give_back();
    }
    for started in validators {
        result = result.and(started.stop());
    }
    for owner in owners {
        let report = owner.stop();
        result = result.and(report.writer).and(report.counts.map(|_| ()));
    }
    result
}

/// How often a node compares what it holds with what the others hold, in times to live.
const BALANCE_EVERY_TTLS: u32 = 2;

/// The balance of shards, and of inbound partitions, between the nodes. Each node that takes
/// either holds a member number whose value says how many of each it takes at most; every few
/// times to live it counts the members and who holds what. While some member holds less than
/// the even share (the total over the members that take it, rounded down) and its own bound, a
/// node holding more than that share, and as much as anyone, hands one over, and no node with
/// its share takes a new one. Nodes that are even stay as they are.
#[derive(Default)]
struct Balance {
    member: Option<LeaseKeeper>,
    last: Option<Instant>,
    every: Duration,
    shards: Share,
    partitions: Share,
}

/// This node's view of one kind of work (by default: nobody is short, nothing to do).
#[derive(Debug, Clone, Copy, Default)]
struct Share {
    /// The even share, rounded down: what every member that takes this work should hold.
    even: u32,
    /// The most any member holds.
    most: u32,
    /// Whether another member holds less than the even share (and could take more).
    others_short: bool,
}

impl Share {
    fn of(
        total: u32,
        me: &str,
        held: u32,
        members: &[Member],
        bound: fn(&Member) -> u32,
        holdings: &HeldBy,
    ) -> Self {
        let takers = members.iter().filter(|member| bound(member) > 0).count() as u32;
        let even = total / takers.max(1);
        let others_short = members.iter().any(|member| {
            member.node != me
                && holdings.get(&member.node).copied().unwrap_or(0) < even.min(bound(member))
        });
        let most = holdings.values().copied().max().unwrap_or(0).max(held);
        Self {
            even,
            most,
            others_short,
        }
    }

    /// Whether to hand one of `held` over now: another member is short, and this node holds
    /// more than the even share and as much as anyone.
    fn should_give_up_one(&self, held: u32) -> bool {
        self.others_short && held > self.even && held >= self.most
    }

    /// Whether to take no new one: another member is short and this node has its share.
    fn holds_enough(&self, held: u32) -> bool {
        self.others_short && held >= self.even
    }
}

/// A member of the cluster as its member lease describes it.
struct Member {
    node: String,
    shards_max: u32,
    validators_max: u32,
}

impl Balance {
    fn due(&self) -> bool {
        self.last.is_none_or(|last| last.elapsed() >= self.every)
    }

    /// Joins (again) as a member where needed, and counts the members and what they hold.
    fn count(
        &mut self,
        leases: &Arc<Leases>,
        config: &NodeConfig,
        held_shards: u32,
        held_partitions: u32,
    ) {
        self.last = Some(Instant::now());
        self.every = leases.ttl() * BALANCE_EVERY_TTLS;
        if config.shards_max == 0 && config.validators_max == 0 {
            return;
        }
        let joined = self
            .member
            .as_ref()
            .is_some_and(|member| member.held().load(Ordering::Acquire));
        if !joined {
            let value = format!(
                "{} {} {}",
                config.node_id, config.shards_max, config.validators_max
            );
            match leases.take_lowest(Leased::Member, crate::lease::MEMBERS_MAX, &value) {
                Ok(Some((_, lease))) => {
                    self.member = Some(LeaseKeeper::start(leases.clone(), lease, value, || {}))
                }
                Ok(None) => {
                    tracing::warn!("every member number is taken: this node is not counted")
                }
                Err(error) => tracing::warn!(%error, "joining the members failed"),
            }
        }
        match balance_of(leases, config) {
            Ok((members, shards, partitions)) if !members.is_empty() => {
                let me = config.node_id.as_str();
                self.shards = Share::of(
                    config.layout.shards,
                    me,
                    held_shards,
                    &members,
                    |member| member.shards_max,
                    &shards,
                );
                self.partitions = Share::of(
                    config.layout.partitions,
                    me,
                    held_partitions,
                    &members,
                    |member| member.validators_max,
                    &partitions,
                );
            }
            Ok(_) => {
                self.shards = Share::default();
                self.partitions = Share::default();
            }
            Err(error) => tracing::debug!(%error, "counting the members failed"),
        }
    }
}

/// How many of one kind each node holds, by node.
type HeldBy = BTreeMap<String, u32>;

/// The members, and how many shards and partitions each node holds.
fn balance_of(
    leases: &Leases,
    config: &NodeConfig,
) -> Result<(Vec<Member>, HeldBy, HeldBy), QueueError> {
    let mut members = Vec::new();
    for number in 0..crate::lease::MEMBERS_MAX {
        if let Some(value) = leases.holder(Leased::Member(number))? {
            let mut parts = value.rsplitn(3, ' ');
            let validators_max = parts.next().and_then(|bound| bound.parse().ok());
            let shards_max = parts.next().and_then(|bound| bound.parse().ok());
            if let (Some(validators_max), Some(shards_max), Some(node)) =
                (validators_max, shards_max, parts.next())
            {
                members.push(Member {
                    node: node.to_owned(),
                    shards_max,
                    validators_max,
                });
            }
        }
    }
    let count = |leased: fn(u32) -> Leased, total: u32| -> Result<HeldBy, QueueError> {
        let mut holdings = BTreeMap::new();
        for index in 0..total {
            if let Some(node) = leases.holder(leased(index))? {
                *holdings.entry(node).or_insert(0) += 1;
            }
        }
        Ok(holdings)
    };
    Ok((
        members,
        count(Leased::Shard, config.layout.shards)?,
        count(Leased::Partition, config.layout.partitions)?,
    ))
}

/// Takes out of `items` those for which `ended` holds.
fn drain_where<T>(items: &mut Vec<T>, ended: impl Fn(&T) -> bool) -> Vec<T> {
    let (gone, kept): (Vec<T>, Vec<T>) = std::mem::take(items).into_iter().partition(ended);
    *items = kept;
    gone
}
