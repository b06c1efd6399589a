//! The matcher station: one per shard, owning the shard's open trades.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use time::format_description::well_known::Rfc3339;
use time::{Date, OffsetDateTime};

use super::{complete, queue_error, retrying, MessageMeta, Processed, ToStore, Validated};
use crate::matcher::{Content, Matcher, Outcome, RecallQuery, ShardCounts};
use crate::network::{Aging, PipelineError, RetryPolicy};
use crate::queue::{QueueError, Rx, Tx};
use crate::store::{RetiredRuns, Store, StoreError};

/// What a bounded matcher ([`Matcher::bounded`]) needs: where to read back what it retired,
/// and the count of items its writer has committed, to know when a generation may be retired.
pub(crate) struct Recall {
    pub(crate) from: RecallFrom,
    pub(crate) committed: Arc<AtomicU64>,
    pub(crate) retry: RetryPolicy,
}

/// Where a bounded matcher reads back what it retired.
pub(crate) enum RecallFrom {
    /// A connection of its own to the shard's store, which answers from its tables
    /// (PostgreSQL).
    Store(Box<dyn Store>),
    /// Its own files of retired facts, written as it retires them (the embedded store).
    Runs(RetiredRuns),
}

/// An item's Sender and MsgId, and its trade key if it was parsed (made in `key`, a buffer the
/// caller keeps): what a bounded matcher looks up for it.
fn identity_of<'a>(
    item: &'a Validated,
    key: &'a mut String,
) -> (&'a str, &'a str, Option<&'a str>) {
    match &item.verdict {
        Ok(msg) => {
            key.clear();
            crate::model::push_trade_key(key, &msg.broker, &msg.trade_ref);
            (msg.sender.as_str(), msg.msg_id.as_str(), Some(key.as_str()))
        }
        Err(refused) => (
            refused.identity.sender.as_str(),
            refused.identity.msg_id.as_str(),
            None,
        ),
    }
}

fn retired_error(station: &str, source: StoreError) -> PipelineError {
    PipelineError::Shard {
        station: station.to_owned(),
        source,
    }
}

/// Formats wall-clock time for CLS `MatchedAt`, at most once per millisecond.
struct MatchedAtClock {
    last_ms: i128,
    text: String,
    today: Date,
}

impl MatchedAtClock {
    /// The timestamp and its date.
    fn now(&mut self) -> (&str, Date) {
        let now = OffsetDateTime::now_utc();
        let ms = now.unix_timestamp_nanos() / 1_000_000;
        if ms != self.last_ms {
            self.last_ms = ms;
            self.today = now.date();
            let truncated = now
                .replace_nanosecond((now.nanosecond() / 1_000_000) * 1_000_000)
                .unwrap_or(now);
            self.text = truncated
                .format(&Rfc3339)
                .unwrap_or_else(|_| "1970-01-01T00:00:00.000Z".to_owned());
        }
        (&self.text, self.today)
    }
}

/// How long a bounded matcher that has stopped waits for its writer to commit the generation
/// it is to retire.
const RETIRE_AT_STOP_WAIT: Duration = Duration::from_secs(5);

