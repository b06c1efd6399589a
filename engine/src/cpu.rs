//! CPU time as Linux counts it for a process or one of its threads, and a ledger of what each
//! kind of station thread used: a message's cost in CPU, told apart by station, in every run.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// Clock ticks per second of `/proc/<pid>/stat` (Linux's USER_HZ, 100 on every architecture it
/// runs on).
pub const USER_HZ: f64 = 100.0;

/// The program name and CPU seconds (user + system) in a `/proc/<pid>/stat` or
/// `/proc/<pid>/task/<tid>/stat` file: a process's covers every thread of it.
pub fn stat_cpu(path: &str) -> Option<(String, f64)> {
    let stat = std::fs::read_to_string(path).ok()?;
    let (open, close) = (stat.find('(')?, stat.rfind(')')?);
    let program = stat.get(open + 1..close)?.to_owned();
    let fields: Vec<&str> = stat.get(close + 1..)?.split_whitespace().collect();
    // After the name: state is field 3 of the line, utime 14 and stime 15.
    let ticks: f64 = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    Some((program, ticks / USER_HZ))
}

/// CPU seconds the calling thread has used (a tick is 10 ms).
pub fn thread_cpu_s() -> Option<f64> {
    stat_cpu("/proc/thread-self/stat").map(|(_, seconds)| seconds)
}

/// CPU seconds of a pipeline's station threads, summed by role: a thread named `matcher-3`
/// counts as `matcher`. Each thread adds its own when it ends.
#[derive(Debug, Default)]
pub struct CpuLedger {
    by_role: Mutex<BTreeMap<String, f64>>,
}

impl CpuLedger {
    /// Adds `seconds` of the thread named `thread` to its role.
    pub fn add(&self, thread: &str, seconds: f64) {
        let role = role_of(thread);
        let mut by_role = self.by_role.lock().unwrap_or_else(|e| e.into_inner());
        *by_role.entry(role.to_owned()).or_default() += seconds;
    }

