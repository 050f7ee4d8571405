//! gRPC over the HTTP door: which requests are gRPC calls, the status codes
//! their outcome is read from, and the trailers-only answers the layer
//! gives them.
//!
//! A gRPC call is an HTTP/2 `POST` whose `content-type` is
//! `application/grpc` (or `application/grpc+proto`, …); its outcome is the
//! `grpc-status` trailer, or the same header in a response without a body
//! (a "trailers-only" response).

mod frames;

use http::{HeaderMap, HeaderName, HeaderValue, header};

pub(crate) use frames::decoded;

/// The header (or trailer) that carries a gRPC call's status code.
pub(crate) const GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
/// The header (or trailer) that carries a gRPC call's error message.
pub(crate) const GRPC_MESSAGE: HeaderName = HeaderName::from_static("grpc-message");
/// What a framework answers before any method runs, for a message it
/// could not decode (tonic's protobuf codec): never a method's outcome.
pub(crate) const DECODE_FAILURE: &str = "failed to decode Protobuf message";
/// How long a gRPC client should wait before it retries (gRPC's own
/// server pushback, in milliseconds).
pub(crate) const GRPC_RETRY_PUSHBACK_MS: HeaderName =
    HeaderName::from_static("grpc-retry-pushback-ms");

/// Who is asking, as far as the layer's own answers go: an HTTP caller reads
/// problem+json, a gRPC caller a status.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Wire {
    Http,
    Grpc,
}

impl Wire {
    /// A request or response is gRPC when its `content-type` says so.
    /// gRPC-Web (`application/grpc-web…`) carries its trailers in the body
    /// and is not this.
    pub(crate) fn of(headers: &HeaderMap) -> Self {
        let grpc = headers
            .get(header::CONTENT_TYPE)
            .and_then(|value| value.to_str().ok())
            .and_then(|value| value.strip_prefix("application/grpc"))
            .is_some_and(|rest| rest.is_empty() || rest.starts_with(['+', ';']));
        if grpc { Self::Grpc } else { Self::Http }
    }
}

/// A gRPC status code, as carried by the `grpc-status` trailer.
///
/// # Examples
///
/// ```
/// use tower_idempotency::GrpcCode;
///
/// assert_eq!(GrpcCode::from_i32(14), GrpcCode::UNAVAILABLE);
/// assert_eq!(GrpcCode::UNAVAILABLE.name(), "UNAVAILABLE");
/// assert!(GrpcCode::UNAVAILABLE.invites_retry());
/// assert!(!GrpcCode::INVALID_ARGUMENT.invites_retry());
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct GrpcCode(u8);

impl GrpcCode {
    /// Not an error.
    pub const OK: Self = Self(0);
    /// The caller cancelled the call.
    pub const CANCELLED: Self = Self(1);
    /// An error without a better code; also what an unknown code reads as.
    pub const UNKNOWN: Self = Self(2);
    /// The request itself is wrong, whatever the server's state.
    pub const INVALID_ARGUMENT: Self = Self(3);
    /// The deadline passed before the call finished.
    pub const DEADLINE_EXCEEDED: Self = Self(4);
    /// Something asked for was not found.
    pub const NOT_FOUND: Self = Self(5);
    /// What the call would create already exists.
    pub const ALREADY_EXISTS: Self = Self(6);
    /// The caller may not do this.
    pub const PERMISSION_DENIED: Self = Self(7);
    /// A quota or a limit was hit, e.g. a message too large.
    pub const RESOURCE_EXHAUSTED: Self = Self(8);
    /// The system is not in the state the call needs; retrying the same
    /// call will not help until that state changes.
    pub const FAILED_PRECONDITION: Self = Self(9);
    /// The call lost a concurrency conflict; retry it.
    pub const ABORTED: Self = Self(10);
    /// A value was out of the valid range.
    pub const OUT_OF_RANGE: Self = Self(11);
    /// The server does not implement the method.
    pub const UNIMPLEMENTED: Self = Self(12);
    /// An invariant of the server broke.
    pub const INTERNAL: Self = Self(13);
    /// The service cannot be reached now; retry, with backoff.
    pub const UNAVAILABLE: Self = Self(14);
    /// Data was lost or corrupted.
    pub const DATA_LOSS: Self = Self(15);
    /// The caller is not authenticated.
    pub const UNAUTHENTICATED: Self = Self(16);

    const NAMES: [&'static str; 17] = [
        "OK",
        "CANCELLED",
        "UNKNOWN",
        "INVALID_ARGUMENT",
        "DEADLINE_EXCEEDED",
        "NOT_FOUND",
        "ALREADY_EXISTS",
        "PERMISSION_DENIED",
        "RESOURCE_EXHAUSTED",
        "FAILED_PRECONDITION",
        "ABORTED",
        "OUT_OF_RANGE",
        "UNIMPLEMENTED",
        "INTERNAL",
        "UNAVAILABLE",
        "DATA_LOSS",
        "UNAUTHENTICATED",
    ];

