//! The validator: a pure function from one inbound message (bytes, claimed sender, signature)
//! to a typed [`Msg`] or a [`Rejection`] with the reason code of the first failing check, in the
//! order of DESIGN.md section 3. It holds no state, so validators can be added freely.

use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;

use crate::codec::{parse_fields, Field, RawFields};
use crate::model::{parse_date, Decimal, Function, Msg, MsgType, PaymentType, Side, Text};
use crate::reason::{ReasonCode, Rejection};
use crate::refdata::{isin_check_digit_ok, Party, RefData, Role};

/// Largest message accepted, in bytes.
pub const MESSAGE_SIZE_MAX_BYTES: usize = 64 * 1024;
/// Longest MsgId, TradeRef, RelatedId or account text.
const IDENTIFIER_LEN_MAX: usize = 35;
/// Largest quantity accepted; keeps `Qty × Price` exact in a [`Decimal`].
const QTY_MAX: u64 = 1_000_000_000_000;
/// Largest AllocCount accepted: bounds the work of matching one trade.
pub const ALLOC_COUNT_MAX: u32 = 1000;

const COMMON: &[Field] = &[
    Field::MsgId,
    Field::Type,
    Field::Function,
    Field::Sender,
    Field::SentAt,
    Field::TradeRef,
    Field::Broker,
];

/// Every field a CAN may carry (and must, RelatedId included): the header and the trade key.
pub const CAN_FIELDS: [Field; 8] = [
    Field::MsgId,
    Field::Type,
    Field::Function,
    Field::Sender,
    Field::SentAt,
    Field::RelatedId,
    Field::TradeRef,
    Field::Broker,
];

const NOE_FIELDS: &[Field] = &[
    Field::InvMgr,
    Field::Side,
    Field::Isin,
    Field::TradeDate,
    Field::SettleDate,
    Field::Market,
    Field::Price,
    Field::Ccy,
    Field::Qty,
];

const ALC_FIELDS: &[Field] = &[
    Field::InvMgr,
    Field::Side,
    Field::Isin,
    Field::TradeDate,
    Field::SettleDate,
    Field::Market,
    Field::Price,
    Field::Ccy,
    Field::Qty,
    Field::AllocCount,
    Field::Account,
    Field::Pset,
    Field::PaymentType,
];

const NPR_FIELDS: &[Field] = &[
    Field::InvMgr,
    Field::Side,
    Field::Isin,
    Field::TradeDate,
    Field::SettleDate,
    Field::Price,
    Field::Ccy,
    Field::Qty,
    Field::Account,
    Field::Gross,
    Field::Commission,
    Field::Fees,
    Field::Net,
];

const SET_FIELDS: &[Field] = &[
    Field::InvMgr,
    Field::Side,
    Field::Isin,
    Field::TradeDate,
    Field::SettleDate,
    Field::Ccy,
    Field::Qty,
    Field::Account,
    Field::Pset,
    Field::PaymentType,
    Field::Custodian,
    Field::SafekeepingAccount,
    Field::SettleAmount,
];

/// The fields a message of this type carries besides the common header.
pub fn type_fields(msg_type: MsgType) -> &'static [Field] {
    match msg_type {
        MsgType::Noe => NOE_FIELDS,
        MsgType::Alc => ALC_FIELDS,
        MsgType::Npr => NPR_FIELDS,
        MsgType::Set => SET_FIELDS,
    }
}

const COMMON_MASK: u32 = Field::mask(COMMON);
const CAN_MASK: u32 = Field::mask(&CAN_FIELDS);

/// [`type_fields`] as a [`Field::mask`].
fn type_mask(msg_type: MsgType) -> u32 {
    match msg_type {
        MsgType::Noe => const { Field::mask(NOE_FIELDS) },
        MsgType::Alc => const { Field::mask(ALC_FIELDS) },
        MsgType::Npr => const { Field::mask(NPR_FIELDS) },
        MsgType::Set => const { Field::mask(SET_FIELDS) },
    }
}

fn field_error(detail: impl Into<String>) -> Rejection {
    Rejection::new(ReasonCode::Field, detail)
}

