//! The sink: consumes the engine's outbound queue, drops repeated CLS (a CLS may be emitted
//! again after a restart or a takeover), records per-trade latency (first message of the trade
//! injected → CLS emitted) in an HdrHistogram, can write every CLS to a file, one per line, and
//! confirms delivery back to the engine once a CLS is written.
//!
//! A shard's CLS arrive in outbox order, and a CLS emitted again is its outbox row again (same
//! ClsId, same outbox id), so a CLS whose outbox id is not above the highest already received
//! from its shard is a repeat: the sink keeps one watermark per shard, and its memory does not
//! grow with the run (a set of every ClsId received had cost 16 bytes and more a trade).
//!
//! Appending to an existing CLS file, the sink first reads the ClsIds it already holds (cutting
//! off a last line that a crash left unfinished), so a CLS emitted again after a restart, whose
//! outbox position this process has not seen, is still recognised as a repeat: those ClsIds are
//! kept, sorted, for the run (16 bytes a line of the file as it was), and only a CLS marked as
//! emitted again is looked up in them (a first emission is a commit of this run).

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::Path;
use std::time::Instant;

use ahash::AHashMap;
use hdrhistogram::Histogram;
use ste_engine::pipeline::{Delivery, OutboundEvent};
use ste_engine::queue::{receive, Rx};
use ste_engine::station::RunClock;
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
    /// CLS received again (at or under their shard's highest outbox id received, or held in the
    /// file appended to), and dropped.
    pub cls_repeats: u64,
    /// CLS that the engine emitted again after a restart (repeats or not).
    pub cls_redelivered: u64,
    /// ClsIds found in the CLS file when the sink started.
    pub cls_already_held: u64,
    /// MISMATCHED status advices received.
    pub mismatched_advices: u64,
    /// AGED advices received.
    pub aged_advices: u64,
    /// RELEASED advices received: strangers' messages that a NOE released from a trade.
    pub released_advices: u64,
    pub latency: Histogram<u64>,
}

impl SinkReport {
    /// The latency distribution as CSV, `percentile,latency_ms,count`: one row per step of
    /// HdrHistogram's percentile iteration (finer towards the tail), for plotting.
    pub fn latency_csv(&self) -> String {
        let mut csv = String::from("percentile,latency_ms,count\n");
        for step in self.latency.iter_quantiles(2) {
            csv.push_str(&format!(
                "{:.6},{:.3},{}\n",
                step.percentile(),
                step.value_iterated_to() as f64 / 1000.0,
                step.count_since_last_iteration()
            ));
        }
        csv
    }

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
    /// Each shard's highest outbox id received.
    through: AHashMap<u32, i64>,
    /// Hashes of the ClsIds in the file appended to, sorted.
    held: Box<[u128]>,
    cls: u64,
    latency: Histogram<u64>,
    cls_out: Option<BufWriter<File>>,
    cls_repeats: u64,
    cls_redelivered: u64,
    cls_already_held: u64,
    mismatched_advices: u64,
    aged_advices: u64,
    released_advices: u64,
}

/// The ClsId of a CLS line.
fn cls_id_of(line: &str) -> Option<&str> {
    let start = line.find("<ClsId>")? + "<ClsId>".len();
    let end = start + line[start..].find("</ClsId>")?;
    Some(&line[start..end])
}

/// Reads the ClsIds of a CLS file (hashed, sorted, without repeats) and cuts off an unfinished
/// last line.
fn read_held(path: &Path) -> std::io::Result<Box<[u128]>> {
    let mut held = Vec::new();
    let mut complete_len: u64 = 0;
    let mut reader = BufReader::new(File::open(path)?);
    let mut line = String::new();
    loop {
        line.clear();
        let read = reader.read_line(&mut line)?;
        if read == 0 || !line.ends_with('\n') {
            break;
        }
        complete_len += read as u64;
        if let Some(cls_id) = cls_id_of(&line) {
            held.push(xxh3_128(cls_id.as_bytes()));
        }
    }
    OpenOptions::new()
        .write(true)
        .open(path)?
        .set_len(complete_len)?;
    held.sort_unstable();
    held.dedup();
    Ok(held.into_boxed_slice())
}

