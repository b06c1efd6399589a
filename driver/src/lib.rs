//! The driver: injects a generated or replayed message set into an in-process pipeline, tallies
//! every ACK and NAK, times CLS emission through the sink, and summarises the run with the
//! operational metrics of every station.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, IsTerminal, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde::Serialize;
use ste_engine::generator::{Generator, GeneratorConfig, RunOutcome};
use ste_engine::network::signed_line;
use ste_engine::options::Settings;
use ste_engine::pipeline::{Ack, AckResult, Pipeline, PipelineConfig, Submitter};
use ste_engine::queue::Rx;
use ste_engine::refdata::RefData;
use ste_engine::sign::SIGNATURE_LEN;
use ste_engine::station::RunClock;
use ste_engine::validate::MESSAGE_SIZE_MAX_BYTES;
use ste_sink::Sink;

pub mod cluster;
pub mod nemesis;
pub mod probe;
pub mod proxy;
pub mod remote;
pub mod scale;
pub mod secrets;
pub mod volume;

/// The first line of a message-set file.
pub const MESSAGE_SET_OPEN: &str = "<MessageSet xmlns=\"urn:ste:trade:1\">";
/// The last line of a message-set file.
pub const MESSAGE_SET_CLOSE: &str = "</MessageSet>";
/// Longest line read from a message-set file; a longer one is cut here (and rejected with
/// E_SIZE), so a hostile file cannot make the driver hold an unbounded line.
const LINE_READ_MAX_BYTES: usize = MESSAGE_SIZE_MAX_BYTES + 1;
/// Buffer a replay reads its message set and signatures through: a read call for every 8 KiB
/// (the default) was one for every 14 messages.
const SET_READ_BUFFER_BYTES: usize = 256 * 1024;

pub use ste_engine::options::StoreKind;

/// Where the messages come from.
#[derive(Debug, Clone)]
pub enum Source {
    Generated(GeneratorConfig),
    File(PathBuf),
}

impl Source {
    /// How many messages a generated set holds; a file's count is not known before it is read.
    fn generated_messages(&self) -> Option<u64> {
        match self {
            Source::Generated(generator) => {
                Some(generator.trades * ste_engine::generator::MESSAGES_PER_TRADE as u64)
            }
            Source::File(_) => None,
        }
    }
}

/// Everything a run needs.
#[derive(Debug, Clone)]
pub struct RunConfig {
    pub source: Source,
    /// The pipeline's options as the engine takes them too: store, shards, validators,
    /// backlog, retention, aging, matcher memory, sampling, profile, transaction bound.
    pub settings: Settings,
    /// How long a writer waits to fill a batch before committing it.
    pub batch_linger: Duration,
    pub queue_capacity_messages: usize,
    /// Open-loop injection rate; `None` injects as fast as backpressure allows.
    pub rate_msgs_per_s: Option<f64>,
    /// Closed loop: at most this many messages injected and not yet acknowledged.
    pub window: Option<u64>,
    pub cls_out: Option<PathBuf>,
    pub run_dir: PathBuf,
    pub progress: bool,
    /// Continue on shards that already hold messages, rebuilding the matchers from them.
    pub resume: bool,
    /// For an `--input` set: the signatures its lines were signed with beforehand
    /// ([`signatures_beside`]), sent as they are instead of signing each line as it is sent.
    pub signatures: Option<PathBuf>,
    /// For an `--input` set: the outcome it must produce ([`expected_beside`]), checked as a
    /// generated run's is; `None`: the replay reports its outcome without a check.
    pub expected: Option<RunOutcome>,
    /// How long the limit probe runs after the run, on the run's first messages
    /// ([`probe`]); `None`: no probe.
    pub limit_probe: Option<Duration>,
}

/// Latency percentiles in milliseconds.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct LatencySummary {
    pub p50: f64,
    pub p99: f64,
    pub p999: f64,
    pub max: f64,
    pub mean: f64,
}

/// One station's operational metrics, in the summary's units.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
#[allow(non_snake_case)]
pub struct StationSummary {
    pub name: String,
    pub A: u64,
    pub C: u64,
    pub B_s: f64,
    pub T_s: f64,
    pub X: f64,
    pub U: f64,
    pub S_ms: f64,
    pub N: f64,
    pub R_ms: f64,
    /// R measured directly from per-message timestamps.
    pub R_direct_ms: f64,
}

/// One shard's share of the run.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct ShardSummary {
    /// Distinct trades with an accepted message on this shard.
    pub trades: u64,
    /// Accepted messages on this shard.
    pub messages: u64,
    /// Rows the shard's store holds at the end.
    pub stored_messages: u64,
    pub stored_cls: u64,
    pub stored_exceptions: u64,
    /// Commits retried after a transient store failure.
    pub commit_retries: u64,
}

