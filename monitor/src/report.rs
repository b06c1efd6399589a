//! One HTML page for a run directory: the run's summary, the operational metrics of every
//! station, the execution graph (queue lengths and throughput over time) and, for a sweep, the
//! Little's-law curve. Self-contained (inline CSS and SVG, no script, nothing fetched), so it
//! works offline; `monitor report` writes it to a file and `monitor serve` serves it live.

use std::fmt::Write as _;
use std::path::Path;

use crate::{analyze, bottleneck, read_samples, SamplesError};

/// Why a report could not be made.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    #[error("{0} holds neither samples.csv nor sweep.json: not a run or sweep directory")]
    NotARun(String),
    #[error("reading {path}")]
    Samples {
        path: String,
        #[source]
        source: SamplesError,
    },
    #[error("reading {path}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("drawing the charts: {0}")]
    Chart(String),
}

/// Escapes text for HTML.
fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '&' => out.push_str("&amp;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            _ => out.push(c),
        }
    }
    out
}

/// An SVG document as an element to inline: without an XML declaration.
fn inline_svg(svg: &str) -> &str {
    match svg.find("<svg") {
        Some(start) => &svg[start..],
        None => svg,
    }
}

const STYLE: &str = "body{font-family:sans-serif;margin:24px;color:#222}\
table{border-collapse:collapse;margin:12px 0}td,th{border:1px solid #ccc;padding:4px 8px;\
text-align:right}th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}\
.figure{margin:16px 0}.note{color:#666}";

/// Renders the page for `dir`. `refresh_s` adds a refresh every so many seconds (the live view).
pub fn render(dir: &Path, refresh_s: Option<u32>) -> Result<String, ReportError> {
    let samples_path = dir.join("samples.csv");
    let sweep_path = dir.join("sweep.json");
    let has_samples = samples_path.exists();
    let has_sweep = sweep_path.exists();
    if !has_samples && !has_sweep {
        return Err(ReportError::NotARun(dir.display().to_string()));
    }
    let title = format!("STE — {}", dir.display());
    let mut html = String::new();
    let _ = write!(
        html,
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{}</title>",
        escape(&title)
    );
    if let Some(seconds) = refresh_s {
        let _ = write!(html, "<meta http-equiv=\"refresh\" content=\"{seconds}\">");
    }
    let _ = write!(
        html,
        "<style>{STYLE}</style></head><body><h1>{}</h1>",
        escape(&title)
    );
    summary_section(dir, &mut html)?;
    if has_samples {
        let samples = read_samples(&samples_path).map_err(|source| ReportError::Samples {
            path: samples_path.display().to_string(),
            source,
        })?;
        let metrics = analyze(&samples);
        cluster_section(dir, &metrics, &mut html);
        stations_section(&samples, &metrics, &mut html)?;
    }
    if has_sweep {
        sweep_section(dir, &mut html)?;
    }
    html.push_str("</body></html>\n");
    Ok(html)
}

fn read_json(path: &Path) -> Result<Option<serde_json::Value>, ReportError> {
    match std::fs::read(path) {
        Ok(bytes) => Ok(serde_json::from_slice(&bytes).ok()),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(ReportError::Io {
            path: path.display().to_string(),
            source,
        }),
    }
}

