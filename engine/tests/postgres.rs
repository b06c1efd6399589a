//! The PostgreSQL store against a real server: `DATABASE_URL` names an administrative
//! connection (default: the local server, user postgres); each test creates its own databases
//! and drops them afterwards.

use std::sync::Arc;

use sqlx::{Connection, PgConnection};
use ste_engine::generator::{Generator, GeneratorConfig};
use ste_engine::matcher::TradeStatus;
use ste_engine::pipeline::{AckResult, Pipeline, PipelineConfig, StoreConfig};
use ste_engine::profile::Tolerances;
use ste_engine::refdata::RefData;
use ste_engine::routing::shard_of;
use ste_engine::store::{Batch, MessageRow, PgStore, Store, TradeRow};

fn admin_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned())
}

/// `url` with its database replaced by `database`.
fn url_of(url: &str, database: &str) -> String {
    let (base, _) = url.rsplit_once('/').expect("a URL with a database");
    format!("{base}/{database}")
}

fn block_on<T>(future: impl std::future::Future<Output = T>) -> T {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
        .block_on(future)
}

/// Databases created for one test, dropped when it ends.
struct TempDatabases {
    names: Vec<String>,
}

impl TempDatabases {
    fn create(label: &str, count: usize) -> Self {
        let names: Vec<String> = (0..count)
            .map(|index| format!("ste_test_{label}_{}_{index}", std::process::id()))
            .collect();
        block_on(async {
            let mut admin = PgConnection::connect(&admin_url())
                .await
                .expect("DATABASE_URL reaches a PostgreSQL server");
            for name in &names {
                sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                    .execute(&mut admin)
                    .await
                    .expect("drop");
                sqlx::query(&format!("CREATE DATABASE {name}"))
                    .execute(&mut admin)
                    .await
                    .expect("create");
            }
        });
        Self { names }
    }

    fn urls(&self) -> Vec<String> {
        self.names
            .iter()
            .map(|name| url_of(&admin_url(), name))
            .collect()
    }
}

impl Drop for TempDatabases {
    fn drop(&mut self) {
        block_on(async {
            if let Ok(mut admin) = PgConnection::connect(&admin_url()).await {
                for name in &self.names {
                    let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                        .execute(&mut admin)
                        .await;
                }
            }
        });
    }
}

fn trade_keys(url: &str) -> Vec<String> {
    block_on(async {
        let mut connection = PgConnection::connect(url).await.expect("connects");
        sqlx::query_scalar("SELECT DISTINCT trade_key FROM messages")
            .fetch_all(&mut connection)
            .await
            .expect("query")
    })
}

#[test]
fn trades_land_on_the_shard_the_routing_rule_names() {
    let databases = TempDatabases::create("routing", 3);
    let refdata = Arc::new(RefData::embedded().expect("reference data"));
    let config = PipelineConfig {
        shards: 3,
        store: StoreConfig::Postgres {
            urls: databases.urls(),
        },
        ..PipelineConfig::default()
    };
    let pipeline =
        Pipeline::start(&config, refdata.clone(), Tolerances::default()).expect("starts");
    let acks = pipeline.acks();
    let mut submitter = pipeline.submitter();
    let trades = 400;
    for (index, line) in Generator::new(&refdata, GeneratorConfig::clean(trades)).enumerate() {
        submitter
            .submit_line(&refdata, line, index as u64)
            .expect("submits");
    }
    submitter.flush().expect("flushes");
    drop(submitter);
    let report = pipeline.finish().expect("finishes");
    let results: Vec<AckResult> = acks.try_iter().flatten().map(|ack| ack.result).collect();
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

#[test]
fn a_replayed_batch_changes_nothing() {
    let databases = TempDatabases::create("replay", 1);
    let url = &databases.urls()[0];
    let mut store = PgStore::open(url).expect("opens and migrates");
    let batch = || Batch {
        messages: vec![MessageRow {
            trade_key: "B/T1".to_owned(),
            sender: "B".to_owned(),
            msg_id: "B-1".to_owned(),
            msg_type: "NOE",
            function: "NEW",
            related_id: None,
            injected_ns: 1,
            raw: b"<Msg/>".to_vec(),
        }],
        trades: vec![TradeRow {
            trade_key: "B/T1".to_owned(),
            status: TradeStatus::Pending,
        }],
        ..Batch::default()
    };
    store.commit(&mut batch()).expect("commits");
    // The same batch again on a healthy connection is a bug upstream: refused, nothing written.
    assert!(store.commit(&mut batch()).is_err());
    // After a reconnect it is a retry whose first commit succeeded: accepted, nothing written.
    store.reconnect().expect("reconnects");
    store.commit(&mut batch()).expect("replays");
    let counts = store.row_counts().expect("counts");
    assert_eq!((counts.messages, counts.trades), (1, 1));
    drop(store);
    // Opening again verifies the applied migrations' checksums and applies nothing twice.
    let mut reopened = PgStore::open(url).expect("reopens");
    assert_eq!(reopened.row_counts().expect("counts").messages, 1);
}
