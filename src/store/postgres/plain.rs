//! The plain store: each operation one short autocommit statement, the
//! claim a lease with a fencing token, like the Redis store.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use bytes::Bytes;
use sqlx::Row;

use super::Base;
use crate::{
    fingerprint::Fingerprint,
    record::{CompletedRecord, codec},
    store::{
        Claim, Forgotten, KeyState, LeaseToken, StorageKey, Store, StoreError, claim_within,
        sql::{decide, millis},
    },
};

/// A [`Store`] on PostgreSQL whose claims are leases, each operation one
/// short autocommit statement: a claim with a lease and a fencing token (an
/// expired claim is taken over by compare-and-swap), heartbeats, fenced
/// completion and release. Use it when the handler's effects live
/// elsewhere; the crash window is then the same as with Redis. For effects
/// in the same database, [`PostgresTxStore`](super::PostgresTxStore)
/// commits the record with them.
///
/// Cloning is cheap and clones share the pool.
///
/// # Examples
///
/// ```no_run
/// # async fn demo() -> Result<(), tower_idempotency::store::StoreError> {
/// use axum::{Router, routing::post};
/// use tower_idempotency::{IdempotencyLayer, PostgresStore};
///
/// let store = PostgresStore::builder()
///     .connect("postgres://postgres@127.0.0.1:5432/app")
///     .await?;
/// store.migrate().await?;
/// let app: Router = Router::new()
///     .route("/v1/emails", post(|| async { "sent" }))
///     .layer(IdempotencyLayer::new(store));
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct PostgresStore {
    pub(super) base: Arc<Base>,
}

impl std::fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresStore")
            .field("table", &self.base.sql.table)
            .field("timeout", &self.base.timeout)
            .finish_non_exhaustive()
    }
}

crate::store::sql::records_methods!(PostgresStore, sqlx::PgPool);

impl Store for PostgresStore {
    type Granted = LeaseToken;

    async fn claim(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<Claim, StoreError> {
        let lease_ms = millis(lease, "lease")?;
        let started = Instant::now();
        // Waiting for a connection sends nothing: a claim that times out here
        // is simply abandoned (carrying it on would add load to a pool
        // already exhausted).
        let mut connection = self.base.bounded(self.base.pool.acquire()).await?;
        // Owned, so that it can outlive this call (see `claim_within`).
        let (base, owned_key, fingerprint) = (self.base.clone(), key.clone(), *fingerprint);
        let claim = async move {
            let token = LeaseToken::generate();
            // The read half sees the statement's snapshot: a row committed
            // just after it began, which made the insert conflict, is
            // invisible to it. Then nothing comes back, and the claim is
            // simply asked again.
            for _ in 0..3 {
                let row = sqlx::query(&base.sql.claim)
                    .bind(owned_key.as_str())
                    .bind(&fingerprint.as_bytes()[..])
                    .bind(&token.to_bytes()[..])
                    .bind(lease_ms)
                    .fetch_optional(&mut *connection)
                    .await?;
                match row {
                    Some(row) if row.try_get::<bool, _>("acquired")? => {
                        return Ok(Claim::Acquired(token));
                    }
                    Some(row) => {
                        let stored: Vec<u8> = row.try_get("fingerprint")?;
                        let record: Option<Vec<u8>> = row.try_get("record")?;
                        let left = row.try_get::<i64, _>("ms_left")?;
                        return decide(
                            &fingerprint,
                            &stored,
                            record.map(Bytes::from),
                            left,
                            &base.compression,
                        );
                    }
                    None => continue,
                }
            }
            Err(StoreError::Unavailable(
                "the claim found a record it could not read three times".into(),
            ))
        };
        claim_within(self, key, started, self.base.timeout, lease, claim).await
    }

    async fn extend(
        &self,
        key: &StorageKey,
        token: LeaseToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let updated = self
            .base
            .bounded(
                sqlx::query(&self.base.sql.extend)
                    .bind(key.as_str())
                    .bind(&token.to_bytes()[..])
                    .bind(millis(lease, "lease")?)
                    .execute(&self.base.pool),
            )
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
        let updated = self
            .base
            .bounded(
                sqlx::query(&self.base.sql.complete)
                    .bind(key.as_str())
                    .bind(&token.to_bytes()[..])
                    .bind(record)
                    .bind(millis(retention, "retention")?)
                    .execute(&self.base.pool),
            )
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
        // Nothing deleted: in flight (not forced), or nothing at all.
        Ok(match self.base.inspect_row(key).await? {
            Some(KeyState::InFlight { .. }) => Forgotten::InFlight,
            _ => Forgotten::Nothing,
        })
    }

    async fn release(&self, key: &StorageKey, token: LeaseToken) -> Result<bool, StoreError> {
        let deleted = self
            .base
            .bounded(
                sqlx::query(&self.base.sql.release)
                    .bind(key.as_str())
                    .bind(&token.to_bytes()[..])
                    .execute(&self.base.pool),
            )
            .await?;
        Ok(deleted.rows_affected() == 1)
    }
}
