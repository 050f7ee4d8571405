//! The handler's side of a transactional claim: the [`IdempotentTx`]
//! extractor and the slot it borrows the transaction from.

use std::{
    ops::{Deref, DerefMut},
    sync::{Arc, Mutex},
};

use axum_core::{
    extract::FromRequestParts,
    response::{IntoResponse, Response},
};
use http::{StatusCode, request::Parts};
use sqlx::{PgConnection, Postgres, pool::PoolConnection};

use super::lock;
use crate::http::problem::Problem;

/// A pooled connection inside a transaction the store began (the claim is
/// sent with `BEGIN` in one round trip, which sqlx's `Transaction` cannot
/// do). Dropped while still open — a task that crashed, an extractor kept
/// too long — it closes the connection instead of returning it to the pool:
/// the server rolls the transaction back, and no other request inherits it.
pub(super) struct OpenTx {
    connection: PoolConnection<Postgres>,
    open: bool,
}

impl OpenTx {
    /// `connection` has just run `BEGIN` successfully.
    pub(super) fn begun(connection: PoolConnection<Postgres>) -> Self {
        Self {
            connection,
            open: true,
        }
    }

    /// Runs `statement`, then `COMMIT` if it succeeded: one round trip.
    pub(super) async fn commit_after(mut self, mut statement: String) -> Result<(), sqlx::Error> {
        statement.push_str("; COMMIT");
        self.end(&statement).await
    }

    pub(super) async fn rollback(mut self) -> Result<(), sqlx::Error> {
        self.end("ROLLBACK").await
    }

    /// `sql` (simple protocol) must end the transaction when it succeeds.
    async fn end(&mut self, sql: &str) -> Result<(), sqlx::Error> {
        let connection: &mut PgConnection = &mut self.connection;
        sqlx::Executor::execute(connection, sqlx::raw_sql(sql)).await?;
        self.open = false;
        Ok(())
    }
}

impl Deref for OpenTx {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        &self.connection
    }
}

impl DerefMut for OpenTx {
    fn deref_mut(&mut self) -> &mut PgConnection {
        &mut self.connection
    }
}

impl Drop for OpenTx {
    fn drop(&mut self) {
        if self.open {
            self.connection.close_on_drop();
        }
    }
}

/// Where a claim's transaction waits: taken by the handler's extractor,
/// put back when the extractor drops, taken by the layer to commit.
pub(super) struct TxSlot(Mutex<Option<OpenTx>>);

impl TxSlot {
    pub(super) fn new(tx: OpenTx) -> Self {
        Self(Mutex::new(Some(tx)))
    }

    /// The transaction, unless someone holds it.
    pub(super) fn take(&self) -> Option<OpenTx> {
        lock(&self.0).take()
    }

    fn put_back(&self, tx: OpenTx) {
        *lock(&self.0) = Some(tx);
    }
}

/// What the store puts into the request's extensions for the extractor.
#[derive(Clone)]
pub(super) struct TxHandle(pub(super) Arc<TxSlot>);

/// The request's transaction, in a handler behind a transactional
/// [`PostgresStore`](super::PostgresStore): write the request's effects with
/// it, and the layer commits them together with the stored response, or
/// rolls everything back.
///
/// Dereferences to the connection, so `sqlx::query(..).execute(&mut *tx)`
/// works. Do not commit or roll back yourself, and do not keep it past the
/// handler: the layer commits once the handler has returned. An
/// `IdempotentTx` still held then (moved into a spawned task) makes the layer
/// answer `500` with nothing committed; it rolls back when that holder drops
/// it.
///
/// Extracting it outside a transactional claim (no layer, a plain store, an
/// unguarded method or a request without a key) fails with `500`: put the
/// layer on the route and require the key.
///
/// # Examples
///
/// ```no_run
/// use axum::{Json, http::StatusCode};
/// use tower_idempotency::IdempotentTx;
///
/// #[derive(serde::Deserialize)]
/// struct NewCharge { amount: i64 }
///
/// async fn charge(mut tx: IdempotentTx, Json(new): Json<NewCharge>) -> Result<StatusCode, StatusCode> {
///     sqlx::query("INSERT INTO charges (amount) VALUES ($1)")
///         .bind(new.amount)
///         .execute(&mut *tx)
///         .await
///         .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
///     Ok(StatusCode::CREATED)
/// }
/// ```
pub struct IdempotentTx {
    slot: Arc<TxSlot>,
    tx: Option<OpenTx>,
}

impl Deref for IdempotentTx {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        self.tx.as_ref().expect("held until dropped")
    }
}

impl DerefMut for IdempotentTx {
    fn deref_mut(&mut self) -> &mut PgConnection {
        self.tx.as_mut().expect("held until dropped")
    }
}

impl Drop for IdempotentTx {
    fn drop(&mut self) {
        if let Some(tx) = self.tx.take() {
            self.slot.put_back(tx);
        }
    }
}

impl std::fmt::Debug for IdempotentTx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotentTx").finish_non_exhaustive()
    }
}

impl IdempotentTx {
    /// The transaction the store attached to these extensions, if it is
    /// still there.
    pub(crate) fn take_from(extensions: &http::Extensions) -> Option<Self> {
        let TxHandle(slot) = extensions.get::<TxHandle>()?;
        Some(Self {
            slot: slot.clone(),
            tx: Some(slot.take()?),
        })
    }
}

impl<S: Send + Sync> FromRequestParts<S> for IdempotentTx {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Response> {
        let unavailable = |detail: &'static str| {
            Problem::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "No idempotent transaction",
            )
            .problem_type("urn:tower-idempotency:problem:no-transaction")
            .detail(detail)
            .into_response()
        };
        if parts.extensions.get::<TxHandle>().is_none() {
            return Err(unavailable(
                "This request has no idempotent transaction: the route needs the IdempotencyLayer over a transactional PostgresStore, and the request an Idempotency-Key.",
            ));
        }
        Self::take_from(&parts.extensions).ok_or_else(|| {
            unavailable(
                "The request's transaction is already in use: extract IdempotentTx once per request.",
            )
        })
    }
}
