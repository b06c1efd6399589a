//! Property tests of the matching invariants: any arrival order of a trade's messages (with
//! cancels, amends, duplicates and invalid messages) gives the same final outcome, and every
//! valid trade yields exactly one CLS.

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};

use proptest::prelude::*;
use ste_engine::generator::{
    Fault, FinalState, Generator, GeneratorConfig, TradeCase, INVALID_CODES,
};
use ste_engine::matcher::{Content, Disposition, Matcher, TradeStatus};
use ste_engine::pipeline::sign_line;
use ste_engine::profile::Tolerances;
use ste_engine::refdata::RefData;
use ste_engine::validate::validate;

fn refdata() -> Arc<RefData> {
    static REFDATA: OnceLock<Arc<RefData>> = OnceLock::new();
    REFDATA
        .get_or_init(|| {
            Arc::new(
                RefData::embedded()
                    .expect("reference data loads")
                    .with_generated_keys(),
            )
        })
        .clone()
}

/// What one arrival order produced.
#[derive(Debug, PartialEq, Eq)]
struct Observed {
    accepted: u64,
    duplicates: u64,
    exceptions: BTreeMap<String, u64>,
    cls: u64,
    status: Option<TradeStatus>,
}

/// Runs lines through the validator and one matcher, as the pipeline does for one trade.
fn run_lines(lines: &[Vec<u8>], trade_key: &str) -> Observed {
    let refdata = refdata();
    let mut matcher = Matcher::new(refdata.clone(), Tolerances::default());
    let mut observed = Observed {
        accepted: 0,
        duplicates: 0,
        exceptions: BTreeMap::new(),
        cls: 0,
        status: None,
    };
    for line in lines {
        let envelope = sign_line(&refdata, line.clone(), 0, 0);
        let validated = validate(
            &refdata,
            &envelope.bytes,
            envelope.sender.as_deref(),
            envelope.signature.as_ref().map(|s| s.as_slice()),
        );
        let msg = match validated {
            Ok(msg) => msg,
            Err(rejection) => {
                *observed
                    .exceptions
                    .entry(rejection.code.as_str().to_owned())
                    .or_default() += 1;
                continue;
            }
        };
        let outcome = matcher.process(
            Box::new(msg),
            Content::of(line),
            0,
            "2026-08-04T10:00:00.000Z",
            time::macros::date!(2026 - 08 - 04),
        );
        match outcome.disposition {
            Disposition::Accepted => observed.accepted += 1,
            Disposition::Duplicate => observed.duplicates += 1,
            Disposition::Rejected(rejection) => {
                *observed
                    .exceptions
                    .entry(rejection.code.as_str().to_owned())
                    .or_default() += 1;
            }
        }
        observed.cls += u64::from(outcome.cls.is_some());
    }
    observed.status = matcher.status_of(trade_key);
    observed
}

fn expected_of(case: &TradeCase) -> Observed {
    Observed {
        accepted: case.expected.accepted,
        duplicates: case.expected.duplicates,
        exceptions: case.expected.exceptions.clone(),
        cls: case.expected.cls,
        status: Some(match case.final_state {
            FinalState::Matched => TradeStatus::Matched,
            FinalState::Mismatched => TradeStatus::Mismatched,
            FinalState::Pending => TradeStatus::Pending,
            FinalState::Cancelled => TradeStatus::Cancelled,
        }),
    }
}

/// Faults whose outcome must not depend on arrival order.
fn order_independent_fault() -> impl Strategy<Value = Option<Fault>> {
    let invalid = (0..INVALID_CODES.len(), any::<bool>()).prop_map(|(index, corrected)| {
        Some(Fault::Invalid {
            code: INVALID_CODES[index],
            corrected,
        })
    });
    prop_oneof![
        Just(None),
        invalid,
        Just(Some(Fault::MismatchAmended)),
        Just(Some(Fault::MismatchLeft)),
        Just(Some(Fault::WithinTolerance)),
        Just(Some(Fault::Duplicate)),
        Just(Some(Fault::DupId)),
        Just(Some(Fault::CancelAll)),
        Just(Some(Fault::Missing)),
    ]
}

