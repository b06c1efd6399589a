//! Storage behind one interface: a batch of rows commits in one transaction or not at all.
//!
//! Two implementations here: [`MemoryStore`] keeps the rows in process memory, and
//! [`SqliteStore`] is the embedded default, one SQLite file per shard through sqlx.

use std::path::Path;

use sqlx::postgres::PgConnection;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqliteSynchronous};
use sqlx::{ConnectOptions, Connection, QueryBuilder, Sqlite, SqliteConnection};
use time::Date;

use crate::matcher::TradeStatus;
use crate::reason::ReasonCode;

/// An accepted message, with its raw bytes.
#[derive(Debug, Clone)]
pub struct MessageRow {
    /// The date of the trade's partition (see [`crate::matcher::Matcher::process`]).
    pub trade_date: Date,
    pub trade_key: String,
    pub sender: String,
    pub msg_id: String,
    pub msg_type: &'static str,
    pub function: &'static str,
    pub related_id: Option<String>,
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
    #[error("database error on {store}")]
    Database { store: String, source: sqlx::Error },
    #[error("migration failed on {store}")]
    Migrate {
        store: String,
        source: sqlx::migrate::MigrateError,
    },
    #[error("{0}")]
    Unsupported(&'static str),
    #[error("cannot start the i/o runtime")]
    Runtime(#[source] std::io::Error),
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

/// Whether an exception row with this code sets the verdict of its MsgId: every code given after
/// the signature checked out, except E_DUPID, which answers a MsgId already used.
pub fn code_is_remembered(code: ReasonCode) -> bool {
    code > ReasonCode::Sig && code != ReasonCode::DupId
}

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
    /// Drops what is older than `keep_days` days before `today`. The memory store refuses.
    fn purge(&mut self, _today: Date, _keep_days: u32) -> Result<PurgeReport, StoreError> {
        Err(StoreError::Unsupported(
            "retention needs a durable store (embedded or postgres)",
        ))
    }
}

/// Rows kept in process memory: the store for tests and for measuring the engine without
/// storage cost. It keeps every row, so its memory grows with the run.
/// Rows are kept as the committed batches themselves, so that growing the store never copies
/// what it already holds.
#[derive(Debug, Default)]
pub struct MemoryStore {
    pub messages: Vec<Vec<MessageRow>>,
    pub trades: ahash::AHashMap<String, TradeStatus>,
    pub cls: Vec<ClsRow>,
    pub exceptions: Vec<ExceptionRow>,
    pub delivered_through: i64,
}

impl Store for MemoryStore {
    fn commit(&mut self, batch: &mut Batch) -> Result<Vec<i64>, StoreError> {
        let batch = std::mem::take(batch);
        if !batch.messages.is_empty() {
            self.messages.push(batch.messages);
        }
        for row in batch.trades {
            self.trades.insert(row.trade_key, row.status);
        }
        let first_id = self.cls.len() as i64 + 1;
        let ids = (first_id..first_id + batch.cls.len() as i64).collect();
        self.cls.extend(batch.cls);
        self.exceptions.extend(batch.exceptions);
        if let Some(through) = batch.delivered_through {
            self.delivered_through = self.delivered_through.max(through);
        }
        Ok(ids)
    }

    fn undelivered_cls(&mut self) -> Result<Vec<UndeliveredCls>, StoreError> {
        let skip = usize::try_from(self.delivered_through).unwrap_or(0);
        Ok(self
            .cls
            .iter()
            .enumerate()
            .skip(skip)
            .map(|(index, row)| UndeliveredCls {
                outbox_id: index as i64 + 1,
                cls_id: row.cls_id.clone(),
                body: row.body.clone(),
            })
            .collect())
    }

    fn row_counts(&mut self) -> Result<RowCounts, StoreError> {
        Ok(RowCounts {
            messages: self.messages.iter().map(Vec::len).sum::<usize>() as u64,
            trades: self.trades.len() as u64,
            cls: self.cls.len() as u64,
            exceptions: self.exceptions.len() as u64,
        })
    }

    fn for_each_accepted(
        &mut self,
        visit: &mut dyn FnMut(StoredMessage),
    ) -> Result<u64, StoreError> {
        let mut count = 0;
        for row in self.messages.iter().flatten() {
            visit(StoredMessage {
                raw: row.raw.clone(),
                injected_ns: row.injected_ns,
                trade_date: Some(row.trade_date),
                received_on: Some(row.received_on),
            });
            count += 1;
        }
        Ok(count)
    }

    fn for_each_remembered_rejection(
        &mut self,
        visit: &mut dyn FnMut(StoredRejection),
    ) -> Result<u64, StoreError> {
        let mut count = 0;
        for row in &self.exceptions {
            if let (Some(sender), Some(msg_id), true) =
                (&row.sender, &row.msg_id, code_is_remembered(row.code))
            {
                visit(StoredRejection {
                    sender: sender.clone(),
                    msg_id: msg_id.clone(),
                    code: row.code,
                    raw: row.raw.clone(),
                });
                count += 1;
            }
        }
        Ok(count)
    }
}

static SQLITE_MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../migrations/sqlite");

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

/// Rows per multi-row INSERT: keeps every statement under SQLite's bound-parameter limit and
/// lets sqlx reuse one prepared statement for every full chunk.
const SQLITE_ROWS_PER_STATEMENT: usize = 500;
/// SQLite page cache per shard, in KiB.
const SQLITE_CACHE_KIB: u32 = 65_536;
/// Larger pages: rows are appended and carry ~600-byte blobs, so fewer, fuller pages cost less.
const SQLITE_PAGE_SIZE_BYTES: u32 = 16_384;

/// The embedded default: one SQLite file per shard, written through sqlx.
pub struct SqliteStore {
    name: String,
    runtime: tokio::runtime::Runtime,
    connection: SqliteConnection,
}

impl SqliteStore {
    /// Opens (creating if needed) the file and applies the migrations.
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        let name = path.display().to_string();
        let runtime = io_runtime()?;
        let options = SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Normal)
            .pragma("cache_size", format!("-{SQLITE_CACHE_KIB}"))
            .pragma("temp_store", "memory")
            .page_size(SQLITE_PAGE_SIZE_BYTES)
            .locking_mode(sqlx::sqlite::SqliteLockingMode::Exclusive);
        let connection = connect_and_migrate(
            &runtime,
            &name,
            options.connect(),
            async |connection: &mut SqliteConnection| SQLITE_MIGRATOR.run(connection).await,
        )?;
        Ok(Self {
            name,
            runtime,
            connection,
        })
    }

