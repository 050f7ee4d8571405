//! Metrics through the `metrics` facade (feature `metrics`) for what both
//! doors share: store latency, completions lost or retried, cache lookups.
//! The HTTP door's span and outcome counter are in `http::observe`.

#[cfg(feature = "metrics")]
use std::time::Instant;

/// Names of the metrics, for dashboards and alerts (listed in the README).
#[cfg(feature = "metrics")]
pub(crate) mod names {
    /// Counter, label `outcome`: what the layer did with each keyed request.
    pub(crate) const OUTCOMES: &str = "idempotency_outcomes_total";
    /// Counter: responses sent but not stored, so a retry may execute again.
    pub(crate) const COMPLETIONS_LOST: &str = "idempotency_completions_lost_total";
    /// Counter: claims granted over earlier ones whose leases lapsed before
    /// they completed — work that may have taken effect, run again.
    pub(crate) const TAKEOVERS: &str = "idempotency_takeovers_total";
    /// Counter, label `result` (`stored`, `lost`, `gave_up`): completions retried
    /// in the background.
    pub(crate) const COMPLETION_RETRIES: &str = "idempotency_completion_retries_total";
    /// Counter, label `result` (`hit`, `miss`): `CachedStore` lookups.
    pub(crate) const CACHE_LOOKUPS: &str = "idempotency_cache_lookups_total";
    /// Histogram, label `operation` (`claim`, `extend`, `complete`,
    /// `release`): store latency in seconds.
    pub(crate) const STORE_SECONDS: &str = "idempotency_store_duration_seconds";
    /// Counter, labels `disposition` (`ack`, `retry`, `dead_letter`) and
    /// `reason` (a dead letter's, else empty): settled deliveries.
    pub(crate) const MESSAGE_DISPOSITIONS: &str = "idempotency_message_dispositions_total";
    /// Counter: HTTP requests the client layer sent.
    #[cfg(feature = "client")]
    pub(crate) const CLIENT_ATTEMPTS: &str = "idempotency_client_attempts_total";
    /// Counter, label `reason`: attempts the client layer retried.
    #[cfg(feature = "client")]
    pub(crate) const CLIENT_RETRIES: &str = "idempotency_client_retries_total";
    /// Counter, label `outcome` (`success`, `failed`, `no_answer`): calls
    /// through the client layer, by their end.
    #[cfg(feature = "client")]
    pub(crate) const CLIENT_CALLS: &str = "idempotency_client_calls_total";
    /// Counter, label `result` (`published`, `retried`, `refused`):
    /// outbox messages the relay handled.
    pub(crate) const OUTBOX_MESSAGES: &str = "idempotency_outbox_messages_total";
    /// Gauge: outbox messages committed and not yet published.
    pub(crate) const OUTBOX_PENDING: &str = "idempotency_outbox_pending";
    /// Gauge: how long the oldest of them has waited, in seconds (0: none
    /// waits).
    pub(crate) const OUTBOX_OLDEST_PENDING: &str = "idempotency_outbox_oldest_pending_seconds";
    /// Gauge: outbox messages refused by the broker for good, kept.
    pub(crate) const OUTBOX_REFUSED: &str = "idempotency_outbox_refused";
    /// Gauge: sent outbox messages past the retention, for the next sweep.
    pub(crate) const OUTBOX_AWAITING_SWEEP: &str = "idempotency_outbox_awaiting_sweep";
}

/// A metric whose one label takes its value from a known set. `metrics`
/// builds the key of a literal label once, statically, but allocates it on
/// every call for a value held in a variable — so the known values are
/// matched to literals, and any other takes the allocating path.
#[cfg(feature = "metrics")]
macro_rules! labelled {
    ($kind:ident!($name:expr, $label:literal => $value:expr, one of [$($known:tt),*])) => {
        match $value {
            $($known => metrics::$kind!($name, $label => $known),)*
            other => metrics::$kind!($name, $label => other),
        }
    };
}
#[cfg(feature = "metrics")]
pub(crate) use labelled;

/// A response went out unstored: a retry may execute again.
pub(crate) fn completion_lost() {
    #[cfg(feature = "metrics")]
    metrics::counter!(names::COMPLETIONS_LOST).increment(1);
}

/// A claim was granted over lapsed ones: see [`names::TAKEOVERS`].
pub(crate) fn takeover() {
    #[cfg(feature = "metrics")]
    metrics::counter!(names::TAKEOVERS).increment(1);
}

/// A background completion retry ended: `stored`, `lost` or `gave_up`.
pub(crate) fn completion_retried(result: &'static str) {
    #[cfg(feature = "metrics")]
    labelled!(counter!(names::COMPLETION_RETRIES, "result" => result, one of ["stored", "lost", "gave_up"]))
        .increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = result;
}

