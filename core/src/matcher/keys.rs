//! The matcher's keys: 128-bit hashes standing in for (Sender, MsgId) pairs and trade keys,
//! and the verdict remembered under each.

use xxhash_rust::xxh3::{xxh3_128, xxh3_64};

use crate::reason::ReasonCode;

/// A 128-bit hash standing in for a (Sender, MsgId) pair or a trade key, so that every message
/// ever accepted by a shard can be remembered in 24 bytes.
pub type HashKey = [u64; 2];

pub(super) fn hash_key(parts: &[&str]) -> HashKey {
    let mut bytes = Vec::with_capacity(64);
    for part in parts {
        bytes.extend_from_slice(part.as_bytes());
        bytes.push(0);
    }
    let hash = xxh3_128(&bytes);
    [(hash >> 64) as u64, hash as u64]
}

/// The key of a message: its Sender and MsgId.
pub fn message_key(sender: &str, msg_id: &str) -> HashKey {
    hash_key(&[sender, msg_id])
}

/// How the first message under a key was answered, packed with its content hash into one word:
/// the high 56 bits are the content hash, the low 8 bits 0 for accepted or 1 + the index of the
/// reason code in [`ReasonCode::ALL`]. 56 bits tell an exact re-send from other content well
/// enough; the set costs no more than a set of accepted messages alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Verdict(u64);

impl Verdict {
    pub(super) fn new(raw: &[u8], rejected: Option<ReasonCode>) -> Self {
        let code = rejected.map_or(0, |code| {
            1 + ReasonCode::ALL
                .iter()
                .position(|c| *c == code)
                .expect("every code is in ReasonCode::ALL") as u64
        });
        Self((xxh3_64(raw) & !0xFF) | code)
    }

    /// The verdict as one word, as a store of retired facts keeps it.
    pub(super) fn bits(self) -> u64 {
        self.0
    }

    pub(super) fn from_bits(bits: u64) -> Self {
        Self(bits)
    }

    pub(super) fn same_content(self, other: Self) -> bool {
        self.0 & !0xFF == other.0 & !0xFF
    }

    pub(super) fn rejected(self) -> Option<ReasonCode> {
        match (self.0 & 0xFF) as usize {
            0 => None,
            index => ReasonCode::ALL.get(index - 1).copied(),
        }
    }
}
