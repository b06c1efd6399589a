//! Storage behind one interface: a batch of rows commits in one transaction or not at all.
//!
//! Three implementations: [`MemoryStore`] keeps the rows in process memory, [`SqliteStore`] is
//! the embedded default, one SQLite file per shard, and [`PgStore`] a shard in a PostgreSQL
//! database; the two durable ones go through sqlx.

/// The outbox id up to which every CLS was confirmed delivered (0 before any), in SQL: the
/// watermark that recovery, the outbox and retention read.
macro_rules! delivered_through_sql {
    () => {
        "COALESCE((SELECT delivered_through FROM cls_delivery WHERE id = 1), 0)"
    };
}

mod memory;
mod postgres;
mod retired;
mod sqlite;

pub use memory::MemoryStore;
pub use postgres::{Month, PgStore, TradeStates, PGPASS_FILE};
pub use retired::{RetiredRuns, RetiredStats};
pub use sqlite::SqliteStore;

use time::Date;

use crate::matcher::{RecallQuery, Recalled, RetiredFact, TradeStatus};
use crate::model::Text;
use crate::reason::ReasonCode;

/// An accepted message, with its raw bytes.
#[derive(Debug, Clone)]
pub struct MessageRow {
    /// The date of the trade's partition (see [`crate::matcher::Matcher::process`]).
    pub trade_date: Date,
    pub trade_key: String,
    pub sender: Text,
    pub msg_id: Text,
    pub msg_type: &'static str,
    pub function: &'static str,
    pub related_id: Option<Text>,
    pub injected_ns: u64,
    pub raw: Vec<u8>,
    /// The day the message arrived: aging counts business days from a trade's latest one.
    pub received_on: Date,
}

/// A trade's new status.
#[derive(Debug, Clone)]
pub struct TradeRow {
    pub trade_date: Date,
    pub trade_key: String,
    pub status: TradeStatus,
    /// The trade's first status: as far as its matcher knows the store has no row of it yet
    /// ([`crate::matcher::Outcome::trade_status_first`]). A store may load it without looking
    /// for one, and must still be right when there is one.
    pub first: bool,
}

/// A CLS in the outbox, written in the transaction of the message that completed the match.
#[derive(Debug, Clone)]
pub struct ClsRow {
    pub trade_date: Date,
    pub cls_id: String,
    pub trade_key: String,
    pub body: String,
}

/// A rejected message with its raw bytes, code and a human detail.
#[derive(Debug, Clone)]
pub struct ExceptionRow {
    /// The day the engine refused the message: exceptions are kept by the day they arrived.
    pub received_on: Date,
    pub trade_key: Option<String>,
    pub sender: Option<String>,
    pub msg_id: Option<String>,
    pub code: ReasonCode,
    pub detail: String,
    pub raw: Vec<u8>,
}

/// Everything one transaction writes.
#[derive(Debug, Default)]
pub struct Batch {
    pub messages: Vec<MessageRow>,
    pub trades: Vec<TradeRow>,
    pub cls: Vec<ClsRow>,
    pub exceptions: Vec<ExceptionRow>,
    /// Raises the outbox delivery watermark: every CLS up to this outbox id was delivered.
    pub delivered_through: Option<i64>,
}

/// A CLS of the outbox that was not confirmed delivered.
#[derive(Debug, Clone)]
pub struct UndeliveredCls {
    pub outbox_id: i64,
    pub cls_id: String,
    pub body: String,
}

/// Rows held by a store, for summaries and checks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RowCounts {
    pub messages: u64,
    pub trades: u64,
    pub cls: u64,
    pub exceptions: u64,
}

