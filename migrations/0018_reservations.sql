-- Budgets are reservations (contract section 7, Owners): before an attempt's
-- call can start, the attempt reserves its prompt's tokens plus its
-- operation's `max_tokens`, and an owner's spend plus its reservations never
-- passes its `daily_tokens`. Only attempts of owners with a budget reserve.
--
-- A reservation lasts while its attempt may still cost something it has not
-- reported: it is replaced by the usage when the usage is recorded (the spend
-- trigger of 0014 counts it, in the same transaction), kept while the
-- attempt is `unknown` or `discarded` with stored evidence still looking for
-- what its call cost (its next look set; 0019), and released when the
-- attempt ends, or that look is over, with no usage
-- (a call never made, or one whose cost was never reported: those are
-- counted in `reservations_released`). Pruning an attempt removes it.
CREATE TABLE IF NOT EXISTS reservations (
    attempt_id   uuid        PRIMARY KEY REFERENCES attempts (id) ON DELETE CASCADE,
    owner_id     text        NOT NULL,
    tokens       bigint      NOT NULL CHECK (tokens >= 0),
    reserved_at  timestamptz NOT NULL DEFAULT now()
);

COMMENT ON TABLE reservations IS 'tokens an open attempt of an owner with a budget reserved (prompt + max_tokens); replaced by its usage, or released when it ends without one';

CREATE INDEX IF NOT EXISTS reservations_by_owner ON reservations (owner_id);

-- Reservations released without a settlement, by why: `no_call` (the attempt
-- ended before its call was made) or `no_usage` (a call was made and no usage
-- was reported for it). Striped by the writing session, as owner_spend is.
CREATE TABLE IF NOT EXISTS reservations_released (
    why       text     NOT NULL CHECK (why IN ('no_call', 'no_usage')),
    stripe    smallint NOT NULL,
    released  bigint   NOT NULL,
    PRIMARY KEY (why, stripe)
);

CREATE OR REPLACE FUNCTION attempts_reservation_ends() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.usage IS NOT NULL THEN
        DELETE FROM reservations WHERE attempt_id = NEW.id;
    ELSIF NEW.status = 'discarded' AND NEW.evidence = 'stored'
          AND NEW.evidence_next_at IS NOT NULL THEN
        NULL;
    ELSIF NEW.status IN ('succeeded', 'failed', 'discarded', 'cancelled') THEN
        DELETE FROM reservations WHERE attempt_id = NEW.id;
        IF FOUND THEN
            INSERT INTO reservations_released (why, stripe, released)
            VALUES (CASE WHEN NEW.started_at IS NULL THEN 'no_call' ELSE 'no_usage' END,
                    pg_backend_pid() % 4, 1)
            ON CONFLICT (why, stripe)
            DO UPDATE SET released = reservations_released.released + 1;
        END IF;
    END IF;
    RETURN NULL;
END $$;

DROP TRIGGER IF EXISTS attempts_reservation_ends ON attempts;
CREATE TRIGGER attempts_reservation_ends
    AFTER UPDATE OF status, usage, evidence_next_at ON attempts
    FOR EACH ROW
    WHEN ((OLD.usage IS NULL AND NEW.usage IS NOT NULL)
          OR (OLD.status IN ('queued', 'started', 'unknown')
              AND NEW.status IN ('succeeded', 'failed', 'discarded', 'cancelled'))
          OR (NEW.status = 'discarded' AND OLD.evidence_next_at IS NOT NULL
              AND NEW.evidence_next_at IS NULL))
    EXECUTE FUNCTION attempts_reservation_ends();

-- The lock that makes one owner's reservations take turns: a reservation
-- reads the owner's spend and reservations after taking it (in a statement
-- of its own, so that its snapshot sees every reservation committed before),
-- and two reservations never both see the same room.
CREATE OR REPLACE FUNCTION owner_budget_lock(owner text) RETURNS void
LANGUAGE sql AS $$
    SELECT pg_advisory_xact_lock(hashtextextended('onejob.budget:' || owner, 0))
$$;
