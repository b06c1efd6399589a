//! What a matcher remembers: exact tables in two generations, and a blocked Bloom filter of
//! fixed size over what a bounded matcher retired from them.

use std::hash::Hash;

use ahash::AHashMap;

use super::keys::HashKey;

/// How much a matcher remembers exactly, and the filter that stands for what it retired
/// (see [`Matcher::bounded`](super::Matcher::bounded)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatcherMemory {
    /// Entries (message keys, closed trades, names) of one generation of the exact tables.
    pub generation_entries: usize,
    /// Bytes of the filter over retired entries (rounded up to a power of two).
    pub filter_bytes: usize,
    /// Bytes that one participant's messages may hold in the open trades of one shard (as
    /// [`Matcher`](super::Matcher) counts them: each message's bytes and what it takes in
    /// memory, and a trade's entry for the message that opens it); a message beyond it is
    /// refused E_LIMIT, so that no participant can fill the memory the others need. It applies
    /// to every store's matcher.
    pub participant_held_bytes: u64,
}

/// Bits of a bounded matcher's filter per fact it is sized for: about 1% false positives.
pub const FILTER_BITS_PER_FACT: u64 = 10;
/// The largest filter [`MatcherMemory::for_facts`] sizes.
pub const FILTER_BYTES_MAX: usize = 1 << 30;

impl MatcherMemory {
    /// The default, with a filter large enough for `facts` retired facts (message keys, closed
    /// trades, names) at [`FILTER_BITS_PER_FACT`] bits each, and never smaller than the
    /// default's: for a run whose size is known, so that the filter's false positives (each a
    /// look-up in the store) stay as rare at its end as at its start.
    pub fn for_facts(facts: u64) -> Self {
        let default = Self::default();
        let wanted = facts.saturating_mul(FILTER_BITS_PER_FACT) / 8;
        let wanted = usize::try_from(wanted).unwrap_or(FILTER_BYTES_MAX);
        Self {
            filter_bytes: wanted
                .clamp(default.filter_bytes, FILTER_BYTES_MAX)
                .next_power_of_two(),
            ..default
        }
    }
}

/// The default of [`MatcherMemory::participant_held_bytes`].
pub const PARTICIPANT_HELD_BYTES_DEFAULT: u64 = 64 << 20;

impl Default for MatcherMemory {
    fn default() -> Self {
        Self {
            generation_entries: 65_536,
            filter_bytes: 8 * 1024 * 1024,
            participant_held_bytes: PARTICIPANT_HELD_BYTES_DEFAULT,
        }
    }
}

/// What a fact of the exact tables is about; each kind probes the filter with its own salt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FactKind {
    /// A message key and its verdict.
    Seen,
    /// A closed trade's key, with its date and whether it aged out.
    Closed,
    /// A message key that an accepted CAN or AMD names.
    Named,
}

impl FactKind {
    /// Every kind, by its [`FactKind::index`].
    pub const ALL: [Self; 3] = [Self::Seen, Self::Closed, Self::Named];

    /// The kind's number, stable across versions: it is written to files.
    pub fn index(self) -> u8 {
        match self {
            Self::Seen => 0,
            Self::Closed => 1,
            Self::Named => 2,
        }
    }

    /// The kind numbered `index`.
    pub fn from_index(index: u8) -> Option<Self> {
        Self::ALL.get(usize::from(index)).copied()
    }

    pub(super) fn salt(self) -> u64 {
        match self {
            Self::Seen => 0x9E37_79B9_7F4A_7C15,
            Self::Closed => 0xC2B2_AE3D_27D4_EB4F,
            Self::Named => 0x1656_67B1_9E37_79F9,
        }
    }
}

/// A blocked Bloom filter of fixed size over keys that are already 128-bit hashes: a key's
/// probes all fall in one block of 512 bits (a cache line), chosen by one half of the key, and
/// the other half places them in it, so that a look-up costs one miss in the cache however large
/// the filter. A false positive costs one look-up in the store; there is no false negative.
pub(super) struct Filter {
    blocks: Vec<[u64; FILTER_BLOCK_WORDS]>,
    mask: u64,
}

/// Words of a block: 512 bits, one cache line.
pub(super) const FILTER_BLOCK_WORDS: usize = 8;
/// Probes per key: the optimum for about ten bits per key.
pub(super) const FILTER_PROBES: u32 = 7;
/// Bits that place one probe in its block.
pub(super) const FILTER_PROBE_BITS: u32 = (FILTER_BLOCK_WORDS * 64).trailing_zeros();
const _: () = assert!(FILTER_PROBES * FILTER_PROBE_BITS <= 64);

impl Filter {
    pub(super) fn new(bytes: usize) -> Self {
        let blocks = (bytes / (FILTER_BLOCK_WORDS * 8))
            .max(1)
            .next_power_of_two();
        Self {
            // Zeroed pages are not resident until a bit is set in them.
            blocks: vec![[0; FILTER_BLOCK_WORDS]; blocks],
            mask: blocks as u64 - 1,
        }
    }

