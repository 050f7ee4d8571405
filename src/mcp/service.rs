//! The MCP door's service: which requests are guarded tool calls, what
//! refuses them before anything runs, and the protocol's answer written as
//! JSON-RPC for the caller's id.

use std::{
    future::Future,
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    task::{Context, Poll},
};

use axum_core::{BoxError, body::Body};
use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header::CONTENT_LENGTH, request::Parts};
use http_body_util::{BodyExt, Full};
use serde_json::value::RawValue;
use tower_service::Service;

use super::{
    answer::{self, Refusal},
    call::{self, Head},
    codes,
    decide::{Decision, Labelled, decide},
    door::{CallFingerprint, Door, ToolCallFingerprint},
    server::{CallId, FinalResponse},
};
use crate::{
    http::{
        Inner,
        grpc::Wire,
        keyed::{self, KeyAt, KeyedRequest},
        observe,
        outcome::{Answered, BypassReason, IdempotencyOutcome},
        rejection::{Rejection, RejectionKind},
        scope::ScopeExtractor,
        shared::Shared,
        store_policy::StorePolicy,
    },
    store::Store,
};

/// Whether a call without a scope was logged: once per process names the
/// misconfiguration.
static NO_SCOPE_SAID: AtomicBool = AtomicBool::new(false);

/// The service produced by [`McpIdempotencyLayer`](super::McpIdempotencyLayer).
///
/// Its responses carry an [`IdempotencyOutcome`] extension, as the HTTP
/// layer's do. A guarded call is detached from the client connection: if
/// the client hangs up, the rest of the call moves to a spawned Tokio task
/// and still completes, so the inner service and its future must be `Send +
/// 'static` (and the service `Clone`).
pub struct McpIdempotencyService<S, St, Sc, P> {
    inner: S,
    shared: Arc<Shared<St, Sc, P, ToolCallFingerprint>>,
    door: Arc<Door>,
}

impl<S, St, Sc, P> McpIdempotencyService<S, St, Sc, P> {
    pub(crate) fn new(
        inner: S,
        shared: Arc<Shared<St, Sc, P, ToolCallFingerprint>>,
        door: Arc<Door>,
    ) -> Self {
        Self {
            inner,
            shared,
            door,
        }
    }
}

impl<S: Clone, St, Sc, P> Clone for McpIdempotencyService<S, St, Sc, P> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            shared: self.shared.clone(),
            door: self.door.clone(),
        }
    }
}

impl<S: std::fmt::Debug, St, Sc, P> std::fmt::Debug for McpIdempotencyService<S, St, Sc, P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("McpIdempotencyService")
            .field("inner", &self.inner)
            .field("door", &self.door)
            .finish_non_exhaustive()
    }
}

type Answer<E> = Pin<Box<dyn Future<Output = Result<Response<Body>, E>> + Send>>;

impl<S, St, Sc, P, ReqBody, ResBody> Service<Request<ReqBody>>
    for McpIdempotencyService<S, St, Sc, P>
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
{
    type Response = Response<Body>;
    type Error = S::Error;
    type Future = Answer<S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        if request.method() != Method::POST {
            return passed(
                self.inner.call(request.map(Body::new)),
                BypassReason::UnguardedMethod,
            );
        }
        let labelled = match call::head(request.headers()) {
            Head::Other => {
                return passed(
                    self.inner.call(request.map(Body::new)),
                    BypassReason::UnguardedMethod,
                );
            }
            Head::Unreadable(why) => {
                let refusal =
                    Refusal::new(codes::HEADER_MISMATCH, why).status(StatusCode::BAD_REQUEST);
                return refused(refusal, None, RejectionKind::BodyUnreadable);
            }
            Head::ToolCall(name) => Labelled::ToolCall(name.map(|n| n.into_owned())),
            Head::Unlabelled => Labelled::No,
        };
        // The ready service is the one that must be called; leave a fresh
        // clone in its place.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        Box::pin(guard(
            self.shared.clone(),
            self.door.clone(),
            inner,
            request,
            labelled,
        ))
    }
}

/// A request the door lets through untouched.
fn passed<F, B, E>(answered: F, reason: BypassReason) -> Answer<E>
where
    F: Future<Output = Result<Response<B>, E>> + Send + 'static,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    tracing::trace!(?reason, "idempotency: bypassed");
    Box::pin(async move {
        let response = answered.await?.map(Body::new);
        Ok(Answered::new(response, IdempotencyOutcome::Bypassed(reason)).stamped())
    })
}

/// A request the door refuses before anything runs.
fn refused<E: Send + 'static>(
    refusal: Refusal,
    id: Option<&RawValue>,
    kind: RejectionKind,
) -> Answer<E> {
    tracing::debug!(?kind, code = refusal.code, "idempotency: rejected");
    let response = Answered::new(
        refusal.into_response(id),
        IdempotencyOutcome::Rejected(kind),
    )
    .stamped();
    Box::pin(std::future::ready(Ok(response)))
}

