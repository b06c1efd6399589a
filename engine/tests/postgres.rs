//! The PostgreSQL store against a real server: `DATABASE_URL` names an administrative
//! connection (default: the local server, user postgres); each test creates its own databases
//! and drops them afterwards.

mod common;

use std::sync::Arc;

use common::{block_on, submit_all, TempDatabases};
use sqlx::{Connection, PgConnection};
use ste_engine::generator::RunOutcome;
use ste_engine::generator::{Generator, GeneratorConfig};
use ste_engine::matcher::{MatcherMemory, TradeStatus};
use ste_engine::pipeline::{AckResult, Pipeline, PipelineConfig, StoreConfig};
use ste_engine::profile::Tolerances;
use ste_engine::queue::drain;
use ste_engine::refdata::RefData;
use ste_engine::routing::shard_of;
use ste_engine::store::{Batch, ClsRow, MessageRow, Month, PgStore, Store, StoreError, TradeRow};

fn trade_keys(url: &str) -> Vec<String> {
    PgStore::open(url)
        .and_then(|mut store| store.trade_keys())
        .expect("the shard's trade keys")
}

/// Runs `trades` clean trades through a pipeline on the postgres shards `urls`.
fn run_clean(
    urls: Vec<String>,
    trades: u64,
    recover: bool,
) -> (ste_engine::pipeline::PipelineReport, Vec<AckResult>) {
    let refdata = Arc::new(
        RefData::embedded()
            .expect("reference data")
            .with_generated_keys(),
    );
    let config = PipelineConfig {
        shards: urls.len() as u32,
        store: StoreConfig::Postgres { urls },
        recover,
        ..PipelineConfig::default()
    };
    let pipeline =
        Pipeline::start(&config, refdata.clone(), Tolerances::default()).expect("starts");
    let acks = pipeline.acks();
    submit_all(
        &pipeline,
        &refdata,
        Generator::new(&refdata, GeneratorConfig::clean(trades)),
    );
    let report = pipeline.finish().expect("finishes");
    let results = drain(&acks)
        .expect("drains")
        .into_iter()
        .map(|ack| ack.result)
        .collect();
    (report, results)
}

/// Sends `lines` through a pipeline on the postgres shards `urls` whose matchers keep
/// `memory`, and counts the answers as the generator counts what it expects.
fn run_lines(
    urls: Vec<String>,
    refdata: &Arc<RefData>,
    lines: &[Vec<u8>],
    memory: MatcherMemory,
    recover: bool,
) -> (ste_engine::pipeline::PipelineReport, RunOutcome) {
    let config = PipelineConfig {
        shards: urls.len() as u32,
        store: StoreConfig::Postgres { urls },
        recover,
        matcher_memory: memory,
        ..PipelineConfig::default()
    };
    let pipeline =
        Pipeline::start(&config, refdata.clone(), Tolerances::default()).expect("starts");
    let acks = pipeline.acks();
    submit_all(&pipeline, refdata, lines.iter().cloned());
    let report = pipeline.finish().expect("finishes");
    let results: Vec<AckResult> = drain(&acks)
        .expect("drains")
        .into_iter()
        .map(|ack| ack.result)
        .collect();
    let outcome = common::outcome_of(&results);
    (report, outcome)
}

