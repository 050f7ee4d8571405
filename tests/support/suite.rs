//! The behaviour suite of the layer (SPEC §2, §3), generic over the store, so
//! the same cases run against memory, one Redis node and a Redis Cluster.

use std::{sync::Arc, time::Duration};

use axum::{Router, body::Body};
use http::{HeaderMap, Method, Request, StatusCode, request::Parts};
use tower::{ServiceExt, service_fn};
use tower_idempotency::{
    Completion, DefaultFingerprint, DefaultStorePolicy, FingerprintStrategy, IdempotencyKey,
    IdempotencyLayer, IdempotencyOutcome, RejectionKind, StoreAll, StorePolicy,
    store::{Claim, LeaseToken, StorageKey, Store},
};

use super::{
    app::{Counter, routes},
    backend::Backend,
    http::{Reply, Server, oneshot, post, request},
};

/// Every case, in one list: `behaviour_cases!(m, args…)` expands to
/// `m!(args…; case, case, …)`.
#[macro_export]
macro_rules! behaviour_cases {
    ($run:ident $(, $($arg:tt)+)?) => {
        $run!($($($arg)+)?;
            replay_is_byte_identical,
            mismatch_on_body_path_query_and_method,
            canonical_json_variants_replay,
            query_parameter_order_is_irrelevant,
            missing_key_passes_through_unless_required,
            key_validation,
            quoted_key_is_the_bare_key,
            unguarded_methods_are_untouched,
            oversized_request_is_413_and_stores_nothing,
            scopes_are_isolated,
            scope_encoding_cannot_collide,
            non_final_responses_release_the_key,
            store_all_keeps_every_status,
            a_fixed_request_executes_under_its_key_only_if_client_errors_are_released,
            handler_error_releases_the_key,
            handler_panic_releases_the_key,
            oversized_response_is_sent_and_unreplayable,
            concurrent_duplicates_execute_once,
            concurrent_duplicates_wait_and_replay,
            client_disconnect_does_not_cancel,
            dropped_response_future_still_completes,
            record_expires_after_retention,
            rejections_are_customisable,
        );
    };
}

/// The cases about leases, for the stores whose claims are leases (the
/// transactional stores' claims live as long as their transaction).
#[macro_export]
macro_rules! lease_cases {
    ($run:ident $(, $($arg:tt)+)?) => {
        $run!($($($arg)+)?;
            expired_lease_lets_a_retry_execute,
            heartbeat_keeps_a_slow_handler_claimed,
            fencing_refuses_a_stale_holder,
        );
    };
}

fn scoped<St: Store>(store: St) -> IdempotencyLayer<St, impl tower_idempotency::ScopeExtractor> {
    IdempotencyLayer::new(store).scope_with(|parts: &Parts| {
        parts
            .headers
            .get("x-account")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    })
}

fn app_with<St, Sc, P, F>(layer: IdempotencyLayer<St, Sc, P, F>) -> (Router, Counter)
where
    St: Store,
    Sc: tower_idempotency::ScopeExtractor,
    P: tower_idempotency::StorePolicy,
    F: FingerprintStrategy,
{
    let counter = Counter::default();
    (routes(counter.clone()).layer(layer), counter)
}

const CHARGE: &str = r#"{"amount":1999,"currency":"eur"}"#;