/// The summary of a run; `--json` prints it as one object.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct Summary {
    /// trades, messages_in, accepted, duplicates, exceptions, cls and final trade states.
    #[serde(flatten)]
    pub outcome: RunOutcome,
    pub cls_repeats: u64,
    /// CLS emitted again after a restart because their delivery had not been confirmed.
    pub cls_redelivered: u64,
    pub mismatched_advices: u64,
    /// The injection: open-loop rate (msg/s) or closed-loop window (messages in flight), if set.
    pub rate_msgs_per_s: Option<f64>,
    pub window: Option<u64>,
    pub elapsed_s: f64,
    pub throughput_msg_s: f64,
    /// Messages stored per second over the first and the last 10% of the run (from the
    /// samples of the store stations): how much the run slowed down as it went on.
    pub throughput_first_10pct_msg_s: Option<f64>,
    pub throughput_last_10pct_msg_s: Option<f64>,
    pub latency_ms: LatencySummary,
    pub stations: Vec<StationSummary>,
    /// In process: whether the sampler ran at real-time priority, which its populations need
    /// when the cores are busy (`None`: not sampled, or a cluster's nodes sampled).
    #[serde(default)]
    pub sampler_on_time: Option<bool>,
    pub bottleneck: Option<String>,
    pub shards: Vec<ShardSummary>,
    /// Rows of the store of messages rejected by validation.
    pub stored_validation_exceptions: u64,
    pub store: String,
    pub validators: u32,
    pub peak_rss_mb: f64,
    /// In process, for a generated set: the resident set (VmRSS, MiB) when 10%, 50% and 90% of
    /// the messages had been answered, and once the pipeline had stopped. Memory that stays
    /// flat after warm-up reads about the same at the first three.
    #[serde(default)]
    pub rss_mb_at_answered: Vec<RssMark>,
    /// messages_in = accepted + duplicates + exceptions.
    pub conserved: bool,
    /// What the generator expected, for a generated set.
    pub expected: Option<RunOutcome>,
    /// Whether the outcome equals the expectation, code by code.
    pub matches_expected: Option<bool>,
    /// Cluster runs: trades stored on a shard other than the one the routing rule names, read
    /// from every shard's database at the end (0 when every shard holds only its own).
    pub misrouted_trades: Option<u64>,
    /// Cluster runs: the CPU this machine spent from the first injection to the last answer,
    /// by program (every process on the machine's kernel that the driver can see).
    #[serde(default)]
    pub cpu: Option<scale::CpuUse>,
    /// In process: the CPU seconds this process (driver and engine) spent from the start of
    /// the pipeline to its end, every thread.
    #[serde(default)]
    pub process_cpu_s: Option<f64>,
    /// In process: the CPU seconds of the engine's station threads by role (`validator`,
    /// `matcher`, `writer`, ...), each over its thread's life, as each thread read it when it
    /// ended.
    #[serde(default)]
    pub station_cpu_s: std::collections::BTreeMap<String, f64>,
    /// In process: the CPU seconds of the process's other threads by name, read every 100 ms
    /// from `/proc` ([`ste_engine::cpu::ThreadWatch`]): `driver` (loading or generating,
    /// signing and injecting), `sink`, `acks`, and those a library starts (`sqlx-sqlite-wor`,
    /// SQLite's workers, where the embedded store's statements run).
    #[serde(default)]
    pub thread_cpu_s: std::collections::BTreeMap<String, f64>,
    /// The limit probe measured after the run, on the same messages ([`probe`]).
    #[serde(default)]
    pub limit_probe: Option<probe::LimitProbe>,
    pub run_dir: String,
}

impl Summary {
    /// Total rejected messages.
    pub fn exceptions_total(&self) -> u64 {
        self.outcome.exceptions.values().sum()
    }
}

/// Peak resident set size of this process in MiB (VmHWM), where the system reports it.
pub fn peak_rss_mb() -> f64 {
    ste_engine::cluster_samples::proc_status_kib("self", "VmHWM")
        .map_or(0.0, |kib| kib as f64 / 1024.0)
}

/// The resident set of this process in KiB (VmRSS), where the system reports it.
fn rss_kib() -> Option<u64> {
    ste_engine::cluster_samples::proc_status_kib("self", "VmRSS")
}

/// The resident set when a share of a run's messages had been answered.
#[derive(Debug, Clone, Copy, serde::Serialize, serde::Deserialize)]
pub struct RssMark {
    /// Percent of the run's messages answered; 100 is the end of the run, read once the
    /// pipeline has stopped and its stores have closed.
    pub answered_pct: u8,
    pub rss_mb: f64,
}

/// Shares of a run's messages at which [`RssMarks`] reads the resident set, in percent.
const RSS_MARK_PCTS: [u8; 3] = [10, 50, 90];