/// A bounded matcher whose generations hold 32 entries and whose filter is 1 KiB (saturated
/// after a few hundred keys, so that nearly every message is read back from the shard) answers
/// a shuffled fault-mix load exactly as the generator expects. Restarted on the same shards —
/// rebuilt with only the open trades in memory — it answers the same load sent again with
/// every accepted message a duplicate and every rejection the same again: everything it
/// retired was read back right.
#[test]
fn a_bounded_matcher_reads_back_from_its_shard_what_it_retired() {
    let databases = TempDatabases::create("recall", 2);
    let refdata = Arc::new(
        RefData::embedded()
            .expect("reference data")
            .with_generated_keys(),
    );
    let (lines, expected) = common::fault_mix(&refdata, 1_500, 23);
    let memory = common::tiny_matcher_memory();

    let (report, first) = run_lines(databases.urls(), &refdata, &lines, memory, false);
    assert_eq!(first.messages_in, expected.messages_in);
    assert_eq!(first.accepted, expected.accepted);
    assert_eq!(first.duplicates, expected.duplicates);
    assert_eq!(first.exceptions, expected.exceptions);
    let matched: u64 = report.shards.iter().map(|counts| counts.matched).sum();
    assert_eq!(matched, expected.cls);
    assert!(expected.duplicates > 0 && expected.exceptions.contains_key("E_CLOSED"));

    let (report, again) = run_lines(databases.urls(), &refdata, &lines, memory, true);
    assert_eq!(again.messages_in, expected.messages_in);
    assert_eq!(again.accepted, 0, "nothing is accepted twice");
    assert_eq!(again.duplicates, expected.accepted + expected.duplicates);
    assert_eq!(again.exceptions, expected.exceptions);
    let matched: u64 = report.shards.iter().map(|counts| counts.matched).sum();
    let messages: u64 = report.shards.iter().map(|counts| counts.messages).sum();
    assert_eq!(
        matched, expected.cls,
        "the rebuilt matchers count every closed trade"
    );
    assert_eq!(messages, expected.accepted);
    let stored: u64 = report.shard_rows.iter().map(|rows| rows.messages).sum();
    assert_eq!(
        stored, expected.accepted,
        "every accepted message stored once"
    );
}

#[test]
fn trades_land_on_the_shard_the_routing_rule_names() {
    let databases = TempDatabases::create("routing", 3);
    let trades = 400;
    let (report, results) = run_clean(databases.urls(), trades, false);
    assert_eq!(results.len() as u64, trades * 7);
    assert!(results.iter().all(|result| *result == AckResult::Accepted));
    let mut seen = 0;
    for (shard, url) in databases.urls().iter().enumerate() {
        let keys = trade_keys(url);
        assert!(!keys.is_empty(), "shard {shard} holds trades");
        for key in &keys {
            assert_eq!(shard_of(key, 3) as usize, shard, "{key}");
        }
        assert_eq!(
            report.shard_rows[shard].messages,
            report.shards[shard].messages
        );
        assert_eq!(report.shard_rows[shard].cls, report.shards[shard].matched);
        seen += keys.len();
    }
    assert_eq!(seen as u64, trades);
}

/// A batch of one NOE of trade `B/<trade_ref>`, its status and a CLS.
fn one_message_batch(trade_ref: &str) -> Batch {
    Batch {
        messages: vec![MessageRow {
            trade_date: time::macros::date!(2026 - 01 - 30),
            trade_key: format!("B/{trade_ref}"),
            sender: "B".into(),
            msg_id: format!("B-{trade_ref}").into(),
            msg_type: "NOE",
            function: "NEW",
            related_id: None,
            injected_ns: 1,
            raw: b"<Msg/>".to_vec(),
            received_on: time::macros::date!(2026 - 11 - 30),
        }],
        trades: vec![TradeRow {
            trade_date: time::macros::date!(2026 - 01 - 30),
            trade_key: format!("B/{trade_ref}"),
            status: TradeStatus::Pending,
            first: true,
        }],
        cls: vec![ClsRow {
            trade_date: time::macros::date!(2026 - 01 - 30),
            cls_id: format!("CLS-B-{trade_ref}"),
            trade_key: format!("B/{trade_ref}"),
            body: "<Cls/>".to_owned(),
        }],
        ..Batch::default()
    }
}

