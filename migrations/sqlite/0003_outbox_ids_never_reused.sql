-- The outbox's ids must rise for ever: the sink confirms CLS in outbox order and one watermark
-- (cls_delivery.delivered_through) says which were delivered. A plain INTEGER PRIMARY KEY takes
-- the largest id present plus one, so once retention had deleted the newest rows (all old and
-- confirmed) a new CLS could get an id at or below the watermark, count as delivered, and be
-- lost after a restart. AUTOINCREMENT keeps the largest id ever given in sqlite_sequence.
CREATE TABLE cls_outbox_autoincrement (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    cls_id TEXT NOT NULL,
    trade_key TEXT NOT NULL,
    body TEXT NOT NULL,
    trade_date INTEGER
);
INSERT INTO cls_outbox_autoincrement (id, cls_id, trade_key, body, trade_date)
    SELECT id, cls_id, trade_key, body, trade_date FROM cls_outbox;
DROP TABLE cls_outbox;
ALTER TABLE cls_outbox_autoincrement RENAME TO cls_outbox;
-- Ids given before this migration whose rows retention already deleted are at most the
-- watermark: the next id starts above it too.
DELETE FROM sqlite_sequence WHERE name = 'cls_outbox';
INSERT INTO sqlite_sequence (name, seq) VALUES ('cls_outbox', MAX(
    COALESCE((SELECT MAX(id) FROM cls_outbox), 0),
    COALESCE((SELECT delivered_through FROM cls_delivery WHERE id = 1), 0)
));
