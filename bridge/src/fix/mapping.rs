//! The mapping of STE messages to FIX application messages and back.

use ste_engine::codec::{self, Field, RawFields};
use ste_engine::reason::{ReasonCode, Rejection};

use super::codec::FixMessage;

/// Where each STE field travels in FIX (the same tag for every message type unless the table
/// says otherwise). Parties (`453` groups: `448` PartyID, `447=B` BIC, `452` PartyRole) carry
/// Broker (role 1, executing firm), InvMgr (13, order origination firm), Custodian (28) and Pset
/// (10, settlement location); the custodian's entry carries SafekeepingAccount as `523`.
pub const TAGS: &[(Field, &str)] = &[
    (Field::MsgId, "571 TradeReportID (NOE), 70 AllocID (ALC, NPR), 777 SettlInstMsgID (SET)"),
    (Field::Function, "487 TradeReportTransType 0/1/2 (NOE), 71 AllocTransType 0/2/1 (ALC, NPR), 163 SettlInstTransType N/C/R (SET): NEW/CAN/AMD"),
    (Field::RelatedId, "572 TradeReportRefID (NOE), 72 RefAllocID (ALC, NPR), 214 SettlInstRefID (SET)"),
    (Field::Sender, "49 SenderCompID"),
    (Field::SentAt, "60 TransactTime (UTC, YYYYMMDD-HH:MM:SS.sss)"),
    (Field::TradeRef, "17 ExecID (in a 124 NoExecs group in J)"),
    (Field::Side, "54 Side 1 BUY / 2 SELL"),
    (Field::Isin, "48 SecurityID with 22=4 (ISIN), and 55 Symbol"),
    (Field::TradeDate, "75 TradeDate (YYYYMMDD)"),
    (Field::SettleDate, "64 SettlDate (YYYYMMDD)"),
    (Field::Market, "30 LastMkt"),
    (Field::Price, "31 LastPx (NOE), 6 AvgPx (ALC, NPR)"),
    (Field::Ccy, "15 Currency"),
    (Field::Qty, "32 LastQty (NOE); 53 Quantity and 80 AllocQty (ALC, NPR); 80 AllocQty (SET)"),
    (Field::AllocCount, "892 TotNoAllocs"),
    (Field::Account, "79 AllocAccount (in a 78 NoAllocs group in J)"),
    (Field::PaymentType, "172 SettlDeliveryType 0 DVP / 1 FOP"),
    (Field::Gross, "381 GrossTradeAmt"),
    (Field::Commission, "12 Commission"),
    (Field::Fees, "137 MiscFeeAmt (136=1 group, 139=7 other)"),
    (Field::Net, "154 AllocNetMoney"),
    (Field::SettleAmount, "119 SettlCurrAmt"),
];

fn dashes_to_fix_date(date: &str) -> String {
    date.replace('-', "")
}

