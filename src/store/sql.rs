//! What the SQL stores share: reading a found row, the table-name rule,
//! durations as milliseconds, and the start-up check that refuses an engine
//! whose claims would not exclude each other.

use std::{future::Future, sync::Arc, time::Duration};

use bytes::Bytes;

use super::{Claim, Forgotten, KeyState, StoreError};
use crate::{
    fingerprint::Fingerprint,
    record::codec::{self, Compression},
};

/// What to do when the start-up check finds that the database would not
/// make a concurrent duplicate wait or fail: a claim held by one
/// uncommitted transaction did not block a second session's claim of the
/// same key (an engine that detects the conflict only at commit, a table
/// without its primary key). Such a store would run a handler twice.
///
/// # Examples
///
/// ```no_run
/// # #[cfg(feature = "sqlite")]
/// # async fn demo() -> Result<(), tower_idempotency::store::StoreError> {
/// use tower_idempotency::{SqliteStore, store::sqlite::EngineCheck};
///
/// // Checked by other means: say so explicitly.
/// let store = SqliteStore::builder()
///     .engine_check(EngineCheck::Warn)
///     .connect("sqlite://records.db")
///     .await?;
/// # let _ = store; Ok(()) }
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum EngineCheck {
    /// Refuse to start (the default).
    #[default]
    Refuse,
    /// Log an error and start anyway: an explicit opt-out.
    Warn,
}

impl EngineCheck {
    /// Applies the check's verdict: `why` is `Some` when the engine failed
    /// it.
    pub(crate) fn verdict(self, engine: &str, why: Option<String>) -> Result<(), StoreError> {
        let Some(why) = why else { return Ok(()) };
        let message = format!(
            "the database ({engine}) failed the start-up check: {why}. A concurrent duplicate \
             would run the handler twice. Use an engine (or a table) where a claim held by an \
             uncommitted transaction makes a second claim of the key wait or fail, or opt out \
             with .engine_check(EngineCheck::Warn) if you have made sure by other means"
        );
        match self {
            Self::Refuse => Err(StoreError::Misconfigured(message)),
            Self::Warn => {
                tracing::error!("idempotency: {message}");
                Ok(())
            }
        }
    }
}

/// What a live row tells a claim: another fingerprint is a mismatch; a row
/// without a record yet (a plain-mode claim) is in flight; a record is a
/// replay.
pub(crate) fn decide<G>(
    fingerprint: &Fingerprint,
    stored: &[u8],
    record: Option<Bytes>,
    ms_left: i64,
    compression: &Compression,
) -> Result<Claim<G>, StoreError> {
    let left = Duration::from_millis(ms_left.max(0) as u64);
    if stored != fingerprint.as_bytes() {
        return Ok(Claim::Mismatch);
    }
    Ok(match record {
        None => Claim::InFlight { retry_after: left },
        Some(bytes) => Claim::Completed {
            record: Arc::new(codec::decode_with(bytes, compression)?.1),
            expires_in: left,
        },
    })
}

/// What a live row tells an operator: a record is completed, none yet is a
/// claim in flight (a plain store's).
pub(crate) fn key_state(
    record: Option<Vec<u8>>,
    ms_left: i64,
    compression: &Compression,
) -> Result<KeyState, StoreError> {
    let left = Duration::from_millis(ms_left.max(0) as u64);
    Ok(match record {
        None => KeyState::InFlight { retry_after: left },
        Some(bytes) => KeyState::Completed {
            record: Arc::new(codec::decode_with(bytes, compression)?.1),
            expires_in: left,
        },
    })
}

/// What a forget's `DELETE … RETURNING record IS NOT NULL` deleted, if
/// anything: a completed record, or (forced) a claim in flight.
pub(crate) fn forgotten(deleted_completed: Option<bool>) -> Option<Forgotten> {
    deleted_completed.map(|completed| {
        if completed {
            Forgotten::Completed
        } else {
            Forgotten::ForcedInFlight
        }
    })
}

/// `table`, if it is a plain lowercase identifier, optionally
/// schema-qualified: it is written into SQL text.
pub(crate) fn checked_table(table: &str, store: &str) -> Result<(), StoreError> {
    let valid = |part: &str| {
        part.starts_with(|c: char| c.is_ascii_lowercase() || c == '_')
            && part
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
    };
    let parts: Vec<&str> = table.split('.').collect();
    if parts.len() > 2 || !parts.iter().all(|p| valid(p)) {
        return Err(StoreError::Misconfigured(format!(
            "{store} table {table:?} must be a lowercase identifier (letters, digits, _), optionally schema-qualified"
        )));
    }
    Ok(())
}

