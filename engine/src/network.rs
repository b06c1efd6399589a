//! The vocabulary of the queue network (DESIGN.md section 1), shared by its two wirings — in
//! process ([`crate::pipeline`]) and across nodes ([`crate::cluster`]) — and by its stations
//! ([`crate::stations`]): the items at the network's edge (what enters, the answers, what
//! leaves after commit), the submitter that batches what enters, delivery confirmations, the
//! errors, the retry and aging policies, and the threads a wiring starts.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::lease::DeliveryBook;
use crate::matcher::Advice;
use crate::model::Text;
use crate::queue::{QueueError, Tx};
use crate::reason::{ReasonCode, Rejection};
use crate::refdata::RefData;
use crate::routing::shard_of_byte_parts;
use crate::sign::{self, SIGNATURE_LEN};
use crate::station::RunClock;
use crate::store::StoreError;

/// One inbound message as it enters the engine.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Envelope {
    pub bytes: Vec<u8>,
    /// The participant whose key signed the bytes (inline: a BIC fits, so no allocation).
    pub sender: Option<Text>,
    pub signature: Option<[u8; SIGNATURE_LEN]>,
    /// Chosen by the sender of the envelope; returned in its ACK or NAK.
    pub correlation: u64,
    /// The gateway that received the message, whose ACK queue its answer goes to (in a
    /// cluster: the gateway number it holds a lease on; 0 in process). Set by the
    /// [`Submitter`], never by a participant.
    pub origin: u32,
    /// When the message entered the engine, on the run clock.
    pub injected_ns: u64,
    /// Set by a gateway that refuses the message before validation (e.g. a connection sending
    /// as a participant it did not log on as): the validator rejects it with this, so it is
    /// stored as an exception and NAKed like any other rejection.
    pub refusal: Option<Rejection>,
}

/// The result of one inbound message, sent after the commit that holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum AckResult {
    Accepted,
    Duplicate,
    Rejected(ReasonCode),
}

/// An ACK (accepted or duplicate) or NAK (rejected with a code).
#[derive(Debug, Clone, Copy, serde::Serialize, serde::Deserialize)]
pub struct Ack {
    pub correlation: u64,
    /// The gateway the message came through ([`Envelope::origin`]).
    pub origin: u32,
    pub result: AckResult,
}

/// What the engine sends outbound after commit.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub enum OutboundEvent {
    Cls {
        cls_id: String,
        body: String,
        /// Injection time of the trade's first message, on the run clock (0 when re-emitted).
        trade_first_injected_ns: u64,
        shard: u32,
        /// Position in the shard's outbox; confirm it through [`Delivery`].
        outbox_id: i64,
        /// Emitted again after a restart because its delivery was never confirmed.
        redelivered: bool,
    },
    Mismatched(Advice),
    /// A stranger's message no longer counts in a trade: its sender is told.
    Released(crate::matcher::Released),
    /// A trade aged out, committed: its parties are told.
    Aged(crate::matcher::AgedTrade),
}

/// Delivery confirmations from the consumer of the outbound queue. CLS of a shard arrive in
/// outbox order, so one watermark per shard is enough: confirming outbox id n confirms every CLS
/// of that shard up to n. Writers record the watermark in their next transaction; a restart
/// emits again what lies above it.
/// Across nodes, the confirmations go to the cluster's [`DeliveryBook`], which every shard's
/// owner reads: each shard's highest, at most every [`BOOK_CONFIRM_INTERVAL`] (a put into a
/// bucket of three copies is one of the dearer things the servers do, and a watermark only
/// needs its latest value).
#[derive(Clone, Debug)]
pub struct Delivery {
    pub(crate) through: Vec<Arc<std::sync::atomic::AtomicI64>>,
    pub(crate) in_use: Arc<AtomicBool>,
    book: Option<Arc<BookConfirmer>>,
}

/// How often a cluster's sink writes its confirmations into the delivery book, at most.
pub const BOOK_CONFIRM_INTERVAL: Duration = Duration::from_millis(100);

/// A cluster sink's confirmations on their way to the delivery book: each shard's highest
/// outbox id not written yet, written by a thread of their own every
/// [`BOOK_CONFIRM_INTERVAL`], and when the last [`Delivery`] holding them is dropped.
#[derive(Debug)]
struct BookConfirmer {
    book: Arc<DeliveryBook>,
    pending: std::sync::Mutex<std::collections::BTreeMap<u32, i64>>,
    /// What this confirmer wrote last for each shard: a lower confirmation (a CLS batch
    /// delivered again) is not written over it.
    written: std::sync::Mutex<std::collections::BTreeMap<u32, i64>>,
}

