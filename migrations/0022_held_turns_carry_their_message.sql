-- A first attempt held at admission keeps its message on its turn, and its
-- outbox row is written only when the turn is handed out: the row that was
-- written not due ('infinity') and made due at the hand-out is one write
-- less a held job, and the relay, which looks for due rows, no longer walks
-- the held ones. A turn made before this migration, and a retry's or
-- hedge's (`next_turns`), still has its outbox row written not due
-- (`outbox_id`), made due when it is handed out, as before.
ALTER TABLE turns ALTER COLUMN outbox_id DROP NOT NULL;
ALTER TABLE turns ADD COLUMN IF NOT EXISTS exchange text NULL;
ALTER TABLE turns ADD COLUMN IF NOT EXISTS routing_key text NULL;
ALTER TABLE turns ADD COLUMN IF NOT EXISTS body jsonb NULL;

COMMENT ON COLUMN turns.body IS 'the attempt message of a turn held at admission, its outbox row written when it is handed out (NULL: the turn has its outbox row, outbox_id)';
