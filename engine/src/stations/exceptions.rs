//! The exception writer: stores what the validators rejected before any shard could — input
//! whose sender was not proved (unsigned, wrongly signed, unreadable, refused by a listener) —
//! within a budget of rows and bytes a second, so that a flood of such input cannot fill the
//! disk: beyond it, the rejections of a batch are kept as one row per code that counts them.
//! Every message is answered with its own code all the same.

use std::time::{Duration, Instant};

use time::OffsetDateTime;

use super::{
    commit_retrying, complete_merged, queue_error, BatchBound, Batcher, RejectedItem, WriterReport,
};
use crate::network::{Ack, AckResult, PipelineError, RetryPolicy, EXCEPTION_RAW_PREFIX_BYTES};
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

/// Rows of unchecked input kept whole: a burst, then so many a second.
const UNCHECKED_ROWS_BURST: f64 = 5_000.0;
const UNCHECKED_ROWS_PER_S: f64 = 500.0;
/// Bytes (raw and detail) of unchecked input kept whole: a burst, then so many a second.
const UNCHECKED_BYTES_BURST: f64 = 8.0 * 1024.0 * 1024.0;
const UNCHECKED_BYTES_PER_S: f64 = 1024.0 * 1024.0;

/// A token bucket over the rows and bytes of unchecked input stored whole.
struct Budget {
    rows: f64,
    bytes: f64,
    at: Instant,
}

impl Budget {
    fn new(now: Instant) -> Self {
        Self {
            rows: UNCHECKED_ROWS_BURST,
            bytes: UNCHECKED_BYTES_BURST,
            at: now,
        }
    }

    /// Takes one row of `bytes` if the budget holds it at `now`.
    fn take(&mut self, bytes: usize, now: Instant) -> bool {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.at = self.at.max(now);
        self.rows = (self.rows + elapsed * UNCHECKED_ROWS_PER_S).min(UNCHECKED_ROWS_BURST);
        self.bytes = (self.bytes + elapsed * UNCHECKED_BYTES_PER_S).min(UNCHECKED_BYTES_BURST);
        let bytes = bytes as f64;
        if self.rows >= 1.0 && self.bytes >= bytes {
            self.rows -= 1.0;
            self.bytes -= bytes;
            true
        } else {
            false
        }
    }
}

/// The rejections of one batch that the budget did not hold, by code: how many, and the first
/// one's detail.
#[derive(Default)]
struct Over {
    by_code: Vec<(crate::reason::ReasonCode, u64, String)>,
}

impl Over {
    fn add(&mut self, code: crate::reason::ReasonCode, detail: &str) {
        match self.by_code.iter_mut().find(|(c, _, _)| *c == code) {
            Some((_, count, _)) => *count += 1,
            None => self
                .by_code
                .push((code, 1, detail.chars().take(200).collect())),
        }
    }

    fn rows(self, today: time::Date) -> impl Iterator<Item = ExceptionRow> {
        self.by_code.into_iter().map(move |(code, count, first)| ExceptionRow {
            received_on: today,
            trade_key: None,
            sender: None,
            msg_id: None,
            code,
            detail: format!(
                "{count} rejections of unchecked input over the exception budget ({UNCHECKED_ROWS_PER_S} rows and {} KiB a second), kept as this count without their bytes; the first: {first}",
                UNCHECKED_BYTES_PER_S as u64 / 1024
            ),
            raw: Vec::new(),
        })
    }
}

/// Writes the validators' rejections to the exception store; their NAKs go out after commit.
/// With `keep_days`, once a day (at its first batch of the day) it deletes what it stored
/// that arrived more than that many days before.
pub(crate) fn run_exception_writer(
    rx: Rx<RejectedItem>,
    mut store: Box<dyn Store>,
    ack_tx: Tx<Ack>,
    batch_max: BatchBound,
    retry: RetryPolicy,
    keep_days: Option<u32>,
) -> Result<WriterReport, PipelineError> {
    let station = rx.station().clone();
    let mut commit_retries = 0;
    let mut budget = Budget::new(Instant::now());
    let mut purged_on: Option<time::Date> = None;
    let mut batches = Batcher::new(rx, batch_max, RejectedItem::weight_bytes, Duration::ZERO);
    while let Some(merged) = batches.next()? {
        let count = merged.len() as u64;
        let (items, enqueued_sum_ns, receipt) = merged.into_parts();
        let started = Instant::now();
        let today = OffsetDateTime::now_utc().date();
        if let Some(days) = keep_days.filter(|_| purged_on != Some(today)) {
            purged_on = Some(today);
            let before = today - time::Duration::days(i64::from(days));
            // A purge that fails is tried again the next day; what it would free waits.
            match store.purge_unchecked_exceptions(before) {
                Ok(0) => {}
                Ok(deleted) => {
                    tracing::info!(deleted, %before, "exceptions of unchecked input past retention deleted")
                }
                Err(error) => tracing::warn!(%error, "exceptions of unchecked input not purged"),
            }
        }
        let mut batch = Batch::default();
        let mut acks = Vec::with_capacity(count as usize);
        let mut over = Over::default();
        for item in items {
            acks.push(Ack {
                correlation: item.correlation,
                origin: item.origin,
                result: AckResult::Rejected(item.rejection.code),
            });
            let (raw, detail) = bounded_raw(item.bytes, item.rejection.detail);
            if !budget.take(raw.len() + detail.len(), started) {
                over.add(item.rejection.code, &detail);
                continue;
            }
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
        batch.exceptions.extend(over.rows(today));
        let (_, retries) = commit_retrying(store.as_mut(), &mut batch, station.name(), retry)?;
        commit_retries += retries;
        complete_merged(
            batches.rx(),
            count,
            started.elapsed().as_nanos() as u64,
            enqueued_sum_ns,
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
    fn unchecked_input_is_kept_whole_within_a_budget_of_rows_and_bytes() {
        let start = Instant::now();
        let mut budget = Budget::new(start);
        let burst = UNCHECKED_ROWS_BURST as usize;
        // A flood of small rows: the burst of rows, then nothing at that instant.
        assert!((0..burst).all(|_| budget.take(100, start)));
        assert!(!budget.take(100, start));
        // A second later, that second's rows.
        let later = start + Duration::from_secs(1);
        let per_s = UNCHECKED_ROWS_PER_S as usize;
        assert!((0..per_s).all(|_| budget.take(100, later)));
        assert!(!budget.take(100, later));
        // Large rows spend the bytes first.
        let mut budget = Budget::new(start);
        let big = 64 * 1024;
        let fit = (UNCHECKED_BYTES_BURST as usize) / big;
        assert!((0..fit).all(|_| budget.take(big, start)));
        assert!(!budget.take(big, start));
        // What goes over is counted by code, one row each.
        let mut over = Over::default();
        for _ in 0..3 {
            over.add(crate::reason::ReasonCode::Sig, "signature does not match");
        }
        over.add(crate::reason::ReasonCode::Parse, "not XML");
        let rows: Vec<ExceptionRow> = over.rows(time::macros::date!(2026 - 12 - 02)).collect();
        assert_eq!(rows.len(), 2);
        assert!(
            rows[0].detail.starts_with("3 rejections"),
            "{}",
            rows[0].detail
        );
        assert!(rows.iter().all(|row| row.raw.is_empty()));
    }

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