/// Runs a shard's matcher over its match queue; what it decided goes to the shard's writer,
/// with the receipts of the batches it came from, acknowledged once committed. After each
/// batch, `table_bytes` holds the size of the matcher's tables ([`Matcher::table_bytes`]). A
/// bounded matcher reads back, before each batch, the facts the batch may need from what it
/// retired, and after it retires what its writer has committed.
pub(crate) fn run_matcher(
    rx: Rx<Validated>,
    mut matcher: Matcher,
    store_tx: Tx<ToStore>,
    aging: Option<Aging>,
    table_bytes: Arc<AtomicU64>,
    mut recall: Option<Recall>,
) -> Result<ShardCounts, PipelineError> {
    let mut sent: u64 = 0;
    // Read-backs, and the keys they asked for.
    let (mut reads, mut keys_read) = (0_u64, 0_u64);
    // Keys to look up in the runs of retired facts, what they held, what a generation retires.
    let (mut keys, mut found, mut retired) = (Vec::new(), Vec::new(), Vec::new());
    // A message's trade key, made in place for each lookup.
    let mut key_buffer = String::new();
    let mut wall = MatchedAtClock {
        last_ms: -1,
        text: String::new(),
        today: Date::MIN,
    };
    let mut aged_on: Option<Date> = None;
    // Without aging the matcher only waits for batches; the wait merely bounds a wake-up.
    let wait = aging.map_or(Duration::from_secs(3600), |aging| aging.check_interval);
    loop {
        let received = match rx.recv_until(Some(Instant::now() + wait)) {
            Ok(received) => received,
            Err(QueueError::Closed { .. }) => break,
            Err(error) => return Err(queue_error(error)),
        };
        if let Some(aging) = aging {
            // Once a day, at the first wake-up of the day.
            let today = OffsetDateTime::now_utc().date();
            if aged_on != Some(today) {
                aged_on = Some(today);
                let aged = matcher.age_out(today, aging.business_days);
                if !aged.is_empty() {
                    tracing::info!(trades = aged.len(), %today, "unmatched trades aged out");
                    sent += aged.len() as u64;
                    let items = aged.into_iter().map(ToStore::Aged).collect();
                    store_tx.send(items).map_err(queue_error)?;
                }
            }
        }
        let Some(received) = received else {
            continue;
        };
        let (items, enqueued_ns) = (received.items, received.enqueued_ns);
        let started = Instant::now();
        let count = items.len() as u64;
        let retry = recall.as_ref().map(|recall| recall.retry);
        match recall.as_mut().map(|recall| &mut recall.from) {
            None => {}
            Some(RecallFrom::Store(store)) => {
                let mut query = RecallQuery::default();
                for item in &items {
                    let (sender, msg_id, trade_key) = identity_of(item, &mut key_buffer);
                    matcher.to_recall(sender, msg_id, trade_key, &mut query);
                }
                if !query.is_empty() {
                    reads += 1;
                    keys_read +=
                        (query.verdicts.len() + query.trades.len() + query.names.len()) as u64;
                    let (recalled, _) = retrying(
                        store.as_mut(),
                        rx.station().name(),
                        "recall",
                        retry.unwrap_or_default(),
                        |store| store.recall(&query),
                    )?;
                    matcher.recall(recalled);
                }
            }
            Some(RecallFrom::Runs(runs)) => {
                for item in &items {
                    let (sender, msg_id, trade_key) = identity_of(item, &mut key_buffer);
                    matcher.to_recall_keys(sender, msg_id, trade_key, &mut keys);
                }
                if !keys.is_empty() {
                    reads += 1;
                    keys_read += keys.len() as u64;
                    runs.lookup(&keys, &mut found)
                        .map_err(|source| retired_error(rx.station().name(), source))?;
                    keys.clear();
                    matcher.recall_entries(found.drain(..));
                }
            }
        }
        let mut processed = Vec::with_capacity(items.len());
        // One reading of the clock per batch: a CLS's MatchedAt is when the matcher took the
        // batch whose message completed the trade.
        let (now, today) = wall.now();
        for item in items {
            // The validator made `content` of these very bytes (checked where it costs nothing
            // in a release build).
            debug_assert_eq!(item.content, Content::of(&item.bytes));
            let (meta, outcome) = match item.verdict {
                Ok(msg) => {
                    let meta = MessageMeta::of(&msg);
                    let outcome = matcher.process_keyed(
                        msg,
                        &meta.trade_key,
                        item.content,
                        item.injected_ns,
                        now,
                        today,
                    );
                    (meta, outcome)
                }
                Err(refused) => {
                    let identity = refused.identity;
                    let disposition = matcher.refuse(
                        &identity.sender,
                        &identity.msg_id,
                        item.content,
                        refused.rejection,
                    );
                    let meta = MessageMeta {
                        trade_key: crate::model::trade_key(&identity.broker, &identity.trade_ref),
                        sender: identity.sender.into(),
                        msg_id: identity.msg_id.into(),
                        msg_type: "",
                        function: "",
                        related_id: None,
                    };
                    (meta, Outcome::only(disposition))
                }
            };
            processed.push(ToStore::Message(Processed {
                received_on: today,
                outcome,
                meta,
                bytes: item.bytes,
                correlation: item.correlation,
                origin: item.origin,
                injected_ns: item.injected_ns,
            }));
        }
        let busy_ns = started.elapsed().as_nanos() as u64;
        // The match batch is acknowledged once its writer has committed what it produced.
        sent += processed.len() as u64;
        store_tx
            .forward(processed, received.receipt)
            .map_err(queue_error)?;
        complete(&rx, count, busy_ns, enqueued_ns);
        if let Some(recall) = &mut recall {
            let committed = recall.committed.load(Ordering::Acquire);
            match &mut recall.from {
                RecallFrom::Store(_) => {
                    matcher.after_batch(sent, committed);
                }
                RecallFrom::Runs(runs) => {
                    if matcher.after_batch_into(sent, committed, Some(&mut retired)) {
                        runs.add(&mut retired)
                            .map_err(|source| retired_error(rx.station().name(), source))?;
                    }
                }
            }
        }
        table_bytes.store(matcher.table_bytes(), Ordering::Relaxed);
    }
    if let Some(Recall {
        committed,
        from: RecallFrom::Runs(runs),
        ..
    }) = &mut recall
    {
        // At a clean stop, the generation waiting for its writer's commit is retired to the
        // files once committed, so that they hold every generation the run closed. The writer
        // commits what it was sent within its linger; the wait is bounded in case it failed.
        if let Some(mark) = matcher.retires_at() {
            let deadline = Instant::now() + RETIRE_AT_STOP_WAIT;
            while committed.load(Ordering::Acquire) < mark && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
            let committed = committed.load(Ordering::Acquire);
            if matcher.after_batch_into(sent, committed, Some(&mut retired)) {
                runs.add(&mut retired)
                    .map_err(|source| retired_error(rx.station().name(), source))?;
            }
        }
    }
    match recall.as_ref().map(|recall| &recall.from) {
        Some(RecallFrom::Runs(runs)) => {
            let stats = runs.stats();
            tracing::info!(
                station = rx.station().name(),
                reads,
                keys_read,
                runs = stats.runs,
                records = stats.records,
                written = stats.written,
                blocks_read = stats.blocks_read,
                "matcher stopped; what it read back from its retired facts"
            );
        }
        Some(RecallFrom::Store(_)) => tracing::info!(
            station = rx.station().name(),
            reads,
            keys_read,
            "matcher stopped; what it read back from its shard"
        ),
        None => {}
    }
    Ok(matcher.counts())
}
