//! Operational analysis (Buzen & Denning, 1978) of the stations sampled during a run.
//!
//! Each station keeps cumulative counters — arrivals A(t), completions C(t), busy time B(t),
//! station time W(t) = ∫ n dt — and its length n(t) = A(t) − C(t). Over a station's
//! observation window T (first to last sample):
//! λ = A/T, X = C/T, U = B/T, S = B/C, N = W/T, R = W/C; Little's law N = X·R and the
//! utilisation law U = X·S hold by construction of these estimators and are reported as checks.
//!
//! W is the difference of the station-time counter between the window's ends where the samples
//! file has it beside it ([`station_time_path`]), exact whatever the instants the sampler read
//! at; otherwise (a file with the six columns of `samples.csv` alone, a JetStream stream) the
//! left-rectangle rule W = Σ_j n_j · (t_{j+1} − t_j) estimates it from the lengths read at the
//! samples' instants, which is unbiased only if those instants are independent of what the
//! stations do.

pub mod chart;
pub mod mva;
pub mod report;
pub mod serve;

use std::collections::BTreeMap;
use std::path::Path;

use serde::Serialize;

/// One row of `samples.csv`.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub t_ms: f64,
    pub station: String,
    pub queue_len: u64,
    pub arrivals: u64,
    pub completions: u64,
    pub busy_ms: f64,
    /// The station's accumulated station time ∫ n dt at `t_ms`, in item-milliseconds, from the
    /// station-time file beside the samples (`None`: not known).
    pub station_ms: Option<f64>,
}

/// The header every samples file starts with.
pub const SAMPLES_HEADER: &str = "t_ms,station,queue_len,arrivals,completions,busy_ms";

/// The header of the station-time file beside a samples file: row for row the same instants
/// and stations, with each station's station time in item-milliseconds, empty where unknown.
pub const STATION_TIME_HEADER: &str = "t_ms,station,station_ms";

/// Where the station times of the samples file `samples` are: `samples.csv` →
/// `samples.station_time.csv`.
pub fn station_time_path(samples: &Path) -> std::path::PathBuf {
    samples.with_extension("station_time.csv")
}

