//! The documented examples: the standard trade of DESIGN.md's examples parses, matches on all 17
//! criteria, and yields exactly the documented CLS.

use std::sync::Arc;

use ste_engine::codec::{encode_cls, encode_msg, parse_fields};
use ste_engine::matcher::{evaluate_trade, Content, Matcher, TradeStatus};
use ste_engine::model::Msg;
use ste_engine::profile::Tolerances;
use ste_engine::refdata::RefData;
use ste_engine::validate::typed_fields;

/// The seven lines of `examples/standard-trade.xml`.
const STANDARD_TRADE: [&str; 7] = [
    r#"<Msg xmlns="urn:ste:trade:1"><MsgId>BRKAAU21XXX-H0000000001</MsgId><Type>NOE</Type><Function>NEW</Function><Sender>BRKAAU21XXX</Sender><SentAt>2026-03-02T09:30:00.000Z</SentAt><TradeRef>H00000000001</TradeRef><Broker>BRKAAU21XXX</Broker><InvMgr>IMGBSG22XXX</InvMgr><Side>BUY</Side><Isin>SG1A00000013</Isin><TradeDate>2026-08-04</TradeDate><SettleDate>2026-08-07</SettleDate><Market>XSES</Market><Price>47.6582</Price><Ccy>SGD</Ccy><Qty>24073</Qty></Msg>"#,
    r#"<Msg xmlns="urn:ste:trade:1"><MsgId>IMGBSG22XXX-H0000000001</MsgId><Type>ALC</Type><Function>NEW</Function><Sender>IMGBSG22XXX</Sender><SentAt>2026-03-02T09:30:00.000Z</SentAt><TradeRef>H00000000001</TradeRef><Broker>BRKAAU21XXX</Broker><InvMgr>IMGBSG22XXX</InvMgr><Side>BUY</Side><Isin>SG1A00000013</Isin><TradeDate>2026-08-04</TradeDate><SettleDate>2026-08-07</SettleDate><Market>XSES</Market><Price>47.6582</Price><Ccy>SGD</Ccy><AllocCount>2</AllocCount><Account>ACC000000010</Account><Qty>15475</Qty><Pset>CDPLSGSGXXX</Pset><PaymentType>DVP</PaymentType></Msg>"#,
    r#"<Msg xmlns="urn:ste:trade:1"><MsgId>BRKAAU21XXX-H0000000002</MsgId><Type>NPR</Type><Function>NEW</Function><Sender>BRKAAU21XXX</Sender><SentAt>2026-03-02T09:30:00.000Z</SentAt><TradeRef>H00000000001</TradeRef><Broker>BRKAAU21XXX</Broker><InvMgr>IMGBSG22XXX</InvMgr><Side>BUY</Side><Isin>SG1A00000013</Isin><TradeDate>2026-08-04</TradeDate><SettleDate>2026-08-07</SettleDate><Price>47.6582</Price><Ccy>SGD</Ccy><Account>ACC000000010</Account><Qty>15475</Qty><Gross>737510.65</Gross><Commission>737.51</Commission><Fees>3.50</Fees><Net>738251.66</Net></Msg>"#,
    r#"<Msg xmlns="urn:ste:trade:1"><MsgId>IMGBSG22XXX-H0000000002</MsgId><Type>SET</Type><Function>NEW</Function><Sender>IMGBSG22XXX</Sender><SentAt>2026-03-02T09:30:00.000Z</SentAt><TradeRef>H00000000001</TradeRef><Broker>BRKAAU21XXX</Broker><InvMgr>IMGBSG22XXX</InvMgr><Side>BUY</Side><Isin>SG1A00000013</Isin><TradeDate>2026-08-04</TradeDate><SettleDate>2026-08-07</SettleDate><Ccy>SGD</Ccy><Account>ACC000000010</Account><Qty>15475</Qty><Custodian>CUSTSG22XXX</Custodian><SafekeepingAccount>SK000000010</SafekeepingAccount><Pset>CDPLSGSGXXX</Pset><PaymentType>DVP</PaymentType><SettleAmount>738251.66</SettleAmount></Msg>"#,
    r#"<Msg xmlns="urn:ste:trade:1"><MsgId>IMGBSG22XXX-H0000000003</MsgId><Type>ALC</Type><Function>NEW</Function><Sender>IMGBSG22XXX</Sender><SentAt>2026-03-02T09:30:00.000Z</SentAt><TradeRef>H00000000001</TradeRef><Broker>BRKAAU21XXX</Broker><InvMgr>IMGBSG22XXX</InvMgr><Side>BUY</Side><Isin>SG1A00000013</Isin><TradeDate>2026-08-04</TradeDate><SettleDate>2026-08-07</SettleDate><Market>XSES</Market><Price>47.6582</Price><Ccy>SGD</Ccy><AllocCount>2</AllocCount><Account>ACC000000011</Account><Qty>8598</Qty><Pset>CDPLSGSGXXX</Pset><PaymentType>DVP</PaymentType></Msg>"#,
    r#"<Msg xmlns="urn:ste:trade:1"><MsgId>BRKAAU21XXX-H0000000003</MsgId><Type>NPR</Type><Function>NEW</Function><Sender>BRKAAU21XXX</Sender><SentAt>2026-03-02T09:30:00.000Z</SentAt><TradeRef>H00000000001</TradeRef><Broker>BRKAAU21XXX</Broker><InvMgr>IMGBSG22XXX</InvMgr><Side>BUY</Side><Isin>SG1A00000013</Isin><TradeDate>2026-08-04</TradeDate><SettleDate>2026-08-07</SettleDate><Price>47.6582</Price><Ccy>SGD</Ccy><Account>ACC000000011</Account><Qty>8598</Qty><Gross>409765.20</Gross><Commission>409.77</Commission><Fees>3.50</Fees><Net>410178.47</Net></Msg>"#,
    r#"<Msg xmlns="urn:ste:trade:1"><MsgId>IMGBSG22XXX-H0000000004</MsgId><Type>SET</Type><Function>NEW</Function><Sender>IMGBSG22XXX</Sender><SentAt>2026-03-02T09:30:00.000Z</SentAt><TradeRef>H00000000001</TradeRef><Broker>BRKAAU21XXX</Broker><InvMgr>IMGBSG22XXX</InvMgr><Side>BUY</Side><Isin>SG1A00000013</Isin><TradeDate>2026-08-04</TradeDate><SettleDate>2026-08-07</SettleDate><Ccy>SGD</Ccy><Account>ACC000000011</Account><Qty>8598</Qty><Custodian>CUSTSG22XXX</Custodian><SafekeepingAccount>SK000000011</SafekeepingAccount><Pset>CDPLSGSGXXX</Pset><PaymentType>DVP</PaymentType><SettleAmount>410178.47</SettleAmount></Msg>"#,
];