/// Why a store failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    // The cause in the message too: the operators' logs print an error's message, and "a
    // database error" alone does not say whether the server is down, full or refusing.
    #[error("database error on {store}: {source}")]
    Database { store: String, source: sqlx::Error },
    #[error("migration failed on {store}")]
    Migrate {
        store: String,
        source: sqlx::migrate::MigrateError,
    },
    #[error("{0}")]
    Unsupported(&'static str),
    /// The shard's fence refused a commit: another owner holds a newer lease.
    #[error("{store} refused a commit with lease token {token}: the shard has a newer owner")]
    Fenced { store: String, token: i64 },
    #[error("cannot start the i/o runtime")]
    Runtime(#[source] std::io::Error),
    /// Reading or writing the files of a shard's retired facts ([`RetiredRuns`]).
    #[error("retired facts in {dir}: {source}")]
    Retired { dir: String, source: std::io::Error },
}

/// An accepted message as stored, for rebuilding a matcher.
#[derive(Debug, Clone)]
pub struct StoredMessage {
    pub raw: Vec<u8>,
    pub injected_ns: u64,
    /// The date of the partition the message is kept in, where the store partitions by date.
    pub trade_date: Option<Date>,
    /// The day the message arrived, where the store has it.
    pub received_on: Option<Date>,
}

/// A rejection a matcher remembers (see [`crate::matcher::Matcher::refuse`]): an exception row
/// with a Sender and MsgId whose code was given after the signature checked out.
#[derive(Debug, Clone)]
pub struct StoredRejection {
    pub sender: String,
    pub msg_id: String,
    pub code: ReasonCode,
    pub raw: Vec<u8>,
}

pub use crate::reason::code_is_remembered;

/// The exception rows of unchecked input, in SQL: those the exception writer keeps, which name
/// no MsgId (the shards' writers keep every row that does).
pub const UNCHECKED_EXCEPTIONS_SQL: &str = "msg_id IS NULL";

/// The condition on `exceptions` rows that [`code_is_remembered`] states, in SQL.
const REMEMBERED_EXCEPTIONS_SQL: &str =
    "msg_id IS NOT NULL AND sender IS NOT NULL AND code NOT IN ('E_SIZE', 'E_SIG', 'E_DUPID')";

/// Rows read per query when a shard's messages are read back: bounds the memory of recovery.
pub const RECOVERY_PAGE_ROWS: i64 = 10_000;

/// A shard's durable storage.
pub trait Store: Send {
    /// Writes the whole batch in one transaction and returns the outbox id of each of its CLS,
    /// in order. On success the store may have taken the rows out of `batch`; on a failure
    /// that [`Store::is_transient`] calls transient it leaves `batch` as it was, so that it can
    /// be retried.
    fn commit(&mut self, batch: &mut Batch) -> Result<Vec<i64>, StoreError>;
    /// The outbox rows above the delivery watermark, in outbox order.
    fn undelivered_cls(&mut self) -> Result<Vec<UndeliveredCls>, StoreError>;
    /// Counts the rows held.
    fn row_counts(&mut self) -> Result<RowCounts, StoreError>;
    /// Makes every later commit carry the lease token of this shard's owner, and raises the
    /// shard's fence to it now: from then on a commit with an older token is refused
    /// ([`StoreError::Fenced`]). Only a store that other nodes can reach can be fenced.
    fn fence(&mut self, _token: u64) -> Result<(), StoreError> {
        Err(StoreError::Unsupported(
            "fencing a shard needs the PostgreSQL store",
        ))
    }
    /// Whether retrying after `error` (with [`Store::reconnect`]) may succeed.
    fn is_transient(&self, _error: &StoreError) -> bool {
        false
    }
    /// Replaces a broken connection.
    fn reconnect(&mut self) -> Result<(), StoreError> {
        Ok(())
    }
    /// Hands every accepted message to `visit`, in the order they were accepted, a bounded page
    /// at a time. Returns how many there were.
    fn for_each_accepted(
        &mut self,
        visit: &mut dyn FnMut(StoredMessage),
    ) -> Result<u64, StoreError>;
    /// Hands every remembered rejection to `visit`, in the order they were written, a bounded
    /// page at a time. Returns how many there were.
    fn for_each_remembered_rejection(
        &mut self,
        visit: &mut dyn FnMut(StoredRejection),
    ) -> Result<u64, StoreError>;
    /// Whether the store answers a bounded matcher ([`Store::recall`],
    /// [`Store::for_each_retired`], [`Store::for_each_accepted_of_open_trades`]).
    fn can_recall(&self) -> bool {
        false
    }
    /// Reads back what a bounded matcher asks for: the first verdict of each (Sender, MsgId)
    /// (an accepted message before any rejection), the trades of the query that are closed,
    /// and the (Sender, MsgId) that an accepted CAN or AMD names.
    fn recall(&mut self, _query: &RecallQuery) -> Result<Recalled, StoreError> {
        Err(StoreError::Unsupported("recall needs the PostgreSQL store"))
    }
    /// Hands a bounded matcher being rebuilt every fact of the shard's history it keeps in its
    /// filter: every accepted message's key (and the key it names), every remembered
    /// rejection's key and every closed trade, a bounded page at a time. Returns how many
    /// messages were accepted.
    fn for_each_retired(&mut self, _visit: &mut dyn FnMut(RetiredFact)) -> Result<u64, StoreError> {
        Err(StoreError::Unsupported("recall needs the PostgreSQL store"))
    }
    /// As [`Store::for_each_accepted`], the messages of the trades that are not closed only.
    fn for_each_accepted_of_open_trades(
        &mut self,
        _visit: &mut dyn FnMut(StoredMessage),
    ) -> Result<u64, StoreError> {
        Err(StoreError::Unsupported("recall needs the PostgreSQL store"))
    }
    /// Deletes the exceptions of unchecked input — the exception writer's rows, which name no
    /// MsgId and so set no verdict ([`UNCHECKED_EXCEPTIONS_SQL`]) — that arrived before
    /// `before`; how many. The memory store keeps everything.
    fn purge_unchecked_exceptions(&mut self, _before: Date) -> Result<u64, StoreError> {
        Ok(0)
    }
    /// Drops what is older than `keep_days` days before `today`. The memory store refuses.
    fn purge(&mut self, _today: Date, _keep_days: u32) -> Result<PurgeReport, StoreError> {
        Err(StoreError::Unsupported(
            "retention needs a durable store (embedded or postgres)",
        ))
    }
}

/// The single-threaded runtime on which a store's writer thread drives sqlx.
fn io_runtime() -> Result<tokio::runtime::Runtime, StoreError> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(StoreError::Runtime)
}

