//! Instrumentation: one type that every station (a queue with its server) uses to count
//! arrivals A(t), completions C(t), busy time B(t) and station time W(t) = ∫ n dt, the last
//! kept exactly rather than estimated from queue lengths read at instants (a sampler's instants
//! are not independent of what the stations do: ARCHITECTURE.md, "Sampling"). The monitor
//! reads nothing else.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

/// The cumulative counters of one station.
#[derive(Debug)]
pub struct Station {
    name: String,
    /// Counters change together under one lock, a few times per batch, so that a reading is
    /// one instant of the station: its station time needs its population and when that last
    /// changed as one.
    counters: Mutex<Counters>,
}

#[derive(Debug)]
struct Counters {
    arrivals: u64,
    completions: u64,
    busy_ns: u64,
    /// Sum over completed items of (completion time − arrival time), for the directly measured R.
    response_ns: u64,
    /// Station time up to `changed`: ∫ n(t) dt in item-nanoseconds, kept exactly by adding
    /// n · (now − changed) at each arrival and completion.
    station_ns: u64,
    /// When the population last changed, on the station's own monotonic clock.
    changed: Instant,
}

/// A reading of a station's counters, all taken at one instant.
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

impl Counters {
    /// Adds the station time since the last change, at `now`.
    fn accrue(&mut self, now: Instant) {
        let population = self.arrivals.saturating_sub(self.completions);
        let elapsed = now.saturating_duration_since(self.changed).as_nanos() as u64;
        self.station_ns = self
            .station_ns
            .saturating_add(population.saturating_mul(elapsed));
        self.changed = self.changed.max(now);
    }
}

impl Station {
    /// A station with all counters at zero.
    pub fn new(name: impl Into<String>) -> Arc<Self> {
        Arc::new(Self {
            name: name.into(),
            counters: Mutex::new(Counters {
                arrivals: 0,
                completions: 0,
                busy_ns: 0,
                response_ns: 0,
                station_ns: 0,
                changed: Instant::now(),
            }),
        })
    }

    /// The station's name, e.g. `match.0`.
    pub fn name(&self) -> &str {
        &self.name
    }

    fn counters(&self) -> std::sync::MutexGuard<'_, Counters> {
        // The counters are plain sums, each update complete before the lock is released: a
        // panic elsewhere while it was held leaves them consistent.
        self.counters.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Counts `count` arrivals; call before the items are enqueued.
    pub fn arrive(&self, count: u64) {
        let mut counters = self.counters();
        counters.accrue(Instant::now());
        counters.arrivals += count;
    }

    /// Counts `count` completions that took `busy_ns` of service together, and whose
    /// time in the station adds up to `response_ns`.
    pub fn complete(&self, count: u64, busy_ns: u64, response_ns: u64) {
        let mut counters = self.counters();
        counters.accrue(Instant::now());
        counters.busy_ns += busy_ns;
        counters.response_ns = counters.response_ns.wrapping_add(response_ns);
        counters.completions += count;
        debug_assert!(
            counters.completions <= counters.arrivals,
            "{}: more completions than arrivals",
            self.name
        );
    }

    /// Reads the counters, and the station time up to now, at one instant.
    pub fn read(&self) -> StationReading {
        let mut counters = self.counters();
        counters.accrue(Instant::now());
        StationReading {
            arrivals: counters.arrivals,
            completions: counters.completions,
            busy_ns: counters.busy_ns,
            response_ns: counters.response_ns,
            station_ns: counters.station_ns,
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
