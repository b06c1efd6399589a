//! A shard in a PostgreSQL database.

use sqlx::postgres::PgConnection;
use sqlx::Connection;
use ste_core::validate::MESSAGE_SIZE_MAX_BYTES;
use time::Date;

use super::{
    connect_and_migrate, database_error, io_runtime, outbox_ids_in_order, read_pages,
    remembered_rejections_query, stored_rejections, undelivered_rows, Batch, ClsRow, MessageRow,
    PurgeReport, RejectionRow, RowCounts, Store, StoreError, StoredMessage, StoredRejection,
    TradeRow, UndeliveredCls, RECOVERY_PAGE_ROWS, REMEMBERED_EXCEPTIONS_SQL,
    UNCHECKED_EXCEPTIONS_SQL, UNDELIVERED_QUERY,
};
use crate::matcher::{RecallQuery, Recalled, RecalledTrade, RecalledVerdict, RetiredFact};
use crate::reason::ReasonCode;

static POSTGRES_MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../migrations/postgres");

/// How long [`PgStore::recreate_database`] waits for other roles' sessions on the database to
/// end before it drops it.
const DROP_WAIT: std::time::Duration = std::time::Duration::from_secs(10);
/// How often it looks.
const DROP_POLL: std::time::Duration = std::time::Duration::from_millis(50);

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
    /// The lease token of this shard's owner (cluster mode): every commit raises the shard's
    /// fence to it first and is refused when the fence is already higher.
    fencing_token: Option<i64>,
    runtime: tokio::runtime::Runtime,
    connection: PgConnection,
    /// The binary COPY's rows on their way out, [`COPY_CHUNK_BYTES`] at a time: one buffer for
    /// the store's life, which stays in cache, where a buffer the size of the batch was new
    /// memory every commit (megabytes of fresh pages, faulted in and zeroed by the kernel).
    copy_buffer: Vec<u8>,
}

/// The name of the password file of the database roles in a cluster's secrets folder.
pub const PGPASS_FILE: &str = "pgpass";

/// A stored message as read back: id, raw bytes, injection time, trade date.
type PgStoredRow = (i64, Vec<u8>, i64, Date, Option<Date>);

/// The tables partitioned by month, in the order a session that locks more than one of them
/// at once (making or dropping partitions) locks them.
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

/// The statements creating `partitions` where they do not exist yet, through the function
/// that makes them with the shard owner role's rights (migration 0005).
fn create_partitions_sql(partitions: &[(PartitionedTable, Month)]) -> String {
    partitions
        .iter()
        .map(|&(table, month)| {
            format!(
                "SELECT ste_create_partition('{}', '{}');",
                table.name(),
                month.first_day(),
            )
        })
        .collect()
}

/// PostgreSQL's binary COPY header: signature, flags, header extension length.
const PG_COPY_HEADER: &[u8] = b"PGCOPY\n\xff\r\n\0\0\0\0\0\0\0\0\0";

/// The Julian day number of 2000-01-01, PostgreSQL's epoch for dates.
const PG_EPOCH_JULIAN_DAY: i32 = 2_451_545;

/// How much of a binary COPY is encoded before it is sent: big enough that a send is a few TLS
/// records and one write, small enough to stay in the cache with the client's own buffer.
const COPY_CHUNK_BYTES: usize = 256 * 1024;

/// The most one row can add to a chunk: the raw message (at most
/// [`MESSAGE_SIZE_MAX_BYTES`]), the columns cut from it (the trade key joins two of its
/// fields), and the field count, lengths, dates and timestamp, far below the rest.
const COPY_ROW_MAX_BYTES: usize = 3 * MESSAGE_SIZE_MAX_BYTES;

/// Appends one column of a binary COPY row: its length and bytes, or -1 for NULL.
fn copy_field(out: &mut Vec<u8>, value: Option<&[u8]>) {
    match value {
        Some(bytes) => {
            out.extend_from_slice(&(bytes.len() as i32).to_be_bytes());
            out.extend_from_slice(bytes);
        }
        None => out.extend_from_slice(&(-1_i32).to_be_bytes()),
    }
}

/// A date as a binary COPY carries it: the number of days since 2000-01-01.
fn copy_date(date: Date) -> [u8; 4] {
    (date.to_julian_day() - PG_EPOCH_JULIAN_DAY).to_be_bytes()
}