fn summary_section(dir: &Path, html: &mut String) -> Result<(), ReportError> {
    let Some(summary) = read_json(&dir.join("summary.json"))? else {
        if dir.join("samples.csv").exists() {
            html.push_str(
                "<p class=\"note\" id=\"state\">Run in progress: the figures below are \
                           those of the samples so far.</p>",
            );
        }
        return Ok(());
    };
    let number = |key: &str| summary.get(key).and_then(serde_json::Value::as_f64);
    html.push_str("<h2>Run</h2><table id=\"summary\">");
    let rows = [
        (
            "messages in",
            number("messages_in").map(|v| format!("{v:.0}")),
        ),
        ("CLS", number("cls").map(|v| format!("{v:.0}"))),
        (
            "elapsed (s)",
            number("elapsed_s").map(|v| format!("{v:.2}")),
        ),
        (
            "throughput (msg/s)",
            number("throughput_msg_s").map(|v| format!("{v:.0}")),
        ),
        (
            "CLS latency p50 / p99 (ms)",
            summary.get("latency_ms").map(|l| {
                format!(
                    "{:.1} / {:.1}",
                    l.get("p50")
                        .and_then(serde_json::Value::as_f64)
                        .unwrap_or_default(),
                    l.get("p99")
                        .and_then(serde_json::Value::as_f64)
                        .unwrap_or_default()
                )
            }),
        ),
        ("conserved", summary.get("conserved").map(|v| v.to_string())),
        (
            "store",
            summary
                .get("store")
                .and_then(serde_json::Value::as_str)
                .map(str::to_owned),
        ),
    ];
    for (name, value) in rows {
        if let Some(value) = value {
            let _ = write!(
                html,
                "<tr><th>{}</th><td>{}</td></tr>",
                escape(name),
                escape(&value)
            );
        }
    }
    html.push_str("</table>");
    Ok(())
}

fn stations_section(
    samples: &[crate::Sample],
    metrics: &[crate::StationMetrics],
    html: &mut String,
) -> Result<(), ReportError> {
    html.push_str("<h2>Stations (operational analysis of samples.csv)</h2>");
    if let Some(worst) = bottleneck(metrics) {
        let _ = write!(
            html,
            "<p id=\"bottleneck\">Bottleneck (largest demand): <b>{}</b>, U = {:.3}</p>",
            escape(&worst.station),
            worst.U
        );
    }
    html.push_str(
        "<table id=\"stations\"><tr><th>station</th><th>T (s)</th><th>A</th><th>C</th>\
         <th>λ (/s)</th><th>X (/s)</th><th>U</th><th>S (ms)</th><th>N</th><th>R (ms)</th></tr>",
    );
    for m in metrics {
        let _ = write!(
            html,
            "<tr><td>{}</td><td>{:.3}</td><td>{}</td><td>{}</td><td>{:.1}</td><td>{:.1}</td>\
             <td>{:.3}</td><td>{:.4}</td><td>{:.2}</td><td>{:.3}</td></tr>",
            escape(&m.station),
            m.T_s,
            m.A,
            m.C,
            m.lambda,
            m.X,
            m.U,
            m.S_s * 1e3,
            m.N,
            m.R_s * 1e3
        );
    }
    html.push_str("</table>");
    if !samples.is_empty() {
        let svg = crate::chart::timeline_svg(samples).map_err(ReportError::Chart)?;
        let _ = write!(
            html,
            "<div class=\"figure\" id=\"timeline\">{}</div>",
            inline_svg(&svg)
        );
    }
    Ok(())
}

