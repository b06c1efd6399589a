//! Queues carried by NATS JetStream, between the nodes of a cluster (DESIGN.md section 1a).
//!
//! One stream per queue: subject `ste.<queue>`, work-queue retention (a batch is gone once it
//! is acknowledged), bounded in batches and in bytes with discard-new (a full queue refuses a
//! publish and the sender waits and tries again: backpressure, nothing dropped), file storage.
//! One durable pull consumer per queue, explicit acknowledgement. A batch is one JetStream
//! message: its items in postcard, LZ4-compressed where it is large enough to gain (a header
//! says so; a compressed batch decodes to at most 1 MiB), its enqueue time (wall clock,
//! nanoseconds since the Unix epoch, so that it means the same on every node) in a header. A
//! batch too large for the server's payload limit is split.
//!
//! Only this file names NATS. The sending and the receiving node each keep a [`Station`] for
//! the queue: the sender counts arrivals on its own, the receiver counts arrivals as it takes
//! batches and completions as they are served; the stream's pending count is the queue length.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_nats::jetstream::{self, consumer, stream};
use futures_util::StreamExt;
use serde::de::DeserializeOwned;
use serde::Serialize;

use super::{BatchReceiver, BatchSender, QueueError, Receipt, Received, Tx};
use crate::station::Station;

/// The header carrying a batch's enqueue time.
const ENQUEUED_NS_HEADER: &str = "Ste-Enqueued-Ns";
/// Largest payload a batch is published with; larger batches are split. Below the server's
/// default `max_payload` of 1 MiB, leaving room for headers.
pub const BATCH_PAYLOAD_MAX_BYTES: usize = 960 * 1024;
// A batch split below the payload limit must still hold the largest message a participant may
// send, with room for its envelope; and a payload must decode within the decoder's bound.
const _: () = assert!(BATCH_PAYLOAD_MAX_BYTES > 2 * crate::validate::MESSAGE_SIZE_MAX_BYTES);
const _: () = assert!(BATCH_PAYLOAD_MAX_BYTES < DECODED_MAX_BYTES);
/// Longest a sender waits between two tries at a full queue.
const FULL_RETRY_MAX: Duration = Duration::from_millis(100);
/// Longest one pull request waits for a batch; a receiver waiting for ever renews it (and sees
/// a stop within this).
const PULL_EXPIRES_MAX: Duration = Duration::from_secs(1);
/// How much longer than a pull request's own expiry the client waits for its answer.
const PULL_CLIENT_MARGIN: Duration = Duration::from_secs(2);
/// How long the server waits for an acknowledgement before it delivers a batch again.
const ACK_WAIT: Duration = Duration::from_secs(30);
/// Batches delivered to a consumer and not yet acknowledged.
const ACK_PENDING_MAX: i64 = 1024;
/// Batches one pull request takes when they are already waiting: one round trip for several.
const PULL_BATCHES_MAX: usize = 16;
/// How long a sender or receiver goes on trying through a failing connection (the server
/// restarting, the network away) before it reports the carrier failed.
const CARRIER_OUTAGE_MAX: Duration = Duration::from_secs(60);
/// Longest pause between two tries through a failing connection.
const CARRIER_RETRY_MAX: Duration = Duration::from_millis(500);
/// How long the server remembers a batch's id to drop a repeated publish of it (a publish
/// tried again because its acknowledgement was lost).
const DUPLICATE_WINDOW: Duration = Duration::from_secs(60);
/// The header naming a batch for the server's deduplication.
const MSG_ID_HEADER: &str = "Nats-Msg-Id";
/// The topic (after `ste.`) of the stream where batches that do not decode are set aside, as
/// `aside.<queue>`; its stream is `STE_ASIDE`.
pub const ASIDE_TOPIC: &str = "aside";
/// Headers of a batch set aside: the queue it came from, its sequence there, and why.
const ASIDE_QUEUE_HEADER: &str = "Ste-Aside-Queue";
const ASIDE_SEQUENCE_HEADER: &str = "Ste-Aside-Sequence";
const ASIDE_CAUSE_HEADER: &str = "Ste-Aside-Cause";
/// Bounds of the aside stream: the oldest go first past them.
const ASIDE_BATCHES_MAX: i64 = 10_000;
const ASIDE_BYTES_MAX: i64 = 64 << 20;
/// How long a receiver waits for the aside stream to take a batch.
const ASIDE_WAIT_MAX: Duration = Duration::from_secs(5);
/// The header naming how a batch's payload is compressed; absent, the payload is the batch's
/// postcard as it is.
const ENCODING_HEADER: &str = "Ste-Encoding";
/// [`ENCODING_HEADER`]'s value for an LZ4 block with the postcard's length before it (four
/// bytes, little-endian).
const LZ4_ENCODING: &str = "lz4";
/// Batches of fewer postcard bytes go uncompressed: too little to gain.
const COMPRESS_FROM_BYTES: usize = 512;
/// Most bytes a compressed batch may decode to. Senders split batches past
/// [`BATCH_PAYLOAD_MAX_BYTES`] of postcard, whatever they compress to, and refuse to send one
/// item past this; a batch claiming more is not decoded (it is set aside, unread).
const DECODED_MAX_BYTES: usize = 1 << 20;
/// Batches this process has set aside (each one's log line gives the count so far).
static BATCHES_SET_ASIDE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// A batch's payload from its postcard `plain`: LZ4-compressed where that makes it smaller
/// (`true`). XML compresses to about a fifth, and every byte a batch saves is a byte the NATS
/// server and both clients do not encrypt, decrypt, copy or store. `Err` where the batch
/// decodes to more than [`DECODED_MAX_BYTES`], which no receiver would take: senders split
/// their batches well below it, so only a single item that large gets here.
fn compress(plain: Vec<u8>) -> Result<(Vec<u8>, bool), String> {
    if plain.len() > DECODED_MAX_BYTES {
        return Err(format!(
            "a batch of {} bytes is more than a receiver takes ({DECODED_MAX_BYTES})",
            plain.len()
        ));
    }
    if plain.len() >= COMPRESS_FROM_BYTES {
        let compressed = lz4_flex::block::compress_prepend_size(&plain);
        if compressed.len() < plain.len() {
            return Ok((compressed, true));
        }
    }
    Ok((plain, false))
}

/// The bytes `items` take as a batch's payload, compressed where that is smaller.
pub fn payload_bytes<T: Serialize>(items: &[T]) -> usize {
    postcard::to_allocvec(items)
        .ok()
        .and_then(|plain| compress(plain).ok())
        .map_or(0, |(payload, _)| payload.len())
}

