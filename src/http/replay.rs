//! A completed key's answer to a retry: its stored response, replayed, or
//! the rejection that says it cannot be.

use axum_core::body::Body;
use http::{HeaderName, HeaderValue, Response};

use crate::{
    http::{
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
) -> Answered {
    match record {
        CompletedRecord::Response(stored) => {
            tracing::debug!(%key, "idempotency: replayed");
            Answered::new(replay(stored), IdempotencyOutcome::Replayed)
        }
        CompletedRecord::Unreplayable { status, .. } => {
            tracing::info!(%key, "idempotency: completed but unreplayable");
            shared.rejection(RejectionKind::Unreplayable { status: *status })
        }
        // A message's record under an HTTP key: the same store and scope
        // serve both doors. It cannot be replayed as a response.
        CompletedRecord::Message { .. } => {
            tracing::warn!(%key, "idempotency: the key holds a processed message, not a response");
            shared.rejection(RejectionKind::Unreplayable {
                status: http::StatusCode::OK,
            })
        }
    }
}

/// The response a retry receives: the stored status, headers (in order)
/// and body, plus `Idempotent-Replayed: true`.
fn replay(stored: &StoredResponse) -> Response<Body> {
    let mut response = Response::new(Body::from(stored.body().clone()));
    *response.status_mut() = stored.status();
    let headers = response.headers_mut();
    headers.reserve(stored.headers().len() + 1);
    for (name, value) in stored.headers() {
        headers.append(name.clone(), value.clone());
    }
    headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    response
}
