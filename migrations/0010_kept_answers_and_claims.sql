-- An answer the provider gave that could not be settled yet (its job row was
-- held under someone else's lock): kept on the attempt, so that a worker that
-- stops meanwhile does not lose it. The reconciler settles kept answers, and
-- the vanished-worker sweep never turns an attempt with one into `unknown`.
ALTER TABLE attempts ADD COLUMN IF NOT EXISTS answer jsonb;

-- The claim that moved an attempt `queued → started`: one token per claim
-- statement, so that a claim whose commit reply was lost, run again, finds the
-- attempts it did start as its own instead of as someone else's.
ALTER TABLE attempts ADD COLUMN IF NOT EXISTS claim uuid;

-- Kept answers are few and short-lived: found by a partial index.
CREATE INDEX IF NOT EXISTS attempts_kept_answer ON attempts (id)
    WHERE answer IS NOT NULL AND status IN ('started', 'unknown');