/// The headers of a payload [`compress`] compressed, or none.
fn encoding_headers(compressed: bool) -> async_nats::HeaderMap {
    let mut headers = async_nats::HeaderMap::new();
    if compressed {
        headers.insert(ENCODING_HEADER, LZ4_ENCODING);
    }
    headers
}

/// The items of a batch's payload, as [`compress`] made it and its headers say; `Err` with why
/// where it does not decode. A compressed payload is decoded only where it claims at most
/// [`DECODED_MAX_BYTES`], so that no payload costs more memory than that.
fn decode<T: DeserializeOwned>(
    payload: &[u8],
    headers: Option<&async_nats::HeaderMap>,
) -> Result<Vec<T>, String> {
    let encoding = headers.and_then(|headers| headers.get(ENCODING_HEADER));
    match encoding.map(|value| value.as_str()) {
        None => postcard::from_bytes(payload).map_err(|error| error.to_string()),
        Some(LZ4_ENCODING) => {
            let (size, block) =
                lz4_flex::block::uncompressed_size(payload).map_err(|error| error.to_string())?;
            if size > DECODED_MAX_BYTES {
                return Err(format!(
                    "claims {size} bytes decompressed, more than {DECODED_MAX_BYTES}"
                ));
            }
            let plain =
                lz4_flex::block::decompress(block, size).map_err(|error| error.to_string())?;
            postcard::from_bytes(&plain).map_err(|error| error.to_string())
        }
        Some(other) => Err(format!("unknown encoding {other:?}")),
    }
}

/// A name for each batch this process publishes, unique across processes.
fn batch_id() -> String {
    static PREFIX: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let prefix = PREFIX.get_or_init(rand::random::<u64>);
    format!("{prefix:016x}-{}", NEXT.fetch_add(1, Ordering::Relaxed))
}

/// Tries through a failing connection: pauses before the next try, or gives up once the
/// outage has lasted [`CARRIER_OUTAGE_MAX`].
struct Outage {
    since: Option<Instant>,
    pause: Duration,
    /// Set once the process stops: an outage is then not waited out.
    stopping: Arc<AtomicBool>,
}

impl Outage {
    fn new(stopping: &Arc<AtomicBool>) -> Self {
        Self {
            since: None,
            pause: Duration::from_millis(10),
            stopping: stopping.clone(),
        }
    }

    /// After a failure: `Err` once the outage is too long (or the process is stopping), else
    /// waits and says try again.
    fn wait(&mut self, queue: &str, error: impl std::fmt::Display) -> Result<(), QueueError> {
        if self.stopping.load(Ordering::Relaxed) {
            return Err(carrier(
                queue,
                format!("{error} (stopping: the server is not waited for)"),
            ));
        }
        let since = *self.since.get_or_insert_with(Instant::now);
        if since.elapsed() >= CARRIER_OUTAGE_MAX {
            return Err(carrier(queue, error));
        }
        if self.pause >= CARRIER_RETRY_MAX {
            tracing::warn!(queue, %error, "the queue's server does not answer; trying again");
        }
        std::thread::sleep(self.pause);
        self.pause = (self.pause * 2).min(CARRIER_RETRY_MAX);
        Ok(())
    }
}

/// How long one wait of a receiver lasts: until `deadline`, at least a millisecond and at most
/// `longest` (so that a receiver waiting for ever still sees a stop).
fn wait_within(deadline: Option<Instant>, longest: Duration) -> Duration {
    deadline.map_or(longest, |deadline| {
        deadline
            .saturating_duration_since(Instant::now())
            .clamp(Duration::from_millis(1), longest)
    })
}

/// Nanoseconds since the Unix epoch.
pub(crate) fn wall_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_nanos() as u64)
}

/// The bounds of one queue's stream.
#[derive(Debug, Clone, Copy)]
pub struct QueueLimits {
    pub batches_max: i64,
    pub bytes_max: i64,
}

/// Where the streams of a cluster go among its NATS servers, and how many copies each keeps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// One placement tag per server (its `server_tags`), in order: a queue placed by index `i`
    /// goes to the server tagged `tags[i % len]`, so that the shards' streams are spread and
    /// no server carries every message. Empty: the servers place the streams themselves.
    pub tags: Vec<String>,
    /// Copies of each queue's stream: 1 (the database commit is the record of durability; a
    /// queue whose server is down waits for it) or 3 (the queue survives a server's loss).
    pub replicas: usize,
}

impl Default for Placement {
    fn default() -> Self {
        Self {
            tags: Vec::new(),
            replicas: 1,
        }
    }
}

impl Placement {
    /// Copies of each key-value bucket (the leases, the delivery book): three where the
    /// cluster has three servers or more, so that losing one server does not stop every owner
    /// from renewing its lease.
    pub fn bucket_replicas(&self) -> usize {
        if self.tags.len() >= 3 {
            3
        } else {
            1
        }
    }

    /// A placement from a list of tags separated by commas (none: the servers place the
    /// streams) and the copies of each queue's stream, 1 or 3.
    pub fn parse(tags: Option<&str>, replicas: usize) -> Result<Self, String> {
        let tags: Vec<String> = tags
            .unwrap_or_default()
            .split(',')
            .map(str::trim)
            .filter(|tag| !tag.is_empty())
            .map(str::to_owned)
            .collect();
        if replicas != 1 && replicas != 3 {
            return Err(format!("a stream keeps 1 or 3 copies, not {replicas}"));
        }
        Ok(Self { tags, replicas })
    }

    /// The placement of the stream placed by `index`: by tag where its stream keeps one copy
    /// (three copies need three servers, and the servers spread the streams' leaders).
    fn of(&self, index: Option<usize>) -> Option<stream::Placement> {
        let index = index?;
        (!self.tags.is_empty() && self.replicas == 1).then(|| stream::Placement {
            cluster: None,
            tags: vec![self.tags[index % self.tags.len()].clone()],
        })
    }
}

/// A connection to a JetStream server (or to one of a cluster's), through which a node opens
/// its queues.
#[derive(Clone)]
pub struct JetStream {
    runtime: Arc<tokio::runtime::Runtime>,
    client: async_nats::Client,
    context: jetstream::Context,
    stopping: Arc<AtomicBool>,
    placement: Arc<Placement>,
    /// Given several servers: a connection to each, in the order of their URLs (which is the
    /// order of their placement tags), so that a queue's traffic goes straight to the server
    /// that holds its stream instead of through another server's route ([`JetStream::placed`]).
    near: Arc<Vec<(async_nats::Client, jetstream::Context)>>,
}

