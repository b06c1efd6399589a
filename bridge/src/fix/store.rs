//! What a participant's FIX session keeps between its connections: both sequence numbers and
//! the application messages the engine sent it, in memory and, when the listener has a
//! folder for them, in one file per participant that a restarted engine reads back. A Logon
//! with ResetSeqNumFlag starts a session again at 1, and so does the first Logon after the
//! configured daily reset time.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};

use serde::{Deserialize, Serialize};
use tracing::warn;

/// Bytes of application messages the engine keeps per participant for resending; the oldest go
/// first, and a ResendRequest reaching past them gets a GapFill over them.
pub const SENT_BYTES_MAX: usize = 4 << 20;

/// An application message the engine sent, kept for a ResendRequest.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct Sent {
    /// From `35` on, without the header the session adds.
    pub body: Vec<(u32, String)>,
    /// Its SendingTime: OrigSendingTime (`122`) when it is sent again.
    pub sending_time: String,
}

/// What the allocator spends on each heap block besides what was asked for (glibc's malloc:
/// a header word, and blocks rounded up to 16 bytes).
const ALLOCATION_OVERHEAD_BYTES: usize = 16;

impl Sent {
    /// The bytes it holds in memory: its map entry, its field vector and every string's
    /// allocation, counted as the allocator spends them (what [`SENT_BYTES_MAX`] bounds).
    pub fn size(&self) -> usize {
        let block = |capacity: usize| {
            if capacity == 0 {
                0
            } else {
                capacity.next_multiple_of(16) + ALLOCATION_OVERHEAD_BYTES
            }
        };
        // A B-tree entry: key, value and a share of its node.
        let entry = 2 * (std::mem::size_of::<u64>() + std::mem::size_of::<Sent>());
        let fields = block(self.body.capacity() * std::mem::size_of::<(u32, String)>());
        let strings: usize = self
            .body
            .iter()
            .map(|(_, value)| block(value.capacity()))
            .sum();
        entry + fields + strings + block(self.sending_time.capacity())
    }
}

/// The application messages the engine sent a participant, by MsgSeqNum, within
/// [`SENT_BYTES_MAX`].
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
#[serde(from = "BTreeMap<u64, Sent>", into = "BTreeMap<u64, Sent>")]
pub(super) struct SentStore {
    pub messages: BTreeMap<u64, Sent>,
    bytes: usize,
}

impl From<BTreeMap<u64, Sent>> for SentStore {
    /// A store read back, held to the bound again.
    fn from(messages: BTreeMap<u64, Sent>) -> Self {
        let mut store = SentStore::default();
        for (seq, sent) in messages {
            store.keep(seq, sent);
        }
        store
    }
}

impl From<SentStore> for BTreeMap<u64, Sent> {
    fn from(store: SentStore) -> Self {
        store.messages
    }
}

impl SentStore {
    /// Keeps an application message for resending, dropping the oldest beyond the bound.
    pub fn keep(&mut self, seq: u64, sent: Sent) {
        self.bytes += sent.size();
        if let Some(replaced) = self.messages.insert(seq, sent) {
            self.bytes -= replaced.size();
        }
        while self.bytes > SENT_BYTES_MAX {
            let Some((_, oldest)) = self.messages.pop_first() else {
                break;
            };
            self.bytes -= oldest.size();
        }
    }
}

/// What the engine keeps of a participant's session between its connections.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct Kept {
    pub next_out: u64,
    pub next_in: u64,
    /// When these numbers started at 1 (Unix seconds): a daily reset after it starts them
    /// again.
    pub since: i64,
    pub sent: SentStore,
}

impl Kept {
    pub fn fresh(now: time::OffsetDateTime) -> Self {
        Self {
            next_out: 1,
            next_in: 1,
            since: now.unix_timestamp(),
            sent: SentStore::default(),
        }
    }
}

/// The last daily reset at or before `now`: today's `at` (UTC) once it has passed, else
/// yesterday's.
pub fn last_reset(now: time::OffsetDateTime, at: time::Time) -> time::OffsetDateTime {
    let today = now.replace_time(at);
    if today <= now {
        today
    } else {
        today - time::Duration::days(1)
    }
}

/// The next daily reset after `now`.
pub fn next_reset(now: time::OffsetDateTime, at: time::Time) -> time::OffsetDateTime {
    last_reset(now, at) + time::Duration::days(1)
}

/// Largest session file read back: the message bound with room for JSON's escaping.
const FILE_BYTES_MAX: u64 = 4 * SENT_BYTES_MAX as u64;