/// Who sent a rejected message: its verified signer, which its Sender names, with its MsgId and
/// trade key (Broker, TradeRef) as the message's XML gives them. For remembering the MsgId of a
/// message that was rejected after its signature checked out.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Identity {
    pub sender: String,
    pub msg_id: String,
    pub broker: String,
    pub trade_ref: String,
}

/// The [`Identity`] of a message signed by `signer`, from its parsed fields: only when its
/// Sender is the signer and it names a MsgId, Broker and TradeRef.
fn identity_of(fields: &RawFields<'_>, signer: &str) -> Option<Identity> {
    let text = |field: Field| {
        fields
            .get(field)
            .filter(|t| !t.is_empty())
            .map(str::to_owned)
    };
    (fields.get(Field::Sender) == Some(signer)).then_some(())?;
    Some(Identity {
        sender: signer.to_owned(),
        msg_id: text(Field::MsgId)?,
        broker: text(Field::Broker)?,
        trade_ref: text(Field::TradeRef)?,
    })
}

/// A message the validator refused: the rejection, and who sent it when the rejection came after
/// its signature checked out and its Sender was found to be its signer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub rejection: Rejection,
    pub identity: Option<Box<Identity>>,
}

/// Validates one inbound message end to end: size, signature, parse, fields, reference data,
/// entitlement and dates.
pub fn validate(
    refdata: &RefData,
    bytes: &[u8],
    claimed_sender: Option<&str>,
    signature: Option<&[u8]>,
) -> Result<Msg, Rejection> {
    validate_message(refdata, bytes, claimed_sender, signature).map_err(|refusal| refusal.rejection)
}

/// [`validate`], telling who sent a refused message when that is known.
///
/// The signer is the sender: once the signature of `claimed_sender` checks out, the Sender of
/// the parsed message (whatever comments, prefixes or spacing surround it) must be that signer
/// before any other check runs, and what is remembered of a refusal is keyed by the signer.
pub fn validate_message(
    refdata: &RefData,
    bytes: &[u8],
    claimed_sender: Option<&str>,
    signature: Option<&[u8]>,
) -> Result<Msg, Refusal> {
    let unknown = |rejection: Rejection| Refusal {
        rejection,
        identity: None,
    };
    if bytes.len() > MESSAGE_SIZE_MAX_BYTES {
        return Err(unknown(Rejection::new(
            ReasonCode::Size,
            format!(
                "message of {} bytes is larger than {MESSAGE_SIZE_MAX_BYTES}",
                bytes.len()
            ),
        )));
    }
    let (Some(sender), Some(signature)) = (claimed_sender, signature) else {
        return Err(unknown(Rejection::new(
            ReasonCode::Sig,
            "message is not signed",
        )));
    };
    let Some(verified) = refdata.verify_signature(sender, bytes, signature) else {
        return Err(unknown(Rejection::new(
            ReasonCode::Sig,
            format!("no signing key for sender {sender}"),
        )));
    };
    if !verified {
        return Err(unknown(Rejection::new(
            ReasonCode::Sig,
            format!("signature does not match the key of {sender}"),
        )));
    }
    let fields = parse_fields(bytes).map_err(unknown)?;
    match fields.get(Field::Sender) {
        Some(named) if named == sender => {}
        Some(named) => {
            return Err(unknown(Rejection::new(
                ReasonCode::Sig,
                format!("message names sender {named:?} but is signed by {sender}"),
            )))
        }
        None => {
            return Err(unknown(field_error(format!(
                "missing mandatory field {}",
                Field::Sender.name()
            ))))
        }
    }
    let refused = |rejection: Rejection| Refusal {
        rejection,
        identity: identity_of(&fields, sender).map(Box::new),
    };
    let msg = typed_fields(&fields).map_err(refused)?;
    check_reference_data(refdata, &msg).map_err(refused)?;
    Ok(msg)
}

fn is_bic(text: &str) -> bool {
    let bytes = text.as_bytes();
    (bytes.len() == 8 || bytes.len() == 11)
        && bytes[..6].iter().all(u8::is_ascii_uppercase)
        && bytes[6..]
            .iter()
            .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit())
}

