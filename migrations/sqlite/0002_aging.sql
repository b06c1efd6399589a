-- Aging: an unmatched trade ages out after a number of business days without a message, so each
-- message keeps the day it arrived (Julian day number; NULL for rows written before this), and
-- a trade's status may be AGED.
ALTER TABLE messages ADD COLUMN received_on INTEGER;

CREATE TABLE trade_status_aging (
    id INTEGER PRIMARY KEY,
    trade_key TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('PENDING', 'MISMATCHED', 'MATCHED', 'CANCELLED', 'AGED'))
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
