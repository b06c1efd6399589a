//! `driver`: generate, replay and measure STE runs.
//!
//! - `driver --trades N [--json]` generates N standard trades and runs them through the whole
//!   pipeline in process;
//! - `driver --input FILE` replays a message-set file;
//! - `driver generate --trades N --out FILE` writes a message set (and `FILE.expected.json`,
//!   and a random key set in `FILE.keys.csv`);
//! - `driver keys --out FILE` writes a random key set;
//! - `driver refdata [--out DIR]` writes the reference-data files.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::{Args, Parser, Subcommand};
use ste_driver::remote::{run_remote as run_remote_load, RemoteConfig};
use ste_driver::{RunConfig, Source, StoreKind, Summary};
use ste_engine::generator::{GeneratorConfig, DEFAULT_SEED};
use ste_engine::keys::KeyRing;
use ste_engine::options::{PipelineArgs, Scope, TlsIdentityArgs};
use ste_engine::refdata::RefData;

mod node_sweep;

// The pipeline allocates many small strings per message across threads; mimalloc's per-thread
// heaps make that markedly cheaper than the system allocator. Transparent huge pages are off
// (feature no_thp): re-faulting 2 MiB pages that the allocator had returned cost a quarter of
// the CPU time in kernel page clearing.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "driver",
    about = "Injects load into the STE trade-matching engine and measures it",
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Subcommand)]
enum Command {
    /// Write a message-set file and, beside it, the outcome it must produce.
    Generate {
        #[command(flatten)]
        generation: GenerationArgs,
        /// The message-set file to write.
        #[arg(long)]
        out: PathBuf,
        /// Reference data folder (default: the data compiled in).
        #[arg(long)]
        refdata: Option<PathBuf>,
    },
    /// Apply the shards' schema migrations to each database (as the role that owns them, e.g.
    /// ste_owner, whose password comes from --secrets' pgpass or PGPASSFILE): the role nodes
    /// run as may not create tables, and finds its database migrated.
    Migrate {
        /// A shard's database URL; once per shard.
        #[arg(long = "db", value_name = "URL", required = true)]
        db: Vec<String>,
        /// The cluster's secrets folder (`driver secrets`).
        #[arg(long, env = "STE_SECRETS_DIR", value_name = "DIR")]
        secrets: Option<PathBuf>,
    },
    /// Make what is missing of a cluster's secrets in DIR (mode 0700) and keep the rest: the
    /// cluster's CA, the NATS servers' and PostgreSQL's certificates, an nkey for each NATS
    /// identity (node, sink, monitor, gateway-<n>, load-<n>), and the servers' authorization
    /// with every role's permissions. With --rotate or --retire, an identity's key is rotated
    /// (its old key stays allowed) or its old key is dropped; reload the servers after either.
    Secrets {
        /// The secrets folder.
        #[arg(long)]
        dir: PathBuf,
        /// Further names the servers' certificates answer to (host names, addresses).
        #[arg(long = "host", value_name = "NAME")]
        hosts: Vec<String>,
        /// Gateway identities (gateway-0 …): gateways that may run at once.
        #[arg(long, default_value_t = ste_driver::secrets::GATEWAYS_DEFAULT)]
        gateways: u32,
        /// Load identities (load-0 …): drivers that may run at once.
        #[arg(long, default_value_t = ste_driver::secrets::LOADS_DEFAULT)]
        loads: u32,
        /// Shards whose database roles (ste_shard_<k>) get a password.
        #[arg(long, default_value_t = ste_driver::secrets::SHARDS_DEFAULT)]
        shards: u32,
        /// Give this identity a new key, its old one still allowed until --retire.
        #[arg(long, value_name = "IDENTITY", conflicts_with = "retire")]
        rotate: Option<String>,
        /// Stop allowing the key this identity rotated away from.
        #[arg(long, value_name = "IDENTITY")]
        retire: Option<String>,
    },
    /// Write a fresh random key set for every participant (CSV bic,key_id,key_hex, readable
    /// by its owner only): the --keys file of an engine node and the drivers that load it.
    Keys {
        /// The key file to write.
        #[arg(long)]
        out: PathBuf,
        /// Reference data folder (default: the data compiled in).
        #[arg(long)]
        refdata: Option<PathBuf>,
    },
    /// Run the same load at rising levels — closed-loop windows, open-loop rates, shard or
    /// validator counts — one run each, and tabulate throughput X, mean population N and
    /// response time R of the system per level: the points of a Little's-law curve (sweep.csv,
    /// sweep.json and littles-law.svg in --out).
    #[command(group(clap::ArgGroup::new("levels").required(true).multiple(false)))]
    Sweep {
        #[command(flatten)]
        run: Box<RunArgs>,
        /// Closed-loop windows (messages in flight), comma-separated, e.g. 16,64,256,1024,4096.
        #[arg(long, value_delimiter = ',', group = "levels")]
        windows: Vec<u64>,
        /// Open-loop rates (messages per second), comma-separated.
        #[arg(long, value_delimiter = ',', group = "levels")]
        rates: Vec<f64>,
        /// Shard counts, comma-separated (memory and embedded stores).
        #[arg(long, value_delimiter = ',', group = "levels")]
        shard_counts: Vec<u32>,
        /// Validator counts, comma-separated.
        #[arg(long, value_delimiter = ',', group = "levels")]
        validator_counts: Vec<u32>,
        /// Engine-node counts of a cluster, comma-separated, e.g. 1,2,4,8: each level a fresh
        /// cluster (its own nats-server, fresh databases `ste_sweep_<k>` on the --db servers,
        /// K `engine` processes from beside the driver) or, with --compose, the compose file's
        /// cluster with `--scale node=K`; a closed loop of --window messages (default 4096).
        #[arg(long, value_delimiter = ',', group = "levels")]
        nodes: Vec<u32>,
        /// With --nodes: the numbers of PostgreSQL databases (shards) to sweep the node counts
        /// on, comma-separated, e.g. 1,4 (default: every --db given; with --compose, 4). The
        /// first N --db URLs name the servers of N shards.
        #[arg(long, value_delimiter = ',', requires = "nodes")]
        db_counts: Vec<u32>,
        /// With --nodes: cap each engine node at this many cores (e.g. 0.2), so that the nodes
        /// are the bottleneck while NATS, PostgreSQL and the driver have the rest of the
        /// machine: a cgroup (v1 cpu controller: cpu.cfs_quota_us) per local node, compose's
        /// `cpus:` on the compose file's nodes.
        #[arg(long, value_name = "CORES", requires = "nodes")]
        node_cpus: Option<f64>,
        /// With --nodes: run each level on this docker-compose file's cluster
        /// (deploy/docker-compose.yml) through `docker compose` instead of local processes.
        #[arg(long, value_name = "FILE", requires = "nodes")]
        compose: Option<PathBuf>,
        /// Folder of the series (one run directory per level); default runs/sweep-<time>.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Start a cluster on this machine (three NATS servers, four PostgreSQL instances, three
    /// owner nodes and a gateway node, TLS and identities everywhere), load it through the
    /// gateway in rounds of faulty, shuffled trades, and meanwhile inject faults drawn from
    /// --seed: owner nodes killed or stopped, NATS servers killed, PostgreSQL instances
    /// stopped, owner nodes cut off from NATS or from their databases, owner nodes' clocks
    /// jumped (libfaketime), each healed later. Every round and then every shard is checked; a failure
    /// names the seed and the faults applied by then. The schedule, the faults as applied, the
    /// rounds and report.json go to --dir.
    Nemesis {
        /// Seed of the schedule: the same seed, the same faults at the same times.
        #[arg(long)]
        seed: u64,
        /// Minutes of load (the faults fall within it).
        #[arg(long, default_value_t = 2.0)]
        minutes: f64,
        /// Mean time between faults, seconds.
        #[arg(long, default_value_t = 3.0)]
        gap: f64,
        /// The kinds of fault to draw from, comma-separated (default: every kind).
        #[arg(long, value_enum, value_delimiter = ',')]
        kinds: Vec<ste_driver::nemesis::FaultKind>,
        /// Apply only the first K faults of the schedule (the prefix a failure names).
        #[arg(long, value_name = "K")]
        faults: Option<usize>,
        /// Trades of each round of load.
        #[arg(long, default_value_t = 1_000)]
        round_trades: u64,
        /// The run folder; default runs/nemesis-<seed>-<time>.
        #[arg(long)]
        dir: Option<PathBuf>,
        /// Print the report as JSON on stdout.
        #[arg(long)]
        json: bool,
        /// No progress on stderr.
        #[arg(long)]
        quiet: bool,
        /// Print how many faults of each kind the schedule holds, and start nothing.
        #[arg(long)]
        plan: bool,
    },
    /// The limit probe alone: the first messages of a generated set (or of --input), signed,
    /// then signature-checked and parsed on every core, and nothing else, for --seconds.
    Probe {
        #[command(flatten)]
        generation: GenerationArgs,
        /// Probe this message-set file's messages instead (its keys beside it, as a run's).
        #[arg(long)]
        input: Option<PathBuf>,
        /// Seconds to run.
        #[arg(long, default_value_t = 5.0)]
        seconds: f64,
        /// Validate each message whole, as a validator does (fields, reference data,
        /// entitlement, dates, the typed message), instead of only its signature and parse:
        /// the validator's own cost beside the limit's, on the same messages.
        #[arg(long)]
        validate: bool,
        /// Reference data folder (default: the data compiled in).
        #[arg(long)]
        refdata: Option<PathBuf>,
        /// Print the result as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Write the reference-data CSV files (deterministic).
    Refdata {
        /// Folder to write into.
        #[arg(long, default_value = "core/refdata")]
        out: PathBuf,
    },
}

#[derive(Args, Clone)]
struct GenerationArgs {
    /// Number of standard trades (7 messages each).
    #[arg(long, default_value_t = 10_000)]
    trades: u64,
    /// Seed of the generator.
    #[arg(long, default_value_t = DEFAULT_SEED)]
    seed: u64,
    /// Fraction of trades carrying a fault (invalid fields, mismatches, duplicates, cancels,
    /// amends, conflicts, late messages).
    #[arg(long, default_value_t = 0.0)]
    fault_rate: f64,
    /// Shuffle each trade's messages (where the fault allows it).
    #[arg(long)]
    shuffle: bool,
    /// This run's tag in every TradeRef and MsgId (5 of 0-9 and A-Z); default: drawn at
    /// random and printed, so that runs against one long-lived node or cluster never meet
    /// each other's trades. Give a former run's to send its messages again.
    #[arg(long, value_name = "ID")]
    run_id: Option<String>,
}

#[derive(Args, Clone)]
struct RunArgs {
    #[command(flatten)]
    generation: GenerationArgs,
    /// Replay this message-set file instead of generating. With the keys beside it (no
    /// --keys), the signatures `driver generate` made beside it (FILE.signatures) are sent as
    /// they are, instead of signing each line as it is sent, and (unless --resume) the run
    /// fails unless its outcome is the one written beside it (FILE.expected.json), as a
    /// generated run does.
    #[arg(long)]
    input: Option<PathBuf>,
    #[command(flatten)]
    pipeline: PipelineArgs,
    /// Milliseconds a writer waits to fill a batch before committing it (0: commit at once).
    #[arg(long, default_value_t = 0)]
    batch_delay_ms: u64,
    /// Capacity of every inbound, match and store queue.
    #[arg(long, default_value_t = 8192)]
    queue_capacity: usize,
    /// Open-loop injection rate in messages per second (default: as fast as accepted).
    #[arg(long)]
    rate: Option<f64>,
    /// Closed loop: keep at most this many messages injected and not yet acknowledged.
    #[arg(long, value_name = "MESSAGES")]
    window: Option<u64>,
    /// Serve the live dashboard of the run on this address while it runs (default address
    /// 127.0.0.1:8686); `monitor serve RUN_DIR` serves it afterwards.
    #[arg(long, value_name = "ADDR", num_args = 0..=1, default_missing_value = "127.0.0.1:8686")]
    dashboard: Option<String>,
    /// Write every CLS to this file, one per line.
    #[arg(long)]
    cls_out: Option<PathBuf>,
    /// Run directory (summary.json, samples.csv, store files); default runs/<time>.
    #[arg(long)]
    run_dir: Option<PathBuf>,
    /// Reference data folder (default: the data compiled in).
    #[arg(long)]
    refdata: Option<PathBuf>,
    /// The participants' signing keys (CSV bic,key_id,key_hex). Default: FILE.keys.csv beside
    /// an --input FILE when there is one, else a random key set drawn for this run (a --target
    /// engine must be given the same file).
    #[arg(long, env = "STE_KEYS_FILE")]
    keys: Option<PathBuf>,
    /// Continue on shards that already hold messages (the --run-dir of an earlier run, or the
    /// --db shards): matchers are rebuilt from them, and messages they already accepted count
    /// as duplicates.
    #[arg(long)]
    resume: bool,
    /// Send the load to a running engine node instead of running the pipeline in process:
    /// tcp://HOST:PORT or tls://HOST:PORT (its framed-XML listener). The store options then
    /// belong to the engine.
    #[arg(long, value_name = "URL")]
    target: Option<String>,
    /// For a tls:// target: the CA that signed the engine's certificate (PEM).
    #[arg(long, value_name = "FILE")]
    tls_ca: Option<PathBuf>,
    #[command(flatten)]
    tls: TlsIdentityArgs,
    /// Put the load into a cluster of engine nodes on this NATS JetStream server (e.g.
    /// nats://127.0.0.1:4222) as a gateway would, and collect its ACKs and CLS there. The
    /// shards' databases (--db, in shard order) give the summary its final states.
    #[arg(long, value_name = "URL", conflicts_with = "target")]
    nats: Option<String>,
    /// The placement tags of the --nats cluster's servers, one per server (as its nodes were
    /// started with).
    #[arg(long, env = "STE_NATS_PLACEMENT", value_name = "TAGS")]
    nats_placement: Option<String>,
    /// Messages in one batch of a shard's inbound stream of the --nats cluster.
    #[arg(long, value_name = "MESSAGES", default_value_t = ste_engine::cluster::INBOUND_BATCH_MESSAGES_DEFAULT)]
    nats_batch: usize,
    /// Copies of each stream of the --nats cluster: 1 or 3 (as its nodes were started with).
    #[arg(long, env = "STE_NATS_REPLICAS", default_value_t = 1)]
    nats_replicas: usize,
    /// The cluster's secrets folder (`driver secrets`): on --nats, TLS checked against its CA
    /// and the driver connected as a load source, the sink and the monitor, each its own
    /// identity; the shards' database roles' passwords from its `pgpass` (unless PGPASSFILE
    /// names another), on --nats and --store postgres alike.
    #[arg(long, env = "STE_SECRETS_DIR", value_name = "DIR")]
    secrets: Option<PathBuf>,
    /// Before injecting into the --nats cluster, wait up to this many seconds until every
    /// shard has an owner.
    #[arg(long, value_name = "SECONDS", requires = "nats")]
    wait_for_owners_s: Option<u64>,
    /// Seconds a --nats run waits without any new answer before it gives up.
    #[arg(long, default_value_t = 120)]
    stall_timeout_s: u64,
    /// Seconds a --nats run, or a connection of a --target run, waits without any new answer
    /// before it sends the unanswered messages again (a cluster's answers travel on plain
    /// NATS, and one may be lost on its way; the shard answers a message it holds as a
    /// duplicate).
    #[arg(long, default_value_t = 5)]
    resend_after_s: u64,
    /// Connections to the --target engine; a trade's messages share one.
    #[arg(long, default_value_t = 4)]
    connections: usize,
    /// With --target: once every message is answered, how long to go on waiting while no CLS
    /// comes before reporting the trades that did not complete (and failing); also how long to
    /// wait while no answer comes before counting the messages still unanswered (and failing).
    #[arg(long, value_name = "SECONDS", default_value_t = ste_driver::remote::CLS_WAIT_DEFAULT.as_secs_f64())]
    cls_wait: f64,
    /// Seconds of the limit probe once the run is over: the run's first messages, signature
    /// checked and parsed on every core and nothing else; the run's throughput is printed as a
    /// fraction of it (0: no probe).
    #[arg(long, value_name = "SECONDS", default_value_t = 1.0)]
    probe_s: f64,
    /// Print the summary as one JSON object.
    #[arg(long)]
    json: bool,
    /// No progress display.
    #[arg(long)]
    quiet: bool,
}

fn load_refdata(dir: Option<&PathBuf>) -> anyhow::Result<RefData> {
    Ok(match dir {
        Some(dir) => RefData::load(dir).with_context(|| format!("loading {}", dir.display()))?,
        None => RefData::embedded().context("loading the compiled-in reference data")?,
    })
}

/// Where `driver generate --out FILE` puts the key set of the message set it writes.
fn keys_beside(set: &std::path::Path) -> PathBuf {
    PathBuf::from(format!("{}.keys.csv", set.display()))
}

/// The reference data of a run with the key set it signs with: `--keys`, else the keys beside
/// the `--input` set, else (in process only) a random set of this run's own.
fn refdata_with_keys(args: &RunArgs) -> anyhow::Result<RefData> {
    let in_process = args.target.is_none() && args.nats.is_none();
    with_key_ring(
        load_refdata(args.refdata.as_ref())?,
        args.keys.as_deref(),
        args.input.as_deref(),
        in_process,
    )
}

/// `refdata` with the key set of `keys`, else of the keys beside the `input` set, else (where
/// `own_set` allows it: nobody else verifies) a random set drawn now.
fn with_key_ring(
    refdata: RefData,
    keys: Option<&std::path::Path>,
    input: Option<&std::path::Path>,
    own_set: bool,
) -> anyhow::Result<RefData> {
    let beside = input.map(keys_beside).filter(|p| p.exists());
    let ring = match keys.or(beside.as_deref()) {
        Some(path) => {
            KeyRing::load(path).with_context(|| format!("loading keys from {}", path.display()))?
        }
        None if !own_set => bail!(
            "a --target engine or a --nats cluster verifies with its own key file: give the driver the same (--keys FILE)"
        ),
        None => KeyRing::generate_for(&refdata),
    };
    refdata
        .with_keys(&ring)
        .context("installing the signing keys")
}

fn generator_config(args: &GenerationArgs) -> anyhow::Result<GeneratorConfig> {
    if !(0.0..=1.0).contains(&args.fault_rate) {
        bail!("--fault-rate must be between 0 and 1");
    }
    let run = match &args.run_id {
        Some(run) if !ste_engine::generator::is_run_id(run) => {
            bail!("--run-id {run:?} is not 5 characters of 0-9 and A-Z")
        }
        Some(run) => run.clone(),
        None => ste_engine::generator::random_run_id(),
    };
    eprintln!("run id {run}: TradeRefs T{run}…, MsgIds <Sender>-{run}…");
    Ok(GeneratorConfig {
        trades: args.trades,
        seed: args.seed,
        fault_rate: args.fault_rate,
        shuffle: args.shuffle,
        run,
    })
}

fn default_run_dir() -> PathBuf {
    let now = time::OffsetDateTime::now_utc();
    PathBuf::from("runs").join(format!(
        "{:04}{:02}{:02}T{:02}{:02}{:02}Z-{}",
        now.year(),
        u8::from(now.month()),
        now.day(),
        now.hour(),
        now.minute(),
        now.second(),
        std::process::id()
    ))
}

fn print_summary(summary: &Summary) {
    println!(
        "STE run ({} store, {} shards, {} validators)",
        summary.store,
        summary.shards.len(),
        summary.validators
    );
    println!("  trades            {}", summary.outcome.trades);
    print_conservation(
        summary.outcome.messages_in,
        summary.outcome.accepted,
        summary.outcome.duplicates,
        &summary.outcome.exceptions,
        summary.conserved,
    );
    println!(
        "  trades            {} CLS, {} mismatched, {} pending, {} cancelled",
        summary.outcome.cls,
        summary.outcome.mismatched_trades,
        summary.outcome.pending_trades,
        summary.outcome.cancelled_trades
    );
    println!(
        "  elapsed           {:.2} s   throughput {:.0} msg/s   peak RSS {:.0} MiB",
        summary.elapsed_s, summary.throughput_msg_s, summary.peak_rss_mb
    );
    if !summary.rss_mb_at_answered.is_empty() {
        let marks: Vec<String> = summary
            .rss_mb_at_answered
            .iter()
            .map(|mark| match mark.answered_pct {
                100 => format!("stopped {:.0}", mark.rss_mb),
                pct => format!("{pct}% {:.0}", mark.rss_mb),
            })
            .collect();
        println!(
            "  RSS MiB           {}   (when that share of the messages was answered; once the pipeline stopped)",
            marks.join("   ")
        );
    }
    if summary.store == StoreKind::Memory.as_str() {
        println!(
            "  memory store      keeps every message, trade and CLS in memory until the run ends: its RSS grows with the run"
        );
    }
    if let Some(process) = summary.process_cpu_s {
        let per_message = |seconds: f64| 1e6 * seconds / summary.outcome.messages_in.max(1) as f64;
        let counted: f64 = summary.station_cpu_s.values().sum::<f64>()
            + summary.thread_cpu_s.values().sum::<f64>();
        let parts: Vec<String> = summary
            .station_cpu_s
            .iter()
            .chain(&summary.thread_cpu_s)
            .filter(|(_, seconds)| per_message(**seconds) >= 0.005)
            .map(|(role, seconds)| format!("{role} {:.2}", per_message(*seconds)))
            .chain([format!(
                "rest {:.2}",
                per_message((process - counted).max(0.0))
            )])
            .collect();
        println!(
            "  CPU µs/msg        {:.2}   {}",
            per_message(process),
            parts.join("   ")
        );
    }
    if let Some(probe) = &summary.limit_probe {
        println!(
            "  limit probe       {:.0} msg/s (signature and parse only, {} threads)   this run {:.3} of it",
            probe.msgs_per_s,
            probe.threads,
            probe.fraction(summary.throughput_msg_s)
        );
    }
    if let (Some(first), Some(last)) = (
        summary.throughput_first_10pct_msg_s,
        summary.throughput_last_10pct_msg_s,
    ) {
        println!(
            "  stored msg/s      first 10% {first:.0}   last 10% {last:.0}   ({:+.1}%)",
            (last / first - 1.0) * 100.0
        );
    }
    println!(
        "  CLS latency ms    p50 {:.2}  p99 {:.2}  p99.9 {:.2}  max {:.2}",
        summary.latency_ms.p50,
        summary.latency_ms.p99,
        summary.latency_ms.p999,
        summary.latency_ms.max
    );
    println!(
        "  {:<12} {:>10} {:>10} {:>7} {:>9} {:>9} {:>10} {:>12}",
        "station", "C", "X/s", "U", "S_ms", "N", "R_ms", "R_direct_ms"
    );
    for station in &summary.stations {
        println!(
            "  {:<12} {:>10} {:>10.0} {:>7.3} {:>9.4} {:>9.2} {:>10.3} {:>12.3}",
            station.name,
            station.C,
            station.X,
            station.U,
            station.S_ms,
            station.N,
            station.R_ms,
            station.R_direct_ms
        );
    }
    if summary.sampler_on_time == Some(false) {
        println!(
            "  sampling          at normal priority (real-time refused): N and R from the \
             samples lean late in the pipeline when the cores are busy"
        );
    }
    if let Some(bottleneck) = &summary.bottleneck {
        println!("  bottleneck        {bottleneck}");
    }
    for (index, shard) in summary.shards.iter().enumerate() {
        println!(
            "  shard {index}           {} trades, {} messages",
            shard.trades, shard.messages
        );
    }
    if let Some(matches) = summary.matches_expected {
        println!(
            "  expected outcome  {}",
            if matches {
                "matched exactly"
            } else {
                "DIFFERS"
            }
        );
    }
    if let Some(misrouted) = summary.misrouted_trades {
        println!(
            "  routing           {}",
            if misrouted == 0 {
                "every shard holds only the trades routed to it".to_owned()
            } else {
                format!("{misrouted} trades on a shard the routing rule does not name")
            }
        );
    }
    println!("  run directory     {}", summary.run_dir);
}

fn main() -> std::process::ExitCode {
    // Errors are printed with their causes, without a backtrace: they are for users.
    match run_cli() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run_cli() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
                tracing_subscriber::EnvFilter::new("warn,sqlx=error,ste_engine::pipeline=info")
            }),
        )
        .init();
    let cli = Cli::parse();
    // The database roles' passwords for every run, sweep and migration, and for the nodes a
    // sweep starts.
    let secrets = match &cli.command {
        Some(Command::Sweep { run, .. }) => run.secrets.as_ref(),
        Some(Command::Migrate { secrets, .. }) => secrets.as_ref(),
        _ => None,
    };
    if let Some(secrets) = secrets.or(cli.run.secrets.as_ref()) {
        ste_engine::store::PgStore::use_password_file_in(secrets);
    }
    let nemesis_dir = match &cli.command {
        Some(Command::Nemesis { dir, seed, .. }) => {
            let dir = dir.clone().unwrap_or_else(|| {
                PathBuf::from(format!(
                    "runs/nemesis-{seed}-{}",
                    std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0, |since| since.as_secs())
                ))
            });
            // Absolute: the database servers run in folders of their own and put their
            // sockets under it.
            Some(
                std::env::current_dir()
                    .context("the current folder")?
                    .join(dir),
            )
        }
        _ => None,
    };
    if let Some(dir) = &nemesis_dir {
        // The run makes the shards' roles' passwords there once its instances start; nothing
        // else has started yet.
        if std::env::var_os("PGPASSFILE").is_none() {
            std::env::set_var("PGPASSFILE", ste_driver::nemesis::password_file(dir));
        }
    }
    match cli.command {
        Some(Command::Refdata { out }) => {
            ste_engine::refdata::generate::write_files(&out)
                .with_context(|| format!("writing {}", out.display()))?;
            eprintln!("reference data written to {}", out.display());
            Ok(())
        }
        Some(Command::Generate {
            generation,
            out,
            refdata,
        }) => {
            let refdata = load_refdata(refdata.as_ref())?;
            let ring = KeyRing::generate_for(&refdata);
            let refdata = refdata.with_keys(&ring).context("installing the keys")?;
            let signatures_path = ste_driver::signatures_beside(&out);
            let expected = ste_driver::write_message_set(
                &refdata,
                generator_config(&generation)?,
                &out,
                Some(&signatures_path),
            )?;
            let expected_path = ste_driver::expected_beside(&out);
            std::fs::write(&expected_path, serde_json::to_string_pretty(&expected)?)
                .with_context(|| format!("writing {}", expected_path.display()))?;
            let keys_path = keys_beside(&out);
            ring.write(&keys_path)
                .with_context(|| format!("writing {}", keys_path.display()))?;
            eprintln!(
                "{} messages of {} trades written to {} (expected outcome in {}, a random key set in {}, each line signed with it in {})",
                expected.messages_in,
                expected.trades,
                out.display(),
                expected_path.display(),
                keys_path.display(),
                signatures_path.display()
            );
            Ok(())
        }
        Some(Command::Probe {
            generation,
            input,
            seconds,
            validate,
            refdata,
            json,
        }) => {
            if !(seconds > 0.0 && seconds <= 600.0) {
                bail!("--seconds must be above 0 and at most 600");
            }
            let refdata = with_key_ring(
                load_refdata(refdata.as_ref())?,
                None,
                input.as_deref(),
                true,
            )?;
            let sample = match &input {
                Some(path) => ste_driver::probe::file_sample(&refdata, path)?,
                None => {
                    let config = generator_config(&generation)?;
                    ste_driver::probe::generated_sample(&refdata, &config)
                }
            };
            let work = if validate {
                ste_driver::probe::ProbeWork::Validate
            } else {
                ste_driver::probe::ProbeWork::Limit
            };
            let probe = ste_driver::probe::run_work(
                &refdata,
                &sample,
                Duration::from_secs_f64(seconds),
                work,
            );
            if json {
                println!("{}", serde_json::to_string_pretty(&probe)?);
            } else {
                println!(
                    "{}: {:.0} msg/s on {} threads ({} messages in {:.2} s over {} distinct, {} refused)",
                    if validate { "validator alone" } else { "limit probe" },
                    probe.msgs_per_s,
                    probe.threads,
                    probe.messages,
                    probe.seconds,
                    probe.distinct,
                    probe.refused
                );
            }
            Ok(())
        }
        Some(Command::Secrets {
            dir,
            hosts,
            gateways,
            loads,
            shards,
            rotate,
            retire,
        }) => {
            use ste_driver::secrets;
            use ste_engine::cluster::roles::Role;
            if let Some(identity) = rotate {
                secrets::rotate(&dir, Role::parse(&identity)?)?;
                eprintln!("{identity} has a new key; its old one stays allowed until --retire {identity}: reload the NATS servers, restart its processes, then retire");
            } else if let Some(identity) = retire {
                secrets::retire(&dir, Role::parse(&identity)?)?;
                eprintln!("{identity}'s old key is no longer allowed: reload the NATS servers");
            } else {
                let made = secrets::ensure(&secrets::SecretsSpec {
                    dir: dir.clone(),
                    hosts,
                    gateways,
                    loads,
                    shards,
                })?;
                eprintln!("{} files made in {}", made.len(), dir.display());
            }
            Ok(())
        }
        Some(Command::Migrate { db, .. }) => {
            for url in &db {
                ste_engine::store::PgStore::open(url).context("migrating a shard's database")?;
            }
            eprintln!("{} shard databases migrated", db.len());
            Ok(())
        }
        Some(Command::Nemesis {
            seed,
            minutes,
            gap,
            kinds,
            faults,
            round_trades,
            dir: _,
            json,
            quiet,
            plan,
        }) => nemesis(
            plan,
            ste_driver::nemesis::NemesisConfig {
                seed,
                span: Duration::try_from_secs_f64(minutes * 60.0)
                    .context("--minutes is a number of minutes")?,
                mean_gap: Duration::try_from_secs_f64(gap)
                    .context("--gap is a number of seconds")?,
                kinds: if kinds.is_empty() {
                    ste_driver::nemesis::FaultKind::ALL.to_vec()
                } else {
                    kinds
                },
                faults,
                round_trades: round_trades.max(1),
                dir: nemesis_dir.expect("set for the nemesis"),
                engine: PathBuf::new(),
                nats_server: PathBuf::new(),
                local_cluster: PathBuf::new(),
                bin_dir: PathBuf::new(),
                libfaketime: ste_driver::nemesis::find_libfaketime(),
                progress: !quiet,
            },
            json,
        ),
        Some(Command::Keys { out, refdata }) => {
            let refdata = load_refdata(refdata.as_ref())?;
            KeyRing::generate_for(&refdata)
                .write(&out)
                .with_context(|| format!("writing {}", out.display()))?;
            eprintln!(
                "random keys of {} participants written to {}",
                refdata.participants().len(),
                out.display()
            );
            Ok(())
        }
        Some(Command::Sweep {
            run,
            windows,
            rates,
            shard_counts,
            validator_counts,
            nodes,
            db_counts,
            node_cpus,
            compose,
            out,
        }) => {
            if !nodes.is_empty() {
                return node_sweep::sweep_nodes(*run, &nodes, &db_counts, node_cpus, compose, out);
            }
            // Exactly one of the four is given (clap's "levels" group).
            let level = Level::default();
            let levels: Vec<Level> = windows
                .iter()
                .map(|&w| Level {
                    window: Some(w),
                    ..level
                })
                .chain(rates.iter().map(|&r| Level {
                    rate: Some(r),
                    ..level
                }))
                .chain(shard_counts.iter().map(|&n| Level {
                    shards: Some(n),
                    ..level
                }))
                .chain(validator_counts.iter().map(|&n| Level {
                    validators: Some(n),
                    ..level
                }))
                .collect();
            sweep(*run, &levels, out)
        }
        None => run(cli.run),
    }
}

