//! The `engine` binary over FIX 4.4, driven by simplefix (a FIX library from PyPI): full trades
//! through sessions of each party, a sequence gap recovered by ResendRequest, refused logons and
//! messages, and one trade whose messages come over FIX, SOAP and framed XML.

mod common;

use base64::Engine as _;
use common::{
    connect_as, everyone, fix_pairs, key_hex, message, refdata, simplefix, trade_lines, Engine,
    RawSession,
};
use ste_bridge::frame::{Frame, PushClass};
use ste_bridge::soap::{BRIDGE_NS, SOAP11_NS};
use ste_engine::sign;

fn sender_of(line: &[u8]) -> &str {
    sign::claimed_sender(line).expect("a sender")
}

fn type_of(line: &[u8]) -> String {
    let text = std::str::from_utf8(line).expect("UTF-8");
    let start = text.find("<Type>").expect("Type") + 6;
    text[start..start + 3].to_owned()
}

#[test]
fn simplefix_sessions_trade_recover_a_gap_and_are_refused_when_they_should_be() {
    let engine = Engine::start(&[]);
    let refdata = refdata();
    let lines = trade_lines(&refdata, 2, 61);
    let (first, second) = lines.split_at(7);

    // A whole trade, each party over its own FIX session, in the order the parties send; the
    // last session waits for the CLS, pushed to it as an XML message.
    common::fix_trade_by_parties(&engine, &refdata, first, serde_json::Value::Null);

    // A sequence gap: MsgSeqNum 3 skipped; the engine asks for it and then takes 4 as well.
    let broker = sender_of(&second[0]);
    let broker_messages: Vec<serde_json::Value> = second
        .iter()
        .filter(|line| sender_of(line) == broker)
        .map(|line| fix_pairs(line))
        .collect();
    assert_eq!(broker_messages.len(), 3, "NOE and two NPRs");
    let result = simplefix(
        &engine,
        serde_json::json!({
            "participant": broker,
            "key_hex": key_hex(&refdata, broker),
            "mode": "gap",
            "messages": broker_messages,
        }),
    );
    assert_eq!(
        result["resend_request"],
        serde_json::json!([3, 0]),
        "{result}"
    );
    let answers = result["answers"].as_array().expect("answers");
    assert_eq!(answers.len(), 3, "{result}");
    assert!(answers.iter().all(|a| a[2] == "0"), "{result}");

    // A wrong logon password: Logout with E_SIG.
    let result = simplefix(
        &engine,
        serde_json::json!({
            "participant": broker,
            "key_hex": key_hex(&refdata, broker),
            "mode": "badpass",
            "messages": [],
        }),
    );
    assert!(
        result["logout_text"]
            .as_str()
            .is_some_and(|t| t.starts_with("E_SIG")),
        "{result}"
    );

    // On the broker's session: a message of another participant signed with that
    // participant's key (E_AUTH), and the broker's own message with a forged signature (E_SIG).
    let other_line = second
        .iter()
        .find(|line| sender_of(line) != broker)
        .expect("another participant's message");
    let other = sender_of(other_line);
    let result = simplefix(
        &engine,
        serde_json::json!({
            "participant": broker,
            "key_hex": key_hex(&refdata, broker),
            "mode": "trade",
            "messages": [fix_pairs(other_line), fix_pairs(&second[0])],
            "senders": [other, broker],
            "signers": [key_hex(&refdata, other), "00".repeat(32)],
        }),
    );
    let answers = result["answers"].as_array().expect("answers");
    assert_eq!(answers.len(), 2, "{result}");
    let texts: Vec<&str> = answers
        .iter()
        .map(|a| a[3].as_str().unwrap_or(""))
        .collect();
    assert!(texts.iter().any(|t| t.starts_with("E_AUTH")), "{result}");
    assert!(texts.iter().any(|t| t.starts_with("E_SIG")), "{result}");
    assert!(engine.stop().success());
}

