//! Where messages enter a cluster and answers leave it: a gateway's (or the driver's) side of
//! the inbound queues and of its answers, the router that sends each answer to its gateway,
//! and the sink's side of the CLS queue.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use super::roles::Role;
use super::{retrying, retrying_carrier, ClusterAccess, ClusterLayout};
use crate::lease::{DeliveryBook, LeaseKeeper, Leased, Leases};
use crate::network::{Ack, Delivery, Envelope, OutboundEvent, PipelineError, Submitter};
use crate::queue::jetstream::{JetStream, JetStreamReceiver, PlainReceiver, StopReceiving};
use crate::queue::{BatchSender, QueueError, Receipt, Rx, Tx};
use crate::station::RunClock;

/// Sends each ACK, after the commit that holds its message, to the plain subject of the
/// gateway its message came through (`ack.<origin>`). Not persisted: an answer lost on its way
/// (its gateway reconnecting, or too slow to take it) costs the participant a resend, which the
/// shard answers as a duplicate; the commit is the record.
#[derive(Clone)]
pub struct AckRouter {
    jetstream: JetStream,
}

impl AckRouter {
    /// A router publishing through `jetstream`.
    pub fn new(jetstream: &JetStream) -> Self {
        Self {
            jetstream: jetstream.clone(),
        }
    }
}

impl BatchSender<Ack> for AckRouter {
    fn forward(&self, items: Vec<Ack>, receipt: Receipt) -> Result<(), QueueError> {
        let mut by_origin: BTreeMap<u32, Vec<Ack>> = BTreeMap::new();
        for ack in items {
            by_origin.entry(ack.origin).or_default().push(ack);
        }
        for (origin, acks) in by_origin {
            let topic = ClusterLayout::ack_topic(origin);
            if let Err(error) = self.jetstream.publish_plain(&topic, &acks) {
                tracing::warn!(gateway = origin, count = acks.len(), %error, "answers lost on their way: their senders ask again");
            }
        }
        receipt.ack()
    }

    fn clone_sender(&self) -> Tx<Ack> {
        Box::new(self.clone())
    }
}

/// Gateway numbers a cluster has room for.
pub const GATEWAYS_MAX: u32 = 1024;

/// Where a gateway (or the driver) puts messages into a cluster and hears their answers: the
/// shards' inbound queues, and the answers' subject of the gateway number it holds a lease on.
pub struct Ingress {
    number: u32,
    batch_messages: usize,
    keeper: LeaseKeeper,
    inbound: Vec<Tx<Envelope>>,
    acks: Option<PlainReceiver<Ack>>,
    stopper: StopReceiving,
}

impl Ingress {
    /// Takes gateway number `number` for `node_id` (the one its credentials allow; `None`:
    /// the lowest free one), listens to its answers (before anything is sent, so that none is
    /// missed) and opens the shards' inbound queues. [`PipelineError::Config`] when the number
    /// is held by another.
    pub fn open(
        jetstream: &JetStream,
        layout: &ClusterLayout,
        leases: Arc<Leases>,
        node_id: &str,
        number: Option<u32>,
    ) -> Result<Self, PipelineError> {
        let won = match number {
            None => leases
                .take_lowest(Leased::Gateway, GATEWAYS_MAX, node_id)
                .map_err(PipelineError::Queue)?,
            Some(number) => leases
                .try_acquire(Leased::Gateway(number), node_id)
                .map_err(PipelineError::Queue)?
                .map(|lease| (number, lease)),
        };
        let Some((number, lease)) = won else {
            return Err(PipelineError::Config(match number {
                None => format!("all {GATEWAYS_MAX} gateway numbers are taken"),
                Some(number) => format!("gateway number {number} is held by another gateway"),
            }));
        };
        let topic = ClusterLayout::ack_topic(number);
        let acks = jetstream
            .plain_receiver::<Ack>(&topic, topic.clone())
            .map_err(PipelineError::Queue)?;
        let stopper = acks.stopper();
        let keeper = LeaseKeeper::start(leases, lease, node_id.to_owned(), || {
            tracing::error!("this gateway lost its number: answers may go to another one");
        });
        let inbound = (0..layout.shards)
            .map(|shard| {
                Box::new(
                    jetstream
                        .placed(ClusterLayout::inbound_placement(shard))
                        .sender::<Envelope>(&ClusterLayout::inbound_queue(shard)),
                ) as Tx<Envelope>
            })
            .collect();
        tracing::info!(gateway = number, node = node_id, "gateway number taken");
        Ok(Self {
            number,
            batch_messages: layout.inbound_batch_messages,
            keeper,
            inbound,
            acks: Some(acks),
            stopper,
        })
    }

