//! What a completed key keeps: a response (captured here from the
//! handler's), the fact that one was sent too large to store, or a
//! processed message's result. Its byte layout is in [`codec`]; the HTTP
//! door replays a response.

pub mod codec;

use std::time::SystemTime;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};

/// A response stored for replay: status, headers, body and trailers.
///
/// Headers that must not be replayed — hop-by-hop headers, `Set-Cookie`,
/// `Content-Length` (recomputed) and `Date` — are dropped when the response is
/// captured; the rest keep their order, repeated names included. Trailers
/// — a gRPC response's `grpc-status`, `grpc-message` and trailing metadata —
/// are kept whole, and replayed after the body.
///
/// # Examples
///
/// ```
/// use http::{HeaderMap, StatusCode, header};
/// use tower_idempotency::StoredResponse;
///
/// let mut headers = HeaderMap::new();
/// headers.insert(header::LOCATION, "/v1/charges/ch_1".parse().unwrap());
/// headers.insert(header::SET_COOKIE, "session=secret".parse().unwrap());
/// let stored = StoredResponse::capture(StatusCode::CREATED, &headers, "{}".into());
///
/// assert_eq!(stored.headers().len(), 1); // Set-Cookie is never replayed
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredResponse {
    status: StatusCode,
    headers: Vec<(HeaderName, HeaderValue)>,
    body: Bytes,
    trailers: Vec<(HeaderName, HeaderValue)>,
    created_at: SystemTime,
}

impl StoredResponse {
    /// Captures a response now, dropping the headers that are never replayed.
    pub fn capture(status: StatusCode, headers: &HeaderMap, body: Bytes) -> Self {
        let headers = headers
            .iter()
            .filter(|(name, _)| is_replayable(name))
            .map(|(n, v)| (n.clone(), v.clone()))
            .collect();
        Self {
            status,
            headers,
            body,
            trailers: Vec::new(),
            created_at: SystemTime::now(),
        }
    }

    /// The same response, with the trailers that followed its body (in
    /// their order), replayed after it.
    ///
    /// # Examples
    ///
    /// ```
    /// use http::{HeaderMap, StatusCode};
    /// use tower_idempotency::StoredResponse;
    ///
    /// let mut trailers = HeaderMap::new();
    /// trailers.insert("grpc-status", "0".parse().unwrap());
    /// let stored = StoredResponse::capture(StatusCode::OK, &HeaderMap::new(), "\0\0\0\0\0".into())
    ///     .with_trailers(&trailers);
    /// assert_eq!(stored.trailers()[0].1, "0");
    /// ```
    pub fn with_trailers(mut self, trailers: &HeaderMap) -> Self {
        self.trailers = trailers
            .iter()
            .map(|(n, v)| (n.clone(), v.clone()))
            .collect();
        self
    }

    /// Rebuilds a stored response, e.g. when a store decodes one.
    pub fn from_parts(
        status: StatusCode,
        headers: Vec<(HeaderName, HeaderValue)>,
        body: Bytes,
        created_at: SystemTime,
    ) -> Self {
        Self {
            status,
            headers,
            body,
            trailers: Vec::new(),
            created_at,
        }
    }

    /// The status code.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The replayable headers, in their original order.
    pub fn headers(&self) -> &[(HeaderName, HeaderValue)] {
        &self.headers
    }

    /// The body bytes.
    pub fn body(&self) -> &Bytes {
        &self.body
    }

    /// The trailers that followed the body, in their original order: empty
    /// for most HTTP responses; `grpc-status` and the trailing metadata of a
    /// gRPC one.
    pub fn trailers(&self) -> &[(HeaderName, HeaderValue)] {
        &self.trailers
    }

    /// When the original response was produced.
    pub fn created_at(&self) -> SystemTime {
        self.created_at
    }
}

/// Hop-by-hop headers, `Set-Cookie`, `Content-Length` (recomputed) and `Date`
/// are never replayed.
fn is_replayable(name: &HeaderName) -> bool {
    !matches!(
        *name,
        header::CONNECTION
            | header::TRANSFER_ENCODING
            | header::UPGRADE
            | header::TE
            | header::TRAILER
            | header::PROXY_AUTHENTICATE
            | header::PROXY_AUTHORIZATION
            | header::SET_COOKIE
            | header::CONTENT_LENGTH
            | header::DATE
    ) && name.as_str() != "keep-alive"
        && name.as_str() != "set-cookie2"
}

/// The final state of a key: a response to replay, the fact that a response
/// was sent that was too large to store, or a processed message's result.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CompletedRecord {
    /// The response, replayed to every matching retry.
    Response(StoredResponse),
    /// A response with this status was sent, but its body exceeded the
    /// storable limit; retries get an error instead of a second execution.
    Unreplayable {
        /// The status of the response that was sent.
        status: StatusCode,
        /// When it was sent.
        created_at: SystemTime,
    },
    /// A message was processed (see [`message`](crate::message)): its
    /// work's result as JSON, or `None` when the result could not be
    /// serialised. Redeliveries are duplicates; the work does not run again.
    Message {
        /// The work's result, as JSON.
        result: Option<Bytes>,
        /// When the work finished.
        created_at: SystemTime,
    },
}

impl CompletedRecord {
    /// When the outcome was produced.
    pub fn created_at(&self) -> SystemTime {
        match self {
            Self::Response(response) => response.created_at(),
            Self::Unreplayable { created_at, .. } | Self::Message { created_at, .. } => *created_at,
        }
    }
}

/// A stored record that cannot be decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("corrupt idempotency record: {0}")]
pub struct CorruptRecord(pub &'static str);
