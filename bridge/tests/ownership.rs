//! The `engine` binary against participants that hold valid keys and act on trades that are not
//! theirs: a custodian that settles another firm's trade, strangers that pre-inject ALCs and
//! SETs into 200 trades to block them (and send ALCs again once the NOEs are in), an attacker
//! that hides the victims' names in the XML it signs to burn their MsgIds, and a chain of AMDs
//! past a trade's bound. Each is refused or released while the victims' own 200 trades
//! match exactly, and a well-behaved participant on another connection completes its trades.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use common::{connect_as, message, refdata, trade_lines, well_behaved, Engine};
use ste_bridge::frame::{Frame, PushClass};
use ste_engine::codec::{encode_msg, parse_fields};
use ste_engine::model::{Function, Msg, MsgType};
use ste_engine::reason::ReasonCode;
use ste_engine::refdata::{RefData, Role};

/// The lines of `trades` clean trades whose TradeRefs and MsgIds carry `tag`, so that they meet
/// no other generated set's.
fn tagged_trades(refdata: &RefData, trades: u64, seed: u64, tag: char) -> Vec<Vec<u8>> {
    trade_lines(refdata, trades, seed)
        .into_iter()
        .map(|line| {
            String::from_utf8(line)
                .expect("UTF-8")
                .replace("<TradeRef>T", &format!("<TradeRef>{tag}"))
                .replace("-000000", &format!("-{tag}00000"))
                .into_bytes()
        })
        .collect()
}

fn msg_of(line: &[u8]) -> Msg {
    let fields = parse_fields(line).expect("a generated line parses");
    ste_engine::validate::typed_fields(&fields).expect("a generated line is well formed")
}

/// The first participant of `role` for which `fits` holds.
fn first_of(refdata: &RefData, role: Role, fits: impl Fn(&str) -> bool) -> String {
    refdata
        .participants()
        .iter()
        .filter(|p| p.role == role)
        .map(|p| p.bic.as_str())
        .find(|bic| fits(bic))
        .expect("a participant that fits")
        .to_owned()
}

/// What one connection heard: the answer to each sequence number (None for an ACK) and the
/// pushes.
#[derive(Default)]
struct Heard {
    answers: BTreeMap<u64, Option<ReasonCode>>,
    cls: Vec<String>,
    advices: Vec<String>,
}

