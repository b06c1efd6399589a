//! The clusters of a node sweep (`driver sweep --nodes 1,2,4,8`): for each level, K engine
//! nodes on a fresh NATS JetStream server and fresh shard databases, started here as processes
//! ([`LocalCluster`]) or as the services of the docker-compose file ([`Compose`]); and the CPU
//! the level cost this machine, by program ([`CpuReading`]), which the sweep's model needs: the
//! machine's cores are a station every process shares.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};
use ste_engine::cpu::USER_HZ;
use ste_engine::store::PgStore;

use super::Summary;

/// The programs a level's CPU is told apart by (a process's `comm`); the rest of the machine's
/// busy time is "other".
pub const PROGRAMS: [&str; 4] = ["engine", "nats-server", "postgres", "driver"];

/// The machine's busy CPU time and every process's, at one instant.
#[derive(Debug, Clone)]
pub struct CpuReading {
    at: Instant,
    busy_s: f64,
    /// pid → (program, CPU seconds so far).
    processes: BTreeMap<u32, (String, f64)>,
}

/// The CPU a stretch of time cost: the machine's, and each program's of [`PROGRAMS`].
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CpuUse {
    /// Wall time between the readings.
    pub seconds: f64,
    /// Cores of the machine.
    pub cores: usize,
    /// Busy CPU seconds of the whole machine (user, system, interrupts, steal).
    pub busy_s: f64,
    /// CPU seconds by program; `other` is the machine's rest (this host's other tenants too).
    pub by_program_s: BTreeMap<String, f64>,
}

impl CpuUse {
    /// Mean busy cores over the stretch.
    pub fn busy_cores(&self) -> f64 {
        self.busy_s / self.seconds.max(1e-9)
    }

    pub fn program_s(&self, program: &str) -> f64 {
        self.by_program_s.get(program).copied().unwrap_or(0.0)
    }
}

impl CpuReading {
    /// Reads `/proc/stat` and every process's `/proc/<pid>/stat` (processes in containers
    /// too: they run on this kernel). Where `/proc` is missing, the reading is empty.
    pub fn now() -> Self {
        let busy_s = std::fs::read_to_string("/proc/stat")
            .ok()
            .and_then(|stat| {
                let fields: Vec<f64> = stat
                    .lines()
                    .next()?
                    .split_whitespace()
                    .skip(1)
                    .filter_map(|f| f.parse().ok())
                    .collect();
                // user nice system idle iowait irq softirq steal (guest time is in user).
                let busy = [0, 1, 2, 5, 6, 7]
                    .iter()
                    .filter_map(|&k| fields.get(k))
                    .sum::<f64>();
                Some(busy / USER_HZ)
            })
            .unwrap_or(0.0);
        let mut processes = BTreeMap::new();
        if let Ok(entries) = std::fs::read_dir("/proc") {
            for entry in entries.flatten() {
                let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse().ok()) else {
                    continue;
                };
                if let Some(process) = process_cpu(pid) {
                    processes.insert(pid, process);
                }
            }
        }
        Self {
            at: Instant::now(),
            busy_s,
            processes,
        }
    }

    /// What happened between this reading and `later`. A process that ended in between
    /// takes its time with it; one that started counts from zero.
    pub fn until(&self, later: &CpuReading) -> CpuUse {
        let mut by_program_s: BTreeMap<String, f64> = PROGRAMS
            .iter()
            .map(|program| (program.to_string(), 0.0))
            .collect();
        for (pid, (program, seconds)) in &later.processes {
            let Some(total) = by_program_s.get_mut(program) else {
                continue;
            };
            let before = self
                .processes
                .get(pid)
                .filter(|(was, _)| was == program)
                .map_or(0.0, |(_, s)| *s);
            *total += (seconds - before).max(0.0);
        }
        let busy_s = (later.busy_s - self.busy_s).max(0.0);
        let known: f64 = by_program_s.values().sum();
        by_program_s.insert("other".to_owned(), (busy_s - known).max(0.0));
        CpuUse {
            seconds: later.at.duration_since(self.at).as_secs_f64(),
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            busy_s,
            by_program_s,
        }
    }
}