/// `examples/cls.xml`: the CLS of that trade.
const CLS: &str = r#"<Cls xmlns="urn:ste:trade:1"><ClsId>CLS-BRKAAU21XXX-H00000000001</ClsId><TradeRef>H00000000001</TradeRef><Broker>BRKAAU21XXX</Broker><InvMgr>IMGBSG22XXX</InvMgr><Isin>SG1A00000013</Isin><Side>BUY</Side><TradeDate>2026-08-04</TradeDate><SettleDate>2026-08-07</SettleDate><Ccy>SGD</Ccy><Price>47.6582</Price><Qty>24073</Qty><MatchedAt>2026-08-04T10:15:02.417Z</MatchedAt><Settlement><Account>ACC000000010</Account><Qty>15475</Qty><Net>738251.66</Net><Custodian>CUSTSG22XXX</Custodian><SafekeepingAccount>SK000000010</SafekeepingAccount><Pset>CDPLSGSGXXX</Pset><PaymentType>DVP</PaymentType></Settlement><Settlement><Account>ACC000000011</Account><Qty>8598</Qty><Net>410178.47</Net><Custodian>CUSTSG22XXX</Custodian><SafekeepingAccount>SK000000011</SafekeepingAccount><Pset>CDPLSGSGXXX</Pset><PaymentType>DVP</PaymentType></Settlement></Cls>"#;

fn messages() -> Vec<Msg> {
    STANDARD_TRADE
        .iter()
        .map(|line| {
            let fields = parse_fields(line.as_bytes()).expect("the example is well-formed");
            typed_fields(&fields).expect("the example's fields are valid")
        })
        .collect()
}

#[test]
fn the_example_messages_round_trip_through_the_codec() {
    for msg in messages() {
        let line = encode_msg(&msg);
        let fields = parse_fields(line.as_bytes()).expect("our encoding is well-formed");
        assert_eq!(typed_fields(&fields).expect("and valid"), msg);
    }
}

#[test]
fn the_example_trade_matches_on_all_criteria() {
    let refdata = RefData::embedded()
        .expect("reference data loads")
        .with_generated_keys();
    let messages = messages();
    let live: Vec<&Msg> = messages.iter().collect();
    assert_eq!(
        evaluate_trade(&live, &refdata, &Tolerances::default()),
        Some(vec![])
    );
}

#[test]
fn the_example_trade_yields_the_documented_cls() {
    let refdata = Arc::new(
        RefData::embedded()
            .expect("reference data loads")
            .with_generated_keys(),
    );
    let mut matcher = Matcher::new(refdata, Tolerances::default());
    let mut emitted = Vec::new();
    for (line, msg) in STANDARD_TRADE.iter().zip(messages()) {
        let outcome = matcher.process(
            Box::new(msg),
            Content::of(line.as_bytes()),
            0,
            "2026-08-04T10:15:02.417Z",
            time::macros::date!(2026 - 08 - 04),
        );
        emitted.extend(outcome.cls);
    }
    assert_eq!(emitted.len(), 1);
    assert_eq!(encode_cls(&emitted[0]), CLS);
    assert_eq!(
        matcher.status_of("BRKAAU21XXX/H00000000001"),
        Some(TradeStatus::Matched)
    );
}
