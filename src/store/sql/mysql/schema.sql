-- Keys are ASCII and only ever compared for equality: VARBINARY compares
-- bytes (a case-insensitive collation would replay one key's answer to
-- another). InnoDB: the record must roll back with the handler's writes.
-- Times are UTC (`UTC_TIMESTAMP(3)`).
CREATE TABLE IF NOT EXISTS idempotency_records (
    `key`       VARBINARY(320) NOT NULL PRIMARY KEY,
    fingerprint VARBINARY(64)  NOT NULL,
    token       VARBINARY(16),
    record      LONGBLOB,
    expires_at  DATETIME(3)    NOT NULL,
    -- For the cleaner, which deletes expired rows in batches.
    INDEX idempotency_records_expires_at_idx (expires_at)
) ENGINE = InnoDB;