/// A `CachedStore` lookup: `hit` or `miss`.
// Counted by the cache alone: a build without it counts none.
#[cfg_attr(not(feature = "cache"), allow(dead_code))]
pub(crate) fn cache_lookup(result: &'static str) {
    #[cfg(feature = "metrics")]
    labelled!(counter!(names::CACHE_LOOKUPS, "result" => result, one of ["hit", "miss"]))
        .increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = result;
}

/// A delivery settled: `ack`, `retry` or `dead_letter`, with a dead
/// letter's reason (else empty).
pub(crate) fn message_settled(disposition: &'static str, reason: &'static str) {
    #[cfg(feature = "metrics")]
    metrics::counter!(names::MESSAGE_DISPOSITIONS, "disposition" => disposition, "reason" => reason)
        .increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = (disposition, reason);
}

/// A relay round: messages published, retried later, refused for good.
pub(crate) fn outbox(published: usize, retried: usize, refused: usize) {
    #[cfg(feature = "metrics")]
    {
        let count = |n: usize| n as u64;
        metrics::counter!(names::OUTBOX_MESSAGES, "result" => "published")
            .increment(count(published));
        metrics::counter!(names::OUTBOX_MESSAGES, "result" => "retried").increment(count(retried));
        metrics::counter!(names::OUTBOX_MESSAGES, "result" => "refused").increment(count(refused));
    }
    #[cfg(not(feature = "metrics"))]
    let _ = (published, retried, refused);
}

/// The current span's trace context (W3C `traceparent`, `tracestate`), as
/// headers of a message it sends: what the consumer continues. Through the
/// application's global propagator, with the `opentelemetry` feature;
/// nothing without it.
#[cfg(sql)]
pub(crate) fn trace_context_into(headers: &mut Vec<(String, String)>) {
    #[cfg(feature = "opentelemetry")]
    {
        use tracing_opentelemetry::OpenTelemetrySpanExt;
        let context = tracing::Span::current().context();
        let mut injected = std::collections::HashMap::new();
        opentelemetry::global::get_text_map_propagator(|propagator| {
            propagator.inject_context(&context, &mut injected)
        });
        for (name, value) in injected {
            if !headers.iter().any(|(n, _)| n.eq_ignore_ascii_case(&name)) {
                headers.push((name, value));
            }
        }
    }
    #[cfg(not(feature = "opentelemetry"))]
    let _ = headers;
}

/// Makes `span` continue the trace a message carried (`traceparent`,
/// `tracestate`), through the application's global propagator, with the
/// `opentelemetry` feature.
pub(crate) fn continue_trace(span: &tracing::Span, (parent, state): (Option<&str>, Option<&str>)) {
    #[cfg(feature = "opentelemetry")]
    {
        use tracing_opentelemetry::OpenTelemetrySpanExt;
        let Some(parent) = parent else { return };
        let mut carried = std::collections::HashMap::new();
        carried.insert("traceparent".to_owned(), parent.to_owned());
        if let Some(state) = state {
            carried.insert("tracestate".to_owned(), state.to_owned());
        }
        let context = opentelemetry::global::get_text_map_propagator(|propagator| {
            propagator.extract(&carried)
        });
        let _ = span.set_parent(context);
    }
    #[cfg(not(feature = "opentelemetry"))]
    let _ = (span, parent, state);
}

/// Links `span` (a relay's publication) to the trace a message carries
/// from the request that enqueued it, with the `opentelemetry` feature: the
/// publication is its own span, the consumer continues the request's trace.
pub(crate) fn link_trace(span: &tracing::Span, (parent, state): (Option<&str>, Option<&str>)) {
    #[cfg(feature = "opentelemetry")]
    {
        use opentelemetry::trace::TraceContextExt;
        use tracing_opentelemetry::OpenTelemetrySpanExt;
        let Some(parent) = parent else { return };
        let mut carried = std::collections::HashMap::new();
        carried.insert("traceparent".to_owned(), parent.to_owned());
        if let Some(state) = state {
            carried.insert("tracestate".to_owned(), state.to_owned());
        }
        let context = opentelemetry::global::get_text_map_propagator(|propagator| {
            propagator.extract(&carried)
        });
        let linked = context.span().span_context().clone();
        if linked.is_valid() {
            span.add_link(linked);
        }
    }
    #[cfg(not(feature = "opentelemetry"))]
    let _ = (span, parent, state);
}

/// Times one store operation.
pub(crate) async fn store_call<T>(operation: &'static str, call: impl Future<Output = T>) -> T {
    #[cfg(feature = "metrics")]
    {
        let started = Instant::now();
        let output = call.await;
        labelled!(histogram!(names::STORE_SECONDS, "operation" => operation,
            one of ["claim", "extend", "complete", "release"]))
        .record(started.elapsed().as_secs_f64());
        output
    }
    #[cfg(not(feature = "metrics"))]
    {
        let _ = operation;
        call.await
    }
}
