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

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use async_nats::jetstream::{kv, stream};

use crate::queue::jetstream::JetStream;
use crate::queue::QueueError;

/// The bucket of the shard leases.
pub const LEASE_BUCKET: &str = "ste_leases";

/// The bucket of the shards' delivery watermarks.
pub const DELIVERY_BUCKET: &str = "ste_delivered";

fn carrier(detail: impl std::fmt::Display) -> QueueError {
    bucket_error(LEASE_BUCKET, detail)
}

fn bucket_error(bucket: &str, detail: impl std::fmt::Display) -> QueueError {
    QueueError::Carrier {
        queue: format!("bucket {bucket}"),
        detail: detail.to_string(),
    }
}

/// Opens the key-value bucket `name`, making its stream where it does not exist: one value a
/// key, entries living `max_age` (zero: for ever). Returns the bucket and how long its entries
/// live: `max_age` for the node that made it, what the first one chose for the others.
fn open_bucket(
    jetstream: &JetStream,
    name: &str,
    max_age: Duration,
) -> Result<(kv::Store, Duration), QueueError> {
    let context = jetstream.context();
    jetstream.block_on(async {
        let config = stream::Config {
            name: format!("KV_{name}"),
            subjects: vec![format!("$KV.{name}.>")],
            max_messages_per_subject: 1,
            max_age,
            storage: stream::StorageType::File,
            allow_rollup: true,
            deny_delete: true,
            allow_direct: true,
            discard: stream::DiscardPolicy::New,
            num_replicas: jetstream.placement().bucket_replicas(),
            ..Default::default()
        };
        let stream = context
            .get_or_create_stream(config)
            .await
            .map_err(|error| bucket_error(name, error))?;
        let max_age = stream.cached_info().config.max_age;
        let bucket = context
            .get_key_value(name)
            .await
            .map_err(|error| bucket_error(name, error))?;
        Ok((bucket, max_age))
    })
}

/// The lease bucket of a cluster.
pub struct Leases {
    jetstream: JetStream,
    bucket: kv::Store,
    ttl: Duration,
}

/// What a lease is for: a shard (its inbound queue, validator, matcher and writers: one owner
/// at a time keeps a trade's messages in order and fences its database), a gateway number (the
/// subject `ack.<n>` its answers come back on), or a member number (a node that lives: the
/// nodes count each other through these).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Leased {
    Shard(u32),
    Gateway(u32),
    Member(u32),
}

impl Leased {
    fn key(self) -> String {
        match self {
            Self::Shard(shard) => format!("shard.{shard}"),
            Self::Gateway(number) => format!("gateway.{number}"),
            Self::Member(number) => format!("member.{number}"),
        }
    }
}

/// Member numbers a cluster has room for: nodes beyond this many run, but are not counted.
pub const MEMBERS_MAX: u32 = 64;

/// A shard, gateway number or member number this node holds, as long as it renews in time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    pub what: Leased,
    /// The revision the shard was won with: the fencing token of this ownership.
    pub token: u64,
    revision: u64,
    renewed: Instant,
}