fn run(args: RunArgs) -> anyhow::Result<()> {
    let refdata = Arc::new(refdata_with_keys(&args)?);
    let json = args.json;
    if let Some(target) = args.target.clone() {
        return run_remote(args, target, refdata);
    }
    let dashboard_address = args.dashboard.clone();
    let placement = ste_engine::queue::jetstream::Placement::parse(
        args.nats_placement.as_deref(),
        args.nats_replicas,
    )
    .map_err(anyhow::Error::msg)?;
    let cluster = args
        .nats
        .clone()
        .map(|url| ste_driver::cluster::ClusterTarget {
            url,
            lease_ttl: Duration::from_secs(3),
            stall_timeout: Duration::from_secs(args.stall_timeout_s.max(1)),
            resend_after: Duration::from_secs(args.resend_after_s.max(1)),
            batch_messages: args.nats_batch.max(1),
            placement,
            wait_for_owners: args
                .wait_for_owners_s
                .map(|s| Duration::from_secs(s.max(1))),
            secrets: args.secrets.clone(),
        });
    let config = run_config(args)?;
    let _dashboard = match dashboard_address {
        Some(address) => {
            std::fs::create_dir_all(&config.run_dir)
                .with_context(|| format!("creating {}", config.run_dir.display()))?;
            let dashboard = ste_monitor::serve::Dashboard::start(&config.run_dir, &address)
                .context("starting the dashboard")?;
            eprintln!("dashboard on http://{}/", dashboard.address());
            Some(dashboard)
        }
        None => None,
    };
    let summary = match &cluster {
        Some(target) => ste_driver::cluster::run_cluster(&config, target, refdata)?,
        None => ste_driver::run(&config, refdata)?,
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&summary)?);
    } else {
        print_summary(&summary);
    }
    check_summary(&summary)
}

