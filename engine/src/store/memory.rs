//! The store in process memory.

use super::{
    code_is_remembered, Batch, ClsRow, ExceptionRow, MessageRow, RowCounts, Store, StoreError,
    StoredMessage, StoredRejection, UndeliveredCls,
};
use crate::matcher::TradeStatus;
use time::Date;

/// Rows kept in process memory: the store for tests and for measuring the engine without
/// storage cost. It keeps every row, so its memory grows with the run.
/// Messages are kept a committed batch to a vector, so that growing the store never copies
/// what it already holds, and each as only what recovery reads back ([`KeptMessage`]).
#[derive(Debug, Default)]
pub struct MemoryStore {
    pub messages: Vec<Vec<KeptMessage>>,
    pub trades: ahash::AHashMap<String, TradeStatus>,
    pub cls: Vec<ClsRow>,
    pub exceptions: Vec<ExceptionRow>,
    pub delivered_through: i64,
}

/// An accepted message as the memory store keeps it: its bytes and what recovery cannot read
/// from them. The rest of a [`MessageRow`] (trade key, sender, MsgId, type, function, related
/// id: about 160 bytes with the trade key's own allocation, against 40 here) is in the bytes;
/// the store grows by a message's row at every message, and on a run of a few million messages
/// the pages it touches for the first time are a fifth of the engine's CPU.
#[derive(Debug)]
pub struct KeptMessage {
    pub raw: Vec<u8>,
    pub injected_ns: u64,
    pub trade_date: Date,
    pub received_on: Date,
}

impl From<MessageRow> for KeptMessage {
    fn from(row: MessageRow) -> Self {
        Self {
            raw: row.raw,
            injected_ns: row.injected_ns,
            trade_date: row.trade_date,
            received_on: row.received_on,
        }
    }
}

impl Store for MemoryStore {
    fn commit(&mut self, batch: &mut Batch) -> Result<Vec<i64>, StoreError> {
        let batch = std::mem::take(batch);
        if !batch.messages.is_empty() {
            // Into a vector of its own size: collecting would reuse the batch's allocation,
            // sized for the longer rows.
            let mut kept = Vec::with_capacity(batch.messages.len());
            kept.extend(batch.messages.into_iter().map(KeptMessage::from));
            self.messages.push(kept);
        }
        for row in batch.trades {
            self.trades.insert(row.trade_key, row.status);
        }
        let first_id = self.cls.len() as i64 + 1;
        let ids = (first_id..first_id + batch.cls.len() as i64).collect();
        self.cls.extend(batch.cls);
        self.exceptions.extend(batch.exceptions);
        if let Some(through) = batch.delivered_through {
            self.delivered_through = self.delivered_through.max(through);
        }
        Ok(ids)
    }

    fn undelivered_cls(&mut self) -> Result<Vec<UndeliveredCls>, StoreError> {
        let skip = usize::try_from(self.delivered_through).unwrap_or(0);
        Ok(self
            .cls
            .iter()
            .enumerate()
            .skip(skip)
            .map(|(index, row)| UndeliveredCls {
                outbox_id: index as i64 + 1,
                cls_id: row.cls_id.clone(),
                body: row.body.clone(),
            })
            .collect())
    }

    fn row_counts(&mut self) -> Result<RowCounts, StoreError> {
        Ok(RowCounts {
            messages: self.messages.iter().map(Vec::len).sum::<usize>() as u64,
            trades: self.trades.len() as u64,
            cls: self.cls.len() as u64,
            exceptions: self.exceptions.len() as u64,
        })
    }

    fn for_each_accepted(
        &mut self,
        visit: &mut dyn FnMut(StoredMessage),
    ) -> Result<u64, StoreError> {
        let mut count = 0;
        for row in self.messages.iter().flatten() {
            visit(StoredMessage {
                raw: row.raw.clone(),
                injected_ns: row.injected_ns,
                trade_date: Some(row.trade_date),
                received_on: Some(row.received_on),
            });
            count += 1;
        }
        Ok(count)
    }

    fn for_each_remembered_rejection(
        &mut self,
        visit: &mut dyn FnMut(StoredRejection),
    ) -> Result<u64, StoreError> {
        let mut count = 0;
        for row in &self.exceptions {
            if let (Some(sender), Some(msg_id), true) =
                (&row.sender, &row.msg_id, code_is_remembered(row.code))
            {
                visit(StoredRejection {
                    sender: sender.clone(),
                    msg_id: msg_id.clone(),
                    code: row.code,
                    raw: row.raw.clone(),
                });
                count += 1;
            }
        }
        Ok(count)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::tests::sample_batch;

    #[test]
    fn memory_store_keeps_the_last_trade_status() {
        let mut store = MemoryStore::default();
        store.commit(&mut sample_batch()).expect("commits");
        assert_eq!(store.trades.get("B/T1"), Some(&TradeStatus::Matched));
        assert_eq!(store.row_counts().expect("counts").messages, 1);
    }
}
