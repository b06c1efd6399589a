//! The command-line options that the engine (`engine`) and the load driver (`driver`) share,
//! defined once here and flattened into both: where the shards keep their rows and how many
//! there are, the validators, the shards' backlog, how long rows are kept, when unmatched trades
//! age out, what a matcher keeps in memory, sampling, the matching profile and the bound of a
//! writer's transaction ([`PipelineArgs`]); and the certificate a process shows over TLS
//! ([`TlsIdentityArgs`]).
//!
//! [`PipelineArgs::resolve`] checks them together, once, and gives [`Settings`]: a process in
//! one piece takes its [`PipelineConfig`] from them ([`Settings::pipeline`]), a node of a
//! cluster its shards' databases, memory, aging, sampling and transaction bound. No binary
//! repeats a default or a check of these options.

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Args, ValueEnum};

use crate::cluster::OWNER_BATCH_MAX;
use crate::matcher::MatcherMemory;
use crate::pipeline::{
    Aging, BatchBound, PipelineConfig, StoreConfig, CLUSTER_SHARD_BACKLOG_BYTES_DEFAULT,
    SHARD_BACKLOG_BYTES_DEFAULT, UNCHECKED_EXCEPTION_DAYS_DEFAULT,
};
use crate::profile::{ProfileError, Tolerances};

/// Shards of the memory and embedded stores unless `--shards` says otherwise.
pub const SHARDS_DEFAULT: u32 = 2;

/// Validators of a process in one piece unless `--validators` says otherwise.
pub const VALIDATORS_DEFAULT: u32 = 2;

/// Milliseconds between two samples of every station unless `--sample-ms` says otherwise.
pub const SAMPLE_MS_DEFAULT: u64 = 10;

/// Where the shards keep their rows.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum StoreKind {
    /// Rows in process memory, for measuring the engine without storage: it keeps every
    /// message, trade and CLS until the process ends, and its matchers every message key, so
    /// its memory grows with the load.
    Memory,
    /// One SQLite file per shard in the process's folder (the default of a process in one
    /// piece), and beside it the facts its bounded matcher retired (shard-N.retired/).
    Embedded,
    /// One PostgreSQL database per shard (--db): the only store every node of a cluster can
    /// reach.
    Postgres,
}

impl StoreKind {
    /// The name used on the command line and in run summaries.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Memory => "memory",
            Self::Embedded => "embedded",
            Self::Postgres => "postgres",
        }
    }
}

/// Whether the options configure one process that holds its shards itself, or the shards of a
/// cluster, which any node may take over.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Scope {
    InProcess,
    Cluster,
}

