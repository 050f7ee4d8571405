//! The SQLite stores on real database files: the transactional store's
//! semantics (charge and record commit together or not at all, counted in
//! rows of the handler's own table), concurrent duplicates answered without
//! waiting for the write lock, two processes on one file, kill -9 and
//! restarts of the example (its durable default), and the start-up check.
//! The behaviour cases run on both stores in `behaviour/`.

// The suite runs against every store: `cargo test --all-features`.
#![cfg(every_store)]

#[path = "../support/mod.rs"]
mod support;

use std::time::Duration;

use axum::{Router, extract::Query, http::StatusCode, routing::post};
use tower_idempotency::{
    IdempotencyLayer, IdempotentTx, SqliteStore, SqliteTx, SqliteTxStore,
    sqlx::{self, Connection, SqliteConnection},
    store::{StoreError, sqlite::EngineCheck},
};

use support::{
    http::{oneshot, post as request},
    sqlite::TestFile,
};

const CHARGE: &str = r#"{"amount":1999,"currency":"eur"}"#;
const CHARGES: &str = "SELECT count(*) FROM charges";

async fn transactional(file: &TestFile) -> SqliteTxStore {
    let store = SqliteStore::builder()
        .transactional()
        .create_table_if_missing()
        .connect(&file.url())
        .await
        .expect("open the test database");
    sqlx::raw_sql("CREATE TABLE IF NOT EXISTS charges (id INTEGER PRIMARY KEY, note TEXT)")
        .execute(store.pool())
        .await
        .unwrap();
    store
}

#[derive(serde::Deserialize)]
struct Params {
    #[serde(default)]
    ms: u64,
    #[serde(default = "created")]
    status: u16,
}

fn created() -> u16 {
    201
}

/// Inserts a charge in the request's transaction, waits `ms`, answers
/// `status` with the number of charges it sees.
async fn charge(mut tx: IdempotentTx<SqliteTx>, Query(p): Query<Params>) -> (StatusCode, String) {
    sqlx::query("INSERT INTO charges (note) VALUES ('charged')")
        .execute(&mut *tx)
        .await
        .expect("insert the charge");
    tokio::time::sleep(Duration::from_millis(p.ms)).await;
    let charges: i64 = sqlx::query_scalar(CHARGES)
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    (
        StatusCode::from_u16(p.status).unwrap(),
        format!("charge {charges}"),
    )
}

fn app(store: SqliteTxStore) -> Router {
    Router::new()
        .route("/charges", post(charge))
        .layer(IdempotencyLayer::new(store).single_tenant())
}

/// A table made by hand without its primary key would let a second claim
/// of a key succeed: the store refuses to open on it, naming SQLite's
/// version and the opt-out; opting out opens it.
#[tokio::test]
async fn a_table_without_its_primary_key_is_refused_at_start_up() {
    let file = TestFile::create();
    let mut connection = SqliteConnection::connect(&file.url()).await.unwrap();
    sqlx::raw_sql(
        "CREATE TABLE idempotency_records (key TEXT NOT NULL, fingerprint BLOB NOT NULL, \
         token BLOB, record BLOB, expires_at INTEGER NOT NULL)",
    )
    .execute(&mut connection)
    .await
    .unwrap();
    let refused = SqliteStore::builder()
        .transactional()
        .connect(&file.url())
        .await;
    match refused {
        Err(StoreError::Misconfigured(message)) => {
            assert!(message.contains("SQLite 3."), "{message}");
            assert!(message.contains("EngineCheck::Warn"), "{message}");
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    let opted_out = SqliteStore::builder()
        .transactional()
        .engine_check(EngineCheck::Warn)
        .connect(&file.url())
        .await;
    assert!(opted_out.is_ok(), "{opted_out:?}");
}

/// A key column that compares case-insensitively would replay one key's
/// answer for another: the start-up check refuses it, and names why.
#[tokio::test]
async fn a_case_insensitive_key_column_is_refused_at_start_up() {
    let file = TestFile::create();
    let mut connection = SqliteConnection::connect(&file.url()).await.unwrap();
    sqlx::raw_sql(
        "CREATE TABLE idempotency_records (key TEXT NOT NULL COLLATE NOCASE PRIMARY KEY, \
         fingerprint BLOB NOT NULL, token BLOB, record BLOB, expires_at INTEGER NOT NULL)",
    )
    .execute(&mut connection)
    .await
    .unwrap();
    match SqliteStore::builder()
        .transactional()
        .connect(&file.url())
        .await
    {
        Err(StoreError::Misconfigured(message)) => {
            assert!(message.contains("does not compare bytes"), "{message}");
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
}

/// A request that gives up while its claim waits for the write lock (a
/// slow charge holds it): the claim still runs once the lock is free, and
/// the transaction it began, which nobody took, must end with it — not go
/// back to the pool holding the file's write lock, which made every later
/// charge wait out the busy timeout and fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_whose_caller_gave_up_does_not_keep_the_write_lock() {
    let file = TestFile::create();
    let app = app(transactional(&file).await);
    let slow = tokio::spawn({
        let app = app.clone();
        async move { oneshot(&app, request("/charges?ms=800", "slow", CHARGE)).await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let gave_up = tokio::time::timeout(
        Duration::from_millis(200),
        oneshot(&app, request("/charges", "impatient", CHARGE)),
    )
    .await;
    assert!(gave_up.is_err(), "it waited for the write lock");
    assert_eq!(slow.await.unwrap().status, StatusCode::CREATED);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let next = oneshot(&app, request("/charges", "next", CHARGE)).await;
    assert_eq!(next.status, StatusCode::CREATED, "{:?}", next.body);
    assert_eq!(
        file.count(CHARGES).await,
        2,
        "the abandoned claim charged nothing"
    );
}
