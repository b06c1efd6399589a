//! Data-driven tables: every reason code of DESIGN.md section 3 and every matching criterion
//! C01–C17, each with passing and failing cases, including the tolerance edges.

use std::sync::{Arc, OnceLock};

use ste_engine::codec::encode_msg;
use ste_engine::generator::{Generator, GeneratorConfig};
use ste_engine::matcher::{evaluate_trade, Content, Disposition, Matcher, TradeStatus};
use ste_engine::model::{Decimal, Function, Msg, MsgType, PaymentType, Side};
use ste_engine::pipeline::sign_line;
use ste_engine::profile::Tolerances;
use ste_engine::reason::{Criterion, ReasonCode, Rejection};
use ste_engine::refdata::generate::csd_of_market;
use ste_engine::refdata::{RefData, Role};
use ste_engine::sign;
use ste_engine::validate::validate;
use time::Duration;

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

fn d(text: &str) -> Decimal {
    Decimal::parse(text).expect("valid decimal")
}

/// A clean standard trade on a London security, with known amounts: price 50, allocations of
/// `first` and `second` shares (so gross = 50 × quantity).
fn london_trade(first: u64, second: u64) -> Vec<Msg> {
    let refdata = refdata();
    let security = refdata
        .securities()
        .iter()
        .find(|s| s.market == "XLON")
        .expect("a London security")
        .clone();
    let mut messages = Generator::new(&refdata, GeneratorConfig::clean(1)).standard_trade(0);
    let trade_date = ste_engine::model::parse_date("2026-08-04").expect("date");
    let settle_date = ste_engine::model::parse_date("2026-08-06").expect("date");
    let price = d("50");
    for msg in &mut messages {
        msg.isin = Some(security.isin.clone().into());
        msg.ccy = Some("GBP".into());
        msg.side = Some(Side::Buy);
        msg.trade_date = Some(trade_date);
        msg.settle_date = Some(settle_date);
        if msg.market.is_some() {
            msg.market = Some("XLON".into());
        }
        if msg.pset.is_some() {
            msg.pset = csd_of_market("XLON").map(Into::into);
        }
        if msg.price.is_some() {
            msg.price = Some(price);
        }
    }
    messages[0].qty = Some(first + second);
    for (allocation, qty) in [(0, first), (1, second)] {
        let base = 1 + 3 * allocation;
        let gross = price.times_quantity(qty);
        let commission = d("10.00");
        let fees = d("3.50");
        let net = gross + commission + fees;
        messages[base].qty = Some(qty);
        let npr = &mut messages[base + 1];
        npr.qty = Some(qty);
        npr.gross = Some(gross);
        npr.commission = Some(commission);
        npr.fees = Some(fees);
        npr.net = Some(net);
        let set = &mut messages[base + 2];
        set.qty = Some(qty);
        set.settle_amount = Some(net);
    }
    messages
}

fn failed(messages: &[Msg]) -> Option<Vec<Criterion>> {
    let live: Vec<&Msg> = messages.iter().collect();
    evaluate_trade(&live, &refdata(), &Tolerances::default())
}

