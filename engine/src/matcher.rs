//! The matcher: a deterministic state machine per shard. It does no I/O and reads no clock; the
//! time it stamps on a CLS is handed in by its caller. Its state can always be rebuilt by
//! replaying the shard's accepted messages.
//!
//! Cancel and amend are order-independent by construction: a message is *live* when it is
//! accepted, is not a CAN, and no accepted CAN or AMD names it. The state of a trade is a
//! function of the set of its accepted messages, whatever order they came in.

use std::sync::Arc;

use std::hash::Hash;

use ahash::AHashMap;
use time::Date;
use xxhash_rust::xxh3::{xxh3_128, xxh3_64};

use crate::model::{cls_id, Cls, Decimal, Function, Msg, MsgType, Settlement, Side};
use crate::profile::Tolerances;
use crate::reason::{Criterion, ReasonCode, Rejection};
use crate::refdata::RefData;

/// A 128-bit hash standing in for a (Sender, MsgId) pair or a trade key, so that every message
/// ever accepted by a shard can be remembered in 24 bytes.
pub type HashKey = [u64; 2];

fn hash_key(parts: &[&str]) -> HashKey {
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
struct Verdict(u64);

impl Verdict {
    fn new(raw: &[u8], rejected: Option<ReasonCode>) -> Self {
        let code = rejected.map_or(0, |code| {
            1 + ReasonCode::ALL
                .iter()
                .position(|c| *c == code)
                .expect("every code is in ReasonCode::ALL") as u64
        });
        Self((xxh3_64(raw) & !0xFF) | code)
    }

    fn same_content(self, other: Self) -> bool {
        self.0 & !0xFF == other.0 & !0xFF
    }

    fn rejected(self) -> Option<ReasonCode> {
        match (self.0 & 0xFF) as usize {
            0 => None,
            index => ReasonCode::ALL.get(index - 1).copied(),
        }
    }
}

/// The status of a trade.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TradeStatus {
    /// Waiting for messages.
    Pending,
    /// Complete but failing at least one criterion; waits for an AMD or CAN.
    Mismatched,
    /// All criteria hold; the CLS is emitted and the trade is closed.
    Matched,
    /// CANs removed every message; a later NEW reopens it.
    Cancelled,
    /// Left unmatched for the aging period: closed and released from memory.
    Aged,
}

impl TradeStatus {
    /// The status as stored.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "PENDING",
            Self::Mismatched => "MISMATCHED",
            Self::Matched => "MATCHED",
            Self::Cancelled => "CANCELLED",
            Self::Aged => "AGED",
        }
    }
}

/// What became of one message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Disposition {
    Accepted,
    /// An exact re-send of an accepted message: acknowledged again, changes nothing.
    Duplicate,
    Rejected(Rejection),
}

/// A MISMATCHED status advice: the criteria that failed.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Advice {
    pub trade_key: String,
    pub failed: Vec<Criterion>,
}

/// A message accepted into a trade before the trade's NOE named its investment manager, from a
/// sender that turned out not to be a party of the trade: it no longer counts in the trade, and
/// its sender is told (a RELEASED advice).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Released {
    pub trade_key: String,
    pub sender: String,
    pub msg_id: String,
}

/// Messages one sender may have held in one trade, whatever they are (NEW, CAN, AMD, live or
/// replaced): in a trade of the largest AllocCount the investment manager sends 2,000 live
/// messages and the broker 1,001, and the rest leaves room for amendments. Beyond it a message
/// is refused E_LIMIT, so that what one trade costs to match and to rebuild is bounded. The
/// bound is the sender's own: a stranger filling a trade before its NOE arrives cannot use up
/// the parties' room.
pub const TRADE_MESSAGES_MAX: u32 = 4096;

/// MISMATCHED advices one trade sends its broker: a party that flips its messages between two
/// mismatches cannot flood its counterparty (or push its earlier answers out of a FIX resend
/// store); past it the trade's status is still kept, and its CLS still comes.
pub const ADVICES_PER_TRADE_MAX: u16 = 32;

/// Everything one message changes: what must be written and what must be sent after commit.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub disposition: Disposition,
    /// The trade's new status, when it changed.
    pub trade_status: Option<TradeStatus>,
    pub cls: Option<Cls>,
    /// Injection time of the trade's first message, for CLS latency.
    pub trade_first_injected_ns: u64,
    pub advice: Option<Advice>,
    /// Messages of non-parties that this message's NOE released from the trade.
    pub released: Vec<Released>,
    /// The date the trade's rows are stored under (see [`Matcher::process`]); meaningful when
    /// the message was accepted.
    pub trade_date: Date,
}

impl Outcome {
    /// The outcome of a message that changes no trade.
    pub fn only(disposition: Disposition) -> Self {
        Self {
            disposition,
            trade_status: None,
            cls: None,
            trade_first_injected_ns: 0,
            advice: None,
            released: Vec::new(),
            trade_date: Date::MIN,
        }
    }
}

struct Held {
    key: HashKey,
    /// What it counts against its sender's quota ([`MatcherMemory::participant_held_bytes`]).
    bytes: u32,
    msg: Msg,
    /// Named by an accepted CAN or AMD of its trade: no longer live. Kept on the message, so
    /// that it holds once the name itself has been retired from the exact tables.
    named: bool,
}

struct Trade {
    messages: Vec<Held>,
    /// The trade's investment manager ([`owner_of`]), worked out again whenever a NOE, or a CAN
    /// or AMD of one, is accepted — only those change it: a trade whose NOE was cancelled still
    /// belongs to its parties.
    owner: Option<Box<str>>,
    status: TradeStatus,
    /// Fixed by the trade's first accepted message: the partition its rows are stored in.
    date: Date,
    first_injected_ns: u64,
    last_failed: Vec<Criterion>,
    /// MISMATCHED advices sent for it ([`ADVICES_PER_TRADE_MAX`]).
    advices: u16,
    /// The day of the trade's latest accepted message: aging counts from there.
    last_active: Date,
}

/// A closed trade: the date its rows are stored under, and whether it aged out (else matched).
#[derive(Debug, Clone, Copy)]
struct Closed {
    date: Date,
    aged: bool,
}

/// A trade that aged out: what its rows and its AGED advice need.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct AgedTrade {
    pub trade_key: String,
    /// The date the trade's rows are stored under.
    pub trade_date: Date,
    /// Its parties, to be told: Broker, InvMgr and the custodians its messages name.
    pub parties: Vec<String>,
}