fn is_identifier(text: &str) -> bool {
    !text.is_empty()
        && text.len() <= IDENTIFIER_LEN_MAX
        && text.bytes().all(|b| b.is_ascii_graphic())
}

/// Checks presence and format of every field and builds the typed message (E_FIELD).
pub fn typed_fields(fields: &RawFields<'_>) -> Result<Msg, Rejection> {
    let require = |field: Field| -> Result<&str, Rejection> {
        fields
            .get(field)
            .ok_or_else(|| field_error(format!("missing mandatory field {}", field.name())))
    };
    let msg_type_text = require(Field::Type)?;
    let msg_type = MsgType::parse(msg_type_text)
        .ok_or_else(|| field_error(format!("unknown Type {msg_type_text:?}")))?;
    let function_text = require(Field::Function)?;
    let function = Function::parse(function_text)
        .ok_or_else(|| field_error(format!("unknown Function {function_text:?}")))?;

    // Which fields are there, once; what must be there and what may not, as masks of them.
    let present = fields.present_mask();
    let require_all = |required: &[Field], mask: u32| -> Result<(), Rejection> {
        if mask & !present == 0 {
            return Ok(());
        }
        required
            .iter()
            .try_for_each(|field| require(*field).map(drop))
    };
    require_all(COMMON, COMMON_MASK)?;
    match function {
        Function::Can => {
            require(Field::RelatedId)?;
            if let Some(field) = Field::first_of(present & !CAN_MASK) {
                return Err(field_error(format!(
                    "field {} is not allowed in a CAN",
                    field.name()
                )));
            }
        }
        Function::New | Function::Amd => {
            if function == Function::Amd {
                require(Field::RelatedId)?;
            } else if fields.get(Field::RelatedId).is_some() {
                return Err(field_error("RelatedId is only allowed in a CAN or AMD"));
            }
            let (allowed, allowed_mask) = (type_fields(msg_type), type_mask(msg_type));
            require_all(allowed, allowed_mask)?;
            let stray = present
                & !(COMMON_MASK | const { Field::mask(&[Field::RelatedId]) } | allowed_mask);
            if let Some(field) = Field::first_of(stray) {
                return Err(field_error(format!(
                    "field {} does not belong in a {}",
                    field.name(),
                    msg_type.as_str()
                )));
            }
        }
    }

    let identifier = |field: Field| -> Result<Option<Text>, Rejection> {
        match fields.get(field) {
            None => Ok(None),
            Some(text) if is_identifier(text) => Ok(Some(Text::new(text))),
            Some(text) => Err(field_error(format!(
                "{} {text:?} is not 1 to {IDENTIFIER_LEN_MAX} printable characters",
                field.name()
            ))),
        }
    };
    let bic = |field: Field| -> Result<Option<Text>, Rejection> {
        match fields.get(field) {
            None => Ok(None),
            Some(text) if is_bic(text) => Ok(Some(Text::new(text))),
            Some(text) => Err(field_error(format!(
                "{} {text:?} is not a BIC",
                field.name()
            ))),
        }
    };
    let decimal = |field: Field| -> Result<Option<Decimal>, Rejection> {
        fields
            .get(field)
            .map(|text| {
                Decimal::parse(text).ok_or_else(|| {
                    field_error(format!(
                        "{} {text:?} is not a decimal with at most 6 fraction digits",
                        field.name()
                    ))
                })
            })
            .transpose()
    };
    let date = |field: Field| -> Result<Option<time::Date>, Rejection> {
        fields
            .get(field)
            .map(|text| {
                parse_date(text).ok_or_else(|| {
                    field_error(format!(
                        "{} {text:?} is not a YYYY-MM-DD date",
                        field.name()
                    ))
                })
            })
            .transpose()
    };
    let code =
        |field: Field, len: usize, digits_allowed: bool| -> Result<Option<Text>, Rejection> {
            match fields.get(field) {
                None => Ok(None),
                Some(text)
                    if text.len() == len
                        && text.bytes().all(|b| {
                            b.is_ascii_uppercase() || (digits_allowed && b.is_ascii_digit())
                        }) =>
                {
                    Ok(Some(Text::new(text)))
                }
                Some(text) => Err(field_error(format!(
                    "{} {text:?} is malformed",
                    field.name()
                ))),
            }
        };

    let sent_at = require(Field::SentAt)?;
    match OffsetDateTime::parse(sent_at, &Rfc3339) {
        Ok(parsed) if parsed.offset().is_utc() => {}
        _ => {
            return Err(field_error(format!(
                "SentAt {sent_at:?} is not an RFC 3339 UTC timestamp"
            )))
        }
    }
    let side = fields
        .get(Field::Side)
        .map(|text| {
            Side::parse(text)
                .ok_or_else(|| field_error(format!("Side {text:?} is not BUY or SELL")))
        })
        .transpose()?;
    let payment_type = fields
        .get(Field::PaymentType)
        .map(|text| {
            PaymentType::parse(text)
                .ok_or_else(|| field_error(format!("PaymentType {text:?} is not DVP or FOP")))
        })
        .transpose()?;
    let qty = fields
        .get(Field::Qty)
        .map(|text| match text.parse::<u64>() {
            Ok(value)
                if value > 0 && value <= QTY_MAX && text.bytes().all(|b| b.is_ascii_digit()) =>
            {
                Ok(value)
            }
            _ => Err(field_error(format!(
                "Qty {text:?} is not a positive integer up to {QTY_MAX}"
            ))),
        })
        .transpose()?;
    let alloc_count = fields
        .get(Field::AllocCount)
        .map(|text| match text.parse::<u32>() {
            Ok(value)
                if value > 0
                    && value <= ALLOC_COUNT_MAX
                    && text.bytes().all(|b| b.is_ascii_digit()) =>
            {
                Ok(value)
            }
            _ => Err(field_error(format!(
                "AllocCount {text:?} is not a positive integer up to {ALLOC_COUNT_MAX}"
            ))),
        })
        .transpose()?;
    let isin = fields.get(Field::Isin);
    if let Some(text) = isin {
        let bytes = text.as_bytes();
        let well_formed = bytes.len() == 12
            && bytes[..2].iter().all(u8::is_ascii_uppercase)
            && bytes[2..11]
                .iter()
                .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit())
            && bytes[11].is_ascii_digit();
        if !well_formed {
            return Err(field_error(format!(
                "Isin {text:?} is not 12 ISIN characters"
            )));
        }
    }

    Ok(Msg {
        msg_id: identifier(Field::MsgId)?.unwrap_or_default(),
        msg_type,
        function,
        sender: bic(Field::Sender)?.unwrap_or_default(),
        sent_at: Text::new(sent_at),
        related_id: identifier(Field::RelatedId)?,
        trade_ref: identifier(Field::TradeRef)?.unwrap_or_default(),
        broker: bic(Field::Broker)?.unwrap_or_default(),
        inv_mgr: bic(Field::InvMgr)?,
        side,
        isin: isin.map(Text::new),
        trade_date: date(Field::TradeDate)?,
        settle_date: date(Field::SettleDate)?,
        market: code(Field::Market, 4, true)?,
        price: decimal(Field::Price)?,
        ccy: code(Field::Ccy, 3, false)?,
        qty,
        alloc_count,
        account: identifier(Field::Account)?,
        pset: bic(Field::Pset)?,
        payment_type,
        gross: decimal(Field::Gross)?,
        commission: decimal(Field::Commission)?,
        fees: decimal(Field::Fees)?,
        net: decimal(Field::Net)?,
        custodian: bic(Field::Custodian)?,
        safekeeping_account: identifier(Field::SafekeepingAccount)?,
        settle_amount: decimal(Field::SettleAmount)?,
    })
}