fn case(index: u64, fault: Option<Fault>) -> TradeCase {
    let refdata = refdata();
    let mut generator = Generator::new(&refdata, GeneratorConfig::clean(1));
    generator.build_trade(index, fault)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn any_arrival_order_gives_the_same_outcome(
        (index, fault, order) in (0_u64..500, order_independent_fault())
            .prop_flat_map(|(index, fault)| {
                let lines = case(index, fault).lines.len();
                (Just(index), Just(fault), Just((0..lines).collect::<Vec<usize>>()).prop_shuffle())
            })
    ) {
        let case = case(index, fault);
        prop_assert!(case.order_independent);
        let permuted: Vec<Vec<u8>> = order.iter().map(|i| case.lines[*i].clone()).collect();
        let in_order = run_lines(&case.lines, &case.trade_key);
        let shuffled = run_lines(&permuted, &case.trade_key);
        prop_assert_eq!(&in_order, &expected_of(&case), "fault {:?} in generated order", fault);
        prop_assert_eq!(&shuffled, &expected_of(&case), "fault {:?} in order {:?}", fault, order);
    }

    #[test]
    fn every_valid_trade_yields_exactly_one_cls(
        (index, order) in (0_u64..10_000).prop_flat_map(|index| {
            (Just(index), Just((0..7_usize).collect::<Vec<usize>>()).prop_shuffle())
        }),
        resend in any::<bool>(),
    ) {
        let case = case(index, None);
        let mut lines: Vec<Vec<u8>> = order.iter().map(|i| case.lines[*i].clone()).collect();
        if resend {
            // Every message again: duplicates must not produce a second CLS.
            lines.extend(case.lines.clone());
        }
        let observed = run_lines(&lines, &case.trade_key);
        prop_assert_eq!(observed.cls, 1);
        prop_assert_eq!(observed.status, Some(TradeStatus::Matched));
        prop_assert_eq!(observed.duplicates, if resend { 7 } else { 0 });
    }
}

#[test]
fn order_dependent_faults_give_their_outcome_in_generated_order() {
    for fault in [Fault::Closed, Fault::Conflict] {
        for index in 0..20 {
            let case = case(index, Some(fault));
            assert_eq!(
                run_lines(&case.lines, &case.trade_key),
                expected_of(&case),
                "{fault:?}"
            );
        }
    }
}

/// What the parties of a trade got: each of their messages' answers, in their order, the CLS
/// bodies and the trade's final status.
#[derive(Debug, PartialEq, Eq)]
struct PartiesOutcome {
    answers: Vec<String>,
    cls: Vec<String>,
    status: Option<TradeStatus>,
}

/// Runs lines (each marked whether a party of the trade sent it) through the validator and one
/// matcher, and keeps what the parties got.
fn run_marked(lines: &[(bool, Vec<u8>)], trade_key: &str) -> PartiesOutcome {
    let refdata = refdata();
    let mut matcher = Matcher::new(refdata.clone(), Tolerances::default());
    let mut outcome = PartiesOutcome {
        answers: Vec::new(),
        cls: Vec::new(),
        status: None,
    };
    for (party, line) in lines {
        let envelope = sign_line(&refdata, line.clone(), 0, 0);
        let answer = match validate(
            &refdata,
            &envelope.bytes,
            envelope.sender.as_deref(),
            envelope.signature.as_ref().map(|s| s.as_slice()),
        ) {
            Err(rejection) => rejection.code.as_str().to_owned(),
            Ok(msg) => {
                let processed = matcher.process(
                    Box::new(msg),
                    Content::of(line),
                    0,
                    "2026-08-04T10:00:00.000Z",
                    time::macros::date!(2026 - 08 - 04),
                );
                if let Some(cls) = &processed.cls {
                    outcome.cls.push(ste_engine::codec::encode_cls(cls));
                }
                // A stranger's message is never released for a party's.
                for released in &processed.released {
                    assert!(
                        lines
                            .iter()
                            .filter(|(party, _)| !party)
                            .any(|(_, l)| String::from_utf8_lossy(l)
                                .contains(&format!("<MsgId>{}</MsgId>", released.msg_id))),
                        "a party's message was released: {released:?}"
                    );
                }
                match processed.disposition {
                    Disposition::Accepted => "ACCEPTED".to_owned(),
                    Disposition::Duplicate => "DUPLICATE".to_owned(),
                    Disposition::Rejected(rejection) => rejection.code.as_str().to_owned(),
                }
            }
        };
        if *party {
            outcome.answers.push(answer);
        }
    }
    outcome.status = matcher.status_of(trade_key);
    outcome
}