impl std::fmt::Debug for JetStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JetStream").finish_non_exhaustive()
    }
}

fn carrier(queue: &str, detail: impl std::fmt::Display) -> QueueError {
    QueueError::Carrier {
        queue: queue.to_owned(),
        detail: detail.to_string(),
    }
}

/// The stream of a queue: `match.2` → `STE_MATCH_2`.
pub fn stream_name(queue: &str) -> String {
    format!("STE_{}", queue.replace(['.', '-'], "_").to_uppercase())
}

/// The subject of a queue: `match.2` → `ste.match.2`.
pub fn subject(queue: &str) -> String {
    format!("ste.{queue}")
}

/// How a process proves to a cluster's NATS servers who it is, and checks that they are the
/// cluster's: the seed of its identity's nkey, the prefix of its inboxes (the servers let each
/// identity listen to its own only), and the cluster's CA, which makes TLS required.
#[derive(Clone, Default)]
pub struct NatsCredentials {
    identity: Option<String>,
    nkey_seed: Option<String>,
    inbox_prefix: Option<String>,
    ca: Option<PathBuf>,
}

impl std::fmt::Debug for NatsCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsCredentials")
            .field("identity", &self.identity)
            .field("tls", &self.ca.is_some())
            .finish_non_exhaustive()
    }
}

/// The file of an identity's nkey seed in a secrets folder.
pub fn nkey_file(secrets: &Path, identity: &str) -> PathBuf {
    secrets.join(format!("nats-{identity}.nk"))
}

/// The cluster CA's certificate in a secrets folder.
pub fn ca_file(secrets: &Path) -> PathBuf {
    secrets.join("ca.pem")
}

impl NatsCredentials {
    /// No identity and no TLS: for a server that asks for neither (a test's own, a
    /// developer's).
    pub fn none() -> Self {
        Self::default()
    }

    /// The identity `identity` (its seed in `nats-<identity>.nk`) with TLS checked against the
    /// cluster's CA (`ca.pem`), both from the secrets folder `secrets`.
    pub fn from_secrets(
        secrets: &Path,
        identity: &str,
        inbox_prefix: String,
    ) -> Result<Self, QueueError> {
        let ca = ca_file(secrets);
        if !ca.is_file() {
            return Err(carrier(
                &ca.display().to_string(),
                "the cluster's CA certificate is missing (driver secrets makes it)",
            ));
        }
        Ok(Self {
            identity: Some(identity.to_owned()),
            nkey_seed: Some(
                crate::keys::read_private(&nkey_file(secrets, identity))
                    .map_err(|error| carrier(identity, error))?,
            ),
            inbox_prefix: Some(inbox_prefix),
            ca: Some(ca),
        })
    }

    /// These credentials without TLS: for a server that asks for identities and not TLS (a
    /// benchmark that tells the two costs apart; no cluster runs so).
    pub fn without_tls(mut self) -> Self {
        self.ca = None;
        self
    }

    fn options(&self) -> async_nats::ConnectOptions {
        let mut options = async_nats::ConnectOptions::new();
        if let Some(seed) = &self.nkey_seed {
            options = options.nkey(seed.clone());
        }
        if let Some(prefix) = &self.inbox_prefix {
            options = options.custom_inbox_prefix(prefix);
        }
        if let Some(identity) = &self.identity {
            options = options.name(identity);
        }
        if let Some(ca) = &self.ca {
            options = options.add_root_certificates(ca.clone()).require_tls(true);
        }
        options
    }
}

impl JetStream {
    /// Connects to the server at `url` (e.g. `nats://127.0.0.1:4222`), or to one of a
    /// cluster's given as URLs separated by commas (the client learns the others from it, and
    /// moves to another when its server goes), with no identity and no TLS.
    pub fn connect(url: &str) -> Result<Self, QueueError> {
        Self::connect_as(url, &NatsCredentials::none())
    }

