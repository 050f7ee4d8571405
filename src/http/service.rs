//! The middleware service: the cheap, synchronous decisions (method, key,
//! scope).
//! Everything that awaits lives in `crate::http::keyed`.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    task::{Context, Poll},
};

use axum_core::{BoxError, body::Body};
use bytes::Bytes;
use http::{Request, Response};
use tower_service::Service;

use crate::{
    fingerprint::FingerprintStrategy,
    http::future::ResponseFuture,
    http::grpc::Wire,
    http::key_source::InHead,
    http::keyed::{self, KeyAt, KeyedRequest},
    http::observe,
    http::outcome::BypassReason,
    http::rejection::RejectionKind,
    http::scope::ScopeExtractor,
    http::shared::Shared,
    http::store_policy::StorePolicy,
    store::Store,
};

/// Whether a request without a scope was logged: once per process is
/// enough to name the misconfiguration, and no more floods the log.
static NO_SCOPE_SAID: AtomicBool = AtomicBool::new(false);

/// The service produced by [`IdempotencyLayer`](crate::IdempotencyLayer).
///
/// Its responses carry an [`IdempotencyOutcome`](crate::IdempotencyOutcome)
/// extension. A guarded request's handler is detached from the client
/// connection: if the client hangs up, the rest of the work moves to a spawned
/// Tokio task and still completes, so the inner service and its future must be
/// `Send + 'static` (and the service `Clone`), as axum routers are.
pub struct IdempotencyService<S, St, Sc, P, F> {
    inner: S,
    shared: Arc<Shared<St, Sc, P, F>>,
}

impl<S, St, Sc, P, F> IdempotencyService<S, St, Sc, P, F> {
    pub(crate) fn new(inner: S, shared: Arc<Shared<St, Sc, P, F>>) -> Self {
        Self { inner, shared }
    }
}

impl<S: Clone, St, Sc, P, F> Clone for IdempotencyService<S, St, Sc, P, F> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            shared: self.shared.clone(),
        }
    }
}

impl<S: std::fmt::Debug, St, Sc, P, F> std::fmt::Debug for IdempotencyService<S, St, Sc, P, F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyService")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S, St, Sc, P, F, ReqBody, ResBody> Service<Request<ReqBody>>
    for IdempotencyService<S, St, Sc, P, F>
where
    S: Service<Request<Body>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: http_body::Body<Data = Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
    St: Store,
    Sc: ScopeExtractor,
    P: StorePolicy,
    F: FingerprintStrategy,
{
    type Response = Response<Body>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        let config = &self.shared.config;
        if !config.methods.contains(req.method()) {
            return self.bypass(req, BypassReason::UnguardedMethod);
        }
        if config.unguarded_paths.iter().any(|p| p == req.uri().path()) {
            return self.bypass(req, BypassReason::UnguardedPath);
        }
        let wire = Wire::of(req.headers());
        let key = match config.key_source.in_head(req.headers()) {
            InHead::Key(key) => KeyAt::Head(key),
            InHead::InBody => KeyAt::Body,
            InHead::Absent if config.require_key => {
                return self.reject(config.key_source.missing(), wire);
            }
            InHead::Absent => return self.bypass(req, BypassReason::NoKey),
            InHead::Invalid(why) => return self.reject(RejectionKind::InvalidKey(why), wire),
        };
        let (parts, body) = req.into_parts();
        let Some(scope) = self.shared.scope.scope(&parts) else {
            if config.pass_through_without_scope {
                return self.bypass(Request::from_parts(parts, body), BypassReason::NoScope);
            }
            if !NO_SCOPE_SAID.swap(true, Ordering::Relaxed) {
                tracing::error!(
                    path = %parts.uri.path(),
                    "idempotency: a keyed request has no scope (scope_with returned None), so it was refused with 500, not run. \
                     The authentication that identifies the caller must run before the idempotency layer: apply it outside \
                     (in axum, `.layer(auth)` after `.layer(idempotency)`, or on the router above). Anonymous callers that may \
                     pass unprotected: .pass_through_without_scope(). Said once per process."
                );
            }
            return self.reject(RejectionKind::NoScope, wire);
        };
        // The ready service is the one that must be called; leave a fresh
        // clone in its place. See
        // https://docs.rs/tower/latest/tower/trait.Service.html#be-careful-when-cloning-inner-services
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let request = KeyedRequest {
            parts,
            body,
            key,
            scope,
            wire,
        };
        let span = observe::request_span(
            request.key.as_str(),
            self.shared.config.sensitive_keys.is_some(),
        );
        let handled = keyed::handle(self.shared.clone(), inner, request);
        ResponseFuture::keyed(Box::pin(observe::recorded(span, handled)))
    }
}

impl<S, St, Sc, P, F> IdempotencyService<S, St, Sc, P, F> {
    fn bypass<ReqBody, ResBody>(
        &mut self,
        req: Request<ReqBody>,
        reason: BypassReason,
    ) -> ResponseFuture<S::Future, S::Error>
    where
        S: Service<Request<Body>, Response = Response<ResBody>>,
        ReqBody: http_body::Body<Data = Bytes> + Send + 'static,
        ReqBody::Error: Into<BoxError>,
    {
        tracing::trace!(?reason, "idempotency: bypassed");
        ResponseFuture::bypass(self.inner.call(req.map(Body::new)), reason)
    }

    fn reject<E, Fut>(&self, kind: RejectionKind, wire: Wire) -> ResponseFuture<Fut, E> {
        tracing::debug!(?kind, "idempotency: rejected");
        ResponseFuture::ready(self.shared.rejection(kind, wire).stamped())
    }
}