/// The pipeline's options, shared by `engine` and `driver`.
#[derive(Args, Clone, Debug)]
pub struct PipelineArgs {
    /// Where the shards keep their rows (default: embedded; in a cluster, postgres).
    #[arg(long, value_enum, env = "STE_STORE")]
    pub store: Option<StoreKind>,
    /// A shard's database URL (postgres store), in shard order: --db once per shard, or the
    /// URLs separated by commas (or STE_DATABASE_URLS).
    #[arg(
        long = "db",
        value_name = "URL",
        env = "STE_DATABASE_URLS",
        value_delimiter = ','
    )]
    pub db: Vec<String>,
    /// Number of shards (a matcher, a writer and a store each); default 2, on the postgres
    /// store the number of database URLs.
    #[arg(long, env = "STE_SHARDS")]
    pub shards: Option<u32>,
    /// Number of validators (and sharded inbound queues) of a process in one piece; in a
    /// cluster each shard's owner runs one on the shard's inbound queue.
    #[arg(long, env = "STE_VALIDATORS", default_value_t = VALIDATORS_DEFAULT)]
    pub validators: u32,
    /// MiB a shard's match queue may hold: the backlog of a shard whose store stalls (its
    /// database down), while the other shards go on. In one process it is memory (default
    /// 64); in a cluster it is the shard's inbound queue on the NATS servers' disks (default
    /// 256).
    #[arg(long, value_name = "MIB")]
    pub shard_backlog_mib: Option<usize>,
    /// Keep trades this many days after their trade date, then drop them (postgres: whole
    /// monthly partitions; embedded: the expired rows), when each shard starts and once a day;
    /// exceptions likewise by the day they arrived (default: keep everything). Durable stores
    /// only.
    #[arg(long, value_name = "DAYS")]
    pub retention_days: Option<u32>,
    /// Keep the exceptions of unchecked input (unsigned, wrongly signed, unreadable; they name
    /// no MsgId) this many days after they arrived; 0 keeps them (durable stores).
    #[arg(long, value_name = "DAYS", default_value_t = UNCHECKED_EXCEPTION_DAYS_DEFAULT)]
    pub unchecked_exception_days: u32,
    /// Age out an unmatched trade after this many whole business days of its market without
    /// a message (AGED advice to its parties, then E_CLOSED); 0: never.
    #[arg(long, env = "STE_AGING_BUSINESS_DAYS", value_name = "DAYS", default_value_t = Aging::default().business_days)]
    pub aging_business_days: u32,
    /// How often an idle matcher wakes up to check whether a new day has begun (aging runs
    /// once a day), in milliseconds.
    #[arg(long, value_name = "MS", default_value_t = Aging::default().check_interval.as_millis() as u64)]
    pub aging_check_ms: u64,
    /// Message keys and closed trades a shard's matcher keeps exactly in one generation (two
    /// generations are kept); older ones go into its filter once committed and are read back
    /// when a message may need them: from the shard's tables (postgres) or from the files of
    /// retired facts beside the shard's (embedded). The memory store keeps every one exactly.
    #[arg(long, value_name = "ENTRIES", default_value_t = MatcherMemory::default().generation_entries)]
    pub matcher_generation: usize,
    /// MiB of each shard matcher's filter over what it retired (postgres and embedded stores):
    /// a larger one reads back less often. Default 8, or for a generated load of the driver its size for
    /// the load.
    #[arg(long, value_name = "MIB")]
    pub matcher_filter_mib: Option<usize>,
    /// MiB that one participant's messages may hold in the open trades of one shard (every
    /// store): beyond it its messages are refused E_LIMIT, so that no participant fills the
    /// memory the others need.
    #[arg(long, value_name = "MIB", default_value_t = MatcherMemory::default().participant_held_bytes >> 20)]
    pub participant_held_mib: u64,
    /// Station sampling interval in milliseconds (samples.csv in the process's folder; a
    /// node of a cluster publishes them on ste.samples.<node-id>, at least every 100 ms); 0
    /// turns sampling off. Default 10; 1 for the levels of `driver sweep`, whose short runs
    /// need more samples for their populations to read true.
    #[arg(long, value_name = "MS")]
    pub sample_ms: Option<u64>,
    /// Matching profile (JSON); default: the T2S-style tolerances.
    #[arg(long, value_name = "FILE")]
    pub profile: Option<PathBuf>,
    /// Most messages a shard's writer commits in one transaction. Default 16,384 in one
    /// process; 4,096 on a node of a cluster.
    #[arg(long, env = "STE_BATCH_MAX", value_name = "MESSAGES")]
    pub batch_max: Option<usize>,
    /// Most bytes of messages a shard's writer commits in one transaction, as it weighs them
    /// (twice their raw bytes and an item's fixed size); a heavier message is committed alone.
    /// The queue in front of each writer holds twice as many. Default 32 MiB in one process;
    /// 10 MiB on a node of a cluster.
    #[arg(long, env = "STE_BATCH_MAX_BYTES", value_name = "BYTES")]
    pub batch_max_bytes: Option<usize>,
}

/// The certificate a process shows over TLS, shared by `engine` and `driver`.
#[derive(Args, Clone, Debug, Default)]
pub struct TlsIdentityArgs {
    /// This process's TLS certificate chain (PEM, leaf first): an engine serves its listeners
    /// over TLS with it; a driver shows it to a tls:// --target that asks for client
    /// certificates.
    #[arg(long, env = "STE_TLS_CERT", value_name = "FILE", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, env = "STE_TLS_KEY", value_name = "FILE", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
}

impl TlsIdentityArgs {
    /// The certificate chain and its key, when both are given (clap requires each with the
    /// other).
    pub fn pair(&self) -> Option<(PathBuf, PathBuf)> {
        self.tls_cert.clone().zip(self.tls_key.clone())
    }
}