pub async fn replay_is_byte_identical<B: Backend>(b: &B) {
    let (app, runs) = app_with(IdempotencyLayer::new(b.store().await));
    let first = oneshot(&app, post("/charges", "k1", CHARGE)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(
        first.outcome,
        Some(IdempotencyOutcome::Executed(Completion::Stored))
    );
    assert!(!first.is_replay());
    assert_eq!(
        first.header("set-cookie"),
        Some("session=secret"),
        "the first response is untouched"
    );

    let retry = oneshot(&app, post("/charges", "k1", CHARGE)).await;
    assert_eq!(runs.get(), 1);
    assert_eq!(retry.outcome, Some(IdempotencyOutcome::Replayed));
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(retry.body, first.body, "same body bytes");
    assert!(retry.is_replay());
    assert_eq!(retry.header("location"), first.header("location"));
    assert_eq!(
        retry.header_all("x-multi"),
        ["first", "second", "third"],
        "multi-valued, in order"
    );
    assert_eq!(retry.header("content-type"), Some("application/json"));
    assert_eq!(
        retry.header("set-cookie"),
        None,
        "Set-Cookie is never replayed"
    );
    // Replayed again: still identical.
    let again = oneshot(&app, post("/charges", "k1", CHARGE)).await;
    assert_eq!(again.body, first.body);
    assert_eq!(runs.get(), 1);
}

pub async fn mismatch_on_body_path_query_and_method<B: Backend>(b: &B) {
    let (app, runs) = app_with(IdempotencyLayer::new(b.store().await));
    let first = oneshot(&app, post("/charges?mode=live", "k", CHARGE)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let changed = [
        post(
            "/charges?mode=live",
            "k",
            r#"{"amount":2000,"currency":"eur"}"#,
        ),
        post("/slow?mode=live", "k", CHARGE),
        post("/charges?mode=test", "k", CHARGE),
        post("/charges", "k", CHARGE),
        request(Method::PATCH, "/charges?mode=live", Some("k"), CHARGE),
    ];
    for req in changed {
        let reply = oneshot(&app, req).await;
        reply.assert_problem(422);
        assert_eq!(
            reply.outcome,
            Some(IdempotencyOutcome::Rejected(RejectionKind::Mismatch))
        );
    }
    assert_eq!(runs.get(), 1);
    // The original still replays.
    assert!(
        oneshot(&app, post("/charges?mode=live", "k", CHARGE))
            .await
            .is_replay()
    );
}

pub async fn canonical_json_variants_replay<B: Backend>(b: &B) {
    let (app, runs) = app_with(IdempotencyLayer::new(b.store().await));
    let variants = [
        r#"{"amount":1999,"currency":"eur","meta":{"a":1,"b":[1,2]}}"#,
        r#"{ "currency" : "eur", "amount" : 1999, "meta" : { "b" : [ 1, 2 ], "a" : 1 } }"#,
        "{\n\t\"meta\": {\"b\": [1,2], \"a\": 1},\n\t\"amount\": 1999,\n\t\"currency\": \"eur\"\n}",
    ];
    let first = oneshot(&app, post("/charges", "k", variants[0])).await;
    for v in &variants[1..] {
        let retry = oneshot(&app, post("/charges", "k", v)).await;
        assert!(retry.is_replay(), "{v} should replay");
        assert_eq!(retry.body, first.body);
    }
    // Array order is significant.
    let reordered = r#"{"amount":1999,"currency":"eur","meta":{"a":1,"b":[2,1]}}"#;
    oneshot(&app, post("/charges", "k", reordered))
        .await
        .assert_problem(422);
    assert_eq!(runs.get(), 1);
}

pub async fn query_parameter_order_is_irrelevant<B: Backend>(b: &B) {
    let (app, runs) = app_with(IdempotencyLayer::new(b.store().await));
    oneshot(&app, post("/charges?a=1&b=2", "k", CHARGE)).await;
    assert!(
        oneshot(&app, post("/charges?b=2&a=1", "k", CHARGE))
            .await
            .is_replay()
    );
    assert_eq!(runs.get(), 1);
}

pub async fn missing_key_passes_through_unless_required<B: Backend>(b: &B) {
    let (app, runs) = app_with(IdempotencyLayer::new(b.store().await));
    for _ in 0..2 {
        let reply = oneshot(&app, request(Method::POST, "/charges", None, CHARGE)).await;
        assert_eq!(reply.status, StatusCode::CREATED);
        assert_eq!(
            reply.outcome,
            Some(IdempotencyOutcome::Bypassed(
                tower_idempotency::BypassReason::NoKey
            ))
        );
    }
    assert_eq!(runs.get(), 2, "without a key every request executes");

    let (app, runs) = app_with(IdempotencyLayer::new(b.store().await).require_key(true));
    let reply = oneshot(&app, request(Method::POST, "/charges", None, CHARGE)).await;
    reply.assert_problem(400);
    assert_eq!(
        reply.outcome,
        Some(IdempotencyOutcome::Rejected(RejectionKind::MissingKey))
    );
    assert_eq!(runs.get(), 0);
}

pub async fn key_validation<B: Backend>(b: &B) {
    let (app, runs) = app_with(IdempotencyLayer::new(b.store().await));
    let longest = "k".repeat(255);
    let reply = oneshot(&app, post("/charges", &longest, CHARGE)).await;
    assert_eq!(reply.status, StatusCode::CREATED);
    assert!(
        oneshot(&app, post("/charges", &longest, CHARGE))
            .await
            .is_replay()
    );
    assert_eq!(runs.get(), 1);

    let bad: [&[u8]; 6] = [
        "k".repeat(256).as_bytes().to_vec().leak(),
        b"has space",
        "cl\u{e9}".as_bytes(),
        b"\"unterminated",
        b"\"\"",
        b"\"tab\tinside\"",
    ];
    for key in bad {
        let req = Request::post("/charges")
            .header(
                "idempotency-key",
                http::HeaderValue::from_bytes(key).unwrap(),
            )
            .body(Body::from(CHARGE))
            .unwrap();
        let reply = oneshot(&app, req).await;
        reply.assert_problem(400);
        assert!(matches!(
            reply.outcome,
            Some(IdempotencyOutcome::Rejected(RejectionKind::InvalidKey(_)))
        ));
    }
    // Two keys on one request are ambiguous.
    let req = Request::post("/charges")
        .header("idempotency-key", "a")
        .header("idempotency-key", "b")
        .body(Body::from(CHARGE))
        .unwrap();
    oneshot(&app, req).await.assert_problem(400);
    assert_eq!(runs.get(), 1, "invalid keys never execute");
}

pub async fn quoted_key_is_the_bare_key<B: Backend>(b: &B) {
    let (app, runs) = app_with(IdempotencyLayer::new(b.store().await));
    oneshot(&app, post("/charges", "\"order-7\"", CHARGE)).await;
    assert!(
        oneshot(&app, post("/charges", "order-7", CHARGE))
            .await
            .is_replay()
    );
    assert_eq!(runs.get(), 1);
    assert_eq!(IdempotencyKey::new("order-7").unwrap().as_str(), "order-7");
}

pub async fn unguarded_methods_are_untouched<B: Backend>(b: &B) {
    let (app, runs) = app_with(IdempotencyLayer::new(b.store().await));
    for _ in 0..2 {
        let reply = oneshot(&app, request(Method::GET, "/charges", Some("k"), "")).await;
        assert!(!reply.is_replay());
        assert_eq!(reply.header("set-cookie"), Some("session=secret"));
    }
    assert_eq!(runs.get(), 2);
    // A POST with the same key afterwards is a fresh key: GETs stored nothing.
    assert_eq!(
        oneshot(&app, post("/charges", "k", CHARGE)).await.status,
        StatusCode::CREATED
    );
    assert_eq!(runs.get(), 3);
}

pub async fn oversized_request_is_413_and_stores_nothing<B: Backend>(b: &B) {
    let (app, runs) = app_with(IdempotencyLayer::new(b.store().await).max_request_body(1024));
    let big = format!(r#"{{"pad":"{}"}}"#, "x".repeat(2048));
    let reply = oneshot(&app, post("/charges", "k", &big)).await;
    reply.assert_problem(413);
    // Also when the size is not announced up front (streamed body).
    let stream =
        futures_util::stream::iter((0..4).map(|_| Ok::<_, std::io::Error>(vec![b' '; 512])));
    let req = Request::post("/charges")
        .header("idempotency-key", "k")
        .body(Body::from_stream(stream))
        .unwrap();
    oneshot(&app, req).await.assert_problem(413);
    assert_eq!(runs.get(), 0);
    // Nothing was stored: the key is still free.
    assert_eq!(
        oneshot(&app, post("/charges", "k", CHARGE)).await.status,
        StatusCode::CREATED
    );
    assert_eq!(runs.get(), 1);
}

pub async fn scopes_are_isolated<B: Backend>(b: &B) {
    let (app, runs) = app_with(scoped(b.store().await));
    let as_account = |account: &str| {
        let mut req = post("/charges", "shared-key", CHARGE);
        req.headers_mut()
            .insert("x-account", account.parse().unwrap());
        req
    };
    let alice = oneshot(&app, as_account("alice")).await;
    let bob = oneshot(&app, as_account("bob")).await;
    assert!(!bob.is_replay(), "bob must never see alice's response");
    assert_ne!(alice.body, bob.body);
    assert_eq!(runs.get(), 2);
    let alice_again = oneshot(&app, as_account("alice")).await;
    assert!(alice_again.is_replay());
    assert_eq!(alice_again.body, alice.body);
    // No scope: not protected, and says so.
    let unscoped = oneshot(&app, post("/charges", "shared-key", CHARGE)).await;
    assert_eq!(
        unscoped.outcome,
        Some(IdempotencyOutcome::Bypassed(
            tower_idempotency::BypassReason::NoScope
        ))
    );
}

pub async fn scope_encoding_cannot_collide<B: Backend>(b: &B) {
    let (app, runs) = app_with(scoped(b.store().await));
    let req = |account: &str, key: &str| {
        let mut req = post("/charges", key, CHARGE);
        req.headers_mut()
            .insert("x-account", account.parse().unwrap());
        req
    };
    oneshot(&app, req("a:b", "c")).await;
    let other = oneshot(&app, req("a", "b:c")).await;
    assert!(!other.is_replay());
    assert_eq!(runs.get(), 2);
}

pub async fn non_final_responses_release_the_key<B: Backend>(b: &B) {
    let (app, runs) = app_with(IdempotencyLayer::new(b.store().await));
    for (i, code) in [408u16, 425, 429, 502, 503, 504].into_iter().enumerate() {
        let path = format!("/status/{code}");
        let key = format!("k{code}");
        for attempt in 1..=2 {
            let reply = oneshot(&app, post(&path, &key, "")).await;
            assert_eq!(reply.status.as_u16(), code);
            assert!(!reply.is_replay());
            assert_eq!(
                reply.outcome,
                Some(IdempotencyOutcome::Executed(Completion::Released))
            );
            assert_eq!(runs.get(), i * 2 + attempt);
        }
    }
    // Final statuses, including errors, are stored.
    for code in [200u16, 400, 404, 500] {
        let path = format!("/status/{code}");
        let key = format!("k{code}");
        oneshot(&app, post(&path, &key, "")).await;
        let retry = oneshot(&app, post(&path, &key, "")).await;
        assert!(retry.is_replay(), "{code} should be stored");
        assert_eq!(retry.status.as_u16(), code);
    }
    assert_eq!(runs.get(), 12 + 4);
}

pub async fn store_all_keeps_every_status<B: Backend>(b: &B) {
    let (app, runs) = app_with(IdempotencyLayer::new(b.store().await).store_when(StoreAll));
    oneshot(&app, post("/status/503", "k", "")).await;
    let retry = oneshot(&app, post("/status/503", "k", "")).await;
    assert!(retry.is_replay());
    assert_eq!(retry.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(runs.get(), 1);
}

/// A client fixes a rejected request (it had no JSON content type) and
/// sends it again under the same key. The default policy stored the `415`,
/// so the fixed request is another request under a used key: `422`. A
/// policy that stores no client errors released the key: it executes.
pub async fn a_fixed_request_executes_under_its_key_only_if_client_errors_are_released<
    B: Backend,
>(
    b: &B,
) {
    let unlabelled = |key: &str| {
        let mut req = post("/orders", key, CHARGE);
        req.headers_mut().remove(http::header::CONTENT_TYPE);
        req
    };

    let (app, runs) = app_with(IdempotencyLayer::new(b.store().await));
    let rejected = oneshot(&app, unlabelled("stored")).await;
    assert_eq!(rejected.status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    let fixed = oneshot(&app, post("/orders", "stored", CHARGE)).await;
    fixed.assert_problem(422);
    assert_eq!(runs.get(), 0);

    let no_client_errors =
        DefaultStorePolicy.and(|status: StatusCode, _: &HeaderMap| !status.is_client_error());
    let (app, runs) = app_with(IdempotencyLayer::new(b.store().await).store_when(no_client_errors));
    let rejected = oneshot(&app, unlabelled("released")).await;
    assert_eq!(rejected.status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    assert_eq!(
        rejected.outcome,
        Some(IdempotencyOutcome::Executed(Completion::Released))
    );
    let fixed = oneshot(&app, post("/orders", "released", CHARGE)).await;
    assert_eq!(fixed.status, StatusCode::CREATED, "{:?}", fixed.body);
    assert!(
        oneshot(&app, post("/orders", "released", CHARGE))
            .await
            .is_replay()
    );
    assert_eq!(runs.get(), 1);
}

pub async fn handler_error_releases_the_key<B: Backend>(b: &B) {
    let attempts = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let seen = attempts.clone();
    let service = service_fn(move |_req: Request<Body>| {
        let n = seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
        async move {
            if n == 1 {
                Err(std::io::Error::other("database down"))
            } else {
                Ok(http::Response::new(Body::from(format!("ok {n}"))))
            }
        }
    });
    let service = tower::Layer::layer(&IdempotencyLayer::new(b.store().await), service);
    let req = || post("/x", "k", CHARGE);
    let error = service.clone().oneshot(req()).await.unwrap_err();
    assert_eq!(error.to_string(), "database down");
    let ok = service.clone().oneshot(req()).await.unwrap();
    assert_eq!(
        ok.status(),
        StatusCode::OK,
        "the retry executes: the error released the key"
    );
    let replay = service.oneshot(req()).await.unwrap();
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(attempts.load(std::sync::atomic::Ordering::SeqCst), 2);
}

pub async fn handler_panic_releases_the_key<B: Backend>(b: &B) {
    let (app, runs) = app_with(IdempotencyLayer::new(b.store().await));
    let server = Server::start(app).await;
    server
        .post("/panic-once", "k", CHARGE)
        .await
        .assert_problem(500);
    let retry = server.post("/panic-once", "k", CHARGE).await;
    assert_eq!(
        retry.status,
        StatusCode::CREATED,
        "the panic released the claim"
    );
    assert!(!retry.is_replay());
    assert!(
        server.post("/panic-once", "k", CHARGE).await.is_replay(),
        "the successful retry is stored"
    );
    assert_eq!(runs.get(), 2);
}

pub async fn oversized_response_is_sent_and_unreplayable<B: Backend>(b: &B) {
    let (app, runs) = app_with(IdempotencyLayer::new(b.store().await).max_stored_body(1024));
    let first = oneshot(&app, post("/big/4096", "k", "")).await;
    assert_eq!(first.status, StatusCode::OK);
    assert_eq!(
        first.body.len(),
        4096,
        "the client still gets the whole body"
    );
    assert_eq!(
        first.outcome,
        Some(IdempotencyOutcome::Executed(Completion::StoredUnreplayable))
    );
    let retry = oneshot(&app, post("/big/4096", "k", "")).await;
    retry.assert_problem(409);
    assert!(retry.json()["detail"].as_str().unwrap().contains("200"));
    assert_eq!(runs.get(), 1, "never a second execution");
    // A response at the limit is stored.
    oneshot(&app, post("/big/1024", "k2", "")).await;
    let replay = oneshot(&app, post("/big/1024", "k2", "")).await;
    assert!(replay.is_replay());
    assert_eq!(replay.body.len(), 1024);
}

/// `n` identical requests at once over HTTP.
async fn fire(server: &Server, n: usize, path: &str, key: &str) -> Vec<Reply> {
    let requests = (0..n).map(|_| server.post(path, key, CHARGE));
    futures_util::future::join_all(requests).await
}

pub async fn concurrent_duplicates_execute_once<B: Backend>(b: &B) {
    let (app, runs) = app_with(IdempotencyLayer::new(b.store().await));
    let server = Server::start(app).await;
    let replies = fire(&server, 64, "/slow?ms=200", "same").await;
    assert_eq!(runs.get(), 1, "64 concurrent duplicates, one execution");
    let executed = replies
        .iter()
        .filter(|r| r.status == StatusCode::CREATED && !r.is_replay())
        .count();
    assert_eq!(executed, 1);
    // A duplicate that reached the store after the first completed (a
    // transactional store's duplicates queue for pooled connections)
    // replays it; every other is told to come back.
    for r in replies.iter().filter(|r| r.status != StatusCode::CREATED) {
        r.assert_problem(409);
        let after: u64 = r
            .header("retry-after")
            .expect("409 carries Retry-After")
            .parse()
            .unwrap();
        assert!(after >= 1);
    }
}

pub async fn concurrent_duplicates_wait_and_replay<B: Backend>(b: &B) {
    let layer = IdempotencyLayer::new(b.store().await).wait_for_in_flight(Duration::from_secs(10));
    let (app, runs) = app_with(layer);
    let server = Server::start(app).await;
    let replies = fire(&server, 64, "/slow?ms=200", "same").await;
    assert_eq!(runs.get(), 1);
    assert!(replies.iter().all(|r| r.status == StatusCode::CREATED));
    assert_eq!(replies.iter().filter(|r| r.is_replay()).count(), 63);
    assert!(replies.iter().all(|r| r.body == replies[0].body));
}

pub async fn client_disconnect_does_not_cancel<B: Backend>(b: &B) {
    use tokio::io::AsyncWriteExt;
    let (app, runs) = app_with(IdempotencyLayer::new(b.store().await));
    let server = Server::start(app).await;
    let mut socket = tokio::net::TcpStream::connect(server.addr).await.unwrap();
    let raw = format!(
        "POST /slow?ms=300 HTTP/1.1\r\nhost: x\r\nidempotency-key: k\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{CHARGE}",
        CHARGE.len()
    );
    socket.write_all(raw.as_bytes()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(runs.get(), 1, "the handler started");
    drop(socket); // the client hangs up mid-handler
    tokio::time::sleep(Duration::from_millis(500)).await;
    let retry = server.post("/slow?ms=300", "k", CHARGE).await;
    assert!(
        retry.is_replay(),
        "the detached handler finished and stored its response"
    );
    assert_eq!(runs.get(), 1);
}

/// The same, without a network: the caller drops the response future.
pub async fn dropped_response_future_still_completes<B: Backend>(b: &B) {
    let (app, runs) = app_with(IdempotencyLayer::new(b.store().await));
    let abandoned = tokio::time::timeout(
        Duration::from_millis(100),
        oneshot(&app, post("/slow?ms=300", "k", CHARGE)),
    )
    .await;
    assert!(
        abandoned.is_err(),
        "the caller gave up while the handler ran"
    );
    assert_eq!(runs.get(), 1);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let retry = oneshot(&app, post("/slow?ms=300", "k", CHARGE)).await;
    assert!(
        retry.is_replay(),
        "the handler finished on its own and stored its response"
    );
    assert_eq!(runs.get(), 1);
}

/// The fingerprint the layer computes for `post(path, key, CHARGE)`.
fn fingerprint_of(path: &str) -> tower_idempotency::Fingerprint {
    let (parts, _) = post(path, "k", CHARGE).into_parts();
    DefaultFingerprint.fingerprint(&parts, CHARGE.as_bytes())
}

pub async fn expired_lease_lets_a_retry_execute<B: Backend>(b: &B)
where
    B::Store: Store<Granted = LeaseToken>,
{
    let store = b.store().await;
    let (app, runs) = app_with(IdempotencyLayer::new(store.clone()));
    let server = Server::start(app).await;
    // A process claimed the key with a short lease, then crashed.
    let key = StorageKey::new("", &IdempotencyKey::new("k").unwrap());
    let lease = Duration::from_millis(300);
    let claim = store
        .claim(&key, &fingerprint_of("/charges"), lease)
        .await
        .unwrap();
    assert!(matches!(claim, Claim::Acquired(_)));
    let blocked = server.post("/charges", "k", CHARGE).await;
    blocked.assert_problem(409);
    assert_eq!(blocked.header("retry-after"), Some("1"));
    assert_eq!(runs.get(), 0);
    tokio::time::sleep(Duration::from_millis(400)).await;
    let retry = server.post("/charges", "k", CHARGE).await;
    assert_eq!(
        retry.status,
        StatusCode::CREATED,
        "the crashed claim expired with its lease"
    );
    assert_eq!(runs.get(), 1);
}

pub async fn heartbeat_keeps_a_slow_handler_claimed<B: Backend>(b: &B)
where
    B::Store: Store<Granted = LeaseToken>,
{
    // A 1.5 s handler under a 300 ms lease: five lease periods.
    let layer = IdempotencyLayer::new(b.store().await).lease(Duration::from_millis(300));
    let (app, runs) = app_with(layer);
    let server = Server::start(app).await;
    let first = server.post("/slow?ms=1500", "k", CHARGE);
    let probes = async {
        // Probe well past several lease periods: the heartbeat must keep the claim.
        for wait_ms in [500, 400, 400] {
            tokio::time::sleep(Duration::from_millis(wait_ms)).await;
            server
                .post("/slow?ms=1500", "k", CHARGE)
                .await
                .assert_problem(409);
        }
    };
    let (first, ()) = tokio::join!(first, probes);
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(server.post("/slow?ms=1500", "k", CHARGE).await.is_replay());
    assert_eq!(runs.get(), 1, "the claim was never lost");
}

pub async fn fencing_refuses_a_stale_holder<B: Backend>(b: &B)
where
    B::Store: Store<Granted = LeaseToken>,
{
    let store = b.store().await;
    let key = StorageKey::new("acct", &IdempotencyKey::new("k").unwrap());
    let fp = fingerprint_of("/charges");
    let lease = Duration::from_millis(100);
    let Claim::Acquired(mut stale) = store.claim(&key, &fp, lease).await.unwrap() else {
        panic!("first claim must be acquired")
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let Claim::Acquired(mut fresh) = store
        .claim(&key, &fp, Duration::from_secs(30))
        .await
        .unwrap()
    else {
        panic!("the expired claim must be re-claimable")
    };
    assert_ne!(stale, fresh);
    let record = Arc::new(tower_idempotency::CompletedRecord::Unreplayable {
        status: StatusCode::OK,
        created_at: std::time::SystemTime::now(),
    });
    let day = Duration::from_secs(86_400);
    assert!(
        !store.extend(&key, stale, lease).await.unwrap(),
        "stale extend refused"
    );
    assert!(
        !store
            .complete(&key, &mut stale, &fp, record.clone(), day)
            .await
            .unwrap(),
        "stale complete refused"
    );
    assert!(
        !store.release(&key, stale).await.unwrap(),
        "stale release refused"
    );
    assert!(
        matches!(
            store.claim(&key, &fp, lease).await.unwrap(),
            Claim::InFlight { .. }
        ),
        "the newer claim is intact"
    );
    assert!(
        store
            .extend(&key, fresh, Duration::from_secs(30))
            .await
            .unwrap()
    );
    assert!(
        store
            .complete(&key, &mut fresh, &fp, record.clone(), day)
            .await
            .unwrap()
    );
    assert!(
        store
            .complete(&key, &mut fresh, &fp, record.clone(), day)
            .await
            .unwrap(),
        "a completion repeated after it was applied (its reply lost) is stored, not refused"
    );
    let other = Arc::new(tower_idempotency::CompletedRecord::Unreplayable {
        status: StatusCode::CREATED,
        created_at: std::time::SystemTime::now(),
    });
    assert!(
        !store
            .complete(&key, &mut fresh, &fp, other, day)
            .await
            .unwrap(),
        "a record completes once: another record never replaces it"
    );
    assert!(
        !store.release(&key, fresh).await.unwrap(),
        "a completed record cannot be released"
    );
    assert!(matches!(
        store.claim(&key, &fp, lease).await.unwrap(),
        Claim::Completed { .. }
    ));
}

pub async fn record_expires_after_retention<B: Backend>(b: &B) {
    let (app, runs) =
        app_with(IdempotencyLayer::new(b.store().await).retention(Duration::from_secs(1)));
    oneshot(&app, post("/charges", "k", CHARGE)).await;
    assert!(
        oneshot(&app, post("/charges", "k", CHARGE))
            .await
            .is_replay()
    );
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let after = oneshot(&app, post("/charges", "k", CHARGE)).await;
    assert!(!after.is_replay(), "the record expired with its retention");
    assert_eq!(runs.get(), 2);
}

pub async fn rejections_are_customisable<B: Backend>(b: &B) {
    let layer =
        IdempotencyLayer::new(b.store().await).on_rejection(|r: tower_idempotency::Rejection| {
            let mut response = http::Response::new(Body::from(format!("custom: {}", r.title())));
            *response.status_mut() = r.status();
            response
        });
    let (app, _) = app_with(layer);
    oneshot(&app, post("/charges", "k", CHARGE)).await;
    let reply = oneshot(&app, post("/charges", "k", "{}")).await;
    assert_eq!(reply.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(
        std::str::from_utf8(&reply.body)
            .unwrap()
            .starts_with("custom: ")
    );
    assert_eq!(
        reply.outcome,
        Some(IdempotencyOutcome::Rejected(RejectionKind::Mismatch))
    );
}