/// Runs the nemesis with the programs beside this driver and the repository's
/// `deploy/local-cluster.sh`, prints its report and fails on any violation.
fn nemesis(
    plan: bool,
    mut config: ste_driver::nemesis::NemesisConfig,
    json: bool,
) -> anyhow::Result<()> {
    if plan {
        let mut faults =
            ste_driver::nemesis::schedule(config.seed, config.span, config.mean_gap, &config.kinds);
        faults.truncate(config.faults.unwrap_or(usize::MAX));
        println!("nemesis seed {}: {} faults", config.seed, faults.len());
        for kind in &config.kinds {
            let count = faults.iter().filter(|f| f.kind == *kind).count();
            println!("{:<10} {count}", kind.name());
        }
        return Ok(());
    }
    let (engine, nats_server) = ste_driver::scale::local_programs()?;
    config.bin_dir = engine.parent().context("the programs' folder")?.to_owned();
    config.engine = engine;
    config.nats_server = nats_server;
    config.local_cluster = match std::env::var_os("STE_LOCAL_CLUSTER") {
        Some(path) => PathBuf::from(path),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/local-cluster.sh"),
    };
    if !config.local_cluster.exists() {
        bail!(
            "{} is missing: run the nemesis from the repository, or name the script in \
             STE_LOCAL_CLUSTER",
            config.local_cluster.display()
        );
    }
    let (seed, minutes) = (config.seed, config.span.as_secs_f64() / 60.0);
    let report = ste_driver::nemesis::run(&config, load_refdata(None)?)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!(
            "nemesis seed {seed}: {} faults applied of {} scheduled, {} rounds, {} messages, \
             {:.0} answers/s over {:.0} s; {} owners' commits checked for their fencing tokens",
            report.faults.len(),
            report.faults_scheduled,
            report.rounds.len(),
            report.messages,
            report.answers_per_s,
            report.elapsed_s,
            report.commits_checked
        );
        print!("{}", ste_driver::nemesis::by_kind(&report));
        println!("run folder {}", config.dir.display());
    }
    match &report.failure {
        None => Ok(()),
        Some(failure) => bail!(
            "nemesis seed {seed} failed {:.1} s into the load, after {} faults: {}\n\
             the schedule's prefix that shows it: driver nemesis --seed {seed} --minutes {minutes} \
             --gap {} --kinds {} --round-trades {} --faults {} (schedule.csv and faults.csv in {})",
            failure.at_s,
            failure.faults_applied,
            failure.what,
            config.mean_gap.as_secs_f64(),
            config
                .kinds
                .iter()
                .map(|kind| kind.name())
                .collect::<Vec<_>>()
                .join(","),
            config.round_trades,
            failure.faults_applied,
            config.dir.display()
        ),
    }
}

