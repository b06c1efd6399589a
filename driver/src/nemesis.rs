//! `driver nemesis`: a cluster on this machine under load, with faults drawn from a seed.
//!
//! The cluster is real: three NATS servers of the pinned release, four PostgreSQL instances of
//! `deploy/local-cluster.sh` (TLS and a password per shard role), owner nodes and one gateway
//! node (`engine --gateway --sink --max-shards 0`), TLS and identities everywhere. The load goes
//! in rounds through the gateway's framed-XML listener, each round a faulty, shuffled set of its
//! own run id; meanwhile a schedule drawn from the seed kills and stops owner nodes, kills NATS
//! servers and stops PostgreSQL instances, each healed after a time also drawn from the seed.
//! The same seed gives the same schedule ([`schedule`]); when each fault was applied and healed
//! is written to the run folder.
//!
//! Every round is checked as it ends ([`check_round`]), and the shards once the run is over
//! ([`check_shards`]). A failure names the seed and the faults applied up to it: the prefix of
//! the schedule that shows it, which `--faults K` replays alone.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::Serialize;
use ste_engine::cluster::roles::Role;
use ste_engine::cluster::{retrying, ClusterAccess, STARTING_PATIENCE};
use ste_engine::draw::Draws;
use ste_engine::generator::{GeneratorConfig, RunOutcome, RUN_ID_LEN};
use ste_engine::keys::KeyRing;
use ste_engine::lease::{Leased, Leases};
use ste_engine::queue::jetstream::Placement;
use ste_engine::refdata::RefData;
use ste_engine::routing::shard_of;
use ste_engine::store::{PgStore, Store};

use crate::proxy::Proxy;
use crate::remote::{run_remote, RemoteConfig, RemoteSummary};
use crate::scale::{node_command, NatsCluster, NodeSpec, LOCAL_NATS_SERVERS};
use crate::volume::Volume;
use crate::Source;

/// Shards (and PostgreSQL instances) of a nemesis cluster.
pub const SHARDS: u32 = 4;
/// Owner nodes of a nemesis cluster, at most two shards each: one of them down leaves the
/// others enough room for every shard.
pub const OWNER_NODES: u32 = 3;
/// The leases' time to live: a node that dies leaves its shards this long after.
const LEASE_TTL_MS: u64 = 2_000;
/// How long a node started again waits for its cluster (`engine --start-patience-s`).
const START_PATIENCE: Duration = Duration::from_secs(600);
/// Warm-up before the first fault.
const FIRST_FAULT_AFTER: Duration = Duration::from_secs(3);
/// How long a connection of the load goes without an answer before it sends its unanswered
/// messages again (the participants' part: an answer may be lost on its way).
const RESEND_AFTER: Duration = Duration::from_secs(5);
/// The size of a clock jump, seconds.
const CLOCK_JUMP_MIN_S: i64 = 5;
const CLOCK_JUMP_MAX_S: i64 = 600;
/// How often a node under libfaketime reads its clock's offset again, seconds.
const FAKETIME_REREAD_S: &str = "1";
/// How long a round waits, while nothing comes, for answers and CLS before it counts what is
/// missing: well past the longest fault and its recovery.
const ROUND_PATIENCE: Duration = Duration::from_secs(60);

/// A kind of fault the nemesis injects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum FaultKind {
    /// An owner node killed (SIGKILL) and started again later.
    KillNode,
    /// An owner node stopped (SIGSTOP) and continued (SIGCONT) later: past its lease, it wakes
    /// to find its shards taken and must be fenced off.
    StopNode,
    /// A NATS server killed (SIGKILL) and started again on its store.
    KillNats,
    /// A shard's PostgreSQL instance stopped abruptly (immediate shutdown) and started again.
    StopDb,
    /// An owner node cut off from every NATS server (its connections closed, new ones
    /// refused) while the rest of the cluster reaches them; healed later.
    CutNats,
    /// An owner node cut off from every shard's database, likewise.
    CutDb,
    /// An owner node's wall clock jumped forward or back (by up to ten minutes, through
    /// libfaketime; its monotonic clock untouched, as a stepped system clock leaves it) and
    /// set right later.
    ClockJump,
    /// A shard's PostgreSQL data folder filled to its last block (its own file system) and
    /// given its space back later; the instance started again if a write it could not make
    /// stopped it.
    FillDisk,
}

impl FaultKind {
    pub const ALL: [FaultKind; 8] = [
        FaultKind::KillNode,
        FaultKind::StopNode,
        FaultKind::KillNats,
        FaultKind::StopDb,
        FaultKind::CutNats,
        FaultKind::CutDb,
        FaultKind::ClockJump,
        FaultKind::FillDisk,
    ];

    pub fn name(self) -> &'static str {
        match self {
            FaultKind::KillNode => "kill-node",
            FaultKind::StopNode => "stop-node",
            FaultKind::KillNats => "kill-nats",
            FaultKind::StopDb => "stop-db",
            FaultKind::CutNats => "cut-nats",
            FaultKind::CutDb => "cut-db",
            FaultKind::ClockJump => "clock-jump",
            FaultKind::FillDisk => "fill-disk",
        }
    }

    /// How many targets of this kind a nemesis cluster has, and how long (ms) a fault of it
    /// lasts at least and at most.
    fn bounds(self) -> (u32, u64, u64) {
        match self {
            FaultKind::KillNode => (OWNER_NODES, 300, 4_000),
            FaultKind::StopNode => (OWNER_NODES, 300, 6_000),
            FaultKind::KillNats => (LOCAL_NATS_SERVERS as u32, 500, 5_000),
            FaultKind::StopDb | FaultKind::FillDisk => (SHARDS, 500, 6_000),
            FaultKind::CutNats | FaultKind::CutDb | FaultKind::ClockJump => {
                (OWNER_NODES, 500, 6_000)
            }
        }
    }

    /// What a fault of this kind occupies: two faults on one process never overlap, and at
    /// most one NATS server is down at a time (a majority of three stays up).
    fn resource(self, target: u32) -> (u8, u32) {
        match self {
            FaultKind::KillNode
            | FaultKind::StopNode
            | FaultKind::CutNats
            | FaultKind::CutDb
            | FaultKind::ClockJump => (0, target),
            FaultKind::KillNats => (1, 0),
            FaultKind::StopDb | FaultKind::FillDisk => (2, target),
        }
    }
}