    /// Runs one statement outside any batch (for tests and maintenance).
    pub fn execute(&mut self, sql: &str) -> Result<(), StoreError> {
        let result = self
            .runtime
            .block_on(sqlx::raw_sql(sql).execute(&mut self.connection));
        result
            .map(|_| ())
            .map_err(|source| self.database_error(source))
    }

    fn database_error(&self, source: sqlx::Error) -> StoreError {
        database_error(&self.name, source)
    }
}

async fn write_batch(
    connection: &mut SqliteConnection,
    batch: &mut Batch,
) -> Result<Vec<i64>, sqlx::Error> {
    let mut transaction = connection.begin().await?;
    // The rows are bound by value: sqlx copies every borrowed argument before it hands the
    // statement to SQLite's thread, and the raw bytes are most of what a batch holds. The
    // embedded store's errors are never transient, so a failed batch is not retried.
    let mut messages = std::mem::take(&mut batch.messages).into_iter();
    while messages.len() > 0 {
        let mut query = QueryBuilder::<Sqlite>::new(
            "INSERT INTO messages (trade_key, sender, msg_id, msg_type, function, related_id, injected_ns, raw, received_on, trade_date) ",
        );
        query.push_values(
            messages.by_ref().take(SQLITE_ROWS_PER_STATEMENT),
            |mut row, message| {
                row.push_bind(message.trade_key)
                    .push_bind(message.sender)
                    .push_bind(message.msg_id)
                    .push_bind(message.msg_type)
                    .push_bind(message.function)
                    .push_bind(message.related_id)
                    .push_bind(message.injected_ns as i64)
                    .push_bind(message.raw)
                    .push_bind(message.received_on.to_julian_day())
                    .push_bind(message.trade_date.to_julian_day());
            },
        );
        query.build().execute(&mut *transaction).await?;
    }
    for chunk in batch.trades.chunks(SQLITE_ROWS_PER_STATEMENT) {
        let mut query = QueryBuilder::<Sqlite>::new(
            "INSERT INTO trade_status (trade_key, status, trade_date) ",
        );
        query.push_values(chunk, |mut row, trade| {
            row.push_bind(trade.trade_key.as_str())
                .push_bind(trade.status.as_str())
                .push_bind(trade.trade_date.to_julian_day());
        });
        query.build().execute(&mut *transaction).await?;
    }
    let mut outbox_ids: ahash::AHashMap<String, i64> = ahash::AHashMap::new();
    for chunk in batch.cls.chunks(SQLITE_ROWS_PER_STATEMENT) {
        let mut query = QueryBuilder::<Sqlite>::new(
            "INSERT INTO cls_outbox (cls_id, trade_key, body, trade_date) ",
        );
        query.push_values(chunk, |mut row, cls| {
            row.push_bind(cls.cls_id.as_str())
                .push_bind(cls.trade_key.as_str())
                .push_bind(cls.body.as_str())
                .push_bind(cls.trade_date.to_julian_day());
        });
        query.push(" RETURNING id, cls_id");
        let returned: Vec<(i64, String)> =
            query.build_query_as().fetch_all(&mut *transaction).await?;
        outbox_ids.extend(returned.into_iter().map(|(id, cls_id)| (cls_id, id)));
    }
    for chunk in batch.exceptions.chunks(SQLITE_ROWS_PER_STATEMENT) {
        let mut query = QueryBuilder::<Sqlite>::new(
            "INSERT INTO exceptions (trade_key, sender, msg_id, code, detail, raw, received_on) ",
        );
        query.push_values(chunk, |mut row, exception| {
            row.push_bind(exception.trade_key.as_deref())
                .push_bind(exception.sender.as_deref())
                .push_bind(exception.msg_id.as_deref())
                .push_bind(exception.code.as_str())
                .push_bind(exception.detail.as_str())
                .push_bind(exception.raw.as_slice())
                .push_bind(exception.received_on.to_julian_day());
        });
        query.build().execute(&mut *transaction).await?;
    }
    if let Some(through) = batch.delivered_through {
        sqlx::query(
            "INSERT INTO cls_delivery (id, delivered_through) VALUES (1, ?) \
             ON CONFLICT (id) DO UPDATE SET delivered_through = max(delivered_through, excluded.delivered_through)",
        )
        .bind(through)
        .execute(&mut *transaction)
        .await?;
    }
    transaction.commit().await?;
    Ok(outbox_ids_in_order(batch, &outbox_ids))
}

/// The outbox id of each CLS of `batch`, in the batch's order.
fn outbox_ids_in_order(batch: &Batch, ids: &ahash::AHashMap<String, i64>) -> Vec<i64> {
    batch
        .cls
        .iter()
        .map(|cls| ids.get(&cls.cls_id).copied().unwrap_or_default())
        .collect()
}

