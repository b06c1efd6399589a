-- Recall (bounded matcher memory): a matcher keeps a filter of fixed size over the message keys
-- and closed trades it has retired, and reads the facts back from its shard when a message may
-- need them. These indexes answer those look-ups: the first remembered rejection of a
-- (Sender, MsgId), and whether an accepted CAN or AMD names a (Sender, MsgId). The first verdict
-- of an accepted (Sender, MsgId) and a trade's status come from the existing unique keys.
CREATE INDEX exceptions_by_key ON exceptions (sender, msg_id);
CREATE INDEX messages_by_related ON messages (sender, related_id) WHERE related_id IS NOT NULL;