/// Final counts of a shard.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ShardCounts {
    /// Distinct trades with at least one accepted message.
    pub trades: u64,
    /// Accepted messages.
    pub messages: u64,
    pub matched: u64,
    pub mismatched: u64,
    pub pending: u64,
    pub cancelled: u64,
    pub aged: u64,
}

/// How much a matcher remembers exactly, and the filter that stands for what it retired
/// (see [`Matcher::bounded`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatcherMemory {
    /// Entries (message keys, closed trades, names) of one generation of the exact tables.
    pub generation_entries: usize,
    /// Bytes of the filter over retired entries (rounded up to a power of two).
    pub filter_bytes: usize,
    /// Bytes that one participant's messages may hold in the open trades of one shard (as
    /// [`Matcher`] counts them: each message's bytes and what it takes in memory, and a trade's
    /// entry for the message that opens it); a message beyond it is refused E_LIMIT, so that no
    /// participant can fill the memory the others need. It applies to every store's matcher.
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
#[derive(Debug, Clone, Copy)]
enum Kind {
    Seen,
    Closed,
    Named,
}

impl Kind {
    fn salt(self) -> u64 {
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
struct Filter {
    blocks: Vec<[u64; FILTER_BLOCK_WORDS]>,
    mask: u64,
}

/// Words of a block: 512 bits, one cache line.
const FILTER_BLOCK_WORDS: usize = 8;
/// Probes per key: the optimum for about ten bits per key.
const FILTER_PROBES: u32 = 7;
/// Bits that place one probe in its block.
const FILTER_PROBE_BITS: u32 = (FILTER_BLOCK_WORDS * 64).trailing_zeros();
const _: () = assert!(FILTER_PROBES * FILTER_PROBE_BITS <= 64);

impl Filter {
    fn new(bytes: usize) -> Self {
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
    fn place(&self, key: HashKey, kind: Kind) -> (usize, impl Iterator<Item = usize>) {
        let block = ((key[0] ^ kind.salt()) & self.mask) as usize;
        let bits = (key[1] ^ kind.salt().rotate_left(29)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let probe_mask = (1_u64 << FILTER_PROBE_BITS) - 1;
        let probes = (0..FILTER_PROBES)
            .map(move |i| ((bits >> (i * FILTER_PROBE_BITS)) & probe_mask) as usize);
        (block, probes)
    }

    fn insert(&mut self, key: HashKey, kind: Kind) {
        let (block, probes) = self.place(key, kind);
        let block = &mut self.blocks[block];
        for bit in probes {
            block[bit >> 6] |= 1 << (bit & 63);
        }
    }

    fn contains(&self, key: HashKey, kind: Kind) -> bool {
        let (block, mut probes) = self.place(key, kind);
        let block = &self.blocks[block];
        probes.all(|bit| block[bit >> 6] & (1 << (bit & 63)) != 0)
    }

    fn bytes(&self) -> usize {
        self.blocks.len() * FILTER_BLOCK_WORDS * 8
    }
}

/// An exact table in two generations: entries go into the current one; the older one waits
/// until everything in it is committed, then is retired into the filter. Clearing keeps a
/// table's capacity, so the tables stop growing once they have reached a generation's size.
struct Remembered<K, V> {
    current: AHashMap<K, V>,
    older: AHashMap<K, V>,
}

impl<K: Hash + Eq + Copy, V: Copy> Remembered<K, V> {
    fn new() -> Self {
        Self {
            current: AHashMap::new(),
            older: AHashMap::new(),
        }
    }

    fn get(&self, key: &K) -> Option<V> {
        match self.current.get(key) {
            Some(value) => Some(*value),
            None if self.older.is_empty() => None,
            None => self.older.get(key).copied(),
        }
    }

    fn contains(&self, key: &K) -> bool {
        self.get(key).is_some()
    }

    fn insert(&mut self, key: K, value: V) {
        self.current.insert(key, value);
    }

    /// Inserts unless the key is there already.
    fn insert_new(&mut self, key: K, value: V) {
        if !self.contains(&key) {
            self.current.insert(key, value);
        }
    }

    fn current_len(&self) -> usize {
        self.current.len()
    }

    /// The older generation, emptied (its capacity kept).
    fn retire(&mut self, mut into: impl FnMut(K)) {
        for (key, _) in self.older.drain() {
            into(key);
        }
    }

    /// The current generation becomes the older one (which must be empty).
    fn rotate(&mut self) {
        debug_assert!(self.older.is_empty());
        std::mem::swap(&mut self.current, &mut self.older);
    }

    fn bytes(&self) -> u64 {
        // One control byte per bucket besides the entry.
        ((self.current.capacity() + self.older.capacity()) * (std::mem::size_of::<(K, V)>() + 1))
            as u64
    }
}

/// A bounded matcher's filter and where its older generation stands.
struct Window {
    memory: MatcherMemory,
    filter: Filter,
    /// Items the matcher had sent to its writer when the older generation stopped taking
    /// entries: once the writer has committed that many, the older generation is in the store.
    older_sent: Option<u64>,
}

/// What a bounded matcher must read back from its shard's store before it processes a batch:
/// facts it retired to its filter that the batch's messages may need ([`Matcher::to_recall`]).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct RecallQuery {
    /// (Sender, MsgId) whose first verdict is needed.
    pub verdicts: Vec<(String, String)>,
    /// Trade keys that may be closed.
    pub trades: Vec<String>,
    /// (Sender, MsgId) that an accepted CAN or AMD may have named.
    pub names: Vec<(String, String)>,
}

impl RecallQuery {
    pub fn is_empty(&self) -> bool {
        self.verdicts.is_empty() && self.trades.is_empty() && self.names.is_empty()
    }
}

/// The first verdict on a (Sender, MsgId), read back from the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecalledVerdict {
    pub sender: String,
    pub msg_id: String,
    /// The bytes of the first message under the key.
    pub raw: Vec<u8>,
    /// Its code, if it was rejected; `None` if it was accepted.
    pub rejected: Option<ReasonCode>,
}

/// A closed trade read back from the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecalledTrade {
    pub trade_key: String,
    pub trade_date: Date,
    pub aged: bool,
}

/// The answers to a [`RecallQuery`]: what the store holds of what was asked; what it does
/// not hold was never there.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Recalled {
    pub verdicts: Vec<RecalledVerdict>,
    pub closed: Vec<RecalledTrade>,
    /// (Sender, MsgId) named by an accepted CAN or AMD.
    pub names: Vec<(String, String)>,
}

