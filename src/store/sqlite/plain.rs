//! The plain store: each operation one short autocommit statement, the
//! claim a lease with a fencing token.

use std::{sync::Arc, time::Duration};

use bytes::Bytes;
use sqlx::Row;

use super::{Base, now_ms};
use crate::{
    fingerprint::Fingerprint,
    record::{CompletedRecord, codec},
    store::{
        Claim, Forgotten, KeyState, LeaseToken, StorageKey, Store, StoreError,
        sql::{decide, millis},
    },
};

/// A [`Store`] on SQLite whose claims are leases, each operation one short
/// autocommit statement, like the Redis store's. Use it when the handler's
/// effects live elsewhere; for effects in the same database file,
/// [`SqliteTxStore`](super::SqliteTxStore) commits the record with them.
///
/// Cloning is cheap and clones share the pool.
///
/// # Examples
///
/// ```no_run
/// # async fn demo() -> Result<(), tower_idempotency::store::StoreError> {
/// use axum::{Router, routing::post};
/// use tower_idempotency::{IdempotencyLayer, SqliteStore};
///
/// let store = SqliteStore::builder().connect("sqlite://records.db").await?;
/// store.migrate().await?;
/// let app: Router = Router::new()
///     .route("/v1/emails", post(|| async { "sent" }))
///     .layer(IdempotencyLayer::new(store));
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct SqliteStore {
    pub(super) base: Arc<Base>,
}

impl std::fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteStore")
            .field("table", &self.base.sql.table)
            .field("timeout", &self.base.timeout)
            .finish_non_exhaustive()
    }
}

crate::store::sql::records_methods!(SqliteStore, sqlx::SqlitePool);

impl Store for SqliteStore {
    type Granted = LeaseToken;

    async fn claim(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<Claim, StoreError> {
        let token = LeaseToken::generate();
        let lease = millis(lease, "lease")?;
        // A row removed between the two statements (released, or expired
        // and cleaned) makes the claim ask again.
        for _ in 0..3 {
            let turn = self.base.write_turn().await?;
            let now = now_ms();
            let inserted = sqlx::query(&self.base.sql.claim)
                .bind(key.as_str())
                .bind(&fingerprint.as_bytes()[..])
                .bind(&token.to_bytes()[..])
                .bind(now.saturating_add(lease))
                .bind(now)
                .fetch_optional(&self.base.pool)
                .await?;
            drop(turn);
            if inserted.is_some() {
                return Ok(Claim::Acquired(token));
            }
            let Some(row) = sqlx::query(&self.base.sql.find)
                .bind(key.as_str())
                .fetch_optional(&self.base.pool)
                .await?
            else {
                continue;
            };
            let stored: Vec<u8> = row.try_get("fingerprint")?;
            let record: Option<Vec<u8>> = row.try_get("record")?;
            let ms_left = row.try_get::<i64, _>("expires_at")? - now_ms();
            if ms_left > 0 {
                return decide(
                    fingerprint,
                    &stored,
                    record.map(Bytes::from),
                    ms_left,
                    &self.base.compression,
                );
            }
        }
        Err(StoreError::Unavailable(
            "the claim found a record it could not read three times".into(),
        ))
    }

    async fn extend(
        &self,
        key: &StorageKey,
        token: LeaseToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let _turn = self.base.write_turn().await?;
        let now = now_ms();
        let updated = sqlx::query(&self.base.sql.extend)
            .bind(key.as_str())
            .bind(&token.to_bytes()[..])
            .bind(now.saturating_add(millis(lease, "lease")?))
            .bind(now)
            .execute(&self.base.pool)
            .await?;
        Ok(updated.rows_affected() == 1)
    }

    async fn complete(
        &self,
        key: &StorageKey,
        token: &mut LeaseToken,
        fingerprint: &Fingerprint,
        record: Arc<CompletedRecord>,
        retention: Duration,
    ) -> Result<bool, StoreError> {
        let record = codec::encode_with(fingerprint, &record, &self.base.compression);
        let _turn = self.base.write_turn().await?;
        let now = now_ms();
        let updated = sqlx::query(&self.base.sql.complete)
            .bind(key.as_str())
            .bind(&token.to_bytes()[..])
            .bind(record)
            .bind(now.saturating_add(millis(retention, "retention")?))
            .bind(now)
            .execute(&self.base.pool)
            .await?;
        Ok(updated.rows_affected() == 1)
    }

    async fn inspect(&self, key: &StorageKey) -> Result<KeyState, StoreError> {
        Ok(self
            .base
            .inspect_row(key)
            .await?
            .unwrap_or(KeyState::Absent))
    }

    async fn forget(&self, key: &StorageKey, force: bool) -> Result<Forgotten, StoreError> {
        if let Some(forgotten) = self.base.forget_row(key, force).await? {
            return Ok(forgotten);
        }
        Ok(match self.base.inspect_row(key).await? {
            Some(KeyState::InFlight { .. }) => Forgotten::InFlight,
            _ => Forgotten::Nothing,
        })
    }

    async fn release(&self, key: &StorageKey, token: LeaseToken) -> Result<bool, StoreError> {
        let _turn = self.base.write_turn().await?;
        let deleted = sqlx::query(&self.base.sql.release)
            .bind(key.as_str())
            .bind(&token.to_bytes()[..])
            .execute(&self.base.pool)
            .await?;
        Ok(deleted.rows_affected() == 1)
    }
}