    /// The key's block, and its probes' bits within it.
    pub(super) fn place(
        &self,
        key: HashKey,
        kind: FactKind,
    ) -> (usize, impl Iterator<Item = usize>) {
        let block = ((key[0] ^ kind.salt()) & self.mask) as usize;
        let bits = (key[1] ^ kind.salt().rotate_left(29)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let probe_mask = (1_u64 << FILTER_PROBE_BITS) - 1;
        let probes = (0..FILTER_PROBES)
            .map(move |i| ((bits >> (i * FILTER_PROBE_BITS)) & probe_mask) as usize);
        (block, probes)
    }

    pub(super) fn insert(&mut self, key: HashKey, kind: FactKind) {
        let (block, probes) = self.place(key, kind);
        let block = &mut self.blocks[block];
        for bit in probes {
            block[bit >> 6] |= 1 << (bit & 63);
        }
    }

    pub(super) fn contains(&self, key: HashKey, kind: FactKind) -> bool {
        let (block, mut probes) = self.place(key, kind);
        let block = &self.blocks[block];
        probes.all(|bit| block[bit >> 6] & (1 << (bit & 63)) != 0)
    }

    pub(super) fn bytes(&self) -> usize {
        self.blocks.len() * FILTER_BLOCK_WORDS * 8
    }
}

/// An exact table in two generations: entries go into the current one; the older one waits
/// until everything in it is committed, then is retired into the filter. Clearing keeps a
/// table's capacity, so the tables stop growing once they have reached a generation's size.
pub(super) struct Remembered<K, V> {
    current: AHashMap<K, V>,
    older: AHashMap<K, V>,
}

impl<K: Hash + Eq + Copy, V: Copy> Remembered<K, V> {
    pub(super) fn new() -> Self {
        Self {
            current: AHashMap::new(),
            older: AHashMap::new(),
        }
    }

    pub(super) fn get(&self, key: &K) -> Option<V> {
        match self.current.get(key) {
            Some(value) => Some(*value),
            None if self.older.is_empty() => None,
            None => self.older.get(key).copied(),
        }
    }

    pub(super) fn contains(&self, key: &K) -> bool {
        self.get(key).is_some()
    }

    pub(super) fn insert(&mut self, key: K, value: V) {
        self.current.insert(key, value);
    }

    /// Inserts unless the key is there already.
    pub(super) fn insert_new(&mut self, key: K, value: V) {
        if !self.contains(&key) {
            self.current.insert(key, value);
        }
    }

    pub(super) fn current_len(&self) -> usize {
        self.current.len()
    }

    /// The older generation, emptied (its capacity kept).
    pub(super) fn retire(&mut self, mut into: impl FnMut(K, V)) {
        for (key, value) in self.older.drain() {
            into(key, value);
        }
    }

    /// The current generation becomes the older one (which must be empty).
    pub(super) fn rotate(&mut self) {
        debug_assert!(self.older.is_empty());
        std::mem::swap(&mut self.current, &mut self.older);
    }

    pub(super) fn bytes(&self) -> u64 {
        // One control byte per bucket besides the entry.
        ((self.current.capacity() + self.older.capacity()) * (std::mem::size_of::<(K, V)>() + 1))
            as u64
    }
}

/// A bounded matcher's filter and where its older generation stands.
pub(super) struct Window {
    pub(super) memory: MatcherMemory,
    pub(super) filter: Filter,
    /// Items the matcher had sent to its writer when the older generation stopped taking
    /// entries: once the writer has committed that many, the older generation is in the store.
    pub(super) older_sent: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::matcher::KeyHasher;

    #[test]
    fn the_filter_has_no_false_negatives_and_few_false_positives_at_its_size() {
        // 1 MiB over 100,000 keys: 84 bits a key.
        let mut filter = Filter::new(1 << 20);
        let hasher = KeyHasher::random();
        let keys: Vec<HashKey> = (0..100_000)
            .map(|i| hasher.message("BROKERGB2L", &format!("M{i}")))
            .collect();
        for key in &keys {
            filter.insert(*key, FactKind::Seen);
        }
        assert!(keys.iter().all(|key| filter.contains(*key, FactKind::Seen)));
        let others = (0..100_000)
            .filter(|i| {
                filter.contains(
                    hasher.message("BROKERGB2L", &format!("N{i}")),
                    FactKind::Seen,
                )
            })
            .count();
        assert!(others < 10, "{others} false positives in 100,000");
        // Kinds do not answer for each other.
        let crossed = keys
            .iter()
            .filter(|key| filter.contains(**key, FactKind::Closed))
            .count();
        assert!(crossed < 10, "{crossed}");
    }
}
