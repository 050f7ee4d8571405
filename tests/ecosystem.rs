//! What an application sees of the layer besides its answers: the key in
//! the handler, a custom header, the span around handler logs, metrics, and
//! logs that an outage cannot flood.

// The suite runs against every store: `cargo test --all-features`.
#![cfg(all(every_store, feature = "metrics"))]

mod support;

use std::time::Duration;

use axum::{Extension, Router, body::Body, response::IntoResponse, routing};
use http::{HeaderName, Request, StatusCode};
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use tower_idempotency::{
    IdempotencyKey, IdempotencyLayer, MemoryStore, RedisStore, Rejection, RejectionKind,
};

use support::{
    http::{oneshot, post},
    logs::Logs,
    redis_server::RedisServer,
};

const CHARGE: &str = r#"{"amount":1999,"currency":"eur"}"#;

/// A handler that passes the key on, as to a payment processor, and logs.
fn echo_key() -> Router {
    Router::new().route(
        "/charges",
        routing::post(|Extension(key): Extension<IdempotencyKey>| async move {
            tracing::info!("charging with the processor");
            (StatusCode::CREATED, format!("processor key: {key}"))
        }),
    )
}

#[tokio::test]
async fn the_handler_receives_the_validated_key() {
    let app = echo_key().layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant());
    // Quoted (sf-string) in the header, plain in the handler.
    let request = Request::post("/charges")
        .header("idempotency-key", "\"order-42\"")
        .body(Body::from(CHARGE))
        .unwrap();
    let reply = oneshot(&app, request).await;
    assert_eq!(reply.status, StatusCode::CREATED);
    assert_eq!(reply.body, "processor key: order-42");
}

#[tokio::test]
async fn the_key_header_can_be_renamed() {
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .single_tenant()
        .header_name(HeaderName::from_static("x-request-key"))
        .require_key(true);
    let app = echo_key().layer(layer);
    let request = |header: &str| {
        Request::post("/charges")
            .header(header, "k1")
            .body(Body::from(CHARGE))
            .unwrap()
    };
    assert_eq!(
        oneshot(&app, request("x-request-key")).await.status,
        StatusCode::CREATED
    );
    assert!(oneshot(&app, request("x-request-key")).await.is_replay());
    // The default header means nothing now: the key is missing.
    oneshot(&app, request("idempotency-key"))
        .await
        .assert_problem(400);
}

#[test]
fn a_rejection_is_a_response() {
    let response = Rejection::new(RejectionKind::Mismatch).into_response();
    assert_eq!(response.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(
        response.headers()["content-type"],
        "application/problem+json"
    );
    assert_eq!(response.extensions().get(), Some(&RejectionKind::Mismatch));
}

#[tokio::test]
async fn handler_logs_sit_in_a_span_with_the_key_and_the_scope_hashed() {
    let (logs, _guard) = Logs::capture("info");
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .scope_with(|_: &http::request::Parts| Some("acct_secret_scope".to_owned()));
    let app = echo_key().layer(layer);
    oneshot(&app, post("/charges", "order-7", CHARGE)).await;
    let text = logs.text();
    let line = text
        .lines()
        .find(|l| l.contains("charging with the processor"))
        .unwrap_or_else(|| panic!("the handler logged: {text}"));
    assert!(line.contains("idempotency.key=order-7"), "{line}");
    assert!(line.contains("idempotency.storage_key="), "{line}");
    assert!(!text.contains("acct_secret_scope"), "{text}");
}

type Snapshot = Vec<(
    metrics_util::CompositeKey,
    Option<metrics::Unit>,
    Option<metrics::SharedString>,
    DebugValue,
)>;

fn counter(snapshot: &Snapshot, name: &str, label: (&str, &str)) -> u64 {
    snapshot
        .iter()
        .filter(|(key, ..)| {
            key.key().name() == name
                && key
                    .key()
                    .labels()
                    .any(|l| l.key() == label.0 && l.value() == label.1)
        })
        .map(|(.., value)| match value {
            DebugValue::Counter(n) => *n,
            other => panic!("{name} is a counter, got {other:?}"),
        })
        .sum()
}

#[tokio::test]
async fn metrics_count_every_decision_and_time_the_store() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    // Thread-local, so the test runs on a current-thread runtime.
    let _guard = metrics::set_default_local_recorder(&recorder);

    let app = echo_key().layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant());
    oneshot(&app, post("/charges", "k", CHARGE)).await;
    oneshot(&app, post("/charges", "k", CHARGE)).await;
    oneshot(&app, post("/charges", "k", CHARGE)).await;
    oneshot(&app, post("/charges", "k", "{}"))
        .await
        .assert_problem(422);

    // A snapshot drains what it reads: take one.
    let snapshot = snapshotter.snapshot().into_vec();
    let outcomes = "idempotency_outcomes_total";
    assert_eq!(counter(&snapshot, outcomes, ("outcome", "executed")), 1);
    assert_eq!(counter(&snapshot, outcomes, ("outcome", "replayed")), 2);
    assert_eq!(
        counter(&snapshot, outcomes, ("outcome", "rejected_mismatch")),
        1
    );
    let timed: Vec<String> = snapshot
        .iter()
        .filter(|(key, ..)| key.key().name() == "idempotency_store_duration_seconds")
        .flat_map(|(key, ..)| {
            key.key()
                .labels()
                .map(|l| l.value().to_owned())
                .collect::<Vec<_>>()
        })
        .collect();
    for operation in ["claim", "complete"] {
        assert!(
            timed.iter().any(|o| o == operation),
            "{operation} timed: {timed:?}"
        );
    }
}

