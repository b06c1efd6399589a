//! A cluster of engine nodes (the `engine` binary with `--nats`) on a cluster of three NATS
//! servers of the test's own (the pinned release) and four PostgreSQL databases, loaded by
//! `driver --nats`: the outcome, the routing of every shard, and what survives nodes killed and
//! stalled, a NATS server killed and a database stopped.
//!
//! The engine binary is the workspace's (`cargo test --workspace` builds it beside the
//! driver's).

mod browser;
#[path = "../../engine/tests/common/mod.rs"]
mod common;

use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::block_on;
use sqlx::{Connection, PgConnection};
use ste_driver::scale::NatsCluster;
use ste_engine::cluster::roles::Role;
use ste_engine::cluster::{retrying, ClusterAccess, STARTING_PATIENCE};
use ste_engine::lease::{Leased, Leases};
use ste_engine::queue::jetstream::{JetStream, Placement};
use ste_engine::routing::shard_of;

const SHARDS: u32 = 4;
const LEASE_TTL_MS: u64 = 2_000;

fn engine_binary() -> PathBuf {
    let path = PathBuf::from(env!("CARGO_BIN_EXE_driver")).with_file_name("engine");
    assert!(
        path.exists(),
        "{} is missing: cargo test --workspace builds it (or cargo build -p ste-bridge --bin engine)",
        path.display()
    );
    path
}

/// Nodes, their NATS server and their shards' databases.
struct Cluster {
    nats: NatsCluster,
    databases: Databases,
    dir: tempfile::TempDir,
    keys: PathBuf,
    /// The cluster's secrets folder (`driver secrets`).
    secrets: PathBuf,
    nodes: Vec<(String, Child)>,
    /// Held while the cluster lives (dropped last).
    _one: std::sync::MutexGuard<'static, ()>,
}

/// The shards' databases, on PostgreSQL instances of the test's own (`deploy/local-cluster.sh`:
/// each shard's role with a password over TLS, as every cluster runs), which it can stop.
struct Databases {
    dir: tempfile::TempDir,
    first_port: u32,
}

impl Databases {
    /// The shards' URLs, as the nodes and the driver are given them (each shard's run-time
    /// role, whose password is in the secrets' pgpass).
    fn urls(&self) -> Vec<String> {
        self.script_lines("urls")
    }

    /// The shards' URLs as the role that owns them, who may make databases (a sweep's levels).
    fn owner_urls(&self) -> Vec<String> {
        self.script_lines("owner-urls")
    }

    fn script_lines(&self, command: &str) -> Vec<String> {
        let output = Self::script(&[command], self.dir.path())
            .output()
            .expect("deploy/local-cluster.sh runs");
        String::from_utf8(output.stdout)
            .expect("UTF-8")
            .lines()
            .map(str::to_owned)
            .collect()
    }

    /// The shards' URLs for the test's own reads, with each shard role's password in them (the
    /// processes read theirs from the secrets' pgpass).
    fn reader_urls(&self) -> Vec<String> {
        let secrets = self.secrets();
        self.urls()
            .iter()
            .enumerate()
            .map(|(shard, url)| {
                let role = ste_driver::secrets::pg_shard_role(shard as u32);
                let password =
                    std::fs::read_to_string(ste_driver::secrets::pg_password_file(&secrets, &role))
                        .expect("the shard role's password");
                url.replacen(
                    &format!("{role}@"),
                    &format!("{role}:{}@", password.trim()),
                    1,
                )
            })
            .collect()
    }

    /// The instances' folder.
    fn dir(&self) -> PathBuf {
        self.dir.path().to_owned()
    }

    /// The secrets folder `deploy/local-cluster.sh` made for the instances, which the NATS
    /// servers, nodes and drivers of the cluster use too.
    fn secrets(&self) -> PathBuf {
        self.dir.path().join("secrets")
    }

    fn script(args: &[&str], dir: &std::path::Path) -> Command {
        let driver = PathBuf::from(env!("CARGO_BIN_EXE_driver"));
        let mut command = Command::new(
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/local-cluster.sh"),
        );
        command
            .args(args)
            .arg("--dir")
            .arg(dir)
            .env("STE_BIN", driver.parent().expect("the binaries' folder"));
        command
    }

    fn instances(args: &[&str], dir: &std::path::Path) -> bool {
        Self::script(args, dir)
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|status| status.success())
    }

    /// Instances for a test holding [`one_cluster`] (one set at a time), in a folder named
    /// after `label`.
    fn own(label: &str) -> Self {
        let dir = tempfile::Builder::new()
            .prefix(&format!("{label}-"))
            .tempdir()
            .expect("a folder");
        // Below the kernel's ephemeral range (32768–60999 here), so that no outgoing
        // connection holds one of the ports.
        let first_port = 26_000 + (std::process::id() % 500) * 4;
        assert!(
            Self::instances(
                &["up", &SHARDS.to_string(), "--port", &first_port.to_string()],
                dir.path()
            ),
            "the shards' PostgreSQL instances start"
        );
        Self { dir, first_port }
    }

    /// Stops shard `shard`'s instance abruptly.
    fn crash(&self, shard: u32) {
        assert!(Self::instances(
            &["crash", &shard.to_string()],
            self.dir.path()
        ));
    }

    /// Starts every stopped instance again.
    fn restart(&self) {
        assert!(Self::instances(
            &[
                "up",
                &SHARDS.to_string(),
                "--port",
                &self.first_port.to_string()
            ],
            self.dir.path()
        ));
    }
}

impl Drop for Databases {
    fn drop(&mut self) {
        Self::instances(&["down"], self.dir.path());
    }
}

impl Cluster {
    /// A cluster on NATS servers and PostgreSQL instances of its own, with TLS and identities
    /// everywhere, as every cluster runs; one at a time.
    fn start(label: &str) -> Self {
        let one = one_cluster();
        let databases = Databases::own(label);
        let dir = tempfile::tempdir().expect("a folder");
        let nats_dir = dir.path().join("nats");
        std::fs::create_dir_all(&nats_dir).expect("a folder");
        // The secrets the instances were made with (local-cluster.sh), for NATS too.
        let secrets = databases.secrets();
        let nats = NatsCluster::start(
            &ste_driver::scale::pinned_nats_server().expect("the pinned NATS release"),
            3,
            &nats_dir,
            Some(&secrets),
        )
        .expect("three NATS servers");
        let keys = dir.path().join("keys.csv");
        let status = Command::new(env!("CARGO_BIN_EXE_driver"))
            .args(["keys", "--out"])
            .arg(&keys)
            .stdout(Stdio::null())
            .status()
            .expect("driver keys");
        assert!(status.success());
        Self {
            nats,
            databases,
            dir,
            keys,
            secrets,
            nodes: Vec::new(),
            _one: one,
        }
    }

