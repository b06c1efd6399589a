//! The shard writer: one per shard, the only station that writes the shard's store.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ahash::AHashMap;
use time::{Date, OffsetDateTime};

use super::{
    commit_retrying, complete_merged, queue_error, BatchBound, Batcher, ToStore, WriterReport,
};
use crate::codec::encode_cls;
use crate::matcher::{Disposition, TradeStatus};
use crate::network::{Ack, AckResult, OutboundEvent, PipelineError, RetryPolicy, DELIVERY_WAIT};
use crate::queue::{Rx, Tx};
use crate::store::{Batch, ClsRow, ExceptionRow, MessageRow, Store, TradeRow};

/// What a shard writer needs besides its queue and store.
pub(crate) struct WriterContext {
    pub(crate) shard: u32,
    pub(crate) ack_tx: Tx<Ack>,
    pub(crate) out_tx: Tx<OutboundEvent>,
    pub(crate) batch_max: BatchBound,
    pub(crate) linger: Duration,
    pub(crate) retry: RetryPolicy,
    /// The shard's delivery watermark, which the consumer of the CLS raises.
    pub(crate) delivered: Arc<AtomicI64>,
    /// Whether a consumer confirms deliveries at all (if not, a stopping writer does not wait
    /// for confirmations).
    pub(crate) delivery_in_use: Arc<AtomicBool>,
    pub(crate) retention_days: Option<u32>,
    /// Items committed so far, for a bounded matcher ([`super::matcher::Recall`]).
    pub(crate) committed: Arc<AtomicU64>,
    /// Cluster mode: whether this node still holds the shard's lease. Checked before every
    /// commit; once it is false the writer stops without writing.
    pub(crate) lease_held: Option<Arc<AtomicBool>>,
}

/// Records a trade's new status in the batch: only its last status in a batch is written, and
/// it is the trade's first if the batch's first status of it was.
fn set_trade_status(
    batch: &mut Batch,
    trade_rows: &mut AHashMap<String, usize>,
    trade_key: &str,
    trade_date: Date,
    (status, first): (TradeStatus, bool),
) {
    match trade_rows.get(trade_key) {
        Some(index) => batch.trades[*index].status = status,
        None => {
            trade_rows.insert(trade_key.to_owned(), batch.trades.len());
            batch.trades.push(TradeRow {
                trade_date,
                trade_key: trade_key.to_owned(),
                status,
                first,
            });
        }
    }
}

