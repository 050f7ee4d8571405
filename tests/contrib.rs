//! The alert rules and the dashboard in `contrib/` stay true: every metric
//! they query is one the crate records — driven here through each door
//! (the layer, a lost completion, the replay cache, a consumer's dead
//! letter, the outbox relay, the client layer) — with the labels they
//! filter on, and `promtool` accepts the rules.

// The suite runs against every store: `cargo test --all-features`.
#![cfg(all(every_store, feature = "metrics", feature = "client"))]

mod support;

use std::{
    collections::{BTreeMap, BTreeSet},
    process::Command,
    time::Duration,
};

use axum::{Router, body::Body, routing};
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;
use metrics_util::debugging::DebuggingRecorder;
use tower::{ServiceBuilder, ServiceExt};
use tower_idempotency::{
    IdempotencyLayer, MemoryStore, SqliteStore,
    client::IdempotentClientLayer,
    message::{Delivery, IdempotencyProcessor},
    outbox::{Outbox, OutboxMessage, OutboxRelay, OutgoingMessage, PublishError, Publisher},
    store::CachedStore,
    testing::{FaultyStore, Op},
};
use tower_idempotency_harness::sqlite::TestFile;

use support::http::{oneshot, post};

const CHARGE: &str = r#"{"amount":1999,"currency":"eur"}"#;

fn created() -> Router {
    Router::new().route("/charges", routing::post(|| async { StatusCode::CREATED }))
}

/// Refuses one destination, takes the rest.
struct Picky;

impl Publisher for Picky {
    async fn publish(&self, message: &OutboxMessage) -> Result<(), PublishError> {
        match message.destination.as_str() {
            "nowhere" => Err(PublishError::Refused("no such queue".into())),
            _ => Ok(()),
        }
    }
}

/// Each metric name the crate recorded, with the label names it carries.
type Recorded = BTreeMap<String, BTreeSet<String>>;

/// Drives every door once, recording what the crate reports.
async fn record_every_door() -> Recorded {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    // Thread-local: the test runs on a current-thread runtime.
    let _guard = metrics::set_default_local_recorder(&recorder);

    // The layer: an execution, a replay, a mismatch.
    let app = created().layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant());
    oneshot(&app, post("/charges", "k", CHARGE)).await;
    oneshot(&app, post("/charges", "k", CHARGE)).await;
    oneshot(&app, post("/charges", "k", "{}")).await;
    // A completion the store never takes: retried for one lease, then lost.
    let failing = FaultyStore::new(MemoryStore::new()).errors(Op::Complete, 1.0);
    let app = created().layer(
        IdempotencyLayer::new(failing)
            .single_tenant()
            .lease(Duration::from_millis(300)),
    );
    oneshot(&app, post("/charges", "lost", CHARGE)).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    // The replay cache.
    let app = created().layer(
        IdempotencyLayer::new(CachedStore::new(MemoryStore::new(), 1 << 20)).single_tenant(),
    );
    oneshot(&app, post("/charges", "c", CHARGE)).await;
    oneshot(&app, post("/charges", "c", CHARGE)).await;

    // A consumer: an order, then the same order id with another payload.
    let orders = IdempotencyProcessor::new(MemoryStore::new()).scope("orders");
    let charge = async |_: &mut _| Ok::<_, std::io::Error>(1);
    orders
        .settle(Delivery::new("order-1", b"{\"amount\":1}"), charge, |_| {
            false
        })
        .await;
    orders
        .settle(Delivery::new("order-1", b"{\"amount\":2}"), charge, |_| {
            false
        })
        .await;

    // A takeover: a work stopped mid-way (its future never polled again,
    // never dropped), its lease lapsed, then the key claimed again.
    let lapsing = IdempotencyProcessor::new(MemoryStore::new())
        .scope("takeovers")
        .lease(Duration::from_millis(50));
    let stalls = async |_: &mut _| {
        std::future::pending::<()>().await;
        Ok::<_, std::io::Error>(1)
    };
    let mut stopped = Box::pin(lapsing.process("order-2", b"{}", stalls));
    std::future::poll_fn(|cx| {
        assert!(stopped.as_mut().poll(cx).is_pending());
        std::task::Poll::Ready(())
    })
    .await;
    std::mem::forget(stopped);
    tokio::time::sleep(Duration::from_millis(150)).await;
    let taken_over = lapsing.process("order-2", b"{}", charge).await;
    assert!(taken_over.is_ok());

    // The outbox: one message published, one refused.
    let file = TestFile::create();
    let store = SqliteStore::builder()
        .transactional()
        .create_table_if_missing()
        .connect(&file.url())
        .await
        .expect("the SQLite store");
    let outbox = Outbox::on(&store)
        .create_table_if_missing()
        .build()
        .await
        .expect("the outbox");
    let events = IdempotencyProcessor::new(store).scope("events");
    for destination in ["charges", "nowhere"] {
        events
            .process(destination, b"{}", async |tx: &mut _| {
                let event = OutgoingMessage::new(destination, b"{}".to_vec());
                outbox.enqueue(tx, event).await.map(drop)
            })
            .await
            .expect("enqueued");
    }
    let relay = OutboxRelay::new(outbox, Picky);
    relay.run_once().await.expect("a relay round");
    relay.backlog().await.expect("the backlog");

    // The client layer: a 503 retried, then the answer.
    let server = created().layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant());
    let flaky = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let client = ServiceBuilder::new()
        .layer(IdempotentClientLayer::new())
        .service(tower::service_fn(move |request: Request<Full<Bytes>>| {
            let (server, flaky) = (server.clone(), flaky.clone());
            async move {
                if flaky.swap(false, std::sync::atomic::Ordering::SeqCst) {
                    let unavailable = http::Response::builder()
                        .status(StatusCode::SERVICE_UNAVAILABLE)
                        .header("retry-after", "0")
                        .body(Body::empty())
                        .unwrap();
                    return Ok::<_, std::convert::Infallible>(unavailable);
                }
                server.oneshot(request.map(Body::new)).await
            }
        }));
    let request = Request::post("/charges")
        .body(Full::new(Bytes::from_static(CHARGE.as_bytes())))
        .unwrap();
    let answer = client.oneshot(request).await.expect("the client's call");
    assert_eq!(answer.status(), StatusCode::CREATED);

    let mut recorded = Recorded::new();
    for (key, ..) in snapshotter.snapshot().into_vec() {
        let key = key.key();
        recorded
            .entry(key.name().to_owned())
            .or_default()
            .extend(key.labels().map(|label| label.key().to_owned()));
    }
    recorded
}

