//! The dashboard: a small HTTP server on localhost over one run (or sweep) directory.
//!
//! - `/` — the live page: the report of [`crate::report`], refreshed every two seconds while
//!   the run writes its samples;
//! - `/report` — the same page without the refresh;
//! - `/metrics` — the stations' counters in Prometheus' text exposition format;
//! - `/api/stations` — the operational metrics as JSON.
//!
//! Requests are few and small: one thread serves them, each reading the directory afresh.
//!
//! It listens on loopback unless told otherwise; off loopback it requires a token, which every
//! request must carry (`Authorization: Bearer <token>`, or `?token=<token>` for a browser), and
//! answers 401 to one that does not.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tiny_http::{Header, Response, Server};

use crate::{analyze, read_samples, Sample};

/// Seconds between two refreshes of the live page.
pub const REFRESH_S: u32 = 2;

/// Why the dashboard could not start.
#[derive(Debug, thiserror::Error)]
#[error("cannot listen on {address}: {reason}")]
pub struct ServeError {
    address: String,
    reason: String,
}

/// A running dashboard; dropping it stops the server.
pub struct Dashboard {
    address: std::net::SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Dashboard {
    /// Starts serving `dir` on `address` (e.g. `127.0.0.1:8686`; port 0 picks a free one), a
    /// loopback address.
    pub fn start(dir: &Path, address: &str) -> Result<Self, ServeError> {
        Self::start_with_token(dir, address, None)
    }

    /// Starts serving `dir` on `address`; with `token`, only to requests that carry it, which
    /// an address off loopback requires.
    pub fn start_with_token(
        dir: &Path,
        address: &str,
        token: Option<String>,
    ) -> Result<Self, ServeError> {
        let error = |reason: String| ServeError {
            address: address.to_owned(),
            reason,
        };
        if token
            .as_deref()
            .is_some_and(|token| token.len() < TOKEN_MIN_BYTES)
        {
            return Err(error(format!(
                "a token of {TOKEN_MIN_BYTES} characters at least"
            )));
        }
        let server = Server::http(address).map_err(|e| error(e.to_string()))?;
        let bound = server
            .server_addr()
            .to_ip()
            .ok_or_else(|| error("not an IP address".to_owned()))?;
        if !bound.ip().is_loopback() && token.is_none() {
            return Err(error(
                "off loopback the dashboard requires a token (monitor serve --token-file FILE)"
                    .to_owned(),
            ));
        }
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let stop = stop.clone();
            let dir = dir.to_path_buf();
            std::thread::Builder::new()
                .name("dashboard".to_owned())
                .spawn(move || serve_until(&server, &dir, &stop, token.as_deref()))
                .map_err(|e| error(e.to_string()))?
        };
        Ok(Self {
            address: bound,
            stop,
            thread: Some(thread),
        })
    }

    /// The address it listens on.
    pub fn address(&self) -> std::net::SocketAddr {
        self.address
    }

