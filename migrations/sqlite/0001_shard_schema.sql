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

-- Every change of a trade's status, appended in commit order. Upserting a table keyed by the
-- trade would insert at random places in a B-tree on every change; an append costs a fraction
-- of that, and the view below gives the current status.
CREATE TABLE trade_status (
    id INTEGER PRIMARY KEY,
    trade_key TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('PENDING', 'MISMATCHED', 'MATCHED', 'CANCELLED'))
);

-- The current status of every trade with an accepted message.
CREATE VIEW trades AS
SELECT trade_key, status
FROM (
    SELECT trade_key, status,
           ROW_NUMBER() OVER (PARTITION BY trade_key ORDER BY id DESC) AS newest
    FROM trade_status
)
WHERE newest = 1;

-- CLS written in the transaction of the message that completed the match. Appended in commit
-- order; a trade matches once, so the matcher already guarantees one row per ClsId.
CREATE TABLE cls_outbox (
    id INTEGER PRIMARY KEY,
    cls_id TEXT NOT NULL,
    trade_key TEXT NOT NULL,
    body TEXT NOT NULL
);

-- The sink confirms CLS in outbox order, so one watermark says which were delivered: every
-- outbox row with an id up to delivered_through. The rest are emitted again after a restart.
CREATE TABLE cls_delivery (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    delivered_through INTEGER NOT NULL
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
