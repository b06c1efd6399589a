//! The queue network of DESIGN.md section 1, in process:
//!
//! ```text
//! inbound[i] → validator i ─ok→ match[k] → matcher k → store[k] → writer k ─after commit→ acks, outbound
//!                          └rejected→ exceptions → exception writer ─after commit→ acks
//! ```
//!
//! This module is the topology: configuration, and the wiring of stations ([`crate::stations`])
//! by queues ([`crate::queue`]) in one process. Every queue is bounded (a full queue blocks its
//! producer; nothing is dropped), the match queues in bytes as well, so that a shard whose store
//! stalls holds its own backlog while the other shards go on; every station counts arrivals,
//! completions and busy time. Inbound queues are sharded by trade key, so the messages of one
//! trade keep their order from injection to the matcher. Nothing leaves the engine before the
//! transaction that holds it has committed.

use std::fs::File;
use std::io::BufWriter;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use time::OffsetDateTime;

use crate::lease::DeliveryBook;
use crate::matcher::{Advice, Matcher, MatcherMemory, ShardCounts};
use crate::profile::Tolerances;
use crate::queue::local::{self, LocalReceiver};
use crate::queue::{QueueError, Rx, Tx};
use crate::reason::{ReasonCode, Rejection};
use crate::refdata::RefData;
use crate::routing::shard_of_bytes;
use crate::sign::{self, SIGNATURE_LEN};
use crate::station::{RunClock, Station};
use crate::stations::exceptions::run_exception_writer;
use crate::stations::matcher::{run_matcher, Recall};
use crate::stations::sampler::run_sampler;
use crate::stations::validator::{run_validator, Routes};
use crate::stations::writer::{run_writer, WriterContext};
use crate::stations::{RejectedItem, ToStore, Validated, WriterReport};
use crate::store::{MemoryStore, PgStore, RowCounts, SqliteStore, Store, StoreError};

pub use crate::stations::sampler::SAMPLES_HEADER;

/// One inbound message as it enters the engine.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Envelope {
    pub bytes: Vec<u8>,
    /// The participant whose key signed the bytes.
    pub sender: Option<String>,
    pub signature: Option<[u8; SIGNATURE_LEN]>,
    /// Chosen by the sender of the envelope; returned in its ACK or NAK.
    pub correlation: u64,
    /// The gateway that received the message, whose ACK queue its answer goes to (in a
    /// cluster: the gateway number it holds a lease on; 0 in process). Set by the
    /// [`Submitter`], never by a participant.
    pub origin: u32,
    /// When the message entered the engine, on the run clock.
    pub injected_ns: u64,
    /// Set by a gateway that refuses the message before validation (e.g. a connection sending
    /// as a participant it did not log on as): the validator rejects it with this, so it is
    /// stored as an exception and NAKed like any other rejection.
    pub refusal: Option<Rejection>,
}

/// The result of one inbound message, sent after the commit that holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum AckResult {
    Accepted,
    Duplicate,
    Rejected(ReasonCode),
}

/// An ACK (accepted or duplicate) or NAK (rejected with a code).
#[derive(Debug, Clone, Copy, serde::Serialize, serde::Deserialize)]
pub struct Ack {
    pub correlation: u64,
    /// The gateway the message came through ([`Envelope::origin`]).
    pub origin: u32,
    pub result: AckResult,
}

/// What the engine sends outbound after commit.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub enum OutboundEvent {
    Cls {
        cls_id: String,
        body: String,
        /// Injection time of the trade's first message, on the run clock (0 when re-emitted).
        trade_first_injected_ns: u64,
        shard: u32,
        /// Position in the shard's outbox; confirm it through [`Delivery`].
        outbox_id: i64,
        /// Emitted again after a restart because its delivery was never confirmed.
        redelivered: bool,
    },
    Mismatched(Advice),
    /// A stranger's message no longer counts in a trade: its sender is told.
    Released(crate::matcher::Released),
    /// A trade aged out, committed: its parties are told.
    Aged(crate::matcher::AgedTrade),
}

/// Default of [`PipelineConfig::unchecked_exception_days`].
pub const UNCHECKED_EXCEPTION_DAYS_DEFAULT: u32 = 30;

