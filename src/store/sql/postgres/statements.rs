//! PostgreSQL's statements, with the table name in place: plain SQL that
//! PostgreSQL and the PostgreSQL-compatible engines document — `INSERT …
//! ON CONFLICT`, `RETURNING`, CTEs, a plain index; no functions, no
//! advisory locks. Times are the server's (`now()`).

use std::time::Duration;

use sha2::{Digest, Sha256};

use crate::{
    fingerprint::{Fingerprint, push_hex},
    store::sql::{
        dialect::{
            Param::{self, *},
            Statements, Stmt,
        },
        tx_engine::Expiry,
    },
};

/// A row's milliseconds left.
const MS_LEFT: &str = "(extract(epoch FROM expires_at - now()) * 1000)::bigint";

pub(super) fn statements(table: &str) -> Statements {
    let s = |sql: &str, params: &'static [Param]| {
        Stmt::new(table, &sql.replace("{ms_left}", MS_LEFT), params)
    };
    Statements {
        table: table.to_owned(),
        schema: super::SCHEMA.replace("idempotency_records", table),
        exists: s(
            "SELECT 0::bigint, ''::bytea, NULL::bytea, NULL::bytea, 0::bigint FROM {t} LIMIT 0",
            &[],
        ),
        find: s(
            "SELECT 0::bigint, fingerprint, token, record, {ms_left} FROM {t} WHERE key = $1",
            &[Key],
        ),
        // One statement: the in-flight row inserted (or an expired record
        // taken over), or else the live row. Its read half sees the
        // statement's snapshot: a row committed just after it began, which
        // made the insert conflict, is invisible to it — then nothing comes
        // back, and the claim asks again.
        claim: s(
            "WITH claimed AS (INSERT INTO {t} AS r (key, fingerprint, token, record, expires_at) \
             VALUES ($1, $2, $3, NULL, now() + $4 * interval '1 millisecond') \
             ON CONFLICT (key) DO UPDATE SET fingerprint = EXCLUDED.fingerprint, \
             token = EXCLUDED.token, record = NULL, expires_at = EXCLUDED.expires_at \
             WHERE r.expires_at <= now() RETURNING 1) \
             SELECT 1::bigint, ''::bytea, NULL::bytea, NULL::bytea, 0::bigint FROM claimed \
             UNION ALL SELECT 0, fingerprint, token, record, {ms_left} \
             FROM {t} WHERE key = $1 AND expires_at > now() AND NOT EXISTS (SELECT 1 FROM claimed)",
            &[Key, Fingerprint, Token, Ms],
        ),
        extend: s(
            "UPDATE {t} SET expires_at = now() + $3 * interval '1 millisecond' \
             WHERE key = $1 AND token = $2 AND expires_at > now()",
            &[Key, Token, Ms],
        ),
        // Fenced by the token; a repeat of this very completion (its reply
        // lost) also counts as stored.
        complete: s(
            "UPDATE {t} SET token = NULL, record = $3, expires_at = now() + $4 * interval '1 millisecond' \
             WHERE key = $1 AND ((token = $2 AND expires_at > now()) OR record = $3)",
            &[Key, Token, Record, Ms],
        ),
        release: s(
            "DELETE FROM {t} WHERE key = $1 AND token = $2",
            &[Key, Token],
        ),
        forget_completed: s(
            "DELETE FROM {t} WHERE key = $1 AND expires_at > now() AND record IS NOT NULL",
            &[Key],
        ),
        delete_claim: s("DELETE FROM {t} WHERE key = $1", &[Key]),
        forget_in_flight: s(
            "DELETE FROM {t} WHERE key = $1 AND expires_at > now() AND record IS NULL",
            &[Key],
        ),
        delete_expired: s(
            "DELETE FROM {t} WHERE key IN (SELECT key FROM {t} WHERE expires_at < now() \
             LIMIT $1 FOR UPDATE SKIP LOCKED)",
            &[Batch],
        ),
        counts: s(
            "SELECT (CASE WHEN expires_at <= now() THEN 2 WHEN record IS NULL THEN 1 ELSE 0 END)::bigint, \
             count(*)::bigint FROM {t} GROUP BY 1",
            &[],
        ),
    }
}

