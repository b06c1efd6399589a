//! `driver --target tcp://…` against the bridge's framed-XML listener: a gateway with the memory
//! store and the listener run in this process, the driver binary sends a faulty, shuffled set
//! over several connections, and its outcome must be exactly what the generator expected.

use std::process::Command;
use std::sync::Arc;

use ste_bridge::gateway::{Gateway, GatewayConfig};
use ste_bridge::tcp::{self, TcpConfig};
use ste_engine::keys::KeyRing;
use ste_engine::pipeline::{PipelineConfig, StoreConfig};
use ste_engine::profile::{MatchingProfile, Tolerances};
use ste_engine::refdata::RefData;

#[test]
fn driver_target_tcp_gets_the_expected_outcome() {
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

    let output = Command::new(env!("CARGO_BIN_EXE_driver"))
        .args([
            "--trades",
            "3000",
            "--fault-rate",
            "0.3",
            "--shuffle",
            "--quiet",
            "--json",
        ])
        .args(["--connections", "3", "--window", "100"])
        .arg("--target")
        .arg(format!("tcp://{address}"))
        .arg("--keys")
        .arg(&keys_file)
        .output()
        .expect("the driver runs");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let summary: serde_json::Value = serde_json::from_slice(&output.stdout).expect("JSON");
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

    stop.send(true).expect("stops");
    runtime.block_on(server).expect("the listener stops");
    let report = gateway.finish().expect("drains");
    assert_eq!(
        report.submitted,
        summary["messages_in"].as_u64().expect("messages_in")
    );
    assert_eq!(report.sink.cls, expected["cls"].as_u64().expect("cls"));
    assert_eq!(report.unrouted, 0, "every answer reached its connection");
}
