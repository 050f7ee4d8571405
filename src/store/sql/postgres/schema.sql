-- Keys are ASCII and only ever compared for equality: the "C" collation
-- compares bytes, cheaper than a locale's rules.
CREATE TABLE IF NOT EXISTS idempotency_records (
    key         text        COLLATE "C" PRIMARY KEY,
    fingerprint bytea       NOT NULL,
    token       bytea,
    record      bytea,
    expires_at  timestamptz NOT NULL
-- Room on each page for a row's completion, which writes the record into
-- the claim's row: kept on its page and off the indexes (a HOT update).
) WITH (fillfactor = 50);
-- For the cleaner, which deletes expired rows in batches. (Tables created
-- by version 0.1 have a BRIN index of this name: it keeps working.)
CREATE INDEX IF NOT EXISTS idempotency_records_expires_at_idx
    ON idempotency_records (expires_at);