const UNDELIVERED_QUERY: &str = "SELECT id, cls_id, body FROM cls_outbox \
     WHERE id > COALESCE((SELECT delivered_through FROM cls_delivery WHERE id = 1), 0) ORDER BY id";

fn undelivered_rows(rows: Vec<(i64, String, String)>) -> Vec<UndeliveredCls> {
    rows.into_iter()
        .map(|(outbox_id, cls_id, body)| UndeliveredCls {
            outbox_id,
            cls_id,
            body,
        })
        .collect()
}

/// Deletes from an embedded shard what expired before `horizon`: the rows of trades whose date
/// is earlier, unless the outbox still holds a CLS of theirs above the delivery watermark, and
/// exceptions that arrived earlier. One transaction; the freed pages are reused by later rows
/// (the file does not shrink).
async fn purge_expired(
    connection: &mut SqliteConnection,
    horizon: Date,
) -> Result<PurgeReport, sqlx::Error> {
    const UNDELIVERED: &str = "SELECT trade_key FROM cls_outbox WHERE id >          COALESCE((SELECT delivered_through FROM cls_delivery WHERE id = 1), 0)";
    let horizon = horizon.to_julian_day();
    let mut transaction = connection.begin().await?;
    let kept: i64 = sqlx::query_scalar(&format!(
        "SELECT COUNT(DISTINCT trade_key) FROM messages WHERE trade_date < ? AND trade_key IN ({UNDELIVERED})"
    ))
    .bind(horizon)
    .fetch_one(&mut *transaction)
    .await?;
    let mut dropped = Vec::new();
    for (table, condition) in [
        ("messages", format!("trade_date < ? AND trade_key NOT IN ({UNDELIVERED})")),
        ("trade_status", format!("trade_date < ? AND trade_key NOT IN ({UNDELIVERED})")),
        (
            "cls_outbox",
            "trade_date < ? AND id <= COALESCE((SELECT delivered_through FROM cls_delivery WHERE id = 1), 0)"
                .to_owned(),
        ),
        ("exceptions", "received_on < ?".to_owned()),
    ] {
        let deleted = sqlx::query(&format!("DELETE FROM {table} WHERE {condition}"))
            .bind(horizon)
            .execute(&mut *transaction)
            .await?
            .rows_affected();
        if deleted > 0 {
            dropped.push(format!("{table}: {deleted} rows"));
        }
    }
    transaction.commit().await?;
    if kept > 0 {
        tracing::warn!(
            trades = kept,
            "trades past retention kept: their outbox holds CLS not confirmed delivered"
        );
    }
    Ok(PurgeReport {
        dropped,
        kept_undelivered: Vec::new(),
    })
}

impl Store for SqliteStore {
    fn purge(&mut self, today: Date, keep_days: u32) -> Result<PurgeReport, StoreError> {
        let horizon = today - time::Duration::days(i64::from(keep_days));
        let result = self
            .runtime
            .block_on(purge_expired(&mut self.connection, horizon));
        let report = result.map_err(|source| self.database_error(source))?;
        if !report.dropped.is_empty() {
            tracing::info!(rows = ?report.dropped, "retention deleted expired rows");
        }
        Ok(report)
    }

    fn commit(&mut self, batch: &mut Batch) -> Result<Vec<i64>, StoreError> {
        let result = self
            .runtime
            .block_on(write_batch(&mut self.connection, batch));
        result.map_err(|source| self.database_error(source))
    }

    fn undelivered_cls(&mut self) -> Result<Vec<UndeliveredCls>, StoreError> {
        let result = self
            .runtime
            .block_on(sqlx::query_as(UNDELIVERED_QUERY).fetch_all(&mut self.connection));
        result
            .map(undelivered_rows)
            .map_err(|source| self.database_error(source))
    }

    fn row_counts(&mut self) -> Result<RowCounts, StoreError> {
        let result = self.runtime.block_on(async {
            let mut counts = [0_i64; 4];
            let queries = [
                "SELECT COUNT(*) FROM messages",
                "SELECT COUNT(DISTINCT trade_key) FROM trade_status",
                "SELECT COUNT(*) FROM cls_outbox",
                "SELECT COUNT(*) FROM exceptions",
            ];
            for (slot, query) in counts.iter_mut().zip(queries) {
                *slot = sqlx::query_scalar(query)
                    .fetch_one(&mut self.connection)
                    .await?;
            }
            Ok::<_, sqlx::Error>(counts)
        });
        let counts = result.map_err(|source| self.database_error(source))?;
        Ok(RowCounts {
            messages: counts[0] as u64,
            trades: counts[1] as u64,
            cls: counts[2] as u64,
            exceptions: counts[3] as u64,
        })
    }

    fn for_each_accepted(
        &mut self,
        visit: &mut dyn FnMut(StoredMessage),
    ) -> Result<u64, StoreError> {
        read_pages(|after_id| self.read_page(after_id), visit)
    }