/// One fault of a schedule.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Fault {
    /// Its place in the schedule, from 1.
    pub number: usize,
    pub kind: FaultKind,
    /// The node, NATS server or shard it hits.
    pub target: u32,
    /// When it is applied, from the start of the load.
    pub at_ms: u64,
    /// How long until it is healed.
    pub lasts_ms: u64,
    /// A clock jump's size, seconds (forward when positive); 0 for other kinds.
    pub jump_s: i64,
}

/// The faults of `seed` within `span`: one every `mean_gap` on average (uniform between half
/// and one and a half of it), of the `kinds` given, each on a target and for a time drawn from
/// the seed (ChaCha8, whose stream is fixed for a seed). A draw whose target is still faulted
/// is dropped, so that the schedule stays the same whatever the cluster does.
pub fn schedule(seed: u64, span: Duration, mean_gap: Duration, kinds: &[FaultKind]) -> Vec<Fault> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let gap = mean_gap.as_millis().max(2) as u64;
    let mut at = FIRST_FAULT_AFTER.as_millis() as u64;
    let mut busy_until: BTreeMap<(u8, u32), u64> = BTreeMap::new();
    let mut faults = Vec::new();
    if kinds.is_empty() {
        return faults;
    }
    loop {
        at += rng.draw(gap / 2..=gap + gap / 2);
        if at >= span.as_millis() as u64 {
            return faults;
        }
        let kind = kinds[rng.draw(0..kinds.len())];
        let (targets, shortest, longest) = kind.bounds();
        let free: Vec<u32> = (0..targets)
            .filter(|&target| {
                busy_until
                    .get(&kind.resource(target))
                    .is_none_or(|&until| until <= at)
            })
            .collect();
        let target = free.get(rng.draw(0..free.len().max(1))).copied();
        let lasts_ms = rng.draw(shortest..=longest);
        let jump_s = match kind {
            FaultKind::ClockJump => {
                let size = rng.draw(CLOCK_JUMP_MIN_S..=CLOCK_JUMP_MAX_S);
                if rng.draw_bool(0.5) {
                    size
                } else {
                    -size
                }
            }
            _ => 0,
        };
        // Every target of the kind is faulted (the draws above are made all the same, so the
        // schedule after this point does not depend on it).
        let Some(target) = target else {
            continue;
        };
        busy_until.insert(kind.resource(target), at + lasts_ms);
        faults.push(Fault {
            number: faults.len() + 1,
            kind,
            target,
            at_ms: at,
            lasts_ms,
            jump_s,
        });
    }
}

/// What a nemesis run is asked to do.
#[derive(Debug, Clone)]
pub struct NemesisConfig {
    pub seed: u64,
    /// How long the load runs (faults fall within it).
    pub span: Duration,
    pub mean_gap: Duration,
    pub kinds: Vec<FaultKind>,
    /// Only the first this many faults of the schedule (a prefix that showed a failure).
    pub faults: Option<usize>,
    /// Trades of each round.
    pub round_trades: u64,
    /// The run folder: the cluster's files, the schedule, the faults as applied, the rounds.
    pub dir: PathBuf,
    pub engine: PathBuf,
    pub nats_server: PathBuf,
    /// `deploy/local-cluster.sh`.
    pub local_cluster: PathBuf,
    /// Where the driver's own programs are (for local-cluster.sh's `STE_BIN`).
    pub bin_dir: PathBuf,
    /// libfaketime's multithreaded library, which the owner nodes are started under when the
    /// kinds include clock jumps.
    pub libfaketime: Option<PathBuf>,
    /// Shows progress on stderr.
    pub progress: bool,
}

/// Where Debian's `libfaketime` package puts the library (`STE_LIBFAKETIME` names another).
pub fn find_libfaketime() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("STE_LIBFAKETIME") {
        return Some(PathBuf::from(path));
    }
    [
        "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1",
        "/usr/lib/aarch64-linux-gnu/faketime/libfaketimeMT.so.1",
        "/usr/lib/faketime/libfaketimeMT.so.1",
    ]
    .into_iter()
    .map(PathBuf::from)
    .find(|path| path.exists())
}

/// A fault as it happened.
#[derive(Debug, Clone, Serialize)]
pub struct Applied {
    #[serde(flatten)]
    pub fault: Fault,
    /// When it was applied and healed, from the start of the load (s).
    pub applied_s: f64,
    pub healed_s: f64,
    /// The longest time without any answer while it lasted (s).
    pub stall_s: f64,
    /// From its heal until answers came again, when none had come in the half second before
    /// it; 0 when answers were flowing at the heal; None when the load ended first (s).
    pub recovery_s: Option<f64>,
    /// Answers per second while it lasted.
    pub answers_per_s: f64,
}

/// A round's result.
#[derive(Debug, Clone, Serialize)]
pub struct Round {
    pub number: u64,
    pub run_id: String,
    pub started_s: f64,
    pub ended_s: f64,
    pub messages: u64,
    pub accepted: u64,
    pub duplicates: u64,
    pub cls: u64,
    /// CLS of earlier rounds delivered again during this one.
    pub other_runs_cls: u64,
    /// Messages sent again for want of an answer, and answers that came for a message already
    /// answered.
    pub resent: u64,
    pub repeat_answers: u64,
    /// What the checker found wrong with it (empty when nothing).
    pub violations: Vec<String>,
}

/// What a nemesis run found.
#[derive(Debug, Clone, Serialize)]
pub struct NemesisReport {
    pub seed: u64,
    pub minutes: f64,
    pub faults_scheduled: usize,
    pub faults: Vec<Applied>,
    pub rounds: Vec<Round>,
    /// Violations of the shards' checks after the run.
    pub shard_violations: Vec<String>,
    /// Owners' commits whose fencing tokens the shards' check read.
    pub commits_checked: u64,
    /// The first violation, and the faults applied by then.
    pub failure: Option<Failure>,
    pub messages: u64,
    pub elapsed_s: f64,
    pub answers_per_s: f64,
}

/// A run's first violation.
#[derive(Debug, Clone, Serialize)]
pub struct Failure {
    pub what: String,
    /// At how many seconds into the load it was seen.
    pub at_s: f64,
    /// Faults applied by then: `--faults` with this many replays the prefix that showed it.
    pub faults_applied: usize,
}

/// The seed's run id of round `round`: five of `0-9A-Z`, different for every round of a seed.
pub fn round_run_id(seed: u64, round: u64) -> String {
    const DIGITS: &[u8; 36] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ";
    let mut value = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ round;
    let mut id = String::with_capacity(RUN_ID_LEN);
    // The round counts in the last digits, so ids of one seed never repeat within 36^3 rounds.
    let mut round_left = round;
    for position in 0..RUN_ID_LEN {
        let digit = if position >= 2 {
            let digit = round_left % 36;
            round_left /= 36;
            digit
        } else {
            let digit = value % 36;
            value /= 36;
            digit
        };
        id.push(DIGITS[digit as usize] as char);
    }
    id
}