/// Delivery confirmations from the consumer of the outbound queue. CLS of a shard arrive in
/// outbox order, so one watermark per shard is enough: confirming outbox id n confirms every CLS
/// of that shard up to n. Writers record the watermark in their next transaction; a restart
/// emits again what lies above it.
/// Across nodes, the confirmations go to the cluster's [`DeliveryBook`], which every shard's
/// owner reads.
#[derive(Clone, Debug)]
pub struct Delivery {
    pub(crate) through: Vec<Arc<std::sync::atomic::AtomicI64>>,
    pub(crate) in_use: Arc<AtomicBool>,
    book: Option<Arc<DeliveryBook>>,
}

impl Delivery {
    /// Confirmations recorded in a cluster's delivery book.
    pub fn cluster(book: Arc<DeliveryBook>) -> Self {
        Self {
            through: Vec::new(),
            in_use: Arc::new(AtomicBool::new(true)),
            book: Some(book),
        }
    }

    /// Confirms that the CLS at `outbox_id` of `shard` (and every earlier one) was delivered.
    pub fn confirm(&self, shard: u32, outbox_id: i64) -> Result<(), QueueError> {
        if let Some(book) = &self.book {
            return book.confirm(shard, outbox_id);
        }
        if let Some(through) = self.through.get(shard as usize) {
            through.fetch_max(outbox_id, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Confirms each `(shard, outbox_id)`: once per shard, its highest.
    pub fn confirm_all(&self, confirmed: &[(u32, i64)]) -> Result<(), QueueError> {
        let mut highest: Vec<(u32, i64)> = Vec::new();
        for &(shard, outbox_id) in confirmed {
            match highest.iter_mut().find(|(known, _)| *known == shard) {
                Some((_, through)) => *through = (*through).max(outbox_id),
                None => highest.push((shard, outbox_id)),
            }
        }
        highest
            .into_iter()
            .try_for_each(|(shard, outbox_id)| self.confirm(shard, outbox_id))
    }
}

/// How long a stopping writer waits for the confirmation of the CLS it emitted last.
pub(crate) const DELIVERY_WAIT: Duration = Duration::from_secs(5);

/// Where the shards keep their rows.
#[derive(Debug, Clone)]
pub enum StoreConfig {
    Memory,
    /// One SQLite file per shard (and one for validation exceptions) in this folder.
    Embedded {
        dir: PathBuf,
    },
    /// One PostgreSQL database per shard, in shard order; validation exceptions go to the first.
    Postgres {
        urls: Vec<String>,
    },
}

/// Sizes and counts of the network; every queue and batch is bounded by one of these.
#[derive(Debug, Clone)]
pub struct PipelineConfig {
    pub shards: u32,
    pub validators: u32,
    /// Capacity of every inbound, match and store queue, in messages.
    pub queue_capacity_messages: usize,
    /// Capacity of the ack and outbound queues.
    pub outbound_capacity: usize,
    /// Largest number of messages committed in one transaction.
    pub batch_max_messages: usize,
    /// How long a writer waits for more messages before committing a batch that is not full
    /// (zero: commit what is queued at once).
    pub batch_linger: Duration,
    pub store: StoreConfig,
    /// Interval between two samples of every station.
    pub sample_interval: Duration,
    /// Where `samples.csv` goes; `None` disables sampling.
    pub samples_path: Option<PathBuf>,
    /// How a writer retries a commit that failed for a transient reason.
    pub retry: RetryPolicy,
    /// Rebuild each matcher from the messages its shard already holds; otherwise a shard that
    /// holds messages is refused.
    pub recover: bool,
    /// Keep a shard's trades this many days after their trade date, then drop them (postgres:
    /// whole monthly partitions; embedded: the expired rows), and exceptions this many days
    /// after they arrived. `None` keeps everything.
    pub retention_days: Option<u32>,
    /// Keep the exceptions of unchecked input (unsigned, wrongly signed, unreadable input that
    /// names no MsgId) this many days after they arrived, checked once a day; `None` keeps them.
    pub unchecked_exception_days: Option<u32>,
    /// When unmatched trades age out; `None`: never.
    pub aging: Option<Aging>,
    /// Bytes a shard's match queue may hold: the backlog of a shard whose store stalls (its
    /// database down), while the other shards go on. Once it is full, backpressure reaches the
    /// validators and the senders.
    pub shard_backlog_bytes: usize,
    /// What a matcher on a store that answers recalls (PostgreSQL) keeps in memory
    /// ([`Matcher::bounded`]); the other stores' matchers remember everything exactly.
    pub matcher_memory: MatcherMemory,
}

/// Default of [`PipelineConfig::shard_backlog_bytes`]: about ten seconds of one shard's
/// share of the load on this kind of machine.
pub const SHARD_BACKLOG_BYTES_DEFAULT: usize = 256 * 1024 * 1024;

/// Aging of unmatched trades: closed after `business_days` whole business days of their
/// market without an accepted message (DESIGN.md section 4; default 20, after T2S's recycling
/// period). Each matcher runs it once a day, at its first wake-up of the day: a batch, or an
/// idle wait of `check_interval`.
#[derive(Debug, Clone, Copy)]
pub struct Aging {
    pub business_days: u32,
    pub check_interval: Duration,
}

impl Default for Aging {
    fn default() -> Self {
        Self {
            business_days: 20,
            check_interval: Duration::from_secs(60),
        }
    }
}

/// Retries of a failed commit: exponential backoff from `backoff_first` to `backoff_max`, for
/// at most `give_up_after`; meanwhile the writer's queue fills and backpressure reaches the
/// producers, and the other shards go on.
#[derive(Debug, Clone, Copy)]
pub struct RetryPolicy {
    pub backoff_first: Duration,
    pub backoff_max: Duration,
    pub give_up_after: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            backoff_first: Duration::from_millis(50),
            backoff_max: Duration::from_secs(2),
            give_up_after: Duration::from_secs(60),
        }
    }
}

impl Default for PipelineConfig {
    fn default() -> Self {
        Self {
            shards: 2,
            validators: 2,
            queue_capacity_messages: 8192,
            outbound_capacity: 1024,
            batch_max_messages: 4096,
            batch_linger: Duration::ZERO,
            store: StoreConfig::Memory,
            sample_interval: Duration::from_millis(10),
            samples_path: None,
            retry: RetryPolicy::default(),
            recover: false,
            retention_days: None,
            unchecked_exception_days: Some(UNCHECKED_EXCEPTION_DAYS_DEFAULT),
            aging: Some(Aging::default()),
            shard_backlog_bytes: SHARD_BACKLOG_BYTES_DEFAULT,
            matcher_memory: MatcherMemory::default(),
        }
    }
}

/// Why the pipeline stopped.
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("cannot write samples: {0}")]
    Samples(std::io::Error),
    #[error("the pipeline has stopped: {0}")]
    Stopped(String),
    #[error("the store of {station} failed")]
    Shard {
        station: String,
        #[source]
        source: StoreError,
    },
    #[error("bad configuration: {0}")]
    Config(String),
    #[error("a pipeline thread panicked: {0}")]
    Panicked(String),
    #[error(transparent)]
    Queue(QueueError),
    /// This node no longer holds the shard's lease: it stopped writing the shard.
    #[error("the lease of shard {shard} was lost")]
    LeaseLost { shard: u32 },
}