    fn for_each_remembered_rejection(
        &mut self,
        visit: &mut dyn FnMut(StoredRejection),
    ) -> Result<u64, StoreError> {
        let query = remembered_rejections_query("?", "?");
        read_pages(
            |after_id| {
                let result: Result<Vec<RejectionRow>, _> = self.runtime.block_on(
                    sqlx::query_as(&query)
                        .bind(after_id)
                        .bind(RECOVERY_PAGE_ROWS)
                        .fetch_all(&mut self.connection),
                );
                let rows = result.map_err(|source| self.database_error(source))?;
                Ok(stored_rejections(rows))
            },
            visit,
        )
    }
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

impl SqliteStore {
    fn read_page(&mut self, after_id: i64) -> Result<Vec<(i64, StoredMessage)>, StoreError> {
        let result: Result<Vec<SqliteStoredRow>, _> = self.runtime.block_on(
            sqlx::query_as(
                "SELECT id, raw, injected_ns, received_on FROM messages WHERE id > ? ORDER BY id LIMIT ?",
            )
            .bind(after_id)
            .bind(RECOVERY_PAGE_ROWS)
            .fetch_all(&mut self.connection),
        );
        let rows = result.map_err(|source| self.database_error(source))?;
        Ok(rows
            .into_iter()
            .map(|(id, raw, injected_ns, received_on)| {
                let message = StoredMessage {
                    raw,
                    injected_ns: injected_ns as u64,
                    trade_date: None,
                    received_on: received_on.and_then(|day| Date::from_julian_day(day).ok()),
                };
                (id, message)
            })
            .collect())
    }
}

static POSTGRES_MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../migrations/postgres");

/// A shard in a PostgreSQL database, written through sqlx with one `UNNEST` insert per table and
/// batch, inside one transaction. Inserts with a natural key are idempotent.
pub struct PgStore {
    name: String,
    url: String,
    /// Set by a reconnect: the next commit may be a batch whose earlier commit succeeded but
    /// whose reply was lost.
    retrying: bool,
    /// Partitions known to exist, by table and month.
    partitions: ahash::AHashSet<(PartitionedTable, Month)>,
    runtime: tokio::runtime::Runtime,
    connection: PgConnection,
}

/// A stored message as read back: id, raw bytes, injection time, trade date.
/// A `messages` row of the embedded store as recovery reads it: id, raw, injected_ns,
/// received_on (Julian day).
type SqliteStoredRow = (i64, Vec<u8>, i64, Option<i32>);

type PgStoredRow = (i64, Vec<u8>, i64, Date, Option<Date>);

/// The tables partitioned by month.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum PartitionedTable {
    Messages,
    Trades,
    ClsOutbox,
    Exceptions,
}

impl PartitionedTable {
    const ALL: [Self; 4] = [
        Self::Messages,
        Self::Trades,
        Self::ClsOutbox,
        Self::Exceptions,
    ];

    fn name(self) -> &'static str {
        match self {
            Self::Messages => "messages",
            Self::Trades => "trades",
            Self::ClsOutbox => "cls_outbox",
            Self::Exceptions => "exceptions",
        }
    }

    fn partition(self, month: Month) -> String {
        format!("{}_p{:04}{:02}", self.name(), month.year, month.month)
    }
}

/// A calendar month: the span of one partition.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Month {
    pub year: i32,
    pub month: u8,
}

impl Month {
    pub fn of(date: Date) -> Self {
        Self {
            year: date.year(),
            month: date.month() as u8,
        }
    }

    fn next(self) -> Self {
        if self.month == 12 {
            Self {
                year: self.year + 1,
                month: 1,
            }
        } else {
            Self {
                year: self.year,
                month: self.month + 1,
            }
        }
    }

    /// The first day, as PostgreSQL reads a date.
    fn first_day(self) -> String {
        format!("{:04}-{:02}-01", self.year, self.month)
    }

    /// Whether every day of the month is before `day`.
    fn ends_before(self, day: Date) -> bool {
        self.next() <= Self::of(day)
    }

    /// The month of a partition named by [`PartitionedTable::partition`].
    fn of_partition(table: PartitionedTable, name: &str) -> Option<Self> {
        let digits = name.strip_prefix(table.name())?.strip_prefix("_p")?;
        if digits.len() != 6 || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        let month = Self {
            year: digits[..4].parse().ok()?,
            month: digits[4..].parse().ok()?,
        };
        (1..=12).contains(&month.month).then_some(month)
    }
}

impl std::fmt::Display for Month {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:04}-{:02}", self.year, self.month)
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

/// The partitions that `batch` writes to.
fn partitions_of(batch: &Batch) -> ahash::AHashSet<(PartitionedTable, Month)> {
    let mut needed = ahash::AHashSet::new();
    let dated = [
        (
            PartitionedTable::Messages,
            batch
                .messages
                .iter()
                .map(|r| r.trade_date)
                .collect::<Vec<_>>(),
        ),
        (
            PartitionedTable::Trades,
            batch.trades.iter().map(|r| r.trade_date).collect(),
        ),
        (
            PartitionedTable::ClsOutbox,
            batch.cls.iter().map(|r| r.trade_date).collect(),
        ),
        (
            PartitionedTable::Exceptions,
            batch.exceptions.iter().map(|r| r.received_on).collect(),
        ),
    ];
    for (table, dates) in dated {
        needed.extend(dates.into_iter().map(|date| (table, Month::of(date))));
    }
    needed
}

/// The statements creating `partitions` where they do not exist yet.
fn create_partitions_sql(partitions: &[(PartitionedTable, Month)]) -> String {
    partitions
        .iter()
        .map(|&(table, month)| {
            format!(
                "CREATE TABLE IF NOT EXISTS \"{}\" PARTITION OF {} FOR VALUES FROM ('{}') TO ('{}');",
                table.partition(month),
                table.name(),
                month.first_day(),
                month.next().first_day()
            )
        })
        .collect()
}

/// PostgreSQL's binary COPY header: signature, flags, header extension length.
const PG_COPY_HEADER: &[u8] = b"PGCOPY\n\xff\r\n\0\0\0\0\0\0\0\0\0";

/// The Julian day number of 2000-01-01, PostgreSQL's epoch for dates.
const PG_EPOCH_JULIAN_DAY: i32 = 2_451_545;

