//! What the crate's spans say through OpenTelemetry, captured as an
//! application exports them (`tracing-opentelemetry` into the SDK's
//! in-memory exporter): a replay is not an error; a failure of the layer
//! is; a consumer's span carries the messaging conventions' attributes and
//! the business key; sensitive keys never appear raw, in spans or in logs.
//!
//! The subscriber is the thread's default: each test runs on a
//! current-thread runtime, so every task the layer spawns reports to it.

// The suite runs against every store: `cargo test --all-features`.
#![cfg(every_store)]

mod support;

use std::time::Duration;

use opentelemetry::{
    Value,
    trace::{SpanKind, Status, TracerProvider as _},
};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use support::{
    app::{Counter, routes},
    http::{oneshot, post},
    logs::Logs,
};
use tower_idempotency::{
    IdempotencyLayer, MemoryStore, SensitiveKeys,
    message::{DeadLetterReason, Delivery, Disposition, IdempotencyProcessor},
    store::StorageKey,
    testing::{FaultyStore, Op},
};
use tracing::subscriber::DefaultGuard;
use tracing_subscriber::layer::SubscriberExt;

/// Spans exported while it lives, and the log lines written meanwhile.
struct Exported {
    exporter: InMemorySpanExporter,
    provider: SdkTracerProvider,
    logs: Logs,
    _guard: DefaultGuard,
}

impl Exported {
    fn capture() -> Self {
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        let logs = Logs::default();
        let writer = logs.clone();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("telemetry-test")))
            .with(
                tracing_subscriber::fmt::layer()
                    .with_ansi(false)
                    .with_writer(move || writer.clone()),
            )
            .with(tracing_subscriber::EnvFilter::new(
                "tower_idempotency=trace",
            ));
        let guard = support::logs::scoped(subscriber);
        Self {
            exporter,
            provider,
            logs,
            _guard: guard,
        }
    }

    /// The spans named `name` (their OpenTelemetry name), in the order
    /// they ended.
    fn spans(&self, name: &str) -> Vec<SpanData> {
        self.provider.force_flush().unwrap();
        self.exporter
            .get_finished_spans()
            .unwrap()
            .into_iter()
            .filter(|span| span.name == name)
            .collect()
    }
}

impl Exported {
    /// Every span of `spans` shows the key as `logged`, and neither they
    /// nor the log lines hold `raw`; a line shows `logged`.
    fn assert_hidden(&self, spans: &[SpanData], logged: &str, raw: &str) {
        for span in spans {
            assert_eq!(attribute(span, "idempotency.key").as_deref(), Some(logged));
            assert!(!every_value(span).contains(raw), "{}", every_value(span));
        }
        let logs = self.logs.text();
        assert!(logs.contains(logged), "{logs}");
        assert!(!logs.contains(raw), "a raw key was logged:\n{logs}");
    }
}

/// `span`'s attribute `key`, as text.
fn attribute(span: &SpanData, key: &str) -> Option<String> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| match &kv.value {
            Value::String(s) => s.as_str().to_owned(),
            other => other.to_string(),
        })
}

fn every_value(span: &SpanData) -> String {
    span.attributes
        .iter()
        .map(|kv| format!("{}={} ", kv.key, kv.value))
        .collect()
}

const CHARGE: &str = r#"{"amount":1999,"currency":"eur"}"#;

/// The secret sensitive keys are keyed with in these tests.
const SECRET: &[u8] = b"a test secret, 16 bytes or more";

