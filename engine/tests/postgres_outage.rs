//! A PostgreSQL shard that goes down for 10 s mid-run: its writer retries with backoff, its
//! match queue holds its backlog, the other shard goes on committing at its rate (read from the
//! run's samples), and the run completes with nothing lost and nothing duplicated. Starts its own instances with `deploy/local-cluster.sh` (needs the PostgreSQL
//! server binaries, as on every machine of this project).

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[path = "common/mod.rs"]
mod common;

use ste_engine::generator::{Generator, GeneratorConfig};
use ste_engine::pipeline::{AckResult, Pipeline, PipelineConfig, StoreConfig};
use ste_engine::profile::Tolerances;
use ste_engine::queue::{QueueError, Rx};
use ste_engine::refdata::RefData;

/// `deploy/local-cluster.sh`, which makes the instances' secrets and migrates them with the
/// workspace's driver, built beside this test by cargo test --workspace.
fn cluster_script() -> Command {
    let binaries = std::env::current_exe()
        .ok()
        .and_then(|exe| Some(exe.parent()?.parent()?.to_owned()))
        .expect("the binaries' folder");
    assert!(
        binaries.join("driver").exists(),
        "{} is missing: cargo test --workspace builds it (or cargo build -p ste-driver)",
        binaries.join("driver").display()
    );
    let mut command =
        Command::new(Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/local-cluster.sh"));
    command.env("STE_BIN", binaries);
    command
}

/// What the instances' servers logged (why one did not start).
fn server_logs(dir: &Path, instances: usize) -> String {
    (0..instances)
        .map(|shard| {
            let log = std::fs::read_to_string(dir.join(format!("shard-{shard}.log")));
            format!("shard-{shard}.log:\n{}", log.unwrap_or_default())
        })
        .collect()
}

/// A local cluster, stopped when dropped.
struct Cluster {
    dir: tempfile::TempDir,
    urls: Vec<String>,
}

impl Cluster {
    fn start(instances: usize, first_port: u32) -> Self {
        let dir = tempfile::tempdir().expect("temporary folder");
        let output = cluster_script()
            .args([
                "up",
                &instances.to_string(),
                "--port",
                &first_port.to_string(),
                "--dir",
            ])
            .arg(dir.path())
            .output()
            .expect("the cluster script runs");
        assert!(
            output.status.success(),
            "cluster start failed: {}\n{}",
            String::from_utf8_lossy(&output.stderr),
            server_logs(dir.path(), instances)
        );
        let urls = String::from_utf8(output.stdout)
            .expect("utf-8")
            .lines()
            .map(str::to_owned)
            .collect();
        // The shards' roles' passwords, for this process's own connections (the only test of
        // this binary: nothing else reads the environment meanwhile).
        std::env::set_var("PGPASSFILE", dir.path().join("secrets/pgpass"));
        Self { dir, urls }
    }

    fn run(&self, args: &[&str]) {
        let status = cluster_script()
            .args(args)
            .arg("--dir")
            .arg(self.dir.path())
            .status()
            .expect("the cluster script runs");
        assert!(status.success(), "{args:?} failed");
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = cluster_script()
            .args(["down", "--dir"])
            .arg(self.dir.path())
            .status();
    }
}

/// Every item of `rx` until the pipeline closes it.
fn read_until_closed<T>(rx: &Rx<T>) -> Vec<T> {
    let mut items = Vec::new();
    loop {
        match rx.recv_until(None) {
            Ok(Some(received)) => {
                items.extend(received.items);
                received.receipt.ack().expect("acknowledges");
            }
            Ok(None) => {}
            Err(QueueError::Closed { .. }) => return items,
            Err(error) => panic!("{error}"),
        }
    }
}

/// How long shard 1's PostgreSQL stays down.
const OUTAGE: Duration = Duration::from_secs(10);

#[test]
fn a_shard_that_crashes_and_comes_back_loses_and_duplicates_nothing() {
    // Below the kernel's ephemeral range (32768–60999 here), so that no outgoing connection
    // holds one of the ports.
    let first_port = 21_000 + (std::process::id() % 1_000) * 2;
    let cluster = Cluster::start(2, first_port);
    let refdata = Arc::new(
        RefData::embedded()
            .expect("reference data")
            .with_generated_keys(),
    );
    let samples_path = cluster.dir.path().join("samples.csv");
    let config = PipelineConfig {
        shards: 2,
        store: StoreConfig::Postgres {
            urls: cluster.urls.clone(),
        },
        sample_interval: Duration::from_millis(50),
        samples_path: Some(samples_path.clone()),
        ..PipelineConfig::default()
    };
    // The samples' clock starts with the pipeline.
    let started = Instant::now();
    let pipeline =
        Pipeline::start(&config, refdata.clone(), Tolerances::default()).expect("starts");
    // Answers and CLS are taken as they come, as the gateway and the sink would.
    let acks = {
        let acks = pipeline.acks();
        std::thread::spawn(move || read_until_closed(&acks))
    };
    let outbound = {
        let outbound = pipeline.outbound();
        std::thread::spawn(move || read_until_closed(&outbound))
    };
    let trades = 24_000_u64;
    let injector = {
        let mut submitter = pipeline.submitter();
        let refdata = refdata.clone();
        std::thread::spawn(move || {
            let lines = Generator::new(&refdata, GeneratorConfig::clean(trades));
            for (index, line) in lines.enumerate() {
                submitter
                    .submit_line(&refdata, line, index as u64)
                    .expect("the pipeline keeps accepting");
                if index % 256 == 0 {
                    // About 16 s of injection: 3 s before the outage, 10 s of it, 3 s after.
                    submitter.flush().expect("flushes");
                    std::thread::sleep(Duration::from_millis(25));
                }
            }
            submitter.flush().expect("flushes");
        })
    };
    std::thread::sleep(Duration::from_millis(3000));
    let crashed_ms = started.elapsed().as_secs_f64() * 1e3;
    cluster.run(&["crash", "1"]);
    std::thread::sleep(OUTAGE);
    let back_ms = started.elapsed().as_secs_f64() * 1e3;
    cluster.run(&["up", "2", "--port", &first_port.to_string()]);
    injector.join().expect("the injector finishes");
    let report = pipeline.finish().expect("the run completes");
    let samples = std::fs::read_to_string(&samples_path).expect("the run wrote its samples");
    let shard_0 = ["store.0".to_owned()];
    let before = common::commit_rate(&samples, &shard_0, 1_000.0, crashed_ms);
    // From 2 s into the outage, once shard 1's store queue is surely full: from then on only
    // its match queue can hold its backlog.
    let during = common::commit_rate(&samples, &shard_0, crashed_ms + 2_000.0, back_ms);

    let results: Vec<AckResult> = acks
        .join()
        .expect("the answers are read")
        .into_iter()
        .map(|ack| ack.result)
        .collect();
    assert_eq!(results.len() as u64, trades * 7);
    assert!(results.iter().all(|result| *result == AckResult::Accepted));
    assert_eq!(
        outbound.join().expect("the CLS are read").len() as u64,
        trades
    );
    for shard in 0..2 {
        // Every accepted message is stored exactly once, every CLS is in the outbox.
        assert_eq!(
            report.shard_rows[shard].messages,
            report.shards[shard].messages
        );
        assert_eq!(report.shard_rows[shard].cls, report.shards[shard].matched);
    }
    // The outage fell inside the run: shard 1's writer had to retry, shard 0's did not.
    assert!(
        report.shard_commit_retries[1] > 0,
        "{:?}",
        report.shard_commit_retries
    );
    assert_eq!(report.shard_commit_retries[0], 0);
    // Shard 1's backlog stayed in its own match queue: shard 0 kept committing at its rate.
    assert!(
        during >= before / 2.0,
        "shard 0 committed {during:.0} msg/s during shard 1's outage, {before:.0} msg/s before"
    );
    eprintln!(
        "shard 0 committed {during:.0} msg/s during shard 1's outage, {before:.0} msg/s before"
    );
    let matched: u64 = report.shards.iter().map(|counts| counts.matched).sum();
    assert_eq!(matched, trades);
}