/// Bytes of its raw input an exception keeps when the input's signature was not checked (too
/// large, unsigned, a bad signature, unreadable, refused by a listener): what an
/// unauthenticated client can make the engine store is bounded. The detail then gives the full
/// length and its xxh3 hash.
pub const EXCEPTION_RAW_PREFIX_BYTES: usize = 4096;

/// Batches a match queue may hold, whatever their bytes: its bound in bytes
/// ([`PipelineConfig::shard_backlog_bytes`]) is the one that counts; this one only sizes the
/// channel (a slot is a few words).
const MATCH_QUEUE_BATCHES_MAX: usize = 65_536;

/// Messages per batch on the inbound queues: one channel operation (and at most one wake-up of a
/// validator) per batch instead of per message.
pub const INBOUND_BATCH_MESSAGES: usize = 64;

/// Sends envelopes into the sharded inbound queues, in batches of up to
/// [`INBOUND_BATCH_MESSAGES`]. Cloneable: several producers may submit; each must
/// [`flush`](Submitter::flush) what it holds before it is dropped or waits.
pub struct Submitter {
    inbound: Vec<Tx<Envelope>>,
    pending: Vec<Vec<Envelope>>,
    clock: RunClock,
    origin: u32,
    batch_messages: usize,
}

impl Clone for Submitter {
    fn clone(&self) -> Self {
        Self {
            inbound: self.inbound.clone(),
            pending: vec![Vec::new(); self.inbound.len()],
            clock: self.clock,
            origin: self.origin,
            batch_messages: self.batch_messages,
        }
    }
}