    /// Serves until the process ends.
    pub fn wait(mut self) {
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for Dashboard {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The shortest token a dashboard takes.
pub const TOKEN_MIN_BYTES: usize = 16;

/// Whether `request` carries `token` (in constant time over the token's length).
fn authorized(request: &tiny_http::Request, token: &str) -> bool {
    let bearer = request
        .headers()
        .iter()
        .find(|header| header.field.equiv("Authorization"))
        .and_then(|header| header.value.as_str().strip_prefix("Bearer "));
    let query = request.url().split_once('?').and_then(|(_, query)| {
        query
            .split('&')
            .find_map(|pair| pair.strip_prefix("token="))
    });
    let same = |given: &str| {
        given.len() == token.len()
            && given
                .bytes()
                .zip(token.bytes())
                .fold(0u8, |diff, (a, b)| diff | (a ^ b))
                == 0
    };
    bearer.is_some_and(same) || query.is_some_and(same)
}

fn serve_until(server: &Server, dir: &Path, stop: &AtomicBool, token: Option<&str>) {
    while !stop.load(Ordering::Relaxed) {
        let request = match server.recv_timeout(Duration::from_millis(100)) {
            Ok(Some(request)) => request,
            Ok(None) => continue,
            Err(error) => {
                tracing::warn!(%error, "dashboard: receiving a request failed");
                continue;
            }
        };
        let path = request.url().split('?').next().unwrap_or("/").to_owned();
        let response = match token {
            Some(token) if !authorized(&request, token) => {
                Response::from_data(b"a token is required\n".to_vec())
                    .with_status_code(401)
                    .with_header(header("WWW-Authenticate", "Bearer"))
                    .with_header(header("Content-Type", "text/plain; charset=utf-8"))
            }
            _ => respond(dir, &path),
        };
        if let Err(error) = request.respond(response) {
            tracing::debug!(%error, "dashboard: the client went away");
        }
    }
}

fn header(name: &str, value: &str) -> Header {
    Header::from_bytes(name.as_bytes(), value.as_bytes())
        .unwrap_or_else(|()| Header::from_bytes(&b"X-Invalid"[..], &b"1"[..]).expect("static"))
}

fn respond(dir: &Path, path: &str) -> Response<std::io::Cursor<Vec<u8>>> {
    let (status, content_type, body) = match path {
        "/" => page(dir, Some(REFRESH_S)),
        "/report" => page(dir, None),
        "/metrics" => match samples(dir) {
            Ok(samples) => (
                200,
                "text/plain; version=0.0.4; charset=utf-8",
                prometheus(&samples),
            ),
            Err(error) => (503, "text/plain; charset=utf-8", error),
        },
        "/api/stations" => match samples(dir) {
            Ok(samples) => (
                200,
                "application/json",
                serde_json::to_string(&analyze(&samples)).unwrap_or_else(|_| "[]".to_owned()),
            ),
            Err(error) => (503, "text/plain; charset=utf-8", error),
        },
        _ => (404, "text/plain; charset=utf-8", "not found\n".to_owned()),
    };
    Response::from_data(body.into_bytes())
        .with_status_code(status)
        .with_header(header("Content-Type", content_type))
        .with_header(header("Cache-Control", "no-store"))
}

fn page(dir: &Path, refresh_s: Option<u32>) -> (u16, &'static str, String) {
    match crate::report::render(dir, refresh_s) {
        Ok(html) => (200, "text/html; charset=utf-8", html),
        Err(error) => {
            // Before the run has written anything, say so and keep refreshing.
            let body = format!(
                "<!DOCTYPE html><html><head><meta charset=\"utf-8\">\
                 <meta http-equiv=\"refresh\" content=\"{REFRESH_S}\"><title>STE</title></head>\
                 <body><p>Waiting for the run: {}</p></body></html>",
                error.to_string().replace('<', "&lt;")
            );
            (503, "text/html; charset=utf-8", body)
        }
    }
}

fn samples(dir: &Path) -> Result<Vec<Sample>, String> {
    let path: PathBuf = dir.join("samples.csv");
    read_samples(&path).map_err(|error| format!("{}: {error}\n", path.display()))
}

/// A metric family: name, type, help, and its value in a sample.
type MetricFamily = (&'static str, &'static str, &'static str, fn(&Sample) -> f64);

/// The newest sample of every station as Prometheus metrics.
pub fn prometheus(samples: &[Sample]) -> String {
    let mut newest: std::collections::BTreeMap<&str, &Sample> = Default::default();
    for sample in samples {
        let entry = newest.entry(sample.station.as_str()).or_insert(sample);
        if sample.t_ms >= entry.t_ms {
            *entry = sample;
        }
    }
    let mut out = String::new();
    let families: [MetricFamily; 4] = [
        (
            "ste_station_arrivals_total",
            "counter",
            "Messages that arrived at the station.",
            |s| s.arrivals as f64,
        ),
        (
            "ste_station_completions_total",
            "counter",
            "Messages the station completed.",
            |s| s.completions as f64,
        ),
        (
            "ste_station_busy_seconds_total",
            "counter",
            "Time the station spent serving.",
            |s| s.busy_ms / 1000.0,
        ),
        (
            "ste_station_queue_length",
            "gauge",
            "Messages at the station: waiting or in service.",
            |s| s.queue_len as f64,
        ),
    ];
    for (name, kind, help, value) in families {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for (station, sample) in &newest {
            let _ = writeln!(out, "{name}{{station=\"{station}\"}} {}", value(sample));
        }
    }
    // Only where it is known: a rate over the counter is the station's mean population.
    let name = "ste_station_time_seconds_total";
    let _ = writeln!(
        out,
        "# HELP {name} Message-seconds spent at the station, waiting or in service.\n# TYPE {name} counter"
    );
    for (station, sample) in &newest {
        if let Some(station_ms) = sample.station_ms {
            let _ = writeln!(
                out,
                "{name}{{station=\"{station}\"}} {}",
                station_ms / 1000.0
            );
        }
    }
    if let Some(t) = newest.values().map(|s| s.t_ms).reduce(f64::max) {
        let _ = writeln!(
            out,
            "# HELP ste_run_seconds Run time at the newest sample.\n# TYPE ste_run_seconds gauge\nste_run_seconds {}",
            t / 1000.0
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn get(address: std::net::SocketAddr, path: &str) -> (u16, String) {
        get_with(address, path, "")
    }

    /// A GET of `path` with `headers` (each line ending in CRLF): its status and body.
    fn get_with(address: std::net::SocketAddr, path: &str, headers: &str) -> (u16, String) {
        use std::io::{Read, Write};
        let mut stream = std::net::TcpStream::connect(address).expect("connects");
        write!(
            stream,
            "GET {path} HTTP/1.1\r\nHost: x\r\n{headers}Connection: close\r\n\r\n"
        )
        .expect("writes");
        let mut text = String::new();
        stream.read_to_string(&mut text).expect("reads");
        let status = text
            .split_whitespace()
            .nth(1)
            .and_then(|code| code.parse().ok())
            .unwrap_or(0);
        let body = text
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_owned())
            .unwrap_or_default();
        (status, body)
    }

    #[test]
    fn the_dashboard_serves_the_page_metrics_and_json() {
        let dir = tempfile::tempdir().expect("temporary folder");
        let dashboard = Dashboard::start(dir.path(), "127.0.0.1:0").expect("listens");
        let address = dashboard.address();
        // Nothing written yet: the page waits, the metrics are unavailable.
        let (status, body) = get(address, "/");
        assert_eq!(status, 503);
        assert!(body.contains("Waiting for the run"));
        assert_eq!(get(address, "/metrics").0, 503);
        std::fs::write(
            dir.path().join("samples.csv"),
            "t_ms,station,queue_len,arrivals,completions,busy_ms\n\
             0,store.0,0,0,0,0\n1000,store.0,3,40,37,250.5\n",
        )
        .expect("writes");
        let (status, body) = get(address, "/");
        assert_eq!(status, 200);
        assert!(body.contains("<td>store.0</td>") && body.contains("<svg"));
        let (status, metrics) = get(address, "/metrics");
        assert_eq!(status, 200);
        assert!(
            metrics.contains("ste_station_completions_total{station=\"store.0\"} 37"),
            "{metrics}"
        );
        assert!(metrics.contains("ste_station_busy_seconds_total{station=\"store.0\"} 0.2505"));
        assert!(metrics.contains("ste_station_queue_length{station=\"store.0\"} 3"));
        let (status, json) = get(address, "/api/stations");
        assert_eq!(status, 200);
        let stations: serde_json::Value = serde_json::from_str(&json).expect("JSON");
        assert_eq!(stations[0]["C"], 37);
        assert_eq!(get(address, "/nothing").0, 404);
    }

    #[test]
    fn off_loopback_the_dashboard_requires_a_token_and_serves_only_those_who_carry_it() {
        let dir = tempfile::tempdir().expect("temporary folder");
        let refused = Dashboard::start(dir.path(), "0.0.0.0:0")
            .err()
            .expect("refused");
        assert!(
            refused.to_string().contains("requires a token"),
            "{refused}"
        );
        assert!(
            Dashboard::start_with_token(dir.path(), "0.0.0.0:0", Some("short".into())).is_err()
        );
        let token = "0123456789abcdef0123";
        let dashboard =
            Dashboard::start_with_token(dir.path(), "0.0.0.0:0", Some(token.to_owned()))
                .expect("listens");
        let address = std::net::SocketAddr::from(([127, 0, 0, 1], dashboard.address().port()));
        assert_eq!(get(address, "/metrics").0, 401);
        assert_eq!(get(address, "/?token=0123456789abcdef0124").0, 401);
        assert_eq!(get(address, &format!("/?token={token}")).0, 503, "let in");
        let bearer = format!("Authorization: Bearer {token}\r\n");
        assert_eq!(get_with(address, "/metrics", &bearer).0, 503, "let in");
    }
}

#[cfg(test)]
mod grafana {
    /// The Grafana dashboard in `deploy/` queries only metrics that `/metrics` exposes.
    #[test]
    fn the_grafana_dashboard_uses_the_exposed_metrics() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../deploy/grafana-dashboard.json"
        );
        let dashboard: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).expect("the dashboard file"))
                .expect("valid JSON");
        let exposed = super::prometheus(&[crate::Sample {
            t_ms: 1.0,
            station: "store.0".to_owned(),
            queue_len: 1,
            arrivals: 1,
            completions: 1,
            busy_ms: 1.0,
            station_ms: Some(2.0),
        }]);
        let names: Vec<&str> = exposed
            .lines()
            .filter(|line| line.starts_with("# TYPE "))
            .filter_map(|line| line.split_whitespace().nth(2))
            .collect();
        let panels = dashboard["panels"].as_array().expect("panels");
        assert!(panels.len() >= 4);
        for panel in panels {
            for target in panel["targets"].as_array().expect("targets") {
                let expr = target["expr"].as_str().expect("expr");
                let used: Vec<&str> = expr
                    .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .filter(|word| word.starts_with("ste_"))
                    .collect();
                assert!(!used.is_empty(), "{expr}");
                for metric in used {
                    assert!(
                        names.contains(&metric),
                        "{metric} is not exposed: {names:?}"
                    );
                }
            }
        }
    }
}
