//! The mapping of STE messages to FIX 4.4 application messages and back, on the messages and
//! repeating groups of the FIX 4.4 data dictionary (the stock `FIX44.xml` of QuickFIX), so that
//! a participant's FIX engine validating against it accepts what it reads and sends what the
//! engine reads.
//!
//! | STE | FIX | dictionary |
//! |---|---|---|
//! | NOE | TradeCaptureReport `AE` | stock |
//! | ALC | AllocationInstruction `J`, AllocType `626=2` (preliminary) | stock |
//! | NPR | AllocationInstruction `J`, AllocType `626=1` (calculated) | stock |
//! | SET | SettlementInstructions `T`, SettlInstMode `160=4` (specific, one account) | stock + [`T_EXTENSION`] |
//!
//! FIX 4.4's SettlementInstructions carries standing instructions and has no place for a
//! trade's instrument, dates, currency, account, quantity or amount; SET needs them, and no
//! stock message both holds them and leaves out a price (every allocation or confirmation
//! message requires AvgPx, which SET does not have). [`T_EXTENSION`] adds those standard
//! fields to T's NoSettlInst entry; nothing else needs it.

use ste_engine::codec::{self, Field, RawFields};
use ste_engine::reason::{ReasonCode, Rejection};

use super::codec::{FixMessage, PARTIES, SETTL_PARTIES};

/// The fields the data dictionary extension adds to the NoSettlInst (`778`) entry of
/// SettlementInstructions (`T`), in order, as a QuickFIX dictionary fragment: merged into the
/// stock `FIX44.xml` by `bridge/fix/extend-dictionary.py`.
pub const T_EXTENSION: &[(u32, &str)] = &[
    (466, "BookingRefID"),
    (48, "SecurityID"),
    (22, "SecurityIDSource"),
    (75, "TradeDate"),
    (64, "SettlDate"),
    (15, "Currency"),
    (79, "AllocAccount"),
    (80, "AllocQty"),
    (119, "SettlCurrAmt"),
];

/// Where each STE field travels in FIX (the same tag for every message type unless the table
/// says otherwise). Parties (`453`: `448` PartyID, `447=B` BIC, `452` PartyRole) name Broker
/// (role 1, executing firm) and InvMgr (13, order origination firm): inside NoSides (`552`) on
/// AE, at the top on J, inside NoSettlInst (`778`) on T. Settlement parties (`781`: `782`
/// SettlPartyID, `783=B`, `784` SettlPartyRole) in the NoDlvyInst (`85`) entry of the
/// allocation (J) or of the instruction (T) name Pset (role 10, settlement location) and
/// Custodian (28), whose SafekeepingAccount is its `785` SettlPartySubID (`786=10`, securities
/// account number). Constants with no STE field, written and not read back: `570=N`
/// PreviouslyReported and `37=NONE` OrderID (AE), `857=0` AllocNoOrdersType (J), `780=2`
/// AllocSettlInstType (full details, ALC), `165=2` SettlInstSource (institution) and `787=S`
/// DlvyInstType (securities) in NoDlvyInst (ALC, SET), `160=4` SettlInstMode (T).
pub const TAGS: &[(Field, &str)] = &[
    (Field::MsgId, "571 TradeReportID (NOE), 70 AllocID (ALC, NPR), 777 SettlInstMsgID and 162 SettlInstID (SET)"),
    (Field::Function, "487 TradeReportTransType 0/1/2 (NOE), 71 AllocTransType 0/2/1 (ALC, NPR), 163 SettlInstTransType N/C/R (SET): NEW/CAN/AMD"),
    (Field::RelatedId, "572 TradeReportRefID (NOE), 72 RefAllocID (ALC, NPR), 214 SettlInstRefID (SET)"),
    (Field::Sender, "49 SenderCompID"),
    (Field::SentAt, "60 TransactTime (UTC, YYYYMMDD-HH:MM:SS.sss)"),
    (Field::TradeRef, "17 ExecID (NOE), 466 BookingRefID (ALC, NPR, SET)"),
    (Field::Broker, "Parties: 448 with 452=1"),
    (Field::InvMgr, "Parties: 448 with 452=13"),
    (Field::Side, "54 Side 1 BUY / 2 SELL (in NoSides on NOE, in NoSettlInst on SET)"),
    (Field::Isin, "48 SecurityID with 22=4 (ISIN)"),
    (Field::TradeDate, "75 TradeDate (YYYYMMDD)"),
    (Field::SettleDate, "64 SettlDate (YYYYMMDD)"),
    (Field::Market, "30 LastMkt"),
    (Field::Price, "31 LastPx (NOE), 6 AvgPx (ALC, NPR)"),
    (Field::Ccy, "15 Currency (in NoSides on NOE)"),
    (Field::Qty, "32 LastQty (NOE); 53 Quantity and 80 AllocQty (ALC, NPR); 80 AllocQty (SET)"),
    (Field::AllocCount, "892 TotNoAllocs"),
    (Field::Account, "79 AllocAccount (in NoAllocs on ALC, NPR)"),
    (Field::Pset, "settlement parties: 782 with 784=10"),
    (Field::PaymentType, "172 SettlDeliveryType 0 DVP / 1 FOP"),
    (Field::Gross, "381 GrossTradeAmt"),
    (Field::Commission, "12 Commission with 13=3 (absolute), in NoAllocs"),
    (Field::Fees, "137 MiscFeeAmt in one NoMiscFees (136) entry with 139=7 (other), in NoAllocs"),
    (Field::Net, "154 AllocNetMoney, in NoAllocs"),
    (Field::Custodian, "settlement parties: 782 with 784=28"),
    (Field::SafekeepingAccount, "785 SettlPartySubID with 786=10, in the custodian's entry"),
    (Field::SettleAmount, "119 SettlCurrAmt"),
];

