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
    http::{HttpClient, Server, oneshot, post as request},
    payments::{Payments, charge_request, kill_mid_charge, retry_until_done},
    redis_server::free_port,
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

/// Two example processes on one database file, concurrent duplicates sent
/// to both: SQLite's write lock keeps the second process out until the
/// first commits, then it replays. One charge.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_processes_on_one_file_never_both_execute_a_key() {
    let file = TestFile::create();
    let url = file.url();
    let env = [
        ("DATABASE_URL", url.as_str()),
        ("PROCESSOR_LATENCY_MS", "300"),
    ];
    let a = Payments::start(free_port(), &env);
    let b = Payments::start(free_port(), &env);
    let client = HttpClient::default();
    let replies = futures_util::future::join_all((0..16).map(|i| {
        let addr = if i % 2 == 0 { &a.addr } else { &b.addr };
        client.send(charge_request(addr))
    }))
    .await;
    let executed = replies
        .iter()
        .filter(|r| r.status == StatusCode::CREATED && !r.is_replay())
        .count();
    assert_eq!(
        executed,
        1,
        "{:?}",
        replies.iter().map(|r| r.status).collect::<Vec<_>>()
    );
    for reply in &replies {
        assert!(
            reply.status == StatusCode::CREATED || reply.status == StatusCode::CONFLICT,
            "{} {:?}",
            reply.status,
            reply.body
        );
    }
    let (done, _) = retry_until_done(&client, &b.addr).await;
    assert!(done.is_replay());
    assert_eq!(file.count(CHARGES).await, 1, "exactly one charge");
}

/// The example's durable default, killed (-9) while its handler holds an
/// uncommitted charge: nothing committed, the key free at once after the
/// restart (the dead process's file locks went with it), and the retry
/// charges once; after another restart the completed charge replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_mid_charge_the_default_example_charges_once_and_replays_after_restarts() {
    let file = TestFile::create();
    let url = file.url();
    let client = HttpClient::default();
    let env = [
        ("DATABASE_URL", url.as_str()),
        ("PROCESSOR_LATENCY_MS", "2000"),
        ("ADMIN_TOKEN", "s3cret"),
    ];
    // In flight, as the operators' route shows it: the handler holds its
    // claim, its charge inserted and uncommitted while the processor works.
    // A client of its own: its kept-alive connection dies with the process.
    let probe = HttpClient::default();
    let in_flight = async |addr: &str| {
        let inspect = http::Request::get(format!(
            "http://{addr}/admin/idempotency/acct_crash/crash-1"
        ))
        .header("authorization", "Bearer s3cret")
        .body(axum::body::Body::empty())
        .unwrap();
        probe.send(inspect).await.json()["state"] == "in_flight"
    };
    let payments = kill_mid_charge(&client, &env, in_flight).await;
    assert_eq!(
        file.count(CHARGES).await,
        0,
        "the uncommitted charge died with the process"
    );

    let (executed, conflicts) = retry_until_done(&client, &payments.addr).await;
    assert_eq!(executed.status, StatusCode::CREATED);
    assert!(!executed.is_replay());
    eprintln!("sqlite: the retry executed after {conflicts} × 409");
    drop(payments);

    let restarted = Payments::start(free_port(), &env);
    let replay = client.send(charge_request(&restarted.addr)).await;
    assert!(
        replay.is_replay(),
        "the record outlived the process: {}",
        replay.status
    );
    assert_eq!(replay.body, executed.body);
    assert_eq!(file.count(CHARGES).await, 1, "exactly one charge");
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

/// A charge as the example takes it, with a description of `bytes` bytes,
/// from `acct_disk` under `key`.
fn large_charge(addr: &str, key: &str, bytes: usize) -> http::Request<axum::body::Body> {
    let body = format!(
        r#"{{"amount":500,"currency":"usd","description":"{}"}}"#,
        "x".repeat(bytes)
    );
    http::Request::post(format!("http://{addr}/v1/charges"))
        .header("authorization", "Bearer acct_disk")
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(axum::body::Body::from(body))
        .unwrap()
}

