//! A keyed request's way through the protocol: the one place that decides
//! what it gets — a replay, a rejection, or an execution.

use std::{sync::Arc, time::Duration};

use axum_core::{BoxError, body::Body};
use bytes::Bytes;
use http::{Request, request::Parts};
use tokio::time::Instant;

use crate::{
    fingerprint::FingerprintStrategy,
    http::{
        Inner,
        buffer::{self, Buffered},
        grpc::{self, Wire},
        handler,
        observe::{self, Throttle},
        outcome::{Answered, BypassReason, IdempotencyOutcome},
        rejection::RejectionKind,
        replay,
        shared::Shared,
        store_policy::StorePolicy,
    },
    key::IdempotencyKey,
    protocol::{self, Claimed, Wait},
    store::{StorageKey, Store, StoreError},
};

/// A guarded request that passed the synchronous checks: it has a valid key
/// (or one to read from its body) and a scope.
pub(crate) struct KeyedRequest<B> {
    pub(crate) parts: Parts,
    pub(crate) body: B,
    pub(crate) key: KeyAt,
    pub(crate) scope: String,
    pub(crate) wire: Wire,
}

/// Where a keyed request's key is.
pub(crate) enum KeyAt {
    /// In a header, read and valid.
    Head(IdempotencyKey),
    /// At the layer's JSON Pointer into the body, read once it is buffered.
    Body,
}

impl KeyAt {
    /// The key as given, where it is known before the body is read.
    pub(crate) fn as_str(&self) -> &str {
        match self {
            Self::Head(key) => key.as_str(),
            Self::Body => "",
        }
    }
}

/// How often a waiting duplicate polls the store, at most.
const MAX_WAIT_POLL: Duration = Duration::from_millis(100);

/// Buffers and fingerprints the request, claims its key, and answers:
/// a replay, a rejection, or the handler's response under the claim.
pub(crate) async fn handle<S, St, Sc, P, F, ReqBody>(
    shared: Arc<Shared<St, Sc, P, F>>,
    inner: S,
    request: KeyedRequest<ReqBody>,
) -> Result<Answered, S::Error>
where
    S: Inner,
    ReqBody: http_body::Body<Data = Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
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
        wire,
    } = request;
    let config = &shared.config;
    let body = match read_body(body, config.max_request_body).await {
        Ok(body) => body,
        Err(kind) => return Ok(shared.rejection(kind, wire)),
    };
    // A gRPC call is compared by its messages, decoded: the same message
    // compressed another way, or not at all, is the same request.
    let messages = match wire {
        Wire::Http => body.clone(),
        Wire::Grpc => match grpc::decoded(&parts.headers, &body, config.max_request_body) {
            Ok(messages) => messages,
            Err(kind) => return Ok(shared.rejection(kind, wire)),
        },
    };
    let key = match key {
        KeyAt::Head(key) => key,
        KeyAt::Body => match config.key_source.in_body(&body) {
            Ok(key) => {
                if config.sensitive_keys.is_none() {
                    tracing::Span::current()
                        .record("idempotency.key", tracing::field::display(&key));
                }
                key
            }
            Err(None) if !config.require_key => {
                let request = Request::from_parts(parts, Body::from(body));
                let outcome = IdempotencyOutcome::Bypassed(BypassReason::NoKey);
                return handler::unclaimed(inner, request, outcome).await;
            }
            Err(None) => return Ok(shared.rejection(config.key_source.missing(), wire)),
            Err(Some(why)) => return Ok(shared.rejection(RejectionKind::InvalidKey(why), wire)),
        },
    };
    let fingerprint = shared.fingerprint.fingerprint(&parts, &messages);
    let storage_key = match &config.namespace {
        None => StorageKey::new(&scope, &key),
        Some(namespace) => StorageKey::namespaced(namespace, &scope, &key),
    };
    let storage_key = match &config.sensitive_keys {
        Some(how) => storage_key.sensitive(how),
        None => storage_key,
    };
    observe::record_key(&tracing::Span::current(), &storage_key);
    // The handler may use the key, e.g. as the idempotency key of a call to a
    // payment processor downstream.
    parts.extensions.insert(key);
    let key = storage_key;

    let wait_until = config.in_flight_wait.map(|wait| Instant::now() + wait);
    let mut poll_every = Duration::from_millis(5);
    loop {
        let claimed = protocol::claim(
            &shared.store,
            key.clone(),
            fingerprint,
            config.lease,
            config.in_flight_retry_after,
            Wait::Bounded,
        );
        match claimed.await {
            Claimed::Granted(hold) => {
                let request = Request::from_parts(parts, Body::from(body));
                return handler::detached(shared, inner, request, hold, wire).await;
            }
            Claimed::Completed { record, expires_in } => {
                let accept = parts.headers.get(http::header::ACCEPT_ENCODING);
                return Ok(replay::answer(
                    &shared, &key, &record, expires_in, wire, accept,
                ));
            }
            Claimed::Mismatch => return Ok(shared.rejection(RejectionKind::Mismatch, wire)),
            Claimed::InFlight { retry_after } => match wait_until {
                Some(deadline) if Instant::now() + poll_every <= deadline => {
                    tokio::time::sleep(poll_every).await;
                    poll_every = (poll_every * 2).min(MAX_WAIT_POLL);
                }
                _ => return Ok(shared.rejection(RejectionKind::InFlight { retry_after }, wire)),
            },
            Claimed::Unavailable(error) => {
                log_outage(&shared.outage_log, &key, &error, config.fail_open);
                if config.fail_open {
                    let request = Request::from_parts(parts, Body::from(body));
                    return handler::unclaimed(inner, request, IdempotencyOutcome::Unprotected)
                        .await;
                }
                let retry_after = config.unavailable_retry_after;
                return Ok(shared.rejection(RejectionKind::StoreUnavailable { retry_after }, wire));
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
pub(crate) async fn read_body<B>(body: B, limit: usize) -> Result<Bytes, RejectionKind>
where
    B: http_body::Body<Data = Bytes>,
{
    if body.size_hint().lower() > limit as u64 {
        return Err(RejectionKind::BodyTooLarge { limit });
    }
    match buffer::buffer(std::pin::pin!(body), limit).await {
        Buffered::Complete(bytes, _trailers) => Ok(bytes),
        Buffered::TooLarge(..) => Err(RejectionKind::BodyTooLarge { limit }),
        Buffered::Failed => Err(RejectionKind::BodyUnreadable),
    }
}