/// Where a FIX message type carries the fields every STE message has: its id, its function
/// (transaction type), the id it cancels or replaces, and the trade's reference.
struct Layout {
    id: u32,
    function: u32,
    related: u32,
    trade_ref: u32,
    /// The function's codes for NEW, CAN and AMD.
    codes: [&'static str; 3],
}

const FUNCTIONS: [&str; 3] = ["NEW", "CAN", "AMD"];

/// TradeCaptureReport (NOE).
const AE: Layout = Layout {
    id: 571,
    function: 487,
    related: 572,
    trade_ref: 17,
    codes: ["0", "1", "2"],
};
/// AllocationInstruction (ALC, NPR).
const J: Layout = Layout {
    id: 70,
    function: 71,
    related: 72,
    trade_ref: 466,
    codes: ["0", "2", "1"],
};
/// SettlementInstructions (SET).
const T: Layout = Layout {
    id: 777,
    function: 163,
    related: 214,
    trade_ref: 466,
    codes: ["N", "C", "R"],
};

impl Layout {
    /// The FIX code of an STE function (NEW for anything else: the validator judges it).
    fn code(&self, function: &str) -> &'static str {
        let at = FUNCTIONS.iter().position(|f| *f == function).unwrap_or(0);
        self.codes[at]
    }

    /// The STE function of a FIX code.
    fn function(&self, code: Option<&str>) -> Option<&'static str> {
        let at = self.codes.iter().position(|c| Some(*c) == code)?;
        Some(FUNCTIONS[at])
    }
}

fn dashes_to_fix_date(date: &str) -> String {
    date.replace('-', "")
}

/// A FIX date's shape: `YYYYMMDD`, eight digits.
pub(super) fn is_fix_date(date: &str) -> bool {
    date.len() == 8 && date.bytes().all(|b| b.is_ascii_digit())
}

fn fix_date_to_dashes(date: &str) -> Option<String> {
    is_fix_date(date).then(|| format!("{}-{}-{}", &date[..4], &date[4..6], &date[6..]))
}

/// RFC 3339 `2002-10-15T09:30:00.123Z` to `20021015-09:30:00.123`.
fn rfc3339_to_fix(text: &str) -> String {
    let text = text.trim_end_matches('Z');
    match text.split_once('T') {
        Some((date, time)) => format!("{}-{time}", date.replace('-', "")),
        None => text.to_owned(),
    }
}

