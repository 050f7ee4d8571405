//! Defects found by adversarial testing, each reproduced against a real
//! Redis (or the example process) and counted in handler executions. Every
//! test here failed before its fix.

// The suite runs against every store: `cargo test --all-features`.
#![cfg(every_store)]

mod support;

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use axum::{Router, body::Body};
use http::{Request, StatusCode, request::Parts};
use tower_idempotency::{
    CompletedRecord, Completion, Fingerprint, IdempotencyKey, IdempotencyLayer, IdempotencyOutcome,
    MemoryStore, RedisStore, StoredResponse,
    store::{Claim, LeaseToken, StorageKey, Store, StoreError, redis::EvictionPolicyCheck},
};

use support::{
    app::{Counter, routes},
    http::{oneshot, post},
    logs::Logs,
    redis_server::RedisServer,
};

const CHARGE: &str = r#"{"amount":1999,"currency":"eur"}"#;

async fn store_with_timeout(server: &RedisServer, timeout: Duration) -> RedisStore {
    RedisStore::builder()
        .command_timeout(timeout)
        .connect(&server.url())
        .await
        .expect("connect")
}

/// Polls `app` with the same request until it executes or replays (not 409
/// or 503), for at most `attempts` × 100 ms.
async fn until_answered(
    app: &Router,
    path: &str,
    key: &str,
    attempts: usize,
) -> Option<StatusCode> {
    for _ in 0..attempts {
        let reply = oneshot(app, post(path, key, CHARGE)).await;
        match reply.status.as_u16() {
            409 | 503 => tokio::time::sleep(Duration::from_millis(100)).await,
            _ => return Some(reply.status),
        }
    }
    None
}

// 1. Every record has a TTL, so every `volatile-*` policy may evict it (under
// `volatile-ttl`, in-flight claims first): a deleted record is a second
// execution. Only `noeviction` (or no memory limit) is safe.
#[tokio::test]
async fn every_evicting_policy_is_refused_unless_the_user_opts_out() {
    let server = RedisServer::start_with(&["--maxmemory", "64mb"]);
    for policy in [
        "volatile-lru",
        "volatile-lfu",
        "volatile-random",
        "volatile-ttl",
        "allkeys-lru",
        "allkeys-lfu",
        "allkeys-random",
    ] {
        server.command(&["CONFIG", "SET", "maxmemory-policy", policy]);
        match RedisStore::builder().connect(&server.url()).await {
            Err(StoreError::Misconfigured(message)) => {
                for needle in [policy, "noeviction", "eviction_policy_check"] {
                    assert!(
                        message.contains(needle),
                        "{policy}: {message:?} names {needle}"
                    );
                }
            }
            other => panic!("{policy} must be refused, got {other:?}"),
        }
        RedisStore::builder()
            .eviction_policy_check(EvictionPolicyCheck::Warn)
            .connect(&server.url())
            .await
            .unwrap_or_else(|e| panic!("{policy} with the explicit opt-out connects: {e}"));
    }

    server.command(&["CONFIG", "SET", "maxmemory-policy", "noeviction"]);
    RedisStore::builder()
        .connect(&server.url())
        .await
        .expect("noeviction is safe");

    // Without a memory limit Redis evicts nothing, whatever the policy says.
    server.command(&["CONFIG", "SET", "maxmemory", "0"]);
    server.command(&["CONFIG", "SET", "maxmemory-policy", "volatile-lru"]);
    RedisStore::builder()
        .connect(&server.url())
        .await
        .expect("maxmemory 0 never evicts");
}

#[tokio::test]
async fn an_unreadable_eviction_policy_is_refused_with_the_fix_named() {
    // Managed services often disable CONFIG; their default policy is often
    // volatile-lru. Not knowing is not safe.
    let server = RedisServer::start_with(&["--rename-command", "CONFIG", "CONFIG_HIDDEN_FOR_TEST"]);
    match RedisStore::builder().connect(&server.url()).await {
        Err(StoreError::Misconfigured(message)) => {
            for needle in [
                "maxmemory-policy",
                "noeviction",
                "EvictionPolicyCheck::Warn",
            ] {
                assert!(message.contains(needle), "{message:?} names {needle}");
            }
        }
        other => panic!("an unknown policy must be refused, got {other:?}"),
    }
    RedisStore::builder()
        .eviction_policy_check(EvictionPolicyCheck::Warn)
        .connect(&server.url())
        .await
        .expect("with the opt-out the store connects");
}

