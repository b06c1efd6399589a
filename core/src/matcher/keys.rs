//! The matcher's keys: 128-bit hashes standing in for (Sender, MsgId) pairs and trade keys,
//! and the verdict remembered under each.

use std::hash::Hasher;

use rand::Rng;
use siphasher::sip128::{Hasher128, SipHasher24};
use xxhash_rust::xxh3::xxh3_64;

use crate::reason::ReasonCode;

/// A 128-bit hash standing in for a (Sender, MsgId) pair or a trade key, so that every message
/// ever accepted by a shard can be remembered in 24 bytes.
pub type HashKey = [u64; 2];

/// How a matcher makes its keys: SipHash-2-4 with 128-bit output, a MAC, under a 128-bit
/// secret drawn from the operating system when the matcher is made and never written down.
///
/// A participant chooses its MsgIds. Under a hash whose key it could know, it could search for
/// a MsgId whose key equals the predictable key of another participant's next message, which
/// would then be refused as a duplicate: an unkeyed hash (or xxh3 under any secret, whose
/// maintainers state that a MAC must be used where an adversary chooses the input) leaves that
/// open. Under a secret MAC, a key it has not seen is 128 random bits to it.
///
/// Nothing outside the matcher that made them reads its keys: its files of retired facts are
/// written again by the next process ([`crate::matcher`]), so the secret needs no keeping.
#[derive(Clone)]
pub struct KeyHasher {
    secret: [u64; 2],
}

impl KeyHasher {
    /// A hasher under a new secret from the operating system's generator (as the
    /// participants' generated keys are: [`crate::keys`]).
    pub fn random() -> Self {
        let mut rng = rand::rand_core::UnwrapErr(rand::rngs::SysRng);
        Self {
            secret: [rng.next_u64(), rng.next_u64()],
        }
    }

    /// The key of parts, each followed by a zero byte (no part holds one), so that parts
    /// cannot be cut differently into the same bytes.
    pub(super) fn key(&self, parts: &[&str]) -> HashKey {
        let mut hasher = SipHasher24::new_with_keys(self.secret[0], self.secret[1]);
        for part in parts {
            hasher.write(part.as_bytes());
            hasher.write(&[0]);
        }
        let hash = hasher.finish128();
        [hash.h1, hash.h2]
    }

    /// The key of a message: its Sender and MsgId.
    pub fn message(&self, sender: &str, msg_id: &str) -> HashKey {
        self.key(&[sender, msg_id])
    }

    /// The key of a trade.
    pub(super) fn trade(&self, trade_key: &str) -> HashKey {
        self.key(&[trade_key])
    }
}

impl std::fmt::Debug for KeyHasher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KeyHasher { secret: <hidden> }")
    }
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

    fn sip(secret: [u64; 2], bytes: &[u8]) -> HashKey {
        let mut hasher = SipHasher24::new_with_keys(secret[0], secret[1]);
        hasher.write(bytes);
        let hash = hasher.finish128();
        [hash.h1, hash.h2]
    }

    #[test]
    fn a_key_is_the_mac_of_its_parts_each_ended_by_a_zero_byte_however_long() {
        let hasher = KeyHasher::random();
        let long = "X".repeat(200);
        for parts in [
            vec!["BRKAAU21XXX", "BRKAAU21XXX-00000001-01"],
            vec![&long, "A"],
            vec!["TRADE"],
        ] {
            let mut joined = Vec::new();
            for part in &parts {
                joined.extend_from_slice(part.as_bytes());
                joined.push(0);
            }
            assert_eq!(hasher.key(&parts), sip(hasher.secret, &joined), "{parts:?}");
        }
        // Parts cut differently are different keys.
        assert_ne!(hasher.message("AB", "C"), hasher.message("A", "BC"));
    }

    #[test]
    fn each_hasher_has_a_secret_of_its_own_that_its_debug_output_does_not_show() {
        let (one, two) = (KeyHasher::random(), KeyHasher::random());
        assert_ne!(one.secret, two.secret);
        let key = one.message("BRKAAU21XXX", "M1");
        assert_eq!(
            one.message("BRKAAU21XXX", "M1"),
            key,
            "stable under one secret"
        );
        assert_ne!(two.message("BRKAAU21XXX", "M1"), key);
        let shown = format!("{one:?}");
        assert!(!shown.contains(&one.secret[0].to_string()), "{shown}");
        assert!(!shown.contains(&format!("{:x}", one.secret[0])), "{shown}");
    }

    #[test]
    fn the_mac_is_siphash_2_4_with_128_bits_out() {
        // The first reference vector of SipHash-2-4-128 (the authors' vectors.h): key 00..0f,
        // the empty message.
        let key = |range: std::ops::Range<u8>| {
            u64::from_le_bytes(range.collect::<Vec<u8>>().try_into().expect("8 bytes"))
        };
        let [h1, h2] = sip([key(0..8), key(8..16)], b"");
        let mut bytes = h1.to_le_bytes().to_vec();
        bytes.extend_from_slice(&h2.to_le_bytes());
        assert_eq!(hex::encode(bytes), "a3817f04ba25a8e66df67214c7550293");
    }
}