/// Encodes message rows in PostgreSQL's binary COPY format.
fn binary_copy_rows(rows: &[MessageRow]) -> Vec<u8> {
    fn field(out: &mut Vec<u8>, value: Option<&[u8]>) {
        match value {
            Some(bytes) => {
                out.extend_from_slice(&(bytes.len() as i32).to_be_bytes());
                out.extend_from_slice(bytes);
            }
            None => out.extend_from_slice(&(-1_i32).to_be_bytes()),
        }
    }
    let size: usize = rows
        .iter()
        .map(|r| 128 + r.raw.len() + r.trade_key.len())
        .sum();
    let mut out = Vec::with_capacity(PG_COPY_HEADER.len() + size + 2);
    out.extend_from_slice(PG_COPY_HEADER);
    for row in rows {
        out.extend_from_slice(&10_i16.to_be_bytes());
        // A date is the number of days since 2000-01-01.
        let days = row.trade_date.to_julian_day() - PG_EPOCH_JULIAN_DAY;
        field(&mut out, Some(&days.to_be_bytes()));
        field(&mut out, Some(row.trade_key.as_bytes()));
        field(&mut out, Some(row.sender.as_bytes()));
        field(&mut out, Some(row.msg_id.as_bytes()));
        field(&mut out, Some(row.msg_type.as_bytes()));
        field(&mut out, Some(row.function.as_bytes()));
        field(&mut out, row.related_id.as_deref().map(str::as_bytes));
        field(&mut out, Some(&(row.injected_ns as i64).to_be_bytes()));
        field(&mut out, Some(&row.raw));
        let received = row.received_on.to_julian_day() - PG_EPOCH_JULIAN_DAY;
        field(&mut out, Some(&received.to_be_bytes()));
    }
    out.extend_from_slice(&(-1_i16).to_be_bytes());
    out
}

/// The URL without its password, for messages.
fn redacted(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme_end), Some(at)) if at > scheme_end => {
            let credentials = &url[scheme_end + 3..at];
            match credentials.split_once(':') {
                Some((user, _)) => format!("{}{user}:***{}", &url[..scheme_end + 3], &url[at..]),
                None => url.to_owned(),
            }
        }
        _ => url.to_owned(),
    }
}

impl PgStore {
    /// Connects and applies the migrations (checksums verified by sqlx).
    pub fn open(url: &str) -> Result<Self, StoreError> {
        let name = redacted(url);
        let runtime = io_runtime()?;
        let connection = connect_and_migrate(
            &runtime,
            &name,
            PgConnection::connect(url),
            async |connection: &mut PgConnection| POSTGRES_MIGRATOR.run(connection).await,
        )?;
        Ok(Self {
            name,
            url: url.to_owned(),
            retrying: false,
            partitions: ahash::AHashSet::new(),
            runtime,
            connection,
        })
    }
}

/// Whether `error` is two sessions creating the same table at once: `CREATE TABLE IF NOT
/// EXISTS` checks the name before it inserts into the catalogs, so the slower one meets the
/// catalogs' unique keys (or `duplicate_table`).
fn catalog_race(error: &sqlx::Error) -> bool {
    let sqlx::Error::Database(database) = error else {
        return false;
    };
    match database.code().as_deref() {
        Some("42P07") => true,
        Some("23505") => database
            .constraint()
            .is_some_and(|constraint| constraint.starts_with("pg_")),
        _ => false,
    }
}

/// Finds the outbox ids of the batch's CLS that are already stored, by their key.
async fn stored_outbox_ids(
    connection: &mut PgConnection,
    batch: &Batch,
    ids: &mut ahash::AHashMap<String, i64>,
) -> Result<(), sqlx::Error> {
    let missing: Vec<&ClsRow> = batch
        .cls
        .iter()
        .filter(|row| !ids.contains_key(&row.cls_id))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    let rows: Vec<(i64, String)> = sqlx::query_as(
        "SELECT id, cls_id FROM cls_outbox \
         WHERE (cls_id, trade_date) IN (SELECT * FROM UNNEST($1::text[], $2::date[]))",
    )
    .bind(
        missing
            .iter()
            .map(|r| r.cls_id.as_str())
            .collect::<Vec<_>>(),
    )
    .bind(missing.iter().map(|r| r.trade_date).collect::<Vec<_>>())
    .fetch_all(&mut *connection)
    .await?;
    ids.extend(rows.into_iter().map(|(id, cls_id)| (cls_id, id)));
    Ok(())
}