#[tokio::test]
async fn a_replay_is_not_an_error_and_each_span_says_what_became_of_its_request() {
    let exported = Exported::capture();
    let counter = Counter::default();
    let app =
        routes(counter.clone()).layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant());

    let first = oneshot(&app, post("/charges", "order-42", CHARGE)).await;
    let replay = oneshot(&app, post("/charges", "order-42", CHARGE)).await;
    assert!(!first.is_replay() && replay.is_replay());
    assert_eq!(counter.get(), 1);

    let spans = exported.spans("idempotency");
    assert_eq!(spans.len(), 2, "{spans:?}");
    let outcomes: Vec<_> = spans
        .iter()
        .map(|s| attribute(s, "idempotency.outcome").unwrap())
        .collect();
    assert_eq!(outcomes, ["executed", "replayed"]);
    for span in &spans {
        assert_eq!(span.status, Status::Unset, "{}", every_value(span));
        assert_eq!(span.span_kind, SpanKind::Internal);
        assert_eq!(
            attribute(span, "idempotency.key").as_deref(),
            Some("order-42")
        );
        let stored = attribute(span, "idempotency.storage_key").unwrap();
        assert!(stored.ends_with(":order-42"), "{stored}");
    }
}

#[tokio::test]
async fn a_store_out_of_reach_is_the_span_s_error() {
    let exported = Exported::capture();
    let store = FaultyStore::new(MemoryStore::new()).errors(Op::Claim, 1.0);
    let app = routes(Counter::default()).layer(IdempotencyLayer::new(store).single_tenant());

    oneshot(&app, post("/charges", "order-7", CHARGE))
        .await
        .assert_problem(503);

    let spans = exported.spans("idempotency");
    assert_eq!(spans.len(), 1);
    assert!(
        matches!(spans[0].status, Status::Error { .. }),
        "{:?}",
        spans[0].status
    );
    assert_eq!(
        attribute(&spans[0], "idempotency.outcome").as_deref(),
        Some("rejected_store_unavailable")
    );
}

