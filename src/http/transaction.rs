//! Handing a transactional store's claim to the handler: the
//! [`IdempotentTx`] extractor, and the slot it borrows the transaction from
//! while the layer holds the claim.

use std::{
    ops::{Deref, DerefMut},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
};

use axum_core::{
    extract::FromRequestParts,
    response::{IntoResponse, Response},
};
use http::{Extensions, StatusCode, request::Parts};

use super::{opt_out::NoReplay, problem::Problem};
use crate::lock::lock;

/// Where a claim's transaction waits while the handler runs: taken by the
/// extractor, put back when the extractor drops, taken back by the layer to
/// commit. Only the layer's request and the extractor share it.
pub(crate) struct TxSlot<T>(Mutex<Option<T>>);

impl<T> TxSlot<T> {
    /// The transaction, unless someone holds it.
    pub(crate) fn take(&self) -> Option<T> {
        lock(&self.0).take()
    }

    fn put_back(&self, tx: T) {
        *lock(&self.0) = Some(tx);
    }
}

/// What the layer claimed a request's key with, put into its extensions so
/// that an extractor that finds no transaction can say why.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ClaimedWith {
    /// The transaction's type, for a transactional store; `None` for a
    /// store whose claims are leases.
    transaction: Option<&'static str>,
}

impl ClaimedWith {
    /// A claim granted as `G`: a transaction, or a lease.
    pub(crate) fn granted<G>(is_transaction: bool) -> Self {
        Self {
            transaction: is_transaction.then(std::any::type_name::<G>),
        }
    }
}

/// Why a handler asking for `IdempotentTx<T>` got none: the likely cause,
/// from what the layer left in the request's extensions.
fn missing_transaction<T>(extensions: &Extensions) -> String {
    let asked = std::any::type_name::<T>();
    match extensions.get::<ClaimedWith>() {
        None => format!(
            "The handler asks for IdempotentTx<{asked}>, but the idempotency layer claimed no key for this request. \
             Likely: the route has no IdempotencyLayer (or it is applied to other routes); the method or path is not \
             guarded; the request has no Idempotency-Key and the key is not required (.require_key(true)); or the \
             store could not be reached and the layer fails open."
        ),
        Some(ClaimedWith { transaction: None }) => format!(
            "The handler asks for IdempotentTx<{asked}>, but the layer's store claims keys with leases, not \
             transactions: build it with .transactional() (e.g. PostgresStore::builder().transactional())."
        ),
        Some(ClaimedWith {
            transaction: Some(given),
        }) => format!(
            "The handler asks for IdempotentTx<{asked}>, but the layer's store hands out {given}: ask for that type."
        ),
    }
}

/// Whether a missing transaction was logged: once per process names the
/// misconfiguration.
static MISSING_SAID: AtomicBool = AtomicBool::new(false);

/// Puts `tx` into the request's extensions for the extractor; the returned
/// slot gives it back once the handler has returned.
pub(crate) fn lend<T: Send + Sync + 'static>(tx: T, extensions: &mut Extensions) -> Arc<TxSlot<T>> {
    let slot = Arc::new(TxSlot(Mutex::new(Some(tx))));
    extensions.insert(TxHandle(slot.clone()));
    slot
}

/// What the layer puts into the request's extensions for the extractor.
struct TxHandle<T>(Arc<TxSlot<T>>);

impl<T> Clone for TxHandle<T> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

/// The request's transaction, in a handler behind a transactional store:
/// write the request's effects with it, and the layer commits them together
/// with the stored response, or rolls everything back.
///
/// `T` is the store's transaction: `PostgresTx` for `PostgresTxStore`,
/// `SqliteTx` for `SqliteTxStore`, or a custom transactional store's own.
/// `IdempotentTx<T>` dereferences to what `T` dereferences to — the
/// database connection — so `sqlx::query(..).execute(&mut *tx)` works. Do
/// not commit or roll back yourself, and do not keep it past the handler:
/// the layer commits once the handler has returned. An `IdempotentTx` still
/// held then (moved into a spawned task) makes the layer answer `500` with
/// nothing committed; the transaction rolls back when that holder drops it.
///
/// Extracting it outside a transactional claim (no layer, a store whose
/// claims are leases, an unguarded method or a request without a key) fails
/// with `500`: put the layer on the route and require the key.
///
/// # Examples
///
/// ```no_run
/// # #[cfg(feature = "sqlite")] mod demo {
/// use axum::{Json, http::StatusCode};
/// use tower_idempotency::{IdempotentTx, SqliteTx};
///
/// #[derive(serde::Deserialize)]
/// struct NewCharge { amount: i64 }
///
/// async fn charge(mut tx: IdempotentTx<SqliteTx>, Json(new): Json<NewCharge>) -> Result<StatusCode, StatusCode> {
///     sqlx::query("INSERT INTO charges (amount) VALUES ($1)")
///         .bind(new.amount)
///         .execute(&mut *tx)
///         .await
///         .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
///     Ok(StatusCode::CREATED)
/// }
/// # }
/// ```
pub struct IdempotentTx<T> {
    slot: Arc<TxSlot<T>>,
    tx: Option<T>,
}

