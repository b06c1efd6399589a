//! The `engine` binary over framed XML: full trades with their CLS pushed, hostile input on the
//! listener, and graceful shutdown on SIGTERM.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::{connect_as, everyone, message, refdata, trade_lines, Engine};
use ste_bridge::frame::{Frame, PushClass};
use ste_engine::reason::ReasonCode;
use ste_engine::sign;

/// Reads frames until `done` says so; panics on a closed connection.
fn read_until(
    reader: &mut ste_bridge::client::FrameReader,
    mut done: impl FnMut(&Frame) -> bool,
) -> Vec<Frame> {
    let mut frames = Vec::new();
    loop {
        let frame = reader
            .next_frame()
            .expect("reads")
            .expect("the connection stays open");
        let finished = done(&frame);
        frames.push(frame);
        if finished {
            return frames;
        }
    }
}

fn cls_id(xml: &[u8]) -> String {
    let text = std::str::from_utf8(xml).expect("UTF-8");
    let start = text.find("<ClsId>").expect("a ClsId") + "<ClsId>".len();
    let end = start + text[start..].find("</ClsId>").expect("closed");
    text[start..end].to_owned()
}

#[test]
fn full_trades_over_framed_xml_are_answered_and_their_cls_pushed() {
    let engine = Engine::start(&[]);
    let refdata = refdata();
    let trades = 300;
    let lines = trade_lines(&refdata, trades, 11);
    // A service bureau: one connection logged on as every participant, many messages in flight.
    let bics = everyone(&refdata);
    let bic_refs: Vec<&str> = bics.iter().map(String::as_str).collect();
    let (mut writer, mut reader) = connect_as(&engine, &refdata, &bic_refs, true);
    let messages = lines.len() as u64;
    let sender = std::thread::spawn({
        let refdata = common::refdata();
        move || {
            for (seq, line) in lines.into_iter().enumerate() {
                writer
                    .send(&message(&refdata, seq as u64, line))
                    .expect("sends");
            }
            writer.flush().expect("flushes");
            writer
        }
    });
    let mut answered = BTreeSet::new();
    let mut cls = BTreeSet::new();
    let mut pushes = 0;
    read_until(&mut reader, |frame| {
        match frame {
            Frame::Ack {
                seq,
                duplicate: false,
            } => assert!(answered.insert(*seq), "answered twice: {seq}"),
            Frame::Push {
                class: PushClass::Cls,
                xml,
            } => {
                pushes += 1;
                cls.insert(cls_id(xml));
            }
            other => panic!("unexpected {other:?}"),
        }
        answered.len() as u64 == messages && cls.len() as u64 == trades
    });
    assert_eq!(answered, (0..messages).collect());
    assert_eq!(pushes, trades, "each CLS pushed once to the connection");
    let writer = sender.join().expect("the sender thread");
    writer.bye().expect("bye");
    assert_eq!(
        reader.next_frame().expect("reads"),
        None,
        "closed after bye"
    );
    assert!(engine.stop().success(), "a clean exit on SIGTERM");
}

