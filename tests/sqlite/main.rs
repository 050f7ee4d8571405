//! The SQLite stores on real database files: the transactional store's
//! semantics (charge and record commit together or not at all, counted in
//! rows of the handler's own table), concurrent duplicates answered without
//! waiting for the write lock, two processes on one file, kill -9 and
//! restarts of the example (its durable default), and the start-up check.
//! The behaviour cases run on both stores in `behaviour/`.

#[path = "../support/mod.rs"]
mod support;

use std::time::{Duration, Instant};

use axum::{Router, extract::Query, http::StatusCode, routing::post};
use tower_idempotency::{
    IdempotencyLayer, IdempotentTx, SqliteStore, SqliteTx, SqliteTxStore,
    sqlx::{self, Connection, SqliteConnection},
    store::{StoreError, sqlite::EngineCheck},
};

use support::{
    http::{Server, oneshot, post as request},
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_charge_and_the_record_commit_together_and_replay() {
    let file = TestFile::create();
    let app = app(transactional(&file).await);
    let first = oneshot(&app, request("/charges", "k", CHARGE)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.body, "charge 1");
    let replay = oneshot(&app, request("/charges", "k", CHARGE)).await;
    assert!(replay.is_replay());
    assert_eq!(replay.body, first.body);
    oneshot(&app, request("/charges", "k", "{}"))
        .await
        .assert_problem(422);
    let busy = oneshot(&app, request("/charges?status=503", "n", CHARGE)).await;
    assert_eq!(busy.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        file.count(CHARGES).await,
        1,
        "a non-final response rolls back"
    );
    assert_eq!(
        file.count("SELECT count(*) FROM idempotency_records WHERE record IS NOT NULL")
            .await,
        1
    );
}

/// 32 duplicates of a request whose handler holds the write lock for a
/// second: one execution, and every duplicate answered `409` while the
/// first still runs — none waits for the lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_duplicates_get_409_at_once_not_a_wait_for_the_write_lock() {
    let file = TestFile::create();
    let server = Server::start(app(transactional(&file).await)).await;
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
        assert!(*at < done, "answered while the first still ran");
    }
    assert_eq!(file.count(CHARGES).await, 1);
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

/// Inserts a charge in the request's transaction; a failed insert (a
/// broken `charges` table) is answered `500`, as the example does.
async fn charge_or_500(mut tx: IdempotentTx<SqliteTx>) -> (StatusCode, String) {
    match sqlx::query("INSERT INTO charges (note) VALUES ('charged')")
        .execute(&mut *tx)
        .await
    {
        Ok(_) => (StatusCode::CREATED, "charged".into()),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("charge failed: {e}"),
        ),
    }
}

/// SQLite does not abort a transaction when one of its statements fails,
/// so a handler's `500` over a broken table used to commit as the key's
/// answer and be replayed once the table was fixed. A server error rolls
/// back and releases the key, as on PostgreSQL: after the fix, the retry
/// charges once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_error_over_a_broken_table_is_not_stored_and_the_fixed_retry_charges_once() {
    let file = TestFile::create();
    let store = transactional(&file).await;
    let pool = store.pool().clone();
    let app = Router::new()
        .route("/charges", post(charge_or_500))
        .layer(IdempotencyLayer::new(store).single_tenant());
    sqlx::raw_sql("DROP TABLE charges")
        .execute(&pool)
        .await
        .unwrap();
    let broken = oneshot(&app, request("/charges", "k", CHARGE)).await;
    assert_eq!(broken.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        file.count("SELECT count(*) FROM idempotency_records").await,
        0,
        "nothing committed for the key"
    );
    sqlx::raw_sql("CREATE TABLE charges (id INTEGER PRIMARY KEY, note TEXT)")
        .execute(&pool)
        .await
        .unwrap();
    let fixed = oneshot(&app, request("/charges", "k", CHARGE)).await;
    assert_eq!(fixed.status, StatusCode::CREATED, "{:?}", fixed.body);
    assert!(!fixed.is_replay());
    assert!(
        oneshot(&app, request("/charges", "k", CHARGE))
            .await
            .is_replay()
    );
    assert_eq!(file.count(CHARGES).await, 1);
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

/// A handler's answer marked not to be replayed: its writes commit without
/// a record (`Cache-Control: no-store`, `NoReplay::new`) or roll back
/// (`NoReplay::rolling_back`), and the key is released either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_that_opts_out_commits_or_rolls_back_as_the_handler_chose() {
    use tower_idempotency::NoReplay;

    async fn write(tx: &mut tower_idempotency::IdempotentTx<tower_idempotency::SqliteTx>) {
        sqlx::query("INSERT INTO charges (note) VALUES ('charged')")
            .execute(&mut **tx)
            .await
            .unwrap();
    }
    let file = TestFile::create();
    let store = transactional(&file).await;
    let app = Router::new()
        .route(
            "/no-store",
            post(
                async |mut tx: tower_idempotency::IdempotentTx<tower_idempotency::SqliteTx>| {
                    write(&mut tx).await;
                    (
                        StatusCode::CREATED,
                        [(http::header::CACHE_CONTROL, "no-store")],
                        "kept",
                    )
                },
            ),
        )
        .route(
            "/rolled-back",
            post(
                async |mut tx: tower_idempotency::IdempotentTx<tower_idempotency::SqliteTx>| {
                    write(&mut tx).await;
                    (
                        StatusCode::UNPROCESSABLE_ENTITY,
                        NoReplay::rolling_back(),
                        "undone",
                    )
                },
            ),
        )
        .layer(IdempotencyLayer::new(store).single_tenant());
    for _ in 0..2 {
        let kept = oneshot(&app, request("/no-store", "kept", CHARGE)).await;
        assert_eq!(kept.status, StatusCode::CREATED);
        assert!(!kept.is_replay());
    }
    assert_eq!(
        file.count(CHARGES).await,
        2,
        "each execution's write committed"
    );
    for _ in 0..2 {
        let undone = oneshot(&app, request("/rolled-back", "undone", CHARGE)).await;
        assert_eq!(undone.status, StatusCode::UNPROCESSABLE_ENTITY);
        assert!(!undone.is_replay());
    }
    assert_eq!(file.count(CHARGES).await, 2, "rolled back");
    assert_eq!(
        file.count("SELECT count(*) FROM idempotency_records").await,
        0,
        "no record, no claim left"
    );
}
