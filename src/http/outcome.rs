//! What the layer did with a request, for the application to see: decided
//! with the response, stamped on it once.

use axum_core::body::Body;
use http::Response;

use crate::http::rejection::RejectionKind;

/// A response and what the layer did to produce it.
pub(crate) struct Answered {
    pub(crate) response: Response<Body>,
    pub(crate) outcome: IdempotencyOutcome,
}

impl Answered {
    pub(crate) fn new(response: Response<Body>, outcome: IdempotencyOutcome) -> Self {
        Self { response, outcome }
    }

    /// The response, carrying its outcome in its extensions: the one place
    /// that writes it.
    pub(crate) fn stamped(mut self) -> Response<Body> {
        self.response.extensions_mut().insert(self.outcome);
        self.response
    }
}

/// What the layer did with a request. Every response that passes through the
/// layer carries one in its extensions; the same is logged with `tracing`.
///
/// # Examples
///
/// ```
/// # async fn demo() {
/// use axum::{Router, body::Body, routing::post};
/// use tower::ServiceExt;
/// use tower_idempotency::{IdempotencyLayer, IdempotencyOutcome, MemoryStore};
///
/// let app = Router::new()
///     .route("/", post(|| async { "ok" }))
///     .layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant());
/// let request = || http::Request::post("/").header("idempotency-key", "k1").body(Body::empty()).unwrap();
///
/// let first = app.clone().oneshot(request()).await.unwrap();
/// assert!(matches!(first.extensions().get(), Some(IdempotencyOutcome::Executed(_))));
/// let retry = app.oneshot(request()).await.unwrap();
/// assert_eq!(retry.extensions().get(), Some(&IdempotencyOutcome::Replayed));
/// # }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum IdempotencyOutcome {
    /// The handler ran under a claim; what became of its response.
    Executed(Completion),
    /// A stored response was replayed; the handler did not run.
    Replayed,
    /// The layer answered itself; the handler did not run (except for
    /// [`RejectionKind::HandlerPanicked`] and [`RejectionKind::ResponseBodyFailed`]).
    Rejected(RejectionKind),
    /// The layer did not apply: unguarded method or path, no key (and none
    /// required), or no scope.
    Bypassed(BypassReason),
    /// The store was unreachable and the layer is configured to fail open: the
    /// handler ran without protection.
    Unprotected,
}

impl IdempotencyOutcome {
    /// A short, stable name: the `outcome` label of the metrics and the
    /// `outcome` field of the request's span.
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::{Completion, IdempotencyOutcome};
    ///
    /// assert_eq!(IdempotencyOutcome::Executed(Completion::Stored).name(), "executed");
    /// assert_eq!(IdempotencyOutcome::Replayed.name(), "replayed");
    /// ```
    pub fn name(&self) -> &'static str {
        match self {
            Self::Executed(Completion::Stored) => "executed",
            Self::Executed(Completion::StoredUnreplayable) => "executed_unreplayable",
            Self::Executed(Completion::Released) => "executed_released",
            Self::Executed(Completion::Pending) => "executed_pending",
            Self::Executed(Completion::LeaseLost) => "executed_lease_lost",
            Self::Replayed => "replayed",
            Self::Rejected(kind) => match kind {
                RejectionKind::MissingKey | RejectionKind::MissingBodyKey { .. } => {
                    "rejected_missing_key"
                }
                RejectionKind::InvalidKey(_) => "rejected_invalid_key",
                RejectionKind::BodyTooLarge { .. } => "rejected_body_too_large",
                RejectionKind::BodyUnreadable => "rejected_body_unreadable",
                RejectionKind::Mismatch => "rejected_mismatch",
                RejectionKind::InFlight { .. } => "rejected_in_flight",
                RejectionKind::Unreplayable { .. } => "rejected_unreplayable",
                RejectionKind::StoreUnavailable { .. } => "rejected_store_unavailable",
                RejectionKind::HandlerPanicked => "rejected_handler_panicked",
                RejectionKind::ResponseBodyFailed => "rejected_response_body_failed",
                RejectionKind::TransactionHeld => "rejected_transaction_held",
                RejectionKind::TransactionRefused => "rejected_transaction_refused",
                RejectionKind::WritesTooLarge { .. } => "rejected_writes_too_large",
                RejectionKind::NoScope => "rejected_no_scope",
                RejectionKind::NotAcceptable { .. } => "rejected_not_acceptable",
            },
            Self::Bypassed(BypassReason::UnguardedMethod) => "bypassed_method",
            Self::Bypassed(BypassReason::UnguardedPath) => "bypassed_path",
            Self::Bypassed(BypassReason::NoKey) => "bypassed_no_key",
            Self::Bypassed(BypassReason::UnguardedTool) => "bypassed_tool",
            Self::Bypassed(BypassReason::NoScope) => "bypassed_no_scope",
            Self::Unprotected => "unprotected",
        }
    }
}

impl IdempotencyOutcome {
    /// Whether the layer failed the request, rather than answered it: the
    /// store out of reach (refused, or the handler run unprotected), a
    /// handler that panicked or whose body failed, a response sent but not
    /// stored (a retry may execute again), a refused or misused
    /// transaction, a keyed request without a scope. A replay, a duplicate
    /// in flight, a key reused with other parameters or refused are
    /// answers: the request's span keeps an unset status for them.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::{IdempotencyOutcome, RejectionKind};
    ///
    /// assert!(!IdempotencyOutcome::Replayed.is_failure());
    /// let outage = RejectionKind::StoreUnavailable { retry_after: Duration::from_secs(1) };
    /// assert!(IdempotencyOutcome::Rejected(outage).is_failure());
    /// ```
    pub fn is_failure(&self) -> bool {
        match self {
            Self::Executed(completion) => matches!(completion, Completion::LeaseLost),
            Self::Rejected(kind) => matches!(
                kind,
                RejectionKind::StoreUnavailable { .. }
                    | RejectionKind::HandlerPanicked
                    | RejectionKind::ResponseBodyFailed
                    | RejectionKind::TransactionHeld
                    | RejectionKind::TransactionRefused
                    | RejectionKind::NoScope
            ),
            Self::Unprotected => true,
            Self::Replayed | Self::Bypassed(_) => false,
        }
    }
}

/// What became of an executed request's response.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Completion {
    /// Stored; retries replay it.
    Stored,
    /// Too large to store; retries are told it cannot be replayed.
    StoredUnreplayable,
    /// Not final per the store policy; the key was released for retries.
    Released,
    /// Storing it failed; the layer keeps retrying in the background while the
    /// lease holds. Retries meanwhile get `409`.
    Pending,
    /// The lease was lost (expired and re-claimed) before the response could
    /// be stored; it was sent but not stored.
    LeaseLost,
}

/// Why the layer let a request through untouched.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum BypassReason {
    /// The method is not guarded (e.g. `GET`).
    UnguardedMethod,
    /// The path is one of the layer's
    /// [`unguarded_paths`](crate::IdempotencyLayer::unguarded_paths), e.g. a
    /// gRPC streaming method.
    UnguardedPath,
    /// No `Idempotency-Key` and the key is not required.
    NoKey,
    /// An MCP tool the door was told not to guard
    /// (`mcp::McpIdempotencyLayer::unguarded`, feature `mcp`).
    UnguardedTool,
    /// The scope extractor returned `None`, and the layer
    /// [passes such requests through](crate::IdempotencyLayer::pass_through_without_scope).
    NoScope,
}