/// In-flight messages per connection to a --target engine unless --window says otherwise.
const REMOTE_WINDOW: u64 = 4096;

fn run_remote(args: RunArgs, target: String, refdata: Arc<RefData>) -> anyhow::Result<()> {
    let json = args.json;
    let config = RemoteConfig {
        tls: args.tls_ca.clone().map(|ca| ste_bridge::tls::ClientTls {
            ca,
            identity: args.tls.pair(),
        }),
        address: target,
        connections: args.connections,
        window: args.window.unwrap_or(REMOTE_WINDOW),
        source: match &args.input {
            Some(path) => Source::File(path.clone()),
            None => Source::Generated(generator_config(&args.generation)?),
        },
        progress: !args.quiet,
        cls_wait: Duration::try_from_secs_f64(args.cls_wait)
            .context("--cls-wait is a number of seconds")?,
        answers: Default::default(),
        resend_after: Duration::from_secs(args.resend_after_s.max(1)),
    };
    let summary = run_remote_load(&config, refdata)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&summary)?);
    } else {
        println!(
            "STE run against {} ({} connections, {} in flight each)",
            summary.target, summary.connections, summary.window
        );
        print_conservation(
            summary.messages_in,
            summary.accepted,
            summary.duplicates,
            &summary.exceptions,
            summary.conserved,
        );
        println!("  CLS pushed        {}", summary.cls);
        println!(
            "  elapsed           {:.2} s, {:.0} msg/s",
            summary.elapsed_s, summary.throughput_msg_s
        );
        let l = &summary.ack_latency_ms;
        println!(
            "  ACK latency ms    p50 {:.2}  p99 {:.2}  p99.9 {:.2}  max {:.2}",
            l.p50, l.p99, l.p999, l.max
        );
        if let Some(matches) = summary.matches_expected {
            println!(
                "  expected outcome  {}",
                if matches { "matched" } else { "DIFFERS" }
            );
        }
    }
    if summary.unanswered > 0 {
        eprintln!(
            "{} messages had no answer after {:.0} s without one",
            summary.unanswered,
            config.cls_wait.as_secs_f64()
        );
    }
    if summary.missing_cls > 0 {
        report_missing(&summary, config.cls_wait);
    }
    check_outcome(summary.conserved, summary.matches_expected)
}

