//! Participants' signing keys: secrets given at start, never reference data.
//!
//! A key file is CSV with the header `bic,key_id,key_hex`. Up to [`KEYS_PER_PARTICIPANT_MAX`]
//! keys of one participant are valid at once, so that a key can be rotated without downtime: a
//! signature checks out under any of them, and the engine signs for a participant (a message it
//! converted from FIX or SOAP) with the one listed last. Keys are at least
//! [`KEY_LEN_MIN_BYTES`] long. Nothing here derives a key from public data: a key set is read
//! from a file or drawn from the operating system's random source.

use std::fmt::Write as _;
use std::io::Write as _;
use std::path::Path;

use rand::Rng;
use serde::Deserialize;

use crate::sign::{self, KeyedMac};

/// Keys of one participant valid at once (the current one and the one being rotated in or out).
pub const KEYS_PER_PARTICIPANT_MAX: usize = 2;
/// Shortest key accepted: HMAC-SHA256 gets no stronger past 32 bytes and is weak well below.
pub const KEY_LEN_MIN_BYTES: usize = 16;
/// Length of the keys this module draws.
pub const KEY_LEN_GENERATED_BYTES: usize = 32;
/// Largest key file read, so that a wrong path cannot make the node read a huge file.
pub const KEY_FILE_MAX_BYTES: u64 = 16 * 1024 * 1024;
/// The header line of a key file.
pub const KEY_FILE_HEADER: &str = "bic,key_id,key_hex";

/// Why a key set could not be read.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("cannot read key file {path}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("key file {path} is larger than {KEY_FILE_MAX_BYTES} bytes")]
    TooLarge { path: String },
    #[error("bad key file, line {line}: {detail}")]
    Row { line: u64, detail: String },
}

/// One participant's key as read from a key file.
#[derive(Clone)]
pub struct KeyEntry {
    pub bic: String,
    pub key_id: String,
    key: Vec<u8>,
}

impl std::fmt::Debug for KeyEntry {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // A key never reaches a log line or a panic message.
        formatter
            .debug_struct("KeyEntry")
            .field("bic", &self.bic)
            .field("key_id", &self.key_id)
            .finish_non_exhaustive()
    }
}

#[derive(Deserialize)]
struct KeyRow {
    bic: String,
    key_id: String,
    key_hex: String,
}

/// A set of participants' keys.
#[derive(Clone, Debug, Default)]
pub struct KeyRing {
    entries: Vec<KeyEntry>,
}

impl KeyRing {
    /// Parses a key file's text. Refuses rows without a BIC or key id, keys that are not hex or
    /// shorter than [`KEY_LEN_MIN_BYTES`], a key id listed twice for one participant, and more
    /// than [`KEYS_PER_PARTICIPANT_MAX`] keys of one participant.
    pub fn parse(text: &str) -> Result<Self, KeyError> {
        let mut reader = csv::Reader::from_reader(text.as_bytes());
        let mut entries: Vec<KeyEntry> = Vec::new();
        for row in reader.deserialize::<KeyRow>() {
            let row = row.map_err(|error| KeyError::Row {
                line: error.position().map_or(0, |p| p.line()),
                // csv's message may quote the row, which holds a key: say only what is wrong.
                detail: match error.kind() {
                    csv::ErrorKind::Deserialize { err, .. } => err.kind().to_string(),
                    csv::ErrorKind::UnequalLengths { .. } => {
                        format!("expected the columns {KEY_FILE_HEADER}")
                    }
                    _ => "not CSV".to_owned(),
                },
            })?;
            let line = entries.len() as u64 + 2;
            let bad = |detail: String| KeyError::Row { line, detail };
            if row.bic.is_empty() || row.key_id.is_empty() {
                return Err(bad("bic and key_id must not be empty".into()));
            }
            let key = hex::decode(row.key_hex.trim())
                .map_err(|_| bad(format!("the key of {} is not hex", row.bic)))?;
            if key.len() < KEY_LEN_MIN_BYTES {
                return Err(bad(format!(
                    "the key of {} is {} bytes, shorter than {KEY_LEN_MIN_BYTES}",
                    row.bic,
                    key.len()
                )));
            }
            let same_participant = entries.iter().filter(|e| e.bic == row.bic);
            if same_participant.clone().any(|e| e.key_id == row.key_id) {
                return Err(bad(format!(
                    "key id {} of {} is listed twice",
                    row.key_id, row.bic
                )));
            }
            if same_participant.count() >= KEYS_PER_PARTICIPANT_MAX {
                return Err(bad(format!(
                    "{} has more than {KEYS_PER_PARTICIPANT_MAX} keys",
                    row.bic
                )));
            }
            entries.push(KeyEntry {
                bic: row.bic,
                key_id: row.key_id,
                key,
            });
        }
        Ok(Self { entries })
    }

