//! The layer's own answers, never stored: RFC 9457 problem+json for HTTP
//! callers, trailers-only gRPC statuses for gRPC ones.

use std::{fmt, sync::Arc, time::Duration};

use axum_core::{body::Body, response::IntoResponse};
use http::{HeaderValue, Response, StatusCode, header, header::InvalidHeaderValue};

use crate::{
    http::grpc::{self, GrpcCode},
    http::problem::Problem,
    key::InvalidKey,
};

/// Why the layer answered instead of the handler.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum RejectionKind {
    /// The key is required but the request has none (`400`).
    MissingKey,
    /// The layer reads keys from the body
    /// ([`key_from_body`](crate::IdempotencyLayer::key_from_body)), which
    /// holds no string at `pointer` (`400`).
    MissingBodyKey {
        /// The JSON Pointer the key was looked for at.
        pointer: Arc<str>,
    },
    /// The `Idempotency-Key` header is malformed (`400`).
    InvalidKey(InvalidKey),
    /// The request body exceeds the configured limit (`413`).
    BodyTooLarge {
        /// The limit, in bytes.
        limit: usize,
    },
    /// The request body could not be read (`400`).
    BodyUnreadable,
    /// The key was first used with different parameters (`422`).
    Mismatch,
    /// A request with this key is still being processed (`409`).
    InFlight {
        /// When to try again.
        retry_after: Duration,
    },
    /// The key completed with a response too large to store, so it cannot be
    /// replayed; it will not be executed again either (`409`).
    Unreplayable {
        /// The status of the response that was sent.
        status: StatusCode,
    },
    /// The store could not be reached, so the request was not run (`503`).
    StoreUnavailable {
        /// When to try again.
        retry_after: Duration,
    },
    /// The handler panicked; the key was released so the request may be
    /// retried (`500`).
    HandlerPanicked,
    /// The handler's response body failed while it was being read; the key was
    /// released (`502`).
    ResponseBodyFailed,
    /// The layer could not tell whose request this is: its scope extractor
    /// returned `None` — most often because the authentication that sets
    /// the account runs after the layer instead of before it. The request
    /// was not run (`500`): a server misconfiguration, never the client's
    /// answer.
    NoScope,
    /// The stored response is in a content coding (`Content-Encoding`) the
    /// retry does not accept, and not one the layer can decode (`406`):
    /// compression placed inside the layer stored it so. Put the
    /// compression layer outside the idempotency layer.
    NotAcceptable {
        /// The stored response's coding.
        coding: String,
    },
    /// The handler kept its transaction past its own end (e.g. moved it into
    /// a spawned task), so nothing was committed (`500`).
    TransactionHeld,
    /// The handler answered with a success (a `2xx`; for a gRPC call, the
    /// status `OK`), but the database refused its
    /// transaction — one of the handler's statements failed, which aborts a
    /// PostgreSQL transaction, or the commit broke a constraint — so nothing
    /// was committed and the success is withheld (`500`). The key was
    /// released. A handler that answers an error itself has that answer
    /// sent instead.
    TransactionRefused,
    /// The handler answered with a success, but its writes are more than
    /// the store takes in one transaction (DynamoDB: 400 KB an item, 100
    /// items): nothing was committed, the key was released, and the same
    /// request would be refused again (`413`). A handler that answers an
    /// error itself has that answer sent instead.
    WritesTooLarge {
        /// What the store said of them.
        why: String,
    },
}

/// A response the layer produced itself. Never stored, never replayed.
///
/// Customise how it is rendered with
/// [`IdempotencyLayer::on_rejection`](crate::IdempotencyLayer::on_rejection);
/// the default is [`Rejection::into_problem_response`].
///
/// # Examples
///
/// ```
/// use http::StatusCode;
/// use tower_idempotency::{Rejection, RejectionKind};
///
/// let r = Rejection::new(RejectionKind::Mismatch);
/// assert_eq!(r.status(), StatusCode::UNPROCESSABLE_ENTITY);
/// let response = r.into_problem_response();
/// assert_eq!(response.headers()["content-type"], "application/problem+json");
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rejection {
    kind: RejectionKind,
    documentation: Option<Arc<str>>,
}

impl Rejection {
    /// A rejection of this kind.
    pub fn new(kind: RejectionKind) -> Self {
        Self {
            kind,
            documentation: None,
        }
    }

