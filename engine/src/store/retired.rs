//! What a bounded matcher on the embedded store retired from its exact tables, kept on disk: a
//! log-structured merge of write-once sorted runs.
//!
//! A retired generation (at most [`crate::matcher::MatcherMemory::generation_entries`] facts) is
//! sorted and written as one run of fixed-size records — one sequential write, whatever the
//! keys, which a B-tree keyed by a random hash cannot offer — and runs are merged in tiers of
//! [`MERGE_FANOUT`] on a thread of their own, so that, once the merges have caught up, a shard
//! holds at most `MERGE_FANOUT - 1` runs of each size (and never more than [`RUNS_MAX`]) and
//! each fact is rewritten once per tier. A look-up costs, per run, a binary search of the run's
//! fence keys (one per block, in memory) and one read of one block. Where a key is in more than
//! one run, the newest holds its value.
//!
//! The facts are derived from the shard: nothing here is synced, and a matcher rebuilt after a
//! restart starts from an empty directory and writes them again as it takes the shard's history
//! back ([`crate::pipeline`]).

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};

use super::StoreError;
use crate::matcher::{FactKind, HashKey, RetiredEntry};

/// Bytes of a record: the key's two words, the kind, the value.
const RECORD_BYTES: usize = 32;
/// Records of a block: the unit a look-up reads (8 KiB), and the spacing of the fence keys.
const BLOCK_RECORDS: usize = 256;
/// Runs of one size merged into one of the next.
pub const MERGE_FANOUT: usize = 8;
/// Buffer of each file a merge or a write streams through.
const STREAM_BUFFER_BYTES: usize = 64 * 1024;

/// A record's order: by key, then kind.
type SortKey = (u64, u64, u8);

fn sort_key(entry: &RetiredEntry) -> SortKey {
    (entry.key[0], entry.key[1], entry.kind.index())
}

fn encode(entry: &RetiredEntry) -> [u8; RECORD_BYTES] {
    let mut record = [0_u8; RECORD_BYTES];
    record[0..8].copy_from_slice(&entry.key[0].to_le_bytes());
    record[8..16].copy_from_slice(&entry.key[1].to_le_bytes());
    record[16..24].copy_from_slice(&u64::from(entry.kind.index()).to_le_bytes());
    record[24..32].copy_from_slice(&entry.value.to_le_bytes());
    record
}

fn decode(record: &[u8], path: &Path) -> std::io::Result<RetiredEntry> {
    let word = |at: usize| u64::from_le_bytes(record[at..at + 8].try_into().expect("8 bytes"));
    let kind = u8::try_from(word(16))
        .ok()
        .and_then(FactKind::from_index)
        .ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("{}: a record of unknown kind {}", path.display(), word(16)),
            )
        })?;
    Ok(RetiredEntry {
        key: [word(0), word(8)],
        kind,
        value: word(24),
    })
}

/// One sorted run: its file, its size, its tier and the first key of each of its blocks.
struct Run {
    file: File,
    path: PathBuf,
    records: u64,
    tier: u32,
    fences: Vec<SortKey>,
}