#[test]
fn one_trade_over_fix_soap_and_framed_xml() {
    let engine = Engine::start(&[]);
    let refdata = refdata();
    let lines = trade_lines(&refdata, 1, 71);
    let bics = everyone(&refdata);
    let bic_refs: Vec<&str> = bics.iter().map(String::as_str).collect();
    let (mut writer, mut reader) = connect_as(&engine, &refdata, &bic_refs, true);

    // NOE and NPRs over FIX (the broker's session).
    let broker = sender_of(&lines[0]).to_owned();
    let fix_lines: Vec<&Vec<u8>> = lines
        .iter()
        .filter(|l| matches!(type_of(l).as_str(), "NOE" | "NPR"))
        .collect();
    let result = simplefix(
        &engine,
        serde_json::json!({
            "participant": broker,
            "key_hex": key_hex(&refdata, &broker),
            "mode": "trade",
            "messages": fix_lines.iter().map(|l| fix_pairs(l)).collect::<Vec<_>>(),
        }),
    );
    assert_eq!(
        result["answers"].as_array().map(Vec::len),
        Some(3),
        "{result}"
    );
    assert!(result["answers"]
        .as_array()
        .expect("answers")
        .iter()
        .all(|a| a[2] == "0"));

    // ALCs over SOAP.
    for line in lines.iter().filter(|l| type_of(l) == "ALC") {
        let signer = sender_of(line);
        let key = refdata.participant_mac(signer).expect("a participant").1;
        let envelope = format!(
            "<s:Envelope xmlns:s=\"{SOAP11_NS}\" xmlns:b=\"{BRIDGE_NS}\"><s:Header><b:Auth><b:Participant>{signer}</b:Participant><b:Signature>{}</b:Signature></b:Auth></s:Header><s:Body><b:Submit><b:Message>{}</b:Message></b:Submit></s:Body></s:Envelope>",
            hex::encode(sign::sign_keyed(key, line)),
            base64::engine::general_purpose::STANDARD.encode(line)
        );
        let mut stream = std::net::TcpStream::connect(engine.http).expect("connects");
        use std::io::{Read, Write};
        write!(
            stream,
            "POST /soap HTTP/1.1\r\nHost: localhost\r\nContent-Type: text/xml\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{envelope}",
            envelope.len()
        )
        .expect("writes");
        let mut response = String::new();
        stream.read_to_string(&mut response).expect("reads");
        assert!(response.starts_with("HTTP/1.1 200"), "{response}");
        assert!(response.contains("ACCEPTED"), "{response}");
    }

    // SETs over framed XML; the CLS arrives there.
    let sets: Vec<&Vec<u8>> = lines.iter().filter(|l| type_of(l) == "SET").collect();
    for (seq, line) in sets.iter().enumerate() {
        writer
            .send(&message(&refdata, seq as u64, (*line).clone()))
            .expect("sends");
    }
    writer.flush().expect("flushes");
    let (mut acks, mut cls) = (0, 0);
    while acks < sets.len() || cls < 1 {
        match reader.next_frame().expect("reads").expect("open") {
            Frame::Ack {
                duplicate: false, ..
            } => acks += 1,
            Frame::Push {
                class: PushClass::Cls,
                ..
            } => cls += 1,
            other => panic!("unexpected {other:?}"),
        }
    }
    assert!(engine.stop().success());
}