    /// Takes a gateway number through `access` as the first identity of `kind` whose number
    /// is free (without secrets: the lowest free number), on a connection of its own, which is
    /// returned with it. Servers that are starting are waited for `patience`.
    pub fn open_as(
        access: &ClusterAccess,
        kind: fn(u32) -> Role,
        layout: &ClusterLayout,
        lease_ttl: Duration,
        node_id: &str,
        patience: Duration,
    ) -> Result<(Self, JetStream), PipelineError> {
        let identities = access.numbered(kind);
        let mut last = None;
        for role in &identities {
            let jetstream =
                retrying(patience, || access.connect(*role)).map_err(PipelineError::Queue)?;
            let leases = Arc::new(
                retrying(patience, || Leases::open(&jetstream, lease_ttl))
                    .map_err(PipelineError::Queue)?,
            );
            let number = access.secrets.as_ref().and(role.gateway_number());
            // A request may time out while the servers elect the bucket's leader; a number held
            // by another is not waited for.
            let opened = retrying_carrier(patience, || {
                Self::open(&jetstream, layout, leases.clone(), node_id, number)
            });
            match opened {
                Ok(ingress) => return Ok((ingress, jetstream)),
                Err(PipelineError::Config(why)) => last = Some(why),
                Err(error) => return Err(error),
            }
        }
        Err(PipelineError::Config(match last {
            Some(why) => format!(
                "every identity of this kind in the secrets is in use ({} of them; the last: {why})",
                identities.len()
            ),
            None => "the secrets hold no identity of this kind: driver secrets makes them".to_owned(),
        }))
    }

    /// The gateway number: every envelope submitted here carries it, and its answers come back
    /// on `ack.<number>`.
    pub fn number(&self) -> u32 {
        self.number
    }

    /// A submitter onto the shards' inbound queues (a message goes to its trade's shard),
    /// stamping envelopes with this gateway's number.
    pub fn submitter(&self, clock: RunClock) -> Submitter {
        Submitter::new(self.inbound.clone(), clock, self.number)
            .with_batch_messages(self.batch_messages)
    }

    /// The answers to what was submitted here (once; `None` afterwards). It ends once
    /// [`Ingress::stop`] is called.
    pub fn take_acks(&mut self) -> Option<Rx<Ack>> {
        self.acks.take().map(|acks| Box::new(acks) as Rx<Ack>)
    }

    /// Stops the answers' receiver and the renewal of the gateway number.
    pub fn stop(self) {
        self.stopper.stop();
        self.keeper.stop();
    }
}

/// The sink's side of a cluster: the CLS queue and the delivery book its confirmations go to.
pub struct ClsFeed {
    events: Option<JetStreamReceiver<OutboundEvent>>,
    stopper: StopReceiving,
    book: Arc<DeliveryBook>,
}

impl ClsFeed {
    /// Opens the CLS queue of `layout` through the sink's durable consumer (one sink per
    /// cluster); the cluster's queues exist ([`ClusterLayout::ensure`]).
    pub fn open(jetstream: &JetStream, layout: &ClusterLayout) -> Result<Self, PipelineError> {
        let events = jetstream
            .placed(layout.cls_placement())
            .receiver::<OutboundEvent>(ClusterLayout::CLS_QUEUE, "sink", true)
            .map_err(PipelineError::Queue)?;
        let stopper = events.stopper();
        let book = Arc::new(DeliveryBook::open(jetstream).map_err(PipelineError::Queue)?);
        Ok(Self {
            events: Some(events),
            stopper,
            book,
        })
    }

    /// The events (once), for the sink.
    pub fn take_events(&mut self) -> Option<Rx<OutboundEvent>> {
        self.events
            .take()
            .map(|events| Box::new(events) as Rx<OutboundEvent>)
    }

    /// Where the sink confirms delivery.
    pub fn delivery(&self) -> Delivery {
        Delivery::cluster(self.book.clone())
    }

    /// A handle that ends the events' receiver.
    pub fn stopper(&self) -> StopReceiving {
        self.stopper.clone()
    }
}
