//! Starting and stopping the `engine` binary, and framed-XML helpers.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use ste_bridge::client::{self, FrameReader, FrameWriter, Logon};
use ste_bridge::frame::Frame;
use ste_engine::generator::{Generator, GeneratorConfig};
use ste_engine::keys::KeyRing;
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
        Engine::start_embedded_with(dir, cls_out, &[])
    }

    /// [`Engine::start_embedded`] with `extra` flags.
    pub fn start_embedded_with(dir: &Path, cls_out: &Path, extra: &[&str]) -> Engine {
        let cls_out = cls_out.to_str().expect("a UTF-8 path");
        let mut args = vec!["--store", "embedded", "--cls-out", cls_out];
        args.extend_from_slice(extra);
        Engine::launch(dir, &args, None)
    }

    fn launch(dir: &Path, args: &[&str], owned: Option<tempfile::TempDir>) -> Engine {
        let mut child = Command::new(env!("CARGO_BIN_EXE_engine"))
            .args(ste_bridge::bench::LOOPBACK_LISTENERS)
            .args(["--sample-ms", "0"])
            .arg("--data-dir")
            .arg(dir)
            .arg("--keys")
            .arg(keys_file())
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

/// The test process's key set: random, drawn once, shared by every engine it starts.
pub fn keys() -> &'static KeyRing {
    static KEYS: OnceLock<KeyRing> = OnceLock::new();
    KEYS.get_or_init(|| KeyRing::generate_for(&RefData::embedded().expect("reference data")))
}

/// The key set as a file that the engine binary reads (`--keys`).
pub fn keys_file() -> &'static Path {
    static FILE: OnceLock<(tempfile::TempDir, std::path::PathBuf)> = OnceLock::new();
    let (_, path) = FILE.get_or_init(|| {
        let dir = tempfile::tempdir().expect("a temporary folder");
        let path = dir.path().join("keys.csv");
        keys().write(&path).expect("the key file is written");
        (dir, path)
    });
    path
}