fn fix_to_rfc3339(text: &str) -> Option<String> {
    let (date, time) = text.split_once('-')?;
    Some(format!("{}T{time}Z", fix_date_to_dashes(date)?))
}

/// A FIX message under construction: fields in the dictionary's order.
struct Builder<'a> {
    fields: &'a RawFields<'a>,
    out: Vec<(u32, String)>,
}

impl Builder<'_> {
    fn constant(&mut self, tag: u32, value: &str) {
        self.out.push((tag, value.to_owned()));
    }

    /// `tag` with the field's text, when the field is present.
    fn field(&mut self, tag: u32, field: Field) {
        if let Some(value) = self.fields.get(field) {
            self.out.push((tag, value.to_owned()));
        }
    }

    /// `tag` with the field's text changed by `convert`, when the field is present.
    fn converted(&mut self, tag: u32, field: Field, convert: impl Fn(&str) -> String) {
        if let Some(value) = self.fields.get(field) {
            self.out.push((tag, convert(value)));
        }
    }

    fn date(&mut self, tag: u32, field: Field) {
        self.converted(tag, field, dashes_to_fix_date);
    }

    fn sent_at(&mut self) {
        self.converted(60, Field::SentAt, rfc3339_to_fix);
    }

    fn side(&mut self) {
        self.converted(54, Field::Side, |side| {
            match side {
                "BUY" => "1",
                "SELL" => "2",
                other => other,
            }
            .to_owned()
        });
    }

    fn instrument(&mut self) {
        if let Some(isin) = self.fields.get(Field::Isin) {
            self.out.push((48, isin.to_owned()));
            self.out.push((22, "4".to_owned()));
        }
    }

    fn payment_type(&mut self) {
        self.converted(172, Field::PaymentType, |payment| {
            if payment == "FOP" { "1" } else { "0" }.to_owned()
        });
    }

    /// The Parties group (`453`) of Broker and InvMgr, when either is present.
    fn parties(&mut self) {
        let entries: Vec<(&str, &str)> = [(Field::Broker, "1"), (Field::InvMgr, "13")]
            .into_iter()
            .filter_map(|(field, role)| self.fields.get(field).map(|bic| (bic, role)))
            .collect();
        if entries.is_empty() {
            return;
        }
        self.out.push((PARTIES.count, entries.len().to_string()));
        for (bic, role) in entries {
            self.out.push((448, bic.to_owned()));
            self.out.push((447, "B".to_owned()));
            self.out.push((452, role.to_owned()));
        }
    }

    /// One NoDlvyInst (`85`) entry with the settlement parties (`781`) Custodian (its
    /// SafekeepingAccount as a sub-ID) and Pset, when either is present.
    fn delivery(&mut self) {
        let custodian = self.fields.get(Field::Custodian);
        let pset = self.fields.get(Field::Pset);
        let count = usize::from(custodian.is_some()) + usize::from(pset.is_some());
        if count == 0 {
            return;
        }
        self.out.extend([
            (85, "1".to_owned()),
            (165, "2".to_owned()),
            (787, "S".to_owned()),
            (SETTL_PARTIES.count, count.to_string()),
        ]);
        if let Some(custodian) = custodian {
            self.out.extend([
                (782, custodian.to_owned()),
                (783, "B".to_owned()),
                (784, "28".to_owned()),
            ]);
            if let Some(account) = self.fields.get(Field::SafekeepingAccount) {
                self.out.extend([
                    (801, "1".to_owned()),
                    (785, account.to_owned()),
                    (786, "10".to_owned()),
                ]);
            }
        }
        if let Some(pset) = pset {
            self.out.extend([
                (782, pset.to_owned()),
                (783, "B".to_owned()),
                (784, "10".to_owned()),
            ]);
        }
    }
}