/// Says which trades did not complete within the wait for their CLS, and what the answers
/// say about why: the reason codes that came more or less often than the generator expected.
fn report_missing(summary: &ste_driver::remote::RemoteSummary, waited: Duration) {
    eprintln!(
        "{} trades expected to match have no CLS after {:.0} s without one: {}{}",
        summary.missing_cls,
        waited.as_secs_f64(),
        summary.missing_cls_ids.join(" "),
        if summary.missing_cls > summary.missing_cls_ids.len() as u64 {
            " …"
        } else {
            ""
        }
    );
    let Some(expected) = &summary.expected else {
        return;
    };
    let codes: std::collections::BTreeSet<&String> = expected
        .exceptions
        .keys()
        .chain(summary.exceptions.keys())
        .collect();
    for code in codes {
        let (want, got) = (
            expected.exceptions.get(code).copied().unwrap_or(0),
            summary.exceptions.get(code).copied().unwrap_or(0),
        );
        if want != got {
            eprintln!("  {code}: {got} answered, {want} expected");
        }
    }
    if expected.accepted != summary.accepted || expected.duplicates != summary.duplicates {
        eprintln!(
            "  accepted {} and duplicates {}, against {} and {} expected",
            summary.accepted, summary.duplicates, expected.accepted, expected.duplicates
        );
    }
    let count = |outcome: &std::collections::BTreeMap<String, u64>| {
        outcome
            .get(ste_engine::reason::ReasonCode::DupId.as_str())
            .copied()
            .unwrap_or(0)
    };
    if count(&summary.exceptions) > count(&expected.exceptions)
        || summary.duplicates > expected.duplicates
    {
        eprintln!(
            "  more E_DUPID or duplicates than expected: MsgIds this node had seen before (a run with the same --run-id, or a file replayed)"
        );
    }
}