/// This process's CPU seconds so far (user + system, every thread); 0 where `/proc` is missing.
pub fn own_cpu_s() -> f64 {
    process_cpu(std::process::id()).map_or(0.0, |(_, seconds)| seconds)
}

/// A process's program name and CPU seconds (user + system, every thread).
fn process_cpu(pid: u32) -> Option<(String, f64)> {
    ste_engine::cpu::stat_cpu(&format!("/proc/{pid}/stat"))
}

/// How a level's nodes split the cluster's work: each takes at most its share of the shards,
/// so that once all are owned every node (up to one per shard) has its part.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Share {
    pub nodes: u32,
    pub shards: u32,
}

impl Share {
    pub fn max_shards(self) -> u32 {
        self.shards.div_ceil(self.nodes.max(1))
    }
}

/// The name of shard `index`'s database in a level of a sweep.
fn sweep_database(index: usize) -> String {
    format!("ste_sweep_{index}")
}

/// A level's cluster as processes of this machine: its own NATS servers (three in one
/// cluster, fresh streams and leases in `dir`), K `engine` nodes, and fresh databases
/// `ste_sweep_<k>` on the servers of the given URLs (dropped again by [`LocalCluster::stop`]).
pub struct LocalCluster {
    nats: NatsCluster,
    nodes: Vec<(String, Child)>,
    caps: Vec<CpuCap>,
    pub nats_url: String,
    /// The NATS servers' placement tags, separated by commas.
    pub nats_placement: String,
    pub db_urls: Vec<String>,
    /// The cluster's secrets folder (`driver secrets`).
    pub secrets: PathBuf,
}

/// What a [`LocalCluster`] is made of.
pub struct LocalSpec<'a> {
    pub dir: &'a Path,
    pub share: Share,
    /// One per shard: the server a shard's database is made on.
    pub servers: &'a [String],
    pub keys: &'a Path,
    pub engine: &'a Path,
    pub nats_server: &'a Path,
    /// More arguments for every node.
    pub node_args: &'a [String],
    /// Cores each node is capped at (a cgroup of its own), if any.
    pub node_cpus: Option<f64>,
}

/// The pinned NATS server release a cluster runs on: `STE_NATS_SERVER`, else where
/// `scripts/nats-server.sh` installs it (`$STE_TOOLS`, default `~/.cache/ste`).
pub fn pinned_nats_server() -> anyhow::Result<PathBuf> {
    let path = match std::env::var_os("STE_NATS_SERVER") {
        Some(path) => PathBuf::from(path),
        None => std::env::var_os("STE_TOOLS")
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/ste")
            })
            .join(format!("nats-server-{NATS_RELEASE}/nats-server")),
    };
    if !path.exists() {
        bail!(
            "{} is missing: scripts/nats-server.sh installs the pinned NATS release ({NATS_RELEASE})",
            path.display()
        );
    }
    Ok(path)
}

/// The NATS server release a cluster runs on (`scripts/nats-server.sh`).
pub const NATS_RELEASE: &str = "2.15.1";

/// NATS servers with JetStream in one cluster on this machine, each with a store folder, a
/// port and the placement tag `ste:<index>` of its own, killed when dropped. The cluster's name
/// is its own too (from its first client port), so that the servers of two clusters on one
/// machine never join each other. Ready once every
/// server reports itself healthy, which in a cluster includes knowing JetStream's meta leader.
pub struct NatsCluster {
    binary: PathBuf,
    servers: Vec<NatsMember>,
    /// Every server's client URL, separated by commas.
    pub url: String,
    /// The servers' placement tags, separated by commas (`--nats-placement`).
    pub placement: String,
}

/// One server of a [`NatsCluster`].
struct NatsMember {
    child: Option<Child>,
    config: PathBuf,
    log: PathBuf,
    monitor_port: u16,
}

