//! A bounded matcher's dealings with its store: what it must read back before a batch, taking
//! the answers back, retiring a committed generation into its filter, and rebuilding from the
//! shard's history.

use time::Date;

use super::keys::{Content, HashKey, Verdict};
use super::memory::FactKind;
use super::{Closed, Matcher};
use crate::reason::ReasonCode;

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
    /// A rejection its MsgId remembers ([`crate::reason::code_is_remembered`]).
    Rejected { sender: String, msg_id: String },
    /// A matched or aged-out trade.
    Closed { trade_key: String, aged: bool },
}
/// A fact that a bounded matcher retired from its exact tables, with its value: what a store
/// of retired facts keyed by hash keeps ([`Matcher::after_batch_into`]) and gives back
/// ([`Matcher::recall_entries`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetiredEntry {
    pub key: HashKey,
    pub kind: FactKind,
    /// Seen: the verdict (content hash and code); Closed: the trade's date and whether it aged
    /// out; Named: 0. Opaque outside the matcher.
    pub value: u64,
}

impl Matcher {
    /// Hands `want` the facts that must be read back before a message of `sender` with
    /// `msg_id` (and, if it was parsed, of `trade_key`) is processed: those about it that only
    /// the filter may hold. Nothing for a matcher that is not bounded.
    fn wanted(
        &self,
        sender: &str,
        msg_id: &str,
        trade_key: Option<&str>,
        mut want: impl FnMut(FactKind, HashKey),
    ) {
        let Some(window) = &self.window else {
            return;
        };
        let key = self.keys.message(sender, msg_id);
        if !self.seen.contains(&key) && window.filter.contains(key, FactKind::Seen) {
            want(FactKind::Seen, key);
        }
        if let Some(trade_key) = trade_key {
            // An open trade is not closed (see `process_dated`): its key is not made.
            if !self.open.contains_key(trade_key) {
                let hash = self.keys.trade(trade_key);
                if !self.closed.contains(&hash) && window.filter.contains(hash, FactKind::Closed) {
                    want(FactKind::Closed, hash);
                }
            }
            if !self.named.contains(&key) && window.filter.contains(key, FactKind::Named) {
                want(FactKind::Named, key);
            }
        }
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
        self.wanted(sender, msg_id, trade_key, |kind, _| {
            match (kind, trade_key) {
                (FactKind::Seen, _) => query.verdicts.push((sender.to_owned(), msg_id.to_owned())),
                (FactKind::Closed, Some(trade_key)) => query.trades.push(trade_key.to_owned()),
                (FactKind::Named, _) => query.names.push((sender.to_owned(), msg_id.to_owned())),
                (FactKind::Closed, None) => {}
            }
        });
    }

    /// As [`Matcher::to_recall`], for a store of retired facts that answers by hash key: adds
    /// the keys to look up, and their kinds, to `keys`.
    pub fn to_recall_keys(
        &self,
        sender: &str,
        msg_id: &str,
        trade_key: Option<&str>,
        keys: &mut Vec<(HashKey, FactKind)>,
    ) {
        self.wanted(sender, msg_id, trade_key, |kind, key| {
            keys.push((key, kind))
        });
    }

    /// Takes back what a store of retired facts held of the keys [`Matcher::to_recall_keys`]
    /// asked for; what it did not hold was never retired.
    pub fn recall_entries(&mut self, entries: impl IntoIterator<Item = RetiredEntry>) {
        for entry in entries {
            match entry.kind {
                FactKind::Seen => self
                    .seen
                    .insert_new(entry.key, Verdict::from_bits(entry.value)),
                FactKind::Closed => self
                    .closed
                    .insert(entry.key, Closed::from_bits(entry.value)),
                FactKind::Named => self.named.insert(entry.key, ()),
            }
        }
    }

    /// Takes back what the store answered to a [`RecallQuery`].
    pub fn recall(&mut self, recalled: Recalled) {
        for verdict in recalled.verdicts {
            self.seen.insert_new(
                self.keys.message(&verdict.sender, &verdict.msg_id),
                Verdict::new(Content::of(&verdict.raw), verdict.rejected),
            );
        }
        for trade in recalled.closed {
            self.closed.insert(
                self.keys.trade(&trade.trade_key),
                Closed {
                    date: trade.trade_date,
                    aged: trade.aged,
                },
            );
        }
        for (sender, msg_id) in recalled.names {
            self.named.insert(self.keys.message(&sender, &msg_id), ());
        }
    }

    /// After each batch: `sent` items handed to the writer so far, `committed` of them
    /// committed. Retires the older generation into the filter once it is committed, and
    /// starts a new generation once the current one is full and the older one retired.
    pub fn after_batch(&mut self, sent: u64, committed: u64) {
        self.after_batch_into(sent, committed, None);
    }

    /// The count of items the writer must have committed before the older generation can be
    /// retired; `None` when no generation waits to be retired.
    pub fn retires_at(&self) -> Option<u64> {
        self.window.as_ref().and_then(|window| window.older_sent)
    }

    /// As [`Matcher::after_batch`]; what it retires is also added to `retired`, if given, for
    /// a store of retired facts that answers by key. Returns whether it retired a generation.
    pub fn after_batch_into(
        &mut self,
        sent: u64,
        committed: u64,
        mut retired: Option<&mut Vec<RetiredEntry>>,
    ) -> bool {
        let Some(window) = &mut self.window else {
            return false;
        };
        let retiring = window.older_sent.is_some_and(|mark| committed >= mark);
        if retiring {
            let filter = &mut window.filter;
            let mut retire = |key, kind, value| {
                filter.insert(key, kind);
                if let Some(retired) = retired.as_deref_mut() {
                    retired.push(RetiredEntry { key, kind, value });
                }
            };
            self.seen
                .retire(|key, verdict| retire(key, FactKind::Seen, verdict.bits()));
            self.closed
                .retire(|key, closed| retire(key, FactKind::Closed, closed.bits()));
            self.named.retire(|key, ()| retire(key, FactKind::Named, 0));
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
        retiring
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
                    .insert(self.keys.message(&sender, &msg_id), FactKind::Seen);
                if let Some(named) = names {
                    window
                        .filter
                        .insert(self.keys.message(&sender, &named), FactKind::Named);
                }
            }
            RetiredFact::Rejected { sender, msg_id } => {
                window
                    .filter
                    .insert(self.keys.message(&sender, &msg_id), FactKind::Seen);
            }
            RetiredFact::Closed { trade_key, aged } => {
                window
                    .filter
                    .insert(self.keys.trade(&trade_key), FactKind::Closed);
                self.closed_total += 1;
                self.aged += u64::from(aged);
            }
        }
    }
}
