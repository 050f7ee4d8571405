//! The other end of the wire: a tower client layer that makes calls to an
//! idempotent API safe to retry — one key per operation, kept across its
//! retries; only what is safe retried; the server's back-off honoured.
//!
//! The mistake it prevents: a client that generates a new
//! `Idempotency-Key` on every attempt. The server then sees each retry as
//! a new operation, and a charge whose answer was lost on the way back is
//! charged again. [`IdempotentClientLayer`] generates one key per call (a
//! UUID v4, unless the request carries one), sends it on every attempt, and
//! retries:
//!
//! | answer | retried? |
//! |---|---|
//! | no answer: a connection failure (before or after the request was sent), the attempt's timeout | yes, after the back-off |
//! | `409` with `Retry-After` (the first request with this key still runs) | yes, after `Retry-After` |
//! | `429`, `503` (and `502`, `504` from a proxy) | yes, after `Retry-After` when given |
//! | gRPC `UNAVAILABLE`, `RESOURCE_EXHAUSTED`, `ABORTED`, `DEADLINE_EXCEEDED` — the codes whose key the server's default policy releases ([`GrpcCode::invites_retry`](crate::GrpcCode::invites_retry)) | yes, after `grpc-retry-pushback-ms` when given (a negative one: no) |
//! | a 2xx, `400`, `422`, any other client error, `500`; gRPC-Web (its status is in the body) | never |
//!
//! The back-off starts at about 0.5 s, doubles, and stops growing at 8 s,
//! each wait within ±25 %; a `Retry-After` or pushback is a floor on the
//! wait, and one longer than the time left to the deadline ends the call
//! with that answer. Each attempt's timeout covers the whole attempt, from
//! connecting to the end of the response body; the bodies are held in
//! memory (the request's to send again, with a size limit that fails
//! clearly).
//!
//! Only guarded methods (`POST` and `PATCH` by default, as on the server)
//! get a key and retries; the others are sent once, as they are.
//!
//! # Examples
//!
//! With hyper's client (`hyper_util`), whose request body is
//! [`Full<Bytes>`](http_body_util::Full):
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! use std::time::Duration;
//! use bytes::Bytes;
//! use http_body_util::Full;
//! use hyper_util::{client::legacy::Client, rt::TokioExecutor};
//! use tower::ServiceExt;
//! use tower_idempotency::client::{IdempotentCall, IdempotentClientLayer};
//!
//! let hyper = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
//! let client = tower::ServiceBuilder::new()
//!     .layer(IdempotentClientLayer::new().max_attempts(5).deadline(Duration::from_secs(30)))
//!     .service(hyper);
//!
//! let request = http::Request::post("http://127.0.0.1:3000/v1/charges")
//!     .header("content-type", "application/json")
//!     .body(Full::new(Bytes::from(r#"{"amount":1999,"currency":"usd"}"#)))?;
//! // `oneshot` (or `ready().await?.call(…)`, naming the request type).
//! let response = client.clone().oneshot(request).await?;
//! let call = response.extensions().get::<IdempotentCall>().unwrap();
//! let key = call.key.as_deref().unwrap_or("-");
//! println!("{} with key {key} after {} attempt(s)", response.status(), call.attempts);
//! # Ok(()) }
//! ```
//!
//! With tonic, below the generated client: the layer sends
//! `Full<Bytes>` bodies, which the channel takes once wrapped in
//! `tonic::body::Body`:
//!
//! ```ignore
//! let channel = tonic::transport::Channel::from_static("http://127.0.0.1:50051").connect().await?;
//! let service = tower::ServiceBuilder::new()
//!     .layer(IdempotentClientLayer::new())
//!     .map_request(|r: http::Request<Full<Bytes>>| r.map(tonic::body::Body::new))
//!     .service(channel);
//! let mut payments = PaymentsClient::new(service);
//! ```

mod body;
mod call;
mod decide;
mod service;

use std::time::Duration;

use http::{HeaderName, Method};

pub use body::BufferedBody;
pub use call::{ClientError, IdempotentCall};
pub use service::{IdempotentClient, ResponseFuture};

/// A boxed error, as the inner service's errors are kept.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The client layer: see the [module docs](self).
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::client::IdempotentClientLayer;
///
/// let layer = IdempotentClientLayer::new()
///     .max_attempts(5)
///     .attempt_timeout(Duration::from_secs(10))
///     .deadline(Duration::from_secs(30));
/// # let _ = layer;
/// ```
#[derive(Clone, Debug)]
pub struct IdempotentClientLayer {
    pub(crate) config: Config,
}

#[derive(Clone, Debug)]
pub(crate) struct Config {
    pub(crate) header: HeaderName,
    pub(crate) methods: Vec<Method>,
    pub(crate) max_attempts: u32,
    pub(crate) attempt_timeout: Duration,
    pub(crate) deadline: Duration,
    pub(crate) first_backoff: Duration,
    pub(crate) max_backoff: Duration,
    pub(crate) max_body: usize,
    pub(crate) max_response_body: usize,
}

