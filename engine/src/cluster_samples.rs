//! Samples of a cluster (DESIGN.md section 6 across nodes): every node publishes its stations'
//! cumulative counters and its resident memory on the plain subject `ste.samples.<node>`; a
//! collector (the driver of a run) writes them into one `samples.csv`, station names prefixed
//! with the node (`n1/match.2`), beside the JetStream queues' own lengths
//! (`jetstream/in.2`, in batches), so that the monitor reads a cluster's run as it reads an
//! in-process one.
//!
//! Counters are cumulative, so a lost notice costs resolution, not correctness. A station that
//! starts again from zero (a node restarted, a shard won back) is a new incarnation:
//! `n1/match.2#1`.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::queue::jetstream::{wall_ns, JetStream};
use crate::station::{RunClock, Station};
use crate::stations::sampler::SampleFiles;

/// The plain subject (after `ste.`) a node publishes its samples on.
pub fn samples_topic(node_id: &str) -> String {
    format!("samples.{}", node_id.replace(['.', '*', '>', ' '], "_"))
}

/// Nodes publish at most this often: their samples cross the network.
pub const NODE_SAMPLE_INTERVAL_MIN: Duration = Duration::from_millis(100);

/// The collector reads the JetStream queues' lengths at most this often: each read is a stream
/// info request, one of the dearer requests a clustered server answers (a sweep level of nine
/// queues read twice every 100 ms spent 5 µs more of the servers' CPU a message with sampling
/// than without: about a millisecond a request).
pub const QUEUE_SAMPLE_INTERVAL_MIN: Duration = Duration::from_millis(500);

/// One station's counters in a node's sample.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StationCount {
    pub name: String,
    pub arrivals: u64,
    pub completions: u64,
    pub busy_ns: u64,
    /// The accumulated station time ∫ n dt, in item-nanoseconds (absent from a node that does
    /// not report it).
    #[serde(default)]
    pub station_ns: Option<u64>,
}

/// What a node publishes at each sampling instant.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeSample {
    pub node: String,
    /// Milliseconds since the Unix epoch when the counters were read.
    pub wall_ms: f64,
    /// The node's resident set size.
    pub rss_kib: u64,
    /// Bytes of its shards' matcher tables ([`crate::matcher::Matcher::table_bytes`]).
    #[serde(default)]
    pub matcher_bytes: u64,
    pub stations: Vec<StationCount>,
}

/// A field of `/proc/<pid>/status` in KiB (`VmRSS`, `VmHWM`; `pid` may be `self`), where the
/// system reports it.
pub fn proc_status_kib(pid: &str, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|line| {
        line.strip_prefix(field)
            .is_some_and(|rest| rest.starts_with(':'))
    })?;
    line.split_whitespace().nth(1)?.parse().ok()
}

fn wall_ms() -> f64 {
    wall_ns() as f64 / 1e6
}

/// What a node runs right now: its stations and its shards' matcher-table sizes, kept by its
/// supervisor and read by its sampler.
#[derive(Clone, Default)]
pub struct StationBoard(Arc<Mutex<Board>>);

#[derive(Default)]
struct Board {
    stations: Vec<Arc<Station>>,
    matcher_tables: Vec<Arc<AtomicU64>>,
}

impl StationBoard {
    /// Replaces what is on the board.
    pub fn set(&self, stations: Vec<Arc<Station>>, matcher_tables: Vec<Arc<AtomicU64>>) {
        *self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Board {
            stations,
            matcher_tables,
        };
    }

    /// The stations' counters and the matcher tables' bytes, read now.
    fn read(&self) -> (Vec<StationCount>, u64) {
        let board = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let stations = board
            .stations
            .iter()
            .map(|station| {
                let reading = station.read();
                StationCount {
                    name: station.name().to_owned(),
                    arrivals: reading.arrivals,
                    completions: reading.completions,
                    busy_ns: reading.busy_ns,
                    station_ns: Some(reading.station_ns),
                }
            })
            .collect();
        let matcher_bytes = board
            .matcher_tables
            .iter()
            .map(|bytes| bytes.load(Ordering::Relaxed))
            .sum();
        (stations, matcher_bytes)
    }
}

/// A node's sampler: publishes the board's counters every interval until stopped.
pub struct NodeSampler {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<()>,
}

