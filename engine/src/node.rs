//! The roles a node of a cluster runs on JetStream queues (DESIGN.md section 1a). The stations
//! are the ones of the in-process network ([`crate::stations`]); only their queues differ.
//!
//! Queues of a cluster: `inbound.<p>` (P partitions, by the routing hash of the trade key),
//! `match.<k>` (one per shard), `exceptions`. Every one is a stream of its own with bounds in
//! batches and bytes ([`ClusterLayout`]).

use std::sync::Arc;
use std::thread::JoinHandle;

use crate::pipeline::{Envelope, PipelineError};
use crate::queue::jetstream::{JetStream, QueueLimits, StopReceiving};
use crate::queue::{QueueError, Tx};
use crate::refdata::RefData;
use crate::stations::validator::run_validator;
use crate::stations::{RejectedItem, Validated};

/// The queues of a cluster and their bounds.
#[derive(Debug, Clone, Copy)]
pub struct ClusterLayout {
    pub partitions: u32,
    pub shards: u32,
    /// Bounds of each inbound partition.
    pub inbound: QueueLimits,
    /// Bounds of each shard's match queue: the backlog a stalled shard may hold on disk.
    pub shard_backlog: QueueLimits,
    /// Bounds of the exception queue.
    pub exceptions: QueueLimits,
}

impl ClusterLayout {
    /// The queue of inbound partition `partition`.
    pub fn inbound_queue(partition: u32) -> String {
        format!("inbound.{partition}")
    }

    /// The match queue of `shard`.
    pub fn match_queue(shard: u32) -> String {
        format!("match.{shard}")
    }

    /// The exception queue.
    pub const EXCEPTIONS_QUEUE: &'static str = "exceptions";

    /// Creates every queue's stream that does not exist yet.
    pub fn ensure(&self, jetstream: &JetStream) -> Result<(), QueueError> {
        for partition in 0..self.partitions {
            jetstream.ensure_queue(&Self::inbound_queue(partition), self.inbound)?;
        }
        for shard in 0..self.shards {
            jetstream.ensure_queue(&Self::match_queue(shard), self.shard_backlog)?;
        }
        jetstream.ensure_queue(Self::EXCEPTIONS_QUEUE, self.exceptions)
    }
}

/// Validators running on a node, one per inbound partition it serves.
pub struct Validators {
    handles: Vec<JoinHandle<Result<(), PipelineError>>>,
    stoppers: Vec<StopReceiving>,
}

/// The durable consumer through which validators take an inbound partition.
fn validators_consumer(partition: u32) -> String {
    format!("validators-{partition}")
}

impl Validators {
    /// Starts a validator for each of `partitions`: it takes batches of envelopes from the
    /// partition, hands what passes to the match queue of its shard and the rest to the
    /// exception queue, and acknowledges the batch once the server holds all of it.
    pub fn start(
        jetstream: &JetStream,
        layout: &ClusterLayout,
        partitions: &[u32],
        refdata: Arc<RefData>,
    ) -> Result<Self, PipelineError> {
        let mut handles = Vec::new();
        let mut stoppers = Vec::new();
        for &partition in partitions {
            let receiver = jetstream
                .receiver::<Envelope>(
                    &ClusterLayout::inbound_queue(partition),
                    &validators_consumer(partition),
                    true,
                )
                .map_err(PipelineError::Queue)?;
            stoppers.push(receiver.stopper());
            let match_txs: Vec<Tx<Validated>> = (0..layout.shards)
                .map(|shard| {
                    Box::new(jetstream.sender::<Validated>(&ClusterLayout::match_queue(shard)))
                        as Tx<Validated>
                })
                .collect();
            let exception_tx: Tx<RejectedItem> =
                Box::new(jetstream.sender::<RejectedItem>(ClusterLayout::EXCEPTIONS_QUEUE));
            let refdata = refdata.clone();
            let handle = std::thread::Builder::new()
                .name(format!("validator-{partition}"))
                .spawn(move || {
                    run_validator(Box::new(receiver), &refdata, &match_txs, &exception_tx)
                })
                .map_err(|error| {
                    PipelineError::Config(format!("cannot start a thread: {error}"))
                })?;
            handles.push(handle);
        }
        Ok(Self { handles, stoppers })
    }

    /// Stops taking batches, lets each validator finish the one it holds, and waits for them.
    pub fn stop(self) -> Result<(), PipelineError> {
        for stopper in &self.stoppers {
            stopper.stop();
        }
        let mut result = Ok(());
        for handle in self.handles {
            let name = handle.thread().name().unwrap_or("validator").to_owned();
            match handle.join() {
                Ok(Ok(())) => {}
                Ok(Err(error)) => result = result.and(Err(error)),
                Err(_) => result = result.and(Err(PipelineError::Panicked(name))),
            }
        }
        result
    }
}