/// The FIX application message of one canonical STE message (without the signature fields
/// and header fields 34/49/52/56, which the session adds), in the dictionary's field order.
pub fn to_fix(xml: &[u8]) -> Result<Vec<(u32, String)>, Rejection> {
    let fields = codec::parse_fields(xml)?;
    let kind = fields.get(Field::Type).unwrap_or("").to_owned();
    let function = fields.get(Field::Function).unwrap_or("");
    let mut b = Builder {
        fields: &fields,
        out: Vec::with_capacity(48),
    };
    match kind.as_str() {
        "NOE" => {
            b.constant(35, "AE");
            b.field(AE.id, Field::MsgId);
            b.constant(AE.function, AE.code(function));
            b.field(AE.related, Field::RelatedId);
            b.field(AE.trade_ref, Field::TradeRef);
            b.constant(570, "N");
            b.instrument();
            b.field(32, Field::Qty);
            b.field(31, Field::Price);
            b.field(30, Field::Market);
            b.date(75, Field::TradeDate);
            b.sent_at();
            b.date(64, Field::SettleDate);
            b.constant(552, "1");
            b.side();
            b.constant(37, "NONE");
            b.parties();
            b.field(15, Field::Ccy);
        }
        "ALC" | "NPR" => {
            b.constant(35, "J");
            b.field(J.id, Field::MsgId);
            b.constant(J.function, J.code(function));
            b.constant(626, if kind == "ALC" { "2" } else { "1" });
            b.field(J.related, Field::RelatedId);
            b.field(J.trade_ref, Field::TradeRef);
            b.constant(857, "0");
            b.side();
            b.instrument();
            b.field(53, Field::Qty);
            b.field(30, Field::Market);
            b.field(6, Field::Price);
            b.field(15, Field::Ccy);
            b.parties();
            b.date(75, Field::TradeDate);
            b.sent_at();
            b.date(64, Field::SettleDate);
            b.field(381, Field::Gross);
            b.field(892, Field::AllocCount);
            if fields.get(Field::Account).is_some() {
                b.constant(78, "1");
                b.field(79, Field::Account);
                b.field(80, Field::Qty);
                if fields.get(Field::Commission).is_some() {
                    b.field(12, Field::Commission);
                    b.constant(13, "3");
                }
                b.field(154, Field::Net);
                if fields.get(Field::Fees).is_some() {
                    b.constant(136, "1");
                    b.field(137, Field::Fees);
                    b.constant(139, "7");
                }
                if fields.get(Field::Pset).is_some() || fields.get(Field::PaymentType).is_some() {
                    b.constant(780, "2");
                }
                b.payment_type();
                b.delivery();
            }
        }
        "SET" => {
            b.constant(35, "T");
            b.field(T.id, Field::MsgId);
            b.constant(160, "4");
            b.sent_at();
            b.constant(778, "1");
            b.field(162, Field::MsgId);
            b.constant(T.function, T.code(function));
            b.field(T.related, Field::RelatedId);
            b.parties();
            b.side();
            b.payment_type();
            b.delivery();
            // The dictionary extension, in its order.
            b.field(T.trade_ref, Field::TradeRef);
            b.instrument();
            b.date(75, Field::TradeDate);
            b.date(64, Field::SettleDate);
            b.field(15, Field::Ccy);
            b.field(79, Field::Account);
            b.field(80, Field::Qty);
            b.field(119, Field::SettleAmount);
        }
        other => {
            return Err(Rejection::new(
                ReasonCode::Field,
                format!("no FIX mapping for message type {other:?}"),
            ))
        }
    }
    Ok(b.out)
}