impl BookConfirmer {
    fn start(book: Arc<DeliveryBook>) -> Arc<Self> {
        let confirmer = Arc::new(Self {
            book,
            pending: std::sync::Mutex::default(),
            written: std::sync::Mutex::default(),
        });
        let weak = Arc::downgrade(&confirmer);
        std::thread::Builder::new()
            .name("delivery-book".to_owned())
            .spawn(move || loop {
                std::thread::sleep(BOOK_CONFIRM_INTERVAL);
                let Some(confirmer) = weak.upgrade() else {
                    return;
                };
                if let Err(error) = confirmer.write() {
                    tracing::warn!(%error, "a delivery confirmation was not recorded; tried again");
                }
            })
            .expect("the operating system can start a thread");
        confirmer
    }

    fn pending(&self) -> std::sync::MutexGuard<'_, std::collections::BTreeMap<u32, i64>> {
        self.pending
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn add(&self, shard: u32, outbox_id: i64) {
        let mut pending = self.pending();
        let through = pending.entry(shard).or_insert(outbox_id);
        *through = (*through).max(outbox_id);
    }

    /// Writes what is pending; what could not be written stays pending.
    fn write(&self) -> Result<(), QueueError> {
        let pending = std::mem::take(&mut *self.pending());
        let mut written = self
            .written
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut failed = None;
        for (shard, outbox_id) in pending {
            if written.get(&shard).is_some_and(|&last| last >= outbox_id) {
                continue;
            }
            if failed.is_some() {
                self.add(shard, outbox_id);
                continue;
            }
            match self.book.confirm(shard, outbox_id) {
                Ok(()) => {
                    written.insert(shard, outbox_id);
                }
                Err(error) => {
                    self.add(shard, outbox_id);
                    failed = Some(error);
                }
            }
        }
        failed.map_or(Ok(()), Err)
    }
}

impl Drop for BookConfirmer {
    fn drop(&mut self) {
        if let Err(error) = self.write() {
            tracing::warn!(%error, "the last delivery confirmations were not recorded");
        }
    }
}

impl Delivery {
    /// Confirmations kept in this process, one watermark for each of `shards`; in use once
    /// the consumer of the outbound queue takes it.
    pub(crate) fn local(shards: u32) -> Self {
        Self {
            through: (0..shards)
                .map(|_| Arc::new(std::sync::atomic::AtomicI64::new(0)))
                .collect(),
            in_use: Arc::new(AtomicBool::new(false)),
            book: None,
        }
    }

    /// Confirmations recorded in a cluster's delivery book.
    pub fn cluster(book: Arc<DeliveryBook>) -> Self {
        Self {
            through: Vec::new(),
            in_use: Arc::new(AtomicBool::new(true)),
            book: Some(BookConfirmer::start(book)),
        }
    }

    /// Confirms that the CLS at `outbox_id` of `shard` (and every earlier one) was delivered:
    /// at once in this process; in a cluster, in the delivery book within
    /// [`BOOK_CONFIRM_INTERVAL`] (or at [`Delivery::flush`]).
    pub fn confirm(&self, shard: u32, outbox_id: i64) -> Result<(), QueueError> {
        if let Some(book) = &self.book {
            book.add(shard, outbox_id);
            return Ok(());
        }
        if let Some(through) = self.through.get(shard as usize) {
            through.fetch_max(outbox_id, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Confirms each `(shard, outbox_id)` (each shard's highest is what counts, in process and
    /// in the book).
    pub fn confirm_all(&self, confirmed: &[(u32, i64)]) -> Result<(), QueueError> {
        confirmed
            .iter()
            .try_for_each(|&(shard, outbox_id)| self.confirm(shard, outbox_id))
    }

    /// Records at once what was confirmed and not recorded yet (a cluster's sink, as it ends).
    pub fn flush(&self) -> Result<(), QueueError> {
        self.book.as_ref().map_or(Ok(()), |book| book.write())
    }
}

/// How long a stopping writer waits for the confirmation of the CLS it emitted last.
pub(crate) const DELIVERY_WAIT: Duration = Duration::from_secs(5);

/// Aging of unmatched trades: closed after `business_days` whole business days of their
/// market without an accepted message (DESIGN.md section 4; default 20, after T2S's recycling
/// period). Each matcher runs it once a day, at its first wake-up of the day: a batch, or an
/// idle wait of `check_interval`.
#[derive(Debug, Clone, Copy)]
pub struct Aging {
    pub business_days: u32,
    pub check_interval: Duration,
}

impl Default for Aging {
    fn default() -> Self {
        Self {
            business_days: 20,
            check_interval: Duration::from_secs(60),
        }
    }
}

/// Retries of a failed commit: exponential backoff from `backoff_first` to `backoff_max`, for
/// at most `give_up_after`; meanwhile the writer's queue fills and backpressure reaches the
/// producers, and the other shards go on.
#[derive(Debug, Clone, Copy)]
pub struct RetryPolicy {
    pub backoff_first: Duration,
    pub backoff_max: Duration,
    pub give_up_after: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            backoff_first: Duration::from_millis(50),
            backoff_max: Duration::from_secs(2),
            give_up_after: Duration::from_secs(60),
        }
    }
}

/// Why the pipeline stopped.
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("cannot write samples: {0}")]
    Samples(std::io::Error),
    #[error("the pipeline has stopped: {0}")]
    Stopped(String),
    #[error("the store of {station} failed")]
    Shard {
        station: String,
        #[source]
        source: StoreError,
    },
    #[error("bad configuration: {0}")]
    Config(String),
    #[error("a pipeline thread panicked: {0}")]
    Panicked(String),
    #[error(transparent)]
    Queue(QueueError),
    /// This node no longer holds the shard's lease: it stopped writing the shard.
    #[error("the lease of shard {shard} was lost")]
    LeaseLost { shard: u32 },
}

