-- Operators and what they did.
--
-- `operator_tokens`: the console's sign-in tokens (`onejob tokens create
-- --operator NAME`), one operator each, kept apart from the gateway's tenant
-- tokens: another table and another prefix (`ojo_`, where a tenant's is `ojt_`),
-- so neither kind is ever looked up where the other is expected. As with
-- gateway tokens, only the SHA-256 is kept.
--
-- `operator_sessions`: the console's signed-in sessions. The cookie holds a
-- random session id; only its SHA-256 is kept, with the form token (CSRF) of
-- the session. A session ends at `expires_at`, at sign-out, or when its
-- operator token is revoked.
--
-- `audit`: one row per operator action (resolving an attempt, cancelling a job,
-- replaying or purging dead letters, qualifying a provider), written in the
-- action's own transaction where the action is a database write, so an action
-- and its record commit together. Who (`actor`: `operator:NAME` from the
-- console, `cli:USER` from the CLI), what (`action`, and what it touched), when,
-- and why (`reason`, as the operator gave it). No foreign key to jobs: the
-- record outlives the job's retention.

CREATE TABLE operator_tokens (
    id            uuid        PRIMARY KEY,
    operator      text        NOT NULL CHECK (operator <> ''),
    token_sha256  text        NOT NULL UNIQUE,
    created_at    timestamptz NOT NULL DEFAULT now(),
    revoked_at    timestamptz NULL
);

CREATE TABLE operator_sessions (
    id_sha256   text        PRIMARY KEY,
    token_id    uuid        NOT NULL REFERENCES operator_tokens (id) ON DELETE CASCADE,
    csrf        text        NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz NOT NULL
);

CREATE INDEX operator_sessions_expiry ON operator_sessions (expires_at);

CREATE TABLE audit (
    id          uuid        PRIMARY KEY,
    at          timestamptz NOT NULL DEFAULT now(),
    actor       text        NOT NULL,
    action      text        NOT NULL,
    job_id      uuid        NULL,
    attempt_id  uuid        NULL,
    target      text        NULL,
    reason      text        NOT NULL DEFAULT '',
    detail      jsonb       NOT NULL DEFAULT '{}'
);

CREATE INDEX audit_job ON audit (job_id, at) WHERE job_id IS NOT NULL;
CREATE INDEX audit_at ON audit (at);

-- The console's job list pages by id (ids are UUIDv7: time-ordered), newest
-- first, filtered by status: this index keeps a page of a rare status fast on
-- millions of jobs. IF NOT EXISTS: on a large table, build it first by hand
-- with CREATE INDEX CONCURRENTLY under this name, and the migration takes no
-- lock.
CREATE INDEX IF NOT EXISTS jobs_status_id ON jobs (status, id);
