//! The granted claim of [`SqliteTxStore`](super::SqliteTxStore): sqlx's own
//! transaction, holding the database's write lock, and the key's place in
//! the process's registry of keys in flight.

use std::ops::{Deref, DerefMut};

use sqlx::{Sqlite, SqliteConnection, Transaction};
use tokio::sync::OwnedMutexGuard;

use super::transactional::Registered;
use crate::store::{Granted, LeaseToken};

/// The request's transaction on a [`SqliteTxStore`](super::SqliteTxStore),
/// with its claim in it: sqlx's `Transaction` (begun `IMMEDIATE`, so it
/// holds the database's write lock), plus the key's place among this
/// process's keys in flight. Handlers receive it through
/// [`IdempotentTx`](crate::IdempotentTx) (`IdempotentTx<SqliteTx>`), a
/// message's work as `&mut SqliteTx`; both dereference to the connection.
/// Dropped unfinished, it rolls back.
///
/// # Examples
///
/// ```no_run
/// # async fn demo(orders: tower_idempotency::message::IdempotencyProcessor<tower_idempotency::SqliteTxStore>) -> Result<(), Box<dyn std::error::Error>> {
/// use tower_idempotency::SqliteTx;
///
/// let payload = br#"{"order_id":"order-42","amount":1999}"#;
/// orders
///     .process("order-42", payload, async |tx: &mut SqliteTx| {
///         sqlx::query("INSERT INTO order_charges (order_id, amount) VALUES (?1, ?2)")
///             .bind("order-42")
///             .bind(1999_i64)
///             .execute(&mut **tx)
///             .await?;
///         Ok::<_, sqlx::Error>(())
///     })
///     .await?;
/// # Ok(()) }
/// ```
pub struct SqliteTx {
    /// `None` once committed or rolled back.
    pub(super) tx: Option<Transaction<'static, Sqlite>>,
    /// This process's turn to write, held with the write lock.
    pub(super) _turn: OwnedMutexGuard<()>,
    pub(super) _registered: Registered,
}

impl Granted for SqliteTx {
    fn lease_token(&self) -> Option<LeaseToken> {
        None
    }
}

impl Deref for SqliteTx {
    type Target = SqliteConnection;

    fn deref(&self) -> &SqliteConnection {
        self.tx
            .as_ref()
            .expect("the transaction is open until the layer ends it")
    }
}

impl DerefMut for SqliteTx {
    fn deref_mut(&mut self) -> &mut SqliteConnection {
        self.tx
            .as_mut()
            .expect("the transaction is open until the layer ends it")
    }
}

impl std::fmt::Debug for SqliteTx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteTx")
            .field("open", &self.tx.is_some())
            .finish()
    }
}
