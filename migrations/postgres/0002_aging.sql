-- Aging: an unmatched trade ages out after a number of business days without a message, so each
-- message keeps the day it arrived (NULL for rows written before this), and a trade's status
-- may be AGED.
ALTER TABLE messages ADD COLUMN received_on DATE;
ALTER TABLE trades DROP CONSTRAINT trades_status_check;
ALTER TABLE trades ADD CONSTRAINT trades_status_check
    CHECK (status IN ('PENDING', 'MISMATCHED', 'MATCHED', 'CANCELLED', 'AGED'));