impl Run {
    /// Writes `entries` (sorted by [`sort_key`], no key twice) as a run of tier `tier`.
    fn write(
        path: PathBuf,
        tier: u32,
        entries: impl Iterator<Item = std::io::Result<RetiredEntry>>,
    ) -> std::io::Result<Self> {
        let file = File::options()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)?;
        let mut writer = BufWriter::with_capacity(STREAM_BUFFER_BYTES, &file);
        let (mut records, mut fences) = (0_u64, Vec::new());
        let mut last: Option<SortKey> = None;
        for entry in entries {
            let entry = entry?;
            let key = sort_key(&entry);
            assert!(
                last.is_none_or(|last| last < key),
                "a run is sorted, no key twice"
            );
            last = Some(key);
            if records.is_multiple_of(BLOCK_RECORDS as u64) {
                fences.push(key);
            }
            writer.write_all(&encode(&entry))?;
            records += 1;
        }
        writer.flush()?;
        drop(writer);
        Ok(Self {
            file,
            path,
            records,
            tier,
            fences,
        })
    }

    /// The value of `key` in this run, reading one block into `block`.
    fn get(&self, key: SortKey, block: &mut Vec<u8>) -> std::io::Result<Option<RetiredEntry>> {
        // The last block whose first key is not above `key`.
        let index = self.fences.partition_point(|fence| *fence <= key);
        let Some(index) = index.checked_sub(1) else {
            return Ok(None);
        };
        let first = (index * BLOCK_RECORDS) as u64;
        let count = (self.records - first).min(BLOCK_RECORDS as u64) as usize;
        block.resize(count * RECORD_BYTES, 0);
        self.file
            .read_exact_at(block, first * RECORD_BYTES as u64)?;
        let record_key = |at: usize| -> SortKey {
            let record = &block[at * RECORD_BYTES..(at + 1) * RECORD_BYTES];
            let word = |w: usize| u64::from_le_bytes(record[w..w + 8].try_into().expect("8"));
            (word(0), word(8), word(16) as u8)
        };
        let (mut low, mut high) = (0, count);
        while low < high {
            let middle = (low + high) / 2;
            match record_key(middle).cmp(&key) {
                std::cmp::Ordering::Less => low = middle + 1,
                std::cmp::Ordering::Greater => high = middle,
                std::cmp::Ordering::Equal => {
                    let at = middle * RECORD_BYTES;
                    return decode(&block[at..at + RECORD_BYTES], &self.path).map(Some);
                }
            }
        }
        Ok(None)
    }

    /// Its records in order.
    fn stream(&self) -> std::io::Result<impl Iterator<Item = std::io::Result<RetiredEntry>> + '_> {
        let mut reader = BufReader::with_capacity(STREAM_BUFFER_BYTES, File::open(&self.path)?);
        let mut record = [0_u8; RECORD_BYTES];
        Ok((0..self.records).map(move |_| {
            reader.read_exact(&mut record)?;
            decode(&record, &self.path)
        }))
    }
}

/// What a shard's retired facts cost: the figures a run's log reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RetiredStats {
    /// Facts held, counting a key once per run that holds it.
    pub records: u64,
    /// Runs held.
    pub runs: u64,
    /// Records written: by retiring generations, and again by merging runs.
    pub written: u64,
    /// Blocks read by look-ups (the keys looked up are the matcher station's count).
    pub blocks_read: u64,
}

/// Runs a shard may hold before retiring a generation waits for the merges: bounds the blocks
/// a look-up reads should merging fall behind.
const RUNS_MAX: usize = 4 * MERGE_FANOUT;

/// What the matcher's thread and the merging thread share.
struct Shared {
    state: Mutex<State>,
    changed: Condvar,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A merging thread that panicked left the runs as they were.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

struct State {
    /// Oldest first; tiers never rise from oldest to newest.
    runs: Vec<Arc<Run>>,
    next_file: u64,
    /// Records written by retiring and by merging.
    written: u64,
    merging: bool,
    stop: bool,
    /// The merge that failed: every later call returns it.
    failed: Option<std::io::Error>,
}

impl State {
    /// The first [`MERGE_FANOUT`] runs of one tier, oldest first, if some tier has as many:
    /// where they start and their tier. Runs of one tier are side by side.
    fn mergeable(&self) -> Option<(usize, u32)> {
        let mut same = 0;
        for (index, run) in self.runs.iter().enumerate() {
            same = if index > 0 && self.runs[index - 1].tier == run.tier {
                same + 1
            } else {
                1
            };
            if same == MERGE_FANOUT {
                return Some((index + 1 - MERGE_FANOUT, run.tier));
            }
        }
        None
    }

    fn next_path(&mut self, dir: &Path) -> PathBuf {
        self.next_file += 1;
        dir.join(format!("{:08}.run", self.next_file))
    }