async fn write_pg_batch(
    connection: &mut PgConnection,
    batch: &Batch,
    create_partitions: &str,
) -> Result<Vec<i64>, sqlx::Error> {
    let mut transaction = connection.begin().await?;
    if !create_partitions.is_empty() {
        sqlx::raw_sql(create_partitions)
            .execute(&mut *transaction)
            .await?;
    }
    if !batch.messages.is_empty() {
        // The bulk of every batch goes in through binary COPY, PostgreSQL's fastest load path.
        // COPY cannot skip existing rows; the (sender, msg_id) key refuses a batch that was
        // already committed, which is what a retry after a lost reply needs to learn.
        let mut copy = transaction
            .copy_in_raw(
                "COPY messages (trade_date, trade_key, sender, msg_id, msg_type, function, related_id, injected_ns, raw, received_on) \
                 FROM STDIN WITH (FORMAT binary)",
            )
            .await?;
        copy.send(binary_copy_rows(&batch.messages)).await?;
        copy.finish().await?;
    }
    if !batch.trades.is_empty() {
        let rows = &batch.trades;
        sqlx::query(
            "INSERT INTO trades (trade_date, trade_key, status) \
             SELECT * FROM UNNEST($1::date[], $2::text[], $3::text[]) \
             ON CONFLICT (trade_key, trade_date) DO UPDATE SET status = excluded.status",
        )
        .bind(rows.iter().map(|r| r.trade_date).collect::<Vec<_>>())
        .bind(
            rows.iter()
                .map(|r| r.trade_key.as_str())
                .collect::<Vec<_>>(),
        )
        .bind(rows.iter().map(|r| r.status.as_str()).collect::<Vec<_>>())
        .execute(&mut *transaction)
        .await?;
    }
    let mut outbox_ids: ahash::AHashMap<String, i64> = ahash::AHashMap::new();
    if !batch.cls.is_empty() {
        let rows = &batch.cls;
        let inserted: Vec<(i64, String)> = sqlx::query_as(
            "INSERT INTO cls_outbox (trade_date, cls_id, trade_key, body) \
             SELECT * FROM UNNEST($1::date[], $2::text[], $3::text[], $4::text[]) \
             ON CONFLICT (cls_id, trade_date) DO NOTHING RETURNING id, cls_id",
        )
        .bind(rows.iter().map(|r| r.trade_date).collect::<Vec<_>>())
        .bind(rows.iter().map(|r| r.cls_id.as_str()).collect::<Vec<_>>())
        .bind(
            rows.iter()
                .map(|r| r.trade_key.as_str())
                .collect::<Vec<_>>(),
        )
        .bind(rows.iter().map(|r| r.body.as_str()).collect::<Vec<_>>())
        .fetch_all(&mut *transaction)
        .await?;
        outbox_ids.extend(inserted.into_iter().map(|(id, cls_id)| (cls_id, id)));
        // Rows that a replayed batch had already written keep their ids.
        stored_outbox_ids(&mut transaction, batch, &mut outbox_ids).await?;
    }
    if !batch.exceptions.is_empty() {
        let rows = &batch.exceptions;
        sqlx::query(
            "INSERT INTO exceptions (received_on, trade_key, sender, msg_id, code, detail, raw) \
             SELECT * FROM UNNEST($1::date[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::bytea[])",
        )
        .bind(rows.iter().map(|r| r.received_on).collect::<Vec<_>>())
        .bind(rows.iter().map(|r| r.trade_key.as_deref()).collect::<Vec<_>>())
        .bind(rows.iter().map(|r| r.sender.as_deref()).collect::<Vec<_>>())
        .bind(rows.iter().map(|r| r.msg_id.as_deref()).collect::<Vec<_>>())
        .bind(rows.iter().map(|r| r.code.as_str()).collect::<Vec<_>>())
        .bind(rows.iter().map(|r| r.detail.as_str()).collect::<Vec<_>>())
        .bind(rows.iter().map(|r| r.raw.as_slice()).collect::<Vec<_>>())
        .execute(&mut *transaction)
        .await?;
    }
    if let Some(through) = batch.delivered_through {
        sqlx::query(
            "INSERT INTO cls_delivery (id, delivered_through) VALUES (1, $1) \
             ON CONFLICT (id) DO UPDATE SET delivered_through = GREATEST(cls_delivery.delivered_through, excluded.delivered_through)",
        )
        .bind(through)
        .execute(&mut *transaction)
        .await?;
    }
    transaction.commit().await?;
    Ok(outbox_ids_in_order(batch, &outbox_ids))
}

/// Drops the partitions whose month ended before `horizon`, except the months whose outbox
/// still holds a CLS not confirmed delivered.
async fn purge_partitions(
    connection: &mut PgConnection,
    horizon: Date,
) -> Result<(PurgeReport, Vec<(PartitionedTable, Month)>), sqlx::Error> {
    let parents: Vec<&str> = PartitionedTable::ALL.iter().map(|t| t.name()).collect();
    let children: Vec<(String, String)> = sqlx::query_as(
        "SELECT parent.relname::text, child.relname::text FROM pg_inherits \
         JOIN pg_class parent ON parent.oid = pg_inherits.inhparent \
         JOIN pg_class child ON child.oid = pg_inherits.inhrelid \
         WHERE parent.relname = ANY($1) AND pg_table_is_visible(parent.oid) \
         ORDER BY child.relname",
    )
    .bind(&parents)
    .fetch_all(&mut *connection)
    .await?;
    let mut expired: Vec<(PartitionedTable, Month)> = Vec::new();
    for (parent, child) in &children {
        let Some(table) = PartitionedTable::ALL
            .into_iter()
            .find(|t| t.name() == parent)
        else {
            continue;
        };
        if let Some(month) = Month::of_partition(table, child) {
            if month.ends_before(horizon) {
                expired.push((table, month));
            }
        }
    }
    let mut report = PurgeReport::default();
    let outbox_months: Vec<Month> = expired
        .iter()
        .filter(|(table, _)| *table == PartitionedTable::ClsOutbox)
        .map(|&(_, month)| month)
        .collect();
    for month in outbox_months {
        let undelivered: bool = sqlx::query_scalar(&format!(
            "SELECT EXISTS (SELECT 1 FROM \"{}\" WHERE id > \
             COALESCE((SELECT delivered_through FROM cls_delivery WHERE id = 1), 0))",
            PartitionedTable::ClsOutbox.partition(month)
        ))
        .fetch_one(&mut *connection)
        .await?;
        if undelivered {
            report.kept_undelivered.push(month);
        }
    }
    // A kept month keeps its messages, trades and outbox together; its exceptions may go.
    expired.retain(|&(table, month)| {
        table == PartitionedTable::Exceptions || !report.kept_undelivered.contains(&month)
    });
    if expired.is_empty() {
        return Ok((report, expired));
    }
    let names: Vec<String> = expired
        .iter()
        .map(|&(table, month)| table.partition(month))
        .collect();
    let drop = format!(
        "DROP TABLE {}",
        names
            .iter()
            .map(|name| format!("\"{name}\""))
            .collect::<Vec<_>>()
            .join(", ")
    );
    sqlx::raw_sql(&drop).execute(&mut *connection).await?;
    report.dropped = names;
    Ok((report, expired))
}