/// A participant may only send as itself; signatures, DOCTYPEs and sizes are refused with their
/// codes, protocol abuse closes the offending connection, and a well-behaved connection goes on.
#[test]
fn hostile_input_is_refused_and_other_connections_keep_working() {
    let engine = Engine::start(&["--frame-timeout-ms", "500"]);
    let refdata = refdata();
    let lines = trade_lines(&refdata, 2, 5);
    let broker = std::str::from_utf8(&lines[0])
        .ok()
        .and_then(|l| sign::claimed_sender(l.as_bytes()))
        .expect("a sender")
        .to_owned();

    // The well-behaved connection, kept open throughout.
    let bics = everyone(&refdata);
    let bic_refs: Vec<&str> = bics.iter().map(String::as_str).collect();
    let (mut good_writer, mut good_reader) = connect_as(&engine, &refdata, &bic_refs, true);

    // 1. A 10 MiB frame: refused from its length prefix, the connection closed.
    {
        let mut stream = TcpStream::connect(engine.tcp).expect("connects");
        let mut challenge = [0_u8; 21];
        stream.read_exact(&mut challenge).expect("challenge");
        stream
            .write_all(&(10 * 1024 * 1024_u32).to_be_bytes())
            .expect("writes");
        let _ = stream.write_all(&vec![b'M'; 64 * 1024]);
        let frame = Frame::read_from(&mut stream).expect("reads");
        assert!(
            matches!(&frame, Some(Frame::Error { code, .. }) if code == "E_SIZE"),
            "{frame:?}"
        );
    }

    // 2. One connection logged on as the broker only.
    let (mut writer, mut reader) = connect_as(&engine, &refdata, &[broker.as_str()], false);
    let noe = lines[0].clone();
    let mut frames = Vec::new();
    // a. A billion-laughs DOCTYPE, correctly signed: E_PARSE, and no expansion.
    let laughs = format!(
        "<?xml version=\"1.0\"?><!DOCTYPE lolz [<!ENTITY lol \"lol\"><!ENTITY lol2 \"&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;\"><!ENTITY lol3 \"&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;\">]><Msg xmlns=\"urn:ste:trade:1\"><Sender>{broker}</Sender><MsgId>&lol3;</MsgId></Msg>"
    );
    frames.push(message(&refdata, 1, laughs.into_bytes()));
    // b. A forged signature.
    let mut forged = message(&refdata, 2, noe.clone());
    if let Frame::Message { signature, .. } = &mut forged {
        signature[0] ^= 0xff;
    }
    frames.push(forged);
    // c. A message of another participant, correctly signed with that participant's key, sent
    //    on a connection that did not log on as it.
    let other_line = lines
        .iter()
        .find(|line| sign::claimed_sender(line) != Some(broker.as_str()))
        .expect("a message of another participant")
        .clone();
    frames.push(message(&refdata, 3, other_line));
    // d. A message larger than the 64 KiB limit (in a frame under the 1 MiB frame limit).
    let mut big = noe.clone();
    big.splice(big.len() - 6..big.len() - 6, vec![b' '; 70 * 1024]);
    frames.push(message(&refdata, 4, big));
    // e. The genuine NOE goes through.
    frames.push(message(&refdata, 5, noe));
    for frame in &frames {
        writer.send(frame).expect("sends");
    }
    writer.flush().expect("flushes");
    let mut answers = BTreeMap::new();
    read_until(&mut reader, |frame| {
        match frame {
            Frame::Nak { seq, code, .. } => answers.insert(*seq, Some(*code)),
            Frame::Ack { seq, .. } => answers.insert(*seq, None),
            other => panic!("unexpected {other:?}"),
        };
        answers.len() == frames.len()
    });
    assert_eq!(
        answers,
        BTreeMap::from([
            (1, Some(ReasonCode::Parse)),
            (2, Some(ReasonCode::Sig)),
            (3, Some(ReasonCode::Auth)),
            (4, Some(ReasonCode::Size)),
            (5, None),
        ])
    );

    // 3. A logon with a wrong MAC: refused with E_SIG.
    {
        let key = ste_engine::sign::keyed(b"not the broker's key");
        let result = ste_bridge::client::connect(
            engine.tcp,
            &[ste_bridge::client::Logon {
                participant: &broker,
                key: &key,
                subscribe: true,
            }],
        );
        assert!(
            matches!(&result, Err(ste_bridge::client::ClientError::Refused { code, .. }) if code == "E_SIG"),
            "{:?}",
            result.err()
        );
    }

    // 4. A message before any logon: refused with E_AUTH, the connection closed.
    {
        let mut stream = TcpStream::connect(engine.tcp).expect("connects");
        let _ = Frame::read_from(&mut stream).expect("challenge");
        stream
            .write_all(&message(&refdata, 9, lines[1].clone()).encode())
            .expect("writes");
        let frame = Frame::read_from(&mut stream).expect("reads");
        assert!(
            matches!(&frame, Some(Frame::Error { code, .. }) if code == "E_AUTH"),
            "{frame:?}"
        );
        assert_eq!(Frame::read_from(&mut stream).expect("closed"), None);
    }

    // 5. Slowloris: two bytes of a frame, then silence past the frame timeout.
    {
        let mut stream = TcpStream::connect(engine.tcp).expect("connects");
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        let _ = Frame::read_from(&mut stream).expect("challenge");
        stream.write_all(&[0, 0]).expect("writes");
        let frame = Frame::read_from(&mut stream).expect("the engine answers in time");
        assert!(
            matches!(&frame, Some(Frame::Error { code, .. }) if code == "E_TIMEOUT"),
            "{frame:?}"
        );
    }

    // The well-behaved connection completes a whole trade (the second one) with its CLS.
    let second: Vec<Vec<u8>> = trade_lines(&refdata, 2, 5).into_iter().skip(7).collect();
    assert_eq!(second.len(), 7);
    for (seq, line) in second.into_iter().enumerate() {
        good_writer
            .send(&message(&refdata, 100 + seq as u64, line))
            .expect("sends");
    }
    good_writer.flush().expect("flushes");
    let mut acks = 0;
    let mut cls = 0;
    read_until(&mut good_reader, |frame| {
        match frame {
            Frame::Ack {
                duplicate: false, ..
            } => acks += 1,
            Frame::Push {
                class: PushClass::Cls,
                ..
            } => cls += 1,
            other => panic!("unexpected {other:?}"),
        }
        acks == 7 && cls == 1
    });
    assert!(engine.stop().success());
}