type Mutation = fn(&mut [Msg]);
/// (name, allocation quantities, mutation, failed criteria); an empty list is a passing case.
type CriterionCase = (&'static str, (u64, u64), Mutation, Vec<Criterion>);

#[test]
fn the_clean_trade_matches() {
    assert_eq!(failed(&london_trade(600, 400)), Some(vec![]));
}

#[test]
fn every_criterion_passes_and_fails() {
    use Criterion::*;
    let cases: Vec<CriterionCase> = vec![
        ("C01 pass", (600, 400), |_| {}, vec![]),
        (
            "C04 pass: a SELL everywhere with SELL nets",
            (600, 400),
            sell_everywhere,
            vec![],
        ),
        (
            "C10 pass: every message in EUR",
            (600, 400),
            |m| m.iter_mut().for_each(|msg| msg.ccy = Some("EUR".into())),
            vec![],
        ),
        (
            "C11 and C13 pass: another split of the block",
            (999, 1),
            |_| {},
            vec![],
        ),
        (
            "C12 pass: messages in another order",
            (600, 400),
            |m| m.reverse(),
            vec![],
        ),
        (
            "C16 pass: free of payment on both ALC and SET",
            (600, 400),
            |m| {
                m[1].payment_type = Some(PaymentType::Fop);
                m[3].payment_type = Some(PaymentType::Fop);
            },
            vec![],
        ),
        (
            "C01 fail: a TradeRef differs",
            (600, 400),
            |m| m[3].trade_ref.push('X'),
            vec![C01],
        ),
        (
            "C02 fail: a Broker differs",
            (600, 400),
            |m| m[3].broker = "BAAAFR25XXX".into(),
            vec![C02],
        ),
        (
            "C03 fail: an InvMgr differs",
            (600, 400),
            |m| m[3].inv_mgr = Some("IMGBSG22XXX".into()),
            vec![C03],
        ),
        (
            "C04 fail: a Side differs",
            (600, 400),
            |m| m[3].side = Some(Side::Sell),
            vec![C04],
        ),
        (
            "C05 fail: an Isin differs",
            (600, 400),
            |m| m[3].isin = Some("US0378331005".into()),
            vec![C05],
        ),
        (
            "C06 fail: a TradeDate differs",
            (600, 400),
            |m| m[3].trade_date = m[3].trade_date.map(|t| t + Duration::days(1)),
            vec![C06],
        ),
        (
            "C07 fail: a SettleDate differs",
            (600, 400),
            |m| m[3].settle_date = m[3].settle_date.map(|t| t + Duration::days(1)),
            vec![C07],
        ),
        (
            "C08 fail: an ALC Market differs",
            (600, 400),
            |m| m[1].market = Some("XPAR".into()),
            vec![C08],
        ),
        (
            "C09 fail: an ALC Price differs in the 6th digit",
            (600, 400),
            |m| m[1].price = Some(d("50.000001")),
            vec![C09],
        ),
        (
            "C10 fail: a SET Ccy differs",
            (600, 400),
            |m| m[3].ccy = Some("EUR".into()),
            vec![C10],
        ),
        (
            "C11 fail: AllocCounts differ",
            (600, 400),
            |m| m[1].alloc_count = Some(3),
            vec![C11],
        ),
        (
            "C11 fail: allocations do not add up to the block",
            (600, 400),
            |m| m[0].qty = Some(1001),
            vec![C11],
        ),
        (
            "C12 fail: a SET names another account",
            (600, 400),
            |m| m[3].account = Some("ACC999".into()),
            vec![C12],
        ),
        (
            "C13 fail: a SET quantity differs",
            (600, 400),
            |m| m[3].qty = Some(601),
            vec![C13],
        ),
        (
            "C14 pass: gross off by exactly 2.00",
            (600, 400),
            |m| shift_gross(m, "2.00"),
            vec![],
        ),
        (
            "C14 fail: gross off by 2.01",
            (600, 400),
            |m| shift_gross(m, "2.01"),
            vec![C14],
        ),
        (
            "C14 pass above 100,000: off by 25.00",
            (3000, 400),
            |m| shift_gross(m, "25.00"),
            vec![],
        ),
        (
            "C14 fail above 100,000: off by 25.01",
            (3000, 400),
            |m| shift_gross(m, "25.01"),
            vec![C14],
        ),
        (
            "C15 pass: net off by exactly 2.00",
            (600, 400),
            |m| shift_net(m, "2.00"),
            vec![],
        ),
        (
            "C15 fail: net off by 2.01",
            (600, 400),
            |m| shift_net(m, "2.01"),
            vec![C15],
        ),
        (
            "C15 fail: a SELL adds commission instead of subtracting",
            (600, 400),
            |m| sell_with_buy_net(m),
            vec![C15],
        ),
        (
            "C16 fail: Pset differs",
            (600, 400),
            |m| m[3].pset = Some("DTCYUS33XXX".into()),
            vec![C16],
        ),
        (
            "C16 fail: PaymentType differs",
            (600, 400),
            |m| m[3].payment_type = Some(PaymentType::Fop),
            vec![C16],
        ),
        (
            "C17 pass: settlement amount off by 2.00",
            (600, 400),
            |m| shift_settle(m, "2.00"),
            vec![],
        ),
        (
            "C17 fail: settlement amount off by 2.01",
            (600, 400),
            |m| shift_settle(m, "2.01"),
            vec![C17],
        ),
        (
            "C17 pass above 100,000: off by 25.00",
            (3000, 400),
            |m| shift_settle(m, "25.00"),
            vec![],
        ),
        (
            "C17 fail above 100,000: off by 25.01",
            (3000, 400),
            |m| shift_settle(m, "25.01"),
            vec![C17],
        ),
    ];
    for (name, (first, second), mutate, expected) in cases {
        let mut messages = london_trade(first, second);
        mutate(&mut messages);
        assert_eq!(failed(&messages), Some(expected), "{name}");
    }
}

/// Moves NPR 1's gross by `delta`, keeping net and settlement amount consistent with it so that
/// only C14 can notice.
fn shift_gross(messages: &mut [Msg], delta: &str) {
    let delta = d(delta);
    let npr = &mut messages[2];
    npr.gross = npr.gross.map(|v| v + delta);
    npr.net = npr.net.map(|v| v + delta);
    messages[3].settle_amount = messages[3].settle_amount.map(|v| v + delta);
}

/// Moves NPR 1's net (and the matching SET amount) by `delta`: only C15 can notice.
fn shift_net(messages: &mut [Msg], delta: &str) {
    let delta = d(delta);
    messages[2].net = messages[2].net.map(|v| v + delta);
    messages[3].settle_amount = messages[3].settle_amount.map(|v| v + delta);
}

/// Moves SET 1's amount by `delta`: only C17 can notice.
fn shift_settle(messages: &mut [Msg], delta: &str) {
    messages[3].settle_amount = messages[3].settle_amount.map(|v| v + d(delta));
}

/// Makes the trade a SELL everywhere, with nets and settlement amounts computed for a SELL.
fn sell_everywhere(messages: &mut [Msg]) {
    for msg in messages.iter_mut() {
        msg.side = Some(Side::Sell);
    }
    for allocation in 0..2 {
        let npr = &mut messages[2 + 3 * allocation];
        let net = npr.gross.unwrap_or_default()
            - npr.commission.unwrap_or_default()
            - npr.fees.unwrap_or_default();
        npr.net = Some(net);
        messages[3 + 3 * allocation].settle_amount = Some(net);
    }
}

/// Makes the trade a SELL everywhere but leaves the NPR nets computed as for a BUY.
fn sell_with_buy_net(messages: &mut [Msg]) {
    for msg in messages.iter_mut() {
        msg.side = Some(Side::Sell);
    }
}

#[test]
fn an_incomplete_trade_is_not_evaluated() {
    let messages = london_trade(600, 400);
    let live: Vec<&Msg> = messages[..6].iter().collect();
    assert_eq!(
        evaluate_trade(&live, &refdata(), &Tolerances::default()),
        None
    );
}

// ---------------------------------------------------------------------------------------------
// Validation: every reason code from E_SIZE to E_DATE, passing and failing.

/// Signs `text` as its claimed sender would, and validates it.
fn validate_signed(text: &str) -> Result<Msg, Rejection> {
    let refdata = refdata();
    let envelope = sign_line(&refdata, text.as_bytes().to_vec(), 0, 0);
    validate(
        &refdata,
        &envelope.bytes,
        envelope.sender.as_deref(),
        envelope.signature.as_ref().map(|s| s.as_slice()),
    )
}

/// [`validate_signed`]'s reason code.
fn validate_text(text: &str) -> Result<Msg, ReasonCode> {
    validate_signed(text).map_err(|rejection| rejection.code)
}

fn line_of(messages: &[Msg], index: usize) -> String {
    encode_msg(&messages[index])
}

type TextMutation = Box<dyn Fn(&[Msg]) -> String>;

fn with(index: usize, change: impl Fn(&mut Msg) + 'static) -> TextMutation {
    Box::new(move |messages: &[Msg]| {
        let mut msg = messages[index].clone();
        change(&mut msg);
        encode_msg(&msg)
    })
}

fn text(index: usize, change: impl Fn(String) -> String + 'static) -> TextMutation {
    Box::new(move |messages: &[Msg]| change(line_of(messages, index)))
}

#[test]
fn every_validation_code_passes_and_fails() {
    let refdata = refdata();
    let a_broker = refdata
        .participants()
        .iter()
        .find(|p| p.role == Role::Broker)
        .map(|p| p.bic.clone())
        .expect("a broker");
    let messages = london_trade(600, 400);
    let inv_mgr = messages[3].inv_mgr.clone().expect("a SET names its InvMgr");
    let named = messages[3]
        .custodian
        .clone()
        .expect("a SET names its custodian");
    // Another custodian that acts for the trade's investment manager, and one that does not.
    let a_custodian = refdata
        .custodians_of(&inv_mgr)
        .find(|c| *c != named)
        .map(str::to_owned)
        .expect("custodians.csv gives each investment manager several custodians");
    let stranger = refdata
        .participants()
        .iter()
        .filter(|p| p.role == Role::Custodian)
        .find(|p| !refdata.acts_for(&p.bic, &inv_mgr))
        .map(|p| p.bic.clone())
        .expect("a custodian that does not act for it");
    let broker_for_party = a_broker.clone();
    let custodian_for_auth = a_custodian.clone();
    let custodian_for_pass = a_custodian.clone();
    let stranger_named = stranger.clone();
    let stranger_sends = stranger.clone();
    let ok: Result<(), ReasonCode> = Ok(());
    use ReasonCode::*;
    let cases: Vec<(&str, TextMutation, Result<(), ReasonCode>)> = vec![
        ("clean NOE", text(0, |t| t), ok),
        ("clean ALC", text(1, |t| t), ok),
        ("clean NPR", text(2, |t| t), ok),
        ("clean SET", text(3, |t| t), ok),
        (
            "E_SIZE pass: 60 KiB with a comment",
            text(0, |t| {
                t.replace("</Msg>", &format!("<!--{}--></Msg>", "x".repeat(60 * 1024)))
            }),
            ok,
        ),
        (
            "E_SIZE fail: 64 KiB + 1",
            text(0, |t| {
                t.replace("</Msg>", &format!("<!--{}--></Msg>", "x".repeat(64 * 1024)))
            }),
            Err(Size),
        ),
        (
            "E_SIG fail: unknown sender",
            with(0, |m| m.sender = "ZZZZSG21XXX".into()),
            Err(Sig),
        ),
        (
            "E_SIG fail: no Sender element",
            text(0, |t| remove_element(&t, "Sender")),
            Err(Sig),
        ),
        (
            "E_PARSE fail: truncated",
            text(0, |t| t[..t.len() - 3].to_owned()),
            Err(Parse),
        ),
        (
            "E_PARSE fail: DOCTYPE",
            text(0, |t| format!("<!DOCTYPE Msg [<!ENTITY x \"y\">]>{t}")),
            Err(Parse),
        ),
        (
            "E_PARSE fail: undeclared entity",
            text(0, |t| t.replace("<Qty>", "<Qty>&x;")),
            Err(Parse),
        ),
        (
            "E_PARSE fail: wrong namespace",
            text(0, |t| t.replace("urn:ste:trade:1", "urn:ste:trade:2")),
            Err(Parse),
        ),
        (
            "E_FIELD fail: signed quantity",
            text(0, |t| t.replace("<Qty>", "<Qty>+")),
            Err(Field),
        ),
        (
            "E_FIELD fail: missing Isin",
            text(0, |t| remove_element(&t, "Isin")),
            Err(Field),
        ),
        (
            "E_FIELD fail: unknown element",
            text(0, |t| t.replace("</Msg>", "<Colour>red</Colour></Msg>")),
            Err(Field),
        ),
        (
            "E_FIELD fail: price with 7 fraction digits",
            text(0, |t| replace_element(&t, "Price", "1.0000001")),
            Err(Field),
        ),
        (
            "E_FIELD pass: price with 6 fraction digits",
            text(0, |t| replace_element(&t, "Price", "1.000001")),
            ok,
        ),
        (
            "E_FIELD fail: date format",
            text(0, |t| replace_element(&t, "TradeDate", "04/08/2026")),
            Err(Field),
        ),
        (
            "E_FIELD fail: Side",
            text(0, |t| replace_element(&t, "Side", "HOLD")),
            Err(Field),
        ),
        (
            "E_FIELD fail: RelatedId in a NEW",
            with(0, |m| m.related_id = Some("X".into())),
            Err(Field),
        ),
        (
            "E_CCY fail",
            with(0, |m| m.ccy = Some("ZZZ".into())),
            Err(Ccy),
        ),
        (
            "E_CCY fail wins over E_MARKET",
            with(0, |m| {
                m.ccy = Some("ZZZ".into());
                m.market = Some("XXXX".into());
            }),
            Err(Ccy),
        ),
        (
            "E_COUNTRY fail",
            with(0, |m| m.inv_mgr = Some("IMGBQQ22XXX".into())),
            Err(Country),
        ),
        (
            "E_MARKET fail",
            with(0, |m| m.market = Some("XXXX".into())),
            Err(Market),
        ),
        (
            "E_MARKET pass: another listed market",
            with(0, |m| m.market = Some("XPAR".into())),
            ok,
        ),
        (
            "E_ISIN fail: check digit",
            with(0, |m| m.isin = m.isin.as_ref().map(|i| flip_check_digit(i).into())),
            Err(Isin),
        ),
        (
            "E_ISIN fail: valid but not listed",
            with(0, |m| m.isin = Some("US0378331005".into())),
            Err(Isin),
        ),
        (
            "E_PARTY fail: InvMgr is a broker",
            with(0, move |m| m.inv_mgr = Some(broker_for_party.clone().into())),
            Err(Party),
        ),
        (
            "E_PARTY fail: unknown custodian",
            with(3, |m| m.custodian = Some("NOPESG21XXX".into())),
            Err(Party),
        ),
        (
            "E_AUTH fail: NOE sent by the investment manager",
            with(0, |m| m.sender = m.inv_mgr.clone().unwrap_or_default()),
            Err(Auth),
        ),
        (
            "E_AUTH fail: SET sent by a custodian of its InvMgr that it does not name",
            with(3, move |m| m.sender = custodian_for_auth.clone().into()),
            Err(Auth),
        ),
        (
            "E_AUTH fail: SET names a custodian that does not act for its InvMgr",
            with(3, move |m| m.custodian = Some(stranger_named.clone().into())),
            Err(Auth),
        ),
        (
            "E_AUTH fail: SET sent by a custodian that names itself but does not act for its InvMgr",
            with(3, move |m| {
                m.custodian = Some(stranger_sends.clone().into());
                m.sender = stranger_sends.clone().into();
            }),
            Err(Auth),
        ),
        (
            "E_AUTH pass: SET sent by the custodian it names, which acts for its InvMgr",
            with(3, move |m| {
                m.custodian = Some(custodian_for_pass.clone().into());
                m.sender = custodian_for_pass.clone().into();
            }),
            ok,
        ),
        (
            "E_DATE fail: Saturday",
            with(0, |m| {
                m.trade_date = ste_engine::model::parse_date("2026-08-01")
            }),
            Err(Date),
        ),
        (
            "E_DATE fail: Christmas in London",
            with(0, |m| {
                m.trade_date = ste_engine::model::parse_date("2026-12-24");
                m.settle_date = ste_engine::model::parse_date("2026-12-25");
            }),
            Err(Date),
        ),
        (
            "E_DATE fail: settles before trading",
            with(0, |m| {
                m.settle_date = ste_engine::model::parse_date("2026-08-03")
            }),
            Err(Date),
        ),
    ];
    for (name, mutate, expected) in cases {
        let result = validate_text(&mutate(&messages)).map(|_| ());
        assert_eq!(result, expected, "{name}");
    }
}

#[test]
fn a_signature_by_another_key_is_rejected() {
    let refdata = refdata();
    let messages = london_trade(600, 400);
    let line = line_of(&messages, 0).into_bytes();
    let forged = sign::sign(b"not the broker's key", &line);
    let result = validate(&refdata, &line, Some(&messages[0].sender), Some(&forged));
    assert_eq!(result.map(|_| ()).map_err(|r| r.code), Err(ReasonCode::Sig));
    let unsigned = validate(&refdata, &line, Some(&messages[0].sender), None);
    assert_eq!(
        unsigned.map(|_| ()).map_err(|r| r.code),
        Err(ReasonCode::Sig)
    );
    // Signed by a real participant, but the message names another sender.
    let other = &refdata.participants()[0];
    let other_key = refdata.participant_mac(&other.bic).expect("a key").1;
    let signed_by_other = sign::sign_keyed(other_key, &line);
    let result = validate(&refdata, &line, Some(&other.bic), Some(&signed_by_other));
    assert_eq!(result.map(|_| ()).map_err(|r| r.code), Err(ReasonCode::Sig));
}

#[test]
fn a_prefixed_namespace_is_the_same_message() {
    let refdata = refdata();
    let messages = london_trade(600, 400);
    let prefixed = line_of(&messages, 0)
        .replace("<Msg xmlns=", "<s:Msg xmlns:s=")
        .replace('<', "<s:")
        .replace("<s:/", "</s:")
        .replace("<s:s:", "<s:");
    let sender = &messages[0].sender;
    let key = refdata.participant_mac(sender).expect("known sender").1;
    let signature = sign::sign_keyed(key, prefixed.as_bytes());
    let msg = validate(
        &refdata,
        prefixed.as_bytes(),
        Some(sender),
        Some(&signature),
    )
    .expect("a prefixed message is valid");
    assert_eq!(msg, messages[0]);
}

/// [`validate_signed`]'s whole rejection, if any.
fn rejection_of(text: &str) -> Option<Rejection> {
    validate_signed(text).err()
}

#[test]
fn the_first_missing_or_stray_field_in_canonical_order_is_the_one_named() {
    let messages = london_trade(600, 400);
    let noe = line_of(&messages, 0);
    assert_eq!(rejection_of(&noe), None);
    let field = |detail: &str| Some(Rejection::new(ReasonCode::Field, detail));
    // Two fields missing, removed in either order: the earlier in canonical order is named.
    for (first, second) in [("Qty", "Isin"), ("Isin", "Qty")] {
        let without = remove_element(&remove_element(&noe, first), second);
        assert_eq!(
            rejection_of(&without),
            field("missing mandatory field Isin")
        );
    }
    let without = remove_element(&remove_element(&noe, "Broker"), "SentAt");
    assert_eq!(
        rejection_of(&without),
        field("missing mandatory field SentAt")
    );
    // Two fields that a NOE does not carry, the later one first in the text.
    let stray = noe.replace("</Msg>", "<Gross>1</Gross><Account>A1</Account></Msg>");
    assert_eq!(
        rejection_of(&stray),
        field("field Account does not belong in a NOE")
    );
    let related = noe.replace("<TradeRef>", "<RelatedId>R1</RelatedId><TradeRef>");
    assert_eq!(
        rejection_of(&related),
        field("RelatedId is only allowed in a CAN or AMD")
    );
    // A CAN carries its header and trade key only.
    let msg = &messages[0];
    let can = |extra: &str| {
        format!(
            "<Msg xmlns=\"urn:ste:trade:1\"><MsgId>{id}-X</MsgId><Type>NOE</Type>\
             <Function>CAN</Function><Sender>{sender}</Sender><SentAt>{sent_at}</SentAt>\
             <RelatedId>{id}</RelatedId><TradeRef>{trade_ref}</TradeRef><Broker>{broker}</Broker>\
             {extra}</Msg>",
            id = msg.msg_id,
            sender = msg.sender,
            sent_at = msg.sent_at,
            trade_ref = msg.trade_ref,
            broker = msg.broker,
        )
    };
    assert_eq!(rejection_of(&can("")), None);
    assert_eq!(
        rejection_of(&can("<Isin>GB0002634946</Isin><Side>BUY</Side>")),
        field("field Side is not allowed in a CAN")
    );
}

fn remove_element(text: &str, name: &str) -> String {
    let open = format!("<{name}>");
    let close = format!("</{name}>");
    let start = text.find(&open).expect("element present");
    let end = text.find(&close).expect("element closed") + close.len();
    format!("{}{}", &text[..start], &text[end..])
}

fn replace_element(text: &str, name: &str, value: &str) -> String {
    let open = format!("<{name}>");
    let close = format!("</{name}>");
    let start = text.find(&open).expect("element present") + open.len();
    let end = text.find(&close).expect("element closed");
    format!("{}{value}{}", &text[..start], &text[end..])
}

fn flip_check_digit(isin: &str) -> String {
    let mut bytes = isin.as_bytes().to_vec();
    let last = bytes.len() - 1;
    bytes[last] = b'0' + (bytes[last] - b'0' + 1) % 10;
    String::from_utf8(bytes).expect("ascii")
}

// ---------------------------------------------------------------------------------------------
// The matcher's codes: E_DUPID, E_CONFLICT and E_CLOSED, passing and failing.

fn process_all(matcher: &mut Matcher, messages: &[Msg]) -> Vec<Disposition> {
    process_on(matcher, messages, time::macros::date!(2026 - 08 - 04))
}

fn code(disposition: &Disposition) -> Option<ReasonCode> {
    match disposition {
        Disposition::Rejected(rejection) => Some(rejection.code),
        _ => None,
    }
}

fn matcher() -> Matcher {
    Matcher::new(refdata(), Tolerances::default())
}

#[test]
fn duplicates_and_dupid() {
    let messages = london_trade(600, 400);
    let mut matcher = matcher();
    process_all(&mut matcher, &messages[..3]);
    // Exact re-send: a duplicate, not an exception.
    let again = process_all(&mut matcher, &messages[1..2]);
    assert_eq!(again, vec![Disposition::Duplicate]);
    // Same MsgId, other content.
    let mut changed = messages[1].clone();
    changed.sent_at = "2026-08-04T09:31:00.000Z".into();
    let result = process_all(&mut matcher, &[changed]);
    assert_eq!(code(&result[0]), Some(ReasonCode::DupId));
    // The same MsgId from another sender is a different message.
    let mut other_sender = messages[2].clone();
    other_sender.msg_id = messages[1].msg_id.clone();
    let result = process_all(&mut matcher, &[other_sender]);
    assert_eq!(code(&result[0]), Some(ReasonCode::Conflict));
}

#[test]
fn conflicts() {
    let messages = london_trade(600, 400);
    let mut matcher = matcher();
    process_all(&mut matcher, &messages[..2]);
    let mut competing = messages[1].clone();
    competing.msg_id.push_str("-B");
    let result = process_all(&mut matcher, &[competing.clone()]);
    assert_eq!(code(&result[0]), Some(ReasonCode::Conflict));
    // A second NOE competes too.
    let mut second_noe = messages[0].clone();
    second_noe.msg_id.push_str("-B");
    assert_eq!(
        code(&process_all(&mut matcher, &[second_noe])[0]),
        Some(ReasonCode::Conflict)
    );
    // Once the first ALC is cancelled, its slot is free — but not for the message that was
    // refused: its MsgId was seen, and an exact re-send gets the same answer again, so a
    // rejected message cannot be replayed into acceptance once its cause is gone.
    let cancel = cancel_of(&messages[1]);
    assert_eq!(
        process_all(&mut matcher, &[cancel]),
        vec![Disposition::Accepted]
    );
    assert_eq!(
        code(&process_all(&mut matcher, &[competing.clone()])[0]),
        Some(ReasonCode::Conflict)
    );
    let mut changed = competing.clone();
    changed.sent_at = "2026-08-04T09:45:00.000Z".into();
    assert_eq!(
        code(&process_all(&mut matcher, &[changed])[0]),
        Some(ReasonCode::DupId)
    );
    // The same allocation under a new MsgId takes the free slot.
    let mut renamed = competing;
    renamed.msg_id.push_str("-C");
    assert_eq!(
        process_all(&mut matcher, &[renamed]),
        vec![Disposition::Accepted]
    );
    process_all(&mut matcher, &messages[2..]);
    let key = messages[0].trade_key();
    assert_eq!(matcher.status_of(&key), Some(TradeStatus::Matched));
}

#[test]
fn a_msgid_rejected_after_its_signature_checked_is_never_accepted() {
    let messages = london_trade(600, 400);
    let mut matcher = matcher();
    let raw = encode_msg(&messages[0]);
    let rejection = Rejection::new(ReasonCode::Date, "a holiday");
    // The validator refused it once the signature checked out: remembered.
    let first = matcher.refuse(
        &messages[0].sender,
        &messages[0].msg_id,
        Content::of(raw.as_bytes()),
        rejection.clone(),
    );
    assert_eq!(code(&first), Some(ReasonCode::Date));
    // The exact message again, even if it would pass now: the same code.
    assert_eq!(
        code(&process_all(&mut matcher, &messages[..1])[0]),
        Some(ReasonCode::Date)
    );
    // Corrected content under the same MsgId: E_DUPID, the MsgId is spent.
    let mut corrected = messages[0].clone();
    corrected.sent_at = "2026-08-04T09:45:00.000Z".into();
    assert_eq!(
        code(&process_all(&mut matcher, &[corrected])[0]),
        Some(ReasonCode::DupId)
    );
    // A rejection of other content for an accepted MsgId keeps the accepted verdict.
    process_all(&mut matcher, &messages[1..2]);
    let other = format!("{}<!-- other -->", encode_msg(&messages[1]));
    let refused = matcher.refuse(
        &messages[1].sender,
        &messages[1].msg_id,
        Content::of(other.as_bytes()),
        rejection.clone(),
    );
    assert_eq!(code(&refused), Some(ReasonCode::Date));
    assert_eq!(
        process_all(&mut matcher, &messages[1..2]),
        vec![Disposition::Duplicate]
    );
    // Taken back after a restart, the verdict holds.
    let mut restarted = self::matcher();
    restarted.restore_rejection(
        &messages[0].sender,
        &messages[0].msg_id,
        raw.as_bytes(),
        ReasonCode::Date,
    );
    assert_eq!(
        code(&process_all(&mut restarted, &messages[..1])[0]),
        Some(ReasonCode::Date)
    );
}

fn cancel_of(msg: &Msg) -> Msg {
    Msg {
        msg_id: format!("{}-X", msg.msg_id).into(),
        function: Function::Can,
        related_id: Some(msg.msg_id.clone()),
        ..msg.clone()
    }
}

#[test]
fn closed_trades() {
    let messages = london_trade(600, 400);
    let mut matcher = matcher();
    process_all(&mut matcher, &messages);
    let key = messages[0].trade_key();
    assert_eq!(matcher.status_of(&key), Some(TradeStatus::Matched));
    // A new message for the matched trade.
    let mut late = messages[3].clone();
    late.msg_id.push_str("-L");
    assert_eq!(
        code(&process_all(&mut matcher, &[late])[0]),
        Some(ReasonCode::Closed)
    );
    // An exact duplicate is still a duplicate.
    assert_eq!(
        process_all(&mut matcher, &messages[3..4]),
        vec![Disposition::Duplicate]
    );
    // A CAN after the match is too late.
    assert_eq!(
        code(&process_all(&mut matcher, &[cancel_of(&messages[2])])[0]),
        Some(ReasonCode::Closed)
    );
}

#[test]
fn a_message_named_before_the_match_is_accepted_after_it() {
    let messages = london_trade(600, 400);
    let mut matcher = matcher();
    // The AMD of NPR 1 comes first and takes its slot; the trade matches without the original.
    let amend = Msg {
        msg_id: format!("{}-A", messages[2].msg_id).into(),
        function: Function::Amd,
        related_id: Some(messages[2].msg_id.clone()),
        ..messages[2].clone()
    };
    let mut order: Vec<Msg> = vec![amend];
    order.extend(
        messages
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != 2)
            .map(|(_, m)| m.clone()),
    );
    let dispositions = process_all(&mut matcher, &order);
    assert!(dispositions.iter().all(|d| *d == Disposition::Accepted));
    assert_eq!(
        matcher.status_of(&messages[0].trade_key()),
        Some(TradeStatus::Matched)
    );
    // The original arrives late: stored and superseded at once, not an exception.
    assert_eq!(
        process_all(&mut matcher, &messages[2..3]),
        vec![Disposition::Accepted]
    );
    assert_eq!(matcher.counts().messages, 8);
}

