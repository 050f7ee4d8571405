//! The SQL stores: one family, whatever the engine — PostgreSQL (feature
//! `postgres`), SQLite (`sqlite`), MySQL and MariaDB (`mysql`).
//!
//! Every engine has the same two stores, built by the same
//! [`SqlStoreBuilder`]:
//!
//! - **[`SqlTxStore`]** (`builder().transactional()`): the record commits in
//!   the handler's own transaction, so record and effect are one fact —
//!   exactly one effect per key, across crashes. Named
//!   `PostgresTxStore`,
//!   `SqliteTxStore`, `MySqlTxStore`; the handler's
//!   transaction is a [`SqlTx`] (`PostgresTx`, `SqliteTx`, `MySqlTx`).
//! - **[`SqlStore`]** (the default): claims are leases with fencing tokens,
//!   each operation one short autocommit statement, like the Redis store.
//!   Named `PostgresStore`,
//!   `SqliteStore`, `MySqlStore`.
//!
//! Both keep their records in one table (default `idempotency_records`),
//! which `migrate()` creates if it is missing (or run the engine's `SCHEMA`
//! with your own migration tool). Use one store per table.
//!
//! **Portable SQL.** The claim is the `processed_messages` pattern — the
//! record's row, inserted inside the request's transaction — in SQL that
//! each engine documents: no stored functions, no advisory locks, no
//! engine-only index. What it relies on, the store proves on the table when
//! it connects (if the table exists) and in `migrate()`; see
//! [`EngineCheck`].
//!
//! **Expiry.** A record counts as absent once it has expired, whether or
//! not it was deleted: correctness never depends on a cleaner. Retention
//! counts from the completion (for a transaction, from the commit, not its
//! start). [`DeleteExpired`] reclaims the space, in bounded batches.
//!
//! **Failures.** Every operation is bounded by the command timeout, and so
//! is waiting for a pooled connection: an unreachable database or an
//! exhausted pool answers `503` (fail closed), never a hang. A connection
//! whose transaction ended in an error is closed, never pooled.

// The engines are this crate's own: a store is named by its engine's alias
// (`PostgresStore`, …), and the traits that bound its impls (`Engine`,
// `TxEngine`, `OutboxEngine`) stay implementation details.
#![allow(private_bounds)]

mod base;
mod builder;
mod check;
mod decide;
pub(crate) mod dialect;
mod lease;
pub(crate) mod outbox;
mod records;
mod transactional;
mod transient;
mod tx;
mod tx_engine;
mod upkeep;

#[cfg(feature = "mysql")]
#[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
pub mod mysql;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub mod postgres;
#[cfg(feature = "sqlite")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
pub mod sqlite;

use std::time::Duration;

pub use crate::store::TableStats;
pub use base::EngineCheck;
pub(crate) use base::{Base, now_ms};
pub use builder::SqlStoreBuilder;
pub(crate) use decide::{UntilFixed, create_error};
pub use dialect::Dialect;
pub use lease::SqlStore;
pub use records::SqlRecords;
pub use transactional::SqlTxStore;
pub use transient::is_transient;
pub use tx::SqlTx;
pub use upkeep::DeleteExpired;

use super::StoreError;

/// The table the stores use unless told otherwise.
const DEFAULT_TABLE: &str = "idempotency_records";

/// The mode of a [`SqlStoreBuilder`] that connects a [`SqlStore`], whose
/// claims are leases.
#[derive(Clone, Copy, Debug)]
pub struct Plain;

/// The mode of a [`SqlStoreBuilder`] that connects a [`SqlTxStore`], whose
/// record commits in the handler's transaction.
#[derive(Clone, Copy, Debug)]
pub struct Transactional;

/// The mode of a [`SqlStoreBuilder`] that connects [`SqlRecords`]: the
/// table as an operator sees it.
#[derive(Clone, Copy, Debug)]
pub struct Records;

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

impl From<sqlx::Error> for StoreError {
    fn from(error: sqlx::Error) -> Self {
        match error {
            // A URL that does not parse, an unknown option: a mistake in the
            // configuration, not an outage.
            sqlx::Error::Configuration(why) => {
                StoreError::Misconfigured(format!("the database URL is not valid: {why}"))
            }
            error => StoreError::Unavailable(Box::new(error)),
        }
    }
}

