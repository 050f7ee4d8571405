//! The claim protocol for a keyed request: the one place that decides what it
//! gets — a replay, a rejection, or an execution.

use std::{sync::Arc, time::Duration};

use axum_core::{BoxError, body::Body};
use bytes::Bytes;
use http::{Request, Response, request::Parts};
use tokio::time::Instant;
use tower_service::Service;

use crate::{
    fingerprint::FingerprintStrategy,
    http::buffer::{self, Buffered},
    http::handler,
    http::observe::Throttle,
    http::rejection::RejectionKind,
    http::shared::Shared,
    http::store_policy::StorePolicy,
    key::IdempotencyKey,
    observe,
    protocol::hold::Lease,
    record::CompletedRecord,
    store::{Claim, StorageKey, Store, StoreError},
};

/// A guarded request that passed the synchronous checks: it has a valid key
/// and a scope.
pub(crate) struct KeyedRequest<B> {
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
    request: KeyedRequest<ReqBody>,
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
    P: StorePolicy,
    F: FingerprintStrategy,
{
    let KeyedRequest {
        mut parts,
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
    let storage_key = StorageKey::new(&scope, &key);
    tracing::Span::current().record(
        "idempotency.storage_key",
        tracing::field::display(&storage_key),
    );
    // The handler may use the key, e.g. as the idempotency key of a call to a
    // payment processor downstream.
    parts.extensions.insert(key);
    let key = storage_key;

    let wait_until = config.in_flight_wait.map(|wait| Instant::now() + wait);
    let mut poll_every = Duration::from_millis(5);
    loop {
        let claim = shared.store.claim(&key, &fingerprint, config.lease);
        match observe::store_call("claim", claim).await {
            Ok(Claim::Acquired(token)) => {
                // A transactional store hands the handler its transaction here.
                shared.store.attach(token, &mut parts.extensions);
                let request = Request::from_parts(parts, Body::from(body));
                let lease = Lease::new(shared.store.clone(), key, token, fingerprint, config.lease);
                return handler::detached(shared, inner, request, lease).await;
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
            Err(error) => {
                log_outage(&shared.outage_log, &key, &error, config.fail_open);
                if config.fail_open {
                    let request = Request::from_parts(parts, Body::from(body));
                    return handler::unprotected(inner, request).await;
                }
                let retry_after = config.unavailable_retry_after;
                return Ok(shared.rejection(RejectionKind::StoreUnavailable { retry_after }));
            }
        }
    }
}

/// A store outage: once a second at `WARN` (fail open) or `ERROR` (fail
/// closed), with the number of such requests since; the rest at `DEBUG`.
fn log_outage(throttle: &Throttle, key: &StorageKey, error: &StoreError, fail_open: bool) {
    let what = if fail_open {
        "idempotency: store unavailable, running UNPROTECTED (fail-open)"
    } else {
        "idempotency: store unavailable, request refused (fail closed)"
    };
    match throttle.admit() {
        Some(suppressed) if fail_open => {
            tracing::warn!(%key, %error, suppressed, "{what}; `suppressed` more since the last such line")
        }
        Some(suppressed) => {
            tracing::error!(%key, %error, suppressed, "{what}; `suppressed` more since the last such line")
        }
        None => tracing::debug!(%key, %error, "{what}"),
    }
}

/// Buffers the request body up to `limit` bytes; larger is `413`.
async fn read_body<B>(body: B, limit: usize) -> Result<Bytes, RejectionKind>
where
    B: http_body::Body<Data = Bytes>,
{
    if body.size_hint().lower() > limit as u64 {
        return Err(RejectionKind::BodyTooLarge { limit });
    }
    match buffer::buffer(std::pin::pin!(body), limit).await {
        Buffered::Complete(bytes) => Ok(bytes),
        Buffered::TooLarge(..) => Err(RejectionKind::BodyTooLarge { limit }),
        Buffered::Failed => Err(RejectionKind::BodyUnreadable),
    }
}

/// A completed key's answer: its stored response, or the rejection that says
/// it cannot be replayed.
fn replay<St, Sc, P, F>(
    shared: &Shared<St, Sc, P, F>,
    key: &StorageKey,
    record: &CompletedRecord,
) -> Response<Body> {
    match record {
        CompletedRecord::Response(stored) => {
            tracing::debug!(%key, "idempotency: replayed");
            stored.replay()
        }
        CompletedRecord::Unreplayable { status, .. } => {
            tracing::info!(%key, "idempotency: completed but unreplayable");
            shared.rejection(RejectionKind::Unreplayable { status: *status })
        }
    }
}
