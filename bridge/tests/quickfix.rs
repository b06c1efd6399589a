//! The `engine` binary against QuickFIX (PyPI `quickfix`, the C++ engine) as participants run
//! it: the FIX 4.4 data dictionary on (the stock `FIX44.xml` of the installed QuickFIX, with
//! STE's extension for SettlementInstructions), QuickFIX's default validation, a FileStore,
//! no ResetOnLogon. A proxy between them drops chosen messages once, in both directions, and
//! records every message it passes.

mod common;

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use common::{fix_pairs, key_hex, python, refdata, run_client, trade_lines, Engine};
use ste_bridge::fix::{self, FixMessage};
use ste_engine::codec::{self as ste_codec, Field};

/// Which way a message travels through the proxy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Way {
    ToEngine,
    ToParticipant,
}

/// A message the proxy saw: its way, the participant's session, and the message.
#[derive(Debug, Clone)]
struct Seen {
    way: Way,
    participant: String,
    message: FixMessage,
    raw: Vec<u8>,
    dropped: bool,
}

/// A message to drop once: the first one that travels `way` on `participant`'s session, is
/// not a resend, and satisfies `chosen`.
struct DropRule {
    way: Way,
    participant: String,
    chosen: Box<dyn Fn(&FixMessage) -> bool + Send>,
    done: bool,
}

#[derive(Default)]
struct ProxyState {
    seen: Vec<Seen>,
    rules: Vec<DropRule>,
}

/// One whole FIX message at the front of `buffer` (BeginString, BodyLength, body, CheckSum).
fn next_frame(buffer: &mut Vec<u8>) -> Option<Vec<u8>> {
    let text = std::str::from_utf8(&buffer[..buffer.len().min(32)]).ok()?;
    let mut fields = text.splitn(3, '\u{1}');
    let begin = fields.next()?;
    let length: usize = fields.next()?.strip_prefix("9=")?.parse().ok()?;
    let header = begin.len() + 1 + 2 + length.to_string().len() + 1;
    let end = header + length + 7;
    (buffer.len() >= end).then(|| buffer.drain(..end).collect())
}

/// Forwards whole messages from `from` to `to`, dropping what the rules choose.
fn pump(mut from: TcpStream, mut to: TcpStream, way: Way, state: Arc<Mutex<ProxyState>>) {
    let mut buffer = Vec::new();
    let mut chunk = [0_u8; 16384];
    loop {
        while let Some(raw) = next_frame(&mut buffer) {
            let message = fix::parse(&raw).expect("the proxy reads whole FIX messages");
            let participant = message
                .get(if way == Way::ToEngine { 49 } else { 56 })
                .unwrap_or("")
                .to_owned();
            let resent = message.get(43) == Some("Y");
            let mut state = state.lock().expect("proxy state");
            let rule = state.rules.iter_mut().find(|rule| {
                !rule.done
                    && !resent
                    && rule.way == way
                    && rule.participant == participant
                    && (rule.chosen)(&message)
            });
            let dropped = rule.is_some_and(|rule| {
                rule.done = true;
                true
            });
            state.seen.push(Seen {
                way,
                participant,
                message,
                raw: raw.clone(),
                dropped,
            });
            drop(state);
            if !dropped && to.write_all(&raw).is_err() {
                return;
            }
        }
        match from.read(&mut chunk) {
            Ok(0) | Err(_) => {
                let _ = to.shutdown(Shutdown::Write);
                return;
            }
            Ok(n) => buffer.extend_from_slice(&chunk[..n]),
        }
    }
}

/// Listens on a free loopback port and relays each connection to `target` (as it is when the
/// connection comes).
fn start_proxy(target: Arc<Mutex<std::net::SocketAddr>>, state: Arc<Mutex<ProxyState>>) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("a free port");
    let port = listener.local_addr().expect("an address").port();
    std::thread::spawn(move || {
        for participant in listener.incoming() {
            let Ok(participant) = participant else {
                continue;
            };
            let address = *target.lock().expect("target");
            let Ok(engine) = TcpStream::connect(address) else {
                continue;
            };
            let (p2, e2) = (
                participant.try_clone().expect("clone"),
                engine.try_clone().expect("clone"),
            );
            let (s1, s2) = (state.clone(), state.clone());
            std::thread::spawn(move || pump(participant, engine, Way::ToEngine, s1));
            std::thread::spawn(move || pump(e2, p2, Way::ToParticipant, s2));
        }
    });
    port
}