/// Whole milliseconds, as SQL binds them.
pub(crate) fn millis(d: Duration, what: &str) -> Result<i64, StoreError> {
    Ok(super::ttl_millis(d, what)? as i64)
}

/// The key the start-up check claims: never a layer's (scope hashes are hex,
/// message keys are visible ASCII after a hash too), unique per check.
pub(crate) fn self_test_key() -> String {
    format!("tower-idempotency:self-test:{:032x}", fastrand::u128(..))
}

/// A SQL store's table, which expired records can be deleted from.
pub(crate) trait DeleteExpired: Send + Sync + 'static {
    /// Deletes up to `batch` expired records; returns how many.
    fn delete_expired(&self, batch: u32) -> impl Future<Output = Result<u64, StoreError>> + Send;
}

/// Deletes expired records in batches of `batch`, every `every`, until the
/// returned handle is aborted. Failures are logged and retried at the next
/// tick.
pub(crate) fn spawn_cleaner<B: DeleteExpired>(
    every: Duration,
    batch: u32,
    base: Arc<B>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        loop {
            tick.tick().await;
            loop {
                match base.delete_expired(batch).await {
                    Ok(deleted) if deleted == u64::from(batch) => continue,
                    Ok(_) => break,
                    Err(error) => {
                        tracing::warn!(%error, "idempotency: deleting expired records failed");
                        break;
                    }
                }
            }
        }
    })
}

/// The table's upkeep, the same on every SQL store: the pool, `migrate`,
/// `delete_expired` and `spawn_cleaner`. The store has a `base` with those
/// operations.
macro_rules! records_methods {
    ($store:ident, $pool:ty) => {
        impl $store {
            /// The pool, e.g. to share it with the rest of the application.
            pub fn pool(&self) -> &$pool {
                &self.base.pool
            }

            /// Creates the table and its index if they are missing
            /// (idempotent), then runs the start-up check on it.
            ///
            /// # Examples
            ///
            /// ```no_run
            #[doc = concat!("# async fn demo(store: tower_idempotency::", stringify!($store), ") -> Result<(), tower_idempotency::store::StoreError> {")]
            /// store.migrate().await?;
            /// # Ok(()) }
            /// ```
            pub async fn migrate(&self) -> Result<(), crate::store::StoreError> {
                self.base.migrate().await
            }

            /// Deletes up to `batch` expired records; returns how many it
            /// deleted. Rows a running claim holds are skipped.
            ///
            /// # Examples
            ///
            /// ```no_run
            #[doc = concat!("# async fn demo(store: tower_idempotency::", stringify!($store), ") -> Result<(), tower_idempotency::store::StoreError> {")]
            /// while store.delete_expired(1000).await? == 1000 {}
            /// # Ok(()) }
            /// ```
            pub async fn delete_expired(&self, batch: u32) -> Result<u64, crate::store::StoreError> {
                crate::store::sql::DeleteExpired::delete_expired(&*self.base, batch).await
            }

            /// Deletes expired records in batches of `batch`, every `every`,
            /// in a background task, until the returned handle is aborted.
            /// Failures are logged and retried at the next tick.
            ///
            /// # Examples
            ///
            /// ```no_run
            #[doc = concat!("# async fn demo(store: tower_idempotency::", stringify!($store), ") {")]
            /// use std::time::Duration;
            ///
            /// let cleaner = store.spawn_cleaner(Duration::from_secs(60), 1000);
            /// # cleaner.abort(); }
            /// ```
            pub fn spawn_cleaner(
                &self,
                every: std::time::Duration,
                batch: u32,
            ) -> tokio::task::JoinHandle<()> {
                crate::store::sql::spawn_cleaner(every, batch, self.base.clone())
            }
        }
    };
}
pub(crate) use records_methods;

/// The mode of a SQL store's builder that connects a store whose claims are
/// leases (`PostgresStore`, `SqliteStore`).
#[derive(Clone, Copy, Debug)]
pub struct Plain;

/// The mode of a SQL store's builder that connects a store whose record
/// commits in the handler's transaction (`PostgresTxStore`,
/// `SqliteTxStore`).
#[derive(Clone, Copy, Debug)]
pub struct Transactional;

impl From<sqlx::Error> for StoreError {
    fn from(error: sqlx::Error) -> Self {
        StoreError::Unavailable(Box::new(error))
    }
}