/// A fact of a shard's history that a bounded matcher rebuilt from its store keeps in its
/// filter only ([`Matcher::retired`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RetiredFact {
    /// An accepted message; `names` is the MsgId a CAN or AMD names.
    Accepted {
        sender: String,
        msg_id: String,
        names: Option<String>,
    },
    /// A rejection its MsgId remembers ([`crate::store::code_is_remembered`]).
    Rejected { sender: String, msg_id: String },
    /// A matched or aged-out trade.
    Closed { trade_key: String, aged: bool },
}

/// The matching state machine of one shard.
pub struct Matcher {
    refdata: Arc<RefData>,
    tolerances: Tolerances,
    open: AHashMap<Box<str>, Trade>,
    /// Matched trades and the date their rows are stored under.
    /// (It fills the entry's padding: an aged trade costs no more than a matched one.)
    closed: Remembered<HashKey, Closed>,
    /// Every message key seen after its signature checked out, with its verdict: the content
    /// hash of the first message under the key and how it was answered ([`Verdict`]).
    seen: Remembered<HashKey, Verdict>,
    /// Message keys named by an accepted CAN or AMD.
    named: Remembered<HashKey, ()>,
    /// Bounded: the filter over retired entries; `None` remembers everything exactly.
    window: Option<Window>,
    /// Bytes each participant's messages hold in open trades ([`Held::bytes`]).
    held_by: AHashMap<Box<str>, u64>,
    /// The most each participant's may hold ([`MatcherMemory::participant_held_bytes`]).
    participant_held_max: u64,
    accepted: u64,
    /// Trades closed: matched or aged out.
    closed_total: u64,
    /// Trades aged out (they are among the closed ones).
    aged: u64,
}

impl Matcher {
    /// A matcher with no trades that remembers every message key and closed trade exactly,
    /// for as long as it runs.
    pub fn new(refdata: Arc<RefData>, tolerances: Tolerances) -> Self {
        Self {
            refdata,
            tolerances,
            open: AHashMap::new(),
            closed: Remembered::new(),
            seen: Remembered::new(),
            named: Remembered::new(),
            window: None,
            held_by: AHashMap::new(),
            participant_held_max: u64::MAX,
            accepted: 0,
            closed_total: 0,
            aged: 0,
        }
    }

    /// A matcher whose memory is bounded: it keeps the open trades, two generations of exact
    /// tables and a filter of fixed size over what it retired. A generation is retired into the
    /// filter once its writer has committed it ([`Matcher::after_batch`]); a message that the
    /// filter may know of needs its facts read back from the store first
    /// ([`Matcher::to_recall`], [`Matcher::recall`]).
    pub fn bounded(refdata: Arc<RefData>, tolerances: Tolerances, memory: MatcherMemory) -> Self {
        Self {
            window: Some(Window {
                memory,
                filter: Filter::new(memory.filter_bytes),
                older_sent: None,
            }),
            ..Self::new(refdata, tolerances).with_quota(memory.participant_held_bytes)
        }
    }

    /// Sets the bytes one participant's messages may hold in open trades
    /// ([`MatcherMemory::participant_held_bytes`]); a new matcher has no such bound.
    pub fn with_quota(mut self, participant_held_bytes: u64) -> Self {
        self.participant_held_max = participant_held_bytes;
        self
    }

    /// Bytes `participant`'s messages hold in this shard's open trades.
    pub fn held_by(&self, participant: &str) -> u64 {
        self.held_by.get(participant).copied().unwrap_or(0)
    }

    fn hold(&mut self, sender: &str, bytes: u32) {
        match self.held_by.get_mut(sender) {
            Some(held) => *held += u64::from(bytes),
            None => {
                self.held_by.insert(sender.into(), u64::from(bytes));
            }
        }
    }

    fn let_go(&mut self, sender: &str, bytes: u32) {
        if let Some(held) = self.held_by.get_mut(sender) {
            *held = held.saturating_sub(u64::from(bytes));
            if *held == 0 {
                self.held_by.remove(sender);
            }
        }
    }

    /// Whether the matcher's memory is bounded ([`Matcher::bounded`]).
    pub fn is_bounded(&self) -> bool {
        self.window.is_some()
    }

    /// Adds to `query` what must be read back from the store before a message of `sender`
    /// with `msg_id` (and, if it was parsed, of `trade_key`) is processed: the facts about it
    /// that only the filter may hold. Nothing for a matcher that is not bounded.
    pub fn to_recall(
        &self,
        sender: &str,
        msg_id: &str,
        trade_key: Option<&str>,
        query: &mut RecallQuery,
    ) {
        let Some(window) = &self.window else {
            return;
        };
        let key = message_key(sender, msg_id);
        if !self.seen.contains(&key) && window.filter.contains(key, Kind::Seen) {
            query.verdicts.push((sender.to_owned(), msg_id.to_owned()));
        }
        if let Some(trade_key) = trade_key {
            let hash = hash_key(&[trade_key]);
            if !self.open.contains_key(trade_key)
                && !self.closed.contains(&hash)
                && window.filter.contains(hash, Kind::Closed)
            {
                query.trades.push(trade_key.to_owned());
            }
            if !self.named.contains(&key) && window.filter.contains(key, Kind::Named) {
                query.names.push((sender.to_owned(), msg_id.to_owned()));
            }
        }
    }

    /// Takes back what the store answered to a [`RecallQuery`].
    pub fn recall(&mut self, recalled: Recalled) {
        for verdict in recalled.verdicts {
            self.seen.insert_new(
                message_key(&verdict.sender, &verdict.msg_id),
                Verdict::new(&verdict.raw, verdict.rejected),
            );
        }
        for trade in recalled.closed {
            self.closed.insert(
                hash_key(&[&trade.trade_key]),
                Closed {
                    date: trade.trade_date,
                    aged: trade.aged,
                },
            );
        }
        for (sender, msg_id) in recalled.names {
            self.named.insert(message_key(&sender, &msg_id), ());
        }
    }

    /// After each batch: `sent` items handed to the writer so far, `committed` of them
    /// committed. Retires the older generation into the filter once it is committed, and
    /// starts a new generation once the current one is full and the older one retired.
    pub fn after_batch(&mut self, sent: u64, committed: u64) {
        let Some(window) = &mut self.window else {
            return;
        };
        if window.older_sent.is_some_and(|mark| committed >= mark) {
            let filter = &mut window.filter;
            self.seen.retire(|key| filter.insert(key, Kind::Seen));
            self.closed.retire(|key| filter.insert(key, Kind::Closed));
            self.named.retire(|key| filter.insert(key, Kind::Named));
            window.older_sent = None;
        }
        let entries =
            self.seen.current_len() + self.closed.current_len() + self.named.current_len();
        if window.older_sent.is_none() && entries >= window.memory.generation_entries {
            self.seen.rotate();
            self.closed.rotate();
            self.named.rotate();
            window.older_sent = Some(sent);
        }
    }