/// The canonical STE message of a FIX application message from `sender`. A CAN keeps only
/// the fields an STE CAN has.
pub fn from_fix(message: &FixMessage, sender: &str) -> Result<Vec<u8>, Rejection> {
    let field_error = |detail: String| Rejection::new(ReasonCode::Field, detail);
    let mut fields = RawFields::default();
    let get = |tag: u32| message.get(tag).map(str::to_owned);
    let (kind, layout) = match (message.msg_type(), message.get(626)) {
        ("AE", _) => ("NOE", &AE),
        ("J", Some("2")) => ("ALC", &J),
        ("J", Some("1")) => ("NPR", &J),
        ("J", other) => {
            return Err(field_error(format!(
                "AllocType {other:?} is neither 1 nor 2"
            )))
        }
        ("T", _) => ("SET", &T),
        (other, _) => return Err(field_error(format!("no STE message for MsgType {other}"))),
    };
    fields.set(Field::Type, kind);
    if let Some(id) = get(layout.id) {
        fields.set(Field::MsgId, id);
    }
    let code = message.get(layout.function);
    let function = layout.function(code).ok_or_else(|| {
        field_error(format!(
            "tag {} has no STE function: {code:?}",
            layout.function
        ))
    })?;
    fields.set(Field::Function, function);
    fields.set(Field::Sender, sender.to_owned());
    if let Some(sent) = message.get(60) {
        fields.set(
            Field::SentAt,
            fix_to_rfc3339(sent).ok_or_else(|| field_error(format!("TransactTime {sent:?}")))?,
        );
    }
    if let Some(related) = get(layout.related) {
        fields.set(Field::RelatedId, related);
    }
    if let Some(trade_ref) = get(layout.trade_ref) {
        fields.set(Field::TradeRef, trade_ref);
    }
    for entry in message.entries(&PARTIES) {
        let role = entry.iter().find(|(tag, _)| *tag == 452).map(|(_, v)| *v);
        let field = match role {
            Some("1") => Field::Broker,
            Some("13") => Field::InvMgr,
            _ => continue,
        };
        if let Some((_, id)) = entry.iter().find(|(tag, _)| *tag == 448) {
            fields.set(field, (*id).to_owned());
        }
    }
    for entry in message.entries(&SETTL_PARTIES) {
        let value = |wanted: u32| {
            entry
                .iter()
                .find(|(tag, _)| *tag == wanted)
                .map(|(_, v)| *v)
        };
        let field = match value(784) {
            Some("28") => Field::Custodian,
            Some("10") => Field::Pset,
            _ => continue,
        };
        if let Some(id) = value(782) {
            fields.set(field, id.to_owned());
        }
        if let (Field::Custodian, Some(account)) = (field, value(785)) {
            fields.set(Field::SafekeepingAccount, account.to_owned());
        }
    }
    match message.get(54) {
        Some("1") => fields.set(Field::Side, "BUY"),
        Some("2") => fields.set(Field::Side, "SELL"),
        Some(other) => return Err(field_error(format!("Side {other:?}"))),
        None => {}
    }
    if let Some(isin) = get(48) {
        fields.set(Field::Isin, isin);
    }
    for (tag, field) in [(75, Field::TradeDate), (64, Field::SettleDate)] {
        if let Some(date) = message.get(tag) {
            fields.set(
                field,
                fix_date_to_dashes(date)
                    .ok_or_else(|| field_error(format!("tag {tag} {date:?}")))?,
            );
        }
    }
    let (price_tag, qty_tag) = if kind == "NOE" { (31, 32) } else { (6, 80) };
    for (tag, field) in [
        (30, Field::Market),
        (price_tag, Field::Price),
        (15, Field::Ccy),
        (qty_tag, Field::Qty),
        (892, Field::AllocCount),
        (79, Field::Account),
        (381, Field::Gross),
        (12, Field::Commission),
        (137, Field::Fees),
        (154, Field::Net),
        (119, Field::SettleAmount),
    ] {
        if let Some(value) = get(tag) {
            fields.set(field, value);
        }
    }
    if fields.get(Field::Qty).is_none() && kind != "NOE" {
        // A J without its NoAllocs entry: the quantity it allocates.
        if let Some(quantity) = get(53) {
            fields.set(Field::Qty, quantity);
        }
    }
    if let Some(delivery) = message.get(172) {
        fields.set(
            Field::PaymentType,
            match delivery {
                "0" => "DVP",
                "1" => "FOP",
                other => return Err(field_error(format!("SettlDeliveryType {other:?}"))),
            },
        );
    }
    if function == "CAN" {
        // FIX requires a cancel to repeat the cancelled message's required fields; STE's CAN
        // has only these.
        fields.keep_only(&ste_engine::validate::CAN_FIELDS);
    }
    Ok(codec::encode_fields(&fields).into_bytes())
}