// 2. "Keep forever" cannot be honoured by every store: refuse it when the
// layer is built, never panic or wedge at run time.
#[test]
#[should_panic(expected = "retention must be at most")]
fn an_absurd_retention_is_refused_when_the_layer_is_built() {
    let _ = IdempotencyLayer::new(MemoryStore::new()).retention(Duration::MAX);
}

#[test]
#[should_panic(expected = "lease must be at most")]
fn an_absurd_lease_is_refused_when_the_layer_is_built() {
    let _ = IdempotencyLayer::new(MemoryStore::new()).lease(Duration::MAX);
}

#[test]
fn the_largest_documented_durations_are_accepted() {
    let _ = IdempotencyLayer::new(MemoryStore::new())
        .retention(tower_idempotency::MAX_RETENTION)
        .lease(tower_idempotency::MAX_LEASE);
}

fn record() -> Arc<CompletedRecord> {
    Arc::new(CompletedRecord::Response(StoredResponse::capture(
        StatusCode::CREATED,
        &http::HeaderMap::new(),
        "done".into(),
    )))
}

#[tokio::test]
async fn stores_called_directly_with_huge_durations_do_not_panic() {
    let key = StorageKey::new("acct", &IdempotencyKey::new("k").unwrap());
    let fp = Fingerprint::from_bytes([1; 32]);

    let memory = MemoryStore::new();
    let Claim::Acquired(mut token) = memory.claim(&key, &fp, Duration::MAX).await.unwrap() else {
        panic!("a fresh key is acquired")
    };
    assert!(memory.extend(&key, token, Duration::MAX).await.unwrap());
    assert!(
        memory
            .complete(&key, &mut token, &fp, record(), Duration::MAX)
            .await
            .unwrap()
    );
    assert!(matches!(
        memory.claim(&key, &fp, Duration::MAX).await.unwrap(),
        Claim::Completed { .. }
    ));

    let server = RedisServer::start();
    let redis = store_with_timeout(&server, Duration::from_secs(1)).await;
    match redis.claim(&key, &fp, Duration::MAX).await {
        Err(StoreError::Misconfigured(message)) => assert!(message.contains("lease"), "{message}"),
        other => panic!("Redis cannot represent the lease: an error, got {other:?}"),
    }
}

/// A store whose completions always fail while everything else works: the
/// shape of a store that rejects one command (e.g. an out-of-range TTL).
#[derive(Clone)]
struct CompletionsFail {
    inner: MemoryStore,
    extends: Arc<AtomicUsize>,
}

impl Store for CompletionsFail {
    type Granted = LeaseToken;

    async fn claim(
        &self,
        key: &StorageKey,
        fp: &Fingerprint,
        lease: Duration,
    ) -> Result<Claim, StoreError> {
        self.inner.claim(key, fp, lease).await
    }
    async fn extend(
        &self,
        key: &StorageKey,
        token: LeaseToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        self.extends.fetch_add(1, Ordering::SeqCst);
        self.inner.extend(key, token, lease).await
    }
    async fn complete(
        &self,
        _: &StorageKey,
        _: &mut LeaseToken,
        _: &Fingerprint,
        _: Arc<CompletedRecord>,
        _: Duration,
    ) -> Result<bool, StoreError> {
        Err(StoreError::Unavailable(
            "completions fail in this test".into(),
        ))
    }
    async fn release(&self, key: &StorageKey, token: LeaseToken) -> Result<bool, StoreError> {
        self.inner.release(key, token).await
    }
}

#[tokio::test]
async fn background_completion_retries_stop_within_a_lease_and_say_so_once() {
    let (logs, _guard) = Logs::capture("tower_idempotency=error");
    let extends = Arc::new(AtomicUsize::new(0));
    let store = CompletionsFail {
        inner: MemoryStore::new(),
        extends: extends.clone(),
    };
    let counter = Counter::default();
    let app = routes(counter.clone()).layer(
        IdempotencyLayer::new(store)
            .single_tenant()
            .lease(Duration::from_millis(300)),
    );

    let first = oneshot(&app, post("/charges", "k", CHARGE)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(
        first.outcome,
        Some(IdempotencyOutcome::Executed(Completion::Pending))
    );
    // Retrying for one lease, then the claim's last extension runs out.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let settled = extends.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(
        extends.load(Ordering::SeqCst),
        settled,
        "the heartbeat stopped: no task keeps the key in flight forever"
    );
    let text = logs.text();
    assert_eq!(
        text.matches("could not be stored").count(),
        1,
        "the outcome is logged once, at ERROR: {text}"
    );
    // The documented consequence: the claim expired, so a retry executes.
    assert_eq!(
        until_answered(&app, "/charges", "k", 10).await,
        Some(StatusCode::CREATED)
    );
    assert_eq!(counter.get(), 2);
}

