//! A completed key's answer to a retry: its stored response, replayed, or
//! the rejection that says it cannot be.

use axum_core::body::Body;
use http::{HeaderMap, HeaderName, HeaderValue, Response};

use crate::{
    http::{
        buffer,
        grpc::Wire,
        outcome::{Answered, IdempotencyOutcome},
        rejection::RejectionKind,
        shared::Shared,
    },
    record::{CompletedRecord, StoredResponse},
    store::StorageKey,
};

/// The header every replayed response carries: `Idempotent-Replayed: true`.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// A completed key's answer.
pub(crate) fn answer<St, Sc, P, F>(
    shared: &Shared<St, Sc, P, F>,
    key: &StorageKey,
    record: &CompletedRecord,
    wire: Wire,
) -> Answered {
    match record {
        CompletedRecord::Response(stored) => {
            tracing::debug!(%key, "idempotency: replayed");
            Answered::new(replay(stored), IdempotencyOutcome::Replayed)
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
/// body and trailers, plus `Idempotent-Replayed: true`.
fn replay(stored: &StoredResponse) -> Response<Body> {
    let trailers = (!stored.trailers().is_empty()).then(|| {
        let mut trailers = HeaderMap::with_capacity(stored.trailers().len());
        append(&mut trailers, stored.trailers());
        trailers
    });
    let mut response = Response::new(buffer::body(stored.body().clone(), trailers));
    *response.status_mut() = stored.status();
    let headers = response.headers_mut();
    headers.reserve(stored.headers().len() + 1);
    append(headers, stored.headers());
    headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    response
}

/// Appends stored headers (or trailers) in their order, repeated names kept.
fn append(map: &mut HeaderMap, fields: &[(HeaderName, HeaderValue)]) {
    for (name, value) in fields {
        map.append(name.clone(), value.clone());
    }
}
