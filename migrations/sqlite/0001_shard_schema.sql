-- One shard of the embedded store. Every table is append-mostly and carries as few indexes as
-- correctness needs: random-key secondary indexes are what make SQLite slow under bulk load.

-- Every accepted message with its raw bytes, in acceptance order.
CREATE TABLE messages (
    id INTEGER PRIMARY KEY,
    trade_key TEXT NOT NULL,
    sender TEXT NOT NULL,
    msg_id TEXT NOT NULL,
    msg_type TEXT NOT NULL,
    function TEXT NOT NULL,
    related_id TEXT,
    injected_ns INTEGER NOT NULL,
    raw BLOB NOT NULL
);

-- The status of every trade with an accepted message.
CREATE TABLE trades (
    trade_key TEXT PRIMARY KEY,
    status TEXT NOT NULL CHECK (status IN ('PENDING', 'MISMATCHED', 'MATCHED', 'CANCELLED'))
) WITHOUT ROWID;

-- CLS written in the transaction of the message that completed the match.
CREATE TABLE cls_outbox (
    cls_id TEXT PRIMARY KEY,
    trade_key TEXT NOT NULL,
    body TEXT NOT NULL,
    delivered INTEGER NOT NULL DEFAULT 0
);

-- Rejected messages with raw bytes, reason code and detail.
CREATE TABLE exceptions (
    id INTEGER PRIMARY KEY,
    trade_key TEXT,
    sender TEXT,
    msg_id TEXT,
    code TEXT NOT NULL,
    detail TEXT NOT NULL,
    raw BLOB NOT NULL
);
