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

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use time::OffsetDateTime;

use crate::cpu::CpuLedger;
use crate::matcher::{Matcher, MatcherMemory, ShardCounts};
use crate::profile::Tolerances;
use crate::queue::local::{self, LocalReceiver};
use crate::queue::{Rx, Tx};
use crate::refdata::RefData;
use crate::station::{RunClock, Station};
use crate::stations::exceptions::run_exception_writer;
use crate::stations::matcher::{run_matcher, Recall, RecallFrom};
use crate::stations::sampler::{run_sampler, SampleFiles};
use crate::stations::validator::{run_validator, Routes};
use crate::stations::writer::{run_writer, WriterContext};
use crate::stations::{RejectedItem, ToStore, Validated, WriterReport};
use crate::store::{MemoryStore, PgStore, RetiredRuns, RowCounts, SqliteStore, Store, StoreError};

pub use crate::network::{
    inbound_index, sign_line, Ack, AckResult, Aging, Delivery, Envelope, OutboundEvent,
    PipelineError, RetryPolicy, Submitter, EXCEPTION_RAW_PREFIX_BYTES, INBOUND_BATCH_MESSAGES,
};
pub(crate) use crate::network::{join, spawn_counted, Joined};
pub use crate::stations::sampler::{station_time_path, SAMPLES_HEADER, STATION_TIME_HEADER};
pub use crate::stations::BatchBound;

/// Default of [`PipelineConfig::unchecked_exception_days`].
pub const UNCHECKED_EXCEPTION_DAYS_DEFAULT: u32 = 30;

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
    /// Capacity of every inbound, match and store queue, in messages. The match queues are
    /// bounded in bytes as well ([`Self::shard_backlog_bytes`]), and so are the store queues and
    /// the exception queue, at two transactions' bytes ([`BatchBound::queue_bytes`]).
    pub queue_capacity_messages: usize,
    /// Capacity of the ack and outbound queues.
    pub outbound_capacity: usize,
    /// Most messages, and most bytes of them, committed in one transaction.
    pub batch_max: BatchBound,
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
    /// What a matcher on a durable store keeps in memory ([`Matcher::bounded`]): it reads back
    /// what it retired from the shard's tables (PostgreSQL) or from files of retired facts
    /// beside the shard's (embedded, [`RetiredRuns`]). The memory store's matchers remember
    /// everything exactly, as the store keeps every row in memory.
    pub matcher_memory: MatcherMemory,
}

/// Default of [`PipelineConfig::shard_backlog_bytes`]: memory, about a second of one shard's
/// share of a saturating load on this kind of machine (a larger one holds more without
/// committing more: a saturated store is the bottleneck either way, BENCHMARKS.md).
pub const SHARD_BACKLOG_BYTES_DEFAULT: usize = 64 * 1024 * 1024;

/// The default bound of a shard's backlog in a cluster: its inbound queue on the NATS servers'
/// disks ([`crate::cluster::ClusterLayout`]).
pub const CLUSTER_SHARD_BACKLOG_BYTES_DEFAULT: usize = 256 * 1024 * 1024;

