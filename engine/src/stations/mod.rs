//! The stations of the queue network (DESIGN.md section 1): each one takes batches off its
//! queue, serves them and hands what it produced to the next queues. They see queues only
//! through [`crate::queue`], so the same station runs whether its queues are in process or
//! cross nodes.
//!
//! ```text
//! inbound[i] → validator ─ok→ match[k] → matcher k → store[k] → writer k ─after commit→ acks, outbound
//!                        └rejected→ exceptions → exception writer ─after commit→ acks
//! ```

pub(crate) mod exceptions;
pub(crate) mod matcher;
pub(crate) mod sampler;
pub(crate) mod validator;
pub(crate) mod writer;

use std::time::{Duration, Instant};

use time::Date;

use crate::matcher::{AgedTrade, Content, Outcome};
use crate::model::{Msg, Text};
use crate::network::{PipelineError, RetryPolicy};
use crate::queue::{receive, QueueError, Receipt, Rx};
use crate::reason::Rejection;
use crate::store::{Batch, RowCounts, Store, StoreError};

/// Commits `batch`, retrying transient failures with backoff and a new connection.
pub(crate) fn commit_retrying(
    store: &mut dyn Store,
    batch: &mut Batch,
    station: &str,
    retry: RetryPolicy,
) -> Result<(Vec<i64>, u64), PipelineError> {
    retrying(store, station, "commit", retry, |store| store.commit(batch))
}

/// Runs `operation` (named `what` in the log) on `store`, retrying transient failures with
/// backoff and a new connection for at most the policy's time. Returns its result and the
/// number of retries.
pub(crate) fn retrying<T>(
    store: &mut dyn Store,
    station: &str,
    what: &'static str,
    retry: RetryPolicy,
    mut operation: impl FnMut(&mut dyn Store) -> Result<T, StoreError>,
) -> Result<(T, u64), PipelineError> {
    let started = Instant::now();
    let mut backoff = retry.backoff_first;
    let mut attempt: u32 = 1;
    loop {
        let error = match operation(store) {
            Ok(result) => {
                if attempt > 1 {
                    tracing::warn!(station, attempt, what, "succeeded after retrying");
                }
                return Ok((result, u64::from(attempt - 1)));
            }
            Err(error) => error,
        };
        if !store.is_transient(&error) || started.elapsed() + backoff > retry.give_up_after {
            return Err(PipelineError::Shard {
                station: station.to_owned(),
                source: error,
            });
        }
        tracing::warn!(station, attempt, what, error = %error, backoff_ms = backoff.as_millis() as u64, "failed; retrying");
        std::thread::sleep(backoff);
        backoff = (backoff * 2).min(retry.backoff_max);
        attempt += 1;
        if let Err(error) = store.reconnect() {
            tracing::warn!(station, error = %error, "reconnect failed");
        }
    }
}

/// A message as a validator hands it to its shard: parsed, or refused after its signature
/// checked out (the shard remembers its MsgId).
pub struct Validated {
    /// The message, or why the validator rejected it after its signature checked out. Boxed:
    /// the item is moved from batch to batch and into its trade, and a pointer moves for less
    /// than the message's ~600 bytes.
    verdict: Result<Box<Msg>, Refused>,
    bytes: Vec<u8>,
    /// What the matcher keeps of `bytes`, made by the validator while they are in its cache.
    content: Content,
    correlation: u64,
    origin: u32,
    injected_ns: u64,
}

impl RejectedItem {
    /// `envelope`'s message, rejected with `rejection`.
    pub(crate) fn of(envelope: crate::network::Envelope, rejection: Rejection) -> Self {
        Self {
            rejection,
            sender: envelope.sender.map(crate::model::Text::into_string),
            bytes: envelope.bytes,
            correlation: envelope.correlation,
            origin: envelope.origin,
        }
    }

    /// The code it was rejected with.
    pub fn code(&self) -> crate::reason::ReasonCode {
        self.rejection.code
    }
}

impl Validated {
    /// The trade the message belongs to (`Broker/TradeRef`).
    pub fn trade_key(&self) -> String {
        match &self.verdict {
            Ok(msg) => msg.trade_key(),
            Err(refused) => {
                crate::model::trade_key(&refused.identity.broker, &refused.identity.trade_ref)
            }
        }
    }

    /// Whether the validator passed the message.
    pub fn passed(&self) -> bool {
        self.verdict.is_ok()
    }

    /// What the item costs on a queue: its raw bytes (the parsed message's text is about as
    /// long again), the fixed size of the item and that of the boxed message.
    pub(crate) fn weight_bytes(&self) -> usize {
        let parsed = if self.verdict.is_ok() {
            std::mem::size_of::<Msg>()
        } else {
            0
        };
        2 * self.bytes.len() + std::mem::size_of::<Self>() + parsed
    }
}

/// A message rejected after its signature checked out: its shard's matcher remembers its MsgId.
pub struct Refused {
    rejection: Rejection,
    identity: crate::validate::Identity,
}

/// The few fields of a message that its store row needs once the matcher owns the message.
pub(crate) struct MessageMeta {
    trade_key: String,
    sender: Text,
    msg_id: Text,
    msg_type: &'static str,
    function: &'static str,
    related_id: Option<Text>,
}

impl MessageMeta {
    fn of(msg: &Msg) -> Self {
        Self {
            trade_key: msg.trade_key(),
            sender: msg.sender.clone(),
            msg_id: msg.msg_id.clone(),
            msg_type: msg.msg_type.as_str(),
            function: msg.function.as_str(),
            related_id: msg.related_id.clone(),
        }
    }
}