/// Each `idempotency_…` selector in `text`: the metric's name (a
/// histogram's series named by their base) and the label names it filters
/// or groups on.
fn selectors(text: &str) -> Vec<(String, BTreeSet<String>)> {
    let mut found = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("idempotency_") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        let mut name = tail[..end].to_owned();
        for suffix in ["_bucket", "_sum", "_count"] {
            if let Some(base) = name.strip_suffix(suffix) {
                name = base.to_owned();
            }
        }
        let mut labels = BTreeSet::new();
        if let Some(matchers) = tail[end..].strip_prefix('{') {
            let matchers = &matchers[..matchers.find('}').unwrap_or(0)];
            for matcher in matchers.split(',') {
                let label = matcher.split(['=', '!']).next().unwrap_or("").trim();
                // `job` and `instance` are Prometheus's own.
                if !label.is_empty() && !["job", "instance", "le"].contains(&label) {
                    labels.insert(label.to_owned());
                }
            }
        }
        found.push((name, labels));
        rest = &tail[end..];
    }
    found
}

fn contrib(path: &str) -> String {
    let path = format!("{}/contrib/{path}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

#[tokio::test(flavor = "current_thread")]
async fn the_alerts_and_the_dashboard_query_only_what_the_crate_records() {
    let recorded = record_every_door().await;
    let rules = contrib("prometheus/alerts.yml");
    let dashboard = contrib("grafana/tower-idempotency.json");
    serde_json::from_str::<serde_json::Value>(&dashboard).expect("the dashboard is JSON");
    let used: Vec<_> = selectors(&rules)
        .into_iter()
        .chain(selectors(&dashboard))
        .collect();
    assert!(used.len() > 20, "too few selectors found: {used:?}");
    let mut wrong = Vec::new();
    for (name, labels) in &used {
        match recorded.get(name) {
            None => wrong.push(format!("{name}: never recorded")),
            Some(carried) => {
                for label in labels.difference(carried) {
                    wrong.push(format!("{name}: no label {label:?} (it has {carried:?})"));
                }
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "contrib/ queries what the crate does not record:\n{}\nrecorded: {recorded:#?}",
        wrong.join("\n")
    );
    // And the other way: a metric the crate records that neither shows.
    let shown: BTreeSet<&String> = used.iter().map(|(name, _)| name).collect();
    let unshown: Vec<_> = recorded.keys().filter(|n| !shown.contains(n)).collect();
    assert!(
        unshown.is_empty(),
        "metrics neither the alerts nor the dashboard show: {unshown:?}"
    );
}

#[test]
fn promtool_accepts_the_rules() {
    let path = format!(
        "{}/contrib/prometheus/alerts.yml",
        env!("CARGO_MANIFEST_DIR")
    );
    let output = Command::new("promtool")
        .args(["check", "rules", &path])
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "promtool: {e}: install Prometheus's promtool (Debian: apt-get install prometheus)"
            )
        });
    assert!(
        output.status.success(),
        "promtool check rules: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}
