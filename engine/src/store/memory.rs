//! The store in process memory.

use super::{
    code_is_remembered, Batch, ClsRow, ExceptionRow, MessageRow, RowCounts, Store, StoreError,
    StoredMessage, StoredRejection, UndeliveredCls,
};
use crate::matcher::TradeStatus;

/// Rows kept in process memory: the store for tests and for measuring the engine without
/// storage cost. It keeps every row, so its memory grows with the run.
/// Rows are kept as the committed batches themselves, so that growing the store never copies
/// what it already holds.
#[derive(Debug, Default)]
pub struct MemoryStore {
    pub messages: Vec<Vec<MessageRow>>,
    pub trades: ahash::AHashMap<String, TradeStatus>,
    pub cls: Vec<ClsRow>,
    pub exceptions: Vec<ExceptionRow>,
    pub delivered_through: i64,
}

impl Store for MemoryStore {
    fn commit(&mut self, batch: &mut Batch) -> Result<Vec<i64>, StoreError> {
        let batch = std::mem::take(batch);
        if !batch.messages.is_empty() {
            self.messages.push(batch.messages);
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