    /// Connects as [`JetStream::connect`] does, proving the identity of `credentials`.
    pub fn connect_as(url: &str, credentials: &NatsCredentials) -> Result<Self, QueueError> {
        let servers = url
            .split(',')
            .map(str::trim)
            .filter(|server| !server.is_empty())
            .map(|server| {
                server
                    .parse::<async_nats::ServerAddr>()
                    .map_err(|error| carrier("connect", format!("{server}: {error}")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("jetstream")
            .enable_all()
            .build()
            .map_err(|error| carrier("connect", error))?;
        let client = runtime
            .block_on(credentials.options().connect(servers.clone()))
            .map_err(|error| carrier("connect", format!("{url}: {error}")))?;
        // The context spawns its own tasks on the runtime.
        let context = runtime.block_on(async { jetstream::new(client.clone()) });
        let mut near = Vec::new();
        if servers.len() > 1 {
            for first in 0..servers.len() {
                // This server first, the others after it in order, should it be away.
                let mut order = servers.clone();
                order.rotate_left(first);
                let client = runtime
                    .block_on(credentials.options().retain_servers_order().connect(order))
                    .map_err(|error| carrier("connect", format!("{url}: {error}")))?;
                let context = runtime.block_on(async { jetstream::new(client.clone()) });
                near.push((client, context));
            }
        }
        Ok(Self {
            client,
            context,
            stopping: Arc::default(),
            runtime: Arc::new(runtime),
            placement: Arc::default(),
            near: Arc::new(near),
        })
    }

    /// This connection as it reaches the queue placed by `index` ([`Placement`]): through the
    /// connection to the server that holds the queue's stream, where the servers were given one
    /// URL each in the order of their placement tags and the streams keep one copy; else this
    /// connection as it is.
    pub fn placed(&self, index: usize) -> JetStream {
        let mut placed = self.clone();
        if self.placement.replicas == 1
            && !self.near.is_empty()
            && self.near.len() == self.placement.tags.len()
        {
            let (client, context) = &self.near[index % self.near.len()];
            placed.client = client.clone();
            placed.context = context.clone();
        }
        placed
    }

    /// This connection, making the streams it creates by `placement`.
    pub fn with_placement(mut self, placement: Placement) -> Self {
        self.placement = Arc::new(placement);
        self
    }

    /// Where the streams this connection creates go.
    pub fn placement(&self) -> &Placement {
        &self.placement
    }

    /// From now on a failing server is not waited out: publishes and pulls through this
    /// connection fail at once instead of trying again for up to a minute. For a process that
    /// stops: what it did not finish is not acknowledged, and is delivered to whoever comes next.
    pub fn stop_riding_out_outages(&self) {
        self.stopping.store(true, Ordering::Relaxed);
    }

    /// The JetStream context, for what else a cluster keeps there (leases).
    pub(crate) fn context(&self) -> jetstream::Context {
        self.context.clone()
    }

    /// Runs `future` to completion on this connection's runtime.
    pub(crate) fn block_on<F: std::future::Future>(&self, future: F) -> F::Output {
        self.runtime.block_on(future)
    }

    /// Creates the stream of `queue` with `limits` where it does not exist yet.
    pub fn ensure_queue(&self, queue: &str, limits: QueueLimits) -> Result<(), QueueError> {
        self.ensure_queue_placed(queue, limits, None)
    }

    /// Creates the stream of `queue` with `limits` where it does not exist yet, on the server
    /// that [`Placement`] gives index `index` (where it is `None`, the servers choose).
    pub fn ensure_queue_placed(
        &self,
        queue: &str,
        limits: QueueLimits,
        index: Option<usize>,
    ) -> Result<(), QueueError> {
        let config = stream::Config {
            num_replicas: self.placement.replicas.max(1),
            placement: self.placement.of(index),
            name: stream_name(queue),
            subjects: vec![subject(queue)],
            retention: stream::RetentionPolicy::WorkQueue,
            storage: stream::StorageType::File,
            discard: stream::DiscardPolicy::New,
            max_messages: limits.batches_max,
            max_bytes: limits.bytes_max,
            duplicate_window: DUPLICATE_WINDOW,
            ..Default::default()
        };
        self.ensure_stream(queue, config)
    }

    /// Creates the stream of `config` where it does not exist yet (`what` names it in errors).
    fn ensure_stream(&self, what: &str, config: stream::Config) -> Result<(), QueueError> {
        let name = config.name.clone();
        self.runtime.block_on(async {
            match self.context.get_or_create_stream(config).await {
                Ok(_) => Ok(()),
                // Nodes starting together race for it: the one whose create comes second is
                // told the subjects overlap (or the name is taken) by the stream the first
                // made, which is all it wanted.
                Err(error) => match self.context.get_stream(&name).await {
                    Ok(_) => Ok(()),
                    Err(_) => Err(carrier(what, error)),
                },
            }
        })
    }

    /// Creates the aside stream ([`ASIDE_TOPIC`]) where it does not exist: every subject
    /// `ste.aside.>`, bounded in batches and bytes, the oldest dropped past either.
    pub fn ensure_aside_stream(&self) -> Result<(), QueueError> {
        let config = stream::Config {
            num_replicas: self.placement.replicas.max(1),
            name: stream_name(ASIDE_TOPIC),
            subjects: vec![format!("{}.>", subject(ASIDE_TOPIC))],
            retention: stream::RetentionPolicy::Limits,
            storage: stream::StorageType::File,
            discard: stream::DiscardPolicy::Old,
            max_messages: ASIDE_BATCHES_MAX,
            max_bytes: ASIDE_BYTES_MAX,
            ..Default::default()
        };
        self.ensure_stream(ASIDE_TOPIC, config)
    }

    /// Batches held by the stream of `queue`: its length.
    pub fn queue_len(&self, queue: &str) -> Result<u64, QueueError> {
        self.queue_state(queue).map(|state| state.batches)
    }

    /// What the stream of `queue` holds now and has ever been given.
    pub fn queue_state(&self, queue: &str) -> Result<QueueState, QueueError> {
        self.runtime.block_on(async {
            // One request: the stream as got carries its state (a stream's info is one of the
            // dearer requests a server answers, its cluster's state included).
            let stream = self
                .context
                .get_stream(stream_name(queue))
                .await
                .map_err(|error| carrier(queue, error))?;
            let info = stream.cached_info();
            Ok(QueueState {
                batches: info.state.messages,
                stored_ever: info.state.last_sequence,
            })
        })
    }

    /// Publishes `payload` on the plain (not persisted) subject `ste.<topic>`: for notices that
    /// may be lost, such as a node's station counters, which are cumulative.
    pub fn notify(&self, topic: &str, payload: Vec<u8>) -> Result<(), QueueError> {
        self.notify_with(topic, async_nats::HeaderMap::new(), payload)
    }

    /// [`JetStream::notify`] with headers (none sent where `headers` is empty).
    fn notify_with(
        &self,
        topic: &str,
        headers: async_nats::HeaderMap,
        payload: Vec<u8>,
    ) -> Result<(), QueueError> {
        let payload = bytes::Bytes::from(payload);
        self.runtime.block_on(async {
            // A client cut off from its server buffers publishes until its buffer is full and
            // then waits: a notice is not worth waiting for.
            let publish = async {
                if headers.is_empty() {
                    self.client.publish(subject(topic), payload).await
                } else {
                    self.client
                        .publish_with_headers(subject(topic), headers, payload)
                        .await
                }
            };
            tokio::time::timeout(NOTICE_WAIT_MAX, publish)
                .await
                .map_err(|_| carrier(topic, "the server is not taking notices"))?
                .map_err(|error| carrier(topic, error))
        })
    }

    /// Listens to the plain subjects `ste.<topics>` (`samples.>`: every node's samples).
    pub fn listen(&self, topics: &str) -> Result<Listener, QueueError> {
        let subscriber = self
            .runtime
            .block_on(self.client.subscribe(subject(topics)))
            .map_err(|error| carrier(topics, error))?;
        Ok(Listener {
            runtime: self.runtime.clone(),
            subscriber,
        })
    }

    /// Copies of the batches published onto `queue` from now on ([`PlainReceiver`]).
    pub fn copies<T: DeserializeOwned + Send + 'static>(
        &self,
        queue: &str,
    ) -> Result<PlainReceiver<T>, QueueError> {
        self.plain_receiver(queue, format!("{queue}.copies"))
    }

    /// The batches published on the plain subject `ste.<topic>` from now on, counted on a
    /// station named `station` ([`PlainReceiver`]).
    pub fn plain_receiver<T: DeserializeOwned + Send + 'static>(
        &self,
        topic: &str,
        station: impl Into<String>,
    ) -> Result<PlainReceiver<T>, QueueError> {
        Ok(PlainReceiver {
            queue: topic.to_owned(),
            listener: std::sync::Mutex::new(self.listen(topic)?),
            station: Station::new(station),
            stopped: Arc::new(AtomicBool::new(false)),
            _items: std::marker::PhantomData,
        })
    }

    /// Publishes `items` as one batch on the plain subject `ste.<topic>`, not persisted: for
    /// what may be lost because whoever misses it asks again (a gateway's answers). `Err` when
    /// the connection does not take it within a second.
    pub fn publish_plain<T: Serialize>(&self, topic: &str, items: &[T]) -> Result<(), QueueError> {
        let plain = postcard::to_allocvec(items).map_err(|error| carrier(topic, error))?;
        let (payload, compressed) = compress(plain).map_err(|error| carrier(topic, error))?;
        self.notify_with(topic, encoding_headers(compressed), payload)
    }

    /// A sender onto `queue`, whose stream must exist.
    pub fn sender<T: Serialize + Send + Sync + 'static>(&self, queue: &str) -> JetStreamSender<T> {
        JetStreamSender {
            jetstream: self.clone(),
            subject: subject(queue),
            station: Station::new(queue),
            _items: std::marker::PhantomData,
        }
    }

    /// The receiver of `queue` through the durable consumer `durable`. With `fresh`, the
    /// consumer is deleted and made again first, so that every batch not acknowledged comes
    /// back at once and in order (a node taking a queue over).
    pub fn receiver<T: DeserializeOwned + Send + 'static>(
        &self,
        queue: &str,
        durable: &str,
        fresh: bool,
    ) -> Result<JetStreamReceiver<T>, QueueError> {
        let consumer = self.consumer(queue, durable, fresh)?;
        Ok(JetStreamReceiver {
            jetstream: self.clone(),
            queue: queue.to_owned(),
            durable: durable.to_owned(),
            pulling: std::sync::Mutex::new(Pulling::new(consumer, fresh)),
            station: Station::new(queue),
            stopped: Arc::new(AtomicBool::new(false)),
            _items: std::marker::PhantomData,
        })
    }