/// Connects with `connect`, then applies `migrator`, naming `store` in any error.
fn connect_and_migrate<C>(
    runtime: &tokio::runtime::Runtime,
    store: &str,
    connect: impl std::future::Future<Output = Result<C, sqlx::Error>>,
    migrate: impl AsyncFnOnce(&mut C) -> Result<(), sqlx::migrate::MigrateError>,
) -> Result<C, StoreError> {
    runtime.block_on(async {
        let mut connection = connect
            .await
            .map_err(|source| database_error(store, source))?;
        migrate(&mut connection)
            .await
            .map_err(|source| StoreError::Migrate {
                store: store.to_owned(),
                source,
            })?;
        Ok(connection)
    })
}

fn database_error(store: &str, source: sqlx::Error) -> StoreError {
    StoreError::Database {
        store: store.to_owned(),
        source,
    }
}

/// The outbox id of each CLS of `batch`, in the batch's order.
fn outbox_ids_in_order(batch: &Batch, ids: &ahash::AHashMap<String, i64>) -> Vec<i64> {
    batch
        .cls
        .iter()
        .map(|cls| ids.get(&cls.cls_id).copied().unwrap_or_default())
        .collect()
}

const UNDELIVERED_QUERY: &str = concat!(
    "SELECT id, cls_id, body FROM cls_outbox WHERE id > ",
    delivered_through_sql!(),
    " ORDER BY id"
);

fn undelivered_rows(rows: Vec<(i64, String, String)>) -> Vec<UndeliveredCls> {
    rows.into_iter()
        .map(|(outbox_id, cls_id, body)| UndeliveredCls {
            outbox_id,
            cls_id,
            body,
        })
        .collect()
}

/// The page query of remembered rejections, with the store's placeholders for the last id
/// read and the page size.
fn remembered_rejections_query(after_id: &str, limit: &str) -> String {
    format!(
        "SELECT id, sender, msg_id, code, raw FROM exceptions \
         WHERE id > {after_id} AND {REMEMBERED_EXCEPTIONS_SQL} ORDER BY id LIMIT {limit}"
    )
}

/// An `exceptions` row as recovery reads it: id, sender, msg_id, code, raw.
type RejectionRow = (i64, String, String, String, Vec<u8>);

fn stored_rejections(rows: Vec<RejectionRow>) -> Vec<(i64, StoredRejection)> {
    rows.into_iter()
        .filter_map(|(id, sender, msg_id, code, raw)| {
            let code = ReasonCode::parse(&code)?;
            Some((
                id,
                StoredRejection {
                    sender,
                    msg_id,
                    code,
                    raw,
                },
            ))
        })
        .collect()
}

/// Reads pages of `(id, row)` in id order until one comes back empty.
fn read_pages<T>(
    mut read_page: impl FnMut(i64) -> Result<Vec<(i64, T)>, StoreError>,
    visit: &mut dyn FnMut(T),
) -> Result<u64, StoreError> {
    let mut after_id = 0;
    let mut count = 0;
    loop {
        let page = read_page(after_id)?;
        let Some(last) = page.last() else {
            return Ok(count);
        };
        after_id = last.0;
        for (_, message) in page {
            visit(message);
            count += 1;
        }
    }
}

/// What a retention purge did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PurgeReport {
    /// What was dropped: partitions (postgres), or tables and row counts (embedded).
    pub dropped: Vec<String>,
    /// Months past the horizon kept because their outbox holds a CLS not confirmed delivered.
    pub kept_undelivered: Vec<Month>,
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) const DAY: Date = time::macros::date!(2026 - 11 - 30);

    pub(crate) fn sample_batch() -> Batch {
        Batch {
            messages: vec![MessageRow {
                trade_date: DAY,
                trade_key: "B/T1".to_owned(),
                sender: "B".into(),
                msg_id: "B-1".into(),
                msg_type: "NOE",
                function: "NEW",
                related_id: None,
                injected_ns: 7,
                raw: b"<Msg/>".to_vec(),
                received_on: DAY,
            }],
            trades: vec![
                TradeRow {
                    trade_date: DAY,
                    trade_key: "B/T1".to_owned(),
                    status: TradeStatus::Pending,
                    first: true,
                },
                TradeRow {
                    trade_date: DAY,
                    trade_key: "B/T1".to_owned(),
                    status: TradeStatus::Matched,
                    first: false,
                },
            ],
            cls: vec![ClsRow {
                trade_date: DAY,
                cls_id: "CLS-B-T1".to_owned(),
                trade_key: "B/T1".to_owned(),
                body: "<Cls/>".to_owned(),
            }],
            exceptions: vec![ExceptionRow {
                received_on: DAY,
                trade_key: None,
                sender: None,
                msg_id: None,
                code: ReasonCode::Parse,
                detail: "garbage".to_owned(),
                raw: vec![0, 159, 255],
            }],
            delivered_through: None,
        }
    }
}
