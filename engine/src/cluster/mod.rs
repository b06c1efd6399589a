//! The queue network of DESIGN.md section 1a, across the nodes of a cluster: the sibling of
//! [`crate::pipeline`], which wires the same stations ([`crate::stations`]) in one process.
//!
//! ```text
//! gateway g ──► in.k ─────────────► owner of shard k, in process:
//!   (the routing hash     JetStream    validator k ─► matcher k ─► writer k ─commit─► PostgreSQL k
//!    of the trade key                      └─ rejected ─► exception writer k ─commit─┘
//!    picks k)            after commit:  ACKs ─► ack.g (plain NATS) ─► gateway g
//!                                       CLS and advices ─► cls (JetStream) ─► sink ─► delivery book
//! ```
//!
//! - One hop in: a message crosses NATS once on its way to its commit, as part of a batch that
//!   stays whole from the gateway to the shard's owner. The owner checks every participant
//!   signature itself; nothing it consumes is trusted because of where it came from. A message
//!   whose bytes parse to another shard's trade is rejected (`E_PARSE`): an owner puts nothing
//!   onto inbound queues.
//! - Each shard's owner keeps its rejected messages in its own database.
//! - The database commit is the record of durability: an inbound batch is acknowledged once
//!   everything made from it is committed. ACKs travel on plain NATS after the commit (a lost
//!   one costs the participant a resend, answered DUPLICATE); CLS on a JetStream queue, and
//!   they stay in the shard's outbox until the sink confirms them.
//!
//! [`owner`] holds a shard, [`ingress`] is where a gateway (or the driver) puts messages in and
//! hears their answers, [`node`] contends for shards and keeps them balanced between nodes.

pub mod ingress;
pub mod node;
pub mod owner;
pub mod roles;

pub use ingress::{AckRouter, ClsFeed, Ingress, GATEWAYS_MAX};
pub use node::{retrying, retrying_carrier, Holdings, Node, NodeConfig, STARTING_PATIENCE};
pub use owner::{OwnershipReport, ShardOwner, ShardOwnerConfig, OWNER_BATCH_MAX};

use std::path::PathBuf;

use crate::queue::jetstream::{JetStream, NatsCredentials, Placement, QueueLimits};
use crate::queue::QueueError;
use roles::Role;

/// How a process reaches a cluster's NATS servers: their URLs, where the streams go, and the
/// secrets folder whose identities it connects as (none: without identity or TLS, for servers
/// that ask for neither).
#[derive(Debug, Clone)]
pub struct ClusterAccess {
    /// The servers' URLs, separated by commas.
    pub url: String,
    pub placement: Placement,
    /// The folder of `driver secrets` (the CA certificate and the identities' seeds).
    pub secrets: Option<PathBuf>,
}

impl ClusterAccess {
    /// A connection of its own for `role`, as the role's identity where there are secrets.
    pub fn connect(&self, role: Role) -> Result<JetStream, QueueError> {
        let credentials = match &self.secrets {
            Some(dir) => NatsCredentials::from_secrets(dir, &role.name(), role.inbox_prefix())?,
            None => NatsCredentials::none(),
        };
        Ok(JetStream::connect_as(&self.url, &credentials)?.with_placement(self.placement.clone()))
    }

    /// The identities of the numbered role `kind` (gateways, load sources) the secrets hold,
    /// in number order; without secrets, number 0's (any number will do).
    pub fn numbered(&self, kind: fn(u32) -> Role) -> Vec<Role> {
        match &self.secrets {
            None => vec![kind(0)],
            Some(dir) => (0..roles::LOAD_NUMBERS_FIRST)
                .map(kind)
                .take_while(|role| crate::queue::jetstream::nkey_file(dir, &role.name()).exists())
                .collect(),
        }
    }
}

/// Default of [`ClusterLayout::inbound_batch_messages`]: 256 messages of about 700 bytes with
/// their envelopes, some 180 KB, well below a server's payload limit (1 MiB).
pub const INBOUND_BATCH_MESSAGES_DEFAULT: usize = 256;

/// The queues of a cluster and their bounds.
#[derive(Debug, Clone, Copy)]
pub struct ClusterLayout {
    /// Shards, each with its inbound queue and its database.
    pub shards: u32,
    /// Bounds of each shard's inbound queue: the backlog a stalled shard may hold on disk.
    pub inbound: QueueLimits,
    /// Bounds of the CLS queue: a sink that falls behind by this much holds the writers.
    pub cls: QueueLimits,
    /// Messages a gateway (or the driver) puts in one batch of a shard's inbound queue: one
    /// message of the queue's server, stored, read and deleted as one, and kept whole to the
    /// shard's commit.
    pub inbound_batch_messages: usize,
}

impl Default for ClusterLayout {
    fn default() -> Self {
        const MIB: i64 = 1 << 20;
        Self {
            shards: 4,
            inbound: QueueLimits {
                batches_max: 65_536,
                bytes_max: (crate::pipeline::CLUSTER_SHARD_BACKLOG_BYTES_DEFAULT as i64),
            },
            cls: QueueLimits {
                batches_max: 65_536,
                bytes_max: 256 * MIB,
            },
            inbound_batch_messages: INBOUND_BATCH_MESSAGES_DEFAULT,
        }
    }
}

impl ClusterLayout {
    /// The inbound queue of `shard`.
    pub fn inbound_queue(shard: u32) -> String {
        format!("in.{shard}")
    }

    /// The plain subject (after `ste.`) on which gateway number `gateway` hears its answers.
    pub fn ack_topic(gateway: u32) -> String {
        format!("ack.{gateway}")
    }

    /// The queue of CLS and advices after commit.
    pub const CLS_QUEUE: &'static str = "cls";

    /// The index by which shard `shard`'s inbound queue is placed among the NATS servers
    /// ([`ClusterLayout::ensure`], [`JetStream::placed`]).
    pub fn inbound_placement(shard: u32) -> usize {
        shard as usize
    }

    /// The index by which the CLS queue is placed: the server after the last shard's.
    pub fn cls_placement(&self) -> usize {
        self.shards as usize
    }

    /// Every queue of the layout with its bounds.
    pub fn queues(&self) -> Vec<(String, QueueLimits)> {
        (0..self.shards)
            .map(|shard| (Self::inbound_queue(shard), self.inbound))
            .chain([(Self::CLS_QUEUE.to_owned(), self.cls)])
            .collect()
    }

    /// Creates every queue's stream that does not exist yet, spread over the NATS servers by
    /// the connection's [`crate::queue::jetstream::Placement`]: shard k's inbound queue on the
    /// server of index k, the CLS queue on the next one after the last shard's (the order of
    /// [`ClusterLayout::queues`]), and the stream where batches that do not decode are set
    /// aside. It makes the delivery book's bucket too, so that a caller who
    /// tries this again while the servers are still forming (a replicated bucket refused with
    /// "peer offline") opens every store of the cluster after it.
    pub fn ensure(&self, jetstream: &JetStream) -> Result<(), QueueError> {
        self.queues()
            .iter()
            .enumerate()
            .try_for_each(|(index, (queue, limits))| {
                jetstream.ensure_queue_placed(queue, *limits, Some(index))
            })?;
        jetstream.ensure_aside_stream()?;
        crate::lease::DeliveryBook::open(jetstream).map(drop)
    }
}