#[test]
fn a_replayed_batch_changes_nothing() {
    let databases = TempDatabases::create("replay", 1);
    let url = &databases.urls()[0];
    let mut store = PgStore::open(url).expect("opens and migrates");
    let batch = || one_message_batch("T1");
    let outbox_ids = store.commit(&mut batch()).expect("commits");
    assert_eq!(outbox_ids.len(), 1);
    // The same batch again on a healthy connection is a bug upstream: refused, nothing written.
    assert!(store.commit(&mut batch()).is_err());
    // After a reconnect it is a retry whose first commit succeeded: accepted, nothing written,
    // and its CLS keeps its outbox id.
    store.reconnect().expect("reconnects");
    assert_eq!(store.commit(&mut batch()).expect("replays"), outbox_ids);
    let counts = store.row_counts().expect("counts");
    assert_eq!((counts.messages, counts.trades, counts.cls), (1, 1, 1));
    drop(store);
    // Opening again verifies the applied migrations' checksums and applies nothing twice.
    let mut reopened = PgStore::open(url).expect("reopens");
    assert_eq!(reopened.row_counts().expect("counts").messages, 1);
}

#[test]
fn a_first_status_that_meets_a_stored_one_is_written_over_it_with_the_rest_of_its_batch() {
    let databases = TempDatabases::create("first_status", 1);
    let url = &databases.urls()[0];
    let mut store = PgStore::open(url).expect("opens and migrates");
    store
        .commit(&mut one_message_batch("T1"))
        .expect("the trade's first status is loaded");
    // A matcher that released the trade and saw it again takes its next status for its first.
    let mut again = one_message_batch("T1");
    again.messages[0].msg_id = "B-T1-again".into();
    again.trades[0].status = TradeStatus::Matched;
    again.cls[0].cls_id = "CLS-B-T1-again".to_owned();
    again.trades.push(TradeRow {
        trade_key: "B/T2".to_owned(),
        ..again.trades[0].clone()
    });
    let outbox_ids = store
        .commit(&mut again)
        .expect("the batch commits: the stored status is updated");
    assert_eq!(outbox_ids.len(), 1);
    let mut connection = block_on(PgConnection::connect(url)).expect("connects");
    let statuses: Vec<(String, String)> = block_on(
        sqlx::query_as("SELECT trade_key, status FROM trades ORDER BY trade_key")
            .fetch_all(&mut connection),
    )
    .expect("reads the trades");
    assert_eq!(
        statuses,
        [
            ("B/T1".to_owned(), "MATCHED".to_owned()),
            ("B/T2".to_owned(), "MATCHED".to_owned())
        ]
    );
    assert_eq!(
        query_i64(&mut connection, "SELECT COUNT(*) FROM messages"),
        2
    );
    assert_eq!(
        query_i64(&mut connection, "SELECT COUNT(*) FROM cls_outbox"),
        2
    );
}

#[test]
fn a_batchs_cls_go_into_the_outbox_in_its_order_and_a_stored_one_is_refused() {
    let databases = TempDatabases::create("outbox", 1);
    let url = &databases.urls()[0];
    let mut store = PgStore::open(url).expect("opens and migrates");
    // CLS of three months in one batch, not in date order: the COPY routes each to its month's
    // partition, and the ids follow the batch's order, not the partitions'.
    let months = [
        time::macros::date!(2026 - 03 - 31),
        time::macros::date!(2026 - 01 - 02),
        time::macros::date!(2026 - 02 - 14),
    ];
    let cls = |n: usize| ClsRow {
        trade_date: months[n % 3],
        cls_id: format!("CLS-B-T{n}"),
        trade_key: format!("B/T{n}"),
        body: format!("<Cls n=\"{n}\">{}</Cls>", "é".repeat(n)),
    };
    let mut first = one_message_batch("T0");
    first.cls = (0..40).map(cls).collect();
    let first_ids = store.commit(&mut first).expect("commits the first batch");
    assert_eq!(first_ids.len(), 40);
    assert!(first_ids.windows(2).all(|pair| pair[0] < pair[1]));
    let mut second = one_message_batch("T1");
    second.cls = (40..45).map(cls).collect();
    let second_ids = store.commit(&mut second).expect("commits the second batch");
    assert!(
        second_ids[0] > first_ids[39],
        "a later batch's ids are above every earlier one"
    );
    let mut connection = block_on(PgConnection::connect(url)).expect("connects");
    let stored: Vec<(i64, time::Date, String, String, String)> = block_on(
        sqlx::query_as(
            "SELECT id, trade_date, cls_id, trade_key, body FROM cls_outbox ORDER BY id",
        )
        .fetch_all(&mut connection),
    )
    .expect("reads the outbox back");
    let expected: Vec<_> = first_ids
        .iter()
        .chain(&second_ids)
        .zip((0..45).map(cls))
        .map(|(&id, row)| (id, row.trade_date, row.cls_id, row.trade_key, row.body))
        .collect();
    assert_eq!(stored, expected);
    // A ClsId already in the outbox, in a batch of new messages: refused, and nothing of the
    // batch is written (the matcher emits a trade's CLS once, so this is a bug upstream).
    let mut again = one_message_batch("T2");
    again.cls = vec![cls(7)];
    assert!(store.commit(&mut again).is_err());
    let counts = store.row_counts().expect("counts");
    assert_eq!((counts.messages, counts.trades, counts.cls), (2, 2, 45));
}