    /// Reads a key file.
    pub fn load(path: &Path) -> Result<Self, KeyError> {
        let io = |source| KeyError::Io {
            path: path.display().to_string(),
            source,
        };
        let length = std::fs::metadata(path).map_err(io)?.len();
        if length > KEY_FILE_MAX_BYTES {
            return Err(KeyError::TooLarge {
                path: path.display().to_string(),
            });
        }
        Self::parse(&std::fs::read_to_string(path).map_err(io)?)
    }

    /// One fresh random key (id `k1`) for each of `bics`, from the operating system's random
    /// source: a throw-away key set for a benchmark run or a test.
    pub fn generate<'a>(bics: impl IntoIterator<Item = &'a str>) -> Self {
        // Panics only if the operating system's random source fails: a key needs its bytes.
        let mut rng = rand::rand_core::UnwrapErr(rand::rngs::SysRng);
        let entries = bics
            .into_iter()
            .map(|bic| {
                let mut key = vec![0_u8; KEY_LEN_GENERATED_BYTES];
                rng.fill_bytes(&mut key);
                KeyEntry {
                    bic: bic.to_owned(),
                    key_id: "k1".to_owned(),
                    key,
                }
            })
            .collect();
        Self { entries }
    }

    /// One fresh random key for every participant of `refdata`.
    pub fn generate_for(refdata: &crate::refdata::RefData) -> Self {
        Self::generate(refdata.participants().iter().map(|p| p.bic.as_str()))
    }

    /// Adds a key for `bic` (for rotation: the new key becomes the one the engine signs with).
    pub fn add(&mut self, bic: &str, key_id: &str, key: Vec<u8>) {
        self.entries.push(KeyEntry {
            bic: bic.to_owned(),
            key_id: key_id.to_owned(),
            key,
        });
    }

    /// The key set as the text of a key file.
    pub fn to_csv(&self) -> String {
        let mut out = format!("{KEY_FILE_HEADER}\n");
        for entry in &self.entries {
            let _ = writeln!(
                out,
                "{},{},{}",
                entry.bic,
                entry.key_id,
                hex::encode(&entry.key)
            );
        }
        out
    }

    /// Writes the key set to `path`, readable by its owner only.
    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        write_private(path, self.to_csv().as_bytes())
    }

    /// The entries, in file order.
    pub fn entries(&self) -> &[KeyEntry] {
        &self.entries
    }

    /// The prepared keys of `bic`, in file order.
    pub fn keys_of(&self, bic: &str) -> ParticipantKeys {
        let mut keys = ParticipantKeys::default();
        for entry in self.entries.iter().filter(|e| e.bic == bic) {
            keys.macs.push(sign::keyed(&entry.key));
        }
        keys
    }

    /// The raw key `bic` signs with (the one listed last), for clients that need the bytes.
    pub fn signing_key(&self, bic: &str) -> Option<&[u8]> {
        self.entries
            .iter()
            .rev()
            .find(|e| e.bic == bic)
            .map(|e| e.key.as_slice())
    }
}

/// The prepared signing states of one participant's valid keys.
#[derive(Clone, Debug, Default)]
pub struct ParticipantKeys {
    macs: Vec<KeyedMac>,
}

impl ParticipantKeys {
    /// Whether `signature` over `bytes` checks out under one of the keys (newest first).
    pub fn verify(&self, bytes: &[u8], signature: &[u8]) -> bool {
        self.macs
            .iter()
            .rev()
            .any(|mac| sign::verify_keyed(mac, bytes, signature))
    }

    /// The key the engine signs with for this participant: the one listed last.
    pub fn signing(&self) -> Option<&KeyedMac> {
        self.macs.last()
    }

    /// Whether the participant has no key.
    pub fn is_empty(&self) -> bool {
        self.macs.is_empty()
    }
}

