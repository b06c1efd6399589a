//! The matcher's keys: 128-bit hashes standing in for (Sender, MsgId) pairs and trade keys,
//! and the verdict remembered under each.

use xxhash_rust::xxh3::{xxh3_128, xxh3_64};

use crate::reason::ReasonCode;

/// A 128-bit hash standing in for a (Sender, MsgId) pair or a trade key, so that every message
/// ever accepted by a shard can be remembered in 24 bytes.
pub type HashKey = [u64; 2];

pub(super) fn hash_key(parts: &[&str]) -> HashKey {
    // Joined on the stack where they fit (a Sender and a MsgId do): a key a message, or two.
    let mut joined = [0_u8; 128];
    let mut length = 0;
    for part in parts {
        let Some(room) = joined.get_mut(length..length + part.len() + 1) else {
            return hash_key_long(parts);
        };
        room[..part.len()].copy_from_slice(part.as_bytes());
        room[part.len()] = 0;
        length += part.len() + 1;
    }
    split(xxh3_128(&joined[..length]))
}

/// [`hash_key`] of parts longer than its buffer: the same bytes, on the heap.
fn hash_key_long(parts: &[&str]) -> HashKey {
    let mut bytes = Vec::with_capacity(parts.iter().map(|part| part.len() + 1).sum());
    for part in parts {
        bytes.extend_from_slice(part.as_bytes());
        bytes.push(0);
    }
    split(xxh3_128(&bytes))
}

fn split(hash: u128) -> HashKey {
    [(hash >> 64) as u64, hash as u64]
}

/// The key of a message: its Sender and MsgId.
pub fn message_key(sender: &str, msg_id: &str) -> HashKey {
    hash_key(&[sender, msg_id])
}

/// What the matcher keeps of a message's wire bytes: their length, which counts toward what its
/// sender holds, and their hash, which tells an exact re-send from other content under the same
/// MsgId. Made where the bytes were last read: the validator makes it right after checking
/// their signature, while they are still in its core's cache. Hashed in the matcher instead,
/// on another core, the bytes were read from memory again, and that was a sixth of the
/// matcher's time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Content {
    bytes: u32,
    hash: u64,
}

impl Content {
    pub fn of(raw: &[u8]) -> Self {
        Self {
            bytes: u32::try_from(raw.len()).unwrap_or(u32::MAX),
            hash: xxh3_64(raw),
        }
    }

    /// How many bytes the message has.
    pub fn bytes(self) -> usize {
        self.bytes as usize
    }
}

/// How the first message under a key was answered, packed with its content hash into one word:
/// the high 56 bits are the content hash, the low 8 bits 0 for accepted or 1 + the index of the
/// reason code in [`ReasonCode::ALL`]. 56 bits tell an exact re-send from other content well
/// enough; the set costs no more than a set of accepted messages alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Verdict(u64);

impl Verdict {
    pub(super) fn new(content: Content, rejected: Option<ReasonCode>) -> Self {
        let code = rejected.map_or(0, |code| {
            1 + ReasonCode::ALL
                .iter()
                .position(|c| *c == code)
                .expect("every code is in ReasonCode::ALL") as u64
        });
        Self((content.hash & !0xFF) | code)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_is_the_hash_of_its_parts_each_ended_by_a_zero_byte_however_long() {
        let long = "X".repeat(200);
        for parts in [
            vec!["BRKAAU21XXX", "BRKAAU21XXX-00000001-01"],
            vec![&long, "A"],
        ] {
            let mut joined = Vec::new();
            for part in &parts {
                joined.extend_from_slice(part.as_bytes());
                joined.push(0);
            }
            assert_eq!(hash_key(&parts), split(xxh3_128(&joined)), "{parts:?}");
        }
    }
}
