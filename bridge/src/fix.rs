//! FIX 4.4 over TCP: the session layer and the mapping of STE messages to FIX application
//! messages.
//!
//! # Session
//! - Logon (`35=A`) first, with `49` SenderCompID = the participant's BIC, `56` TargetCompID =
//!   `STE`, `108` HeartBtInt, `52` SendingTime within two minutes of the engine's clock, and `554`
//!   Password = hex HMAC-SHA256 under the participant's key of `STE-FIX-LOGON\0` ‖ SendingTime ‖
//!   BIC. A bad password gets a Logout with `58=E_SIG …`, an unknown participant `58=E_AUTH …`.
//!   Sequence numbers start at 1 on both sides at every logon.
//! - Heartbeat (`0`) after HeartBtInt seconds of silence from the engine; TestRequest (`1`)
//!   after HeartBtInt + 20% of silence from the participant, answered by a Heartbeat with its
//!   `112`; a participant that stays silent another HeartBtInt is logged out (`58=E_TIMEOUT`).
//! - A MsgSeqNum above the expected one is a gap: the engine sends a ResendRequest (`2`,
//!   `7`=expected, `16=0`) and sets aside later messages until the gap is filled (messages
//!   resent with `43=Y`, or a SequenceReset). A MsgSeqNum below the expected one without
//!   `43=Y` is fatal: Logout `58=MsgSeqNum too low`. A ResendRequest from the participant is
//!   answered with a SequenceReset-GapFill (`4`, `123=Y`): answers are idempotent, so a
//!   participant re-sends an application message to hear its answer again (a duplicate ACK).
//! - A garbled message (bad BodyLength or CheckSum) is ignored, as FIX prescribes; the gap it
//!   leaves is recovered by the ResendRequest.
//! - Logout (`5`) is answered with a Logout once the answers in flight are sent.
//!
//! # Application messages
//! Each carries `93`/`89` (SignatureLength, Signature): the hex HMAC-SHA256, under the key of
//! the sender (`49`), of the message's bytes from `35=` up to `93=`. Every byte with meaning
//! must be covered ([`signed_part`]): `35` comes right after `9`, `93` and `89` are the last
//! fields before `10`, and no tag appears twice outside the Parties group (`453`), whose
//! entries are well formed and name each role once. A message that breaks this gets a session
//! Reject (`35=3` with `373` SessionRejectReason and `371` RefTagID) and is stored as an
//! exception (E_SIG for bytes outside the signed part, E_PARSE for a repeated tag); it is never
//! mapped. One that keeps it has its signature checked, is converted to the canonical XML and
//! signed for the validator.
//!
//! | STE | FIX message | ACK / NAK |
//! |---|---|---|
//! | NOE | TradeCaptureReport `AE` | TradeCaptureReportAck `AR`: `939` TrdRptStatus 0 / 1 |
//! | ALC | AllocationInstruction `J` with `626` AllocType=2 (preliminary) | AllocationInstructionAck `P`: `87` AllocStatus 0 / 1 |
//! | NPR | AllocationInstruction `J` with `626` AllocType=1 (calculated) | AllocationInstructionAck `P` |
//! | SET | SettlementInstructions `T` | ConfirmationAck `AU`: `940` AffirmStatus 3 (affirmed) / 2 (rejected) |
//!
//! The NAK's `58` Text is the reason code; an ACK of a duplicate says `58=DUPLICATE`. CLS and
//! status advices are pushed as XML messages (`35=n`, `212`/`213` XmlDataLen/XmlData).
//! Field by field, see [`TAGS`].

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use ste_engine::codec::{self, Field, RawFields};
use ste_engine::pipeline::{AckResult, Envelope};
use ste_engine::reason::{ReasonCode, Rejection};
use ste_engine::sign::{self, KeyedMac};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch, Semaphore};
use tracing::{debug, warn};

use crate::frame::PushClass;
use crate::gateway::{GatewayHandle, Pushed, Reply, Subscriber};
use crate::listener::accept_loop;

/// The field separator.
pub const SOH: u8 = 0x01;
/// BeginString.
pub const BEGIN_STRING: &str = "FIX.4.4";
/// The engine's CompID.
pub const ENGINE_COMP_ID: &str = "STE";
/// What the logon password covers before SendingTime and the BIC.
const LOGON_CONTEXT: &[u8] = b"STE-FIX-LOGON\0";
/// Largest FIX message body accepted: the canonical message limit, since a FIX message is the
/// more compact of the two.
pub const BODY_MAX_BYTES: usize = ste_engine::validate::MESSAGE_SIZE_MAX_BYTES;
/// Bytes of messages a session may hold behind a sequence gap before it is logged out.
pub const HELD_BYTES_MAX: usize = 1024 * 1024;
/// Messages a session may hold behind a sequence gap before it is logged out.
pub const HELD_MESSAGES_MAX: usize = 1024;
/// Largest MsgSeqNum or NewSeqNo accepted (FIX's SeqNum is a 32-bit field in practice).
pub const SEQ_NUM_MAX: u64 = u32::MAX as u64;
/// How far a logon's SendingTime may be from the engine's clock.
const LOGON_CLOCK_SKEW: Duration = Duration::from_secs(120);

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

/// The FIX fields of one message, in order (repeating groups keep their order).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FixMessage {
    pub fields: Vec<(u32, String)>,
}

impl FixMessage {
    /// The first value of `tag`.
    pub fn get(&self, tag: u32) -> Option<&str> {
        self.fields
            .iter()
            .find(|(t, _)| *t == tag)
            .map(|(_, v)| v.as_str())
    }