#[test]
fn a_batch_larger_than_one_copy_chunk_is_stored_byte_for_byte() {
    let databases = TempDatabases::create("chunks", 1);
    let url = &databases.urls()[0];
    let mut store = PgStore::open(url).expect("opens and migrates");
    // 700 rows of 1 KiB each: the COPY goes out in several chunks of 256 KiB, and a row
    // straddles each boundary unless the encoder cuts between rows.
    let row = |n: usize| {
        let cancels = n.is_multiple_of(3);
        MessageRow {
            trade_date: time::macros::date!(2026 - 01 - 30),
            trade_key: format!("B/T{n}"),
            sender: "B".into(),
            msg_id: format!("B-{n}").into(),
            msg_type: "NOE",
            function: if cancels { "CAN" } else { "NEW" },
            related_id: cancels.then(|| format!("B-{}", n + 1).into()),
            injected_ns: n as u64,
            raw: (0..1024).map(|i| ((n * 31 + i * 7) % 251) as u8).collect(),
            received_on: time::macros::date!(2026 - 11 - 30),
        }
    };
    let mut big = Batch {
        messages: (0..700).map(row).collect(),
        ..Batch::default()
    };
    store.commit(&mut big).expect("commits the large batch");
    // The next batch reuses the encoder's buffer: nothing of the last one may leak into it.
    let mut small = Batch {
        messages: vec![row(700)],
        ..Batch::default()
    };
    store.commit(&mut small).expect("commits the small batch");
    let mut connection = block_on(PgConnection::connect(url)).expect("connects");
    let stored: Vec<(String, Option<String>, i64, Vec<u8>)> = block_on(
        sqlx::query_as("SELECT msg_id, related_id, injected_ns, raw FROM messages ORDER BY id")
            .fetch_all(&mut connection),
    )
    .expect("reads the rows back");
    assert_eq!(stored.len(), 701);
    for (n, (msg_id, related_id, injected_ns, raw)) in stored.into_iter().enumerate() {
        let expected = row(n);
        assert_eq!(msg_id, expected.msg_id.as_str());
        assert_eq!(related_id.as_deref(), expected.related_id.as_deref());
        assert_eq!(injected_ns as u64, expected.injected_ns);
        assert_eq!(raw, expected.raw, "row {n}'s bytes");
    }
}

