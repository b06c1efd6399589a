//! Instrumentation: one type that every station (a queue with its server) uses to count
//! arrivals A(t), completions C(t) and busy time B(t). The monitor reads nothing else.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// The cumulative counters of one station.
#[derive(Debug)]
pub struct Station {
    name: String,
    arrivals: AtomicU64,
    completions: AtomicU64,
    busy_ns: AtomicU64,
    /// Sum over completed items of (completion time − arrival time), for the directly measured R.
    response_ns: AtomicU64,
}

/// A consistent-enough reading of a station's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StationReading {
    pub arrivals: u64,
    pub completions: u64,
    pub busy_ns: u64,
    pub response_ns: u64,
}

impl StationReading {
    /// Items in the station (queued or in service): n = A − C.
    pub fn queue_len(&self) -> u64 {
        self.arrivals.saturating_sub(self.completions)
    }
}

impl Station {
    /// A station with all counters at zero.
    pub fn new(name: impl Into<String>) -> Arc<Self> {
        Arc::new(Self {
            name: name.into(),
            arrivals: AtomicU64::new(0),
            completions: AtomicU64::new(0),
            busy_ns: AtomicU64::new(0),
            response_ns: AtomicU64::new(0),
        })
    }

    /// The station's name, e.g. `match.0`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Counts `count` arrivals; call before the items are enqueued.
    pub fn arrive(&self, count: u64) {
        self.arrivals.fetch_add(count, Ordering::Relaxed);
    }

    /// Counts `count` completions that took `busy_ns` of service together, and whose
    /// time in the station adds up to `response_ns`.
    pub fn complete(&self, count: u64, busy_ns: u64, response_ns: u64) {
        self.busy_ns.fetch_add(busy_ns, Ordering::Relaxed);
        self.response_ns.fetch_add(response_ns, Ordering::Relaxed);
        self.completions.fetch_add(count, Ordering::Relaxed);
    }

    /// Reads the counters. Completions are read first so that n = A − C never goes negative.
    pub fn read(&self) -> StationReading {
        let completions = self.completions.load(Ordering::Relaxed);
        let busy_ns = self.busy_ns.load(Ordering::Relaxed);
        let response_ns = self.response_ns.load(Ordering::Relaxed);
        let arrivals = self.arrivals.load(Ordering::Relaxed);
        StationReading {
            arrivals,
            completions,
            busy_ns,
            response_ns,
        }
    }
}

/// A monotonic clock shared by the whole run: nanoseconds since the run started. Timestamps
/// travel with messages as plain numbers, so pure components never read a clock.
#[derive(Debug, Clone, Copy)]
pub struct RunClock {
    start: Instant,
}

impl RunClock {
    /// Starts the clock now.
    pub fn start() -> Self {
        Self {
            start: Instant::now(),
        }
    }

    /// Nanoseconds since the start.
    pub fn now_ns(&self) -> u64 {
        self.start.elapsed().as_nanos() as u64
    }
}