    /// The message type (`35`).
    pub fn msg_type(&self) -> &str {
        self.get(35).unwrap_or("")
    }
}

/// Why bytes are not a FIX message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FixError {
    #[error("garbled: {0}")]
    Garbled(String),
    #[error("message body of {0} bytes is larger than {BODY_MAX_BYTES}")]
    TooLarge(usize),
}

/// The checksum of FIX bytes: their sum modulo 256.
pub fn checksum(bytes: &[u8]) -> u8 {
    bytes.iter().fold(0_u8, |sum, b| sum.wrapping_add(*b))
}

/// Encodes fields (from `35` on, without 8, 9 and 10) as one FIX message.
pub fn encode(body_fields: &[(u32, String)]) -> Vec<u8> {
    let mut body = Vec::with_capacity(256);
    for (tag, value) in body_fields {
        body.extend_from_slice(tag.to_string().as_bytes());
        body.push(b'=');
        body.extend_from_slice(value.as_bytes());
        body.push(SOH);
    }
    let mut out = Vec::with_capacity(body.len() + 32);
    out.extend_from_slice(format!("8={BEGIN_STRING}\u{1}9={}\u{1}", body.len()).as_bytes());
    out.extend_from_slice(&body);
    let sum = checksum(&out);
    out.extend_from_slice(format!("10={sum:03}\u{1}").as_bytes());
    out
}

/// Parses one whole FIX message, checking BeginString, BodyLength and CheckSum.
pub fn parse(bytes: &[u8]) -> Result<FixMessage, FixError> {
    let garbled = |why: &str| FixError::Garbled(why.to_owned());
    let mut fields = Vec::new();
    let mut body_start = None;
    let mut checksum_at = None;
    let mut position = 0;
    for piece in bytes.split(|b| *b == SOH) {
        let start = position;
        position += piece.len() + 1;
        if piece.is_empty() {
            if position <= bytes.len() {
                return Err(garbled("an empty field"));
            }
            break;
        }
        let (tag, value) = piece
            .iter()
            .position(|b| *b == b'=')
            .map(|at| (&piece[..at], &piece[at + 1..]))
            .ok_or_else(|| garbled("a field without '='"))?;
        let tag: u32 = std::str::from_utf8(tag)
            .ok()
            .and_then(|t| t.parse().ok())
            .ok_or_else(|| garbled("a tag that is not a number"))?;
        let value = std::str::from_utf8(value)
            .map_err(|_| garbled("a value that is not UTF-8"))?
            .to_owned();
        if fields.len() == 1 && tag == 9 {
            body_start = Some(position);
        }
        if tag == 10 {
            checksum_at = Some(start);
        }
        fields.push((tag, value));
    }
    match fields.first() {
        Some((8, begin)) if begin == BEGIN_STRING => {}
        _ => return Err(garbled("BeginString is not FIX.4.4")),
    }
    let declared: usize = match fields.get(1) {
        Some((9, length)) => length.parse().map_err(|_| garbled("bad BodyLength"))?,
        _ => return Err(garbled("BodyLength is not the second field")),
    };
    let (Some(body_start), Some(checksum_at)) = (body_start, checksum_at) else {
        return Err(garbled("no CheckSum"));
    };
    if checksum_at < body_start || checksum_at - body_start != declared {
        return Err(garbled("BodyLength does not match the body"));
    }
    let Some((10, sum)) = fields.last() else {
        return Err(garbled("CheckSum is not the last field"));
    };
    if sum.parse::<u8>().ok() != Some(checksum(&bytes[..checksum_at])) {
        return Err(garbled("CheckSum does not match"));
    }
    fields.remove(0);
    fields.remove(0);
    fields.pop();
    Ok(FixMessage { fields })
}

/// Why an application message is refused before it is mapped: its bytes are not all covered by
/// its signature, or it says one thing twice. Answered by a session Reject (`35=3`) and kept as
/// an exception with `code`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StructureError {
    /// SessionRejectReason (`373`).
    pub session_reason: u32,
    /// RefTagID (`371`).
    pub tag: u32,
    /// The reason code of the stored exception.
    pub code: ReasonCode,
    pub detail: String,
}

/// The members of the Parties group (`453` NoPartyIDs), the only tags that may repeat.
const PARTY_GROUP_TAGS: [u32; 4] = [448, 447, 452, 523];