impl Store for PgStore {
    fn commit(&mut self, batch: &mut Batch) -> Result<Vec<i64>, StoreError> {
        let retrying = std::mem::take(&mut self.retrying);
        let mut new_partitions: Vec<(PartitionedTable, Month)> = partitions_of(batch)
            .into_iter()
            .filter(|partition| !self.partitions.contains(partition))
            .collect();
        new_partitions.sort_by_key(|&(table, month)| (month, table as u8));
        let create = create_partitions_sql(&new_partitions);
        let mut result =
            self.runtime
                .block_on(write_pg_batch(&mut self.connection, batch, &create));
        if !create.is_empty() && matches!(&result, Err(error) if catalog_race(error)) {
            // Another writer of this database created the same partition at the same moment
            // (shard 0's writer and the exceptions writer share `exceptions`): it exists now.
            result = self
                .runtime
                .block_on(write_pg_batch(&mut self.connection, batch, &create));
        }
        let error = match result {
            Ok(ids) => {
                self.partitions.extend(new_partitions);
                return Ok(ids);
            }
            Err(error) => error,
        };
        // A retried batch whose messages are already there was committed before the connection
        // broke: the transaction is all or nothing, so all of it is there.
        let already_committed = retrying
            && !batch.messages.is_empty()
            && !catalog_race(&error)
            && matches!(&error, sqlx::Error::Database(database) if database.code().as_deref() == Some("23505"));
        let result = if already_committed {
            tracing::warn!(store = %self.name, "a retried batch had already been committed");
            self.runtime.block_on(async {
                let mut ids = ahash::AHashMap::new();
                stored_outbox_ids(&mut self.connection, batch, &mut ids).await?;
                Ok(outbox_ids_in_order(batch, &ids))
            })
        } else {
            Err(error)
        };
        result.map_err(|source| database_error(&self.name, source))
    }

    fn undelivered_cls(&mut self) -> Result<Vec<UndeliveredCls>, StoreError> {
        let result = self
            .runtime
            .block_on(sqlx::query_as(UNDELIVERED_QUERY).fetch_all(&mut self.connection));
        result
            .map(undelivered_rows)
            .map_err(|source| database_error(&self.name, source))
    }

    /// Lost connections, a server shutting down or starting up, and serialization failures.
    fn is_transient(&self, error: &StoreError) -> bool {
        let StoreError::Database { source, .. } = error else {
            return false;
        };
        match source {
            sqlx::Error::Io(_)
            | sqlx::Error::PoolTimedOut
            | sqlx::Error::PoolClosed
            | sqlx::Error::WorkerCrashed
            | sqlx::Error::Protocol(_) => true,
            sqlx::Error::Database(database) => database.code().is_some_and(|code| {
                code.starts_with("08")
                    || matches!(
                        &*code,
                        "57P01" | "57P02" | "57P03" | "53300" | "40001" | "40P01"
                    )
            }),
            _ => false,
        }
    }

    fn for_each_accepted(
        &mut self,
        visit: &mut dyn FnMut(StoredMessage),
    ) -> Result<u64, StoreError> {
        read_pages(
            |after_id| {
                let result: Result<Vec<PgStoredRow>, _> = self.runtime.block_on(
                    sqlx::query_as(
                        "SELECT id, raw, injected_ns, trade_date, received_on FROM messages \
                         WHERE id > $1 ORDER BY id LIMIT $2",
                    )
                    .bind(after_id)
                    .bind(RECOVERY_PAGE_ROWS)
                    .fetch_all(&mut self.connection),
                );
                let rows = result.map_err(|source| database_error(&self.name, source))?;
                Ok(rows
                    .into_iter()
                    .map(|(id, raw, injected_ns, trade_date, received_on)| {
                        let message = StoredMessage {
                            raw,
                            injected_ns: injected_ns as u64,
                            trade_date: Some(trade_date),
                            received_on,
                        };
                        (id, message)
                    })
                    .collect())
            },
            visit,
        )
    }

    fn for_each_remembered_rejection(
        &mut self,
        visit: &mut dyn FnMut(StoredRejection),
    ) -> Result<u64, StoreError> {
        let query = remembered_rejections_query("$1", "$2");
        read_pages(
            |after_id| {
                let result: Result<Vec<RejectionRow>, _> = self.runtime.block_on(
                    sqlx::query_as(&query)
                        .bind(after_id)
                        .bind(RECOVERY_PAGE_ROWS)
                        .fetch_all(&mut self.connection),
                );
                let rows = result.map_err(|source| database_error(&self.name, source))?;
                Ok(stored_rejections(rows))
            },
            visit,
        )
    }

    fn purge(&mut self, today: Date, keep_days: u32) -> Result<PurgeReport, StoreError> {
        let horizon = today - time::Duration::days(i64::from(keep_days));
        let result = self
            .runtime
            .block_on(purge_partitions(&mut self.connection, horizon));
        let (report, dropped) = result.map_err(|source| database_error(&self.name, source))?;
        for partition in &dropped {
            self.partitions.remove(partition);
        }
        for month in &report.kept_undelivered {
            tracing::warn!(store = %self.name, %month, "month past retention kept: its outbox holds CLS not confirmed delivered");
        }
        if !report.dropped.is_empty() {
            tracing::info!(store = %self.name, partitions = ?report.dropped, "retention dropped partitions");
        }
        Ok(report)
    }