impl Sink {
    /// A sink that writes CLS to `cls_out` when given: a new file, or with `append` the end of
    /// an existing one whose ClsIds count as already seen.
    pub fn new(cls_out: Option<&Path>, append: bool) -> std::io::Result<Self> {
        let mut held = Box::default();
        let cls_out = match cls_out {
            Some(path) if append && path.exists() => {
                held = read_held(path)?;
                Some(BufWriter::new(OpenOptions::new().append(true).open(path)?))
            }
            Some(path) => Some(BufWriter::new(File::create(path)?)),
            None => None,
        };
        let cls_already_held = held.len() as u64;
        let latency = Histogram::new_with_bounds(1, LATENCY_MAX_US, LATENCY_SIGNIFICANT_FIGURES)
            .map_err(|error| std::io::Error::other(error.to_string()))?;
        Ok(Self {
            through: AHashMap::new(),
            held,
            cls: 0,
            latency,
            cls_out,
            cls_repeats: 0,
            cls_redelivered: 0,
            cls_already_held,
            mismatched_advices: 0,
            aged_advices: 0,
            released_advices: 0,
        })
    }

    /// Takes one outbound event received at `now_ns` on the run clock.
    pub fn accept(&mut self, event: OutboundEvent, now_ns: u64) -> std::io::Result<()> {
        match event {
            OutboundEvent::Cls {
                cls_id,
                body,
                trade_first_injected_ns,
                shard,
                outbox_id,
                redelivered,
            } => {
                self.cls_redelivered += u64::from(redelivered);
                // One look-up a CLS: a shard's first CLS finds nothing below it.
                let through = self.through.entry(shard).or_insert(i64::MIN);
                let repeat = outbox_id <= *through
                    || (redelivered
                        && self
                            .held
                            .binary_search(&xxh3_128(cls_id.as_bytes()))
                            .is_ok());
                *through = (*through).max(outbox_id);
                if repeat {
                    self.cls_repeats += 1;
                    return Ok(());
                }
                self.cls += 1;
                // A CLS emitted again after a restart has no injection time in this run.
                if !redelivered {
                    let latency_us = now_ns.saturating_sub(trade_first_injected_ns) / 1000;
                    self.latency.saturating_record(latency_us.max(1));
                }
                if let Some(out) = &mut self.cls_out {
                    out.write_all(body.as_bytes())?;
                    out.write_all(b"\n")?;
                }
            }
            OutboundEvent::Mismatched(_) => self.mismatched_advices += 1,
            OutboundEvent::Aged(_) => self.aged_advices += 1,
            OutboundEvent::Released(_) => self.released_advices += 1,
        }
        Ok(())
    }

    /// Pushes what was written to the file, so that it can be confirmed.
    pub fn flush(&mut self) -> std::io::Result<()> {
        if let Some(out) = &mut self.cls_out {
            out.flush()?;
        }
        Ok(())
    }

    /// Flushes the CLS file and reports.
    pub fn finish(mut self) -> std::io::Result<SinkReport> {
        self.flush()?;
        Ok(SinkReport {
            cls: self.cls,
            cls_repeats: self.cls_repeats,
            cls_redelivered: self.cls_redelivered,
            cls_already_held: self.cls_already_held,
            mismatched_advices: self.mismatched_advices,
            aged_advices: self.aged_advices,
            released_advices: self.released_advices,
            latency: self.latency,
        })
    }
}

/// Consumes `events` until the engine closes the queue, counting each as a completion of the
/// queue's station (`outbound`), and confirms each batch's CLS through `delivery` once they
/// are written.
pub fn run(
    events: Rx<OutboundEvent>,
    sink: Sink,
    clock: RunClock,
    delivery: Option<Delivery>,
) -> std::io::Result<SinkReport> {
    run_with(events, sink, clock, delivery, |_| {})
}