/// The bytes an application message's signature covers, once its shape guarantees that they
/// are every byte with meaning: `8` and `9` first, then `35`, then the fields, then `93` and
/// `89` and nothing but `10` after them; no tag twice outside the Parties group, whose entries
/// are well formed, as many as `453` says, each role once. The covered bytes run from `35=` up
/// to `93=`.
pub fn signed_part(raw: &[u8]) -> Result<&[u8], StructureError> {
    let refuse = |session_reason: u32, tag: u32, code: ReasonCode, detail: String| StructureError {
        session_reason,
        tag,
        code,
        detail,
    };
    // (tag, value, offset of the field's first byte)
    let mut fields: Vec<(u32, &[u8], usize)> = Vec::new();
    let mut offset = 0;
    for piece in raw.split(|b| *b == SOH) {
        let start = offset;
        offset += piece.len() + 1;
        if piece.is_empty() {
            continue;
        }
        let Some(equals) = piece.iter().position(|b| *b == b'=') else {
            return Err(refuse(
                0,
                0,
                ReasonCode::Parse,
                "a field without '='".into(),
            ));
        };
        let tag = std::str::from_utf8(&piece[..equals])
            .ok()
            .and_then(|t| t.parse::<u32>().ok())
            .ok_or_else(|| refuse(0, 0, ReasonCode::Parse, "a tag that is not a number".into()))?;
        fields.push((tag, &piece[equals + 1..], start));
    }
    let tags: Vec<u32> = fields.iter().map(|(tag, _, _)| *tag).collect();
    if tags.len() < 6 || tags[0] != 8 || tags[1] != 9 || tags[tags.len() - 1] != 10 {
        return Err(refuse(0, 0, ReasonCode::Parse, "not a FIX message".into()));
    }
    if tags[2] != 35 {
        return Err(refuse(
            14,
            tags[2],
            ReasonCode::Sig,
            format!(
                "tag {} comes before MsgType (35), outside the signed part",
                tags[2]
            ),
        ));
    }
    let last = tags.len() - 1;
    let Some(signature_at) = tags.iter().position(|tag| *tag == 89) else {
        return Err(refuse(1, 89, ReasonCode::Sig, "no Signature (89)".into()));
    };
    if signature_at + 1 != last {
        return Err(refuse(
            14,
            tags[signature_at + 1],
            ReasonCode::Sig,
            format!(
                "tag {} follows the Signature (89), outside the signed part",
                tags[signature_at + 1]
            ),
        ));
    }
    if tags[signature_at - 1] != 93 {
        return Err(refuse(
            14,
            tags[signature_at - 1],
            ReasonCode::Sig,
            "SignatureLength (93) must come just before Signature (89)".into(),
        ));
    }
    let declared = std::str::from_utf8(fields[signature_at - 1].1)
        .ok()
        .and_then(|n| n.parse::<usize>().ok());
    if declared != Some(fields[signature_at].1.len()) {
        return Err(refuse(
            5,
            93,
            ReasonCode::Sig,
            "SignatureLength (93) is not the length of the Signature (89)".into(),
        ));
    }
    check_repeats(&tags[2..last], &fields[2..last])?;
    Ok(&raw[fields[2].2..fields[signature_at - 1].2])
}

/// No tag twice outside the Parties group; the group itself well formed.
fn check_repeats(tags: &[u32], fields: &[(u32, &[u8], usize)]) -> Result<(), StructureError> {
    let refuse = |session_reason: u32, tag: u32, code: ReasonCode, detail: String| StructureError {
        session_reason,
        tag,
        code,
        detail,
    };
    let mut seen = ahash::AHashSet::with_capacity(tags.len());
    for tag in tags {
        if !PARTY_GROUP_TAGS.contains(tag) && !seen.insert(*tag) {
            return Err(refuse(
                13,
                *tag,
                ReasonCode::Parse,
                format!("tag {tag} appears more than once"),
            ));
        }
    }
    let first_member = tags.iter().position(|tag| PARTY_GROUP_TAGS.contains(tag));
    let count_at = tags.iter().position(|tag| *tag == 453);
    let (count_at, first_member) = match (count_at, first_member) {
        (None, None) => return Ok(()),
        (Some(count_at), Some(first_member)) if first_member == count_at + 1 => {
            (count_at, first_member)
        }
        (Some(_), None) => (0, tags.len()),
        (_, Some(first_member)) => {
            return Err(refuse(
                15,
                tags[first_member],
                ReasonCode::Parse,
                format!(
                    "tag {} is a Parties field outside its group (453)",
                    tags[first_member]
                ),
            ))
        }
    };
    let declared = std::str::from_utf8(fields[count_at].1)
        .ok()
        .and_then(|n| n.parse::<usize>().ok());
    let group_end = tags[first_member.min(tags.len())..]
        .iter()
        .position(|tag| !PARTY_GROUP_TAGS.contains(tag))
        .map_or(tags.len(), |at| first_member + at);
    let mut entries = 0;
    let mut in_entry: Vec<u32> = Vec::new();
    let mut roles: Vec<&[u8]> = Vec::new();
    for index in first_member.min(group_end)..group_end {
        let tag = tags[index];
        if tag == 448 {
            entries += 1;
            in_entry.clear();
        } else if entries == 0 || in_entry.contains(&tag) {
            return Err(refuse(
                15,
                tag,
                ReasonCode::Parse,
                format!("tag {tag} is out of place in the Parties group"),
            ));
        }
        in_entry.push(tag);
        if tag == 452 {
            let role = fields[index].1;
            if roles.contains(&role) {
                return Err(refuse(
                    5,
                    452,
                    ReasonCode::Field,
                    format!("PartyRole {} is given twice", String::from_utf8_lossy(role)),
                ));
            }
            roles.push(role);
        }
    }
    if let Some(stray) = tags[group_end..]
        .iter()
        .find(|tag| PARTY_GROUP_TAGS.contains(tag))
    {
        return Err(refuse(
            15,
            *stray,
            ReasonCode::Parse,
            format!("tag {stray} is a Parties field outside its group (453)"),
        ));
    }
    if declared != Some(entries) {
        return Err(refuse(
            16,
            453,
            ReasonCode::Parse,
            format!("NoPartyIDs (453) does not count the {entries} entries of the group"),
        ));
    }
    Ok(())
}

/// Current UTC time as FIX UTCTimestamp with milliseconds.
pub fn utc_timestamp() -> String {
    let now = time::OffsetDateTime::now_utc();
    format!(
        "{:04}{:02}{:02}-{:02}:{:02}:{:02}.{:03}",
        now.year(),
        u8::from(now.month()),
        now.day(),
        now.hour(),
        now.minute(),
        now.second(),
        now.millisecond()
    )
}

