//! End-to-end runs of the whole pipeline: generated fault mixes, replayed files and hostile input.

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use ste_driver::{RunConfig, Source, StoreKind, Summary};
use ste_engine::generator::{GeneratorConfig, INVALID_CODES};
use ste_engine::options::Settings;
use ste_engine::refdata::RefData;

fn config(source: Source, store: StoreKind, run_dir: &Path) -> RunConfig {
    RunConfig {
        source,
        settings: Settings {
            store,
            shards: 3,
            sample_interval: Duration::from_millis(5),
            batch_max: ste_engine::pipeline::BatchBound {
                messages: 512,
                ..Default::default()
            },
            ..Settings::default()
        },
        batch_linger: Duration::from_millis(2),
        queue_capacity_messages: 1024,
        rate_msgs_per_s: None,
        window: None,
        cls_out: None,
        run_dir: run_dir.to_path_buf(),
        progress: false,
        resume: false,
        signatures: None,
        expected: None,
        limit_probe: None,
    }
}

fn fault_mix(trades: u64) -> Source {
    Source::Generated(GeneratorConfig {
        trades,
        seed: 7,
        fault_rate: 0.4,
        shuffle: true,
        run: String::new(),
    })
}

fn refdata() -> Arc<RefData> {
    Arc::new(
        RefData::embedded()
            .expect("reference data loads")
            .with_generated_keys(),
    )
}

fn assert_outcome_is_expected(summary: &Summary) {
    let expected = summary
        .expected
        .clone()
        .expect("a generated run knows its outcome");
    assert_eq!(summary.outcome, expected);
    assert_eq!(summary.matches_expected, Some(true));
    assert!(summary.conserved);
    // The mix provokes every code the generator knows.
    for code in INVALID_CODES {
        assert!(
            summary
                .outcome
                .exceptions
                .get(code.as_str())
                .copied()
                .unwrap_or(0)
                > 0,
            "{code} missing"
        );
    }
    for code in ["E_DUPID", "E_CONFLICT", "E_CLOSED"] {
        assert!(
            summary.outcome.exceptions.get(code).copied().unwrap_or(0) > 0,
            "{code} missing"
        );
    }
    assert!(summary.outcome.duplicates > 0 && summary.outcome.mismatched_trades > 0);
    assert!(summary.outcome.pending_trades > 0 && summary.outcome.cancelled_trades > 0);
}

#[test]
fn a_fault_mix_gives_exactly_the_expected_outcome_in_memory() {
    let dir = tempfile::tempdir().expect("temporary folder");
    let summary = ste_driver::run(
        &config(fault_mix(3000), StoreKind::Memory, dir.path()),
        refdata(),
    )
    .expect("the run completes");
    assert_outcome_is_expected(&summary);
    assert!(dir.path().join("summary.json").exists());
    assert!(dir.path().join("samples.csv").exists());
}

#[test]
fn a_fault_mix_gives_exactly_the_expected_outcome_on_the_embedded_store() {
    let dir = tempfile::tempdir().expect("temporary folder");
    let summary = ste_driver::run(
        &config(fault_mix(2000), StoreKind::Embedded, dir.path()),
        refdata(),
    )
    .expect("the run completes");
    assert_outcome_is_expected(&summary);
    // Every accepted message, CLS and exception is in a store, once.
    let stored: u64 = summary.shards.iter().map(|s| s.stored_messages).sum();
    assert_eq!(stored, summary.outcome.accepted);
    for shard in &summary.shards {
        assert_eq!(shard.stored_messages, shard.messages);
    }
    let stored_cls: u64 = summary.shards.iter().map(|s| s.stored_cls).sum();
    assert_eq!(stored_cls, summary.outcome.cls);
    let stored_exceptions: u64 = summary
        .shards
        .iter()
        .map(|s| s.stored_exceptions)
        .sum::<u64>()
        + summary.stored_validation_exceptions;
    assert_eq!(stored_exceptions, summary.exceptions_total());
    for shard in 0..3 {
        assert!(dir
            .path()
            .join(format!("store/shard-{shard}.sqlite"))
            .exists());
    }
    // The resident set at each share of the answers, and at the end.
    let marks: Vec<u8> = summary
        .rss_mb_at_answered
        .iter()
        .map(|mark| mark.answered_pct)
        .collect();
    assert_eq!(marks, vec![10, 50, 90, 100]);
    assert!(
        summary
            .rss_mb_at_answered
            .iter()
            .all(|mark| mark.rss_mb > 1.0 && mark.rss_mb <= summary.peak_rss_mb),
        "{:?}, peak {} MiB",
        summary.rss_mb_at_answered,
        summary.peak_rss_mb
    );
}