impl Submitter {
    /// A submitter onto `inbound` (one queue per partition, in order), stamping every envelope
    /// with `origin`, the gateway whose ACK queue answers it.
    pub fn new(inbound: Vec<Tx<Envelope>>, clock: RunClock, origin: u32) -> Self {
        Self {
            pending: vec![Vec::new(); inbound.len()],
            inbound,
            clock,
            origin,
            batch_messages: INBOUND_BATCH_MESSAGES,
        }
    }

    /// This submitter, sending batches of up to `messages` (at least one) instead of
    /// [`INBOUND_BATCH_MESSAGES`]: across nodes a batch is what a queue's server stores, reads
    /// and deletes as one.
    pub fn with_batch_messages(mut self, messages: usize) -> Self {
        self.batch_messages = messages.max(1);
        self
    }

    /// The run clock, for stamping `injected_ns`.
    pub fn clock(&self) -> RunClock {
        self.clock
    }

    /// Adds one envelope to the batch of its trade's inbound queue, sending the batch when full
    /// (blocking while that queue is full).
    pub fn submit(&mut self, mut envelope: Envelope) -> Result<(), PipelineError> {
        envelope.origin = self.origin;
        let index = inbound_index(&envelope.bytes, self.inbound.len());
        self.pending[index].push(envelope);
        if self.pending[index].len() >= self.batch_messages {
            self.send(index)?;
        }
        Ok(())
    }

    /// Signs a line with its claimed sender's key (unsigned if there is none) and submits it.
    pub fn submit_line(
        &mut self,
        refdata: &RefData,
        bytes: Vec<u8>,
        correlation: u64,
    ) -> Result<(), PipelineError> {
        let envelope = sign_line(refdata, bytes, correlation, self.clock.now_ns());
        self.submit(envelope)
    }

    /// Sends every partial batch.
    pub fn flush(&mut self) -> Result<(), PipelineError> {
        for index in 0..self.pending.len() {
            if !self.pending[index].is_empty() {
                self.send(index)?;
            }
        }
        Ok(())
    }

    fn send(&mut self, index: usize) -> Result<(), PipelineError> {
        let batch = std::mem::replace(
            &mut self.pending[index],
            Vec::with_capacity(self.batch_messages),
        );
        self.inbound[index]
            .send(batch)
            .map_err(crate::stations::queue_error)
    }
}

/// Builds the envelope a participant would send: signed with the key of the line's first
/// `<Sender>`, or unsigned when there is none or it has no key.
pub fn sign_line(
    refdata: &RefData,
    bytes: Vec<u8>,
    correlation: u64,
    injected_ns: u64,
) -> Envelope {
    let sender = sign::claimed_sender(&bytes).map(str::to_owned);
    let signature = sender
        .as_deref()
        .and_then(|sender| refdata.participant_mac(sender))
        .map(|(_, mac)| sign::sign_keyed(mac, &bytes));
    Envelope {
        bytes,
        sender,
        signature,
        correlation,
        origin: 0,
        injected_ns,
        refusal: None,
    }
}

/// The inbound queue of a message: the shard of the trade its bytes name, over `queues`
/// ([`crate::routing`]), so that a trade's messages stay in order and, where there is one
/// inbound queue per shard (a cluster), a message's queue is its shard's; queue 0 when the
/// bytes name no trade. The bytes are scanned, not parsed: a validator that parses them to
/// another trade sends the message on ([`crate::stations::validator`]).
pub fn inbound_index(bytes: &[u8], queues: usize) -> usize {
    let text_of = |tag_open: &[u8], tag_close: &[u8]| -> Option<&[u8]> {
        let start = sign::find(bytes, tag_open)? + tag_open.len();
        let end = start + sign::find(&bytes[start..], tag_close)?;
        Some(&bytes[start..end])
    };
    match (
        text_of(b"<Broker>", b"</Broker>"),
        text_of(b"<TradeRef>", b"</TradeRef>"),
    ) {
        (Some(broker), Some(trade_ref)) => {
            let mut key = Vec::with_capacity(broker.len() + 1 + trade_ref.len());
            key.extend_from_slice(broker);
            key.push(b'/');
            key.extend_from_slice(trade_ref);
            shard_of_bytes(&key, queues as u32) as usize
        }
        _ => 0,
    }
}