/// Reads the file `path` that holds a secret (trimmed), refusing one that others than its owner
/// may read; every error names the file.
pub fn read_private(path: &Path) -> std::io::Result<String> {
    let named = |error: std::io::Error| {
        std::io::Error::new(error.kind(), format!("{}: {error}", path.display()))
    };
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt as _;
        let mode = std::fs::metadata(path).map_err(named)?.mode();
        if mode & 0o077 != 0 {
            return Err(named(std::io::Error::new(
                std::io::ErrorKind::PermissionDenied,
                format!(
                    "holds a secret but its mode is {:o}: make it readable by its owner only \
                     (chmod 600)",
                    mode & 0o777
                ),
            )));
        }
    }
    Ok(std::fs::read_to_string(path)
        .map_err(named)?
        .trim()
        .to_owned())
}

/// Writes `contents` to `path` as a file readable by its owner only (mode 0600, an existing
/// file narrowed too), synced: for every file that holds a secret.
pub fn write_private(path: &Path, contents: &[u8]) -> std::io::Result<()> {
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt as _;
        options.mode(0o600);
    }
    let mut file = options.open(path)?;
    #[cfg(unix)]
    {
        // `mode` applies only when the file is created: narrow an existing one too.
        use std::os::unix::fs::PermissionsExt as _;
        file.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    }
    file.write_all(contents)?;
    file.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key_hex(byte: u8) -> String {
        hex::encode([byte; 32])
    }

    #[test]
    fn both_keys_of_a_rotation_verify_and_the_last_signs() {
        let text = format!(
            "{KEY_FILE_HEADER}\nAAA,old,{}\nAAA,new,{}\nBBB,k1,{}\n",
            key_hex(1),
            key_hex(2),
            key_hex(3)
        );
        let ring = KeyRing::parse(&text).expect("a valid key file");
        let keys = ring.keys_of("AAA");
        let old = sign::sign(&[1; 32], b"msg");
        let new = sign::sign(&[2; 32], b"msg");
        let other = sign::sign(&[3; 32], b"msg");
        assert!(keys.verify(b"msg", &old));
        assert!(keys.verify(b"msg", &new));
        assert!(!keys.verify(b"msg", &other));
        let signing = keys.signing().expect("a key");
        assert_eq!(sign::sign_keyed(signing, b"msg"), new);
        assert!(ring.keys_of("CCC").is_empty());
        assert_eq!(ring.signing_key("AAA"), Some(&[2_u8; 32][..]));
    }

    #[test]
    fn bad_key_files_are_refused_with_the_line() {
        let cases = [
            (format!("{KEY_FILE_HEADER}\nAAA,k1,zz\n"), "not hex"),
            (format!("{KEY_FILE_HEADER}\nAAA,k1,0011\n"), "shorter"),
            (
                format!(
                    "{KEY_FILE_HEADER}\nAAA,k1,{}\nAAA,k1,{}\n",
                    key_hex(1),
                    key_hex(2)
                ),
                "listed twice",
            ),
            (
                format!(
                    "{KEY_FILE_HEADER}\nAAA,a,{}\nAAA,b,{}\nAAA,c,{}\n",
                    key_hex(1),
                    key_hex(2),
                    key_hex(3)
                ),
                "more than 2 keys",
            ),
            (format!("{KEY_FILE_HEADER}\n,k1,{}\n", key_hex(1)), "empty"),
            (format!("{KEY_FILE_HEADER}\nAAA,k1\n"), "columns"),
        ];
        for (text, expected) in cases {
            let error = KeyRing::parse(&text).expect_err(expected).to_string();
            assert!(error.contains(expected), "{error} lacks {expected}");
            assert!(
                !error.contains(&key_hex(1)),
                "the error quotes a key: {error}"
            );
        }
    }

    #[test]
    fn generated_keys_are_random_and_round_trip_through_a_file() {
        let first = KeyRing::generate(["AAA", "BBB"]);
        let second = KeyRing::generate(["AAA", "BBB"]);
        assert_ne!(first.signing_key("AAA"), second.signing_key("AAA"));
        assert_ne!(first.signing_key("AAA"), first.signing_key("BBB"));
        let dir = tempfile::tempdir().expect("a temporary folder");
        let path = dir.path().join("keys.csv");
        first.write(&path).expect("written");
        let read = KeyRing::load(&path).expect("read back");
        assert_eq!(read.signing_key("BBB"), first.signing_key("BBB"));
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt as _;
            let mode = std::fs::metadata(&path)
                .expect("metadata")
                .permissions()
                .mode();
            assert_eq!(mode & 0o077, 0, "the key file is readable by others");
        }
        assert!(
            !format!("{first:?}").contains(&hex::encode(first.signing_key("AAA").expect("a key")))
        );
    }
}
