//! The `engine` binary against participants with valid keys that try to take more than their
//! share: open trades past their quota, a party flooding its counterparty with advices, refused
//! logons that would rewrite a session file, and ResendRequests that would turn a full store into
//! an endless stream. Each is bounded while a well-behaved participant on another
//! connection completes its trades.

mod common;

use std::time::Duration;

use common::{connect_as, message, refdata, trade_lines, well_behaved, Engine, RawSession};
use ste_bridge::fix;
use ste_bridge::frame::{Frame, PushClass};
use ste_engine::reason::ReasonCode;

/// `line` with the text of its first `<tag>` replaced.
fn with_element(line: &str, tag: &str, value: &str) -> String {
    let open = format!("<{tag}>");
    let start = line.find(&open).expect("the element") + open.len();
    let end = start + line[start..].find('<').expect("its end");
    format!("{}{value}{}", &line[..start], &line[end..])
}

fn element(line: &str, tag: &str) -> String {
    let open = format!("<{tag}>");
    let start = line.find(&open).expect("the element") + open.len();
    let end = start + line[start..].find('<').expect("its end");
    line[start..end].to_owned()
}

#[test]
fn a_broker_opening_trades_without_end_is_stopped_at_its_quota() {
    // A quota of 1 MiB a shard, 2 shards.
    let engine = Engine::start(&["--participant-held-mib", "1"]);
    let refdata = refdata();
    let good = well_behaved(&engine, &refdata, 20, 701);
    let noe = String::from_utf8(trade_lines(&refdata, 1, 702).remove(0)).expect("UTF-8");
    let broker = element(&noe, "Sender");
    let (mut writer, mut reader) = connect_as(&engine, &refdata, &[&broker], false);
    let count = 4_000_u64;
    for n in 0..count {
        let line = with_element(&noe, "TradeRef", &format!("ZQ{n:010}"));
        let line = with_element(&line, "MsgId", &format!("ZQ-{n:010}"));
        writer
            .send(&message(&refdata, n, line.into_bytes()))
            .expect("sends");
    }
    writer.flush().expect("flushes");
    let (mut accepted, mut limited) = (0, 0);
    for _ in 0..count {
        match reader.next_frame().expect("an answer") {
            Some(Frame::Ack { .. }) => accepted += 1,
            Some(Frame::Nak { code, .. }) => {
                assert_eq!(code, ReasonCode::Limit);
                limited += 1;
            }
            other => panic!("{other:?}"),
        }
    }
    // About 1.5 KB a trade it opens: some 1,400 fit in 2 MiB, and the rest are refused.
    assert!((1_000..2_000).contains(&accepted), "{accepted} accepted");
    assert_eq!(accepted + limited, count);
    assert_eq!(good.join().expect("the good participant"), (140, 20));
    assert!(engine.stop().success());
}

#[test]
fn a_party_flipping_between_mismatches_sends_its_counterparty_a_bounded_number_of_advices() {
    let engine = Engine::start(&[]);
    let refdata = refdata();
    let good = well_behaved(&engine, &refdata, 20, 703);
    let lines: Vec<String> = trade_lines(&refdata, 1, 704)
        .into_iter()
        .map(|line| {
            String::from_utf8(line)
                .expect("UTF-8")
                .replace("<TradeRef>T", "<TradeRef>Z")
                .replace("-000000", "-Z00000")
        })
        .collect();
    let broker = element(&lines[0], "Sender");
    let inv_mgr = element(&lines[1], "Sender");
    let (mut broker_writer, mut broker_reader) = connect_as(&engine, &refdata, &[&broker], true);
    let (mut writer, mut reader) = connect_as(&engine, &refdata, &[&inv_mgr], false);
    for (seq, line) in lines
        .iter()
        .filter(|l| element(l, "Sender") == broker)
        .enumerate()
    {
        broker_writer
            .send(&message(&refdata, seq as u64, line.clone().into_bytes()))
            .expect("sends");
    }
    broker_writer.flush().expect("flushes");
    // The investment manager's ALCs and first SET, then its last SET flipped 200 times.
    let set = lines
        .iter()
        .rfind(|l| element(l, "Type") == "SET")
        .expect("a SET")
        .clone();
    let mut sent = 0_u64;
    for line in lines
        .iter()
        .filter(|l| element(l, "Sender") == inv_mgr && **l != set)
    {
        writer
            .send(&message(&refdata, sent, line.clone().into_bytes()))
            .expect("sends");
        sent += 1;
    }
    let mut previous = element(&set, "MsgId");
    for n in 0..200 {
        let bad = if n % 2 == 0 {
            with_element(&set, "SettleAmount", "1.00")
        } else {
            with_element(&set, "PaymentType", "FOP")
        };
        let line = if n == 0 {
            bad
        } else {
            let id = format!("ZF-{n:05}");
            let amend = with_element(&bad, "MsgId", &id)
                .replace("<Function>NEW</Function>", "<Function>AMD</Function>")
                .replace(
                    "<Sender>",
                    &format!("<RelatedId>{previous}</RelatedId><Sender>"),
                );
            previous = id;
            amend
        };
        writer
            .send(&message(&refdata, sent, line.into_bytes()))
            .expect("sends");
        sent += 1;
    }
    writer.flush().expect("flushes");
    for _ in 0..sent {
        assert!(matches!(
            reader.next_frame().expect("an answer"),
            Some(Frame::Ack { .. })
        ));
    }
    broker_reader
        .set_read_timeout(Some(Duration::from_secs(2)))
        .expect("a timeout");
    let mut advices = 0;
    while let Ok(Some(frame)) = broker_reader.next_frame() {
        if let Frame::Push {
            class: PushClass::Advice,
            xml,
        } = frame
        {
            advices += usize::from(String::from_utf8_lossy(&xml).contains("MISMATCHED"));
        }
    }
    assert_eq!(
        advices,
        usize::from(ste_engine::matcher::ADVICES_PER_TRADE_MAX)
    );
    assert_eq!(good.join().expect("the good participant"), (140, 20));
    assert!(engine.stop().success());
}

