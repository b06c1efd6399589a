//! The queue network of DESIGN.md section 1, in process:
//!
//! ```text
//! inbound[i] → validator i ─ok→ match[k] → matcher k → store[k] → writer k ─after commit→ acks, outbound
//!                          └rejected→ exceptions → exception writer ─after commit→ acks
//! ```
//!
//! Every queue is a bounded crossbeam channel (a full queue blocks its producer; nothing is
//! dropped) and every station counts arrivals, completions and busy time. Inbound queues are
//! sharded by trade key, so the messages of one trade keep their order from injection to the
//! matcher. Nothing leaves the engine before the transaction that holds it has committed.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ahash::AHashMap;
use crossbeam_channel::{bounded, Receiver, Sender};
use time::format_description::well_known::Rfc3339;
use time::{Date, OffsetDateTime};

use crate::codec::encode_cls;
use crate::matcher::{Advice, Disposition, Matcher, Outcome, ShardCounts, TradeStatus};
use crate::model::Msg;
use crate::profile::Tolerances;
use crate::reason::{ReasonCode, Rejection};
use crate::refdata::RefData;
use crate::routing::{fnv1a_64, shard_of_parts};
use crate::sign::{self, SIGNATURE_LEN};
use crate::station::{RunClock, Station};
use crate::store::{
    Batch, ClsRow, ExceptionRow, MemoryStore, MessageRow, PgStore, RowCounts, SqliteStore, Store,
    StoreError, TradeRow,
};
use crate::validate::validate;

/// One inbound message as it enters the engine.
#[derive(Debug, Clone)]
pub struct Envelope {
    pub bytes: Vec<u8>,
    /// The participant whose key signed the bytes.
    pub sender: Option<String>,
    pub signature: Option<[u8; SIGNATURE_LEN]>,
    /// Chosen by the sender of the envelope; returned in its ACK or NAK.
    pub correlation: u64,
    /// When the message entered the engine, on the run clock.
    pub injected_ns: u64,
    /// Set by a gateway that refuses the message before validation (e.g. a connection sending
    /// as a participant it did not log on as): the validator rejects it with this, so it is
    /// stored as an exception and NAKed like any other rejection.
    pub refusal: Option<Rejection>,
}

/// The result of one inbound message, sent after the commit that holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AckResult {
    Accepted,
    Duplicate,
    Rejected(ReasonCode),
}

/// An ACK (accepted or duplicate) or NAK (rejected with a code).
#[derive(Debug, Clone, Copy)]
pub struct Ack {
    pub correlation: u64,
    pub result: AckResult,
}

/// What the engine sends outbound after commit.
#[derive(Debug, Clone)]
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
    /// A trade aged out, committed: its parties are told.
    Aged(crate::matcher::AgedTrade),
}

/// Delivery confirmations from the consumer of the outbound queue. CLS of a shard arrive in
/// outbox order, so one watermark per shard is enough: confirming outbox id n confirms every CLS
/// of that shard up to n. Writers record the watermark in their next transaction; a restart
/// emits again what lies above it.
#[derive(Clone, Debug)]
pub struct Delivery {
    through: Vec<Arc<std::sync::atomic::AtomicI64>>,
    in_use: Arc<AtomicBool>,
}

impl Delivery {
    /// Confirms that the CLS at `outbox_id` of `shard` (and every earlier one) was delivered.
    pub fn confirm(&self, shard: u32, outbox_id: i64) {
        if let Some(through) = self.through.get(shard as usize) {
            through.fetch_max(outbox_id, Ordering::Relaxed);
        }
    }
}

/// How long a stopping writer waits for the confirmation of the CLS it emitted last.
const DELIVERY_WAIT: Duration = Duration::from_secs(5);

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
    /// When unmatched trades age out; `None`: never.
    pub aging: Option<Aging>,
}

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

