-- The console's job list filtered by provider pages from the provider's
-- attempts, newest job first: a provider that few jobs used is found without
-- reading every job. On a large table, build it by hand first (the migration
-- then does nothing):
--   CREATE INDEX CONCURRENTLY IF NOT EXISTS attempts_provider_job ON attempts (provider, job_id);
CREATE INDEX IF NOT EXISTS attempts_provider_job ON attempts (provider, job_id);