/// The stock FIX44.xml of the installed QuickFIX, extended by STE's dictionary extension.
fn dictionary(dir: &Path) -> PathBuf {
    let output = std::process::Command::new(python())
        .args([
            "-c",
            "import os, sys, quickfix; print(os.path.join(sys.prefix, 'share', 'quickfix', 'FIX44.xml'))",
        ])
        .output()
        .expect("python3 runs (with quickfix: pip install -r bridge/tests/clients/requirements.txt)");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let stock = PathBuf::from(String::from_utf8_lossy(&output.stdout).trim());
    assert!(stock.exists(), "QuickFIX's stock dictionary {stock:?}");
    let extended = dir.join("FIX44-STE.xml");
    let status = std::process::Command::new(python())
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/fix-dictionary/extend.py"
        ))
        .arg(&stock)
        .arg(&extended)
        .status()
        .expect("the extension script runs");
    assert!(status.success());
    extended
}

fn field_of(line: &[u8], field: Field) -> String {
    ste_codec::parse_fields(line)
        .expect("a generated line")
        .get(field)
        .unwrap_or("")
        .to_owned()
}

/// Every message the proxy saw, one per line, for a failure's message.
fn wire_log(state: &Mutex<ProxyState>) -> String {
    let state = state.lock().expect("proxy state");
    state
        .seen
        .iter()
        .map(|s| {
            format!(
                "{:?} {} {}{}",
                s.way,
                s.participant,
                String::from_utf8_lossy(&s.raw).replace('\u{1}', "|"),
                if s.dropped { "  (dropped)" } else { "" }
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// QuickFIX's event logs, for a failure's message.
fn event_logs(dir: &Path) -> String {
    let mut text = String::new();
    for entry in std::fs::read_dir(dir.join("log"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let path = entry.path();
        if path.to_string_lossy().contains(".event.") {
            text.push_str(&format!("== {}\n", path.display()));
            text.push_str(&std::fs::read_to_string(&path).unwrap_or_default());
        }
    }
    text
}

/// The body of an application message: what the participant wrote, without the header and
/// trailer the session fills in.
fn body(message: &FixMessage) -> Vec<(u32, String)> {
    message
        .fields
        .iter()
        .filter(|(tag, _)| ![8, 9, 10, 34, 43, 52, 122, 89, 93].contains(tag))
        .cloned()
        .collect()
}

#[test]
fn quickfix_with_the_fix44_dictionary_trades_recovers_dropped_messages_and_reconnects() {
    let work = tempfile::tempdir().expect("a temporary folder");
    let (node_dir, cls_out) = (work.path().join("node"), work.path().join("cls.xml"));
    let mut engine = Engine::start_embedded(&node_dir, &cls_out);
    let refdata = refdata();
    let dictionary = dictionary(work.path());
    let lines = trade_lines(&refdata, 2, 1301);
    let (first, second) = lines.split_at(7);

    // The sessions: every sender of the trades, and every custodian they name.
    let mut participants: Vec<String> = Vec::new();
    for line in &lines {
        for field in [Field::Sender, Field::Custodian] {
            let bic = field_of(line, field);
            if !bic.is_empty() && !participants.contains(&bic) {
                participants.push(bic);
            }
        }
    }
    assert!(
        participants.len() >= 3,
        "broker, investment manager, custodian: {participants:?}"
    );
    let broker = field_of(&first[0], Field::Broker);
    let inv_mgr = field_of(&first[0], Field::InvMgr);

    let run = |trade: &[Vec<u8>]| {
        let messages: Vec<serde_json::Value> = trade
            .iter()
            .map(|line| serde_json::json!([field_of(line, Field::Sender), fix_pairs(line)]))
            .collect();
        let mut expect = serde_json::Map::new();
        for participant in &participants {
            let answers = trade
                .iter()
                .filter(|line| field_of(line, Field::Sender) == *participant)
                .count();
            let party = [Field::Broker, Field::InvMgr, Field::Custodian]
                .iter()
                .any(|field| {
                    trade
                        .iter()
                        .any(|line| field_of(line, *field) == *participant)
                });
            expect.insert(
                participant.clone(),
                serde_json::json!({"answers": answers, "cls": usize::from(party)}),
            );
        }
        serde_json::json!({"messages": messages, "expect": expect})
    };

    // Dropped once each: the broker's first ACK and the investment manager's CLS on the way
    // to the participant; the investment manager's first ALC on the way to the engine.
    let state = Arc::new(Mutex::new(ProxyState::default()));
    let first_alc = first
        .iter()
        .find(|line| field_of(line, Field::Type) == "ALC")
        .expect("an ALC");
    let first_alc_id = field_of(first_alc, Field::MsgId);
    assert_eq!(field_of(first_alc, Field::Sender), inv_mgr);
    {
        let mut state = state.lock().expect("proxy state");
        state.rules.push(DropRule {
            way: Way::ToParticipant,
            participant: broker.clone(),
            chosen: Box::new(|m| m.msg_type() == "AR"),
            done: false,
        });
        state.rules.push(DropRule {
            way: Way::ToParticipant,
            participant: inv_mgr.clone(),
            chosen: Box::new(|m| m.msg_type() == "n"),
            done: false,
        });
        let id = first_alc_id.clone();
        state.rules.push(DropRule {
            way: Way::ToEngine,
            participant: inv_mgr.clone(),
            chosen: Box::new(move |m| m.msg_type() == "J" && m.get(70) == Some(id.as_str())),
            done: false,
        });
    }
    let target = Arc::new(Mutex::new(engine.fix));
    let port = start_proxy(target.clone(), state.clone());

    let sessions: Vec<serde_json::Value> = participants
        .iter()
        .map(|p| serde_json::json!({"participant": p, "key_hex": key_hex(&refdata, p)}))
        .collect();
    // One QuickFIX process per run, on the same FileStore.
    let drive = |plan: serde_json::Value, name: &str| -> serde_json::Value {
        let scenario = serde_json::json!({
            "host": "127.0.0.1",
            "port": port,
            "dictionary": dictionary,
            "dir": work.path(),
            "heartbeat": 2,
            "timeout": 60,
            "sessions": sessions,
            "runs": [plan],
        });
        let path = work.path().join(format!("{name}.json"));
        std::fs::write(&path, serde_json::to_vec(&scenario).expect("JSON")).expect("writes");
        let output = run_client("fix_quickfix.py", &path);
        assert!(
            output.status.success(),
            "{}: {}\n{}\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr),
            String::from_utf8_lossy(&output.stdout),
            event_logs(work.path())
        );
        let result: serde_json::Value = serde_json::from_slice(&output.stdout).expect("JSON");
        assert!(
            result["error"].is_null(),
            "{result}\n{}\n{}",
            wire_log(&state),
            event_logs(work.path())
        );
        result["participants"].clone()
    };
    let mut by = drive(run(first), "first");
    // The engine restarts between the runs: the sessions go on from what its data folder kept.
    assert!(engine.stop().success());
    engine = Engine::start_embedded(&node_dir, &cls_out);
    *target.lock().expect("target") = engine.fix;
    let then = drive(run(second), "second");
    for participant in &participants {
        let mine = by[participant].as_object_mut().expect("a participant");
        for (key, more) in then[participant].as_object().expect("a participant") {
            let list = mine[key].as_array_mut().expect("a list");
            list.extend(more.as_array().expect("a list").iter().cloned());
        }
    }
    let seen = state.lock().expect("proxy state").seen.clone();
    let log = || wire_log(&state);
    // Kept for reading: every message both ways, as the proxy saw it.
    let kept_log = Path::new(env!("CARGO_TARGET_TMPDIR")).join("quickfix-wire.log");
    std::fs::write(&kept_log, log()).expect("writes the wire log");

    // Every message of both trades answered and accepted, every party given both CLS; no
    // Reject or BusinessMessageReject either way, as the participants and the proxy saw it.
    for participant in &participants {
        let mine = &by[participant];
        let sent = lines
            .iter()
            .filter(|line| field_of(line, Field::Sender) == *participant)
            .count();
        let answers = mine["answers"].as_array().expect("answers");
        assert_eq!(answers.len(), sent, "{participant}: {mine}");
        assert!(
            answers
                .iter()
                .all(|a| a[2] == "0" || (a[0] == "AU" && a[2] == "3")),
            "{participant}: all accepted: {mine}"
        );
        assert!(
            answers.iter().all(|a| a[3].is_null()),
            "no DUPLICATE: {mine}"
        );
        for key in ["rejects_received", "rejects_sent"] {
            assert_eq!(
                mine[key],
                serde_json::json!([]),
                "{participant} {key}: {mine}"
            );
        }
    }
    assert!(
        !seen
            .iter()
            .any(|s| matches!(s.message.msg_type(), "3" | "j")),
        "a Reject on the wire:\n{}",
        log()
    );
    for participant in &participants {
        let trades = [first, second]
            .iter()
            .filter(|trade| {
                trade.iter().any(|line| {
                    [Field::Broker, Field::InvMgr, Field::Custodian]
                        .iter()
                        .any(|field| field_of(line, *field) == *participant)
                })
            })
            .count();
        let cls = by[participant]["cls"].as_array().expect("cls");
        assert_eq!(
            cls.len(),
            trades,
            "{participant}: the CLS of its trades: {}",
            by[participant]
        );
    }

    // The dropped ACK and CLS came back through the participant's ResendRequest, as the
    // messages first sent (PossDupFlag), not as a GapFill.
    for (participant, what, list) in [(&broker, "ACK", "answers"), (&inv_mgr, "CLS", "cls")] {
        let mine = &by[participant];
        assert!(
            !mine["resend_requests_sent"]
                .as_array()
                .expect("list")
                .is_empty(),
            "{participant} asked for the dropped {what}: {mine}"
        );
        let recovered = mine[list].as_array().expect("list");
        assert!(
            recovered
                .iter()
                .any(|item| item.as_array().and_then(|a| a.last()) == Some(&true.into())),
            "{participant}'s dropped {what} arrived again with PossDupFlag: {mine}\n{}",
            log()
        );
    }

    // The ALC dropped on the way to the engine: the engine asked for it, QuickFIX sent it
    // again (PossDupFlag), its body unchanged, and it was accepted.
    let dropped = seen
        .iter()
        .find(|s| s.dropped && s.way == Way::ToEngine)
        .expect("the ALC was dropped");
    assert!(
        seen.iter().any(|s| s.way == Way::ToParticipant
            && s.participant == inv_mgr
            && s.message.msg_type() == "2"),
        "the engine asked for the dropped ALC:\n{}",
        log()
    );
    let again = seen
        .iter()
        .find(|s| {
            s.way == Way::ToEngine
                && !s.dropped
                && s.message.msg_type() == "J"
                && s.message.get(70) == Some(first_alc_id.as_str())
        })
        .expect("QuickFIX sent the ALC again");
    assert_eq!(again.message.get(43), Some("Y"), "{:?}", again.message);
    assert_eq!(again.message.get(34), dropped.message.get(34));
    assert_eq!(body(&again.message), body(&dropped.message));
    assert!(by[&inv_mgr]["resent"]
        .as_array()
        .expect("resent")
        .contains(&first_alc_id.clone().into()));

    // The second run is a reconnect to a restarted engine: every Logon goes on from the
    // numbers of the first, without ResetSeqNumFlag, on both sides.
    for participant in &participants {
        let logons: Vec<&Seen> = seen
            .iter()
            .filter(|s| s.participant == *participant && s.message.msg_type() == "A")
            .collect();
        assert_eq!(
            logons.len(),
            4,
            "two Logons each way: {participant}\n{}",
            log()
        );
        for logon in &logons {
            assert_eq!(
                logon.message.get(141),
                None,
                "no ResetSeqNumFlag: {logon:?}"
            );
        }
        for way in [Way::ToEngine, Way::ToParticipant] {
            let seqs: Vec<u64> = logons
                .iter()
                .filter(|s| s.way == way)
                .map(|s| {
                    s.message
                        .get(34)
                        .and_then(|n| n.parse().ok())
                        .expect("MsgSeqNum")
                })
                .collect();
            assert_eq!(seqs[0], 1, "{participant} {way:?}");
            assert!(seqs[1] > 2, "{participant} {way:?} goes on: {seqs:?}");
        }
    }
    assert!(engine.stop().success());
}
