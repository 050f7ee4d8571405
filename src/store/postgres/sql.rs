//! The statements, with the table name in place. Plain SQL that PostgreSQL
//! and the PostgreSQL-compatible engines document: `INSERT … ON CONFLICT`,
//! `RETURNING`, CTEs, a plain index — no functions, no advisory locks.

use std::time::Duration;

use sha2::{Digest, Sha256};

use crate::{
    fingerprint::{Fingerprint, push_hex},
    store::{StoreError, sql::checked_table},
};

/// The schema, for the default table name `idempotency_records`; idempotent.
pub const SCHEMA: &str = include_str!("schema.sql");

pub(super) const DEFAULT_TABLE: &str = "idempotency_records";

pub(super) struct Sql {
    pub(super) table: String,
    pub(super) schema: String,
    pub(super) claim: String,
    pub(super) extend: String,
    pub(super) complete: String,
    pub(super) release: String,
    pub(super) delete_expired: String,
    pub(super) take_over: String,
    pub(super) inspect: String,
    pub(super) forget: String,
    /// The prefix of this table's prepared statements' names.
    pub(super) prepared: String,
}

impl Sql {
    pub(super) fn new(table: &str) -> Result<Self, StoreError> {
        checked_table(table, "PostgresStore")?;
        let t = |sql: &str| sql.replace("{t}", table);
        Ok(Self {
            table: table.to_owned(),
            schema: SCHEMA.replace(DEFAULT_TABLE, table),
            claim: t(CLAIM),
            extend: t(EXTEND),
            complete: t(COMPLETE),
            release: t(RELEASE),
            delete_expired: t(DELETE_EXPIRED),
            take_over: t(TAKE_OVER),
            inspect: t(INSPECT),
            forget: t(FORGET),
            prepared: prepared_names(table),
        })
    }

    /// The transactional claim, inside the request's transaction. First the
    /// transaction's bounds (`idle_in_transaction_session_timeout` and
    /// `statement_timeout`, for this transaction only) and the claim's short
    /// `lock_timeout` (`wait`), set once the table's lock is held — so that
    /// DDL holding the table (a migration) is waited for under the command
    /// timeout, an outage (`503`), not taken for a duplicate in flight. Then
    /// the claim's row inserted, or else the row that holds the key: a row
    /// another transaction inserted and has not committed makes the insert
    /// wait for that transaction, for at most `wait`, then fail — the
    /// in-flight answer. Then `lock_timeout` back to the session's
    /// (`lock_timeout`), for the handler's statements. Sent in the simple
    /// protocol (it travels with `BEGIN`), so the values are literals, to
    /// statements prepared once per connection ([`prepare`](Self::prepare)):
    /// planned once, not on every request.
    pub(super) fn tx_claim(
        &self,
        key: &str,
        fingerprint: &Fingerprint,
        wait: Duration,
        bound: Duration,
        lock_timeout: &str,
    ) -> String {
        let mut sql = String::with_capacity(256);
        sql.push_str(&format!(
            "EXECUTE {names}_begin('{bound}', '{wait}'); EXECUTE {names}_claim({key}, ",
            names = self.prepared,
            bound = bound.as_millis(),
            wait = wait.as_millis().max(1),
            key = text_literal(key),
        ));
        push_bytea_literal(&mut sql, fingerprint.as_bytes());
        sql.push_str(&format!(
            ", {}); EXECUTE {}_after({})",
            bound.as_millis(),
            self.prepared,
            text_literal(lock_timeout)
        ));
        sql
    }

    /// The statements [`tx_claim`](Self::tx_claim) and
    /// [`tx_complete`](Self::tx_complete) execute, prepared on a connection
    /// the first time it serves a claim. The settings are made in a `WHERE`
    /// that is never true: only the claim answers with a row.
    pub(super) fn prepare(&self) -> String {
        let (names, t) = (&self.prepared, &self.table);
        format!(
            "PREPARE {names}_begin (text, text) AS \
             SELECT 1 FROM (SELECT 1) AS one LEFT JOIN (SELECT 1 FROM {t} LIMIT 0) AS locked ON true \
             WHERE (set_config('idle_in_transaction_session_timeout', $1, true) \
             || set_config('statement_timeout', $1, true) || set_config('lock_timeout', $2, true)) IS NULL; \
             PREPARE {names}_after (text) AS SELECT 1 WHERE set_config('lock_timeout', $1, true) IS NULL; \
             PREPARE {names}_claim (text, bytea, bigint) AS \
             WITH claimed AS (INSERT INTO {t} (key, fingerprint, record, expires_at) \
             VALUES ($1, $2, NULL, now() + $3 * interval '1 millisecond') ON CONFLICT (key) DO NOTHING RETURNING 1) \
             SELECT true AS acquired, NULL::bytea AS fingerprint, NULL::bytea AS record, 0::bigint AS ms_left FROM claimed \
             UNION ALL SELECT false, fingerprint, record, (extract(epoch FROM expires_at - now()) * 1000)::bigint \
             FROM {t} WHERE key = $1 AND NOT EXISTS (SELECT 1 FROM claimed); \
             PREPARE {names}_complete (text, bytea, bigint) AS \
             WITH done AS (UPDATE {t} SET record = $2, \
             expires_at = clock_timestamp() + $3 * interval '1 millisecond' WHERE key = $1 RETURNING 1) \
             SELECT 1 / (SELECT count(*)::int FROM done)"
        )
    }