    /// Rebuilding a bounded matcher: a fact of the shard's history that goes straight into the
    /// filter (the open trades' messages are then taken back with [`Matcher::restore`]).
    /// A matcher that is not bounded takes back every message instead, and ignores this.
    pub fn retired(&mut self, fact: RetiredFact) {
        let Some(window) = &mut self.window else {
            return;
        };
        match fact {
            RetiredFact::Accepted {
                sender,
                msg_id,
                names,
            } => {
                window
                    .filter
                    .insert(message_key(&sender, &msg_id), Kind::Seen);
                if let Some(named) = names {
                    window
                        .filter
                        .insert(message_key(&sender, &named), Kind::Named);
                }
            }
            RetiredFact::Rejected { sender, msg_id } => {
                window
                    .filter
                    .insert(message_key(&sender, &msg_id), Kind::Seen);
            }
            RetiredFact::Closed { trade_key, aged } => {
                window.filter.insert(hash_key(&[&trade_key]), Kind::Closed);
                self.closed_total += 1;
                self.aged += u64::from(aged);
            }
        }
    }

    /// Rebuilding a bounded matcher: the shard's count of accepted messages, of which only the
    /// open trades' were taken back.
    pub fn set_accepted(&mut self, accepted: u64) {
        self.accepted = accepted;
    }

    /// Processes one validated message. `raw` is its wire bytes (for exact-duplicate detection),
    /// `injected_ns` when it entered the engine, `now` the timestamp to stamp on a CLS and
    /// `today` its date.
    ///
    /// A trade's rows are stored under one date, fixed by its first accepted message: that
    /// message's TradeDate, or `today` for a CAN (which carries none).
    pub fn process(
        &mut self,
        msg: Msg,
        raw: &[u8],
        injected_ns: u64,
        now: &str,
        today: Date,
    ) -> Outcome {
        let date = msg.trade_date.unwrap_or(today);
        self.process_dated(msg, raw, injected_ns, now, date, today, false)
    }

    #[allow(clippy::too_many_arguments)]
    fn process_dated(
        &mut self,
        msg: Msg,
        raw: &[u8],
        injected_ns: u64,
        now: &str,
        date_if_new: Date,
        received_on: Date,
        restoring: bool,
    ) -> Outcome {
        let key = message_key(&msg.sender, &msg.msg_id);
        if let Some(seen) = self.answer_seen(key, raw, &msg.sender, &msg.msg_id) {
            return Outcome::only(seen);
        }
        let trade_key = msg.trade_key();
        let is_named = self.named.contains(&key);
        if let Some(Closed { date, aged }) = self.closed.get(&hash_key(&[&trade_key])) {
            if !is_named {
                return self.reject(
                    key,
                    raw,
                    Rejection::new(
                        ReasonCode::Closed,
                        format!(
                            "trade {trade_key} is already {}",
                            if aged { "aged out" } else { "matched" }
                        ),
                    ),
                );
            }
            self.remember(key, raw, &msg);
            return Outcome {
                trade_date: date,
                ..Outcome::only(Disposition::Accepted)
            };
        }
        // Taking back what a shard accepted, the checks that a stored message may predate (who
        // is a party, the bounds, AMDs in another sender's slot) are not made again: what was
        // accepted stays accepted, and the trade ends as it was.
        if let Some(trade) = self.open.get(trade_key.as_str()).filter(|_| !restoring) {
            if let Some(owner) = trade.owner.as_deref() {
                if !self.is_party(&msg, owner) {
                    // Who the trade's parties are is not told to a stranger.
                    let rejection = Rejection::new(
                        ReasonCode::Auth,
                        format!("{} is not a party of trade {trade_key}", msg.sender),
                    );
                    return self.reject(key, raw, rejection);
                }
            }
            let own = trade
                .messages
                .iter()
                .filter(|held| held.msg.sender == msg.sender)
                .count();
            if own >= TRADE_MESSAGES_MAX as usize {
                let rejection = Rejection::new(
                    ReasonCode::Limit,
                    format!(
                        "trade {trade_key} holds {TRADE_MESSAGES_MAX} messages of {}, its most",
                        msg.sender
                    ),
                );
                return self.reject(key, raw, rejection);
            }
            if msg.function != Function::Can && !is_named {
                // A NEW takes a free slot; an AMD whose message is not there yet takes it as a
                // NEW would, and no AMD puts a second live message into a slot that another
                // sender's message holds. Before a NOE names the investment manager, each
                // investment manager's messages have slots of their own.
                let slot = slot_of(&msg);
                let taken = trade.messages.iter().any(|held| {
                    self.is_live(held)
                        && slot_of(&held.msg) == slot
                        && (msg.function == Function::New || held.msg.sender != msg.sender)
                });
                if taken {
                    let rejection = Rejection::new(
                        ReasonCode::Conflict,
                        format!(
                            "a live {} already holds this slot of trade {trade_key}",
                            msg.msg_type.as_str()
                        ),
                    );
                    return self.reject(key, raw, rejection);
                }
            }
        }
        let opens = !self.open.contains_key(trade_key.as_str());
        let bytes = held_bytes(raw, &trade_key, opens);
        if !restoring && self.held_by(&msg.sender) + u64::from(bytes) > self.participant_held_max {
            let rejection = Rejection::new(
                ReasonCode::Limit,
                format!(
                    "{} holds {} bytes in open trades of this shard, its most",
                    msg.sender, self.participant_held_max
                ),
            );
            return self.reject(key, raw, rejection);
        }
        self.remember(key, raw, &msg);
        self.hold(&msg.sender, bytes);
        let trade = self
            .open
            .entry(trade_key.clone().into_boxed_str())
            .or_insert_with(|| Trade {
                // One message, then doubling: a trade that never gets a second message (most
                // of what a flood of unmatched NOEs holds) keeps one slot of 608 bytes, not four.
                messages: Vec::with_capacity(1),
                owner: None,
                status: TradeStatus::Pending,
                date: date_if_new,
                first_injected_ns: injected_ns,
                last_failed: Vec::new(),
                advices: 0,
                last_active: received_on,
            });
        trade.first_injected_ns = trade.first_injected_ns.min(injected_ns);
        trade.last_active = trade.last_active.max(received_on);
        if msg.function != Function::New {
            if let Some(related) = &msg.related_id {
                let named = message_key(&msg.sender, related);
                for held in &mut trade.messages {
                    held.named |= held.key == named;
                }
            }
        }
        let names_owner = msg.msg_type == MsgType::Noe;
        trade.messages.push(Held {
            key,
            bytes,
            msg,
            named: is_named,
        });
        let released = self.release_strangers(&trade_key, names_owner);
        Outcome {
            released,
            ..self.evaluate(trade_key, now)
        }
    }