fn parse_utc_timestamp(text: &str) -> Option<time::OffsetDateTime> {
    let format = time::macros::format_description!(
        "[year][month][day]-[hour]:[minute]:[second][optional [.[subsecond]]]"
    );
    time::PrimitiveDateTime::parse(text, format)
        .ok()
        .map(time::PrimitiveDateTime::assume_utc)
}

/// The logon password: hex HMAC over the context, SendingTime and the BIC.
pub fn logon_password(key: &KeyedMac, sending_time: &str, participant: &str) -> String {
    let mut covered = LOGON_CONTEXT.to_vec();
    covered.extend_from_slice(sending_time.as_bytes());
    covered.extend_from_slice(participant.as_bytes());
    hex::encode(sign::sign_keyed(key, &covered))
}

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

/// Limits and timers of the FIX listener.
#[derive(Debug, Clone)]
pub struct FixConfig {
    pub max_connections: usize,
    /// Connections served at once from one source address.
    pub max_connections_per_source: usize,
    /// TLS for every connection, when set.
    pub tls: Option<crate::tls::Tls>,
    /// Application messages one session may have in flight.
    pub window: usize,
    /// Time allowed from a message's first byte to its last.
    pub message_timeout: Duration,
    /// Time allowed for the Logon after connecting.
    pub logon_timeout: Duration,
    /// Pushes that may wait for a subscriber before it is logged out as too slow.
    pub push_capacity: usize,
}

impl FixConfig {
    fn accepting(&self) -> crate::listener::Accepting {
        crate::listener::Accepting {
            tls: self.tls.as_ref().map(|tls| tls.0.clone()),
            handshake_timeout: self.message_timeout,
            ..crate::listener::Accepting::plain(crate::listener::ConnectionLimits {
                total: self.max_connections,
                per_source: self.max_connections_per_source,
            })
        }
    }
}

impl Default for FixConfig {
    fn default() -> Self {
        Self {
            max_connections: 1024,
            max_connections_per_source: 64,
            tls: None,
            window: 4096,
            message_timeout: Duration::from_secs(10),
            logon_timeout: Duration::from_secs(10),
            push_capacity: 65_536,
        }
    }
}

/// Reads one raw FIX message: `Ok(None)` at a clean end of stream.
async fn read_message<R: tokio::io::AsyncBufRead + Unpin>(
    input: &mut R,
    message_timeout: Duration,
    idle: Duration,
) -> Result<Option<Vec<u8>>, (&'static str, String)> {
    // The first byte may take as long as the session allows silence; the rest must follow
    // within the message timeout.
    let first = match tokio::time::timeout(idle, input.read_u8()).await {
        Err(_) => return Err(("E_TIMEOUT", format!("no message for {idle:?}"))),
        Ok(Err(error)) if error.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Ok(Err(error)) => return Err(("E_IO", error.to_string())),
        Ok(Ok(byte)) => byte,
    };
    let rest = async {
        let mut raw = vec![first];
        // "8=FIX.4.4<SOH>9=<digits><SOH>"
        for _ in 0..2 {
            let before = raw.len();
            let read = input.take(32).read_until(SOH, &mut raw).await?;
            if read == 0 || raw.last() != Some(&SOH) || raw.len() - before > 31 {
                return Ok(Err(("E_FRAME", "not a FIX header".to_owned())));
            }
        }
        let header = String::from_utf8_lossy(&raw).into_owned();
        let length: usize = match header
            .split('\u{1}')
            .nth(1)
            .and_then(|f| f.strip_prefix("9="))
            .and_then(|n| n.parse().ok())
        {
            Some(length) => length,
            None => return Ok(Err(("E_FRAME", "no BodyLength".to_owned()))),
        };
        if length > BODY_MAX_BYTES {
            return Ok(Err((
                "E_SIZE",
                format!("message body of {length} bytes is larger than {BODY_MAX_BYTES}"),
            )));
        }
        let start = raw.len();
        raw.resize(start + length + 7, 0);
        input.read_exact(&mut raw[start..]).await?;
        Ok::<_, std::io::Error>(Ok(raw))
    };
    match tokio::time::timeout(message_timeout, rest).await {
        Err(_) => Err((
            "E_TIMEOUT",
            format!("a message took longer than {message_timeout:?} to arrive"),
        )),
        Ok(Err(error)) => Err(("E_IO", error.to_string())),
        Ok(Ok(Err(refusal))) => Err(refusal),
        Ok(Ok(Ok(raw))) => Ok(Some(raw)),
    }
}

/// What an answer must name: the inbound message type and its id.
#[derive(Debug, Clone)]
struct Pending {
    msg_type: String,
    id: String,
    detail: Option<String>,
    /// Already answered by a session Reject: the engine's verdict is not sent again.
    rejected_by_session: bool,
}

/// The engine's side of one session: outbound sequence numbers and header.
struct Outbound {
    output: BufWriter<tokio::io::WriteHalf<crate::listener::Connection>>,
    participant: String,
    next_seq: u64,
}

impl Outbound {
    async fn send(&mut self, mut body: Vec<(u32, String)>) -> std::io::Result<()> {
        let msg_type = body.remove(0);
        let mut fields = vec![
            msg_type,
            (49, ENGINE_COMP_ID.to_owned()),
            (56, self.participant.clone()),
            (34, self.next_seq.to_string()),
            (52, utc_timestamp()),
        ];
        fields.extend(body);
        self.next_seq += 1;
        self.write(&encode(&fields)).await
    }

