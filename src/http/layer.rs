//! The layer and its configuration.

use std::{fmt, sync::Arc, time::Duration};

use axum_core::body::Body;
use http::{HeaderName, Method, Response};
use tower_layer::Layer;

use crate::{
    fingerprint::{DefaultFingerprint, FingerprintStrategy},
    http::key_source::KeySource,
    http::observe::Throttle,
    http::rejection::Rejection,
    http::scope::{NoScope, ScopeExtractor, ScopeNotChosen},
    http::service::IdempotencyService,
    http::shared::{Config, Shared},
    http::store_policy::{DefaultStorePolicy, StorePolicy},
    key::IDEMPOTENCY_KEY,
    protocol,
    store::{SensitiveKeys, Store},
};

/// Applies Stripe-style `Idempotency-Key` semantics to the requests of a
/// service: the first response under a key is stored and replayed to every
/// retry, a key reused with different parameters is rejected, and two copies
/// of one request never run at once.
///
/// The layer holds its configuration behind one `Arc`: cloning it, or applying
/// it to many routes, shares that configuration (and the throttle of its
/// outage logs) instead of copying it. The records live in the [`Store`],
/// which clones share.
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
///
/// A layer must be told whose keys it guards — a forgotten scope would
/// replay one tenant's response to another — so one without
/// [`scope_with`](Self::scope_with) or
/// [`single_tenant`](Self::single_tenant) guards nothing; it does not
/// compile:
///
/// ```compile_fail
/// use axum::{Router, routing::post};
/// use tower_idempotency::{IdempotencyLayer, MemoryStore};
///
/// let app: Router = Router::new()
///     .route("/v1/charges", post(|| async { "charged" }))
///     .layer(IdempotencyLayer::new(MemoryStore::new()));
/// ```
pub struct IdempotencyLayer<St, Sc = ScopeNotChosen, P = DefaultStorePolicy, F = DefaultFingerprint>
{
    shared: Arc<Shared<St, Sc, P, F>>,
}

impl<St, Sc, P, F> Clone for IdempotencyLayer<St, Sc, P, F> {
    fn clone(&self) -> Self {
        Self {
            shared: self.shared.clone(),
        }
    }
}

impl<St: Store> IdempotencyLayer<St> {
    /// A layer over `store` with the defaults: guards `POST` and
    /// `PATCH`, key optional, 24 h retention, 30 s lease, 1 MiB request and
    /// stored-response limits, `409` for in-flight duplicates, fail closed.
    /// Choose its scope before it guards anything:
    /// [`scope_with`](Self::scope_with) or
    /// [`single_tenant`](Self::single_tenant).
    pub fn new(store: St) -> Self {
        let shared = Shared {
            store,
            scope: ScopeNotChosen,
            policy: DefaultStorePolicy,
            fingerprint: DefaultFingerprint::new(),
            config: Config {
                methods: vec![Method::POST, Method::PATCH],
                unguarded_paths: Vec::new(),
                key_source: KeySource::Header(IDEMPOTENCY_KEY),
                require_key: false,
                pass_through_without_scope: false,
                retention: protocol::DEFAULT_RETENTION,
                retention_header: false,
                sensitive_keys: None,
                namespace: None,
                lease: protocol::DEFAULT_LEASE,
                max_request_body: 1024 * 1024,
                max_stored_body: 1024 * 1024,
                in_flight_wait: None,
                fail_open: false,
                unavailable_retry_after: Duration::from_secs(1),
                in_flight_retry_after: protocol::DEFAULT_IN_FLIGHT_HINT,
                documentation: None,
            },
            render: Arc::new(Rejection::into_problem_response),
            outage_log: Arc::new(Throttle::new(Duration::from_secs(1))),
        };
        Self {
            shared: Arc::new(shared),
        }
    }
}

impl<St: Clone, Sc: Clone, P: Clone, F: Clone> IdempotencyLayer<St, Sc, P, F> {
    /// The configuration, to change while the layer is being built (copied
    /// first only if the layer was cloned before).
    fn config(&mut self) -> &mut Config {
        &mut Arc::make_mut(&mut self.shared).config
    }

