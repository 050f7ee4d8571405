//! The claim protocol, the one place that decides what a
//! guarded request gets: a replay, a rejection, or an execution.

use std::{sync::Arc, time::Duration};

use axum::body::Body;
use bytes::Bytes;
use http::{HeaderName, HeaderValue, Request, Response, request::Parts};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use tokio::time::Instant;
use tower_service::Service;

use crate::{
    CachePolicy, CompletedRecord, FingerprintStrategy, IdempotencyKey, IdempotencyOutcome,
    RejectionKind, execute,
    layer::Shared,
    lease::Lease,
    store::{Claim, StorageKey, Store},
};

pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The header every replayed response carries.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// A guarded request that passed the synchronous checks.
pub(crate) struct Guarded<B> {
    pub(crate) parts: Parts,
    pub(crate) body: B,
    pub(crate) key: IdempotencyKey,
    pub(crate) scope: String,
}

/// How often a waiting duplicate polls the store, at most.
const MAX_WAIT_POLL: Duration = Duration::from_millis(100);

pub(crate) async fn handle<S, St, Sc, P, F, ReqBody, ResBody>(
    shared: Arc<Shared<St, Sc, P, F>>,
    inner: S,
    request: Guarded<ReqBody>,
) -> Result<Response<Body>, S::Error>
where
    S: Service<Request<Body>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: http_body::Body<Data = Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
    St: Store,
    Sc: Send + Sync + 'static,
    P: CachePolicy,
    F: FingerprintStrategy,
{
    let Guarded {
        parts,
        body,
        key,
        scope,
    } = request;
    let config = &shared.config;
    let body = match read_body(body, config.max_request_body).await {
        Ok(body) => body,
        Err(kind) => return Ok(shared.rejection(kind)),
    };
    let fingerprint = shared.fingerprint.fingerprint(&parts, &body);
    let key = StorageKey::new(&scope, &key);

    let wait_until = config.in_flight_wait.map(|wait| Instant::now() + wait);
    let mut poll_every = Duration::from_millis(5);
    loop {
        match shared.store.claim(&key, &fingerprint, config.lease).await {
            Ok(Claim::Acquired(token)) => {
                let request = Request::from_parts(parts, Body::from(body));
                let lease = Lease::new(shared.store.clone(), key, token, fingerprint, config.lease);
                return execute::detached(shared, inner, request, lease).await;
            }
            Ok(Claim::Completed { record, .. }) => return Ok(replay(&shared, &key, &record)),
            Ok(Claim::Mismatch) => {
                tracing::info!(%key, "idempotency: key reused with different parameters");
                return Ok(shared.rejection(RejectionKind::Mismatch));
            }
            Ok(Claim::InFlight { retry_after }) => match wait_until {
                Some(deadline) if Instant::now() + poll_every <= deadline => {
                    tokio::time::sleep(poll_every).await;
                    poll_every = (poll_every * 2).min(MAX_WAIT_POLL);
                }
                _ => {
                    tracing::debug!(%key, "idempotency: duplicate of an in-flight request");
                    return Ok(shared.rejection(RejectionKind::InFlight { retry_after }));
                }
            },
            Err(error) if config.fail_open => {
                tracing::warn!(%key, %error, "idempotency: store unavailable, running UNPROTECTED (fail-open)");
                let request = Request::from_parts(parts, Body::from(body));
                return execute::unprotected(inner, request).await;
            }
            Err(error) => {
                tracing::error!(%key, %error, "idempotency: store unavailable, request refused (fail closed)");
                let retry_after = config.unavailable_retry_after;
                return Ok(shared.rejection(RejectionKind::StoreUnavailable { retry_after }));
            }
        }
    }
}

/// Buffers the request body up to `limit` bytes; larger is `413`.
async fn read_body<B>(body: B, limit: usize) -> Result<Bytes, RejectionKind>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    if body.size_hint().lower() > limit as u64 {
        return Err(RejectionKind::BodyTooLarge { limit });
    }
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(error) if error.is::<LengthLimitError>() => Err(RejectionKind::BodyTooLarge { limit }),
        Err(_) => Err(RejectionKind::BodyUnreadable),
    }
}

/// The stored status, headers (in order) and body, plus
/// `Idempotent-Replayed: true`.
fn replay<St, Sc, P, F>(
    shared: &Shared<St, Sc, P, F>,
    key: &StorageKey,
    record: &CompletedRecord,
) -> Response<Body> {
    let stored = match record {
        CompletedRecord::Response(stored) => stored,
        CompletedRecord::Unreplayable { status, .. } => {
            tracing::info!(%key, "idempotency: completed but unreplayable");
            return shared.rejection(RejectionKind::Unreplayable { status: *status });
        }
    };
    tracing::debug!(%key, "idempotency: replayed");
    let mut response = Response::new(Body::from(stored.body().clone()));
    *response.status_mut() = stored.status();
    let headers = response.headers_mut();
    headers.reserve(stored.headers().len() + 1);
    for (name, value) in stored.headers() {
        headers.append(name.clone(), value.clone());
    }
    headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    response
        .extensions_mut()
        .insert(IdempotencyOutcome::Replayed);
    response
}