/// Bytes of its raw input an exception keeps when the input's signature was not checked (too
/// large, unsigned, a bad signature, unreadable, refused by a listener): what an
/// unauthenticated client can make the engine store is bounded. The detail then gives the full
/// length and its xxh3 hash.
pub const EXCEPTION_RAW_PREFIX_BYTES: usize = 4096;
const _: () = assert!(EXCEPTION_RAW_PREFIX_BYTES < crate::validate::MESSAGE_SIZE_MAX_BYTES);

/// Messages per batch on the inbound queues: one channel operation (and at most one wake-up of a
/// validator) per batch instead of per message.
pub const INBOUND_BATCH_MESSAGES: usize = 64;

/// Sends envelopes into the sharded inbound queues, in batches of up to
/// [`INBOUND_BATCH_MESSAGES`]. Cloneable: several producers may submit; each must
/// [`flush`](Submitter::flush) what it holds before it is dropped or waits.
pub struct Submitter {
    inbound: Vec<Tx<Envelope>>,
    pending: Vec<Vec<Envelope>>,
    clock: RunClock,
    origin: u32,
    batch_messages: usize,
}

impl Clone for Submitter {
    fn clone(&self) -> Self {
        Self {
            inbound: self.inbound.clone(),
            pending: vec![Vec::new(); self.inbound.len()],
            clock: self.clock,
            origin: self.origin,
            batch_messages: self.batch_messages,
        }
    }
}

impl Submitter {
    /// A submitter onto `inbound` (one queue per partition, in order), stamping every envelope
    /// with `origin`, the gateway whose ACK queue answers it.
    pub fn new(inbound: Vec<Tx<Envelope>>, clock: RunClock, origin: u32) -> Self {
        Self {
            pending: vec![Vec::new(); inbound.len()],
            inbound,
            clock,
            origin,
            batch_messages: INBOUND_BATCH_MESSAGES,
        }
    }

    /// This submitter, sending batches of up to `messages` (at least one) instead of
    /// [`INBOUND_BATCH_MESSAGES`]: across nodes a batch is what a queue's server stores, reads
    /// and deletes as one.
    pub fn with_batch_messages(mut self, messages: usize) -> Self {
        self.batch_messages = messages.max(1);
        self
    }

    /// Messages submitted and not sent yet (in partial batches).
    pub fn pending(&self) -> usize {
        self.pending.iter().map(Vec::len).sum()
    }

    /// Messages of a whole batch on every partition: the most [`Submitter::pending`] can hold.
    pub fn whole_batches(&self) -> usize {
        self.batch_messages * self.inbound.len()
    }

    /// The run clock, for stamping `injected_ns`.
    pub fn clock(&self) -> RunClock {
        self.clock
    }

    /// Adds one envelope to the batch of its trade's inbound queue, sending the batch when full
    /// (blocking while that queue is full).
    pub fn submit(&mut self, mut envelope: Envelope) -> Result<(), PipelineError> {
        envelope.origin = self.origin;
        let index = inbound_index(&envelope.bytes, self.inbound.len());
        self.pending[index].push(envelope);
        if self.pending[index].len() >= self.batch_messages {
            self.send(index)?;
        }
        Ok(())
    }