/// Every participant's [`Kept`] session, shared by the listener's connections (one session
/// per participant at a time). Bounded: one entry per participant of the reference data, each
/// at most [`SENT_BYTES_MAX`] of messages.
#[derive(Debug, Default)]
pub(super) struct SessionBook {
    kept: Mutex<HashMap<String, Kept>>,
    dir: Option<PathBuf>,
    daily_reset: Option<time::Time>,
}

impl SessionBook {
    /// The book of a listener: the sessions kept in `dir` (those of participants `known`
    /// accepts), and the daily reset time.
    pub fn open(
        dir: Option<&Path>,
        daily_reset: Option<time::Time>,
        known: impl Fn(&str) -> bool,
    ) -> Self {
        let mut kept = HashMap::new();
        if let Some(dir) = dir {
            if let Err(error) = std::fs::create_dir_all(dir) {
                warn!(dir = %dir.display(), %error, "FIX session folder not created: sessions are kept in memory only");
            }
            for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
                let path = entry.path();
                let Some(participant) = path
                    .file_name()
                    .and_then(|name| name.to_str())
                    .and_then(|name| name.strip_suffix(".json"))
                else {
                    continue;
                };
                if !known(participant) {
                    continue;
                }
                match read_kept(&path) {
                    Ok(session) => {
                        kept.insert(participant.to_owned(), session);
                    }
                    Err(error) => {
                        warn!(path = %path.display(), %error, "FIX session file not read: that session starts at 1");
                    }
                }
            }
        }
        Self {
            kept: Mutex::new(kept),
            dir: dir.map(Path::to_owned),
            daily_reset,
        }
    }

    /// The session a participant's Logon continues: what was kept, unless `reset`
    /// (ResetSeqNumFlag) or a daily reset since it started says to start at 1.
    pub fn take(&self, participant: &str, reset: bool, now: time::OffsetDateTime) -> Kept {
        let kept = self
            .kept
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(participant);
        let stale = |kept: &Kept| {
            self.daily_reset
                .is_some_and(|at| kept.since < last_reset(now, at).unix_timestamp())
        };
        match kept {
            Some(kept) if !reset && !stale(&kept) => kept,
            _ => Kept::fresh(now),
        }
    }

    /// Puts what a session's next connection continues from into the book, and into its file
    /// (blocking file I/O: call it off the async workers).
    pub fn put(&self, participant: &str, kept: Kept) {
        if let Some(dir) = &self.dir {
            let path = dir.join(format!("{participant}.json"));
            if let Err(error) = write_kept(&path, &kept) {
                warn!(path = %path.display(), %error, "FIX session file not written: a restart starts that session at 1");
            }
        }
        self.put_back(participant, kept);
    }

    /// Puts a session taken with [`SessionBook::take`] back unchanged, as after a refused
    /// Logon: its file already holds it, so nothing is written.
    pub fn put_back(&self, participant: &str, kept: Kept) {
        self.kept
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(participant.to_owned(), kept);
    }

    /// When the next daily reset ends every live session, if one is configured.
    pub fn next_reset(&self, now: time::OffsetDateTime) -> Option<time::OffsetDateTime> {
        self.daily_reset.map(|at| next_reset(now, at))
    }
}

fn read_kept(path: &Path) -> std::io::Result<Kept> {
    use std::io::Read;
    let mut text = Vec::new();
    std::fs::File::open(path)?
        .take(FILE_BYTES_MAX + 1)
        .read_to_end(&mut text)?;
    if text.len() as u64 > FILE_BYTES_MAX {
        return Err(std::io::Error::other(format!(
            "larger than {FILE_BYTES_MAX} bytes"
        )));
    }
    serde_json::from_slice(&text).map_err(std::io::Error::other)
}