/// [`run`], handing every event to `tap` first (a gateway pushes CLS and advices to the
/// participants connected to it); `tap` must not block.
pub fn run_with(
    events: Rx<OutboundEvent>,
    mut sink: Sink,
    clock: RunClock,
    delivery: Option<Delivery>,
    mut tap: impl FnMut(&OutboundEvent),
) -> std::io::Result<SinkReport> {
    let mut confirmations: Vec<(u32, i64)> = Vec::new();
    while let Some(received) = receive(&events).map_err(std::io::Error::other)? {
        let (batch, enqueued_ns) = (received.items, received.enqueued_ns);
        let started = Instant::now();
        let count = batch.len() as u64;
        confirmations.clear();
        for event in batch {
            let now_ns = clock.now_ns();
            if let OutboundEvent::Cls {
                shard, outbox_id, ..
            } = &event
            {
                confirmations.push((*shard, *outbox_id));
            }
            tap(&event);
            sink.accept(event, now_ns)?;
        }
        if let Some(delivery) = &delivery {
            if !confirmations.is_empty() {
                sink.flush()?;
                // A confirmation that is not recorded costs a repeat after a restart or a
                // takeover (which the sink drops), nothing more; the next one covers it.
                if let Err(error) = delivery.confirm_all(&confirmations) {
                    tracing::warn!(%error, "a delivery confirmation was not recorded");
                }
            }
        }
        // Each item's time at the station, on the queue's own clock (across nodes: the wall
        // clock), runs to the batch's completion, after the flush and the confirmations, where
        // the station's count of completions is taken: Little's law pairs the two.
        let response_ns = count * events.now_ns().saturating_sub(enqueued_ns);
        events
            .station()
            .complete(count, started.elapsed().as_nanos() as u64, response_ns);
        received.receipt.ack().map_err(std::io::Error::other)?;
    }
    if let Some(delivery) = &delivery {
        if let Err(error) = delivery.flush() {
            tracing::warn!(%error, "the last delivery confirmations were not recorded");
        }
    }
    sink.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cls_at(id: &str, shard: u32, outbox_id: i64, redelivered: bool) -> OutboundEvent {
        OutboundEvent::Cls {
            cls_id: id.to_owned(),
            body: format!("<Cls><ClsId>{id}</ClsId></Cls>"),
            trade_first_injected_ns: 0,
            shard,
            outbox_id,
            redelivered,
        }
    }

    fn cls(id: &str, outbox_id: i64, injected_ns: u64) -> OutboundEvent {
        let mut event = cls_at(id, 0, outbox_id, false);
        if let OutboundEvent::Cls {
            trade_first_injected_ns,
            ..
        } = &mut event
        {
            *trade_first_injected_ns = injected_ns;
        }
        event
    }

    #[test]
    fn repeats_are_dropped_and_latency_recorded() {
        let dir = tempfile::tempdir().expect("temporary folder");
        let path = dir.path().join("cls.xml");
        let mut sink = Sink::new(Some(&path), false).expect("sink");
        sink.accept(cls("CLS-A-1", 1, 0), 2_000_000)
            .expect("accepts");
        sink.accept(cls("CLS-A-1", 1, 0), 3_000_000)
            .expect("accepts");
        sink.accept(cls("CLS-A-2", 2, 1_000_000), 5_000_000)
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

    #[test]
    fn each_shard_has_its_own_watermark_and_what_a_takeover_emits_again_is_a_repeat() {
        let mut sink = Sink::new(None, false).expect("sink");
        // Two shards interleaved, outbox ids with gaps (retention, rolled-back sequences).
        for (id, shard, outbox_id) in [
            ("CLS-A-1", 0, 5),
            ("CLS-B-1", 1, 1),
            ("CLS-A-2", 0, 9),
            ("CLS-B-2", 1, 2),
        ] {
            sink.accept(cls_at(id, shard, outbox_id, false), 1_000)
                .expect("accepts");
        }
        // A new owner of shard 0 emits again above the last watermark it read (5), then what it
        // commits itself; a late CLS of the old owner arrives after them.
        for (id, outbox_id, redelivered) in [
            ("CLS-A-2", 9, true),
            ("CLS-A-3", 12, true),
            ("CLS-A-4", 13, false),
            ("CLS-A-3", 12, false),
        ] {
            sink.accept(cls_at(id, 0, outbox_id, redelivered), 1_000)
                .expect("accepts");
        }
        let report = sink.finish().expect("finishes");
        assert_eq!(
            (report.cls, report.cls_repeats, report.cls_redelivered),
            (6, 2, 2)
        );
        // Only first emissions of this run are timed.
        assert_eq!(report.latency.len(), 5);
    }

    #[test]
    fn appending_remembers_what_the_file_holds_and_cuts_a_torn_line() {
        let dir = tempfile::tempdir().expect("temporary folder");
        let path = dir.path().join("cls.xml");
        std::fs::write(
            &path,
            "<Cls><ClsId>CLS-A-1</ClsId></Cls>\n<Cls><ClsId>CLS-A-2</ClsId></Cls>\n<Cls><ClsId>CLS-A",
        )
        .expect("writes");
        let mut sink = Sink::new(Some(&path), true).expect("sink");
        // Emitted again after the restart: one the file holds, one it does not.
        sink.accept(cls_at("CLS-A-2", 0, 2, true), 1_000)
            .expect("accepts");
        sink.accept(cls_at("CLS-A-3", 0, 3, true), 1_000)
            .expect("accepts");
        sink.accept(cls("CLS-A-4", 4, 0), 1_000).expect("accepts");
        let report = sink.finish().expect("finishes");
        assert_eq!(
            (report.cls, report.cls_repeats, report.cls_already_held),
            (2, 1, 2)
        );
        let written = std::fs::read_to_string(&path).expect("cls file");
        let ids: Vec<&str> = written.lines().filter_map(cls_id_of).collect();
        assert_eq!(ids, ["CLS-A-1", "CLS-A-2", "CLS-A-3", "CLS-A-4"]);
    }
}
