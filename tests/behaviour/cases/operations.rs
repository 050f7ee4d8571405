//! What operators and API owners get: one key inspected and forgotten (the
//! scope given raw, as the layer hashes it), fingerprints declared as rules,
//! and rejections that link to the published policy.

use std::time::Duration;

use http::StatusCode;
use tower_idempotency::{
    CompletedRecord, DefaultFingerprint, IdempotencyKey, IdempotencyLayer,
    store::{Forgotten, KeyState, LeaseToken, StorageKey, Store, StoreError},
};

use super::{CHARGE, app_with, scoped};
use crate::support::{
    app::Counter,
    backend::Backend,
    http::{Reply, Server, oneshot, post},
};

/// The address an operator builds from the raw account and key.
fn address(account: &str, key: &str) -> StorageKey {
    StorageKey::new(account, &IdempotencyKey::new(key).unwrap())
}

fn with_account(
    mut request: http::Request<axum::body::Body>,
    account: &str,
) -> http::Request<axum::body::Body> {
    request
        .headers_mut()
        .insert("x-account", account.parse().unwrap());
    request
}

/// `POST /slow?ms=…` for `acct_alice` with key `slow-1`, sent to `server`.
fn slow_request(server: &Server, ms: u64) -> http::Request<axum::body::Body> {
    let path = format!("/slow?ms={ms}");
    let mut request = with_account(post(&path, "slow-1", CHARGE), "acct_alice");
    *request.uri_mut() = server.url(&path).parse().unwrap();
    request
}

/// Sends [`slow_request`] on a task of its own.
fn spawn_slow(server: &Server, ms: u64) -> tokio::task::JoinHandle<Reply> {
    let request = slow_request(server, ms);
    let client = server.client.clone();
    tokio::spawn(async move { client.send(request).await })
}