    /// Signs a line with its claimed sender's key (unsigned if there is none) and submits it.
    pub fn submit_line(
        &mut self,
        refdata: &RefData,
        bytes: Vec<u8>,
        correlation: u64,
    ) -> Result<(), PipelineError> {
        let envelope = sign_line(refdata, bytes, correlation, self.clock.now_ns());
        self.submit(envelope)
    }

    /// Sends every partial batch.
    pub fn flush(&mut self) -> Result<(), PipelineError> {
        for index in 0..self.pending.len() {
            if !self.pending[index].is_empty() {
                self.send(index)?;
            }
        }
        Ok(())
    }

    fn send(&mut self, index: usize) -> Result<(), PipelineError> {
        let batch = std::mem::replace(
            &mut self.pending[index],
            Vec::with_capacity(self.batch_messages),
        );
        self.inbound[index]
            .send(batch)
            .map_err(crate::stations::queue_error)
    }
}

/// Builds the envelope a participant would send: signed with the key of the line's first
/// `<Sender>`, or unsigned when there is none or it has no key.
pub fn sign_line(
    refdata: &RefData,
    bytes: Vec<u8>,
    correlation: u64,
    injected_ns: u64,
) -> Envelope {
    let sender = sign::claimed_sender(&bytes);
    let signature = sender
        .and_then(|sender| refdata.participant_mac(sender))
        .map(|(_, mac)| sign::sign_keyed(mac, &bytes));
    let sender = sender.map(Text::from);
    envelope(bytes, sender, signature, correlation, injected_ns)
}

/// The envelope of a line signed beforehand (a pre-signed message set), as [`sign_line`] would
/// have made it: its claimed sender and `signature` (`None`: sent unsigned).
pub fn signed_line(
    bytes: Vec<u8>,
    signature: Option<[u8; SIGNATURE_LEN]>,
    correlation: u64,
    injected_ns: u64,
) -> Envelope {
    let sender = sign::claimed_sender(&bytes).map(Text::from);
    envelope(bytes, sender, signature, correlation, injected_ns)
}

fn envelope(
    bytes: Vec<u8>,
    sender: Option<Text>,
    signature: Option<[u8; SIGNATURE_LEN]>,
    correlation: u64,
    injected_ns: u64,
) -> Envelope {
    Envelope {
        sender,
        bytes,
        signature,
        correlation,
        origin: 0,
        injected_ns,
        refusal: None,
    }
}

/// The inbound queue of a message: the shard of the trade its bytes name, over `queues`
/// ([`crate::routing`]), so that a trade's messages stay in order and, where there is one
/// inbound queue per shard (a cluster), a message's queue is its shard's; queue 0 when the
/// bytes name no trade. The bytes are scanned, not parsed: a validator that parses them to
/// another trade sends the message on ([`crate::stations::validator`]).
pub fn inbound_index(bytes: &[u8], queues: usize) -> usize {
    static BROKER: LazyLock<sign::Element> = LazyLock::new(|| sign::Element::new("Broker"));
    static TRADE_REF: LazyLock<sign::Element> = LazyLock::new(|| sign::Element::new("TradeRef"));
    match (BROKER.text(bytes), TRADE_REF.text(bytes)) {
        (Some(broker), Some(trade_ref)) => {
            shard_of_byte_parts(broker, trade_ref, queues as u32) as usize
        }
        _ => 0,
    }
}

pub(crate) type Joined<T> = JoinHandle<Result<T, PipelineError>>;

pub(crate) fn spawn<T: Send + 'static>(
    name: String,
    body: impl FnOnce() -> Result<T, PipelineError> + Send + 'static,
) -> Joined<T> {
    std::thread::Builder::new()
        .name(name)
        .spawn(body)
        .expect("the operating system can start a thread")
}

/// [`spawn`], the thread's CPU added to `ledger` under its role when it ends.
pub(crate) fn spawn_counted<T: Send + 'static>(
    ledger: &Arc<crate::cpu::CpuLedger>,
    name: String,
    body: impl FnOnce() -> Result<T, PipelineError> + Send + 'static,
) -> Joined<T> {
    let ledger = ledger.clone();
    let thread = name.clone();
    spawn(name, move || crate::cpu::counted(&ledger, &thread, body))
}

pub(crate) fn join<T>(handle: Joined<T>) -> Result<T, PipelineError> {
    let name = handle.thread().name().unwrap_or("unnamed").to_owned();
    handle.join().map_err(|_| PipelineError::Panicked(name))?
}
