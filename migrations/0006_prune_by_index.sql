-- Pruning deletes a succeeded job's winning attempt, and the foreign key from
-- jobs.completed_by then looks for a job that names that attempt. Without this
-- index each such look reads the whole jobs table: a batch of 1,000 jobs ran
-- for minutes on a million. IF NOT EXISTS: on a large table, build it first by
-- hand with CREATE INDEX CONCURRENTLY under this name, and the migration takes
-- no lock.
CREATE INDEX IF NOT EXISTS jobs_completed_by ON jobs (completed_by) WHERE completed_by IS NOT NULL;
