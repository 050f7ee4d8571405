//! Safe in a newcomer's hands: the ordinary mistakes of someone adding the
//! layer to a service for the first time — the authentication layer placed
//! inside it, a store built without `.transactional()`, a typo'd body, a
//! webhook body the handler refuses — never turn the protection off, never
//! burn a key, and say what to fix. Written as a user writes them, counted
//! in handler executions and rows.

// The suite runs against every store: `cargo test --all-features`.
#![cfg(every_store)]

mod support;

use std::sync::{
    Arc,
    atomic::{AtomicUsize, Ordering},
};

use axum::{
    Json, Router,
    extract::Request,
    middleware::{self, Next},
    response::Response,
    routing::post,
};
use http::{StatusCode, request::Parts};
use tower_idempotency::{
    IdempotencyLayer, IdempotencyOutcome, IdempotentTx, PostgresTx, RejectionKind, SqliteStore,
    SqliteTx, sqlx,
};

use support::{
    http::{oneshot, post as keyed_post},
    logs::Logs,
    sqlite::TestFile,
};

const CHARGE: &str = r#"{"amount":1999,"currency":"eur"}"#;

#[derive(Clone)]
struct Account(String);

/// The application's authentication: the bearer token names the account.
async fn authenticate(mut request: Request, next: Next) -> Response {
    let token = request
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::to_owned);
    if let Some(token) = token {
        request.extensions_mut().insert(Account(token));
    }
    next.run(request).await
}

fn account(parts: &Parts) -> Option<String> {
    parts.extensions.get::<Account>().map(|a| a.0.clone())
}

/// The authentication middleware applied inside the idempotency layer (in
/// axum, the last `.layer` is the outermost): the scope is `None` for every
/// request. The keyed request is refused with a problem that names the
/// likely cause — never run unprotected — and the mistake is logged once.
#[tokio::test(flavor = "current_thread")]
async fn a_misplaced_authentication_layer_refuses_keyed_requests_instead_of_running_them() {
    let (logs, _guard) = Logs::capture("tower_idempotency=error");
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    let app = Router::new()
        .route(
            "/v1/charges",
            post(move || {
                counted.fetch_add(1, Ordering::SeqCst);
                async { StatusCode::CREATED }
            }),
        )
        .layer(middleware::from_fn(authenticate)) // inside: runs after the layer
        .layer(IdempotencyLayer::new(tower_idempotency::MemoryStore::new()).scope_with(account));
    for _ in 0..3 {
        let mut request = keyed_post("/v1/charges", "order-42", CHARGE);
        request
            .headers_mut()
            .insert("authorization", "Bearer acct_alice".parse().unwrap());
        let reply = oneshot(&app, request).await;
        reply.assert_problem(500);
        assert_eq!(
            reply.outcome,
            Some(IdempotencyOutcome::Rejected(RejectionKind::NoScope))
        );
        assert!(
            reply.json()["detail"]
                .as_str()
                .unwrap()
                .contains("authentication that identifies the caller must run before"),
            "{:?}",
            reply.body
        );
    }
    assert_eq!(runs.load(Ordering::SeqCst), 0, "never run unprotected");
    let said = logs.text();
    assert_eq!(said.matches("has no scope").count(), 1, "once: {said}");

    // Placed outside, it works.
    let app = Router::new()
        .route("/v1/charges", post(|| async { StatusCode::CREATED }))
        .layer(IdempotencyLayer::new(tower_idempotency::MemoryStore::new()).scope_with(account))
        .layer(middleware::from_fn(authenticate));
    let mut request = keyed_post("/v1/charges", "order-42", CHARGE);
    request
        .headers_mut()
        .insert("authorization", "Bearer acct_alice".parse().unwrap());
    assert_eq!(oneshot(&app, request).await.status, StatusCode::CREATED);
}

/// A SQLite file with a `charges` table, and the records table.
async fn sqlite(file: &TestFile) -> SqliteStore {
    let store = SqliteStore::builder()
        .create_table_if_missing()
        .connect(&file.url())
        .await
        .unwrap();
    sqlx::raw_sql("CREATE TABLE charges (amount INTEGER)")
        .execute(store.pool())
        .await
        .unwrap();
    store
}

/// A handler that charges in the request's transaction.
async fn charge(mut tx: IdempotentTx<SqliteTx>) -> StatusCode {
    sqlx::query("INSERT INTO charges VALUES (1999)")
        .execute(&mut *tx)
        .await
        .unwrap();
    StatusCode::CREATED
}

