//! Queues between the threads of one process, on crossbeam channels. Bounded in batches and,
//! where a queue says so, in bytes: a queue that must hold a stalled consumer's backlog while
//! its siblings go on (a shard whose database is down) is bounded by what the backlog costs.

use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::Instant;

use crossbeam_channel::{RecvTimeoutError, TryRecvError};

use super::{BatchReceiver, BatchSender, QueueError, Receipt, Received, Tx};
use crate::station::{RunClock, Station};

/// Bytes held by a byte-bounded queue; senders wait while it is over its limit.
struct Budget {
    limit_bytes: usize,
    state: Mutex<BudgetState>,
    freed: Condvar,
}

#[derive(Default)]
struct BudgetState {
    held_bytes: usize,
    receiver_gone: bool,
}

impl Budget {
    /// Waits until `bytes` fit (a batch always fits an empty queue, so none is refused for its
    /// size). False once the receiver is gone.
    fn take(&self, bytes: usize) -> bool {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        while state.held_bytes > 0
            && state.held_bytes + bytes > self.limit_bytes
            && !state.receiver_gone
        {
            state = self
                .freed
                .wait(state)
                .unwrap_or_else(PoisonError::into_inner);
        }
        if state.receiver_gone {
            return false;
        }
        state.held_bytes += bytes;
        true
    }

    fn give_back(&self, bytes: usize) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.held_bytes = state.held_bytes.saturating_sub(bytes);
        self.freed.notify_all();
    }

    fn close(&self) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.receiver_gone = true;
        self.freed.notify_all();
    }
}

/// The weight of one item in bytes.
type Weigh<T> = fn(&T) -> usize;

/// A batch on a local queue: the items, when they were enqueued, their weight in bytes when
/// the queue counts bytes, and the receipt it was forwarded with.
type Slot<T> = (Vec<T>, u64, usize, Receipt);

/// Sends onto a local queue.
pub struct LocalSender<T> {
    tx: crossbeam_channel::Sender<Slot<T>>,
    station: Arc<Station>,
    clock: RunClock,
    budget: Option<(Arc<Budget>, Weigh<T>)>,
}

/// Receives from a local queue. Clones share the queue (each batch goes to one of them).
pub struct LocalReceiver<T> {
    rx: crossbeam_channel::Receiver<Slot<T>>,
    station: Arc<Station>,
    clock: RunClock,
    budget: Option<Arc<Closer>>,
}

/// Releases the senders waiting on a budget once the last receiver is gone.
struct Closer(Arc<Budget>);

impl Drop for Closer {
    fn drop(&mut self) {
        self.0.close();
    }
}

impl<T> Clone for LocalReceiver<T> {
    fn clone(&self) -> Self {
        Self {
            rx: self.rx.clone(),
            station: self.station.clone(),
            clock: self.clock,
            budget: self.budget.clone(),
        }
    }
}

/// A queue named `name` holding up to `batches` batches.
pub fn bounded<T: Send + 'static>(
    name: impl Into<String>,
    batches: usize,
    clock: RunClock,
) -> (LocalSender<T>, LocalReceiver<T>) {
    queue(name, batches, None, clock)
}

/// A queue named `name` holding up to `batches` batches and `limit_bytes` bytes, an item
/// weighing `weigh` bytes.
pub fn bounded_bytes<T: Send + 'static>(
    name: impl Into<String>,
    batches: usize,
    limit_bytes: usize,
    weigh: Weigh<T>,
    clock: RunClock,
) -> (LocalSender<T>, LocalReceiver<T>) {
    queue(name, batches, Some((limit_bytes, weigh)), clock)
}

fn queue<T: Send + 'static>(
    name: impl Into<String>,
    batches: usize,
    bytes: Option<(usize, Weigh<T>)>,
    clock: RunClock,
) -> (LocalSender<T>, LocalReceiver<T>) {
    let (tx, rx) = crossbeam_channel::bounded(batches.max(1));
    let station = Station::new(name);
    let budget = bytes.map(|(limit_bytes, weigh)| {
        (
            Arc::new(Budget {
                limit_bytes,
                state: Mutex::default(),
                freed: Condvar::new(),
            }),
            weigh,
        )
    });
    let receiver_budget = budget
        .as_ref()
        .map(|(budget, _)| Arc::new(Closer(budget.clone())));
    (
        LocalSender {
            tx,
            station: station.clone(),
            clock,
            budget,
        },
        LocalReceiver {
            rx,
            station,
            clock,
            budget: receiver_budget,
        },
    )
}

impl<T> LocalSender<T> {
    /// The station of this queue.
    pub fn station(&self) -> &Arc<Station> {
        &self.station
    }

    fn closed(&self) -> QueueError {
        QueueError::Closed {
            queue: self.station.name().to_owned(),
        }
    }
}

impl<T> Clone for LocalSender<T> {
    fn clone(&self) -> Self {
        Self {
            tx: self.tx.clone(),
            station: self.station.clone(),
            clock: self.clock,
            budget: self.budget.clone(),
        }
    }
}