/// For the start-up check: a claim as a transaction makes it, the row held
/// a minute.
pub(super) fn check_claim(table: &str) -> Stmt {
    Stmt::new(
        table,
        "INSERT INTO {t} (key, fingerprint, record, expires_at) \
         VALUES ($1, '\\x00', NULL, now() + interval '1 minute') ON CONFLICT (key) DO NOTHING \
         RETURNING 1::bigint, ''::bytea, NULL::bytea, NULL::bytea, 0::bigint",
        &[Key],
    )
}

/// The statements of the transactional store, which travel in the simple
/// protocol (with `BEGIN` and `COMMIT`), so their values are literals, to
/// statements prepared once per connection.
pub(super) struct TxStatements {
    pub(super) table: String,
    /// The prefix of this table's prepared statements' names: one set per
    /// table, so two stores on one connection's database never share them.
    prepared: String,
    /// An expired record replaced by this claim's row, which the
    /// transaction then holds, `lock_timeout` put back for the handler. $1
    /// key, $2 fingerprint, $3 lifetime ms, $4 the session's `lock_timeout`.
    pub(super) take_over: String,
}

impl TxStatements {
    pub(super) fn new(table: &str) -> Self {
        let digest = Sha256::digest(table.as_bytes());
        let mut prepared = String::from("tower_idempotency_");
        push_hex(&mut prepared, &digest[..6]);
        Self {
            table: table.to_owned(),
            prepared,
            take_over: format!(
                "UPDATE {table} SET fingerprint = $2, token = NULL, record = NULL, \
                 expires_at = now() + $3 * interval '1 millisecond' WHERE key = $1 AND expires_at <= now() \
                 RETURNING set_config('lock_timeout', $4, true)"
            ),
        }
    }

    /// The transactional claim, the first statement of the request's
    /// transaction: the claim's row inserted, answering with it, or, when
    /// the insert did nothing, the row that holds the key (read only then,
    /// so a first execution pays for the insert alone; a row committed
    /// after the statement's snapshot is invisible to it, and nothing comes
    /// back: the claim asks again). A row another
    /// transaction inserted and has not committed makes the insert wait for
    /// that transaction, for at most `wait` (`lock_timeout`, set by the
    /// insert's own source row, once the statement holds the table's lock
    /// — so that DDL holding the table, a migration, is waited for under
    /// the command timeout, an outage, not taken for a duplicate in
    /// flight), then fail: the in-flight answer. The claimed row puts
    /// `lock_timeout` back to the session's (`lock_timeout`), for the
    /// handler's statements. The row is written to expire after
    /// `lifetime_ms` (see `SqlTxStore::claim_lifetime_ms`).
    /// Sent in the simple protocol (it travels with `BEGIN`), so the values
    /// are literals, to a statement prepared once per connection
    /// ([`prepare`](Self::prepare)): planned once, not on every request.
    pub(super) fn claim(
        &self,
        key: &str,
        fingerprint: &Fingerprint,
        wait: Duration,
        lifetime_ms: i64,
        lock_timeout: &str,
    ) -> String {
        let mut sql = String::with_capacity(256);
        sql.push_str(&format!(
            "EXECUTE {}_claim({}, ",
            self.prepared,
            text_literal(key)
        ));
        push_bytea_literal(&mut sql, fingerprint.as_bytes());
        sql.push_str(&format!(
            ", {lifetime_ms}, '{}', {})",
            wait.as_millis().max(1),
            text_literal(lock_timeout),
        ));
        sql
    }

    /// What a connection does before its first claim, in a round trip of
    /// its own (a setting made in the transaction that follows would be
    /// undone with it): the bounds of every request transaction it will
    /// run, `idle_in_transaction_session_timeout` and `statement_timeout`,
    /// set for the session — the database enforces them whatever the
    /// process does.
    pub(super) fn session(&self, bound: Duration) -> String {
        let bound = bound.as_millis();
        format!(
            "ROLLBACK; SET idle_in_transaction_session_timeout = '{bound}'; SET statement_timeout = '{bound}'"
        )
    }