fn check_summary(summary: &Summary) -> anyhow::Result<()> {
    check_outcome(summary.conserved, summary.matches_expected)
}

/// A run fails when it broke conservation or differs from what the generator expected.
fn check_outcome(conserved: bool, matches_expected: Option<bool>) -> anyhow::Result<()> {
    if !conserved {
        bail!("conservation violated: messages_in != accepted + duplicates + exceptions");
    }
    if matches_expected == Some(false) {
        bail!("the outcome differs from what the generator expected");
    }
    Ok(())
}

/// The conservation line of a summary, and the exceptions by code.
fn print_conservation(
    messages_in: u64,
    accepted: u64,
    duplicates: u64,
    exceptions: &std::collections::BTreeMap<String, u64>,
    conserved: bool,
) {
    println!(
        "  messages in       {messages_in}  = accepted {accepted} + duplicates {duplicates} + exceptions {}  [{}]",
        exceptions.values().sum::<u64>(),
        if conserved { "conserved" } else { "NOT CONSERVED" }
    );
    if !exceptions.is_empty() {
        let codes: Vec<String> = exceptions
            .iter()
            .map(|(code, count)| format!("{code}={count}"))
            .collect();
        println!("  exceptions        {}", codes.join(" "));
    }
}

/// What one level of a sweep sets; the rest comes from the run options.
#[derive(Debug, Clone, Copy, Default)]
struct Level {
    window: Option<u64>,
    rate: Option<f64>,
    shards: Option<u32>,
    validators: Option<u32>,
}

/// One point of a sweep.
#[derive(serde::Serialize)]
#[allow(non_snake_case)]
struct SweepPoint {
    level: usize,
    window: Option<u64>,
    rate_msg_s: Option<f64>,
    shards: u32,
    validators: u32,
    /// System throughput, messages per second.
    X: f64,
    /// Mean messages in the system: the sum of the stations' N.
    N: f64,
    /// Response time of a message through the system, ms: the stations' R = W / C from their
    /// samples (Little's law at each station), weighted by visits per message and summed.
    R_ms: f64,
    /// The same from the stations' directly measured response times, summed along the path.
    R_direct_ms: f64,
    cls_p50_ms: f64,
    cls_p99_ms: f64,
    bottleneck: Option<String>,
    /// CPU this process spent per message at this level, µs: the cores' demand as measured here.
    D_us: Option<f64>,
    /// What MVA predicts at this level from the measured demands (see `SweepModel`).
    X_mva: Option<f64>,
    R_mva_ms: Option<f64>,
    /// The same model with this level's own measured CPU per message (`D_us`) as the cores'
    /// demand: what the cores and the delay allow once what a message costs at this load is known.
    X_mva_level: Option<f64>,
    /// Whether the model applies at this level: the cores were at least 90% busy (X × D_us / c).
    /// Below that, messages in flight leave the cores idle while threads wait for batches and for
    /// each other, which no closed network of load-independent stations represents.
    mva_applies: Option<bool>,
    run_dir: String,
}

impl SweepPoint {
    /// The columns of `sweep.csv` and of the printed table.
    const COLUMNS: &'static [&'static str] = &[
        "level",
        "window",
        "rate_msg_s",
        "shards",
        "validators",
        "X",
        "N",
        "R_ms",
        "R_direct_ms",
        "cls_p50_ms",
        "cls_p99_ms",
        "bottleneck",
        "D_us",
        "X_mva",
        "R_mva_ms",
        "X_mva_level",
        "mva_applies",
    ];

    /// This point's cells, in the order of [`Self::COLUMNS`].
    fn cells(&self) -> Vec<String> {
        vec![
            self.level.to_string(),
            self.window.map(|w| w.to_string()).unwrap_or_default(),
            self.rate_msg_s.map(|r| r.to_string()).unwrap_or_default(),
            self.shards.to_string(),
            self.validators.to_string(),
            format!("{:.1}", self.X),
            format!("{:.3}", self.N),
            format!("{:.4}", self.R_ms),
            format!("{:.4}", self.R_direct_ms),
            format!("{:.3}", self.cls_p50_ms),
            format!("{:.3}", self.cls_p99_ms),
            self.bottleneck.clone().unwrap_or_default(),
            optional_cell(self.D_us, 3),
            optional_cell(self.X_mva, 4),
            optional_cell(self.R_mva_ms, 4),
            optional_cell(self.X_mva_level, 1),
            self.mva_applies.map(|a| a.to_string()).unwrap_or_default(),
        ]
    }
}