/// The reference data with the test process's keys.
pub fn refdata() -> RefData {
    RefData::embedded()
        .expect("reference data")
        .with_keys(keys())
        .expect("keys of known participants")
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
        sender: envelope.sender.expect("a sender").into_string(),
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
pub fn key_hex(_refdata: &RefData, bic: &str) -> String {
    hex::encode(keys().signing_key(bic).expect("a participant's key"))
}

/// A raw FIX session for the timing and size tests.
pub struct RawSession {
    pub stream: std::net::TcpStream,
    pub buffer: Vec<u8>,
}

impl RawSession {
    pub fn logon(
        engine: &Engine,
        refdata: &RefData,
        participant: &str,
        heartbeat_s: u32,
    ) -> RawSession {
        let (session, answer) =
            RawSession::send_logon(engine, &fix_logon(refdata, participant, heartbeat_s));
        assert_eq!(answer.msg_type(), "A", "{answer:?}");
        session
    }

    /// Connects and sends `logon` as it is; the session and the engine's first answer.
    pub fn send_logon(engine: &Engine, logon: &[u8]) -> (RawSession, ste_bridge::fix::FixMessage) {
        use std::io::Write;
        let mut stream = std::net::TcpStream::connect(engine.fix).expect("connects");
        stream
            .set_read_timeout(Some(std::time::Duration::from_secs(20)))
            .expect("timeout");
        stream.write_all(logon).expect("writes");
        let mut session = RawSession {
            stream,
            buffer: Vec::new(),
        };
        let answer = session.next().expect("a logon answer");
        (session, answer)
    }

    /// Logs `participant` on at MsgSeqNum `seq` without a reset, once the engine has let its
    /// previous connection go (a Logon while it is still live is refused, and tried again).
    pub fn logon_again(
        engine: &Engine,
        refdata: &RefData,
        participant: &str,
        seq: u64,
    ) -> (RawSession, ste_bridge::fix::FixMessage) {
        let started = Instant::now();
        loop {
            let (session, answer) =
                RawSession::send_logon(engine, &fix_logon_at(refdata, participant, 30, seq, false));
            let busy = answer
                .get(58)
                .is_some_and(|t| t.contains("already has a live"));
            if !busy {
                return (session, answer);
            }
            assert!(started.elapsed() < Duration::from_secs(20));
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The next message that is not a Heartbeat or TestRequest.
    pub fn next_answer(&mut self) -> Option<ste_bridge::fix::FixMessage> {
        std::iter::from_fn(|| self.next()).find(|m| !matches!(m.msg_type(), "0" | "1"))
    }

    /// Sends raw bytes.
    pub fn send(&mut self, bytes: &[u8]) {
        use std::io::Write;
        self.stream.write_all(bytes).expect("writes");
    }
}

/// A FIX Logon of `participant` with a fresh SendingTime and its password, MsgSeqNum 1 and
/// ResetSeqNumFlag: a session that starts afresh.
pub fn fix_logon(refdata: &RefData, participant: &str, heartbeat_s: u32) -> Vec<u8> {
    fix_logon_at(refdata, participant, heartbeat_s, 1, true)
}

/// A FIX Logon of `participant` with MsgSeqNum `seq`, resetting the sequence numbers or
/// (`reset` false) going on from the participant's last session.
pub fn fix_logon_at(
    refdata: &RefData,
    participant: &str,
    heartbeat_s: u32,
    seq: u64,
    reset: bool,
) -> Vec<u8> {
    // A new logon each call: SendingTime has milliseconds, and two logons built within one
    // would be the same logon (which the engine takes only once).
    static LAST_SENDING_TIME: std::sync::Mutex<String> = std::sync::Mutex::new(String::new());
    let mut last = LAST_SENDING_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let sending_time = loop {
        let now = ste_bridge::fix::utc_timestamp();
        if now != *last {
            break now;
        }
        std::thread::sleep(std::time::Duration::from_micros(200));
    };
    last.clone_from(&sending_time);
    drop(last);
    let key = refdata
        .participant_mac(participant)
        .expect("a participant")
        .1;
    let password = ste_bridge::fix::logon_password(key, &sending_time, participant);
    let mut fields = vec![
        (35, "A".into()),
        (49, participant.into()),
        (56, "STE".into()),
        (34, seq.to_string()),
        (52, sending_time),
        (98, "0".into()),
        (108, heartbeat_s.to_string()),
    ];
    if reset {
        fields.push((141, "Y".into()));
    }
    fields.push((554, password));
    ste_bridge::fix::encode(&fields)
}

/// A FIX message from `participant` with MsgSeqNum `seq`: `fields` start with its MsgType
/// (`35`), and the session header goes after it.
pub fn fix_message(participant: &str, seq: u64, fields: &[(u32, &str)]) -> Vec<u8> {
    let mut all = vec![
        (35, fields[0].1.to_owned()),
        (49, participant.to_owned()),
        (56, "STE".to_owned()),
        (34, seq.to_string()),
        (52, ste_bridge::fix::utc_timestamp()),
    ];
    all.extend(fields[1..].iter().map(|(t, v)| (*t, (*v).to_owned())));
    ste_bridge::fix::encode(&all)
}

/// The fields of the FIX application message of `line` from `35` to `89`, with the session
/// header of MsgSeqNum `seq`, signed by the line's sender after `tamper` changed the fields.
pub fn signed_fix_fields(
    refdata: &RefData,
    seq: u64,
    line: &[u8],
    tamper: impl FnOnce(&mut Vec<(u32, String)>),
) -> Vec<(u32, String)> {
    let sender = ste_engine::sign::claimed_sender(line).expect("a sender");
    let key = refdata.participant_mac(sender).expect("a participant").1;
    let mut pairs = ste_bridge::fix::to_fix(line).expect("maps to FIX");
    let msg_type = pairs.remove(0);
    let mut fields = vec![
        msg_type,
        (49, sender.to_owned()),
        (56, "STE".to_owned()),
        (34, seq.to_string()),
        (52, ste_bridge::fix::utc_timestamp()),
    ];
    fields.extend(pairs);
    tamper(&mut fields);
    ste_bridge::fix::sign_fields(key, &mut fields);
    fields
}

impl RawSession {
    /// The next whole message from the engine; `None` once it has closed.
    pub fn next(&mut self) -> Option<ste_bridge::fix::FixMessage> {
        use std::io::Read;
        loop {
            if let Some(end) = ste_engine::sign::find(&self.buffer, b"\x0110=").map(|at| at + 8) {
                if self.buffer.len() >= end {
                    let raw: Vec<u8> = self.buffer.drain(..end).collect();
                    return Some(ste_bridge::fix::parse(&raw).expect("a valid FIX message"));
                }
            }
            let mut chunk = [0_u8; 4096];
            match self.stream.read(&mut chunk) {
                Ok(0) | Err(_) => return None,
                Ok(n) => self.buffer.extend_from_slice(&chunk[..n]),
            }
        }
    }
}

/// A well-behaved participant's run in the background: one connection logged on as every
/// participant sends `trades` whole trades and waits for every ACK and CLS. Joined, it returns
/// (ACKs, CLS) received.
pub fn well_behaved(
    engine: &Engine,
    refdata: &RefData,
    trades: u64,
    seed: u64,
) -> std::thread::JoinHandle<(usize, usize)> {
    let lines = trade_lines(refdata, trades, seed);
    // It logs on as everyone, so it also hears the CLS of other connections' trades: it counts
    // the CLS of its own.
    let own_cls: std::collections::HashSet<String> = lines
        .iter()
        .map(|line| {
            let fields = ste_engine::codec::parse_fields(line).expect("a generated line parses");
            let text = |field| fields.get(field).expect("a generated line names its trade");
            ste_engine::model::cls_id(
                text(ste_engine::codec::Field::Broker),
                text(ste_engine::codec::Field::TradeRef),
            )
        })
        .collect();
    let bics = everyone(refdata);
    let names: Vec<&str> = bics.iter().map(String::as_str).collect();
    let (mut writer, mut reader) = connect_as(engine, refdata, &names, true);
    let frames: Vec<Frame> = lines
        .into_iter()
        .enumerate()
        .map(|(seq, line)| message(refdata, seq as u64, line))
        .collect();
    std::thread::spawn(move || {
        let expected_acks = frames.len();
        for frame in &frames {
            writer.send(frame).expect("sends");
        }
        writer.flush().expect("flushes");
        let mut acks = 0;
        let mut cls: std::collections::HashSet<String> = std::collections::HashSet::new();
        while acks < expected_acks || cls.len() < trades as usize {
            match reader.next_frame() {
                Ok(Some(Frame::Ack { .. })) => acks += 1,
                Ok(Some(Frame::Push {
                    class: ste_bridge::frame::PushClass::Cls,
                    xml,
                })) => {
                    let xml = String::from_utf8_lossy(&xml);
                    let cls_id = xml
                        .split_once("<ClsId>")
                        .and_then(|(_, rest)| rest.split_once("</ClsId>"))
                        .map(|(id, _)| id.to_owned());
                    if let Some(id) = cls_id.filter(|id| own_cls.contains(id)) {
                        cls.insert(id);
                    }
                }
                Ok(Some(_)) => {}
                Ok(None) | Err(_) => break,
            }
        }
        (acks, cls.len())
    })
}

/// The FIX fields of a canonical line, as JSON pairs for the simplefix client.
pub fn fix_pairs(line: &[u8]) -> serde_json::Value {
    let pairs = ste_bridge::fix::to_fix(line).expect("maps to FIX");
    serde_json::Value::Array(
        pairs
            .into_iter()
            .map(|(tag, value)| serde_json::json!([tag, value]))
            .collect(),
    )
}

/// Runs `bridge/tests/clients/SCRIPT` on the scenario file at `scenario`.
pub fn run_client(script: &str, scenario: &Path) -> std::process::Output {
    std::process::Command::new(python())
        .arg(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("tests/clients")
                .join(script),
        )
        .arg(scenario)
        .output()
        .expect(
            "python3 runs (with the clients: pip install -r bridge/tests/clients/requirements.txt)",
        )
}

/// Runs the simplefix participant on a scenario; its JSON result.
pub fn simplefix(engine: &Engine, scenario: serde_json::Value) -> serde_json::Value {
    let dir = tempfile::tempdir().expect("a temporary folder");
    let path = dir.path().join("scenario.json");
    let mut scenario = scenario;
    scenario["host"] = "127.0.0.1".into();
    scenario["port"] = engine.fix.port().into();
    std::fs::write(&path, serde_json::to_vec(&scenario).expect("JSON")).expect("writes");
    let output = run_client("fix_simplefix.py", &path);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("JSON")
}

/// A whole trade over FIX, each party over its own simplefix session in the order the parties
/// send (`tls`: the scenario's TLS settings, or null); every message must be accepted, and the
/// last session must hear the CLS pushed over FIX.
pub fn fix_trade_by_parties(
    engine: &Engine,
    refdata: &RefData,
    trade: &[Vec<u8>],
    tls: serde_json::Value,
) {
    let sender_of = |line: &[u8]| {
        ste_engine::sign::claimed_sender(line)
            .expect("a sender")
            .to_owned()
    };
    let mut senders: Vec<String> = Vec::new();
    for line in trade {
        if !senders.contains(&sender_of(line)) {
            senders.push(sender_of(line));
        }
    }
    for (index, sender) in senders.iter().enumerate() {
        let messages: Vec<serde_json::Value> = trade
            .iter()
            .filter(|line| sender_of(line) == *sender)
            .map(|line| fix_pairs(line))
            .collect();
        let last = index + 1 == senders.len();
        let mut scenario = serde_json::json!({
            "participant": sender,
            "key_hex": key_hex(refdata, sender),
            "mode": "trade",
            "messages": messages,
            "cls": if last { 1 } else { 0 },
        });
        if !tls.is_null() {
            scenario["tls"] = tls.clone();
        }
        let result = simplefix(engine, scenario);
        let answers = result["answers"].as_array().expect("answers");
        assert_eq!(answers.len(), messages.len(), "{result}");
        assert!(
            answers.iter().all(|a| a[2] == "0" || a[2] == "3"),
            "accepted (AR/P 0, AU 3): {result}"
        );
        if last {
            assert_eq!(result["cls"], 1, "the CLS pushed over FIX: {result}");
        }
    }
}