#[test]
fn a_trade_cancelled_completely_is_cancelled_and_reopens() {
    let mut messages = london_trade(600, 400);
    messages[2].net = messages[2].net.map(|n| n + d("50"));
    let mut matcher = matcher();
    process_all(&mut matcher, &messages);
    let key = messages[0].trade_key();
    assert_eq!(matcher.status_of(&key), Some(TradeStatus::Mismatched));
    let cancels: Vec<Msg> = messages.iter().map(cancel_of).collect();
    process_all(&mut matcher, &cancels);
    assert_eq!(matcher.status_of(&key), Some(TradeStatus::Cancelled));
    // A later NEW reopens it.
    let mut again = london_trade(600, 400);
    for msg in &mut again {
        msg.msg_id.push_str("-R");
    }
    process_all(&mut matcher, &again);
    assert_eq!(matcher.status_of(&key), Some(TradeStatus::Matched));
    let _ = MsgType::Noe;
}

// ---------------------------------------------------------------------------------------------
// The date a trade's rows are stored under (the partition of the postgres store).

#[test]
fn a_trade_is_stored_under_the_date_of_its_first_accepted_message() {
    use time::macros::date;
    let today = date!(2026 - 11 - 30);
    let stored_date = |matcher: &mut Matcher, msg: &Msg| {
        let raw = encode_msg(msg);
        let outcome = matcher.process(
            Box::new(msg.clone()),
            Content::of(raw.as_bytes()),
            0,
            "",
            today,
        );
        assert_eq!(outcome.disposition, Disposition::Accepted, "{}", msg.msg_id);
        outcome.trade_date
    };

    // Its TradeDate, for every message, the CLS and a message accepted after the match.
    let messages = london_trade(600, 400);
    let mut matcher = matcher();
    let amend = Msg {
        msg_id: format!("{}-A", messages[2].msg_id).into(),
        function: Function::Amd,
        related_id: Some(messages[2].msg_id.clone()),
        ..messages[2].clone()
    };
    for msg in messages.iter().filter(|m| m.msg_id != messages[2].msg_id) {
        assert_eq!(stored_date(&mut matcher, msg), date!(2026 - 08 - 04));
    }
    assert_eq!(stored_date(&mut matcher, &amend), date!(2026 - 08 - 04));
    assert_eq!(
        matcher.status_of(&messages[0].trade_key()),
        Some(TradeStatus::Matched)
    );
    assert_eq!(
        stored_date(&mut matcher, &messages[2]),
        date!(2026 - 08 - 04)
    );

    // The first message fixes the date: a later message with another TradeDate follows it.
    let mut matcher = self::matcher();
    let mut first = messages[1].clone();
    first.trade_date = Some(date!(2026 - 08 - 03));
    assert_eq!(stored_date(&mut matcher, &first), date!(2026 - 08 - 03));
    assert_eq!(
        stored_date(&mut matcher, &messages[0]),
        date!(2026 - 08 - 03)
    );

    // A CAN carries no TradeDate: a trade that starts with one is stored under the day of
    // arrival, and so are the messages that follow.
    let mut matcher = self::matcher();
    let mut cancel = cancel_of(&messages[4]);
    cancel.trade_date = None;
    assert_eq!(stored_date(&mut matcher, &cancel), today);
    assert_eq!(stored_date(&mut matcher, &messages[0]), today);

    // After a restart the date the store kept wins over the message's own.
    let mut restored = self::matcher();
    let raw = encode_msg(&cancel);
    assert!(restored.restore(
        Box::new(cancel.clone()),
        raw.as_bytes(),
        0,
        Some(date!(2026 - 11 - 02)),
        today
    ));
    assert_eq!(
        stored_date(&mut restored, &messages[0]),
        date!(2026 - 11 - 02)
    );
}

