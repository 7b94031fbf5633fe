-- What qualification found of a provider's evidence claim (contract section 7,
-- Evidence): configuring `evidence` is the operator's statement that the
-- provider keeps it; `providers qualify` tests the statement. While the latest
-- check found it false, the evidence pass leaves that provider's unknowns to an
-- operator.
CREATE TABLE IF NOT EXISTS evidence_claims (
    id          uuid        PRIMARY KEY,
    provider    text        NOT NULL,
    kind        text        NOT NULL,
    held        boolean     NOT NULL,
    detail      text        NOT NULL DEFAULT '',
    checked_at  timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX IF NOT EXISTS evidence_claims_latest ON evidence_claims (provider, checked_at DESC);
