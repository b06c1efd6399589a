//! What the engine's integration tests share: a `nats-server` of a test's own, and temporary
//! PostgreSQL databases on the server `DATABASE_URL` names.
#![allow(dead_code)]

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ste_engine::store::PgStore;

/// A `nats-server -js` of the test's own, killed when dropped.
pub struct NatsServer {
    child: Child,
    pub url: String,
    port: u16,
    store: tempfile::TempDir,
}

/// How often a server is started on a fresh port when the one it was given is taken by
/// another process between the probe and the server's own bind.
const START_ATTEMPTS: usize = 5;

impl NatsServer {
    pub fn start() -> Self {
        let store = tempfile::tempdir().expect("a store folder");
        let (child, port) = Self::spawn_retrying(store.path(), || {
            ste_engine::ports::free_local_port().expect("a free port")
        });
        Self {
            child,
            url: format!("nats://127.0.0.1:{port}"),
            port,
            store,
        }
    }

    /// [`Self::spawn`] on the port `port` gives, up to [`START_ATTEMPTS`] times.
    fn spawn_retrying(store: &std::path::Path, mut port: impl FnMut() -> u16) -> (Child, u16) {
        let mut failures = Vec::new();
        for _ in 0..START_ATTEMPTS {
            let port = port();
            match Self::spawn(port, store) {
                Ok(child) => return (child, port),
                Err(why) => failures.push(why),
            }
        }
        panic!("nats-server did not start: {failures:#?}");
    }

    /// Starts `nats-server` on `port` and waits until that very server answers there: its
    /// greeting names it. A listener of another process on the port (one that took it after
    /// the probe) is not taken for it; a server that exits (the port taken) is reported with
    /// the end of its log.
    fn spawn(port: u16, store: &std::path::Path) -> Result<Child, String> {
        let name = format!("ste-test-{}-{port}", std::process::id());
        let log = store.join("nats-server.log");
        let mut child = Command::new("nats-server")
            .args([
                "-js",
                "-a",
                "127.0.0.1",
                "-p",
                &port.to_string(),
                "-n",
                &name,
            ])
            .arg("-sd")
            .arg(store)
            .arg("-l")
            .arg(&log)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("nats-server starts (Debian's nats-server package)");
        let started = Instant::now();
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                let log = std::fs::read_to_string(&log).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(5).collect();
                return Err(format!(
                    "port {port}: nats-server exited ({status}): {tail:?}"
                ));
            }
            if greets_as(port, &name) {
                return Ok(child);
            }
            if started.elapsed() > Duration::from_secs(10) {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "port {port}: nats-server {name} did not answer within 10 s"
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Stops the server (SIGTERM, as an operator would) and starts it again on the same port
    /// and store.
    pub fn restart(&mut self) {
        self.stop();
        let port = self.port;
        self.child = Self::spawn_retrying(self.store.path(), || port).0;
    }

    /// Stops the server (SIGTERM) and waits until it has gone.
    pub fn stop(&mut self) {
        let _ = Command::new("kill")
            .arg(self.child.id().to_string())
            .status();
        let _ = self.child.wait();
    }
}

/// Whether the server on `port` greets a client as the server named `name` (NATS's `INFO`
/// line carries its `server_name`).
fn greets_as(port: u16, name: &str) -> bool {
    use std::io::{BufRead, BufReader, Read};
    let Ok(stream) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    if stream
        .set_read_timeout(Some(Duration::from_secs(1)))
        .is_err()
    {
        return false;
    }
    let mut greeting = String::new();
    let read = BufReader::new(stream.take(64 * 1024)).read_line(&mut greeting);
    read.is_ok()
        && greeting.starts_with("INFO ")
        && greeting.contains(&format!("\"server_name\":\"{name}\""))
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn admin_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned())
}

/// Runs `future` on the tests' one runtime, so that a connection outlives a call.
pub fn block_on<T>(future: impl std::future::Future<Output = T>) -> T {
    static RUNTIME: std::sync::OnceLock<tokio::runtime::Runtime> = std::sync::OnceLock::new();
    RUNTIME
        .get_or_init(|| {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime")
        })
        .block_on(future)
}

/// Databases created for one test, dropped when it ends.
pub struct TempDatabases {
    names: Vec<String>,
}