/// The reference-data, entitlement and date checks, in reason-code order.
pub fn check_reference_data(refdata: &RefData, msg: &Msg) -> Result<(), Rejection> {
    if let Some(ccy) = &msg.ccy {
        if refdata.currency(ccy).is_none() {
            return Err(Rejection::new(
                ReasonCode::Ccy,
                format!("currency {ccy} is not in currencies.csv"),
            ));
        }
    }
    let parties: [(&str, Option<&str>, Role); 5] = [
        ("Sender", Some(msg.sender.as_str()), Role::Broker),
        ("Broker", Some(msg.broker.as_str()), Role::Broker),
        ("InvMgr", msg.inv_mgr.as_deref(), Role::InvMgr),
        ("Custodian", msg.custodian.as_deref(), Role::Custodian),
        ("Pset", msg.pset.as_deref(), Role::Csd),
    ];
    // Each party looked up once (the Broker is often the Sender), for its country and then its
    // role: a participant's BIC country was looked up when the tables were loaded, so only a
    // BIC that is no participant's needs a search among the countries. The checks and their
    // order are those of DESIGN.md section 3 all the same.
    let mut found: [Option<Party>; 5] = [None; 5];
    for (at, (_, bic, _)) in parties.iter().enumerate() {
        found[at] = match (at, bic) {
            (1, Some(bic)) if Some(*bic) == parties[0].1 => found[0],
            (_, Some(bic)) => refdata.party(bic),
            (_, None) => None,
        };
    }
    for ((name, bic, _), found) in parties.iter().zip(&found) {
        if let Some(bic) = bic {
            let country = &bic[4..6];
            let known = match found {
                Some(party) => party.bic_country_known,
                None => refdata.has_country(country),
            };
            if !known {
                return Err(Rejection::new(
                    ReasonCode::Country,
                    format!("{name} {bic} has country {country}, not in countries.csv"),
                ));
            }
        }
    }
    if let Some(mic) = &msg.market {
        if refdata.market(mic).is_none() {
            return Err(Rejection::new(
                ReasonCode::Market,
                format!("market {mic} is not in markets.csv"),
            ));
        }
    }
    let listing = match &msg.isin {
        // A listed ISIN's check digit was checked when the tables were loaded.
        Some(isin) => match refdata.listing(isin) {
            Some(listing) if listing.isin_check_digit_ok => Some(listing),
            listed => {
                if !isin_check_digit_ok(isin) {
                    return Err(Rejection::new(
                        ReasonCode::Isin,
                        format!("ISIN {isin} has a wrong check digit"),
                    ));
                }
                let Some(listing) = listed else {
                    return Err(Rejection::new(
                        ReasonCode::Isin,
                        format!("ISIN {isin} is not in securities.csv"),
                    ));
                };
                Some(listing)
            }
        },
        None => None,
    };
    // The Sender's role is checked by entitlement below, not here.
    for ((name, bic, role), found) in parties.iter().zip(&found).skip(1) {
        if let Some(bic) = bic {
            match found {
                Some(party) if party.role == *role => {}
                Some(party) => {
                    return Err(Rejection::new(
                        ReasonCode::Party,
                        format!(
                            "{name} {bic} is a {}, not a {}",
                            party.role.as_str(),
                            role.as_str()
                        ),
                    ))
                }
                None => {
                    return Err(Rejection::new(
                        ReasonCode::Party,
                        format!("{name} {bic} is not in participants.csv"),
                    ))
                }
            }
        }
    }
    check_entitlement(refdata, msg)?;
    if let (Some(trade_date), Some(settle_date)) = (msg.trade_date, msg.settle_date) {
        // The security is known here: a NEW or AMD carries an Isin, checked above.
        for (name, date) in [("TradeDate", trade_date), ("SettleDate", settle_date)] {
            let business_day = match listing {
                Some(listing) => refdata.is_business_day_in(listing, date),
                None => refdata.is_business_day("", date),
            };
            if !business_day {
                // The market's name is read from the security's row only to say so.
                let market = msg.isin.as_deref().and_then(|isin| refdata.security(isin));
                let market = market.map(|s| s.market.as_str()).unwrap_or_default();
                return Err(Rejection::new(
                    ReasonCode::Date,
                    format!("{name} {date} is not a business day of {market}"),
                ));
            }
        }
        if settle_date < trade_date {
            return Err(Rejection::new(
                ReasonCode::Date,
                format!("SettleDate {settle_date} is before TradeDate {trade_date}"),
            ));
        }
    }
    Ok(())
}

