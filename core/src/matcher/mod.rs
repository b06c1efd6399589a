//! The matcher: a deterministic state machine per shard. It does no I/O and reads no clock; the
//! time it stamps on a CLS is handed in by its caller. Its state can always be rebuilt by
//! replaying the shard's accepted messages. It hashes its keys under a secret of its own
//! ([`KeyHasher`], drawn from the operating system as its hash maps' seeds are); what it answers
//! does not depend on the secret.
//!
//! Cancel and amend are order-independent by construction: a message is *live* when it is
//! accepted, is not a CAN, and no accepted CAN or AMD names it. The state of a trade is a
//! function of the set of its accepted messages, whatever order they came in.

mod criteria;
mod keys;
mod memory;
mod recall;

use std::sync::Arc;

use std::hash::Hash;

use ahash::AHashMap;
use time::Date;

use crate::model::{is_trade_key_of, Cls, Function, Msg, MsgType, Text};
use crate::profile::Tolerances;
use crate::reason::{Criterion, ReasonCode, Rejection};
use crate::refdata::RefData;

pub use criteria::evaluate_trade;
use criteria::{Group, TypeCounts};
use keys::Verdict;
pub use keys::{Content, HashKey, KeyHasher};
pub use memory::{
    FactKind, MatcherMemory, FILTER_BITS_PER_FACT, FILTER_BYTES_MAX, PARTICIPANT_HELD_BYTES_DEFAULT,
};
use memory::{Filter, Remembered, Window};
pub use recall::{
    RecallQuery, Recalled, RecalledTrade, RecalledVerdict, RetiredEntry, RetiredFact,
};

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
    /// The new status is the trade's first: no status of it was stored before, as far as this
    /// matcher knows (a trade it restored from the store counts as stored). A store may insert
    /// its row where it would otherwise insert or update; the store's own key has the last word.
    pub trade_status_first: bool,
    /// Boxed: one outcome in seven carries one, and every outcome is moved through the queues.
    pub cls: Option<Box<Cls>>,
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
    /// The outcome's parts agree: a CLS only for a message accepted into a trade it matched,
    /// a mismatch advice only for an accepted message of a mismatched trade, a new status and
    /// released messages only from an accepted one.
    fn assert_consistent(&self) {
        let accepted = self.disposition == Disposition::Accepted;
        if self.cls.is_some() {
            assert!(accepted && self.trade_status == Some(TradeStatus::Matched));
        }
        if self.advice.is_some() {
            // Told again while the trade stays mismatched: its status need not change.
            assert!(accepted && matches!(self.trade_status, None | Some(TradeStatus::Mismatched)));
        }
        assert!(accepted || self.released.is_empty());
        assert!(accepted || self.trade_status.is_none());
        assert!(self.trade_status.is_some() || !self.trade_status_first);
    }

    /// The outcome of a message that changes no trade.
    pub fn only(disposition: Disposition) -> Self {
        Self {
            disposition,
            trade_status: None,
            trade_status_first: false,
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
    /// Boxed: a trade's slots are copied as it grows, and a pointer copies for less.
    msg: Box<Msg>,
    /// Named by an accepted CAN or AMD of its trade: no longer live. Kept on the message, so
    /// that it holds once the name itself has been retired from the exact tables.
    named: bool,
}

struct Trade {
    messages: Vec<Held>,
    /// The trade's investment manager ([`owner_of`]), worked out again whenever a NOE, or a CAN
    /// or AMD of one, is accepted — only those change it: a trade whose NOE was cancelled still
    /// belongs to its parties.
    owner: Option<Text>,
    status: TradeStatus,
    /// Whether a status of the trade has been handed to the store ([`Outcome::trade_status_first`]).
    status_stored: bool,
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

impl Closed {
    /// The closed trade as one word, as a store of retired facts keeps it: its date's Julian
    /// day shifted left once, the low bit set if it aged out.
    fn bits(self) -> u64 {
        (u64::from(self.date.to_julian_day() as u32) << 1) | u64::from(self.aged)
    }

    fn from_bits(bits: u64) -> Self {
        Self {
            date: Date::from_julian_day((bits >> 1) as u32 as i32).unwrap_or(Date::MIN),
            aged: bits & 1 == 1,
        }
    }
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

/// The matching state machine of one shard.
pub struct Matcher {
    refdata: Arc<RefData>,
    tolerances: Tolerances,
    /// Makes the keys of `closed`, `seen` and `named` under this matcher's own secret.
    keys: KeyHasher,
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
    held_by: AHashMap<Text, u64>,
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
            keys: KeyHasher::random(),
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
            // What is let go was held: the quota's count never goes below what it holds.
            assert!(
                *held >= u64::from(bytes),
                "{sender} lets go more than it holds"
            );
            *held -= u64::from(bytes);
            if *held == 0 {
                self.held_by.remove(sender);
            }
        }
    }

    /// Whether the matcher's memory is bounded ([`Matcher::bounded`]).
    pub fn is_bounded(&self) -> bool {
        self.window.is_some()
    }

    /// Rebuilding a bounded matcher: the shard's count of accepted messages, of which only the
    /// open trades' were taken back.
    pub fn set_accepted(&mut self, accepted: u64) {
        self.accepted = accepted;
    }

    /// Processes one validated message. `content` is what the matcher keeps of its wire bytes
    /// (their length, and their hash for exact-duplicate detection: [`Content::of`]),
    /// `injected_ns` when it entered the engine, `now` the timestamp to stamp on a CLS and
    /// `today` its date.
    ///
    /// A trade's rows are stored under one date, fixed by its first accepted message: that
    /// message's TradeDate, or `today` for a CAN (which carries none).
    pub fn process(
        &mut self,
        msg: Box<Msg>,
        content: Content,
        injected_ns: u64,
        now: &str,
        today: Date,
    ) -> Outcome {
        let trade_key = msg.trade_key();
        self.process_keyed(msg, &trade_key, content, injected_ns, now, today)
    }

    /// [`Matcher::process`], given the message's trade key (`Broker/TradeRef`, as
    /// [`Msg::trade_key`] makes it), for a caller that has made it already.
    pub fn process_keyed(
        &mut self,
        msg: Box<Msg>,
        trade_key: &str,
        content: Content,
        injected_ns: u64,
        now: &str,
        today: Date,
    ) -> Outcome {
        assert!(
            is_trade_key_of(trade_key, &msg),
            "{trade_key} is not the message's trade key"
        );
        let date = msg.trade_date.unwrap_or(today);
        let accepted_before = self.accepted;
        let outcome = self.process_dated(
            msg,
            trade_key,
            content,
            injected_ns,
            now,
            date,
            today,
            false,
        );
        outcome.assert_consistent();
        // A message is counted once, and only when it is accepted.
        assert_eq!(
            self.accepted,
            accepted_before + u64::from(outcome.disposition == Disposition::Accepted)
        );
        outcome
    }

    #[allow(clippy::too_many_arguments)]
    fn process_dated(
        &mut self,
        msg: Box<Msg>,
        trade_key: &str,
        content: Content,
        injected_ns: u64,
        now: &str,
        date_if_new: Date,
        received_on: Date,
        restoring: bool,
    ) -> Outcome {
        let key = self.keys.message(&msg.sender, &msg.msg_id);
        if let Some(seen) = self.answer_seen(key, content, &msg.sender, &msg.msg_id) {
            return Outcome::only(seen);
        }
        let is_named = self.named.contains(&key);
        // A trade is open or closed, never both: it opens only past this check and closes only
        // as it leaves `open`. An open trade's messages (all but its first) therefore skip the
        // key and the look-up in `closed`, which is large and cold.
        let open = self.open.contains_key(trade_key);
        debug_assert!(!open || self.closed.get(&self.keys.trade(trade_key)).is_none());
        let closed = if open {
            None
        } else {
            self.closed.get(&self.keys.trade(trade_key))
        };
        if let Some(Closed { date, aged }) = closed {
            if !is_named {
                return self.reject(
                    key,
                    content,
                    Rejection::new(
                        ReasonCode::Closed,
                        format!(
                            "trade {trade_key} is already {}",
                            if aged { "aged out" } else { "matched" }
                        ),
                    ),
                );
            }
            self.remember(key, content, &msg);
            return Outcome {
                trade_date: date,
                ..Outcome::only(Disposition::Accepted)
            };
        }
        // Taking back what a shard accepted, the checks that a stored message may predate (who
        // is a party, the bounds, AMDs in another sender's slot) are not made again: what was
        // accepted stays accepted, and the trade ends as it was.
        if let Some(trade) = self.open.get(trade_key).filter(|_| !restoring) {
            if let Some(owner) = trade.owner.as_deref() {
                if !self.is_party(&msg, owner) {
                    // Who the trade's parties are is not told to a stranger.
                    let rejection = Rejection::new(
                        ReasonCode::Auth,
                        format!("{} is not a party of trade {trade_key}", msg.sender),
                    );
                    return self.reject(key, content, rejection);
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
                return self.reject(key, content, rejection);
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
                    return self.reject(key, content, rejection);
                }
            }
        }
        let opens = !self.open.contains_key(trade_key);
        let bytes = held_bytes(content, trade_key, opens);
        if !restoring && self.held_by(&msg.sender) + u64::from(bytes) > self.participant_held_max {
            let rejection = Rejection::new(
                ReasonCode::Limit,
                format!(
                    "{} holds {} bytes in open trades of this shard, its most",
                    msg.sender, self.participant_held_max
                ),
            );
            return self.reject(key, content, rejection);
        }
        self.remember(key, content, &msg);
        self.hold(&msg.sender, bytes);
        // The key is copied only when the trade opens: `entry` would take a copy every time.
        let trade = match self.open.get_mut(trade_key) {
            Some(trade) => trade,
            None => self.open.entry(trade_key.into()).or_insert_with(|| Trade {
                // One message, then doubling: a trade that never gets a second message (most
                // of what a flood of unmatched NOEs holds) keeps one slot, not four.
                messages: Vec::with_capacity(1),
                owner: None,
                status: TradeStatus::Pending,
                status_stored: restoring,
                date: date_if_new,
                first_injected_ns: injected_ns,
                last_failed: Vec::new(),
                advices: 0,
                last_active: received_on,
            }),
        };
        trade.first_injected_ns = trade.first_injected_ns.min(injected_ns);
        trade.last_active = trade.last_active.max(received_on);
        if msg.function != Function::New {
            if let Some(related) = &msg.related_id {
                let named = self.keys.message(&msg.sender, related);
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
        let released = self.release_strangers(trade_key, names_owner);
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
        let Some(owner) = owner_of(trade, |held| self.is_live(held)).map(Text::from) else {
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
                sender: held.msg.sender.to_string(),
                msg_id: held.msg.msg_id.to_string(),
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
        msg: Box<Msg>,
        raw: &[u8],
        injected_ns: u64,
        stored_date: Option<Date>,
        received_on: Date,
    ) -> bool {
        let date = stored_date.or(msg.trade_date).unwrap_or(Date::MIN);
        // What was accepted stays accepted, whatever the bounds and rules are now.
        let trade_key = msg.trade_key();
        let outcome = self.process_dated(
            msg,
            &trade_key,
            Content::of(raw),
            injected_ns,
            "",
            date,
            received_on,
            true,
        );
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
        let mut let_go: Vec<(crate::model::Text, u32)> = Vec::new();
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
                    if !parties.iter().any(|known| known == party) {
                        parties.push(party.to_string());
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
                self.keys.trade(&trade.trade_key),
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
        content: Content,
        sender: &str,
        msg_id: &str,
    ) -> Option<Disposition> {
        let seen = self.seen.get(&key)?;
        Some(if !seen.same_content(Verdict::new(content, None)) {
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
    fn reject(&mut self, key: HashKey, content: Content, rejection: Rejection) -> Outcome {
        self.seen
            .insert_new(key, Verdict::new(content, Some(rejection.code)));
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
        content: Content,
        rejection: Rejection,
    ) -> Disposition {
        let key = self.keys.message(sender, msg_id);
        match self.seen.get(&key) {
            None => self.reject(key, content, rejection).disposition,
            Some(seen) if seen.same_content(Verdict::new(content, None)) => self
                .answer_seen(key, content, sender, msg_id)
                .unwrap_or(Disposition::Rejected(rejection)),
            Some(_) => Disposition::Rejected(rejection),
        }
    }

    /// Takes back a rejection remembered before a restart (see [`Matcher::refuse`]); after
    /// the accepted messages, so that a key already accepted keeps its verdict.
    pub fn restore_rejection(&mut self, sender: &str, msg_id: &str, raw: &[u8], code: ReasonCode) {
        self.seen.insert_new(
            self.keys.message(sender, msg_id),
            Verdict::new(Content::of(raw), Some(code)),
        );
    }

    fn remember(&mut self, key: HashKey, content: Content, msg: &Msg) {
        self.seen.insert(key, Verdict::new(content, None));
        self.accepted += 1;
        if msg.function != Function::New {
            if let Some(related) = &msg.related_id {
                self.named
                    .insert(self.keys.message(&msg.sender, related), ());
            }
        }
    }

    fn is_live(&self, held: &Held) -> bool {
        held.msg.function != Function::Can && !held.named && !self.named.contains(&held.key)
    }

    fn evaluate(&mut self, trade_key: &str, now: &str) -> Outcome {
        let Some(trade) = self.open.get(trade_key) else {
            return Outcome::only(Disposition::Accepted);
        };
        let live = trade
            .messages
            .iter()
            .filter(|held| self.is_live(held))
            .map(|held| &*held.msg);
        // One pass counts the live messages by type; they are collected, and the criteria
        // judged, only where the counts are a complete trade's.
        let counts = TypeCounts::of(live.clone());
        let judged = if counts.complete() {
            let mut live: Vec<&Msg> = live.collect();
            Group::complete(&mut live).map(|group| {
                let failed = group.failed_criteria(&self.refdata, &self.tolerances);
                let cls = failed
                    .is_empty()
                    .then(|| Box::new(group.cls(&self.refdata, now)));
                (failed, cls)
            })
        } else {
            None
        };
        let (status, failed, cls) = match judged {
            Some((failed, Some(cls))) => (TradeStatus::Matched, failed, Some(cls)),
            Some((failed, None)) => (TradeStatus::Mismatched, failed, None),
            None if counts.is_empty()
                && trade
                    .messages
                    .iter()
                    .any(|h| h.msg.function == Function::Can) =>
            {
                (TradeStatus::Cancelled, Vec::new(), None)
            }
            None => (TradeStatus::Pending, Vec::new(), None),
        };
        let first_injected_ns = trade.first_injected_ns;
        let date = trade.date;
        let changed = status != trade.status;
        let first_status = changed && !trade.status_stored;
        let advise = status == TradeStatus::Mismatched
            && failed != trade.last_failed
            && trade.advices < ADVICES_PER_TRADE_MAX;
        let advice = advise.then(|| Advice {
            trade_key: trade_key.to_owned(),
            failed: failed.clone(),
        });
        if status == TradeStatus::Matched {
            if let Some(trade) = self.open.remove(trade_key) {
                for held in &trade.messages {
                    self.let_go(&held.msg.sender, held.bytes);
                }
            }
            self.closed
                .insert(self.keys.trade(trade_key), Closed { date, aged: false });
            self.closed_total += 1;
        } else if let Some(trade) = self.open.get_mut(trade_key) {
            trade.status = status;
            trade.status_stored |= changed;
            trade.last_failed = failed;
            trade.advices += u16::from(advise);
        }
        Outcome {
            disposition: Disposition::Accepted,
            trade_status: changed.then_some(status),
            trade_status_first: first_status,
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
        if let Some(closed) = self.closed.get(&self.keys.trade(trade_key)) {
            return Some(if closed.aged {
                TradeStatus::Aged
            } else {
                TradeStatus::Matched
            });
        }
        self.open.get(trade_key).map(|trade| trade.status)
    }
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
fn held_bytes(content: Content, trade_key: &str, opens: bool) -> u32 {
    let trade = if opens {
        std::mem::size_of::<(Box<str>, Trade)>() + trade_key.len() + 16
    } else {
        0
    };
    // Each of a message's ~20 strings is an allocation with a header and rounding.
    let strings = 20 * 16;
    let held = std::mem::size_of::<Held>() + std::mem::size_of::<Msg>();
    u32::try_from(content.bytes() + held + strings + trade).unwrap_or(u32::MAX)
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

#[cfg(test)]
mod tests {
    use super::*;

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
            matcher.refuse("S", id, Content::of(id.as_bytes()), rejection());
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
        let again = matcher.refuse("S", "A", Content::of(b"A"), rejection());
        assert!(matches!(again, Disposition::Rejected(r) if r.code == ReasonCode::Field));
        let mut query = RecallQuery::default();
        matcher.to_recall("S", "A", None, &mut query);
        assert!(query.is_empty(), "known exactly again");
    }
}