/// What a finished pipeline reports.
#[derive(Debug, Clone)]
pub struct PipelineReport {
    /// Per shard, in order: the matcher's final counts.
    pub shards: Vec<ShardCounts>,
    /// Per shard, in order: the rows its store holds.
    pub shard_rows: Vec<RowCounts>,
    /// Per shard, in order: commits retried after a transient failure.
    pub shard_commit_retries: Vec<u64>,
    /// Rows of the validation-exception store.
    pub exception_rows: RowCounts,
}

pub(crate) type Joined<T> = JoinHandle<Result<T, PipelineError>>;

/// A running pipeline.
pub struct Pipeline {
    submitter: Option<Submitter>,
    acks: LocalReceiver<Ack>,
    outbound: LocalReceiver<OutboundEvent>,
    stations: Vec<Arc<Station>>,
    validators: Vec<Joined<()>>,
    matchers: Vec<Joined<ShardCounts>>,
    writers: Vec<Joined<WriterReport>>,
    exception_writer: Option<Joined<WriterReport>>,
    sampler: Option<(Arc<AtomicBool>, Joined<()>)>,
    delivery: Delivery,
}

/// Opens the store of `shard`, or the store of validation exceptions for `None`.
fn open_store(config: &StoreConfig, shard: Option<usize>) -> Result<Box<dyn Store>, PipelineError> {
    Ok(match config {
        StoreConfig::Memory => Box::new(MemoryStore::default()),
        StoreConfig::Embedded { dir } => {
            std::fs::create_dir_all(dir).map_err(StoreError::Runtime)?;
            let file = match shard {
                Some(shard) => format!("shard-{shard}.sqlite"),
                None => "exceptions.sqlite".to_owned(),
            };
            Box::new(SqliteStore::open(&dir.join(file))?)
        }
        StoreConfig::Postgres { urls } => {
            let url = urls.get(shard.unwrap_or(0)).ok_or_else(|| {
                PipelineError::Config(format!(
                    "shard {} has no database URL ({} given)",
                    shard.unwrap_or(0),
                    urls.len()
                ))
            })?;
            Box::new(PgStore::open(url)?)
        }
    })
}

pub(crate) fn spawn<T: Send + 'static>(
    name: String,
    body: impl FnOnce() -> Result<T, PipelineError> + Send + 'static,
) -> Joined<T> {
    std::thread::Builder::new()
        .name(name)
        .spawn(body)
        .expect("the operating system can start a thread")
}