/// Options that do not fit together.
#[derive(Debug, thiserror::Error)]
pub enum OptionsError {
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    Profile(#[from] ProfileError),
}

/// The pipeline's options, checked together and resolved.
#[derive(Debug, Clone)]
pub struct Settings {
    pub store: StoreKind,
    /// The shards' database URLs in shard order (postgres store: one per shard).
    pub database_urls: Vec<String>,
    pub shards: u32,
    pub validators: u32,
    pub shard_backlog_bytes: usize,
    pub retention_days: Option<u32>,
    pub unchecked_exception_days: Option<u32>,
    pub aging: Option<Aging>,
    pub matcher_memory: MatcherMemory,
    /// Whether `--matcher-filter-mib` was given; otherwise a process may size the filter for
    /// the load it knows ([`MatcherMemory::for_facts`]).
    pub filter_given: bool,
    pub sample_interval: Duration,
    /// Whether `--sample-ms` was given; otherwise a sweep samples more often.
    pub sample_given: bool,
    pub tolerances: Tolerances,
    /// What one transaction of a shard's writer holds at most.
    pub batch_max: BatchBound,
}

impl PipelineArgs {
    /// Checks the options together and resolves their defaults, once.
    pub fn resolve(&self, scope: Scope) -> Result<Settings, OptionsError> {
        let invalid = |text: String| Err(OptionsError::Invalid(text));
        let store = self.store.unwrap_or(match scope {
            Scope::InProcess => StoreKind::Embedded,
            Scope::Cluster => StoreKind::Postgres,
        });
        if scope == Scope::Cluster && store != StoreKind::Postgres {
            return invalid(
                "a cluster runs on the postgres store: another node may take over a shard, so \
                 each shard's database must be one every node can reach (--db URL per shard, \
                 or STE_DATABASE_URLS); the embedded and memory stores live inside one process"
                    .to_owned(),
            );
        }
        let database_urls: Vec<String> = self
            .db
            .iter()
            .map(|url| url.trim())
            .filter(|url| !url.is_empty())
            .map(str::to_owned)
            .collect();
        let postgres = store == StoreKind::Postgres;
        if postgres && database_urls.is_empty() {
            return invalid(
                "the postgres store needs database URLs: --db URL once per shard, or \
                 STE_DATABASE_URLS"
                    .to_owned(),
            );
        }
        let shards = match self.shards {
            Some(shards) => shards,
            None if postgres => database_urls.len() as u32,
            None => SHARDS_DEFAULT,
        };
        if shards == 0 || self.validators == 0 {
            return invalid("--shards and --validators must be at least 1".to_owned());
        }
        if postgres && shards as usize != database_urls.len() {
            return invalid(format!(
                "the postgres store needs one database URL per shard: {shards} shards, {} URLs \
                 (--db, repeated in shard order, or STE_DATABASE_URLS)",
                database_urls.len()
            ));
        }
        if self.retention_days.is_some() && store == StoreKind::Memory {
            return invalid(
                "--retention-days needs a durable store (embedded or postgres); the memory \
                 store keeps everything"
                    .to_owned(),
            );
        }
        let default_memory = MatcherMemory::default();
        let default_batch = match scope {
            Scope::InProcess => BatchBound::DEFAULT,
            Scope::Cluster => OWNER_BATCH_MAX,
        };
        Ok(Settings {
            store,
            database_urls,
            shards,
            validators: self.validators,
            shard_backlog_bytes: self.shard_backlog_mib.map_or(
                match scope {
                    Scope::InProcess => SHARD_BACKLOG_BYTES_DEFAULT,
                    Scope::Cluster => CLUSTER_SHARD_BACKLOG_BYTES_DEFAULT,
                },
                |mib| mib.max(1) << 20,
            ),
            retention_days: self.retention_days,
            unchecked_exception_days: (self.unchecked_exception_days > 0)
                .then_some(self.unchecked_exception_days),
            aging: (self.aging_business_days > 0).then(|| Aging {
                business_days: self.aging_business_days,
                check_interval: Duration::from_millis(self.aging_check_ms.max(1)),
            }),
            matcher_memory: MatcherMemory {
                generation_entries: self.matcher_generation.max(1),
                filter_bytes: self
                    .matcher_filter_mib
                    .map_or(default_memory.filter_bytes, |mib| mib.max(1) << 20),
                participant_held_bytes: self.participant_held_mib.max(1) << 20,
            },
            filter_given: self.matcher_filter_mib.is_some(),
            sample_interval: Duration::from_millis(self.sample_ms.unwrap_or(SAMPLE_MS_DEFAULT)),
            sample_given: self.sample_ms.is_some(),
            tolerances: Tolerances::load(self.profile.as_deref())?,
            batch_max: BatchBound {
                messages: self.batch_max.unwrap_or(default_batch.messages),
                bytes: self.batch_max_bytes.unwrap_or(default_batch.bytes),
            },
        })
    }
}

impl Default for Settings {
    /// What [`PipelineArgs::resolve`] gives a process in one piece when no option is given.
    fn default() -> Self {
        Self {
            store: StoreKind::Embedded,
            database_urls: Vec::new(),
            shards: SHARDS_DEFAULT,
            validators: VALIDATORS_DEFAULT,
            shard_backlog_bytes: SHARD_BACKLOG_BYTES_DEFAULT,
            retention_days: None,
            unchecked_exception_days: Some(UNCHECKED_EXCEPTION_DAYS_DEFAULT),
            aging: Some(Aging::default()),
            matcher_memory: MatcherMemory::default(),
            filter_given: false,
            sample_interval: Duration::from_millis(SAMPLE_MS_DEFAULT),
            sample_given: false,
            tolerances: Tolerances::default(),
            batch_max: BatchBound::DEFAULT,
        }
    }
}

impl Settings {
    /// The shards' store, its files (if any) under `dir`.
    pub fn store_config(&self, dir: &Path) -> StoreConfig {
        match self.store {
            StoreKind::Memory => StoreConfig::Memory,
            StoreKind::Embedded => StoreConfig::Embedded {
                dir: dir.join("store"),
            },
            StoreKind::Postgres => StoreConfig::Postgres {
                urls: self.database_urls.clone(),
            },
        }
    }

