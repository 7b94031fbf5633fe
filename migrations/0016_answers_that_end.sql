-- Kept answers that end, and evidence that never strands what it found
-- (contract section 7, Evidence).
--
-- What evidence an attempt's own call can have, as its worker sent it:
-- 'stored' (the call asked the provider to store it, with the attempt as
-- metadata), 'idempotency_key' (the call carried the attempt id as its key)
-- or 'none'. Written when the attempt starts. NULL for attempts started
-- before this column: their calls are taken to have asked for nothing, so an
-- unknown among them waits for an operator rather than being failed
-- `no_evidence` or sent again (a re-send of a call that carried no key would
-- be new paid work).
ALTER TABLE attempts ADD COLUMN IF NOT EXISTS evidence text;

-- The look that leased an unknown last (a token per take): a take whose
-- commit took effect although its reply was lost finds its own lease again
-- on its next try, instead of leaving the unknown unlooked at for a lease.
ALTER TABLE attempts ADD COLUMN IF NOT EXISTS evidence_lease uuid;

-- When the kept-answer pass may try a kept answer again: NULL is now. A
-- settlement that meets a held row moves it on, so that answers it cannot
-- settle yet never stand in front of the ones it can; 'infinity' marks an
-- answer this version cannot read (an operator resolves its attempt).
ALTER TABLE attempts ADD COLUMN IF NOT EXISTS kept_next_at timestamptz;

DROP INDEX IF EXISTS attempts_kept_answer;
CREATE INDEX IF NOT EXISTS attempts_kept_due ON attempts (kept_next_at NULLS FIRST, id)
    WHERE answer IS NOT NULL AND status IN ('started', 'unknown');

-- An attempt that leaves `started`/`unknown` by any path (settled, closed
-- by a winner, resolved by an operator, cancelled) with an answer still kept
-- on it: the kept answer ends with it, in the same statement, and what it
-- cost is kept on the attempt (a paid answer's usage is never thrown away).
CREATE OR REPLACE FUNCTION attempts_answer_closed() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.usage := COALESCE(NEW.usage, NULLIF(OLD.answer -> 'usage', 'null'::jsonb));
    NEW.provider_request_id := COALESCE(NEW.provider_request_id, OLD.answer ->> 'request_id');
    NEW.answer := NULL;
    NEW.kept_next_at := NULL;
    RETURN NEW;
END $$;

DROP TRIGGER IF EXISTS attempts_answer_closed ON attempts;
CREATE TRIGGER attempts_answer_closed
    BEFORE UPDATE OF status ON attempts
    FOR EACH ROW
    WHEN (OLD.answer IS NOT NULL AND NEW.status NOT IN ('started', 'unknown'))
    EXECUTE FUNCTION attempts_answer_closed();

-- The spend ledger counts usage however it was written, a kept answer's
-- usage copied by the trigger above included (a column-specific trigger,
-- `UPDATE OF usage`, does not see a change a BEFORE trigger made).
DROP TRIGGER IF EXISTS attempts_spend ON attempts;
CREATE TRIGGER attempts_spend
    AFTER UPDATE ON attempts
    FOR EACH ROW WHEN (OLD.usage IS NULL AND NEW.usage IS NOT NULL)
    EXECUTE FUNCTION attempts_spend();