/// Reads the resident set as a run's answers pass [`RSS_MARK_PCTS`] of its messages, from a
/// thread of its own that looks every [`RSS_MARK_INTERVAL`].
struct RssMarks {
    /// KiB at each mark; 0 until it is passed.
    read: Arc<[AtomicU64; RSS_MARK_PCTS.len()]>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

const RSS_MARK_INTERVAL: Duration = Duration::from_millis(50);

impl RssMarks {
    /// Starts the reading for a run of `total` messages (none when the total is not known).
    fn start(tally: &Arc<Tally>, total: Option<u64>) -> Self {
        let read: Arc<[AtomicU64; RSS_MARK_PCTS.len()]> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let thread = total.filter(|total| *total > 0).map(|total| {
            let (tally, read, stop) = (tally.clone(), read.clone(), stop.clone());
            std::thread::Builder::new()
                .name("rss-marks".into())
                .spawn(move || {
                    let mut next = 0;
                    loop {
                        // A last look once the run has ended, for marks passed since the one
                        // before.
                        let stopping = stop.load(Ordering::Relaxed);
                        let answered = tally.acked.load(Ordering::Relaxed);
                        while next < RSS_MARK_PCTS.len()
                            && answered * 100 >= total * u64::from(RSS_MARK_PCTS[next])
                        {
                            read[next].store(rss_kib().unwrap_or(0), Ordering::Relaxed);
                            next += 1;
                        }
                        if stopping || next == RSS_MARK_PCTS.len() {
                            break;
                        }
                        std::thread::sleep(RSS_MARK_INTERVAL);
                    }
                })
                .expect("a thread for the RSS marks")
        });
        Self { read, stop, thread }
    }

    /// Stops the thread; whether there was one.
    fn stop(&mut self) -> bool {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.take().map(|thread| thread.join()).is_some()
    }

    /// The marks passed, and the resident set now as the end's.
    fn finish(mut self) -> Vec<RssMark> {
        if !self.stop() {
            return Vec::new();
        }
        let mib = |kib: u64| kib as f64 / 1024.0;
        let mut marks: Vec<RssMark> = RSS_MARK_PCTS
            .iter()
            .zip(self.read.iter())
            .map(|(pct, kib)| (*pct, kib.load(Ordering::Relaxed)))
            .filter(|(_, kib)| *kib > 0)
            .map(|(answered_pct, kib)| RssMark {
                answered_pct,
                rss_mb: mib(kib),
            })
            .collect();
        if let Some(kib) = rss_kib() {
            marks.push(RssMark {
                answered_pct: 100,
                rss_mb: mib(kib),
            });
        }
        marks
    }
}

impl Drop for RssMarks {
    /// A run that fails half way, whose answers never reach the marks, stops the reading too.
    fn drop(&mut self) {
        self.stop();
    }
}

#[derive(Default)]
struct Tally {
    /// Messages answered (each counted once).
    acked: AtomicU64,
    /// Across nodes, by correlation (the order of injection): whether a message was answered.
    answered: std::sync::Mutex<Vec<bool>>,
    /// When the last ACK or NAK arrived, on the run clock.
    last_ack_ns: AtomicU64,
    accepted: AtomicU64,
    duplicates: AtomicU64,
}

/// Reads one line of at most `max` bytes (without its newline); the rest of a longer line is
/// skipped. Returns `None` at end of file.
fn read_bounded_line(reader: &mut impl BufRead, max: usize) -> std::io::Result<Option<Vec<u8>>> {
    let mut line = Vec::new();
    let mut read_any = false;
    loop {
        let available = reader.fill_buf()?;
        if available.is_empty() {
            return Ok(read_any.then_some(line));
        }
        read_any = true;
        let (chunk, found_newline) = match memchr::memchr(b'\n', available) {
            Some(position) => (&available[..position], Some(position)),
            None => (available, None),
        };
        let room = max.saturating_sub(line.len());
        line.extend_from_slice(&chunk[..chunk.len().min(room)]);
        match found_newline {
            Some(position) => {
                reader.consume(position + 1);
                return Ok(Some(line));
            }
            None => {
                let consumed = available.len();
                reader.consume(consumed);
            }
        }
    }
}

/// Streams the message lines of a message-set file (everything between the opening and closing
/// `MessageSet` lines).
pub struct MessageSetReader<R: BufRead> {
    reader: R,
    started: bool,
    done: bool,
}

impl<R: BufRead> MessageSetReader<R> {
    /// Wraps a reader positioned at the start of a message-set file.
    pub fn new(reader: R) -> Self {
        Self {
            reader,
            started: false,
            done: false,
        }
    }
}

impl MessageSetReader<BufReader<File>> {
    /// Opens a message-set file, read [`SET_READ_BUFFER_BYTES`] at a time.
    pub fn open(path: &Path) -> anyhow::Result<Self> {
        let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
        Ok(Self::new(BufReader::with_capacity(
            SET_READ_BUFFER_BYTES,
            file,
        )))
    }
}

impl<R: BufRead> Iterator for MessageSetReader<R> {
    type Item = std::io::Result<Vec<u8>>;