/// Processes `messages` on `day`.
fn process_on(matcher: &mut Matcher, messages: &[Msg], day: time::Date) -> Vec<Disposition> {
    messages
        .iter()
        .map(|msg| {
            let raw = encode_msg(msg);
            matcher
                .process(
                    Box::new(msg.clone()),
                    Content::of(raw.as_bytes()),
                    0,
                    "2026-12-24T10:00:00.000Z",
                    day,
                )
                .disposition
        })
        .collect()
}

#[test]
fn unmatched_trades_age_out_after_business_days_of_their_market() {
    use time::macros::date;
    // A London trade left incomplete on Thursday 24 December 2026: Friday 25 is a holiday of
    // XLON, then a weekend; Monday 28 is its first business day after.
    let messages = london_trade(600, 400);
    let key = messages[0].trade_key();
    let mut matcher = matcher();
    process_on(&mut matcher, &messages[..6], date!(2026 - 12 - 24));
    assert_eq!(matcher.status_of(&key), Some(TradeStatus::Pending));
    // On Monday no whole business day has passed (the holiday does not count).
    assert!(matcher.age_out(date!(2026 - 12 - 28), 1).is_empty());
    assert_eq!(matcher.status_of(&key), Some(TradeStatus::Pending));
    // On Tuesday Monday has: one business day.
    let aged = matcher.age_out(date!(2026 - 12 - 29), 1);
    assert_eq!(aged.len(), 1);
    assert_eq!(aged[0].trade_key, key);
    let broker = messages[0].broker.clone();
    let inv_mgr = messages[0].inv_mgr.clone().expect("an investment manager");
    assert!(
        aged[0].parties.iter().any(|p| *p == broker)
            && aged[0].parties.iter().any(|p| *p == inv_mgr)
    );
    let custodian = messages
        .iter()
        .find_map(|m| m.custodian.clone())
        .expect("a custodian");
    assert!(
        aged[0].parties.iter().any(|p| *p == custodian),
        "{:?}",
        aged[0].parties
    );
    assert_eq!(matcher.status_of(&key), Some(TradeStatus::Aged));
    assert_eq!(matcher.counts().aged, 1);
    assert_eq!(matcher.counts().matched, 0);
    // Closed: the missing message comes too late; an exact re-send is still a duplicate.
    let late = process_on(&mut matcher, &messages[6..], date!(2026 - 12 - 30));
    assert_eq!(code(&late[0]), Some(ReasonCode::Closed));
    assert_eq!(
        process_on(&mut matcher, &messages[..1], date!(2026 - 12 - 30)),
        vec![Disposition::Duplicate]
    );
    // A later message restarts the count: a trade touched on Monday is not aged on Tuesday.
    let other = london_trade(300, 200);
    let other: Vec<Msg> = other
        .into_iter()
        .map(|mut m| {
            m.trade_ref = "T-AGING-2".into();
            m.msg_id.push_str("-2");
            m
        })
        .collect();
    process_on(&mut matcher, &other[..3], date!(2026 - 12 - 24));
    process_on(&mut matcher, &other[3..5], date!(2026 - 12 - 28));
    assert!(matcher.age_out(date!(2026 - 12 - 29), 1).is_empty());
    assert_eq!(matcher.age_out(date!(2026 - 12 - 30), 1).len(), 1);
}

