//! `driver --target tcp://…` against the bridge's framed-XML listener: a gateway with the memory
//! store and the listener run in this process, the driver binary sends a faulty, shuffled set
//! over several connections, and its outcome must be exactly what the generator expected; runs
//! follow each other against the same node, and one whose trades cannot complete says so.

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ste_bridge::gateway::{Gateway, GatewayConfig};
use ste_bridge::tcp::{self, TcpConfig};
use ste_engine::keys::KeyRing;
use ste_engine::pipeline::{PipelineConfig, StoreConfig};
use ste_engine::profile::{MatchingProfile, Tolerances};
use ste_engine::refdata::RefData;

/// A node in this process: a gateway on the memory store behind a framed-XML listener.
struct Node {
    gateway: Gateway,
    runtime: tokio::runtime::Runtime,
    server: tokio::task::JoinHandle<()>,
    stop: tokio::sync::watch::Sender<bool>,
    address: std::net::SocketAddr,
    keys_file: PathBuf,
    _keys_dir: tempfile::TempDir,
}

impl Node {
    fn start() -> Self {
        let config = GatewayConfig {
            pipeline: PipelineConfig {
                store: StoreConfig::Memory,
                ..PipelineConfig::default()
            },
            tolerances: Tolerances::from_profile(&MatchingProfile::default()).expect("tolerances"),
            cls_out: None,
            ingress_capacity: 1024,
            participant_rate: ste_bridge::gateway::PARTICIPANT_RATE_DEFAULT,
        };
        let refdata = RefData::embedded().expect("reference data");
        let keys = KeyRing::generate_for(&refdata);
        let keys_dir = tempfile::tempdir().expect("a temporary folder");
        let keys_file = keys_dir.path().join("keys.csv");
        keys.write(&keys_file).expect("the key file is written");
        let refdata = Arc::new(refdata.with_keys(&keys).expect("keys of participants"));
        let gateway = Gateway::start(&config, refdata).expect("the gateway starts");
        let runtime = tokio::runtime::Runtime::new().expect("a runtime");
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .expect("binds");
        let address = listener.local_addr().expect("an address");
        let (stop, stopped) = tokio::sync::watch::channel(false);
        // A small window, so that the driver's own window and the engine's backpressure both act.
        let tcp_config = TcpConfig {
            window: 64,
            ..TcpConfig::default()
        };
        let server = runtime.spawn(tcp::serve(listener, gateway.handle(), tcp_config, stopped));
        Self {
            gateway,
            runtime,
            server,
            stop,
            address,
            keys_file,
            _keys_dir: keys_dir,
        }
    }

    /// The driver against this node with `args`, killed and reported if it has not ended
    /// within `limit`.
    fn drive(&self, args: &[&str], limit: Duration) -> Output {
        let mut child = Command::new(env!("CARGO_BIN_EXE_driver"))
            .args(args)
            .args(["--quiet", "--json", "--connections", "3", "--window", "100"])
            .arg("--target")
            .arg(format!("tcp://{}", self.address))
            .arg("--keys")
            .arg(&self.keys_file)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the driver runs");
        let started = Instant::now();
        while child.try_wait().expect("the driver's status").is_none() {
            if started.elapsed() > limit {
                let _ = child.kill();
                let output = child.wait_with_output().expect("the driver's output");
                panic!(
                    "the driver did not end within {limit:?}: {}",
                    String::from_utf8_lossy(&output.stderr)
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        child.wait_with_output().expect("the driver's output")
    }

    /// Stops the listener and the gateway; what the gateway's sink saw.
    fn finish(self) -> ste_bridge::gateway::GatewayReport {
        self.stop.send(true).expect("stops");
        self.runtime
            .block_on(self.server)
            .expect("the listener stops");
        self.gateway.finish().expect("drains")
    }
}

fn summary_of(output: &Output) -> serde_json::Value {
    serde_json::from_slice(&output.stdout).unwrap_or_else(|error| {
        panic!(
            "{error}: {}\n{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        )
    })
}

/// The run id a driver printed on stderr.
fn run_id_of(output: &Output) -> String {
    let stderr = String::from_utf8_lossy(&output.stderr);
    stderr
        .lines()
        .find_map(|line| line.strip_prefix("run id "))
        .and_then(|rest| rest.split(':').next())
        .unwrap_or_else(|| panic!("no run id printed: {stderr}"))
        .to_owned()
}

#[test]
fn driver_target_tcp_gets_the_expected_outcome() {
    let node = Node::start();
    let output = node.drive(
        &["--trades", "3000", "--fault-rate", "0.3", "--shuffle"],
        Duration::from_secs(300),
    );
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let summary = summary_of(&output);
    assert_eq!(summary["matches_expected"], true, "{summary:#}");
    assert_eq!(summary["conserved"], true);
    let expected = &summary["expected"];
    assert_eq!(summary["cls"], expected["cls"]);
    assert_eq!(summary["exceptions"], expected["exceptions"]);
    assert!(
        summary["exceptions"]
            .as_object()
            .is_some_and(|codes| codes.len() >= 3),
        "faults give several codes: {summary:#}"
    );
    assert!(summary["ack_latency_ms"]["p50"].as_f64().expect("p50") > 0.0);

    let report = node.finish();
    assert_eq!(
        report.submitted,
        summary["messages_in"].as_u64().expect("messages_in")
    );
    assert_eq!(report.sink.cls, expected["cls"].as_u64().expect("cls"));
    assert_eq!(report.unrouted, 0, "every answer reached its connection");
}

#[test]
fn runs_follow_each_other_on_one_node_and_one_that_cannot_complete_says_which_trades() {
    let node = Node::start();
    let limit = Duration::from_secs(120);
    let faulty = ["--trades", "200", "--fault-rate", "0.3", "--shuffle"];
    // Two runs of different seeds, each with a run id of its own: both complete.
    let first = node.drive(&[&faulty[..], &["--seed", "1"]].concat(), limit);
    let second = node.drive(&[&faulty[..], &["--seed", "2"]].concat(), limit);
    for output in [&first, &second] {
        assert!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
        assert_eq!(summary_of(output)["matches_expected"], true);
    }
    let run = run_id_of(&first);
    assert_ne!(run, run_id_of(&second));

    // The first run again, run id and all: every message meets its first sending, no trade can
    // complete, and the driver ends after --cls-wait with the trades that did not.
    let again = node.drive(
        &[
            &faulty[..],
            &["--seed", "1", "--run-id", &run, "--cls-wait", "2"],
        ]
        .concat(),
        limit,
    );
    assert!(!again.status.success());
    let summary = summary_of(&again);
    let stderr = String::from_utf8_lossy(&again.stderr);
    assert_eq!(summary["matches_expected"], false);
    assert_eq!(summary["accepted"], 0, "{summary:#}");
    assert_eq!(summary["cls"], 0);
    let due = summary["expected"]["cls"].as_u64().expect("cls due");
    assert!(due > 100);
    assert_eq!(summary["missing_cls"], due);
    let named = summary["missing_cls_ids"]
        .as_array()
        .expect("the missing ClsIds");
    assert_eq!(named.len(), 20);
    let first_missing = named[0].as_str().expect("a ClsId");
    assert!(
        first_missing.starts_with("CLS-") && first_missing.contains(&format!("-T{run}")),
        "{first_missing}"
    );
    assert!(
        stderr.contains(&format!(
            "{due} trades expected to match have no CLS after 2 s without one: {first_missing}"
        )),
        "{stderr}"
    );
    assert!(
        stderr.contains("more E_DUPID or duplicates than expected"),
        "{stderr}"
    );
    node.finish();
}