#[test]
fn transactions_bounded_in_bytes_split_queued_batches_and_lose_nothing() {
    let dir = tempfile::tempdir().expect("temporary folder");
    let mut config = config(fault_mix(400), StoreKind::Embedded, dir.path());
    // About three messages a transaction at their weight, where the queues carry batches of
    // hundreds: every queued batch is split, and its rest starts the next transaction.
    config.settings.batch_max = ste_engine::pipeline::BatchBound {
        messages: 512,
        bytes: 4096,
    };
    let summary = ste_driver::run(&config, refdata()).expect("the run completes");
    assert_outcome_is_expected(&summary);
    let stored: u64 = summary.shards.iter().map(|s| s.stored_messages).sum();
    assert_eq!(stored, summary.outcome.accepted);
    let stored_cls: u64 = summary.shards.iter().map(|s| s.stored_cls).sum();
    assert_eq!(stored_cls, summary.outcome.cls);
}

fn driver() -> Command {
    Command::new(env!("CARGO_BIN_EXE_driver"))
}

fn run_json(args: &[&str]) -> serde_json::Value {
    let output = driver().args(args).output().expect("driver runs");
    assert!(
        output.status.success(),
        "driver failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("one JSON object")
}

#[test]
fn a_generated_file_replays_to_its_expected_outcome() {
    let dir = tempfile::tempdir().expect("temporary folder");
    let set = dir.path().join("set.xml");
    let status = driver()
        .args([
            "generate",
            "--trades",
            "800",
            "--fault-rate",
            "0.3",
            "--shuffle",
            "--out",
        ])
        .arg(&set)
        .status()
        .expect("driver runs");
    assert!(status.success());
    let expected: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("set.xml.expected.json")).expect("expected file"),
    )
    .expect("json");
    let run_dir = dir.path().join("run");
    let cls_out = dir.path().join("cls.xml");
    let replay = |run_dir: &Path, more: &[&str]| {
        let mut args = vec![
            "--input",
            set.to_str().expect("utf-8 path"),
            "--store",
            "memory",
            "--json",
            "--quiet",
            "--run-dir",
            run_dir.to_str().expect("utf-8 path"),
        ];
        args.extend_from_slice(more);
        run_json(&args)
    };
    let summary = replay(
        &run_dir,
        &["--cls-out", cls_out.to_str().expect("utf-8 path")],
    );
    for key in [
        "trades",
        "messages_in",
        "accepted",
        "duplicates",
        "exceptions",
        "cls",
        "mismatched_trades",
        "pending_trades",
        "cancelled_trades",
    ] {
        assert_eq!(summary[key], expected[key], "{key}");
    }
    let cls_lines = std::fs::read_to_string(&cls_out).expect("cls file");
    assert_eq!(
        cls_lines.lines().count() as u64,
        expected["cls"].as_u64().expect("count")
    );
    assert!(cls_lines
        .lines()
        .all(|line| line.starts_with("<Cls xmlns=\"urn:ste:trade:1\"><ClsId>CLS-")));
    for key in [
        "elapsed_s",
        "throughput_msg_s",
        "latency_ms",
        "stations",
        "shards",
        "run_dir",
    ] {
        assert!(!summary[key].is_null(), "{key} missing");
    }
    assert!(summary["latency_ms"]["p999"].is_number());
    let station = &summary["stations"][0];
    for key in [
        "name", "A", "C", "B_s", "T_s", "X", "U", "S_ms", "N", "R_ms",
    ] {
        assert!(!station[key].is_null(), "station {key} missing");
    }
    // The limit probe ran on the set's messages after the run (1 s by default): every line
    // checked on every core, the set's unsigned and unparsable ones refused.
    let probe = &summary["limit_probe"];
    assert!(probe["msgs_per_s"].as_f64().expect("probe rate") > 0.0);
    assert_eq!(probe["distinct"], expected["messages_in"]);
    assert!(
        probe["refused"].as_u64().expect("refused") > 0,
        "the fault mix has E_SIG and E_PARSE lines"
    );

    // The replay sent the signatures made when the set was generated (set.xml.signatures), as
    // they are: one changed after the fact makes its message E_SIG, and nothing else changes.
    let signatures_path = dir.path().join("set.xml.signatures");
    let mut signatures = std::fs::read(&signatures_path).expect("signatures beside the set");
    assert_eq!(
        signatures.len() as u64,
        33 * expected["messages_in"].as_u64().expect("count")
    );
    let signed = signatures
        .chunks(33)
        .position(|record| record[0] == 1)
        .expect("a signed line");
    signatures[signed * 33 + 5] ^= 0x40;
    std::fs::write(&signatures_path, &signatures).expect("rewrites");
    // The replay checks its outcome against set.xml.expected.json: it reports and fails.
    let output = driver()
        .args([
            "--input",
            set.to_str().expect("utf-8 path"),
            "--store",
            "memory",
        ])
        .args(["--json", "--quiet", "--probe-s", "0", "--run-dir"])
        .arg(dir.path().join("run-tampered"))
        .output()
        .expect("driver runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !output.status.success(),
        "a tampered set replayed as expected"
    );
    assert!(
        stderr.contains("the outcome differs from what the generator expected"),
        "{stderr}"
    );
    let tampered: serde_json::Value =
        serde_json::from_slice(&output.stdout).expect("the summary still printed");
    let sig = |summary: &serde_json::Value| summary["exceptions"]["E_SIG"].as_u64().unwrap_or(0);
    assert_eq!(sig(&tampered), sig(&summary) + 1);
    assert_eq!(tampered["messages_in"], summary["messages_in"]);
    assert!(tampered["limit_probe"].is_null());
    assert_eq!(tampered["matches_expected"], false);
    assert_eq!(summary["matches_expected"], true);
}

