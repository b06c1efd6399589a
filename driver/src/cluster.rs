//! `driver --nats URL`: the load of a run put into a cluster's inbound queues, one per shard
//! (DESIGN.md section 1a), as a gateway would, its answers taken off the gateway's subject, its
//! CLS off the cluster's CLS queue by the sink, and the run summarised from the answers and the
//! shards' databases as in process. Answers travel on plain NATS: where some stop coming (lost
//! while a connection was re-made), the driver sends the unanswered messages again, as a
//! participant would, and is answered as their first sending was.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use ste_engine::cluster::roles::Role;
use ste_engine::cluster::{
    retrying, retrying_carrier, ClsFeed, ClusterAccess, ClusterLayout, Ingress, STARTING_PATIENCE,
};
use ste_engine::cluster_samples::{MemoryReading, NodeMemory, SampleCollector};
use ste_engine::generator::RunOutcome;
use ste_engine::lease::Leases;
use ste_engine::queue::jetstream::Placement;
use ste_engine::refdata::RefData;
use ste_engine::routing::shard_of;
use ste_engine::station::RunClock;
use ste_engine::store::{PgStore, Store};
use ste_sink::Sink;

use super::scale::CpuReading;
use super::{
    inject_source, peak_rss_mb, resubmit_unanswered, run_seconds, station_summaries, tally_answers,
    write_run_files, Progress, RunConfig, ShardSummary, Source, Summary, Tally,
};

/// Where a cluster is and how its queues are laid out.
#[derive(Debug, Clone)]
pub struct ClusterTarget {
    /// The NATS server, e.g. `nats://127.0.0.1:4222`.
    pub url: String,
    /// Time to live of the cluster's leases (the gateway number the driver holds).
    pub lease_ttl: Duration,
    /// Longest the driver waits without a new answer before it gives up on the run.
    pub stall_timeout: Duration,
    /// How long the driver waits without a new answer before it sends the unanswered messages
    /// again.
    pub resend_after: Duration,
    /// Where the cluster's streams go among its NATS servers.
    pub placement: Placement,
    /// Messages in one batch of a shard's inbound stream.
    pub batch_messages: usize,
    /// Before injecting, wait up to this long until every shard has an owner, so
    /// that the run measures the cluster at work and not its nodes starting (a sweep's levels).
    pub wait_for_owners: Option<Duration>,
    /// The cluster's secrets folder: the driver connects as a load source (the first `load-<n>`
    /// identity whose number is free), as the sink and as the monitor.
    pub secrets: Option<std::path::PathBuf>,
}

/// Waits until every shard of `layout` is held by a node; returns how many distinct nodes hold
/// them.
fn wait_until_owned(
    leases: &Leases,
    layout: &ClusterLayout,
    timeout: Duration,
) -> anyhow::Result<usize> {
    use ste_engine::lease::Leased;
    let started = Instant::now();
    loop {
        let mut owners = std::collections::BTreeSet::new();
        let mut all = true;
        let mut unreadable = None;
        for shard in 0..layout.shards {
            // A bucket just made on a cluster of servers answers only once its copies have
            // chosen a leader: until then, as if nobody held the shard yet.
            match leases.holder(Leased::Shard(shard)) {
                Ok(Some(owner)) => {
                    owners.insert(owner);
                }
                Ok(None) => all = false,
                Err(error) => {
                    all = false;
                    unreadable = Some(error);
                }
            }
        }
        if all {
            return Ok(owners.len());
        }
        if started.elapsed() > timeout {
            let why = unreadable.map_or_else(String::new, |error| format!(" ({error})"));
            bail!(
                "after {} s, not every one of {} shards has an owner{why}: are the nodes running?",
                timeout.as_secs(),
                layout.shards
            );
        }
        std::thread::sleep(DRAIN_POLL);
    }
}

/// Messages sent again are given up after this many rounds without an answer to each.
const RESEND_ROUNDS_MAX: u32 = 5;

/// How often the driver looks whether the CLS queue is drained at the end of a run.
const DRAIN_POLL: Duration = Duration::from_millis(50);

