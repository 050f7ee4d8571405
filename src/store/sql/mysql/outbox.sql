-- The outbox: one row per message a handler enqueued, committed with its
-- record and its effects. Times are Unix milliseconds by the server's clock.
-- state: 0 pending (a relay claims it: claimed_by, until next_at), 1 sent
-- (kept until the sweep, sent_at), 2 refused by the broker for good (kept,
-- last_error; requeued by an operator). Text compares as bytes.
CREATE TABLE IF NOT EXISTS idempotency_outbox (
    seq          BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
    id           VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    destination  VARCHAR(1024) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    ordering_key VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NULL,
    payload      LONGBLOB NOT NULL,
    headers      TEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    created_at   BIGINT NOT NULL,
    state        BIGINT NOT NULL DEFAULT 0,
    attempts     BIGINT NOT NULL DEFAULT 0,
    next_at      BIGINT NOT NULL DEFAULT 0,
    claimed_by   VARBINARY(16) NULL,
    last_error   TEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NULL,
    sent_at      BIGINT NULL,
    UNIQUE KEY idempotency_outbox_id (id),
    -- What a claim walks, oldest first; a key's run behind its head.
    KEY idempotency_outbox_pending (state, seq),
    KEY idempotency_outbox_ordering (ordering_key, state, seq),
    KEY idempotency_outbox_claimed (claimed_by),
    -- What the sweep deletes.
    KEY idempotency_outbox_sent (state, sent_at)
) ENGINE = InnoDB;