/// Why a samples file could not be read.
#[derive(Debug, thiserror::Error)]
pub enum SamplesError {
    #[error("cannot read samples")]
    Io(#[from] std::io::Error),
    #[error("the samples file does not start with the header {SAMPLES_HEADER:?}")]
    Header,
    #[error("the station-time file does not start with the header {STATION_TIME_HEADER:?}")]
    StationTimeHeader,
    #[error("station-time line {line}: {detail}")]
    StationTimeRow { line: usize, detail: String },
    #[error("line {line}: {detail}")]
    Row { line: usize, detail: String },
}

fn parse_row(line_number: usize, line: &str) -> Result<Sample, SamplesError> {
    let error = |detail: &str| SamplesError::Row {
        line: line_number,
        detail: detail.to_owned(),
    };
    let columns: Vec<&str> = line.split(',').collect();
    if columns.len() != 6 {
        return Err(error("expected 6 columns"));
    }
    Ok(Sample {
        t_ms: columns[0].parse().map_err(|_| error("bad t_ms"))?,
        station: columns[1].to_owned(),
        queue_len: columns[2].parse().map_err(|_| error("bad queue_len"))?,
        arrivals: columns[3].parse().map_err(|_| error("bad arrivals"))?,
        completions: columns[4].parse().map_err(|_| error("bad completions"))?,
        busy_ms: columns[5].parse().map_err(|_| error("bad busy_ms"))?,
        station_ms: None,
    })
}

/// The complete lines of a file written as it is read: a last line without its newline is one
/// still being written.
fn complete_lines(text: &str) -> &str {
    match text.rfind('\n') {
        Some(end) => &text[..=end],
        None => "",
    }
}

/// Adds to `samples` the station times of the file beside them, row for row; where that file is
/// behind (a run in progress writes both), the samples it does not cover yet are left out.
fn join_station_times(samples: &mut Vec<Sample>, path: &Path) -> Result<(), SamplesError> {
    let text = std::fs::read_to_string(path)?;
    let mut lines = complete_lines(&text).lines().enumerate();
    match lines.next() {
        Some((_, header)) if header.trim() == STATION_TIME_HEADER => {}
        None => {
            samples.clear();
            return Ok(());
        }
        Some(_) => return Err(SamplesError::StationTimeHeader),
    }
    let mut joined = 0;
    for ((index, line), sample) in lines.zip(samples.iter_mut()) {
        let error = |detail: &str| SamplesError::StationTimeRow {
            line: index + 1,
            detail: detail.to_owned(),
        };
        let mut columns = line.trim().split(',');
        let (Some(t_ms), Some(station), Some(station_ms), None) = (
            columns.next(),
            columns.next(),
            columns.next(),
            columns.next(),
        ) else {
            return Err(error("expected 3 columns"));
        };
        let t_ms: f64 = t_ms.parse().map_err(|_| error("bad t_ms"))?;
        if t_ms != sample.t_ms || station != sample.station {
            return Err(error("not the instant and station of the samples' row"));
        }
        sample.station_ms = match station_ms {
            "" => None,
            value => Some(value.parse().map_err(|_| error("bad station_ms"))?),
        };
        joined += 1;
    }
    samples.truncate(joined);
    Ok(())
}

/// Reads a samples file, with the station times beside it where they are
/// ([`station_time_path`]). A last line without its newline is one the sampler is still
/// writing (the file of a run in progress) and is left out.
pub fn read_samples(path: &Path) -> Result<Vec<Sample>, SamplesError> {
    let text = std::fs::read_to_string(path)?;
    let complete = complete_lines(&text);
    let mut samples = Vec::new();
    for (index, line) in complete.lines().enumerate() {
        if index == 0 {
            if line.trim() != SAMPLES_HEADER {
                return Err(SamplesError::Header);
            }
            continue;
        }
        if line.trim().is_empty() {
            continue;
        }
        samples.push(parse_row(index + 1, line.trim())?);
    }
    if complete.is_empty() && !text.is_empty() && !SAMPLES_HEADER.starts_with(text.trim()) {
        return Err(SamplesError::Header);
    }
    let station_times = station_time_path(path);
    if station_times.exists() {
        join_station_times(&mut samples, &station_times)?;
    }
    Ok(samples)
}

/// The operational metrics of one station. Times in seconds.
#[derive(Debug, Clone, Serialize, PartialEq)]
#[allow(non_snake_case)]
pub struct StationMetrics {
    pub station: String,
    pub T_s: f64,
    pub A: u64,
    pub C: u64,
    pub B_s: f64,
    /// Accumulated station time ∫ n dt over the window, in item-seconds: from the station-time
    /// counter where the samples have it, else Σ n·Δt over the samples.
    pub W: f64,
    /// Whether W is the counter's (exact) rather than estimated from the sampled lengths.
    pub W_exact: bool,
    pub lambda: f64,
    pub X: f64,
    pub U: f64,
    pub S_s: f64,
    pub N: f64,
    pub R_s: f64,
}

fn ratio(numerator: f64, denominator: f64) -> f64 {
    if denominator > 0.0 {
        numerator / denominator
    } else {
        0.0
    }
}

/// Computes the metrics of every station, in order of first appearance.
pub fn analyze(samples: &[Sample]) -> Vec<StationMetrics> {
    let mut order: Vec<&str> = Vec::new();
    let mut by_station: BTreeMap<&str, Vec<&Sample>> = BTreeMap::new();
    for sample in samples {
        let entry = by_station.entry(sample.station.as_str()).or_default();
        if entry.is_empty() {
            order.push(sample.station.as_str());
        }
        entry.push(sample);
    }
    order
        .into_iter()
        .map(|name| {
            let mut rows = by_station.remove(name).unwrap_or_default();
            rows.sort_by(|a, b| a.t_ms.total_cmp(&b.t_ms));
            station_metrics(name, &rows)
        })
        .collect()
}

fn station_metrics(name: &str, rows: &[&Sample]) -> StationMetrics {
    let (Some(first), Some(last)) = (rows.first(), rows.last()) else {
        return StationMetrics {
            station: name.to_owned(),
            T_s: 0.0,
            A: 0,
            C: 0,
            B_s: 0.0,
            W: 0.0,
            W_exact: false,
            lambda: 0.0,
            X: 0.0,
            U: 0.0,
            S_s: 0.0,
            N: 0.0,
            R_s: 0.0,
        };
    };
    let t_s = (last.t_ms - first.t_ms) / 1000.0;
    let arrivals = last.arrivals.saturating_sub(first.arrivals);
    let completions = last.completions.saturating_sub(first.completions);
    let busy_s = (last.busy_ms - first.busy_ms).max(0.0) / 1000.0;
    let (w, w_exact) = match (first.station_ms, last.station_ms) {
        (Some(from), Some(to)) => ((to - from).max(0.0) / 1000.0, true),
        _ => (
            rows.windows(2)
                .map(|pair| pair[0].queue_len as f64 * (pair[1].t_ms - pair[0].t_ms) / 1000.0)
                .sum(),
            false,
        ),
    };
    let c = completions as f64;
    StationMetrics {
        station: name.to_owned(),
        T_s: t_s,
        A: arrivals,
        C: completions,
        B_s: busy_s,
        W: w,
        W_exact: w_exact,
        lambda: ratio(arrivals as f64, t_s),
        X: ratio(c, t_s),
        U: ratio(busy_s, t_s),
        S_s: ratio(busy_s, c),
        N: ratio(w, t_s),
        R_s: ratio(w, c),
    }
}

/// Completion rates over the first and the last `fraction` of the completions of the stations
/// whose names start with `prefix` (summed), from the samples: how much a run slowed down as it
/// went on. `None` when the samples are too few to tell.
pub fn edge_rates(samples: &[Sample], prefix: &str, fraction: f64) -> Option<(f64, f64)> {
    // Total completions of the matching stations at each sample time.
    let mut totals: BTreeMap<u64, u64> = BTreeMap::new();
    let mut latest: BTreeMap<&str, u64> = BTreeMap::new();
    let mut rows: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.station.starts_with(prefix))
        .collect();
    rows.sort_by(|a, b| a.t_ms.total_cmp(&b.t_ms));
    for row in rows {
        latest.insert(row.station.as_str(), row.completions);
        totals.insert((row.t_ms * 1000.0) as u64, latest.values().sum());
    }
    let points: Vec<(f64, u64)> = totals
        .into_iter()
        .map(|(t, c)| (t as f64 / 1e6, c))
        .collect();
    let (start, _) = *points.first()?;
    let (_, total) = *points.last()?;
    let edge = (total as f64 * fraction).max(1.0);
    // When the completions reached `count`, interpolating linearly between samples.
    let time_at = |count: f64| -> Option<f64> {
        let after = points.iter().position(|(_, c)| *c as f64 >= count)?;
        let (t1, c1) = points[after];
        if after == 0 || c1 as f64 == count {
            return Some(t1);
        }
        let (t0, c0) = points[after - 1];
        Some(t0 + (count - c0 as f64) / (c1 - c0) as f64 * (t1 - t0))
    };
    let first = ratio(edge, time_at(edge)? - start);
    let last = ratio(edge, time_at(total as f64)? - time_at(total as f64 - edge)?);
    (first > 0.0 && last > 0.0).then_some((first, last))
}