/// The model of a sweep: the machine's cores as one station of `c` servers, whose demand is the
/// CPU this process (driver and engine, every thread) spent per message at the most loaded
/// level — the validators, matchers, writers, the sink and the driver's own generating and
/// signing all take their turns on the same cores — and a delay station for the rest of a
/// message's time round the loop at the least loaded level, which it spent on no core (a batch
/// filling, a thread waking, the way back of its answer). At small windows the delay bounds the
/// rate (W / loop time); as the window grows the cores saturate at `c / D`. A station per
/// thread, each with a processor of its own, would predict what two cores cannot give.
///
/// Each level is also given the same model with its own measured CPU per message
/// (`X_mva_level`), and is marked where the model applies (`mva_applies`: the cores at least
/// 90% busy). In between the two ends a message costs more than at saturation (its batches are
/// smaller) and waits for batch-mates and hand-overs off the cores; the model, whose demand and
/// delay do not change with the load, predicts more than such a level gives.
struct SweepModel {
    /// The cores and the off-core delay; no think time: the loop's time off the cores is in the
    /// delay station.
    stations: Vec<ste_monitor::mva::Station>,
}

/// The share of the cores' time a level must keep busy for the sweep's model to apply to it.
const MVA_BUSY_CORES: f64 = 0.9;

fn sweep_model(first: &Summary, last: &Summary) -> Option<SweepModel> {
    use ste_monitor::mva::{Kind, Station};
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as u32;
    let demand = last.process_cpu_s? / last.outcome.messages_in.max(1) as f64;
    if demand <= 0.0 || first.throughput_msg_s <= 0.0 {
        return None;
    }
    // A message's time round the loop at the least loaded level: the window over the rate in a
    // closed loop (Little), the stations' residence times along its path in an open one.
    let messages = first.outcome.messages_in.max(1) as f64;
    let loop_s = match first.window {
        Some(window) => window as f64 / first.throughput_msg_s,
        None => first
            .stations
            .iter()
            .map(|s| s.R_direct_ms / 1e3 * s.C as f64 / messages)
            .sum(),
    };
    let mut stations = vec![Station {
        name: "cores".to_owned(),
        kind: Kind::MultiServer(cores),
        service: demand,
        visits: 1.0,
    }];
    if loop_s > demand {
        stations.push(Station {
            name: "off-core".to_owned(),
            kind: Kind::Delay,
            service: loop_s - demand,
            visits: 1.0,
        });
    }
    Some(SweepModel { stations })
}

/// How often a sweep's levels sample their stations unless `--sample-ms` is given. N and R come
/// from the stations' station-time counters, exact whatever the instants they are read at, so
/// the interval sets only the resolution of the queue-length charts (a level lasts a second or
/// a few: a thousand samples or more) and what the sampler takes from the cores it measures:
/// every 250 µs, as when the lengths at the instants were the estimate, about 3% of them at a
/// window of 16 (BENCHMARKS.md).
const SWEEP_SAMPLE_INTERVAL: std::time::Duration = std::time::Duration::from_millis(1);

fn sweep(args: RunArgs, levels: &[Level], out: Option<PathBuf>) -> anyhow::Result<()> {
    if args.run_dir.is_some() || args.resume {
        bail!("a sweep makes one fresh run directory per level under --out; --run-dir and --resume do not apply");
    }
    let refdata = Arc::new(refdata_with_keys(&args)?);
    let out = out.unwrap_or_else(|| {
        let mut dir = default_run_dir();
        dir.set_file_name(format!(
            "sweep-{}",
            dir.file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default()
        ));
        dir
    });
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let base = run_config(args)?;
    let mut points = Vec::with_capacity(levels.len());
    let mut summaries = Vec::with_capacity(levels.len());
    if levels.iter().any(|l| l.shards.is_some()) && base.settings.store == StoreKind::Postgres {
        bail!("the postgres store has one shard per database URL: sweep its shard count by running with other URLs");
    }
    for (level, spec) in levels.iter().enumerate() {
        let name = match *spec {
            Level {
                window: Some(window),
                ..
            } => format!("level-{level}-window-{window}"),
            Level {
                rate: Some(rate), ..
            } => format!("level-{level}-rate-{rate}"),
            Level {
                shards: Some(shards),
                ..
            } => format!("level-{level}-shards-{shards}"),
            Level {
                validators: Some(validators),
                ..
            } => {
                format!("level-{level}-validators-{validators}")
            }
            _ => format!("level-{level}"),
        };
        let (window, rate) = (spec.window, spec.rate);
        let mut settings = base.settings.clone();
        if !settings.sample_given {
            settings.sample_interval = SWEEP_SAMPLE_INTERVAL;
        }
        settings.shards = spec.shards.unwrap_or(settings.shards).max(1);
        settings.validators = spec.validators.unwrap_or(settings.validators).max(1);
        let config = RunConfig {
            window: window.or(base.window),
            rate_msgs_per_s: rate.filter(|rate| *rate > 0.0).or(base.rate_msgs_per_s),
            settings,
            run_dir: out.join(&name),
            ..base.clone()
        };
        eprintln!("sweep level {level}: {name}");
        let summary = ste_driver::run(&config, refdata.clone())?;
        check_summary(&summary)?;
        let population: f64 = summary.stations.iter().map(|s| s.N).sum();
        // A message's time along its path: each station's response time weighted by its visits
        // per message, from the samples (W / C over the sampler's window, W from the stations'
        // station-time counters) and item by item.
        // N / X would divide the sampler's population by a throughput over the driver's
        // elapsed time, a window 0.4–3.8% shorter in a run of a second or two.
        let messages = summary.outcome.messages_in.max(1) as f64;
        let along_path = |r_ms: fn(&ste_driver::StationSummary) -> f64| -> f64 {
            summary
                .stations
                .iter()
                .filter(|s| s.C > 0)
                .map(|s| r_ms(s) * s.C as f64 / messages)
                .sum()
        };
        points.push(SweepPoint {
            level,
            window: config.window,
            rate_msg_s: config.rate_msgs_per_s,
            shards: config.settings.shards,
            validators: config.settings.validators,
            X: summary.throughput_msg_s,
            N: population,
            R_ms: along_path(|s| s.R_ms),
            R_direct_ms: along_path(|s| s.R_direct_ms),
            cls_p50_ms: summary.latency_ms.p50,
            cls_p99_ms: summary.latency_ms.p99,
            bottleneck: summary.bottleneck.clone(),
            D_us: summary.process_cpu_s.map(|cpu| 1e6 * cpu / messages),
            X_mva: None,
            R_mva_ms: None,
            X_mva_level: None,
            mva_applies: None,
            run_dir: config.run_dir.display().to_string(),
        });
        summaries.push(summary);
    }
    let chart = out.join("littles-law.svg");
    let mut curve = ste_monitor::chart::LittleCurve {
        title: format!(
            "Little's law: {} levels, {}",
            points.len(),
            base.settings.store.as_str()
        ),
        measured: points
            .iter()
            .map(|p| ste_monitor::chart::CurvePoint {
                x: p.X,
                n: p.N,
                r_ms: p.R_ms,
            })
            .collect(),
        ..Default::default()
    };
    // The model is of load levels on one configuration: shard and worker counts change it.
    let load_levels = levels
        .iter()
        .all(|l| l.window.is_some() || l.rate.is_some());
    if let (true, Some(first), Some(last)) = (load_levels, summaries.first(), summaries.last()) {
        if let Some(model) = sweep_model(first, last) {
            predict(&model, &mut points, &mut curve)?;
        }
    }
    ste_monitor::chart::write_svg(&curve, &chart)?;
    write_series(
        &out,
        SweepPoint::COLUMNS,
        points.iter().map(SweepPoint::cells).collect(),
        &points,
        &chart,
    )
}