#[test]
fn refused_logons_leave_the_session_file_alone_and_it_is_its_owners_only() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("a folder");
    let cls = dir.path().join("cls.xml");
    let engine = Engine::start_embedded_with(dir.path(), &cls, &[]);
    let refdata = refdata();
    let good = well_behaved(&engine, &refdata, 20, 705);
    let bic = refdata.participants()[21].bic.clone();
    let key = refdata.participant_mac(&bic).expect("a key").1;
    // A session that ends: its file is written.
    let (mut session, answer) =
        RawSession::send_logon(&engine, &fix::fresh_logon(key, &bic, &fix::utc_timestamp()));
    assert_eq!(answer.msg_type(), "A", "{answer:?}");
    session.send(&fix::encode(&[
        (35, "5".into()),
        (49, bic.clone()),
        (56, "STE".into()),
        (34, "2".into()),
        (52, fix::utc_timestamp()),
    ]));
    assert!(session.next_answer().is_some());
    drop(session);
    let file = dir.path().join("fix-sessions").join(format!("{bic}.json"));
    let written = |file: &std::path::Path| -> Option<std::fs::Metadata> {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(metadata) = std::fs::metadata(file) {
                return Some(metadata);
            }
            if std::time::Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    let metadata = written(&file).expect("the session file");
    assert_eq!(metadata.permissions().mode() & 0o777, 0o600);
    let modified = metadata.modified().expect("a time");
    let content = std::fs::read(&file).expect("reads");
    // Logons below the expected MsgSeqNum, each refused: nothing is written for them.
    for _ in 0..20 {
        let sending_time = fix::utc_timestamp();
        let logon = fix::encode(&[
            (35, "A".into()),
            (49, bic.clone()),
            (56, "STE".into()),
            (34, "1".into()),
            (52, sending_time.clone()),
            (98, "0".into()),
            (108, "30".into()),
            (554, fix::logon_password(key, &sending_time, &bic)),
        ]);
        let (_, answer) = RawSession::send_logon(&engine, &logon);
        assert_eq!(answer.msg_type(), "5", "{answer:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    let metadata = std::fs::metadata(&file).expect("still there");
    assert_eq!(metadata.modified().expect("a time"), modified);
    assert_eq!(std::fs::read(&file).expect("reads"), content);
    assert_eq!(good.join().expect("the good participant"), (140, 20));
    assert!(engine.stop().success());
}

#[test]
fn resend_requests_for_a_full_store_are_paid_from_a_budget() {
    use common::signed_fix_fields;
    let engine = Engine::start(&[]);
    let refdata = refdata();
    let good = well_behaved(&engine, &refdata, 20, 706);
    let noe = String::from_utf8(trade_lines(&refdata, 1, 707).remove(0)).expect("UTF-8");
    let broker = element(&noe, "Sender");
    let key = refdata.participant_mac(&broker).expect("a key").1;
    let (mut session, answer) = RawSession::send_logon(
        &engine,
        &fix::fresh_logon(key, &broker, &fix::utc_timestamp()),
    );
    assert_eq!(answer.msg_type(), "A", "{answer:?}");
    // 6,000 NOEs, each answered: the store keeps every answer (about 4 MiB of it).
    let count = 6_000_u64;
    let mut out = Vec::new();
    for n in 0..count {
        let line = with_element(&noe, "TradeRef", &format!("ZS{n:010}"));
        let line = with_element(&line, "MsgId", &format!("ZS-{n:010}"));
        out.extend(fix::encode(&signed_fix_fields(
            &refdata,
            n + 2,
            line.as_bytes(),
            |_| {},
        )));
    }
    session.send(&out);
    for _ in 0..count {
        let answer = session.next_answer().expect("an answer");
        assert_eq!(answer.msg_type(), "AR", "{answer:?}");
    }
    // Twenty ResendRequests for everything, at once.
    let mut requests = Vec::new();
    for n in 0..20 {
        requests.extend(fix::encode(&[
            (35, "2".into()),
            (49, broker.clone()),
            (56, "STE".into()),
            (34, (count + 2 + n).to_string()),
            (52, fix::utc_timestamp()),
            (7, "1".into()),
            (16, "0".into()),
        ]));
    }
    session.send(&requests);
    session
        .stream
        .set_read_timeout(Some(Duration::from_secs(3)))
        .expect("a timeout");
    let (mut resent, mut busy, mut gap_fills) = (0, 0, 0);
    while let Some(message) = session.next() {
        match message.msg_type() {
            "AR" if message.get(43) == Some("Y") => resent += 1,
            "3" if message.get(58).is_some_and(|t| t.starts_with("E_BUSY")) => busy += 1,
            "4" => gap_fills += 1,
            _ => {}
        }
    }
    // The budget pays for the whole store twice: two requests answered with every answer again
    // (and a GapFill over the Logon answer), the other eighteen refused.
    assert_eq!(busy, 18, "{resent} resent, {gap_fills} gap fills");
    assert_eq!(resent, 2 * count as usize);
    assert_eq!(gap_fills, 2);
    assert_eq!(good.join().expect("the good participant"), (140, 20));
    assert!(engine.stop().success());
}
