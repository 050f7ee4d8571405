-- Times are Unix milliseconds, by the clock of the process that wrote them:
-- SQLite is embedded, so every writer of the file shares the host's clock.
CREATE TABLE IF NOT EXISTS idempotency_records (
    key         TEXT    NOT NULL PRIMARY KEY,
    fingerprint BLOB    NOT NULL,
    token       BLOB,
    record      BLOB,
    expires_at  INTEGER NOT NULL
);
-- For the cleaner, which deletes expired rows in batches.
CREATE INDEX IF NOT EXISTS idempotency_records_expires_at_idx
    ON idempotency_records (expires_at);