/// What a round must show, whatever failed while it ran: every message answered once, the
/// generator's outcome code by code, one CLS for each trade expected to match and none for
/// others. A message whose answer was lost with a node is delivered again and answered
/// DUPLICATE (its shard holds it), so accepted and duplicates may move between each other,
/// and only they.
pub fn check_round(summary: &RemoteSummary) -> Vec<String> {
    let mut violations = Vec::new();
    let Some(expected) = &summary.expected else {
        return vec!["the round has no expected outcome".into()];
    };
    if summary.unanswered > 0 {
        violations.push(format!("{} messages unanswered", summary.unanswered));
    }
    if !summary.conserved {
        violations.push(format!(
            "answers not conserved: {} in, {} accepted, {} duplicates, {} rejected",
            summary.messages_in,
            summary.accepted,
            summary.duplicates,
            summary.exceptions.values().sum::<u64>()
        ));
    }
    if summary.messages_in != expected.messages_in {
        violations.push(format!(
            "{} messages sent, {} generated",
            summary.messages_in, expected.messages_in
        ));
    }
    if summary.exceptions != expected.exceptions {
        violations.push(format!(
            "rejections {:?}, expected {:?}",
            summary.exceptions, expected.exceptions
        ));
    }
    if summary.accepted + summary.duplicates != expected.accepted + expected.duplicates {
        violations.push(format!(
            "{} accepted and {} duplicates, expected {} and {}",
            summary.accepted, summary.duplicates, expected.accepted, expected.duplicates
        ));
    }
    if summary.cls != expected.cls || summary.missing_cls > 0 {
        violations.push(format!(
            "{} CLS, expected {}; missing {}: {}",
            summary.cls,
            expected.cls,
            summary.missing_cls,
            summary.missing_cls_ids.join(" ")
        ));
    }
    violations
}

/// What the shards must hold once every round is over: each only its routed trades, no
/// message and no CLS twice, no commit with an older fencing token after a newer one, and in
/// all the rounds' expected outcome — the accepted messages,
/// the CLS, the trades by status.
/// Returns the violations and how many owners' commits were checked for their tokens.
pub fn check_shards(urls: &[String], expected: &RunOutcome) -> anyhow::Result<(Vec<String>, u64)> {
    let mut violations = Vec::new();
    let mut commits_checked = 0;
    let (mut messages, mut cls) = (0, 0);
    let mut by_status: BTreeMap<String, u64> = BTreeMap::new();
    for (shard, url) in urls.iter().enumerate() {
        let mut store = PgStore::open(url).with_context(|| format!("opening shard {shard}"))?;
        let misrouted: Vec<String> = store
            .trade_keys()
            .with_context(|| format!("shard {shard}'s trade keys"))?
            .into_iter()
            .filter(|key| shard_of(key, urls.len() as u32) as usize != shard)
            .collect();
        if !misrouted.is_empty() {
            violations.push(format!(
                "shard {shard} holds {} trades of other shards, e.g. {}",
                misrouted.len(),
                misrouted[0]
            ));
        }
        let (messages_twice, cls_twice) = store
            .stored_twice()
            .with_context(|| format!("shard {shard}'s repeats"))?;
        if messages_twice + cls_twice > 0 {
            violations.push(format!(
                "shard {shard} holds {messages_twice} messages and {cls_twice} CLS more than once"
            ));
        }
        let (commits, out_of_order) = store
            .commits_out_of_fence_order()
            .with_context(|| format!("shard {shard}'s commits"))?;
        commits_checked += commits;
        if out_of_order > 0 {
            violations.push(format!(
                "shard {shard}: {out_of_order} of {commits} commits carry a fencing token older \
                 than a commit before them"
            ));
        }
        let rows = store
            .row_counts()
            .with_context(|| format!("counting shard {shard}'s rows"))?;
        messages += rows.messages;
        cls += rows.cls;
        let states = store
            .trade_states()
            .with_context(|| format!("shard {shard}'s trades"))?;
        for (status, count) in states.by_status {
            *by_status.entry(status).or_default() += count;
        }
    }
    if messages != expected.accepted {
        violations.push(format!(
            "the shards hold {messages} messages, {} were to be accepted",
            expected.accepted
        ));
    }
    if cls != expected.cls {
        violations.push(format!(
            "the shards' outboxes hold {cls} CLS, {} trades were to match",
            expected.cls
        ));
    }
    let count = |status: &str| by_status.get(status).copied().unwrap_or(0);
    for (status, want) in [
        ("MATCHED", expected.cls),
        ("MISMATCHED", expected.mismatched_trades),
        ("PENDING", expected.pending_trades),
        ("CANCELLED", expected.cancelled_trades),
    ] {
        if count(status) != want {
            violations.push(format!(
                "{} trades {status}, expected {want}",
                count(status)
            ));
        }
    }
    Ok((violations, commits_checked))
}

/// The shards' PostgreSQL instances (`deploy/local-cluster.sh` in a folder of the run's),
/// brought down when dropped; with volumes, each instance's data folder on a file system of
/// its own that a fault can fill.
struct Instances {
    script: PathBuf,
    dir: PathBuf,
    bin_dir: PathBuf,
    port: u16,
    up: bool,
    /// Shard k's data folder's volume at k (none when no fault fills them).
    volumes: Vec<Volume>,
}

impl Instances {
    fn start(config: &NemesisConfig) -> anyhow::Result<Self> {
        let mut instances = Self {
            script: config.local_cluster.clone(),
            dir: config.dir.join("postgres"),
            bin_dir: config.bin_dir.clone(),
            // Below the kernel's ephemeral range, clear of the machine's own instance.
            port: 27_000 + (std::process::id() % 1_000) as u16 * 4,
            up: true,
            volumes: Vec::new(),
        };
        if config.kinds.contains(&FaultKind::FillDisk) {
            let images = config.dir.join("volumes");
            std::fs::create_dir_all(&images).context("the volumes' folder")?;
            for shard in 0..SHARDS {
                let volume = Volume::mount(
                    &images.join(format!("shard-{shard}.img")),
                    &instances.dir.join(format!("shard-{shard}")),
                    Some("postgres"),
                )
                .context(
                    "a shard's data folder on a volume of its own, for fill-disk faults; or \
                     leave fill-disk out of --kinds",
                )?;
                instances.volumes.push(volume);
            }
        }
        if let Err(error) = instances.run(&[
            "up",
            &SHARDS.to_string(),
            "--port",
            &instances.port.to_string(),
        ]) {
            instances.down();
            return Err(error);
        }
        Ok(instances)
    }