#[tokio::test]
async fn an_outage_is_logged_once_a_second_not_once_a_request() {
    let (logs, _guard) = Logs::capture("tower_idempotency=error");
    let mut server = RedisServer::start();
    let store = RedisStore::builder()
        .command_timeout(Duration::from_millis(200))
        .connect(&server.url())
        .await
        .unwrap();
    let app = echo_key().layer(IdempotencyLayer::new(store).single_tenant());
    server.kill();
    let started = std::time::Instant::now();
    for i in 0..30 {
        oneshot(&app, post("/charges", &format!("k{i}"), CHARGE))
            .await
            .assert_problem(503);
    }
    let text = logs.text();
    let lines = text
        .lines()
        .filter(|l| l.contains("store unavailable"))
        .count() as u64;
    // One line a second at most; the first request's line always goes out.
    let most = started.elapsed().as_secs() + 1;
    assert!(
        (1..=most).contains(&lines) && lines < 30,
        "30 refusals in {:?}, {lines} ERROR lines: {text}",
        started.elapsed()
    );
}

/// Compression placed inside the layer (it belongs outside): the stored
/// response is gzip. A retry that accepts gzip gets it as it is; one that
/// does not gets it decoded — never a body it cannot read.
#[tokio::test]
async fn a_compressed_response_is_replayed_only_to_clients_that_accept_its_coding() {
    use tower_http::compression::CompressionLayer;

    let big = "x".repeat(4096);
    let app = Router::new()
        .route(
            "/charges",
            routing::post(move || {
                let big = big.clone();
                async move { (StatusCode::CREATED, [("content-type", "text/plain")], big) }
            }),
        )
        .layer(CompressionLayer::new())
        .layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant());
    let request = |accept: Option<&str>| {
        let mut request = post("/charges", "k1", CHARGE);
        if let Some(accept) = accept {
            request
                .headers_mut()
                .insert("accept-encoding", accept.parse().unwrap());
        }
        request
    };
    let first = oneshot(&app, request(Some("gzip"))).await;
    assert_eq!(first.headers["content-encoding"], "gzip");
    let gzip_again = oneshot(&app, request(Some("gzip, br"))).await;
    assert!(gzip_again.is_replay());
    assert_eq!(gzip_again.headers["content-encoding"], "gzip");
    assert_eq!(gzip_again.body, first.body);
    let plain = oneshot(&app, request(None)).await;
    assert!(plain.is_replay());
    assert!(!plain.headers.contains_key("content-encoding"));
    assert_eq!(plain.body, "x".repeat(4096));
}
