//! The statements, with the table name in place: `INSERT … ON CONFLICT`,
//! `RETURNING` and a plain index, as SQLite documents them.

use crate::store::{StoreError, sql::checked_table};

/// The schema, for the default table name `idempotency_records`; idempotent.
pub const SCHEMA: &str = include_str!("schema.sql");

pub(super) const DEFAULT_TABLE: &str = "idempotency_records";

pub(super) struct Sql {
    pub(super) table: String,
    pub(super) schema: String,
    pub(super) find: String,
    pub(super) claim: String,
    pub(super) extend: String,
    pub(super) complete: String,
    pub(super) release: String,
    pub(super) delete_expired: String,
    pub(super) tx_claim: String,
    pub(super) tx_complete: String,
    pub(super) forget: String,
}

impl Sql {
    pub(super) fn new(table: &str) -> Result<Self, StoreError> {
        checked_table(table, "SqliteStore")?;
        let t = |sql: &str| sql.replace("{t}", table);
        Ok(Self {
            table: table.to_owned(),
            schema: SCHEMA.replace(DEFAULT_TABLE, table),
            find: t(FIND),
            claim: t(CLAIM),
            extend: t(EXTEND),
            complete: t(COMPLETE),
            release: t(RELEASE),
            delete_expired: t(DELETE_EXPIRED),
            tx_claim: t(TX_CLAIM),
            tx_complete: t(TX_COMPLETE),
            forget: t(FORGET),
        })
    }
}

/// The row that holds a key, live or not. ?1 key.
const FIND: &str = "SELECT fingerprint, record, expires_at FROM {t} WHERE key = ?1";

/// Plain claim: the in-flight row inserted, or an expired record taken
/// over; nothing when a live row holds the key. ?1 key, ?2 fingerprint,
/// ?3 token, ?4 lease deadline, ?5 now (Unix ms).
const CLAIM: &str = "INSERT INTO {t} AS r (key, fingerprint, token, record, expires_at) \
     VALUES (?1, ?2, ?3, NULL, ?4) \
     ON CONFLICT (key) DO UPDATE SET fingerprint = excluded.fingerprint, token = excluded.token, \
     record = NULL, expires_at = excluded.expires_at WHERE r.expires_at <= ?5 RETURNING 1";

/// ?1 key, ?2 token, ?3 new deadline, ?4 now.
const EXTEND: &str =
    "UPDATE {t} SET expires_at = ?3 WHERE key = ?1 AND token = ?2 AND expires_at > ?4";

/// Fenced by the token; a repeat of this very completion also counts as
/// stored. ?1 key, ?2 token, ?3 record, ?4 expiry, ?5 now.
const COMPLETE: &str = "UPDATE {t} SET token = NULL, record = ?3, expires_at = ?4 \
     WHERE key = ?1 AND ((token = ?2 AND expires_at > ?5) OR record = ?3)";

const RELEASE: &str = "DELETE FROM {t} WHERE key = ?1 AND token = ?2";

/// ?1 now, ?2 batch.
const DELETE_EXPIRED: &str =
    "DELETE FROM {t} WHERE key IN (SELECT key FROM {t} WHERE expires_at < ?1 LIMIT ?2)";

/// Inside the request's transaction, which holds the write lock: the
/// claim's row inserted, or an expired record replaced. ?1 key,
/// ?2 fingerprint, ?3 deadline, ?4 now.
const TX_CLAIM: &str = "INSERT INTO {t} AS r (key, fingerprint, token, record, expires_at) \
     VALUES (?1, ?2, NULL, NULL, ?3) \
     ON CONFLICT (key) DO UPDATE SET fingerprint = excluded.fingerprint, token = NULL, \
     record = NULL, expires_at = excluded.expires_at WHERE r.expires_at <= ?4 RETURNING 1";

/// The record, written into the claim's row. ?1 key, ?2 record, ?3 expiry.
const TX_COMPLETE: &str = "UPDATE {t} SET record = ?2, expires_at = ?3 WHERE key = ?1";

/// Deletes a live completed record, or (with ?3) a claim in flight too.
/// ?1 key, ?2 now, ?3 force.
const FORGET: &str = "DELETE FROM {t} WHERE key = ?1 AND expires_at > ?2 \
     AND (record IS NOT NULL OR ?3) RETURNING record IS NOT NULL";