    /// The same layer with one part of another type.
    fn rebuild<Sc2, P2, F2>(
        self,
        f: impl FnOnce(Shared<St, Sc, P, F>) -> Shared<St, Sc2, P2, F2>,
    ) -> IdempotencyLayer<St, Sc2, P2, F2> {
        IdempotencyLayer {
            shared: Arc::new(f(Arc::unwrap_or_clone(self.shared))),
        }
    }

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
        self.config().methods = methods.into_iter().collect();
        assert!(
            !self.config().methods.is_empty(),
            "IdempotencyLayer::methods: guard at least one method"
        );
        self
    }

    /// Paths whose requests pass through untouched, whatever their method
    /// and key: a gRPC service's streaming methods
    /// (`/package.Service/Method`), which this layer does not guard. A
    /// guarded call is buffered whole, request and response, before anything
    /// is sent on; a long-lived stream must not be. Without a key, a
    /// streaming call passes through anyway, unless the key is
    /// [required](Self::require_key).
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore};
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .require_key(true)
    ///     .unguarded_paths(["/payments.v1.Payments/WatchCharges"]);
    /// # let _ = layer;
    /// ```
    pub fn unguarded_paths<I>(mut self, paths: I) -> Self
    where
        I: IntoIterator,
        I::Item: Into<String>,
    {
        self.config().unguarded_paths = paths.into_iter().map(Into::into).collect();
        self
    }

    /// The request header that carries the key (default `Idempotency-Key`),
    /// and the metadata entry of a gRPC call (`idempotency-key`). Keys come
    /// from one place: this replaces [`key_from_body`](Self::key_from_body)
    /// when called after it.
    ///
    /// # Examples
    ///
    /// ```
    /// use http::HeaderName;
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore};
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .header_name(HeaderName::from_static("x-request-key"));
    /// # let _ = layer;
    /// ```
    pub fn header_name(mut self, name: HeaderName) -> Self {
        self.config().key_source = KeySource::Header(name);
        self
    }

    /// Takes the key from the JSON body, at the JSON Pointer `pointer`,
    /// instead of a header: for webhook receivers, whose provider names
    /// each event in its body (a Stripe event's `/id`) and redelivers it
    /// until it gets a 2xx. The value must be a string that is a valid key;
    /// the key header is then not read (until a later
    /// [`header_name`](Self::header_name)).
    /// A body without one is refused with `400` when the key is
    /// [required](Self::require_key), and passes through unprotected
    /// otherwise. Redeliveries carry new timestamps and signatures in their
    /// headers, which the fingerprint does not read: it is the method, the
    /// path, the query and the body, as for any request. For a provider
    /// that names its events in a header (`webhook-id` in Standard
    /// Webhooks, `X-GitHub-Delivery`), use [`header_name`](Self::header_name).
    ///
    /// # Panics
    ///
    /// When configured, never at run time: when `pointer` is neither empty
    /// nor starts with `/`.
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore};
    ///
    /// // `{"id": "evt_1", "type": "charge.succeeded", …}`: one execution per event.
    /// let webhooks = IdempotencyLayer::new(MemoryStore::new())
    ///     .key_from_body("/id")
    ///     .require_key(true);
    /// # let _ = webhooks;
    /// ```
    pub fn key_from_body(mut self, pointer: &str) -> Self {
        assert!(
            pointer.is_empty() || pointer.starts_with('/'),
            "IdempotencyLayer::key_from_body: {pointer:?} is not a JSON Pointer (RFC 6901): start it with `/`"
        );
        self.config().key_source = KeySource::Body(pointer.into());
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
        self.config().require_key = require;
        self
    }

    /// How long a completed response is kept for replay (default 24 hours).
    /// Stores keep it exactly this long, never shorter.
    ///
    /// # Panics
    ///
    /// When the layer is configured, never at run time: if `retention` is
    /// under one second or over [`MAX_RETENTION`](crate::MAX_RETENTION) (a year).
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
        self.config().retention =
            protocol::checked_retention(retention, "IdempotencyLayer::retention");
        self
    }

    /// Tells clients how long an answer will be replayed: a stored first
    /// execution and each replay carry
    /// [`Idempotency-Replayable-For`](crate::IDEMPOTENCY_REPLAYABLE_FOR) —
    /// the seconds its record has left (the retention, on the first
    /// answer). An answer that will not be replayed (released, refused,
    /// unreplayable) carries none, which tells a client that a retry
    /// executes again. Off by default: the header is one more line on every
    /// stored answer, and says how long the server keeps records.
    ///
    /// After its record expires, a key is new: a retry with it executes
    /// again, as at Stripe. Answering `410 Gone` instead would mean keeping
    /// a trace of every key for longer than its record — the cost the
    /// retention exists to bound — so the layer does not offer it; clients
    /// that may retry late should read this header and use a new key past
    /// it only after checking the operation's own state.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore};
    ///
    /// // `Idempotency-Replayable-For: 86400` on a first answer.
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .single_tenant()
    ///     .retention(Duration::from_secs(86_400))
    ///     .retention_header(true);
    /// # let _ = layer;
    /// ```
    pub fn retention_header(mut self, on: bool) -> Self {
        self.config().retention_header = on;
        self
    }

    /// Keeps this layer's records apart from every other scope's in the
    /// store: its scopes live in `namespace`, so no scope any other layer
    /// (or processor) gives — an account that names itself after this
    /// layer's scope, say — can address one of its records. For a route
    /// whose scope is of another kind than the accounts': a webhook
    /// provider's events, keyed by the provider's event id.
    ///
    /// Changing a layer's namespace (adding one included) addresses its
    /// records anew: keys completed before are not found after the change.
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore};
    ///
    /// // The card processor's webhooks, beside the accounts' charges in one store.
    /// let webhooks = IdempotencyLayer::new(MemoryStore::new())
    ///     .namespace("webhooks:processor")
    ///     .single_tenant()
    ///     .key_from_body("/id");
    /// # let _ = webhooks;
    /// ```
    pub fn namespace(mut self, namespace: impl Into<String>) -> Self {
        self.config().namespace = Some(namespace.into().into());
        self
    }

    /// Keeps idempotency keys out of spans and logs, for APIs whose keys may
    /// carry customer data (an order reference, an email): each key is
    /// shown there only as a digest of its scope and key — an HMAC under
    /// the application's secret ([`SensitiveKeys::keyed`]: `hmac:` and 16
    /// hex digits), or, chosen explicitly, a plain SHA-256
    /// ([`SensitiveKeys::unkeyed`]: `sha256:`), which a guessable key
    /// (`order-42`) does not survive. The digest is the same on every line
    /// about the key, and what [`SensitiveKeys::show`] and the operator
    /// CLI's `inspect` (with `--log-secret`) print, so an operator can
    /// still find it. Off by default.
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore, SensitiveKeys};
    ///
    /// let secret = std::env::var("LOG_KEY_SECRET").unwrap_or_else(|_| "dev only, 16+ bytes".into());
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .single_tenant()
    ///     .sensitive_keys(SensitiveKeys::keyed(secret));
    /// # let _ = layer;
    /// ```
    pub fn sensitive_keys(mut self, how: SensitiveKeys) -> Self {
        self.config().sensitive_keys = Some(how);
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
    /// 30 ms (heartbeats could not keep up) or over [`MAX_LEASE`](crate::MAX_LEASE) (a day).
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
        self.config().lease = protocol::checked_lease(lease, "IdempotencyLayer::lease");
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
        self.config().max_request_body = bytes;
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
        self.config().max_stored_body = bytes;
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
        self.config().in_flight_wait = Some(timeout);
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
        self.config().fail_open = fail_open;
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
        self.config().unavailable_retry_after = after;
        self
    }

    /// The `Retry-After` (gRPC: `grpc-retry-pushback-ms`) sent with the
    /// `409` a duplicate of a request still running gets, at most (default
    /// 1 s). The store knows only when the running request's lease runs out
    /// — up to a whole lease (30 s) — not when its work ends; a client that
    /// honours a hint that long waits far longer than most work takes. A
    /// lease about to run out (its holder crashed) shortens the hint.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore};
    ///
    /// // Charges take about 3 s.
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).in_flight_retry_after(Duration::from_secs(3));
    /// # let _ = layer;
    /// ```
    pub fn in_flight_retry_after(mut self, after: Duration) -> Self {
        self.config().in_flight_retry_after = after;
        self
    }

    /// Publishes the API's idempotency policy at `url` (its key format,
    /// retention, what each status means): every rejection the layer makes
    /// — `400`, `409`, `413`, `422`, and the `503` it answers for the store —
    /// carries `Link: <url>; rel="describedby"`, and its problem+json `type`
    /// points into it (`url#key-reused`), as the IETF draft on the
    /// `Idempotency-Key` header asks of servers.
    ///
    /// # Panics
    ///
    /// When configured: if `url` cannot be written into a header.
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore};
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .documentation("https://docs.example.com/api/idempotency");
    /// # let _ = layer;
    /// ```
    pub fn documentation(mut self, url: &str) -> Self {
        assert!(
            crate::http::rejection::described_by(url).is_ok(),
            "IdempotencyLayer::documentation: {url:?} cannot be written into a Link header"
        );
        self.config().documentation = Some(url.into());
        self
    }

    /// Renders the layer's own rejections to HTTP callers (default
    /// [`Rejection::into_problem_response`]). gRPC callers always get
    /// [`Rejection::into_grpc_response`]: a status is all they can read.
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
        Arc::make_mut(&mut self.shared).render = Arc::new(render);
        self
    }

    /// Lets a keyed request whose scope is `None` pass through unprotected
    /// (outcome [`Bypassed`](crate::IdempotencyOutcome::Bypassed)) instead of
    /// refusing it with `500`: for an API whose anonymous callers may send
    /// keys that nobody needs to honour. **Dangerous** where the scope is
    /// `None` because the authentication runs after the layer: every request
    /// then runs unprotected.
    ///
    /// # Examples
    ///
    /// ```
    /// use http::request::Parts;
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore};
    ///
    /// #[derive(Clone)]
    /// struct AccountId(String);
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .scope_with(|parts: &Parts| parts.extensions.get::<AccountId>().map(|a| a.0.clone()))
    ///     // Guest checkout: no account, no protection.
    ///     .pass_through_without_scope();
    /// # let _ = layer;
    /// ```
    pub fn pass_through_without_scope(mut self) -> Self {
        self.config().pass_through_without_scope = true;
        self
    }

    /// Addresses every record by its key alone: one global scope, for a
    /// service whose callers are all the same party (an internal service,
    /// a single merchant's backend). Say so explicitly: on an API with
    /// more than one tenant, two callers that pick the same key would
    /// receive each other's responses — use
    /// [`scope_with`](Self::scope_with) there.
    ///
    /// # Examples
    ///
    /// ```
    /// use axum::{Router, routing::post};
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore};
    ///
    /// let app: Router = Router::new()
    ///     .route("/internal/transfers", post(|| async { "moved" }))
    ///     .layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant());
    /// ```
    pub fn single_tenant(self) -> IdempotencyLayer<St, NoScope, P, F> {
        self.scope_with(NoScope)
    }

    /// Addresses records by `(scope, key)`, with the scope taken from each
    /// request (typically the authenticated account, which your
    /// authentication middleware — applied *outside* this layer, so that
    /// it runs first — puts in the request's extensions). A request whose
    /// scope is `None` is refused (see [`ScopeExtractor`]). See also
    /// [`single_tenant`](Self::single_tenant).
    pub fn scope_with<Sc2: ScopeExtractor>(self, scope: Sc2) -> IdempotencyLayer<St, Sc2, P, F> {
        self.rebuild(|s| Shared {
            scope,
            store: s.store,
            policy: s.policy,
            fingerprint: s.fingerprint,
            config: s.config,
            render: s.render,
            outage_log: s.outage_log,
        })
    }

    /// Decides which responses are final and stored; see [`StorePolicy`].
    pub fn store_when<P2: StorePolicy>(self, policy: P2) -> IdempotencyLayer<St, Sc, P2, F> {
        self.rebuild(|s| Shared {
            policy,
            store: s.store,
            scope: s.scope,
            fingerprint: s.fingerprint,
            config: s.config,
            render: s.render,
            outage_log: s.outage_log,
        })
    }

    /// Decides which requests count as the same; see [`FingerprintStrategy`].
    pub fn fingerprint_with<F2: FingerprintStrategy>(
        self,
        fingerprint: F2,
    ) -> IdempotencyLayer<St, Sc, P, F2> {
        self.rebuild(|s| Shared {
            fingerprint,
            store: s.store,
            scope: s.scope,
            policy: s.policy,
            config: s.config,
            render: s.render,
            outage_log: s.outage_log,
        })
    }
}

