//! The transactional stores through the layer, written once for every
//! engine: the handler's charge (a row of its own table, written with the
//! request's transaction) and the record commit together or not at all.
//! The store-level rules are `testing::TxStoreContract`'s, run in
//! `tests/contract.rs`.

use std::time::{Duration, Instant};

use axum::{
    Router,
    extract::{Query, State},
    http::StatusCode,
    response::{IntoResponse, Response},
    routing::post,
};
use tower_idempotency::{
    IdempotencyLayer, IdempotentTx, NoReplay, store::sql::DeleteExpired, testing::TxEffects,
};

use super::CHARGE;
use crate::support::{
    backend::{Total, TxBackend},
    http::{Server, oneshot, post as request},
};

#[derive(serde::Deserialize)]
struct Params {
    /// How long the handler holds its transaction after writing.
    #[serde(default)]
    ms: u64,
    #[serde(default = "created")]
    status: u16,
    /// Runs a statement that fails after the charge, and answers `500`.
    #[serde(default)]
    fail: bool,
    /// `keep`: answers `Cache-Control: no-store` (the writes commit, no
    /// record); `undo`: answers with `NoReplay::rolling_back`.
    #[serde(default)]
    opt_out: Option<String>,
}

fn created() -> u16 {
    201
}

/// Writes one charge named by the idempotency key with the request's
/// transaction, then answers as asked.
async fn charge<B: TxBackend>(
    State(charges): State<B::Charges>,
    Query(p): Query<Params>,
    headers: http::HeaderMap,
    mut tx: IdempotentTx<B::Tx>,
) -> Response {
    let key = headers["idempotency-key"].to_str().unwrap().to_owned();
    if let Err(e) = charges.write(&mut *tx, &key).await {
        return (StatusCode::INTERNAL_SERVER_ERROR, e).into_response();
    }
    if p.fail {
        charges.fail_a_statement(&mut *tx).await;
        return (StatusCode::INTERNAL_SERVER_ERROR, "charge failed").into_response();
    }
    tokio::time::sleep(Duration::from_millis(p.ms)).await;
    let status = StatusCode::from_u16(p.status).unwrap();
    match p.opt_out.as_deref() {
        Some("keep") => {
            (status, [(http::header::CACHE_CONTROL, "no-store")], "kept").into_response()
        }
        Some("undo") => (status, NoReplay::rolling_back(), "undone").into_response(),
        _ => (status, format!("charged {key}")).into_response(),
    }
}

async fn app<B: TxBackend>(b: &B) -> (Router, B::Charges) {
    let (store, charges) = b.store_and_charges().await;
    (
        app_on::<B>(IdempotencyLayer::new(store).single_tenant(), &charges),
        charges,
    )
}

fn app_on<B: TxBackend>(
    layer: IdempotencyLayer<B::Store, tower_idempotency::NoScope>,
    charges: &B::Charges,
) -> Router {
    Router::new()
        .route("/charges", post(charge::<B>))
        .layer(layer)
        .with_state(charges.clone())
}

