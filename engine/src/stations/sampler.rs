//! The sampler: reads every station's counters about every interval (DESIGN.md section 6), each
//! wait drawn at random between half and one and a half intervals.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::RngExt;

use crate::network::PipelineError;
use crate::station::{RunClock, Station, StationReading};

/// The header of `samples.csv`.
pub const SAMPLES_HEADER: &str = "t_ms,station,queue_len,arrivals,completions,busy_ms";

/// The header of the station-time file beside it ([`station_time_path`]): row for row the
/// same instants and stations as `samples.csv`, with each station's accumulated station time
/// ∫ n dt in item-milliseconds (empty where it is not known: a JetStream stream's).
pub const STATION_TIME_HEADER: &str = "t_ms,station,station_ms";

/// Where the station times of the samples file `samples` go: beside it, `samples.csv` →
/// `samples.station_time.csv`. `samples.csv` keeps the columns DESIGN.md section 6 names.
pub fn station_time_path(samples: &Path) -> PathBuf {
    samples.with_extension("station_time.csv")
}

/// The two files a sampler writes, row for row.
pub struct SampleFiles {
    samples: BufWriter<File>,
    station_time: BufWriter<File>,
}

impl SampleFiles {
    /// Creates `samples` and its station-time file, and writes their headers.
    pub fn create(samples: &Path) -> std::io::Result<Self> {
        let mut files = Self {
            samples: BufWriter::new(File::create(samples)?),
            station_time: BufWriter::new(File::create(station_time_path(samples))?),
        };
        writeln!(files.samples, "{SAMPLES_HEADER}")?;
        writeln!(files.station_time, "{STATION_TIME_HEADER}")?;
        Ok(files)
    }

    /// One row of each: a station's cumulative counters at `t_ms`; its length is arrivals
    /// less completions.
    pub fn write_row(
        &mut self,
        t_ms: f64,
        station: &str,
        arrivals: u64,
        completions: u64,
        busy_ns: u64,
        station_ns: Option<u64>,
    ) -> std::io::Result<()> {
        writeln!(
            self.samples,
            "{t_ms:.3},{station},{},{arrivals},{completions},{:.3}",
            arrivals.saturating_sub(completions),
            busy_ns as f64 / 1e6
        )?;
        match station_ns {
            Some(ns) => writeln!(
                self.station_time,
                "{t_ms:.3},{station},{:.6}",
                ns as f64 / 1e6
            ),
            None => writeln!(self.station_time, "{t_ms:.3},{station},"),
        }
    }

    /// Hands what is buffered to both files. Either may be ahead of the other between two
    /// flushes (a buffer also empties itself when full): a reader joins them row for row up to
    /// the shorter.
    pub fn flush(&mut self) -> std::io::Result<()> {
        self.samples.flush()?;
        self.station_time.flush()
    }
}

/// Reads every station's counters, then writes them: the readings are taken together, within a
/// microsecond, before any row is formatted, so that a sample is one instant of the network.
/// Formatting between readings spread a sample over tens of microseconds, about as long as a
/// message stays at a station at small windows, in which it could be read at two stations or
/// at none.
fn write_samples(
    out: &mut SampleFiles,
    stations: &[Arc<Station>],
    readings: &mut Vec<StationReading>,
    clock: RunClock,
) -> std::io::Result<()> {
    let t_ms = clock.now_ns() as f64 / 1e6;
    readings.clear();
    readings.extend(stations.iter().map(|station| station.read()));
    for (station, reading) in stations.iter().zip(readings.iter()) {
        out.write_row(
            t_ms,
            station.name(),
            reading.arrivals,
            reading.completions,
            reading.busy_ns,
            Some(reading.station_ns),
        )?;
    }
    Ok(())
}

/// Asks the operating system to run the calling thread, a sampler, as soon as it wakes: real-time
/// FIFO scheduling at the lowest real-time priority, above every thread of normal priority.
/// Returns whether that was granted (it takes root, `CAP_SYS_NICE` or an `RLIMIT_RTPRIO`).
///
/// A sampler of normal priority wakes on time only when a core is idle; when the stations keep
/// both cores busy, the scheduler lets it run when a station's thread yields its core, which it
/// does when its queue is empty, after handing its batch on. So its samples found the stations
/// early in the pipeline emptier, and the late ones fuller, than they are on average: in a
/// closed-loop run of 16 messages, the stations' summed population read 14–17% above what
/// Little's law gives from the response times measured directly, and 0.3–4% off at real-time
/// priority (ARCHITECTURE.md, "Sampling"). Sleeping 10 ms between samples of about 30 µs, the
/// sampler takes well under 1% of a core at that priority.
pub fn sample_on_time() -> bool {
    #[cfg(unix)]
    {
        use thread_priority::unix::{
            set_thread_priority_and_policy, thread_native_id, RealtimeThreadSchedulePolicy,
            ThreadSchedulePolicy,
        };
        set_thread_priority_and_policy(
            thread_native_id(),
            thread_priority::ThreadPriority::Min,
            ThreadSchedulePolicy::Realtime(RealtimeThreadSchedulePolicy::Fifo),
        )
        .is_ok()
    }
    #[cfg(not(unix))]
    {
        false
    }
}

/// How often the sampler hands its buffered rows to the file.
const SAMPLES_FLUSH_INTERVAL: Duration = Duration::from_millis(500);

/// Writes every station's counters to `samples.csv` about every `interval` (each wait drawn from
/// 0.5–1.5 intervals) until `stop`; returns whether it sampled on time ([`sample_on_time`]).
pub(crate) fn run_sampler(
    mut out: SampleFiles,
    stations: &[Arc<Station>],
    stop: &AtomicBool,
    interval: Duration,
    clock: RunClock,
) -> Result<bool, PipelineError> {
    let on_time = sample_on_time();
    if !on_time {
        tracing::warn!(
            "the sampler runs at normal priority (real-time priority was refused): on busy \
             cores its samples read early stations emptier and late ones fuller than they are"
        );
    }
    let mut next = Instant::now();
    let mut flushed = Instant::now();
    let mut readings = Vec::with_capacity(stations.len());
    let mut rng = rand::rng();
    loop {
        write_samples(&mut out, stations, &mut readings, clock).map_err(PipelineError::Samples)?;
        // A live dashboard reads the file while the run goes on.
        if flushed.elapsed() >= SAMPLES_FLUSH_INTERVAL {
            out.flush().map_err(PipelineError::Samples)?;
            flushed = Instant::now();
        }
        if stop.load(Ordering::Relaxed) {
            break;
        }
        // Spread at random around the interval: samples at a fixed period can fall in step
        // with the stations' own timed wake-ups and read them at the same phase every time.
        next += interval.mul_f64(rng.random_range(0.5..1.5));
        let now = Instant::now();
        if next > now {
            std::thread::sleep(next - now);
        } else {
            next = now;
        }
    }
    out.flush().map_err(PipelineError::Samples)?;
    Ok(on_time)
}