    /// Whether `msg` may count in a trade whose investment manager is `owner`: the broker's
    /// messages always (the trade key names the broker, and only it may send them); an ALC or
    /// SET only for that investment manager; a CAN of an ALC only from it, a CAN of a SET also
    /// from a custodian that acts for it.
    fn is_party(&self, msg: &Msg, owner: &str) -> bool {
        match (msg.function, msg.msg_type) {
            (_, MsgType::Noe | MsgType::Npr) => true,
            (Function::Can, MsgType::Alc) => msg.sender == owner,
            (Function::Can, MsgType::Set) => {
                msg.sender == owner || self.refdata.acts_for(&msg.sender, owner)
            }
            (_, MsgType::Alc | MsgType::Set) => msg.inv_mgr.as_deref() == Some(owner),
        }
    }

    /// Once a NOE (`names_owner`: the message just accepted is one, or a CAN or AMD of one)
    /// names the trade's investment manager, keeps it on the trade and removes the messages of every sender that is not a party of the
    /// trade — accepted while no NOE said who is, or while another NOE named another investment
    /// manager — and returns them, so that their senders can be told.
    fn release_strangers(&mut self, trade_key: &str, names_owner: bool) -> Vec<Released> {
        if !names_owner {
            return Vec::new();
        }
        let Some(trade) = self.open.get(trade_key) else {
            return Vec::new();
        };
        let Some(owner) = owner_of(trade, |held| self.is_live(held)).map(Box::<str>::from) else {
            return Vec::new();
        };
        let strangers: Vec<usize> = trade
            .messages
            .iter()
            .enumerate()
            .filter(|(_, held)| !self.is_party(&held.msg, &owner))
            .map(|(index, _)| index)
            .collect();
        let Some(trade) = self.open.get_mut(trade_key) else {
            return Vec::new();
        };
        trade.owner = Some(owner);
        let mut released = Vec::with_capacity(strangers.len());
        let mut let_go = Vec::with_capacity(strangers.len());
        for index in strangers.into_iter().rev() {
            let held = trade.messages.remove(index);
            let_go.push((held.msg.sender.clone(), held.bytes));
            released.push(Released {
                trade_key: trade_key.to_owned(),
                sender: held.msg.sender,
                msg_id: held.msg.msg_id,
            });
        }
        for (sender, bytes) in let_go {
            self.let_go(&sender, bytes);
        }
        released.reverse();
        released
    }

    /// Takes back a message that was accepted before a restart, in acceptance order, so that the
    /// matcher ends in the state it had. Returns false if the message would not be accepted now,
    /// which means the shard's history and this matcher disagree. `stored_date` is the date
    /// the store kept the message under, where it keeps one.
    pub fn restore(
        &mut self,
        msg: Msg,
        raw: &[u8],
        injected_ns: u64,
        stored_date: Option<Date>,
        received_on: Date,
    ) -> bool {
        let date = stored_date.or(msg.trade_date).unwrap_or(Date::MIN);
        // What was accepted stays accepted, whatever the bounds and rules are now.
        let outcome = self.process_dated(msg, raw, injected_ns, "", date, received_on, true);
        outcome.disposition == Disposition::Accepted
    }

    /// Ages out every open trade that has had no accepted message for `business_days` whole
    /// business days of its security's market (weekends and that market's holidays do not
    /// count) before `today`: it is closed — later messages for it are E_CLOSED — and its
    /// messages are released, keeping only the closed trade's hash and date. A trade whose
    /// messages name no known security counts weekends only.
    pub fn age_out(&mut self, today: Date, business_days: u32) -> Vec<AgedTrade> {
        let refdata = self.refdata.clone();
        let mut aged = Vec::new();
        let mut let_go: Vec<(String, u32)> = Vec::new();
        self.open.retain(|trade_key, trade| {
            let market = trade
                .messages
                .iter()
                .find_map(|held| held.msg.isin.as_deref())
                .and_then(|isin| refdata.security(isin))
                .map(|security| security.market.as_str())
                .unwrap_or("");
            let mut elapsed = 0_u32;
            let mut day = trade.last_active;
            while elapsed < business_days {
                day = day.next_day().unwrap_or(Date::MAX);
                if day >= today {
                    return true;
                }
                if refdata.is_business_day(market, day) {
                    elapsed += 1;
                }
            }
            let_go.extend(
                trade
                    .messages
                    .iter()
                    .map(|held| (held.msg.sender.clone(), held.bytes)),
            );
            let mut parties: Vec<String> = Vec::new();
            for held in &trade.messages {
                let named = [
                    Some(&held.msg.broker),
                    held.msg.inv_mgr.as_ref(),
                    held.msg.custodian.as_ref(),
                ];
                for party in named.into_iter().flatten() {
                    if !parties.contains(party) {
                        parties.push(party.clone());
                    }
                }
            }
            aged.push(AgedTrade {
                trade_key: trade_key.to_string(),
                trade_date: trade.date,
                parties,
            });
            false
        });
        for (sender, bytes) in let_go {
            self.let_go(&sender, bytes);
        }
        self.closed_total += aged.len() as u64;
        for trade in &aged {
            self.closed.insert(
                hash_key(&[&trade.trade_key]),
                Closed {
                    date: trade.trade_date,
                    aged: true,
                },
            );
        }
        self.aged += aged.len() as u64;
        aged
    }

