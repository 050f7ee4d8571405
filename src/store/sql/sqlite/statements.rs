//! SQLite's statements: `INSERT … ON CONFLICT`, `RETURNING` and a plain
//! index, as SQLite documents them. Times are Unix milliseconds by the
//! clock of the process that writes them (`Param::Now`): SQLite is
//! embedded, so every writer of the file shares the host's clock.

use crate::store::sql::dialect::{
    Param::{self, *},
    Statements, Stmt,
};

pub(super) fn statements(table: &str) -> Statements {
    let s = |sql: &str, params: &'static [Param]| Stmt::new(table, sql, params);
    Statements {
        table: table.to_owned(),
        schema: super::SCHEMA.replace("idempotency_records", table),
        exists: s("SELECT 0, x'', NULL, NULL, 0 FROM {t} LIMIT 0", &[]),
        find: s(
            "SELECT 0, fingerprint, token, record, expires_at - ?2 FROM {t} WHERE key = ?1",
            &[Key, Now],
        ),
        // Its row count says whether it claimed: an insert, or an expired
        // row taken over, count 1; a live row, 0.
        claim: s(
            "INSERT INTO {t} AS r (key, fingerprint, token, record, expires_at) \
             VALUES (?1, ?2, ?3, NULL, ?4 + ?5) \
             ON CONFLICT (key) DO UPDATE SET fingerprint = excluded.fingerprint, token = excluded.token, \
             record = NULL, expires_at = excluded.expires_at WHERE r.expires_at <= ?4",
            &[Key, Fingerprint, Token, Now, Ms],
        ),
        extend: s(
            "UPDATE {t} SET expires_at = ?3 + ?4 WHERE key = ?1 AND token = ?2 AND expires_at > ?3",
            &[Key, Token, Now, Ms],
        ),
        // A repeat of this very completion also counts as stored.
        complete: s(
            "UPDATE {t} SET token = NULL, record = ?3, expires_at = ?4 + ?5 \
             WHERE key = ?1 AND ((token = ?2 AND expires_at > ?4) OR record = ?3)",
            &[Key, Token, Record, Now, Ms],
        ),
        release: s(
            "DELETE FROM {t} WHERE key = ?1 AND token = ?2",
            &[Key, Token],
        ),
        forget_completed: s(
            "DELETE FROM {t} WHERE key = ?1 AND expires_at > ?2 AND record IS NOT NULL",
            &[Key, Now],
        ),
        delete_claim: s("DELETE FROM {t} WHERE key = ?1", &[Key]),
        forget_in_flight: s(
            "DELETE FROM {t} WHERE key = ?1 AND expires_at > ?2 AND record IS NULL",
            &[Key, Now],
        ),
        delete_expired: s(
            "DELETE FROM {t} WHERE key IN (SELECT key FROM {t} WHERE expires_at < ?1 LIMIT ?2)",
            &[Now, Batch],
        ),
        counts: s(
            "SELECT CASE WHEN expires_at <= ?1 THEN 2 WHEN record IS NULL THEN 1 ELSE 0 END, count(*) \
             FROM {t} GROUP BY 1",
            &[Now],
        ),
    }
}

/// `before` (the request's transaction begun, `IMMEDIATE`: the file's
/// write lock; a batch's savepoint), then the claim's row inserted, or an
/// expired record replaced, expiring at `expires_at` — in one call:
/// literals, as SQLite runs several statements only as text. `None` rows:
/// a live row holds the key.
pub(super) fn tx_claim(
    before: &str,
    table: &str,
    key: &str,
    fingerprint: &[u8],
    now: i64,
    expires_at: i64,
) -> String {
    let mut hex = String::with_capacity(2 * fingerprint.len());
    crate::fingerprint::push_hex(&mut hex, fingerprint);
    format!(
        "{before}INSERT INTO {table} AS r (key, fingerprint, token, record, expires_at) \
         VALUES ('{}', X'{hex}', NULL, NULL, {expires_at}) \
         ON CONFLICT (key) DO UPDATE SET fingerprint = excluded.fingerprint, token = NULL, \
         record = NULL, expires_at = excluded.expires_at WHERE r.expires_at <= {now} \
         RETURNING 1, x'', NULL, NULL, 0",
        key.replace('\'', "''")
    )
}

/// For the start-up check, inside the transaction it began: a claim of
/// Key held for Ms.
pub(super) fn check_claim(table: &str) -> Stmt {
    Stmt::new(
        table,
        "INSERT INTO {t} AS r (key, fingerprint, token, record, expires_at) \
         VALUES (?1, ?2, NULL, NULL, ?3 + ?4) \
         ON CONFLICT (key) DO UPDATE SET fingerprint = excluded.fingerprint, token = NULL, \
         record = NULL, expires_at = excluded.expires_at WHERE r.expires_at <= ?3 \
         RETURNING 1, x'', NULL, NULL, 0",
        &[Key, Fingerprint, Now, Ms],
    )
}

/// The record, written into the claim's row, whose expiry already covers
/// its retention: no index changes.
pub(super) fn tx_complete(table: &str) -> Stmt {
    Stmt::new(
        table,
        "UPDATE {t} SET record = ?2 WHERE key = ?1",
        &[Key, Record],
    )
}

/// The record, written into the claim's row, kept for Ms from now: for a
/// transaction that outlived the expiry its claim was written with.
pub(super) fn tx_complete_later(table: &str) -> Stmt {
    Stmt::new(
        table,
        "UPDATE {t} SET record = ?2, expires_at = ?3 + ?4 WHERE key = ?1",
        &[Key, Record, Now, Ms],
    )
}

/// Appends `bytes` as a blob literal, `X'…'`.
pub(super) fn push_blob_literal(out: &mut String, bytes: &[u8]) {
    out.push_str("X'");
    crate::fingerprint::push_hex(out, bytes);
    out.push('\'');
}