impl<T: Deref> Deref for IdempotentTx<T> {
    type Target = T::Target;

    fn deref(&self) -> &T::Target {
        self.tx.as_ref().expect("held until dropped")
    }
}

impl<T: DerefMut> DerefMut for IdempotentTx<T> {
    fn deref_mut(&mut self) -> &mut T::Target {
        self.tx.as_mut().expect("held until dropped")
    }
}

impl<T: Send + Sync + 'static> IdempotentTx<T> {
    /// The request's transaction, taken from its extensions, for handlers
    /// that are not axum handlers — a tonic service's method reads it from
    /// its request's extensions. `None` outside a transactional claim, or
    /// when it was taken already.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # #[cfg(feature = "sqlite")] mod demo {
    /// use tower_idempotency::{IdempotentTx, SqliteTx};
    ///
    /// async fn charge(extensions: &http::Extensions, amount: i64) -> Result<(), &'static str> {
    ///     let mut tx = IdempotentTx::<SqliteTx>::from_extensions(extensions)
    ///         .ok_or("no idempotent transaction: is the layer over a SqliteTxStore?")?;
    ///     sqlx::query("INSERT INTO charges (amount) VALUES ($1)")
    ///         .bind(amount)
    ///         .execute(&mut *tx)
    ///         .await
    ///         .map_err(|_| "insert failed")?;
    ///     Ok(())
    /// }
    /// # }
    /// ```
    pub fn from_extensions(extensions: &Extensions) -> Option<Self> {
        let TxHandle(slot) = extensions.get::<TxHandle<T>>()?;
        let tx = slot.take()?;
        Some(Self {
            slot: slot.clone(),
            tx: Some(tx),
        })
    }
}

/// The store's transaction itself, for what takes it whole (the outbox's
/// `enqueue`).
impl<T> AsMut<T> for IdempotentTx<T> {
    fn as_mut(&mut self) -> &mut T {
        self.tx.as_mut().expect("held until dropped")
    }
}

impl<T> Drop for IdempotentTx<T> {
    fn drop(&mut self) {
        if let Some(tx) = self.tx.take() {
            self.slot.put_back(tx);
        }
    }
}

impl<T> std::fmt::Debug for IdempotentTx<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotentTx").finish_non_exhaustive()
    }
}

impl<S: Send + Sync, T: Send + Sync + 'static> FromRequestParts<S> for IdempotentTx<T> {
    type Rejection = Response;

    /// Fails with `500` (`urn:tower-idempotency:problem:no-transaction`)
    /// whose detail names the likely cause — a store built without
    /// `.transactional()`, another transaction type, no layer or no key —
    /// and which the layer never stores: a misconfiguration is never the
    /// answer to the client's parameters, so the key is released and a
    /// retry runs again once it is fixed. The first such failure in a
    /// process is logged as an error.
    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Response> {
        let unavailable = |detail: String| {
            if !MISSING_SAID.swap(true, Ordering::Relaxed) {
                tracing::error!("idempotency: {detail} (said once per process)");
            }
            let mut response = Problem::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "No idempotent transaction",
            )
            .problem_type("urn:tower-idempotency:problem:no-transaction")
            .detail(detail)
            .into_response();
            // The server's mistake, not the client's answer: never replayed.
            response.extensions_mut().insert(NoReplay::rolling_back());
            response
        };
        let Some(TxHandle(slot)) = parts.extensions.get::<TxHandle<T>>() else {
            return Err(unavailable(missing_transaction::<T>(&parts.extensions)));
        };
        let tx = slot.take().ok_or_else(|| {
            unavailable(
                "The request's transaction is already in use: extract IdempotentTx once per request."
                    .to_owned(),
            )
        })?;
        Ok(Self {
            slot: slot.clone(),
            tx: Some(tx),
        })
    }
}