impl Default for PipelineConfig {
    fn default() -> Self {
        Self {
            shards: 2,
            validators: 2,
            queue_capacity_messages: 8192,
            outbound_capacity: 1024,
            batch_max: BatchBound::DEFAULT,
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

/// Batches a match queue may hold, whatever their bytes: its bound in bytes
/// ([`PipelineConfig::shard_backlog_bytes`]) is the one that counts; this one only sizes the
/// channel (a slot is a few words).
const MATCH_QUEUE_BATCHES_MAX: usize = 65_536;

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
    /// Whether the sampler ran at real-time priority (`None`: no sampler).
    pub sampler_on_time: Option<bool>,
    /// CPU seconds of the station threads over their lives, by role (`validator`, `matcher`,
    /// `writer`, `exception-writer`, `sampler`): a shard's restore included.
    pub station_cpu_s: BTreeMap<String, f64>,
}

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
    sampler: Option<(Arc<AtomicBool>, Joined<bool>)>,
    delivery: Delivery,
    /// CPU seconds of the station threads, by role, added as each one ends.
    cpu: Arc<CpuLedger>,
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
        type Rebuilt = (
            Matcher,
            Option<RetiredRuns>,
            Vec<crate::store::UndeliveredCls>,
        );
        let rebuilt: Vec<Result<Rebuilt, PipelineError>> = std::thread::scope(|scope| {
            let handles: Vec<_> = stores
                .iter_mut()
                .enumerate()
                .map(|(shard, store)| {
                    let refdata = &refdata;
                    let tolerances = &tolerances;
                    let retired = retired_dir(&config.store, shard);
                    scope.spawn(move || {
                        let (matcher, runs) = restore_matcher(
                            store.as_mut(),
                            shard,
                            refdata,
                            tolerances,
                            config.matcher_memory,
                            retired.as_deref(),
                        )?;
                        Ok((matcher, runs, store.undelivered_cls()?))
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
        let mut retired_runs = Vec::with_capacity(shards as usize);
        let mut undelivered = Vec::with_capacity(shards as usize);
        for result in rebuilt {
            let (matcher, runs, unconfirmed) = result?;
            restored_matchers.push(matcher);
            retired_runs.push(runs);
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
        let delivery = Delivery::local(shards);
        let batch_max = config.batch_max;

        // Writers and their store queues.
        let mut store_txs = Vec::new();
        let mut store_stations = Vec::new();
        let cpu = Arc::new(CpuLedger::default());
        let mut writers = Vec::new();
        let mut recalls = Vec::new();
        for (((shard, store), redeliver), runs) in stores
            .into_iter()
            .enumerate()
            .zip(undelivered)
            .zip(retired_runs)
        {
            let committed = Arc::new(AtomicU64::new(0));
            let from = match runs {
                Some(runs) => Some(RecallFrom::Runs(runs)),
                None if restored_matchers[shard].is_bounded() => {
                    Some(RecallFrom::Store(open_store(&config.store, Some(shard))?))
                }
                None => None,
            };
            recalls.push(from.map(|from| Recall {
                from,
                committed: committed.clone(),
                retry,
            }));
            let (tx, rx) = local::bounded_bytes::<ToStore>(
                format!("store.{shard}"),
                capacity,
                batch_max.queue_bytes(),
                ToStore::weight_bytes,
                clock,
            );
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
            writers.push(spawn_counted(&cpu, format!("writer-{shard}"), move || {
                run_writer(Box::new(rx), store, context, redeliver)
            }));
        }

        let (exception_tx, exception_rx) = local::bounded_bytes::<RejectedItem>(
            "exceptions",
            capacity,
            batch_max.queue_bytes(),
            RejectedItem::weight_bytes,
            clock,
        );
        let exception_station = exception_tx.station().clone();
        let unchecked_exception_days = config.unchecked_exception_days;
        let exception_writer = {
            let acks: Tx<Ack> = Box::new(ack_tx.clone());
            spawn_counted(&cpu, "exception-writer".to_owned(), move || {
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
            matchers.push(spawn_counted(&cpu, format!("matcher-{shard}"), move || {
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
            validator_handles.push(spawn_counted(
                &cpu,
                format!("validator-{index}"),
                move || run_validator(Box::new(rx), &refdata, &routes, &exception_tx),
            ));
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
                let files = SampleFiles::create(path).map_err(PipelineError::Samples)?;
                let stop = Arc::new(AtomicBool::new(false));
                let flag = stop.clone();
                let sampled = stations.clone();
                let interval = config.sample_interval;
                let handle = spawn_counted(&cpu, "sampler".to_owned(), move || {
                    run_sampler(files, &sampled, &flag, interval, clock)
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
            cpu,
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
        let mut sampler_on_time = None;
        if let Some((stop, handle)) = self.sampler.take() {
            stop.store(true, Ordering::Relaxed);
            match join(handle) {
                Ok(on_time) => sampler_on_time = Some(on_time),
                Err(error) => keep(Err(error)),
            }
        }
        match first_error {
            Some(error) => Err(error),
            None => Ok(PipelineReport {
                shards,
                shard_rows,
                shard_commit_retries,
                exception_rows,
                sampler_on_time,
                station_cpu_s: self.cpu.by_role(),
            }),
        }
    }
}

/// How often rebuilding a matcher reports its progress.
const RESTORE_PROGRESS_EVERY_MESSAGES: u64 = 500_000;

/// Where the embedded store keeps a shard's retired facts: beside its file.
fn retired_dir(config: &StoreConfig, shard: usize) -> Option<PathBuf> {
    match config {
        StoreConfig::Embedded { dir } => Some(dir.join(format!("shard-{shard}.retired"))),
        StoreConfig::Memory | StoreConfig::Postgres { .. } => None,
    }
}

/// Rebuilds a shard's matcher by taking back, in order, every message the shard accepted.
///
/// On a store that can answer recalls ([`Store::can_recall`]) the matcher is bounded by
/// `memory`: the closed trades, every message key and every remembered rejection go into its
/// filter, and only the open trades' messages are taken back. Otherwise every accepted message
/// and then every remembered rejection is taken back in order ([`take_back_all`]): given
/// `retired` (the embedded store), into a matcher bounded by `memory` whose retired facts go to
/// files there ([`RetiredRuns`], started empty); without it, into one that remembers everything
/// exactly.
pub(crate) fn restore_matcher(
    store: &mut dyn Store,
    shard: usize,
    refdata: &Arc<RefData>,
    tolerances: &Tolerances,
    memory: MatcherMemory,
    retired: Option<&std::path::Path>,
) -> Result<(Matcher, Option<RetiredRuns>), PipelineError> {
    let mut progress = TakeBack::new(shard);
    if !store.can_recall() {
        let (matcher, runs) = match retired {
            Some(dir) => (
                Matcher::bounded(refdata.clone(), tolerances.clone(), memory),
                Some(RetiredRuns::create(dir)?),
            ),
            None => (
                Matcher::new(refdata.clone(), tolerances.clone())
                    .with_quota(memory.participant_held_bytes),
                None,
            ),
        };
        return take_back_all(store, matcher, runs, progress);
    }
    let mut matcher = Matcher::bounded(refdata.clone(), tolerances.clone(), memory);
    let accepted = store.for_each_retired(&mut |fact| {
        matcher.retired(fact);
    })?;
    let restored = store.for_each_accepted_of_open_trades(&mut |stored| {
        progress.take_back(&mut matcher, &stored, |_, _| {});
    })?;
    progress.check(restored)?;
    matcher.set_accepted(accepted);
    progress.report(accepted, None);
    Ok((matcher, None))
}

/// Taking a shard's messages back into its matcher: the count, the messages that would not be
/// accepted now, and the day a message without one counts as received on.
struct TakeBack {
    shard: usize,
    started: Instant,
    restart_day: time::Date,
    taken_back: u64,
    disagreements: u64,
}

impl TakeBack {
    fn new(shard: usize) -> Self {
        Self {
            shard,
            started: Instant::now(),
            restart_day: OffsetDateTime::now_utc().date(),
            taken_back: 0,
            disagreements: 0,
        }
    }

    /// Takes `stored` back into `matcher`, handing it the message first to `before` (which may
    /// read back what it needs).
    fn take_back(
        &mut self,
        matcher: &mut Matcher,
        stored: &crate::store::StoredMessage,
        before: impl FnOnce(&mut Matcher, &crate::model::Msg),
    ) {
        self.taken_back += 1;
        if self
            .taken_back
            .is_multiple_of(RESTORE_PROGRESS_EVERY_MESSAGES)
        {
            tracing::info!(
                shard = self.shard,
                messages = self.taken_back,
                "rebuilding the matcher"
            );
        }
        // A stored message passed validation when it was accepted; only its fields are needed.
        let typed = crate::codec::parse_fields(&stored.raw)
            .and_then(|fields| crate::validate::typed_fields(&fields));
        let restored = match typed {
            Ok(msg) => {
                before(matcher, &msg);
                matcher.restore(
                    Box::new(msg),
                    &stored.raw,
                    stored.injected_ns,
                    stored.trade_date,
                    // A row written before days were kept counts from the restart.
                    stored.received_on.unwrap_or(self.restart_day),
                )
            }
            Err(_) => false,
        };
        if !restored {
            self.disagreements += 1;
        }
    }

    /// Whether every one of the `stored` messages was taken back.
    fn check(&self, stored: u64) -> Result<(), PipelineError> {
        if self.disagreements > 0 {
            return Err(PipelineError::Config(format!(
                "shard {}: {} of {stored} stored messages could not be taken back",
                self.shard, self.disagreements
            )));
        }
        Ok(())
    }

    fn report(&self, accepted: u64, runs: Option<&RetiredRuns>) {
        if accepted == 0 {
            return;
        }
        let stats = runs.map(RetiredRuns::stats).unwrap_or_default();
        tracing::info!(
            shard = self.shard,
            messages = accepted,
            taken_back = self.taken_back,
            retired = stats.records,
            runs = stats.runs,
            seconds = self.started.elapsed().as_secs_f64(),
            "matcher rebuilt from its shard"
        );
    }
}

/// Takes every accepted message of a shard back into `matcher`, then every remembered
/// rejection (so that a MsgId that was accepted keeps that verdict), in order. A bounded
/// matcher's retired facts go to `runs`: before each message or rejection what it needs is
/// looked up there, as in service, and after it the generation it completed is retired into
/// them — everything read back is committed, so a generation retires as soon as the next one
/// is full.
fn take_back_all(
    store: &mut dyn Store,
    mut matcher: Matcher,
    mut runs: Option<RetiredRuns>,
    mut progress: TakeBack,
) -> Result<(Matcher, Option<RetiredRuns>), PipelineError> {
    let (mut keys, mut found, mut retired) = (Vec::new(), Vec::new(), Vec::new());
    // The visitors cannot fail: the first error is kept, and what follows it skipped.
    let mut failed: Option<StoreError> = None;
    let mut recall = |matcher: &mut Matcher,
                      keys: &mut Vec<_>,
                      runs: &mut Option<RetiredRuns>,
                      failed: &mut Option<StoreError>| {
        // Only a bounded matcher asks for keys, and only it has runs.
        if let (false, Some(runs)) = (keys.is_empty(), runs.as_mut()) {
            if let Err(error) = runs.lookup(keys, &mut found) {
                failed.get_or_insert(error);
            }
            keys.clear();
            matcher.recall_entries(found.drain(..));
        }
    };
    let mut retire = |matcher: &mut Matcher,
                      (sent, committed): (u64, u64),
                      runs: &mut Option<RetiredRuns>,
                      failed: &mut Option<StoreError>| {
        if let Some(runs) = runs.as_mut() {
            if matcher.after_batch_into(sent, committed, Some(&mut retired)) {
                if let Err(error) = runs.add(&mut retired) {
                    failed.get_or_insert(error);
                }
            }
        }
    };
    let accepted = store.for_each_accepted(&mut |stored| {
        if failed.is_some() {
            return;
        }
        progress.take_back(&mut matcher, &stored, |matcher, msg| {
            matcher.to_recall_keys(&msg.sender, &msg.msg_id, Some(&msg.trade_key()), &mut keys);
            recall(matcher, &mut keys, &mut runs, &mut failed);
        });
        let count = progress.taken_back;
        retire(&mut matcher, (count, count), &mut runs, &mut failed);
    })?;
    progress.check(accepted)?;
    let mut count = accepted;
    store.for_each_remembered_rejection(&mut |rejection| {
        if failed.is_some() {
            return;
        }
        count += 1;
        matcher.to_recall_keys(&rejection.sender, &rejection.msg_id, None, &mut keys);
        recall(&mut matcher, &mut keys, &mut runs, &mut failed);
        matcher.restore_rejection(
            &rejection.sender,
            &rejection.msg_id,
            &rejection.raw,
            rejection.code,
        );
        retire(&mut matcher, (count, count), &mut runs, &mut failed);
    })?;
    // Everything taken back is committed: the older generation retires now, and one that
    // becomes older now retires after the first batch in service (sent 0), rather than once the
    // writer has committed as many items again.
    retire(&mut matcher, (0, u64::MAX), &mut runs, &mut failed);
    if let Some(error) = failed {
        return Err(error.into());
    }
    progress.report(accepted, runs.as_ref());
    Ok((matcher, runs))
}