#[test]
fn silent_slow_and_oversized_fix_sessions_are_logged_out() {
    use std::io::Write;
    let engine = Engine::start(&["--frame-timeout-ms", "500"]);
    let refdata = refdata();
    let bics = everyone(&refdata);

    // A well-behaved session, open throughout.
    let mut good = RawSession::logon(&engine, &refdata, &bics[3], 30);

    // Silence: a TestRequest after HeartBtInt + 20%, then a Logout if still nothing comes.
    let mut silent = RawSession::logon(&engine, &refdata, &bics[0], 1);
    let mut seen = Vec::new();
    while let Some(message) = silent.next() {
        let msg_type = message.msg_type().to_owned();
        seen.push(msg_type.clone());
        if msg_type == "5" {
            assert!(
                message.get(58).is_some_and(|t| t.starts_with("E_TIMEOUT")),
                "{message:?}"
            );
            break;
        }
    }
    assert!(
        seen.contains(&"1".to_owned()),
        "a TestRequest first: {seen:?}"
    );
    assert_eq!(seen.last().map(String::as_str), Some("5"), "{seen:?}");

    // A message that stops half way: logged out when the message timeout passes.
    let mut slow = RawSession::logon(&engine, &refdata, &bics[1], 30);
    slow.stream
        .write_all(b"8=FIX.4.4\x019=200\x0135=AE\x01")
        .expect("writes");
    let logout = std::iter::from_fn(|| slow.next())
        .find(|m| m.msg_type() == "5")
        .expect("a Logout");
    assert!(
        logout.get(58).is_some_and(|t| t.starts_with("E_TIMEOUT")),
        "{logout:?}"
    );

    // A 10 MiB body: refused from its BodyLength.
    let mut big = RawSession::logon(&engine, &refdata, &bics[2], 30);
    big.stream
        .write_all(b"8=FIX.4.4\x019=10485760\x0135=AE\x01")
        .expect("writes");
    let logout = std::iter::from_fn(|| big.next())
        .find(|m| m.msg_type() == "5")
        .expect("a Logout");
    assert!(
        logout.get(58).is_some_and(|t| t.starts_with("E_SIZE")),
        "{logout:?}"
    );

    // The well-behaved session still answers: a TestRequest gets its Heartbeat.
    let test_request = ste_bridge::fix::encode(&[
        (35, "1".into()),
        (49, bics[3].clone()),
        (56, "STE".into()),
        (34, "2".into()),
        (52, ste_bridge::fix::utc_timestamp()),
        (112, "STILL-THERE".into()),
    ]);
    good.stream.write_all(&test_request).expect("writes");
    let heartbeat = std::iter::from_fn(|| good.next())
        .find(|m| m.get(112).is_some())
        .expect("a Heartbeat");
    assert_eq!(heartbeat.msg_type(), "0");
    assert_eq!(heartbeat.get(112), Some("STILL-THERE"));
    assert!(engine.stop().success());
}

/// More sessions than allowed are told E_BUSY in a Logout.
#[test]
fn fix_sessions_are_bounded() {
    let engine = Engine::start(&["--max-connections", "2"]);
    let refdata = refdata();
    let bics = everyone(&refdata);
    let _first = RawSession::logon(&engine, &refdata, &bics[0], 30);
    let _second = RawSession::logon(&engine, &refdata, &bics[1], 30);
    let mut third = RawSession {
        stream: std::net::TcpStream::connect(engine.fix).expect("connects"),
        buffer: Vec::new(),
    };
    third
        .stream
        .set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .expect("timeout");
    let logout = third.next().expect("a Logout");
    assert_eq!(logout.msg_type(), "5");
    assert!(
        logout.get(58).is_some_and(|t| t.starts_with("E_BUSY")),
        "{logout:?}"
    );
    assert!(engine.stop().success());
}