    /// The statements [`claim`](Self::claim) and [`complete`](Self::complete)
    /// execute, prepared on a connection the first time it serves a claim.
    pub(super) fn prepare(&self) -> String {
        let (names, t) = (&self.prepared, &self.table);
        format!(
            "PREPARE {names}_claim (text, bytea, bigint, text, text) AS \
             WITH claimed AS (INSERT INTO {t} (key, fingerprint, record, expires_at) \
             SELECT $1, $2, NULL, now() + $3 * interval '1 millisecond' \
             FROM (SELECT set_config('lock_timeout', $4, true)) AS wait \
             ON CONFLICT (key) DO NOTHING \
             RETURNING set_config('lock_timeout', $5, true)) \
             SELECT 1::bigint, ''::bytea, NULL::bytea, NULL::bytea, 0::bigint FROM claimed \
             UNION ALL SELECT 0, fingerprint, token, record, {MS_LEFT} FROM {t} \
             WHERE key = $1 AND NOT EXISTS (SELECT 1 FROM claimed); \
             PREPARE {names}_complete (text, bytea, bigint) AS \
             WITH done AS (UPDATE {t} SET record = $2, \
             expires_at = COALESCE(clock_timestamp() + $3 * interval '1 millisecond', expires_at) \
             WHERE key = $1 RETURNING 1) \
             SELECT 1 / (SELECT count(*)::int FROM done)"
        )
    }

    /// Whether a transaction holds `key` in flight: a claim of it in a
    /// transaction of its own, rolled back at once, that meets the holder's
    /// uncommitted row fails its `lock_timeout`. One round trip.
    pub(super) fn probe(&self, key: &str) -> String {
        format!(
            "BEGIN; SET LOCAL lock_timeout = 50; INSERT INTO {} (key, fingerprint, record, expires_at) \
             VALUES ({}, '\\x00', NULL, now()) ON CONFLICT (key) DO NOTHING; ROLLBACK",
            self.table,
            text_literal(key)
        )
    }

    /// The transactional completion, sent with `COMMIT` in one round trip:
    /// the record written into the claim's row. Its expiry, written with the
    /// claim, is kept (`NULL`), so that the common update changes no
    /// indexed column: PostgreSQL keeps it on its page (a HOT update) and
    /// touches no index; or written as the retention from now
    /// (`clock_timestamp()`, the end of the handler, not the transaction's
    /// start). If the row is gone, the prepared statement's division by
    /// zero fails, and the `COMMIT` after it never runs.
    pub(super) fn complete(&self, key: &str, record: &[u8], expiry: Expiry) -> String {
        self.record(key, record, expiry, "COMMIT")
    }

    /// The record written into `key`'s row as [`complete`](Self::complete)
    /// writes it, then `then`, in one round trip.
    pub(super) fn record(&self, key: &str, record: &[u8], expiry: Expiry, then: &str) -> String {
        let mut sql = String::with_capacity(2 * record.len() + 128);
        sql.push_str(&format!(
            "EXECUTE {}_complete({}, ",
            self.prepared,
            text_literal(key)
        ));
        push_bytea_literal(&mut sql, record);
        match expiry {
            Expiry::Kept => sql.push_str(", NULL); "),
            Expiry::Retention(ms) => sql.push_str(&format!(", {ms}); ")),
        }
        sql.push_str(then);
        sql
    }
}

/// `s` as an escape string literal: visible ASCII keys, `\` and `'` escaped.
pub(super) fn text_literal(s: &str) -> String {
    format!("E'{}'", s.replace('\\', "\\\\").replace('\'', "\\'"))
}

/// Appends `bytes` as a `bytea` literal in hex, `E'\\x…'`.
pub(super) fn push_bytea_literal(out: &mut String, bytes: &[u8]) {
    out.push_str("E'\\\\x");
    push_hex(out, bytes);
    out.push('\'');
}