/// `.transactional()` forgotten: the handler's `IdempotentTx` finds no
/// transaction. The `500` names the cause and is never stored — the retry
/// is not answered with it for a day, and runs once the store is fixed —
/// and so do another transaction type and a route without the layer's key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forgotten_transactional_is_named_and_never_stored() {
    let file = TestFile::create();
    let leases = sqlite(&file).await;
    let app = Router::new()
        .route("/v1/charges", post(charge))
        .layer(IdempotencyLayer::new(leases).single_tenant());
    for _ in 0..2 {
        let reply = oneshot(&app, keyed_post("/v1/charges", "order-1", CHARGE)).await;
        reply.assert_problem(500);
        assert!(!reply.is_replay(), "a misconfiguration is never replayed");
        assert_eq!(
            reply.outcome,
            Some(IdempotencyOutcome::Executed(
                tower_idempotency::Completion::Released
            ))
        );
        let detail = reply.json()["detail"].as_str().unwrap().to_owned();
        assert!(detail.contains(".transactional()"), "{detail}");
    }
    assert_eq!(file.count("SELECT count(*) FROM charges").await, 0);

    // Fixed: the same key executes, once.
    let transactional = SqliteStore::builder()
        .transactional()
        .connect(&file.url())
        .await
        .unwrap();
    let app = Router::new()
        .route("/v1/charges", post(charge))
        .layer(IdempotencyLayer::new(transactional.clone()).single_tenant());
    let fixed = oneshot(&app, keyed_post("/v1/charges", "order-1", CHARGE)).await;
    assert_eq!(fixed.status, StatusCode::CREATED);
    assert_eq!(file.count("SELECT count(*) FROM charges").await, 1);

    // Another engine's transaction type, and a request without a key.
    let wrong = Router::new()
        .route(
            "/v1/charges",
            post(|_: IdempotentTx<PostgresTx>| async { StatusCode::CREATED }),
        )
        .layer(IdempotencyLayer::new(transactional).single_tenant());
    let reply = oneshot(&wrong, keyed_post("/v1/charges", "order-2", CHARGE)).await;
    let detail = reply.json()["detail"].as_str().unwrap().to_owned();
    assert!(
        detail.contains("SqlTx"),
        "names what the store gives: {detail}"
    );
    let mut unkeyed = keyed_post("/v1/charges", "x", CHARGE);
    unkeyed.headers_mut().remove("idempotency-key");
    let reply = oneshot(&wrong, unkeyed).await;
    let detail = reply.json()["detail"].as_str().unwrap().to_owned();
    assert!(detail.contains("require_key"), "{detail}");
}

/// A typo'd JSON body is refused by axum's `Json` extractor (`400`) before
/// anything ran: the key is not burned, and the corrected request executes.
/// An answer produced by executing (`402`, card declined) is stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrected_request_executes_and_an_executed_refusal_is_replayed() {
    #[derive(serde::Deserialize)]
    struct NewCharge {
        amount: i64,
    }
    let file = TestFile::create();
    let store = SqliteStore::builder()
        .transactional()
        .create_table_if_missing()
        .connect(&file.url())
        .await
        .unwrap();
    sqlx::raw_sql("CREATE TABLE charges (amount INTEGER)")
        .execute(store.pool())
        .await
        .unwrap();
    let app = Router::new()
        .route(
            "/v1/charges",
            post(
                async |mut tx: IdempotentTx<SqliteTx>, Json(new): Json<NewCharge>| {
                    if new.amount > 10_000 {
                        return StatusCode::PAYMENT_REQUIRED; // declined, by executing
                    }
                    sqlx::query("INSERT INTO charges VALUES (?1)")
                        .bind(new.amount)
                        .execute(&mut *tx)
                        .await
                        .unwrap();
                    StatusCode::CREATED
                },
            ),
        )
        .layer(IdempotencyLayer::new(store).single_tenant());
    let typo = oneshot(
        &app,
        keyed_post("/v1/charges", "order-1", r#"{"amount": 19,99}"#),
    )
    .await;
    assert_eq!(typo.status, StatusCode::BAD_REQUEST);
    let mistyped = oneshot(
        &app,
        keyed_post("/v1/charges", "order-1", r#"{"amount":"1999"}"#),
    )
    .await;
    assert_eq!(mistyped.status, StatusCode::UNPROCESSABLE_ENTITY);
    let corrected = oneshot(&app, keyed_post("/v1/charges", "order-1", CHARGE)).await;
    assert_eq!(
        corrected.status,
        StatusCode::CREATED,
        "{:?}",
        corrected.body
    );
    assert!(
        oneshot(&app, keyed_post("/v1/charges", "order-1", CHARGE))
            .await
            .is_replay()
    );
    assert_eq!(file.count("SELECT count(*) FROM charges").await, 1);

    let declined = r#"{"amount":50000}"#;
    let first = oneshot(&app, keyed_post("/v1/charges", "order-2", declined)).await;
    assert_eq!(first.status, StatusCode::PAYMENT_REQUIRED);
    let again = oneshot(&app, keyed_post("/v1/charges", "order-2", declined)).await;
    assert!(again.is_replay(), "an executed answer is stored");
}

/// Anyone who can reach a webhook route sends a body the handler refuses
/// (`400`) under a genuine event's id: nothing is stored, so the
/// provider's genuine event executes when it arrives, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_webhook_body_cannot_squat_an_event_id() {
    #[derive(serde::Deserialize)]
    struct Event {
        #[serde(rename = "type")]
        kind: String,
    }
    let recorded = Arc::new(AtomicUsize::new(0));
    let counted = recorded.clone();
    let app = Router::new()
        .route(
            "/webhooks",
            post(move |Json(event): Json<Event>| {
                let counted = counted.clone();
                async move {
                    if event.kind != "charge.succeeded" {
                        return StatusCode::BAD_REQUEST;
                    }
                    counted.fetch_add(1, Ordering::SeqCst);
                    StatusCode::OK
                }
            }),
        )
        .layer(
            IdempotencyLayer::new(tower_idempotency::MemoryStore::new())
                .single_tenant()
                .key_from_body("/id")
                .require_key(true),
        );
    let webhook = |body: &str| {
        http::Request::post("/webhooks")
            .header("content-type", "application/json")
            .body(axum::body::Body::from(body.to_owned()))
            .unwrap()
    };
    let squat = oneshot(&app, webhook(r#"{"id":"evt_1","type":"bogus"}"#)).await;
    assert_eq!(squat.status, StatusCode::BAD_REQUEST);
    let genuine = r#"{"id":"evt_1","type":"charge.succeeded"}"#;
    assert_eq!(oneshot(&app, webhook(genuine)).await.status, StatusCode::OK);
    assert!(oneshot(&app, webhook(genuine)).await.is_replay());
    assert_eq!(recorded.load(Ordering::SeqCst), 1);
}