#[test]
fn hostile_lines_become_exceptions_and_the_run_goes_on() {
    let dir = tempfile::tempdir().expect("temporary folder");
    let set = dir.path().join("clean.xml");
    let status = driver()
        .args(["generate", "--trades", "50", "--out"])
        .arg(&set)
        .status()
        .expect("driver runs");
    assert!(status.success());
    let clean = std::fs::read(&set).expect("set");
    let clean = String::from_utf8(clean).expect("utf-8");
    let mut lines: Vec<Vec<u8>> = clean.lines().map(|l| l.as_bytes().to_vec()).collect();
    let close = lines.pop().expect("closing line");
    let a_message = String::from_utf8(lines[1].clone()).expect("utf-8");
    let sender = "<Sender>BRKAAU21XXX</Sender>";
    let hostile: Vec<(Vec<u8>, &str)> = vec![
        (a_message.as_bytes()[..a_message.len() / 2].to_vec(), "E_PARSE"),
        (
            format!(
                "<!DOCTYPE lolz [<!ENTITY lol \"lol\"><!ENTITY lol2 \"&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;\"><!ENTITY lol3 \"&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;\">]><Msg xmlns=\"urn:ste:trade:1\">{sender}<Account>&lol3;</Account></Msg>"
            )
            .into_bytes(),
            "E_PARSE",
        ),
        (
            a_message
                .replace("</Msg>", &format!("<!--{}--></Msg>", "x".repeat(10 * 1024 * 1024)))
                .into_bytes(),
            "E_SIZE",
        ),
        ((0..600_u32).map(|i| (i * 7919 % 251) as u8).filter(|b| *b != b'\n').collect(), "E_SIG"),
        (
            [b"\x00\xff\xfe garbage ".as_slice(), sender.as_bytes(), b" \x01\x02"].concat(),
            "E_PARSE",
        ),
        (a_message.replace("urn:ste:trade:1", "urn:not:ste").into_bytes(), "E_PARSE"),
        (Vec::new(), "E_SIG"),
    ];
    let mut expected_exceptions = std::collections::BTreeMap::<String, u64>::new();
    for (line, code) in &hostile {
        *expected_exceptions.entry((*code).to_owned()).or_default() += 1;
        // Hostile lines go in among the clean ones.
        let at = 1 + (line.len() % (lines.len() - 1));
        lines.insert(at, line.clone());
    }
    lines.push(close);
    let hostile_set = dir.path().join("hostile.xml");
    std::fs::write(&hostile_set, lines.join(&b'\n')).expect("writes");
    let run_dir = dir.path().join("run");
    let summary = run_json(&[
        "--input",
        hostile_set.to_str().expect("utf-8 path"),
        "--json",
        "--quiet",
        "--run-dir",
        run_dir.to_str().expect("utf-8 path"),
    ]);
    assert_eq!(summary["cls"], 50);
    assert_eq!(summary["accepted"], 350);
    assert_eq!(summary["messages_in"], 357);
    assert_eq!(
        summary["exceptions"],
        serde_json::to_value(&expected_exceptions).expect("json")
    );
}