impl Pipeline {
    /// Opens the stores and starts every station.
    pub fn start(
        config: &PipelineConfig,
        refdata: Arc<RefData>,
        tolerances: Tolerances,
    ) -> Result<Self, PipelineError> {
        let shards = config.shards.max(1);
        let validators = config.validators.max(1);
        // Queues hold batches: their capacity in batches keeps the bound in messages.
        let capacity = (config.queue_capacity_messages / INBOUND_BATCH_MESSAGES).max(2);

        if let StoreConfig::Postgres { urls } = &config.store {
            if urls.len() != shards as usize {
                return Err(PipelineError::Config(format!(
                    "{shards} shards need {shards} database URLs, {} given",
                    urls.len()
                )));
            }
        }
        let mut stores = Vec::with_capacity(shards as usize);
        if config.retention_days.is_some() && matches!(config.store, StoreConfig::Memory) {
            return Err(PipelineError::Config(
                "retention needs a durable store (embedded or postgres)".to_owned(),
            ));
        }
        for shard in 0..shards as usize {
            let mut store = open_store(&config.store, Some(shard))?;
            if let Some(days) = config.retention_days {
                let today = OffsetDateTime::now_utc().date();
                let report = store.purge(today, days)?;
                if !report.dropped.is_empty() {
                    tracing::info!(shard, partitions = report.dropped.len(), "retention purge");
                }
            }
            let held = store.row_counts()?.messages;
            if held > 0 && !config.recover {
                return Err(PipelineError::Config(format!(
                    "shard {shard} already holds {held} messages; recover from it or start from empty shards"
                )));
            }
            stores.push(store);
        }
        // Shards rebuild their matchers side by side: each reads only its own store.
        let rebuilt: Vec<Result<(Matcher, Vec<crate::store::UndeliveredCls>), PipelineError>> =
            std::thread::scope(|scope| {
                let handles: Vec<_> = stores
                    .iter_mut()
                    .enumerate()
                    .map(|(shard, store)| {
                        let refdata = &refdata;
                        let tolerances = &tolerances;
                        scope.spawn(move || {
                            let matcher = restore_matcher(
                                store.as_mut(),
                                shard,
                                refdata,
                                tolerances,
                                config.matcher_memory,
                            )?;
                            Ok((matcher, store.undelivered_cls()?))
                        })
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|handle| {
                        handle
                            .join()
                            .unwrap_or_else(|_| Err(PipelineError::Panicked("restore".to_owned())))
                    })
                    .collect()
            });
        let mut restored_matchers = Vec::with_capacity(shards as usize);
        let mut undelivered = Vec::with_capacity(shards as usize);
        for result in rebuilt {
            let (matcher, unconfirmed) = result?;
            restored_matchers.push(matcher);
            undelivered.push(unconfirmed);
        }
        let exception_store = open_store(&config.store, None)?;
        // Run time starts once the stores are open and the matchers rebuilt.
        let clock = RunClock::start();

        let mut stations = Vec::new();
        let (ack_tx, ack_rx) = local::bounded::<Ack>("acks", config.outbound_capacity, clock);
        let (out_tx, out_rx) =
            local::bounded::<OutboundEvent>("outbound", config.outbound_capacity, clock);
        let outbound_station = out_tx.station().clone();
        let retry = config.retry;
        let delivery = Delivery {
            through: (0..shards)
                .map(|_| Arc::new(std::sync::atomic::AtomicI64::new(0)))
                .collect(),
            in_use: Arc::new(AtomicBool::new(false)),
            book: None,
        };
        let batch_max = config.batch_max_messages.max(1);

        // Writers and their store queues.
        let mut store_txs = Vec::new();
        let mut store_stations = Vec::new();
        let mut writers = Vec::new();
        let mut recalls = Vec::new();
        for ((shard, store), redeliver) in stores.into_iter().enumerate().zip(undelivered) {
            let committed = Arc::new(AtomicU64::new(0));
            recalls.push(if restored_matchers[shard].is_bounded() {
                Some(Recall {
                    store: open_store(&config.store, Some(shard))?,
                    committed: committed.clone(),
                    retry,
                })
            } else {
                None
            });
            let (tx, rx) = local::bounded::<ToStore>(format!("store.{shard}"), capacity, clock);
            store_stations.push(tx.station().clone());
            store_txs.push(tx);
            let context = WriterContext {
                shard: shard as u32,
                ack_tx: Box::new(ack_tx.clone()),
                out_tx: Box::new(out_tx.clone()),
                batch_max,
                linger: config.batch_linger,
                retry,
                delivered: delivery.through[shard].clone(),
                delivery_in_use: delivery.in_use.clone(),
                retention_days: config.retention_days,
                committed,
                lease_held: None,
            };
            writers.push(spawn(format!("writer-{shard}"), move || {
                run_writer(Box::new(rx), store, context, redeliver)
            }));
        }

        let (exception_tx, exception_rx) =
            local::bounded::<RejectedItem>("exceptions", capacity, clock);
        let exception_station = exception_tx.station().clone();
        let unchecked_exception_days = config.unchecked_exception_days;
        let exception_writer = {
            let acks: Tx<Ack> = Box::new(ack_tx.clone());
            spawn("exception-writer".to_owned(), move || {
                run_exception_writer(
                    Box::new(exception_rx),
                    exception_store,
                    acks,
                    batch_max,
                    retry,
                    unchecked_exception_days,
                )
            })
        };
        drop(ack_tx);
        drop(out_tx);

        // Matchers and their match queues, bounded in bytes too: a stalled shard keeps its
        // backlog here while the validators serve the others.
        let match_capacity = capacity.max(MATCH_QUEUE_BATCHES_MAX);
        let mut match_txs: Vec<Tx<Validated>> = Vec::new();
        let mut match_stations = Vec::new();
        let mut matchers = Vec::new();
        for (((shard, matcher), store_tx), recall) in restored_matchers
            .into_iter()
            .enumerate()
            .zip(store_txs)
            .zip(recalls)
        {
            let (tx, rx) = local::bounded_bytes::<Validated>(
                format!("match.{shard}"),
                match_capacity,
                config.shard_backlog_bytes,
                Validated::weight_bytes,
                clock,
            );
            match_stations.push(tx.station().clone());
            match_txs.push(Box::new(tx));
            let aging = config.aging;
            matchers.push(spawn(format!("matcher-{shard}"), move || {
                run_matcher(
                    Box::new(rx),
                    matcher,
                    Box::new(store_tx),
                    aging,
                    Arc::default(),
                    recall,
                )
            }));
        }

        // Validators and the sharded inbound queues.
        let mut inbound: Vec<Tx<Envelope>> = Vec::new();
        let mut inbound_stations = Vec::new();
        let mut validator_handles = Vec::new();
        for index in 0..validators as usize {
            let (tx, rx) = local::bounded::<Envelope>(format!("inbound.{index}"), capacity, clock);
            inbound_stations.push(tx.station().clone());
            inbound.push(Box::new(tx));
            let refdata = refdata.clone();
            let routes = Routes::Every(match_txs.clone());
            let exception_tx: Tx<RejectedItem> = Box::new(exception_tx.clone());
            validator_handles.push(spawn(format!("validator-{index}"), move || {
                run_validator(Box::new(rx), &refdata, &routes, &exception_tx)
            }));
        }
        drop(match_txs);
        drop(exception_tx);

        stations.extend(inbound_stations);
        stations.extend(match_stations);
        stations.extend(store_stations);
        stations.push(exception_station);
        stations.push(outbound_station);

        let sampler = match &config.samples_path {
            Some(path) => {
                let file = File::create(path).map_err(PipelineError::Samples)?;
                let stop = Arc::new(AtomicBool::new(false));
                let flag = stop.clone();
                let sampled = stations.clone();
                let interval = config.sample_interval;
                let handle = spawn("sampler".to_owned(), move || {
                    run_sampler(BufWriter::new(file), &sampled, &flag, interval, clock)
                });
                Some((stop, handle))
            }
            None => None,
        };

        Ok(Self {
            submitter: Some(Submitter::new(inbound, clock, 0)),
            acks: ack_rx,
            outbound: out_rx,
            stations,
            validators: validator_handles,
            matchers,
            writers,
            exception_writer: Some(exception_writer),
            sampler,
            delivery,
        })
    }

    /// The handle through which the consumer of [`Pipeline::outbound`] confirms delivery. Once
    /// it has been taken, a stopping writer waits (boundedly) for its last CLS to be confirmed,
    /// so that the watermark it commits covers the whole run.
    pub fn delivery(&self) -> Delivery {
        self.delivery.in_use.store(true, Ordering::Relaxed);
        self.delivery.clone()
    }

    /// A handle to submit messages; the pipeline drains and stops once every handle is dropped
    /// and [`Pipeline::finish`] is called.
    pub fn submitter(&self) -> Submitter {
        self.submitter
            .clone()
            .expect("the submitter lives until finish")
    }

    /// ACK/NAK batches, one per commit.
    pub fn acks(&self) -> Rx<Ack> {
        Box::new(self.acks.clone())
    }

    /// CLS and status advices after commit, in batches stamped with the run-clock time they
    /// were enqueued; the `outbound` station is this queue's.
    pub fn outbound(&self) -> Rx<OutboundEvent> {
        Box::new(self.outbound.clone())
    }

    /// Every station, in network order.
    pub fn stations(&self) -> &[Arc<Station>] {
        &self.stations
    }

    /// The station with this name.
    pub fn station(&self, name: &str) -> Option<Arc<Station>> {
        self.stations.iter().find(|s| s.name() == name).cloned()
    }

    /// The run clock every timestamp of this pipeline is taken on.
    pub fn clock(&self) -> RunClock {
        self.submitter().clock()
    }

    /// Closes the inbound queues, drains every station, and reports.
    pub fn finish(mut self) -> Result<PipelineReport, PipelineError> {
        self.submitter = None;
        // A failing station closes its queues, so the stations around it stop too; the error
        // worth reporting is the cause, not the "queue closed" that it left upstream.
        let mut first_error: Option<PipelineError> = None;
        let mut keep = |result: Result<(), PipelineError>| {
            if let Err(error) = result {
                let is_cause = !matches!(error, PipelineError::Stopped(_));
                if first_error.is_none()
                    || (is_cause && matches!(first_error, Some(PipelineError::Stopped(_))))
                {
                    first_error = Some(error);
                }
            }
        };
        for handle in self.validators.drain(..) {
            keep(join(handle));
        }
        let mut shards = Vec::new();
        for handle in self.matchers.drain(..) {
            match join(handle) {
                Ok(counts) => shards.push(counts),
                Err(error) => keep(Err(error)),
            }
        }
        let mut shard_rows = Vec::new();
        let mut shard_commit_retries = Vec::new();
        for handle in self.writers.drain(..) {
            match join(handle) {
                Ok(report) => {
                    shard_rows.push(report.rows);
                    shard_commit_retries.push(report.commit_retries);
                }
                Err(error) => keep(Err(error)),
            }
        }
        let mut exception_rows = RowCounts::default();
        if let Some(handle) = self.exception_writer.take() {
            match join(handle) {
                Ok(report) => exception_rows = report.rows,
                Err(error) => keep(Err(error)),
            }
        }
        if let Some((stop, handle)) = self.sampler.take() {
            stop.store(true, Ordering::Relaxed);
            keep(join(handle));
        }
        match first_error {
            Some(error) => Err(error),
            None => Ok(PipelineReport {
                shards,
                shard_rows,
                shard_commit_retries,
                exception_rows,
            }),
        }
    }
}

/// How often rebuilding a matcher reports its progress.
const RESTORE_PROGRESS_EVERY_MESSAGES: u64 = 500_000;

/// Rebuilds a shard's matcher by taking back, in order, every message the shard accepted. On
/// a store that can answer recalls ([`Store::can_recall`]) the matcher is bounded by `memory`:
/// the closed trades, every message key and every remembered rejection go into its filter,
/// and only the open trades' messages are taken back.
pub(crate) fn restore_matcher(
    store: &mut dyn Store,
    shard: usize,
    refdata: &Arc<RefData>,
    tolerances: &Tolerances,
    memory: MatcherMemory,
) -> Result<Matcher, PipelineError> {
    let bounded = store.can_recall();
    let mut matcher = if bounded {
        Matcher::bounded(refdata.clone(), tolerances.clone(), memory)
    } else {
        Matcher::new(refdata.clone(), tolerances.clone()).with_quota(memory.participant_held_bytes)
    };
    let restart_day = OffsetDateTime::now_utc().date();
    let mut disagreements = 0_u64;
    let mut taken_back = 0_u64;
    let started = Instant::now();
    let accepted = if bounded {
        Some(store.for_each_retired(&mut |fact| {
            matcher.retired(fact);
        })?)
    } else {
        None
    };
    let mut take_back = |stored: crate::store::StoredMessage| {
        taken_back += 1;
        if taken_back.is_multiple_of(RESTORE_PROGRESS_EVERY_MESSAGES) {
            tracing::info!(shard, messages = taken_back, "rebuilding the matcher");
        }
        // A stored message passed validation when it was accepted; only its fields are needed.
        let typed = crate::codec::parse_fields(&stored.raw)
            .and_then(|fields| crate::validate::typed_fields(&fields));
        let restored = match typed {
            Ok(msg) => matcher.restore(
                msg,
                &stored.raw,
                stored.injected_ns,
                stored.trade_date,
                // A row written before days were kept counts from the restart.
                stored.received_on.unwrap_or(restart_day),
            ),
            Err(_) => false,
        };
        if !restored {
            disagreements += 1;
        }
    };
    let restored = if bounded {
        store.for_each_accepted_of_open_trades(&mut take_back)?
    } else {
        store.for_each_accepted(&mut take_back)?
    };
    if disagreements > 0 {
        return Err(PipelineError::Config(format!(
            "shard {shard}: {disagreements} of {restored} stored messages could not be taken back"
        )));
    }
    match accepted {
        Some(accepted) => matcher.set_accepted(accepted),
        // After the accepted messages: a MsgId that was accepted keeps that verdict.
        None => {
            store.for_each_remembered_rejection(&mut |rejection| {
                matcher.restore_rejection(
                    &rejection.sender,
                    &rejection.msg_id,
                    &rejection.raw,
                    rejection.code,
                );
            })?;
        }
    }
    if restored > 0 || accepted.is_some_and(|accepted| accepted > 0) {
        tracing::info!(
            shard,
            messages = accepted.unwrap_or(restored),
            taken_back = restored,
            seconds = started.elapsed().as_secs_f64(),
            "matcher rebuilt from its shard"
        );
    }
    Ok(matcher)
}

pub(crate) fn join<T>(handle: Joined<T>) -> Result<T, PipelineError> {
    let name = handle.thread().name().unwrap_or("unnamed").to_owned();
    handle.join().map_err(|_| PipelineError::Panicked(name))?
}
