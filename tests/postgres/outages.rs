//! Outages, in both stores: the database unreachable, hung, lost
//! mid-request; an exhausted pool; a claim blocked behind a table lock.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use axum::{Router, extract::State, http::StatusCode, routing::post};
use tokio::sync::Notify;
use tower_idempotency::{
    IdempotencyLayer, PostgresStore, PostgresTxStore,
    sqlx::{self, PgPool},
    store::postgres::PostgresStoreBuilder,
};

use super::*;
use crate::support::{
    http::{Server, oneshot, post as request},
    logs::Logs,
    postgres::TestDatabase,
    relay::Relay,
};

/// The two modes, each with a handler whose effect is one `charges` row:
/// inserted through the request's transaction (transactional) or on its own
/// (plain: effects committed apart from the record).
#[derive(Clone, Copy, Debug)]
enum Mode {
    Plain,
    Transactional,
}

async fn charge_apart(State(pool): State<PgPool>) -> StatusCode {
    sqlx::query("INSERT INTO charges (note) VALUES ('charged')")
        .execute(&pool)
        .await
        .expect("insert the charge");
    StatusCode::CREATED
}

/// Creates the tables, then opens the transactional store `builder`
/// describes at `url` (the test database itself, or the same through a
/// relay).
async fn tx_store(db: &TestDatabase, url: &str, builder: PostgresStoreBuilder) -> PostgresTxStore {
    drop(transactional(db).await);
    let builder = builder.transactional();
    builder.connect(url).await.expect("connect the store")
}

/// The store of `mode` behind its router, the tables created first.
async fn mode_app(
    db: &TestDatabase,
    mode: Mode,
    url: &str,
    builder: PostgresStoreBuilder,
) -> Router {
    match mode {
        Mode::Transactional => app(tx_store(db, url, builder).await),
        Mode::Plain => {
            drop(transactional(db).await);
            plain_app(builder.connect(url).await.expect("connect the store"))
        }
    }
}

/// A plain store in front of `charge_apart`.
fn plain_app(store: PostgresStore) -> Router {
    let pool = store.pool().clone();
    Router::new()
        .route("/charges", post(charge_apart))
        .layer(IdempotencyLayer::new(store).single_tenant())
        .with_state(pool)
}