/// Appends one message row to a binary COPY: the columns of [`COPY_MESSAGES`], in order.
fn encode_copy_row(out: &mut Vec<u8>, row: &MessageRow) {
    let start = out.len();
    out.extend_from_slice(&10_i16.to_be_bytes());
    copy_field(out, Some(&copy_date(row.trade_date)));
    copy_field(out, Some(row.trade_key.as_bytes()));
    copy_field(out, Some(row.sender.as_bytes()));
    copy_field(out, Some(row.msg_id.as_bytes()));
    copy_field(out, Some(row.msg_type.as_bytes()));
    copy_field(out, Some(row.function.as_bytes()));
    copy_field(out, row.related_id.as_deref().map(str::as_bytes));
    copy_field(out, Some(&(row.injected_ns as i64).to_be_bytes()));
    copy_field(out, Some(&row.raw));
    copy_field(out, Some(&copy_date(row.received_on)));
    // So that a chunk, cut after the row that reaches its size, fits the buffer made for it.
    debug_assert!(out.len() - start <= COPY_ROW_MAX_BYTES);
}

/// Appends one trade row to a binary COPY: the columns of [`COPY_TRADES`], in order.
fn encode_trade_row(out: &mut Vec<u8>, row: &TradeRow) {
    out.extend_from_slice(&3_i16.to_be_bytes());
    copy_field(out, Some(&copy_date(row.trade_date)));
    copy_field(out, Some(row.trade_key.as_bytes()));
    copy_field(out, Some(row.status.as_str().as_bytes()));
}

/// Appends one outbox row to a binary COPY: the columns of [`COPY_OUTBOX`], in order.
fn encode_outbox_row(out: &mut Vec<u8>, (id, row): (i64, &ClsRow)) {
    out.extend_from_slice(&5_i16.to_be_bytes());
    copy_field(out, Some(&id.to_be_bytes()));
    copy_field(out, Some(&copy_date(row.trade_date)));
    copy_field(out, Some(row.cls_id.as_bytes()));
    copy_field(out, Some(row.trade_key.as_bytes()));
    copy_field(out, Some(row.body.as_bytes()));
}

/// The COPY that loads a batch's message rows, in the column order of [`encode_copy_row`].
const COPY_MESSAGES: &str = "COPY messages (trade_date, trade_key, sender, msg_id, msg_type, function, related_id, injected_ns, raw, received_on) \
     FROM STDIN WITH (FORMAT binary)";

/// The COPY that loads the trades' first statuses, in the column order of [`encode_trade_row`].
const COPY_TRADES: &str =
    "COPY trades (trade_date, trade_key, status) FROM STDIN WITH (FORMAT binary)";

/// Whether `error` is the trades' key refusing a row: a status its matcher took for a trade's
/// first met one stored before. A matcher counts every trade it restored from the store as
/// stored and opens no trade twice, so this is not expected; if it happens the batch is written
/// again with every status as an upsert, and the key, not the matcher, has the last word.
fn is_trade_status_stored(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(database)
        if database.code().as_deref() == Some("23505")
            && database.table().is_some_and(|table| table.starts_with("trades")))
}

/// The COPY that loads a batch's CLS into the outbox, with the ids reserved for them
/// ([`RESERVE_OUTBOX_IDS`]), in the column order of [`encode_outbox_row`].
const COPY_OUTBOX: &str =
    "COPY cls_outbox (id, trade_date, cls_id, trade_key, body) FROM STDIN WITH (FORMAT binary)";

/// Takes as many outbox ids from the outbox's sequence as the batch has CLS. One writer
/// commits a shard's batches one after another, so the ids of a later batch are above every
/// id of an earlier one. In a cluster the fence is raised first in the same transaction, so
/// an owner that has lost the shard is refused before it takes any, and one that still holds
/// the fence's lock commits before the new owner's first commit can take its own.
const RESERVE_OUTBOX_IDS: &str = "SELECT nextval('cls_outbox_id_seq') FROM generate_series(1, $1)";