    /// Starts shard `shard`'s instance again (nothing when it runs).
    fn start_shard(&self, shard: u32) -> anyhow::Result<()> {
        self.run(&["start", &shard.to_string()]).map(drop)
    }

    /// Stops shard `shard`'s instance abruptly.
    fn crash(&self, shard: u32) -> anyhow::Result<()> {
        self.run(&["crash", &shard.to_string()]).map(drop)
    }

    /// Fills shard `shard`'s data folder to its last block.
    fn fill(&self, shard: u32) -> anyhow::Result<()> {
        let volume = self
            .volumes
            .get(shard as usize)
            .context("the shards' data folders are not on volumes of their own")?;
        volume.fill().map(drop)
    }

    /// Gives shard `shard`'s data folder its space back, and starts its instance again if a
    /// write it could not make stopped it.
    fn free(&self, shard: u32) -> anyhow::Result<()> {
        if let Some(volume) = self.volumes.get(shard as usize) {
            volume.free()?;
        }
        self.start_shard(shard)
    }

    /// The shards' URLs, as the nodes are given them.
    fn urls(&self) -> anyhow::Result<Vec<String>> {
        Ok(self.run(&["urls"])?.lines().map(str::to_owned).collect())
    }

    /// The secrets the instances were made with, which NATS and the nodes use too.
    fn secrets(&self) -> PathBuf {
        self.dir.join("secrets")
    }

    fn run(&self, args: &[&str]) -> anyhow::Result<String> {
        let output = Command::new(&self.script)
            .args(args)
            .arg("--dir")
            .arg(&self.dir)
            .env("STE_BIN", &self.bin_dir)
            .output()
            .with_context(|| format!("running {}", self.script.display()))?;
        if !output.status.success() {
            bail!(
                "deploy/local-cluster.sh {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&output.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    }

    /// Stops the instances, then unmounts their volumes.
    fn down(&mut self) {
        if std::mem::take(&mut self.up) {
            let _ = self.run(&["down"]);
        }
        self.volumes.iter_mut().for_each(Volume::unmount);
    }
}

impl Drop for Instances {
    fn drop(&mut self) {
        self.down();
    }
}

/// What stands between an owner node and the servers: a forwarder per NATS server and per
/// database, which a cut closes.
struct Links {
    nats: Vec<Proxy>,
    databases: Vec<Proxy>,
    /// The NATS URLs and database URLs the node is given: the forwarders'.
    nats_url: String,
    db_urls: Vec<String>,
}

impl Links {
    fn start(nats_url: &str, db_urls: &[String]) -> anyhow::Result<Self> {
        let mut links = Links {
            nats: Vec::new(),
            databases: Vec::new(),
            nats_url: String::new(),
            db_urls: Vec::new(),
        };
        let mut urls = Vec::new();
        for url in nats_url.split(',') {
            let address = url.trim_start_matches("nats://");
            let proxy = Proxy::start(address.parse().context("a NATS server's address")?)?;
            urls.push(format!("nats://127.0.0.1:{}", proxy.port()));
            links.nats.push(proxy);
        }
        links.nats_url = urls.join(",");
        for url in db_urls {
            // postgres://role@127.0.0.1:PORT/db?…
            let (head, rest) = url.split_once('@').context("a database URL with a role")?;
            let (address, tail) = rest.split_once('/').context("a database URL's path")?;
            let proxy = Proxy::start(address.parse().context("a database's address")?)?;
            links
                .db_urls
                .push(format!("{head}@127.0.0.1:{}/{tail}", proxy.port()));
            links.databases.push(proxy);
        }
        Ok(links)
    }
}

/// The cluster a nemesis run attacks.
///
/// Faults on different processes run at once, each on a thread of its own: so every part that
/// a fault changes has a lock of its own (a node, the NATS servers), and the rest does not
/// change once the cluster is up.
struct Cluster {
    dir: PathBuf,
    nats: Mutex<NatsCluster>,
    nats_url: String,
    placement: String,
    engine: PathBuf,
    keys: PathBuf,
    secrets: PathBuf,
    db_urls: Vec<String>,
    /// The owner nodes, by number (None while killed).
    owners: Vec<Mutex<Option<Child>>>,
    /// Each owner node's way to the servers.
    links: Vec<Links>,
    /// libfaketime, when owner nodes' clocks are to jump.
    libfaketime: Option<PathBuf>,
    gateway: Mutex<Option<Child>>,
    gateway_address: String,
    /// Last, so that the nodes go before their databases.
    instances: Instances,
}

impl Cluster {
    fn start(config: &NemesisConfig, refdata: &RefData) -> anyhow::Result<Self> {
        let instances = Instances::start(config)?;
        let db_urls = instances.urls()?;
        let secrets = instances.secrets();
        let nats_dir = config.dir.join("nats");
        std::fs::create_dir_all(&nats_dir).context("the NATS servers' folder")?;
        let nats = NatsCluster::start(
            &config.nats_server,
            LOCAL_NATS_SERVERS,
            &nats_dir,
            Some(&secrets),
        )?;
        let keys = config.dir.join("keys.csv");
        KeyRing::generate_for(refdata)
            .write(&keys)
            .with_context(|| format!("writing {}", keys.display()))?;
        let mut cluster = Self {
            dir: config.dir.clone(),
            nats_url: nats.url.clone(),
            placement: nats.placement.clone(),
            nats: Mutex::new(nats),
            engine: config.engine.clone(),
            keys,
            secrets,
            db_urls,
            owners: Vec::new(),
            links: Vec::new(),
            libfaketime: config
                .kinds
                .contains(&FaultKind::ClockJump)
                .then(|| config.libfaketime.clone())
                .flatten(),
            gateway: Mutex::new(None),
            gateway_address: String::new(),
            instances,
        };
        cluster.start_gateway()?;
        for node in 0..OWNER_NODES {
            cluster.owners.push(Mutex::new(None));
            cluster
                .links
                .push(Links::start(&cluster.nats_url, &cluster.db_urls)?);
            cluster.start_owner(node)?;
        }
        cluster.wait_until_held()?;
        Ok(cluster)
    }

    /// Node `id`, reaching the servers directly or through `links`.
    fn node(&self, id: &str, max_shards: u32, links: Option<&Links>) -> anyhow::Result<Command> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join(format!("{id}.log")))
            .with_context(|| format!("{id}.log"))?;
        let mut command = node_command(
            &NodeSpec {
                engine: &self.engine,
                nats_url: links.map_or(&self.nats_url, |links| &links.nats_url),
                placement: &self.placement,
                secrets: &self.secrets,
                keys: &self.keys,
                db_urls: links.map_or(&self.db_urls, |links| &links.db_urls),
                max_shards,
            },
            id,
        );
        command
            .args(["--lease-ttl-ms", &LEASE_TTL_MS.to_string()])
            // A node started again while faults keep the NATS servers electing leaders waits
            // for them, as a supervisor that restarts it would.
            .args(["--start-patience-s", &START_PATIENCE.as_secs().to_string()])
            // Small generations: the matchers retire what their shards committed many times a
            // run, and a message that needs it is answered from the shard.
            .args(["--matcher-generation", "1024"])
            .arg("--data-dir")
            .arg(self.dir.join(format!("{id}-data")))
            .stderr(log);
        Ok(command)
    }

    /// The file owner node `node`'s clock offset is read from (libfaketime's format: `+0`,
    /// `-300`).
    fn clock_file(&self, node: u32) -> PathBuf {
        self.dir.join(format!("owner-{node}.clock"))
    }

    fn set_clock(&self, node: u32, offset_s: i64) -> anyhow::Result<()> {
        let path = self.clock_file(node);
        std::fs::write(&path, format!("{offset_s:+}\n"))
            .with_context(|| format!("writing {}", path.display()))
    }

    fn start_owner(&self, node: u32) -> anyhow::Result<()> {
        let mut command = self.node(
            &format!("owner-{node}"),
            2,
            Some(&self.links[node as usize]),
        )?;
        if let Some(library) = &self.libfaketime {
            // A node started again starts on the right time.
            self.set_clock(node, 0)?;
            command
                .env("LD_PRELOAD", library)
                .env("FAKETIME_TIMESTAMP_FILE", self.clock_file(node))
                .env("FAKETIME_CACHE_DURATION", FAKETIME_REREAD_S)
                .env("FAKETIME_DONT_FAKE_MONOTONIC", "1");
        }
        let child = command
            .stdout(Stdio::null())
            .spawn()
            .context("starting an owner node")?;
        *self.owner(node) = Some(child);
        Ok(())
    }

    fn owner(&self, node: u32) -> std::sync::MutexGuard<'_, Option<Child>> {
        self.owners[node as usize].lock().expect("an owner node")
    }

