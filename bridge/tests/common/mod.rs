//! Starting and stopping the `engine` binary, and framed-XML helpers.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use ste_bridge::client::{self, FrameReader, FrameWriter, Logon};
use ste_bridge::frame::Frame;
use ste_engine::generator::{Generator, GeneratorConfig};
use ste_engine::pipeline::sign_line;
use ste_engine::refdata::RefData;

/// A running engine node; killed if the test fails before stopping it.
pub struct Engine {
    child: Option<Child>,
    pub tcp: SocketAddr,
    pub http: SocketAddr,
    pub fix: SocketAddr,
    _data_dir: Option<tempfile::TempDir>,
}

impl Engine {
    /// Starts the engine binary on a free loopback port with the memory store and `extra` flags.
    pub fn start(extra: &[&str]) -> Engine {
        let data_dir = tempfile::tempdir().expect("a temporary folder");
        let mut args = vec!["--store", "memory"];
        args.extend_from_slice(extra);
        let path = data_dir.path().to_owned();
        Engine::launch(&path, &args, Some(data_dir))
    }

    /// Starts the engine binary with the embedded store in `dir` (kept across restarts),
    /// appending every CLS to `cls_out`.
    pub fn start_embedded(dir: &Path, cls_out: &Path) -> Engine {
        let cls_out = cls_out.to_str().expect("a UTF-8 path");
        Engine::launch(dir, &["--store", "embedded", "--cls-out", cls_out], None)
    }

    fn launch(dir: &Path, args: &[&str], owned: Option<tempfile::TempDir>) -> Engine {
        let mut child = Command::new(env!("CARGO_BIN_EXE_engine"))
            .args([
                "--tcp",
                "127.0.0.1:0",
                "--http",
                "127.0.0.1:0",
                "--fix",
                "127.0.0.1:0",
                "--sample-ms",
                "0",
            ])
            .arg("--data-dir")
            .arg(dir)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("the engine starts");
        let stdout = child.stdout.take().expect("stdout");
        let mut lines = BufReader::new(stdout);
        let mut address_of = |label: &str| -> SocketAddr {
            let mut line = String::new();
            lines
                .read_line(&mut line)
                .expect("the engine prints its addresses");
            line.trim()
                .strip_prefix(label)
                .and_then(|rest| rest.trim().parse().ok())
                .unwrap_or_else(|| panic!("expected {label} ADDRESS, got {line:?}"))
        };
        let tcp = address_of("tcp");
        let http = address_of("http");
        let fix = address_of("fix");
        Engine {
            child: Some(child),
            tcp,
            http,
            fix,
            _data_dir: owned,
        }
    }

    /// Sends SIGTERM.
    pub fn terminate(&self) {
        let child = self.child.as_ref().expect("running");
        let status = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status()
            .expect("kill runs");
        assert!(status.success());
    }

    /// The exit status (within 60 s).
    pub fn wait(mut self) -> ExitStatus {
        let mut child = self.child.take().expect("running");
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = child.try_wait().expect("waits") {
                return status;
            }
            assert!(Instant::now() < deadline, "the engine did not stop");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGTERM, then the exit status.
    pub fn stop(self) -> ExitStatus {
        self.terminate();
        self.wait()
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        if let Some(child) = &mut self.child {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

pub fn refdata() -> RefData {
    RefData::embedded().expect("reference data")
}

/// The lines of `trades` clean standard trades.
pub fn trade_lines(refdata: &RefData, trades: u64, seed: u64) -> Vec<Vec<u8>> {
    Generator::new(
        refdata,
        GeneratorConfig {
            seed,
            ..GeneratorConfig::clean(trades)
        },
    )
    .collect()
}

/// A message frame for a line, signed by the line's sender.
pub fn message(refdata: &RefData, seq: u64, line: Vec<u8>) -> Frame {
    let envelope = sign_line(refdata, line, seq, 0);
    Frame::Message {
        seq,
        sender: envelope.sender.expect("a sender"),
        signature: envelope.signature.expect("signed"),
        xml: envelope.bytes,
    }
}

/// Connects and logs on as each of `participants`.
pub fn connect_as(
    engine: &Engine,
    refdata: &RefData,
    participants: &[&str],
    subscribe: bool,
) -> (FrameWriter, FrameReader) {
    let logons: Vec<Logon<'_>> = participants
        .iter()
        .map(|bic| Logon {
            participant: bic,
            key: refdata.participant_mac(bic).expect("a participant").1,
            subscribe,
        })
        .collect();
    client::connect(engine.tcp, &logons).expect("connects and logs on")
}

/// Every participant's BIC.
pub fn everyone(refdata: &RefData) -> Vec<String> {
    refdata
        .participants()
        .iter()
        .map(|p| p.bic.clone())
        .collect()
}

/// The Python that runs the third-party clients (`STE_PYTHON`, else `python3`).
pub fn python() -> std::path::PathBuf {
    std::env::var_os("STE_PYTHON")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from("python3"))
}

/// A participant's signing key, hex, as a third-party client is given it.
pub fn key_hex(refdata: &RefData, bic: &str) -> String {
    hex::encode(
        &refdata
            .participants()
            .iter()
            .find(|p| p.bic == bic)
            .expect("a participant")
            .key,
    )
}