#[tokio::test]
async fn sensitive_keys_are_hashed_in_spans_and_logs() {
    let exported = Exported::capture();
    let key = "jane.doe@example.com-order-9";
    let app = routes(Counter::default()).layer(
        IdempotencyLayer::new(MemoryStore::new())
            .single_tenant()
            .sensitive_keys(SensitiveKeys::keyed(SECRET)),
    );
    oneshot(&app, post("/charges", key, CHARGE)).await;
    oneshot(&app, post("/charges", key, CHARGE)).await;
    // A reused key is logged (info): hashed too.
    oneshot(&app, post("/charges", key, r#"{"amount":1}"#))
        .await
        .assert_problem(422);

    let address = StorageKey::new("", &tower_idempotency::IdempotencyKey::new(key).unwrap());
    let logged = SensitiveKeys::keyed(SECRET).show(&address);
    // Keyed: not the plain hash anyone could recompute from a guessed key.
    assert!(logged.starts_with("hmac:"), "{logged}");
    assert_ne!(logged, SensitiveKeys::unkeyed().show(&address));
    let spans = exported.spans("idempotency");
    assert_eq!(spans.len(), 3);
    exported.assert_hidden(&spans, &logged, "jane");
    assert!(
        !exported
            .logs
            .text()
            .contains(&SensitiveKeys::unkeyed().show(&address))
    );
}

#[tokio::test]
async fn a_delivery_s_span_follows_the_messaging_conventions() {
    let exported = Exported::capture();
    let orders = IdempotencyProcessor::new(MemoryStore::new()).scope("orders");
    let payload = br#"{"order_id":"order-42","amount":1999}"#;
    let delivery = || {
        Delivery::new("order-42", payload)
            .messaging_system("aws_sqs")
            .destination("orders")
    };
    let charge = async |_: &mut _| Ok::<_, std::io::Error>("ch_1".to_owned());
    let passing = |_: &std::io::Error| false;

    let first = orders
        .settle(delivery().message_id("m-1"), charge, passing)
        .await;
    let again = orders
        .settle(delivery().message_id("m-2"), charge, passing)
        .await;
    let reused = orders
        .settle(
            Delivery::new("order-42", br#"{"order_id":"order-42","amount":1}"#)
                .messaging_system("aws_sqs")
                .destination("orders")
                .message_id("m-3"),
            charge,
            passing,
        )
        .await;
    assert_eq!(first.disposition, Disposition::Ack);
    assert_eq!(again.disposition, Disposition::Ack);
    assert_eq!(
        reused.disposition,
        Disposition::DeadLetter(DeadLetterReason::Mismatch)
    );

    let spans = exported.spans("process orders");
    assert_eq!(spans.len(), 3, "{spans:?}");
    for (span, id) in spans.iter().zip(["m-1", "m-2", "m-3"]) {
        assert_eq!(span.span_kind, SpanKind::Consumer);
        assert_eq!(
            attribute(span, "messaging.system").as_deref(),
            Some("aws_sqs")
        );
        assert_eq!(
            attribute(span, "messaging.destination.name").as_deref(),
            Some("orders")
        );
        assert_eq!(attribute(span, "messaging.message.id").as_deref(), Some(id));
        assert_eq!(
            attribute(span, "messaging.operation.type").as_deref(),
            Some("process")
        );
        assert_eq!(
            attribute(span, "idempotency.key").as_deref(),
            Some("order-42")
        );
    }
    // A duplicate is acknowledged: not an error. What can never be
    // processed is.
    assert_eq!(spans[0].status, Status::Unset);
    assert_eq!(spans[1].status, Status::Unset);
    assert!(matches!(spans[2].status, Status::Error { .. }));
    assert_eq!(
        attribute(&spans[2], "idempotency.dead_letter_reason").as_deref(),
        Some("mismatch")
    );
    // Each attempt is a span inside its delivery's.
    let attempts = exported.spans("idempotency");
    let outcomes: Vec<_> = attempts
        .iter()
        .map(|s| attribute(s, "idempotency.outcome").unwrap())
        .collect();
    assert_eq!(outcomes, ["executed", "duplicate", "mismatch"]);
    for (attempt, delivery) in attempts.iter().zip(&spans) {
        assert_eq!(attempt.parent_span_id, delivery.span_context.span_id());
        // One meaning per field, as on the HTTP door: the key as given,
        // and the store's address beside it.
        assert_eq!(
            attribute(attempt, "idempotency.key").as_deref(),
            Some("order-42")
        );
        let address = StorageKey::new(
            "orders",
            &tower_idempotency::IdempotencyKey::new("order-42").unwrap(),
        );
        assert_eq!(
            attribute(attempt, "idempotency.storage_key").as_deref(),
            Some(address.as_str())
        );
    }
}

#[tokio::test]
async fn a_consumer_s_sensitive_keys_are_hashed_in_spans_and_logs() {
    let exported = Exported::capture();
    // The store unavailable: the delivery is retried in hand (each attempt
    // logged), then given back.
    let store = FaultyStore::new(MemoryStore::new()).errors(Op::Claim, 1.0);
    let orders = IdempotencyProcessor::new(store)
        .scope("orders")
        .sensitive_keys(SensitiveKeys::keyed(SECRET))
        .budget(
            tower_idempotency::message::DeliveryBudget::new()
                .backoff_between(Duration::from_millis(1), Duration::from_millis(2))
                .give_back_after(Duration::from_millis(30)),
        );
    let key = "jane.doe@example.com";
    let settled = orders
        .settle(
            Delivery::new(key, b"{}").destination("orders"),
            async |_: &mut _| Ok::<_, std::io::Error>(()),
            |_| false,
        )
        .await;
    assert!(
        matches!(settled.disposition, Disposition::Retry { .. }),
        "{:?}",
        settled.disposition
    );
    let logged = SensitiveKeys::keyed(SECRET).show(&StorageKey::new(
        "orders",
        &tower_idempotency::IdempotencyKey::new(key).unwrap(),
    ));
    let spans = [
        exported.spans("process orders"),
        exported.spans("idempotency"),
    ]
    .concat();
    assert!(spans.len() >= 2, "{spans:?}");
    exported.assert_hidden(&spans, &logged, "jane");
}

/// The futures the doors hand out can be spawned on a multi-threaded
/// runtime.
#[test]
fn the_doors_futures_are_send() {
    fn send<T: Send>(_: T) {}
    let orders = IdempotencyProcessor::new(MemoryStore::new());
    let work = async |_: &mut _| Ok::<_, std::io::Error>(());
    send(orders.process("k", b"{}", work));
    send(orders.settle(Delivery::new("k", b"{}"), work, |_| false));
}

/// A relay's publisher that keeps what it is given.
#[cfg(feature = "opentelemetry")]
#[derive(Clone, Default)]
struct Kept(std::sync::Arc<std::sync::Mutex<Vec<tower_idempotency::outbox::OutboxMessage>>>);

#[cfg(feature = "opentelemetry")]
impl tower_idempotency::outbox::Publisher for Kept {
    async fn publish(
        &self,
        message: &tower_idempotency::outbox::OutboxMessage,
    ) -> Result<(), tower_idempotency::outbox::PublishError> {
        self.0.lock().unwrap().push(message.clone());
        Ok(())
    }
}

/// A charge, the publication of its event and the booking a consumer
/// makes of it are one trace: the request's context travels in the
/// message's `traceparent`, the relay's `publish` span links to it, and
/// the consumer's `process` span is its child.
#[cfg(feature = "opentelemetry")]
#[tokio::test]
async fn a_charge_its_publication_and_its_booking_are_one_trace() {
    use axum::{Router, http::StatusCode, routing};
    use tower_idempotency::{
        IdempotentTx, SqliteStore, SqliteTx,
        outbox::{Outbox, OutboxRelay, OutgoingMessage},
    };

    opentelemetry::global::set_text_map_propagator(
        opentelemetry_sdk::propagation::TraceContextPropagator::new(),
    );
    let exported = Exported::capture();
    let file = tower_idempotency_harness::sqlite::TestFile::create();
    let store = SqliteStore::builder()
        .transactional()
        .create_table_if_missing()
        .connect(&file.url())
        .await
        .unwrap();
    let outbox = Outbox::on(&store)
        .create_table_if_missing()
        .build()
        .await
        .unwrap();
    let events = outbox.clone();
    let app = Router::new()
        .route(
            "/charges",
            routing::post(move |mut tx: IdempotentTx<SqliteTx>| async move {
                let event = OutgoingMessage::new("charges", br#"{"charge":"ch_1"}"#.to_vec());
                events.enqueue(&mut tx, event).await.unwrap();
                StatusCode::CREATED
            }),
        )
        .layer(IdempotencyLayer::new(store).single_tenant());
    oneshot(&app, post("/charges", "order-7", CHARGE)).await;
    let kept = Kept::default();
    OutboxRelay::new(outbox, kept.clone())
        .run_once()
        .await
        .unwrap();
    let message = kept.0.lock().unwrap()[0].clone();
    let header = |name: &str| {
        message
            .headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.clone())
    };
    let traceparent = header("traceparent").expect("the request's context travels");
    let ledger = IdempotencyProcessor::new(MemoryStore::new()).scope("ledger");
    let booked = ledger
        .settle(
            Delivery::new("ch_1", &message.payload)
                .destination("charges")
                .message_id(&message.id)
                .trace_context(Some(&traceparent), None),
            async |_: &mut _| Ok::<_, std::io::Error>(()),
            |_: &std::io::Error| false,
        )
        .await;
    assert_eq!(booked.disposition, Disposition::Ack);

    let request = exported
        .spans("idempotency")
        .into_iter()
        .find(|span| attribute(span, "idempotency.key").as_deref() == Some("order-7"));
    let request = request.expect("the request's span").span_context;
    let publish = exported.spans("publish charges");
    assert_eq!(publish.len(), 1);
    assert_eq!(publish[0].span_kind, SpanKind::Producer);
    assert!(
        publish[0]
            .links
            .iter()
            .any(|link| link.span_context.trace_id() == request.trace_id()),
        "the publication links to the request: {:?}",
        publish[0].links
    );
    let process = exported.spans("process charges");
    assert_eq!(process.len(), 1);
    assert_eq!(
        process[0].span_context.trace_id(),
        request.trace_id(),
        "the booking continues the charge's trace"
    );
}
