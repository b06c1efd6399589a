//! The queues between stations (DESIGN.md section 1): one interface to send and receive
//! batches, whatever carries them. [`local`] carries them between the threads of one process,
//! [`jetstream`] between the nodes of a cluster.
//!
//! Invariants of the seam:
//! - A queue holds batches, never single items, and is bounded; a full queue makes its
//!   senders wait. Nothing is dropped.
//! - A batch is acknowledged (its [`Receipt`]) once everything produced from it is committed
//!   or handed on. A carrier that can lose a consumer redelivers what was not acknowledged;
//!   in process nothing is lost while the process lives, and acknowledging does nothing.
//! - Every batch carries the time it was enqueued, so the consuming station measures its
//!   waiting time wherever the batch came from.
//! - Each queue counts its arrivals on its [`Station`]; the consuming station counts the
//!   completions there.

pub mod jetstream;
pub mod local;

use std::sync::Arc;
use std::time::Instant;

use crate::station::Station;

/// Why a queue could not take or give a batch.
#[derive(Debug, thiserror::Error)]
pub enum QueueError {
    /// Every sender is gone and the queue is drained (receiving), or the receiver is gone
    /// (sending).
    #[error("{queue} queue closed")]
    Closed { queue: String },
    /// The carrier failed.
    #[error("{queue} queue: {detail}")]
    Carrier { queue: String, detail: String },
}

/// Acknowledges a received batch; see the module's invariants.
#[must_use = "a batch is acknowledged once what it produced is committed or handed on"]
#[derive(Default)]
pub struct Receipt {
    acks: Vec<Box<dyn FnOnce() -> Result<(), QueueError> + Send>>,
}

impl Receipt {
    /// A receipt whose acknowledgement does nothing (in process).
    pub fn none() -> Self {
        Self::default()
    }

    /// A receipt that runs `ack` when acknowledged.
    pub fn from_fn(ack: impl FnOnce() -> Result<(), QueueError> + Send + 'static) -> Self {
        Self {
            acks: vec![Box::new(ack)],
        }
    }

    /// Adds the acknowledgements of `other`: a station that merged batches acknowledges
    /// them together.
    pub fn merge(&mut self, other: Receipt) {
        self.acks.extend(other.acks);
    }

    /// Splits this receipt into `parts` (at least one), for a station that hands one batch on
    /// in several parts: what this one stands for is acknowledged once every part is. A part
    /// dropped unacknowledged leaves it unacknowledged (the carrier delivers it again).
    pub fn split(self, parts: usize) -> Vec<Receipt> {
        let parts = parts.max(1);
        if self.acks.is_empty() || parts == 1 {
            let mut split = Vec::with_capacity(parts);
            split.push(self);
            split.resize_with(parts, Receipt::none);
            return split;
        }
        let whole = Arc::new(std::sync::Mutex::new((parts, Some(self))));
        (0..parts)
            .map(|_| {
                let whole = whole.clone();
                Receipt::from_fn(move || {
                    let last = {
                        let mut whole = whole
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner);
                        whole.0 -= 1;
                        if whole.0 == 0 {
                            whole.1.take()
                        } else {
                            None
                        }
                    };
                    last.map_or(Ok(()), Receipt::ack)
                })
            })
            .collect()
    }

    /// Acknowledges every batch this receipt stands for.
    pub fn ack(self) -> Result<(), QueueError> {
        self.acks.into_iter().try_for_each(|ack| ack())
    }
}

impl std::fmt::Debug for Receipt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Receipt")
            .field("batches", &self.acks.len())
            .finish()
    }
}

/// A batch as it comes off a queue.
#[derive(Debug)]
pub struct Received<T> {
    pub items: Vec<T>,
    /// When the batch was enqueued, in nanoseconds on the clock of the queue.
    pub enqueued_ns: u64,
    pub receipt: Receipt,
}

/// The sending end of a queue.
pub trait BatchSender<T>: Send {
    /// Enqueues one batch, waiting while the queue is full. An empty batch is not sent.
    fn send(&self, items: Vec<T>) -> Result<(), QueueError> {
        self.forward(items, Receipt::none())
    }
    /// Enqueues a batch produced from the batches `receipt` stands for, which are acknowledged
    /// once this one is: by its consumer (in process), or once the carrier holds it durably.
    /// An empty batch acknowledges them at once.
    fn forward(&self, items: Vec<T>, receipt: Receipt) -> Result<(), QueueError>;
    /// Another sender onto the same queue.
    fn clone_sender(&self) -> Tx<T>;
}

/// The receiving end of a queue.
pub trait BatchReceiver<T>: Send {
    /// The next batch, waiting for it until `deadline` (for ever when `None`): `Ok(None)` when
    /// the deadline passed first, [`QueueError::Closed`] once every sender is gone and the
    /// queue is drained.
    fn recv_until(&self, deadline: Option<Instant>) -> Result<Option<Received<T>>, QueueError>;
    /// The station of this queue, on which the consumer counts its completions.
    fn station(&self) -> &Arc<Station>;
    /// Nanoseconds on the queue's clock, for measuring time in the queue.
    fn now_ns(&self) -> u64;
}

/// A sending end, whatever carries the queue.
pub type Tx<T> = Box<dyn BatchSender<T>>;
/// A receiving end, whatever carries the queue.
pub type Rx<T> = Box<dyn BatchReceiver<T>>;

impl<T> Clone for Tx<T> {
    fn clone(&self) -> Self {
        self.clone_sender()
    }
}

/// The next batch of `rx`, waiting for it; `None` once every sender is gone and the queue is
/// drained.
pub fn receive<T>(rx: &Rx<T>) -> Result<Option<Received<T>>, QueueError> {
    match rx.recv_until(None) {
        Err(QueueError::Closed { .. }) => Ok(None),
        received => received,
    }
}

/// Every item queued on `rx` now, in order, without waiting; their batches are acknowledged.
pub fn drain<T>(rx: &Rx<T>) -> Result<Vec<T>, QueueError> {
    let mut items = Vec::new();
    loop {
        match rx.recv_until(Some(Instant::now())) {
            Ok(Some(received)) => {
                items.extend(received.items);
                received.receipt.ack()?;
            }
            Ok(None) | Err(QueueError::Closed { .. }) => return Ok(items),
            Err(error) => return Err(error),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    /// A receipt and how many times it has been acknowledged.
    fn counted() -> (Receipt, Arc<AtomicU32>) {
        let acked = Arc::new(AtomicU32::new(0));
        let counter = acked.clone();
        let receipt = Receipt::from_fn(move || {
            counter.fetch_add(1, Ordering::SeqCst);
            Ok(())
        });
        (receipt, acked)
    }

    #[test]
    fn a_split_receipt_acknowledges_once_every_part_is() {
        let (receipt, acked) = counted();
        let mut parts = receipt.split(3).into_iter();
        parts.next().expect("a part").ack().expect("acks");
        parts.next().expect("a part").ack().expect("acks");
        assert_eq!(acked.load(Ordering::SeqCst), 0, "one part is still out");
        parts.next().expect("a part").ack().expect("acks");
        assert_eq!(acked.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_part_dropped_unacknowledged_leaves_the_whole_unacknowledged() {
        let (receipt, acked) = counted();
        let mut parts = receipt.split(2).into_iter();
        parts.next().expect("a part").ack().expect("acks");
        drop(parts);
        assert_eq!(acked.load(Ordering::SeqCst), 0);
        assert_eq!(Receipt::none().split(4).len(), 4);
    }
}
