//! The transactional store: the claim is the record's row, inserted inside
//! the request's `IMMEDIATE` transaction, and the record commits with the
//! handler's writes.

use std::{
    collections::HashSet,
    sync::{Arc, Mutex, MutexGuard},
    time::Duration,
};

use bytes::Bytes;
use sqlx::{Row, Sqlite, Transaction};
use tokio::sync::OwnedMutexGuard;

use super::{Base, SqliteTx, now_ms};
use crate::{
    fingerprint::Fingerprint,
    record::{CompletedRecord, codec},
    store::{
        Claim, Forgotten, KeyState, LeaseToken, StorageKey, Store, StoreError,
        sql::{decide, millis},
    },
};

/// Retry-After for a duplicate of a request whose transaction is running.
const IN_FLIGHT_RETRY_AFTER: Duration = Duration::from_secs(1);

/// A [`Store`] on SQLite whose record commits in the handler's own
/// transaction: exactly one effect per key, across crashes, in one file
/// with nothing to install. See the [module docs](super) for how it works,
/// what SQLite's single writer means for slow handlers, and what it costs.
///
/// Handlers take the transaction with
/// [`IdempotentTx<SqliteTx>`](crate::IdempotentTx); a message's work
/// receives it as `&mut SqliteTx`. Cloning is cheap and clones share the
/// pool and the registry of keys in flight.
///
/// # Examples
///
/// ```no_run
/// # async fn demo() -> Result<(), tower_idempotency::store::StoreError> {
/// use axum::{Router, http::StatusCode, routing::post};
/// use tower_idempotency::{IdempotencyLayer, IdempotentTx, SqliteStore, SqliteTx};
///
/// let store = SqliteStore::builder()
///     .transactional()
///     .connect("sqlite://payments.db")
///     .await?;
/// store.migrate().await?;
///
/// async fn charge(mut tx: IdempotentTx<SqliteTx>) -> Result<StatusCode, StatusCode> {
///     sqlx::query("INSERT INTO charges (amount) VALUES (?1)")
///         .bind(1999_i64)
///         .execute(&mut *tx)
///         .await
///         .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
///     // The layer commits this insert together with the stored response.
///     Ok(StatusCode::CREATED)
/// }
///
/// let app: Router = Router::new()
///     .route("/v1/charges", post(charge))
///     .layer(IdempotencyLayer::new(store));
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct SqliteTxStore {
    pub(super) base: Arc<Base>,
    /// The keys this process has claimed and not yet settled: a duplicate
    /// in this process is answered at once, without waiting for the
    /// database's write lock, which the first holds.
    pub(super) in_flight: Arc<Mutex<HashSet<StorageKey>>>,
    /// How long a claim's row says it is held, should it ever commit
    /// without its record.
    pub(super) bound: Duration,
}

impl std::fmt::Debug for SqliteTxStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteTxStore")
            .field("table", &self.base.sql.table)
            .field("timeout", &self.base.timeout)
            .finish_non_exhaustive()
    }
}

crate::store::sql::records_methods!(SqliteTxStore, sqlx::SqlitePool);

/// A key's place among the keys this process has in flight, given up when
/// dropped (with the transaction that holds the claim).
pub(crate) struct Registered {
    in_flight: Arc<Mutex<HashSet<StorageKey>>>,
    key: StorageKey,
}

impl Registered {
    /// `None` when the key is already in flight in this process.
    fn enter(in_flight: &Arc<Mutex<HashSet<StorageKey>>>, key: &StorageKey) -> Option<Self> {
        lock(in_flight).insert(key.clone()).then(|| Self {
            in_flight: in_flight.clone(),
            key: key.clone(),
        })
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        lock(&self.in_flight).remove(&self.key);
    }
}

