//! `driver --nats URL`: the load of a run put into a cluster's inbound partitions (DESIGN.md
//! section 1a) as a gateway would, its answers taken off the gateway's ACK queue, its CLS off
//! the cluster's CLS queue by the sink, and the run summarised from the answers and the shards'
//! databases as in process.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::BufReader;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use ste_engine::generator::{Generator, RunOutcome};
use ste_engine::lease::Leases;
use ste_engine::node::{ClsFeed, ClusterLayout, Ingress};
use ste_engine::pipeline::AckResult;
use ste_engine::queue::jetstream::JetStream;
use ste_engine::refdata::RefData;
use ste_engine::station::RunClock;
use ste_engine::store::{PgStore, Store};
use ste_sink::Sink;

use super::{
    inject, peak_rss_mb, LatencySummary, MessageSetReader, Pacing, Progress, RunConfig,
    ShardSummary, Source, Summary, Tally,
};

/// Where a cluster is and how its queues are laid out.
#[derive(Debug, Clone)]
pub struct ClusterTarget {
    /// The NATS server, e.g. `nats://127.0.0.1:4222`.
    pub url: String,
    /// Inbound partitions: the same number the nodes were started with.
    pub partitions: u32,
    /// Time to live of the cluster's leases (the gateway number the driver holds).
    pub lease_ttl: Duration,
    /// Longest the driver waits without a new answer before it gives up on the run.
    pub stall_timeout: Duration,
}

/// The first answer to each message, by correlation (the order it was injected in): a message
/// delivered again after a node failed is answered again, and only its first answer counts.
#[derive(Default)]
struct Answers {
    /// 0: none yet; 1 + the answer's kind otherwise.
    first: Vec<u8>,
    exceptions: BTreeMap<String, u64>,
    repeats: u64,
}

const ACCEPTED: u8 = 1;
const DUPLICATE: u8 = 2;
const REJECTED: u8 = 3;

/// How often the driver looks whether the CLS queue is drained at the end of a run.
const DRAIN_POLL: Duration = Duration::from_millis(50);