/// E_AUTH: NOE and NPR come from the executing broker; ALC from the investment manager; SET from
/// the investment manager or the custodian it names, and that custodian must act for the
/// investment manager (custodians.csv), whoever sends it. A CAN carries no InvMgr or Custodian, so its sender is checked by role
/// here; the matcher only lets it name the sender's own messages, and lets it count in a trade
/// only when its sender is a party of that trade.
fn check_entitlement(refdata: &RefData, msg: &Msg) -> Result<(), Rejection> {
    let sender = msg.sender.as_str();
    if let (Some(custodian), Some(inv_mgr)) = (&msg.custodian, &msg.inv_mgr) {
        if !refdata.acts_for(custodian, inv_mgr) {
            return Err(Rejection::new(
                ReasonCode::Auth,
                format!("custodian {custodian} does not act for {inv_mgr} (custodians.csv)"),
            ));
        }
    }
    let entitled = match (msg.function, msg.msg_type) {
        (Function::Can, MsgType::Noe | MsgType::Npr) => sender == msg.broker,
        (Function::Can, MsgType::Alc) => {
            matches!(refdata.participant(sender), Some(p) if p.role == Role::InvMgr)
        }
        (Function::Can, MsgType::Set) => matches!(
            refdata.participant(sender),
            Some(p) if p.role == Role::InvMgr || p.role == Role::Custodian
        ),
        (_, MsgType::Noe | MsgType::Npr) => sender == msg.broker,
        (_, MsgType::Alc) => msg.inv_mgr.as_deref() == Some(sender),
        (_, MsgType::Set) => {
            msg.inv_mgr.as_deref() == Some(sender) || msg.custodian.as_deref() == Some(sender)
        }
    };
    if entitled {
        Ok(())
    } else {
        Err(Rejection::new(
            ReasonCode::Auth,
            format!(
                "{sender} is not entitled to send this {} {}",
                msg.msg_type.as_str(),
                msg.function.as_str()
            ),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generator::{Generator, GeneratorConfig};
    use crate::refdata::tests::tables_with_faulty_rows;

    /// A listed participant and a listed security are held to the checks an unlisted one is,
    /// though the validator reads what it needs of them from beside the keys.
    #[test]
    fn a_listed_row_is_held_to_the_country_and_check_digit_of_its_key() {
        let (refdata, faulty_isin) = tables_with_faulty_rows();
        let line = Generator::new(&refdata, GeneratorConfig::clean(1))
            .next()
            .expect("a NOE");
        let noe = typed_fields(&parse_fields(&line).expect("parses")).expect("typed");
        assert_eq!(noe.msg_type, MsgType::Noe);
        assert_eq!(check_reference_data(&refdata, &noe), Ok(()));
        let code_of = |change: &dyn Fn(&mut Msg)| {
            let mut msg = noe.clone();
            change(&mut msg);
            check_reference_data(&refdata, &msg).map_err(|rejection| rejection.code)
        };
        // A broker of participants.csv whose BIC names a country countries.csv lacks.
        let listed_broker = |msg: &mut Msg| {
            msg.sender = Text::new("BRKRQQ22XXX");
            msg.broker = Text::new("BRKRQQ22XXX");
        };
        assert_eq!(code_of(&listed_broker), Err(ReasonCode::Country));
        assert_eq!(
            code_of(&|msg| msg.broker = Text::new("BRKRQQ22XXX")),
            Err(ReasonCode::Country)
        );
        // Country comes before Party: a broker named as the investment manager.
        assert_eq!(
            code_of(&|msg| msg.inv_mgr = Some(Text::new("BRKRQQ22XXX"))),
            Err(ReasonCode::Country)
        );
        let mut msg = noe.clone();
        msg.isin = Some(Text::new(&faulty_isin));
        let rejection = check_reference_data(&refdata, &msg).expect_err("a wrong check digit");
        assert_eq!(rejection.code, ReasonCode::Isin);
        assert!(
            rejection.detail.contains("check digit"),
            "{}",
            rejection.detail
        );
        // A Saturday is no business day of any market.
        let saturday = parse_date("2026-08-01");
        assert_eq!(
            code_of(&|msg| msg.trade_date = saturday),
            Err(ReasonCode::Date)
        );
    }
}