impl Leases {
    /// Opens the bucket, making it with entries that live `ttl` where it does not exist. A
    /// cluster has one time to live, set by the node that made the bucket: one that asks for
    /// another is warned and renews by the cluster's ([`Leases::ttl`]).
    pub fn open(jetstream: &JetStream, ttl: Duration) -> Result<Self, QueueError> {
        let (bucket, bucket_ttl) = open_bucket(jetstream, LEASE_BUCKET, ttl)?;
        if bucket_ttl != ttl {
            tracing::warn!(
                asked_ms = ttl.as_millis() as u64,
                cluster_ms = bucket_ttl.as_millis() as u64,
                "the cluster's leases live as long as its first node chose; renewing by that"
            );
        }
        let ttl = bucket_ttl;
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

    /// Wins `what` for `node_id` when nobody holds it; `None` when somebody does.
    pub fn try_acquire(&self, what: Leased, node_id: &str) -> Result<Option<Lease>, QueueError> {
        let asked = Instant::now();
        let created = self.jetstream.block_on(
            self.bucket
                .create(what.key(), bytes::Bytes::from(node_id.to_owned())),
        );
        match created {
            Ok(revision) => Ok(Some(Lease {
                what,
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
            lease.what.key(),
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

    /// Gives `lease` back at once, rather than letting it run out, if nobody wrote its key
    /// since this node did: a node that hands a shard over lets the next one win it now.
    pub fn release(&self, lease: &Lease) -> Result<(), QueueError> {
        self.jetstream
            .block_on(
                self.bucket
                    .delete_expect_revision(lease.what.key(), Some(lease.revision)),
            )
            .map_err(carrier)
    }

    /// Wins the lowest of the numbers `0..count` of a kind (`Leased::Gateway`,
    /// `Leased::Member`) that nobody holds, for `node_id`; `None` when all are held.
    pub fn take_lowest(
        &self,
        kind: fn(u32) -> Leased,
        count: u32,
        node_id: &str,
    ) -> Result<Option<(u32, Lease)>, QueueError> {
        for number in 0..count {
            if let Some(lease) = self.try_acquire(kind(number), node_id)? {
                return Ok(Some((number, lease)));
            }
        }
        Ok(None)
    }

    /// The node holding `what`, if any.
    pub fn holder(&self, what: Leased) -> Result<Option<String>, QueueError> {
        let entry = self
            .jetstream
            .block_on(self.bucket.entry(what.key()))
            .map_err(carrier)?;
        Ok(entry
            .filter(|entry| entry.operation == kv::Operation::Put)
            .map(|entry| String::from_utf8_lossy(&entry.value).into_owned()))
    }
}

/// Renewals of a held lease per time to live.
const RENEWALS_PER_TTL: u32 = 4;

/// Keeps a lease: renews it a few times per time to live on a thread of its own. Once a
/// renewal is refused, or a time to live passes without one (by this node's clock), the lease
/// counts as lost: [`LeaseKeeper::held`] turns false and `on_lost` runs, once.
pub struct LeaseKeeper {
    token: u64,
    held: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    leases: Arc<Leases>,
    /// Ends with the lease as last renewed, while it is still held.
    thread: Option<JoinHandle<Option<Lease>>>,
}

impl Drop for LeaseKeeper {
    /// A keeper dropped (its owner failed half way) stops renewing too.
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

impl LeaseKeeper {
    /// Starts keeping `lease` for `node_id`.
    pub fn start(
        leases: Arc<Leases>,
        mut lease: Lease,
        node_id: String,
        on_lost: impl FnOnce() + Send + 'static,
    ) -> Self {
        let token = lease.token;
        let held = Arc::new(AtomicBool::new(true));
        let stop = Arc::new(AtomicBool::new(false));
        let interval = leases.ttl() / RENEWALS_PER_TTL;
        let thread = {
            let (held, stop, leases) = (held.clone(), stop.clone(), leases.clone());
            std::thread::Builder::new()
                .name("lease".to_owned())
                .spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        std::thread::sleep(interval);
                        let renewed = match leases.renew(&mut lease, &node_id) {
                            Ok(renewed) => renewed,
                            Err(error) => {
                                tracing::warn!(what = ?lease.what, %error, "renewing a lease failed");
                                true
                            }
                        };
                        if !renewed || !leases.holds(&lease) {
                            held.store(false, Ordering::Release);
                            tracing::warn!(what = ?lease.what, "lost the lease");
                            on_lost();
                            return None;
                        }
                    }
                    Some(lease)
                })
                .expect("the operating system can start a thread")
        };
        Self {
            token,
            held,
            stop,
            leases,
            thread: Some(thread),
        }
    }

    /// The fencing token of the lease.
    pub fn token(&self) -> u64 {
        self.token
    }

    /// Whether the lease is still held; false for good once it was lost.
    pub fn held(&self) -> Arc<AtomicBool> {
        self.held.clone()
    }

    /// Stops renewing. The lease is not given back: it runs out, as a crashed node's would.
    pub fn stop(mut self) {
        self.stop_renewing();
    }

    /// Stops renewing and gives the lease back at once, if it is still held
    /// ([`Leases::release`]).
    pub fn give_back(mut self) {
        if let Some(lease) = self.stop_renewing() {
            if let Err(error) = self.leases.release(&lease) {
                tracing::warn!(what = ?lease.what, %error, "giving a lease back failed; it runs out");
            }
        }
    }

    fn stop_renewing(&mut self) -> Option<Lease> {
        self.stop.store(true, Ordering::Relaxed);
        let lease = self.thread.take()?.join().ok()??;
        self.leases.holds(&lease).then_some(lease)
    }
}

/// The shards' delivery watermarks across nodes: the sink records, per shard, the outbox id up
/// to which every CLS was delivered; the shard's owner reads it and commits it with its next
/// transaction, so that a new owner emits again only what lies above it.
pub struct DeliveryBook {
    jetstream: JetStream,
    bucket: kv::Store,
}

impl std::fmt::Debug for DeliveryBook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeliveryBook").finish_non_exhaustive()
    }
}

impl DeliveryBook {
    /// Opens the bucket, making it where it does not exist.
    pub fn open(jetstream: &JetStream) -> Result<Self, QueueError> {
        Ok(Self {
            jetstream: jetstream.clone(),
            bucket: open_bucket(jetstream, DELIVERY_BUCKET, Duration::ZERO)?.0,
        })
    }

    fn key(shard: u32) -> String {
        format!("shard.{shard}")
    }

    /// Records that every CLS of `shard` up to `outbox_id` was delivered. Only the sink writes
    /// here, in outbox order, so the value only grows.
    pub fn confirm(&self, shard: u32, outbox_id: i64) -> Result<(), QueueError> {
        self.jetstream
            .block_on(
                self.bucket
                    .put(Self::key(shard), bytes::Bytes::from(outbox_id.to_string())),
            )
            .map(|_| ())
            .map_err(|error| bucket_error(DELIVERY_BUCKET, error))
    }

    /// The outbox id through which `shard`'s CLS were delivered (0: none yet).
    pub fn delivered_through(&self, shard: u32) -> Result<i64, QueueError> {
        let value = self
            .jetstream
            .block_on(self.bucket.get(Self::key(shard)))
            .map_err(|error| bucket_error(DELIVERY_BUCKET, error))?;
        Ok(value
            .and_then(|value| std::str::from_utf8(&value).ok()?.parse().ok())
            .unwrap_or(0))
    }
}
