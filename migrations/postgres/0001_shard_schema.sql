-- One shard of the PostgreSQL store. Every row with a natural key is stored once: a batch replayed
-- after a failure changes nothing.

-- Every accepted message with its raw bytes (loaded with binary COPY); a (Sender, MsgId) is
-- stored once.
CREATE TABLE messages (
    id BIGSERIAL PRIMARY KEY,
    trade_key TEXT NOT NULL,
    sender TEXT NOT NULL,
    msg_id TEXT NOT NULL,
    msg_type TEXT NOT NULL,
    function TEXT NOT NULL,
    related_id TEXT,
    injected_ns BIGINT NOT NULL,
    raw BYTEA NOT NULL,
    UNIQUE (sender, msg_id)
);

-- The current status of every trade with an accepted message.
CREATE TABLE trades (
    trade_key TEXT PRIMARY KEY,
    status TEXT NOT NULL CHECK (status IN ('PENDING', 'MISMATCHED', 'MATCHED', 'CANCELLED'))
);

-- CLS written in the transaction of the message that completed the match, numbered in commit
-- order (one writer per shard).
CREATE TABLE cls_outbox (
    id BIGSERIAL UNIQUE,
    cls_id TEXT PRIMARY KEY,
    trade_key TEXT NOT NULL,
    body TEXT NOT NULL
);

-- The sink confirms CLS in outbox order, so one watermark says which were delivered: every
-- outbox row with an id up to delivered_through. The rest are emitted again after a restart.
CREATE TABLE cls_delivery (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    delivered_through BIGINT NOT NULL
);

-- Rejected messages with raw bytes, reason code and detail.
CREATE TABLE exceptions (
    id BIGSERIAL PRIMARY KEY,
    trade_key TEXT,
    sender TEXT,
    msg_id TEXT,
    code TEXT NOT NULL,
    detail TEXT NOT NULL,
    raw BYTEA NOT NULL
);