/// Runs the configured load through the cluster at `target` and summarises it. The shards'
/// databases (`config.db_urls`, in shard order) give the trades' final states and rows.
pub fn run_cluster(
    config: &RunConfig,
    target: &ClusterTarget,
    refdata: Arc<RefData>,
) -> anyhow::Result<Summary> {
    if config.db_urls.len() != config.shards as usize || config.db_urls.is_empty() {
        bail!(
            "a cluster run reads each shard's database at the end: one --db URL per shard \
             ({} shards, {} URLs)",
            config.shards,
            config.db_urls.len()
        );
    }
    std::fs::create_dir_all(&config.run_dir)
        .with_context(|| format!("creating {}", config.run_dir.display()))?;
    let jetstream = JetStream::connect(&target.url)
        .with_context(|| format!("connecting to NATS at {}", target.url))?;
    let layout = ClusterLayout {
        partitions: target.partitions,
        shards: config.shards,
        ..ClusterLayout::default()
    };
    layout
        .ensure(&jetstream)
        .context("making the cluster's queues")?;
    let leases =
        Arc::new(Leases::open(&jetstream, target.lease_ttl).context("opening the leases")?);
    let node_id = format!("driver-{}", std::process::id());
    let mut ingress =
        Ingress::open(&jetstream, &layout, leases, &node_id).context("taking a gateway number")?;
    let mut feed = ClsFeed::open(&jetstream, &layout).context("opening the CLS queue")?;
    let clock = RunClock::start();
    let started = Instant::now();

    let tally = Arc::new(Tally::default());
    let answers: Arc<Mutex<Answers>> = Arc::default();
    let ack_thread = {
        let acks = ingress.take_acks().context("the ACK queue")?;
        let (tally, answers) = (tally.clone(), answers.clone());
        std::thread::spawn(move || loop {
            let batch = match ste_engine::queue::receive(&acks) {
                Ok(Some(received)) => {
                    let items = received.items;
                    if let Err(error) = received.receipt.ack() {
                        tracing::warn!(%error, "acknowledging answers failed; they come again");
                    }
                    items
                }
                Ok(None) => break,
                Err(error) => {
                    tracing::warn!(%error, "the ACK queue failed; taking answers again");
                    std::thread::sleep(Duration::from_millis(200));
                    continue;
                }
            };
            let Ok(mut answers) = answers.lock() else {
                break;
            };
            let mut fresh = 0;
            for ack in batch {
                let index = ack.correlation as usize;
                if answers.first.len() <= index {
                    answers.first.resize(index + 1, 0);
                }
                if answers.first[index] != 0 {
                    answers.repeats += 1;
                    continue;
                }
                fresh += 1;
                answers.first[index] = match ack.result {
                    AckResult::Accepted => {
                        tally.accepted.fetch_add(1, Ordering::Relaxed);
                        ACCEPTED
                    }
                    AckResult::Duplicate => {
                        tally.duplicates.fetch_add(1, Ordering::Relaxed);
                        DUPLICATE
                    }
                    AckResult::Rejected(code) => {
                        *answers
                            .exceptions
                            .entry(code.as_str().to_owned())
                            .or_default() += 1;
                        REJECTED
                    }
                };
            }
            tally.acked.fetch_add(fresh, Ordering::Relaxed);
            tally.last_ack_ns.store(clock.now_ns(), Ordering::Relaxed);
        })
    };
    let sink = Sink::new(config.cls_out.as_deref(), false).context("opening the CLS output")?;
    let sink_stopper = feed.stopper();
    let sink_thread = {
        let events = feed.take_events().context("the CLS queue")?;
        let delivery = feed.delivery();
        std::thread::spawn(move || ste_sink::run(events, sink, clock, Some(delivery)))
    };

    let progress = Progress::start(&tally, &config.source, config.progress);
    let mut submitter = ingress.submitter(clock);
    let pacing = Pacing {
        rate: config.rate_msgs_per_s,
        window: config.window.map(|window| window.max(1)),
        acked: &tally.acked,
    };
    let (injected, expected) = match &config.source {
        Source::Generated(generator_config) => {
            let mut generator = Generator::new(&refdata, generator_config.clone());
            let lines = generator.by_ref().map(Ok);
            let count = inject(
                &mut submitter,
                &refdata,
                lines,
                &pacing,
                &progress.submitted,
            );
            (count, Some(generator.expected().clone()))
        }
        Source::File(path) => {
            let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
            let lines = MessageSetReader::new(BufReader::new(file));
            let count = inject(
                &mut submitter,
                &refdata,
                lines,
                &pacing,
                &progress.submitted,
            );
            (count, None)
        }
    };
    drop(submitter);
    let messages_in = injected?;

    // Every message is answered once its commit holds it; the CLS of a commit are on their
    // queue before its answers are.
    let mut last_progress = (tally.acked.load(Ordering::Relaxed), Instant::now());
    while tally.acked.load(Ordering::Relaxed) < messages_in {
        std::thread::sleep(DRAIN_POLL);
        let acked = tally.acked.load(Ordering::Relaxed);
        if acked != last_progress.0 {
            last_progress = (acked, Instant::now());
        } else if last_progress.1.elapsed() > target.stall_timeout {
            bail!(
                "{} of {messages_in} messages were never answered (no answer for {} s): are the \
                 nodes running, with {} partitions and {} shards?",
                messages_in - acked,
                target.stall_timeout.as_secs(),
                target.partitions,
                config.shards
            );
        }
    }
    let elapsed_s = match tally.last_ack_ns.load(Ordering::Relaxed) {
        0 => started.elapsed().as_secs_f64(),
        last_ack_ns => last_ack_ns as f64 / 1e9,
    };
    while jetstream
        .queue_len(ClusterLayout::CLS_QUEUE)
        .context("reading the CLS queue")?
        > 0
    {
        std::thread::sleep(DRAIN_POLL);
    }
    sink_stopper.stop();
    progress.finish();
    ingress.stop();
    let _ = ack_thread.join();
    let sink_report = sink_thread
        .join()
        .map_err(|_| anyhow::anyhow!("the sink thread panicked"))?
        .context("writing CLS")?;

    let mut shards = Vec::with_capacity(config.db_urls.len());
    let (mut mismatched, mut pending, mut cancelled, mut with_messages) = (0, 0, 0, 0);
    for url in &config.db_urls {
        let mut store = PgStore::open(url).context("opening a shard's database")?;
        let rows = store.row_counts().context("counting a shard's rows")?;
        let states = store.trade_states().context("reading a shard's trades")?;
        mismatched += states.count("MISMATCHED");
        pending += states.count("PENDING");
        cancelled += states.count("CANCELLED");
        with_messages += states.with_messages;
        shards.push(ShardSummary {
            trades: states.with_messages,
            messages: rows.messages,
            stored_messages: rows.messages,
            stored_cls: rows.cls,
            stored_exceptions: rows.exceptions,
            commit_retries: 0,
        });
    }
    let answers = std::mem::take(&mut *answers.lock().map_err(|_| anyhow::anyhow!("answers"))?);
    let accepted = tally.accepted.load(Ordering::Relaxed);
    let duplicates = tally.duplicates.load(Ordering::Relaxed);
    let exceptions_total: u64 = answers.exceptions.values().sum();
    let outcome = RunOutcome {
        trades: match &config.source {
            Source::Generated(generator) => generator.trades,
            Source::File(_) => with_messages,
        },
        messages_in,
        accepted,
        duplicates,
        exceptions: answers.exceptions,
        cls: sink_report.cls,
        mismatched_trades: mismatched,
        pending_trades: pending,
        cancelled_trades: cancelled,
    };
    if answers.repeats > 0 {
        eprintln!(
            "{} answers came twice (batches delivered again after a node stopped); the first counted",
            answers.repeats
        );
    }
    let matches_expected = expected.as_ref().map(|expected| *expected == outcome);
    let latency = sink_report.latency_ms();
    let summary = Summary {
        outcome,
        cls_repeats: sink_report.cls_repeats,
        cls_redelivered: sink_report.cls_redelivered,
        mismatched_advices: sink_report.mismatched_advices,
        rate_msgs_per_s: config.rate_msgs_per_s,
        window: config.window,
        elapsed_s,
        throughput_msg_s: messages_in as f64 / elapsed_s.max(1e-9),
        throughput_first_10pct_msg_s: None,
        throughput_last_10pct_msg_s: None,
        latency_ms: LatencySummary {
            p50: latency.p50,
            p99: latency.p99,
            p999: latency.p999,
            max: latency.max,
            mean: latency.mean,
        },
        stations: Vec::new(),
        bottleneck: None,
        shards,
        stored_validation_exceptions: 0,
        store: format!("postgres, cluster at {}", target.url),
        validators: target.partitions,
        peak_rss_mb: peak_rss_mb(),
        conserved: messages_in == accepted + duplicates + exceptions_total,
        expected,
        matches_expected,
        run_dir: config.run_dir.display().to_string(),
    };
    let summary_path = config.run_dir.join("summary.json");
    std::fs::write(&summary_path, serde_json::to_string_pretty(&summary)?)
        .with_context(|| format!("writing {}", summary_path.display()))?;
    let latency_path = config.run_dir.join("latency.csv");
    std::fs::write(&latency_path, sink_report.latency_csv())
        .with_context(|| format!("writing {}", latency_path.display()))?;
    Ok(summary)
}
