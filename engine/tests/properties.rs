//! Property tests of the matching invariants: any arrival order of a trade's messages (with
//! cancels, amends, duplicates and invalid messages) gives the same final outcome, and every
//! valid trade yields exactly one CLS.

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};

use proptest::prelude::*;
use ste_engine::generator::{
    Fault, FinalState, Generator, GeneratorConfig, TradeCase, INVALID_CODES,
};
use ste_engine::matcher::{Disposition, Matcher, TradeStatus};
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
            msg,
            line,
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
