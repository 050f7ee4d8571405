//! The call: the request's body held, one key for every attempt, each
//! attempt judged, the wait before the next one.

use std::{
    future::{Future, poll_fn},
    pin::Pin,
    task::{Context, Poll},
};

use bytes::Bytes;
use http::{HeaderValue, Request, Response, request::Parts};
use http_body::Body;
use http_body_util::Full;
use tokio::time::Instant;
use tower_service::Service;

use super::{
    BoxError, ClientError, Config, IdempotentCall,
    body::{self, BufferedBody, ReadError},
    decide::{self, Reason, Verdict},
};
use crate::http::replay::IDEMPOTENT_REPLAYED;

/// The future of a call through [`IdempotentClient`].
pub type ResponseFuture =
    Pin<Box<dyn Future<Output = Result<Response<BufferedBody>, ClientError>> + Send>>;

/// A client service behind [`IdempotentClientLayer`](super::IdempotentClientLayer).
#[derive(Clone, Debug)]
pub struct IdempotentClient<S> {
    inner: S,
    config: Config,
}

impl<S> IdempotentClient<S> {
    pub(super) fn new(inner: S, config: Config) -> Self {
        Self { inner, config }
    }
}

impl<S, B, RB> Service<Request<B>> for IdempotentClient<S>
where
    S: Service<Request<Full<Bytes>>, Response = Response<RB>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
    RB: Body + Send + 'static,
    RB::Data: Send,
    RB::Error: Into<BoxError>,
{
    type Response = Response<BufferedBody>;
    type Error = ClientError;
    type Future = ResponseFuture;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // Each attempt waits for the inner service's readiness itself.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let (inner, config) = (self.inner.clone(), self.config.clone());
        Box::pin(run(inner, config, request))
    }
}

async fn run<S, B, RB>(
    mut inner: S,
    config: Config,
    request: Request<B>,
) -> Result<Response<BufferedBody>, ClientError>
where
    S: Service<Request<Full<Bytes>>, Response = Response<RB>>,
    S::Error: Into<BoxError>,
    B: Body,
    B::Error: Into<BoxError>,
    RB: Body,
    RB::Error: Into<BoxError>,
{
    let (mut parts, body) = request.into_parts();
    let bytes = match body::read(body, config.max_body).await {
        Ok(body) => body.bytes(),
        Err(ReadError::TooLarge) => {
            return Err(ClientError::BodyTooLarge {
                limit: config.max_body,
            });
        }
        Err(ReadError::Failed(error)) => return Err(ClientError::Body(error)),
    };
    let guarded = config.methods.contains(&parts.method);
    let key = guarded.then(|| key_of(&mut parts, &config));
    let max_attempts = if guarded { config.max_attempts } else { 1 };
    let deadline = Instant::now() + config.deadline;
    let mut call = IdempotentCall {
        key,
        attempts: 0,
        replayed: false,
    };

    loop {
        call.attempts += 1;
        observe::attempt();
        let attempt = attempt(&mut inner, &config, &parts, &bytes, deadline);
        let (reason, floor, last) = match attempt.await {
            Attempt::Answer(response) => {
                let trailers = response.body().trailers();
                match decide::verdict(response.status(), response.headers(), trailers) {
                    Verdict::Final => return Ok(finish(response, call)),
                    Verdict::Retry { reason, floor } => (reason, floor, Last::Answer(response)),
                }
            }
            Attempt::TooLarge => {
                observe::call("failed");
                return Err(ClientError::ResponseTooLarge {
                    limit: config.max_response_body,
                    call,
                });
            }
            Attempt::Failed(reason, error) => (reason, None, Last::Error(error)),
        };
        // The wait before the next attempt: the back-off, or longer if the
        // server asked for longer.
        let wait = decide::backoff(call.attempts, config.first_backoff, config.max_backoff)
            .max(floor.unwrap_or_default());
        if call.attempts >= max_attempts || Instant::now() + wait >= deadline {
            tracing::debug!(
                key = call.key.as_deref(),
                attempts = call.attempts,
                "idempotent call: no attempt left"
            );
            return last.end(call);
        }
        tracing::debug!(
            key = call.key.as_deref(),
            reason = reason.name(),
            ?wait,
            attempt = call.attempts,
            "idempotent call: retrying"
        );
        observe::retry(reason);
        tokio::time::sleep(wait).await;
    }
}