impl Default for IdempotentClientLayer {
    fn default() -> Self {
        Self::new()
    }
}

impl IdempotentClientLayer {
    /// Guards `POST` and `PATCH` with `Idempotency-Key`; at most 5 attempts
    /// within 30 s, each at most 10 s; back-off from 0.5 s to 8 s; request
    /// bodies up to 1 MiB, responses up to 16 MiB.
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::client::IdempotentClientLayer;
    ///
    /// let layer = IdempotentClientLayer::new();
    /// # let _ = layer;
    /// ```
    pub fn new() -> Self {
        Self {
            config: Config {
                header: HeaderName::from_static("idempotency-key"),
                methods: vec![Method::POST, Method::PATCH],
                max_attempts: 5,
                attempt_timeout: Duration::from_secs(10),
                deadline: Duration::from_secs(30),
                first_backoff: Duration::from_millis(500),
                max_backoff: Duration::from_secs(8),
                max_body: 1024 * 1024,
                max_response_body: 16 * 1024 * 1024,
            },
        }
    }

    /// The methods that get a key and retries (default `POST`, `PATCH`).
    ///
    /// # Examples
    ///
    /// ```
    /// use http::Method;
    /// use tower_idempotency::client::IdempotentClientLayer;
    ///
    /// let layer = IdempotentClientLayer::new().methods([Method::POST, Method::PATCH, Method::DELETE]);
    /// # let _ = layer;
    /// ```
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.config.methods = methods.into_iter().collect();
        self
    }

    /// The key's header (default `Idempotency-Key`).
    ///
    /// # Examples
    ///
    /// ```
    /// use http::HeaderName;
    /// use tower_idempotency::client::IdempotentClientLayer;
    ///
    /// let layer = IdempotentClientLayer::new().header(HeaderName::from_static("x-idempotency-key"));
    /// # let _ = layer;
    /// ```
    pub fn header(mut self, header: HeaderName) -> Self {
        self.config.header = header;
        self
    }

    /// The most HTTP requests one call sends (default 5).
    ///
    /// # Panics
    ///
    /// When `attempts` is 0.
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::client::IdempotentClientLayer;
    ///
    /// let layer = IdempotentClientLayer::new().max_attempts(3);
    /// # let _ = layer;
    /// ```
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        assert!(
            attempts > 0,
            "IdempotentClientLayer::max_attempts: at least 1"
        );
        self.config.max_attempts = attempts;
        self
    }

    /// How long one attempt may take, from connecting to the end of the
    /// response body (default 10 s).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::client::IdempotentClientLayer;
    ///
    /// let layer = IdempotentClientLayer::new().attempt_timeout(Duration::from_secs(5));
    /// # let _ = layer;
    /// ```
    pub fn attempt_timeout(mut self, timeout: Duration) -> Self {
        self.config.attempt_timeout = timeout;
        self
    }

    /// How long the whole call may take, waits included (default 30 s): no
    /// attempt starts after it, and a wait the server asks for that would
    /// end past it ends the call with that answer.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::client::IdempotentClientLayer;
    ///
    /// let layer = IdempotentClientLayer::new().deadline(Duration::from_secs(60));
    /// # let _ = layer;
    /// ```
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.config.deadline = deadline;
        self
    }

    /// The back-off: `first` before the first retry, doubling, at most
    /// `max` (default 0.5 s and 8 s), each wait within ±25 %.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::client::IdempotentClientLayer;
    ///
    /// let layer = IdempotentClientLayer::new().backoff(Duration::from_millis(200), Duration::from_secs(2));
    /// # let _ = layer;
    /// ```
    pub fn backoff(mut self, first: Duration, max: Duration) -> Self {
        self.config.first_backoff = first;
        self.config.max_backoff = max.max(first);
        self
    }

    /// The largest request body held to be sent again (default 1 MiB); a
    /// larger one fails the call before anything is sent
    /// ([`ClientError::BodyTooLarge`]).
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::client::IdempotentClientLayer;
    ///
    /// let layer = IdempotentClientLayer::new().max_body(64 * 1024);
    /// # let _ = layer;
    /// ```
    pub fn max_body(mut self, bytes: usize) -> Self {
        self.config.max_body = bytes;
        self
    }

    /// The largest response body read (default 16 MiB;
    /// [`ClientError::ResponseTooLarge`]).
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::client::IdempotentClientLayer;
    ///
    /// let layer = IdempotentClientLayer::new().max_response_body(1024 * 1024);
    /// # let _ = layer;
    /// ```
    pub fn max_response_body(mut self, bytes: usize) -> Self {
        self.config.max_response_body = bytes;
        self
    }
}

impl<S> tower_layer::Layer<S> for IdempotentClientLayer {
    type Service = IdempotentClient<S>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotentClient::new(inner, self.config.clone())
    }
}