    fn next(&mut self) -> Option<Self::Item> {
        while !self.done {
            let line = match read_bounded_line(&mut self.reader, LINE_READ_MAX_BYTES) {
                Ok(Some(line)) => line,
                Ok(None) => return None,
                Err(error) => return Some(Err(error)),
            };
            // Compared as bytes: the lines are the validator's to read, and decoding each one
            // here to find the set's two framing lines cost a twentieth of a replay.
            let trimmed = line.trim_ascii();
            if !self.started {
                if trimmed.starts_with(b"<MessageSet") {
                    self.started = true;
                }
                continue;
            }
            if trimmed == MESSAGE_SET_CLOSE.as_bytes() {
                self.done = true;
                return None;
            }
            return Some(Ok(line));
        }
        None
    }
}

/// Bytes of one record of a signatures file: 1 if the line is signed (0 if it is sent
/// unsigned), then its HMAC-SHA256.
pub const SIGNATURE_RECORD_BYTES: usize = 1 + SIGNATURE_LEN;

/// Where `driver generate --out FILE` puts the signatures of FILE's lines, made with the keys
/// beside it: a replay with those keys sends them as they are ([`RunConfig::signatures`]).
pub fn signatures_beside(set: &Path) -> PathBuf {
    PathBuf::from(format!("{}.signatures", set.display()))
}

/// Where `driver generate --out FILE` puts the outcome FILE must produce on empty shards, as
/// JSON: a replay with the keys beside the set checks its outcome against it
/// ([`RunConfig::expected`]).
pub fn expected_beside(set: &Path) -> PathBuf {
    PathBuf::from(format!("{}.expected.json", set.display()))
}

/// Reads an outcome written by `driver generate` ([`expected_beside`]).
pub fn read_expected(path: &Path) -> anyhow::Result<RunOutcome> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| {
        format!(
            "{} is not an outcome written by driver generate",
            path.display()
        )
    })
}

/// Writes a generated message set and returns what it must produce. With `signatures`, each
/// line is also signed as a participant would sign it, with the keys `refdata` holds, and the
/// signatures are written there ([`SIGNATURE_RECORD_BYTES`] a line, in order).
pub fn write_message_set(
    refdata: &RefData,
    config: GeneratorConfig,
    out: &Path,
    signatures: Option<&Path>,
) -> anyhow::Result<RunOutcome> {
    let file = File::create(out).with_context(|| format!("creating {}", out.display()))?;
    let mut writer = BufWriter::new(file);
    let mut signed = match signatures {
        Some(path) => Some(BufWriter::new(
            File::create(path).with_context(|| format!("creating {}", path.display()))?,
        )),
        None => None,
    };
    writeln!(writer, "{MESSAGE_SET_OPEN}")?;
    let mut generator = Generator::new(refdata, config);
    for line in generator.by_ref() {
        writer.write_all(&line)?;
        writer.write_all(b"\n")?;
        if let Some(signed) = &mut signed {
            let envelope = ste_engine::network::sign_line(refdata, line, 0, 0);
            let mut record = [0_u8; SIGNATURE_RECORD_BYTES];
            if let Some(signature) = envelope.signature {
                record[0] = 1;
                record[1..].copy_from_slice(&signature);
            }
            signed.write_all(&record)?;
        }
    }
    writeln!(writer, "{MESSAGE_SET_CLOSE}")?;
    writer.flush()?;
    if let Some(signed) = &mut signed {
        signed.flush()?;
    }
    Ok(generator.expected().clone())
}

/// Shows progress on stderr: a bar on a terminal, a status line every few seconds otherwise.
fn spawn_progress(
    tally: Arc<Tally>,
    submitted: Arc<AtomicU64>,
    total_estimate: u64,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let started = Instant::now();
        if std::io::stderr().is_terminal() {
            let bar = indicatif::ProgressBar::new(total_estimate);
            bar.set_style(
                indicatif::ProgressStyle::with_template(
                    "{spinner} [{elapsed_precise}] {wide_bar} {pos}/{len} msgs acked, {msg}",
                )
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
            while !stop.load(Ordering::Relaxed) {
                let acked = tally.acked.load(Ordering::Relaxed);
                if acked > bar.length().unwrap_or(0) {
                    bar.set_length(acked);
                }
                bar.set_position(acked);
                bar.set_message(format!(
                    "{:.0} msg/s, {} in flight",
                    acked as f64 / started.elapsed().as_secs_f64().max(1e-9),
                    submitted.load(Ordering::Relaxed).saturating_sub(acked)
                ));
                std::thread::sleep(Duration::from_millis(100));
            }
            bar.finish_and_clear();
        } else {
            let mut last_report = Instant::now();
            while !stop.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(100));
                if last_report.elapsed() >= Duration::from_secs(5) {
                    last_report = Instant::now();
                    let acked = tally.acked.load(Ordering::Relaxed);
                    eprintln!(
                        "[{:>6.1}s] {acked} messages acknowledged of ~{total_estimate} ({:.0} msg/s)",
                        started.elapsed().as_secs_f64(),
                        acked as f64 / started.elapsed().as_secs_f64().max(1e-9)
                    );
                }
            }
        }
    })
}