impl<T: Send + 'static> BatchSender<T> for LocalSender<T> {
    fn forward(&self, items: Vec<T>, receipt: Receipt) -> Result<(), QueueError> {
        if items.is_empty() {
            return receipt.ack();
        }
        let weight = match &self.budget {
            Some((budget, weigh)) => {
                let weight = items.iter().map(weigh).sum();
                if !budget.take(weight) {
                    return Err(self.closed());
                }
                weight
            }
            None => 0,
        };
        self.station.arrive(items.len() as u64);
        self.tx
            .send((items, self.clock.now_ns(), weight, receipt))
            .map_err(|_| self.closed())
    }

    fn clone_sender(&self) -> Tx<T> {
        Box::new(self.clone())
    }
}

impl<T> LocalReceiver<T> {
    fn received(&self, (items, enqueued_ns, weight, receipt): Slot<T>) -> Received<T> {
        if let Some(closer) = &self.budget {
            closer.0.give_back(weight);
        }
        Received {
            items,
            enqueued_ns,
            receipt,
        }
    }

    fn closed(&self) -> QueueError {
        QueueError::Closed {
            queue: self.station.name().to_owned(),
        }
    }
}

impl<T: Send + 'static> BatchReceiver<T> for LocalReceiver<T> {
    fn recv_until(&self, deadline: Option<Instant>) -> Result<Option<Received<T>>, QueueError> {
        let slot = match deadline {
            None => self.rx.recv().map_err(|_| self.closed())?,
            Some(deadline) => match self.rx.try_recv() {
                Ok(slot) => slot,
                Err(TryRecvError::Disconnected) => return Err(self.closed()),
                Err(TryRecvError::Empty) => match self.rx.recv_deadline(deadline) {
                    Ok(slot) => slot,
                    Err(RecvTimeoutError::Timeout) => return Ok(None),
                    Err(RecvTimeoutError::Disconnected) => return Err(self.closed()),
                },
            },
        };
        Ok(Some(self.received(slot)))
    }

    fn station(&self) -> &Arc<Station> {
        &self.station
    }

    fn now_ns(&self) -> u64 {
        self.clock.now_ns()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn batches_come_out_in_order_with_their_arrivals_counted() {
        let (tx, rx) = bounded::<u32>("q", 4, RunClock::start());
        tx.send(vec![1, 2]).expect("queues");
        tx.send(Vec::new()).expect("queues");
        tx.send(vec![3]).expect("queues");
        let first = rx.recv_until(None).expect("receives").expect("a batch");
        let second = rx.recv_until(None).expect("receives").expect("a batch");
        assert_eq!((first.items, second.items), (vec![1, 2], vec![3]));
        assert_eq!(rx.station().read().arrivals, 3);
        drop(tx);
        assert!(matches!(
            rx.recv_until(None),
            Err(QueueError::Closed { .. })
        ));
    }

    #[test]
    fn a_deadline_ends_the_wait() {
        let (_tx, rx) = bounded::<u32>("q", 4, RunClock::start());
        let deadline = Instant::now() + Duration::from_millis(20);
        assert!(rx.recv_until(Some(deadline)).expect("queues").is_none());
    }

    #[test]
    fn a_byte_bound_makes_the_sender_wait_until_bytes_are_taken_off() {
        let (tx, rx) =
            bounded_bytes::<Vec<u8>>("q", 1024, 100, |item| item.len(), RunClock::start());
        tx.send(vec![vec![0; 60]]).expect("queues");
        let sender = std::thread::spawn(move || {
            // 60 + 60 > 100: waits for the first batch to leave.
            tx.send(vec![vec![1; 60]]).expect("queues");
            tx
        });
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(rx.station().read().arrivals, 1, "the second batch waits");
        assert_eq!(
            rx.recv_until(None)
                .expect("receives")
                .expect("a batch")
                .items[0][0],
            0
        );
        let _tx = sender.join().expect("the sender returns");
        assert_eq!(
            rx.recv_until(None)
                .expect("receives")
                .expect("a batch")
                .items[0][0],
            1
        );
    }

    #[test]
    fn a_batch_larger_than_the_bound_still_enters_an_empty_queue() {
        let (tx, rx) = bounded_bytes::<Vec<u8>>("q", 4, 10, |item| item.len(), RunClock::start());
        tx.send(vec![vec![0; 50]]).expect("queues");
        assert_eq!(
            rx.recv_until(None)
                .expect("receives")
                .expect("a batch")
                .items[0]
                .len(),
            50
        );
    }

    #[test]
    fn a_waiting_sender_is_released_when_the_receiver_goes() {
        let (tx, rx) = bounded_bytes::<Vec<u8>>("q", 4, 10, |item| item.len(), RunClock::start());
        tx.send(vec![vec![0; 10]]).expect("queues");
        let sender = std::thread::spawn(move || tx.send(vec![vec![0; 10]]));
        std::thread::sleep(Duration::from_millis(20));
        drop(rx);
        assert!(matches!(
            sender.join().expect("the sender returns"),
            Err(QueueError::Closed { .. })
        ));
    }
}
