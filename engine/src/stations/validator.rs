//! The validator: stateless, any number of them.
//!
//! In process ([`Routes::Every`]) it hands what passes to any shard's match queue. In a cluster
//! it runs inside the owner of one shard ([`Routes::Owner`]), on that shard's inbound queue:
//! nothing it consumes is trusted because of where it came from, and a message whose bytes
//! parse to another shard's trade (its sender formatted it so that the gateway's scan of the
//! bytes saw another key, or a gateway put it on the wrong queue) is rejected with `E_PARSE`,
//! kept in this shard's exceptions: an owner puts nothing onto inbound queues.

use std::time::Instant;

use super::{complete, queue_error, Refused, RejectedItem, Validated};
use crate::matcher::Content;
use crate::network::{Envelope, PipelineError};
use crate::queue::Receipt;
use crate::queue::{receive, Rx, Tx};
use crate::reason::{ReasonCode, Rejection};
use crate::refdata::RefData;
use crate::routing::shard_of_parts;
use crate::validate::{validate_message, Refusal};

/// Where a validator hands on what it validated.
pub(crate) enum Routes {
    /// Every shard's match queue, in shard order (in process).
    Every(Vec<Tx<Validated>>),
    /// The owner of `shard` among `shards` in a cluster: its own match queue; a message that
    /// names another shard's trade is rejected.
    Owner {
        shard: u32,
        shards: u32,
        to_match: Tx<Validated>,
    },
}

impl Routes {
    fn shards(&self) -> u32 {
        match self {
            Self::Every(match_txs) => match_txs.len() as u32,
            Self::Owner { shards, .. } => *shards,
        }
    }
}

/// Validates inbound batches: what passes goes to its shard's match queue, a rejection after
/// the signature checked out too (its shard remembers the MsgId), the rest to the exception
/// writer. The batch taken is acknowledged once every part handed on is.
pub(crate) fn run_validator(
    rx: Rx<Envelope>,
    refdata: &RefData,
    routes: &Routes,
    exception_tx: &Tx<RejectedItem>,
) -> Result<(), PipelineError> {
    let shards = routes.shards();
    let own_queues = match routes {
        Routes::Every(_) => shards as usize,
        Routes::Owner { .. } => 1,
    };
    while let Some(received) = receive(&rx).map_err(queue_error)? {
        let envelopes = received.items;
        let enqueued_ns = received.enqueued_ns;
        let started = Instant::now();
        let count = envelopes.len() as u64;
        // Room for twice a shard's even share of the batch (the whole batch on two shards):
        // growing a vector a message at a time copied each of them again, and room for the
        // whole batch in every one of many shards would be mostly unused.
        let room = (2 * envelopes.len())
            .div_ceil(own_queues)
            .min(envelopes.len());
        let mut to_match: Vec<Vec<Validated>> =
            (0..own_queues).map(|_| Vec::with_capacity(room)).collect();
        let mut rejected = Vec::new();
        for mut envelope in envelopes {
            let refusal = envelope.refusal.take();
            let refused_by_listener = refusal.is_some();
            let result = match refusal {
                Some(rejection) => Err(Refusal {
                    rejection,
                    identity: None,
                }),
                None => validate_message(
                    refdata,
                    &envelope.bytes,
                    envelope.sender.as_deref(),
                    envelope.signature.as_ref().map(|s| s.as_slice()),
                ),
            };
            // A message the validator rejected once its signer was found to be its Sender goes
            // to its shard's matcher, which remembers the MsgId under that signer; a refusal by
            // a listener (about the connection, not the message) and an unsigned, unreadable or
            // impersonating one go straight to the exception writer.
            let verdict = match result {
                Ok(msg) => Ok(Box::new(msg)),
                Err(Refusal {
                    rejection,
                    identity,
                }) => {
                    let remembered = !refused_by_listener && rejection.code > ReasonCode::Sig;
                    match identity.filter(|_| remembered) {
                        Some(identity) => Err(Refused {
                            rejection,
                            identity: *identity,
                        }),
                        None => {
                            rejected.push(RejectedItem::of(envelope, rejection));
                            continue;
                        }
                    }
                }
            };
            let (broker, trade_ref) = match &verdict {
                Ok(msg) => (msg.broker.as_str(), msg.trade_ref.as_str()),
                Err(refused) => (
                    refused.identity.broker.as_str(),
                    refused.identity.trade_ref.as_str(),
                ),
            };
            let shard = shard_of_parts(broker, trade_ref, shards);
            let queue = match routes {
                Routes::Every(_) => shard as usize,
                Routes::Owner { shard: own, .. } if shard == *own => 0,
                Routes::Owner { shard: own, .. } => {
                    // Its gateway's first reading of the bytes found another trade than its
                    // parse: the message names its trade more than once, or the gateway put it
                    // on the wrong queue. Either way it is not this shard's to keep, and a
                    // shard's owner puts nothing onto inbound queues.
                    rejected.push(RejectedItem::of(
                        envelope,
                        Rejection::new(
                            ReasonCode::Parse,
                            format!(
                                "the message came to shard {own} but its trade {broker}/{trade_ref} \
                                 is shard {shard}'s: its layout must name the trade once, as the \
                                 canonical layout does"
                            ),
                        ),
                    ));
                    continue;
                }
            };
            to_match[queue].push(Validated {
                verdict,
                content: Content::of(&envelope.bytes),
                bytes: envelope.bytes,
                correlation: envelope.correlation,
                origin: envelope.origin,
                injected_ns: envelope.injected_ns,
            });
        }
        let busy_ns = started.elapsed().as_nanos() as u64;
        let parts = to_match.len() + 1;
        let mut receipts = received.receipt.split(parts).into_iter();
        let mut part = || receipts.next().unwrap_or_else(Receipt::none);
        match routes {
            Routes::Every(match_txs) => {
                for (batch, tx) in to_match.into_iter().zip(match_txs) {
                    tx.forward(batch, part()).map_err(queue_error)?;
                }
            }
            Routes::Owner { to_match: tx, .. } => {
                for batch in to_match {
                    tx.forward(batch, part()).map_err(queue_error)?;
                }
            }
        }
        exception_tx
            .forward(rejected, part())
            .map_err(queue_error)?;
        complete(&rx, count, busy_ns, enqueued_ns);
    }
    Ok(())
}
