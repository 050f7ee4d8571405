//! The layer and its configuration.

use std::{fmt, sync::Arc, time::Duration};

use axum::body::Body;
use http::{Method, Response};
use tower_layer::Layer;

use crate::{
    CachePolicy, DefaultCachePolicy, DefaultFingerprint, FingerprintStrategy, IdempotencyOutcome,
    IdempotencyService, NoScope, Rejection, RejectionKind, ScopeExtractor,
    rejection::RenderRejection, store::Store,
};

/// Applies Stripe-style `Idempotency-Key` semantics to the requests of a
/// service: the first response under a key is stored and replayed to every
/// retry, a key reused with different parameters is rejected, and two copies
/// of one request never run at once.
///
/// The layer holds only configuration and is cheap to clone; the records live
/// in the [`Store`], which clones share.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use axum::{Router, routing::post};
/// use http::request::Parts;
/// use tower_idempotency::{IdempotencyLayer, MemoryStore};
///
/// /// Put in the request's extensions by your authentication middleware.
/// #[derive(Clone)]
/// struct AccountId(String);
///
/// let idempotency = IdempotencyLayer::new(MemoryStore::new())
///     .require_key(true)
///     // Each account has its own keys: never replay one tenant's response to another.
///     .scope_with(|parts: &Parts| parts.extensions.get::<AccountId>().map(|a| a.0.clone()))
///     .retention(Duration::from_secs(24 * 60 * 60))
///     .lease(Duration::from_secs(30));
///
/// let app: Router = Router::new()
///     .route("/v1/charges", post(|| async { "charged" }))
///     .layer(idempotency);
/// ```
#[derive(Clone)]
pub struct IdempotencyLayer<St, Sc = NoScope, P = DefaultCachePolicy, F = DefaultFingerprint> {
    store: St,
    scope: Sc,
    policy: P,
    fingerprint: F,
    config: Config,
    render: RenderRejection,
}

/// The longest [`IdempotencyLayer::retention`]: a year. "Keep forever" is not
/// something every store can honour, and no client retries for longer.
pub const MAX_RETENTION: Duration = Duration::from_secs(365 * 24 * 60 * 60);

/// The longest [`IdempotencyLayer::lease`]: a day. The lease is how long a
/// crashed process blocks its keys; the heartbeat keeps slow handlers claimed
/// whatever its length.
pub const MAX_LEASE: Duration = Duration::from_secs(24 * 60 * 60);

/// Plain settings, read on every request.
#[derive(Clone, Debug)]
pub(crate) struct Config {
    pub(crate) methods: Vec<Method>,
    pub(crate) require_key: bool,
    pub(crate) retention: Duration,
    pub(crate) lease: Duration,
    pub(crate) max_request_body: usize,
    pub(crate) max_stored_body: usize,
    pub(crate) in_flight_wait: Option<Duration>,
    pub(crate) fail_open: bool,
    pub(crate) unavailable_retry_after: Duration,
}

/// Everything a service needs, shared by the clones of one service.
pub(crate) struct Shared<St, Sc, P, F> {
    pub(crate) store: St,
    pub(crate) scope: Sc,
    pub(crate) policy: P,
    pub(crate) fingerprint: F,
    pub(crate) config: Config,
    pub(crate) render: RenderRejection,
}

impl<St, Sc, P, F> Shared<St, Sc, P, F> {
    /// The rendered rejection, tagged with its outcome.
    pub(crate) fn rejection(&self, kind: RejectionKind) -> Response<Body> {
        let mut response = (self.render)(Rejection::new(kind.clone()));
        response
            .extensions_mut()
            .insert(IdempotencyOutcome::Rejected(kind));
        response
    }
}

