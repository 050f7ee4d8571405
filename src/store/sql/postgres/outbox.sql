-- The outbox: one row per message a handler enqueued, committed with its
-- record and its effects. Times are Unix milliseconds by the server's clock.
-- state: 0 pending (a relay claims it: claimed_by, until next_at), 1 sent
-- (kept until the sweep, sent_at), 2 refused by the broker for good (kept,
-- last_error; requeued by an operator).
CREATE TABLE IF NOT EXISTS idempotency_outbox (
    seq          bigserial PRIMARY KEY,
    id           text   NOT NULL UNIQUE,
    destination  text   NOT NULL,
    ordering_key text,
    payload      bytea  NOT NULL,
    headers      text   NOT NULL,
    created_at   bigint NOT NULL,
    state        bigint NOT NULL DEFAULT 0,
    attempts     bigint NOT NULL DEFAULT 0,
    next_at      bigint NOT NULL DEFAULT 0,
    claimed_by   bytea,
    last_error   text,
    sent_at      bigint
);
-- What a claim walks, oldest first; a key's run behind its head.
CREATE INDEX IF NOT EXISTS idempotency_outbox_pending ON idempotency_outbox (seq) WHERE state = 0;
CREATE INDEX IF NOT EXISTS idempotency_outbox_ordering ON idempotency_outbox (ordering_key, seq) WHERE state = 0;
CREATE INDEX IF NOT EXISTS idempotency_outbox_claimed ON idempotency_outbox (claimed_by) WHERE claimed_by IS NOT NULL;
-- What the sweep deletes.
CREATE INDEX IF NOT EXISTS idempotency_outbox_sent ON idempotency_outbox (sent_at) WHERE state = 1;
