//! A completed key's answer to a retry: its stored response, replayed, or
//! the rejection that says it cannot be.

use std::time::Duration;

use axum_core::body::Body;
use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Response, header::CONTENT_ENCODING};

use crate::{
    http::{
        buffer, encoding,
        grpc::Wire,
        outcome::{Answered, IdempotencyOutcome},
        rejection::RejectionKind,
        shared::{Config, Shared},
    },
    record::{CompletedRecord, StoredResponse},
    store::StorageKey,
};

/// The header every replayed response carries: `Idempotent-Replayed: true`.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// The header that tells a client how many more seconds an answer will be
/// replayed to a retry with its key, when the layer is asked to
/// ([`IdempotencyLayer::retention_header`](crate::IdempotencyLayer::retention_header)):
/// `Idempotency-Replayable-For: 86400`.
pub const IDEMPOTENCY_REPLAYABLE_FOR: HeaderName =
    HeaderName::from_static("idempotency-replayable-for");

/// Adds `Idempotency-Replayable-For` to an answer the store keeps for
/// `left`, when the layer says so; nothing when the store does not know
/// (zero) or keeps it longer than a client could use (a custom store's
/// `Duration::MAX`).
pub(crate) fn tell_retention(config: &Config, response: &mut Response<Body>, left: Duration) {
    if config.retention_header && !left.is_zero() && left <= MAX_TOLD {
        response.headers_mut().insert(
            IDEMPOTENCY_REPLAYABLE_FOR,
            HeaderValue::from(left.as_secs()),
        );
    }
}

/// Ten years: beyond it, a store's expiry is no expiry a client can use.
const MAX_TOLD: Duration = Duration::from_secs(10 * 365 * 86_400);

/// A completed key's answer, to a retry that accepts the content codings
/// `accept` names; its record is kept for `expires_in` more.
pub(crate) fn answer<St, Sc, P, F>(
    shared: &Shared<St, Sc, P, F>,
    key: &StorageKey,
    record: &CompletedRecord,
    expires_in: Duration,
    wire: Wire,
    accept: Option<&HeaderValue>,
) -> Answered {
    match record {
        CompletedRecord::Response(stored) => {
            let decoded = match encoding::for_retry(stored.headers(), stored.body(), accept) {
                Ok(decoded) => decoded,
                Err(coding) => {
                    tracing::warn!(%key, %coding, "idempotency: the stored response's coding is not one the retry accepts");
                    return shared.rejection(RejectionKind::NotAcceptable { coding }, wire);
                }
            };
            tracing::debug!(%key, "idempotency: replayed");
            let mut response = replay(stored, decoded);
            tell_retention(&shared.config, &mut response, expires_in);
            Answered::new(response, IdempotencyOutcome::Replayed)
        }
        CompletedRecord::Unreplayable { status, .. } => {
            tracing::info!(%key, "idempotency: completed but unreplayable");
            shared.rejection(RejectionKind::Unreplayable { status: *status }, wire)
        }
        // A message's record under an HTTP key: the same store and scope
        // serve both doors. It cannot be replayed as a response.
        CompletedRecord::Message { .. } => {
            tracing::warn!(%key, "idempotency: the key holds a processed message, not a response");
            shared.rejection(
                RejectionKind::Unreplayable {
                    status: http::StatusCode::OK,
                },
                wire,
            )
        }
    }
}

/// The response a retry receives: the stored status, headers (in order),
/// body and trailers, plus `Idempotent-Replayed: true` — with the body
/// `decoded` from its content coding, if given, and then no
/// `Content-Encoding`.
fn replay(stored: &StoredResponse, decoded: Option<Bytes>) -> Response<Body> {
    let trailers = (!stored.trailers().is_empty()).then(|| {
        let mut trailers = HeaderMap::with_capacity(stored.trailers().len());
        append(&mut trailers, stored.trailers());
        trailers
    });
    let is_decoded = decoded.is_some();
    let body = decoded.unwrap_or_else(|| stored.body().clone());
    let mut response = Response::new(buffer::body(body, trailers));
    *response.status_mut() = stored.status();
    let headers = response.headers_mut();
    headers.reserve(stored.headers().len() + 1);
    append(headers, stored.headers());
    if is_decoded {
        headers.remove(CONTENT_ENCODING);
    }
    headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    response
}

/// Appends stored headers (or trailers) in their order, repeated names kept.
fn append(map: &mut HeaderMap, fields: &[(HeaderName, HeaderValue)]) {
    for (name, value) in fields {
        map.append(name.clone(), value.clone());
    }
}