/// Runs the configured load through the cluster at `target` and summarises it. The shards'
/// databases (one per shard, in shard order: [`ste_engine::options::Settings`] holds no other
/// cluster) give the trades' final states and rows.
pub fn run_cluster(
    config: &RunConfig,
    target: &ClusterTarget,
    refdata: Arc<RefData>,
) -> anyhow::Result<Summary> {
    std::fs::create_dir_all(&config.run_dir)
        .with_context(|| format!("creating {}", config.run_dir.display()))?;
    let access = ClusterAccess {
        url: target.url.clone(),
        placement: target.placement.clone(),
        secrets: target.secrets.clone(),
    };
    let layout = ClusterLayout {
        shards: config.settings.shards,
        inbound_batch_messages: target.batch_messages,
        ..ClusterLayout::default()
    };
    // A cluster of servers that is starting (or electing leaders) may time out a request or
    // have no responder yet: tried again for as long as the run would wait for its owners.
    let patience = target.wait_for_owners.unwrap_or(STARTING_PATIENCE);
    let node_id = format!("driver-{}", std::process::id());
    // The load source's connection makes the queues where they are missing.
    let (mut ingress, jetstream) = Ingress::open_as(
        &access,
        Role::Load,
        &layout,
        target.lease_ttl,
        &node_id,
        patience,
    )
    .with_context(|| format!("taking a gateway number on NATS at {}", target.url))?;
    retrying(patience, || layout.ensure(&jetstream)).context("making the cluster's queues")?;
    if let Some(timeout) = target.wait_for_owners {
        let leases = retrying(patience, || Leases::open(&jetstream, target.lease_ttl))
            .context("opening the leases")?;
        let owners = wait_until_owned(&leases, &layout, timeout)?;
        eprintln!("{} shards owned by {owners} nodes", layout.shards);
    }
    let sink_connection =
        retrying(patience, || access.connect(Role::Sink)).context("connecting as the sink")?;
    let mut feed = retrying_carrier(patience, || ClsFeed::open(&sink_connection, &layout))
        .context("opening the CLS queue")?;
    let clock = RunClock::start();
    let started = Instant::now();
    // The nodes' stations and the queues' lengths, in one samples.csv.
    let samples_path = config.run_dir.join("samples.csv");
    let collector = if config.settings.sample_interval.is_zero() {
        None
    } else {
        Some(
            SampleCollector::start(
                &access
                    .connect(Role::Monitor)
                    .context("connecting as the monitor")?,
                &layout
                    .queues()
                    .into_iter()
                    .map(|(queue, _)| queue)
                    .collect::<Vec<_>>(),
                &samples_path,
                config.settings.sample_interval,
                clock,
            )
            .with_context(|| format!("writing {}", samples_path.display()))?,
        )
    };

    let tally = Arc::new(Tally::default());
    let ack_thread = {
        let acks = ingress.take_acks().context("the ACK queue")?;
        let tally = tally.clone();
        std::thread::spawn(move || tally_answers(acks, &tally, clock, true))
    };
    let sink = Sink::new(config.cls_out.as_deref(), false).context("opening the CLS output")?;
    let sink_stopper = feed.stopper();
    let sink_thread = {
        let events = feed.take_events().context("the CLS queue")?;
        let delivery = feed.delivery();
        std::thread::spawn(move || ste_sink::run(events, sink, clock, Some(delivery)))
    };

    let progress = Progress::start(&tally, &config.source, config.progress);
    let cpu_before = CpuReading::now();
    let mut submitter = ingress.submitter(clock);
    let (injected, expected) = inject_source(
        &mut submitter,
        &refdata,
        config,
        &tally,
        &progress.submitted,
    )?;
    drop(submitter);
    let messages_in = injected?;

    // Every message is answered once its commit holds it; the CLS of a commit are on their
    // queue before its answers are. Where answers stop coming, the unanswered messages are sent
    // again (an answer may be lost on its way), a few times, before the run is given up.
    let mut last_progress = (tally.acked.load(Ordering::Relaxed), Instant::now());
    let (mut resend_rounds, mut resent) = (0, 0);
    let mut last_resend = Instant::now();
    while tally.acked.load(Ordering::Relaxed) < messages_in {
        std::thread::sleep(DRAIN_POLL);
        let acked = tally.acked.load(Ordering::Relaxed);
        if acked != last_progress.0 {
            last_progress = (acked, Instant::now());
        } else if last_progress.1.elapsed() > target.stall_timeout {
            bail!(
                "{} of {messages_in} messages were never answered (no answer for {} s, {resent} \
                 sent again): are the nodes running, on {} shards?",
                messages_in - acked,
                target.stall_timeout.as_secs(),
                config.settings.shards
            );
        } else if last_progress.1.elapsed() > target.resend_after
            && last_resend.elapsed() > target.resend_after
            && resend_rounds < RESEND_ROUNDS_MAX
        {
            let mut again = ingress.submitter(clock);
            let count = resubmit_unanswered(&mut again, &refdata, config, &tally, messages_in)?;
            resend_rounds += 1;
            resent += count;
            last_resend = Instant::now();
            eprintln!(
                "no answer for {} s: {count} unanswered messages sent again",
                target.resend_after.as_secs_f64()
            );
        }
    }
    let elapsed_s = run_seconds(&tally, started);
    let cpu = cpu_before.until(&CpuReading::now());
    // The CLS of every commit are on their queue; the sink takes them. Waiting is bounded as
    // the answers' is: a queue that does not shrink for the stall timeout ends the run, and a
    // sink that ended says why below.
    let mut draining = (u64::MAX, Instant::now());
    loop {
        let left = jetstream
            .queue_len(ClusterLayout::CLS_QUEUE)
            .context("reading the CLS queue")?;
        if left == 0 || sink_thread.is_finished() {
            break;
        }
        if left < draining.0 {
            draining = (left, Instant::now());
        } else if draining.1.elapsed() > target.stall_timeout {
            bail!(
                "the CLS queue has held {left} batches for {} s that the sink does not take",
                target.stall_timeout.as_secs()
            );
        }
        std::thread::sleep(DRAIN_POLL);
    }
    sink_stopper.stop();
    progress.finish();
    ingress.stop();
    let answers = ack_thread
        .join()
        .map_err(|_| anyhow::anyhow!("the ack thread panicked"))?;
    let sink_report = sink_thread
        .join()
        .map_err(|_| anyhow::anyhow!("the sink thread panicked"))?
        .context("writing CLS")?;
    let (stations, bottleneck) = match collector {
        None => (Vec::new(), None),
        Some(collector) => {
            let memory = collector.stop().context("collecting the nodes' samples")?;
            report_memory(&memory, elapsed_s, &config.run_dir)?;
            let samples = ste_monitor::read_samples(&samples_path).context("reading samples")?;
            station_summaries(&samples, |_| 0.0)
        }
    };

    let mut shards = Vec::with_capacity(config.settings.database_urls.len());
    let (mut mismatched, mut pending, mut cancelled, mut with_messages) = (0, 0, 0, 0);
    let mut misrouted = 0;
    for (shard, url) in config.settings.database_urls.iter().enumerate() {
        let mut store = PgStore::open(url).context("opening a shard's database")?;
        misrouted += store
            .trade_keys()
            .context("reading a shard's trade keys")?
            .iter()
            .filter(|key| shard_of(key, config.settings.shards) as usize != shard)
            .count() as u64;
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
        latency_ms: latency.into(),
        stations,
        sampler_on_time: None,
        bottleneck,
        shards,
        stored_validation_exceptions: 0,
        store: format!("postgres, cluster at {}", target.url),
        validators: config.settings.shards,
        peak_rss_mb: peak_rss_mb(),
        // The driver's own memory says nothing of the nodes'.
        rss_mb_at_answered: Vec::new(),
        conserved: messages_in == accepted + duplicates + exceptions_total,
        expected,
        matches_expected,
        misrouted_trades: Some(misrouted),
        cpu: Some(cpu),
        process_cpu_s: None,
        station_cpu_s: Default::default(),
        thread_cpu_s: Default::default(),
        limit_probe: crate::limit_probe(config, &refdata)?,
        run_dir: config.run_dir.display().to_string(),
    };
    write_run_files(config, &summary, &sink_report)?;
    Ok(summary)
}

