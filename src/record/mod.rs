//! What a completed key keeps, and how it comes back: the response is
//! captured here, and replayed from here.

pub mod codec;

use std::time::SystemTime;

use axum_core::body::Body;
use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode, header};

use crate::http::outcome::IdempotencyOutcome;

/// The header every replayed response carries: `Idempotent-Replayed: true`.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// A response stored for replay: status, headers and body.
///
/// Headers that must not be replayed — hop-by-hop headers, `Set-Cookie`,
/// `Content-Length` (recomputed) and `Date` — are dropped when the response is
/// captured; the rest keep their order, repeated names included.
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
/// let block = stored.encode_headers();
/// let decoded = StoredResponse::decode_headers(&block).unwrap();
/// assert_eq!(decoded, stored.headers());
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredResponse {
    status: StatusCode,
    headers: Vec<(HeaderName, HeaderValue)>,
    body: Bytes,
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
            created_at: SystemTime::now(),
        }
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

    /// When the original response was produced.
    pub fn created_at(&self) -> SystemTime {
        self.created_at
    }

    /// The response a retry receives: the stored status, headers (in order)
    /// and body, plus `Idempotent-Replayed: true`.
    pub(crate) fn replay(&self) -> Response<Body> {
        let mut response = Response::new(Body::from(self.body.clone()));
        *response.status_mut() = self.status;
        let headers = response.headers_mut();
        headers.reserve(self.headers.len() + 1);
        for (name, value) in &self.headers {
            headers.append(name.clone(), value.clone());
        }
        headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
        response
            .extensions_mut()
            .insert(IdempotencyOutcome::Replayed);
        response
    }

    /// Encodes the headers into a compact, binary-safe block: for each header
    /// a `u16` name length, the name, a `u32` value length, the value (lengths
    /// big-endian).
    pub fn encode_headers(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.headers_len());
        self.encode_headers_into(&mut out);
        out
    }

    /// The length of [`encode_headers`](Self::encode_headers)' block.
    pub(crate) fn headers_len(&self) -> usize {
        self.headers
            .iter()
            .map(|(n, v)| 6 + n.as_str().len() + v.len())
            .sum()
    }

    /// Appends the header block to `out`.
    pub(crate) fn encode_headers_into(&self, out: &mut Vec<u8>) {
        for (name, value) in &self.headers {
            out.extend_from_slice(&(name.as_str().len() as u16).to_be_bytes());
            out.extend_from_slice(name.as_str().as_bytes());
            out.extend_from_slice(&(value.len() as u32).to_be_bytes());
            out.extend_from_slice(value.as_bytes());
        }
    }

    /// Decodes a block written by [`encode_headers`](Self::encode_headers).
    pub fn decode_headers(
        mut block: &[u8],
    ) -> Result<Vec<(HeaderName, HeaderValue)>, CorruptRecord> {
        let mut headers = Vec::new();
        while !block.is_empty() {
            let name = take_prefixed(&mut block, 2)?;
            let value = take_prefixed(&mut block, 4)?;
            let name = HeaderName::from_bytes(name).map_err(|_| CorruptRecord("header name"))?;
            let value =
                HeaderValue::from_bytes(value).map_err(|_| CorruptRecord("header value"))?;
            headers.push((name, value));
        }
        Ok(headers)
    }
}

fn take_prefixed<'a>(block: &mut &'a [u8], width: usize) -> Result<&'a [u8], CorruptRecord> {
    let truncated = CorruptRecord("truncated header block");
    let (len, rest) = block.split_at_checked(width).ok_or(truncated)?;
    let len = len.iter().fold(0usize, |acc, b| acc << 8 | usize::from(*b));
    let (field, rest) = rest.split_at_checked(len).ok_or(truncated)?;
    *block = rest;
    Ok(field)
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

/// The final state of a key: a response to replay, or only the fact that a
/// response was sent that was too large to store.
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
}

/// A stored record that cannot be decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("corrupt idempotency record: {0}")]
pub struct CorruptRecord(pub &'static str);