/// The charge and the record commit together: a replay is the first
/// answer, another payload a `422`, and a non-final answer rolls its
/// charge back.
pub async fn the_charge_and_the_record_commit_together_and_replay<B: TxBackend>(b: &B) {
    let (app, charges) = app(b).await;
    let first = oneshot(&app, request("/charges", "k", CHARGE)).await;
    assert_eq!(first.status, StatusCode::CREATED, "{:?}", first.body);
    for _ in 0..2 {
        let replay = oneshot(&app, request("/charges", "k", CHARGE)).await;
        assert!(replay.is_replay(), "{} {:?}", replay.status, replay.body);
        assert_eq!(replay.body, first.body);
    }
    oneshot(&app, request("/charges", "k", "{}"))
        .await
        .assert_problem(422);
    let busy = oneshot(&app, request("/charges?status=503", "n", CHARGE)).await;
    assert_eq!(busy.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(charges.total().await, 1, "a non-final answer rolls back");
    let retried = oneshot(&app, request("/charges", "n", CHARGE)).await;
    assert_eq!(
        retried.status,
        StatusCode::CREATED,
        "released, then executed"
    );
    assert_eq!(charges.total().await, 2);
}

/// 32 duplicates of a charge that holds its transaction for a second:
/// one charge, and every duplicate answered `409` with `Retry-After` while
/// the first still runs — none waits on its lock.
pub async fn concurrent_duplicates_charge_once_and_none_waits_for_the_first<B: TxBackend>(b: &B) {
    let (app, charges) = app(b).await;
    let server = Server::start(app).await;
    let started = Instant::now();
    let replies = futures_util::future::join_all((0..32).map(|_| async {
        let reply = server.post("/charges?ms=1000", "k", CHARGE).await;
        (reply, started.elapsed())
    }))
    .await;
    let executed: Vec<_> = replies
        .iter()
        .filter(|(r, _)| r.status == StatusCode::CREATED)
        .collect();
    assert_eq!(executed.len(), 1, "one execution");
    let done = executed[0].1;
    for (reply, at) in replies
        .iter()
        .filter(|(r, _)| r.status != StatusCode::CREATED)
    {
        reply.assert_problem(409);
        assert!(reply.header("retry-after").is_some());
        assert!(*at < done, "answered while the first still ran");
    }
    assert_eq!(charges.total().await, 1);
    assert!(
        server
            .post("/charges?ms=1000", "k", CHARGE)
            .await
            .is_replay()
    );
}

/// A handler's answer marked not to be replayed: its writes commit without
/// a record (`Cache-Control: no-store`) or roll back
/// (`NoReplay::rolling_back`), and the key is released either way.
pub async fn an_answer_that_opts_out_commits_or_rolls_back_as_the_handler_chose<B: TxBackend>(
    b: &B,
) {
    let (app, charges) = app(b).await;
    for _ in 0..2 {
        let kept = oneshot(&app, request("/charges?opt_out=keep", "kept", CHARGE)).await;
        assert_eq!(kept.status, StatusCode::CREATED);
        assert!(!kept.is_replay());
    }
    assert_eq!(charges.total().await, 2, "each execution's write committed");
    for _ in 0..2 {
        let undone = oneshot(
            &app,
            request("/charges?opt_out=undo&status=422", "undone", CHARGE),
        )
        .await;
        assert_eq!(undone.status, StatusCode::UNPROCESSABLE_ENTITY);
        assert!(!undone.is_replay());
    }
    assert_eq!(charges.total().await, 2, "rolled back");
    let after = oneshot(&app, request("/charges", "undone", CHARGE)).await;
    assert_eq!(
        after.status,
        StatusCode::CREATED,
        "no record, no claim left"
    );
}

/// A handler whose statement failed answers `500` (PostgreSQL aborts the
/// transaction, SQLite and MySQL go on): not stored, nothing committed,
/// the key released; the retry charges once and is replayed.
pub async fn a_server_error_after_a_failed_statement_is_not_stored_and_the_retry_charges_once<
    B: TxBackend,
>(
    b: &B,
) {
    let (app, charges) = app(b).await;
    let broken = oneshot(&app, request("/charges?fail=true", "k", CHARGE)).await;
    assert_eq!(broken.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(!broken.is_replay());
    assert_eq!(charges.total().await, 0, "nothing committed for the key");
    let fixed = oneshot(&app, request("/charges", "k", CHARGE)).await;
    assert_eq!(fixed.status, StatusCode::CREATED, "{:?}", fixed.body);
    assert!(!fixed.is_replay());
    assert!(
        oneshot(&app, request("/charges", "k", CHARGE))
            .await
            .is_replay()
    );
    assert_eq!(charges.total().await, 1);
}

/// Expired records are absent at once — a retry past the retention
/// executes again, as the retention says — and deleted in batches; the
/// live record stays.
pub async fn expired_records_are_absent_at_once_and_deleted_in_batches<B: TxBackend>(b: &B) {
    let (store, charges) = b.store_and_charges().await;
    let layer = IdempotencyLayer::new(store.clone())
        .single_tenant()
        .retention(Duration::from_secs(3));
    let app = app_on::<B>(layer, &charges);
    for i in 0..5 {
        let reply = oneshot(&app, request("/charges", &format!("k{i}"), CHARGE)).await;
        assert_eq!(reply.status, StatusCode::CREATED);
    }
    // Past the last one's retention, however late the timer wakes; the
    // checks after the next charge land well inside its own.
    let stored_at = tokio::time::Instant::now();
    tokio::time::sleep_until(stored_at + Duration::from_millis(3200)).await;
    let again = oneshot(&app, request("/charges", "k0", CHARGE)).await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert!(!again.is_replay());
    assert_eq!(charges.total().await, 6);

    assert_eq!(store.delete_expired(3).await.unwrap(), 3);
    assert_eq!(store.delete_expired(3).await.unwrap(), 1);
    assert_eq!(store.delete_expired(3).await.unwrap(), 0);
    assert!(
        oneshot(&app, request("/charges", "k0", CHARGE))
            .await
            .is_replay(),
        "the live record stays"
    );
}