#[test]
fn a_shard_refuses_the_commits_of_an_owner_with_an_older_lease_token() {
    let databases = TempDatabases::create("fence", 1);
    let url = &databases.urls()[0];
    let mut stalled = PgStore::open(url).expect("opens");
    stalled.fence(7).expect("the first owner fences the shard");
    stalled
        .commit(&mut one_message_batch("T1"))
        .expect("the owner commits");
    // Another node wins the shard with a newer token and fences it.
    let mut successor = PgStore::open(url).expect("opens");
    successor.fence(9).expect("the new owner fences the shard");
    let refused = stalled.commit(&mut one_message_batch("T2"));
    assert!(
        matches!(refused, Err(StoreError::Fenced { token: 7, .. })),
        "{refused:?}"
    );
    assert!(!stalled.is_transient(&refused.expect_err("refused")));
    successor
        .commit(&mut one_message_batch("T3"))
        .expect("the new owner commits");
    // Nothing of the refused batch is there; an older token cannot fence again either.
    assert_eq!(trade_keys(url).len(), 2);
    assert!(!trade_keys(url).contains(&"B/T2".to_owned()));
    assert!(matches!(stalled.fence(8), Err(StoreError::Fenced { .. })));
    // The same owner re-fencing with its own token (a restart of its writer) is accepted.
    successor.fence(9).expect("the owner's own token");
}

fn query_i64(connection: &mut PgConnection, sql: &str) -> i64 {
    block_on(sqlx::query_scalar(sqlx::AssertSqlSafe(sql)).fetch_one(&mut *connection)).expect(sql)
}

/// The months (YYYY-MM) of the partitions of `table`, read from their bounds.
fn partition_months(connection: &mut PgConnection, table: &str) -> Vec<String> {
    block_on(
        sqlx::query_scalar(
            r"SELECT (regexp_match(pg_get_expr(child.relpartbound, child.oid), '(\d{4}-\d{2})-01'))[1]
              FROM pg_inherits JOIN pg_class child ON child.oid = inhrelid
              WHERE inhparent = $1::regclass ORDER BY 1",
        )
        .bind(table)
        .fetch_all(&mut *connection),
    )
    .expect("partitions")
}

const TRADE_TABLES: [&str; 3] = ["messages", "trades", "cls_outbox"];

fn rows_from(connection: &mut PgConnection, from: &str) -> Vec<i64> {
    TRADE_TABLES
        .iter()
        .map(|table| {
            query_i64(
                connection,
                &format!("SELECT COUNT(*) FROM {table} WHERE trade_date >= '{from}'"),
            )
        })
        .collect()
}