/// The bottleneck: the station with the largest service demand (busy time).
pub fn bottleneck(metrics: &[StationMetrics]) -> Option<&StationMetrics> {
    metrics.iter().max_by(|a, b| a.B_s.total_cmp(&b.B_s))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(t_ms: f64, queue_len: u64, arrivals: u64, completions: u64, busy_ms: f64) -> Sample {
        Sample {
            t_ms,
            station: "s".to_owned(),
            queue_len,
            arrivals,
            completions,
            busy_ms,
            station_ms: None,
        }
    }

    #[test]
    fn hand_computed_station() {
        // Four samples 1 s apart: lengths 0, 2, 1, 0; 4 arrivals, 4 completions, 3 s busy.
        let samples = vec![
            sample(0.0, 0, 0, 0, 0.0),
            sample(1000.0, 2, 3, 1, 1000.0),
            sample(2000.0, 1, 4, 3, 2000.0),
            sample(3000.0, 0, 4, 4, 3000.0),
        ];
        let metrics = &analyze(&samples)[0];
        assert_eq!(metrics.T_s, 3.0);
        assert_eq!((metrics.A, metrics.C), (4, 4));
        // W = 0·1 + 2·1 + 1·1 = 3 item-seconds.
        assert!((metrics.W - 3.0).abs() < 1e-9);
        assert!((metrics.X - 4.0 / 3.0).abs() < 1e-9);
        assert!((metrics.U - 1.0).abs() < 1e-9);
        assert!((metrics.S_s - 0.75).abs() < 1e-9);
        assert!((metrics.N - 1.0).abs() < 1e-9);
        assert!((metrics.R_s - 0.75).abs() < 1e-9);
        assert!((metrics.N - metrics.X * metrics.R_s).abs() < 1e-9);
        assert!((metrics.U - metrics.X * metrics.S_s).abs() < 1e-9);
    }

    #[test]
    fn edge_rates_compare_the_start_and_the_end() {
        // 1,000 completions a second for 10 s, then 500 a second for the last 2 s.
        let mut samples = Vec::new();
        let mut completions = 0;
        for second in 0..=12 {
            samples.push(Sample {
                t_ms: f64::from(second) * 1000.0,
                station: "store.0".to_owned(),
                queue_len: 0,
                arrivals: completions,
                completions,
                busy_ms: 0.0,
                station_ms: None,
            });
            completions += if second < 10 { 1000 } else { 500 };
        }
        // Total 11,000: the first 1,100 took 1.1 s; the last 1,100 took 0.1 s at 1,000/s and
        // 2 s at 500/s.
        let (first, last) = edge_rates(&samples, "store.", 0.1).expect("enough samples");
        assert!((first - 1000.0).abs() < 1e-9, "{first}");
        assert!((last - 1100.0 / 2.1).abs() < 1e-9, "{last}");
    }

    #[test]
    fn reads_a_samples_file() {
        let dir = tempfile::tempdir().expect("temporary folder");
        let path = dir.path().join("samples.csv");
        std::fs::write(
            &path,
            format!("{SAMPLES_HEADER}\n0.000,a,0,0,0,0.000\n10.000,a,1,1,0,0.000\n"),
        )
        .expect("writes");
        let samples = read_samples(&path).expect("reads");
        assert_eq!(samples.len(), 2);
        std::fs::write(&path, "bad header\n").expect("writes");
        assert!(matches!(read_samples(&path), Err(SamplesError::Header)));
    }

    #[test]
    fn the_station_time_counter_gives_w_whatever_the_instants_read() {
        let dir = tempfile::tempdir().expect("temporary folder");
        let path = dir.path().join("samples.csv");
        // Each instant read an empty station, but its counter says it held 1.5 items on
        // average over the 2 s: the lengths at the instants miss it; the counter does not.
        std::fs::write(
            &path,
            format!(
                "{SAMPLES_HEADER}\n0.000,a,0,0,0,0.000\n1000.000,a,0,3,3,900.000\n\
                 2000.000,a,0,6,6,1800.000\n"
            ),
        )
        .expect("writes");
        let station_times = station_time_path(&path);
        assert_eq!(station_times, dir.path().join("samples.station_time.csv"));
        let without = &analyze(&read_samples(&path).expect("reads"))[0];
        assert_eq!((without.W, without.W_exact), (0.0, false));
        std::fs::write(
            &station_times,
            format!(
                "{STATION_TIME_HEADER}\n0.000,a,500.000000\n1000.000,a,1700.000000\n\
                 2000.000,a,3500.0000"
            ),
        )
        .expect("writes");
        // The station-time file's last line is still being written: its sample waits for it.
        let samples = read_samples(&path).expect("reads");
        assert_eq!(samples.len(), 2);
        assert_eq!(samples[1].station_ms, Some(1700.0));
        std::fs::write(
            &station_times,
            format!(
                "{STATION_TIME_HEADER}\n0.000,a,500.000000\n1000.000,a,1700.000000\n\
                 2000.000,a,3500.000000\n"
            ),
        )
        .expect("writes");
        let with = &analyze(&read_samples(&path).expect("reads"))[0];
        assert!(with.W_exact);
        assert!((with.W - 3.0).abs() < 1e-9, "{}", with.W);
        assert!((with.N - 1.5).abs() < 1e-9 && (with.R_s - 0.5).abs() < 1e-9);
        // A station time that is not its sample's row is refused, not joined.
        std::fs::write(
            &station_times,
            format!("{STATION_TIME_HEADER}\n0.000,b,500.000000\n"),
        )
        .expect("writes");
        assert!(matches!(
            read_samples(&path),
            Err(SamplesError::StationTimeRow { line: 2, .. })
        ));
        std::fs::write(&station_times, "t_ms,station\n").expect("writes");
        assert!(matches!(
            read_samples(&path),
            Err(SamplesError::StationTimeHeader)
        ));
    }
}