#[test]
fn the_matcher_tables_grow_with_the_messages_it_remembers() {
    let mut matcher = matcher();
    let empty = matcher.table_bytes();
    let mut last = empty;
    for trade in 0..64 {
        let mut messages = london_trade(600, 400);
        for message in &mut messages {
            message.trade_ref = format!("{}-{trade}", message.trade_ref).into();
            message.msg_id = format!("{}-{trade}", message.msg_id).into();
        }
        process_all(&mut matcher, &messages);
        assert!(
            matcher.table_bytes() >= last,
            "the tables never shrink while they fill"
        );
        last = matcher.table_bytes();
    }
    // 448 message keys and 64 closed trades are remembered: at least 24 bytes per key.
    assert!(last >= empty + 448 * 24, "{empty} → {last}");
}

// ---------------------------------------------------------------------------------------------
// A trade belongs to its parties: its broker, the investment manager its NOE names, and the
// custodians that act for that investment manager.

/// Another investment manager than the trade's, and a custodian that acts for it but not for the
/// trade's investment manager.
fn stranger_of(messages: &[Msg]) -> (String, String) {
    let refdata = refdata();
    let inv_mgr = messages[0].inv_mgr.clone().expect("a NOE names its InvMgr");
    refdata
        .participants()
        .iter()
        .filter(|p| p.role == Role::InvMgr && p.bic != inv_mgr)
        .find_map(|p| {
            refdata
                .custodians_of(&p.bic)
                .find(|c| !refdata.acts_for(c, &inv_mgr))
                .map(|c| (p.bic.clone(), c.to_owned()))
        })
        .expect("another investment manager with a custodian of its own")
}

