//! The sink: consumes the engine's outbound queue, drops repeated CLS by ClsId (a CLS may be
//! re-emitted after a restart), records per-trade latency (first message of the trade injected →
//! CLS emitted) in an HdrHistogram, and can write every CLS to a file, one per line.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use ahash::AHashSet;
use crossbeam_channel::Receiver;
use hdrhistogram::Histogram;
use ste_engine::pipeline::OutboundEvent;
use ste_engine::station::{RunClock, Station};
use xxhash_rust::xxh3::xxh3_128;

/// Highest latency the histogram records, in microseconds (one hour); larger values saturate.
const LATENCY_MAX_US: u64 = 3_600_000_000;
/// Significant figures kept by the histogram.
const LATENCY_SIGNIFICANT_FIGURES: u8 = 3;

/// Latency percentiles in milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LatencyMs {
    pub p50: f64,
    pub p99: f64,
    pub p999: f64,
    pub max: f64,
    pub mean: f64,
}

/// What the sink saw.
#[derive(Debug, Clone)]
pub struct SinkReport {
    /// Distinct CLS received.
    pub cls: u64,
    /// CLS received again with a ClsId already seen, and dropped.
    pub cls_repeats: u64,
    /// MISMATCHED status advices received.
    pub mismatched_advices: u64,
    pub latency: Histogram<u64>,
}

impl SinkReport {
    /// Latency percentiles of the CLS received.
    pub fn latency_ms(&self) -> LatencyMs {
        if self.latency.is_empty() {
            return LatencyMs::default();
        }
        let ms = |us: u64| us as f64 / 1000.0;
        LatencyMs {
            p50: ms(self.latency.value_at_quantile(0.50)),
            p99: ms(self.latency.value_at_quantile(0.99)),
            p999: ms(self.latency.value_at_quantile(0.999)),
            max: ms(self.latency.max()),
            mean: self.latency.mean() / 1000.0,
        }
    }
}

/// The sink's state.
pub struct Sink {
    seen: AHashSet<u128>,
    latency: Histogram<u64>,
    cls_out: Option<BufWriter<File>>,
    cls_repeats: u64,
    mismatched_advices: u64,
}

impl Sink {
    /// A sink that writes CLS to `cls_out` when given.
    pub fn new(cls_out: Option<&Path>) -> std::io::Result<Self> {
        let cls_out = match cls_out {
            Some(path) => Some(BufWriter::new(File::create(path)?)),
            None => None,
        };
        let latency = Histogram::new_with_bounds(1, LATENCY_MAX_US, LATENCY_SIGNIFICANT_FIGURES)
            .map_err(|error| std::io::Error::other(error.to_string()))?;
        Ok(Self {
            seen: AHashSet::new(),
            latency,
            cls_out,
            cls_repeats: 0,
            mismatched_advices: 0,
        })
    }

    /// Takes one outbound event received at `now_ns` on the run clock.
    pub fn accept(&mut self, event: OutboundEvent, now_ns: u64) -> std::io::Result<()> {
        match event {
            OutboundEvent::Cls {
                cls_id,
                body,
                trade_first_injected_ns,
            } => {
                if !self.seen.insert(xxh3_128(cls_id.as_bytes())) {
                    self.cls_repeats += 1;
                    return Ok(());
                }
                let latency_us = now_ns.saturating_sub(trade_first_injected_ns) / 1000;
                self.latency.saturating_record(latency_us.max(1));
                if let Some(out) = &mut self.cls_out {
                    out.write_all(body.as_bytes())?;
                    out.write_all(b"\n")?;
                }
            }
            OutboundEvent::Mismatched(_) => self.mismatched_advices += 1,
        }
        Ok(())
    }

    /// Flushes the CLS file and reports.
    pub fn finish(mut self) -> std::io::Result<SinkReport> {
        if let Some(out) = &mut self.cls_out {
            out.flush()?;
        }
        Ok(SinkReport {
            cls: self.seen.len() as u64,
            cls_repeats: self.cls_repeats,
            mismatched_advices: self.mismatched_advices,
            latency: self.latency,
        })
    }
}

/// Consumes `events` until the engine closes the queue, counting each as a completion of the
/// `outbound` station.
pub fn run(
    events: Receiver<(Vec<OutboundEvent>, u64)>,
    mut sink: Sink,
    station: Arc<Station>,
    clock: RunClock,
) -> std::io::Result<SinkReport> {
    for (batch, enqueued_ns) in events {
        let started = Instant::now();
        let count = batch.len() as u64;
        let mut response_ns = 0;
        for event in batch {
            let now_ns = clock.now_ns();
            response_ns += now_ns.saturating_sub(enqueued_ns);
            sink.accept(event, now_ns)?;
        }
        station.complete(count, started.elapsed().as_nanos() as u64, response_ns);
    }
    sink.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cls(id: &str, injected_ns: u64) -> OutboundEvent {
        OutboundEvent::Cls {
            cls_id: id.to_owned(),
            body: format!("<Cls><ClsId>{id}</ClsId></Cls>"),
            trade_first_injected_ns: injected_ns,
        }
    }

    #[test]
    fn repeats_are_dropped_and_latency_recorded() {
        let dir = tempfile::tempdir().expect("temporary folder");
        let path = dir.path().join("cls.xml");
        let mut sink = Sink::new(Some(&path)).expect("sink");
        sink.accept(cls("CLS-A-1", 0), 2_000_000).expect("accepts");
        sink.accept(cls("CLS-A-1", 0), 3_000_000).expect("accepts");
        sink.accept(cls("CLS-A-2", 1_000_000), 5_000_000)
            .expect("accepts");
        let report = sink.finish().expect("finishes");
        assert_eq!(report.cls, 2);
        assert_eq!(report.cls_repeats, 1);
        let latency = report.latency_ms();
        assert!((latency.max - 4.0).abs() < 0.01, "{latency:?}");
        assert!((latency.p50 - 2.0).abs() < 0.01, "{latency:?}");
        let written = std::fs::read_to_string(&path).expect("cls file");
        assert_eq!(written.lines().count(), 2);
    }
}
