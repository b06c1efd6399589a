//! `driver nemesis` for two minutes on fixed seeds: a cluster of this machine's (three NATS
//! servers, four PostgreSQL instances, owner nodes and a gateway node, on TLS and identities)
//! loaded through the gateway while faults hit it as the seed's schedule says. Every round and
//! every shard must pass the checker, and every kind of fault asked for must have been applied
//! and healed, in the schedule's order.
//!
//! The engine binary is the workspace's (`cargo test --workspace` builds it beside the
//! driver's).

use std::path::PathBuf;
use std::process::Command;

/// The seed CI runs the nemesis on.
const SEED: &str = "20261203";

/// One nemesis at a time: two cores do not run two clusters and keep their leases in time, and
/// a run's PostgreSQL instances take ports named after the process.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Runs the nemesis with `args` for two minutes on [`SEED`]; its report, once it has passed
/// and applied a fault of each of `kinds` in the schedule's order.
fn passes(args: &[&str], kinds: &[&str]) -> serde_json::Value {
    let _one = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let engine = PathBuf::from(env!("CARGO_BIN_EXE_driver")).with_file_name("engine");
    assert!(
        engine.exists(),
        "{} is missing: cargo test --workspace builds it (or cargo build -p ste-bridge --bin engine)",
        engine.display()
    );
    let dir = tempfile::Builder::new()
        .prefix("nemesis-")
        .tempdir()
        .expect("a folder");
    let run = dir.path().join("run");
    let output = Command::new(env!("CARGO_BIN_EXE_driver"))
        .args(["nemesis", "--seed", SEED, "--minutes", "2", "--json"])
        .args(args)
        .arg("--dir")
        .arg(&run)
        .env("RUST_LOG", "warn,sqlx=error")
        .output()
        .expect("the nemesis runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    eprintln!("{stderr}");
    if !output.status.success() {
        // The run folder stays for whoever reads the failure.
        let kept = dir.keep();
        panic!(
            "the nemesis failed (its folder kept: {}):\n{stderr}",
            kept.display()
        );
    }
    let report: serde_json::Value =
        serde_json::from_slice(&output.stdout).expect("the report in JSON");
    assert_eq!(report["failure"], serde_json::Value::Null, "{report:#}");
    let rounds = report["rounds"].as_array().expect("rounds");
    assert!(rounds.len() >= 2, "several rounds: {report:#}");
    assert!(rounds
        .iter()
        .all(|round| round["violations"].as_array().is_some_and(Vec::is_empty)));
    let faults = report["faults"].as_array().expect("faults");
    for kind in kinds {
        assert!(
            faults.iter().any(|fault| fault["kind"] == *kind),
            "a {kind} fault applied: {report:#}"
        );
    }
    assert!(faults
        .iter()
        .all(|fault| fault["healed_s"].as_f64() >= fault["applied_s"].as_f64()));
    // What was applied is the schedule's, in its order.
    let schedule = std::fs::read_to_string(run.join("schedule.csv")).expect("schedule.csv");
    let planned: Vec<&str> = schedule.lines().skip(1).collect();
    assert_eq!(
        planned.len() as u64,
        report["faults_scheduled"].as_u64().expect("a count")
    );
    assert_eq!(faults.len(), planned.len(), "every fault applied");
    for (fault, line) in faults.iter().zip(&planned) {
        let fields: Vec<&str> = line.split(',').collect();
        assert_eq!(fault["number"].to_string(), fields[0]);
        assert_eq!(fault["kind"], fields[1]);
        assert_eq!(fault["target"].to_string(), fields[2]);
    }
    report
}

#[test]
fn two_minutes_of_faults_of_every_kind_drawn_from_a_fixed_seed_lose_nothing_and_double_nothing() {
    passes(
        &[],
        &[
            "kill-node",
            "stop-node",
            "kill-nats",
            "stop-db",
            "cut-nats",
            "cut-db",
            "clock-jump",
            "fill-disk",
        ],
    );
}

/// Owners stopped past their leases, dozens of times: each wakes inside a transaction now and
/// then, and only the fence keeps its commit from landing after its successor's (the checker
/// reads every commit's token).
#[test]
fn two_minutes_of_owners_stalled_past_their_leases_leave_every_commit_in_fence_order() {
    let report = passes(&["--kinds", "stop-node", "--gap", "1.5"], &["stop-node"]);
    let faults = report["faults"].as_array().expect("faults");
    assert!(faults.len() >= 30, "{} stalls", faults.len());
    // The check read the owners' commits: hundreds of them, every shard's.
    let commits = report["commits_checked"].as_u64().expect("a count");
    assert!(commits >= 400, "{commits} commits checked");
}