/// `msg` (an ALC or SET of the trade) as a stranger sends it, naming itself as investment
/// manager (and its custodian, for a SET).
fn as_stranger(msg: &Msg, inv_mgr: &str, custodian: &str, sender: &str) -> Msg {
    Msg {
        msg_id: format!("{sender}-{}", msg.msg_id).into(),
        sender: sender.into(),
        inv_mgr: Some(inv_mgr.into()),
        custodian: msg.custodian.as_ref().map(|_| custodian.into()),
        safekeeping_account: msg
            .safekeeping_account
            .as_ref()
            .map(|_| "ATTACKER-ACCT".into()),
        ..msg.clone()
    }
}

fn outcome_of(matcher: &mut Matcher, msg: &Msg) -> ste_engine::matcher::Outcome {
    let raw = encode_msg(msg);
    matcher.process(
        Box::new(msg.clone()),
        Content::of(raw.as_bytes()),
        0,
        "2026-08-04T10:00:00.000Z",
        time::macros::date!(2026 - 08 - 04),
    )
}

#[test]
fn strangers_before_the_noe_are_released_by_it_and_refused_after_it() {
    let messages = london_trade(600, 400);
    let (other, its_custodian) = stranger_of(&messages);
    let mut matcher = matcher();
    // Before the NOE, a stranger's ALC and SET for the trade's own accounts are accepted: nobody
    // can tell yet whose trade it is. They take no slot of the trade's own messages.
    let early_alc = as_stranger(&messages[1], &other, &its_custodian, &other);
    let early_set = as_stranger(&messages[3], &other, &its_custodian, &its_custodian);
    assert_eq!(
        process_all(&mut matcher, &[early_alc.clone(), early_set.clone()]),
        vec![Disposition::Accepted, Disposition::Accepted]
    );
    assert_eq!(
        process_all(&mut matcher, &messages[1..4]),
        vec![Disposition::Accepted; 3]
    );
    // The NOE names the investment manager: the strangers' messages are released, each sender
    // told.
    let noe = outcome_of(&mut matcher, &messages[0]);
    assert_eq!(noe.disposition, Disposition::Accepted);
    let released: Vec<(&str, &str)> = noe
        .released
        .iter()
        .map(|r| (r.sender.as_str(), r.msg_id.as_str()))
        .collect();
    assert_eq!(
        released,
        vec![
            (other.as_str(), early_alc.msg_id.as_str()),
            (its_custodian.as_str(), early_set.msg_id.as_str())
        ]
    );
    // What they held is given back.
    assert_eq!(matcher.held_by(&other), 0);
    assert_eq!(matcher.held_by(&its_custodian), 0);
    // After it, a stranger is refused E_AUTH, without being told who the parties are.
    let late = as_stranger(&messages[4], &other, &its_custodian, &other);
    let refused = process_all(&mut matcher, &[late]);
    let Disposition::Rejected(rejection) = &refused[0] else {
        panic!("{refused:?}");
    };
    assert_eq!(rejection.code, ReasonCode::Auth);
    assert!(
        !rejection
            .detail
            .contains(messages[0].inv_mgr.as_deref().unwrap_or("?")),
        "{rejection:?}"
    );
    // A stranger cannot cancel for the trade's investment manager either.
    let mut cancel = cancel_of(&early_set);
    cancel.msg_id.push_str("-2");
    assert_eq!(
        code(&process_all(&mut matcher, &[cancel])[0]),
        Some(ReasonCode::Auth)
    );
    // The parties' trade matches, settled with their own custodian.
    let mut cls = None;
    for msg in &messages[4..] {
        let outcome = outcome_of(&mut matcher, msg);
        assert_eq!(outcome.disposition, Disposition::Accepted);
        cls = cls.or(outcome.cls);
    }
    let cls = cls.expect("the trade matches");
    assert!(cls.settlements.iter().all(|s| Some(s.custodian.as_str())
        == messages[3].custodian.as_deref()
        && s.safekeeping_account != "ATTACKER-ACCT"));
}

