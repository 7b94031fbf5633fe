-- The console shows a job's messages (its attempts' messages and its events),
-- and admission looks up the message of an attempt it did not write: both find
-- outbox rows by message id. Without this index each was a scan of the whole
-- outbox, which keeps published rows for `outbox_retention` (7 days by default).
-- On a large outbox, build it by hand first (the migration then does nothing):
--   CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_message_id ON outbox (message_id);
CREATE INDEX IF NOT EXISTS outbox_message_id ON outbox (message_id);