#[cfg(test)]
mod tests {
    use super::super::codec::{encode, parse, signed_part};
    use super::*;
    use ste_engine::generator::{Generator, GeneratorConfig};
    use ste_engine::refdata::RefData;

    /// Every message of a faulty generated set that FIX can carry comes back as the same
    /// fields: STE → FIX → STE loses nothing.
    #[test]
    fn every_generated_message_maps_to_fix_and_back() {
        let refdata = RefData::embedded()
            .expect("reference data")
            .with_generated_keys();
        let config = GeneratorConfig {
            fault_rate: 0.5,
            shuffle: true,
            ..GeneratorConfig::clean(400)
        };
        let (mut mapped, mut total) = (0, 0);
        for line in Generator::new(&refdata, config) {
            let Ok(original) = codec::parse_fields(&line) else {
                continue;
            };
            total += 1;
            let Ok(pairs) = to_fix(&line) else { continue };
            let sender = original.get(Field::Sender).unwrap_or("").to_owned();
            let mut all = vec![pairs[0].clone(), (49, sender.clone())];
            all.extend(pairs[1..].iter().cloned());
            let mut signed = all.clone();
            signed.extend([(93, "2".to_owned()), (89, "00".to_owned())]);
            let raw = encode(&signed);
            if let Err(error) = signed_part(&raw) {
                panic!("{error:?}: {}", String::from_utf8_lossy(&raw));
            }
            let message = parse(&encode(&all)).expect("well-formed FIX");
            let Ok(back) = from_fix(&message, &sender) else {
                continue;
            };
            let back = codec::parse_fields(&back).expect("canonical XML");
            let a: Vec<(Field, &str)> = original.present().collect();
            let b: Vec<(Field, &str)> = back.present().collect();
            assert_eq!(a, b, "{}", String::from_utf8_lossy(&line));
            mapped += 1;
        }
        assert!(mapped * 10 >= total * 9, "{mapped} of {total} mapped");
    }

    /// The shipped dictionary extension lists exactly [`T_EXTENSION`], in its order, and a
    /// SET's T carries those tags in that order at the end of its NoSettlInst entry.
    #[test]
    fn the_dictionary_extension_is_what_t_carries_beyond_the_stock_dictionary() {
        let xml = include_str!("../../fix-dictionary/FIX44-STE-extension.xml");
        let attribute = |line: &str, name: &str| -> Option<String> {
            let start = line.find(&format!("{name}=\""))? + name.len() + 2;
            Some(line[start..start + line[start..].find('"')?].to_owned())
        };
        let listed: Vec<(u32, String)> = xml
            .lines()
            .filter(|line| line.trim_start().starts_with("<field "))
            .map(|line| {
                let number = attribute(line, "number").expect("a number");
                (
                    number.parse().expect("a tag"),
                    attribute(line, "name").expect("a name"),
                )
            })
            .collect();
        let expected: Vec<(u32, String)> = T_EXTENSION
            .iter()
            .map(|(tag, name)| (*tag, (*name).to_owned()))
            .collect();
        assert_eq!(listed, expected);

        let refdata = RefData::embedded()
            .expect("reference data")
            .with_generated_keys();
        let set = Generator::new(&refdata, GeneratorConfig::clean(1))
            .find(|line| String::from_utf8_lossy(line).contains("<Type>SET</Type>"))
            .expect("a SET");
        let pairs = to_fix(&set).expect("maps");
        let tail: Vec<u32> = pairs[pairs.len() - T_EXTENSION.len()..]
            .iter()
            .map(|(tag, _)| *tag)
            .collect();
        let tags: Vec<u32> = T_EXTENSION.iter().map(|(tag, _)| *tag).collect();
        assert_eq!(tail, tags);
    }
}
