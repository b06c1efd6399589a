//! The validator: stateless, any number of them.

use std::time::Instant;

use super::{complete, queue_error, Refused, RejectedItem, Validated};
use crate::pipeline::{Envelope, PipelineError};
use crate::queue::{receive, Rx, Tx};
use crate::reason::ReasonCode;
use crate::refdata::RefData;
use crate::routing::shard_of_parts;
use crate::validate::{validate_message, Refusal};

/// Validates inbound batches: what passes goes to its shard's match queue, a rejection after
/// the signature checked out too (its shard remembers the MsgId), the rest to the exception
/// writer.
pub(crate) fn run_validator(
    rx: Rx<Envelope>,
    refdata: &RefData,
    match_txs: &[Tx<Validated>],
    exception_tx: &Tx<RejectedItem>,
) -> Result<(), PipelineError> {
    let shards = match_txs.len() as u32;
    while let Some(received) = receive(&rx).map_err(queue_error)? {
        let envelopes = received.items;
        let enqueued_ns = received.enqueued_ns;
        let started = Instant::now();
        let count = envelopes.len() as u64;
        let mut to_match: Vec<Vec<Validated>> = (0..match_txs.len()).map(|_| Vec::new()).collect();
        let mut rejected = Vec::new();
        for envelope in envelopes {
            let refused_by_listener = envelope.refusal.is_some();
            let result = match envelope.refusal {
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
                Ok(msg) => Ok(msg),
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
                            rejected.push(RejectedItem {
                                rejection,
                                sender: envelope.sender,
                                bytes: envelope.bytes,
                                correlation: envelope.correlation,
                                origin: envelope.origin,
                            });
                            continue;
                        }
                    }
                }
            };
            let (broker, trade_ref) = match &verdict {
                Ok(msg) => (&msg.broker, &msg.trade_ref),
                Err(refused) => (&refused.identity.broker, &refused.identity.trade_ref),
            };
            let shard = shard_of_parts(broker, trade_ref, shards) as usize;
            to_match[shard].push(Validated {
                verdict,
                bytes: envelope.bytes,
                correlation: envelope.correlation,
                origin: envelope.origin,
                injected_ns: envelope.injected_ns,
            });
        }
        let busy_ns = started.elapsed().as_nanos() as u64;
        // Every shard's part on its way at once, then the acknowledgements: one round trip to
        // a network carrier instead of one a shard. A shard's queue still gets this
        // partition's batches in order (the next is sent only once this one is held).
        let mut sending = Vec::with_capacity(match_txs.len() + 1);
        for (shard, batch) in to_match.into_iter().enumerate() {
            sending.push(match_txs[shard].start_send(batch).map_err(queue_error)?);
        }
        sending.push(exception_tx.start_send(rejected).map_err(queue_error)?);
        for send in sending {
            send.wait().map_err(queue_error)?;
        }
        received.receipt.ack().map_err(queue_error)?;
        complete(&rx, count, busy_ns, enqueued_ns);
    }
    Ok(())
}