    /// The same rejection, pointing to the API's idempotency policy at
    /// `url` (see
    /// [`IdempotencyLayer::documentation`](crate::IdempotencyLayer::documentation)).
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::{Rejection, RejectionKind};
    ///
    /// let r = Rejection::new(RejectionKind::Mismatch).documented_at("https://example.com/idempotency");
    /// let response = r.into_problem_response();
    /// assert_eq!(response.headers()["link"], r#"<https://example.com/idempotency>; rel="describedby""#);
    /// ```
    pub fn documented_at(mut self, url: impl Into<Arc<str>>) -> Self {
        self.documentation = Some(url.into());
        self
    }

    /// The URL of the API's idempotency policy, if the layer has one.
    pub fn documentation(&self) -> Option<&str> {
        self.documentation.as_deref()
    }

    /// Why the request was rejected.
    pub fn kind(&self) -> &RejectionKind {
        &self.kind
    }

    /// The HTTP status of the rejection.
    pub fn status(&self) -> StatusCode {
        match self.kind {
            RejectionKind::MissingKey
            | RejectionKind::MissingBodyKey { .. }
            | RejectionKind::InvalidKey(_)
            | RejectionKind::BodyUnreadable => StatusCode::BAD_REQUEST,
            RejectionKind::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            RejectionKind::Mismatch => StatusCode::UNPROCESSABLE_ENTITY,
            RejectionKind::NotAcceptable { .. } => StatusCode::NOT_ACCEPTABLE,
            RejectionKind::InFlight { .. } | RejectionKind::Unreplayable { .. } => {
                StatusCode::CONFLICT
            }
            RejectionKind::StoreUnavailable { .. } => StatusCode::SERVICE_UNAVAILABLE,
            RejectionKind::HandlerPanicked
            | RejectionKind::NoScope
            | RejectionKind::TransactionHeld
            | RejectionKind::TransactionRefused => StatusCode::INTERNAL_SERVER_ERROR,
            RejectionKind::WritesTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            RejectionKind::ResponseBodyFailed => StatusCode::BAD_GATEWAY,
        }
    }

    /// The gRPC status a gRPC caller receives instead of
    /// [`status`](Self::status), chosen by gRPC's own guidance on status
    /// codes: the request's own fault is `INVALID_ARGUMENT` (or
    /// `RESOURCE_EXHAUSTED` for a message over the limit); a key already
    /// used with other parameters, or whose response cannot be replayed, is
    /// `FAILED_PRECONDITION` (retrying the same call will not help); a
    /// duplicate of a call still running is `ABORTED` and an unreachable
    /// store `UNAVAILABLE` (retry after the pushback); a failure of the
    /// handler's is `INTERNAL`, or `UNAVAILABLE` when its response broke
    /// off (as gRPC maps HTTP's `502`).
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::{GrpcCode, Rejection, RejectionKind};
    ///
    /// let r = Rejection::new(RejectionKind::Mismatch);
    /// assert_eq!(r.grpc_code(), GrpcCode::FAILED_PRECONDITION);
    /// ```
    pub fn grpc_code(&self) -> GrpcCode {
        match self.kind {
            RejectionKind::MissingKey
            | RejectionKind::MissingBodyKey { .. }
            | RejectionKind::InvalidKey(_)
            | RejectionKind::BodyUnreadable => GrpcCode::INVALID_ARGUMENT,
            RejectionKind::BodyTooLarge { .. } => GrpcCode::RESOURCE_EXHAUSTED,
            RejectionKind::Mismatch | RejectionKind::Unreplayable { .. } => {
                GrpcCode::FAILED_PRECONDITION
            }
            RejectionKind::InFlight { .. } => GrpcCode::ABORTED,
            RejectionKind::StoreUnavailable { .. } | RejectionKind::ResponseBodyFailed => {
                GrpcCode::UNAVAILABLE
            }
            RejectionKind::HandlerPanicked
            | RejectionKind::NoScope
            | RejectionKind::NotAcceptable { .. }
            | RejectionKind::TransactionHeld
            | RejectionKind::TransactionRefused => GrpcCode::INTERNAL,
            RejectionKind::WritesTooLarge { .. } => GrpcCode::INVALID_ARGUMENT,
        }
    }

    /// When the client should try again, for rejections that say so.
    pub fn retry_after(&self) -> Option<Duration> {
        match self.kind {
            RejectionKind::InFlight { retry_after }
            | RejectionKind::StoreUnavailable { retry_after } => Some(retry_after),
            _ => None,
        }
    }