    /// The answer to a message whose key was seen before: the first answer again for an exact
    /// re-send (a duplicate ACK, or the same NAK code), E_DUPID for other content. `None` when
    /// the key is new.
    fn answer_seen(
        &self,
        key: HashKey,
        raw: &[u8],
        sender: &str,
        msg_id: &str,
    ) -> Option<Disposition> {
        let seen = self.seen.get(&key)?;
        Some(if !seen.same_content(Verdict::new(raw, None)) {
            Disposition::Rejected(Rejection::new(
                ReasonCode::DupId,
                format!("MsgId {msg_id} of {sender} was already used with different content"),
            ))
        } else {
            match seen.rejected() {
                None => Disposition::Duplicate,
                Some(code) => Disposition::Rejected(Rejection::new(
                    code,
                    format!(
                        "MsgId {msg_id} of {sender}: an exact re-send of a message rejected {code}"
                    ),
                )),
            }
        })
    }

    /// Rejects a message and remembers its verdict, so that its MsgId is never accepted later.
    fn reject(&mut self, key: HashKey, raw: &[u8], rejection: Rejection) -> Outcome {
        self.seen
            .insert_new(key, Verdict::new(raw, Some(rejection.code)));
        Outcome::only(Disposition::Rejected(rejection))
    }

    /// Answers a message that the validator rejected after its signature checked out (the
    /// Sender signed it): its MsgId is remembered like an accepted one, so that it is never
    /// accepted later — not even once the cause of the rejection is gone. An exact re-send of a
    /// message seen before gets the first answer again; other content keeps the validator's
    /// code, which comes first in the order of checks.
    pub fn refuse(
        &mut self,
        sender: &str,
        msg_id: &str,
        raw: &[u8],
        rejection: Rejection,
    ) -> Disposition {
        let key = message_key(sender, msg_id);
        match self.seen.get(&key) {
            None => self.reject(key, raw, rejection).disposition,
            Some(seen) if seen.same_content(Verdict::new(raw, None)) => self
                .answer_seen(key, raw, sender, msg_id)
                .unwrap_or(Disposition::Rejected(rejection)),
            Some(_) => Disposition::Rejected(rejection),
        }
    }

    /// Takes back a rejection remembered before a restart (see [`Matcher::refuse`]); after
    /// the accepted messages, so that a key already accepted keeps its verdict.
    pub fn restore_rejection(&mut self, sender: &str, msg_id: &str, raw: &[u8], code: ReasonCode) {
        self.seen
            .insert_new(message_key(sender, msg_id), Verdict::new(raw, Some(code)));
    }

    fn remember(&mut self, key: HashKey, raw: &[u8], msg: &Msg) {
        self.seen.insert(key, Verdict::new(raw, None));
        self.accepted += 1;
        if msg.function != Function::New {
            if let Some(related) = &msg.related_id {
                self.named.insert(message_key(&msg.sender, related), ());
            }
        }
    }

    fn is_live(&self, held: &Held) -> bool {
        held.msg.function != Function::Can && !held.named && !self.named.contains(&held.key)
    }

    fn evaluate(&mut self, trade_key: String, now: &str) -> Outcome {
        let Some(trade) = self.open.get(trade_key.as_str()) else {
            return Outcome::only(Disposition::Accepted);
        };
        let live: Vec<&Msg> = trade
            .messages
            .iter()
            .filter(|held| self.is_live(held))
            .map(|held| &held.msg)
            .collect();
        let mut failed = Vec::new();
        let status = if live.is_empty() {
            if trade
                .messages
                .iter()
                .any(|h| h.msg.function == Function::Can)
            {
                TradeStatus::Cancelled
            } else {
                TradeStatus::Pending
            }
        } else if let Some(group) = Group::complete(&live) {
            failed = group.failed_criteria(&self.refdata, &self.tolerances);
            if failed.is_empty() {
                TradeStatus::Matched
            } else {
                TradeStatus::Mismatched
            }
        } else {
            TradeStatus::Pending
        };
        let cls = if status == TradeStatus::Matched {
            Group::complete(&live).map(|group| group.cls(&self.refdata, now))
        } else {
            None
        };
        let first_injected_ns = trade.first_injected_ns;
        let date = trade.date;
        let changed = status != trade.status;
        let advise = status == TradeStatus::Mismatched
            && failed != trade.last_failed
            && trade.advices < ADVICES_PER_TRADE_MAX;
        let advice = advise.then(|| Advice {
            trade_key: trade_key.clone(),
            failed: failed.clone(),
        });
        if status == TradeStatus::Matched {
            if let Some(trade) = self.open.remove(trade_key.as_str()) {
                for held in &trade.messages {
                    self.let_go(&held.msg.sender, held.bytes);
                }
            }
            self.closed
                .insert(hash_key(&[&trade_key]), Closed { date, aged: false });
            self.closed_total += 1;
        } else if let Some(trade) = self.open.get_mut(trade_key.as_str()) {
            trade.status = status;
            trade.last_failed = failed;
            trade.advices += u16::from(advise);
        }
        Outcome {
            disposition: Disposition::Accepted,
            trade_status: changed.then_some(status),
            cls,
            trade_first_injected_ns: first_injected_ns,
            advice,
            released: Vec::new(),
            trade_date: date,
        }
    }

    /// Bytes the matcher's tables take, by their capacity: the exact memory of message keys
    /// seen and trades closed (all of them, or two generations in a bounded matcher), its
    /// filter, and the open trades' slots (not the messages those trades hold).
    pub fn table_bytes(&self) -> u64 {
        let open = (self.open.capacity() * (std::mem::size_of::<(Box<str>, Trade)>() + 1)) as u64;
        let filter = self
            .window
            .as_ref()
            .map_or(0, |window| window.filter.bytes() as u64);
        self.seen.bytes() + self.closed.bytes() + self.named.bytes() + open + filter
    }

    /// Final counts: trades by status and accepted messages.
    pub fn counts(&self) -> ShardCounts {
        let mut counts = ShardCounts {
            trades: self.open.len() as u64 + self.closed_total,
            messages: self.accepted,
            matched: self.closed_total - self.aged,
            aged: self.aged,
            ..ShardCounts::default()
        };
        for trade in self.open.values() {
            match trade.status {
                TradeStatus::Pending => counts.pending += 1,
                TradeStatus::Mismatched => counts.mismatched += 1,
                TradeStatus::Cancelled => counts.cancelled += 1,
                TradeStatus::Aged => counts.aged += 1,
                TradeStatus::Matched => counts.matched += 1,
            }
        }
        counts
    }

    /// The status of a trade, if the shard knows it (a bounded matcher: if it has not retired
    /// it).
    pub fn status_of(&self, trade_key: &str) -> Option<TradeStatus> {
        if let Some(closed) = self.closed.get(&hash_key(&[trade_key])) {
            return Some(if closed.aged {
                TradeStatus::Aged
            } else {
                TradeStatus::Matched
            });
        }
        self.open.get(trade_key).map(|trade| trade.status)
    }
}