    /// Whether a transaction holds `key` in flight: a claim of it in a
    /// transaction of its own, rolled back at once, that meets the holder's
    /// uncommitted row fails its `lock_timeout`. One round trip.
    pub(super) fn tx_probe(&self, key: &str) -> String {
        format!(
            "BEGIN; SET LOCAL lock_timeout = 50; INSERT INTO {} (key, fingerprint, record, expires_at) \
             VALUES ({}, '\\x00', NULL, now()) ON CONFLICT (key) DO NOTHING; ROLLBACK",
            self.table,
            text_literal(key)
        )
    }

    /// The transactional completion, sent with `COMMIT` in one round trip:
    /// the record written into the claim's row, its retention counted from
    /// now (`clock_timestamp()`, the end of the handler, not the
    /// transaction's start). If the row is gone, the prepared statement's
    /// division by zero fails, and the `COMMIT` after it never runs.
    pub(super) fn tx_complete(&self, key: &str, record: &[u8], retention_ms: i64) -> String {
        let mut sql = String::with_capacity(2 * record.len() + 128);
        sql.push_str(&format!(
            "EXECUTE {}_complete({}, ",
            self.prepared,
            text_literal(key)
        ));
        push_bytea_literal(&mut sql, record);
        sql.push_str(&format!(", {retention_ms}); COMMIT"));
        sql
    }
}

/// The prefix of a table's prepared statements: one set per table, so two
/// stores on one connection's database never share them.
fn prepared_names(table: &str) -> String {
    let digest = Sha256::digest(table.as_bytes());
    let mut names = String::from("tower_idempotency_");
    push_hex(&mut names, &digest[..6]);
    names
}

/// `s` as an escape string literal: visible ASCII keys, `\` and `'` escaped.
fn text_literal(s: &str) -> String {
    format!("E'{}'", s.replace('\\', "\\\\").replace('\'', "\\'"))
}

/// Appends `bytes` as a `bytea` literal in hex, `E'\\x…'`.
fn push_bytea_literal(out: &mut String, bytes: &[u8]) {
    out.push_str("E'\\\\x");
    push_hex(out, bytes);
    out.push('\'');
}

/// Plain claim, one statement: the in-flight row inserted (or an expired
/// record taken over), or else the live record. $1 key, $2 fingerprint,
/// $3 token, $4 lease ms.
const CLAIM: &str = concat!(
    "WITH claimed AS (INSERT INTO {t} AS r (key, fingerprint, token, record, expires_at) \
     VALUES ($1, $2, $3, NULL, now() + $4 * interval '1 millisecond') \
     ON CONFLICT (key) DO UPDATE SET fingerprint = EXCLUDED.fingerprint, \
     token = EXCLUDED.token, record = NULL, expires_at = EXCLUDED.expires_at \
     WHERE r.expires_at <= now() RETURNING 1",
    ") SELECT true AS acquired, NULL::bytea AS fingerprint, NULL::bytea AS record, 0::bigint AS ms_left FROM claimed \
     UNION ALL SELECT false, fingerprint, record, \
     (extract(epoch FROM expires_at - now()) * 1000)::bigint \
     FROM {t} WHERE key = $1 AND expires_at > now() AND NOT EXISTS (SELECT 1 FROM claimed)"
);

const EXTEND: &str = "UPDATE {t} SET expires_at = now() + $3 * interval '1 millisecond' \
     WHERE key = $1 AND token = $2 AND expires_at > now()";

/// Fenced by the token; a repeat of this very completion (its reply lost)
/// also counts as stored.
const COMPLETE: &str = "UPDATE {t} SET token = NULL, record = $3, expires_at = now() + $4 * interval '1 millisecond' \
     WHERE key = $1 AND ((token = $2 AND expires_at > now()) OR record = $3)";

const RELEASE: &str = "DELETE FROM {t} WHERE key = $1 AND token = $2";

const DELETE_EXPIRED: &str = "DELETE FROM {t} WHERE key IN (SELECT key FROM {t} WHERE expires_at < now() \
     LIMIT $1 FOR UPDATE SKIP LOCKED)";

/// Inside a request's transaction: an expired record replaced by this
/// claim's row, which the transaction then holds. $1 key, $2 fingerprint,
/// $3 bound ms.
const TAKE_OVER: &str = "UPDATE {t} SET fingerprint = $2, token = NULL, record = NULL, \
     expires_at = now() + $3 * interval '1 millisecond' WHERE key = $1 AND expires_at <= now()";

/// A live row's record (none: a plain claim in flight) and milliseconds
/// left. $1 key.
const INSPECT: &str = "SELECT record, (extract(epoch FROM expires_at - now()) * 1000)::bigint AS ms_left \
     FROM {t} WHERE key = $1 AND expires_at > now()";

/// Deletes a live completed record, or (with $2) a claim in flight too.
/// $1 key, $2 force.
const FORGET: &str = "DELETE FROM {t} WHERE key = $1 AND expires_at > now() \
     AND (record IS NOT NULL OR $2) RETURNING record IS NOT NULL AS completed";