    /// The durable pull consumer `durable` on the stream of `queue`, made where absent; with
    /// `fresh`, deleted and made again first.
    fn consumer(
        &self,
        queue: &str,
        durable: &str,
        fresh: bool,
    ) -> Result<consumer::PullConsumer, QueueError> {
        self.runtime.block_on(async {
            let stream = self
                .context
                .get_stream(stream_name(queue))
                .await
                .map_err(|error| carrier(queue, error))?;
            if fresh {
                // Absent is as good as deleted.
                let _ = stream.delete_consumer(durable).await;
            }
            stream
                .get_or_create_consumer(
                    durable,
                    consumer::pull::Config {
                        durable_name: Some(durable.to_owned()),
                        ack_policy: consumer::AckPolicy::Explicit,
                        ack_wait: ACK_WAIT,
                        max_ack_pending: ACK_PENDING_MAX,
                        ..Default::default()
                    },
                )
                .await
                .map_err(|error| carrier(queue, error))
        })
    }
}

/// What a queue's stream holds and has been given, in batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueState {
    /// Batches held: published and not yet acknowledged.
    pub batches: u64,
    /// Batches ever stored (the stream's last sequence number).
    pub stored_ever: u64,
}

/// A subscription to plain subjects ([`JetStream::listen`]).
pub struct Listener {
    runtime: Arc<tokio::runtime::Runtime>,
    subscriber: async_nats::Subscriber,
}

impl Listener {
    /// The payload of the next notice, waiting at most `wait`; `None` when none came (or the
    /// subscription ended).
    pub fn next(&mut self, wait: Duration) -> Option<bytes::Bytes> {
        self.next_message(wait).map(|message| message.payload)
    }

    /// The next notice, headers and all ([`Listener::next`]).
    fn next_message(&mut self, wait: Duration) -> Option<async_nats::Message> {
        self.runtime
            .block_on(async { tokio::time::timeout(wait, self.subscriber.next()).await })
            .ok()?
    }
}

/// Sends onto a JetStream queue.
pub struct JetStreamSender<T> {
    jetstream: JetStream,
    subject: String,
    station: Arc<Station>,
    _items: std::marker::PhantomData<fn(T)>,
}

impl<T> Clone for JetStreamSender<T> {
    fn clone(&self) -> Self {
        Self {
            jetstream: self.jetstream.clone(),
            subject: self.subject.clone(),
            station: self.station.clone(),
            _items: std::marker::PhantomData,
        }
    }
}

/// Whether a publish failed because the stream is full (its limits, discard-new): the server
/// answers 503 (codes 10077, maximum messages; 10047, storage exceeded).
fn is_full(error: &jetstream::context::PublishError) -> bool {
    std::error::Error::source(error)
        .and_then(|source| source.downcast_ref::<jetstream::Error>())
        .is_some_and(|error| error.code() == 503)
}

impl<T: Serialize> JetStreamSender<T> {
    /// The station on which this sender counts its arrivals.
    pub fn station(&self) -> &Arc<Station> {
        &self.station
    }

    /// The messages of `items`: one, or the halves' while too large for one.
    fn messages(
        &self,
        items: &[T],
        enqueued_ns: u64,
    ) -> Result<Vec<(bytes::Bytes, async_nats::HeaderMap)>, QueueError> {
        let plain = postcard::to_allocvec(items).map_err(|error| carrier(&self.subject, error))?;
        // Split by the bytes a receiver decodes, whatever they compress to, so that no batch
        // decodes to more than it takes (a compressed payload is smaller still).
        if plain.len() > BATCH_PAYLOAD_MAX_BYTES && items.len() > 1 {
            let (first, second) = items.split_at(items.len() / 2);
            let mut messages = self.messages(first, enqueued_ns)?;
            messages.extend(self.messages(second, enqueued_ns)?);
            return Ok(messages);
        }
        let (payload, compressed) =
            compress(plain).map_err(|error| carrier(&self.subject, error))?;
        Ok(vec![message(payload, compressed, enqueued_ns)])
    }

    /// Publishes one batch's message until the server holds it: waiting while the stream is
    /// full, riding out an outage.
    fn publish_message(
        &self,
        payload: &bytes::Bytes,
        headers: &async_nats::HeaderMap,
    ) -> Result<(), QueueError> {
        let mut backoff = Duration::from_millis(1);
        let mut outage = Outage::new(&self.jetstream.stopping);
        loop {
            let published = self.jetstream.runtime.block_on(async {
                self.jetstream
                    .context
                    .publish_with_headers(self.subject.clone(), headers.clone(), payload.clone())
                    .await?
                    .await
            });
            match published {
                Ok(_) => return Ok(()),
                Err(error) if is_full(&error) => {
                    std::thread::sleep(backoff);
                    backoff = (backoff * 2).min(FULL_RETRY_MAX);
                }
                Err(error) => outage.wait(&self.subject, error)?,
            }
        }
    }
}

