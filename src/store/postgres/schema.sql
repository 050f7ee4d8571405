CREATE TABLE IF NOT EXISTS idempotency_records (
    key         text        PRIMARY KEY,
    fingerprint bytea       NOT NULL,
    token       bytea,
    record      bytea,
    expires_at  timestamptz NOT NULL
);
CREATE INDEX IF NOT EXISTS idempotency_records_expires_at_idx
    ON idempotency_records (expires_at);