    /// The configuration of a pipeline in one process whose files (the embedded store,
    /// samples.csv) go under `dir`; the sizes the options do not name keep their defaults.
    pub fn pipeline(&self, dir: &Path) -> PipelineConfig {
        PipelineConfig {
            shards: self.shards,
            validators: self.validators,
            store: self.store_config(dir),
            sample_interval: self.sample_interval,
            // A zero interval turns sampling off (to measure what sampling costs).
            samples_path: (!self.sample_interval.is_zero()).then(|| dir.join("samples.csv")),
            retention_days: self.retention_days,
            unchecked_exception_days: self.unchecked_exception_days,
            aging: self.aging,
            shard_backlog_bytes: self.shard_backlog_bytes,
            matcher_memory: self.matcher_memory,
            batch_max: self.batch_max,
            ..PipelineConfig::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        pipeline: PipelineArgs,
        #[command(flatten)]
        tls: TlsIdentityArgs,
    }

    fn resolve(args: &[&str], scope: Scope) -> Result<Settings, String> {
        let cli = Cli::try_parse_from(std::iter::once("ste").chain(args.iter().copied()))
            .map_err(|e| e.to_string())?;
        cli.pipeline.resolve(scope).map_err(|e| e.to_string())
    }

    #[test]
    fn defaults_of_a_process_in_one_piece_and_of_a_cluster() {
        let settings = resolve(&[], Scope::InProcess).expect("defaults resolve");
        assert_eq!(
            format!("{settings:?}"),
            format!("{:?}", Settings::default())
        );
        assert_eq!(settings.store, StoreKind::Embedded);
        assert_eq!((settings.shards, settings.validators), (SHARDS_DEFAULT, 2));
        let pipeline = settings.pipeline(Path::new("/data"));
        assert!(
            matches!(&pipeline.store, StoreConfig::Embedded { dir } if dir == Path::new("/data/store"))
        );
        assert_eq!(
            pipeline.samples_path.as_deref(),
            Some(Path::new("/data/samples.csv"))
        );
        assert_eq!(pipeline.aging.map(|a| a.business_days), Some(20));
        assert!(!settings.filter_given);

        let error = resolve(&[], Scope::Cluster).expect_err("a cluster needs its databases");
        assert!(error.contains("needs database URLs"), "{error}");
        let settings = resolve(&["--db", "postgres://a/x,postgres://b/x"], Scope::Cluster)
            .expect("a cluster on two databases");
        assert_eq!(settings.store, StoreKind::Postgres);
        assert_eq!(settings.shards, 2);
        // A shard's backlog is memory in one process, disk in a cluster.
        assert_eq!(settings.shard_backlog_bytes, 256 << 20);
        let settings = resolve(&[], Scope::InProcess).expect("defaults resolve");
        assert_eq!(settings.shard_backlog_bytes, 64 << 20);
        let settings = resolve(&["--shard-backlog-mib", "16"], Scope::InProcess).expect("resolves");
        assert_eq!(settings.shard_backlog_bytes, 16 << 20);
    }

    #[test]
    fn a_transaction_bound_by_scope_unless_given_and_into_the_pipeline() {
        let in_process = resolve(&[], Scope::InProcess).expect("defaults resolve");
        assert_eq!(in_process.batch_max, BatchBound::DEFAULT);
        let cluster = resolve(&["--db", "postgres://a/x"], Scope::Cluster).expect("resolves");
        assert_eq!(cluster.batch_max, OWNER_BATCH_MAX);
        assert_ne!(cluster.batch_max, in_process.batch_max);
        let given = resolve(
            &[
                "--db",
                "postgres://a/x",
                "--batch-max",
                "16384",
                "--batch-max-bytes",
                "1048576",
            ],
            Scope::Cluster,
        )
        .expect("resolves");
        let bound = BatchBound {
            messages: 16_384,
            bytes: 1 << 20,
        };
        assert_eq!(given.batch_max, bound);
        assert_eq!(given.pipeline(Path::new("/data")).batch_max, bound);
        assert_eq!(bound.queue_bytes(), 2 << 20);
    }

    #[test]
    fn database_urls_repeated_or_comma_separated_and_one_per_shard() {
        let repeated = resolve(
            &[
                "--store",
                "postgres",
                "--db",
                "postgres://a/x",
                "--db",
                "postgres://b/x",
            ],
            Scope::InProcess,
        )
        .expect("repeated --db");
        let joined = resolve(
            &[
                "--store",
                "postgres",
                "--db",
                "postgres://a/x, postgres://b/x,",
            ],
            Scope::InProcess,
        )
        .expect("comma-separated --db");
        assert_eq!(repeated.database_urls, joined.database_urls);
        assert_eq!(joined.database_urls, ["postgres://a/x", "postgres://b/x"]);
        let error = resolve(
            &[
                "--store",
                "postgres",
                "--db",
                "postgres://a/x",
                "--shards",
                "3",
            ],
            Scope::InProcess,
        )
        .expect_err("three shards on one database");
        assert!(error.contains("one database URL per shard"), "{error}");
    }

    #[test]
    fn options_that_do_not_fit_together_are_refused() {
        for (args, scope, expected) in [
            (
                &["--store", "embedded"][..],
                Scope::Cluster,
                "a cluster runs on the postgres store",
            ),
            (&["--shards", "0"][..], Scope::InProcess, "at least 1"),
            (&["--validators", "0"][..], Scope::InProcess, "at least 1"),
            (
                &["--store", "memory", "--retention-days", "3"][..],
                Scope::InProcess,
                "needs a durable store",
            ),
            (&["--tls-cert", "a.pem"][..], Scope::InProcess, "--tls-key"),
        ] {
            let error = resolve(args, scope).expect_err("refused");
            assert!(error.contains(expected), "{args:?}: {error}");
        }
    }

    #[test]
    fn memory_aging_and_retention_from_their_options() {
        let settings = resolve(
            &[
                "--matcher-generation",
                "1000",
                "--matcher-filter-mib",
                "16",
                "--participant-held-mib",
                "2",
                "--aging-business-days",
                "0",
                "--unchecked-exception-days",
                "0",
                "--retention-days",
                "30",
                "--sample-ms",
                "0",
            ],
            Scope::InProcess,
        )
        .expect("resolves");
        assert_eq!(
            settings.matcher_memory,
            MatcherMemory {
                generation_entries: 1000,
                filter_bytes: 16 << 20,
                participant_held_bytes: 2 << 20,
            }
        );
        assert!(settings.filter_given);
        assert!(settings.aging.is_none());
        assert_eq!(settings.unchecked_exception_days, None);
        let pipeline = settings.pipeline(Path::new("/data"));
        assert_eq!(pipeline.retention_days, Some(30));
        assert_eq!(pipeline.samples_path, None);
    }
}
