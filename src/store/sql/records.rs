//! The records table as an operator sees it: one key looked up or
//! forgotten, the table counted and swept — without claiming anything, so
//! without the start-up check a store runs before it claims.

use std::sync::Arc;

use super::{
    Base,
    dialect::{Args, Dialect, Engine, ErrorClass},
    transactional::IN_FLIGHT_RETRY_AFTER,
    tx_engine::{Probe, Seam, TxEngine},
};
use crate::store::{Forgotten, KeyState, StorageKey, StoreError};

/// A SQL store's records table, for an operator (the `tower-idempotency`
/// CLI, an admin tool): what one key holds, forgetting it, counting and
/// sweeping the table — whichever store writes the table, leases or
/// transactions. It claims nothing, so it runs no start-up check (it
/// needs no write rights to look up and count: a read-only database or a
/// `SELECT`-only user will do), and it never waits for a request in
/// flight: what it says is what held when it was asked.
///
/// Open it with `builder().records()`; it is not a
/// [`Store`](crate::store::Store), and guards nothing.
///
/// # Examples
///
/// ```no_run
/// # #[cfg(feature = "sqlite")]
/// # async fn demo() -> Result<(), tower_idempotency::store::StoreError> {
/// use tower_idempotency::{IdempotencyKey, SqliteStore, store::{Forgotten, StorageKey}};
///
/// let records = SqliteStore::builder().records().connect("sqlite://payments.db").await?;
/// let key = StorageKey::new("acct_alice", &IdempotencyKey::new("order-42").unwrap());
/// match records.forget(&key, false).await? {
///     Forgotten::InFlight => eprintln!("a request with this key is running: not forgotten"),
///     forgotten => println!("{forgotten:?}"),
/// }
/// # Ok(()) }
/// ```
pub struct SqlRecords<D: Dialect> {
    pub(crate) base: Arc<Base<D>>,
    state: Arc<D::TxState>,
}

impl<D: Dialect> Clone for SqlRecords<D> {
    fn clone(&self) -> Self {
        Self {
            base: self.base.clone(),
            state: self.state.clone(),
        }
    }
}

impl<D: Engine> std::fmt::Debug for SqlRecords<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqlRecords")
            .field("table", &self.base.sql.table)
            .finish_non_exhaustive()
    }
}
impl<D: TxEngine> SqlRecords<D> {
    /// The table on `base`, once it can be read.
    pub(super) async fn open(base: Arc<Base<D>>) -> Result<Self, StoreError> {
        let readable = base
            .bounded(async {
                let mut on = base.pool.acquire().await.map_err(|e| base.error(e))?;
                Ok(D::fetch(&mut on, &base.sql.exists, &Args::default()).await)
            })
            .await?;
        if let Err(error) = readable {
            let table = &base.sql.table;
            return Err(match D::classify(&error) {
                ErrorClass::MissingTable => StoreError::Misconfigured(format!(
                    "there is no idempotency table {table} in this database: check the table's \
                     name (and its schema) against the application's"
                )),
                ErrorClass::PermissionDenied => StoreError::Misconfigured(format!(
                    "the database user may not read the idempotency table {table} ({error}): \
                     grant it SELECT (and DELETE, to forget and sweep)"
                )),
                _ => base.error(error),
            });
        }
        let state = D::tx_state(&base.pool, &base.engine, &base.sql.table, base.timeout).await?;
        Ok(Self {
            base,
            state: Arc::new(state),
        })
    }

    fn seam(&self) -> Seam<D> {
        Seam::new(self.base.clone(), self.state.clone())
    }

    /// The pool.
    pub fn pool(&self) -> &sqlx::Pool<D::Db> {
        &self.base.pool
    }

    /// What the table holds for `key`: a completed record, a claim in
    /// flight — a lease's row, or a transaction's (probed without waiting
    /// for it: on SQLite, another process holding the file's write lock
    /// counts as one) — or nothing. A user who may only read sees the
    /// committed rows only, and the answer says nothing about a
    /// transaction in flight (logged as a warning).
    ///
    /// # Errors
    ///
    /// The database's.
    ///
    /// # Examples
    ///
    /// See [`SqlRecords`].
    pub async fn inspect(&self, key: &StorageKey) -> Result<KeyState, StoreError> {
        if let Some(found) = self.base.inspect_row(key).await? {
            return Ok(found);
        }
        Ok(match D::tx_in_flight(&self.seam(), key).await? {
            Probe::InFlight => KeyState::InFlight {
                retry_after: IN_FLIGHT_RETRY_AFTER,
            },
            Probe::Free => KeyState::Absent,
            Probe::Unseen(why) => {
                tracing::warn!(%key, %why, "idempotency: a request in flight in a transaction cannot be seen; only committed records are");
                KeyState::Absent
            }
        })
    }

    /// Forgets what `key` holds when asked: a completed record is deleted,
    /// so the next request with it executes again. A request in flight is
    /// left alone ([`Forgotten::InFlight`]) — a lease's claim is deleted
    /// with `force` (its handler's completion is then fenced off, and a
    /// retry runs it a second time), a transaction's never (it is the
    /// handler's open transaction: [`StoreError::Unsupported`]). A record
    /// committed after the question is never deleted by it.
    ///
    /// # Errors
    ///
    /// The database's.
    ///
    /// # Examples
    ///
    /// See [`SqlRecords`].
    pub async fn forget(&self, key: &StorageKey, force: bool) -> Result<Forgotten, StoreError> {
        match self.base.forget_row(key, force).await? {
            Forgotten::Nothing => {}
            forgotten => return Ok(forgotten),
        }
        match D::tx_in_flight(&self.seam(), key).await? {
            Probe::Free => Ok(Forgotten::Nothing),
            Probe::InFlight if force => Err(StoreError::Unsupported(
                "forcing a transactional claim in flight: it is the handler's open transaction, which ends when the handler does or at the transaction timeout",
            )),
            Probe::InFlight => Ok(Forgotten::InFlight),
            Probe::Unseen(why) => Err(StoreError::Unavailable(
                format!("whether a request holds the key cannot be told: {why}").into(),
            )),
        }
    }

    /// What the table holds, counted; see [`TableStats`](super::TableStats).
    ///
    /// # Errors
    ///
    /// The database's.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # #[cfg(feature = "sqlite")]
    /// # async fn demo(records: tower_idempotency::store::sql::SqlRecords<tower_idempotency::store::sqlite::Sqlite>) -> Result<(), tower_idempotency::store::StoreError> {
    /// let stats = records.stats().await?;
    /// println!("{} completed, {} expired", stats.completed, stats.expired);
    /// # Ok(()) }
    /// ```
    pub async fn stats(&self) -> Result<super::TableStats, StoreError> {
        self.base.stats().await
    }

    /// Deletes up to `batch` expired records; how many. See
    /// [`DeleteExpired`](super::DeleteExpired).
    ///
    /// # Errors
    ///
    /// The database's.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # #[cfg(feature = "sqlite")]
    /// # async fn demo(records: tower_idempotency::store::sql::SqlRecords<tower_idempotency::store::sqlite::Sqlite>) -> Result<(), tower_idempotency::store::StoreError> {
    /// while records.delete_expired(1000).await? == 1000 {}
    /// # Ok(()) }
    /// ```
    pub async fn delete_expired(&self, batch: u32) -> Result<u64, StoreError> {
        self.base.delete_expired(batch).await
    }
}