#[test]
fn a_sweep_of_closed_loop_windows_draws_a_littles_law_series() {
    let dir = tempfile::tempdir().expect("temporary folder");
    let out = dir.path().join("sweep");
    let output = driver()
        .args(["sweep", "--trades", "300", "--store", "memory", "--quiet"])
        .args(["--windows", "1,512", "--sample-ms", "2", "--out"])
        .arg(&out)
        .output()
        .expect("driver runs");
    assert!(
        output.status.success(),
        "sweep failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let points: Vec<serde_json::Value> =
        serde_json::from_slice(&std::fs::read(out.join("sweep.json")).expect("sweep.json"))
            .expect("JSON");
    assert_eq!(points.len(), 2);
    // The model's prediction is there for every window and meets the least loaded level, where
    // its think time and latencies were measured: exactly, unless a station's demand measured at
    // the most loaded level exceeds its residence at the least loaded one (which a busy machine
    // can make happen), and then by that excess.
    for point in &points {
        assert!(point["X_mva"].as_f64().is_some_and(|x| x > 0.0), "{point}");
        // Each level also has its own CPU per message, the model at that demand, and whether
        // its cores were busy enough for the model to apply.
        let demand_us = point["D_us"].as_f64().expect("CPU per message");
        assert!(demand_us > 0.0, "{point}");
        assert!(
            point["X_mva_level"].as_f64().is_some_and(|x| x > 0.0),
            "{point}"
        );
        let busy = point["X"].as_f64().expect("X") * demand_us
            / 1e6
            / std::thread::available_parallelism().map_or(1.0, |n| n.get() as f64);
        assert_eq!(point["mva_applies"].as_bool(), Some(busy >= 0.9), "{point}");
    }
    let low = (
        points[0]["X"].as_f64().expect("X"),
        points[0]["X_mva"].as_f64().expect("X_mva"),
    );
    assert!(low.1 <= low.0 * (1.0 + 1e-6), "{low:?}");
    assert!(low.1 >= 0.9 * low.0, "{low:?}");
    let svg = std::fs::read_to_string(out.join("littles-law.svg")).expect("the curve is drawn");
    assert!(svg.starts_with("<svg") && svg.contains("MVA prediction") && svg.contains("measured"));
    assert!(
        svg.matches("<circle").count() >= 2 * 2,
        "two measured points on each panel"
    );
    let csv = std::fs::read_to_string(out.join("sweep.csv")).expect("sweep.csv");
    assert_eq!(csv.lines().count(), 3, "{csv}");
    let x = |k: usize| points[k]["X"].as_f64().expect("X");
    // One message in flight at a time serialises the whole network; 512 overlap.
    assert!(x(1) > 2.0 * x(0), "X(1) = {}, X(512) = {}", x(0), x(1));
    for point in &points {
        let run_dir = std::path::PathBuf::from(point["run_dir"].as_str().expect("run_dir"));
        let summary: serde_json::Value = serde_json::from_slice(
            &std::fs::read(run_dir.join("summary.json")).expect("each level keeps its summary"),
        )
        .expect("JSON");
        assert_eq!(summary["cls"], 300);
        assert_eq!(summary["window"], point["window"]);
        // Little's law per level: the stations' W / C from their station-time counters read
        // at the samples, along the path, against the response times measured directly, each
        // message's own. Both cover every message of a level, whatever instants the sampler
        // read at.
        let (r, r_direct) = (
            point["R_ms"].as_f64().expect("R"),
            point["R_direct_ms"].as_f64().expect("R direct"),
        );
        assert!(r > 0.0 && r_direct > 0.0);
        assert!(
            (r - r_direct).abs() <= 0.05 * r_direct,
            "R {r} ms from samples, {r_direct} ms measured: {point}"
        );
    }
    // With a window of one, the stations hold one message at most: their mean population
    // stays at or below one (a sample may catch a message between two stations' counters, but
    // only for the microseconds it takes to move), while a window of 512 fills them.
    let population = |k: usize| points[k]["N"].as_f64().expect("N");
    assert!(
        population(0) <= 1.05,
        "N = {} with a window of one",
        population(0)
    );
    assert!(
        population(1) > 10.0 * population(0).max(0.1),
        "N = {} with 512",
        population(1)
    );
}

#[test]
fn a_real_run_obeys_the_operational_laws_and_littles_law_matches_direct_measurement() {
    let dir = tempfile::tempdir().expect("temporary folder");
    let mut config = config(
        Source::Generated(GeneratorConfig::clean(10_000)),
        StoreKind::Memory,
        dir.path(),
    );
    // A writer's population is a saw-tooth (batches gather for the linger, then commit
    // together) and an optimised run lasts under a second: at one sample every 5 ms, its mean
    // from about 160 samples strayed up to 16% from the truth. A sample every millisecond
    // gives the estimate five times the samples, so that it is the law that is tested here
    // and not the luck of the draw.
    config.settings.sample_interval = Duration::from_millis(1);
    let summary = ste_driver::run(&config, refdata()).expect("runs");
    // The sampler asks for real-time priority; a process that may set it (CAP_SYS_NICE in its
    // effective capabilities, which root has, outside a control group without real-time time)
    // gets it, and the summary says either way (an RLIMIT_RTPRIO may grant it without).
    let may_set_priority = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            let mask = status
                .lines()
                .find_map(|line| line.strip_prefix("CapEff:"))?;
            u64::from_str_radix(mask.trim(), 16).ok()
        })
        .is_some_and(|mask| mask & (1 << 23) != 0);
    assert!(summary.sampler_on_time.is_some(), "the sampler's priority");
    if may_set_priority {
        assert_eq!(
            summary.sampler_on_time,
            Some(true),
            "the sampler's priority"
        );
    }
    let mut checked_direct = 0;
    for s in summary.stations.iter().filter(|s| s.C > 0) {
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0);
        // Utilisation law and Little's law, from the samples.
        assert!(
            close(s.U, s.X * s.S_ms / 1e3),
            "{}: U {} X·S {}",
            s.name,
            s.U,
            s.X * s.S_ms / 1e3
        );
        assert!(
            close(s.N, s.X * s.R_ms / 1e3),
            "{}: N {} X·R {}",
            s.name,
            s.N,
            s.X * s.R_ms / 1e3
        );
        // R from the sampled queue lengths against R from every message's own timestamps.
        if s.B_s > 1.0 {
            let gap = (s.R_ms - s.R_direct_ms).abs() / s.R_direct_ms;
            assert!(
                gap <= 0.05,
                "{}: R {} ms from samples, {} ms measured",
                s.name,
                s.R_ms,
                s.R_direct_ms
            );
            checked_direct += 1;
        }
        // A writer merges several queued batches into one transaction: an item's time there
        // runs from its own batch's enqueue stamp to the commit, the wait for the batches merged
        // after it included, as its station's population counts it.
        if s.name.starts_with("store.") {
            let gap = (s.R_ms - s.R_direct_ms).abs() / s.R_direct_ms;
            assert!(
                gap <= 0.05,
                "{}: R {} ms from samples, {} ms measured",
                s.name,
                s.R_ms,
                s.R_direct_ms
            );
            checked_direct += 1;
        }
    }
    assert!(
        checked_direct >= 3,
        "no station was busy for more than a second"
    );
    // The latency distribution is kept beside the summary.
    let latency = std::fs::read_to_string(dir.path().join("latency.csv")).expect("latency.csv");
    let rows: Vec<(f64, f64)> = latency
        .lines()
        .skip(1)
        .map(|line| {
            let mut columns = line.split(',');
            let percentile = columns
                .next()
                .and_then(|v| v.parse().ok())
                .expect("percentile");
            let ms = columns
                .next()
                .and_then(|v| v.parse().ok())
                .expect("latency");
            (percentile, ms)
        })
        .collect();
    assert!(rows.len() > 10);
    assert!(rows
        .windows(2)
        .all(|w| w[0].0 <= w[1].0 && w[0].1 <= w[1].1));
    assert!((rows.last().expect("rows").0 - 100.0).abs() < 1e-9);
}