/// Session rules as strict FIX engines keep them: the engine's Heartbeat comes HeartBtInt after
/// its own last message, however often the participant sends; a participant's Reject is taken
/// without a Reject back; a ResendRequest is acted on even when it arrives beyond a gap, and
/// not again once the gap is filled.
#[test]
fn heartbeats_rejects_and_resend_requests_follow_the_session_rules() {
    let engine = Engine::start(&[]);
    let refdata = refdata();
    let bics = everyone(&refdata);
    let bic = bics[0].clone();
    let mut session = RawSession::logon(&engine, &refdata, &bic, 1);
    let message = |seq: u64, fields: &[(u32, &str)]| common::fix_message(&bic, seq, fields);
    // Everything the engine sends until `until` holds, reading in short slices.
    let received = |session: &mut RawSession,
                    until: &dyn Fn(&[ste_bridge::fix::FixMessage]) -> bool| {
        let mut seen = Vec::new();
        let started = std::time::Instant::now();
        while !until(&seen) {
            assert!(
                started.elapsed() < std::time::Duration::from_secs(20),
                "{seen:?}"
            );
            if let Some(message) = session.next() {
                seen.push(message);
            }
        }
        seen
    };
    session
        .stream
        .set_read_timeout(Some(std::time::Duration::from_millis(100)))
        .expect("timeout");

    // The participant sends a Heartbeat every 300 ms for 3.5 s (HeartBtInt 1 s): the engine's
    // own Heartbeats still come, about one a second.
    let mut seq = 2;
    let mut engine_heartbeats = 0;
    let started = std::time::Instant::now();
    while started.elapsed() < std::time::Duration::from_millis(3500) {
        session.send(&message(seq, &[(35, "0")]));
        seq += 1;
        let slice = std::time::Instant::now();
        while slice.elapsed() < std::time::Duration::from_millis(300) {
            if let Some(answer) = session.next() {
                assert_ne!(answer.msg_type(), "5", "{answer:?}");
                if answer.msg_type() == "0" && answer.get(112).is_none() {
                    engine_heartbeats += 1;
                }
            }
        }
    }
    assert!(
        engine_heartbeats >= 2,
        "{engine_heartbeats} Heartbeats in 3.5 s"
    );

    // A Reject and a BusinessMessageReject of the participant's: no Reject comes back, and the
    // session goes on.
    session.send(&message(
        seq,
        &[(35, "3"), (45, "1"), (373, "99"), (58, "test reject")],
    ));
    session.send(&message(
        seq + 1,
        &[(35, "j"), (45, "1"), (380, "0"), (58, "test")],
    ));
    session.send(&message(seq + 2, &[(35, "1"), (112, "AFTER-REJECTS")]));
    seq += 3;
    let seen = received(&mut session, &|seen| {
        seen.iter().any(|m| m.get(112) == Some("AFTER-REJECTS"))
    });
    assert!(seen.iter().all(|m| m.msg_type() != "3"), "{seen:?}");

    // A ResendRequest that skips MsgSeqNum `seq`: answered at once with a GapFill, and the
    // engine asks for `seq` itself.
    session.send(&message(seq + 1, &[(35, "2"), (7, "1"), (16, "0")]));
    let seen = received(&mut session, &|seen| {
        seen.iter().any(|m| m.msg_type() == "4") && seen.iter().any(|m| m.msg_type() == "2")
    });
    let gap_fill = seen
        .iter()
        .find(|m| m.msg_type() == "4")
        .expect("a GapFill");
    assert_eq!(gap_fill.get(123), Some("Y"), "{gap_fill:?}");
    let request = seen
        .iter()
        .find(|m| m.msg_type() == "2")
        .expect("a ResendRequest");
    assert_eq!(
        request.get(7),
        Some(seq.to_string().as_str()),
        "{request:?}"
    );
    // The participant fills its gap; the ResendRequest it releases is not answered again.
    let new_seq = (seq + 2).to_string();
    session.send(&message(
        seq,
        &[(35, "4"), (43, "Y"), (123, "Y"), (36, &new_seq)],
    ));
    session.send(&message(seq + 2, &[(35, "1"), (112, "AFTER-GAP")]));
    let seen = received(&mut session, &|seen| {
        seen.iter().any(|m| m.get(112) == Some("AFTER-GAP"))
    });
    assert!(
        seen.iter()
            .all(|m| !matches!(m.msg_type(), "4" | "3" | "5")),
        "{seen:?}"
    );
    assert!(engine.stop().success());
}

