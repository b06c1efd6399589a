//! Shard ownership across nodes (DESIGN.md section 1a): a lease per shard in a JetStream
//! key-value bucket whose entries live for the lease's time to live.
//!
//! A node wins shard k by creating key `shard.k` (refused while another node's entry lives)
//! and keeps it by updating the entry with the revision it last wrote (refused once anyone else
//! wrote it), well within the time to live. Revisions are sequence numbers of the bucket's
//! stream, so the revision a node won a shard with is larger than any revision written before:
//! it is the owner's fencing token, which every commit of the shard carries
//! ([`crate::store::Store::fence`]). An owner that has not renewed within the time to live
//! assumes it lost the shard and stops writing it, whatever the bucket says.
//!
//! On nats-server 2.9 the bucket's stream is made directly (async-nats's bucket creation reads
//! account fields that 2.9 does not send), with the settings a key-value bucket has; an entry
//! that expires sends no event there, so contenders poll.

use std::time::{Duration, Instant};

use async_nats::jetstream::{kv, stream};

use crate::queue::jetstream::JetStream;
use crate::queue::QueueError;

/// The bucket of the shard leases.
pub const LEASE_BUCKET: &str = "ste_leases";

fn carrier(detail: impl std::fmt::Display) -> QueueError {
    QueueError::Carrier {
        queue: format!("lease bucket {LEASE_BUCKET}"),
        detail: detail.to_string(),
    }
}

/// The lease bucket of a cluster.
pub struct Leases {
    jetstream: JetStream,
    bucket: kv::Store,
    ttl: Duration,
}

/// A shard this node owns, as long as it renews in time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    pub shard: u32,
    /// The revision the shard was won with: the fencing token of this ownership.
    pub token: u64,
    revision: u64,
    renewed: Instant,
}

fn key(shard: u32) -> String {
    format!("shard.{shard}")
}

impl Leases {
    /// Opens the bucket, making it with entries that live `ttl` where it does not exist. Every
    /// node of a cluster must use the same `ttl`: the first one to start sets it.
    pub fn open(jetstream: &JetStream, ttl: Duration) -> Result<Self, QueueError> {
        let context = jetstream.context();
        let bucket = jetstream.block_on(async {
            let config = stream::Config {
                name: format!("KV_{LEASE_BUCKET}"),
                subjects: vec![format!("$KV.{LEASE_BUCKET}.>")],
                max_messages_per_subject: 1,
                max_age: ttl,
                storage: stream::StorageType::File,
                allow_rollup: true,
                deny_delete: true,
                allow_direct: true,
                discard: stream::DiscardPolicy::New,
                num_replicas: 1,
                ..Default::default()
            };
            context
                .get_or_create_stream(config)
                .await
                .map_err(carrier)?;
            context.get_key_value(LEASE_BUCKET).await.map_err(carrier)
        })?;
        Ok(Self {
            jetstream: jetstream.clone(),
            bucket,
            ttl,
        })
    }

    /// The lease's time to live.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Wins `shard` for `node_id` when nobody holds it; `None` when somebody does.
    pub fn try_acquire(&self, shard: u32, node_id: &str) -> Result<Option<Lease>, QueueError> {
        let asked = Instant::now();
        let created = self.jetstream.block_on(
            self.bucket
                .create(key(shard), bytes::Bytes::from(node_id.to_owned())),
        );
        match created {
            Ok(revision) => Ok(Some(Lease {
                shard,
                token: revision,
                revision,
                renewed: asked,
            })),
            Err(error) if error.kind() == kv::CreateErrorKind::AlreadyExists => Ok(None),
            Err(error) => Err(carrier(error)),
        }
    }

    /// Keeps `lease` for another time to live. False when it was lost: somebody else wrote the
    /// key since (it had expired and was won), and this node must not write the shard again.
    pub fn renew(&self, lease: &mut Lease, node_id: &str) -> Result<bool, QueueError> {
        let asked = Instant::now();
        let updated = self.jetstream.block_on(self.bucket.update(
            key(lease.shard),
            bytes::Bytes::from(node_id.to_owned()),
            lease.revision,
        ));
        match updated {
            Ok(revision) => {
                lease.revision = revision;
                lease.renewed = asked;
                Ok(true)
            }
            Err(error) if error.kind() == kv::UpdateErrorKind::WrongLastRevision => Ok(false),
            Err(error) => Err(carrier(error)),
        }
    }

    /// Whether `lease` still holds by this node's own clock: renewed (or won) less than a time
    /// to live ago, counted from when the request was sent.
    pub fn holds(&self, lease: &Lease) -> bool {
        lease.renewed.elapsed() < self.ttl
    }

    /// The node holding `shard`, if any.
    pub fn holder(&self, shard: u32) -> Result<Option<String>, QueueError> {
        let entry = self
            .jetstream
            .block_on(self.bucket.entry(key(shard)))
            .map_err(carrier)?;
        Ok(entry
            .filter(|entry| entry.operation == kv::Operation::Put)
            .map(|entry| String::from_utf8_lossy(&entry.value).into_owned()))
    }
}