/// Opens `D`'s pool with `options`: when no connection could be made
/// before the pool's timeout — all the pool says then is that it timed out
/// — one direct connection says why (refused, unknown host); a user the
/// database refuses is a configuration mistake, said as such. (SQLite
/// opens a file, and says why itself.)
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) async fn connect_pool<D: dialect::Engine>(
    pool: sqlx::pool::PoolOptions<D::Db>,
    options: <<D::Db as sqlx::Database>::Connection as sqlx::Connection>::Options,
) -> Result<sqlx::Pool<D::Db>, StoreError> {
    use sqlx::Connection;
    let error = match pool.connect_with(options.clone()).await {
        Ok(pool) => return Ok(pool),
        Err(sqlx::Error::PoolTimedOut) => {
            match <D::Db as sqlx::Database>::Connection::connect_with(&options).await {
                Err(error) => error,
                Ok(_) => sqlx::Error::PoolTimedOut,
            }
        }
        Err(error) => error,
    };
    Err(match D::classify(&error) {
        dialect::ErrorClass::BadCredentials => StoreError::Misconfigured(format!(
            "the database server refuses the credentials in the URL ({error}): check that the \
             user (role) exists and that its password is right"
        )),
        dialect::ErrorClass::NoDatabase => StoreError::Misconfigured(format!(
            "the database the URL names does not exist on the server ({error}): create it \
             (CREATE DATABASE), or fix its name in the URL"
        )),
        dialect::ErrorClass::PermissionDenied => StoreError::Misconfigured(format!(
            "the database refuses this user ({error}): grant the user access to the database, \
             and SELECT, INSERT, UPDATE and DELETE on the idempotency table"
        )),
        _ if matches!(error, sqlx::Error::Configuration(_)) => StoreError::from(error),
        _ => StoreError::Unavailable(format!("cannot connect to the database: {error}").into()),
    })
}

/// The table's methods, the same on both stores of every engine: the pool,
/// `migrate`, and the upkeep of [`DeleteExpired`].
macro_rules! table_methods {
    ($store:ident) => {
        impl<D: $crate::store::sql::dialect::Engine> $store<D> {
            /// The pool, e.g. to share it with the rest of the application.
            pub fn pool(&self) -> &sqlx::Pool<D::Db> {
                &self.base.pool
            }

            /// Creates the table and its index again if they are missing
            /// (idempotent) — dropped while the store runs, say — then runs
            /// the start-up check on it. A store connects only where the
            /// table exists: create it at start-up with
            /// [`create_table_if_missing`](crate::store::sql::SqlStoreBuilder::create_table_if_missing).
            ///
            /// # Examples
            ///
            /// ```no_run
            /// # #[cfg(feature = "sqlite")]
            /// # async fn demo() -> Result<(), tower_idempotency::store::StoreError> {
            /// let store = tower_idempotency::SqliteStore::builder()
            ///     .create_table_if_missing()
            ///     .connect("sqlite://records.db")
            ///     .await?;
            /// store.migrate().await?;
            /// # Ok(()) }
            /// ```
            pub async fn migrate(&self) -> Result<(), $crate::store::StoreError> {
                $crate::store::sql::check::migrate(&self.base).await
            }

            /// What the table holds: live records, claims in flight, expired
            /// rows not deleted yet; see [`TableStats`](crate::store::sql::TableStats).
            pub async fn stats(
                &self,
            ) -> Result<$crate::store::sql::TableStats, $crate::store::StoreError> {
                self.base.stats().await
            }

            /// Deletes up to `batch` expired records; see
            /// [`DeleteExpired::delete_expired`](crate::store::sql::DeleteExpired::delete_expired).
            pub async fn delete_expired(
                &self,
                batch: u32,
            ) -> Result<u64, $crate::store::StoreError> {
                self.base.delete_expired(batch).await
            }

            /// Deletes expired records in the background; see
            /// [`DeleteExpired::spawn_cleaner`](crate::store::sql::DeleteExpired::spawn_cleaner).
            pub fn spawn_cleaner(
                &self,
                every: std::time::Duration,
                batch: u32,
            ) -> tokio::task::JoinHandle<()> {
                $crate::store::sql::DeleteExpired::spawn_cleaner(self, every, batch)
            }
        }

        impl<D: $crate::store::sql::dialect::Engine> $crate::store::sql::DeleteExpired
            for $store<D>
        {
            async fn delete_expired(&self, batch: u32) -> Result<u64, $crate::store::StoreError> {
                self.base.delete_expired(batch).await
            }
        }
    };
}
pub(crate) use table_methods;