/// More connections than allowed are refused with E_BUSY; closing one makes room.
#[test]
fn connections_are_bounded() {
    let engine = Engine::start(&["--max-connections", "2"]);
    let refdata = refdata();
    let bics = everyone(&refdata);
    let first = connect_as(&engine, &refdata, &[bics[0].as_str()], false);
    let second = connect_as(&engine, &refdata, &[bics[1].as_str()], false);
    let third = ste_bridge::client::connect(engine.tcp, &[]);
    assert!(
        matches!(&third, Err(ste_bridge::client::ClientError::Refused { code, .. }) if code == "E_BUSY"),
        "{:?}",
        third.err()
    );
    first.0.bye().expect("bye");
    drop(first.1);
    // The slot frees once the engine has closed the first connection.
    let mut admitted = false;
    for _ in 0..100 {
        if ste_bridge::client::connect(engine.tcp, &[]).is_ok() {
            admitted = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(admitted, "a closed connection frees its slot");
    drop(second);
    assert!(engine.stop().success());
}

/// SIGTERM mid-run: the engine stops reading, commits and answers everything it read, and exits
/// cleanly; after a restart on the same embedded store, re-sending the whole set gives duplicate
/// ACKs for exactly what was acknowledged before, and every trade's CLS is in the CLS stream
/// once. (Pushes are notifications to whoever is connected: a CLS matched while its subscriber
/// was away is not pushed again; the CLS stream is the delivery of record.)
#[test]
fn sigterm_answers_what_is_in_flight_and_a_restart_keeps_it() {
    let dir = tempfile::tempdir().expect("a temporary folder");
    let refdata = refdata();
    let trades = 2000_u64;
    let lines = trade_lines(&refdata, trades, 21);
    let messages = lines.len() as u64;
    let bics = everyone(&refdata);
    let bic_refs: Vec<&str> = bics.iter().map(String::as_str).collect();

    let send_all = |engine: &Engine| {
        let (mut writer, reader) = connect_as(engine, &refdata, &bic_refs, true);
        let lines = lines.clone();
        let sender = std::thread::spawn(move || {
            let refdata = common::refdata();
            for (seq, line) in lines.into_iter().enumerate() {
                if writer.send(&message(&refdata, seq as u64, line)).is_err() {
                    return None;
                }
            }
            writer.flush().ok().map(|()| writer)
        });
        (sender, reader)
    };

    // First life: stopped once 3,000 messages are acknowledged.
    let cls_out = dir.path().join("cls.xml");
    let engine = Engine::start_embedded(dir.path(), &cls_out);
    let (sender, mut reader) = send_all(&engine);
    let mut acked = BTreeSet::new();
    let mut cls = BTreeSet::new();
    let mut terminated = false;
    let mut shutdown_said = false;
    while let Some(frame) = reader.next_frame().expect("reads") {
        match frame {
            Frame::Ack {
                seq,
                duplicate: false,
            } => {
                acked.insert(seq);
            }
            Frame::Push {
                class: PushClass::Cls,
                xml,
            } => {
                cls.insert(cls_id(&xml));
            }
            Frame::Error { code, .. } if code == "E_SHUTDOWN" => shutdown_said = true,
            other => panic!("unexpected {other:?}"),
        }
        if !terminated && acked.len() >= 3000 {
            engine.terminate();
            terminated = true;
        }
    }
    assert!(terminated, "the run got to 3,000 ACKs");
    assert!(shutdown_said, "the engine says why it closes");
    assert!(engine.wait().success(), "a clean exit");
    sender.join().expect("the sender thread");
    assert!(
        (acked.len() as u64) < messages,
        "stopped mid-run: {} of {messages} acknowledged",
        acked.len()
    );

    // Second life on the same store: the whole set again.
    let engine = Engine::start_embedded(dir.path(), &cls_out);
    let (sender, mut reader) = send_all(&engine);
    let mut duplicates = BTreeSet::new();
    let mut accepted = BTreeSet::new();
    while (duplicates.len() + accepted.len()) as u64 != messages {
        match reader
            .next_frame()
            .expect("reads")
            .expect("open until answered")
        {
            Frame::Ack {
                seq,
                duplicate: true,
            } => {
                duplicates.insert(seq);
            }
            Frame::Ack {
                seq,
                duplicate: false,
            } => {
                accepted.insert(seq);
            }
            Frame::Push {
                class: PushClass::Cls,
                xml,
            } => {
                cls.insert(cls_id(&xml));
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    // (Counts first: a failing set comparison would print thousands of numbers.)
    assert_eq!(
        duplicates.len(),
        acked.len(),
        "what was acknowledged was committed"
    );
    assert!(duplicates == acked, "the same messages");
    assert!(accepted.is_disjoint(&acked));
    let writer = sender.join().expect("the sender thread").expect("sent");
    writer.bye().expect("bye");
    while let Some(frame) = reader.next_frame().expect("reads") {
        match frame {
            Frame::Push {
                class: PushClass::Cls,
                xml,
            } => {
                cls.insert(cls_id(&xml));
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert!(engine.stop().success());
    let stream = std::fs::read_to_string(&cls_out).expect("the CLS stream");
    let ids: Vec<String> = stream.lines().map(|line| cls_id(line.as_bytes())).collect();
    let distinct: BTreeSet<&String> = ids.iter().collect();
    assert_eq!(ids.len() as u64, trades, "every CLS once in the stream");
    assert_eq!(distinct.len() as u64, trades);
    assert!(
        cls.iter().all(|id| distinct.contains(id)),
        "what was pushed is in the stream"
    );
}
