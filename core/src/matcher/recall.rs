//! A bounded matcher's dealings with its store: what it must read back before a batch, taking
//! the answers back, retiring a committed generation into its filter, and rebuilding from the
//! shard's history.

use time::Date;

use super::keys::{hash_key, message_key, Verdict};
use super::memory::Kind;
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
impl Matcher {
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
}