impl NatsCluster {
    /// Starts `count` servers of `binary` with their configurations, stores and logs in `dir`;
    /// with `secrets` (a folder `driver secrets` made), TLS required of clients and routes and
    /// only the identities of its authorization let in.
    pub fn start(
        binary: &Path,
        count: usize,
        dir: &Path,
        secrets: Option<&Path>,
    ) -> anyhow::Result<Self> {
        let settings = secrets
            .map(crate::secrets::nats_server_settings)
            .transpose()?;
        let (top, route_tls) = settings
            .map(|settings| (settings.top, settings.cluster))
            .unwrap_or_default();
        let ports = (0..count)
            .map(|_| Ok([free_port()?, free_port()?, free_port()?]))
            .collect::<anyhow::Result<Vec<[u16; 3]>>>()?;
        let routes: Vec<String> = ports
            .iter()
            .map(|[_, route, _]| format!("nats-route://127.0.0.1:{route}"))
            .collect();
        let mut servers = Vec::with_capacity(count);
        for (index, [client, route, monitor]) in ports.iter().enumerate() {
            let store = dir.join(format!("nats-{index}"));
            std::fs::create_dir_all(&store)
                .with_context(|| format!("creating {}", store.display()))?;
            let cluster = if count > 1 {
                format!(
                    // Clients use the URLs they were given and no other (a nemesis's forwarders
                    // stand between some of them and the servers).
                    "cluster {{\n  name: ste-{}\n  listen: 127.0.0.1:{route}\n  routes: [{}]\n  \
                     no_advertise: true\n  {route_tls}\n}}\n",
                    ports[0][0],
                    routes.join(", ")
                )
            } else {
                String::new()
            };
            let config = dir.join(format!("nats-{index}.conf"));
            std::fs::write(
                &config,
                format!(
                    "server_name: ste-nats-{index}\nlisten: 127.0.0.1:{client}\n\
                     http: 127.0.0.1:{monitor}\nserver_tags: [\"ste:{index}\"]\n\
                     jetstream {{ store_dir: \"{}\" }}\n{cluster}{top}",
                    store.display()
                ),
            )
            .with_context(|| format!("writing {}", config.display()))?;
            servers.push(NatsMember {
                child: None,
                config,
                log: dir.join(format!("nats-{index}.log")),
                monitor_port: *monitor,
            });
        }
        let mut cluster = Self {
            binary: binary.to_owned(),
            servers,
            url: ports
                .iter()
                .map(|[client, _, _]| format!("nats://127.0.0.1:{client}"))
                .collect::<Vec<_>>()
                .join(","),
            placement: (0..count)
                .map(|index| format!("ste:{index}"))
                .collect::<Vec<_>>()
                .join(","),
        };
        // None of them runs yet.
        cluster.start_all_again()?;
        Ok(cluster)
    }