/// The cluster at a glance, for a run through nodes (station names `node/station`, queues
/// `jetstream/queue`): every node with its stations, busiest station and memory (`nodes.csv`),
/// and every JetStream queue with its length in batches. Nothing for an in-process run.
fn cluster_section(dir: &Path, metrics: &[crate::StationMetrics], html: &mut String) {
    let mut nodes: std::collections::BTreeMap<&str, Vec<&crate::StationMetrics>> =
        std::collections::BTreeMap::new();
    let mut queues = Vec::new();
    for m in metrics {
        match m.station.split_once('/') {
            Some(("jetstream", _)) => queues.push(m),
            Some((node, _)) => nodes.entry(node).or_default().push(m),
            None => {}
        }
    }
    if nodes.is_empty() && queues.is_empty() {
        return;
    }
    // The latest memory reading of each node.
    let mut memory: std::collections::BTreeMap<String, (String, String)> = Default::default();
    if let Ok(text) = std::fs::read_to_string(dir.join("nodes.csv")) {
        for line in text.lines().skip(1) {
            let fields: Vec<&str> = line.split(',').collect();
            if let [_, node, rss, tables] = fields[..] {
                memory.insert(node.to_owned(), (rss.to_owned(), tables.to_owned()));
            }
        }
    }
    let _ = write!(
        html,
        "<h2>Cluster: {} nodes, {} JetStream queues</h2>\
         <table id=\"nodes\"><tr><th>node</th><th>stations</th><th>busiest</th><th>U</th>\
         <th>RSS (MiB)</th><th>matcher tables (MiB)</th></tr>",
        nodes.len(),
        queues.len()
    );
    for (node, stations) in &nodes {
        let names: Vec<String> = stations
            .iter()
            .map(|m| escape(m.station.split_once('/').map_or("", |(_, name)| name)))
            .collect();
        let busiest = stations.iter().max_by(|a, b| a.U.total_cmp(&b.U));
        let (rss, tables) = memory.get(*node).cloned().unwrap_or_default();
        let _ = write!(
            html,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{:.3}</td><td>{}</td><td>{}</td></tr>",
            escape(node),
            names.join(" "),
            busiest.map_or(String::new(), |m| escape(&m.station)),
            busiest.map_or(0.0, |m| m.U),
            escape(&rss),
            escape(&tables)
        );
    }
    html.push_str(
        "</table><table id=\"jetstream\"><tr><th>queue</th><th>mean length (batches)</th>\
         <th>batches stored</th><th>stored (/s)</th></tr>",
    );
    for m in &queues {
        let _ = write!(
            html,
            "<tr><td>{}</td><td>{:.2}</td><td>{}</td><td>{:.1}</td></tr>",
            escape(&m.station),
            m.N,
            m.A,
            m.lambda
        );
    }
    html.push_str("</table>");
}

/// A sweep level's figure `key` with `decimals` (empty where the level has none).
fn cell(point: &serde_json::Value, key: &str, decimals: usize) -> String {
    point
        .get(key)
        .and_then(serde_json::Value::as_f64)
        .map(|v| format!("{v:.decimals$}"))
        .unwrap_or_default()
}

fn sweep_section(dir: &Path, html: &mut String) -> Result<(), ReportError> {
    let Some(serde_json::Value::Array(points)) = read_json(&dir.join("sweep.json"))? else {
        return Ok(());
    };
    if points.iter().any(|p| p.get("nodes").is_some()) {
        node_sweep_section(&points, html);
        return Ok(());
    }
    html.push_str(
        "<h2>Little's law over the sweep</h2><table id=\"sweep\"><tr><th>level</th>\
         <th>window</th><th>rate (msg/s)</th><th>X (msg/s)</th><th>N</th>\
         <th>R from samples (ms)</th><th>R measured (ms)</th><th>CPU µs/msg</th>\
         <th>MVA X (msg/s)</th><th>MVA R (ms)</th><th>MVA X, level's CPU</th>\
         <th>cores ≥ 90% busy (model applies)</th><th>bottleneck</th></tr>",
    );
    for point in &points {
        let _ = write!(
            html,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>\
             <td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            cell(point, "level", 0),
            cell(point, "window", 0),
            cell(point, "rate_msg_s", 0),
            cell(point, "X", 0),
            cell(point, "N", 1),
            cell(point, "R_ms", 3),
            cell(point, "R_direct_ms", 3),
            cell(point, "D_us", 2),
            cell(point, "X_mva", 0),
            cell(point, "R_mva_ms", 3),
            cell(point, "X_mva_level", 0),
            point
                .get("mva_applies")
                .and_then(serde_json::Value::as_bool)
                .map_or("", |applies| if applies { "yes" } else { "no" }),
            escape(
                point
                    .get("bottleneck")
                    .and_then(serde_json::Value::as_str)
                    .unwrap_or("")
            )
        );
    }
    html.push_str("</table>");
    let chart = dir.join("littles-law.svg");
    if let Ok(svg) = std::fs::read_to_string(&chart) {
        let _ = write!(
            html,
            "<div class=\"figure\" id=\"littles-law\">{}</div>",
            inline_svg(&svg)
        );
    }
    Ok(())
}