#[test]
fn a_cancelled_noe_leaves_the_trade_with_its_parties() {
    let messages = london_trade(600, 400);
    let (other, its_custodian) = stranger_of(&messages);
    let mut matcher = matcher();
    process_all(&mut matcher, &messages);
    let mut second = london_trade(600, 400);
    for msg in &mut second {
        msg.trade_ref = "T99999999999".into();
        msg.msg_id.push_str("-2");
    }
    process_all(&mut matcher, &second[..1]);
    process_all(&mut matcher, &[cancel_of(&second[0])]);
    // No live NOE, but the trade still belongs to the investment manager the NOE named.
    let stranger = as_stranger(&second[1], &other, &its_custodian, &other);
    assert_eq!(
        code(&process_all(&mut matcher, &[stranger])[0]),
        Some(ReasonCode::Auth)
    );
    assert_eq!(
        matcher.status_of(&second[0].trade_key()),
        Some(TradeStatus::Cancelled)
    );
}

#[test]
fn an_amd_never_puts_a_second_live_message_into_another_senders_slot() {
    let messages = london_trade(600, 400);
    let refdata = refdata();
    let inv_mgr = messages[0].inv_mgr.clone().expect("InvMgr");
    let named = messages[3].custodian.clone().expect("a custodian");
    let mut matcher = matcher();
    process_all(&mut matcher, &messages[..4]);
    // The named custodian amends a SET of its own that never arrived, for the account whose SET
    // the investment manager already sent.
    let amend = Msg {
        msg_id: format!("{named}-A1").into(),
        sender: named.clone(),
        function: Function::Amd,
        related_id: Some(format!("{named}-NEVER").into()),
        ..messages[3].clone()
    };
    assert!(refdata.acts_for(&named, &inv_mgr));
    assert_eq!(
        code(&process_all(&mut matcher, &[amend])[0]),
        Some(ReasonCode::Conflict)
    );
    // A sender's own AMD may arrive before the message it replaces, and its own slot is not
    // taken from it.
    let set = &messages[6];
    let first = Msg {
        msg_id: format!("{}-C1", set.msg_id).into(),
        function: Function::Amd,
        related_id: Some(set.msg_id.clone()),
        ..set.clone()
    };
    let second = Msg {
        msg_id: format!("{}-C2", set.msg_id).into(),
        function: Function::Amd,
        related_id: Some(first.msg_id.clone()),
        ..set.clone()
    };
    assert_eq!(
        process_all(&mut matcher, &[set.clone(), second, first]),
        vec![Disposition::Accepted; 3]
    );
    process_all(&mut matcher, &messages[4..6]);
    assert_eq!(
        matcher.status_of(&messages[0].trade_key()),
        Some(TradeStatus::Matched)
    );
}

#[test]
fn a_trade_holds_a_bounded_number_of_messages() {
    use ste_engine::matcher::TRADE_MESSAGES_MAX;
    let messages = london_trade(600, 400);
    let mut matcher = matcher();
    process_all(&mut matcher, &messages[..2]);
    // The investment manager amends its ALC again and again, to its bound in the trade.
    let mut previous = messages[1].msg_id.clone();
    let mut answers = Vec::new();
    for n in 2..=TRADE_MESSAGES_MAX {
        let amend = Msg {
            msg_id: format!("{}-M{n}", messages[1].msg_id).into(),
            function: Function::Amd,
            related_id: Some(previous.clone()),
            ..messages[1].clone()
        };
        previous = amend.msg_id.clone();
        answers.extend(process_all(&mut matcher, &[amend]));
    }
    assert_eq!(
        answers.iter().find(|a| **a != Disposition::Accepted),
        None,
        "of {}",
        answers.len()
    );
    let beyond = Msg {
        msg_id: format!("{}-M-LAST", messages[1].msg_id).into(),
        function: Function::Amd,
        related_id: Some(previous),
        ..messages[1].clone()
    };
    assert_eq!(
        code(&process_all(&mut matcher, &[beyond])[0]),
        Some(ReasonCode::Limit)
    );
    // Other trades are untouched.
    let mut other = london_trade(600, 400);
    for msg in &mut other {
        msg.trade_ref = "T99999999998".into();
        msg.msg_id.push_str("-O");
    }
    process_all(&mut matcher, &other);
    assert_eq!(
        matcher.status_of(&other[0].trade_key()),
        Some(TradeStatus::Matched)
    );
}

#[test]
fn the_signer_is_the_sender_whatever_the_xml_hides() {
    use ste_engine::validate::validate_message;
    let refdata = refdata();
    let messages = london_trade(600, 400);
    let victim = &messages[0];
    let (attacker, _) = stranger_of(&messages);
    let attacker_key = refdata.participant_mac(&attacker).expect("a key").1;
    let line = line_of(&messages, 0);
    let sender_element = format!("<Sender>{}</Sender>", victim.sender);
    // A bad Qty besides, so that the field check would refuse it if it ran first.
    let bad = line.replace("<Qty>", "<Qty>+");
    let disguises = [
        bad.replace(
            &sender_element,
            &format!("<!--<Sender>{attacker}</Sender>-->{sender_element}"),
        ),
        bad.replace(
            &sender_element,
            &format!(
                "<s:Sender xmlns:s=\"urn:ste:trade:1\">{}</s:Sender>",
                victim.sender
            ),
        ),
        bad.replace(
            &sender_element,
            &format!("<Sender>\n{}</Sender>", victim.sender),
        ),
    ];
    for disguised in disguises {
        let signature = sign::sign_keyed(attacker_key, disguised.as_bytes());
        let refused = validate_message(
            &refdata,
            disguised.as_bytes(),
            Some(&attacker),
            Some(&signature),
        )
        .expect_err("refused");
        assert!(
            matches!(refused.rejection.code, ReasonCode::Sig | ReasonCode::Field),
            "{disguised}: {refused:?}"
        );
        // Nothing is remembered under the victim's name.
        assert!(
            refused
                .identity
                .as_ref()
                .is_none_or(|identity| identity.sender == attacker),
            "{refused:?}"
        );
    }
    // The attacker's own bad message is remembered under the attacker.
    let own = bad.replace(&*victim.sender, &attacker);
    let signature = sign::sign_keyed(attacker_key, own.as_bytes());
    let refused = validate_message(&refdata, own.as_bytes(), Some(&attacker), Some(&signature))
        .expect_err("refused");
    assert_eq!(refused.rejection.code, ReasonCode::Field);
    assert_eq!(
        refused.identity.map(|identity| identity.sender),
        Some(attacker.clone())
    );
}