/// The progress display of a run, and the count of messages sent that it shows.
struct Progress {
    submitted: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Progress {
    /// Starts the display when `enabled`; the total is known for a generated set.
    fn start(tally: &Arc<Tally>, source: &Source, enabled: bool) -> Progress {
        let submitted = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let total_estimate = source.generated_messages().unwrap_or(0);
        let thread = enabled.then(|| {
            spawn_progress(
                tally.clone(),
                submitted.clone(),
                total_estimate,
                stop.clone(),
            )
        });
        Progress {
            submitted,
            stop,
            thread,
        }
    }

    /// Stops the display.
    fn finish(self) {
        drop(self);
    }
}

impl Drop for Progress {
    /// A run that fails half way stops its display too.
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// How far ahead of its open-loop schedule the injector gets before it sleeps.
const RATE_SLACK: Duration = Duration::from_millis(1);

/// How messages are paced into the pipeline.
struct Pacing<'a> {
    /// Open loop: messages per second.
    rate: Option<f64>,
    /// Closed loop: at most this many messages in flight, counted against `acked`.
    window: Option<u64>,
    acked: &'a AtomicU64,
}

/// A line to send.
enum Line {
    /// Signed here, as it is sent, with its claimed sender's key.
    ToSign(Vec<u8>),
    /// Signed beforehand (`None`: sent unsigned).
    Signed(Vec<u8>, Option<[u8; SIGNATURE_LEN]>),
}

/// The lines of a pre-signed set, each with its record of `signatures`; an error where the
/// signatures end before the lines.
fn presigned_lines(
    lines: impl Iterator<Item = std::io::Result<Vec<u8>>>,
    signatures: impl std::io::Read,
) -> impl Iterator<Item = std::io::Result<Line>> {
    let mut signatures = BufReader::with_capacity(SET_READ_BUFFER_BYTES, signatures);
    lines.map(move |line| {
        let line = line?;
        let mut record = [0_u8; SIGNATURE_RECORD_BYTES];
        signatures.read_exact(&mut record).map_err(|error| {
            std::io::Error::new(
                error.kind(),
                format!("the signatures end before the messages: {error}"),
            )
        })?;
        let mut signature = [0_u8; SIGNATURE_LEN];
        signature.copy_from_slice(&record[1..]);
        Ok(Line::Signed(line, (record[0] == 1).then_some(signature)))
    })
}

fn inject(
    submitter: &mut Submitter,
    refdata: &RefData,
    lines: impl Iterator<Item = std::io::Result<Line>>,
    pacing: &Pacing<'_>,
    submitted: &AtomicU64,
) -> anyhow::Result<u64> {
    let started = Instant::now();
    let mut count: u64 = 0;
    for line in lines {
        let line = line.context("reading the message set")?;
        if let Some(rate) = pacing.rate {
            let due = Duration::from_secs_f64(count as f64 / rate);
            let elapsed = started.elapsed();
            // The schedule is absolute, so a late wake-up is made up by the messages after it;
            // sleeping only when a millisecond or more ahead saves a wake-up per message.
            if due > elapsed + RATE_SLACK {
                // Ahead of schedule: what is batched goes now rather than after the pause.
                submitter.flush().context("submitting to the pipeline")?;
                std::thread::sleep(due - elapsed);
            }
        }
        if let Some(window) = pacing.window {
            if count.saturating_sub(pacing.acked.load(Ordering::Relaxed)) >= window {
                // The window is full. A window of at least two whole batches on every partition
                // is full of sent messages as well, whose answers free it: the partial batches
                // wait to be filled, so that batches stay whole in a closed loop too (sent at
                // every full window, they went out a few messages each, as the answers came
                // back). Once nothing sent is left unanswered, what is batched must go, or its
                // answers never come.
                let batches_wait = window >= 2 * submitter.whole_batches() as u64;
                let all_answered = |submitter: &Submitter| {
                    count.saturating_sub(submitter.pending() as u64)
                        <= pacing.acked.load(Ordering::Relaxed)
                };
                if !batches_wait || all_answered(submitter) {
                    submitter.flush().context("submitting to the pipeline")?;
                }
                while count.saturating_sub(pacing.acked.load(Ordering::Relaxed)) >= window {
                    if all_answered(submitter) {
                        submitter.flush().context("submitting to the pipeline")?;
                    }
                    std::thread::sleep(Duration::from_micros(50));
                }
            }
        }
        match line {
            Line::ToSign(bytes) => submitter.submit_line(refdata, bytes, count),
            Line::Signed(bytes, signature) => {
                let injected_ns = submitter.clock().now_ns();
                submitter.submit(signed_line(bytes, signature, count, injected_ns))
            }
        }
        .context("submitting to the pipeline")?;
        count += 1;
        submitted.store(count, Ordering::Relaxed);
    }
    submitter.flush().context("submitting to the pipeline")?;
    Ok(count)
}

/// Runs the whole pipeline in process over the configured source and summarises it.
pub fn run(config: &RunConfig, refdata: Arc<RefData>) -> anyhow::Result<Summary> {
    let store_dir = config.run_dir.join("store");
    let store_exists = store_dir
        .read_dir()
        .is_ok_and(|mut entries| entries.next().is_some());
    if store_exists && !config.resume {
        bail!(
            "{} already holds a store from an earlier run; choose another --run-dir, or --resume it",
            config.run_dir.display()
        );
    }
    std::fs::create_dir_all(&config.run_dir)
        .with_context(|| format!("creating {}", config.run_dir.display()))?;
    let pipeline_config = PipelineConfig {
        queue_capacity_messages: config.queue_capacity_messages,
        batch_linger: config.batch_linger,
        recover: config.resume,
        matcher_memory: matcher_memory(config),
        ..config.settings.pipeline(&config.run_dir)
    };
    let started = Instant::now();
    let cpu_started_s = scale::own_cpu_s();
    let thread_watch = ste_engine::cpu::ThreadWatch::start(Duration::from_millis(100));
    let pipeline = Pipeline::start(
        &pipeline_config,
        refdata.clone(),
        config.settings.tolerances.clone(),
    )
    .context("starting the pipeline")?;
    let clock = pipeline.clock();

    let tally = Arc::new(Tally::default());
    let ack_thread = {
        let acks = pipeline.acks();
        let tally = tally.clone();
        std::thread::Builder::new()
            .name("acks".to_owned())
            .spawn(move || tally_answers(acks, &tally, clock, false))
            .context("starting the acks thread")?
    };
    let sink =
        Sink::new(config.cls_out.as_deref(), config.resume).context("opening the CLS output")?;
    let sink_thread = {
        let events = pipeline.outbound();
        let delivery = pipeline.delivery();
        std::thread::Builder::new()
            .name("sink".to_owned())
            .spawn(move || ste_sink::run(events, sink, clock, Some(delivery)))
            .context("starting the sink thread")?
    };

    let progress = Progress::start(&tally, &config.source, config.progress);
    let rss_marks = RssMarks::start(&tally, config.source.generated_messages());

    let mut submitter = pipeline.submitter();
    let (injected, expected) = inject_source(
        &mut submitter,
        &refdata,
        config,
        &tally,
        &progress.submitted,
    )?;
    drop(submitter);
    let station_handles = pipeline.stations().to_vec();
    let report = pipeline.finish();
    // Throughput counts from the first injection to the last acknowledgement; closing the
    // stores and counting their rows afterwards is not part of it.
    let elapsed_s = run_seconds(&tally, started);
    let process_cpu_s = scale::own_cpu_s() - cpu_started_s;
    let thread_cpu_s = thread_watch.finish();
    let rss_mb_at_answered = rss_marks.finish();
    progress.finish();
    let answers = ack_thread
        .join()
        .map_err(|_| anyhow::anyhow!("the ack thread panicked"))?;
    let sink_report = sink_thread
        .join()
        .map_err(|_| anyhow::anyhow!("the sink thread panicked"))?
        .context("writing CLS")?;
    // The pipeline's own error is the cause when injection stopped because a queue closed.
    let report = report.context("the pipeline failed")?;
    let messages_in = injected?;

    let samples = match &pipeline_config.samples_path {
        None => Vec::new(),
        Some(path) => ste_monitor::read_samples(path).context("reading samples")?,
    };
    let edge_rates = ste_monitor::edge_rates(&samples, "store.", 0.1);
    let (stations, bottleneck) = station_summaries(&samples, |name| {
        station_handles
            .iter()
            .find(|s| s.name() == name)
            .map(|s| {
                let reading = s.read();
                reading.response_ns as f64 / 1e6 / (reading.completions.max(1) as f64)
            })
            .unwrap_or_default()
    });

    let exceptions = answers.exceptions;
    let accepted = tally.accepted.load(Ordering::Relaxed);
    let duplicates = tally.duplicates.load(Ordering::Relaxed);
    let exceptions_total: u64 = exceptions.values().sum();
    let latency = sink_report.latency_ms();
    let shards: Vec<ShardSummary> = report
        .shards
        .iter()
        .zip(&report.shard_rows)
        .zip(&report.shard_commit_retries)
        .map(|((counts, rows), retries)| ShardSummary {
            trades: counts.trades,
            messages: counts.messages,
            stored_messages: rows.messages,
            stored_cls: rows.cls,
            stored_exceptions: rows.exceptions,
            commit_retries: *retries,
        })
        .collect();
    let sum =
        |f: fn(&ste_engine::matcher::ShardCounts) -> u64| report.shards.iter().map(f).sum::<u64>();
    let trades = match &config.source {
        Source::Generated(generator) => generator.trades,
        Source::File(_) => sum(|c| c.trades),
    };
    let outcome = RunOutcome {
        trades,
        messages_in,
        accepted,
        duplicates,
        exceptions,
        cls: sink_report.cls,
        mismatched_trades: sum(|c| c.mismatched),
        pending_trades: sum(|c| c.pending),
        cancelled_trades: sum(|c| c.cancelled),
    };
    // A generated set's expectation is for one run from empty shards; a resumed run sees part of
    // it again as duplicates.
    let matches_expected = expected
        .as_ref()
        .filter(|_| !config.resume)
        .map(|expected| *expected == outcome);
    let summary = Summary {
        outcome,
        cls_repeats: sink_report.cls_repeats,
        cls_redelivered: sink_report.cls_redelivered,
        mismatched_advices: sink_report.mismatched_advices,
        rate_msgs_per_s: config.rate_msgs_per_s,
        window: config.window,
        elapsed_s,
        throughput_msg_s: messages_in as f64 / elapsed_s.max(1e-9),
        throughput_first_10pct_msg_s: edge_rates.map(|(first, _)| first),
        throughput_last_10pct_msg_s: edge_rates.map(|(_, last)| last),
        latency_ms: latency.into(),
        stations,
        sampler_on_time: report.sampler_on_time,
        bottleneck,
        shards,
        stored_validation_exceptions: report.exception_rows.exceptions,
        store: config.settings.store.as_str().to_owned(),
        validators: config.settings.validators,
        // The kernel raises VmHWM only when it is about to lower the resident set, and not on
        // every path that lowers it, so it may read below a mark taken before: the peak is at
        // least every mark.
        peak_rss_mb: rss_mb_at_answered
            .iter()
            .map(|mark| mark.rss_mb)
            .fold(peak_rss_mb(), f64::max),
        rss_mb_at_answered,
        conserved: messages_in == accepted + duplicates + exceptions_total,
        expected: expected.clone(),
        matches_expected,
        // In process, a trade's shard is chosen by the routing rule itself.
        misrouted_trades: None,
        cpu: None,
        process_cpu_s: Some(process_cpu_s),
        thread_cpu_s: thread_cpu_s
            .into_iter()
            .filter(|(role, _)| !report.station_cpu_s.contains_key(role))
            .collect(),
        station_cpu_s: report.station_cpu_s.clone(),
        limit_probe: limit_probe(config, &refdata)?,
        run_dir: config.run_dir.display().to_string(),
    };
    write_run_files(config, &summary, &sink_report)?;
    Ok(summary)
}

/// The stations of a run as its summary gives them, and its bottleneck; `direct_r_ms` is a
/// station's response time as measured item by item, where it is known.
fn station_summaries(
    samples: &[ste_monitor::Sample],
    direct_r_ms: impl Fn(&str) -> f64,
) -> (Vec<StationSummary>, Option<String>) {
    let metrics = ste_monitor::analyze(samples);
    let bottleneck = ste_monitor::bottleneck(&metrics).map(|m| m.station.clone());
    let stations = metrics
        .iter()
        .map(|m| StationSummary {
            name: m.station.clone(),
            A: m.A,
            C: m.C,
            B_s: m.B_s,
            T_s: m.T_s,
            X: m.X,
            U: m.U,
            S_ms: m.S_s * 1e3,
            N: m.N,
            R_ms: m.R_s * 1e3,
            R_direct_ms: direct_r_ms(&m.station),
        })
        .collect();
    (stations, bottleneck)
}

/// What each shard's matcher keeps in memory: as the options say; unless they name the
/// filter's size, for a generated set a filter sized for what the shard will retire over the
/// run (every message key and closed trade).
fn matcher_memory(config: &RunConfig) -> ste_engine::matcher::MatcherMemory {
    let settings = &config.settings;
    match &config.source {
        Source::Generated(generator) if !settings.filter_given => {
            let per_trade = ste_engine::generator::MESSAGES_PER_TRADE as u64 + 1;
            let facts =
                generator.trades.saturating_mul(per_trade) / u64::from(settings.shards.max(1));
            ste_engine::matcher::MatcherMemory {
                filter_bytes: ste_engine::matcher::MatcherMemory::for_facts(facts).filter_bytes,
                ..settings.matcher_memory
            }
        }
        _ => settings.matcher_memory,
    }
}

/// The limit probe of a run, once it is over: on its first messages, signed as it signed them.
fn limit_probe(config: &RunConfig, refdata: &RefData) -> anyhow::Result<Option<probe::LimitProbe>> {
    let Some(duration) = config.limit_probe else {
        return Ok(None);
    };
    let sample = match &config.source {
        Source::Generated(generator) => probe::generated_sample(refdata, generator),
        Source::File(path) => probe::file_sample(refdata, path)?,
    };
    Ok(Some(probe::run(refdata, &sample, duration)))
}

/// Writes a run's `summary.json` and `latency.csv` into its run directory.
fn write_run_files(
    config: &RunConfig,
    summary: &Summary,
    sink_report: &ste_sink::SinkReport,
) -> anyhow::Result<()> {
    let summary_path = config.run_dir.join("summary.json");
    std::fs::write(&summary_path, serde_json::to_string_pretty(summary)?)
        .with_context(|| format!("writing {}", summary_path.display()))?;
    let latency_path = config.run_dir.join("latency.csv");
    std::fs::write(&latency_path, sink_report.latency_csv())
        .with_context(|| format!("writing {}", latency_path.display()))
}

impl From<ste_sink::LatencyMs> for LatencySummary {
    fn from(latency: ste_sink::LatencyMs) -> Self {
        Self {
            p50: latency.p50,
            p99: latency.p99,
            p999: latency.p999,
            max: latency.max,
            mean: latency.mean,
        }
    }
}

/// Seconds from the start of a run to its last answer (to now, if none came): closing the
/// stores and counting their rows afterwards is not part of it.
fn run_seconds(tally: &Tally, started: Instant) -> f64 {
    match tally.last_ack_ns.load(Ordering::Relaxed) {
        0 => started.elapsed().as_secs_f64(),
        last_ack_ns => last_ack_ns as f64 / 1e9,
    }
}

/// What the answers of a run said besides the counts in [`Tally`].
#[derive(Default)]
struct Answers {
    exceptions: BTreeMap<String, u64>,
    /// Answers to messages already answered, not counted again.
    repeats: u64,
}

/// Counts the answers off `acks` into `tally` until the queue ends. With `first_only`, only a
/// message's first answer counts (by its correlation, the order it was injected in): across
/// nodes a batch delivered again after a node failed is answered again. In process each message
/// is answered once and nothing is kept per message.
fn tally_answers(acks: Rx<Ack>, tally: &Tally, clock: RunClock, first_only: bool) -> Answers {
    let mut answers = Answers::default();
    loop {
        let batch = match ste_engine::queue::receive(&acks) {
            Ok(Some(received)) => {
                if let Err(error) = received.receipt.ack() {
                    tracing::warn!(%error, "acknowledging answers failed; they come again");
                }
                received.items
            }
            Ok(None) => break,
            Err(error) => {
                tracing::error!(%error, "the ack queue failed; the tally stops here");
                break;
            }
        };
        let mut counted = 0;
        // Only across nodes is an answer kept per message (in process each comes once).
        let mut answered = first_only.then(|| {
            tally
                .answered
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
        });
        for ack in &batch {
            if let Some(answered) = answered.as_mut() {
                let index = ack.correlation as usize;
                if answered.len() <= index {
                    answered.resize(index + 1, false);
                }
                if std::mem::replace(&mut answered[index], true) {
                    answers.repeats += 1;
                    continue;
                }
            }
            counted += 1;
            match ack.result {
                AckResult::Accepted => {
                    tally.accepted.fetch_add(1, Ordering::Relaxed);
                }
                AckResult::Duplicate => {
                    tally.duplicates.fetch_add(1, Ordering::Relaxed);
                }
                AckResult::Rejected(code) => {
                    *answers
                        .exceptions
                        .entry(code.as_str().to_owned())
                        .or_default() += 1;
                }
            }
        }
        drop(answered);
        tally.acked.fetch_add(counted, Ordering::Relaxed);
        tally.last_ack_ns.store(clock.now_ns(), Ordering::Relaxed);
    }
    answers
}

/// Injects the configured source through `submitter`, paced as configured: how many messages
/// (or why injection stopped, which the caller reports after the engine's own error) and, for a
/// generated set, what the generator expects.
fn inject_source(
    submitter: &mut Submitter,
    refdata: &RefData,
    config: &RunConfig,
    tally: &Tally,
    submitted: &AtomicU64,
) -> anyhow::Result<(anyhow::Result<u64>, Option<RunOutcome>)> {
    let pacing = Pacing {
        rate: config.rate_msgs_per_s,
        window: config.window.map(|window| window.max(1)),
        acked: &tally.acked,
    };
    Ok(match &config.source {
        Source::Generated(generator_config) => {
            let mut generator = Generator::new(refdata, generator_config.clone());
            let lines = generator.by_ref().map(|line| Ok(Line::ToSign(line)));
            let count = inject(submitter, refdata, lines, &pacing, submitted);
            (count, Some(generator.expected().clone()))
        }
        Source::File(path) => {
            let lines = MessageSetReader::open(path)?;
            let count = match &config.signatures {
                Some(signatures) => {
                    let signatures = File::open(signatures)
                        .with_context(|| format!("opening {}", signatures.display()))?;
                    let lines = presigned_lines(lines, signatures);
                    inject(submitter, refdata, lines, &pacing, submitted)
                }
                None => {
                    let lines = lines.map(|line| line.map(Line::ToSign));
                    inject(submitter, refdata, lines, &pacing, submitted)
                }
            };
            (count, config.expected.clone())
        }
    })
}

/// Submits again, unpaced, every message of the configured source (the first `messages`) that
/// has no answer yet: across nodes an answer may be lost on its way, and a message sent again
/// is answered as its first sending was (DUPLICATE where it was accepted). Returns how many.
fn resubmit_unanswered(
    submitter: &mut Submitter,
    refdata: &RefData,
    config: &RunConfig,
    tally: &Tally,
    messages: u64,
) -> anyhow::Result<u64> {
    let unanswered = |index: u64| {
        let answered = tally
            .answered
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        !answered.get(index as usize).copied().unwrap_or(false)
    };
    let mut resent = 0;
    let mut again = |index: u64, line: Vec<u8>| -> anyhow::Result<()> {
        if index < messages && unanswered(index) {
            submitter
                .submit_line(refdata, line, index)
                .context("submitting again")?;
            resent += 1;
        }
        Ok(())
    };
    match &config.source {
        Source::Generated(generator_config) => {
            for (index, line) in Generator::new(refdata, generator_config.clone()).enumerate() {
                again(index as u64, line)?;
            }
        }
        Source::File(path) => {
            for (index, line) in MessageSetReader::open(path)?.enumerate() {
                again(index as u64, line.context("reading the message set")?)?;
            }
        }
    }
    submitter.flush().context("submitting again")?;
    Ok(resent)
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_engine_writes_the_samples_header_the_monitor_reads() {
        // Two crates, one file format: the monitor stays independent of the engine.
        assert_eq!(
            ste_engine::pipeline::SAMPLES_HEADER,
            ste_monitor::SAMPLES_HEADER
        );
        assert_eq!(
            ste_engine::pipeline::STATION_TIME_HEADER,
            ste_monitor::STATION_TIME_HEADER
        );
        let samples = std::path::Path::new("runs/r/samples.csv");
        assert_eq!(
            ste_engine::pipeline::station_time_path(samples),
            ste_monitor::station_time_path(samples)
        );
    }
}