/// The caller's key, or a new one (a UUID v4) set on the request: the
/// same on every attempt.
fn key_of(parts: &mut Parts, config: &Config) -> String {
    if let Some(given) = parts.headers.get(&config.header) {
        return String::from_utf8_lossy(given.as_bytes()).into_owned();
    }
    let key = uuid::Uuid::new_v4().to_string();
    let value = HeaderValue::from_str(&key).expect("a UUID is a header value");
    parts.headers.insert(config.header.clone(), value);
    key
}

// One per attempt, moved once: not worth a box.
#[allow(clippy::large_enum_variant)]
enum Attempt {
    Answer(Response<BufferedBody>),
    TooLarge,
    Failed(Reason, BoxError),
}

/// One attempt, bounded by its timeout and the deadline: the inner
/// service made ready, the request sent, the answer read in full.
async fn attempt<S, RB>(
    inner: &mut S,
    config: &Config,
    parts: &Parts,
    bytes: &Bytes,
    deadline: Instant,
) -> Attempt
where
    S: Service<Request<Full<Bytes>>, Response = Response<RB>>,
    S::Error: Into<BoxError>,
    RB: Body,
    RB::Error: Into<BoxError>,
{
    let budget = config
        .attempt_timeout
        .min(deadline.saturating_duration_since(Instant::now()));
    let mut request = Request::new(Full::new(bytes.clone()));
    *request.method_mut() = parts.method.clone();
    *request.uri_mut() = parts.uri.clone();
    *request.version_mut() = parts.version;
    *request.headers_mut() = parts.headers.clone();
    let sent = async {
        poll_fn(|cx| inner.poll_ready(cx))
            .await
            .map_err(Into::into)?;
        let response = inner.call(request).await.map_err(Into::into)?;
        let (head, body) = response.into_parts();
        match body::read(body, config.max_response_body).await {
            Ok(body) => Ok(Ok(Response::from_parts(head, body))),
            Err(ReadError::TooLarge) => Ok(Err(())),
            Err(ReadError::Failed(error)) => Err(error),
        }
    };
    match tokio::time::timeout(budget, sent).await {
        Ok(Ok(Ok(response))) => Attempt::Answer(response),
        Ok(Ok(Err(()))) => Attempt::TooLarge,
        Ok(Err(error)) => Attempt::Failed(Reason::Connection, error),
        Err(_) => Attempt::Failed(
            Reason::Timeout,
            format!("the attempt took longer than {budget:?}").into(),
        ),
    }
}

/// The last attempt's result, for a call that ran out of attempts or time.
// Made once per call, at its end: not worth a box.
#[allow(clippy::large_enum_variant)]
enum Last {
    Answer(Response<BufferedBody>),
    Error(BoxError),
}

impl Last {
    fn end(self, call: IdempotentCall) -> Result<Response<BufferedBody>, ClientError> {
        match self {
            Last::Answer(response) => Ok(finish(response, call)),
            Last::Error(source) => {
                observe::call("no_answer");
                Err(ClientError::NoAnswer { call, source })
            }
        }
    }
}

/// The final answer, with what the caller learns of the call.
fn finish(
    mut response: Response<BufferedBody>,
    mut call: IdempotentCall,
) -> Response<BufferedBody> {
    call.replayed = response
        .headers()
        .get(IDEMPOTENT_REPLAYED)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"true"));
    observe::call(if response.status().is_success() {
        "success"
    } else {
        "failed"
    });
    response.extensions_mut().insert(call);
    response
}

/// The client's metrics (feature `metrics`).
mod observe {
    use super::Reason;
    #[cfg(feature = "metrics")]
    use crate::observe::{labelled, names};

    pub(super) fn attempt() {
        #[cfg(feature = "metrics")]
        metrics::counter!(names::CLIENT_ATTEMPTS).increment(1);
    }

    pub(super) fn retry(reason: Reason) {
        #[cfg(feature = "metrics")]
        labelled!(counter!(names::CLIENT_RETRIES, "reason" => reason.name(), one of ["connection", "timeout", "in_flight", "rate_limited", "unavailable", "grpc"]))
            .increment(1);
        #[cfg(not(feature = "metrics"))]
        let _ = reason;
    }

    pub(super) fn call(outcome: &'static str) {
        #[cfg(feature = "metrics")]
        labelled!(counter!(names::CLIENT_CALLS, "outcome" => outcome, one of ["success", "failed", "no_answer"]))
            .increment(1);
        #[cfg(not(feature = "metrics"))]
        let _ = outcome;
    }
}
