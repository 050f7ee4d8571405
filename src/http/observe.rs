//! What the HTTP door tells operators: a span per keyed request with its
//! outcome, the outcome counter, and logs that an outage cannot turn into a
//! flood.

use std::{
    sync::atomic::{AtomicU64, Ordering},
    time::{Duration, Instant},
};

use axum_core::body::Body;
use http::Response;
use tracing::Instrument;

use super::outcome::{Answered, IdempotencyOutcome};
#[cfg(feature = "metrics")]
use crate::observe::{labelled, names};
use crate::store::StorageKey;

/// The span of one keyed request: the handler's own logs nest inside it.
/// The scope is never a field (it may be a credential); the storage key,
/// which carries its hash, is. A sensitive key is recorded only once it is
/// known hashed ([`record_key`]). Its OpenTelemetry status (through
/// `tracing-opentelemetry`'s `otel.status_code`) is set only when the
/// layer failed the request ([`IdempotencyOutcome::is_failure`]): a
/// replay, a duplicate in flight, a refused key are answers, not errors.
pub(crate) fn request_span(key: &str, sensitive: bool) -> tracing::Span {
    let span = tracing::info_span!(
        "idempotency",
        idempotency.key = tracing::field::Empty,
        idempotency.storage_key = tracing::field::Empty,
        idempotency.outcome = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
    );
    if !sensitive && !key.is_empty() {
        span.record("idempotency.key", tracing::field::display(key));
    }
    span
}

/// Records the request's storage key on its span: as it is, or — a
/// sensitive key — hashed, as both its fields.
pub(crate) fn record_key(span: &tracing::Span, key: &StorageKey) {
    if key.is_sensitive() {
        span.record("idempotency.key", tracing::field::display(key));
    }
    span.record("idempotency.storage_key", tracing::field::display(key));
}

/// Runs a keyed request's future in its span, then records what became of it
/// (on the span and in the metrics) and stamps it on the response.
pub(crate) async fn recorded<E>(
    span: tracing::Span,
    request: impl Future<Output = Result<Answered, E>>,
) -> Result<Response<Body>, E> {
    let answered = request.instrument(span.clone()).await?;
    record_outcome(&span, &answered.outcome);
    Ok(answered.stamped())
}

fn record_outcome(span: &tracing::Span, outcome: &IdempotencyOutcome) {
    span.record("idempotency.outcome", outcome.name());
    if outcome.is_failure() {
        span.record("otel.status_code", "error");
    }
    #[cfg(feature = "metrics")]
    labelled!(
        counter!(names::OUTCOMES, "outcome" => outcome.name(), one of ["executed", "replayed"])
    )
    .increment(1);
}

/// Lets one log line through per interval and counts the rest, so that an
/// outage's `503`s are logged once a second, not once per request.
#[derive(Debug)]
pub(crate) struct Throttle {
    every: Duration,
    origin: Instant,
    /// When the last line went through, in milliseconds since `origin`, plus
    /// one (zero: never).
    last: AtomicU64,
    suppressed: AtomicU64,
}

impl Throttle {
    pub(crate) fn new(every: Duration) -> Self {
        Self {
            every,
            origin: Instant::now(),
            last: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
        }
    }

    /// `Some(lines suppressed since the last one)` when this line may be
    /// logged, `None` when it is one of the suppressed.
    pub(crate) fn admit(&self) -> Option<u64> {
        let now = self.origin.elapsed().as_millis() as u64 + 1;
        let last = self.last.load(Ordering::Relaxed);
        let due = last == 0 || now.saturating_sub(last) >= self.every.as_millis() as u64;
        if due
            && self
                .last
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            return Some(self.suppressed.swap(0, Ordering::Relaxed));
        }
        self.suppressed.fetch_add(1, Ordering::Relaxed);
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_throttle_admits_one_line_per_interval_and_counts_the_rest() {
        let throttle = Throttle::new(Duration::from_millis(50));
        assert_eq!(throttle.admit(), Some(0));
        for _ in 0..99 {
            assert_eq!(throttle.admit(), None);
        }
        std::thread::sleep(Duration::from_millis(60));
        assert_eq!(throttle.admit(), Some(99));
        assert_eq!(throttle.admit(), None);
    }
}
