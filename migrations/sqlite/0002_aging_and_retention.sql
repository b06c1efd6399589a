-- Aging: an unmatched trade ages out after a number of business days without a message, so each
-- message keeps the day it arrived (Julian day number; NULL for rows written before this), and
-- a trade's status may be AGED.
-- Retention: rows keep their trade's date (messages, statuses, outbox) or the day they arrived
-- (exceptions), as Julian day numbers, so that what has expired can be deleted; rows written
-- before this have none and are kept.
ALTER TABLE messages ADD COLUMN received_on INTEGER;
ALTER TABLE messages ADD COLUMN trade_date INTEGER;
ALTER TABLE cls_outbox ADD COLUMN trade_date INTEGER;
ALTER TABLE exceptions ADD COLUMN received_on INTEGER;

CREATE TABLE trade_status_aging (
    id INTEGER PRIMARY KEY,
    trade_key TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('PENDING', 'MISMATCHED', 'MATCHED', 'CANCELLED', 'AGED')),
    trade_date INTEGER
);
INSERT INTO trade_status_aging (id, trade_key, status) SELECT id, trade_key, status FROM trade_status;
DROP VIEW trades;
DROP TABLE trade_status;
ALTER TABLE trade_status_aging RENAME TO trade_status;

CREATE VIEW trades AS
SELECT trade_key, status
FROM (
    SELECT trade_key, status,
           ROW_NUMBER() OVER (PARTITION BY trade_key ORDER BY id DESC) AS newest
    FROM trade_status
)
WHERE newest = 1;