/// Sends rows through an open binary COPY, [`COPY_CHUNK_BYTES`] at a time, encoded in
/// `buffer` by `encode` (emptied first; its capacity is kept for the next batch). A chunk holds
/// at most that and one row. A message row is at most [`COPY_ROW_MAX_BYTES`], which the buffer
/// is made for; an outbox row has no bound of its own (a CLS carries a settlement for each of
/// up to [`ste_core::validate::ALLOC_COUNT_MAX`] allocations), so the buffer grows to hold the
/// largest CLS the shard has written and keeps that size.
async fn send_copy_rows<R>(
    copy: &mut sqlx::postgres::PgCopyIn<&mut PgConnection>,
    rows: impl IntoIterator<Item = R>,
    encode: fn(&mut Vec<u8>, R),
    buffer: &mut Vec<u8>,
) -> Result<(), sqlx::Error> {
    buffer.clear();
    buffer.extend_from_slice(PG_COPY_HEADER);
    for row in rows {
        encode(buffer, row);
        if buffer.len() >= COPY_CHUNK_BYTES {
            copy.send(buffer.as_slice()).await?;
            buffer.clear();
        }
    }
    buffer.extend_from_slice(&(-1_i16).to_be_bytes());
    copy.send(buffer.as_slice()).await?;
    buffer.clear();
    Ok(())
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
    /// One page of rows after `after_id`, by a query whose placeholders are the last id read
    /// and the page size. The queries are this module's own text: their only parts not
    /// written here are conditions from this module and partition names of its own making.
    fn page<T>(&mut self, query: &str, after_id: i64) -> Result<Vec<T>, StoreError>
    where
        T: for<'r> sqlx::FromRow<'r, sqlx::postgres::PgRow> + Send + Unpin,
    {
        let result = self.runtime.block_on(
            sqlx::query_as(sqlx::AssertSqlSafe(query))
                .bind(after_id)
                .bind(RECOVERY_PAGE_ROWS)
                .fetch_all(&mut self.connection),
        );
        result.map_err(|source| database_error(&self.name, source))
    }

    /// Hands the accepted messages (as `m`) that satisfy `condition` to `visit`, in order.
    fn read_messages(
        &mut self,
        condition: &str,
        visit: &mut dyn FnMut(StoredMessage),
    ) -> Result<u64, StoreError> {
        let query = format!(
            "SELECT m.id, m.raw, m.injected_ns, m.trade_date, m.received_on FROM messages m \
             WHERE m.id > $1 AND {condition} ORDER BY m.id LIMIT $2"
        );
        read_pages(
            |after_id| {
                let rows: Vec<PgStoredRow> = self.page(&query, after_id)?;
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

    /// The URL of database `name` on the server of `url` (same user, host, port and options).
    pub fn url_of_database(url: &str, name: &str) -> String {
        let authority = url.find("://").map_or(0, |scheme| scheme + 3);
        let path = url[authority..].find('/').map(|slash| authority + slash);
        let query = url[authority..].find('?').map(|q| authority + q);
        let end_of_server = path.or(query).unwrap_or(url.len());
        let options = query.map_or("", |q| &url[q..]);
        format!("{}/{name}{options}", &url[..end_of_server])
    }

    /// Drops database `name` on the server of `url` if it is there (closing its connections)
    /// and, with `create`, makes it again, empty: the fresh shards of one sweep level. Returns
    /// the database's URL.
    ///
    /// `WITH (FORCE)` ends the sessions of the dropping role, but another role's only when the
    /// dropper may signal them (a superuser, or a member of `pg_signal_backend`); otherwise
    /// `DROP` refuses while they last. A process that has just closed its connections leaves
    /// their server sessions behind for a moment, so the sessions of other roles are waited
    /// for first, for at most `DROP_WAIT`: a database still in use after that is refused with
    /// the server's reason.
    pub fn recreate_database(url: &str, name: &str, create: bool) -> Result<String, StoreError> {
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return Err(StoreError::Unsupported(
                "a database name of letters, digits and _ only",
            ));
        }
        let admin = Self::url_of_database(url, "postgres");
        let runtime = io_runtime()?;
        let server = redacted(&admin);
        runtime
            .block_on(async {
                let mut connection = PgConnection::connect(&admin).await?;
                let deadline = tokio::time::Instant::now() + DROP_WAIT;
                loop {
                    let others: i64 = sqlx::query_scalar(
                        "SELECT count(*) FROM pg_stat_activity \
                         WHERE datname = $1 AND usename <> current_user \
                         AND NOT pg_has_role('pg_signal_backend', 'MEMBER')",
                    )
                    .bind(name)
                    .fetch_one(&mut connection)
                    .await?;
                    if others == 0 || tokio::time::Instant::now() >= deadline {
                        break;
                    }
                    tokio::time::sleep(DROP_POLL).await;
                }
                sqlx::query(sqlx::AssertSqlSafe(format!(
                    "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
                )))
                .execute(&mut connection)
                .await?;
                if create {
                    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
                        .execute(&mut connection)
                        .await?;
                }
                connection.close().await
            })
            .map_err(|source| database_error(&server, source))?;
        Ok(Self::url_of_database(url, name))
    }

    /// Points PostgreSQL's password file (`PGPASSFILE`) at `secrets`'s `pgpass` when the
    /// environment names none and the folder has one: the roles' passwords come from there,
    /// never from a URL or the command line. Call before any thread starts.
    pub fn use_password_file_in(secrets: &std::path::Path) {
        let pgpass = secrets.join(PGPASS_FILE);
        if std::env::var_os("PGPASSFILE").is_none() && pgpass.is_file() {
            std::env::set_var("PGPASSFILE", pgpass);
        }
    }

    /// Connects and applies the migrations (checksums verified by sqlx).
    pub fn open(url: &str) -> Result<Self, StoreError> {
        let name = redacted(url);
        let runtime = io_runtime()?;
        let connection = connect_and_migrate(
            &runtime,
            &name,
            PgConnection::connect(url),
            async |connection: &mut PgConnection| {
                // The role nodes run as may not create tables: a database its owner role has
                // migrated is left as it is, and only one that is not is migrated here.
                if migrated(connection).await {
                    Ok(())
                } else {
                    POSTGRES_MIGRATOR.run(connection).await
                }
            },
        )?;
        Ok(Self {
            name,
            url: url.to_owned(),
            retrying: false,
            partitions: ahash::AHashSet::new(),
            fencing_token: None,
            runtime,
            connection,
            // As large as a chunk can get, once: it never grows after.
            copy_buffer: Vec::with_capacity(COPY_CHUNK_BYTES + COPY_ROW_MAX_BYTES),
        })
    }

    /// How many of the shard's trades are in each status (`PENDING`, `MATCHED`, ...; a trade
    /// with messages and no status written yet is pending), and how
    /// many distinct trades hold an accepted message: what a cluster's driver reports at the
    /// end of a run, as the matchers do in process.
    /// The trade keys of every accepted message the shard holds, once each.
    pub fn trade_keys(&mut self) -> Result<Vec<String>, StoreError> {
        let result = self.runtime.block_on(
            sqlx::query_scalar("SELECT DISTINCT trade_key FROM messages")
                .fetch_all(&mut self.connection),
        );
        result.map_err(|source| database_error(&self.name, source))
    }

    /// Messages (sender and MsgId) the shard holds more than once, and CLS ids its outbox
    /// holds more than once: both must be none, whatever failed meanwhile.
    pub fn stored_twice(&mut self) -> Result<(u64, u64), StoreError> {
        let result = self.runtime.block_on(async {
            let messages: i64 = sqlx::query_scalar(
                "SELECT COUNT(*) FROM (SELECT 1 FROM messages \
                 GROUP BY sender, msg_id HAVING COUNT(*) > 1) twice",
            )
            .fetch_one(&mut self.connection)
            .await?;
            let cls: i64 = sqlx::query_scalar(
                "SELECT COUNT(*) FROM (SELECT 1 FROM cls_outbox \
                 GROUP BY cls_id HAVING COUNT(*) > 1) twice",
            )
            .fetch_one(&mut self.connection)
            .await?;
            Ok::<_, sqlx::Error>((messages as u64, cls as u64))
        });
        result.map_err(|source| database_error(&self.name, source))
    }

    /// The commits of a cluster's owners the shard keeps, and how many of them carry a fencing
    /// token older than a commit before them (none, where the fence works).
    pub fn commits_out_of_fence_order(&mut self) -> Result<(u64, u64), StoreError> {
        let result = self.runtime.block_on(
            sqlx::query_as::<_, (i64, i64)>(
                "SELECT COUNT(*), COUNT(*) FILTER (WHERE token < earlier) FROM \
                 (SELECT token, MAX(token) OVER (ORDER BY id ROWS BETWEEN UNBOUNDED PRECEDING \
                 AND 1 PRECEDING) AS earlier FROM shard_commits) c",
            )
            .fetch_one(&mut self.connection),
        );
        result
            .map(|(commits, late)| (commits as u64, late as u64))
            .map_err(|source| database_error(&self.name, source))
    }

    pub fn trade_states(&mut self) -> Result<TradeStates, StoreError> {
        let result = self.runtime.block_on(async {
            let by_status: Vec<(String, i64)> =
                sqlx::query_as("SELECT status, COUNT(*) FROM trades GROUP BY status")
                    .fetch_all(&mut self.connection)
                    .await?;
            // A trade gets a row when its status first changes: one that holds messages and no
            // row is pending.
            let (with_messages, without_row): (i64, i64) = sqlx::query_as(
                "SELECT COUNT(*), COUNT(*) FILTER (WHERE NOT EXISTS \
                 (SELECT 1 FROM trades t WHERE t.trade_key = m.trade_key)) \
                 FROM (SELECT DISTINCT trade_key FROM messages) m",
            )
            .fetch_one(&mut self.connection)
            .await?;
            Ok::<_, sqlx::Error>((by_status, with_messages, without_row))
        });
        let (by_status, with_messages, without_row) =
            result.map_err(|source| database_error(&self.name, source))?;
        let mut by_status: std::collections::BTreeMap<String, u64> = by_status
            .into_iter()
            .map(|(status, count)| (status, count as u64))
            .collect();
        *by_status.entry("PENDING".to_owned()).or_default() += without_row as u64;
        Ok(TradeStates {
            by_status,
            with_messages: with_messages as u64,
        })
    }
}

/// A shard's trades by status ([`PgStore::trade_states`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TradeStates {
    pub by_status: std::collections::BTreeMap<String, u64>,
    /// Distinct trades with at least one accepted message.
    pub with_messages: u64,
}

impl TradeStates {
    /// Trades in `status`.
    pub fn count(&self, status: &str) -> u64 {
        self.by_status.get(status).copied().unwrap_or(0)
    }
}

/// Whether every migration of this build is applied to the database, with the checksum it has
/// here (false where the migrations' table is missing or unreadable).
async fn migrated(connection: &mut PgConnection) -> bool {
    let applied: Result<Vec<(i64, Vec<u8>)>, _> = sqlx::query_as(
        "SELECT version, checksum FROM _sqlx_migrations WHERE success ORDER BY version",
    )
    .fetch_all(&mut *connection)
    .await;
    let Ok(applied) = applied else {
        return false;
    };
    let applied: ahash::AHashMap<i64, Vec<u8>> = applied.into_iter().collect();
    POSTGRES_MIGRATOR
        .iter()
        .filter(|migration| !migration.migration_type.is_down_migration())
        .all(|migration| {
            applied
                .get(&migration.version)
                .is_some_and(|checksum| checksum.as_slice() == &*migration.checksum)
        })
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

/// Commits whose fencing tokens a shard keeps (migration 0006).
const COMMIT_LOG_KEPT: i64 = 100_000;

/// SQLSTATE of a commit refused by the shard's fence (migration 0003).
const FENCED_SQLSTATE: &str = "SF001";

/// Whether `error` is the shard's fence refusing a commit.
fn is_fenced(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(database) if database.code().as_deref() == Some(FENCED_SQLSTATE))
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
    fencing_token: Option<i64>,
    copy_buffer: &mut Vec<u8>,
    trades_by_copy: bool,
) -> Result<Vec<i64>, sqlx::Error> {
    let mut transaction = connection.begin().await?;
    if let Some(token) = fencing_token {
        // First, so that a fenced owner writes nothing at all.
        sqlx::query("SELECT ste_raise_fence($1)")
            .bind(token)
            .execute(&mut *transaction)
            .await?;
    }
    if !create_partitions.is_empty() {
        sqlx::raw_sql(sqlx::AssertSqlSafe(create_partitions))
            .execute(&mut *transaction)
            .await?;
    }
    if !batch.messages.is_empty() {
        // The bulk of every batch goes in through binary COPY, PostgreSQL's fastest load path.
        // COPY cannot skip existing rows; the (sender, msg_id) key refuses a batch that was
        // already committed, which is what a retry after a lost reply needs to learn.
        let mut copy = transaction.copy_in_raw(COPY_MESSAGES).await?;
        send_copy_rows(&mut copy, &batch.messages, encode_copy_row, copy_buffer).await?;
        copy.finish().await?;
    }
    // A trade's first status goes in through COPY too: through psql, new rows as an insert
    // that looks for each one first (`ON CONFLICT`, 250 rows a statement) took 8.2-9.4 µs a
    // row, and as a COPY 3.8-4.4 (`bench/trade-status.sh`, BENCHMARKS.md). Its matcher's word
    // that there is no row is not trusted blindly: if there is one, the key refuses the COPY,
    // and the batch is written again with every status as an upsert
    // ([`is_trade_status_stored`]).
    let (first, rest): (Vec<&TradeRow>, Vec<&TradeRow>) = batch
        .trades
        .iter()
        .partition(|row| trades_by_copy && row.first);
    if !first.is_empty() {
        let mut copy = transaction.copy_in_raw(COPY_TRADES).await?;
        send_copy_rows(&mut copy, first, encode_trade_row, copy_buffer).await?;
        copy.finish().await?;
    }
    if !rest.is_empty() {
        sqlx::query(
            "INSERT INTO trades (trade_date, trade_key, status) \
             SELECT * FROM UNNEST($1::date[], $2::text[], $3::text[]) \
             ON CONFLICT (trade_key, trade_date) DO UPDATE SET status = excluded.status",
        )
        .bind(rest.iter().map(|r| r.trade_date).collect::<Vec<_>>())
        .bind(
            rest.iter()
                .map(|r| r.trade_key.as_str())
                .collect::<Vec<_>>(),
        )
        .bind(rest.iter().map(|r| r.status.as_str()).collect::<Vec<_>>())
        .execute(&mut *transaction)
        .await?;
    }
    let mut outbox_ids = Vec::new();
    if !batch.cls.is_empty() {
        // Through binary COPY, with ids taken first (see `RESERVE_OUTBOX_IDS`): an insert that
        // gave each row its id and returned them cost the servers about twice as much. COPY
        // cannot skip a stored ClsId, and need not: the matcher closes a trade when it emits
        // its CLS, and a retried batch that was committed meets its own messages first.
        outbox_ids = sqlx::query_scalar(RESERVE_OUTBOX_IDS)
            .bind(batch.cls.len() as i64)
            .fetch_all(&mut *transaction)
            .await?;
        outbox_ids.sort_unstable();
        assert_eq!(outbox_ids.len(), batch.cls.len(), "one outbox id per CLS");
        let mut copy = transaction.copy_in_raw(COPY_OUTBOX).await?;
        let rows = outbox_ids.iter().copied().zip(&batch.cls);
        send_copy_rows(&mut copy, rows, encode_outbox_row, copy_buffer).await?;
        copy.finish().await?;
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
    if let Some(token) = fencing_token {
        // The commit's token, last, so that its place follows the commit's: the fence's lock
        // makes an owner's commits take turns with another's, and an owner that stalled inside
        // a transaction the fence did not hold would land after the newer owner's commits.
        sqlx::query("INSERT INTO shard_commits (token) VALUES ($1)")
            .bind(token)
            .execute(&mut *transaction)
            .await?;
    }
    transaction.commit().await?;
    Ok(outbox_ids)
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
        let undelivered: bool = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT EXISTS (SELECT 1 FROM \"{}\" WHERE id > {})",
            PartitionedTable::ClsOutbox.partition(month),
            delivered_through_sql!()
        )))
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
    // Dropping a partition locks its parent first: parents in the order of `PartitionedTable`,
    // as a writer making partitions takes them.
    expired.sort_by_key(|&(table, month)| (table as u8, month));
    let names: Vec<String> = expired
        .iter()
        .map(|&(table, month)| table.partition(month))
        .collect();
    // Through the function that drops them with the shard owner role's rights (migration
    // 0005), in one transaction.
    let drop: String = std::iter::once("BEGIN;".to_owned())
        .chain(expired.iter().map(|&(table, month)| {
            format!(
                "SELECT ste_drop_partition('{}', '{}');",
                table.name(),
                month.first_day()
            )
        }))
        .chain(std::iter::once("COMMIT;".to_owned()))
        .collect();
    sqlx::raw_sql(sqlx::AssertSqlSafe(drop.as_str()))
        .execute(&mut *connection)
        .await?;
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
        // In the one order every session of a shard takes its tables' locks in.
        new_partitions.sort_by_key(|&(table, month)| (table as u8, month));
        let create = create_partitions_sql(&new_partitions);
        let fencing_token = self.fencing_token;
        let mut write = |trades_by_copy: bool| {
            self.runtime.block_on(write_pg_batch(
                &mut self.connection,
                batch,
                &create,
                fencing_token,
                &mut self.copy_buffer,
                trades_by_copy,
            ))
        };
        // Each of the two known refusals is answered once, in whichever order they come: a
        // first status that met a stored one (written again with every status upserted), and
        // another writer of this database creating the same partition at the same moment
        // (shard 0's writer and the exceptions writer share `exceptions`: it exists now).
        let (mut trades_by_copy, mut raced) = (true, create.is_empty());
        let result = loop {
            match write(trades_by_copy) {
                Err(error) if trades_by_copy && is_trade_status_stored(&error) => {
                    tracing::warn!(store = %self.name, "a trade's first status met a stored one: the batch is written again with every status as an upsert");
                    trades_by_copy = false;
                }
                Err(error) if !raced && catalog_race(&error) => raced = true,
                result => break result,
            }
        };
        let error = match result {
            Ok(ids) => {
                self.partitions.extend(new_partitions);
                return Ok(ids);
            }
            Err(error) if is_fenced(&error) => {
                return Err(StoreError::Fenced {
                    store: self.name.clone(),
                    token: self.fencing_token.unwrap_or_default(),
                });
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

    fn fence(&mut self, token: u64) -> Result<(), StoreError> {
        let token = i64::try_from(token).map_err(|_| StoreError::Fenced {
            store: self.name.clone(),
            token: i64::MAX,
        })?;
        self.fencing_token = Some(token);
        // Raise the fence at once: from now on an older owner's commit is refused.
        self.commit(&mut Batch::default())?;
        let trimmed = self.runtime.block_on(
            sqlx::query(
                "DELETE FROM shard_commits WHERE id <= \
                 (SELECT MAX(id) FROM shard_commits) - $1",
            )
            .bind(COMMIT_LOG_KEPT)
            .execute(&mut self.connection),
        );
        trimmed
            .map(drop)
            .map_err(|source| database_error(&self.name, source))
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
        self.read_messages("TRUE", visit)
    }

    fn can_recall(&self) -> bool {
        true
    }

    fn recall(&mut self, query: &RecallQuery) -> Result<Recalled, StoreError> {
        let result = self.runtime.block_on(recall(&mut self.connection, query));
        result.map_err(|source| database_error(&self.name, source))
    }

    fn for_each_retired(&mut self, visit: &mut dyn FnMut(RetiredFact)) -> Result<u64, StoreError> {
        let accepted = read_pages(
            |after_id| {
                let rows: Vec<(i64, String, String, String, Option<String>)> = self.page(
                    "SELECT id, sender, msg_id, function, related_id FROM messages \
                         WHERE id > $1 ORDER BY id LIMIT $2",
                    after_id,
                )?;
                Ok(rows
                    .into_iter()
                    .map(|(id, sender, msg_id, function, related_id)| {
                        let names = related_id.filter(|_| function != "NEW");
                        let fact = RetiredFact::Accepted {
                            sender,
                            msg_id,
                            names,
                        };
                        (id, fact)
                    })
                    .collect())
            },
            visit,
        )?;
        let rejections = format!(
            "SELECT id, sender, msg_id FROM exceptions WHERE id > $1 AND {REMEMBERED_EXCEPTIONS_SQL} \
             ORDER BY id LIMIT $2"
        );
        read_pages(
            |after_id| {
                let rows: Vec<(i64, String, String)> = self.page(&rejections, after_id)?;
                Ok(rows
                    .into_iter()
                    .map(|(id, sender, msg_id)| (id, RetiredFact::Rejected { sender, msg_id }))
                    .collect())
            },
            visit,
        )?;
        // Trades have no id: pages follow their key.
        let mut after: Option<(String, Date)> = None;
        loop {
            let (key, date) = after.clone().unzip();
            let result: Result<Vec<(String, Date, String)>, _> = self.runtime.block_on(
                sqlx::query_as(
                    "SELECT trade_key, trade_date, status FROM trades \
                     WHERE ($1::text IS NULL OR (trade_key, trade_date) > ($1, $2::date)) \
                     AND status IN ('MATCHED', 'AGED') \
                     ORDER BY trade_key, trade_date LIMIT $3",
                )
                .bind(key)
                .bind(date)
                .bind(RECOVERY_PAGE_ROWS)
                .fetch_all(&mut self.connection),
            );
            let rows = result.map_err(|source| database_error(&self.name, source))?;
            let Some((key, date, _)) = rows.last() else {
                return Ok(accepted);
            };
            after = Some((key.clone(), *date));
            for (trade_key, _, status) in rows {
                visit(RetiredFact::Closed {
                    trade_key,
                    aged: status == "AGED",
                });
            }
        }
    }

    fn for_each_accepted_of_open_trades(
        &mut self,
        visit: &mut dyn FnMut(StoredMessage),
    ) -> Result<u64, StoreError> {
        self.read_messages(
            "NOT EXISTS (SELECT 1 FROM trades t WHERE t.trade_key = m.trade_key \
             AND t.trade_date = m.trade_date AND t.status IN ('MATCHED', 'AGED'))",
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
                let rows: Vec<RejectionRow> = self.page(&query, after_id)?;
                Ok(stored_rejections(rows))
            },
            visit,
        )
    }

    fn purge_unchecked_exceptions(&mut self, before: Date) -> Result<u64, StoreError> {
        let result = self.runtime.block_on(
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "DELETE FROM exceptions WHERE received_on < $1 AND {UNCHECKED_EXCEPTIONS_SQL}"
            )))
            .bind(before)
            .execute(&mut self.connection),
        );
        Ok(result
            .map_err(|source| database_error(&self.name, source))?
            .rows_affected())
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
        // A statement, and so a transaction, a table: a count holds one table's locks at a
        // time. Counted in one statement, the tables were locked one after another and held
        // together, and another writer of the database making a new month's partitions (which
        // locks each table it adds one to) could wait for one of them while holding the table
        // the count waited for: PostgreSQL broke the cycle by failing one of the two.
        let result = self.runtime.block_on(async {
            let mut counts = [0_i64; PartitionedTable::ALL.len()];
            for (count, table) in counts.iter_mut().zip(PartitionedTable::ALL) {
                *count = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                    "SELECT COUNT(*) FROM {}",
                    table.name()
                )))
                .fetch_one(&mut self.connection)
                .await?;
            }
            Ok::<_, sqlx::Error>(counts)
        });
        let [messages, trades, cls, exceptions] =
            result.map_err(|source| database_error(&self.name, source))?;
        Ok(RowCounts {
            messages: messages as u64,
            trades: trades as u64,
            cls: cls as u64,
            exceptions: exceptions as u64,
        })
    }
}