/// A message of a non-party for the trade of `template` (one of the trade's messages): another
/// investment manager's ALC or SET naming itself, a custodian of another investment manager,
/// a custodian or broker naming the real parties, or a CAN or AMD of a message of its own,
/// with random fields.
fn stranger_line(
    template: &ste_engine::model::Msg,
    choice: (u8, u8, u16, u64, bool),
    n: usize,
) -> Vec<u8> {
    use ste_engine::model::{Function, MsgType};
    use ste_engine::refdata::Role;
    let refdata = refdata();
    let (who, kind, pick, qty, same_account) = choice;
    let real_inv_mgr = template.inv_mgr.clone().unwrap_or_default();
    let of_role = |role: Role| -> Vec<String> {
        refdata
            .participants()
            .iter()
            .filter(|p| p.role == role)
            .map(|p| p.bic.clone())
            .collect()
    };
    let inv_mgrs: Vec<String> = of_role(Role::InvMgr)
        .into_iter()
        .filter(|bic| *bic != real_inv_mgr)
        .collect();
    let other_inv_mgr = inv_mgrs[pick as usize % inv_mgrs.len()].clone();
    let strangers_custodians: Vec<String> = of_role(Role::Custodian)
        .into_iter()
        .filter(|bic| !refdata.acts_for(bic, &real_inv_mgr))
        .collect();
    let brokers: Vec<String> = of_role(Role::Broker)
        .into_iter()
        .filter(|bic| *bic != template.broker)
        .collect();
    let mut msg = template.clone();
    msg.msg_type = if kind % 2 == 0 {
        MsgType::Alc
    } else {
        MsgType::Set
    };
    msg.function = match kind / 2 % 3 {
        0 => Function::New,
        1 => Function::Amd,
        _ => Function::Can,
    };
    let custodian_of = |inv_mgr: &str| {
        let custodians: Vec<&str> = refdata
            .custodians_of(inv_mgr)
            .filter(|c| !refdata.acts_for(c, &real_inv_mgr))
            .collect();
        custodians
            .get(pick as usize % custodians.len().max(1))
            .map(|c| (*c).to_owned())
    };
    match who % 4 {
        // Another investment manager, naming itself.
        0 => {
            msg.sender = other_inv_mgr.clone().into();
            msg.inv_mgr = Some(other_inv_mgr.clone().into());
        }
        // A custodian of another investment manager, for it.
        1 => {
            let Some(custodian) = custodian_of(&other_inv_mgr) else {
                return b"<Msg/>".to_vec();
            };
            msg.msg_type = MsgType::Set;
            msg.sender = custodian.clone().into();
            msg.inv_mgr = Some(other_inv_mgr.clone().into());
            msg.custodian = Some(custodian.into());
        }
        // A custodian that does not act for the trade's investment manager, naming it.
        2 => {
            let custodian =
                strangers_custodians[pick as usize % strangers_custodians.len()].clone();
            msg.msg_type = MsgType::Set;
            msg.sender = custodian.clone().into();
            msg.custodian = Some(custodian.into());
        }
        // Another broker, under the trade's key.
        _ => {
            msg.sender = brokers[pick as usize % brokers.len()].clone().into();
        }
    }
    // Fields of the right type, random where a slot or an amount is decided.
    let account = if same_account {
        template.account.clone()
    } else {
        Some(format!("ZZ{qty:09}").into())
    };
    if msg.msg_type == MsgType::Alc {
        msg.market = template.market.clone().or(Some("XLON".into()));
        msg.price = template.price;
        msg.alloc_count = Some(2);
        msg.custodian = None;
        msg.safekeeping_account = None;
        msg.settle_amount = None;
    } else {
        msg.market = None;
        msg.price = None;
        msg.alloc_count = None;
        if msg.custodian.is_none() {
            msg.custodian =
                custodian_of(msg.inv_mgr.as_deref().unwrap_or_default()).map(Into::into);
        }
        msg.safekeeping_account = Some("ATTACKER-ACCT".into());
        msg.settle_amount = template.net.or(Some(ste_engine::model::Decimal(1)));
    }
    msg.gross = None;
    msg.commission = None;
    msg.fees = None;
    msg.net = None;
    msg.account = account;
    msg.pset = template.pset.clone().or(Some("CRSTGB22XXX".into()));
    msg.payment_type = Some(ste_engine::model::PaymentType::Dvp);
    msg.qty = Some(1 + qty % 100_000);
    msg.msg_id = format!("{}-X{n:04}", msg.sender).into();
    if msg.function != Function::New {
        msg.related_id = Some(format!("{}-X{:04}", msg.sender, (n + 1) % 7).into());
    }
    if msg.function == Function::Can {
        let mut fields = ste_engine::codec::fields_of(&msg);
        fields.keep_only(&ste_engine::validate::CAN_FIELDS);
        return ste_engine::codec::encode_fields(&fields).into_bytes();
    }
    ste_engine::codec::encode_msg(&msg).into_bytes()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn strangers_never_change_what_the_parties_get(
        (index, fault, order) in (0_u64..500, order_independent_fault())
            .prop_flat_map(|(index, fault)| {
                let lines = case(index, fault).lines.len();
                (Just(index), Just(fault), Just((0..lines).collect::<Vec<usize>>()).prop_shuffle())
            }),
        strangers in proptest::collection::vec(
            (any::<u8>(), any::<u8>(), any::<u16>(), any::<u64>(), any::<bool>(), any::<prop::sample::Index>()),
            1..12,
        ),
    ) {
        let case = case(index, fault);
        let messages = {
            let refdata = refdata();
            let mut generator = Generator::new(&refdata, GeneratorConfig::clean(1));
            generator.standard_trade(index)
        };
        let parties: Vec<(bool, Vec<u8>)> =
            order.iter().map(|i| (true, case.lines[*i].clone())).collect();
        let mut mixed = parties.clone();
        for (n, (who, kind, pick, qty, same_account, at)) in strangers.into_iter().enumerate() {
            let template = &messages[usize::from(kind) % messages.len()];
            let line = stranger_line(template, (who, kind, pick, qty, same_account), n);
            mixed.insert(at.index(mixed.len() + 1), (false, line));
        }
        let alone = run_marked(&parties, &case.trade_key);
        let among_strangers = run_marked(&mixed, &case.trade_key);
        prop_assert_eq!(&among_strangers, &alone, "fault {:?}", fault);
    }
}
