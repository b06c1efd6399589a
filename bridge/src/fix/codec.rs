//! The FIX 4.4 wire: messages as tag=value fields between BeginString, BodyLength and
//! CheckSum, read from a stream with bounded time and size; the shape that makes every byte of
//! an application message covered by its signature ([`signed_part`]); FIX timestamps.

use std::time::Duration;

use ste_engine::reason::ReasonCode;
use tokio::io::{AsyncBufReadExt, AsyncReadExt};

/// The field separator.
pub const SOH: u8 = 0x01;
/// BeginString.
pub const BEGIN_STRING: &str = "FIX.4.4";
/// Largest FIX message body accepted: the canonical message limit, since a FIX message is the
/// more compact of the two.
pub const BODY_MAX_BYTES: usize = ste_engine::validate::MESSAGE_SIZE_MAX_BYTES;

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

/// A repeating group whose members may appear once in each of its entries, the only tags
/// that may repeat in an application message (its sub-group, if any, holds one entry).
#[derive(Debug)]
pub struct Group {
    /// NoXxx, the number of entries.
    pub count: u32,
    /// The first field of every entry.
    pub delimiter: u32,
    /// Every tag of an entry, the delimiter first.
    pub members: &'static [u32],
    /// The role of an entry: no two entries of the group name the same one.
    pub role: u32,
}

/// Parties (`453` NoPartyIDs), with a PartySubID (`802`, `523`, `803`).
pub const PARTIES: Group = Group {
    count: 453,
    delimiter: 448,
    members: &[448, 447, 452, 802, 523, 803],
    role: 452,
};

/// SettlParties (`781` NoSettlPartyIDs), with a SettlPartySubID (`801`, `785`, `786`).
pub const SETTL_PARTIES: Group = Group {
    count: 781,
    delimiter: 782,
    members: &[782, 783, 784, 801, 785, 786],
    role: 784,
};

const GROUPS: [&Group; 2] = [&PARTIES, &SETTL_PARTIES];

impl FixMessage {
    /// The entries of `group` (the first instance of its count tag), each its fields in order.
    pub fn entries(&self, group: &Group) -> Vec<Vec<(u32, &str)>> {
        let mut entries: Vec<Vec<(u32, &str)>> = Vec::new();
        let Some(count_at) = self.fields.iter().position(|(tag, _)| *tag == group.count) else {
            return entries;
        };
        for (tag, value) in &self.fields[count_at + 1..] {
            if !group.members.contains(tag) {
                break;
            }
            if *tag == group.delimiter {
                entries.push(Vec::new());
            }
            if let Some(entry) = entries.last_mut() {
                entry.push((*tag, value.as_str()));
            }
        }
        entries
    }
}

fn refuse(session_reason: u32, tag: u32, code: ReasonCode, detail: String) -> StructureError {
    StructureError {
        session_reason,
        tag,
        code,
        detail,
    }
}

/// The bytes an application message's signature covers, once its shape guarantees that they
/// are every byte with meaning: `8` and `9` first, then `35`, then the fields, then `93` and
/// `89` and nothing but `10` after them; no tag twice outside the repeating groups
/// ([`PARTIES`], [`SETTL_PARTIES`]), whose entries are well formed, as many as their count
/// says, each role once. The covered bytes run from `35=` up to `93=`.
pub fn signed_part(raw: &[u8]) -> Result<&[u8], StructureError> {
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

/// No tag twice outside the repeating groups ([`PARTIES`], [`SETTL_PARTIES`]); each group
/// well formed: right after its count, as many entries as it says, each starting with the
/// delimiter, no tag twice in an entry, no role twice.
fn check_repeats(tags: &[u32], fields: &[(u32, &[u8], usize)]) -> Result<(), StructureError> {
    let in_a_group = |tag: &u32| GROUPS.iter().any(|group| group.members.contains(tag));
    let mut seen = ahash::AHashSet::with_capacity(tags.len());
    for tag in tags {
        if !in_a_group(tag) && !seen.insert(*tag) {
            return Err(refuse(
                13,
                *tag,
                ReasonCode::Parse,
                format!("tag {tag} appears more than once"),
            ));
        }
    }
    for group in GROUPS {
        check_group(group, tags, fields)?;
    }
    Ok(())
}

fn check_group(
    group: &Group,
    tags: &[u32],
    fields: &[(u32, &[u8], usize)],
) -> Result<(), StructureError> {
    let outside = |tag: u32| {
        refuse(
            15,
            tag,
            ReasonCode::Parse,
            format!("tag {tag} is a field of group {} outside it", group.count),
        )
    };
    let is_member = |tag: &u32| group.members.contains(tag);
    let first_member = tags.iter().position(is_member);
    let count_at = match (
        tags.iter().position(|tag| *tag == group.count),
        first_member,
    ) {
        (None, None) => return Ok(()),
        (Some(count_at), Some(first)) if first == count_at + 1 => count_at,
        (Some(count_at), None) => count_at,
        (_, Some(first)) => return Err(outside(tags[first])),
    };
    let mut entries = 0;
    let mut in_entry: Vec<u32> = Vec::new();
    let mut roles: Vec<&[u8]> = Vec::new();
    let mut end = count_at + 1;
    while end < tags.len() && is_member(&tags[end]) {
        let tag = tags[end];
        if tag == group.delimiter {
            entries += 1;
            in_entry.clear();
        } else if entries == 0 || in_entry.contains(&tag) {
            return Err(refuse(
                15,
                tag,
                ReasonCode::Parse,
                format!("tag {tag} is out of place in group {}", group.count),
            ));
        }
        in_entry.push(tag);
        if tag == group.role {
            let role = fields[end].1;
            if roles.contains(&role) {
                return Err(refuse(
                    5,
                    tag,
                    ReasonCode::Field,
                    format!(
                        "role {} is given twice in group {}",
                        String::from_utf8_lossy(role),
                        group.count
                    ),
                ));
            }
            roles.push(role);
        }
        end += 1;
    }
    if let Some(stray) = tags[end..].iter().find(|tag| is_member(tag)) {
        return Err(outside(*stray));
    }
    let declared = std::str::from_utf8(fields[count_at].1)
        .ok()
        .and_then(|n| n.parse::<usize>().ok());
    if declared != Some(entries) {
        return Err(refuse(
            16,
            group.count,
            ReasonCode::Parse,
            format!("group {} does not count its {entries} entries", group.count),
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

pub(super) fn parse_utc_timestamp(text: &str) -> Option<time::OffsetDateTime> {
    let format = time::macros::format_description!(
        "[year][month][day]-[hour]:[minute]:[second][optional [.[subsecond]]]"
    );
    time::PrimitiveDateTime::parse(text, format)
        .ok()
        .map(time::PrimitiveDateTime::assume_utc)
}

/// Reads one raw FIX message: `Ok(None)` at a clean end of stream.
pub(super) async fn read_message<R: tokio::io::AsyncBufRead + Unpin>(
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