/// Evaluates a set of live messages: `None` while the trade is incomplete, otherwise the
/// criteria that fail (empty when the trade matches).
pub fn evaluate_trade(
    live: &[&Msg],
    refdata: &RefData,
    tolerances: &Tolerances,
) -> Option<Vec<Criterion>> {
    Group::complete(live).map(|group| group.failed_criteria(refdata, tolerances))
}

/// The slot a NEW message takes in its trade: the NOE, one NPR per Account, and one ALC and
/// one SET per Account and investment manager (until the NOE says which investment manager's
/// messages count, a stranger's cannot take a slot from the trade's own).
fn slot_of(msg: &Msg) -> (MsgType, Option<&str>, Option<&str>) {
    match msg.msg_type {
        MsgType::Noe => (MsgType::Noe, None, None),
        MsgType::Npr => (MsgType::Npr, msg.account.as_deref(), None),
        other => (other, msg.account.as_deref(), msg.inv_mgr.as_deref()),
    }
}

/// What a message counts against its sender's quota: its bytes (its fields' text, as held, is
/// about as long), what holding it takes besides (its slot in its trade, and the ~20 string
/// allocations), and a trade's entry when it opens one: about 1.5 KB for a NOE that opens a
/// trade, close to what the heap spends on it.
fn held_bytes(raw: &[u8], trade_key: &str, opens: bool) -> u32 {
    let trade = if opens {
        std::mem::size_of::<(Box<str>, Trade)>() + trade_key.len() + 16
    } else {
        0
    };
    // Each of a message's ~20 strings is an allocation with a header and rounding.
    let strings = 20 * 16;
    u32::try_from(raw.len() + std::mem::size_of::<Held>() + strings + trade).unwrap_or(u32::MAX)
}

/// The investment manager of a trade: the one its live NOE names; with no live NOE, the one a
/// live NOE named last, or else the one a NOE it holds names (a NOE that a CAN or AMD of the
/// broker had named before it arrived).
fn owner_of(trade: &Trade, is_live: impl Fn(&Held) -> bool) -> Option<&str> {
    let noes = || {
        trade
            .messages
            .iter()
            .filter(|held| held.msg.msg_type == MsgType::Noe && held.msg.inv_mgr.is_some())
    };
    noes()
        .find(|held| is_live(held))
        .and_then(|held| held.msg.inv_mgr.as_deref())
        .or(trade.owner.as_deref())
        .or_else(|| noes().next().and_then(|held| held.msg.inv_mgr.as_deref()))
}

/// The live messages of a complete trade, by type.
struct Group<'a> {
    noe: &'a Msg,
    alcs: Vec<&'a Msg>,
    nprs: Vec<&'a Msg>,
    sets: Vec<&'a Msg>,
    all: &'a [&'a Msg],
}

