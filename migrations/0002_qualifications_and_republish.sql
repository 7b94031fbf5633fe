-- Provider qualification results, one row per golden case per run, and the count
-- of times the reconciler republished a queued attempt whose message went missing.

CREATE TABLE provider_qualifications (
    id              bigserial   PRIMARY KEY,
    run_id          uuid        NOT NULL,
    provider        text        NOT NULL,
    operation       text        NOT NULL,
    contract_hash   text        NOT NULL,
    case_index      int         NOT NULL,
    passed          boolean     NOT NULL,
    detail          text        NOT NULL,
    prompt_tokens   int         NULL,
    tokens_estimated boolean    NOT NULL DEFAULT false,
    latency_ms      bigint      NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT provider_qualifications_case UNIQUE (run_id, case_index)
);

COMMENT ON COLUMN provider_qualifications.contract_hash IS
    'sha256 of the canonical {system, prompt, output_schema, model, temperature} the run was made against';

CREATE INDEX provider_qualifications_latest ON provider_qualifications (provider, operation, created_at DESC, id DESC);

ALTER TABLE attempts ADD COLUMN republished int NOT NULL DEFAULT 0;

COMMENT ON COLUMN attempts.republished IS
    'how often the reconciler republished this queued attempt because it never started';