/// Retries `key` while it is answered "come back later" — `409` in flight,
/// or `503` while a short command timeout still trips on a loaded machine —
/// for at most `within`.
async fn retry_while_told_to_wait(
    app: &Router,
    key: &str,
    within: Duration,
) -> support::http::Reply {
    let deadline = Instant::now() + within;
    loop {
        let reply = oneshot(app, request("/charges", key, CHARGE)).await;
        let wait = [StatusCode::CONFLICT, StatusCode::SERVICE_UNAVAILABLE];
        if !wait.contains(&reply.status) || Instant::now() > deadline {
            return reply;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Database unreachable (every connection to it cut, new ones refused):
/// `503` with `Retry-After` at once, nothing written; service resumes
/// without a restart when it comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_database_is_a_503_and_service_resumes_when_it_returns() {
    for mode in [Mode::Plain, Mode::Transactional] {
        let db = TestDatabase::create();
        let relay = Relay::start(&db.host_port()).await;
        let builder = PostgresStore::builder().command_timeout(Duration::from_millis(500));
        let app = mode_app(&db, mode, &db.url_via(relay.port()), builder).await;
        let first = oneshot(&app, request("/charges", "k1", CHARGE)).await;
        assert_eq!(first.status, StatusCode::CREATED, "{mode:?}");

        relay.cut();
        let started = Instant::now();
        let down = oneshot(&app, request("/charges", "k2", CHARGE)).await;
        down.assert_problem(503);
        assert!(down.header("retry-after").is_some(), "{mode:?}");
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "{mode:?}: answered within the command timeout, not hung ({:?})",
            started.elapsed()
        );
        assert_eq!(charges(&db).await, 1, "{mode:?}: the handler never ran");

        relay.restore();
        let back = oneshot(&app, request("/charges", "k2", CHARGE)).await;
        assert_eq!(
            back.status,
            StatusCode::CREATED,
            "{mode:?}: {:?}",
            back.body
        );
        assert!(
            oneshot(&app, request("/charges", "k1", CHARGE))
                .await
                .is_replay(),
            "{mode:?}"
        );
        assert_eq!(charges(&db).await, 2, "{mode:?}");
    }
}

/// The network to the database cut while the handler holds an uncommitted
/// charge (the database is gone mid-request): `503`, nothing half-written;
/// once it is back, the retry charges once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_lost_mid_request_is_a_503_and_the_retry_charges_once() {
    let db = TestDatabase::create();
    let relay = Relay::start(&db.host_port()).await;
    let builder = PostgresStore::builder().command_timeout(Duration::from_millis(500));
    let store = tx_store(&db, &db.url_via(relay.port()), builder).await;
    // The handler says when its insert has answered: the server shows the
    // insert done before the answer has crossed the relay, and a cut in
    // between would fail the insert itself (a 500, not this test).
    let inserted = Arc::new(Notify::new());
    let app = {
        let inserted = inserted.clone();
        let handler = move |mut tx: Tx| {
            let inserted = inserted.clone();
            async move {
                insert(&mut tx).await;
                inserted.notify_one();
                tokio::time::sleep(Duration::from_secs(1)).await;
                StatusCode::CREATED
            }
        };
        Router::new()
            .route("/charges", post(handler))
            .layer(IdempotencyLayer::new(store).single_tenant())
    };
    let request_in_flight = {
        let app = app.clone();
        tokio::spawn(async move { oneshot(&app, request("/charges", "k", CHARGE)).await })
    };
    tokio::time::timeout(Duration::from_secs(5), inserted.notified())
        .await
        .expect("the handler never inserted");
    relay.cut();
    request_in_flight.await.unwrap().assert_problem(503);
    assert_eq!(charges(&db).await, 0, "nothing half-written");
    assert_eq!(
        db.count("SELECT count(*) FROM idempotency_records").await,
        0
    );

    relay.restore();
    let retry = oneshot(&app, request("/charges", "k", CHARGE)).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{:?}", retry.body);
    assert_eq!(charges(&db).await, 1);
}

/// A database that stops answering (no error, no bytes): `503` once the
/// documented default command timeout (1 s) has passed — not earlier, not
/// never.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_database_is_a_503_after_the_documented_default_timeout() {
    for mode in [Mode::Plain, Mode::Transactional] {
        let db = TestDatabase::create();
        let relay = Relay::start(&db.host_port()).await;
        let app = mode_app(
            &db,
            mode,
            &db.url_via(relay.port()),
            PostgresStore::builder(),
        )
        .await;
        let first = oneshot(&app, request("/charges", "k1", CHARGE)).await;
        assert_eq!(first.status, StatusCode::CREATED, "{mode:?}");

        relay.stall();
        let started = Instant::now();
        let hung = oneshot(&app, request("/charges", "k2", CHARGE)).await;
        let waited = started.elapsed();
        hung.assert_problem(503);
        assert!(
            waited >= Duration::from_secs(1) && waited < Duration::from_secs(3),
            "{mode:?}: the 1 s default is the timeout in force, waited {waited:?}"
        );

        relay.restore();
        let back = retry_while_told_to_wait(&app, "k2", Duration::from_secs(5)).await;
        assert_eq!(
            back.status,
            StatusCode::CREATED,
            "{mode:?}: {:?}",
            back.body
        );
        assert_eq!(charges(&db).await, 2, "{mode:?}");
    }
}

