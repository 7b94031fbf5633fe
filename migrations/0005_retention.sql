-- Retention: the reconciler deletes ended jobs (with their attempts) once they
-- have been kept for their status's retention. This index finds them, oldest
-- ending first, without reading the live ones.
CREATE INDEX jobs_ended ON jobs (updated_at) WHERE status IN ('succeeded', 'failed', 'cancelled');
