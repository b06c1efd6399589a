-- One shard of the PostgreSQL store. Every row with a natural key is stored once: a batch replayed
-- after a failure changes nothing.
--
-- The tables of trades are partitioned by trade date, one partition per calendar month, so that
-- retention drops whole partitions instead of deleting rows. The engine creates a month's
-- partitions (named <table>_pYYYYMM) before it first writes a row of that month. A trade's rows
-- all carry one date: the TradeDate of the first message the shard accepted for it (the day of
-- arrival for a trade whose first message is a CAN, which carries no TradeDate). Exceptions are
-- partitioned by the day they arrived.

-- Every accepted message with its raw bytes (loaded with binary COPY); a (Sender, MsgId) is
-- stored once. `id` orders the shard's history for recovery.
CREATE TABLE messages (
    id BIGSERIAL NOT NULL,
    trade_date DATE NOT NULL,
    trade_key TEXT NOT NULL,
    sender TEXT NOT NULL,
    msg_id TEXT NOT NULL,
    msg_type TEXT NOT NULL,
    function TEXT NOT NULL,
    related_id TEXT,
    injected_ns BIGINT NOT NULL,
    raw BYTEA NOT NULL,
    UNIQUE (sender, msg_id, trade_date)
) PARTITION BY RANGE (trade_date);
CREATE INDEX messages_by_id ON messages (id);

-- The current status of every trade with an accepted message.
CREATE TABLE trades (
    trade_date DATE NOT NULL,
    trade_key TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('PENDING', 'MISMATCHED', 'MATCHED', 'CANCELLED')),
    PRIMARY KEY (trade_key, trade_date)
) PARTITION BY RANGE (trade_date);

-- CLS written in the transaction of the message that completed the match, numbered in commit
-- order (one writer per shard).
CREATE TABLE cls_outbox (
    id BIGSERIAL NOT NULL,
    trade_date DATE NOT NULL,
    cls_id TEXT NOT NULL,
    trade_key TEXT NOT NULL,
    body TEXT NOT NULL,
    PRIMARY KEY (cls_id, trade_date)
) PARTITION BY RANGE (trade_date);
CREATE INDEX cls_outbox_by_id ON cls_outbox (id);

-- The sink confirms CLS in outbox order, so one watermark says which were delivered: every
-- outbox row with an id up to delivered_through. The rest are emitted again after a restart.
-- Retention never drops a month that still holds an undelivered CLS.
CREATE TABLE cls_delivery (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    delivered_through BIGINT NOT NULL
);

-- Rejected messages with raw bytes, reason code and detail, by the day they arrived.
CREATE TABLE exceptions (
    id BIGSERIAL NOT NULL,
    received_on DATE NOT NULL,
    trade_key TEXT,
    sender TEXT,
    msg_id TEXT,
    code TEXT NOT NULL,
    detail TEXT NOT NULL,
    raw BYTEA NOT NULL,
    PRIMARY KEY (id, received_on)
) PARTITION BY RANGE (received_on);