/// Every pooled connection held by a request in its handler: the next
/// request gets `503` once the command timeout passes, instead of waiting
/// for a connection to come back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exhausted_pool_is_a_503_not_a_wait() {
    let db = TestDatabase::create();
    let builder = PostgresStore::builder()
        .max_connections(2)
        .command_timeout(Duration::from_millis(300));
    let app = mode_app(&db, Mode::Transactional, db.url(), builder).await;
    let server = Server::start(app).await;
    let slow = ["a", "b"].map(|key| {
        let client = server.client.clone();
        let mut req = request("/charges?ms=4000", key, CHARGE);
        *req.uri_mut() = server.url("/charges?ms=4000").parse().unwrap();
        tokio::spawn(async move { client.send(req).await.status })
    });
    let holding = "the two slow requests never started";
    db.wait_for_count(IDLE_IN_TRANSACTION, |n| n >= 2, holding)
        .await;

    let started = Instant::now();
    let third = server.post("/charges", "c", CHARGE).await;
    third.assert_problem(503);
    assert!(third.header("retry-after").is_some());
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "answered while the pool was still exhausted ({:?})",
        started.elapsed()
    );

    for slow in slow {
        assert_eq!(slow.await.unwrap(), StatusCode::CREATED);
    }
    let again = server.post("/charges", "c", CHARGE).await;
    assert_eq!(again.status, StatusCode::CREATED, "{:?}", again.body);
    assert_eq!(charges(&db).await, 3);
}

/// In plain mode the pool is only held for a statement, but it runs out all
/// the same under load: `503`, and the claim that timed out waiting for a
/// connection was never sent, so it is dropped — not run later, adding
/// load to a pool already short of connections.
#[tokio::test]
async fn plain_mode_on_an_exhausted_pool_is_a_503_and_the_claim_is_dropped() {
    let (logs, _guard) = Logs::capture("tower_idempotency=debug");
    let db = TestDatabase::create();
    drop(transactional(&db).await);
    // The application's own pool, with sqlx's default acquire timeout (30 s):
    // the store's command timeout bounds the wait all the same.
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(db.url())
        .await
        .unwrap();
    let store = PostgresStore::builder()
        .command_timeout(Duration::from_millis(300))
        .with_pool(pool.clone())
        .await
        .unwrap();
    let app = plain_app(store);

    let held = pool.acquire().await.unwrap();
    oneshot(&app, request("/charges", "k", CHARGE))
        .await
        .assert_problem(503);
    drop(held);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !logs.text().contains("applied late"),
        "the abandoned claim ran: {}",
        logs.text()
    );
    let retry = retry_while_told_to_wait(&app, "k", Duration::from_secs(5)).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{:?}", retry.body);
    assert_eq!(charges(&db).await, 1);
}

/// A claim blocked in the database (here by a table lock, as a migration
/// takes) times out with `503`, and the database runs it once unblocked.
/// That claim has no holder: it must not keep the key in flight for a whole
/// lease — a retry soon after executes, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_the_database_runs_after_its_timeout_does_not_block_the_key() {
    for mode in [Mode::Plain, Mode::Transactional] {
        let db = TestDatabase::create();
        // One connection, its statements prepared by a first request: the
        // blocked claim is then sent whole, not stuck in its preparation.
        let builder = PostgresStore::builder()
            .command_timeout(Duration::from_millis(300))
            .max_connections(1);
        let app = mode_app(&db, mode, db.url(), builder).await;
        let warm = oneshot(&app, request("/charges", "warm", CHARGE)).await;
        assert_eq!(warm.status, StatusCode::CREATED);
        let mut locker = <sqlx::PgConnection as sqlx::Connection>::connect(db.url())
            .await
            .unwrap();
        sqlx::raw_sql("BEGIN; LOCK TABLE idempotency_records IN ACCESS EXCLUSIVE MODE")
            .execute(&mut locker)
            .await
            .unwrap();

        oneshot(&app, request("/charges", "k", CHARGE))
            .await
            .assert_problem(503);
        tokio::time::sleep(Duration::from_millis(300)).await;
        sqlx::raw_sql("COMMIT").execute(&mut locker).await.unwrap();

        // The default lease is 30 s: a claim left behind would answer 409
        // for all of it.
        let retry = retry_while_told_to_wait(&app, "k", Duration::from_secs(5)).await;
        assert_eq!(
            retry.status,
            StatusCode::CREATED,
            "{mode:?}: {:?}",
            retry.body
        );
        assert_eq!(charges(&db).await, 2, "{mode:?}");
    }
}