impl TempDatabases {
    pub fn create(label: &str, count: usize) -> Self {
        let names: Vec<String> = (0..count)
            .map(|index| format!("ste_test_{label}_{}_{index}", std::process::id()))
            .collect();
        for name in &names {
            PgStore::recreate_database(&admin_url(), name, true)
                .expect("DATABASE_URL reaches a PostgreSQL server");
        }
        Self { names }
    }

    pub fn urls(&self) -> Vec<String> {
        self.names
            .iter()
            .map(|name| PgStore::url_of_database(&admin_url(), name))
            .collect()
    }
}

impl Drop for TempDatabases {
    fn drop(&mut self) {
        for name in &self.names {
            let _ = PgStore::recreate_database(&admin_url(), name, false);
        }
    }
}

/// The commit rate (messages per second) of the stations whose names end with one of
/// `store_stations` (`store.0`, or `n1/store.0` on a node), between `from_ms` and `to_ms` of a
/// run's `samples.csv`: completions summed over stations (each station's latest reading at or
/// before each instant), divided by the time between.
pub fn commit_rate(samples_csv: &str, store_stations: &[String], from_ms: f64, to_ms: f64) -> f64 {
    let completed_at = |instant_ms: f64| -> u64 {
        let mut latest: std::collections::BTreeMap<&str, u64> = Default::default();
        for line in samples_csv.lines().skip(1) {
            let columns: Vec<&str> = line.split(',').collect();
            let (Some(t), Some(station), Some(completions)) =
                (columns.first(), columns.get(1), columns.get(4))
            else {
                continue;
            };
            let (Ok(t), Ok(completions)) = (t.parse::<f64>(), completions.parse::<u64>()) else {
                continue;
            };
            let base = station.split('#').next().unwrap_or(station);
            let wanted = store_stations
                .iter()
                .any(|name| base == name || base.ends_with(&format!("/{name}")));
            if wanted && t <= instant_ms {
                // A station's incarnations (`#1`, …) add up: each counts from zero.
                latest.insert(station, completions);
            }
        }
        latest.values().sum()
    };
    let committed = completed_at(to_ms).saturating_sub(completed_at(from_ms));
    committed as f64 / ((to_ms - from_ms) / 1e3).max(1e-9)
}

/// Submits `lines` to `pipeline`, numbered in order, and flushes what is buffered.
pub fn submit_all(
    pipeline: &ste_engine::pipeline::Pipeline,
    refdata: &ste_engine::refdata::RefData,
    lines: impl IntoIterator<Item = Vec<u8>>,
) {
    let mut submitter = pipeline.submitter();
    for (index, line) in lines.into_iter().enumerate() {
        submitter
            .submit_line(refdata, line, index as u64)
            .expect("submits");
    }
    submitter.flush().expect("flushes");
}

/// A shuffled fault mix of `trades` trades drawn from `seed`, and the outcome it must produce.
pub fn fault_mix(
    refdata: &ste_engine::refdata::RefData,
    trades: u64,
    seed: u64,
) -> (Vec<Vec<u8>>, ste_engine::generator::RunOutcome) {
    let mut generator = ste_engine::generator::Generator::new(
        refdata,
        ste_engine::generator::GeneratorConfig {
            trades,
            seed,
            fault_rate: 0.3,
            shuffle: true,
            run: String::new(),
        },
    );
    let lines = generator.by_ref().collect();
    (lines, generator.expected().clone())
}

/// A bounded matcher's memory so small that nearly every message needs what it retired read
/// back: generations of 32 entries, and a filter of 1 KiB (saturated after a few hundred keys).
pub fn tiny_matcher_memory() -> ste_engine::matcher::MatcherMemory {
    ste_engine::matcher::MatcherMemory {
        generation_entries: 32,
        filter_bytes: 1024,
        ..Default::default()
    }
}

/// Counts answers as the generator counts what it expects.
pub fn outcome_of<'a>(
    results: impl IntoIterator<Item = &'a ste_engine::pipeline::AckResult>,
) -> ste_engine::generator::RunOutcome {
    use ste_engine::pipeline::AckResult;
    let mut outcome = ste_engine::generator::RunOutcome::default();
    for result in results {
        outcome.messages_in += 1;
        match result {
            AckResult::Accepted => outcome.accepted += 1,
            AckResult::Duplicate => outcome.duplicates += 1,
            AckResult::Rejected(code) => {
                *outcome
                    .exceptions
                    .entry(code.as_str().to_owned())
                    .or_default() += 1
            }
        }
    }
    outcome
}