/// The share of a run after which a node counts as warmed up.
const WARM_UP_FRACTION: f64 = 0.2;

/// Prints each node's resident memory after warm-up (first, peak, last), with its matcher
/// tables and what the rest of it did, and writes every reading to `nodes.csv` in the run
/// directory.
fn report_memory(
    memory: &BTreeMap<String, NodeMemory>,
    elapsed_s: f64,
    run_dir: &std::path::Path,
) -> anyhow::Result<()> {
    let mut csv = String::from("t_ms,node,rss_mib,matcher_tables_mib\n");
    let warm_ms = elapsed_s * 1e3 * WARM_UP_FRACTION;
    for (node, readings) in memory {
        for reading in &readings.readings {
            csv.push_str(&format!(
                "{:.3},{node},{:.1},{:.1}\n",
                reading.t_ms,
                reading.rss_mib(),
                reading.matcher_mib()
            ));
        }
        let spans = (
            readings.span(warm_ms, MemoryReading::rss_mib),
            readings.span(warm_ms, MemoryReading::matcher_mib),
            readings.span(warm_ms, |r| r.rss_mib() - r.matcher_mib()),
        );
        if let (Some(rss), Some(tables), Some(rest)) = spans {
            eprintln!(
                "node {node}: RSS {:.0} MiB after warm-up ({:.0}% of the run), peak {:.0}, {:.0} at the end; \
                 its matchers' tables {:.0} then {:.0} MiB; the rest {:.0}, peak {:.0}, {:.0} at the end",
                rss.first,
                WARM_UP_FRACTION * 100.0,
                rss.peak,
                rss.last,
                tables.first,
                tables.last,
                rest.first,
                rest.peak,
                rest.last
            );
        }
    }
    let path = run_dir.join("nodes.csv");
    std::fs::write(&path, csv).with_context(|| format!("writing {}", path.display()))
}