    /// A stable URI naming the problem type (RFC 9457 `type`).
    pub fn problem_type(&self) -> &'static str {
        match self.kind {
            RejectionKind::MissingKey | RejectionKind::MissingBodyKey { .. } => {
                "urn:tower-idempotency:problem:missing-key"
            }
            RejectionKind::InvalidKey(_) => "urn:tower-idempotency:problem:invalid-key",
            RejectionKind::BodyTooLarge { .. } => "urn:tower-idempotency:problem:body-too-large",
            RejectionKind::BodyUnreadable => "urn:tower-idempotency:problem:body-unreadable",
            RejectionKind::Mismatch => "urn:tower-idempotency:problem:key-reused",
            RejectionKind::InFlight { .. } => "urn:tower-idempotency:problem:in-flight",
            RejectionKind::Unreplayable { .. } => "urn:tower-idempotency:problem:unreplayable",
            RejectionKind::StoreUnavailable { .. } => {
                "urn:tower-idempotency:problem:store-unavailable"
            }
            RejectionKind::HandlerPanicked => "urn:tower-idempotency:problem:handler-panicked",
            RejectionKind::NoScope => "urn:tower-idempotency:problem:no-scope",
            RejectionKind::NotAcceptable { .. } => "urn:tower-idempotency:problem:not-acceptable",
            RejectionKind::TransactionHeld => "urn:tower-idempotency:problem:transaction-held",
            RejectionKind::TransactionRefused => {
                "urn:tower-idempotency:problem:transaction-refused"
            }
            RejectionKind::WritesTooLarge { .. } => {
                "urn:tower-idempotency:problem:writes-too-large"
            }
            RejectionKind::ResponseBodyFailed => {
                "urn:tower-idempotency:problem:response-body-failed"
            }
        }
    }

    /// A short, human-readable summary (RFC 9457 `title`).
    pub fn title(&self) -> &'static str {
        match self.kind {
            RejectionKind::MissingKey => "Idempotency-Key required",
            RejectionKind::MissingBodyKey { .. } => "Idempotency key required in the body",
            RejectionKind::InvalidKey(_) => "Invalid Idempotency-Key",
            RejectionKind::BodyTooLarge { .. } => "Request body too large",
            RejectionKind::BodyUnreadable => "Request body unreadable",
            RejectionKind::Mismatch => "Idempotency-Key reused with different parameters",
            RejectionKind::InFlight { .. } => "Request in progress",
            RejectionKind::Unreplayable { .. } => "Original response cannot be replayed",
            RejectionKind::StoreUnavailable { .. } => "Idempotency store unavailable",
            RejectionKind::HandlerPanicked | RejectionKind::TransactionHeld => {
                "Internal server error"
            }
            RejectionKind::TransactionRefused => "Transaction refused",
            RejectionKind::WritesTooLarge { .. } => "Request too large to record",
            RejectionKind::NoScope => "Request not attributed to an account",
            RejectionKind::NotAcceptable { .. } => "Stored response not acceptable",
            RejectionKind::ResponseBodyFailed => "Response body failed",
        }
    }

    /// An explanation of this occurrence (RFC 9457 `detail`).
    pub fn detail(&self) -> String {
        match &self.kind {
            RejectionKind::MissingKey => {
                "This endpoint requires an Idempotency-Key header; send the same key on every retry of one operation.".into()
            }
            RejectionKind::MissingBodyKey { pointer } => format!(
                "This endpoint reads the idempotency key from the JSON body, at {pointer}: send a JSON body with a string there."
            ),
            RejectionKind::InvalidKey(why) => format!("{why}."),
            RejectionKind::BodyTooLarge { limit } => {
                format!("The request body exceeds the limit of {limit} bytes; nothing was stored.")
            }
            RejectionKind::BodyUnreadable => "The request body could not be read.".into(),
            RejectionKind::Mismatch => {
                "This Idempotency-Key was already used with a different request (method, path, query or body). Use a new key for a new operation.".into()
            }
            RejectionKind::InFlight { .. } => {
                "A request with this Idempotency-Key is still being processed. Retry after the indicated delay to receive its result.".into()
            }
            RejectionKind::Unreplayable { status } => format!(
                "The original request completed with status {} but its response was too large to store, so it cannot be replayed. It will not be executed again.",
                status.as_u16()
            ),
            RejectionKind::StoreUnavailable { .. } => {
                "The idempotency store cannot be reached, so the request was not processed. Retry later with the same key.".into()
            }
            RejectionKind::HandlerPanicked => {
                "The request failed unexpectedly and was not recorded; it may be retried with the same key.".into()
            }
            RejectionKind::ResponseBodyFailed => {
                "The response failed while it was produced and was not recorded; it may be retried with the same key.".into()
            }
            RejectionKind::TransactionHeld => {
                "The request's work was not committed; it may be retried with the same key.".into()
            }
            RejectionKind::NotAcceptable { coding } => format!(
                "The original response was stored compressed ({coding}), which this request does not accept (Accept-Encoding). It was not executed again; retry accepting {coding}."
            ),
            RejectionKind::NoScope => {
                "The server could not tell whose request this is, so it did not run it: the idempotency layer found no scope (the authenticated account) in it. This is a server configuration problem — the authentication that identifies the caller must run before the idempotency layer — and nothing was done or recorded.".into()
            }
            RejectionKind::TransactionRefused => {
                "A statement of the request failed, so the database rolled its work back: nothing was committed and nothing was recorded.".into()
            }
            RejectionKind::WritesTooLarge { why } => format!(
                "What this request writes is more than the store can record in one transaction ({why}): nothing was committed. The same request will be refused again; send a smaller one."
            ),
        }
    }

    /// Renders the rejection as RFC 9457 `application/problem+json`, with
    /// `Retry-After` where there is one. With a documentation URL, the
    /// problem's `type` is that URL with the problem's name as fragment
    /// (`https://…/idempotency#key-reused`), and the response carries `Link:
    /// <url>; rel="describedby"`, as the IETF draft on the `Idempotency-Key`
    /// header asks.
    pub fn into_problem_response(self) -> Response<Body> {
        let problem_type = match &self.documentation {
            Some(url) => {
                let name = self.problem_type().rsplit(':').next().unwrap_or_default();
                format!("{url}#{name}").into()
            }
            None => std::borrow::Cow::Borrowed(self.problem_type()),
        };
        let mut response = Problem::new(self.status(), self.title())
            .problem_type(problem_type)
            .detail(self.detail())
            .into_response();
        let headers = response.headers_mut();
        if let Some(after) = self.retry_after() {
            headers.insert(header::RETRY_AFTER, retry_after_secs(after).into());
        }
        if let Some(link) = self
            .documentation
            .as_deref()
            .and_then(|url| described_by(url).ok())
        {
            headers.insert(header::LINK, link);
        }
        response
    }

    /// Renders the rejection for a gRPC caller: a trailers-only response
    /// (HTTP `200`, no body) whose `grpc-status` is
    /// [`grpc_code`](Self::grpc_code) and whose `grpc-message` is the title
    /// and the detail; with `grpc-retry-pushback-ms`, gRPC's own retry
    /// delay, where there is one. The layer answers every gRPC request
    /// (`content-type: application/grpc…`) this way.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::{Rejection, RejectionKind};
    ///
    /// let retry_after = Duration::from_millis(1500);
    /// let response = Rejection::new(RejectionKind::InFlight { retry_after }).into_grpc_response();
    /// assert_eq!(response.status(), 200);
    /// assert_eq!(response.headers()["grpc-status"], "10"); // ABORTED
    /// assert_eq!(response.headers()["grpc-retry-pushback-ms"], "1500");
    /// ```
    pub fn into_grpc_response(self) -> Response<Body> {
        let mut response = Response::new(Body::empty());
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/grpc"),
        );
        headers.insert(grpc::GRPC_STATUS, self.grpc_code().as_i32().into());
        let message = format!("{}: {}", self.title(), self.detail());
        headers.insert(grpc::GRPC_MESSAGE, grpc::encode_message(&message));
        if let Some(after) = self.retry_after() {
            let millis = u64::try_from(after.as_millis()).unwrap_or(u64::MAX).max(1);
            headers.insert(grpc::GRPC_RETRY_PUSHBACK_MS, millis.into());
        }
        response
    }
}

/// The problem+json rendering, with the rejection attached to the response's
/// extensions.
impl IntoResponse for Rejection {
    fn into_response(self) -> Response<Body> {
        let kind = self.kind.clone();
        let mut response = self.into_problem_response();
        response.extensions_mut().insert(kind);
        response
    }
}

/// The `Link` header value that points to the policy at `url`.
pub(crate) fn described_by(url: &str) -> Result<HeaderValue, InvalidHeaderValue> {
    HeaderValue::from_str(&format!("<{url}>; rel=\"describedby\""))
}

/// Whole seconds, rounded up, at least 1: `Retry-After: 0` would invite a
/// tight retry loop.
fn retry_after_secs(d: Duration) -> u64 {
    d.as_millis().div_ceil(1000).max(1) as u64
}

impl fmt::Display for Rejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.title(), self.status())
    }
}

/// Renders rejections; see [`IdempotencyLayer::on_rejection`](crate::IdempotencyLayer::on_rejection).
pub(crate) type RenderRejection = Arc<dyn Fn(Rejection) -> Response<Body> + Send + Sync>;