/// A node sweep (`driver sweep --nodes`): per level X, X per node, R, the CPU and the model's
/// predictions, and its charts (per-node rate against nodes; R against X).
fn node_sweep_section(points: &[serde_json::Value], html: &mut String) {
    html.push_str(
        "<h2>Scale-out over node counts</h2><table id=\"node-sweep\"><tr><th>databases</th>\
         <th>nodes</th><th>X (msg/s)</th><th>X per node</th><th>R = N/X (ms)</th>\
         <th>CLS p99 (ms)</th><th>busy cores</th><th>CPU µs/msg</th><th>MVA X, this machine</th>\
         <th>MVA X, level's CPU</th><th>MVA X, nodes on own machines</th>\
         <th>MVA X, every program on own machines</th><th>what bounds it then</th>\
         <th>MVA X, capped nodes</th><th>bottleneck</th>\
         <th>busiest station</th></tr>",
    );
    for point in points {
        let _ = write!(html, "<tr>");
        for (key, decimals) in [
            ("databases", 0),
            ("nodes", 0),
            ("X", 0),
            ("X_per_node", 0),
            ("R_ms", 1),
            ("cls_p99_ms", 1),
            ("cpu_busy_cores", 2),
            ("cpu_us_per_msg", 1),
            ("X_mva", 0),
            ("X_mva_level", 0),
            ("X_own", 0),
            ("X_spread", 0),
            ("spread_bound", 0),
            ("X_capped", 0),
        ] {
            let text = match point.get(key) {
                Some(serde_json::Value::String(name)) => escape(name),
                _ => cell(point, key, decimals),
            };
            let _ = write!(html, "<td>{text}</td>");
        }
        for key in ["bottleneck", "busiest_station"] {
            let name = point.get(key).and_then(serde_json::Value::as_str);
            let _ = write!(html, "<td>{}</td>", escape(name.unwrap_or("")));
        }
        html.push_str("</tr>");
    }
    html.push_str("</table>");
    // Drawn afresh from the levels, as the station charts are from the samples.
    match crate::chart::node_sweep_svg(&serde_json::Value::Array(points.to_vec())) {
        Ok(svg) => {
            let _ = write!(
                html,
                "<div class=\"figure\" id=\"node-sweep-charts\">{}</div>",
                inline_svg(&svg)
            );
        }
        Err(reason) => {
            let _ = write!(
                html,
                "<p>The charts could not be drawn: {}</p>",
                escape(&reason)
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_is_escaped() {
        assert_eq!(
            escape("<a href=\"x\">&'"),
            "&lt;a href=&quot;x&quot;&gt;&amp;&#39;"
        );
    }

    #[test]
    fn a_folder_without_samples_or_sweep_is_refused() {
        let dir = tempfile::tempdir().expect("temporary folder");
        assert!(matches!(
            render(dir.path(), None),
            Err(ReportError::NotARun(_))
        ));
    }

    #[test]
    fn a_cluster_run_shows_each_node_with_its_stations_and_memory_and_each_queue() {
        let dir = tempfile::tempdir().expect("temporary folder");
        std::fs::write(
            dir.path().join("samples.csv"),
            "t_ms,station,queue_len,arrivals,completions,busy_ms\n\
             0,node-1/match.0,0,0,0,0\n0,node-2/store.1,0,0,0,0\n0,jetstream/match.0,0,0,0,0\n\
             100,node-1/match.0,1,50,49,10\n100,node-2/store.1,0,40,40,80\n\
             100,jetstream/match.0,3,7,4,0\n",
        )
        .expect("writes");
        std::fs::write(
            dir.path().join("nodes.csv"),
            "t_ms,node,rss_mib,matcher_tables_mib\n50,node-1,40.0,14.0\n100,node-1,41.5,14.0\n",
        )
        .expect("writes");
        let html = render(dir.path(), None).expect("renders");
        let table = |id: &str| {
            html.split(&format!("id=\"{id}\""))
                .nth(1)
                .and_then(|rest| rest.split("</table>").next())
                .unwrap_or_else(|| panic!("no #{id} table"))
        };
        let nodes = table("nodes");
        assert!(
            nodes.contains("<td>node-1</td><td>match.0</td><td>node-1/match.0</td>"),
            "{nodes}"
        );
        // node-2's store was busy 80 of 100 ms.
        assert!(
            nodes.contains("<td>node-2/store.1</td><td>0.800</td>"),
            "{nodes}"
        );
        // The latest memory reading.
        assert!(nodes.contains("<td>41.5</td><td>14.0</td>"), "{nodes}");
        let queues = table("jetstream");
        assert!(queues.contains("<td>jetstream/match.0</td>"), "{queues}");
        assert!(!queues.contains("node-1"));
        assert!(html.contains("Cluster: 2 nodes, 1 JetStream queues"));
    }

    #[test]
    fn an_in_process_run_has_no_cluster_section() {
        let dir = tempfile::tempdir().expect("temporary folder");
        std::fs::write(
            dir.path().join("samples.csv"),
            "t_ms,station,queue_len,arrivals,completions,busy_ms\n0,store.0,0,0,0,0\n",
        )
        .expect("writes");
        let html = render(dir.path(), None).expect("renders");
        assert!(!html.contains("id=\"nodes\"") && !html.contains("Cluster:"));
    }

    #[test]
    fn a_run_in_progress_is_drawn_from_its_samples() {
        let dir = tempfile::tempdir().expect("temporary folder");
        // The sampler is mid-line: the torn last row is left out.
        std::fs::write(
            dir.path().join("samples.csv"),
            "t_ms,station,queue_len,arrivals,completions,busy_ms\n\
             0,inbound.0,0,0,0,0\n10,inbound.0,4,10,6,5\n20,inbound.0,2,20,18,12\n30,inbou",
        )
        .expect("writes");
        let html = render(dir.path(), Some(2)).expect("renders");
        assert!(html.contains("http-equiv=\"refresh\" content=\"2\""));
        assert!(html.contains("Run in progress"));
        assert!(html.contains("<td>inbound.0</td>"));
        // C = 18 completions over T = 0.02 s: X = 900/s.
        assert!(html.contains("<td>900.0</td>"), "{html}");
        assert!(html.contains("<svg"));
        assert!(!html.contains("<?xml"));
    }

    #[test]
    fn a_node_sweep_shows_its_levels_and_charts() {
        let dir = tempfile::tempdir().expect("temp dir");
        let point = |databases: u32, nodes: u32, x: f64| {
            serde_json::json!({"level": 0, "databases": databases, "nodes": nodes, "X": x,
                "X_per_node": x / f64::from(nodes), "R_ms": 4096e3 / x, "X_mva": 40000.0,
                "X_own": 80000.0, "X_spread": 160000.0, "spread_bound": "nats",
                "bottleneck": "node-1/store.0"})
        };
        let points = vec![
            point(1, 1, 43000.0),
            point(1, 2, 41000.0),
            point(4, 8, 25000.0),
        ];
        std::fs::write(
            dir.path().join("sweep.json"),
            serde_json::to_string(&points).expect("JSON"),
        )
        .expect("sweep.json");
        let html = render(dir.path(), None).expect("renders");
        assert!(html.contains("id=\"node-sweep\""));
        assert_eq!(html.matches("<td>node-1/store.0</td>").count(), 3);
        assert!(
            html.contains("<td>20500</td>"),
            "the per-node rate of 2 nodes"
        );
        assert!(html.contains("id=\"node-sweep-charts\"><svg"));
        assert!(html.contains("Per-node rate") && html.contains("4 DB measured"));
        assert!(html.contains("Throughput over node counts"));
        assert_eq!(
            html.matches("<td>nats</td>").count(),
            3,
            "what bounds the spread model"
        );
        assert!(!html.contains("id=\"sweep\""));
    }
}