/// The file system under the example's database fills up, so COMMITs fail;
/// once the space is back, the very next charges succeed — no connection
/// is left inside the transaction whose COMMIT failed (it was one pooled
/// connection's wedge: every later claim on it answered 503 until a
/// restart). Each key charges at most once throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_fails_charges_and_the_store_recovers_when_space_returns() {
    let disk = support::tmpfs::Tmpfs::mount(4 << 20);
    let url = format!("sqlite://{}/payments.db", disk.path().display());
    let payments = Payments::start(free_port(), &[("DATABASE_URL", url.as_str())]);
    let client = HttpClient::default();
    // Charges of 150 KB until the disk is full and one fails.
    let filler = disk.fill("filler");
    std::fs::write(disk.path().join("headroom"), vec![0u8; 0]).unwrap();
    let mut failed = 0;
    for i in 0..40 {
        let reply = client
            .send(large_charge(&payments.addr, &format!("fill-{i}"), 150_000))
            .await;
        assert_ne!(reply.status, StatusCode::CREATED, "the disk is full: {i}");
        failed += 1;
        if failed >= 8 {
            break;
        }
    }
    assert!(failed >= 8);
    // Space back: every connection of the pool must serve again.
    std::fs::remove_file(&filler).unwrap();
    for i in 0..16 {
        let reply = client
            .send(large_charge(&payments.addr, &format!("after-{i}"), 1_000))
            .await;
        assert_eq!(
            reply.status,
            StatusCode::CREATED,
            "charge {i} after the space came back: {:?}",
            reply.body
        );
    }
    let file = disk.path().join("payments.db");
    let count = |sql: &'static str| {
        let url = format!("sqlite://{}", file.display());
        async move {
            let mut connection = SqliteConnection::connect(&url).await.unwrap();
            sqlx::query_scalar::<_, i64>(sql)
                .fetch_one(&mut connection)
                .await
                .unwrap()
        }
    };
    assert_eq!(
        count("SELECT count(*) FROM charges WHERE account = 'acct_disk'").await,
        16
    );
    assert_eq!(count("SELECT count(DISTINCT id) FROM charges").await, 16);
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

/// A second instance on the file of one whose charge holds the write lock
/// (a slow charge here; a paused process alike) is not misconfigured: it
/// waits for the lock, saying so, starts, and replays the charge. It never
/// advises turning the start-up check off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_instance_waits_for_a_busy_database_instead_of_refusing_to_start() {
    let file = TestFile::create();
    let url = file.url();
    let first = Payments::start(
        free_port(),
        &[
            ("DATABASE_URL", url.as_str()),
            ("PROCESSOR_LATENCY_MS", "7000"),
        ],
    );
    let client = HttpClient::default();
    let charge = tokio::spawn({
        let (client, addr) = (client.clone(), first.addr.clone());
        async move { client.send(charge_request(&addr)).await }
    });
    // The charge holds the write lock for 7 s.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let started = Instant::now();
    let second = Payments::start(
        free_port(),
        &[
            ("DATABASE_URL", url.as_str()),
            ("RUST_LOG", "tower_idempotency=warn"),
        ],
    );
    let output = second.output();
    assert!(
        started.elapsed() >= Duration::from_secs(5),
        "it waited for the lock"
    );
    assert!(output.contains("waiting for the database"), "{output}");
    assert!(!output.contains("EngineCheck::Warn"), "{output}");
    assert_eq!(charge.await.unwrap().status, StatusCode::CREATED);
    let replay = client.send(charge_request(&second.addr)).await;
    assert!(replay.is_replay(), "{}", replay.status);
    assert_eq!(file.count(CHARGES).await, 1);
}