fn fix_date_to_dashes(date: &str) -> Option<String> {
    (date.len() == 8 && date.bytes().all(|b| b.is_ascii_digit()))
        .then(|| format!("{}-{}-{}", &date[..4], &date[4..6], &date[6..]))
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

/// The FIX application message of one canonical STE message (without the signature fields
/// and header fields 34/49/52/56, which the session adds).
pub fn to_fix(xml: &[u8]) -> Result<Vec<(u32, String)>, Rejection> {
    let fields = codec::parse_fields(xml)?;
    let get = |field: Field| fields.get(field).unwrap_or("").to_owned();
    let kind = get(Field::Type);
    let function = get(Field::Function);
    let mut out: Vec<(u32, String)> = Vec::new();
    let push = |out: &mut Vec<(u32, String)>, tag: u32, field: Field| {
        if let Some(value) = fields.get(field) {
            out.push((tag, value.to_owned()));
        }
    };
    let side = match fields.get(Field::Side) {
        Some("BUY") => "1",
        Some("SELL") => "2",
        Some(other) => other,
        None => "",
    }
    .to_owned();
    let parties = |out: &mut Vec<(u32, String)>| {
        let entries: Vec<(Field, &str)> = [
            (Field::Broker, "1"),
            (Field::InvMgr, "13"),
            (Field::Custodian, "28"),
            (Field::Pset, "10"),
        ]
        .into_iter()
        .filter(|(field, _)| fields.get(*field).is_some())
        .collect();
        if entries.is_empty() {
            return;
        }
        out.push((453, entries.len().to_string()));
        for (field, role) in entries {
            out.push((448, get(field)));
            out.push((447, "B".into()));
            out.push((452, role.into()));
            if field == Field::Custodian {
                if let Some(account) = fields.get(Field::SafekeepingAccount) {
                    out.push((523, account.to_owned()));
                }
            }
        }
    };
    let instrument = |out: &mut Vec<(u32, String)>| {
        if let Some(isin) = fields.get(Field::Isin) {
            out.push((55, isin.to_owned()));
            out.push((48, isin.to_owned()));
            out.push((22, "4".into()));
        }
    };
    let dates = |out: &mut Vec<(u32, String)>| {
        if let Some(date) = fields.get(Field::TradeDate) {
            out.push((75, dashes_to_fix_date(date)));
        }
        if let Some(date) = fields.get(Field::SettleDate) {
            out.push((64, dashes_to_fix_date(date)));
        }
    };
    match kind.as_str() {
        "NOE" => {
            out.push((35, "AE".into()));
            push(&mut out, 571, Field::MsgId);
            let trans = match function.as_str() {
                "CAN" => "1",
                "AMD" => "2",
                _ => "0",
            };
            out.push((487, trans.into()));
            push(&mut out, 572, Field::RelatedId);
            push(&mut out, 17, Field::TradeRef);
            instrument(&mut out);
            if !side.is_empty() {
                out.push((54, side));
            }
            push(&mut out, 32, Field::Qty);
            push(&mut out, 31, Field::Price);
            push(&mut out, 15, Field::Ccy);
            push(&mut out, 30, Field::Market);
            dates(&mut out);
            if let Some(sent) = fields.get(Field::SentAt) {
                out.push((60, rfc3339_to_fix(sent)));
            }
            parties(&mut out);
        }
        "ALC" | "NPR" => {
            out.push((35, "J".into()));
            push(&mut out, 70, Field::MsgId);
            let trans = match function.as_str() {
                "CAN" => "2",
                "AMD" => "1",
                _ => "0",
            };
            out.push((71, trans.into()));
            push(&mut out, 72, Field::RelatedId);
            out.push((626, if kind == "ALC" { "2" } else { "1" }.into()));
            if let Some(trade_ref) = fields.get(Field::TradeRef) {
                out.push((124, "1".into()));
                out.push((17, trade_ref.to_owned()));
            }
            if !side.is_empty() {
                out.push((54, side));
            }
            instrument(&mut out);
            push(&mut out, 53, Field::Qty);
            push(&mut out, 6, Field::Price);
            push(&mut out, 15, Field::Ccy);
            push(&mut out, 30, Field::Market);
            dates(&mut out);
            if let Some(sent) = fields.get(Field::SentAt) {
                out.push((60, rfc3339_to_fix(sent)));
            }
            push(&mut out, 892, Field::AllocCount);
            push(&mut out, 381, Field::Gross);
            parties(&mut out);
            if fields.get(Field::Account).is_some() {
                out.push((78, "1".into()));
                push(&mut out, 79, Field::Account);
                push(&mut out, 80, Field::Qty);
                push(&mut out, 154, Field::Net);
                push(&mut out, 12, Field::Commission);
                if let Some(fees) = fields.get(Field::Fees) {
                    out.push((136, "1".into()));
                    out.push((137, fees.to_owned()));
                    out.push((139, "7".into()));
                }
                if let Some(payment) = fields.get(Field::PaymentType) {
                    out.push((172, if payment == "FOP" { "1" } else { "0" }.into()));
                }
            }
        }
        "SET" => {
            out.push((35, "T".into()));
            push(&mut out, 777, Field::MsgId);
            let trans = match function.as_str() {
                "CAN" => "C",
                "AMD" => "R",
                _ => "N",
            };
            out.push((163, trans.into()));
            push(&mut out, 214, Field::RelatedId);
            push(&mut out, 17, Field::TradeRef);
            if !side.is_empty() {
                out.push((54, side));
            }
            instrument(&mut out);
            push(&mut out, 15, Field::Ccy);
            dates(&mut out);
            if let Some(sent) = fields.get(Field::SentAt) {
                out.push((60, rfc3339_to_fix(sent)));
            }
            push(&mut out, 79, Field::Account);
            push(&mut out, 80, Field::Qty);
            push(&mut out, 119, Field::SettleAmount);
            if let Some(payment) = fields.get(Field::PaymentType) {
                out.push((172, if payment == "FOP" { "1" } else { "0" }.into()));
            }
            parties(&mut out);
        }
        other => {
            return Err(Rejection::new(
                ReasonCode::Field,
                format!("no FIX mapping for message type {other:?}"),
            ))
        }
    }
    Ok(out)
}

/// The canonical STE message of a FIX application message from `sender`.
pub fn from_fix(message: &FixMessage, sender: &str) -> Result<Vec<u8>, Rejection> {
    let field_error = |detail: String| Rejection::new(ReasonCode::Field, detail);
    let mut fields = RawFields::default();
    let get = |tag: u32| message.get(tag).map(str::to_owned);
    let (kind, id_tag, trans_tag, ref_tag) = match (message.msg_type(), message.get(626)) {
        ("AE", _) => ("NOE", 571, 487, 572),
        ("J", Some("2")) => ("ALC", 70, 71, 72),
        ("J", Some("1")) => ("NPR", 70, 71, 72),
        ("J", other) => {
            return Err(field_error(format!(
                "AllocType {other:?} is neither 1 nor 2"
            )))
        }
        ("T", _) => ("SET", 777, 163, 214),
        (other, _) => return Err(field_error(format!("no STE message for MsgType {other}"))),
    };
    fields.set(Field::Type, kind);
    if let Some(id) = get(id_tag) {
        fields.set(Field::MsgId, id);
    }
    let function = match (kind, message.get(trans_tag)) {
        ("NOE", Some("0")) | ("ALC" | "NPR", Some("0")) | ("SET", Some("N")) => "NEW",
        ("NOE", Some("1")) | ("ALC" | "NPR", Some("2")) | ("SET", Some("C")) => "CAN",
        ("NOE", Some("2")) | ("ALC" | "NPR", Some("1")) | ("SET", Some("R")) => "AMD",
        (_, other) => {
            return Err(field_error(format!(
                "tag {trans_tag} has no STE function: {other:?}"
            )))
        }
    };
    fields.set(Field::Function, function);
    fields.set(Field::Sender, sender.to_owned());
    if let Some(sent) = message.get(60) {
        fields.set(
            Field::SentAt,
            fix_to_rfc3339(sent).ok_or_else(|| field_error(format!("TransactTime {sent:?}")))?,
        );
    }
    if let Some(related) = get(ref_tag) {
        fields.set(Field::RelatedId, related);
    }
    if let Some(trade_ref) = get(17) {
        fields.set(Field::TradeRef, trade_ref);
    }
    // Parties, in their group.
    let mut role: Option<String> = None;
    for (tag, value) in &message.fields {
        match tag {
            448 => role = Some(value.clone()),
            452 => {
                let field = match value.as_str() {
                    "1" => Some(Field::Broker),
                    "13" => Some(Field::InvMgr),
                    "28" => Some(Field::Custodian),
                    "10" => Some(Field::Pset),
                    _ => None,
                };
                if let (Some(field), Some(id)) = (field, role.take()) {
                    fields.set(field, id);
                }
            }
            523 => fields.set(Field::SafekeepingAccount, value.clone()),
            _ => {}
        }
    }
    match message.get(54) {
        Some("1") => fields.set(Field::Side, "BUY"),
        Some("2") => fields.set(Field::Side, "SELL"),
        Some(other) => return Err(field_error(format!("Side {other:?}"))),
        None => {}
    }
    if let Some(isin) = get(48).or_else(|| get(55)) {
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
    let price_tag = if kind == "NOE" { 31 } else { 6 };
    let qty_tag = if kind == "NOE" { 32 } else { 80 };
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
    Ok(codec::encode_fields(&fields).into_bytes())
}

#[cfg(test)]
mod tests {
    use super::super::codec::{encode, parse};
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
}
