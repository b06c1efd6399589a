//! Instrumentation: one type that every station (a queue with its server) uses to count
//! arrivals A(t), completions C(t), busy time B(t) and station time W(t) = ∫ n dt, the last
//! kept exactly rather than estimated from queue lengths read at instants (a sampler's instants
//! are not independent of what the stations do: ARCHITECTURE.md, "Station time"). The monitor
//! reads nothing else.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

/// The cumulative counters of one station.
///
/// Station time is kept as W(t) = ∫ A dt − ∫ C dt = t·(A − C) − Σ a + Σ c, with Σ a the sum of
/// the arrivals' instants and Σ c that of the completions' (one per item, in nanoseconds since
/// the station was made, wrapping: the difference is exact while W stays below 2⁶⁴ item-ns,
/// 584 item-years). Each side's count and sum of instants change together under that side's
/// lock, so a queue's producers and its consumer never wait for each other, and a reading sees
/// each pair whole.
#[derive(Debug)]
pub struct Station {
    name: String,
    epoch: Instant,
    arrived: Mutex<Side>,
    completed: Mutex<Completed>,
}

/// One side's items and the sum of the instants they passed it.
#[derive(Debug, Default, Clone, Copy)]
struct Side {
    items: u64,
    instants_ns: u64,
}

#[derive(Debug, Default)]
struct Completed {
    side: Side,
    busy_ns: u64,
    /// Sum over completed items of (completion time − arrival time), for the directly measured R.
    response_ns: u64,
}

/// A reading of a station's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StationReading {
    pub arrivals: u64,
    pub completions: u64,
    pub busy_ns: u64,
    pub response_ns: u64,
    /// The accumulated station time ∫ n(t) dt up to the reading, in item-nanoseconds.
    pub station_ns: u64,
}

impl StationReading {
    /// Items in the station (queued or in service): n = A − C.
    pub fn queue_len(&self) -> u64 {
        self.arrivals.saturating_sub(self.completions)
    }
}

impl Side {
    fn pass(&mut self, count: u64, at_ns: u64) {
        self.items += count;
        self.instants_ns = self.instants_ns.wrapping_add(count.wrapping_mul(at_ns));
    }

    /// ∫ (items) dt from the epoch to `now_ns`.
    fn integral(&self, now_ns: u64) -> u64 {
        self.items
            .wrapping_mul(now_ns)
            .wrapping_sub(self.instants_ns)
    }
}

fn whole<T>(lock: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every update is complete before its lock is released: a panic elsewhere while one was
    // held leaves the counters consistent.
    lock.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Station {
    /// A station with all counters at zero.
    pub fn new(name: impl Into<String>) -> Arc<Self> {
        Arc::new(Self {
            name: name.into(),
            epoch: Instant::now(),
            arrived: Mutex::default(),
            completed: Mutex::default(),
        })
    }

    /// The station's name, e.g. `match.0`.
    pub fn name(&self) -> &str {
        &self.name
    }

    fn now_ns(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    /// Counts `count` arrivals; call before the items are enqueued.
    pub fn arrive(&self, count: u64) {
        let now = self.now_ns();
        whole(&self.arrived).pass(count, now);
    }

    /// Counts `count` completions that took `busy_ns` of service together, and whose
    /// time in the station adds up to `response_ns`.
    pub fn complete(&self, count: u64, busy_ns: u64, response_ns: u64) {
        let now = self.now_ns();
        let mut completed = whole(&self.completed);
        completed.side.pass(count, now);
        completed.busy_ns += busy_ns;
        completed.response_ns = completed.response_ns.wrapping_add(response_ns);
    }

    /// Reads the counters. Completions are read first, so that n = A − C never goes negative,
    /// and the instant last, so that every item counted has its instant before it: the station
    /// time then holds each item that arrived up to the reading, and one that completed in the
    /// nanoseconds between the two reads as still there until the instant.
    pub fn read(&self) -> StationReading {
        let (completed, busy_ns, response_ns) = {
            let completed = whole(&self.completed);
            (completed.side, completed.busy_ns, completed.response_ns)
        };
        let arrived = *whole(&self.arrived);
        let now = self.now_ns();
        debug_assert!(
            completed.items <= arrived.items,
            "{}: more completions than arrivals",
            self.name
        );
        StationReading {
            arrivals: arrived.items,
            completions: completed.items,
            busy_ns,
            response_ns,
            station_ns: arrived.integral(now).wrapping_sub(completed.integral(now)),
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn station_time_is_the_population_integrated_over_time() {
        let station = Station::new("s");
        let before_arrival = Instant::now();
        station.arrive(2);
        let after_arrival = Instant::now();
        std::thread::sleep(Duration::from_millis(20));
        let before_completion = Instant::now();
        station.complete(1, 0, 0);
        let after_completion = Instant::now();
        std::thread::sleep(Duration::from_millis(20));
        let before_reading = Instant::now();
        let reading = station.read();
        let after_reading = Instant::now();
        // Two items from the arrival to the completion, then one until the reading: the
        // counter's instants lie between the ones taken around each call.
        let ns = |from: Instant, to: Instant| to.duration_since(from).as_nanos() as u64;
        let least = 2 * ns(after_arrival, before_completion) + ns(after_completion, before_reading);
        let most = 2 * ns(before_arrival, after_completion) + ns(before_completion, after_reading);
        assert!(
            (least..=most).contains(&reading.station_ns),
            "{} not in {least}..={most}",
            reading.station_ns
        );
        assert_eq!((reading.arrivals, reading.completions), (2, 1));
        // An empty station accrues nothing.
        station.complete(1, 0, 0);
        let emptied = station.read().station_ns;
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(station.read().station_ns, emptied);
    }
}