    /// Sends what is buffered, within the same time limit as a write.
    async fn flush(&mut self) -> std::io::Result<()> {
        match tokio::time::timeout(crate::tcp::WRITE_TIMEOUT, self.output.flush()).await {
            Ok(result) => result,
            Err(_) => Err(std::io::ErrorKind::TimedOut.into()),
        }
    }

    /// A write that a participant who stops reading cannot hold up for ever.
    async fn write(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        match tokio::time::timeout(crate::tcp::WRITE_TIMEOUT, self.output.write_all(bytes)).await {
            Ok(result) => result,
            Err(_) => Err(std::io::ErrorKind::TimedOut.into()),
        }
    }

    /// A SequenceReset-GapFill over `begin..next_seq`: sent with MsgSeqNum `begin` and
    /// PossDupFlag, it does not take a number of its own.
    async fn send_gap_fill(&mut self, begin: u64) -> std::io::Result<()> {
        let now = utc_timestamp();
        let fields = vec![
            (35, "4".to_owned()),
            (49, ENGINE_COMP_ID.to_owned()),
            (56, self.participant.clone()),
            (34, begin.min(self.next_seq).to_string()),
            (43, "Y".to_owned()),
            (52, now.clone()),
            (122, now),
            (123, "Y".to_owned()),
            (36, self.next_seq.to_string()),
        ];
        self.write(&encode(&fields)).await
    }
}

fn answer(pending: &Pending, result: AckResult) -> Vec<(u32, String)> {
    let (accepted, text) = match result {
        AckResult::Accepted => (true, None),
        AckResult::Duplicate => (true, Some("DUPLICATE".to_owned())),
        AckResult::Rejected(code) => (
            false,
            Some(match &pending.detail {
                Some(detail) => format!("{code} {detail}"),
                None => code.as_str().to_owned(),
            }),
        ),
    };
    let mut out = match pending.msg_type.as_str() {
        "AE" => vec![
            (35, "AR".to_owned()),
            (571, pending.id.clone()),
            (939, if accepted { "0" } else { "1" }.to_owned()),
        ],
        "J" => vec![
            (35, "P".to_owned()),
            (70, pending.id.clone()),
            (87, if accepted { "0" } else { "1" }.to_owned()),
        ],
        _ => vec![
            (35, "AU".to_owned()),
            (664, pending.id.clone()),
            (940, if accepted { "3" } else { "2" }.to_owned()),
        ],
    };
    if !accepted {
        out.push(match pending.msg_type.as_str() {
            "AE" => (751, "99".to_owned()),
            "J" => (88, "7".to_owned()),
            _ => (774, "99".to_owned()),
        });
    }
    if let Some(text) = text {
        out.push((58, text));
    }
    out
}

/// Serves FIX sessions until `shutdown` turns true, then logs every session out once it has
/// answered what it read.
pub async fn serve(
    listener: TcpListener,
    gateway: GatewayHandle,
    config: FixConfig,
    shutdown: watch::Receiver<bool>,
) {
    let accepting = config.accepting();
    let refusal = |why: &str| {
        encode(&[
            (35, "5".into()),
            (49, ENGINE_COMP_ID.into()),
            (34, "1".into()),
            (52, utc_timestamp()),
            (58, format!("E_BUSY {why}")),
        ])
    };
    let stop = shutdown.clone();
    accept_loop(
        listener,
        "FIX",
        accepting,
        shutdown,
        refusal,
        move |stream| session(stream, gateway.clone(), config.clone(), stop.clone()),
    )
    .await;
}

/// Why a session ends from the engine's side: the Logout's Text.
type Ending = Option<String>;