/// A batch's message: its payload, and headers with the time it was enqueued and an id of its
/// own (tried again after a lost acknowledgement, the batch is stored once).
fn message(
    payload: Vec<u8>,
    compressed: bool,
    enqueued_ns: u64,
) -> (bytes::Bytes, async_nats::HeaderMap) {
    let mut headers = encoding_headers(compressed);
    headers.insert(ENQUEUED_NS_HEADER, enqueued_ns.to_string().as_str());
    headers.insert(MSG_ID_HEADER, batch_id().as_str());
    (bytes::Bytes::from(payload), headers)
}

impl<T: Serialize + Send + Sync + 'static> BatchSender<T> for JetStreamSender<T> {
    /// Publishes the batch and returns once the server holds it (a full stream or an outage is
    /// waited out, under the same message id); then what it came from is done with.
    fn forward(&self, items: Vec<T>, receipt: Receipt) -> Result<(), QueueError> {
        if !items.is_empty() {
            self.station.arrive(items.len() as u64);
            // A batch split below the payload limit: each part is held before the next is
            // sent, so that they keep their order.
            for (payload, headers) in &self.messages(&items, wall_ns())? {
                self.publish_message(payload, headers)?;
            }
        }
        receipt.ack()
    }

    fn clone_sender(&self) -> Tx<T> {
        Box::new(self.clone())
    }
}

/// Receives from a JetStream queue through its durable consumer.
pub struct JetStreamReceiver<T> {
    jetstream: JetStream,
    queue: String,
    durable: String,
    pulling: std::sync::Mutex<Pulling>,
    station: Arc<Station>,
    stopped: Arc<AtomicBool>,
    _items: std::marker::PhantomData<fn() -> T>,
}

/// A receiver's side of its consumer.
///
/// The consumer numbers its deliveries 1, 2, 3… (a batch delivered again takes a new number).
/// A number skipped is a delivery that never reached this receiver — on the wire when the
/// connection dropped, with a server restarting — and the server holds that batch as pending
/// until its ack wait runs out: the batches behind it would be served first, and a trade's
/// messages would reach its matcher out of order. So a receiver that sees a number skipped
/// drops what it pulled and makes its consumer again, which delivers every batch not yet
/// acknowledged at once and in order; those it had already handed out come again and are
/// answered as repeats.
///
/// A receiver that made its consumer afresh expects number 1 first. Another receiver of the
/// same durable name may have pulled the first deliveries: an owner that stalled past its lease
/// and has not learned yet that the shard has a new owner. Those batches would come back to the
/// new owner only after the ack wait, behind the ones after them, so the new owner treats a
/// first number above 1 as a skip, like any other.
struct Pulling {
    consumer: consumer::PullConsumer,
    /// Batches pulled and not handed out yet (at most [`PULL_BATCHES_MAX`]).
    pulled: std::collections::VecDeque<jetstream::Message>,
    /// The consumer's number of the last delivery taken: 0 when this receiver made the
    /// consumer afresh and has taken none yet, `None` when it found the consumer made.
    last_delivery: Option<u64>,
    /// A delivery was seen lost and the consumer is not made again yet.
    lost_delivery: bool,
}

impl Pulling {
    /// A receiver's side of `consumer`, which it made afresh or found made.
    fn new(consumer: consumer::PullConsumer, fresh: bool) -> Self {
        Self {
            consumer,
            pulled: std::collections::VecDeque::new(),
            last_delivery: fresh.then_some(0),
            lost_delivery: false,
        }
    }

    /// Takes the deliveries of one pull, `Err` with the skipped numbers when one is missing.
    fn take(
        &mut self,
        messages: impl IntoIterator<Item = jetstream::Message>,
    ) -> Result<(), (u64, u64)> {
        for message in messages {
            if let Ok(info) = message.info() {
                let number = info.consumer_sequence;
                match self.last_delivery {
                    Some(last) if number > last + 1 => return Err((last + 1, number - 1)),
                    // Numbered from 1 again: the consumer was made again (a node taking the
                    // queue over), and this receiver is about to learn it lost its lease.
                    _ => self.last_delivery = Some(number),
                }
            }
            self.pulled.push_back(message);
        }
        Ok(())
    }
}

/// Stops a receiver: its next wait ends with [`QueueError::Closed`].
#[derive(Debug, Clone)]
pub struct StopReceiving(Arc<AtomicBool>);