/// Waits (up to 5 s) until the handler runs (`runs`), then until `key`'s
/// claim is in flight as the store sees it. (Probed before the handler
/// runs, a transactional store's probe could meet the claim being made and
/// turn it away.)
async fn wait_in_flight<St: Store>(store: &St, key: &StorageKey, runs: &Counter) {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while runs.get() == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the handler never ran"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    while !matches!(store.inspect(key).await.unwrap(), KeyState::InFlight { .. }) {
        assert!(std::time::Instant::now() < deadline, "never in flight");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub async fn a_completed_key_is_inspected_and_forgotten<B: Backend>(b: &B) {
    let store = b.store().await;
    let (app, runs) = app_with(scoped(store.clone()));
    let key = address("acct_alice", "order-42");
    assert!(matches!(
        store.inspect(&key).await.unwrap(),
        KeyState::Absent
    ));
    assert_eq!(store.forget(&key, false).await.unwrap(), Forgotten::Nothing);

    let charge = || with_account(post("/charges", "order-42", CHARGE), "acct_alice");
    let first = oneshot(&app, charge()).await;
    assert_eq!(first.status, StatusCode::CREATED);
    match store.inspect(&key).await.unwrap() {
        KeyState::Completed { record, expires_in } => {
            let CompletedRecord::Response(response) = &*record else {
                panic!("a stored response, got {record:?}")
            };
            assert_eq!(response.status(), StatusCode::CREATED);
            assert_eq!(response.body(), &first.body, "the stored body");
            assert!(expires_in <= Duration::from_secs(24 * 60 * 60));
            assert!(
                expires_in > Duration::from_secs(23 * 60 * 60),
                "{expires_in:?}"
            );
        }
        other => panic!("completed, got {other:?}"),
    }
    // Another account's same key is another record.
    assert!(matches!(
        store
            .inspect(&address("acct_bob", "order-42"))
            .await
            .unwrap(),
        KeyState::Absent
    ));

    assert_eq!(
        store.forget(&key, false).await.unwrap(),
        Forgotten::Completed
    );
    let again = oneshot(&app, charge()).await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert!(!again.is_replay(), "forgotten: the request executes again");
    assert_eq!(runs.get(), 2);
    assert!(oneshot(&app, charge()).await.is_replay());
}

pub async fn a_key_in_flight_is_not_forgotten_without_force<B: Backend>(b: &B) {
    let store = b.store().await;
    let (app, runs) = app_with(scoped(store.clone()));
    let server = Server::start(app).await;
    let key = address("acct_alice", "slow-1");
    let slow = spawn_slow(&server, 1500);
    wait_in_flight(&store, &key, &runs).await;
    assert_eq!(
        store.forget(&key, false).await.unwrap(),
        Forgotten::InFlight
    );
    assert_eq!(slow.await.unwrap().status, StatusCode::CREATED);
    assert_eq!(runs.get(), 1);
    assert!(matches!(
        store.inspect(&key).await.unwrap(),
        KeyState::Completed { .. }
    ));
}

/// Forcing: the claim in flight is deleted, a retry meanwhile executes
/// (the work runs twice — what the operator chose), and the first
/// handler's completion is fenced off: the record is the second's.
pub async fn a_key_in_flight_is_forgotten_with_force<B: Backend>(b: &B)
where
    B::Store: Store<Granted = LeaseToken>,
{
    let store = b.store().await;
    let (app, runs) = app_with(scoped(store.clone()));
    let server = Server::start(app).await;
    let key = address("acct_alice", "slow-1");
    let first = spawn_slow(&server, 800);
    wait_in_flight(&store, &key, &runs).await;
    assert_eq!(
        store.forget(&key, true).await.unwrap(),
        Forgotten::ForcedInFlight
    );
    let second = spawn_slow(&server, 800);
    let (first, second) = (first.await.unwrap(), second.await.unwrap());
    assert_eq!(
        (first.status, second.status),
        (StatusCode::CREATED, StatusCode::CREATED)
    );
    assert_eq!(runs.get(), 2, "forced: the work ran twice");
    let replay = server.client.send(slow_request(&server, 800)).await;
    assert!(replay.is_replay());
    assert_eq!(
        replay.body, second.body,
        "the first's completion was fenced off"
    );
}

/// A transactional store's claim in flight is the handler's transaction:
/// forcing it is refused, and says why.
pub async fn a_transaction_in_flight_cannot_be_forced<B: Backend>(b: &B) {
    let store = b.store().await;
    let (app, runs) = app_with(scoped(store.clone()));
    let server = Server::start(app).await;
    let key = address("acct_alice", "slow-1");
    let slow = spawn_slow(&server, 1000);
    wait_in_flight(&store, &key, &runs).await;
    assert!(matches!(
        store.forget(&key, true).await,
        Err(StoreError::Unsupported(_))
    ));
    assert_eq!(slow.await.unwrap().status, StatusCode::CREATED);
}

/// A field declared ignored may differ between retries; a kept one and an
/// included header may not.
pub async fn declared_fingerprint_rules_decide_what_is_the_same_request<B: Backend>(b: &B) {
    let rules = DefaultFingerprint::new()
        .ignore("/metadata/client_time")
        .header("api-version");
    let (app, runs) = app_with(
        IdempotencyLayer::new(b.store().await)
            .single_tenant()
            .fingerprint_with(rules),
    );
    let charge = |client_time: &str, amount: u32, version: Option<&str>| {
        let mut request = post(
            "/charges",
            "k",
            &format!(r#"{{"amount":{amount},"metadata":{{"client_time":"{client_time}"}}}}"#),
        );
        if let Some(version) = version {
            request
                .headers_mut()
                .insert("api-version", version.parse().unwrap());
        }
        request
    };
    let first = oneshot(&app, charge("10:00:00", 1999, Some("2026-01"))).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(
        oneshot(&app, charge("10:00:05", 1999, Some("2026-01")))
            .await
            .is_replay()
    );
    oneshot(&app, charge("10:00:05", 2000, Some("2026-01")))
        .await
        .assert_problem(422);
    oneshot(&app, charge("10:00:05", 1999, Some("2026-02")))
        .await
        .assert_problem(422);
    oneshot(&app, charge("10:00:05", 1999, None))
        .await
        .assert_problem(422);
    assert_eq!(runs.get(), 1);
}

/// Every rejection the layer makes links to the published policy, and its
/// problem type points into it.
pub async fn rejections_link_to_the_published_policy<B: Backend>(b: &B) {
    const DOCS: &str = "https://docs.example.com/idempotency";
    let layer = IdempotencyLayer::new(b.store().await)
        .single_tenant()
        .require_key(true)
        .documentation(DOCS);
    let (app, _) = app_with(layer);
    let link = r#"<https://docs.example.com/idempotency>; rel="describedby""#;
    let mut missing = post("/charges", "k", CHARGE);
    missing.headers_mut().remove("idempotency-key");
    let mut invalid = post("/charges", "k", CHARGE);
    invalid
        .headers_mut()
        .insert("idempotency-key", "a b".parse().unwrap());
    oneshot(&app, post("/charges", "k", CHARGE)).await;
    for (request, status, name) in [
        (missing, 400, "missing-key"),
        (invalid, 400, "invalid-key"),
        (post("/charges", "k", "{}"), 422, "key-reused"),
    ] {
        let reply = oneshot(&app, request).await;
        reply.assert_problem(status);
        assert_eq!(reply.header("link"), Some(link), "{name}");
        assert_eq!(reply.json()["type"], format!("{DOCS}#{name}"));
    }
}