// 3. A claim that Redis runs after the client gave up on it must not block
// the key for a whole lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_redis_applies_after_its_timeout_is_released() {
    let server = RedisServer::start();
    let store = store_with_timeout(&server, Duration::from_millis(300)).await;
    let counter = Counter::default();
    // The default 30 s lease: without the release, the key is blocked 30 s.
    let app = routes(counter.clone()).layer(IdempotencyLayer::new(store).single_tenant());

    server.command(&["CLIENT", "PAUSE", "1500", "ALL"]);
    oneshot(&app, post("/charges", "k", CHARGE))
        .await
        .assert_problem(503);
    assert_eq!(counter.get(), 0);

    // Redis wakes at 1.5 s and runs the queued claim; the layer releases it.
    tokio::time::sleep(Duration::from_millis(1300)).await;
    assert_eq!(
        until_answered(&app, "/charges", "k", 30).await,
        Some(StatusCode::CREATED),
        "a retry shortly after Redis recovers executes"
    );
    assert_eq!(counter.get(), 1);
}

// 4. The documented command timeout is the one in force (it was silently
// capped at redis-rs's 500 ms response timeout).
#[tokio::test]
async fn a_stall_shorter_than_the_command_timeout_is_waited_out() {
    let server = RedisServer::start();
    let store = store_with_timeout(&server, Duration::from_secs(3)).await;
    let counter = Counter::default();
    let app = routes(counter.clone()).layer(IdempotencyLayer::new(store).single_tenant());
    server.command(&["CLIENT", "PAUSE", "1500", "ALL"]);
    let reply = oneshot(&app, post("/charges", "k", CHARGE)).await;
    assert_eq!(
        reply.status,
        StatusCode::CREATED,
        "a 1.5 s stall is within the 3 s timeout: {:?}",
        reply.body
    );
    assert_eq!(counter.get(), 1);
}

// 7. A completion that timed out on the client but that Redis applied later:
// covered where that scenario lives, in `redis.rs`
// (`a_hung_redis_cannot_hang_requests_and_completion_is_retried`), and by the
// suite's `fencing_refuses_a_stale_holder` (a repeated completion is stored).

// 8. A scope may be a credential: it must never leave the process raw.
#[tokio::test]
async fn a_credential_scope_never_reaches_redis_key_names_or_logs() {
    let (logs, _guard) = Logs::capture("tower_idempotency=trace");
    let server = RedisServer::start();
    let store = store_with_timeout(&server, Duration::from_secs(1)).await;
    let counter = Counter::default();
    // The recipe the docs must not recommend; the layer must still protect it.
    let layer = IdempotencyLayer::new(store).scope_with(|parts: &Parts| {
        parts
            .headers
            .get("authorization")?
            .to_str()
            .ok()
            .map(str::to_owned)
    });
    let app = routes(counter.clone()).layer(layer);
    let secret = "sk_live_4eC39HqLyjWDarjtT1zdp7dc";
    let charge = |token: &str, body: &str| {
        Request::post("/charges")
            .header("authorization", format!("Bearer {token}"))
            .header("idempotency-key", "order-1")
            .header("content-type", "application/json")
            .body(Body::from(body.to_owned()))
            .unwrap()
    };
    assert_eq!(
        oneshot(&app, charge(secret, CHARGE)).await.status,
        StatusCode::CREATED
    );
    assert!(oneshot(&app, charge(secret, CHARGE)).await.is_replay());
    oneshot(&app, charge(secret, "{}"))
        .await
        .assert_problem(422);
    // Another tenant with the same key is still another record.
    assert_eq!(
        oneshot(&app, charge("sk_live_other", CHARGE)).await.status,
        StatusCode::CREATED
    );
    assert_eq!(counter.get(), 2);

    let keys = server.command(&["KEYS", "*"]);
    assert_eq!(
        keys.lines().count(),
        3,
        "two records, the key-names marker: {keys}"
    );
    assert!(!keys.contains("sk_live"), "Redis key names: {keys}");
    let text = logs.text();
    assert!(
        text.contains("order-1"),
        "the idempotency key itself is logged: {text}"
    );
    assert!(!text.contains("sk_live"), "logs: {text}");
}