/// What a shard writer writes: the outcome of a message, or a trade that aged out.
// Messages are the hot path and aged trades rare: boxing the large variant would cost every
// message an allocation to save queue slots a few bytes.
#[allow(clippy::large_enum_variant)]
pub(crate) enum ToStore {
    Message(Processed),
    Aged(AgedTrade),
}

impl ToStore {
    /// What the item costs on a queue: a message's raw bytes and about as much again for what
    /// the matcher made of it, the fixed size of the item and that of a boxed CLS.
    pub(crate) fn weight_bytes(&self) -> usize {
        let (raw, cls) = match self {
            Self::Message(processed) => (
                processed.bytes.len(),
                processed
                    .outcome
                    .cls
                    .as_ref()
                    .map_or(0, |_| std::mem::size_of::<crate::model::Cls>()),
            ),
            Self::Aged(_) => (0, 0),
        };
        2 * raw + std::mem::size_of::<Self>() + cls
    }
}

pub(crate) struct Processed {
    /// The day the matcher took the message, which aging counts from.
    received_on: Date,
    outcome: Outcome,
    meta: MessageMeta,
    bytes: Vec<u8>,
    correlation: u64,
    origin: u32,
    injected_ns: u64,
}

/// A message a validator rejected before any shard could take it, for the exception writer.
#[derive(serde::Serialize, serde::Deserialize)]
pub struct RejectedItem {
    rejection: Rejection,
    sender: Option<String>,
    bytes: Vec<u8>,
    correlation: u64,
    origin: u32,
}

/// What a writer reports when it stops.
pub(crate) struct WriterReport {
    pub(crate) rows: RowCounts,
    pub(crate) commit_retries: u64,
}

/// A queue's failure as the pipeline reports it: a closed queue means a station around it
/// stopped, which is a consequence; a failed carrier is a cause.
pub(crate) fn queue_error(error: QueueError) -> PipelineError {
    match error {
        QueueError::Closed { .. } => PipelineError::Stopped(error.to_string()),
        QueueError::Carrier { .. } => PipelineError::Queue(error),
    }
}

/// Counts the completion of `count` items of `rx`'s station that took `busy_ns` of service,
/// queued since `enqueued_ns`.
pub(crate) fn complete<T>(rx: &Rx<T>, count: u64, busy_ns: u64, enqueued_ns: u64) {
    let response_ns = count * rx.now_ns().saturating_sub(enqueued_ns);
    rx.station().complete(count, busy_ns, response_ns);
}

/// Counts the completion of a merged batch of `count` items on `rx`'s station, which took
/// `busy_ns` of service: each item's time there runs from its batch's enqueue stamp to now, the
/// time it waited to be merged with later batches included (`enqueued_sum_ns`, the sum of the
/// items' stamps, wrapping). So the station's directly measured R covers exactly what its
/// population counts, from arrival to completion, and Little's law holds between them.
pub(crate) fn complete_merged<T>(rx: &Rx<T>, count: u64, busy_ns: u64, enqueued_sum_ns: u64) {
    let response_ns = count
        .wrapping_mul(rx.now_ns())
        .wrapping_sub(enqueued_sum_ns);
    rx.station().complete(count, busy_ns, response_ns);
}

/// A batch merged from several queue batches, with the sum of its items' enqueue stamps and the
/// receipts of every batch it holds. The batches are kept as they came, not copied into one
/// vector: a writer's merged batch can hold thousands of items of a few hundred bytes, and
/// gathering them moved every item once more and grew a vector of fresh pages each time.
pub(crate) struct Merged<T> {
    batches: Vec<Vec<T>>,
    /// Σ over the merged batches of (items × enqueue stamp), wrapping.
    enqueued_sum_ns: u64,
    receipt: Receipt,
}

impl<T> Merged<T> {
    /// How many items the merged batches hold.
    pub fn len(&self) -> usize {
        self.batches.iter().map(Vec::len).sum()
    }

    /// The items, in the order they were queued, and the stamps and receipts apart.
    pub fn into_parts(self) -> (impl Iterator<Item = T>, u64, Receipt) {
        (
            self.batches.into_iter().flatten(),
            self.enqueued_sum_ns,
            self.receipt,
        )
    }
}

/// Takes the first batch (waiting for it), then whatever is already queued or arrives within
/// `linger`, until `batch_max` items are held. `None` once the queue is closed and drained.
pub(crate) fn next_batch<T>(
    rx: &Rx<T>,
    batch_max: usize,
    linger: Duration,
) -> Result<Option<Merged<T>>, PipelineError> {
    let Some(first) = receive(rx).map_err(queue_error)? else {
        return Ok(None);
    };
    let deadline = Instant::now() + linger;
    let stamps = |count: usize, enqueued_ns: u64| (count as u64).wrapping_mul(enqueued_ns);
    let mut held = first.items.len();
    let mut merged = Merged {
        enqueued_sum_ns: stamps(first.items.len(), first.enqueued_ns),
        batches: vec![first.items],
        receipt: first.receipt,
    };
    while held < batch_max {
        let next = match rx.recv_until(Some(deadline)) {
            Ok(Some(next)) => next,
            Ok(None) | Err(QueueError::Closed { .. }) => break,
            Err(error) => return Err(queue_error(error)),
        };
        merged.enqueued_sum_ns = merged
            .enqueued_sum_ns
            .wrapping_add(stamps(next.items.len(), next.enqueued_ns));
        held += next.items.len();
        merged.batches.push(next.items);
        merged.receipt.merge(next.receipt);
    }
    Ok(Some(merged))
}