#[test]
fn a_participant_holds_a_bounded_number_of_bytes_in_open_trades() {
    let quota = 64 * 1024;
    let mut matcher = matcher().with_quota(quota);
    let messages = london_trade(600, 400);
    let broker = messages[0].sender.clone();
    // The broker opens trade after trade and never lets them match, until it is refused.
    let mut opened = 0;
    let refused = loop {
        let noe = Msg {
            msg_id: format!("{broker}-Q{opened:06}").into(),
            trade_ref: format!("Q{opened:011}").into(),
            ..messages[0].clone()
        };
        match process_all(&mut matcher, &[noe]).remove(0) {
            Disposition::Accepted => opened += 1,
            other => break other,
        }
        assert!(opened < 10_000, "never bounded");
    };
    assert_eq!(code(&refused), Some(ReasonCode::Limit));
    assert!(matcher.held_by(&broker) <= quota);
    assert!(opened > 16, "{opened} trades in {quota} bytes");
    // Others are not held to its quota: a whole trade of another broker matches.
    let mut other = london_trade(600, 400);
    let other_broker = refdata()
        .participants()
        .iter()
        .find(|p| p.role == Role::Broker && p.bic != broker)
        .map(|p| p.bic.clone())
        .expect("another broker");
    for msg in &mut other {
        if msg.sender == broker {
            msg.sender = other_broker.clone().into();
        }
        msg.broker = other_broker.clone().into();
    }
    assert_eq!(
        process_all(&mut matcher, &other),
        vec![Disposition::Accepted; 7]
    );
    assert_eq!(
        matcher.status_of(&other[0].trade_key()),
        Some(TradeStatus::Matched)
    );
    // What a matched trade held is given back.
    assert_eq!(matcher.held_by(&other_broker), 0);
    // Aged out, the broker's open trades give their bytes back, and it may open trades again.
    matcher.age_out(time::macros::date!(2027 - 06 - 01), 20);
    assert_eq!(matcher.held_by(&broker), 0);
    let noe = Msg {
        msg_id: format!("{broker}-Q-AGAIN").into(),
        trade_ref: "Q99999999999".into(),
        ..messages[0].clone()
    };
    assert_eq!(
        process_all(&mut matcher, &[noe]),
        vec![Disposition::Accepted]
    );
}

#[test]
fn a_trade_sends_a_bounded_number_of_mismatched_advices() {
    use ste_engine::matcher::ADVICES_PER_TRADE_MAX;
    let messages = london_trade(600, 400);
    let mut matcher = matcher();
    process_all(&mut matcher, &messages[..6]);
    // The investment manager flips its last SET between two mismatches, again and again.
    let set = &messages[6];
    let mut previous = set.msg_id.clone();
    let mut advices = 0;
    let mut first = true;
    for n in 0..200 {
        // C17 one time, C16 the next: the failed criteria change each time.
        let mut amend = Msg {
            msg_id: format!("{}-F{n}", set.msg_id).into(),
            function: Function::Amd,
            related_id: Some(previous.clone()),
            ..set.clone()
        };
        if n % 2 == 0 {
            amend.settle_amount = Some(d("1.00"));
        } else {
            amend.payment_type = Some(PaymentType::Fop);
        }
        if first {
            amend = Msg {
                function: Function::New,
                related_id: None,
                msg_id: set.msg_id.clone(),
                ..amend
            };
            first = false;
        }
        previous = amend.msg_id.clone();
        let outcome = outcome_of(&mut matcher, &amend);
        assert_eq!(outcome.disposition, Disposition::Accepted);
        advices += usize::from(outcome.advice.is_some());
    }
    assert_eq!(advices, usize::from(ADVICES_PER_TRADE_MAX));
    // Put right, it still matches.
    let fixed = Msg {
        msg_id: format!("{}-FIXED", set.msg_id).into(),
        function: Function::Amd,
        related_id: Some(previous),
        ..set.clone()
    };
    assert!(outcome_of(&mut matcher, &fixed).cls.is_some());
}

#[test]
fn what_a_shard_accepted_is_taken_back_whatever_the_rules_are_now() {
    // A history written before parties were checked: a stranger's ALC after the NOE.
    let messages = london_trade(600, 400);
    let (other, its_custodian) = stranger_of(&messages);
    let stranger = as_stranger(&messages[1], &other, &its_custodian, &other);
    let mut live = matcher();
    process_all(&mut live, &messages[..1]);
    assert_eq!(
        code(&process_all(&mut live, std::slice::from_ref(&stranger))[0]),
        Some(ReasonCode::Auth)
    );
    let mut restarted = matcher().with_quota(1);
    let day = time::macros::date!(2026 - 08 - 04);
    for msg in [&messages[0], &stranger] {
        let raw = encode_msg(msg);
        assert!(restarted.restore(Box::new(msg.clone()), raw.as_bytes(), 0, None, day));
    }
}

#[test]
fn a_stranger_filling_a_trade_before_its_noe_leaves_the_parties_their_room() {
    use ste_engine::matcher::TRADE_MESSAGES_MAX;
    let messages = london_trade(600, 400);
    let (other, its_custodian) = stranger_of(&messages);
    let mut matcher = matcher();
    // A stranger's ALC, then AMDs of it to its own bound, before any party has sent anything.
    let first = as_stranger(&messages[1], &other, &its_custodian, &other);
    let mut previous = first.msg_id.clone();
    let mut chain = vec![first.clone()];
    for n in 1..TRADE_MESSAGES_MAX {
        let amend = Msg {
            msg_id: format!("{other}-S{n:05}").into(),
            function: Function::Amd,
            related_id: Some(previous.clone()),
            ..first.clone()
        };
        previous = amend.msg_id.clone();
        chain.push(amend);
    }
    assert!(process_all(&mut matcher, &chain)
        .iter()
        .all(|answer| *answer == Disposition::Accepted));
    // The parties' seven messages all count, and the trade matches.
    assert_eq!(
        process_all(&mut matcher, &messages),
        vec![Disposition::Accepted; 7]
    );
    assert_eq!(
        matcher.status_of(&messages[0].trade_key()),
        Some(TradeStatus::Matched)
    );
}

/// Each message's new trade status and whether the matcher took it for the trade's first.
fn statuses(matcher: &mut Matcher, messages: &[Msg]) -> Vec<Option<(TradeStatus, bool)>> {
    messages
        .iter()
        .map(|msg| {
            let raw = encode_msg(msg);
            let outcome = matcher.process(
                Box::new(msg.clone()),
                Content::of(raw.as_bytes()),
                0,
                "2026-12-24T10:00:00.000Z",
                time::macros::date!(2026 - 08 - 04),
            );
            assert!(outcome.trade_status.is_some() || !outcome.trade_status_first);
            outcome
                .trade_status
                .map(|s| (s, outcome.trade_status_first))
        })
        .collect()
}

#[test]
fn a_trades_status_is_its_first_until_one_has_been_handed_to_the_store() {
    let matched_first = Some((TradeStatus::Matched, true));
    // A clean trade: one status, its first, with the seventh message.
    let messages = london_trade(600, 400);
    let told = statuses(&mut matcher(), &messages);
    assert_eq!(told, [vec![None; 6], vec![matched_first]].concat());

    // Mismatched first, then matched by an amendment: the second status is not the first.
    let mut wrong = london_trade(600, 400);
    shift_settle(&mut wrong, "5.00");
    let mut matcher = matcher();
    let told = statuses(&mut matcher, &wrong);
    assert_eq!(told[6], Some((TradeStatus::Mismatched, true)));
    let amend = Msg {
        msg_id: format!("{}-A", wrong[3].msg_id).into(),
        function: Function::Amd,
        related_id: Some(wrong[3].msg_id.clone()),
        ..messages[3].clone()
    };
    assert_eq!(
        statuses(&mut matcher, &[amend]),
        [Some((TradeStatus::Matched, false))]
    );

    // A trade restored from the store may have a stored status: none of its is the first.
    let mut restored = self::matcher();
    for msg in &messages[..6] {
        let raw = encode_msg(msg);
        assert!(restored.restore(
            Box::new(msg.clone()),
            raw.as_bytes(),
            0,
            None,
            msg.trade_date.expect("dated")
        ));
    }
    assert_eq!(
        statuses(&mut restored, &messages[6..]),
        [Some((TradeStatus::Matched, false))]
    );
}