    /// The gateway node: the participants' listeners and the sink, no shard of its own.
    fn start_gateway(&mut self) -> anyhow::Result<()> {
        let mut child = self
            .node("gateway", 0, None)?
            .args(["--gateway", "--sink"])
            .args(ste_bridge::bench::LOOPBACK_LISTENERS)
            .stdout(Stdio::piped())
            .spawn()
            .context("starting the gateway node")?;
        let stdout = child.stdout.take().context("the gateway's output")?;
        let mut lines = BufReader::new(stdout).lines();
        let Some(address) =
            lines.find_map(|line| line.ok()?.strip_prefix("tcp ").map(str::to_owned))
        else {
            let _ = child.wait();
            bail!(
                "the gateway announced no framed-XML listener; {}",
                crate::scale::end_of_log(&self.dir.join("gateway.log"), 20)
            );
        };
        // Its later lines go nowhere, and it never blocks writing them.
        std::thread::spawn(move || lines.for_each(drop));
        *self.gateway.get_mut().expect("the gateway") = Some(child);
        self.gateway_address = address;
        Ok(())
    }

    fn leases(&self) -> anyhow::Result<Leases> {
        let jetstream = ClusterAccess {
            url: self.nats_url.clone(),
            placement: Placement::parse(Some(&self.placement), 1).map_err(anyhow::Error::msg)?,
            secrets: Some(self.secrets.clone()),
        }
        .connect(Role::Monitor)
        .context("connecting as the monitor")?;
        retrying(STARTING_PATIENCE, || {
            Leases::open(&jetstream, Duration::from_millis(LEASE_TTL_MS))
        })
        .context("the cluster's leases")
    }

