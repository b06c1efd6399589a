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
use crate::queue::{receive, QueueError, Receipt, Received, Rx};
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

/// What one transaction holds at most: messages, and their weight in bytes (what holding them
/// costs in memory, as the station's queue items weigh themselves: [`ToStore::weight_bytes`],
/// [`RejectedItem::weight_bytes`]). A message heavier than the byte bound is committed alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchBound {
    pub messages: usize,
    pub bytes: usize,
}

impl BatchBound {
    /// The default bound: 16,384 messages, which a writer's transactions reach under a
    /// saturating load, or 32 MiB of them as a writer weighs them ([`ToStore::weight_bytes`]:
    /// twice the raw bytes and the item's fixed size, 304 bytes on x86-64 today). Standard
    /// messages of about 580 bytes weigh about 1.5 KB, so 16,384 of them stay under 25 MB;
    /// messages of the largest size, 64 KiB, reach the byte bound at 255. Larger transactions
    /// than the former 4,096 cost the servers less a message (BENCHMARKS.md).
    pub const DEFAULT: Self = Self {
        messages: 16_384,
        bytes: 32 * 1024 * 1024,
    };

    /// Bytes of the queue in front of a writer committing at this bound: two transactions'
    /// worth, so that the next transaction is ready when one commits, and no more (what waits
    /// beyond it waits upstream, in the match queue's bounded backlog).
    pub const fn queue_bytes(self) -> usize {
        self.bytes.saturating_mul(2)
    }
}

impl Default for BatchBound {
    fn default() -> Self {
        Self::DEFAULT
    }
}

impl RejectedItem {
    /// What the item costs while the exception writer holds it: its bytes, its reason's detail
    /// and sender, and its fixed size.
    pub(crate) fn weight_bytes(&self) -> usize {
        self.bytes.len()
            + self.rejection.detail.len()
            + self.sender.as_ref().map_or(0, String::len)
            + std::mem::size_of::<Self>()
    }
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
    /// The items held, and their weight.
    items: usize,
    bytes: usize,
}

impl<T> Merged<T> {
    /// How many items the merged batches hold.
    pub fn len(&self) -> usize {
        self.items
    }

    /// The items, in the order they were queued, and the stamps and receipts apart.
    pub fn into_parts(self) -> (impl Iterator<Item = T>, u64, Receipt) {
        (
            self.batches.into_iter().flatten(),
            self.enqueued_sum_ns,
            self.receipt,
        )
    }

    fn empty() -> Self {
        Self {
            batches: Vec::new(),
            enqueued_sum_ns: 0,
            receipt: Receipt::none(),
            items: 0,
            bytes: 0,
        }
    }

    fn is_full(&self, bound: BatchBound) -> bool {
        self.items >= bound.messages || self.bytes >= bound.bytes
    }

    /// Takes as much of `received` as `bound` leaves room for (its first item at least, if
    /// nothing is held yet) and returns the rest, with its share of the receipt.
    fn take_fitting(
        &mut self,
        mut received: Received<T>,
        bound: BatchBound,
        weigh: fn(&T) -> usize,
    ) -> Option<Received<T>> {
        if received.items.is_empty() {
            // Nothing to commit: acknowledged with the transaction it came with.
            self.receipt.merge(received.receipt);
            return None;
        }
        let mut fitting = 0;
        let mut bytes = 0;
        for item in &received.items {
            let weight = weigh(item);
            let room = self.items + fitting < bound.messages
                && (self.bytes + bytes + weight <= bound.bytes || self.items + fitting == 0);
            if !room {
                break;
            }
            bytes += weight;
            fitting += 1;
        }
        if fitting == 0 {
            return Some(received);
        }
        let rest = (fitting < received.items.len()).then(|| received.items.split_off(fitting));
        let receipt = match rest {
            Some(_) => {
                let mut parts = received.receipt.split(2).into_iter();
                let taken = parts.next().unwrap_or_default();
                received.receipt = parts.next().unwrap_or_default();
                taken
            }
            None => std::mem::take(&mut received.receipt),
        };
        self.enqueued_sum_ns = self
            .enqueued_sum_ns
            .wrapping_add((fitting as u64).wrapping_mul(received.enqueued_ns));
        self.items += fitting;
        self.bytes += bytes;
        self.receipt.merge(receipt);
        let taken = std::mem::replace(&mut received.items, rest.unwrap_or_default());
        self.batches.push(taken);
        (!received.items.is_empty()).then_some(received)
    }
}