    fn reconnect(&mut self) -> Result<(), StoreError> {
        self.retrying = true;
        let result = self.runtime.block_on(PgConnection::connect(&self.url));
        self.connection = result.map_err(|source| database_error(&self.name, source))?;
        Ok(())
    }

    fn row_counts(&mut self) -> Result<RowCounts, StoreError> {
        let result = self.runtime.block_on(async {
            let counts: (i64, i64, i64, i64) = sqlx::query_as(
                "SELECT (SELECT COUNT(*) FROM messages), (SELECT COUNT(*) FROM trades), \
                 (SELECT COUNT(*) FROM cls_outbox), (SELECT COUNT(*) FROM exceptions)",
            )
            .fetch_one(&mut self.connection)
            .await?;
            Ok::<_, sqlx::Error>(counts)
        });
        let counts = result.map_err(|source| database_error(&self.name, source))?;
        Ok(RowCounts {
            messages: counts.0 as u64,
            trades: counts.1 as u64,
            cls: counts.2 as u64,
            exceptions: counts.3 as u64,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY: Date = time::macros::date!(2026 - 11 - 30);

    fn sample_batch() -> Batch {
        Batch {
            messages: vec![MessageRow {
                trade_date: DAY,
                trade_key: "B/T1".to_owned(),
                sender: "B".to_owned(),
                msg_id: "B-1".to_owned(),
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
                },
                TradeRow {
                    trade_date: DAY,
                    trade_key: "B/T1".to_owned(),
                    status: TradeStatus::Matched,
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

    #[test]
    fn sqlite_store_commits_a_batch() {
        let dir = tempfile::tempdir().expect("temporary folder");
        let path = dir.path().join("shard-0.sqlite");
        let mut store = SqliteStore::open(&path).expect("opens");
        store.commit(&mut sample_batch()).expect("commits");
        let expected = RowCounts {
            messages: 1,
            trades: 1,
            cls: 1,
            exceptions: 1,
        };
        assert_eq!(store.row_counts().expect("counts"), expected);
        drop(store);
        // Reopening applies no migration twice and keeps the rows.
        let mut reopened = SqliteStore::open(&path).expect("reopens");
        assert_eq!(reopened.row_counts().expect("counts"), expected);
    }

    #[test]
    fn a_failing_batch_writes_nothing() {
        let dir = tempfile::tempdir().expect("temporary folder");
        let mut store = SqliteStore::open(&dir.path().join("s.sqlite")).expect("opens");
        store.commit(&mut sample_batch()).expect("commits");
        // The outbox refuses the batch's last table: everything before it must roll back too.
        store
            .execute("CREATE TRIGGER refuse BEFORE INSERT ON exceptions BEGIN SELECT RAISE(ABORT, 'refused'); END")
            .expect("trigger");
        let error = store.commit(&mut sample_batch());
        assert!(error.is_err());
        let counts = store.row_counts().expect("counts");
        assert_eq!((counts.messages, counts.cls, counts.exceptions), (1, 1, 1));
    }

    #[test]
    fn the_trades_view_shows_the_newest_status() {
        let dir = tempfile::tempdir().expect("temporary folder");
        let mut store = SqliteStore::open(&dir.path().join("s.sqlite")).expect("opens");
        store.commit(&mut sample_batch()).expect("commits");
        let status: String = store
            .runtime
            .block_on(
                sqlx::query_scalar("SELECT status FROM trades WHERE trade_key = 'B/T1'")
                    .fetch_one(&mut store.connection),
            )
            .expect("one row");
        assert_eq!(status, "MATCHED");
    }

    #[test]
    fn months_name_and_bound_their_partitions() {
        let november = Month::of(time::macros::date!(2026 - 11 - 30));
        assert_eq!(november.to_string(), "2026-11");
        assert_eq!(
            PartitionedTable::ClsOutbox.partition(november),
            "cls_outbox_p202611"
        );
        assert_eq!(
            Month::of_partition(PartitionedTable::ClsOutbox, "cls_outbox_p202611"),
            Some(november)
        );
        assert_eq!(
            Month::of_partition(PartitionedTable::Trades, "cls_outbox_p202611"),
            None
        );
        assert_eq!(
            Month::of_partition(PartitionedTable::Trades, "trades_p202613"),
            None
        );
        assert_eq!(
            Month::of_partition(PartitionedTable::Trades, "trades_default"),
            None
        );
        let december = Month::of(time::macros::date!(2026 - 12 - 01));
        assert_eq!(november.next(), december);
        assert_eq!(december.next().first_day(), "2027-01-01");
        // A month has passed a horizon when its last day is before it.
        assert!(!november.ends_before(time::macros::date!(2026 - 11 - 30)));
        assert!(november.ends_before(time::macros::date!(2026 - 12 - 01)));
        assert_eq!(
            create_partitions_sql(&[(PartitionedTable::Messages, december)]),
            "CREATE TABLE IF NOT EXISTS \"messages_p202612\" PARTITION OF messages \
             FOR VALUES FROM ('2026-12-01') TO ('2027-01-01');"
        );
    }

    #[test]
    fn passwords_are_redacted_from_store_names() {
        assert_eq!(
            redacted("postgres://ste:secret@db:5432/ste"),
            "postgres://ste:***@db:5432/ste"
        );
        assert_eq!(
            redacted("postgres://postgres@127.0.0.1/x"),
            "postgres://postgres@127.0.0.1/x"
        );
    }

    #[test]
    fn memory_store_keeps_the_last_trade_status() {
        let mut store = MemoryStore::default();
        store.commit(&mut sample_batch()).expect("commits");
        assert_eq!(store.trades.get("B/T1"), Some(&TradeStatus::Matched));
        assert_eq!(store.row_counts().expect("counts").messages, 1);
    }
}