    /// Waits (60 s at most) until every shard has an owner.
    fn wait_until_held(&self) -> anyhow::Result<()> {
        let leases = self.leases()?;
        let started = Instant::now();
        while !(0..SHARDS).all(|k| matches!(leases.holder(Leased::Shard(k)), Ok(Some(_)))) {
            if started.elapsed() > Duration::from_secs(60) {
                bail!("the owner nodes did not take every shard within 60 s");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(())
    }

    fn signal(&self, node: u32, signal: &str) -> anyhow::Result<()> {
        let owner = self.owner(node);
        let child = owner.as_ref().context("the node is not running")?;
        let status = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(child.id().to_string())
            .status()?;
        if !status.success() {
            bail!("kill -{signal} owner-{node} failed");
        }
        Ok(())
    }

    fn apply(&self, fault: &Fault) -> anyhow::Result<()> {
        match fault.kind {
            FaultKind::KillNode => {
                if let Some(mut child) = self.owner(fault.target).take() {
                    let _ = child.kill();
                    let _ = child.wait();
                }
                Ok(())
            }
            FaultKind::StopNode => self.signal(fault.target, "STOP"),
            FaultKind::KillNats => {
                self.nats
                    .lock()
                    .expect("the NATS servers")
                    .kill(fault.target as usize);
                Ok(())
            }
            FaultKind::StopDb => self.instances.crash(fault.target),
            FaultKind::FillDisk => self.instances.fill(fault.target),
            FaultKind::CutNats | FaultKind::CutDb => {
                self.forwarders(fault).iter().for_each(Proxy::cut);
                Ok(())
            }
            FaultKind::ClockJump => {
                // Within the day: a node whose date changes is another fault (a business
                // date is not a node's clock's to decide), so a jump that would cross
                // midnight goes the other way.
                let now = time::OffsetDateTime::now_utc();
                let crosses =
                    |jump: i64| (now + time::Duration::seconds(jump)).date() != now.date();
                let jump = if crosses(fault.jump_s) {
                    -fault.jump_s
                } else {
                    fault.jump_s
                };
                self.set_clock(fault.target, jump)
            }
        }
    }

    /// The forwarders a cut of `fault`'s kind closes: its node's to the NATS servers or to
    /// the databases.
    fn forwarders(&self, fault: &Fault) -> &[Proxy] {
        let links = &self.links[fault.target as usize];
        match fault.kind {
            FaultKind::CutNats => &links.nats,
            _ => &links.databases,
        }
    }

    fn heal(&self, fault: &Fault) -> anyhow::Result<()> {
        match fault.kind {
            FaultKind::KillNode => self.start_owner(fault.target),
            FaultKind::StopNode => self.signal(fault.target, "CONT"),
            FaultKind::KillNats => self
                .nats
                .lock()
                .expect("the NATS servers")
                .start_again(fault.target as usize),
            FaultKind::StopDb => self.instances.start_shard(fault.target),
            FaultKind::FillDisk => self.instances.free(fault.target),
            FaultKind::CutNats | FaultKind::CutDb => {
                self.forwarders(fault).iter().for_each(Proxy::heal);
                Ok(())
            }
            FaultKind::ClockJump => self.set_clock(fault.target, 0),
        }
    }

    /// Stops the nodes, NATS and the instances.
    fn stop(&mut self) {
        let owners = self.owners.iter_mut();
        for mut child in owners.filter_map(|owner| owner.get_mut().ok()?.take()) {
            // SIGKILL ends a stopped process too.
            let _ = child.kill();
            let _ = child.wait();
        }
        if let Some(mut gateway) = self.gateway.get_mut().ok().and_then(Option::take) {
            let _ = gateway.kill();
            let _ = gateway.wait();
        }
        if let Ok(nats) = self.nats.get_mut() {
            nats.stop();
        }
        self.instances.down();
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Answers counted over the run, sampled every 100 ms: (seconds into the load, answers).
type Samples = Arc<Mutex<Vec<(f64, u64)>>>;

/// Where the shards' roles' passwords of a nemesis run in `dir` are: point `PGPASSFILE` here
/// before any thread starts.
pub fn password_file(dir: &Path) -> PathBuf {
    dir.join("postgres/secrets")
        .join(ste_engine::store::PGPASS_FILE)
}

/// Runs the nemesis: starts the cluster (a fresh key set for its participants), loads it in
/// rounds while the schedule's faults are applied and healed, checks every round and then the
/// shards.
pub fn run(config: &NemesisConfig, refdata: RefData) -> anyhow::Result<NemesisReport> {
    std::fs::create_dir_all(&config.dir)
        .with_context(|| format!("creating {}", config.dir.display()))?;
    if config.kinds.contains(&FaultKind::ClockJump) && config.libfaketime.is_none() {
        bail!(
            "clock jumps need libfaketime (Debian: apt-get install faketime; or STE_LIBFAKETIME \
             names the library); or leave clock-jump out of --kinds"
        );
    }
    let mut planned = schedule(config.seed, config.span, config.mean_gap, &config.kinds);
    let scheduled = planned.len();
    if let Some(prefix) = config.faults {
        planned.truncate(prefix);
    }
    write_csv(
        &config.dir.join("schedule.csv"),
        "number,kind,target,at_s,lasts_s,jump_s",
        planned.iter().map(|f| {
            format!(
                "{},{},{},{:.3},{:.3},{}",
                f.number,
                f.kind.name(),
                f.target,
                f.at_ms as f64 / 1e3,
                f.lasts_ms as f64 / 1e3,
                f.jump_s
            )
        }),
    )?;
    if config.progress {
        eprintln!(
            "nemesis seed {}: {} faults in {:.1} min, run folder {}",
            config.seed,
            planned.len(),
            config.span.as_secs_f64() / 60.0,
            config.dir.display()
        );
    }
    let mut cluster = Cluster::start(config, &refdata)?;
    let ring = KeyRing::load(&cluster.keys).context("loading the cluster's key set")?;
    let refdata = Arc::new(
        refdata
            .with_keys(&ring)
            .context("installing the signing keys")?,
    );
    if config.progress {
        eprintln!(
            "cluster up: 3 NATS servers, {SHARDS} PostgreSQL instances, {OWNER_NODES} owner nodes, \
             gateway at {}",
            cluster.gateway_address
        );
    }

    let started = Instant::now();
    let answers = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let failure: Arc<Mutex<Option<(String, f64)>>> = Arc::default();
    let samples: Samples = Arc::default();
    let sampler = {
        let (answers, stop, samples) = (answers.clone(), stop.clone(), samples.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let point = (
                    started.elapsed().as_secs_f64(),
                    answers.load(Ordering::Relaxed),
                );
                samples.lock().expect("samples").push(point);
                std::thread::sleep(Duration::from_millis(100));
            }
        })
    };
    let load = {
        let (answers, stop, failure) = (answers.clone(), stop.clone(), failure.clone());
        let address = format!("tcp://{}", cluster.gateway_address);
        let (seed, round_trades, span, progress) = (
            config.seed,
            config.round_trades,
            config.span,
            config.progress,
        );
        std::thread::spawn(move || {
            rounds(
                &address,
                &refdata,
                seed,
                round_trades,
                span,
                started,
                answers,
                &stop,
                &failure,
                progress,
            )
        })
    };

    // The schedule: a thread for each process the faults hit (a node, the NATS servers, a
    // shard's database), applying its faults at their times and healing each after its span,
    // one after the other; a heal that takes long (a NATS server waits until it is healthy
    // and back in its cluster) holds up that process's next fault only.
    let mut by_resource: BTreeMap<(u8, u32), Vec<usize>> = BTreeMap::new();
    for (index, fault) in planned.iter().enumerate() {
        by_resource
            .entry(fault.kind.resource(fault.target))
            .or_default()
            .push(index);
    }
    let times: Mutex<Vec<(f64, f64)>> = Mutex::new(vec![(f64::NAN, f64::NAN); planned.len()]);
    let fault_error: Mutex<Option<anyhow::Error>> = Mutex::new(None);
    let stopping = || {
        failure.lock().expect("failure").is_some() || fault_error.lock().expect("error").is_some()
    };
    let wait_until = |due: Duration| {
        while started.elapsed() < due && !stopping() {
            std::thread::sleep(Duration::from_millis(10).min(due - started.elapsed().min(due)));
        }
    };
    let progress = config.progress;
    std::thread::scope(|scope| {
        for indices in by_resource.values() {
            let (cluster, planned, times, fault_error) = (&cluster, &planned, &times, &fault_error);
            scope.spawn(move || {
                for &index in indices {
                    let fault = &planned[index];
                    wait_until(Duration::from_millis(fault.at_ms));
                    // Once a round has failed or a fault could not be applied, no new fault.
                    if stopping() {
                        return;
                    }
                    for apply in [true, false] {
                        if !apply {
                            // A heal is due even when the run is stopping: the cluster is read
                            // after it.
                            let due = Duration::from_millis(fault.at_ms + fault.lasts_ms);
                            wait_until(due);
                        }
                        let result = if apply {
                            cluster.apply(fault)
                        } else {
                            cluster.heal(fault)
                        };
                        let now = started.elapsed().as_secs_f64();
                        if let Err(error) = result {
                            let mut slot = fault_error.lock().expect("error");
                            slot.get_or_insert(error.context(format!(
                                "{} fault {} on {} {}",
                                if apply { "applying" } else { "healing" },
                                fault.number,
                                fault.kind.name(),
                                fault.target
                            )));
                            // Neither applied nor healed: nothing more on this process.
                            return;
                        }
                        let mut times = times.lock().expect("times");
                        if apply {
                            times[index].0 = now;
                        } else {
                            times[index].1 = now;
                        }
                        if progress {
                            eprintln!(
                                "{now:7.1} s  fault {:>4} {:<10} {} {}",
                                fault.number,
                                fault.kind.name(),
                                fault.target,
                                if apply { "applied" } else { "healed" }
                            );
                        }
                    }
                }
            });
        }
    });
    let times = times.into_inner().expect("times");
    let applied = times
        .iter()
        .rposition(|(applied_s, _)| !applied_s.is_nan())
        .map_or(0, |last| last + 1);
    let fault_error = fault_error.into_inner().expect("error");
    if let Some(error) = fault_error {
        stop.store(true, Ordering::Relaxed);
        let _ = load.join();
        let _ = sampler.join();
        return Err(error);
    }
    let rounds = load
        .join()
        .map_err(|_| anyhow::anyhow!("the load thread panicked"))?;
    stop.store(true, Ordering::Relaxed);
    let _ = sampler.join();
    let elapsed_s = started.elapsed().as_secs_f64();
    let (rounds, expected) = rounds?;

    // Every fault is healed: the shards are read once their owners are back.
    cluster.wait_until_held()?;
    let (shard_violations, commits_checked) = check_shards(&cluster.db_urls, &expected)?;
    let mut failure = failure.lock().expect("failure").take();
    if failure.is_none() && !shard_violations.is_empty() {
        failure = Some((shard_violations.join("; "), elapsed_s));
    }
    let faults_applied_by =
        |at_s: f64| times.iter().filter(|(applied, _)| *applied <= at_s).count();
    let samples = samples.lock().expect("samples").clone();
    let faults = planned
        .iter()
        .zip(&times)
        .filter(|(_, (applied_s, _))| !applied_s.is_nan())
        .map(|(fault, &(applied_s, healed_s))| {
            let (stall_s, recovery_s, answers_per_s) = recovery(&samples, applied_s, healed_s);
            Applied {
                fault: fault.clone(),
                applied_s,
                healed_s,
                stall_s,
                recovery_s,
                answers_per_s,
            }
        })
        .collect::<Vec<_>>();
    let messages = rounds.iter().map(|r| r.messages).sum();
    let report = NemesisReport {
        seed: config.seed,
        minutes: config.span.as_secs_f64() / 60.0,
        faults_scheduled: scheduled,
        faults,
        rounds,
        shard_violations,
        commits_checked,
        failure: failure.map(|(what, at_s)| Failure {
            faults_applied: faults_applied_by(at_s).min(applied),
            what,
            at_s,
        }),
        messages,
        elapsed_s,
        answers_per_s: answers.load(Ordering::Relaxed) as f64 / elapsed_s.max(1e-9),
    };
    write_report(&config.dir, &report)?;
    cluster.stop();
    Ok(report)
}

/// Rounds of load until `span` has passed (the last round runs to its end) or a round fails;
/// the rounds and the sum of their expected outcomes.
#[allow(clippy::too_many_arguments)]
fn rounds(
    address: &str,
    refdata: &Arc<RefData>,
    seed: u64,
    trades: u64,
    span: Duration,
    started: Instant,
    answers: Arc<AtomicU64>,
    stop: &AtomicBool,
    failure: &Mutex<Option<(String, f64)>>,
    progress: bool,
) -> anyhow::Result<(Vec<Round>, RunOutcome)> {
    let mut rounds = Vec::new();
    let mut expected = RunOutcome::default();
    let mut number = 0;
    while started.elapsed() < span && !stop.load(Ordering::Relaxed) {
        number += 1;
        let run_id = round_run_id(seed, number);
        let config = RemoteConfig {
            address: address.to_owned(),
            tls: None,
            connections: 2,
            window: 512,
            source: Source::Generated(GeneratorConfig {
                trades,
                seed: seed.wrapping_add(number),
                fault_rate: 0.1,
                shuffle: true,
                run: run_id.clone(),
            }),
            progress: false,
            cls_wait: ROUND_PATIENCE,
            answers: answers.clone(),
            resend_after: RESEND_AFTER,
        };
        let started_s = started.elapsed().as_secs_f64();
        let (summary, violations) = match run_remote(&config, refdata.clone()) {
            Ok(summary) => {
                let violations = check_round(&summary);
                (Some(summary), violations)
            }
            Err(error) => (None, vec![format!("the round's load failed: {error:#}")]),
        };
        let ended_s = started.elapsed().as_secs_f64();
        if let Some(outcome) = summary.as_ref().and_then(|s| s.expected.as_ref()) {
            expected.add(outcome);
        }
        let round = Round {
            number,
            run_id,
            started_s,
            ended_s,
            messages: summary.as_ref().map_or(0, |s| s.messages_in),
            accepted: summary.as_ref().map_or(0, |s| s.accepted),
            duplicates: summary.as_ref().map_or(0, |s| s.duplicates),
            cls: summary.as_ref().map_or(0, |s| s.cls),
            other_runs_cls: summary.as_ref().map_or(0, |s| s.other_runs_cls),
            resent: summary.as_ref().map_or(0, |s| s.resent),
            repeat_answers: summary.as_ref().map_or(0, |s| s.repeat_answers),
            violations,
        };
        if progress {
            eprintln!(
                "{ended_s:7.1} s  round {number} ({}): {} messages in {:.1} s{}",
                round.run_id,
                round.messages,
                ended_s - started_s,
                if round.violations.is_empty() {
                    String::new()
                } else {
                    format!(" — {}", round.violations.join("; "))
                }
            );
        }
        let failed = !round.violations.is_empty();
        if failed {
            *failure.lock().expect("failure") = Some((
                format!("round {number}: {}", round.violations.join("; ")),
                ended_s,
            ));
        }
        rounds.push(round);
        if failed {
            break;
        }
    }
    Ok((rounds, expected))
}

/// From the answer samples (every 100 ms): the longest time without an answer while the
/// fault lasted, how long after its heal answers came again when none had come in the half
/// second before it (0 when they were flowing), and the rate of answers while it lasted.
fn recovery(samples: &[(f64, u64)], applied_s: f64, healed_s: f64) -> (f64, Option<f64>, f64) {
    let at = |time: f64| {
        samples
            .iter()
            .rev()
            .find(|&&(t, _)| t <= time)
            .map_or(0, |&(_, answers)| answers)
    };
    let mut stall_s: f64 = 0.0;
    let mut last_change = applied_s;
    let mut previous = at(applied_s);
    for &(t, answers) in samples
        .iter()
        .filter(|&&(t, _)| t > applied_s && t <= healed_s)
    {
        if answers != previous {
            previous = answers;
            last_change = t;
        }
        stall_s = stall_s.max(t - last_change);
    }
    let at_heal = at(healed_s);
    let recovery_s = if at(healed_s - 0.5) < at_heal {
        Some(0.0)
    } else {
        samples
            .iter()
            .find(|&&(t, answers)| t > healed_s && answers > at_heal)
            .map(|&(t, _)| t - healed_s)
    };
    let during = (at_heal - at(applied_s)) as f64 / (healed_s - applied_s).max(1e-3);
    (stall_s, recovery_s, during)
}

fn write_csv(path: &Path, header: &str, rows: impl Iterator<Item = String>) -> anyhow::Result<()> {
    let mut text = format!("{header}\n");
    for row in rows {
        text.push_str(&row);
        text.push('\n');
    }
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

/// faults.csv, rounds.csv and report.json in the run folder.
fn write_report(dir: &Path, report: &NemesisReport) -> anyhow::Result<()> {
    let opt = |value: Option<f64>| value.map_or(String::new(), |v| format!("{v:.3}"));
    write_csv(
        &dir.join("faults.csv"),
        "number,kind,target,planned_s,applied_s,healed_s,stall_s,recovery_s,answers_per_s",
        report.faults.iter().map(|f| {
            format!(
                "{},{},{},{:.3},{:.3},{:.3},{:.1},{},{:.0}",
                f.fault.number,
                f.fault.kind.name(),
                f.fault.target,
                f.fault.at_ms as f64 / 1e3,
                f.applied_s,
                f.healed_s,
                f.stall_s,
                opt(f.recovery_s),
                f.answers_per_s
            )
        }),
    )?;
    write_csv(
        &dir.join("rounds.csv"),
        "number,run_id,started_s,ended_s,messages,accepted,duplicates,cls,other_runs_cls,resent,\
         repeat_answers,violations",
        report.rounds.iter().map(|r| {
            format!(
                "{},{},{:.3},{:.3},{},{},{},{},{},{},{},\"{}\"",
                r.number,
                r.run_id,
                r.started_s,
                r.ended_s,
                r.messages,
                r.accepted,
                r.duplicates,
                r.cls,
                r.other_runs_cls,
                r.resent,
                r.repeat_answers,
                r.violations.join("; ").replace('"', "'")
            )
        }),
    )?;
    let path = dir.join("report.json");
    std::fs::write(&path, serde_json::to_string_pretty(report)?)
        .with_context(|| format!("writing {}", path.display()))
}

/// Faults by kind, as the table a run prints: how many; how long they lasted (mean, s); the
/// longest stall of answers within one (median and max, s); the recovery after the heal
/// (median and max, s); answers per second while they lasted (mean), beside the run's.
pub fn by_kind(report: &NemesisReport) -> String {
    let mut table = String::from(
        "kind        faults  lasted s  stall p50/max s  recovery p50/max s  answers/s during (run)\n",
    );
    let median_max = |mut values: Vec<f64>| {
        values.sort_by(f64::total_cmp);
        (
            values.get(values.len() / 2).copied().unwrap_or(f64::NAN),
            values.last().copied().unwrap_or(f64::NAN),
        )
    };
    for kind in FaultKind::ALL {
        let faults: Vec<&Applied> = report
            .faults
            .iter()
            .filter(|f| f.fault.kind == kind)
            .collect();
        if faults.is_empty() {
            continue;
        }
        let count = faults.len() as f64;
        let lasted = faults.iter().map(|f| f.healed_s - f.applied_s).sum::<f64>() / count;
        let (stall_p50, stall_max) = median_max(faults.iter().map(|f| f.stall_s).collect());
        let (recovery_p50, recovery_max) =
            median_max(faults.iter().filter_map(|f| f.recovery_s).collect());
        let during = faults.iter().map(|f| f.answers_per_s).sum::<f64>() / count;
        let _ = writeln!(
            table,
            "{:<11} {:>6}  {:>8.1}  {:>7.1}/{:<7.1}  {:>8.1}/{:<9.1}  {:>7.0} ({:.0})",
            kind.name(),
            faults.len(),
            lasted,
            stall_p50,
            stall_max,
            recovery_p50,
            recovery_max,
            during,
            report.answers_per_s
        );
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_gives_one_schedule_and_another_seed_another() {
        let kinds = FaultKind::ALL;
        let span = Duration::from_secs(120);
        let gap = Duration::from_secs(2);
        let first = schedule(7, span, gap, &kinds);
        assert_eq!(first, schedule(7, span, gap, &kinds));
        assert_ne!(first, schedule(8, span, gap, &kinds));
        assert!(first.len() > 20, "{} faults", first.len());
        for kind in kinds {
            assert!(first.iter().any(|f| f.kind == kind), "{kind:?} drawn");
        }
    }

    #[test]
    fn no_two_faults_hold_one_process_and_one_nats_server_at_most_is_down() {
        let faults = schedule(
            11,
            Duration::from_secs(600),
            Duration::from_millis(700),
            &FaultKind::ALL,
        );
        for (i, a) in faults.iter().enumerate() {
            for b in &faults[i + 1..] {
                let overlap = b.at_ms < a.at_ms + a.lasts_ms;
                if overlap {
                    assert_ne!(
                        a.kind.resource(a.target),
                        b.kind.resource(b.target),
                        "{a:?} and {b:?}"
                    );
                }
            }
            assert!(a.at_ms >= FIRST_FAULT_AFTER.as_millis() as u64);
        }
    }

    #[test]
    fn round_run_ids_differ_within_a_seed_and_are_run_ids() {
        let ids: std::collections::BTreeSet<String> =
            (1..=2_000).map(|round| round_run_id(42, round)).collect();
        assert_eq!(ids.len(), 2_000);
        assert!(ids.iter().all(|id| ste_engine::generator::is_run_id(id)));
    }
}