/// On a read-only file system the example refuses to start with an error
/// that says the database is read-only — not that it failed the start-up
/// check, and never advice to disable it.
#[test]
fn a_read_only_database_says_so_at_start_up() {
    let disk = support::tmpfs::Tmpfs::mount(4 << 20);
    let url = format!("sqlite://{}/payments.db", disk.path().display());
    // Created, with its tables, while writable.
    drop(Payments::start(
        free_port(),
        &[("DATABASE_URL", url.as_str())],
    ));
    disk.set_read_only(true);
    let (status, output) =
        support::payments::run_to_exit(&[("DATABASE_URL", url.as_str()), ("RUST_LOG", "off")]);
    assert!(!status.success(), "{output}");
    assert!(output.contains("read-only"), "{output}");
    assert!(!output.contains("EngineCheck::Warn"), "{output}");
    assert!(!output.contains("failed the start-up check"), "{output}");
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

/// The example's database file deleted while it runs: new connections
/// would open an empty file, existing ones write into one that no longer
/// exists. Every charge is refused (`503`) and the log says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_file_deleted_while_running_is_refused_and_said_in_the_log() {
    let file = TestFile::create();
    let url = file.url();
    let payments = Payments::start(
        free_port(),
        &[
            ("DATABASE_URL", url.as_str()),
            ("RUST_LOG", "tower_idempotency=error"),
        ],
    );
    let client = HttpClient::default();
    assert_eq!(
        client.send(charge_request(&payments.addr)).await.status,
        StatusCode::CREATED
    );
    std::fs::remove_file(file.path()).unwrap();
    let mut next = charge_request(&payments.addr);
    next.headers_mut()
        .insert("idempotency-key", "after-delete".parse().unwrap());
    let refused = client.send(next).await;
    refused.assert_problem(503);
    let deadline = Instant::now() + Duration::from_secs(5);
    while !payments.output().contains("was deleted or replaced") {
        assert!(Instant::now() < deadline, "{}", payments.output());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// An operator looks up, then forgets without force, a key whose charge is
/// in flight in another process on the same file: its claim is an
/// uncommitted row no reader sees. The look-up answers what is known — a
/// writer of the file holds it, so it may be in flight — not "the next
/// request executes"; the forget must not wait for that commit and then
/// delete the fresh record (the retry charged again): it is refused as in
/// flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_in_flight_in_another_process_is_reported_and_not_forgotten() {
    let file = TestFile::create();
    let url = file.url();
    let env = [
        ("DATABASE_URL", url.as_str()),
        ("PROCESSOR_LATENCY_MS", "1500"),
        ("ADMIN_TOKEN", "s3cret"),
    ];
    let a = Payments::start(free_port(), &env);
    let b = Payments::start(free_port(), &env);
    let client = HttpClient::default();
    let charge = tokio::spawn({
        let (client, addr) = (client.clone(), a.addr.clone());
        async move { client.send(charge_request(&addr)).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let inspect = http::Request::get(format!(
        "http://{}/admin/idempotency/acct_crash/crash-1",
        b.addr
    ))
    .header("authorization", "Bearer s3cret")
    .body(axum::body::Body::empty())
    .unwrap();
    let looked_up = client.send(inspect).await;
    assert_eq!(looked_up.status, StatusCode::OK, "{:?}", looked_up.body);
    let state: serde_json::Value = serde_json::from_slice(&looked_up.body).unwrap();
    assert_eq!(state["state"], "in_flight", "{state}");
    let forget = http::Request::delete(format!(
        "http://{}/admin/idempotency/acct_crash/crash-1",
        b.addr
    ))
    .header("authorization", "Bearer s3cret")
    .body(axum::body::Body::empty())
    .unwrap();
    let refused = client.send(forget).await;
    refused.assert_problem(409);
    assert_eq!(charge.await.unwrap().status, StatusCode::CREATED);
    let replay = client.send(charge_request(&b.addr)).await;
    assert!(replay.is_replay(), "the record was kept: {}", replay.status);
    assert_eq!(file.count(CHARGES).await, 1, "charged once");
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