    fn check(&self) -> std::io::Result<()> {
        match &self.failed {
            None => Ok(()),
            Some(error) => Err(std::io::Error::new(error.kind(), error.to_string())),
        }
    }
}

/// One shard's retired facts: its sorted runs in a directory of their own. The matcher's thread
/// writes a retired generation as a new run and looks keys up; a thread of its own merges runs
/// in the background, so that a merge (up to a gigabyte for ten million trades) never stops the
/// matcher.
pub struct RetiredRuns {
    dir: PathBuf,
    shared: Arc<Shared>,
    merger: Option<std::thread::JoinHandle<()>>,
    blocks_read: u64,
    /// The runs as a look-up found them, and the block it reads into.
    snapshot: Vec<Arc<Run>>,
    block: Vec<u8>,
}

impl RetiredRuns {
    /// Starts with no facts in `dir`, deleting what a previous process left there: the facts are
    /// the shard's, taken back from it when its matcher is rebuilt.
    pub fn create(dir: &Path) -> Result<Self, StoreError> {
        let failed = |source| StoreError::Retired {
            dir: dir.display().to_string(),
            source,
        };
        match std::fs::remove_dir_all(dir) {
            Ok(()) => {}
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
            Err(error) => return Err(failed(error)),
        }
        std::fs::create_dir_all(dir).map_err(failed)?;
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                runs: Vec::new(),
                next_file: 0,
                written: 0,
                merging: false,
                stop: false,
                failed: None,
            }),
            changed: Condvar::new(),
        });
        let merger = {
            let (shared, dir) = (shared.clone(), dir.to_owned());
            std::thread::Builder::new()
                .name("retired-merge".to_owned())
                .spawn(move || merge_while_running(&shared, &dir))
                .map_err(failed)?
        };
        Ok(Self {
            dir: dir.to_owned(),
            shared,
            merger: Some(merger),
            blocks_read: 0,
            snapshot: Vec::new(),
            block: Vec::with_capacity(BLOCK_RECORDS * RECORD_BYTES),
        })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.shared.lock()
    }

    fn failed(&self, source: std::io::Error) -> StoreError {
        StoreError::Retired {
            dir: self.dir.display().to_string(),
            source,
        }
    }

    /// Keeps the facts of one retired generation (emptying `entries`) as a new run, and wakes
    /// the merging thread. Waits while the shard holds `RUNS_MAX` (32) runs.
    pub fn add(&mut self, entries: &mut Vec<RetiredEntry>) -> Result<(), StoreError> {
        self.write_generation(entries)
            .map_err(|source| self.failed(source))
    }

    fn write_generation(&mut self, entries: &mut Vec<RetiredEntry>) -> std::io::Result<()> {
        if entries.is_empty() {
            return Ok(());
        }
        // Within a generation each table holds a key once; the last of equal keys wins all the
        // same.
        entries.sort_by_key(sort_key);
        entries.dedup_by(|later, earlier| {
            let same = sort_key(later) == sort_key(earlier);
            if same {
                *earlier = *later;
            }
            same
        });
        let path = {
            let mut state = self.state();
            state.check()?;
            state.next_path(&self.dir)
        };
        let run = Run::write(path, 0, entries.drain(..).map(Ok))?;
        let mut state = self.state();
        state.written += run.records;
        state.runs.push(Arc::new(run));
        self.shared.changed.notify_all();
        while state.runs.len() >= RUNS_MAX && state.failed.is_none() {
            state = self
                .shared
                .changed
                .wait(state)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
        state.check()
    }

    /// Waits until no tier holds `MERGE_FANOUT` (8) runs (or a merge failed).
    pub fn wait_for_merges(&self) -> Result<(), StoreError> {
        let mut state = self.state();
        while state.failed.is_none() && (state.merging || state.mergeable().is_some()) {
            state = self
                .shared
                .changed
                .wait(state)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
        state.check().map_err(|source| self.failed(source))
    }

    /// Looks up each of `wanted`, adding what the runs hold of it to `found` (the newest
    /// run's value, where several hold it).
    pub fn lookup(
        &mut self,
        wanted: &[(HashKey, FactKind)],
        found: &mut Vec<RetiredEntry>,
    ) -> Result<(), StoreError> {
        self.look_up(wanted, found)
            .map_err(|source| self.failed(source))
    }

    fn look_up(
        &mut self,
        wanted: &[(HashKey, FactKind)],
        found: &mut Vec<RetiredEntry>,
    ) -> std::io::Result<()> {
        {
            let state = self.shared.lock();
            state.check()?;
            self.snapshot.clear();
            self.snapshot.extend(state.runs.iter().cloned());
        }
        for &(key, kind) in wanted {
            let key = (key[0], key[1], kind.index());
            for run in self.snapshot.iter().rev() {
                if run.fences.first().is_none_or(|first| key < *first) {
                    continue;
                }
                self.blocks_read += 1;
                if let Some(entry) = run.get(key, &mut self.block)? {
                    found.push(entry);
                    break;
                }
            }
        }
        // Merged runs' files close once no look-up holds them.
        self.snapshot.clear();
        Ok(())
    }

    pub fn stats(&self) -> RetiredStats {
        let state = self.state();
        RetiredStats {
            records: state.runs.iter().map(|run| run.records).sum(),
            runs: state.runs.len() as u64,
            written: state.written,
            blocks_read: self.blocks_read,
        }
    }
}

impl Drop for RetiredRuns {
    fn drop(&mut self) {
        self.state().stop = true;
        self.shared.changed.notify_all();
        if let Some(merger) = self.merger.take() {
            // A panic there was reported on its thread; the files are derived and rewritten at
            // the next start.
            let _ = merger.join();
        }
    }
}

/// The merging thread: while the shard runs, merges the oldest [`MERGE_FANOUT`] runs of a tier
/// into one of the next, in place of them. Only this thread takes runs out; the matcher's only
/// appends, so the merged runs are still side by side when the merge is done.
fn merge_while_running(shared: &Shared, dir: &Path) {
    let mut state = shared.lock();
    loop {
        if state.stop || state.failed.is_some() {
            return;
        }
        let Some((start, tier)) = state.mergeable() else {
            state = shared
                .changed
                .wait(state)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            continue;
        };
        let inputs: Vec<Arc<Run>> = state.runs[start..start + MERGE_FANOUT].to_vec();
        let path = state.next_path(dir);
        state.merging = true;
        drop(state);
        let merged = Merge::new(&inputs).and_then(|merge| Run::write(path, tier + 1, merge));
        state = shared.lock();
        state.merging = false;
        match merged {
            Ok(merged) => {
                let at = state
                    .runs
                    .iter()
                    .position(|run| Arc::ptr_eq(run, &inputs[0]))
                    .expect("only the merging thread takes runs out");
                state.written += merged.records;
                state.runs.splice(at..at + MERGE_FANOUT, [Arc::new(merged)]);
                // A look-up that holds one keeps reading it: the file goes when it is closed.
                for input in &inputs {
                    if let Err(error) = std::fs::remove_file(&input.path) {
                        state.failed.get_or_insert(error);
                    }
                }
            }
            Err(error) => state.failed = Some(error),
        }
        shared.changed.notify_all();
    }
}

/// A merge of runs, oldest first, into one stream in key order; of equal keys the newest run's
/// record is kept.
struct Merge<'a> {
    inputs: Vec<std::iter::Peekable<Box<dyn Iterator<Item = std::io::Result<RetiredEntry>> + 'a>>>,
}

