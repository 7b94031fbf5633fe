-- Bearer tokens of the HTTP gateway (`onejob-producer serve`), one owner each.
-- Only a token's SHA-256 is kept: the token itself is printed once, by
-- `onejob tokens create`, and cannot be recovered from the database.

CREATE TABLE gateway_tokens (
    id            uuid        PRIMARY KEY,
    owner_id      text        NOT NULL,
    token_sha256  text        NOT NULL UNIQUE,
    created_at    timestamptz NOT NULL DEFAULT now(),
    revoked_at    timestamptz NULL
);

CREATE INDEX gateway_tokens_owner ON gateway_tokens (owner_id, created_at);