#[cfg(feature = "mcp")]
impl<St: Clone, Sc: Clone, P: Clone> IdempotencyLayer<St, Sc, P, DefaultFingerprint> {
    /// What another door over the same protocol reads: this layer's store,
    /// scope, policy and settings, with the door's own fingerprint.
    pub(crate) fn into_shared<F2>(self, fingerprint: F2) -> Arc<Shared<St, Sc, P, F2>> {
        self.rebuild(|s| Shared {
            store: s.store,
            scope: s.scope,
            policy: s.policy,
            fingerprint,
            config: s.config,
            render: s.render,
            outage_log: s.outage_log,
        })
        .shared
    }
}

impl<St, Sc, P, F> IdempotencyLayer<St, Sc, P, F> {
    /// Wraps `inner`, as [`Layer::layer`] does — an inherent method, so
    /// that on a layer whose scope is not chosen the compiler asks for
    /// [`scope_with`](Self::scope_with) or
    /// [`single_tenant`](Self::single_tenant) rather than saying only that
    /// the trait's bounds are not met.
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore};
    ///
    /// let inner = tower::service_fn(|_: http::Request<axum::body::Body>| async {
    ///     Ok::<_, std::convert::Infallible>(http::Response::new(axum::body::Body::empty()))
    /// });
    /// let service = IdempotencyLayer::new(MemoryStore::new()).single_tenant().layer(inner);
    /// # let _ = service;
    /// ```
    pub fn layer<S>(&self, inner: S) -> IdempotencyService<S, St, Sc, P, F>
    where
        St: Store,
        Sc: ScopeExtractor,
        P: StorePolicy,
        F: FingerprintStrategy,
    {
        IdempotencyService::new(inner, self.shared.clone())
    }
}

impl<S, St, Sc, P, F> Layer<S> for IdempotencyLayer<St, Sc, P, F>
where
    St: Store,
    Sc: ScopeExtractor,
    P: StorePolicy,
    F: FingerprintStrategy,
{
    type Service = IdempotencyService<S, St, Sc, P, F>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotencyLayer::layer(self, inner)
    }
}

impl<St: fmt::Debug, Sc: fmt::Debug, P: fmt::Debug, F: fmt::Debug> fmt::Debug
    for IdempotencyLayer<St, Sc, P, F>
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let shared = &*self.shared;
        f.debug_struct("IdempotencyLayer")
            .field("store", &shared.store)
            .field("scope", &shared.scope)
            .field("policy", &shared.policy)
            .field("fingerprint", &shared.fingerprint)
            .field("config", &shared.config)
            .finish_non_exhaustive()
    }
}
