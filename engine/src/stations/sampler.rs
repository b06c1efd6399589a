//! The sampler: reads every station's counters at a fixed interval (DESIGN.md section 6).

use std::fs::File;
use std::io::{BufWriter, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::network::PipelineError;
use crate::station::{RunClock, Station};

/// The header of `samples.csv`.
pub const SAMPLES_HEADER: &str = "t_ms,station,queue_len,arrivals,completions,busy_ms";

/// One row of `samples.csv`: a station's cumulative counters at `t_ms`; its length is
/// arrivals less completions.
pub(crate) fn write_row(
    out: &mut impl Write,
    t_ms: f64,
    station: &str,
    arrivals: u64,
    completions: u64,
    busy_ns: u64,
) -> std::io::Result<()> {
    writeln!(
        out,
        "{t_ms:.3},{station},{},{arrivals},{completions},{:.3}",
        arrivals.saturating_sub(completions),
        busy_ns as f64 / 1e6
    )
}

fn write_samples(
    out: &mut impl Write,
    stations: &[Arc<Station>],
    clock: RunClock,
) -> std::io::Result<()> {
    let t_ms = clock.now_ns() as f64 / 1e6;
    for station in stations {
        let reading = station.read();
        write_row(
            out,
            t_ms,
            station.name(),
            reading.arrivals,
            reading.completions,
            reading.busy_ns,
        )?;
    }
    Ok(())
}

/// How often the sampler hands its buffered rows to the file.
const SAMPLES_FLUSH_INTERVAL: Duration = Duration::from_millis(500);

/// Writes every station's counters to `samples.csv` every `interval` until `stop`.
pub(crate) fn run_sampler(
    mut out: BufWriter<File>,
    stations: &[Arc<Station>],
    stop: &AtomicBool,
    interval: Duration,
    clock: RunClock,
) -> Result<(), PipelineError> {
    writeln!(out, "{SAMPLES_HEADER}").map_err(PipelineError::Samples)?;
    let mut next = Instant::now();
    let mut flushed = Instant::now();
    loop {
        write_samples(&mut out, stations, clock).map_err(PipelineError::Samples)?;
        // A live dashboard reads the file while the run goes on.
        if flushed.elapsed() >= SAMPLES_FLUSH_INTERVAL {
            out.flush().map_err(PipelineError::Samples)?;
            flushed = Instant::now();
        }
        if stop.load(Ordering::Relaxed) {
            break;
        }
        next += interval;
        let now = Instant::now();
        if next > now {
            std::thread::sleep(next - now);
        } else {
            next = now;
        }
    }
    out.flush().map_err(PipelineError::Samples)
}