impl<'a> Merge<'a> {
    fn new(runs: &'a [Arc<Run>]) -> std::io::Result<Self> {
        let mut inputs = Vec::with_capacity(runs.len());
        for run in runs {
            let stream: Box<dyn Iterator<Item = std::io::Result<RetiredEntry>> + 'a> =
                Box::new(run.stream()?);
            inputs.push(stream.peekable());
        }
        Ok(Self { inputs })
    }
}

impl Iterator for Merge<'_> {
    type Item = std::io::Result<RetiredEntry>;

    fn next(&mut self) -> Option<Self::Item> {
        // The smallest key at the inputs' heads; of equal keys, the newest input's.
        let mut smallest: Option<(SortKey, usize)> = None;
        for (index, input) in self.inputs.iter_mut().enumerate() {
            match input.peek() {
                None => {}
                Some(Err(_)) => return input.next(),
                Some(Ok(entry)) => {
                    let key = sort_key(entry);
                    if smallest.is_none_or(|(least, _)| key <= least) {
                        smallest = Some((key, index));
                    }
                }
            }
        }
        let (key, newest) = smallest?;
        // Older inputs' records of the same key are superseded.
        for input in &mut self.inputs[..newest] {
            if input
                .peek()
                .is_some_and(|head| head.as_ref().is_ok_and(|entry| sort_key(entry) == key))
            {
                input.next();
            }
        }
        self.inputs[newest].next()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(key: u64, kind: FactKind, value: u64) -> RetiredEntry {
        RetiredEntry {
            key: [key.wrapping_mul(0x9E37_79B9_7F4A_7C15), key],
            kind,
            value,
        }
    }

    #[test]
    fn runs_answer_every_retired_fact_with_its_newest_value_across_merges() {
        let dir = tempfile::tempdir().expect("temporary folder");
        let mut runs = RetiredRuns::create(&dir.path().join("retired")).expect("creates");
        // Enough generations for two tiers of merges; every tenth key is retired again, later,
        // with another value, and each key is both Seen and Named.
        let generations = MERGE_FANOUT * MERGE_FANOUT + 3;
        let per_generation = 1_000_u64;
        for generation in 0..generations as u64 {
            let mut entries = Vec::new();
            for i in 0..per_generation {
                let key = generation * per_generation + i;
                entries.push(entry(key, FactKind::Seen, key));
                entries.push(entry(key, FactKind::Named, 0));
                if generation > 0 && i % 10 == 0 {
                    let earlier = key - per_generation;
                    entries.push(entry(earlier, FactKind::Seen, earlier + 1_000_000));
                }
            }
            runs.add(&mut entries).expect("adds");
            assert!(entries.is_empty());
        }
        runs.wait_for_merges().expect("merges");
        let stats = runs.stats();
        // 67 generations with a fanout of 8: one run of tier 2, none of tier 1, three of tier 0.
        assert_eq!(stats.runs, 4, "{stats:?}");
        let total = generations as u64 * per_generation;
        // A key retired again is held twice until the runs that hold it are merged: at most
        // one extra record per tenth key.
        assert!(
            (2 * total..=2 * total + total / 10).contains(&stats.records),
            "{stats:?}"
        );
        let mut found = Vec::new();
        let wanted: Vec<(HashKey, FactKind)> = (0..total)
            .flat_map(|key| {
                let key = entry(key, FactKind::Seen, 0).key;
                [
                    (key, FactKind::Seen),
                    (key, FactKind::Named),
                    (key, FactKind::Closed),
                ]
            })
            .collect();
        runs.lookup(&wanted, &mut found).expect("works");
        // Seen and Named for every key, never Closed.
        assert_eq!(found.len() as u64, 2 * total);
        for fact in &found {
            let key = fact.key[1];
            match fact.kind {
                FactKind::Seen => {
                    let generation = key / per_generation;
                    let retired_again = key % 10 == 0 && generation + 1 < generations as u64;
                    let expected = if retired_again { key + 1_000_000 } else { key };
                    assert_eq!(fact.value, expected, "key {key}");
                }
                FactKind::Named => assert_eq!(fact.value, 0),
                FactKind::Closed => panic!("never retired"),
            }
        }
        // Keys never retired are not found.
        let mut none = Vec::new();
        let absent: Vec<(HashKey, FactKind)> = (total..total + 1_000)
            .map(|key| (entry(key, FactKind::Seen, 0).key, FactKind::Seen))
            .collect();
        runs.lookup(&absent, &mut none).expect("works");
        assert!(none.is_empty());
        // Merged runs' files are gone: one file per run.
        let files = std::fs::read_dir(dir.path().join("retired"))
            .expect("works")
            .count();
        assert_eq!(files as u64, stats.runs);
    }

    #[test]
    fn a_new_set_of_runs_starts_from_an_empty_directory() {
        let dir = tempfile::tempdir().expect("temporary folder");
        let path = dir.path().join("retired");
        let mut runs = RetiredRuns::create(&path).expect("creates");
        runs.add(&mut vec![entry(1, FactKind::Closed, 7)])
            .expect("works");
        drop(runs);
        let mut runs = RetiredRuns::create(&path).expect("creates");
        let mut found = Vec::new();
        runs.lookup(
            &[(entry(1, FactKind::Closed, 0).key, FactKind::Closed)],
            &mut found,
        )
        .expect("works");
        assert!(found.is_empty());
        assert_eq!(std::fs::read_dir(&path).expect("works").count(), 0);
    }
}