impl NodeSampler {
    /// Starts publishing `board`'s counters as `node_id` every `interval` (at least
    /// [`NODE_SAMPLE_INTERVAL_MIN`]).
    pub fn start(
        jetstream: &JetStream,
        node_id: &str,
        board: StationBoard,
        interval: Duration,
    ) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let interval = interval.max(NODE_SAMPLE_INTERVAL_MIN);
        let (jetstream, node, flag) = (jetstream.clone(), node_id.to_owned(), stop.clone());
        let thread = std::thread::Builder::new()
            .name("node-sampler".to_owned())
            .spawn(move || {
                let topic = samples_topic(&node);
                let mut warned = false;
                while !flag.load(Ordering::Relaxed) {
                    let (stations, matcher_bytes) = board.read();
                    let sample = NodeSample {
                        node: node.clone(),
                        wall_ms: wall_ms(),
                        rss_kib: proc_status_kib("self", "VmRSS").unwrap_or_default(),
                        matcher_bytes,
                        stations,
                    };
                    let sent = serde_json::to_vec(&sample)
                        .map_err(|error| error.to_string())
                        .and_then(|payload| {
                            jetstream
                                .notify(&topic, payload)
                                .map_err(|error| error.to_string())
                        });
                    match sent {
                        Err(error) if !warned => {
                            tracing::warn!(%error, "publishing samples failed; trying on");
                            warned = true;
                        }
                        Err(_) => {}
                        Ok(()) => warned = false,
                    }
                    std::thread::sleep(interval);
                }
            })
            .expect("the operating system can start a thread");
        Self { stop, thread }
    }

    /// Stops publishing.
    pub fn stop(self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.thread.join();
    }
}

/// A node's memory over a run, as its samples reported it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NodeMemory {
    /// Readings in order.
    pub readings: Vec<MemoryReading>,
}

/// One sample's memory figures.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MemoryReading {
    /// Milliseconds on the run clock.
    pub t_ms: f64,
    pub rss_kib: u64,
    /// Bytes of the node's matcher tables.
    pub matcher_bytes: u64,
}

/// A figure after warm-up, at its highest and at the end, in MiB.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Span {
    pub first: f64,
    pub peak: f64,
    pub last: f64,
}

impl NodeMemory {
    /// `figure` (MiB) of every reading at or after `from_ms`: the first, the highest and the
    /// last. A flat curve after warm-up has the three close together.
    pub fn span(&self, from_ms: f64, figure: impl Fn(&MemoryReading) -> f64) -> Option<Span> {
        let tail: Vec<f64> = self
            .readings
            .iter()
            .filter(|reading| reading.t_ms >= from_ms)
            .map(figure)
            .collect();
        Some(Span {
            first: *tail.first()?,
            peak: tail.iter().copied().fold(f64::MIN, f64::max),
            last: *tail.last()?,
        })
    }
}

impl MemoryReading {
    /// The resident set in MiB.
    pub fn rss_mib(&self) -> f64 {
        self.rss_kib as f64 / 1024.0
    }

    /// The matcher tables in MiB.
    pub fn matcher_mib(&self) -> f64 {
        self.matcher_bytes as f64 / (1024.0 * 1024.0)
    }
}

/// The last counters seen of a station, and how many times it started again from zero.
#[derive(Default)]
struct Incarnation {
    arrivals: u64,
    completions: u64,
    count: u32,
}

/// Writes the samples of every node of a cluster, and its queues' lengths, into one file.
pub struct SampleCollector {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<std::io::Result<BTreeMap<String, NodeMemory>>>,
}