/// Writes a shard's batches, one transaction each; ACKs, CLS and advices go out after commit,
/// and so do the acknowledgements of the batches they came from.
pub(crate) fn run_writer(
    rx: Rx<ToStore>,
    mut store: Box<dyn Store>,
    context: WriterContext,
    redeliver: Vec<crate::store::UndeliveredCls>,
) -> Result<WriterReport, PipelineError> {
    let WriterContext {
        shard,
        ack_tx,
        out_tx,
        batch_max,
        linger,
        retry,
        delivered,
        delivery_in_use,
        retention_days,
        committed,
        lease_held,
    } = context;
    let still_owner = || {
        lease_held
            .as_ref()
            .is_none_or(|held| held.load(Ordering::Acquire))
    };
    let mut watermark_written: i64 = 0;
    let mut last_emitted: i64 = redeliver.last().map_or(0, |cls| cls.outbox_id);
    // What was committed but never confirmed goes out again first, in outbox order.
    if !redeliver.is_empty() {
        tracing::info!(
            shard,
            count = redeliver.len(),
            "emitting unconfirmed CLS again"
        );
        let events = redeliver
            .into_iter()
            .map(|cls| OutboundEvent::Cls {
                cls_id: cls.cls_id,
                body: cls.body,
                trade_first_injected_ns: 0,
                shard,
                outbox_id: cls.outbox_id,
                redelivered: true,
            })
            .collect();
        out_tx.send(events).map_err(queue_error)?;
    }
    let station = rx.station().clone();
    let mut commit_retries = 0;
    let mut purged_on = OffsetDateTime::now_utc().date();
    let mut batches = Batcher::new(rx, batch_max, ToStore::weight_bytes, linger);
    while let Some(merged) = batches.next()? {
        let count = merged.len() as u64;
        let (items, enqueued_sum_ns, receipt) = merged.into_parts();
        let started = Instant::now();
        let today = OffsetDateTime::now_utc().date();
        if let Some(days) = retention_days.filter(|_| today != purged_on) {
            // Retention runs when the shard starts and then once a day.
            purged_on = today;
            if let Err(error) = store.purge(today, days) {
                tracing::error!(shard, error = %error, "retention purge failed; retried tomorrow");
            }
        }
        // Each message is one row: room for all of them at once, where growing the vector
        // row by row copied every row again (and left up to half of it unused in the memory
        // store, which keeps the vector).
        let mut batch = Batch {
            messages: Vec::with_capacity(count as usize),
            ..Batch::default()
        };
        let mut acks = Vec::with_capacity(count as usize);
        let mut events = Vec::new();
        // Only the last status of a trade in this batch needs writing.
        let mut trade_rows: AHashMap<String, usize> = AHashMap::new();
        let mut aged_count = 0_u64;
        for item in items {
            let item = match item {
                ToStore::Message(item) => item,
                ToStore::Aged(aged) => {
                    aged_count += 1;
                    set_trade_status(
                        &mut batch,
                        &mut trade_rows,
                        &aged.trade_key,
                        aged.trade_date,
                        (TradeStatus::Aged, false),
                    );
                    events.push(OutboundEvent::Aged(aged));
                    continue;
                }
            };
            let meta = item.meta;
            let mut trade_key = meta.trade_key;
            let trade_date = item.outcome.trade_date;
            if let Some(status) = item.outcome.trade_status {
                let first = item.outcome.trade_status_first;
                set_trade_status(
                    &mut batch,
                    &mut trade_rows,
                    &trade_key,
                    trade_date,
                    (status, first),
                );
            }
            // The message's row takes the trade key, unless a CLS row is still to take it.
            let mut row_key = || match item.outcome.cls {
                Some(_) => trade_key.clone(),
                None => std::mem::take(&mut trade_key),
            };
            let result = match item.outcome.disposition {
                Disposition::Accepted => {
                    batch.messages.push(MessageRow {
                        trade_date,
                        trade_key: row_key(),
                        sender: meta.sender,
                        msg_id: meta.msg_id,
                        msg_type: meta.msg_type,
                        function: meta.function,
                        related_id: meta.related_id,
                        injected_ns: item.injected_ns,
                        raw: item.bytes,
                        received_on: item.received_on,
                    });
                    AckResult::Accepted
                }
                Disposition::Duplicate => AckResult::Duplicate,
                Disposition::Rejected(rejection) => {
                    let code = rejection.code;
                    batch.exceptions.push(ExceptionRow {
                        received_on: today,
                        trade_key: Some(row_key()),
                        sender: Some(meta.sender.to_string()),
                        msg_id: Some(meta.msg_id.to_string()),
                        code,
                        detail: rejection.detail,
                        raw: item.bytes,
                    });
                    AckResult::Rejected(code)
                }
            };
            acks.push(Ack {
                correlation: item.correlation,
                origin: item.origin,
                result,
            });
            if let Some(cls) = item.outcome.cls {
                let body = encode_cls(&cls);
                batch.cls.push(ClsRow {
                    trade_date,
                    cls_id: cls.cls_id.clone(),
                    trade_key,
                    body: body.clone(),
                });
                events.push(OutboundEvent::Cls {
                    cls_id: cls.cls_id,
                    body,
                    trade_first_injected_ns: item.outcome.trade_first_injected_ns,
                    shard,
                    outbox_id: 0,
                    redelivered: false,
                });
            }
            if let Some(advice) = item.outcome.advice {
                events.push(OutboundEvent::Mismatched(advice));
            }
            events.extend(
                item.outcome
                    .released
                    .into_iter()
                    .map(OutboundEvent::Released),
            );
        }
        // One answer per message: every message of the batch has exactly one ACK or NAK, and
        // an aged trade none.
        assert_eq!(
            acks.len() as u64 + aged_count,
            count,
            "shard {shard}: a batch's answers must be one per message"
        );
        // The store may take the rows out of the batch as it commits them.
        let cls_count = batch.cls.len();
        let confirmed = delivered.load(Ordering::Relaxed);
        if confirmed > watermark_written {
            batch.delivered_through = Some(confirmed);
        }
        if !still_owner() {
            return Err(PipelineError::LeaseLost { shard });
        }
        let (outbox_ids, retries) =
            commit_retrying(store.as_mut(), &mut batch, station.name(), retry)?;
        // The outbox as committed: one id per CLS, in the batch's order, each above every id
        // this writer emitted before. The sink confirms CLS in outbox order and one watermark
        // says which were delivered; ids out of order would lose or repeat CLS after a restart.
        assert_eq!(
            outbox_ids.len(),
            cls_count,
            "shard {shard}: the store must give one outbox id per CLS"
        );
        assert!(
            outbox_ids
                .iter()
                .try_fold(last_emitted, |previous, id| (*id > previous).then_some(*id))
                .is_some(),
            "shard {shard}: outbox ids must rise: {outbox_ids:?} after {last_emitted}"
        );
        commit_retries += retries;
        committed.fetch_add(count, Ordering::Release);
        watermark_written = watermark_written.max(confirmed);
        let mut outbox_ids = outbox_ids.into_iter();
        for event in &mut events {
            if let OutboundEvent::Cls { outbox_id, .. } = event {
                *outbox_id = outbox_ids.next().unwrap_or_default();
                last_emitted = last_emitted.max(*outbox_id);
            }
        }
        complete_merged(
            batches.rx(),
            count,
            started.elapsed().as_nanos() as u64,
            enqueued_sum_ns,
        );
        // CLS first, then the answers, then the acknowledgement of the batches they came from:
        // whoever holds every answer of a run holds every CLS of it, and a node that dies
        // before the acknowledgement leaves the batches to be delivered again (answered again,
        // as duplicates; their CLS are in the outbox, emitted again by the next owner).
        out_tx.send(events).map_err(queue_error)?;
        ack_tx.send(acks).map_err(queue_error)?;
        receipt.ack().map_err(queue_error)?;
    }
    // Record the final watermark, once the consumer has confirmed what this writer emitted.
    if delivery_in_use.load(Ordering::Relaxed) {
        let waiting_since = Instant::now();
        while delivered.load(Ordering::Relaxed) < last_emitted
            && waiting_since.elapsed() < DELIVERY_WAIT
        {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    let confirmed = delivered.load(Ordering::Relaxed);
    if confirmed > watermark_written {
        let mut batch = Batch {
            delivered_through: Some(confirmed),
            ..Batch::default()
        };
        if !still_owner() {
            return Err(PipelineError::LeaseLost { shard });
        }
        commit_retrying(store.as_mut(), &mut batch, station.name(), retry)?;
    }
    Ok(WriterReport {
        rows: store.row_counts()?,
        commit_retries,
    })
}