/// Commits `batch`, retrying transient failures with backoff and a new connection.
fn commit_retrying(
    store: &mut dyn Store,
    batch: &mut Batch,
    station: &str,
    retry: RetryPolicy,
) -> Result<(Vec<i64>, u64), PipelineError> {
    let started = Instant::now();
    let mut backoff = retry.backoff_first;
    let mut attempt: u32 = 1;
    loop {
        let error = match store.commit(batch) {
            Ok(outbox_ids) => {
                if attempt > 1 {
                    tracing::warn!(station, attempt, "commit succeeded after retrying");
                }
                return Ok((outbox_ids, u64::from(attempt - 1)));
            }
            Err(error) => error,
        };
        if !store.is_transient(&error) || started.elapsed() + backoff > retry.give_up_after {
            return Err(PipelineError::Shard {
                station: station.to_owned(),
                source: error,
            });
        }
        tracing::warn!(station, attempt, error = %error, backoff_ms = backoff.as_millis() as u64, "commit failed; retrying");
        std::thread::sleep(backoff);
        backoff = (backoff * 2).min(retry.backoff_max);
        attempt += 1;
        if let Err(error) = store.reconnect() {
            tracing::warn!(station, error = %error, "reconnect failed");
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
            aging: Some(Aging::default()),
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
}

struct Validated {
    /// The message, or why the validator rejected it after its signature checked out.
    verdict: Result<Msg, Refused>,
    bytes: Vec<u8>,
    correlation: u64,
    injected_ns: u64,
}

/// A message rejected after its signature checked out: its shard's matcher remembers its MsgId.
struct Refused {
    rejection: Rejection,
    identity: crate::validate::Identity,
}

/// The few fields of a message that its store row needs once the matcher owns the message.
struct MessageMeta {
    trade_key: String,
    sender: String,
    msg_id: String,
    msg_type: &'static str,
    function: &'static str,
    related_id: Option<String>,
}

impl MessageMeta {
    fn of(msg: &Msg) -> Self {
        Self {
            trade_key: msg.trade_key(),
            sender: msg.sender.clone(),
            msg_id: msg.msg_id.clone(),
            msg_type: msg.msg_type.as_str(),
            function: msg.function.as_str(),
            related_id: msg.related_id.clone(),
        }
    }
}

/// What a shard writer writes: the outcome of a message, or a trade that aged out.
// Messages are the hot path and aged trades rare: boxing the large variant would cost every
// message an allocation to save queue slots a few bytes.
#[allow(clippy::large_enum_variant)]
enum ToStore {
    Message(Processed),
    Aged(crate::matcher::AgedTrade),
}

struct Processed {
    /// The day the matcher took the message, which aging counts from.
    received_on: Date,
    outcome: Outcome,
    meta: MessageMeta,
    bytes: Vec<u8>,
    correlation: u64,
    injected_ns: u64,
}

struct RejectedItem {
    rejection: Rejection,
    sender: Option<String>,
    bytes: Vec<u8>,
    correlation: u64,
}

/// Bytes of its raw input an exception keeps when the input's signature was not checked (too
/// large, unsigned, a bad signature, unreadable, refused by a listener): what an
/// unauthenticated client can make the engine store is bounded. The detail then gives the full
/// length and its xxh3 hash.
pub const EXCEPTION_RAW_PREFIX_BYTES: usize = 4096;

/// Messages per batch on the inbound queues: one channel operation (and at most one wake-up of a
/// validator) per batch instead of per message.
pub const INBOUND_BATCH_MESSAGES: usize = 64;

/// A batch on a queue, stamped with the time it was enqueued.
type Stamped<T> = (Vec<T>, u64);

/// Sends envelopes into the sharded inbound queues, in batches of up to
/// [`INBOUND_BATCH_MESSAGES`]. Cloneable: several producers may submit; each must
/// [`flush`](Submitter::flush) what it holds before it is dropped or waits.
pub struct Submitter {
    inbound: Vec<Sender<Stamped<Envelope>>>,
    stations: Vec<Arc<Station>>,
    pending: Vec<Vec<Envelope>>,
    clock: RunClock,
}

impl Clone for Submitter {
    fn clone(&self) -> Self {
        Self {
            inbound: self.inbound.clone(),
            stations: self.stations.clone(),
            pending: vec![Vec::new(); self.inbound.len()],
            clock: self.clock,
        }
    }
}

impl Submitter {
    /// The run clock, for stamping `injected_ns`.
    pub fn clock(&self) -> RunClock {
        self.clock
    }

    /// Adds one envelope to the batch of its trade's inbound queue, sending the batch when full
    /// (blocking while that queue is full).
    pub fn submit(&mut self, envelope: Envelope) -> Result<(), PipelineError> {
        let index = inbound_index(&envelope.bytes, self.inbound.len());
        self.pending[index].push(envelope);
        if self.pending[index].len() >= INBOUND_BATCH_MESSAGES {
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
            Vec::with_capacity(INBOUND_BATCH_MESSAGES),
        );
        self.stations[index].arrive(batch.len() as u64);
        self.inbound[index]
            .send((batch, self.clock.now_ns()))
            .map_err(|_| stopped("inbound"))
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
        injected_ns,
        refusal: None,
    }
}

/// The inbound queue of a message: by trade key when the bytes name one, so that a trade's
/// messages stay in order; queue 0 otherwise.
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
            (fnv1a_64(&key) % queues as u64) as usize
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

type Joined<T> = JoinHandle<Result<T, PipelineError>>;

/// What a writer reports when it stops.
struct WriterReport {
    rows: RowCounts,
    commit_retries: u64,
}

/// A running pipeline.
pub struct Pipeline {
    submitter: Option<Submitter>,
    acks: Receiver<Vec<Ack>>,
    outbound: Receiver<Stamped<OutboundEvent>>,
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

fn spawn<T: Send + 'static>(
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
                            let matcher =
                                restore_matcher(store.as_mut(), shard, refdata, tolerances)?;
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
        let (ack_tx, ack_rx) = bounded::<Vec<Ack>>(config.outbound_capacity);
        let (out_tx, out_rx) = bounded::<Stamped<OutboundEvent>>(config.outbound_capacity);
        let outbound_station = Station::new("outbound");
        let retry = config.retry;
        let delivery = Delivery {
            through: (0..shards)
                .map(|_| Arc::new(std::sync::atomic::AtomicI64::new(0)))
                .collect(),
            in_use: Arc::new(AtomicBool::new(false)),
        };

        // Writers and their store queues.
        let mut store_txs = Vec::new();
        let mut store_stations = Vec::new();
        let mut writers = Vec::new();
        for ((shard, store), redeliver) in stores.into_iter().enumerate().zip(undelivered) {
            let (tx, rx) = bounded::<Stamped<ToStore>>(capacity);
            let station = Station::new(format!("store.{shard}"));
            store_txs.push(tx);
            store_stations.push(station.clone());
            let acks = ack_tx.clone();
            let outbound = out_tx.clone();
            let outbound_station = outbound_station.clone();
            let batch_max = config.batch_max_messages.max(1);
            let context = WriterContext {
                shard: shard as u32,
                station,
                ack_tx: acks,
                out_tx: outbound,
                outbound_station,
                clock,
                batch_max,
                linger: config.batch_linger,
                retry,
                delivery: delivery.clone(),
                retention_days: config.retention_days,
            };
            writers.push(spawn(format!("writer-{shard}"), move || {
                run_writer(rx, store, context, redeliver)
            }));
        }

        let (exception_tx, exception_rx) = bounded::<Stamped<RejectedItem>>(capacity);
        let exception_station = Station::new("exceptions");
        let exception_writer = {
            let station = exception_station.clone();
            let acks = ack_tx.clone();
            let batch_max = config.batch_max_messages.max(1);
            spawn("exception-writer".to_owned(), move || {
                run_exception_writer(
                    exception_rx,
                    exception_store,
                    station,
                    acks,
                    clock,
                    batch_max,
                    retry,
                )
            })
        };
        drop(ack_tx);
        drop(out_tx);

        // Matchers and their match queues.
        let mut match_txs = Vec::new();
        let mut match_stations = Vec::new();
        let mut matchers = Vec::new();
        for (shard, matcher) in restored_matchers.into_iter().enumerate() {
            let (tx, rx) = bounded::<Stamped<Validated>>(capacity);
            let station = Station::new(format!("match.{shard}"));
            match_txs.push(tx);
            match_stations.push(station.clone());
            let store_tx = store_txs[shard].clone();
            let store_station = store_stations[shard].clone();
            let aging = config.aging;
            matchers.push(spawn(format!("matcher-{shard}"), move || {
                run_matcher(rx, matcher, station, store_tx, store_station, clock, aging)
            }));
        }
        drop(store_txs);

        // Validators and the sharded inbound queues.
        let mut inbound = Vec::new();
        let mut inbound_stations = Vec::new();
        let mut validator_handles = Vec::new();
        for index in 0..validators as usize {
            let (tx, rx) = bounded::<Stamped<Envelope>>(capacity);
            let station = Station::new(format!("inbound.{index}"));
            inbound.push(tx);
            inbound_stations.push(station.clone());
            let refdata = refdata.clone();
            let match_txs = match_txs.clone();
            let match_stations = match_stations.clone();
            let exception_tx = exception_tx.clone();
            let exception_station = exception_station.clone();
            validator_handles.push(spawn(format!("validator-{index}"), move || {
                run_validator(
                    rx,
                    &refdata,
                    station,
                    &match_txs,
                    &match_stations,
                    &exception_tx,
                    &exception_station,
                    clock,
                )
            }));
        }
        drop(match_txs);
        drop(exception_tx);

        stations.extend(inbound_stations.iter().cloned());
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
            submitter: Some(Submitter {
                pending: vec![Vec::new(); inbound.len()],
                inbound,
                stations: inbound_stations,
                clock,
            }),
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
    pub fn acks(&self) -> Receiver<Vec<Ack>> {
        self.acks.clone()
    }

    /// CLS and status advices after commit, in batches stamped with the run-clock time they
    /// were enqueued.
    pub fn outbound(&self) -> Receiver<Stamped<OutboundEvent>> {
        self.outbound.clone()
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

/// Rebuilds a shard's matcher by taking back, in order, every message the shard accepted.
fn restore_matcher(
    store: &mut dyn Store,
    shard: usize,
    refdata: &Arc<RefData>,
    tolerances: &Tolerances,
) -> Result<Matcher, PipelineError> {
    let mut matcher = Matcher::new(refdata.clone(), tolerances.clone());
    let restart_day = OffsetDateTime::now_utc().date();
    let mut disagreements = 0_u64;
    let mut taken_back = 0_u64;
    let started = Instant::now();
    let restored = store.for_each_accepted(&mut |stored| {
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
    })?;
    if disagreements > 0 {
        return Err(PipelineError::Config(format!(
            "shard {shard}: {disagreements} of {restored} stored messages could not be taken back"
        )));
    }
    // After the accepted messages: a MsgId that was accepted keeps that verdict.
    store.for_each_remembered_rejection(&mut |rejection| {
        matcher.restore_rejection(
            &rejection.sender,
            &rejection.msg_id,
            &rejection.raw,
            rejection.code,
        );
    })?;
    if restored > 0 {
        tracing::info!(
            shard,
            messages = restored,
            seconds = started.elapsed().as_secs_f64(),
            "matcher rebuilt from its shard"
        );
    }
    Ok(matcher)
}

fn join<T>(handle: Joined<T>) -> Result<T, PipelineError> {
    let name = handle.thread().name().unwrap_or("unnamed").to_owned();
    handle.join().map_err(|_| PipelineError::Panicked(name))?
}

fn stopped(queue: &str) -> PipelineError {
    PipelineError::Stopped(format!("{queue} queue closed"))
}

/// Sends one batch to a station's queue, counting its arrivals first.
fn send_batch<T>(
    tx: &Sender<Stamped<T>>,
    station: &Station,
    batch: Vec<T>,
    clock: RunClock,
    queue: &str,
) -> Result<(), PipelineError> {
    if batch.is_empty() {
        return Ok(());
    }
    station.arrive(batch.len() as u64);
    tx.send((batch, clock.now_ns())).map_err(|_| stopped(queue))
}

#[allow(clippy::too_many_arguments)]
fn run_validator(
    rx: Receiver<Stamped<Envelope>>,
    refdata: &RefData,
    station: Arc<Station>,
    match_txs: &[Sender<Stamped<Validated>>],
    match_stations: &[Arc<Station>],
    exception_tx: &Sender<Stamped<RejectedItem>>,
    exception_station: &Station,
    clock: RunClock,
) -> Result<(), PipelineError> {
    let shards = match_txs.len() as u32;
    for (envelopes, enqueued_ns) in rx {
        let started = Instant::now();
        let count = envelopes.len() as u64;
        let mut to_match: Vec<Vec<Validated>> = (0..match_txs.len()).map(|_| Vec::new()).collect();
        let mut rejected = Vec::new();
        for envelope in envelopes {
            let refused_by_listener = envelope.refusal.is_some();
            let result = match envelope.refusal {
                Some(refusal) => Err(refusal),
                None => validate(
                    refdata,
                    &envelope.bytes,
                    envelope.sender.as_deref(),
                    envelope.signature.as_ref().map(|s| s.as_slice()),
                ),
            };
            // A message the validator rejected once its Sender's signature checked out goes to
            // its shard's matcher, which remembers the MsgId; a refusal by a listener (about the
            // connection, not the message) and an unsigned or unreadable one go straight to the
            // exception writer.
            let verdict = match result {
                Ok(msg) => Ok(msg),
                Err(rejection) => {
                    let remembered = !refused_by_listener && rejection.code > ReasonCode::Sig;
                    match remembered
                        .then(|| crate::validate::identity_of(&envelope.bytes))
                        .flatten()
                    {
                        Some(identity) => Err(Refused {
                            rejection,
                            identity,
                        }),
                        None => {
                            rejected.push(RejectedItem {
                                rejection,
                                sender: envelope.sender,
                                bytes: envelope.bytes,
                                correlation: envelope.correlation,
                            });
                            continue;
                        }
                    }
                }
            };
            let (broker, trade_ref) = match &verdict {
                Ok(msg) => (&msg.broker, &msg.trade_ref),
                Err(refused) => (&refused.identity.broker, &refused.identity.trade_ref),
            };
            let shard = shard_of_parts(broker, trade_ref, shards) as usize;
            to_match[shard].push(Validated {
                verdict,
                bytes: envelope.bytes,
                correlation: envelope.correlation,
                injected_ns: envelope.injected_ns,
            });
        }
        let busy_ns = started.elapsed().as_nanos() as u64;
        for (shard, batch) in to_match.into_iter().enumerate() {
            send_batch(
                &match_txs[shard],
                &match_stations[shard],
                batch,
                clock,
                "match",
            )?;
        }
        send_batch(
            exception_tx,
            exception_station,
            rejected,
            clock,
            "exceptions",
        )?;
        station.complete(
            count,
            busy_ns,
            count * clock.now_ns().saturating_sub(enqueued_ns),
        );
    }
    Ok(())
}

/// Formats wall-clock time for CLS `MatchedAt`, at most once per millisecond.
struct MatchedAtClock {
    last_ms: i128,
    text: String,
    today: Date,
}

impl MatchedAtClock {
    /// The timestamp and its date.
    fn now(&mut self) -> (&str, Date) {
        let now = OffsetDateTime::now_utc();
        let ms = now.unix_timestamp_nanos() / 1_000_000;
        if ms != self.last_ms {
            self.last_ms = ms;
            self.today = now.date();
            let truncated = now
                .replace_nanosecond((now.nanosecond() / 1_000_000) * 1_000_000)
                .unwrap_or(now);
            self.text = truncated
                .format(&Rfc3339)
                .unwrap_or_else(|_| "1970-01-01T00:00:00.000Z".to_owned());
        }
        (&self.text, self.today)
    }
}

fn run_matcher(
    rx: Receiver<Stamped<Validated>>,
    mut matcher: Matcher,
    station: Arc<Station>,
    store_tx: Sender<Stamped<ToStore>>,
    store_station: Arc<Station>,
    clock: RunClock,
    aging: Option<Aging>,
) -> Result<ShardCounts, PipelineError> {
    let mut wall = MatchedAtClock {
        last_ms: -1,
        text: String::new(),
        today: Date::MIN,
    };
    let mut aged_on: Option<Date> = None;
    // Without aging the matcher only waits for batches; the wait merely bounds a wake-up.
    let wait = aging.map_or(Duration::from_secs(3600), |aging| aging.check_interval);
    loop {
        let received = match rx.recv_timeout(wait) {
            Ok(batch) => Some(batch),
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => None,
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => break,
        };
        if let Some(aging) = aging {
            // Once a day, at the first wake-up of the day.
            let today = OffsetDateTime::now_utc().date();
            if aged_on != Some(today) {
                aged_on = Some(today);
                let aged = matcher.age_out(today, aging.business_days);
                if !aged.is_empty() {
                    tracing::info!(trades = aged.len(), %today, "unmatched trades aged out");
                    let items = aged.into_iter().map(ToStore::Aged).collect();
                    send_batch(&store_tx, &store_station, items, clock, "store")?;
                }
            }
        }
        let Some((items, enqueued_ns)) = received else {
            continue;
        };
        let started = Instant::now();
        let count = items.len() as u64;
        let mut processed = Vec::with_capacity(items.len());
        for item in items {
            let (now, today) = wall.now();
            let (meta, outcome) = match item.verdict {
                Ok(msg) => {
                    let meta = MessageMeta::of(&msg);
                    let outcome = matcher.process(msg, &item.bytes, item.injected_ns, now, today);
                    (meta, outcome)
                }
                Err(refused) => {
                    let identity = refused.identity;
                    let disposition = matcher.refuse(
                        &identity.sender,
                        &identity.msg_id,
                        &item.bytes,
                        refused.rejection,
                    );
                    let meta = MessageMeta {
                        trade_key: crate::model::trade_key(&identity.broker, &identity.trade_ref),
                        sender: identity.sender,
                        msg_id: identity.msg_id,
                        msg_type: "",
                        function: "",
                        related_id: None,
                    };
                    (meta, Outcome::only(disposition))
                }
            };
            processed.push(ToStore::Message(Processed {
                received_on: today,
                outcome,
                meta,
                bytes: item.bytes,
                correlation: item.correlation,
                injected_ns: item.injected_ns,
            }));
        }
        let busy_ns = started.elapsed().as_nanos() as u64;
        send_batch(&store_tx, &store_station, processed, clock, "store")?;
        station.complete(
            count,
            busy_ns,
            count * clock.now_ns().saturating_sub(enqueued_ns),
        );
    }
    Ok(matcher.counts())
}

/// Takes the first batch (blocking), then whatever is already queued or arrives within `linger`,
/// until `batch_max` messages are held. Returns the items and the sum of their times in the queue.
fn next_batch<T>(
    rx: &Receiver<Stamped<T>>,
    batch_max: usize,
    linger: Duration,
    clock: RunClock,
) -> Option<(Vec<T>, u64)> {
    let (mut items, enqueued_ns) = rx.recv().ok()?;
    let deadline = Instant::now() + linger;
    let mut waited_ns = items.len() as u64 * clock.now_ns().saturating_sub(enqueued_ns);
    while items.len() < batch_max {
        let next = match rx.try_recv() {
            Ok(next) => next,
            Err(_) if linger.is_zero() => break,
            Err(_) => match rx.recv_deadline(deadline) {
                Ok(next) => next,
                Err(_) => break,
            },
        };
        let (more, enqueued_ns) = next;
        waited_ns += more.len() as u64 * clock.now_ns().saturating_sub(enqueued_ns);
        items.extend(more);
    }
    Some((items, waited_ns))
}

/// What a shard writer needs besides its queue and store.
struct WriterContext {
    shard: u32,
    station: Arc<Station>,
    ack_tx: Sender<Vec<Ack>>,
    out_tx: Sender<Stamped<OutboundEvent>>,
    outbound_station: Arc<Station>,
    clock: RunClock,
    batch_max: usize,
    linger: Duration,
    retry: RetryPolicy,
    delivery: Delivery,
    retention_days: Option<u32>,
}

/// Records a trade's new status in the batch: only its last status in a batch is written.
fn set_trade_status(
    batch: &mut Batch,
    trade_rows: &mut AHashMap<String, usize>,
    trade_key: &str,
    trade_date: Date,
    status: TradeStatus,
) {
    match trade_rows.get(trade_key) {
        Some(index) => batch.trades[*index].status = status,
        None => {
            trade_rows.insert(trade_key.to_owned(), batch.trades.len());
            batch.trades.push(TradeRow {
                trade_date,
                trade_key: trade_key.to_owned(),
                status,
            });
        }
    }
}

fn run_writer(
    rx: Receiver<Stamped<ToStore>>,
    mut store: Box<dyn Store>,
    context: WriterContext,
    redeliver: Vec<crate::store::UndeliveredCls>,
) -> Result<WriterReport, PipelineError> {
    let WriterContext {
        shard,
        station,
        ack_tx,
        out_tx,
        outbound_station,
        clock,
        batch_max,
        linger,
        retry,
        delivery,
        retention_days,
    } = context;
    let delivered = delivery.through[shard as usize].clone();
    let mut watermark_written: i64 = 0;
    let mut last_emitted: i64 = redeliver.last().map_or(0, |cls| cls.outbox_id);
    // What was committed but never confirmed goes out again first, in outbox order.
    if !redeliver.is_empty() {
        tracing::info!(
            shard,
            count = redeliver.len(),
            "emitting unconfirmed CLS again"
        );
        let events = redeliver
            .into_iter()
            .map(|cls| OutboundEvent::Cls {
                cls_id: cls.cls_id,
                body: cls.body,
                trade_first_injected_ns: 0,
                shard,
                outbox_id: cls.outbox_id,
                redelivered: true,
            })
            .collect();
        send_batch(&out_tx, &outbound_station, events, clock, "outbound")?;
    }
    let mut commit_retries = 0;
    let mut purged_on = OffsetDateTime::now_utc().date();
    while let Some((items, waited_ns)) = next_batch(&rx, batch_max, linger, clock) {
        let started = Instant::now();
        let dequeued_ns = clock.now_ns();
        let today = OffsetDateTime::now_utc().date();
        if let Some(days) = retention_days.filter(|_| today != purged_on) {
            // Retention runs when the shard starts and then once a day.
            purged_on = today;
            if let Err(error) = store.purge(today, days) {
                tracing::error!(shard, error = %error, "retention purge failed; retried tomorrow");
            }
        }
        let mut batch = Batch::default();
        let mut acks = Vec::with_capacity(items.len());
        let mut events = Vec::new();
        // Only the last status of a trade in this batch needs writing.
        let mut trade_rows: AHashMap<String, usize> = AHashMap::new();
        let count = items.len() as u64;
        for item in items {
            let item = match item {
                ToStore::Message(item) => item,
                ToStore::Aged(aged) => {
                    set_trade_status(
                        &mut batch,
                        &mut trade_rows,
                        &aged.trade_key,
                        aged.trade_date,
                        TradeStatus::Aged,
                    );
                    events.push(OutboundEvent::Aged(aged));
                    continue;
                }
            };
            let meta = item.meta;
            let trade_key = meta.trade_key;
            let trade_date = item.outcome.trade_date;
            let result = match item.outcome.disposition {
                Disposition::Accepted => {
                    batch.messages.push(MessageRow {
                        trade_date,
                        trade_key: trade_key.clone(),
                        sender: meta.sender,
                        msg_id: meta.msg_id,
                        msg_type: meta.msg_type,
                        function: meta.function,
                        related_id: meta.related_id,
                        injected_ns: item.injected_ns,
                        raw: item.bytes,
                        received_on: item.received_on,
                    });
                    AckResult::Accepted
                }
                Disposition::Duplicate => AckResult::Duplicate,
                Disposition::Rejected(rejection) => {
                    let code = rejection.code;
                    batch.exceptions.push(ExceptionRow {
                        received_on: today,
                        trade_key: Some(trade_key.clone()),
                        sender: Some(meta.sender),
                        msg_id: Some(meta.msg_id),
                        code,
                        detail: rejection.detail,
                        raw: item.bytes,
                    });
                    AckResult::Rejected(code)
                }
            };
            acks.push(Ack {
                correlation: item.correlation,
                result,
            });
            if let Some(status) = item.outcome.trade_status {
                set_trade_status(&mut batch, &mut trade_rows, &trade_key, trade_date, status);
            }
            if let Some(cls) = item.outcome.cls {
                let body = encode_cls(&cls);
                batch.cls.push(ClsRow {
                    trade_date,
                    cls_id: cls.cls_id.clone(),
                    trade_key,
                    body: body.clone(),
                });
                events.push(OutboundEvent::Cls {
                    cls_id: cls.cls_id,
                    body,
                    trade_first_injected_ns: item.outcome.trade_first_injected_ns,
                    shard,
                    outbox_id: 0,
                    redelivered: false,
                });
            }
            if let Some(advice) = item.outcome.advice {
                events.push(OutboundEvent::Mismatched(advice));
            }
        }
        let confirmed = delivered.load(Ordering::Relaxed);
        if confirmed > watermark_written {
            batch.delivered_through = Some(confirmed);
        }
        let (outbox_ids, retries) =
            commit_retrying(store.as_mut(), &mut batch, station.name(), retry)?;
        commit_retries += retries;
        watermark_written = watermark_written.max(confirmed);
        let mut outbox_ids = outbox_ids.into_iter();
        for event in &mut events {
            if let OutboundEvent::Cls { outbox_id, .. } = event {
                *outbox_id = outbox_ids.next().unwrap_or_default();
                last_emitted = last_emitted.max(*outbox_id);
            }
        }
        let finished_ns = clock.now_ns();
        station.complete(
            count,
            started.elapsed().as_nanos() as u64,
            waited_ns + count * finished_ns.saturating_sub(dequeued_ns),
        );
        ack_tx.send(acks).map_err(|_| stopped("acks"))?;
        send_batch(&out_tx, &outbound_station, events, clock, "outbound")?;
    }
    // Record the final watermark, once the consumer has confirmed what this writer emitted.
    if delivery.in_use.load(Ordering::Relaxed) {
        let waiting_since = Instant::now();
        while delivered.load(Ordering::Relaxed) < last_emitted
            && waiting_since.elapsed() < DELIVERY_WAIT
        {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    let confirmed = delivered.load(Ordering::Relaxed);
    if confirmed > watermark_written {
        let mut batch = Batch {
            delivered_through: Some(confirmed),
            ..Batch::default()
        };
        commit_retrying(store.as_mut(), &mut batch, station.name(), retry)?;
    }
    Ok(WriterReport {
        rows: store.row_counts()?,
        commit_retries,
    })
}

/// The raw bytes an exception of unchecked input keeps: at most
/// [`EXCEPTION_RAW_PREFIX_BYTES`], with the full length and hash added to the detail.
fn bounded_raw(mut raw: Vec<u8>, detail: String) -> (Vec<u8>, String) {
    if raw.len() <= EXCEPTION_RAW_PREFIX_BYTES {
        return (raw, detail);
    }
    let detail = format!(
        "{detail} (the first {EXCEPTION_RAW_PREFIX_BYTES} of {} bytes are kept, xxh3 {:016x})",
        raw.len(),
        xxhash_rust::xxh3::xxh3_64(&raw)
    );
    raw.truncate(EXCEPTION_RAW_PREFIX_BYTES);
    raw.shrink_to_fit();
    (raw, detail)
}

fn run_exception_writer(
    rx: Receiver<Stamped<RejectedItem>>,
    mut store: Box<dyn Store>,
    station: Arc<Station>,
    ack_tx: Sender<Vec<Ack>>,
    clock: RunClock,
    batch_max: usize,
    retry: RetryPolicy,
) -> Result<WriterReport, PipelineError> {
    let mut commit_retries = 0;
    while let Some((items, waited_ns)) = next_batch(&rx, batch_max, Duration::ZERO, clock) {
        let started = Instant::now();
        let dequeued_ns = clock.now_ns();
        let today = OffsetDateTime::now_utc().date();
        let count = items.len() as u64;
        let mut batch = Batch::default();
        let mut acks = Vec::with_capacity(items.len());
        for item in items {
            acks.push(Ack {
                correlation: item.correlation,
                result: AckResult::Rejected(item.rejection.code),
            });
            let (raw, detail) = bounded_raw(item.bytes, item.rejection.detail);
            batch.exceptions.push(ExceptionRow {
                received_on: today,
                trade_key: None,
                sender: item.sender,
                msg_id: None,
                code: item.rejection.code,
                detail,
                raw,
            });
        }
        let (_, retries) = commit_retrying(store.as_mut(), &mut batch, station.name(), retry)?;
        commit_retries += retries;
        let finished_ns = clock.now_ns();
        station.complete(
            count,
            started.elapsed().as_nanos() as u64,
            waited_ns + count * finished_ns.saturating_sub(dequeued_ns),
        );
        ack_tx.send(acks).map_err(|_| stopped("acks"))?;
    }
    Ok(WriterReport {
        rows: store.row_counts()?,
        commit_retries,
    })
}

/// The header of `samples.csv`.
pub const SAMPLES_HEADER: &str = "t_ms,station,queue_len,arrivals,completions,busy_ms";

fn write_samples(
    out: &mut impl Write,
    stations: &[Arc<Station>],
    clock: RunClock,
) -> std::io::Result<()> {
    let t_ms = clock.now_ns() as f64 / 1e6;
    for station in stations {
        let reading = station.read();
        writeln!(
            out,
            "{t_ms:.3},{},{},{},{},{:.3}",
            station.name(),
            reading.queue_len(),
            reading.arrivals,
            reading.completions,
            reading.busy_ns as f64 / 1e6
        )?;
    }
    Ok(())
}

/// How often the sampler hands its buffered rows to the file.
const SAMPLES_FLUSH_INTERVAL: Duration = Duration::from_millis(500);

fn run_sampler(
    mut out: BufWriter<File>,
    stations: &[Arc<Station>],
    stop: &AtomicBool,
    interval: Duration,
    clock: RunClock,
) -> Result<(), PipelineError> {
    writeln!(out, "{SAMPLES_HEADER}").map_err(PipelineError::Samples)?;
    let mut next = Instant::now();
    let mut flushed = Instant::now();
    loop {
        write_samples(&mut out, stations, clock).map_err(PipelineError::Samples)?;
        // A live dashboard reads the file while the run goes on.
        if flushed.elapsed() >= SAMPLES_FLUSH_INTERVAL {
            out.flush().map_err(PipelineError::Samples)?;
            flushed = Instant::now();
        }
        if stop.load(Ordering::Relaxed) {
            break;
        }
        next += interval;
        let now = Instant::now();
        if next > now {
            std::thread::sleep(next - now);
        } else {
            next = now;
        }
    }
    out.flush().map_err(PipelineError::Samples)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unchecked_input_keeps_a_bounded_prefix_with_its_length_and_hash() {
        let raw = vec![b'x'; 1024 * 1024];
        let (kept, detail) = bounded_raw(raw.clone(), "not a SOAP envelope".into());
        assert_eq!(kept, raw[..EXCEPTION_RAW_PREFIX_BYTES]);
        assert!(detail.starts_with("not a SOAP envelope"), "{detail}");
        assert!(detail.contains("of 1048576 bytes"), "{detail}");
        assert!(
            detail.contains(&format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&raw))),
            "{detail}"
        );
        let small = b"<Msg/>".to_vec();
        assert_eq!(
            bounded_raw(small.clone(), "short".into()),
            (small, "short".to_owned())
        );
    }
}