/// Reads `reader` until `done` holds or 60 s pass.
fn listen(
    reader: &mut ste_bridge::client::FrameReader,
    heard: &mut Heard,
    done: impl Fn(&Heard) -> bool,
) {
    reader
        .set_read_timeout(Some(Duration::from_millis(200)))
        .expect("a timeout");
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done(heard) && Instant::now() < deadline {
        match reader.next_frame() {
            Ok(Some(Frame::Ack { seq, .. })) => {
                heard.answers.insert(seq, None);
            }
            Ok(Some(Frame::Nak { seq, code, .. })) => {
                heard.answers.insert(seq, Some(code));
            }
            Ok(Some(Frame::Push { class, xml })) => {
                let xml = String::from_utf8(xml).expect("UTF-8");
                match class {
                    PushClass::Cls => heard.cls.push(xml),
                    PushClass::Advice => heard.advices.push(xml),
                }
            }
            Ok(Some(_)) => {}
            Ok(None) => break,
            Err(error)
                if matches!(
                    error.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(error) => panic!("the connection failed: {error}"),
        }
    }
}

#[test]
fn strangers_with_valid_keys_cannot_settle_block_or_burn_anothers_trades() {
    const TRADES: u64 = 200;
    let engine = Engine::start(&[]);
    let refdata = refdata();
    let good = well_behaved(&engine, &refdata, 20, 601);
    let victims = tagged_trades(&refdata, TRADES, 602, 'V');
    let victim_msgs: Vec<Msg> = victims.iter().map(|l| msg_of(l)).collect();

    // For each trade: a custodian that does not act for its investment manager (the hijacker),
    // another investment manager and a custodian of that one's (the blockers).
    let mut attack: Vec<Vec<u8>> = Vec::new();
    let mut expected: Vec<&str> = Vec::new();
    let mut attackers: BTreeSet<String> = BTreeSet::new();
    // Sent once the trades' NOEs are in: ALCs of the blockers' that can no longer be taken.
    let mut late_alcs: Vec<Vec<u8>> = Vec::new();
    for (n, trade) in victim_msgs.chunks(7).enumerate() {
        let noe = &trade[0];
        let inv_mgr = noe.inv_mgr.clone().expect("InvMgr");
        let hijacker = first_of(&refdata, Role::Custodian, |c| {
            !refdata.acts_for(c, &inv_mgr)
        });
        let blocker = first_of(&refdata, Role::InvMgr, |i| i != inv_mgr);
        let blockers_custodian = refdata
            .custodians_of(&blocker)
            .find(|c| !refdata.acts_for(c, &inv_mgr))
            .expect("a custodian of the blocker's only")
            .to_owned();
        let set = trade
            .iter()
            .rfind(|m| m.msg_type == MsgType::Set)
            .expect("a SET");
        let alc = trade
            .iter()
            .find(|m| m.msg_type == MsgType::Alc)
            .expect("an ALC");
        // The settlement hijack: the trade's last SET, naming the real investment manager and
        // the hijacker as custodian, with its own safekeeping account.
        let hijack = Msg {
            msg_id: format!("{hijacker}-H{n:06}").into(),
            sender: hijacker.clone().into(),
            custodian: Some(hijacker.clone().into()),
            safekeeping_account: Some("ATTACKER-ACCT".to_owned().into()),
            ..set.clone()
        };
        // Pre-injected: an ALC of another investment manager, and an AMD of a SET of its
        // custodian's that never existed, both for the trade's own accounts.
        let blocking_alc = Msg {
            msg_id: format!("{blocker}-A{n:06}").into(),
            sender: blocker.clone().into(),
            inv_mgr: Some(blocker.clone().into()),
            ..alc.clone()
        };
        let blocking_amd = Msg {
            msg_id: format!("{blockers_custodian}-S{n:06}").into(),
            sender: blockers_custodian.clone().into(),
            function: Function::Amd,
            related_id: Some(format!("{blockers_custodian}-NEVER").into()),
            inv_mgr: Some(blocker.clone().into()),
            custodian: Some(blockers_custodian.clone().into()),
            safekeeping_account: Some("ATTACKER-ACCT".to_owned().into()),
            ..set.clone()
        };
        late_alcs.push(
            encode_msg(&Msg {
                msg_id: format!("{blocker}-L{n:06}").into(),
                ..blocking_alc.clone()
            })
            .into_bytes(),
        );
        for (msg, answer) in [
            (hijack, "E_AUTH"),
            (blocking_alc, "ACK"),
            (blocking_amd, "ACK"),
        ] {
            attack.push(encode_msg(&msg).into_bytes());
            expected.push(answer);
            attackers.insert(msg.sender.to_string());
        }
    }

    // Burning MsgIds: the victims' NOEs signed by a blocker, whose own name hides in a comment
    // before the victim's Sender, with a bad Qty that the field check would refuse.
    let burner = attackers
        .iter()
        .find(|bic| {
            refdata
                .participant(bic)
                .is_some_and(|p| p.role == Role::InvMgr)
        })
        .expect("an attacking investment manager")
        .clone();
    let mut burns = Vec::new();
    for noe in victim_msgs.iter().filter(|m| m.msg_type == MsgType::Noe) {
        let line = encode_msg(noe)
            .replace(
                &format!("<Sender>{}</Sender>", noe.sender),
                &format!(
                    "<!--<Sender>{burner}</Sender>--><Sender>{}</Sender>",
                    noe.sender
                ),
            )
            .replace("<Qty>", "<Qty>+");
        burns.push(line.into_bytes());
    }

    let names: Vec<&str> = attackers.iter().map(String::as_str).collect();
    let (mut attacker_writer, mut attacker_reader) = connect_as(&engine, &refdata, &names, true);
    let mut seq = 0_u64;
    for line in &attack {
        attacker_writer
            .send(&message(&refdata, seq, line.clone()))
            .expect("sends");
        seq += 1;
    }
    for line in &burns {
        // Signed by the burner as the frame says, whatever the XML's comment claims.
        let key = refdata.participant_mac(&burner).expect("a key").1;
        attacker_writer
            .send(&Frame::Message {
                seq,
                sender: burner.clone(),
                signature: ste_engine::sign::sign_keyed(key, line),
                xml: line.clone(),
            })
            .expect("sends");
        seq += 1;
    }
    attacker_writer.flush().expect("flushes");
    let mut attackers_heard = Heard::default();
    let sent = seq as usize;
    listen(&mut attacker_reader, &mut attackers_heard, |h| {
        h.answers.len() == sent
    });
    let code_name = |answer: &Option<ReasonCode>| answer.map_or("ACK", |c| c.as_str());
    for (index, want) in expected.iter().enumerate() {
        assert_eq!(
            code_name(&attackers_heard.answers[&(index as u64)]),
            *want,
            "attack message {index}"
        );
    }
    for index in attack.len()..sent {
        let answer = attackers_heard.answers[&(index as u64)];
        assert!(
            matches!(answer, Some(ReasonCode::Sig)),
            "burn {index}: {answer:?}"
        );
    }

    // The victims' own 1,400 messages, from their parties' connection.
    let mut parties: BTreeSet<String> = BTreeSet::new();
    for msg in &victim_msgs {
        parties.insert(msg.sender.to_string());
        parties.extend(msg.custodian.as_deref().map(str::to_owned));
    }
    let names: Vec<&str> = parties.iter().map(String::as_str).collect();
    let (mut writer, mut reader) = connect_as(&engine, &refdata, &names, true);
    let is_noe = |line: &Vec<u8>| String::from_utf8_lossy(line).contains("<Type>NOE</Type>");
    let mut heard = Heard::default();
    // The NOEs first: each names its investment manager, and releases the blockers' messages.
    for (seq, line) in victims.iter().enumerate().filter(|(_, l)| is_noe(l)) {
        writer
            .send(&message(&refdata, seq as u64, line.clone()))
            .expect("sends");
    }
    writer.flush().expect("flushes");
    listen(&mut reader, &mut heard, |h| {
        h.answers.len() == TRADES as usize
    });
    // Now a blocker's ALC is refused outright.
    for line in &late_alcs {
        attacker_writer
            .send(&message(&refdata, seq, line.clone()))
            .expect("sends");
        seq += 1;
    }
    attacker_writer.flush().expect("flushes");
    let sent = seq as usize;
    listen(&mut attacker_reader, &mut attackers_heard, |h| {
        h.answers.len() == sent
    });
    for index in sent - late_alcs.len()..sent {
        assert_eq!(
            attackers_heard.answers[&(index as u64)],
            Some(ReasonCode::Auth),
            "a late ALC of a blocker"
        );
    }
    // Then the rest of the trades.
    for (seq, line) in victims.iter().enumerate().filter(|(_, l)| !is_noe(l)) {
        writer
            .send(&message(&refdata, seq as u64, line.clone()))
            .expect("sends");
    }
    writer.flush().expect("flushes");
    let own: BTreeSet<String> = victim_msgs
        .iter()
        .map(|m| ste_engine::model::cls_id(&m.broker, &m.trade_ref))
        .collect();
    let cls_id = |xml: &str| -> String {
        xml.split_once("<ClsId>")
            .and_then(|(_, rest)| rest.split_once("</ClsId>"))
            .map(|(id, _)| id.to_owned())
            .unwrap_or_default()
    };
    listen(&mut reader, &mut heard, |h| {
        h.answers.len() == victims.len()
            && h.cls.iter().filter(|x| own.contains(&cls_id(x))).count() == TRADES as usize
    });
    assert!(
        heard.answers.values().all(Option::is_none),
        "every victim message accepted: {:?}",
        heard
            .answers
            .iter()
            .filter(|(_, a)| a.is_some())
            .collect::<Vec<_>>()
    );
    let victims_cls: Vec<&String> = heard
        .cls
        .iter()
        .filter(|x| own.contains(&cls_id(x)))
        .collect();
    assert_eq!(
        victims_cls.len(),
        TRADES as usize,
        "one CLS per victim trade"
    );
    for cls in &victims_cls {
        assert!(!cls.contains("ATTACKER-ACCT"), "{cls}");
        // Settled with the custodians the investment manager's own SETs named.
        let fields: Vec<&str> = cls.split("<Custodian>").skip(1).collect();
        for custodian in fields {
            let bic = custodian.split('<').next().unwrap_or_default();
            assert!(!attackers.contains(bic) || parties.contains(bic), "{cls}");
        }
    }

    // The blockers hear their messages released, and no settlement of theirs.
    listen(&mut attacker_reader, &mut attackers_heard, |h| {
        h.advices.len() >= 2 * TRADES as usize
    });
    let released = attackers_heard
        .advices
        .iter()
        .filter(|a| a.contains("<Status>RELEASED</Status>") && a.contains("E_AUTH"))
        .count();
    assert_eq!(released, 2 * TRADES as usize);
    assert!(attackers_heard
        .cls
        .iter()
        .all(|cls| !cls.contains("ATTACKER-ACCT")));

    assert_eq!(good.join().expect("the good participant"), (140, 20));
    assert!(engine.stop().success());
}

#[test]
fn a_chain_of_amds_stops_at_the_trades_bound_while_others_trade() {
    use ste_engine::matcher::TRADE_MESSAGES_MAX;
    let engine = Engine::start(&[]);
    let refdata = refdata();
    let good = well_behaved(&engine, &refdata, 20, 603);
    // An investment manager's own ALC, then AMD after AMD of it, each naming the one before.
    let alc = msg_of(&tagged_trades(&refdata, 1, 604, 'C')[1]);
    let chain = u64::from(TRADE_MESSAGES_MAX) + 100;
    let mut previous = alc.msg_id.clone();
    let mut lines = vec![encode_msg(&alc).into_bytes()];
    for n in 1..chain {
        let amend = Msg {
            msg_id: format!("{}-A{n:05}", alc.sender).into(),
            function: Function::Amd,
            related_id: Some(previous.clone()),
            ..alc.clone()
        };
        previous = amend.msg_id.clone();
        lines.push(encode_msg(&amend).into_bytes());
    }
    let (mut writer, mut reader) = connect_as(&engine, &refdata, &[&alc.sender], false);
    for (seq, line) in lines.iter().enumerate() {
        writer
            .send(&message(&refdata, seq as u64, line.clone()))
            .expect("sends");
    }
    writer.flush().expect("flushes");
    let mut heard = Heard::default();
    listen(&mut reader, &mut heard, |h| h.answers.len() == lines.len());
    let accepted = heard.answers.values().filter(|a| a.is_none()).count();
    let limited = heard
        .answers
        .values()
        .filter(|a| **a == Some(ReasonCode::Limit))
        .count();
    assert_eq!(accepted, TRADE_MESSAGES_MAX as usize);
    assert_eq!(limited, lines.len() - TRADE_MESSAGES_MAX as usize);
    assert_eq!(good.join().expect("the good participant"), (140, 20));
    assert!(engine.stop().success());
}