impl<St: Store> IdempotencyLayer<St> {
    /// A layer over `store` with the defaults: guards `POST` and
    /// `PATCH`, key optional, one global scope (see [`NoScope`]: set a scope
    /// for multi-tenant APIs), 24 h retention, 30 s lease, 1 MiB request and
    /// stored-response limits, `409` for in-flight duplicates, fail closed.
    pub fn new(store: St) -> Self {
        Self {
            store,
            scope: NoScope,
            policy: DefaultCachePolicy,
            fingerprint: DefaultFingerprint,
            config: Config {
                methods: vec![Method::POST, Method::PATCH],
                require_key: false,
                retention: Duration::from_secs(24 * 60 * 60),
                lease: Duration::from_secs(30),
                max_request_body: 1024 * 1024,
                max_stored_body: 1024 * 1024,
                in_flight_wait: None,
                fail_open: false,
                unavailable_retry_after: Duration::from_secs(1),
            },
            render: Arc::new(Rejection::into_problem_response),
        }
    }
}

impl<St, Sc, P, F> IdempotencyLayer<St, Sc, P, F> {
    /// The methods the layer guards (default `POST`, `PATCH`). Requests with
    /// other methods pass through untouched.
    ///
    /// # Panics
    ///
    /// If `methods` is empty.
    ///
    /// # Examples
    ///
    /// ```
    /// use http::Method;
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore};
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).methods([Method::POST, Method::PUT]);
    /// # let _ = layer;
    /// ```
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.config.methods = methods.into_iter().collect();
        assert!(
            !self.config.methods.is_empty(),
            "IdempotencyLayer::methods: guard at least one method"
        );
        self
    }

    /// Reject guarded requests without an `Idempotency-Key` with `400`
    /// (default: let them through unprotected).
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore};
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).require_key(true);
    /// # let _ = layer;
    /// ```
    pub fn require_key(mut self, require: bool) -> Self {
        self.config.require_key = require;
        self
    }

    /// How long a completed response is kept for replay (default 24 hours).
    /// Stores keep it exactly this long, never shorter.
    ///
    /// # Panics
    ///
    /// When the layer is configured, never at run time: if `retention` is
    /// under one second or over [`MAX_RETENTION`] (a year).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore};
    ///
    /// // Keep responses for 7 days.
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).retention(Duration::from_secs(7 * 86_400));
    /// # let _ = layer;
    /// ```
    pub fn retention(mut self, retention: Duration) -> Self {
        assert!(
            retention >= Duration::from_secs(1),
            "IdempotencyLayer::retention must be at least 1 s (got {retention:?})"
        );
        assert!(
            retention <= MAX_RETENTION,
            "IdempotencyLayer::retention must be at most MAX_RETENTION (365 days), got {retention:?}: \
             records cannot be kept forever; use the longest time a client may retry"
        );
        self.config.retention = retention;
        self
    }

    /// How long a claim survives without a heartbeat (default 30 s): the
    /// analogue of a queue's visibility timeout. While the handler runs the
    /// lease is extended every third of this period, so a slow handler keeps
    /// its claim and a crashed process loses it within one lease.
    ///
    /// # Panics
    ///
    /// When the layer is configured, never at run time: if `lease` is under
    /// 30 ms (heartbeats could not keep up) or over [`MAX_LEASE`] (a day).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore};
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).lease(Duration::from_secs(10));
    /// # let _ = layer;
    /// ```
    pub fn lease(mut self, lease: Duration) -> Self {
        assert!(
            lease >= Duration::from_millis(30),
            "IdempotencyLayer::lease must be at least 30 ms (got {lease:?})"
        );
        assert!(
            lease <= MAX_LEASE,
            "IdempotencyLayer::lease must be at most MAX_LEASE (24 hours), got {lease:?}: \
             a crashed process blocks its keys this long"
        );
        self.config.lease = lease;
        self
    }

    /// The largest request body the layer buffers to fingerprint (default
    /// 1 MiB); larger requests get `413` and are not run.
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore};
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).max_request_body(64 * 1024);
    /// # let _ = layer;
    /// ```
    pub fn max_request_body(mut self, bytes: usize) -> Self {
        self.config.max_request_body = bytes;
        self
    }

    /// The largest response body the layer stores (default 1 MiB). A larger
    /// response still reaches the client, and the key completes as
    /// unreplayable: retries get `409` saying so, never a second execution.
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore};
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).max_stored_body(256 * 1024);
    /// # let _ = layer;
    /// ```
    pub fn max_stored_body(mut self, bytes: usize) -> Self {
        self.config.max_stored_body = bytes;
        self
    }

    /// Instead of answering `409` at once, let a duplicate of an in-flight
    /// request wait up to `timeout` for the first to finish, then replay its
    /// response (or run, if the first released the key). Still `409` after
    /// the wait.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore};
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).wait_for_in_flight(Duration::from_secs(5));
    /// # let _ = layer;
    /// ```
    pub fn wait_for_in_flight(mut self, timeout: Duration) -> Self {
        self.config.in_flight_wait = Some(timeout);
        self
    }

    /// **Dangerous.** When the store cannot be reached, run the handler
    /// without protection instead of answering `503` (default: fail closed).
    /// Duplicates arriving during an outage may then execute twice.
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore};
    ///
    /// // Only for endpoints where a duplicate is cheaper than an outage.
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).fail_open(true);
    /// # let _ = layer;
    /// ```
    pub fn fail_open(mut self, fail_open: bool) -> Self {
        self.config.fail_open = fail_open;
        self
    }

    /// The `Retry-After` sent with `503` when the store is unreachable
    /// (default 1 s).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore};
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).unavailable_retry_after(Duration::from_secs(5));
    /// # let _ = layer;
    /// ```
    pub fn unavailable_retry_after(mut self, after: Duration) -> Self {
        self.config.unavailable_retry_after = after;
        self
    }

    /// Renders the layer's own rejections (default
    /// [`Rejection::into_problem_response`]).
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore, Rejection};
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).on_rejection(|r: Rejection| {
    ///     let mut response = r.into_problem_response();
    ///     response.headers_mut().insert("x-idempotency-error", "1".parse().unwrap());
    ///     response
    /// });
    /// # let _ = layer;
    /// ```
    pub fn on_rejection<R>(mut self, render: R) -> Self
    where
        R: Fn(Rejection) -> Response<Body> + Send + Sync + 'static,
    {
        self.render = Arc::new(render);
        self
    }

    /// Addresses records by `(scope, key)`, with the scope taken from each
    /// request (typically the authenticated account). See [`ScopeExtractor`].
    pub fn scope_with<Sc2: ScopeExtractor>(self, scope: Sc2) -> IdempotencyLayer<St, Sc2, P, F> {
        IdempotencyLayer {
            store: self.store,
            scope,
            policy: self.policy,
            fingerprint: self.fingerprint,
            config: self.config,
            render: self.render,
        }
    }

    /// Decides which responses are final and stored; see [`CachePolicy`].
    pub fn cache_when<P2: CachePolicy>(self, policy: P2) -> IdempotencyLayer<St, Sc, P2, F> {
        IdempotencyLayer {
            store: self.store,
            scope: self.scope,
            policy,
            fingerprint: self.fingerprint,
            config: self.config,
            render: self.render,
        }
    }

    /// Decides which requests count as the same; see [`FingerprintStrategy`].
    pub fn fingerprint_with<F2: FingerprintStrategy>(
        self,
        fingerprint: F2,
    ) -> IdempotencyLayer<St, Sc, P, F2> {
        IdempotencyLayer {
            store: self.store,
            scope: self.scope,
            policy: self.policy,
            fingerprint,
            config: self.config,
            render: self.render,
        }
    }
}

impl<S, St, Sc, P, F> Layer<S> for IdempotencyLayer<St, Sc, P, F>
where
    St: Store,
    Sc: ScopeExtractor,
    P: CachePolicy,
    F: FingerprintStrategy,
{
    type Service = IdempotencyService<S, St, Sc, P, F>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotencyService::new(
            inner,
            Arc::new(Shared {
                store: self.store.clone(),
                scope: self.scope.clone(),
                policy: self.policy.clone(),
                fingerprint: self.fingerprint.clone(),
                config: self.config.clone(),
                render: self.render.clone(),
            }),
        )
    }
}

impl<St: fmt::Debug, Sc: fmt::Debug, P: fmt::Debug, F: fmt::Debug> fmt::Debug
    for IdempotencyLayer<St, Sc, P, F>
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("store", &self.store)
            .field("scope", &self.scope)
            .field("policy", &self.policy)
            .field("fingerprint", &self.fingerprint)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}