/// A panic while holding the registry's lock cannot leave it half-written
/// (each critical section is one set operation), so a poisoned lock is
/// safe to use.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl SqliteTxStore {
    /// The row that holds the key, read without a transaction (no lock:
    /// WAL readers never wait for the writer): a live row's answer, or
    /// `None` when no live row holds it.
    async fn find(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
    ) -> Result<Option<Claim<SqliteTx>>, StoreError> {
        let row = sqlx::query(&self.base.sql.find)
            .bind(key.as_str())
            .fetch_optional(&self.base.pool)
            .await?;
        let Some(row) = row else { return Ok(None) };
        let ms_left = row.try_get::<i64, _>("expires_at")? - now_ms();
        if ms_left <= 0 {
            return Ok(None);
        }
        let stored: Vec<u8> = row.try_get("fingerprint")?;
        let record: Option<Vec<u8>> = row.try_get("record")?;
        decide(
            fingerprint,
            &stored,
            record.map(Bytes::from),
            ms_left,
            &self.base.compression,
        )
        .map(Some)
    }

    async fn claim_in_transaction(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
    ) -> Result<Claim<SqliteTx>, StoreError> {
        let in_flight = Claim::InFlight {
            retry_after: IN_FLIGHT_RETRY_AFTER,
        };
        // A replay (or a mismatch) needs no write lock, and no place in the
        // registry: concurrent replays of one key all replay.
        if lock(&self.in_flight).contains(key) {
            return Ok(in_flight);
        }
        if let Some(found) = self.find(key, fingerprint).await? {
            return Ok(found);
        }
        let Some(registered) = Registered::enter(&self.in_flight, key) else {
            return Ok(in_flight);
        };
        // On a task of its own: a caller that stops waiting halfway through
        // `BEGIN` must not return a connection to the pool that the worker
        // then puts inside a transaction. The task finishes, and a
        // transaction nobody took rolls back when dropped.
        let claim = tokio::spawn({
            let (base, key, fingerprint) = (self.base.clone(), key.clone(), *fingerprint);
            let deadline = millis(self.bound, "bound")?;
            async move { Self::insert_claim(&base, &key, &fingerprint, deadline).await }
        });
        match claim
            .await
            .map_err(|e| StoreError::Unavailable(e.into()))??
        {
            Some((tx, turn)) => Ok(Claim::Acquired(SqliteTx {
                tx: Some(tx),
                _turn: turn,
                _registered: registered,
            })),
            // Committed by another process since the first look.
            None => Ok(self.find(key, fingerprint).await?.unwrap_or(in_flight)),
        }
    }

    /// Takes this process's turn to write, then the database's write lock
    /// (waiting for a writer in another process as SQLite does: its busy
    /// timeout, the command timeout), and inserts the claim's row: the
    /// transaction holding it, with the turn, or `None` when a live row
    /// holds the key.
    async fn insert_claim(
        base: &Base,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        hold_ms: i64,
    ) -> Result<Option<(Transaction<'static, Sqlite>, OwnedMutexGuard<()>)>, StoreError> {
        let turn = base.write_turn().await?;
        let mut tx = base.pool.begin_with("BEGIN IMMEDIATE").await?;
        let now = now_ms();
        let inserted = sqlx::query(&base.sql.tx_claim)
            .bind(key.as_str())
            .bind(&fingerprint.as_bytes()[..])
            .bind(now.saturating_add(hold_ms))
            .bind(now)
            .fetch_optional(&mut *tx)
            .await?;
        Ok(inserted.map(|_| (tx, turn)))
    }
}

impl Store for SqliteTxStore {
    type Granted = SqliteTx;

    async fn claim(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        _lease: Duration,
    ) -> Result<Claim<SqliteTx>, StoreError> {
        self.claim_in_transaction(key, fingerprint).await
    }

    /// The claim lives as long as its transaction: nothing to extend.
    async fn extend(&self, _: &StorageKey, _: LeaseToken, _: Duration) -> Result<bool, StoreError> {
        Ok(true)
    }

    async fn complete(
        &self,
        key: &StorageKey,
        granted: &mut SqliteTx,
        fingerprint: &Fingerprint,
        record: Arc<CompletedRecord>,
        retention: Duration,
    ) -> Result<bool, StoreError> {
        let Some(mut tx) = granted.tx.take() else {
            return Ok(false);
        };
        let record = codec::encode_with(fingerprint, &record, &self.base.compression);
        // Retention counts from now, the end of the handler.
        let expires_at = now_ms().saturating_add(millis(retention, "retention")?);
        let written = sqlx::query(&self.base.sql.tx_complete)
            .bind(key.as_str())
            .bind(record)
            .bind(expires_at)
            .execute(&mut *tx)
            .await
            .map_err(refused_or_unavailable)?;
        if written.rows_affected() != 1 {
            // The claim's row is gone (the handler deleted it, or a failure
            // rolled the transaction back): committing now would keep the
            // handler's writes without their record.
            return Err(StoreError::Refused(
                "the claim's row is no longer in the transaction".into(),
            ));
        }
        tx.commit().await.map_err(refused_or_unavailable)?;
        Ok(true)
    }

    async fn release(&self, _: &StorageKey, mut granted: SqliteTx) -> Result<bool, StoreError> {
        if let Some(tx) = granted.tx.take() {
            tx.rollback().await?;
        }
        Ok(true)
    }

    /// A committed record is read; a claim in flight is known from this
    /// process's registry (another process's claim in flight is an
    /// uncommitted row no reader sees: it shows as absent).
    async fn inspect(&self, key: &StorageKey) -> Result<KeyState, StoreError> {
        if lock(&self.in_flight).contains(key) {
            return Ok(KeyState::InFlight {
                retry_after: IN_FLIGHT_RETRY_AFTER,
            });
        }
        Ok(self
            .base
            .inspect_row(key)
            .await?
            .unwrap_or(KeyState::Absent))
    }

    async fn forget(&self, key: &StorageKey, force: bool) -> Result<Forgotten, StoreError> {
        if lock(&self.in_flight).contains(key) {
            return if force {
                Err(StoreError::Unsupported(
                    "forcing a transactional claim in flight: it is the handler's open transaction, which ends when the handler does",
                ))
            } else {
                Ok(Forgotten::InFlight)
            };
        }
        Ok(self
            .base
            .forget_row(key, false)
            .await?
            .unwrap_or(Forgotten::Nothing))
    }
}

/// A constraint the commit broke (SQLite's primary result code 19, e.g. a
/// deferred foreign key) is the request's own: refused. Anything else is
/// the database failing.
fn refused_or_unavailable(error: sqlx::Error) -> StoreError {
    let constraint = error
        .as_database_error()
        .and_then(|e| e.code())
        .and_then(|code| code.parse::<i32>().ok())
        .is_some_and(|code| code & 0xff == 19);
    if constraint {
        StoreError::Refused(Box::new(error))
    } else {
        error.into()
    }
}