    /// The code with this number; a number gRPC does not define reads as
    /// [`UNKNOWN`](Self::UNKNOWN), as gRPC clients read it.
    pub fn from_i32(code: i32) -> Self {
        match u8::try_from(code) {
            Ok(code) if usize::from(code) < Self::NAMES.len() => Self(code),
            _ => Self::UNKNOWN,
        }
    }

    /// The code's number, as `grpc-status` carries it.
    pub fn as_i32(self) -> i32 {
        i32::from(self.0)
    }

    /// The code's name, as gRPC spells it (`"UNAVAILABLE"`).
    pub fn name(self) -> &'static str {
        Self::NAMES[usize::from(self.0)]
    }

    /// `true` for the codes that say "nothing was done, try again":
    /// `UNAVAILABLE`, `RESOURCE_EXHAUSTED`, `ABORTED` and
    /// `DEADLINE_EXCEEDED`. The default store policy releases the key of
    /// a call that ends with one of them, as it does for HTTP's `503` and
    /// `429`.
    pub fn invites_retry(self) -> bool {
        matches!(
            self,
            Self::UNAVAILABLE | Self::RESOURCE_EXHAUSTED | Self::ABORTED | Self::DEADLINE_EXCEEDED
        )
    }

    /// Whether the code says the server failed — `UNKNOWN`, `UNIMPLEMENTED`,
    /// `INTERNAL`, `DATA_LOSS` — as an HTTP `5xx` does. A transactional
    /// store rolls such a call back (see
    /// [`StorePolicy::rolls_back_server_errors`](crate::StorePolicy::rolls_back_server_errors)).
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::GrpcCode;
    ///
    /// assert!(GrpcCode::INTERNAL.is_server_error());
    /// assert!(!GrpcCode::FAILED_PRECONDITION.is_server_error());
    /// ```
    pub fn is_server_error(self) -> bool {
        matches!(
            self,
            Self::UNKNOWN | Self::UNIMPLEMENTED | Self::INTERNAL | Self::DATA_LOSS
        )
    }

    /// The code in a `grpc-status` value; a value that is not a number
    /// reads as [`UNKNOWN`](Self::UNKNOWN).
    pub(crate) fn from_header(value: &HeaderValue) -> Self {
        value
            .to_str()
            .ok()
            .and_then(|v| v.parse().ok())
            .map_or(Self::UNKNOWN, Self::from_i32)
    }
}

impl std::fmt::Debug for GrpcCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}({})", self.name(), self.0)
    }
}

impl std::fmt::Display for GrpcCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A gRPC response's status, with the metadata that carries it: its
/// trailers, or its headers when it was answered without a body (a
/// "trailers-only" response). `None` if it has none.
pub(crate) fn status<'a>(
    headers: &'a HeaderMap,
    trailers: Option<&'a HeaderMap>,
) -> Option<(GrpcCode, &'a HeaderMap)> {
    [trailers, Some(headers)]
        .into_iter()
        .flatten()
        .find_map(|fields| Some((GrpcCode::from_header(fields.get(GRPC_STATUS)?), fields)))
}

/// `grpc-message` is percent-encoded: every byte outside printable ASCII,
/// and `%` itself. Written here rather than with a crate: it is these few
/// lines, on messages the layer writes itself.
pub(crate) fn encode_message(message: &str) -> HeaderValue {
    let mut encoded = String::with_capacity(message.len());
    for byte in message.bytes() {
        if (0x20..=0x7e).contains(&byte) && byte != b'%' {
            encoded.push(char::from(byte));
        } else {
            encoded.push_str(&format!("%{byte:02X}"));
        }
    }
    HeaderValue::try_from(encoded).expect("printable ASCII is a valid header value")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_is_recognised_by_its_content_type() {
        let with = |value: &'static str| {
            let mut headers = HeaderMap::new();
            headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(value));
            Wire::of(&headers)
        };
        assert_eq!(with("application/grpc"), Wire::Grpc);
        assert_eq!(with("application/grpc+proto"), Wire::Grpc);
        assert_eq!(with("application/grpc-web"), Wire::Http);
        assert_eq!(with("application/json"), Wire::Http);
        assert_eq!(Wire::of(&HeaderMap::new()), Wire::Http);
    }

    #[test]
    fn codes_read_as_grpc_clients_read_them() {
        assert_eq!(
            GrpcCode::from_header(&HeaderValue::from_static("14")),
            GrpcCode::UNAVAILABLE
        );
        assert_eq!(
            GrpcCode::from_header(&HeaderValue::from_static("99")),
            GrpcCode::UNKNOWN
        );
        assert_eq!(
            GrpcCode::from_header(&HeaderValue::from_static("x")),
            GrpcCode::UNKNOWN
        );
        assert_eq!(GrpcCode::from_i32(-1), GrpcCode::UNKNOWN);
        assert_eq!(GrpcCode::UNAUTHENTICATED.name(), "UNAUTHENTICATED");
    }

    #[test]
    fn messages_are_percent_encoded() {
        assert_eq!(encode_message("100% sure"), "100%25 sure");
        assert_eq!(encode_message("déjà"), "d%C3%A9j%C3%A0");
        assert_eq!(encode_message("line\nbreak"), "line%0Abreak");
    }
}