/// Merges a queue's batches into transactions within a [`BatchBound`]: a queued batch that does
/// not fit is split, and its rest starts the next transaction, so the bound holds exactly
/// whatever size the batches were queued in.
pub(crate) struct Batcher<T> {
    rx: Rx<T>,
    bound: BatchBound,
    weigh: fn(&T) -> usize,
    linger: Duration,
    /// The rest of a queued batch the last transaction had no room for.
    carried: Option<Received<T>>,
}

impl<T> Batcher<T> {
    /// A bound of no message or no byte is taken as one: a transaction holds a message at least.
    pub(crate) fn new(
        rx: Rx<T>,
        bound: BatchBound,
        weigh: fn(&T) -> usize,
        linger: Duration,
    ) -> Self {
        let bound = BatchBound {
            messages: bound.messages.max(1),
            bytes: bound.bytes.max(1),
        };
        Self {
            rx,
            bound,
            weigh,
            linger,
            carried: None,
        }
    }

    /// The queue batches come from.
    pub(crate) fn rx(&self) -> &Rx<T> {
        &self.rx
    }

    /// Takes the first batch (waiting for it), then whatever is already queued or arrives
    /// within the linger, until the bound is reached. `None` once the queue is closed and
    /// drained.
    pub(crate) fn next(&mut self) -> Result<Option<Merged<T>>, PipelineError> {
        let first = loop {
            let received = match self.carried.take() {
                Some(carried) => carried,
                None => match receive(&self.rx).map_err(queue_error)? {
                    Some(received) => received,
                    None => return Ok(None),
                },
            };
            if !received.items.is_empty() {
                break received;
            }
            // A batch of nothing stands for nothing to commit.
            received.receipt.ack().map_err(queue_error)?;
        };
        let deadline = Instant::now() + self.linger;
        let mut merged = Merged::empty();
        let mut next = Some(first);
        while let Some(received) = next.take() {
            if let Some(rest) = merged.take_fitting(received, self.bound, self.weigh) {
                self.carried = Some(rest);
                break;
            }
            if merged.is_full(self.bound) {
                break;
            }
            next = match self.rx.recv_until(Some(deadline)) {
                Ok(next) => next,
                Err(QueueError::Closed { .. }) => None,
                Err(error) => return Err(queue_error(error)),
            };
        }
        assert!(merged.items >= 1, "a merged batch holds an item");
        assert!(
            merged.items <= self.bound.messages,
            "a merged batch holds at most its bound's messages"
        );
        assert!(
            merged.bytes <= self.bound.bytes || merged.items == 1,
            "a merged batch weighs at most its bound's bytes, or is one message"
        );
        Ok(Some(merged))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    use super::*;
    use crate::queue::local;
    use crate::queue::BatchSender;
    use crate::station::RunClock;

    /// An item that weighs its value in bytes.
    struct Weight(usize);

    fn weigh(item: &Weight) -> usize {
        item.0
    }

    fn batcher(bound: BatchBound, batches: Vec<Vec<usize>>) -> Batcher<Weight> {
        let (tx, rx) = local::bounded::<Weight>("store.0", 64, RunClock::start());
        for batch in batches {
            tx.send(batch.into_iter().map(Weight).collect())
                .expect("the queue takes the batch");
        }
        Batcher::new(Box::new(rx), bound, weigh, Duration::ZERO)
    }

    /// Each merged batch's weights, until the queue is drained (its senders are gone).
    fn transactions(mut batches: Batcher<Weight>) -> Vec<Vec<usize>> {
        let mut out = Vec::new();
        while let Some(merged) = batches.next().expect("the queue drains") {
            let (items, _, receipt) = merged.into_parts();
            out.push(items.map(|item| item.0).collect());
            receipt.ack().expect("acknowledged");
        }
        out
    }

    #[test]
    fn a_queued_batch_past_the_message_bound_is_split_and_its_rest_starts_the_next() {
        let bound = BatchBound {
            messages: 3,
            bytes: 1 << 20,
        };
        let got = transactions(batcher(
            bound,
            vec![vec![1, 2], vec![3, 4, 5, 6, 7], vec![8]],
        ));
        assert_eq!(got, vec![vec![1, 2, 3], vec![4, 5, 6], vec![7, 8]]);
    }

    #[test]
    fn the_byte_bound_holds_and_a_heavier_message_goes_alone() {
        let bound = BatchBound {
            messages: 100,
            bytes: 10,
        };
        let got = transactions(batcher(
            bound,
            vec![vec![4, 4, 4], vec![25, 1], vec![6, 4, 1]],
        ));
        assert_eq!(
            got,
            vec![vec![4, 4], vec![4], vec![25], vec![1, 6], vec![4, 1]]
        );
        for transaction in &got {
            assert!(transaction.len() == 1 || transaction.iter().sum::<usize>() <= 10);
        }
    }

    #[test]
    fn an_empty_queued_batch_is_acknowledged_with_the_transaction_it_joins() {
        let acked = Arc::new(AtomicBool::new(false));
        let flag = acked.clone();
        let bound = BatchBound {
            messages: 2,
            bytes: 100,
        };
        let mut merged = Merged::empty();
        let first = Received {
            items: vec![Weight(1)],
            enqueued_ns: 1,
            receipt: Receipt::none(),
        };
        assert!(merged.take_fitting(first, bound, weigh).is_none());
        let empty = Received {
            items: Vec::new(),
            enqueued_ns: 2,
            receipt: Receipt::from_fn(move || {
                flag.store(true, Ordering::SeqCst);
                Ok(())
            }),
        };
        assert!(
            merged.take_fitting(empty, bound, weigh).is_none(),
            "nothing carried"
        );
        assert_eq!((merged.len(), merged.enqueued_sum_ns), (1, 1));
        let (_, _, receipt) = merged.into_parts();
        assert!(!acked.load(Ordering::SeqCst), "not before the transaction");
        receipt.ack().expect("acknowledged");
        assert!(acked.load(Ordering::SeqCst));
    }

    #[test]
    fn a_split_batch_is_acknowledged_once_both_parts_are() {
        let acked = Arc::new(AtomicBool::new(false));
        let flag = acked.clone();
        let received = Received {
            items: vec![Weight(1), Weight(1), Weight(1)],
            enqueued_ns: 7,
            receipt: Receipt::from_fn(move || {
                flag.store(true, Ordering::SeqCst);
                Ok(())
            }),
        };
        let bound = BatchBound {
            messages: 2,
            bytes: 100,
        };
        let mut merged = Merged::empty();
        let rest = merged.take_fitting(received, bound, weigh).expect("a rest");
        assert_eq!((merged.len(), rest.items.len()), (2, 1));
        assert_eq!(merged.enqueued_sum_ns, 14, "two items stamped 7");
        let (_, _, receipt) = merged.into_parts();
        receipt.ack().expect("acknowledged");
        assert!(
            !acked.load(Ordering::SeqCst),
            "half of the batch is not yet committed"
        );
        rest.receipt.ack().expect("acknowledged");
        assert!(acked.load(Ordering::SeqCst));
    }
}