/// Writes a sweep's points to `sweep.csv` (`header`, `rows`) and `sweep.json` (`points`) in
/// `out`, prints the rows as a table, and says where they are beside its `chart`.
fn write_series(
    out: &std::path::Path,
    header: &[&str],
    rows: Vec<Vec<String>>,
    points: &impl serde::Serialize,
    chart: &std::path::Path,
) -> anyhow::Result<()> {
    let mut csv = header.join(",") + "\n";
    for row in &rows {
        csv.push_str(&row.join(","));
        csv.push('\n');
    }
    std::fs::write(out.join("sweep.csv"), &csv).context("writing sweep.csv")?;
    std::fs::write(
        out.join("sweep.json"),
        serde_json::to_string_pretty(points)?,
    )
    .context("writing sweep.json")?;
    // The same cells as a table, each column as wide as its widest cell.
    let widths: Vec<usize> = (0..header.len())
        .map(|k| {
            rows.iter()
                .map(|row| row[k].len())
                .chain([header[k].len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    for row in std::iter::once(header.iter().map(|h| h.to_string()).collect::<Vec<_>>()).chain(rows)
    {
        let cells: Vec<String> = row
            .iter()
            .zip(&widths)
            .map(|(cell, width)| format!("{cell:>width$}"))
            .collect();
        println!("{}", cells.join(" "));
    }
    eprintln!(
        "series written to {} (sweep.csv, sweep.json, {})",
        out.display(),
        chart.display()
    );
    Ok(())
}

/// A table cell of an optional figure, with `places` decimals (empty without one).
fn optional_cell(value: Option<f64>, places: usize) -> String {
    value.map(|v| format!("{v:.places$}")).unwrap_or_default()
}

/// Fills in the MVA prediction of every level and of the curve: exact MVA over the windows of a
/// closed-loop sweep, the open-network solution over the rates of an open-loop one.
fn predict(
    model: &SweepModel,
    points: &mut [SweepPoint],
    curve: &mut ste_monitor::chart::LittleCurve,
) -> anyhow::Result<()> {
    use ste_monitor::chart::CurvePoint;
    use ste_monitor::mva;
    let demands = mva::demands(&model.stations, 0.0)?;
    if demands.D_max > 0.0 {
        curve.x_bound = Some(1.0 / demands.D_max);
    }
    // MVA takes a message's demand on the cores to be the same at every load, and the time off
    // them to be a fixed delay; where batches are small a message costs more (each batch's
    // wake-ups, hand-overs and commit are shared by fewer messages) and waits for its batch,
    // and the model over-predicts what the cores give.
    let cores = f64::from(model.stations[0].kind.servers().unwrap_or(1));
    for p in points.iter_mut() {
        p.mva_applies = p
            .D_us
            .map(|measured| p.X * measured / 1e6 / cores >= MVA_BUSY_CORES);
        if let (Some(window), Some(measured)) = (p.window, p.D_us) {
            let mut stations = model.stations.clone();
            stations[0].service = measured / 1e6;
            let population = u32::try_from(window).unwrap_or(u32::MAX).min(1 << 20);
            p.X_mva_level = mva::closed(&stations, 0.0, population)?
                .last()
                .map(|at| at.X);
        }
    }
    let largest_window = points.iter().filter_map(|p| p.window).max();
    if let Some(largest) = largest_window {
        let population = u32::try_from(largest).unwrap_or(u32::MAX).min(1 << 20);
        let solution = mva::closed(&model.stations, 0.0, population)?;
        for p in points.iter_mut() {
            if let Some(at) = p.window.and_then(|w| solution.get(w as usize - 1)) {
                p.X_mva = Some(at.X);
                p.R_mva_ms = Some(at.R * 1e3);
            }
        }
        // About a hundred points, spaced evenly on a log scale of n.
        let mut n = 1.0_f64;
        while (n as usize) <= solution.len() {
            let at = &solution[n as usize - 1];
            curve.predicted.push(CurvePoint {
                x: at.X,
                n: at.X * at.R,
                r_ms: at.R * 1e3,
            });
            n = (n * 1.1).max(n + 1.0);
        }
    } else if let Some(bound) = curve.x_bound {
        for p in points.iter_mut() {
            if let Some(rate) = p.rate_msg_s.filter(|rate| *rate < bound) {
                let at = mva::open(&model.stations, rate)?;
                p.X_mva = Some(rate);
                p.R_mva_ms = Some(at.R * 1e3);
            }
        }
        for step in 1..100 {
            let rate = bound * f64::from(step) / 100.0;
            let at = mva::open(&model.stations, rate)?;
            curve.predicted.push(CurvePoint {
                x: rate,
                n: at.N,
                r_ms: at.R * 1e3,
            });
        }
    }
    Ok(())
}

fn run_config(args: RunArgs) -> anyhow::Result<RunConfig> {
    let source = match &args.input {
        Some(path) => Source::File(path.clone()),
        None => Source::Generated(generator_config(&args.generation)?),
    };
    // A cluster's shards are PostgreSQL databases.
    let scope = if args.nats.is_some() {
        Scope::Cluster
    } else {
        Scope::InProcess
    };
    let settings = args.pipeline.resolve(scope)?;
    if args.resume && args.run_dir.is_none() && settings.store != StoreKind::Postgres {
        bail!("--resume needs the --run-dir of the run to continue");
    }
    let config = RunConfig {
        source,
        settings,
        batch_linger: Duration::from_millis(args.batch_delay_ms),
        queue_capacity_messages: args.queue_capacity.max(1),
        rate_msgs_per_s: args.rate.filter(|rate| *rate > 0.0),
        cls_out: args.cls_out,
        run_dir: args.run_dir.unwrap_or_else(default_run_dir),
        progress: !args.quiet,
        resume: args.resume,
        window: args.window,
        // A set's own signatures are sent as they are when it is replayed with its own keys.
        signatures: args
            .input
            .as_deref()
            .filter(|_| args.keys.is_none())
            .map(ste_driver::signatures_beside)
            .filter(|path| path.exists()),
        // And its outcome is checked, unless the run goes on from shards that hold part of it.
        expected: match args.input.as_deref() {
            Some(set) if args.keys.is_none() && !args.resume => {
                let path = ste_driver::expected_beside(set);
                path.exists()
                    .then(|| ste_driver::read_expected(&path))
                    .transpose()?
            }
            _ => None,
        },
        limit_probe: (args.probe_s > 0.0).then(|| Duration::from_secs_f64(args.probe_s.min(600.0))),
    };
    Ok(config)
}