    fn db_args(&self) -> Vec<String> {
        self.databases
            .urls()
            .into_iter()
            .flat_map(|url| ["--db".to_owned(), url])
            .collect()
    }

    /// Starts node `id`: at most two shards.
    fn start_node(&mut self, id: &str) {
        self.start_node_with(id, &[]);
    }

    /// Starts node `id` with `extra` arguments (`--max-shards` among them replaces the bounds).
    fn start_node_with(&mut self, id: &str, extra: &[&str]) {
        let child = self.spawn_node(id, extra, Stdio::null());
        self.nodes.push((id.to_owned(), child));
    }

    /// Starts node `id` with the participants' listeners on free ports and the cluster's sink;
    /// returns the address of its framed-XML listener.
    fn start_gateway_node(&mut self, id: &str) -> String {
        let mut extra = vec!["--gateway", "--sink"];
        extra.extend(ste_bridge::bench::LOOPBACK_LISTENERS);
        let mut child = self.spawn_node(id, &extra, Stdio::piped());
        let stdout = child.stdout.take().expect("the node's stdout");
        let mut lines = std::io::BufRead::lines(std::io::BufReader::new(stdout));
        let address = lines
            .find_map(|line| line.ok()?.strip_prefix("tcp ").map(str::to_owned))
            .unwrap_or_else(|| panic!("{id} announced no listener:\n{}", self.log(id)));
        // The node's later lines go nowhere, and it never blocks writing them.
        std::thread::spawn(move || lines.for_each(drop));
        self.nodes.push((id.to_owned(), child));
        address
    }

    /// Node `node-a` serving the participants' listeners and running the sink, `node-b` and
    /// `node-c` beside it, every shard held; returns node-a's framed-XML address.
    fn with_gateway_node(&mut self) -> String {
        let address = self.start_gateway_node("node-a");
        for id in ["node-b", "node-c"] {
            self.start_node(id);
        }
        self.wait_until_held(&self.leases());
        address
    }

    /// A participant's driver over TCP to the gateway at `address`, with `args`: a faulty
    /// load whose summary comes in JSON on its standard output.
    fn participant(&self, address: &str, args: &[&str]) -> Command {
        let mut command = Command::new(env!("CARGO_BIN_EXE_driver"));
        command
            .args(args)
            .args(["--fault-rate", "0.1"])
            .args(["--target", &format!("tcp://{address}"), "--quiet", "--json"])
            .arg("--keys")
            .arg(&self.keys);
        command
    }

    fn spawn_node(&self, id: &str, extra: &[&str], stdout: Stdio) -> Child {
        let log = std::fs::File::create(self.dir.path().join(format!("{id}.log"))).expect("log");
        Command::new(engine_binary())
            .args(["--nats", &self.nats.url, "--node-id", id])
            .args(["--nats-placement", &self.nats.placement])
            .arg("--secrets")
            .arg(&self.secrets)
            .arg("--keys")
            .arg(&self.keys)
            .args(self.db_args())
            .args(if extra.contains(&"--max-shards") {
                &[][..]
            } else {
                &["--max-shards", "2"][..]
            })
            .args(["--lease-ttl-ms", &LEASE_TTL_MS.to_string()])
            // Small generations: the matchers retire what their shards committed many times a
            // run, and a message that needs it is answered from the shard.
            .args(["--matcher-generation", "1024"])
            .args(extra)
            .env("RUST_LOG", "info,sqlx=error")
            .stdout(stdout)
            .stderr(log)
            .spawn()
            .expect("the engine starts")
    }

    fn log(&self, id: &str) -> String {
        std::fs::read_to_string(self.dir.path().join(format!("{id}.log"))).unwrap_or_default()
    }

    fn pid(&self, id: &str) -> u32 {
        self.nodes
            .iter()
            .find(|(node, _)| node == id)
            .map(|(_, child)| child.id())
            .expect("a running node")
    }

    /// SIGKILL, as a crash.
    fn kill(&mut self, id: &str) {
        let index = self
            .nodes
            .iter()
            .position(|(node, _)| node == id)
            .expect("a running node");
        let (_, mut child) = self.nodes.remove(index);
        let _ = child.kill();
        let _ = child.wait();
    }

    fn signal(&self, id: &str, signal: &str) {
        let status = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(self.pid(id).to_string())
            .status()
            .expect("kill");
        assert!(status.success());
    }

    /// A cluster of three nodes, each shard held.
    fn of_three_nodes(label: &str) -> Self {
        Self::start(label).with_three_nodes()
    }

    fn with_three_nodes(mut self) -> Self {
        for id in ["node-a", "node-b", "node-c"] {
            self.start_node(id);
        }
        self.wait_until_held(&self.leases());
        self
    }

    /// A connection to the cluster's NATS servers as `role`, placing as the nodes do.
    fn connect_as(&self, role: Role) -> JetStream {
        ClusterAccess {
            url: self.nats.url.clone(),
            placement: Placement::parse(Some(&self.nats.placement), 1)
                .expect("the cluster's placement"),
            secrets: Some(self.secrets.clone()),
        }
        .connect(role)
        .expect("connects")
    }

    /// A connection to the cluster's NATS servers as the monitor, which reads the queues'
    /// state and the leases.
    fn jetstream(&self) -> JetStream {
        self.connect_as(Role::Monitor)
    }

    /// The cluster's leases, tried again as the nodes do while the servers elect the bucket's
    /// leader (a busy machine may time a request out meanwhile).
    fn leases(&self) -> Leases {
        let jetstream = self.jetstream();
        retrying(STARTING_PATIENCE, || {
            Leases::open(&jetstream, Duration::from_millis(LEASE_TTL_MS))
        })
        .expect("leases")
    }

