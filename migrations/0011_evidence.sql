-- Evidence (contract section 7): an `unknown` attempt of a provider that keeps
-- evidence is looked up by the reconciler. `evidence_next_at` is when it may be
-- looked at next (set a lease ahead when a pod takes it, so that one pod looks
-- at a time, then the backoff), `evidence_looks` how many looks were taken,
-- `evidence_last_at` when the last one ended and `evidence_note` what it found,
-- for operators.
ALTER TABLE attempts ADD COLUMN IF NOT EXISTS evidence_next_at timestamptz;
ALTER TABLE attempts ADD COLUMN IF NOT EXISTS evidence_looks integer NOT NULL DEFAULT 0;
ALTER TABLE attempts ADD COLUMN IF NOT EXISTS evidence_last_at timestamptz;
ALTER TABLE attempts ADD COLUMN IF NOT EXISTS evidence_note text;

-- The attempts the evidence pass looks at are few: unknown ones, and those
-- discarded while unknown whose cost is not known yet. Found by a partial
-- index whose predicate the pass's own filter implies, so that the pass never
-- scans the attempts table.
CREATE INDEX IF NOT EXISTS attempts_evidence_pending ON attempts (id)
    WHERE status = 'unknown'
       OR (status = 'discarded' AND usage IS NULL AND evidence_next_at IS NOT NULL);