    /// What has been added so far, by role.
    pub fn by_role(&self) -> BTreeMap<String, f64> {
        self.by_role
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

/// The role of a thread: its name without a `-N` tail (`matcher-3`: `matcher`).
fn role_of(thread: &str) -> &str {
    thread
        .rsplit_once('-')
        .filter(|(_, index)| !index.is_empty() && index.bytes().all(|b| b.is_ascii_digit()))
        .map_or(thread, |(role, _)| role)
}

/// Every thread [`ThreadWatch`] has read, by thread id: its name, CPU at the start, latest
/// reading.
type Seen = HashMap<u32, (String, f64, f64)>;

/// The name of [`ThreadWatch`]'s own thread.
const WATCH_THREAD: &str = "cpu-watch";

/// The CPU of every thread of this process, read from `/proc/self/task` every interval by a
/// thread of its own, for the threads that report nothing themselves (those a library starts,
/// such as SQLite's workers, and the driver's). A thread counts from its CPU at the start, or
/// from nothing if it started later, to its last reading; what a thread spends after its last
/// reading (at most an interval's worth, if it ends before the watch does) is missed.
///
/// Dropped without [`ThreadWatch::finish`] (a run that failed), its thread stops at its next
/// reading.
pub struct ThreadWatch {
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<Seen>>,
}

impl ThreadWatch {
    /// Starts watching, taking every thread's CPU so far as its start.
    pub fn start(interval: Duration) -> Self {
        let mut seen = HashMap::new();
        read_threads(&mut seen, false);
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let handle = std::thread::Builder::new()
            .name(WATCH_THREAD.to_owned())
            .spawn(move || {
                while !flag.load(Ordering::Relaxed) {
                    std::thread::sleep(interval);
                    read_threads(&mut seen, true);
                }
                read_threads(&mut seen, true);
                seen
            })
            .expect("the operating system can start a thread");
        Self {
            stop,
            handle: Some(handle),
        }
    }

    /// Stops watching: the CPU seconds each role's threads spent since the start, the watch's
    /// own thread left out.
    pub fn finish(mut self) -> BTreeMap<String, f64> {
        self.stop.store(true, Ordering::Relaxed);
        let seen = self
            .handle
            .take()
            .and_then(|handle| handle.join().ok())
            .unwrap_or_default();
        let mut by_role = BTreeMap::<String, f64>::new();
        for (name, first, last) in seen.into_values() {
            if name != WATCH_THREAD {
                *by_role.entry(role_of(&name).to_owned()).or_default() += last - first;
            }
        }
        by_role
    }
}

impl Drop for ThreadWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Reads the CPU of every thread of this process into `seen`, by thread id: name, CPU at the
/// start, latest reading. A thread first seen `born_since` the start counts from nothing: all
/// of its CPU was spent since, however late it was first read.
fn read_threads(seen: &mut Seen, born_since: bool) {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return;
    };
    for task in tasks.flatten() {
        let Some(tid) = task
            .file_name()
            .to_str()
            .and_then(|t| t.parse::<u32>().ok())
        else {
            continue;
        };
        if let Some((name, seconds)) = stat_cpu(&format!("/proc/self/task/{tid}/stat")) {
            let start = if born_since { 0.0 } else { seconds };
            let entry = seen.entry(tid).or_insert((name, start, seconds));
            entry.2 = seconds;
        }
    }
}

/// Runs `body`, then adds the CPU its thread used in all to `ledger` under `thread`'s role.
pub(crate) fn counted<T>(ledger: &Arc<CpuLedger>, thread: &str, body: impl FnOnce() -> T) -> T {
    let result = body();
    if let Some(seconds) = thread_cpu_s() {
        ledger.add(thread, seconds);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_counts_its_own_cpu_under_its_role() {
        let ledger = Arc::new(CpuLedger::default());
        let handles: Vec<_> = ["spinner-0", "spinner-1", "sampler"]
            .into_iter()
            .map(|name| {
                let ledger = ledger.clone();
                std::thread::Builder::new()
                    .name(name.to_owned())
                    .spawn(move || {
                        counted(&ledger, name, || {
                            // Busy until the thread's own clock has moved past a few ticks.
                            let mut spins = 0_u64;
                            while thread_cpu_s().unwrap_or(1.0) < 0.05 {
                                spins = std::hint::black_box(spins + 1);
                            }
                        })
                    })
                    .expect("a thread")
            })
            .collect();
        for handle in handles {
            handle.join().expect("joined");
        }
        let by_role = ledger.by_role();
        assert_eq!(by_role.keys().collect::<Vec<_>>(), ["sampler", "spinner"]);
        assert!(by_role["spinner"] >= 0.1, "{by_role:?}");
        assert!(by_role["sampler"] >= 0.05, "{by_role:?}");
        // A name whose tail is no number is a role of its own.
        ledger.add("exception-writer", 0.5);
        assert_eq!(ledger.by_role()["exception-writer"], 0.5);
    }

    #[test]
    fn the_watch_sees_threads_that_report_nothing() {
        let watch = ThreadWatch::start(Duration::from_millis(10));
        let spinner = std::thread::Builder::new()
            .name("library-worker".to_owned())
            .spawn(|| {
                let mut spins = 0_u64;
                while thread_cpu_s().unwrap_or(1.0) < 0.1 {
                    spins = std::hint::black_box(spins + 1);
                }
                // Alive long enough to be read after its work, by a watch reading every 10 ms
                // on a machine busy with other tests.
                std::thread::sleep(Duration::from_millis(200));
            })
            .expect("a thread");
        spinner.join().expect("joined");
        let by_role = watch.finish();
        assert!(by_role["library-worker"] >= 0.05, "{by_role:?}");
        assert!(!by_role.contains_key(WATCH_THREAD), "{by_role:?}");
    }
}