#[test]
fn trades_are_kept_by_month_and_retention_drops_whole_months() {
    use time::macros::date;
    let databases = TempDatabases::create("retention", 1);
    let url = databases.urls()[0].clone();
    let trades = 300;
    let (report, _) = run_clean(vec![url.clone()], trades, false);
    assert_eq!(report.shards[0].matched, trades);
    let mut connection = block_on(PgConnection::connect(&url)).expect("connects");

    // Every message is stored under the TradeDate it carries (clean trades agree on it), in the
    // partition of its month, and no trade is split across dates.
    assert_eq!(
        query_i64(
            &mut connection,
            "SELECT COUNT(*) FROM messages WHERE trade_date <> \
             substring(convert_from(raw, 'UTF8') FROM '<TradeDate>([0-9-]{10})</TradeDate>')::date"
        ),
        0
    );
    assert_eq!(
        query_i64(
            &mut connection,
            "SELECT COUNT(*) FROM (SELECT trade_key FROM messages GROUP BY trade_key \
             HAVING COUNT(DISTINCT trade_date) > 1) split"
        ),
        0
    );
    assert_eq!(
        query_i64(
            &mut connection,
            "SELECT COUNT(*) FROM messages m JOIN pg_class p ON p.oid = m.tableoid \
             WHERE p.relname <> 'messages_p' || to_char(m.trade_date, 'YYYYMM')"
        ),
        0
    );
    let months: Vec<String> = block_on(
        sqlx::query_scalar(
            "SELECT DISTINCT to_char(trade_date, 'YYYY-MM') FROM messages ORDER BY 1",
        )
        .fetch_all(&mut connection),
    )
    .expect("months");
    assert!(
        months.len() >= 10,
        "trades spread over the year: {months:?}"
    );
    for table in TRADE_TABLES {
        assert_eq!(partition_months(&mut connection, table), months, "{table}");
    }

    // Keeping 61 days on 2026-11-30 puts the horizon at 2026-09-30: January to August have
    // expired. The sink has confirmed nothing, so every expired month still holds an
    // undelivered CLS and stays.
    let today = date!(2026 - 11 - 30);
    let (expired, remaining): (Vec<String>, Vec<String>) =
        months.iter().cloned().partition(|m| m.as_str() < "2026-09");
    let mut store = PgStore::open(&url).expect("opens");
    let before = store.row_counts().expect("counts");
    let report = store.purge(today, 61).expect("purges");
    assert!(report.dropped.is_empty(), "{report:?}");
    let kept: Vec<String> = report
        .kept_undelivered
        .iter()
        .map(Month::to_string)
        .collect();
    assert_eq!(kept, expired);
    assert_eq!(store.row_counts().expect("counts"), before);

    // Once every CLS is confirmed, the expired months go, whole, and nothing else does.
    let kept_before = rows_from(&mut connection, "2026-09-01");
    block_on(
        sqlx::query(
            "INSERT INTO cls_delivery (id, delivered_through) SELECT 1, MAX(id) FROM cls_outbox \
             ON CONFLICT (id) DO UPDATE SET delivered_through = excluded.delivered_through",
        )
        .execute(&mut connection),
    )
    .expect("confirms");
    let report = store.purge(today, 61).expect("purges");
    assert!(report.kept_undelivered.is_empty());
    assert_eq!(report.dropped.len(), expired.len() * 3, "{report:?}");
    for table in TRADE_TABLES {
        assert_eq!(
            partition_months(&mut connection, table),
            remaining,
            "{table}"
        );
    }
    assert_eq!(rows_from(&mut connection, "0001-01-01"), kept_before);
    assert_eq!(rows_from(&mut connection, "2026-09-01"), kept_before);
    // A second purge finds nothing more to drop.
    assert_eq!(store.purge(today, 61).expect("purges"), Default::default());

    // Writing into a dropped month creates its partition again.
    let mut batch = Batch {
        messages: vec![MessageRow {
            trade_date: date!(2026 - 02 - 10),
            trade_key: "B/LATE".to_owned(),
            sender: "B".into(),
            msg_id: "B-LATE".into(),
            msg_type: "NOE",
            function: "NEW",
            related_id: None,
            injected_ns: 1,
            raw: b"<Msg/>".to_vec(),
            received_on: time::macros::date!(2026 - 11 - 30),
        }],
        ..Batch::default()
    };
    store.commit(&mut batch).expect("commits");
    assert!(partition_months(&mut connection, "messages").contains(&"2026-02".to_owned()));
    drop(store);
    block_on(sqlx::query("DELETE FROM messages WHERE msg_id = 'B-LATE'").execute(&mut connection))
        .expect("deletes");

    // A restart rebuilds the matcher from what retention left.
    let left = query_i64(&mut connection, "SELECT COUNT(*) FROM messages");
    let (report, _) = run_clean(vec![url], 0, true);
    assert_eq!(report.shards[0].messages as i64, left);
    assert_eq!(report.shards[0].matched as i64, kept_before[2]);
}

