//! The exception writer: stores what the validators rejected before any shard could.

use std::time::{Duration, Instant};

use time::OffsetDateTime;

use super::{
    commit_retrying, complete_merged, next_batch, queue_error, Merged, RejectedItem, WriterReport,
};
use crate::pipeline::{Ack, AckResult, PipelineError, RetryPolicy, EXCEPTION_RAW_PREFIX_BYTES};
use crate::queue::{Rx, Tx};
use crate::store::{Batch, ExceptionRow, Store};

/// The raw bytes an exception of unchecked input keeps: at most
/// [`EXCEPTION_RAW_PREFIX_BYTES`], with the full length and hash added to the detail.
pub(crate) fn bounded_raw(mut raw: Vec<u8>, detail: String) -> (Vec<u8>, String) {
    if raw.len() <= EXCEPTION_RAW_PREFIX_BYTES {
        return (raw, detail);
    }
    let detail = format!(
        "{detail} (the first {EXCEPTION_RAW_PREFIX_BYTES} of {} bytes are kept, xxh3 {:016x})",
        raw.len(),
        xxhash_rust::xxh3::xxh3_64(&raw)
    );
    raw.truncate(EXCEPTION_RAW_PREFIX_BYTES);
    raw.shrink_to_fit();
    (raw, detail)
}

/// Writes the validators' rejections to the exception store; their NAKs go out after commit.
pub(crate) fn run_exception_writer(
    rx: Rx<RejectedItem>,
    mut store: Box<dyn Store>,
    ack_tx: Tx<Ack>,
    batch_max: usize,
    retry: RetryPolicy,
) -> Result<WriterReport, PipelineError> {
    let station = rx.station().clone();
    let mut commit_retries = 0;
    while let Some(merged) = next_batch(&rx, batch_max, Duration::ZERO)? {
        let Merged {
            items,
            waited_ns,
            receipt,
        } = merged;
        let started = Instant::now();
        let dequeued_ns = rx.now_ns();
        let today = OffsetDateTime::now_utc().date();
        let count = items.len() as u64;
        let mut batch = Batch::default();
        let mut acks = Vec::with_capacity(items.len());
        for item in items {
            acks.push(Ack {
                correlation: item.correlation,
                origin: item.origin,
                result: AckResult::Rejected(item.rejection.code),
            });
            let (raw, detail) = bounded_raw(item.bytes, item.rejection.detail);
            batch.exceptions.push(ExceptionRow {
                received_on: today,
                trade_key: None,
                sender: item.sender,
                msg_id: None,
                code: item.rejection.code,
                detail,
                raw,
            });
        }
        let (_, retries) = commit_retrying(store.as_mut(), &mut batch, station.name(), retry)?;
        commit_retries += retries;
        complete_merged(
            &rx,
            count,
            started.elapsed().as_nanos() as u64,
            waited_ns,
            dequeued_ns,
        );
        // Answered before the batches it came from are acknowledged: a node that dies in
        // between leaves them to be delivered again, and answered again.
        ack_tx.send(acks).map_err(queue_error)?;
        receipt.ack().map_err(queue_error)?;
    }
    Ok(WriterReport {
        rows: store.row_counts()?,
        commit_retries,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unchecked_input_keeps_a_bounded_prefix_with_its_length_and_hash() {
        let raw = vec![b'x'; 1024 * 1024];
        let (kept, detail) = bounded_raw(raw.clone(), "not a SOAP envelope".into());
        assert_eq!(kept, raw[..EXCEPTION_RAW_PREFIX_BYTES]);
        assert!(detail.starts_with("not a SOAP envelope"), "{detail}");
        assert!(detail.contains("of 1048576 bytes"), "{detail}");
        assert!(
            detail.contains(&format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&raw))),
            "{detail}"
        );
        let small = b"<Msg/>".to_vec();
        assert_eq!(
            bounded_raw(small.clone(), "short".into()),
            (small, "short".to_owned())
        );
    }
}