/// Reads a guarded request's call, refuses it or runs it through the
/// protocol, and writes the protocol's answer for the call's id.
async fn guard<S, St, Sc, P, ReqBody>(
    shared: Arc<Shared<St, Sc, P, ToolCallFingerprint>>,
    door: Arc<Door>,
    mut inner: S,
    request: Request<ReqBody>,
    labelled: Labelled,
) -> Result<Response<Body>, S::Error>
where
    S: Inner,
    ReqBody: http_body::Body<Data = Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    St: Store,
    Sc: ScopeExtractor,
    P: StorePolicy,
{
    let (mut parts, body) = request.into_parts();
    let bytes = match keyed::read_body(body, shared.config.max_request_body).await {
        Ok(bytes) => bytes,
        Err(kind) => return refused(refusal_of(&kind), None, kind).await,
    };
    let mut pass = |parts: Parts, bytes: Bytes, reason| {
        passed(
            inner.call(Request::from_parts(parts, Body::from(bytes))),
            reason,
        )
    };
    let (key, id, fingerprint) = match decide(&bytes, &labelled, &door) {
        Decision::Pass(reason) => return pass(parts, bytes, reason).await,
        Decision::Refuse { refusal, id, kind } => return refused(refusal, id, kind).await,
        Decision::Guard {
            key,
            id,
            fingerprint,
        } => (key, id, fingerprint),
    };
    let Some(scope) = shared.scope.scope(&parts) else {
        if shared.config.pass_through_without_scope {
            return pass(parts, bytes, BypassReason::NoScope).await;
        }
        if !NO_SCOPE_SAID.swap(true, Ordering::Relaxed) {
            tracing::error!(
                "idempotency: a keyed tools/call has no scope (scope_with returned None), so it was refused, not run. \
                 The authentication that identifies the caller must run before the MCP door: apply it outside. \
                 Said once per process."
            );
        }
        let refusal = Refusal::new(
            codes::INTERNAL_ERROR,
            "the server could not tell whose call this is, so it did not run it",
        );
        return refused(refusal, Some(&id), RejectionKind::NoScope).await;
    };
    parts.extensions.insert(CallFingerprint(fingerprint));
    parts.extensions.insert(CallId(id.clone()));
    let span = observe::request_span(key.as_str(), shared.config.sensitive_keys.is_some());
    let request = KeyedRequest {
        parts,
        body: Full::new(bytes),
        key: KeyAt::Head(key),
        scope,
        wire: Wire::Http,
    };
    let handled = keyed::handle(shared, FinalResponse(inner), request);
    let response = observe::recorded(span, handled).await?;
    Ok(for_caller(response, &id).await)
}

/// The protocol's answer, written for the call `id`: a replay with the
/// caller's own id, a refusal as a JSON-RPC error; an execution as it is
/// (the server's final response, to this very id).
async fn for_caller(response: Response<Body>, id: &RawValue) -> Response<Body> {
    let Some(outcome) = response.extensions().get::<IdempotencyOutcome>().cloned() else {
        return response;
    };
    match outcome {
        IdempotencyOutcome::Replayed => {
            let (mut parts, body) = response.into_parts();
            let stored = match body.collect().await {
                Ok(stored) => stored.to_bytes(),
                Err(_) => Bytes::new(),
            };
            match answer::for_retry(&stored, id) {
                Some(written) => {
                    parts.headers.remove(CONTENT_LENGTH);
                    Response::from_parts(parts, Body::from(written))
                }
                // The key holds another door's record (an HTTP response, a
                // message): the same store and scope serve every door.
                None => {
                    let refusal = Refusal::new(
                        codes::UNREPLAYABLE,
                        "this idempotency key holds another kind of record, not a tool call's answer: use a new key",
                    );
                    Answered::new(
                        refusal.into_response(Some(id)),
                        IdempotencyOutcome::Rejected(RejectionKind::Unreplayable {
                            status: StatusCode::OK,
                        }),
                    )
                    .stamped()
                }
            }
        }
        IdempotencyOutcome::Rejected(kind) => {
            let refusal = refusal_of(&kind);
            Answered::new(
                refusal.into_response(Some(id)),
                IdempotencyOutcome::Rejected(kind),
            )
            .stamped()
        }
        _ => response,
    }
}

/// The protocol's rejection, as the door's JSON-RPC error.
fn refusal_of(kind: &RejectionKind) -> Refusal {
    match kind {
        RejectionKind::Mismatch => Refusal::new(
            codes::KEY_REUSED,
            "this idempotency key was first used for another tool or other arguments, so the call was not run: a new call needs a new key",
        ),
        RejectionKind::InFlight { retry_after } => Refusal::new(
            codes::IN_FLIGHT,
            format!(
                "a call with this idempotency key is still running, so this one was not run: re-send it with the same key in {} ms",
                retry_after.as_millis()
            ),
        )
        .retry_after(*retry_after),
        RejectionKind::StoreUnavailable { retry_after } => Refusal::new(
            codes::STORE_UNAVAILABLE,
            format!(
                "the idempotency store cannot be reached, so the call was not run: re-send it with the same key in {} ms",
                retry_after.as_millis()
            ),
        )
        .retry_after(*retry_after),
        RejectionKind::Unreplayable { .. } => Refusal::new(
            codes::UNREPLAYABLE,
            "the call under this idempotency key completed, but its answer was too large to keep: it will not run again",
        ),
        RejectionKind::BodyTooLarge { limit } => Refusal::new(
            codes::INVALID_REQUEST,
            format!("the request body is larger than this server's limit of {limit} bytes"),
        )
        .status(StatusCode::PAYLOAD_TOO_LARGE),
        RejectionKind::BodyUnreadable => {
            Refusal::new(codes::INVALID_REQUEST, "the request body could not be read")
                .status(StatusCode::BAD_REQUEST)
        }
        RejectionKind::InvalidKey(why) => {
            Refusal::new(codes::INVALID_PARAMS, format!("the idempotency key is not valid: {why}"))
        }
        other => {
            let rejection = Rejection::new(other.clone());
            Refusal::new(
                codes::INTERNAL_ERROR,
                format!("{}: {}", rejection.title(), rejection.detail()),
            )
        }
    }
}