    fn spawn(&mut self, index: usize) -> anyhow::Result<()> {
        let member = &mut self.servers[index];
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&member.log)
            .with_context(|| format!("opening {}", member.log.display()))?;
        member.child = Some(
            Command::new(&self.binary)
                .arg("-c")
                .arg(&member.config)
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .with_context(|| format!("starting {}", self.binary.display()))?,
        );
        Ok(())
    }

    /// Waits (30 s at most) until server `index` answers its health check with 200; fails at
    /// once, with the end of its log, if it has exited.
    fn wait_healthy(&mut self, index: usize) -> anyhow::Result<()> {
        let member = &mut self.servers[index];
        let port = member.monitor_port;
        let mut exited = None;
        let waited = wait_until(&format!("NATS server {index} is healthy"), || {
            if let Some(Ok(Some(status))) = member.child.as_mut().map(Child::try_wait) {
                exited = Some(status);
                return true;
            }
            monitor_get(port, "/healthz").is_some_and(|(status, _)| status == 200)
        });
        let tail = || end_of_log(&member.log, 5);
        if let Some(status) = exited {
            let tail = tail();
            member.child = None;
            bail!("NATS server {index} exited ({status}); {tail}");
        }
        waited.with_context(tail)
    }

    /// Waits (30 s at most) until the JetStream meta group has a leader that counts every
    /// other server as a current follower (only the leader knows): before that, a replicated
    /// bucket may be refused with "peer offline".
    fn wait_formed(&self) -> anyhow::Result<()> {
        let count = self.servers.len();
        if count == 1 {
            return Ok(());
        }
        wait_until("the NATS servers' JetStream cluster has formed", || {
            self.servers.iter().enumerate().any(|(index, member)| {
                let Some((200, body)) = monitor_get(member.monitor_port, "/jsz") else {
                    return false;
                };
                let Ok(jsz) = serde_json::from_str::<serde_json::Value>(&body) else {
                    return false;
                };
                let meta = &jsz["meta_cluster"];
                let followers = meta["replicas"].as_array().map_or(&[][..], Vec::as_slice);
                meta["leader"].as_str() == Some(&format!("ste-nats-{index}"))
                    && meta["cluster_size"].as_u64() == Some(count as u64)
                    && followers.len() + 1 == count
                    && followers.iter().all(|peer| {
                        peer["current"].as_bool() == Some(true)
                            && peer["offline"].as_bool() != Some(true)
                    })
            })
        })
    }

    /// Kills server `index` (SIGKILL, as a crash).
    pub fn kill(&mut self, index: usize) {
        if let Some(mut child) = self.servers[index].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts server `index` again on its port and store, and waits until it is healthy.
    pub fn start_again(&mut self, index: usize) -> anyhow::Result<()> {
        self.spawn(index)?;
        self.wait_healthy(index)?;
        self.wait_formed()
    }

    /// Starts every server that is not running (again, on its port and store), and waits until
    /// they are healthy and have formed their cluster: all at once, since after
    /// [`NatsCluster::stop`] one alone would wait for the others to elect a leader.
    pub fn start_all_again(&mut self) -> anyhow::Result<()> {
        let stopped: Vec<usize> = (0..self.servers.len())
            .filter(|index| self.servers[*index].child.is_none())
            .collect();
        for index in &stopped {
            self.spawn(*index)?;
        }
        for index in stopped {
            self.wait_healthy(index)?;
        }
        self.wait_formed()
    }

    /// Stops every server (SIGTERM, as an operator would) and waits until they have gone.
    pub fn stop(&mut self) {
        for member in &mut self.servers {
            if let Some(mut child) = member.child.take() {
                let _ = Command::new("kill").arg(child.id().to_string()).status();
                let _ = child.wait();
            }
        }
    }
}