#[test]
fn two_writers_creating_the_same_partition_at_once_both_commit() {
    use ste_engine::reason::ReasonCode;
    use ste_engine::store::ExceptionRow;
    let databases = TempDatabases::create("partition_race", 1);
    let url = databases.urls()[0].clone();
    // Shard 0's writer and the exceptions writer share `exceptions`: both may be first to write
    // into a new month. Twenty new months, two writers released together into each.
    let months = 20;
    let barrier = Arc::new(std::sync::Barrier::new(2));
    let writers: Vec<_> = (0..2)
        .map(|writer| {
            let url = url.clone();
            let barrier = barrier.clone();
            std::thread::spawn(move || {
                let mut store = PgStore::open(&url).expect("opens");
                let mut failures = Vec::new();
                for month in 0..months {
                    let day = time::Date::from_calendar_date(
                        2030 + month / 12,
                        time::Month::try_from(1 + (month % 12) as u8).expect("month"),
                        15,
                    )
                    .expect("date");
                    let mut batch = Batch {
                        exceptions: vec![ExceptionRow {
                            received_on: day,
                            trade_key: None,
                            sender: None,
                            msg_id: Some(format!("W{writer}-{month}")),
                            code: ReasonCode::Parse,
                            detail: "race".to_owned(),
                            raw: vec![1],
                        }],
                        ..Batch::default()
                    };
                    barrier.wait();
                    // A failure is recorded, not raised: the other writer must not wait at the
                    // barrier for a thread that is gone.
                    if let Err(error) = store.commit(&mut batch) {
                        failures.push(format!("month {month}: {error:?}"));
                    }
                }
                failures
            })
        })
        .collect();
    let failures: Vec<String> = writers
        .into_iter()
        .flat_map(|writer| writer.join().expect("the writer finishes"))
        .collect();
    assert!(failures.is_empty(), "{failures:#?}");
    let mut connection = block_on(PgConnection::connect(&url)).expect("connects");
    assert_eq!(
        query_i64(&mut connection, "SELECT COUNT(*) FROM exceptions"),
        2 * i64::from(months)
    );
    assert_eq!(
        partition_months(&mut connection, "exceptions").len(),
        months as usize
    );
}

