//! The granted claim of [`PostgresTxStore`](super::PostgresTxStore): a
//! pooled connection inside the request's transaction.

use std::ops::{Deref, DerefMut};

use sqlx::{PgConnection, Postgres, pool::PoolConnection};

use crate::store::{Granted, LeaseToken};

/// A pooled connection inside a transaction the store began, with the
/// request's claim in it: the granted claim of a
/// [`PostgresTxStore`](super::PostgresTxStore). Handlers receive it through
/// [`IdempotentTx`](crate::IdempotentTx) (`IdempotentTx<PostgresTx>`), a
/// message's work as `&mut PostgresTx`; both dereference to the connection.
///
/// It is sqlx's `Transaction` for this one purpose: the store sends
/// `BEGIN` with the claim in one round trip, and the record with `COMMIT`,
/// which sqlx's own type cannot. Dropped while still open — a task that
/// crashed, an extractor kept too long — it closes the connection instead
/// of returning it to the pool: the server rolls the transaction back, the
/// claim with it, and no other request inherits it.
///
/// # Examples
///
/// ```no_run
/// # async fn demo(orders: tower_idempotency::message::IdempotencyProcessor<tower_idempotency::PostgresTxStore>) -> Result<(), Box<dyn std::error::Error>> {
/// use tower_idempotency::PostgresTx;
///
/// let payload = br#"{"order_id":"order-42","amount":1999}"#;
/// orders
///     .process("order-42", payload, async |tx: &mut PostgresTx| {
///         sqlx::query("INSERT INTO order_charges (order_id, amount) VALUES ($1, $2)")
///             .bind("order-42")
///             .bind(1999_i64)
///             .execute(&mut **tx)
///             .await?;
///         Ok::<_, sqlx::Error>(())
///     })
///     .await?;
/// # Ok(()) }
/// ```
pub struct PostgresTx {
    /// `None` once committed or rolled back.
    connection: Option<PoolConnection<Postgres>>,
}

impl PostgresTx {
    /// `connection` has just run `BEGIN` successfully.
    pub(super) fn begun(connection: PoolConnection<Postgres>) -> Self {
        Self {
            connection: Some(connection),
        }
    }

    /// Runs `sql` (simple protocol), which must end the transaction when it
    /// succeeds. On failure the connection is closed: the server rolls back.
    pub(super) async fn end(&mut self, sql: &str) -> Result<(), sqlx::Error> {
        let Some(mut connection) = self.connection.take() else {
            return Err(sqlx::Error::PoolClosed);
        };
        let on: &mut PgConnection = &mut connection;
        match sqlx::Executor::execute(on, sqlx::raw_sql(sql)).await {
            Ok(_) => Ok(()),
            Err(error) => {
                connection.close_on_drop();
                Err(error)
            }
        }
    }

    pub(super) async fn rollback(mut self) -> Result<(), sqlx::Error> {
        self.end("ROLLBACK").await
    }
}

impl Granted for PostgresTx {
    fn lease_token(&self) -> Option<LeaseToken> {
        None
    }
}

impl Deref for PostgresTx {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        self.connection
            .as_ref()
            .expect("the transaction is open until the layer ends it")
    }
}

impl DerefMut for PostgresTx {
    fn deref_mut(&mut self) -> &mut PgConnection {
        self.connection
            .as_mut()
            .expect("the transaction is open until the layer ends it")
    }
}

impl Drop for PostgresTx {
    fn drop(&mut self) {
        if let Some(connection) = &mut self.connection {
            connection.close_on_drop();
        }
    }
}

impl std::fmt::Debug for PostgresTx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresTx")
            .field("open", &self.connection.is_some())
            .finish()
    }
}
