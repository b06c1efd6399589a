//! The embedded default: one SQLite file per shard.

use std::path::Path;
use std::sync::Arc;

use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqliteSynchronous};
use sqlx::{ConnectOptions, Connection, QueryBuilder, Sqlite, SqliteConnection};
use time::Date;

use super::{
    connect_and_migrate, database_error, io_runtime, outbox_ids_in_order, read_pages,
    remembered_rejections_query, stored_rejections, undelivered_rows, Batch, PurgeReport,
    RejectionRow, RowCounts, Store, StoreError, StoredMessage, StoredRejection, UndeliveredCls,
    RECOVERY_PAGE_ROWS, UNDELIVERED_QUERY,
};

static SQLITE_MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../migrations/sqlite");

/// Rows per multi-row INSERT: keeps every statement under SQLite's bound-parameter limit and
/// lets sqlx reuse one prepared statement for every full chunk.
const SQLITE_ROWS_PER_STATEMENT: usize = 500;
/// SQLite page cache per shard, in KiB. Rows are appended, so a commit touches few pages; 16 MiB
/// ran a 1,000,000-trade run no slower than 64 MiB, at 330 MiB of peak memory against 490
/// (BENCHMARKS.md).
const SQLITE_CACHE_KIB: u32 = 16_384;
/// Pages of write-ahead log after which a commit copies them into the file (SQLite's default is
/// 1,000). The commit that crosses the mark does the copy and its syncs on the writer's thread,
/// and every answer of its batch waits for it: at 1,000 pages of 16 KiB the open-loop CLS p99
/// was 11.8–12.5 ms against 3.4 ms on the memory store, at 32 pages 4.9–5.0 ms, with no loss of
/// throughput measured (BENCHMARKS.md).
const SQLITE_WAL_CHECKPOINT_PAGES: u32 = 32;
/// Larger pages: rows are appended and carry ~600-byte blobs, so fewer, fuller pages cost less.
const SQLITE_PAGE_SIZE_BYTES: u32 = 16_384;

/// The embedded default: one SQLite file per shard, written through sqlx.
pub struct SqliteStore {
    name: String,
    runtime: tokio::runtime::Runtime,
    connection: SqliteConnection,
    texts: SharedTexts,
}

/// The few texts that rows repeat (message types, functions, trade statuses), each made once
/// and bound by reference count. sqlx binds a borrowed text as a new `String` in a new `Arc`,
/// two allocations a value, and an `Arc<str>` as itself. Keyed by `'static` texts only, so it
/// holds no more entries than the program has such names.
#[derive(Default)]
struct SharedTexts(Vec<(&'static str, Arc<str>)>);

impl SharedTexts {
    fn get(&mut self, text: &'static str) -> Arc<str> {
        if let Some((_, shared)) = self.0.iter().find(|(known, _)| *known == text) {
            return Arc::clone(shared);
        }
        let shared: Arc<str> = Arc::from(text);
        self.0.push((text, Arc::clone(&shared)));
        shared
    }
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
            .pragma(
                "wal_autocheckpoint",
                SQLITE_WAL_CHECKPOINT_PAGES.to_string(),
            )
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
            texts: SharedTexts::default(),
        })
    }

    /// Runs one statement outside any batch (for tests and maintenance).
    pub fn execute(&mut self, sql: &'static str) -> Result<(), StoreError> {
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
    texts: &mut SharedTexts,
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
                // Texts as `Arc<str>`, which sqlx binds as they are (see `SharedTexts`).
                let shared = |text: &str| Arc::<str>::from(text);
                row.push_bind(message.trade_key)
                    .push_bind(shared(&message.sender))
                    .push_bind(shared(&message.msg_id))
                    .push_bind(texts.get(message.msg_type))
                    .push_bind(texts.get(message.function))
                    .push_bind(message.related_id.as_deref().map(shared))
                    .push_bind(message.injected_ns as i64)
                    .push_bind(message.raw)
                    .push_bind(message.received_on.to_julian_day())
                    .push_bind(message.trade_date.to_julian_day());
            },
        );
        query.build().execute(&mut *transaction).await?;
    }
    let mut trades = std::mem::take(&mut batch.trades).into_iter();
    while trades.len() > 0 {
        let mut query = QueryBuilder::<Sqlite>::new(
            "INSERT INTO trade_status (trade_key, status, trade_date) ",
        );
        query.push_values(
            trades.by_ref().take(SQLITE_ROWS_PER_STATEMENT),
            |mut row, trade| {
                row.push_bind(trade.trade_key)
                    .push_bind(texts.get(trade.status.as_str()))
                    .push_bind(trade.trade_date.to_julian_day());
            },
        );
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

/// Deletes from an embedded shard what expired before `horizon`: the rows of trades whose date
/// is earlier, unless the outbox still holds a CLS of theirs above the delivery watermark, and
/// exceptions that arrived earlier. One transaction; the freed pages are reused by later rows
/// (the file does not shrink).
async fn purge_expired(
    connection: &mut SqliteConnection,
    horizon: Date,
) -> Result<PurgeReport, sqlx::Error> {
    const UNDELIVERED: &str = concat!(
        "SELECT trade_key FROM cls_outbox WHERE id > ",
        delivered_through_sql!()
    );
    let horizon = horizon.to_julian_day();
    let mut transaction = connection.begin().await?;
    let kept: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT COUNT(DISTINCT trade_key) FROM messages WHERE trade_date < ? AND trade_key IN ({UNDELIVERED})"
    )))
    .bind(horizon)
    .fetch_one(&mut *transaction)
    .await?;
    let mut dropped = Vec::new();
    for (table, condition) in [
        (
            "messages",
            format!("trade_date < ? AND trade_key NOT IN ({UNDELIVERED})"),
        ),
        (
            "trade_status",
            format!("trade_date < ? AND trade_key NOT IN ({UNDELIVERED})"),
        ),
        (
            "cls_outbox",
            concat!("trade_date < ? AND id <= ", delivered_through_sql!()).to_owned(),
        ),
        ("exceptions", "received_on < ?".to_owned()),
    ] {
        let deleted = sqlx::query(sqlx::AssertSqlSafe(format!(
            "DELETE FROM {table} WHERE {condition}"
        )))
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
    fn purge_unchecked_exceptions(&mut self, before: Date) -> Result<u64, StoreError> {
        let result = self.runtime.block_on(
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "DELETE FROM exceptions WHERE received_on < ? AND {}",
                super::UNCHECKED_EXCEPTIONS_SQL
            )))
            .bind(before.to_julian_day())
            .execute(&mut self.connection),
        );
        Ok(result
            .map_err(|source| self.database_error(source))?
            .rows_affected())
    }

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
        let result =
            self.runtime
                .block_on(write_batch(&mut self.connection, &mut self.texts, batch));
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
            // Counting distinct trades sorts every key: on disk, not in memory, which would
            // take a few hundred MiB after ten million trades.
            sqlx::raw_sql("PRAGMA temp_store = FILE")
                .execute(&mut self.connection)
                .await?;
            for (slot, query) in counts.iter_mut().zip(queries) {
                *slot = sqlx::query_scalar(query)
                    .fetch_one(&mut self.connection)
                    .await?;
            }
            sqlx::raw_sql("PRAGMA temp_store = MEMORY")
                .execute(&mut self.connection)
                .await?;
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
                    sqlx::query_as(sqlx::AssertSqlSafe(query.as_str()))
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