impl StopReceiving {
    /// Stops the receiver.
    pub fn stop(&self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// Batches taken off a plain subject by a subscription as they are published: copies of a
/// queue's batches ([`JetStream::copies`]), for a gateway that pushes CLS to the participants
/// connected to it while the sink, alone, consumes the queue; or a gateway's answers
/// ([`JetStream::plain_receiver`]). A batch is never acknowledged and may be missed (the
/// client's subscription buffer is bounded and drops what a slow reader leaves, and nothing is
/// kept for a subscriber that is reconnecting); whoever relies on it must be able to ask again.
pub struct PlainReceiver<T> {
    queue: String,
    listener: std::sync::Mutex<Listener>,
    station: Arc<Station>,
    stopped: Arc<AtomicBool>,
    _items: std::marker::PhantomData<fn() -> T>,
}

impl<T> PlainReceiver<T> {
    /// A handle that stops this receiver.
    pub fn stopper(&self) -> StopReceiving {
        StopReceiving(self.stopped.clone())
    }
}

/// How long a notice may wait for room in the client's buffer.
const NOTICE_WAIT_MAX: Duration = Duration::from_secs(1);

/// How long one wait for a copy lasts at most, so that a stopped receiver notices.
const COPY_WAIT_MAX: Duration = Duration::from_millis(200);

impl<T: DeserializeOwned + Send + 'static> BatchReceiver<T> for PlainReceiver<T> {
    fn recv_until(&self, deadline: Option<Instant>) -> Result<Option<Received<T>>, QueueError> {
        loop {
            if self.stopped.load(Ordering::Relaxed) {
                return Err(QueueError::Closed {
                    queue: self.queue.clone(),
                });
            }
            let wait = wait_within(deadline, COPY_WAIT_MAX);
            let copy = self
                .listener
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .next_message(wait);
            if let Some(copy) = copy {
                match decode::<T>(&copy.payload, copy.headers.as_ref()) {
                    Ok(items) => {
                        self.station.arrive(items.len() as u64);
                        return Ok(Some(Received {
                            items,
                            enqueued_ns: wall_ns(),
                            receipt: Receipt::none(),
                        }));
                    }
                    Err(error) => {
                        tracing::warn!(queue = %self.queue, %error, "a copied batch does not decode; left out");
                        continue;
                    }
                }
            }
            if deadline.is_some_and(|deadline| Instant::now() >= deadline) {
                return Ok(None);
            }
        }
    }

    fn station(&self) -> &Arc<Station> {
        &self.station
    }

    fn now_ns(&self) -> u64 {
        wall_ns()
    }
}

impl<T> JetStreamReceiver<T> {
    /// A handle that stops this receiver (a JetStream queue has no last sender to close it).
    pub fn stopper(&self) -> StopReceiving {
        StopReceiving(self.stopped.clone())
    }
}

impl<T: DeserializeOwned + Send + 'static> JetStreamReceiver<T> {
    /// The next batch within `wait`, if any: one already pulled, else whatever is waiting
    /// (up to [`PULL_BATCHES_MAX`] in one request), else the first to arrive within `wait`.
    fn pull(&self, wait: Duration) -> Result<Option<jetstream::Message>, QueueError> {
        let mut pulling = self
            .pulling
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if pulling.lost_delivery {
            self.take_again(&mut pulling)?;
        }
        if let Some(message) = pulling.pulled.pop_front() {
            return Ok(Some(message));
        }
        // A pull request lives on the server: one lost with a restarting server is never
        // answered, so the client bounds its wait too.
        let bound = wait + PULL_CLIENT_MARGIN;
        let queue = &self.queue;
        let consumer = &pulling.consumer;
        let mut fetched = Vec::new();
        let waiting = self.jetstream.runtime.block_on(async {
            tokio::time::timeout(bound, async {
                let mut waiting = consumer
                    .fetch()
                    .max_messages(PULL_BATCHES_MAX)
                    .messages()
                    .await
                    .map_err(|error| carrier(queue, error))?;
                while let Some(message) = waiting.next().await {
                    fetched.push(message.map_err(|error| carrier(queue, error))?);
                }
                Ok::<_, QueueError>(())
            })
            .await
        });
        self.took(&mut pulling, fetched)?;
        match waiting {
            Ok(result) => result?,
            Err(_) => return Err(carrier(queue, "a pull request went unanswered")),
        }
        if let Some(message) = pulling.pulled.pop_front() {
            return Ok(Some(message));
        }
        let consumer = &pulling.consumer;
        let next = self.jetstream.runtime.block_on(async {
            tokio::time::timeout(bound, async {
                let mut batch = consumer
                    .batch()
                    .max_messages(1)
                    .expires(wait)
                    .messages()
                    .await
                    .map_err(|error| carrier(queue, error))?;
                match batch.next().await {
                    None => Ok(None),
                    Some(Ok(message)) => Ok(Some(message)),
                    Some(Err(error)) => Err(carrier(queue, error)),
                }
            })
            .await
        });
        let next =
            next.unwrap_or_else(|_| Err(carrier(queue, "a pull request went unanswered")))?;
        self.took(&mut pulling, next)?;
        Ok(pulling.pulled.pop_front())
    }

    /// Takes the deliveries of a pull into `pulling`; where one is missing, drops them and takes
    /// the queue again from its first unacknowledged batch ([`Pulling`]).
    fn took(
        &self,
        pulling: &mut Pulling,
        deliveries: impl IntoIterator<Item = jetstream::Message>,
    ) -> Result<(), QueueError> {
        if let Err((first, last)) = pulling.take(deliveries) {
            tracing::warn!(
                queue = %self.queue,
                first,
                last,
                "deliveries were lost on their way; taking the queue again from its first \
                 unacknowledged batch"
            );
            pulling.pulled.clear();
            pulling.lost_delivery = true;
            self.take_again(pulling)?;
        }
        Ok(())
    }

    /// Moves a batch that does not decode onto the aside stream ([`ASIDE_TOPIC`]), with its
    /// queue, stream sequence and cause in headers, and acknowledges it: logged and counted
    /// (the aside stream's length). Where the aside stream does not take it, the batch is left
    /// unacknowledged and comes again after the ack wait.
    fn set_aside(&self, message: jetstream::Message, cause: &str) {
        let sequence = message
            .info()
            .map(|info| info.stream_sequence)
            .unwrap_or_default();
        let bytes = message.payload.len();
        // Kept with its encoding, so that it can be read as it came.
        let encoding = message
            .headers
            .as_ref()
            .and_then(|headers| headers.get(ENCODING_HEADER))
            .map(|value| value.as_str().to_owned());
        let mut headers = async_nats::HeaderMap::new();
        if let Some(encoding) = encoding {
            headers.insert(ENCODING_HEADER, encoding.as_str());
        }
        headers.insert(ASIDE_QUEUE_HEADER, self.queue.as_str());
        headers.insert(ASIDE_SEQUENCE_HEADER, sequence.to_string().as_str());
        headers.insert(ASIDE_CAUSE_HEADER, cause);
        let context = &self.jetstream.context;
        let moved = self.jetstream.runtime.block_on(async {
            tokio::time::timeout(ASIDE_WAIT_MAX, async {
                context
                    .publish_with_headers(
                        subject(&format!("{ASIDE_TOPIC}.{}", self.queue)),
                        headers,
                        message.payload.clone(),
                    )
                    .await?
                    .await
            })
            .await
        });
        match moved {
            Ok(Ok(_)) => {
                let acked = self.jetstream.runtime.block_on(message.ack()).is_ok();
                let total = BATCHES_SET_ASIDE.fetch_add(1, Ordering::Relaxed) + 1;
                tracing::warn!(
                    queue = %self.queue,
                    sequence,
                    bytes,
                    cause,
                    acked,
                    set_aside = total,
                    "a batch that does not decode was set aside (stream {})",
                    stream_name(ASIDE_TOPIC)
                );
            }
            Ok(Err(error)) => tracing::error!(
                queue = %self.queue, sequence, bytes, cause, %error,
                "a batch that does not decode could not be set aside; it comes again after the ack wait"
            ),
            Err(_) => tracing::error!(
                queue = %self.queue, sequence, bytes, cause,
                "a batch that does not decode could not be set aside in time; it comes again after the ack wait"
            ),
        }
    }

    /// Makes the consumer again, so that every batch not acknowledged comes back in order
    /// (what was pulled from the one before is dropped).
    fn take_again(&self, pulling: &mut Pulling) -> Result<(), QueueError> {
        *pulling = Pulling::new(
            self.jetstream.consumer(&self.queue, &self.durable, true)?,
            true,
        );
        Ok(())
    }