impl<'a> Group<'a> {
    /// A trade is complete when its live messages are 1 NOE and n ALC, n NPR and n SET, where n
    /// is the AllocCount of at least one ALC.
    fn complete(live: &'a [&'a Msg]) -> Option<Self> {
        let of = |msg_type: MsgType| -> Vec<&'a Msg> {
            live.iter()
                .copied()
                .filter(|m| m.msg_type == msg_type)
                .collect()
        };
        let noes = of(MsgType::Noe);
        let alcs = of(MsgType::Alc);
        let nprs = of(MsgType::Npr);
        let sets = of(MsgType::Set);
        let count = alcs.len();
        let complete = noes.len() == 1
            && count >= 1
            && nprs.len() == count
            && sets.len() == count
            && alcs.iter().any(|alc| alc.alloc_count == Some(count as u32));
        complete.then(|| Self {
            noe: noes[0],
            alcs,
            nprs,
            sets,
            all: live,
        })
    }

    fn minor_units(&self, refdata: &RefData) -> u8 {
        self.noe
            .ccy
            .as_deref()
            .and_then(|ccy| refdata.currency(ccy))
            .map_or(2, |currency| currency.minor_units)
    }

    fn failed_criteria(&self, refdata: &RefData, tolerances: &Tolerances) -> Vec<Criterion> {
        let mut failed = Vec::new();
        let mut check = |criterion: Criterion, holds: bool| {
            if !holds {
                failed.push(criterion);
            }
        };
        fn all_equal<'m, T: PartialEq + 'm>(
            messages: impl IntoIterator<Item = &'m &'m Msg>,
            field: impl Fn(&'m Msg) -> T,
        ) -> bool {
            let mut values = messages.into_iter().map(|m| field(m));
            match values.next() {
                Some(first) => values.all(|value| value == first),
                None => true,
            }
        }
        let noe_alc = || std::iter::once(&self.noe).chain(self.alcs.iter());
        check(
            Criterion::C01,
            all_equal(self.all, |m| m.trade_ref.as_str()),
        );
        check(Criterion::C02, all_equal(self.all, |m| m.broker.as_str()));
        check(
            Criterion::C03,
            all_equal(self.all, |m| m.inv_mgr.as_deref()),
        );
        check(Criterion::C04, all_equal(self.all, |m| m.side));
        check(Criterion::C05, all_equal(self.all, |m| m.isin.as_deref()));
        check(Criterion::C06, all_equal(self.all, |m| m.trade_date));
        check(Criterion::C07, all_equal(self.all, |m| m.settle_date));
        check(
            Criterion::C08,
            all_equal(noe_alc(), |m| m.market.as_deref()),
        );
        check(
            Criterion::C09,
            all_equal(noe_alc().chain(self.nprs.iter()), |m| m.price),
        );
        check(Criterion::C10, all_equal(self.all, |m| m.ccy.as_deref()));
        let allocated: u64 = self.alcs.iter().filter_map(|alc| alc.qty).sum();
        check(
            Criterion::C11,
            all_equal(self.alcs.iter(), |m| m.alloc_count) && Some(allocated) == self.noe.qty,
        );

        let find = |messages: &[&'a Msg], account: Option<&str>| -> Vec<&'a Msg> {
            messages
                .iter()
                .copied()
                .filter(|m| m.account.as_deref() == account)
                .collect()
        };
        let mut accounts_hold = true;
        let mut per_account: Vec<(&Msg, &Msg, &Msg)> = Vec::with_capacity(self.alcs.len());
        for alc in &self.alcs {
            let account = alc.account.as_deref();
            let alcs = find(&self.alcs, account);
            let nprs = find(&self.nprs, account);
            let sets = find(&self.sets, account);
            if alcs.len() == 1 && nprs.len() == 1 && sets.len() == 1 {
                per_account.push((alc, nprs[0], sets[0]));
            } else {
                accounts_hold = false;
            }
        }
        check(Criterion::C12, accounts_hold);
        check(
            Criterion::C13,
            per_account
                .iter()
                .all(|(alc, npr, set)| alc.qty == npr.qty && npr.qty == set.qty),
        );
        let minor_units = self.minor_units(refdata);
        let gross_holds = self
            .nprs
            .iter()
            .all(|npr| match (npr.qty, npr.price, npr.gross) {
                (Some(qty), Some(price), Some(gross)) => {
                    let expected = price.times_quantity(qty).round_to(minor_units);
                    tolerances.within(expected, gross)
                }
                _ => false,
            });
        check(Criterion::C14, gross_holds);
        let net_holds = self.nprs.iter().all(|npr| {
            match (npr.gross, npr.commission, npr.fees, npr.net, npr.side) {
                (Some(gross), Some(commission), Some(fees), Some(net), Some(side)) => {
                    let expected = match side {
                        Side::Buy => gross + commission + fees,
                        Side::Sell => gross - commission - fees,
                    };
                    tolerances.within(expected, net)
                }
                _ => false,
            }
        });
        check(Criterion::C15, net_holds);
        check(
            Criterion::C16,
            per_account
                .iter()
                .all(|(alc, _, set)| alc.pset == set.pset && alc.payment_type == set.payment_type),
        );
        check(
            Criterion::C17,
            per_account
                .iter()
                .all(|(_, npr, set)| match (npr.net, set.settle_amount) {
                    (Some(net), Some(amount)) => tolerances.within(net, amount),
                    _ => false,
                }),
        );
        failed
    }

    fn cls(&self, refdata: &RefData, now: &str) -> Cls {
        let noe = self.noe;
        let mut settlements: Vec<Settlement> = self
            .alcs
            .iter()
            .map(|alc| {
                let account = alc.account.as_deref();
                let npr = self.nprs.iter().find(|m| m.account.as_deref() == account);
                let set = self.sets.iter().find(|m| m.account.as_deref() == account);
                Settlement {
                    account: alc.account.clone().unwrap_or_default(),
                    qty: alc.qty.unwrap_or_default(),
                    net: npr.and_then(|m| m.net).unwrap_or_default(),
                    custodian: set.and_then(|m| m.custodian.clone()).unwrap_or_default(),
                    safekeeping_account: set
                        .and_then(|m| m.safekeeping_account.clone())
                        .unwrap_or_default(),
                    pset: alc.pset.clone().unwrap_or_default(),
                    payment_type: alc.payment_type.unwrap_or(crate::model::PaymentType::Dvp),
                }
            })
            .collect();
        settlements.sort_by(|a, b| a.account.cmp(&b.account));
        Cls {
            cls_id: cls_id(&noe.broker, &noe.trade_ref),
            trade_ref: noe.trade_ref.clone(),
            broker: noe.broker.clone(),
            inv_mgr: noe.inv_mgr.clone().unwrap_or_default(),
            isin: noe.isin.clone().unwrap_or_default(),
            side: noe.side.unwrap_or(Side::Buy),
            trade_date: noe.trade_date.unwrap_or(time::Date::MIN),
            settle_date: noe.settle_date.unwrap_or(time::Date::MIN),
            ccy: noe.ccy.clone().unwrap_or_default(),
            ccy_minor_units: self.minor_units(refdata),
            price: noe.price.unwrap_or(Decimal(0)),
            qty: noe.qty.unwrap_or_default(),
            matched_at: now.to_owned(),
            settlements,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_filter_has_no_false_negatives_and_few_false_positives_at_its_size() {
        // 1 MiB over 100,000 keys: 84 bits a key.
        let mut filter = Filter::new(1 << 20);
        let keys: Vec<HashKey> = (0..100_000)
            .map(|i| message_key("BROKERGB2L", &format!("M{i}")))
            .collect();
        for key in &keys {
            filter.insert(*key, Kind::Seen);
        }
        assert!(keys.iter().all(|key| filter.contains(*key, Kind::Seen)));
        let others = (0..100_000)
            .filter(|i| filter.contains(message_key("BROKERGB2L", &format!("N{i}")), Kind::Seen))
            .count();
        assert!(others < 10, "{others} false positives in 100,000");
        // Kinds do not answer for each other.
        let crossed = keys
            .iter()
            .filter(|key| filter.contains(**key, Kind::Closed))
            .count();
        assert!(crossed < 10, "{crossed}");
    }

    #[test]
    fn a_generation_is_retired_only_once_its_writer_has_committed_it() {
        let refdata = Arc::new(RefData::embedded().expect("reference data"));
        let memory = MatcherMemory {
            generation_entries: 2,
            filter_bytes: 1024,
            ..MatcherMemory::default()
        };
        let mut matcher = Matcher::bounded(refdata, Tolerances::default(), memory);
        let rejection = || Rejection::new(ReasonCode::Field, "bad".to_owned());
        for id in ["A", "B"] {
            matcher.refuse("S", id, id.as_bytes(), rejection());
        }
        let mut query = RecallQuery::default();
        // Full: the generation becomes the older one; not committed yet, so kept exactly.
        matcher.after_batch(2, 0);
        matcher.to_recall("S", "A", None, &mut query);
        assert!(query.is_empty());
        matcher.after_batch(2, 1);
        matcher.to_recall("S", "A", None, &mut query);
        assert!(query.is_empty());
        // Committed: retired into the filter, which now asks for it.
        matcher.after_batch(2, 2);
        matcher.to_recall("S", "A", None, &mut query);
        assert_eq!(query.verdicts, vec![("S".to_owned(), "A".to_owned())]);
        // Read back, it is answered as before.
        matcher.recall(Recalled {
            verdicts: vec![RecalledVerdict {
                sender: "S".to_owned(),
                msg_id: "A".to_owned(),
                raw: b"A".to_vec(),
                rejected: Some(ReasonCode::Field),
            }],
            ..Recalled::default()
        });
        let again = matcher.refuse("S", "A", b"A", rejection());
        assert!(matches!(again, Disposition::Rejected(r) if r.code == ReasonCode::Field));
        let mut query = RecallQuery::default();
        matcher.to_recall("S", "A", None, &mut query);
        assert!(query.is_empty(), "known exactly again");
    }
}
