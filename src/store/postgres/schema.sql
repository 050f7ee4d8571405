CREATE TABLE IF NOT EXISTS idempotency_records (
    key         text        PRIMARY KEY,
    fingerprint bytea       NOT NULL,
    token       bytea,
    record      bytea,
    expires_at  timestamptz NOT NULL
);
CREATE INDEX IF NOT EXISTS idempotency_records_expires_at_idx
    ON idempotency_records (expires_at);
-- The transactional claim, sent with BEGIN in one round trip: the live
-- record if there is one (replays need no lock); else the key's advisory
-- lock, taken without waiting; then the live record once more, in case one
-- was committed meanwhile (each query here takes a fresh snapshot).
CREATE OR REPLACE FUNCTION idempotency_records_claim(claim_key text, lock_key bigint)
RETURNS TABLE (state text, fingerprint bytea, record bytea, ms_left bigint)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
BEGIN
    FOR attempt IN 1..2 LOOP
        RETURN QUERY SELECT 'completed'::text, r.fingerprint, r.record,
            (extract(epoch FROM r.expires_at - now()) * 1000)::bigint
            FROM idempotency_records r WHERE r.key = claim_key AND r.expires_at > now();
        IF FOUND THEN
            RETURN;
        END IF;
        IF attempt = 1 AND NOT pg_try_advisory_xact_lock(lock_key) THEN
            RETURN QUERY SELECT 'in_flight'::text, NULL::bytea, NULL::bytea, 0::bigint;
            RETURN;
        END IF;
    END LOOP;
    RETURN QUERY SELECT 'acquired'::text, NULL::bytea, NULL::bytea, 0::bigint;
END
$$;