#[test]
fn counting_a_shards_rows_never_deadlocks_with_a_writer_making_partitions() {
    let databases = TempDatabases::create("count_locks", 1);
    let url = databases.urls()[0].clone();
    let mut store = PgStore::open(&url).expect("opens");
    // Another session of the shard's database, as a writer whose batch opens new months: it
    // makes a partition of `trades`, which locks `trades` until it commits.
    let mut writer = block_on(PgConnection::connect(&url)).expect("connects");
    block_on(
        sqlx::raw_sql("BEGIN; SELECT ste_create_partition('trades', '2031-01-01');")
            .execute(&mut writer),
    )
    .expect("the writer makes a partition of trades");
    // The count waits for `trades`.
    let counter = std::thread::spawn(move || store.row_counts());
    let mut watcher = block_on(PgConnection::connect(&url)).expect("connects");
    let mut waiting = || {
        query_i64(
            &mut watcher,
            "SELECT COUNT(*) FROM pg_locks WHERE NOT granted \
             AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        )
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while waiting() == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the count never waited for the writer"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    // Then the writer makes a partition of `messages`. A count that still held `messages`
    // while it waited for `trades` made a cycle here, and PostgreSQL failed one of the two.
    block_on(
        sqlx::raw_sql("SELECT ste_create_partition('messages', '2031-02-01'); COMMIT;")
            .execute(&mut writer),
    )
    .expect("the writer makes a partition of messages and commits");
    let counts = counter
        .join()
        .expect("the count finishes")
        .expect("the count succeeds");
    assert_eq!(
        counts.messages + counts.trades + counts.cls + counts.exceptions,
        0
    );
    assert!(partition_months(&mut watcher, "messages").contains(&"2031-02".to_owned()));
}

#[test]
fn exceptions_of_unchecked_input_go_after_their_days_and_remembered_ones_stay() {
    use ste_engine::reason::ReasonCode;
    use ste_engine::store::{Batch, ExceptionRow, PgStore, Store};
    let databases = TempDatabases::create("unchecked", 1);
    let mut store = PgStore::open(&databases.urls()[0]).expect("opens");
    let today = time::OffsetDateTime::now_utc().date();
    let old = today - time::Duration::days(40);
    let row = |received_on, msg_id: Option<&str>, code| ExceptionRow {
        received_on,
        trade_key: None,
        sender: msg_id.map(|_| "BRKAAU21XXX".to_owned()),
        msg_id: msg_id.map(str::to_owned),
        code,
        detail: "test".to_owned(),
        raw: b"<Msg/>".to_vec(),
    };
    let mut batch = Batch {
        exceptions: vec![
            row(old, None, ReasonCode::Sig),
            row(today, None, ReasonCode::Parse),
            row(old, Some("M-1"), ReasonCode::Field),
        ],
        ..Batch::default()
    };
    store.commit(&mut batch).expect("commits");
    let before = today - time::Duration::days(30);
    assert_eq!(store.purge_unchecked_exceptions(before).expect("purges"), 1);
    // Today's unchecked row, and the old one whose MsgId it spent, stay.
    assert_eq!(store.row_counts().expect("counts").exceptions, 2);
    assert_eq!(store.purge_unchecked_exceptions(before).expect("purges"), 0);
}

/// `url` with `role` as its user (and no password).
fn as_role(url: &str, role: &str) -> String {
    let authority = url.find("://").map_or(0, |scheme| scheme + 3);
    let end = url[authority..]
        .find(['/', '?'])
        .map_or(url.len(), |at| authority + at);
    let host = url[authority..end]
        .rsplit_once('@')
        .map_or(&url[authority..end], |(_, host)| host);
    format!("{}{role}@{host}{}", &url[..authority], &url[end..])
}

/// A process that has just closed its connections leaves their sessions on the server for a
/// moment, and the role that drops the database (its owner, no superuser) may not end another
/// role's sessions: the drop waits for them instead of failing, as a sweep's next level once
/// did right after its nodes stopped.
#[test]
fn a_database_is_dropped_once_another_roles_session_on_it_ends() {
    let admin = common::admin_url();
    let pid = std::process::id();
    let (dropper, other, name) = (
        format!("ste_test_dropper_{pid}"),
        format!("ste_test_other_{pid}"),
        format!("ste_test_linger_{pid}"),
    );
    // One statement at a time: DROP and CREATE DATABASE run outside a transaction only.
    let run = |statements: &[String]| {
        block_on(async {
            let mut connection = PgConnection::connect(&admin).await?;
            for statement in statements {
                sqlx::raw_sql(sqlx::AssertSqlSafe(statement.clone()))
                    .execute(&mut connection)
                    .await?;
            }
            connection.close().await
        })
        .expect("the administrative connection runs it")
    };
    let cleanup = [
        format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"),
        format!("DROP ROLE IF EXISTS {dropper}"),
        format!("DROP ROLE IF EXISTS {other}"),
    ];
    run(&cleanup);
    run(&[
        format!("CREATE ROLE {dropper} LOGIN CREATEDB"),
        format!("CREATE ROLE {other} LOGIN"),
        format!("CREATE DATABASE {name} OWNER {dropper}"),
    ]);
    let other_url = PgStore::url_of_database(&as_role(&admin, &other), &name);
    let session = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(async {
            let connection = PgConnection::connect(&other_url)
                .await
                .expect("the other role connects");
            tokio::time::sleep(std::time::Duration::from_millis(700)).await;
            drop(connection);
        });
    });
    // The other role's session is on the database while the drop starts.
    let dropper_url = as_role(&admin, &dropper);
    let count_sessions = || {
        block_on(async {
            let mut connection = PgConnection::connect(&admin).await?;
            let count: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND usename = $2",
            )
            .bind(&name)
            .bind(&other)
            .fetch_one(&mut connection)
            .await?;
            connection.close().await?;
            Ok::<_, sqlx::Error>(count)
        })
        .expect("reads the sessions")
    };
    let started = std::time::Instant::now();
    while count_sessions() == 0 {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(5),
            "the other role's session never appeared"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let dropped = PgStore::recreate_database(&dropper_url, &name, false);
    session.join().expect("the session's thread");
    let left: i64 = block_on(async {
        let mut connection = PgConnection::connect(&admin).await?;
        sqlx::query_scalar("SELECT count(*) FROM pg_database WHERE datname = $1")
            .bind(&name)
            .fetch_one(&mut connection)
            .await
    })
    .expect("reads the databases");
    run(&cleanup);
    dropped.expect("the drop waits for the other role's session and succeeds");
    assert_eq!(left, 0, "the database is gone");
}