/// Written whole beside the file, then renamed over it: a crash leaves the old or the new. The
/// file holds the participant's ACKs and CLS: readable by the engine's user only.
fn write_kept(path: &Path, kept: &Kept) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let partial = path.with_extension("json.partial");
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&partial)?;
    // A partial file left by an older version may have other bits: set them whatever it had.
    file.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    file.write_all(&serde_json::to_vec(kept).map_err(std::io::Error::other)?)?;
    drop(file);
    std::fs::rename(&partial, path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use time::macros::{datetime, time};

    #[test]
    fn the_daily_reset_is_the_last_one_passed() {
        let at = time!(21:30);
        assert_eq!(
            last_reset(datetime!(2026-12-02 22:00 UTC), at),
            datetime!(2026-12-02 21:30 UTC)
        );
        assert_eq!(
            last_reset(datetime!(2026-12-02 21:30 UTC), at),
            datetime!(2026-12-02 21:30 UTC)
        );
        assert_eq!(
            last_reset(datetime!(2026-12-02 03:00 UTC), at),
            datetime!(2026-12-01 21:30 UTC)
        );
        assert_eq!(
            next_reset(datetime!(2026-12-02 03:00 UTC), at),
            datetime!(2026-12-02 21:30 UTC)
        );
    }

    /// A book read back from its folder continues each session; a daily reset passed since
    /// the session started, or ResetSeqNumFlag, starts it at 1; an unknown participant's file
    /// and a damaged file are left out.
    #[test]
    fn sessions_outlive_the_book_until_a_reset() {
        let dir = tempfile::tempdir().expect("a folder");
        let started = datetime!(2026-12-02 08:00 UTC);
        let book = SessionBook::open(Some(dir.path()), Some(time!(21:30)), |_| true);
        let mut kept = book.take("BRKAAU21XXX", false, started);
        assert_eq!((kept.next_out, kept.next_in), (1, 1));
        kept.next_out = 7;
        kept.next_in = 5;
        kept.sent.keep(
            3,
            Sent {
                body: vec![(35, "AR".into()), (571, "X-1".into())],
                sending_time: "20261202-08:00:01.000".into(),
            },
        );
        book.put("BRKAAU21XXX", kept.clone());
        book.put("OTHERXXXXXX", kept);
        // It holds the participant's answers and CLS: its owner's alone.
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.path().join("BRKAAU21XXX.json"))
            .expect("written")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        std::fs::write(dir.path().join("BADFILEXXXX.json"), b"{").expect("writes");

        let known = |bic: &str| bic != "OTHERXXXXXX";
        let again = SessionBook::open(Some(dir.path()), Some(time!(21:30)), known);
        let noon = datetime!(2026-12-02 12:00 UTC);
        let kept = again.take("BRKAAU21XXX", false, noon);
        assert_eq!((kept.next_out, kept.next_in), (7, 5));
        assert_eq!(kept.sent.messages[&3].body[1].1, "X-1");
        again.put("BRKAAU21XXX", kept);
        assert_eq!(again.take("OTHERXXXXXX", false, noon).next_out, 1);
        assert_eq!(again.take("BADFILEXXXX", false, noon).next_out, 1);

        let after_reset = datetime!(2026-12-02 21:31 UTC);
        assert_eq!(again.take("BRKAAU21XXX", false, after_reset).next_out, 1);
        let mut kept = again.take("BRKAAU21XXX", false, noon);
        kept.next_out = 9;
        again.put("BRKAAU21XXX", kept);
        assert_eq!(again.take("BRKAAU21XXX", true, noon).next_out, 1);
    }

    #[test]
    fn a_kept_message_counts_what_it_holds_in_memory() {
        // An ACK: a dozen short fields cost far more than their text.
        let ack = Sent {
            body: (0..12)
                .map(|tag| (tag, "ABCDEFGH".to_owned()))
                .collect::<Vec<_>>(),
            sending_time: "20261202-08:00:01.000".to_owned(),
        };
        let text: usize = ack.body.iter().map(|(_, v)| v.len()).sum();
        let heap = ack.body.capacity() * std::mem::size_of::<(u32, String)>()
            + ack.body.iter().map(|(_, v)| v.capacity()).sum::<usize>();
        assert!(
            ack.size() >= heap + std::mem::size_of::<Sent>(),
            "{}",
            ack.size()
        );
        assert!(
            ack.size() > 5 * text,
            "{} for {text} bytes of text",
            ack.size()
        );
    }

    #[test]
    fn the_store_keeps_its_bound_when_read_back() {
        let mut store = SentStore::default();
        // Just under 1 MiB with what the allocator and the map spend on it: four fit.
        let big = "x".repeat((1 << 20) - 1024);
        for seq in 1..=6 {
            store.keep(
                seq,
                Sent {
                    body: vec![(213, big.clone())],
                    sending_time: String::new(),
                },
            );
        }
        assert!(store.bytes <= SENT_BYTES_MAX);
        assert_eq!(store.messages.keys().next(), Some(&3));
        let mut all: BTreeMap<u64, Sent> = store.messages.clone();
        all.insert(
            0,
            Sent {
                body: vec![(213, big)],
                sending_time: String::new(),
            },
        );
        let read_back = SentStore::from(all);
        assert!(read_back.bytes <= SENT_BYTES_MAX);
        assert_eq!(read_back.messages.len(), 4);
    }
}
