//! Kill and restart: the driver (the whole engine in one process) is killed with SIGKILL at
//! several points of a 20,000-trade run and resumed each time; at the end every trade has exactly
//! one CLS at the sink, every accepted message is stored once, and the conservation law holds.

use std::collections::HashSet;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use sqlx::{Connection, SqliteConnection};
use ste_engine::store::PgStore;

const TRADES: u64 = 20_000;
/// At least this many runs must still be going when they are killed.
const KILLS_MIN: usize = 5;

fn driver() -> Command {
    Command::new(env!("CARGO_BIN_EXE_driver"))
}

fn count(database: &Path, query: &'static str) -> i64 {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime")
        .block_on(async {
            let url = format!("sqlite://{}?mode=ro", database.display());
            let mut connection = SqliteConnection::connect(&url).await.expect("opens");
            sqlx::query_scalar(query)
                .fetch_one(&mut connection)
                .await
                .expect("query")
        })
}

/// Generates the set, kills the driver `delays_ms.len()` times at those delays after each start,
/// resumes it to the end, and checks the sink's CLS file. Returns the final summary.
fn kill_and_resume(dir: &Path, store_args: &[String], delays_ms: &[u64]) -> serde_json::Value {
    let set = dir.join("set.xml");
    let status = driver()
        .args([
            "generate",
            "--trades",
            &TRADES.to_string(),
            "--shuffle",
            "--out",
        ])
        .arg(&set)
        .stderr(Stdio::null())
        .status()
        .expect("driver runs");
    assert!(status.success());
    let run_dir = dir.join("run");
    let cls_out = dir.join("cls.xml");
    let args = |extra: &[&str]| -> Vec<String> {
        let mut args: Vec<String> = vec![
            "--input".into(),
            set.display().to_string(),
            "--run-dir".into(),
            run_dir.display().to_string(),
            "--cls-out".into(),
            cls_out.display().to_string(),
            "--resume".into(),
            "--quiet".into(),
        ];
        args.extend(store_args.iter().cloned());
        args.extend(extra.iter().map(|s| (*s).to_owned()));
        args
    };
    let mut killed = 0;
    for delay in delays_ms {
        let mut child = driver()
            .args(args(&[]))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("driver starts");
        std::thread::sleep(Duration::from_millis(*delay));
        if child.try_wait().expect("status").is_none() {
            child.kill().expect("SIGKILL");
            killed += 1;
        }
        let _ = child.wait();
    }
    assert!(
        killed >= KILLS_MIN,
        "only {killed} runs were still going when killed"
    );

    let output = driver()
        .args(args(&["--json"]))
        .output()
        .expect("driver runs");
    assert!(
        output.status.success(),
        "final run failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let summary: serde_json::Value = serde_json::from_slice(&output.stdout).expect("json");
    assert_eq!(summary["conserved"], true);
    assert_eq!(summary["messages_in"], TRADES * 7);

    // Exactly one CLS per trade at the sink.
    let text = std::fs::read_to_string(&cls_out).expect("cls file");
    let ids: Vec<&str> = text
        .lines()
        .map(|line| {
            let start = line.find("<ClsId>").expect("a ClsId") + "<ClsId>".len();
            let end = line.find("</ClsId>").expect("closed");
            &line[start..end]
        })
        .collect();
    let distinct: HashSet<&str> = ids.iter().copied().collect();
    assert_eq!(ids.len(), distinct.len(), "a CLS reached the sink twice");
    assert_eq!(distinct.len() as u64, TRADES);
    summary
}

#[test]
fn killed_at_random_points_and_resumed_every_trade_has_one_cls() {
    let dir = tempfile::tempdir().expect("temporary folder");
    // Kill points spread over the run, from start-up (migrations, recovery) to the end.
    kill_and_resume(dir.path(), &[], &[150, 400, 700, 1000, 1300, 1700]);

    // Every accepted message stored once, across the shards.
    let run_dir = dir.path().join("run");
    let mut stored = 0;
    for shard in 0..2 {
        let database = run_dir.join(format!("store/shard-{shard}.sqlite"));
        stored += count(&database, "SELECT COUNT(*) FROM messages");
        let repeated = count(
            &database,
            "SELECT COUNT(*) FROM (SELECT sender, msg_id FROM messages GROUP BY sender, msg_id HAVING COUNT(*) > 1)",
        );
        assert_eq!(repeated, 0, "shard {shard} stored a message twice");
        let outbox = count(&database, "SELECT COUNT(*) FROM cls_outbox");
        let matched = count(
            &database,
            "SELECT COUNT(*) FROM trades WHERE status = 'MATCHED'",
        );
        assert_eq!(outbox, matched);
    }
    assert_eq!(stored as u64, TRADES * 7);
}

fn admin_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned())
}

fn pg<T>(url: &str, work: impl AsyncFnOnce(&mut sqlx::PgConnection) -> T) -> T {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
        .block_on(async {
            let mut connection = sqlx::PgConnection::connect(url).await.expect("connects");
            work(&mut connection).await
        })
}

#[test]
fn killed_and_resumed_on_postgres_shards() {
    let dir = tempfile::tempdir().expect("temporary folder");
    let admin = admin_url();
    let names: Vec<String> = (0..2)
        .map(|shard| format!("ste_test_kill_{}_{shard}", std::process::id()))
        .collect();
    let urls: Vec<String> = names
        .iter()
        .map(|name| PgStore::recreate_database(&admin, name, true).expect("creates a database"))
        .collect();
    let store_args: Vec<String> = ["--store", "postgres", "--db", &urls[0], "--db", &urls[1]]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
    kill_and_resume(dir.path(), &store_args, &[300, 900, 1500, 2100, 2700, 3300]);
    let mut stored = 0;
    for url in &urls {
        stored += pg(url, async |connection| -> i64 {
            sqlx::query_scalar("SELECT COUNT(*) FROM messages")
                .fetch_one(&mut *connection)
                .await
                .expect("count")
        });
        // The (sender, msg_id) key makes a message impossible to store twice; the outbox holds
        // one CLS per matched trade.
        let (outbox, matched): (i64, i64) = pg(url, async |connection| {
            sqlx::query_as(
                "SELECT (SELECT COUNT(*) FROM cls_outbox), (SELECT COUNT(*) FROM trades WHERE status = 'MATCHED')",
            )
            .fetch_one(&mut *connection)
            .await
            .expect("counts")
        });
        assert_eq!(outbox, matched);
    }
    assert_eq!(stored as u64, TRADES * 7);
    for name in &names {
        let _ = PgStore::recreate_database(&admin, name, false);
    }
}