impl SampleCollector {
    /// Listens to every node's samples and reads the length of each of `queues` (the
    /// cluster's, [`crate::cluster::ClusterLayout::queues`]) every `interval` (at least
    /// [`QUEUE_SAMPLE_INTERVAL_MIN`]), writing
    /// `samples.csv` rows to `path` on `clock`.
    pub fn start(
        jetstream: &JetStream,
        queues: &[String],
        path: &Path,
        interval: Duration,
        clock: RunClock,
    ) -> std::io::Result<Self> {
        let mut out = SampleFiles::create(path)?;
        let mut listener = jetstream
            .listen("samples.>")
            .map_err(std::io::Error::other)?;
        let queues = queues.to_vec();
        let interval = interval.max(QUEUE_SAMPLE_INTERVAL_MIN);
        // The run clock's zero on the wall clock: nodes stamp their samples with the latter.
        let zero_wall_ms = wall_ms() - clock.now_ns() as f64 / 1e6;
        let stop = Arc::new(AtomicBool::new(false));
        let (flag, jetstream) = (stop.clone(), jetstream.clone());
        let thread = std::thread::Builder::new()
            .name("sample-collector".to_owned())
            .spawn(move || {
                let mut seen: BTreeMap<String, Incarnation> = BTreeMap::new();
                let mut memory: BTreeMap<String, NodeMemory> = BTreeMap::new();
                let mut next_tick = Instant::now();
                let mut flushed = Instant::now();
                loop {
                    let now = Instant::now();
                    if now >= next_tick {
                        let t_ms = clock.now_ns() as f64 / 1e6;
                        for queue in &queues {
                            // A queue whose state cannot be read now is read at the next tick.
                            if let Ok(state) = jetstream.queue_state(queue) {
                                out.write_row(
                                    t_ms,
                                    &format!("jetstream/{queue}"),
                                    state.stored_ever,
                                    state.stored_ever.saturating_sub(state.batches),
                                    0,
                                    None,
                                )?;
                            }
                        }
                        next_tick += interval;
                        if next_tick < now {
                            next_tick = now + interval;
                        }
                    }
                    if flushed.elapsed() >= Duration::from_millis(500) {
                        out.flush()?;
                        flushed = Instant::now();
                    }
                    if flag.load(Ordering::Relaxed) {
                        break;
                    }
                    let wait = next_tick.saturating_duration_since(Instant::now());
                    let Some(payload) = listener.next(wait.max(Duration::from_millis(1))) else {
                        continue;
                    };
                    let Ok(sample) = serde_json::from_slice::<NodeSample>(&payload) else {
                        tracing::debug!("a sample that does not decode was left out");
                        continue;
                    };
                    let t_ms = sample.wall_ms - zero_wall_ms;
                    if t_ms < 0.0 {
                        continue;
                    }
                    memory
                        .entry(sample.node.clone())
                        .or_default()
                        .readings
                        .push(MemoryReading {
                            t_ms,
                            rss_kib: sample.rss_kib,
                            matcher_bytes: sample.matcher_bytes,
                        });
                    for station in &sample.stations {
                        let name = format!("{}/{}", sample.node, station.name);
                        let incarnation = seen.entry(name.clone()).or_default();
                        if station.arrivals < incarnation.arrivals
                            || station.completions < incarnation.completions
                        {
                            incarnation.count += 1;
                        }
                        incarnation.arrivals = station.arrivals;
                        incarnation.completions = station.completions;
                        let name = match incarnation.count {
                            0 => name,
                            count => format!("{name}#{count}"),
                        };
                        out.write_row(
                            t_ms,
                            &name,
                            station.arrivals,
                            station.completions,
                            station.busy_ns,
                            station.station_ns,
                        )?;
                    }
                }
                out.flush()?;
                Ok(memory)
            })?;
        Ok(Self { stop, thread })
    }

    /// Stops collecting; every node's memory over the run.
    pub fn stop(self) -> std::io::Result<BTreeMap<String, NodeMemory>> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread
            .join()
            .map_err(|_| std::io::Error::other("the sample collector panicked"))?
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_after_warm_up_reads_first_peak_and_last() {
        let reading = |t_ms, rss_kib| MemoryReading {
            t_ms,
            rss_kib,
            matcher_bytes: 0,
        };
        let memory = NodeMemory {
            readings: vec![
                reading(0.0, 1024),
                reading(10.0, 4096),
                reading(20.0, 3072),
                reading(30.0, 3072),
            ],
        };
        assert_eq!(
            memory.span(10.0, MemoryReading::rss_mib),
            Some(Span {
                first: 4.0,
                peak: 4.0,
                last: 3.0
            })
        );
        assert_eq!(memory.span(40.0, MemoryReading::rss_mib), None);
    }

    #[test]
    fn topics_keep_subject_wildcards_out() {
        assert_eq!(samples_topic("n.1>*"), "samples.n_1__");
    }

    #[test]
    fn this_process_reports_its_memory() {
        assert!(proc_status_kib("self", "VmRSS").is_some_and(|kib| kib > 0));
        assert_eq!(proc_status_kib("self", "NoSuchField"), None);
    }
}
