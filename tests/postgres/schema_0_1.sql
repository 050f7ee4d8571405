-- The schema version 0.1 created (table, BRIN index, two functions): a
-- table it made must keep working.
-- Keys are ASCII and only ever compared for equality: the "C" collation
-- compares bytes, cheaper than a locale's rules.
CREATE TABLE IF NOT EXISTS idempotency_records (
    key         text        COLLATE "C" PRIMARY KEY,
    fingerprint bytea       NOT NULL,
    token       bytea,
    record      bytea,
    expires_at  timestamptz NOT NULL
);
-- For the cleaner. Rows arrive roughly in expiry order, so a BRIN index
-- finds the expired ones at a fraction of a B-tree's cost per insert.
CREATE INDEX IF NOT EXISTS idempotency_records_expires_at_idx
    ON idempotency_records USING brin (expires_at);
-- The transactional claim, sent with BEGIN in one round trip: the live
-- record if there is one (replays need no lock); else the key's advisory
-- lock, taken without waiting; then the live record once more, in case one
-- was committed meanwhile (each query here takes a fresh snapshot). The
-- answer is one bytea, a scalar rather than a row set (cheaper to plan and
-- to return): 'a' (acquired: the lock is held), 'i' (in flight elsewhere),
-- or 'c' / 'C' (found; 'C' with the lock held) followed by milliseconds
-- left (int8), the fingerprint's length (int4), the fingerprint and the
-- record. `_v2`: the version before returned a table under the name
-- idempotency_records_claim; instances still running it keep using it
-- during an upgrade, and it can be dropped once none does.
CREATE OR REPLACE FUNCTION idempotency_records_claim_v2(claim_key text, lock_key bigint)
RETURNS bytea
LANGUAGE plpgsql AS $$
DECLARE
    found_fingerprint bytea;
    found_record bytea;
    found_ms_left bigint;
BEGIN
    FOR attempt IN 1..2 LOOP
        SELECT r.fingerprint, r.record, (extract(epoch FROM r.expires_at - now()) * 1000)::bigint
            INTO found_fingerprint, found_record, found_ms_left
            FROM idempotency_records r WHERE r.key = claim_key AND r.expires_at > now();
        IF FOUND THEN
            RETURN (CASE attempt WHEN 1 THEN 'c' ELSE 'C' END)::bytea || int8send(found_ms_left)
                || int4send(length(found_fingerprint)) || found_fingerprint
                || coalesce(found_record, ''::bytea);
        END IF;
        IF attempt = 1 AND NOT pg_try_advisory_xact_lock(lock_key) THEN
            RETURN 'i'::bytea;
        END IF;
    END LOOP;
    RETURN 'a'::bytea;
END
$$;
-- The transactional completion, sent with COMMIT in one round trip: the
-- record written under the key's lock (an expired one replaced). A live
-- record in its place raises SQLSTATE IR001, so the COMMIT after it never
-- runs and the transaction rolls back.
CREATE OR REPLACE FUNCTION idempotency_records_complete(claim_key text, claim_fingerprint bytea, completed bytea, retention_ms bigint)
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO idempotency_records AS r (key, fingerprint, token, record, expires_at)
    VALUES (claim_key, claim_fingerprint, NULL, completed, now() + retention_ms * interval '1 millisecond')
    ON CONFLICT (key) DO UPDATE SET fingerprint = EXCLUDED.fingerprint, token = NULL,
        record = EXCLUDED.record, expires_at = EXCLUDED.expires_at
        WHERE r.expires_at <= now();
    IF NOT FOUND THEN
        RAISE EXCEPTION 'a live idempotency record already holds key %', claim_key
            USING ERRCODE = 'IR001';
    END IF;
END
$$;