async fn session(
    stream: crate::listener::Connection,
    gateway: GatewayHandle,
    config: FixConfig,
    mut shutdown: watch::Receiver<bool>,
) {
    let (read, write) = tokio::io::split(stream);
    let mut input = BufReader::with_capacity(64 * 1024, read);
    let mut outbound = Outbound {
        output: BufWriter::with_capacity(64 * 1024, write),
        participant: String::new(),
        next_seq: 1,
    };

    // Logon.
    let logon = match read_message(&mut input, config.message_timeout, config.logon_timeout).await {
        Ok(Some(raw)) => raw,
        Ok(None) => return,
        Err((code, detail)) => {
            debug!(code, detail, "no logon");
            return;
        }
    };
    let logon = match parse(&logon) {
        Ok(message) if message.msg_type() == "A" => message,
        Ok(_) | Err(_) => return,
    };
    let participant = logon.get(49).unwrap_or("").to_owned();
    outbound.participant = participant.clone();
    let heartbeat = logon
        .get(108)
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|s| (1..=3600).contains(s))
        .map_or(Duration::from_secs(30), Duration::from_secs);
    let connection = gateway.connection_id();
    let claimed = check_logon(&gateway, &logon, &participant).and_then(|()| {
        gateway.claim_fix_session(
            &participant,
            logon.get(52).unwrap_or(""),
            connection,
            LOGON_CLOCK_SKEW,
        )
    });
    if let Err(text) = claimed {
        // The CompID comes from an unauthenticated peer: Debug-escaped, it cannot forge lines.
        warn!(participant = ?participant, text = ?text, "FIX logon refused");
        let _ = outbound.send(vec![(35, "5".into()), (58, text)]).await;
        let _ = outbound.flush().await;
        return;
    }
    let _ = outbound
        .send(vec![
            (35, "A".into()),
            (98, "0".into()),
            (108, heartbeat.as_secs().to_string()),
        ])
        .await;
    let _ = outbound.flush().await;

    // The reader runs on its own, so that a message is never cut by the session's other work;
    // it hands over whole messages (or why it stopped).
    let (raw_tx, mut raw_rx) = mpsc::channel::<Result<Vec<u8>, (&'static str, String)>>(64);
    let message_timeout = config.message_timeout;
    let reader = tokio::spawn(async move {
        loop {
            // Silence is the session's business (TestRequest, then Logout): no idle limit here.
            let next = read_message(&mut input, message_timeout, Duration::from_secs(86_400)).await;
            let stop = !matches!(next, Ok(Some(_)));
            let item = match next {
                Ok(Some(raw)) => Ok(raw),
                Ok(None) => break,
                Err(error) => Err(error),
            };
            if raw_tx.send(item).await.is_err() || stop {
                break;
            }
        }
    });

    let (reply_tx, mut replies) = mpsc::channel::<Reply>(config.window + 1);
    let (push_tx, mut pushes) = mpsc::channel::<Pushed>(config.push_capacity.max(1));
    let (kick_tx, mut kicked) = watch::channel(false);
    let window = Arc::new(Semaphore::new(config.window.max(1)));
    let pending: Arc<Mutex<BTreeMap<u64, Pending>>> = Arc::default();
    gateway.subscribe(
        &participant,
        Subscriber {
            connection,
            push: push_tx,
            kick: kick_tx,
        },
    );
    let idle = heartbeat + heartbeat / 5;
    let mut expected_in: u64 = 2;
    let mut reading = true;
    let mut ending: Ending = None;
    let mut test_request_sent = false;
    let mut last_out = tokio::time::Instant::now();
    let mut last_in = tokio::time::Instant::now();
    // Messages set aside while a gap is being filled (and in-order ones waiting for the
    // window), by sequence number.
    // Kept raw (parsed again when released): a parsed message costs several times its bytes.
    let mut held: BTreeMap<u64, Vec<u8>> = BTreeMap::new();
    let mut held_bytes: usize = 0;
    let mut resend_requested = false;

    'session: loop {
        tokio::select! {
            biased;
            Ok(()) = kicked.changed() => {
                ending = Some("E_SLOW the subscriber did not read its pushes".into());
                break;
            }
            _ = shutdown.changed(), if reading => {
                ending = Some("E_SHUTDOWN the engine is shutting down".into());
                reading = false;
            }
            reply = replies.recv() => {
                let Some(reply) = reply else { break };
                window.add_permits(1);
                let item = pending.lock().unwrap_or_else(PoisonError::into_inner).remove(&reply.seq);
                if let Some(item) = item.filter(|item| !item.rejected_by_session) {
                    if outbound.send(answer(&item, reply.result)).await.is_err() { break; }
                    last_out = tokio::time::Instant::now();
                }
            }
            Some(pushed) = pushes.recv() => {
                let xml = String::from_utf8_lossy(&pushed.xml).into_owned();
                let class = match pushed.class { PushClass::Cls => "CLS", PushClass::Advice => "ADVICE" };
                let body = vec![(35, "n".into()), (212, xml.len().to_string()), (213, xml), (58, class.into())];
                if outbound.send(body).await.is_err() { break; }
                last_out = tokio::time::Instant::now();
            }
            // Only while the window has room: a full window stops reading (TCP backpressure).
            raw = raw_rx.recv(), if reading && window.available_permits() > 0 => { 'raw: {
                let raw = match raw {
                    Some(Ok(raw)) => raw,
                    None => { reading = false; break 'raw; }
                    Some(Err((code, detail))) => {
                        ending = Some(format!("{code} {detail}"));
                        reading = false;
                        break 'raw;
                    }
                };
                last_in = tokio::time::Instant::now();
                test_request_sent = false;
                let message = match parse(&raw) {
                    Ok(message) => message,
                    Err(error) => {
                        warn!(%participant, error = ?error.to_string(), "garbled FIX message ignored");
                        break 'raw;
                    }
                };
                let seq: u64 = message.get(34).and_then(|s| s.parse().ok()).unwrap_or(0);
                let poss_dup = message.get(43) == Some("Y");
                if seq > SEQ_NUM_MAX {
                    ending = Some(format!("MsgSeqNum {seq} is larger than {SEQ_NUM_MAX}"));
                    reading = false;
                    break 'raw;
                }
                if message.msg_type() == "4" {
                    // SequenceReset (GapFill or Reset) moves the expected number forward, never
                    // back and never past the largest number.
                    let new_seq = message.get(36).and_then(|s| s.parse::<u64>().ok());
                    match new_seq {
                        Some(new_seq) if new_seq <= SEQ_NUM_MAX => {
                            expected_in = expected_in.max(new_seq);
                        }
                        _ => {
                            // A rejected message still takes its sequence number.
                            if seq == expected_in {
                                expected_in += 1;
                            }
                            let reject = vec![
                                (35, "3".into()),
                                (45, seq.to_string()),
                                (371, "36".into()),
                                (372, "4".into()),
                                (373, "5".into()),
                                (58, format!("NewSeqNo must be a number up to {SEQ_NUM_MAX}")),
                            ];
                            if outbound.send(reject).await.is_err() { break 'session; }
                            last_out = tokio::time::Instant::now();
                        }
                    }
                } else if seq > expected_in && !held.contains_key(&expected_in) {
                    held_bytes += raw.len();
                    if let Some(old) = held.insert(seq, raw) {
                        held_bytes -= old.len();
                    }
                    if held_bytes > HELD_BYTES_MAX || held.len() > HELD_MESSAGES_MAX {
                        ending = Some(format!(
                            "E_SIZE more than {HELD_BYTES_MAX} bytes or {HELD_MESSAGES_MAX} messages held behind a sequence gap"
                        ));
                        reading = false;
                        break 'raw;
                    }
                    if !resend_requested {
                        resend_requested = true;
                        let request = vec![(35, "2".into()), (7, expected_in.to_string()), (16, "0".into())];
                        if outbound.send(request).await.is_err() { break 'session; }
                        last_out = tokio::time::Instant::now();
                    }
                } else if seq < expected_in {
                    if !poss_dup {
                        ending = Some(format!("MsgSeqNum too low, expecting {expected_in} but received {seq}"));
                        reading = false;
                    }
                } else {
                    held_bytes += raw.len();
                    if let Some(old) = held.insert(seq, raw) {
                        held_bytes -= old.len();
                    }
                }
            }}
            _ = tokio::time::sleep_until(last_in + idle), if reading => {
                if test_request_sent {
                    ending = Some("E_TIMEOUT no answer to a TestRequest".into());
                    reading = false;
                } else {
                    test_request_sent = true;
                    last_in = tokio::time::Instant::now();
                    let request = vec![(35, "1".into()), (112, format!("TEST-{}", outbound.next_seq))];
                    if outbound.send(request).await.is_err() { break; }
                    last_out = tokio::time::Instant::now();
                }
            }
            _ = tokio::time::sleep_until(last_out + heartbeat) => {
                if outbound.send(vec![(35, "0".into())]).await.is_err() { break; }
                last_out = tokio::time::Instant::now();
            }
        }
        // What is now in order, as far as the window allows.
        while reading && window.available_permits() > 0 {
            let Some(entry) = held.first_entry() else {
                break;
            };
            if *entry.key() > expected_in {
                break;
            }
            let (seq, raw) = entry.remove_entry();
            held_bytes -= raw.len();
            if seq < expected_in {
                continue;
            }
            expected_in += 1;
            let Ok(message) = parse(&raw) else {
                continue;
            };
            match handle(
                &gateway,
                &participant,
                &message,
                &raw,
                &window,
                &pending,
                &reply_tx,
                &mut outbound,
            )
            .await
            {
                Ok(Some(end)) => {
                    ending = Some(end);
                    reading = false;
                }
                Ok(None) => {}
                Err(()) => break,
            }
            last_out = tokio::time::Instant::now();
        }
        if held.keys().next().is_none_or(|first| *first <= expected_in) {
            resend_requested = false;
        }
        if !reading
            && pending
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .is_empty()
        {
            break;
        }
        if replies.is_empty() && pushes.is_empty() && outbound.flush().await.is_err() {
            break;
        }
    }
    reader.abort();
    gateway.unsubscribe(connection);
    gateway.release_fix_session(&participant, connection);
    let mut logout = vec![(35, "5".to_owned())];
    if let Some(text) = ending.filter(|text| !text.is_empty()) {
        if !text.starts_with("E_SHUTDOWN") {
            warn!(%participant, text = ?text, "FIX session ended by the engine");
        }
        logout.push((58, text));
    }
    let _ = outbound.send(logout).await;
    let _ = outbound.flush().await;
    let _ = outbound.output.shutdown().await;
}

fn check_logon(
    gateway: &GatewayHandle,
    logon: &FixMessage,
    participant: &str,
) -> Result<(), String> {
    if logon.get(56) != Some(ENGINE_COMP_ID) {
        return Err(format!("E_AUTH TargetCompID must be {ENGINE_COMP_ID}"));
    }
    if gateway.refdata().participant(participant).is_none() {
        return Err(format!("E_AUTH {participant} is not a participant"));
    }
    let sending_time = logon.get(52).unwrap_or("");
    let fresh = parse_utc_timestamp(sending_time).is_some_and(|sent| {
        let skew = (time::OffsetDateTime::now_utc() - sent).abs();
        skew <= LOGON_CLOCK_SKEW
    });
    if !fresh {
        return Err(format!(
            "E_AUTH SendingTime {sending_time:?} is not within {}s of the engine's clock",
            LOGON_CLOCK_SKEW.as_secs()
        ));
    }
    let given = logon.get(554).unwrap_or("");
    let mut covered = LOGON_CONTEXT.to_vec();
    covered.extend_from_slice(sending_time.as_bytes());
    covered.extend_from_slice(participant.as_bytes());
    let given_bytes = hex::decode(given).unwrap_or_default();
    if gateway.signed_by(participant, &covered, &given_bytes) {
        Ok(())
    } else {
        Err(format!(
            "E_SIG the logon password of {participant} is not signed with its key"
        ))
    }
}

/// Handles one in-order message; `Ok(Some(text))` ends the session with a Logout, `Err` means
/// the connection failed.
#[allow(clippy::too_many_arguments)]
async fn handle(
    gateway: &GatewayHandle,
    participant: &str,
    message: &FixMessage,
    raw: &[u8],
    window: &Arc<Semaphore>,
    pending: &Arc<Mutex<BTreeMap<u64, Pending>>>,
    reply: &mpsc::Sender<Reply>,
    outbound: &mut Outbound,
) -> Result<Option<String>, ()> {
    match message.msg_type() {
        "0" => Ok(None),
        "1" => {
            let id = message.get(112).unwrap_or("").to_owned();
            outbound
                .send(vec![(35, "0".into()), (112, id)])
                .await
                .map_err(|_| ())?;
            Ok(None)
        }
        "2" => {
            // Answers are idempotent: the range is gap-filled instead of resent.
            let begin = message
                .get(7)
                .and_then(|s| s.parse::<u64>().ok())
                .unwrap_or(1)
                .max(1);
            outbound.send_gap_fill(begin).await.map_err(|_| ())?;
            Ok(None)
        }
        // A Logout from the participant: answered (without Text) once what is in flight is.
        "5" => Ok(Some(String::new())),
        "A" => Ok(Some("E_FRAME a second Logon".into())),
        "AE" | "J" | "T" => {
            // The session calls this only while the window has room.
            if let Ok(permit) = window.try_acquire() {
                permit.forget();
            }
            let id_tag = match message.msg_type() {
                "AE" => 571,
                "J" => 70,
                _ => 777,
            };
            let id = message.get(id_tag).unwrap_or("").to_owned();
            let seq: u64 = message.get(34).and_then(|s| s.parse().ok()).unwrap_or(0);
            let sender = message.get(49).unwrap_or("");
            let (envelope, detail, rejected_by_session) = match signed_part(raw) {
                Ok(covered) => {
                    let (envelope, detail) =
                        envelope_of(gateway, participant, sender, message, raw, covered);
                    (envelope, detail, false)
                }
                Err(error) => {
                    outbound
                        .send(vec![
                            (35, "3".into()),
                            (45, seq.to_string()),
                            (371, error.tag.to_string()),
                            (372, message.msg_type().to_owned()),
                            (373, error.session_reason.to_string()),
                            (58, format!("{} {}", error.code, error.detail)),
                        ])
                        .await
                        .map_err(|_| ())?;
                    let rejection = Rejection::new(error.code, error.detail);
                    (refused_envelope(raw, participant, rejection), None, true)
                }
            };
            pending
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .insert(
                    seq,
                    Pending {
                        msg_type: message.msg_type().to_owned(),
                        id,
                        detail,
                        rejected_by_session,
                    },
                );
            if gateway.submit(envelope, seq, reply).await.is_err() {
                return Ok(Some("E_SHUTDOWN the engine is shutting down".into()));
            }
            Ok(None)
        }
        other => {
            outbound
                .send(vec![
                    (35, "3".into()),
                    (45, message.get(34).unwrap_or("0").to_owned()),
                    (372, other.to_owned()),
                    (373, "11".into()),
                    (58, format!("MsgType {other} is not supported")),
                ])
                .await
                .map_err(|_| ())?;
            Ok(None)
        }
    }
}

/// A refused message, kept as an exception with its raw FIX bytes.
fn refused_envelope(raw: &[u8], participant: &str, rejection: Rejection) -> Envelope {
    Envelope {
        bytes: raw.to_vec(),
        sender: Some(participant.to_owned()),
        signature: None,
        correlation: 0,
        origin: 0,
        injected_ns: 0,
        refusal: Some(rejection),
    }
}

/// The engine envelope of an application message whose signature covers `covered` (every byte
/// with meaning, [`signed_part`]): converted and re-signed when the signature holds, a refusal
/// otherwise.
fn envelope_of(
    gateway: &GatewayHandle,
    participant: &str,
    sender: &str,
    message: &FixMessage,
    raw: &[u8],
    covered: &[u8],
) -> (Envelope, Option<String>) {
    let refused = |rejection: Rejection| {
        let detail = Some(rejection.detail.clone());
        (refused_envelope(raw, participant, rejection), detail)
    };
    let signature = message
        .get(89)
        .and_then(|hex_text| hex::decode(hex_text).ok())
        .unwrap_or_default();
    let signed = gateway.signed_by(sender, covered, &signature);
    if sender != participant {
        // A message under another CompID than the session's.
        if signed {
            return refused(Rejection::new(
                ReasonCode::Auth,
                format!("the session of {participant} may not send as {sender}"),
            ));
        }
        return refused(Rejection::new(
            ReasonCode::Sig,
            format!("signature does not match the key of {sender}"),
        ));
    }
    if !signed {
        return refused(Rejection::new(
            ReasonCode::Sig,
            format!("signature (89) does not match the key of {participant}"),
        ));
    }
    let xml = match from_fix(message, participant) {
        Ok(xml) => xml,
        Err(rejection) => return refused(rejection),
    };
    let Some((_, key)) = gateway.refdata().participant_mac(participant) else {
        return refused(Rejection::new(
            ReasonCode::Sig,
            format!("no key for {participant}"),
        ));
    };
    let signature = sign::sign_keyed(key, &xml);
    (
        Envelope {
            bytes: xml,
            sender: Some(participant.to_owned()),
            signature: Some(signature),
            correlation: 0,
            origin: 0,
            injected_ns: 0,
            refusal: None,
        },
        None,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use ste_engine::generator::{Generator, GeneratorConfig};
    use ste_engine::refdata::RefData;

    #[test]
    fn encode_parse_round_trip_and_garbling() {
        let fields = vec![
            (35, "0".to_owned()),
            (49, "A".to_owned()),
            (34, "7".to_owned()),
        ];
        let bytes = encode(&fields);
        assert_eq!(parse(&bytes).expect("parses").fields, fields);
        let mut bad_sum = bytes.clone();
        let at = bad_sum.len() - 2;
        bad_sum[at] = if bad_sum[at] == b'0' { b'1' } else { b'0' };
        assert!(matches!(parse(&bad_sum), Err(FixError::Garbled(_))));
        let mut bad_length = bytes.clone();
        bad_length[12] = b'9';
        assert!(parse(&bad_length).is_err());
        assert!(parse(b"8=FIX.4.2\x019=5\x0135=0\x0110=000\x01").is_err());
    }

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