    /// The batch `message` carries; `Err` with the message and why where it does not decode.
    #[allow(clippy::result_large_err)]
    fn received(
        &self,
        message: jetstream::Message,
    ) -> Result<Received<T>, (jetstream::Message, String)> {
        let items: Vec<T> = match decode(&message.payload, message.headers.as_ref()) {
            Ok(items) => items,
            Err(cause) => return Err((message, cause)),
        };
        let enqueued_ns = message
            .headers
            .as_ref()
            .and_then(|headers| headers.get(ENQUEUED_NS_HEADER))
            .and_then(|value| value.as_str().parse().ok())
            .unwrap_or_else(wall_ns);
        self.station.arrive(items.len() as u64);
        let handle = self.jetstream.runtime.handle().clone();
        let queue = self.queue.clone();
        let receipt = Receipt::from_fn(move || {
            // A lost acknowledgement delivers the batch again after the ack wait, which every
            // consumer handles (its effects are idempotent): not worth stopping a station for.
            if let Err(error) = handle.block_on(message.ack()) {
                tracing::warn!(queue, %error, "an acknowledgement was lost; the batch comes again");
            }
            Ok(())
        });
        Ok(Received {
            items,
            enqueued_ns,
            receipt,
        })
    }
}

impl<T: DeserializeOwned + Send + 'static> BatchReceiver<T> for JetStreamReceiver<T> {
    fn recv_until(&self, deadline: Option<Instant>) -> Result<Option<Received<T>>, QueueError> {
        let mut outage = Outage::new(&self.jetstream.stopping);
        loop {
            if self.stopped.load(Ordering::Relaxed) {
                return Err(QueueError::Closed {
                    queue: self.queue.clone(),
                });
            }
            let wait = wait_within(deadline, PULL_EXPIRES_MAX);
            let pulled = match self.pull(wait) {
                Ok(pulled) => {
                    outage = Outage::new(&self.jetstream.stopping);
                    pulled
                }
                Err(error) => {
                    outage.wait(&self.queue, error)?;
                    continue;
                }
            };
            if let Some(message) = pulled {
                match self.received(message) {
                    Ok(received) => return Ok(Some(received)),
                    // Whoever sent it, it holds nothing this queue's consumer can serve: out of
                    // the way, and on to the next.
                    Err((message, cause)) => self.set_aside(message, &cause),
                }
            }
            if deadline.is_some_and(|deadline| Instant::now() >= deadline) {
                return Ok(None);
            }
        }
    }

    fn station(&self) -> &Arc<Station> {
        &self.station
    }

    fn now_ns(&self) -> u64 {
        wall_ns()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lz4() -> async_nats::HeaderMap {
        encoding_headers(true)
    }

    /// A batch's payload as a sender makes it.
    fn encode<T: Serialize>(items: &[T]) -> Result<(Vec<u8>, bool), String> {
        compress(postcard::to_allocvec(items).map_err(|error| error.to_string())?)
    }

    fn xml_batch(count: usize) -> Vec<String> {
        (0..count)
            .map(|n| {
                format!(
                    "<Message><MsgId>M{n:08}</MsgId><TradeRef>T{:06}</TradeRef>\
                     <Quantity>{}</Quantity></Message>",
                    n / 7,
                    1000 + n
                )
            })
            .collect()
    }

    #[test]
    fn a_large_batch_goes_compressed_and_comes_back_whole() {
        let items = xml_batch(256);
        let (payload, compressed) = encode(&items).expect("encodes");
        assert!(compressed);
        assert!(payload.len() * 2 < postcard::to_allocvec(&items).expect("encodes").len());
        let back: Vec<String> =
            decode(&payload, Some(&encoding_headers(compressed))).expect("decodes");
        assert_eq!(back, items);
    }

    #[test]
    fn a_small_batch_goes_as_postcard_without_a_header() {
        let items = xml_batch(1);
        let (payload, compressed) = encode(&items).expect("encodes");
        assert!(!compressed);
        assert!(encoding_headers(compressed).is_empty());
        assert_eq!(payload, postcard::to_allocvec(&items).expect("encodes"));
        let back: Vec<String> = decode(&payload, None).expect("decodes");
        assert_eq!(back, items);
    }

    #[test]
    fn a_compressed_batch_claiming_more_than_the_bound_is_not_decompressed() {
        let mut payload = ((DECODED_MAX_BYTES + 1) as u32).to_le_bytes().to_vec();
        payload.extend_from_slice(&[0x1f, b'x', 0, 0, 0]);
        let error = decode::<String>(&payload, Some(&lz4())).expect_err("refused");
        assert!(error.contains("more than"), "{error}");
        let mut claims_4_gib = u32::MAX.to_le_bytes().to_vec();
        claims_4_gib.push(0);
        assert!(decode::<String>(&claims_4_gib, Some(&lz4())).is_err());
    }

    #[test]
    fn a_compressed_batch_larger_than_it_claims_or_cut_short_is_refused() {
        let items = xml_batch(64);
        let (payload, _) = encode(&items).expect("encodes");
        let mut understated = payload.clone();
        understated[..4].copy_from_slice(&100u32.to_le_bytes());
        assert!(decode::<String>(&understated, Some(&lz4())).is_err());
        let cut = &payload[..payload.len() / 2];
        assert!(decode::<String>(cut, Some(&lz4())).is_err());
        assert!(decode::<String>(&payload[..3], Some(&lz4())).is_err());
    }

    #[test]
    fn a_batch_that_would_decode_to_more_than_a_receiver_takes_is_not_sent() {
        let one_item = vec![vec![7u8; DECODED_MAX_BYTES + 1]];
        let error = encode(&one_item).expect_err("refused");
        assert!(error.contains("more than a receiver takes"), "{error}");
    }

    #[test]
    fn an_unknown_encoding_is_refused_by_name() {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(ENCODING_HEADER, "zstd");
        let error = decode::<String>(b"\x00", Some(&headers)).expect_err("refused");
        assert!(error.contains("zstd"), "{error}");
    }

    proptest::proptest! {
        #[test]
        fn no_payload_said_to_be_compressed_makes_decoding_panic(
            payload in proptest::collection::vec(proptest::num::u8::ANY, 0..2048)
        ) {
            let _ = decode::<String>(&payload, Some(&lz4()));
        }

        #[test]
        fn hostile_bytes_after_a_true_length_do_not_make_decoding_panic(
            body in proptest::collection::vec(proptest::num::u8::ANY, 0..2048),
            size in 0u32..4096,
        ) {
            let mut payload = size.to_le_bytes().to_vec();
            payload.extend_from_slice(&body);
            let _ = decode::<Vec<u8>>(&payload, Some(&lz4()));
        }
    }
}