/// Answers a bounded matcher's [`RecallQuery`] in at most four look-ups, each by an index.
async fn recall(
    connection: &mut PgConnection,
    query: &RecallQuery,
) -> Result<Recalled, sqlx::Error> {
    fn columns(pairs: &[(String, String)]) -> (Vec<&str>, Vec<&str>) {
        pairs.iter().map(|(a, b)| (a.as_str(), b.as_str())).unzip()
    }
    let mut recalled = Recalled::default();
    if !query.verdicts.is_empty() {
        let (senders, msg_ids) = columns(&query.verdicts);
        let accepted: Vec<(String, String, Vec<u8>)> = sqlx::query_as(
            "SELECT sender, msg_id, raw FROM messages \
             WHERE (sender, msg_id) IN (SELECT * FROM UNNEST($1::text[], $2::text[]))",
        )
        .bind(&senders)
        .bind(&msg_ids)
        .fetch_all(&mut *connection)
        .await?;
        let rejected: Vec<(String, String, String, Vec<u8>)> =
            sqlx::query_as(sqlx::AssertSqlSafe(format!(
                "SELECT DISTINCT ON (sender, msg_id) sender, msg_id, code, raw FROM exceptions \
             WHERE (sender, msg_id) IN (SELECT * FROM UNNEST($1::text[], $2::text[])) \
             AND {REMEMBERED_EXCEPTIONS_SQL} ORDER BY sender, msg_id, id"
            )))
            .bind(&senders)
            .bind(&msg_ids)
            .fetch_all(&mut *connection)
            .await?;
        // An accepted message is the first verdict of its key: a rejection remembered under an
        // accepted key came after it.
        let accepted_keys: ahash::AHashSet<(String, String)> = accepted
            .iter()
            .map(|(sender, msg_id, _)| (sender.clone(), msg_id.clone()))
            .collect();
        for (sender, msg_id, raw) in accepted {
            recalled.verdicts.push(RecalledVerdict {
                sender,
                msg_id,
                raw,
                rejected: None,
            });
        }
        for (sender, msg_id, code, raw) in rejected {
            let Some(code) = ReasonCode::parse(&code) else {
                continue;
            };
            if !accepted_keys.contains(&(sender.clone(), msg_id.clone())) {
                recalled.verdicts.push(RecalledVerdict {
                    sender,
                    msg_id,
                    raw,
                    rejected: Some(code),
                });
            }
        }
    }
    if !query.trades.is_empty() {
        let closed: Vec<(String, Date, String)> = sqlx::query_as(
            "SELECT DISTINCT ON (trade_key) trade_key, trade_date, status FROM trades \
             WHERE trade_key = ANY($1) AND status IN ('MATCHED', 'AGED') \
             ORDER BY trade_key, trade_date",
        )
        .bind(&query.trades)
        .fetch_all(&mut *connection)
        .await?;
        recalled.closed = closed
            .into_iter()
            .map(|(trade_key, trade_date, status)| RecalledTrade {
                trade_key,
                trade_date,
                aged: status == "AGED",
            })
            .collect();
    }
    if !query.names.is_empty() {
        let (senders, msg_ids) = columns(&query.names);
        recalled.names = sqlx::query_as(
            "SELECT DISTINCT sender, related_id FROM messages \
             WHERE (sender, related_id) IN (SELECT * FROM UNNEST($1::text[], $2::text[])) \
             AND related_id IS NOT NULL AND function <> 'NEW'",
        )
        .bind(&senders)
        .bind(&msg_ids)
        .fetch_all(&mut *connection)
        .await?;
    }
    Ok(recalled)
}

#[cfg(test)]
mod tests {
    use super::*;

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
            "SELECT ste_create_partition('messages', '2026-12-01');"
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
}