/// A `messages` row of the embedded store as recovery reads it: id, raw, injected_ns,
/// received_on (Julian day).
type SqliteStoredRow = (i64, Vec<u8>, i64, Option<i32>);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::tests::sample_batch;

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
    fn the_write_ahead_log_is_copied_into_the_file_every_few_pages() {
        let dir = tempfile::tempdir().expect("temporary folder");
        let path = dir.path().join("shard-0.sqlite");
        let mut store = SqliteStore::open(&path).expect("opens");
        // 4 MiB of raw bytes in 64 commits: 256 pages and more, which SQLite's default mark
        // (1,000 pages) would leave in the log.
        for _ in 0..64 {
            let mut batch = sample_batch();
            batch.messages[0].raw = vec![b'x'; 64 * 1024];
            store.commit(&mut batch).expect("commits");
        }
        let log_bytes = std::fs::metadata(dir.path().join("shard-0.sqlite-wal"))
            .expect("the write-ahead log")
            .len();
        // Twice the mark and a commit; the default would hold all 4 MiB.
        let bound = u64::from((2 * 32 + 8) * (SQLITE_PAGE_SIZE_BYTES + 24));
        assert!(
            log_bytes <= bound,
            "the log holds {log_bytes} bytes, above {bound}"
        );
        assert_eq!(store.row_counts().expect("counts").messages, 64);
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
    fn an_outbox_id_is_never_given_twice_even_once_retention_emptied_the_outbox() {
        let dir = tempfile::tempdir().expect("temporary folder");
        let mut store = SqliteStore::open(&dir.path().join("s.sqlite")).expect("opens");
        let first = store.commit(&mut sample_batch()).expect("commits");
        assert_eq!(first, vec![1]);
        let mut confirmed = Batch {
            delivered_through: Some(1),
            ..Batch::default()
        };
        store.commit(&mut confirmed).expect("confirms");
        store
            .purge(time::macros::date!(2040 - 01 - 01), 30)
            .expect("purges");
        assert_eq!(store.row_counts().expect("counts").cls, 0);
        // The next CLS is above the watermark, not delivered already.
        let next = store.commit(&mut sample_batch()).expect("commits");
        assert_eq!(next, vec![2]);
        assert_eq!(store.undelivered_cls().expect("reads").len(), 1);
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
}
