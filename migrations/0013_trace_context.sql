-- W3C trace context, so that one job can be followed across its hops in a
-- tracing system. `jobs.traceparent` is the intake's span for the job: the
-- parent that every attempt message and event of the job names. The outbox
-- row copies it from its job when it is written, and the publisher puts it in
-- the message's headers. Both are NULL for jobs admitted before this version.
-- Adding nullable columns without a default rewrites no table.
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS traceparent text NULL;
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS tracestate text NULL;
ALTER TABLE outbox ADD COLUMN IF NOT EXISTS traceparent text NULL;
ALTER TABLE outbox ADD COLUMN IF NOT EXISTS tracestate text NULL;

COMMENT ON COLUMN jobs.traceparent IS 'W3C traceparent of the intake span that admitted the job';
COMMENT ON COLUMN outbox.traceparent IS 'the job''s traceparent, sent in the message headers';