    /// Waits until every shard has a holder.
    fn wait_until_held(&self, leases: &Leases) {
        let started = Instant::now();
        loop {
            if (0..SHARDS).all(|k| matches!(leases.holder(Leased::Shard(k)), Ok(Some(_)))) {
                return;
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "the nodes did not take every shard"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// `driver --nats` with a paced faulty, shuffled run of `trades`, so that what the test
    /// does to the cluster falls inside the run, in the background.
    fn paced_driver(&self, trades: u64) -> Child {
        self.driver(&[
            "--trades",
            &trades.to_string(),
            "--fault-rate",
            "0.1",
            "--shuffle",
            "--rate",
            "2500",
        ])
    }

    /// `driver --nats` with `args`, in the background.
    fn driver(&self, args: &[&str]) -> Child {
        Command::new(env!("CARGO_BIN_EXE_driver"))
            .args(args)
            .args(["--nats", &self.nats.url, "--quiet", "--json"])
            .args(["--nats-placement", &self.nats.placement])
            .arg("--secrets")
            .arg(&self.secrets)
            .arg("--keys")
            .arg(&self.keys)
            .arg("--run-dir")
            .arg(self.dir.path().join("run"))
            .args(self.db_args())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the driver runs")
    }

    /// The shards' trade keys, each shard's own.
    fn trade_keys(&self) -> Vec<Vec<String>> {
        self.databases
            .reader_urls()
            .iter()
            .map(|url| {
                ste_engine::store::PgStore::open(url)
                    .and_then(|mut store| store.trade_keys())
                    .expect("the shard's trade keys")
            })
            .collect()
    }

    /// Messages stored twice (same sender and MsgId) across the shards.
    fn stored_twice(&self) -> i64 {
        self.databases
            .reader_urls()
            .iter()
            .map(|url| {
                block_on(async {
                    let mut connection = PgConnection::connect(url).await.expect("connects");
                    let (twice,): (i64,) = sqlx::query_as(
                        "SELECT COUNT(*) FROM (SELECT sender, msg_id FROM messages \
                         GROUP BY sender, msg_id HAVING COUNT(*) > 1) d",
                    )
                    .fetch_one(&mut connection)
                    .await
                    .expect("count");
                    let (cls_twice,): (i64,) = sqlx::query_as(
                        "SELECT COUNT(*) FROM (SELECT cls_id FROM cls_outbox \
                         GROUP BY cls_id HAVING COUNT(*) > 1) d",
                    )
                    .fetch_one(&mut connection)
                    .await
                    .expect("count");
                    twice + cls_twice
                })
            })
            .sum()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for (_, child) in &mut self.nodes {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// One cluster at a time: two cores do not run four of them and keep their leases in time.
static ONE_CLUSTER: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_cluster() -> std::sync::MutexGuard<'static, ()> {
    ONE_CLUSTER
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The summary of a run during which nodes failed. A message whose answer was lost with a node
/// is delivered again and answered DUPLICATE (the shard holds it), so the run may differ from
/// the generator's expectation there, and only there: accepted and duplicates move between
/// each other, everything else is exact. Nothing is stored twice, and every shard holds its own
/// trades.
fn summary_after_failures(output: &Output, cluster: &Cluster) -> serde_json::Value {
    let summary: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap_or_else(|_| {
        panic!(
            "driver: {}\nnode-a: {}",
            String::from_utf8_lossy(&output.stderr),
            cluster.log("node-a")
        )
    });
    let expected = &summary["expected"];
    let number = |value: &serde_json::Value| value.as_u64().expect("a count");
    assert_eq!(summary["conserved"], true, "{summary:#}");
    assert_eq!(summary["exceptions"], expected["exceptions"], "{summary:#}");
    assert_eq!(
        summary["cls"], expected["cls"],
        "one CLS per matched trade: {summary:#}"
    );
    assert_eq!(
        number(&summary["accepted"]) + number(&summary["duplicates"]),
        number(&expected["accepted"]) + number(&expected["duplicates"]),
        "{summary:#}"
    );
    for state in ["mismatched_trades", "pending_trades", "cancelled_trades"] {
        assert_eq!(summary[state], expected[state], "{state}: {summary:#}");
    }
    if !output.status.success() {
        assert!(
            String::from_utf8_lossy(&output.stderr).contains("differs"),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let stored: u64 = summary["shards"]
        .as_array()
        .expect("shards")
        .iter()
        .map(|shard| number(&shard["stored_messages"]))
        .sum();
    assert_eq!(
        stored,
        number(&expected["accepted"]),
        "every accepted message stored once"
    );
    eprintln!(
        "accepted {} (expected {}), duplicates {} (expected {}), CLS repeats dropped {}",
        summary["accepted"],
        expected["accepted"],
        summary["duplicates"],
        expected["duplicates"],
        summary["cls_repeats"]
    );
    summary
}

fn summary_of(output: &Output, cluster: &Cluster) -> serde_json::Value {
    assert!(
        output.status.success(),
        "driver: {}\nnode-a: {}",
        String::from_utf8_lossy(&output.stderr),
        cluster.log("node-a")
    );
    serde_json::from_slice(&output.stdout).expect("the summary in JSON")
}

/// The node holding `shard`, waiting out a hand-over (a shard given back to a node that joined
/// is briefly held by nobody).
fn owner_of(leases: &Leases, shard: u32) -> String {
    let started = Instant::now();
    loop {
        if let Some(owner) = leases.holder(Leased::Shard(shard)).expect("lease bucket") {
            return owner;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "nobody holds shard {shard}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits for a node other than `owner` to hold `shard`, within the lease's time to live and a
/// recovery (eight times the time to live: a guard against a hang, with room for a machine
/// whose two cores also run the other tests' clusters); returns it.
fn new_owner(leases: &Leases, shard: u32, owner: &str) -> String {
    let since = Instant::now();
    loop {
        match leases.holder(Leased::Shard(shard)) {
            Ok(Some(holder)) if holder != owner => return holder,
            _ => {}
        }
        assert!(
            since.elapsed() < Duration::from_millis(LEASE_TTL_MS * 8),
            "shard {shard} was not taken over from {owner}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn assert_routed(cluster: &Cluster) {
    for (shard, keys) in cluster.trade_keys().iter().enumerate() {
        assert!(!keys.is_empty(), "shard {shard} holds trades");
        for key in keys {
            assert_eq!(
                shard_of(key, SHARDS),
                shard as u32,
                "{key} is on shard {shard}"
            );
        }
    }
}

#[test]
fn three_nodes_on_four_shards_give_the_outcome_the_generator_expected() {
    let cluster = Cluster::of_three_nodes("cluster_outcome");
    let output = cluster
        .driver(&["--trades", "20000", "--fault-rate", "0.1", "--shuffle"])
        .wait_with_output()
        .expect("the driver ends");
    let summary = summary_of(&output, &cluster);
    assert_eq!(summary["conserved"], true, "{summary:#}");
    assert_eq!(summary["matches_expected"], true, "{summary:#}");
    assert!(
        summary["exceptions"]
            .as_object()
            .is_some_and(|codes| codes.len() >= 5),
        "the fault mix gives several codes: {summary:#}"
    );
    assert_routed(&cluster);
    assert_eq!(cluster.stored_twice(), 0);
}

#[test]
fn nodes_killed_three_times_mid_run_leave_one_cls_per_trade_and_nothing_stored_twice() {
    let mut cluster = Cluster::of_three_nodes("cluster_failover");
    let leases = cluster.leases();
    let driver = cluster.paced_driver(6000);
    for round in 0..3 {
        std::thread::sleep(Duration::from_secs(3));
        let owner = owner_of(&leases, round % SHARDS);
        let killed_at = Instant::now();
        cluster.kill(&owner);
        new_owner(&leases, round % SHARDS, &owner);
        eprintln!(
            "round {round}: {owner} killed, shard {} taken over in {} ms",
            round % SHARDS,
            killed_at.elapsed().as_millis()
        );
        cluster.start_node(&owner);
    }
    let output = driver.wait_with_output().expect("the driver ends");
    summary_after_failures(&output, &cluster);
}

#[test]
fn one_nats_server_of_three_killed_mid_run_and_restarted_loses_nothing_and_stores_nothing_twice() {
    let mut cluster = Cluster::of_three_nodes("cluster_nats_kill");
    let driver = cluster.paced_driver(4000);
    std::thread::sleep(Duration::from_secs(3));
    // Server 1 holds shard 1's inbound stream (placement ste:1) and a copy of the leases.
    cluster.nats.kill(1);
    std::thread::sleep(Duration::from_secs(3));
    let restarted_at = Instant::now();
    cluster.nats.start_again(1).expect("server 1 starts again");
    eprintln!(
        "NATS server 1 killed for 3 s, healthy again {} ms after its start",
        restarted_at.elapsed().as_millis()
    );
    let output = driver.wait_with_output().expect("the driver ends");
    let taken_again: usize = ["node-a", "node-b", "node-c"]
        .iter()
        .map(|node| cluster.log(node).matches("lost on their way").count())
        .sum();
    eprintln!("queues taken again after a lost delivery: {taken_again}");
    summary_after_failures(&output, &cluster);
    assert_routed(&cluster);
    assert_eq!(cluster.stored_twice(), 0);
}

#[test]
fn a_stalled_owner_is_fenced_off_when_it_wakes_and_stands_down() {
    let cluster = Cluster::of_three_nodes("cluster_fencing");
    let leases = cluster.leases();
    let driver = cluster.paced_driver(4000);
    std::thread::sleep(Duration::from_secs(2));
    let owner = owner_of(&leases, 1);
    cluster.signal(&owner, "STOP");
    let successor = new_owner(&leases, 1, &owner);
    // Let the successor commit, then wake the stalled owner.
    std::thread::sleep(Duration::from_secs(2));
    cluster.signal(&owner, "CONT");
    let output = driver.wait_with_output().expect("the driver ends");
    summary_after_failures(&output, &cluster);
    let started = Instant::now();
    while !cluster.log(&owner).contains("stood down from the shard") {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "{owner} did not stand down after {successor} took shard 1:\n{}",
            cluster.log(&owner)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // It stood down because the database refused its commit (Fenced), or because it saw its
    // lease lost before it tried one (LeaseLost).
    let log = cluster.log(&owner);
    let stood_down: Vec<&str> = log
        .lines()
        .filter(|line| line.contains("stood down from the shard"))
        .collect();
    assert!(
        stood_down
            .iter()
            .all(|line| line.contains("Fenced") || line.contains("LeaseLost")),
        "{stood_down:#?}"
    );
    for line in stood_down {
        eprintln!("{owner}: {line}");
    }
}

#[test]
fn a_shard_database_stopped_for_ten_seconds_holds_only_its_own_shard_back() {
    let cluster = Cluster::start("cluster_database_outage").with_three_nodes();
    // 2,500 messages/s for about 17 s: 3 s before the outage, 10 s of it, the rest after.
    let started = Instant::now();
    let driver = cluster.paced_driver(6000);
    std::thread::sleep(Duration::from_secs(3));
    let stopped_ms = started.elapsed().as_secs_f64() * 1e3;
    cluster.databases.crash(2);
    std::thread::sleep(Duration::from_secs(10));
    let back_ms = started.elapsed().as_secs_f64() * 1e3;
    cluster.databases.restart();
    let output = driver.wait_with_output().expect("the driver ends");
    summary_after_failures(&output, &cluster);
    assert_routed(&cluster);
    assert_eq!(cluster.stored_twice(), 0);
    // The other shards' commits, on whichever node owned them, from the run's samples. The
    // driver's clock starts after `started`, by the time it takes to connect and see every
    // shard owned (over a second on a machine busy with other tests' clusters): the outage is
    // read in its middle, 3 s from either end, which leaves that room.
    let samples = std::fs::read_to_string(cluster.dir.path().join("run/samples.csv"))
        .expect("the driver collected the nodes' samples");
    // Beside them, row for row, the nodes' station-time counters; a JetStream stream has none.
    let rows = ste_monitor::read_samples(&cluster.dir.path().join("run/samples.csv"))
        .expect("the samples and their station times read together");
    assert_eq!(rows.len() + 1, samples.lines().count());
    for row in &rows {
        assert_eq!(
            row.station_ms.is_some(),
            !row.station.starts_with("jetstream/"),
            "{row:?}"
        );
    }
    assert!(ste_monitor::analyze(&rows).iter().any(|station| station
        .station
        .ends_with("/store.0")
        && station.W_exact
        && station.W > 0.0));
    let others: Vec<String> = [0, 1, 3].map(|shard| format!("store.{shard}")).into();
    let before = common::commit_rate(&samples, &others, 1_000.0, stopped_ms - 500.0);
    let during = common::commit_rate(&samples, &others, stopped_ms + 3_000.0, back_ms - 3_000.0);
    eprintln!(
        "shards 0, 1 and 3 committed {during:.0} msg/s during shard 2's outage, {before:.0} msg/s before"
    );
    assert!(before > 0.0, "the samples show commits before the outage");
    assert!(
        during >= before / 2.0,
        "shards 0, 1 and 3 committed {during:.0} msg/s during shard 2's outage, {before:.0} msg/s before"
    );
    let stalled = common::commit_rate(
        &samples,
        &["store.2".to_owned()],
        stopped_ms + 3_000.0,
        back_ms - 3_000.0,
    );
    assert_eq!(
        stalled, 0.0,
        "shard 2 committed nothing while its database was down"
    );
}

#[test]
fn participants_connected_to_a_node_get_every_answer_and_their_cls_from_the_cluster() {
    let mut cluster = Cluster::start("cluster_gateway");
    let address = cluster.with_gateway_node();
    let output = cluster
        .participant(&address, &["--trades", "3000", "--shuffle"])
        .output()
        .expect("the driver runs");
    let summary = summary_of(&output, &cluster);
    // Answers, NAKs by code and one CLS pushed per matched trade, as the generator expected.
    assert_eq!(summary["matches_expected"], true, "{summary:#}");
    assert_eq!(summary["conserved"], true, "{summary:#}");
    assert_routed(&cluster);
    assert_eq!(cluster.stored_twice(), 0);
    // The node's sink took the CLS off their queue and confirmed them.
    let jetstream = cluster.jetstream();
    let since = Instant::now();
    while jetstream
        .queue_len(ste_engine::cluster::ClusterLayout::CLS_QUEUE)
        .expect("the CLS queue")
        > 0
    {
        assert!(
            since.elapsed() < Duration::from_secs(20),
            "the sink left CLS on their queue"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A gateway node started while its NATS servers are down (a machine that boots before them)
/// waits for them, within its start patience, instead of exiting: its connections, the queues,
/// the sink's consumer of the CLS queue and its gateway number all wait. Then it serves.
#[test]
fn a_gateway_node_started_before_its_nats_servers_waits_for_them_and_serves() {
    let mut cluster = Cluster::start("cluster_gateway_first");
    cluster.nats.stop();
    let mut extra = vec!["--gateway", "--sink", "--start-patience-s", "60"];
    extra.extend(ste_bridge::bench::LOOPBACK_LISTENERS);
    let mut gateway = cluster.spawn_node("node-a", &extra, Stdio::piped());
    std::thread::sleep(Duration::from_secs(3));
    assert!(
        gateway.try_wait().expect("its status").is_none(),
        "the gateway did not wait for its servers:\n{}",
        cluster.log("node-a")
    );
    cluster
        .nats
        .start_all_again()
        .expect("the NATS servers again");
    let stdout = gateway.stdout.take().expect("the node's stdout");
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(stdout));
    let address = lines
        .find_map(|line| line.ok()?.strip_prefix("tcp ").map(str::to_owned))
        .unwrap_or_else(|| panic!("no listener announced:\n{}", cluster.log("node-a")));
    std::thread::spawn(move || lines.for_each(drop));
    cluster.nodes.push(("node-a".to_owned(), gateway));
    assert!(
        cluster.log("node-a").contains("not ready yet"),
        "{}",
        cluster.log("node-a")
    );
    for id in ["node-b", "node-c"] {
        cluster.start_node(id);
    }
    cluster.wait_until_held(&cluster.leases());
    let output = cluster
        .participant(&address, &["--trades", "1000"])
        .output()
        .expect("the driver runs");
    let summary = summary_of(&output, &cluster);
    assert_eq!(summary["matches_expected"], true, "{summary:#}");
    assert_eq!(summary["conserved"], true, "{summary:#}");
}

#[test]
fn a_node_told_to_stop_while_its_server_is_gone_does_not_wait_the_outage_out() {
    let mut cluster = Cluster::start("cluster_stop_without_nats");
    for id in ["node-a", "node-b"] {
        cluster.start_node(id);
    }
    cluster.wait_until_held(&cluster.leases());
    let driver = cluster.paced_driver(4000);
    std::thread::sleep(Duration::from_secs(2));
    cluster.nats.stop();
    cluster.signal("node-a", "TERM");
    let (_, mut node) = cluster.nodes.remove(0);
    // A node that waited the outage out would still be trying after a minute.
    let since = Instant::now();
    let status = loop {
        if let Some(status) = node.try_wait().expect("the node's status") {
            break status;
        }
        assert!(
            since.elapsed() < Duration::from_secs(50),
            "node-a still stopping after 50 s:\n{}",
            cluster.log("node-a")
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    eprintln!(
        "node-a stopped {} ms after SIGTERM without its server ({status})",
        since.elapsed().as_millis()
    );
    // Nothing it held was acknowledged that it did not finish: the next owner gets it again.
    // It stops cleanly, or reports what it left: a send or pull the outage ended, or (with
    // three servers going one after the other, the stop outlasting a lease) a commit its
    // writer refused once the shard's lease could not be renewed.
    let log = cluster.log("node-a");
    assert!(
        status.success()
            || log.contains("stopping: the server is not waited for")
            || (log.contains("lost the lease") && log.contains("was lost")),
        "{log}"
    );
    let mut driver = driver;
    let _ = driver.kill();
    let _ = driver.wait();
}

#[test]
fn nodes_that_join_a_running_cluster_get_shards_handed_over() {
    let mut cluster = Cluster::start("cluster_balance");
    cluster.start_node_with("node-a", &["--max-shards", "4"]);
    cluster.wait_until_held(&cluster.leases());
    let leases = cluster.leases();
    let held_by = |node: &str| {
        (0..4)
            .filter(|&k| leases.holder(Leased::Shard(k)).ok().flatten().as_deref() == Some(node))
            .count()
    };
    assert_eq!(held_by("node-a"), 4, "alone, node-a owns every shard");
    let driver = cluster.paced_driver(6000);
    std::thread::sleep(Duration::from_secs(2));
    for id in ["node-b", "node-c"] {
        cluster.start_node(id);
    }
    // node-a hands shards over, one at a time, during the run.
    let since = Instant::now();
    // Four over three nodes: each holds at least one, none more than two.
    let shared = |count: &dyn Fn(&str) -> usize| {
        ["node-a", "node-b", "node-c"]
            .iter()
            .all(|node| (1..=2).contains(&count(node)))
    };
    while !shared(&held_by) {
        assert!(
            since.elapsed() < Duration::from_secs(40),
            "not shared: shards a {}, b {}, c {}\n{}",
            held_by("node-a"),
            held_by("node-b"),
            held_by("node-c"),
            cluster.log("node-a")
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    eprintln!(
        "shards shared {} ms after the two nodes started",
        since.elapsed().as_millis()
    );
    let output = driver.wait_with_output().expect("the driver ends");
    summary_after_failures(&output, &cluster);
    assert_routed(&cluster);
    assert_eq!(cluster.stored_twice(), 0);
}

#[test]
fn headless_chromium_shows_every_node_and_every_jetstream_queue_of_a_running_cluster() {
    let cluster = Cluster::of_three_nodes("cluster_dashboard");
    let port = browser::free_port();
    // About 34 s of load, so that the browser sees the run in progress however long the nodes
    // take to show and the browser to load the page on a busy machine.
    let driver = cluster.driver(&[
        "--trades",
        "12000",
        "--rate",
        "2500",
        "--dashboard",
        &format!("127.0.0.1:{port}"),
    ]);
    let mut driver = driver;
    let nodes = ["node-a", "node-b", "node-c"];
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let page = browser::get(port, "/")
            .map(|(_, body)| body)
            .unwrap_or_default();
        if nodes
            .iter()
            .all(|node| page.contains(&format!("<td>{node}</td>")))
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the dashboard never showed the nodes:\n{page}"
        );
        assert!(
            driver.try_wait().expect("driver status").is_none(),
            "the run ended too soon"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    std::thread::sleep(Duration::from_secs(2));
    let shots = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cluster-dashboard");
    std::fs::create_dir_all(&shots).expect("a folder for the screenshot");
    let screenshot = shots.join("cluster-dashboard.png");
    let dom =
        browser::Chromium::find().load(&format!("http://127.0.0.1:{port}/report"), &screenshot);
    assert!(
        driver.try_wait().expect("driver status").is_none(),
        "the browser saw a finished run"
    );

    // Every node, with the stations it runs, in the cluster table.
    let table = |id: &str| -> String {
        dom.split(&format!("id=\"{id}\""))
            .nth(1)
            .and_then(|rest| rest.split("</table>").next())
            .unwrap_or_else(|| panic!("no #{id} table on the page"))
            .to_owned()
    };
    let node_table = table("nodes");
    for node in nodes {
        let row = node_table
            .split(&format!("<td>{node}</td>"))
            .nth(1)
            .and_then(|rest| rest.split("</tr>").next())
            .unwrap_or_else(|| panic!("no row for {node}: {node_table}"));
        assert!(
            row.contains("in.") || row.contains("match."),
            "{node} runs no station: {row}"
        );
    }
    // Every shard's inbound queue and the CLS queue, as JetStream holds them.
    let queues = table("jetstream");
    for shard in 0..SHARDS {
        assert!(
            queues.contains(&format!("<td>jetstream/in.{shard}</td>")),
            "{queues}"
        );
    }
    assert!(queues.contains("<td>jetstream/cls</td>"), "{queues}");
    assert!(dom.contains("Run in progress"));
    browser::assert_rendered(&screenshot);
    let output = driver.wait_with_output().expect("the driver ends");
    summary_of(&output, &cluster);
}

#[test]
fn a_node_sweep_starts_a_cluster_per_level_and_draws_the_per_node_rate_beside_the_model() {
    let _one = one_cluster();
    let dir = tempfile::tempdir().expect("temp dir");
    let out = dir.path().join("sweep");
    // Two shards on instances of the test's own, as their owner role, who may make the
    // sweep's databases there.
    let databases = Databases::own("cluster_sweep");
    let servers = databases.owner_urls();
    let output = Command::new(env!("CARGO_BIN_EXE_driver"))
        .args(["sweep", "--nodes", "1,2", "--db-counts", "1,2"])
        .args(["--trades", "400", "--window", "256", "--quiet"])
        .arg("--secrets")
        .arg(databases.secrets())
        .args(["--db", &servers[0], "--db", &servers[1], "--out"])
        .arg(&out)
        .output()
        .expect("the driver runs");
    assert!(
        output.status.success(),
        "sweep failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let points: Vec<serde_json::Value> =
        serde_json::from_slice(&std::fs::read(out.join("sweep.json")).expect("sweep.json"))
            .expect("JSON");
    let levels: Vec<(u64, u64)> = points
        .iter()
        .map(|p| {
            (
                p["databases"].as_u64().expect("a count"),
                p["nodes"].as_u64().expect("a count"),
            )
        })
        .collect();
    assert_eq!(levels, [(1, 1), (1, 2), (2, 1), (2, 2)]);
    for point in &points {
        let x = point["X"].as_f64().expect("X");
        let nodes = point["nodes"].as_f64().expect("nodes");
        assert!(x > 0.0, "{point}");
        assert!((point["X_per_node"].as_f64().expect("a number") - x / nodes).abs() < 1e-6 * x);
        assert!((point["R_ms"].as_f64().expect("a number") - 256e3 / x).abs() < 1e-6 * 256e3 / x);
        assert!(
            point["cpu"]["busy_s"].as_f64().expect("a number") > 0.0,
            "{point}"
        );
        assert!(
            point["cpu"]["by_program_s"]["engine"]
                .as_f64()
                .expect("a number")
                > 0.0,
            "{point}"
        );
        assert!(point["X_mva"].as_f64().expect("a number") > 0.0, "{point}");
        assert!(point["X_own"].as_f64().expect("a number") > 0.0, "{point}");
        // Every level's run held its shards' rows where the routing rule puts them.
        let run = std::path::Path::new(point["run_dir"].as_str().expect("run_dir"));
        let summary: serde_json::Value =
            serde_json::from_slice(&std::fs::read(run.join("summary.json")).expect("summary"))
                .expect("JSON");
        assert_eq!(summary["matches_expected"], true, "{summary}");
        assert_eq!(summary["misrouted_trades"], 0, "{summary}");
        assert_eq!(summary["cls"], 400);
    }
    // The model: the cores a station of the CPU per message measured at the first level of
    // each database count (256 in flight keep its servers busy: X = cores / D); the nodes on
    // machines of their own can only be faster.
    for (reference, levels) in [(&points[0], &points[0..2]), (&points[2], &points[2..4])] {
        let cpu = &reference["cpu"];
        let demand = cpu["busy_s"].as_f64().expect("a number") / 2800.0;
        let bound = cpu["cores"].as_f64().expect("a number") / demand;
        for point in levels {
            let model = point["X_mva"].as_f64().expect("a number");
            assert!(
                (model - bound).abs() < 0.01 * bound,
                "{model} vs {bound}: {point}"
            );
            let own = point["X_own"].as_f64().expect("a number");
            assert!(own >= model * 0.999, "{point}");
            let spread = point["X_spread"].as_f64().expect("a number");
            assert!(spread >= own * 0.999, "{point}");
        }
    }
    let csv = std::fs::read_to_string(out.join("sweep.csv")).expect("sweep.csv");
    assert_eq!(csv.lines().count(), 5, "{csv}");
    assert!(csv.starts_with("level,databases,nodes,window,X,X_per_node"));
    let svg = std::fs::read_to_string(out.join("nodes.svg")).expect("nodes.svg");
    assert!(svg.contains("Per-node rate") && svg.contains("2 DB measured"));
    // The levels' databases are gone.
    let password = std::fs::read_to_string(ste_driver::secrets::pg_password_file(
        &databases.secrets(),
        ste_driver::secrets::PG_OWNER,
    ))
    .expect("the owner's password");
    for server in &servers {
        let server = server.replacen("ste_owner@", &format!("ste_owner:{}@", password.trim()), 1);
        let left: i64 = block_on(async {
            let mut admin = PgConnection::connect(&server).await.expect("connects");
            sqlx::query_scalar("SELECT COUNT(*) FROM pg_database WHERE datname LIKE 'ste_sweep_%'")
                .fetch_one(&mut admin)
                .await
                .expect("counts")
        });
        assert_eq!(left, 0);
    }
}

/// A raw NATS client of the attack test: TLS checked against the cluster's CA, signed in as
/// `identity` (none: no credentials at all).
fn raw_client(cluster: &Cluster, identity: Option<&str>) -> Result<async_nats::Client, String> {
    let mut options = async_nats::ConnectOptions::new()
        .add_root_certificates(cluster.secrets.join("ca.pem"))
        .require_tls(true)
        .max_reconnects(Some(1));
    if let Some(identity) = identity {
        let seed = std::fs::read_to_string(ste_engine::queue::jetstream::nkey_file(
            &cluster.secrets,
            identity,
        ))
        .expect("the identity's seed");
        options = options
            .nkey(seed.trim().to_owned())
            .custom_inbox_prefix(format!("_INBOX_{identity}"));
    }
    let url = cluster
        .nats
        .url
        .split(',')
        .next()
        .expect("a URL")
        .to_owned();
    block_on(options.connect(url)).map_err(|error| error.to_string())
}

/// Whether a request on `subject` as `client` is answered within a second (a JetStream API
/// call, or a publish into a stream or bucket, which the server answers once stored).
fn answered(client: &async_nats::Client, subject: &str, payload: &'static [u8]) -> bool {
    block_on(async {
        tokio::time::timeout(
            Duration::from_secs(1),
            client.request(subject.to_owned(), bytes::Bytes::from_static(payload)),
        )
        .await
        .is_ok_and(|answer| answer.is_ok())
    })
}

/// Whether anything published on `subject` from now on reaches `client` within the time a
/// well-behaved run takes to publish there.
fn hears(client: &async_nats::Client, subject: &str) -> bool {
    block_on(async {
        let Ok(mut subscriber) = client.subscribe(subject.to_owned()).await else {
            return false;
        };
        use futures_util::StreamExt as _;
        tokio::time::timeout(Duration::from_secs(3), subscriber.next())
            .await
            .is_ok_and(|message| message.is_some())
    })
}

#[test]
fn a_holder_of_one_roles_key_can_do_that_role_and_nothing_else_while_participants_trade() {
    let mut cluster = Cluster::start("cluster_trust");
    let address = cluster.with_gateway_node();
    // A well-behaved participant trades through the gateway while the attacks go on.
    let participant = cluster
        .participant(&address, &["--trades", "3000", "--rate", "1000"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the driver runs");

    // No credentials: refused at the door, with or without TLS.
    let refused = raw_client(&cluster, None).expect_err("an outsider is let in");
    assert!(
        refused.to_lowercase().contains("authori"),
        "refused for another reason: {refused}"
    );
    // Over plain TCP the server says TLS is required and answers nothing in the clear.
    let port: u16 = cluster
        .nats
        .url
        .split(',')
        .next()
        .and_then(|url| url.rsplit(':').next())
        .and_then(|port| port.parse().ok())
        .expect("a port");
    {
        use std::io::{BufRead as _, Write as _};
        let mut plain = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connects");
        plain
            .set_read_timeout(Some(Duration::from_secs(3)))
            .expect("a timeout");
        let mut reader = std::io::BufReader::new(plain.try_clone().expect("a clone"));
        let mut info = String::new();
        reader.read_line(&mut info).expect("the server's INFO");
        assert!(info.contains("\"tls_required\":true"), "{info}");
        let _ = plain.write_all(b"CONNECT {\"verbose\":false}\r\nPING\r\n");
        let mut answer = String::new();
        let _ = reader.read_line(&mut answer);
        assert!(
            !answer.starts_with("PONG"),
            "a plain client was answered: {answer}"
        );
    }

    // A gateway's key (one no gateway runs on): none of the keepers' writes, nobody else's
    // answers, no forged answers, CLS or samples.
    let gateway = raw_client(&cluster, Some("gateway-1")).expect("a gateway signs in");
    for (subject, payload) in [
        ("$KV.ste_delivered.shard.0", &b"999999999"[..]),
        ("$KV.ste_leases.shard.0", b"intruder"),
        ("$KV.ste_leases.member.20", b"intruder 64"),
        ("$KV.ste_leases.gateway.0", b"intruder"),
        ("$JS.API.STREAM.PURGE.STE_IN_0", b""),
        ("$JS.API.STREAM.DELETE.KV_ste_leases", b""),
        ("$JS.API.STREAM.MSG.GET.STE_IN_0", b"{\"seq\":1}"),
        ("$JS.API.CONSUMER.MSG.NEXT.STE_CLS.sink", b"{\"batch\":1}"),
    ] {
        assert!(
            !answered(&gateway, subject, payload),
            "a gateway's key got an answer on {subject}"
        );
    }
    for subject in ["ste.ack.1000", "ste.cls", "ste.samples.node-1"] {
        block_on(gateway.publish(subject, bytes::Bytes::from_static(b"forged")))
            .expect("sent (the server refuses it)");
    }
    assert!(
        !hears(&gateway, "ste.ack.0"),
        "a gateway heard another gateway's answers"
    );
    assert!(
        !hears(&gateway, "_INBOX_node.>"),
        "a gateway heard a node's replies"
    );

    // A shard owner's key: nothing into inbound partitions, no reading what it has no business
    // with.
    let node = raw_client(&cluster, Some("node")).expect("a node signs in");
    assert!(
        !answered(&node, "ste.in.0", b"not a batch"),
        "a node's key put a message into an inbound partition"
    );
    assert!(
        !answered(&node, "$KV.ste_delivered.shard.0", b"999999999"),
        "a node's key wrote a delivery watermark"
    );
    assert!(
        !answered(&node, "$KV.ste_leases.gateway.0", b"intruder"),
        "a node's key took a gateway's number"
    );
    for subject in ["ste.samples.>", "ste.in.>", "_INBOX_sink.>"] {
        assert!(!hears(&node, subject), "a node's key heard {subject}");
    }
    // A batch that does not decode, on each stream, from a key allowed to publish there: set
    // aside, and its consumer goes on.
    assert!(
        answered(&gateway, "ste.in.0", b"not postcard"),
        "a gateway's batch was not stored"
    );
    assert!(
        answered(&node, "ste.cls", b"not postcard either"),
        "a node's batch was not stored"
    );
    // The monitor reads and writes nothing else.
    let monitor = raw_client(&cluster, Some("monitor")).expect("the monitor signs in");
    assert!(!answered(&monitor, "$KV.ste_leases.shard.1", b"intruder"));
    block_on(monitor.publish(
        "ste.samples.evil-node",
        bytes::Bytes::from_static(b"forged"),
    ))
    .expect("sent (the server refuses it)");
    block_on(async {
        for client in [&gateway, &node, &monitor] {
            let _ = client.flush().await;
        }
    });

    // The participant's run ends as the generator said, one CLS per trade.
    let output = participant.wait_with_output().expect("the driver ends");
    let summary = summary_of(&output, &cluster);
    assert_eq!(summary["matches_expected"], true, "{summary:#}");
    assert_eq!(summary["conserved"], true, "{summary:#}");
    assert_eq!(cluster.stored_twice(), 0);
    assert_routed(&cluster);
    let jetstream = cluster.jetstream();
    let since = Instant::now();
    while jetstream.queue_len("aside").expect("the aside stream") < 2 {
        assert!(
            since.elapsed() < Duration::from_secs(30),
            "the undecodable batches were not set aside"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let node_logs: String = ["node-a", "node-b", "node-c"]
        .iter()
        .map(|id| cluster.log(id))
        .collect();
    for queue in ["queue=in.0", "queue=cls"] {
        assert!(
            node_logs
                .lines()
                .any(|line| line.contains("was set aside") && line.contains(queue)),
            "no batch of {queue} set aside in the nodes' logs"
        );
    }
    assert!(
        !node_logs.contains("stood down") && !node_logs.contains("standing down"),
        "an owner stood down:\n{node_logs}"
    );

    // Every refusal is in a server's log.
    let logs: String = (0..3)
        .map(|index| {
            std::fs::read_to_string(cluster.dir.path().join(format!("nats/nats-{index}.log")))
                .unwrap_or_default()
        })
        .collect();
    assert!(logs.contains("authentication error"), "{logs}");
    for subject in [
        "$KV.ste_delivered.shard.0",
        "$KV.ste_leases.shard.0",
        "$KV.ste_leases.member.20",
        "$KV.ste_leases.gateway.0",
        "$JS.API.STREAM.PURGE.STE_IN_0",
        "ste.ack.1000",
        "ste.cls",
        "ste.samples.node-1",
        "ste.in.0",
        "ste.samples.evil-node",
    ] {
        assert!(
            logs.lines().any(|line| line.contains("Publish Violation")
                && line.contains(&format!("\"{subject}\""))),
            "no refusal of a publish to {subject} logged:\n{logs}"
        );
    }
    for subject in [
        "ste.ack.0",
        "_INBOX_node.>",
        "ste.samples.>",
        "_INBOX_sink.>",
    ] {
        assert!(
            logs.lines()
                .any(|line| line.contains("Subscription Violation")
                    && line.contains(&format!("\"{subject}\""))),
            "no refusal of a subscription to {subject} logged:\n{logs}"
        );
    }
}

/// `psql` (PostgreSQL's own client) on `url` running `sql`, with the passwords of `pgpass`:
/// whether it succeeded, and what it said on stderr.
fn psql(url: &str, pgpass: &std::path::Path, sql: &str) -> (bool, String) {
    let output = Command::new("psql")
        .args([url, "-qtA", "-v", "ON_ERROR_STOP=1", "-c", sql])
        .env("PGPASSFILE", pgpass)
        .env_remove("PGPASSWORD")
        .output()
        .expect("psql runs (Debian's postgresql-client)");
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[test]
fn a_shard_role_does_a_shard_owners_work_in_its_own_database_and_nothing_more() {
    let _one = one_cluster();
    let databases = Databases::own("cluster_database_roles");
    let secrets = databases.secrets();
    let pgpass = ste_driver::secrets::pgpass_file(&secrets);
    let urls = databases.urls();
    let shard_0 = &urls[0];
    assert!(
        shard_0.starts_with("postgres://ste_shard_0@") && shard_0.contains("sslmode=verify-full"),
        "{shard_0}"
    );
    // What a shard's owner does.
    for sql in [
        "SELECT COUNT(*) FROM messages",
        "SELECT ste_raise_fence(1)",
        "SELECT ste_create_partition('messages', '2031-01-01')",
        "SELECT ste_drop_partition('messages', '2031-01-01')",
        "DELETE FROM cls_delivery WHERE false",
    ] {
        let (ok, said) = psql(shard_0, &pgpass, sql);
        assert!(ok, "{sql}: {said}");
    }
    // And nothing more.
    for (sql, refusal) in [
        ("CREATE ROLE intruder", "permission denied"),
        ("ALTER ROLE ste_shard_0 SUPERUSER", "must be superuser"),
        ("DROP FUNCTION ste_raise_fence(BIGINT)", "must be owner"),
        ("CREATE TABLE intruder (a int)", "permission denied"),
        ("DROP TABLE messages", "must be owner"),
        (
            "SELECT ste_create_partition('pg_authid', '2031-01-01')",
            "not a partitioned table",
        ),
        ("SELECT * FROM pg_authid", "permission denied"),
    ] {
        let (ok, said) = psql(shard_0, &pgpass, sql);
        assert!(
            !ok && said.contains(refusal),
            "{sql} was not refused: {said}"
        );
    }
    // Another shard's database: shard 0's role is not known there.
    let other = urls[1].replacen("ste_shard_1@", "ste_shard_0@", 1);
    let (ok, said) = psql(&other, &pgpass, "SELECT 1");
    assert!(!ok && said.contains("authentication failed"), "{said}");
    // Without a password, or in the clear, no connection at all.
    let (ok, said) = psql(shard_0, std::path::Path::new("/dev/null"), "SELECT 1");
    assert!(!ok && said.contains("no password supplied"), "{said}");
    let plain = shard_0.replace("sslmode=verify-full", "sslmode=disable");
    let (ok, said) = psql(&plain, &pgpass, "SELECT 1");
    assert!(
        !ok && said.contains("no pg_hba.conf entry") && said.contains("no encryption"),
        "{said}"
    );
    // Nothing trusted in what the instances were set up with.
    for shard in 0..SHARDS {
        let hba = std::fs::read_to_string(
            databases
                .dir()
                .join(format!("shard-{shard}"))
                .join("pg_hba.conf"),
        )
        .expect("the instance's pg_hba.conf");
        assert!(
            hba.lines()
                .filter(|line| !line.trim_start().starts_with('#'))
                .all(|line| !line.contains("trust")),
            "{hba}"
        );
    }
}