impl Drop for NatsCluster {
    fn drop(&mut self) {
        for member in &mut self.servers {
            if let Some(mut child) = member.child.take() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
}

/// Asks `condition` every 100 ms until it holds, for 30 s at most.
fn wait_until(what: &str, mut condition: impl FnMut() -> bool) -> anyhow::Result<()> {
    let started = Instant::now();
    while !condition() {
        if started.elapsed() > Duration::from_secs(30) {
            bail!("waited 30 s until {what}, in vain");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(())
}

/// The last `count` lines of the log at `path`, introduced by its name: for an error about the
/// process that wrote it, whose folder may not outlive the error's reader.
pub(crate) fn end_of_log(path: &Path, count: usize) -> String {
    let log = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = log.lines().collect();
    format!(
        "the end of {}:\n{}",
        path.display(),
        lines[lines.len().saturating_sub(count)..].join("\n")
    )
}

/// The status and body of a GET of `path` on a NATS server's monitoring port (None when it
/// does not answer).
fn monitor_get(port: u16, path: &str) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\n\r\n").as_bytes())
        .ok()?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).ok()?;
    let status = answer.split(' ').nth(1)?.parse().ok()?;
    let body = answer.split_once("\r\n\r\n").map_or("", |(_, body)| body);
    Some((status, body.to_owned()))
}

/// A CPU cap on one process: a group of cgroup v1's cpu controller of its own, with a quota of
/// `cores` × the period, the process moved into it (its threads with it, and those it starts
/// later).
pub struct CpuCap {
    dir: PathBuf,
}

/// Where cgroup v1's cpu controller is mounted.
const CPU_CGROUPS: &str = "/sys/fs/cgroup/cpu";
/// The period of a cap's quota, µs.
const CPU_PERIOD_US: u64 = 100_000;

impl CpuCap {
    /// Caps process `pid` at `cores` in a new group `name`.
    pub fn apply(name: &str, pid: u32, cores: f64) -> anyhow::Result<Self> {
        let root = Path::new(CPU_CGROUPS);
        if !root.join("cpu.cfs_quota_us").exists() {
            bail!(
                "--node-cpus needs cgroup v1's cpu controller at {CPU_CGROUPS} (and the right to \
                 make groups there)"
            );
        }
        let dir = root.join(name);
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let cap = Self { dir };
        let quota = ((cores * CPU_PERIOD_US as f64).round() as u64).max(1_000);
        for (file, value) in [
            ("cpu.cfs_period_us", CPU_PERIOD_US.to_string()),
            ("cpu.cfs_quota_us", quota.to_string()),
            ("cgroup.procs", pid.to_string()),
        ] {
            std::fs::write(cap.dir.join(file), value)
                .with_context(|| format!("writing {}", cap.dir.join(file).display()))?;
        }
        Ok(cap)
    }

    /// Removes the group (once its processes have gone).
    pub fn remove(self) {
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// NATS servers of a local cluster.
pub const LOCAL_NATS_SERVERS: usize = 3;

/// Where the programs a local cluster runs are: `engine` beside this executable, and the
/// pinned `nats-server` ([`pinned_nats_server`]).
pub fn local_programs() -> anyhow::Result<(PathBuf, PathBuf)> {
    let engine = std::env::current_exe()
        .context("locating the driver's executable")?
        .with_file_name("engine");
    if !engine.exists() {
        bail!(
            "{} is missing: build it beside the driver (cargo build --release --bin engine)",
            engine.display()
        );
    }
    let nats = pinned_nats_server()?;
    Ok((engine, nats))
}

/// What every node of a local cluster is started with.
pub struct NodeSpec<'a> {
    pub engine: &'a Path,
    pub nats_url: &'a str,
    pub placement: &'a str,
    /// The cluster's secrets folder (`driver secrets`).
    pub secrets: &'a Path,
    /// The participants' key set.
    pub keys: &'a Path,
    /// One per shard.
    pub db_urls: &'a [String],
    pub max_shards: u32,
}

/// The command line of engine node `id` of a local cluster (its log level from `RUST_LOG`,
/// else info); the caller adds further arguments and the node's output.
pub fn node_command(spec: &NodeSpec<'_>, id: &str) -> Command {
    let mut command = Command::new(spec.engine);
    command
        .args(["--nats", spec.nats_url, "--node-id", id])
        .args(["--nats-placement", spec.placement])
        .arg("--secrets")
        .arg(spec.secrets)
        .arg("--keys")
        .arg(spec.keys)
        .args(spec.db_urls.iter().flat_map(|url| ["--db", url.as_str()]))
        .args(["--max-shards", &spec.max_shards.to_string()])
        .env(
            "RUST_LOG",
            std::env::var("RUST_LOG").unwrap_or_else(|_| "info,sqlx=error".into()),
        );
    command
}

fn free_port() -> anyhow::Result<u16> {
    ste_engine::ports::free_local_port().context("finding a free port")
}

impl LocalCluster {
    pub fn start(spec: &LocalSpec<'_>) -> anyhow::Result<Self> {
        let mut db_urls = Vec::with_capacity(spec.servers.len());
        for (index, server) in spec.servers.iter().enumerate() {
            db_urls.push(
                PgStore::recreate_database(server, &sweep_database(index), true)
                    .with_context(|| format!("making shard {index}'s database"))?,
            );
        }
        // Every level on TLS and identities, as a cluster runs.
        let secrets = spec.dir.join("secrets");
        crate::secrets::ensure(&crate::secrets::SecretsSpec::new(&secrets))?;
        let nats = NatsCluster::start(
            spec.nats_server,
            LOCAL_NATS_SERVERS,
            spec.dir,
            Some(&secrets),
        )?;
        let mut cluster = Self {
            secrets,
            nats_url: nats.url.clone(),
            nats_placement: nats.placement.clone(),
            nats,
            nodes: Vec::new(),
            caps: Vec::new(),
            db_urls,
        };
        for node in 1..=spec.share.nodes {
            let id = format!("node-{node}");
            let log = std::fs::File::create(spec.dir.join(format!("{id}.log")))
                .with_context(|| format!("{id}.log"))?;
            let child = node_command(
                &NodeSpec {
                    engine: spec.engine,
                    nats_url: &cluster.nats_url,
                    placement: &cluster.nats_placement,
                    secrets: &cluster.secrets,
                    keys: spec.keys,
                    db_urls: &cluster.db_urls,
                    max_shards: spec.share.max_shards(),
                },
                &id,
            )
            .args(spec.node_args)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", spec.engine.display()));
            match child {
                Ok(child) => {
                    let pid = child.id();
                    cluster.nodes.push((id.clone(), child));
                    if let Some(cpus) = spec.node_cpus {
                        match CpuCap::apply(&format!("ste-{}-{id}", std::process::id()), pid, cpus)
                        {
                            Ok(cap) => cluster.caps.push(cap),
                            Err(error) => {
                                cluster.stop()?;
                                return Err(error);
                            }
                        }
                    }
                }
                Err(error) => {
                    cluster.stop()?;
                    return Err(error);
                }
            }
        }
        Ok(cluster)
    }

    /// Stops the nodes (SIGTERM, then SIGKILL after 15 s), then NATS, and drops the level's
    /// databases.
    pub fn stop(mut self) -> anyhow::Result<()> {
        for (_, child) in &self.nodes {
            let _ = Command::new("kill")
                .args(["-TERM", &child.id().to_string()])
                .status();
        }
        for (id, child) in &mut self.nodes {
            let started = Instant::now();
            while child.try_wait()?.is_none() {
                if started.elapsed() > Duration::from_secs(15) {
                    eprintln!("{id} did not stop within 15 s of SIGTERM: killed");
                    let _ = child.kill();
                    let _ = child.wait();
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        self.nats.stop();
        for cap in self.caps.drain(..) {
            cap.remove();
        }
        for (index, url) in self.db_urls.iter().enumerate() {
            PgStore::recreate_database(url, &sweep_database(index), false)
                .with_context(|| format!("dropping shard {index}'s database"))?;
        }
        Ok(())
    }
}

/// The docker-compose cluster of `deploy/docker-compose.yml`, driven through the compose
/// command line (`docker compose`, or the older `docker-compose`).
pub struct Compose {
    program: Vec<String>,
    file: PathBuf,
}

/// The compose project of a sweep's clusters (its containers and volumes are named after it).
const COMPOSE_PROJECT: &str = "ste-sweep";

/// The shard URLs inside the compose network.
fn compose_shard_url(shard: u32) -> String {
    format!(
        "postgres://ste_shard_{shard}@shard-{shard}:5432/ste?sslmode=verify-full&sslrootcert=/run/secrets/ca.pem"
    )
}

impl Compose {
    /// Finds a compose command that answers.
    pub fn find(file: &Path) -> anyhow::Result<Self> {
        if !file.exists() {
            bail!("{} does not exist", file.display());
        }
        for program in [&["docker", "compose"][..], &["docker-compose"][..]] {
            let answers = Command::new(program[0])
                .args(&program[1..])
                .arg("version")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|status| status.success());
            if answers {
                return Ok(Self {
                    program: program.iter().map(|p| p.to_string()).collect(),
                    file: file.to_owned(),
                });
            }
        }
        bail!("neither `docker compose` nor `docker-compose` answers: install Docker with compose (deploy/compose-run.sh does)")
    }

    fn command(&self, share: Share) -> Command {
        let mut command = Command::new(&self.program[0]);
        command
            .args(&self.program[1..])
            .args(["-p", COMPOSE_PROJECT, "-f"])
            .arg(&self.file)
            .env(
                "STE_COMPOSE_SHARD_URLS",
                (0..share.shards)
                    .map(compose_shard_url)
                    .collect::<Vec<_>>()
                    .join(","),
            )
            .env("STE_COMPOSE_MAX_SHARDS", share.max_shards().to_string());
        command
    }

    fn run(&self, share: Share, args: &[&str]) -> anyhow::Result<()> {
        let status = self
            .command(share)
            .args(args)
            .stdout(Stdio::null())
            .status()
            .with_context(|| format!("running {} {}", self.program.join(" "), args.join(" ")))?;
        if !status.success() {
            bail!(
                "{} {} failed ({status})",
                self.program.join(" "),
                args.join(" ")
            );
        }
        Ok(())
    }

    /// Removes the cluster with its volumes: what each level starts from and the sweep ends
    /// with.
    pub fn down(&self) -> anyhow::Result<()> {
        let share = Share {
            nodes: 1,
            shards: 1,
        };
        self.run(share, &["down", "-v", "--remove-orphans"])
    }

    /// One level: a fresh cluster of `share.nodes` nodes on `share.shards` shards, then the
    /// compose file's driver with `driver_args` (the load, `--json`), whose summary it
    /// returns with the CPU the run cost this machine.
    pub fn level(
        &self,
        share: Share,
        node_cpus: Option<f64>,
        driver_args: &[String],
    ) -> anyhow::Result<(Summary, CpuUse)> {
        self.down()?;
        let scale = format!("node={}", share.nodes);
        let status = self
            .command(share)
            .env(
                "STE_COMPOSE_NODE_CPUS",
                node_cpus.map_or_else(|| "0".to_owned(), |cpus| cpus.to_string()),
            )
            .args(["up", "-d", "--no-build", "--scale", &scale, "node"])
            .stdout(Stdio::null())
            .status()
            .context("running docker compose up")?;
        if !status.success() {
            bail!("docker compose up failed ({status})");
        }
        let before = CpuReading::now();
        let output = self
            .command(share)
            .args(["run", "--rm", "--no-deps", "-T", "driver"])
            .args(driver_args)
            .stderr(Stdio::inherit())
            .output()
            .context("running the compose file's driver")?;
        let cpu = before.until(&CpuReading::now());
        if !output.status.success() {
            bail!("the compose file's driver failed ({})", output.status);
        }
        let summary: Summary = serde_json::from_slice(&output.stdout)
            .context("reading the summary the compose file's driver printed")?;
        // Inside its container the driver sees the whole machine's /proc/stat but only its
        // own processes: its reading gives the load's span and busy time, this one (wider: the
        // container's start and the final reads too) the split by program, scaled to it.
        let cpu = match &summary.cpu {
            Some(load) if cpu.busy_s > 0.0 => {
                let scale = load.busy_s / cpu.busy_s;
                CpuUse {
                    seconds: load.seconds,
                    cores: load.cores,
                    busy_s: load.busy_s,
                    by_program_s: cpu
                        .by_program_s
                        .iter()
                        .map(|(program, seconds)| (program.clone(), seconds * scale))
                        .collect(),
                }
            }
            _ => cpu,
        };
        Ok((summary, cpu))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_share_spreads_the_shards_over_the_nodes() {
        let share = |nodes, shards| Share { nodes, shards };
        assert_eq!(share(1, 4).max_shards(), 4);
        assert_eq!(share(3, 4).max_shards(), 2);
        assert_eq!(share(8, 1).max_shards(), 1);
    }

    #[test]
    fn this_process_is_read_and_its_cpu_counted() {
        let before = CpuReading::now();
        let me = std::process::id();
        assert!(before.processes.contains_key(&me), "no /proc/{me}/stat");
        // Burn CPU in this process until /proc says it has spent 0.2 s more.
        let mut x = 0u64;
        let started = Instant::now();
        while process_cpu(me).expect("/proc/self").1 - before.processes[&me].1 < 0.2 {
            for _ in 0..100_000 {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
            }
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "no CPU time counted"
            );
        }
        std::hint::black_box(x);
        let after = CpuReading::now();
        let mine = after.processes[&me].1 - before.processes[&me].1;
        assert!(mine >= 0.2, "{mine} CPU seconds");
        let used = before.until(&after);
        // The machine was busy at least while this process was, and the rest is accounted.
        assert!(used.busy_s >= mine - 0.02, "{used:?}");
        let programs: f64 = used.by_program_s.values().sum();
        assert!(
            (programs - used.busy_s).abs() < 1e-6 || programs > used.busy_s,
            "{used:?}"
        );
    }
}