/// A participant that reconnects without ResetSeqNumFlag goes on with both sequence numbers,
/// and a ResendRequest brings back an application message of the engine's (an ACK) as it was
/// first sent, with PossDupFlag and OrigSendingTime; a Logon below the expected number is
/// refused.
#[test]
fn sequence_numbers_and_sent_answers_outlive_a_connection() {
    let engine = Engine::start(&[]);
    let refdata = refdata();
    let lines = trade_lines(&refdata, 1, 67);
    let noe = lines
        .iter()
        .find(|line| type_of(line) == "NOE")
        .expect("a NOE");
    let broker = sender_of(noe).to_owned();

    let mut first = RawSession::logon(&engine, &refdata, &broker, 30);
    first.send(&ste_bridge::fix::encode(&common::signed_fix_fields(
        &refdata,
        2,
        noe,
        |_| {},
    )));
    let ack = first.next_answer().expect("an answer");
    assert_eq!(ack.msg_type(), "AR", "{ack:?}");
    let ack_seq: u64 = ack.get(34).and_then(|s| s.parse().ok()).expect("MsgSeqNum");
    drop(first);

    // The same participant again, at MsgSeqNum 3 and without a reset, once the engine has let
    // the first connection go.
    let logon_at = |seq: u64| RawSession::logon_again(&engine, &refdata, &broker, seq);
    let (mut second, answer) = logon_at(3);
    assert_eq!(answer.msg_type(), "A", "{answer:?}");
    let logon_seq: u64 = answer
        .get(34)
        .and_then(|s| s.parse().ok())
        .expect("MsgSeqNum");
    assert!(
        logon_seq > ack_seq,
        "the engine's numbers go on: {answer:?} after {ack:?}"
    );
    assert_eq!(answer.get(141), None, "{answer:?}");

    // The ACK again, as it was, for a ResendRequest of its number.
    let ack_seq_text = ack_seq.to_string();
    second.send(&common::fix_message(
        &broker,
        4,
        &[(35, "2"), (7, &ack_seq_text), (16, &ack_seq_text)],
    ));
    let resent = second.next_answer().expect("the ACK again");
    assert_eq!(resent.get(43), Some("Y"), "{resent:?}");
    assert_eq!(resent.get(122), ack.get(52), "{resent:?}");
    let body = |message: &ste_bridge::fix::FixMessage| -> Vec<(u32, String)> {
        message
            .fields
            .iter()
            .filter(|(tag, _)| !matches!(tag, 34 | 43 | 52 | 122))
            .cloned()
            .collect()
    };
    assert_eq!(body(&resent), body(&ack));
    assert_eq!(resent.get(34), ack.get(34));
    drop(second);

    // A Logon at a number the engine has already had is refused.
    let (_third, answer) = logon_at(2);
    assert_eq!(answer.msg_type(), "5", "{answer:?}");
    assert!(
        answer
            .get(58)
            .is_some_and(|t| t.starts_with("MsgSeqNum too low")),
        "{answer:?}"
    );
    assert!(engine.stop().success());
}

/// With `--fix-reset-at`, a live session is logged out at that time of day, and the next
/// Logon starts both sequence numbers at 1 without ResetSeqNumFlag.
#[test]
fn a_daily_reset_ends_the_session_and_starts_the_numbers_again() {
    let at = time::OffsetDateTime::now_utc() + time::Duration::seconds(8);
    let at = format!("{:02}:{:02}:{:02}", at.hour(), at.minute(), at.second());
    let engine = Engine::start(&["--fix-reset-at", &at]);
    let refdata = refdata();
    let broker = everyone(&refdata)[0].clone();

    let mut session = RawSession::logon(&engine, &refdata, &broker, 30);
    session.send(&common::fix_message(
        &broker,
        2,
        &[(35, "1"), (112, "PING")],
    ));
    let heartbeat = session.next().expect("a Heartbeat");
    assert_eq!(heartbeat.get(112), Some("PING"), "{heartbeat:?}");
    let logout = session.next_answer().expect("a Logout at the reset time");
    assert_eq!(logout.msg_type(), "5", "{logout:?}");
    assert!(
        logout
            .get(58)
            .is_some_and(|t| t.starts_with("E_SESSION_END")),
        "{logout:?}"
    );
    drop(session);

    let (_session, answer) = RawSession::logon_again(&engine, &refdata, &broker, 1);
    assert_eq!(answer.msg_type(), "A", "{answer:?}");
    assert_eq!(
        answer.get(34),
        Some("1"),
        "the engine's numbers start at 1: {answer:?}"
    );
    assert_eq!(answer.get(141), None, "{answer:?}");
    assert!(engine.stop().success());
}
