//! The transactional Postgres store on a real PostgreSQL: the handler's
//! writes and the record commit together or not at all, counted in rows of
//! the handler's own table. Plain mode runs the behaviour suite
//! (`behaviour.rs`); outages (the network to the database cut or stalled by
//! a relay, an exhausted pool, a blocked claim) are tried in both modes here.

mod support;

use std::{
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use axum::{
    Router,
    extract::{Query, State},
    http::StatusCode,
    routing::post,
};
use tokio::sync::Notify;
use tower_idempotency::{
    IdempotencyLayer, IdempotencyOutcome, PostgresStore, PostgresTx, PostgresTxStore,
    RejectionKind,
    sqlx::{self, PgPool},
    store::{CachedStore, postgres::PostgresStoreBuilder},
};

use support::{
    http::{HttpClient, Server, oneshot, post as request},
    logs::Logs,
    payments::{Payments, charge_request},
    postgres::TestDatabase,
    redis_server::{RedisServer, free_port},
    relay::Relay,
};

const CHARGE: &str = r#"{"amount":1999,"currency":"eur"}"#;

/// The request's transaction, as handlers take it.
type Tx = tower_idempotency::IdempotentTx<PostgresTx>;

async fn transactional(db: &TestDatabase) -> PostgresTxStore {
    let store = PostgresStore::builder()
        .transactional()
        .connect(db.url())
        .await
        .expect("connect to the test database");
    store.migrate().await.unwrap();
    sqlx::raw_sql("CREATE TABLE charges (id serial PRIMARY KEY, note text)")
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

async fn insert(tx: &mut Tx) {
    sqlx::query("INSERT INTO charges (note) VALUES ('charged')")
        .execute(&mut **tx)
        .await
        .expect("insert the charge");
}

/// Inserts a charge in the request's transaction, waits `ms`, answers
/// `status` with the number of charges it sees.
async fn charge(mut tx: Tx, Query(p): Query<Params>) -> (StatusCode, String) {
    insert(&mut tx).await;
    tokio::time::sleep(Duration::from_millis(p.ms)).await;
    let charges: i64 = sqlx::query_scalar("SELECT count(*) FROM charges")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    (
        StatusCode::from_u16(p.status).unwrap(),
        format!("charge {charges}"),
    )
}

async fn panics(mut tx: Tx) -> StatusCode {
    insert(&mut tx).await;
    panic!("the card processor exploded");
}

/// Keeps the transaction past the handler: a mistake the layer must catch.
async fn leaks(mut tx: Tx) -> StatusCode {
    insert(&mut tx).await;
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        drop(tx);
    });
    StatusCode::CREATED
}

/// Loses its database connection after inserting (the server terminates
/// it), as when the database restarts mid-request.
async fn loses_its_connection(State(pool): State<PgPool>, mut tx: Tx) -> StatusCode {
    insert(&mut tx).await;
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    sqlx::query("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .execute(&pool)
        .await
        .unwrap();
    StatusCode::CREATED
}

fn app(store: PostgresTxStore) -> Router {
    let pool = store.pool().clone();
    Router::new()
        .route("/charges", post(charge))
        .route("/panics", post(panics))
        .route("/leaks", post(leaks))
        .route("/loses-its-connection", post(loses_its_connection))
        .layer(IdempotencyLayer::new(store))
        .with_state(pool)
}

const CHARGES: &str = "SELECT count(*) FROM charges";

async fn charges(db: &TestDatabase) -> i64 {
    db.count(CHARGES).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_charge_and_the_record_commit_together_and_replay() {
    let db = TestDatabase::create();
    let app = app(transactional(&db).await);

    let first = oneshot(&app, request("/charges", "k", CHARGE)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.body, "charge 1");
    for _ in 0..3 {
        let replay = oneshot(&app, request("/charges", "k", CHARGE)).await;
        assert!(replay.is_replay(), "{} {:?}", replay.status, replay.body);
        assert_eq!(replay.body, first.body);
    }
    oneshot(&app, request("/charges", "k", "{}"))
        .await
        .assert_problem(422);
    assert_eq!(charges(&db).await, 1);
    assert_eq!(
        db.count(
            "SELECT count(*) FROM idempotency_records WHERE record IS NOT NULL AND token IS NULL"
        )
        .await,
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_final_responses_panics_and_errors_roll_the_charge_back() {
    let db = TestDatabase::create();
    let app = app(transactional(&db).await);

    let busy = oneshot(&app, request("/charges?status=503", "k", CHARGE)).await;
    assert_eq!(busy.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(charges(&db).await, 0, "a non-final response rolls back");

    oneshot(&app, request("/panics", "p", CHARGE))
        .await
        .assert_problem(500);
    assert_eq!(charges(&db).await, 0, "a panic rolls back");

    // Released: the retry executes, and commits.
    let retry = oneshot(&app, request("/charges", "k", CHARGE)).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(!retry.is_replay());
    assert_eq!(charges(&db).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_kept_past_the_handler_is_a_500_and_commits_nothing() {
    let db = TestDatabase::create();
    let app = app(transactional(&db).await);

    let leaked = oneshot(&app, request("/leaks", "k", CHARGE)).await;
    leaked.assert_problem(500);
    assert_eq!(
        leaked.outcome,
        Some(IdempotencyOutcome::Rejected(RejectionKind::TransactionHeld))
    );
    // The holder drops it at 300 ms: it rolls back, and the key is free.
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(charges(&db).await, 0, "never silently committed");
    assert_eq!(
        oneshot(&app, request("/charges", "k", CHARGE)).await.status,
        StatusCode::CREATED
    );
    assert_eq!(charges(&db).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_lost_mid_request_is_a_503_and_writes_nothing() {
    let db = TestDatabase::create();
    let app = app(transactional(&db).await);

    let lost = oneshot(&app, request("/loses-its-connection", "k", CHARGE)).await;
    lost.assert_problem(503);
    assert!(lost.header("retry-after").is_some());
    assert_eq!(charges(&db).await, 0, "nothing half-written");
    assert_eq!(
        db.count("SELECT count(*) FROM idempotency_records").await,
        0
    );
    // The retry executes for the first time.
    let retry = oneshot(&app, request("/charges", "k", CHARGE)).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(charges(&db).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixty_four_concurrent_duplicates_one_charge_and_no_one_waits_for_it() {
    let db = TestDatabase::create();
    let server = Server::start(app(transactional(&db).await)).await;
    let finished = Arc::new(Mutex::new(Vec::new()));
    let requests = (0..64).map(|_| {
        let finished = finished.clone();
        let server = &server;
        async move {
            let reply = server.post("/charges?ms=1500", "k", CHARGE).await;
            finished
                .lock()
                .unwrap()
                .push((reply.status, Instant::now()));
            reply
        }
    });
    let replies = futures_util::future::join_all(requests).await;
    let created: Vec<_> = replies
        .iter()
        .filter(|r| r.status == StatusCode::CREATED)
        .collect();
    assert_eq!(created.len(), 1, "one execution");
    for reply in replies.iter().filter(|r| r.status != StatusCode::CREATED) {
        reply.assert_problem(409);
        assert!(reply.header("retry-after").is_some());
    }
    // Every duplicate was answered while the first still ran: none waited
    // on its lock.
    let finished = std::mem::take(&mut *finished.lock().unwrap());
    let done = finished
        .iter()
        .find(|(s, _)| *s == StatusCode::CREATED)
        .unwrap()
        .1;
    assert!(
        finished
            .iter()
            .all(|(s, at)| *s == StatusCode::CREATED || *at < done)
    );
    assert_eq!(charges(&db).await, 1);
}

/// The client hangs up while the handler holds its uncommitted charge: the
/// handler runs on, detached, and the layer commits the charge with the
/// record; the retry replays it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_hang_up_mid_handler_still_commits_the_charge_with_its_record() {
    use tokio::io::AsyncWriteExt;
    let db = TestDatabase::create();
    let server = Server::start(app(transactional(&db).await)).await;
    let mut socket = tokio::net::TcpStream::connect(server.addr).await.unwrap();
    let raw = format!(
        "POST /charges?ms=500 HTTP/1.1\r\nhost: x\r\nidempotency-key: k\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{CHARGE}",
        CHARGE.len()
    );
    socket.write_all(raw.as_bytes()).await.unwrap();
    // The insert is the handler's: the claim has answered, the handler runs.
    db.wait_for_count(UNCOMMITTED_CHARGES, |n| n >= 1, "the handler never started")
        .await;
    drop(socket);

    let committed = "the detached handler's charge never committed";
    db.wait_for_count(CHARGES, |n| n > 0, committed).await;
    let retry = server.post("/charges?ms=500", "k", CHARGE).await;
    assert!(retry.is_replay(), "{} {:?}", retry.status, retry.body);
    assert_eq!(retry.body, "charge 1");
    assert_eq!(charges(&db).await, 1);
}

/// The claim carries the key inside SQL text (it travels with `BEGIN` in the
/// simple protocol): keys with quotes and backslashes must stay data.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_with_quotes_and_backslashes_are_data_not_sql() {
    let db = TestDatabase::create();
    let app = app(transactional(&db).await);
    for key in [
        r"it's",
        r"back\slash",
        r"');DROP/**/TABLE/**/charges;--",
        r"\'\\'",
    ] {
        let first = oneshot(&app, request("/charges", key, CHARGE)).await;
        assert_eq!(first.status, StatusCode::CREATED, "{key}: {:?}", first.body);
        assert!(
            oneshot(&app, request("/charges", key, CHARGE))
                .await
                .is_replay(),
            "{key}"
        );
    }
    assert_eq!(charges(&db).await, 4);
    assert_eq!(
        db.count("SELECT count(*) FROM idempotency_records").await,
        4
    );
}

/// Replays take no lock: concurrent retries of a completed key all replay
/// (a claim that tried the key's lock first answered some of them 409).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_replays_of_a_completed_key_all_replay() {
    let db = TestDatabase::create();
    let server = Server::start(app(transactional(&db).await)).await;
    assert_eq!(
        server.post("/charges", "k", CHARGE).await.status,
        StatusCode::CREATED
    );
    for _ in 0..5 {
        let replies =
            futures_util::future::join_all((0..32).map(|_| server.post("/charges", "k", CHARGE)))
                .await;
        for reply in &replies {
            assert!(reply.is_replay(), "{} {:?}", reply.status, reply.body);
        }
    }
    assert_eq!(charges(&db).await, 1);
}

/// Inserts a charge, then deletes its own claim's row in the same
/// transaction (as a handler that cleans the records table by mistake
/// would): the completion finds no row to write the record into, and must
/// not commit the charge without it.
async fn deletes_its_claim(mut tx: Tx) -> StatusCode {
    insert(&mut tx).await;
    sqlx::query("DELETE FROM idempotency_records")
        .execute(&mut *tx)
        .await
        .unwrap();
    StatusCode::CREATED
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_row_gone_before_the_commit_rolls_the_charge_back() {
    let db = TestDatabase::create();
    let app = Router::new()
        .route("/deletes", post(deletes_its_claim))
        .layer(IdempotencyLayer::new(transactional(&db).await));
    let reply = oneshot(&app, request("/deletes", "k", CHARGE)).await;
    reply.assert_problem(500);
    assert_eq!(
        reply.outcome,
        Some(IdempotencyOutcome::Rejected(
            RejectionKind::TransactionRefused
        ))
    );
    assert_eq!(charges(&db).await, 0, "the charge must roll back");
    assert_eq!(
        db.count("SELECT count(*) FROM idempotency_records").await,
        0
    );
}

async fn isolation(mut tx: Tx) -> String {
    sqlx::query_scalar("SHOW transaction_isolation")
        .fetch_one(&mut *tx)
        .await
        .unwrap()
}

/// The claim's second look (after taking the key's lock) must see records
/// committed since its first; under a database default of REPEATABLE READ
/// both would share one snapshot and a concurrent duplicate could execute.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_request_transaction_is_read_committed_whatever_the_database_default() {
    let db = TestDatabase::create();
    let store = transactional(&db).await;
    sqlx::raw_sql(
        "DO $$ BEGIN EXECUTE format('ALTER DATABASE %I SET default_transaction_isolation = %L', \
         current_database(), 'repeatable read'); END $$",
    )
    .execute(store.pool())
    .await
    .unwrap();
    // A new pool, so its sessions start with the new default.
    let store = PostgresStore::builder()
        .transactional()
        .connect(db.url())
        .await
        .unwrap();
    let default: String = sqlx::query_scalar("SHOW default_transaction_isolation")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(default, "repeatable read");
    let app = Router::new()
        .route("/isolation", post(isolation))
        .layer(IdempotencyLayer::new(store));
    let reply = oneshot(&app, request("/isolation", "k", CHARGE)).await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.body, "read committed");
}

/// A cache in front of the transactional store hands the transaction to the
/// handler, commits the charge with the record, and then replays from the
/// process without asking the database.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_a_cache_the_charge_commits_and_replays_come_from_the_cache() {
    let db = TestDatabase::create();
    let store = transactional(&db).await;
    let pool = store.pool().clone();
    let app = Router::new()
        .route("/charges", post(charge))
        .layer(IdempotencyLayer::new(CachedStore::new(store, 1 << 20)))
        .with_state(pool.clone());
    let first = oneshot(&app, request("/charges", "k", CHARGE)).await;
    assert_eq!(first.status, StatusCode::CREATED, "{:?}", first.body);
    assert_eq!(charges(&db).await, 1);
    // With the record gone from the database, only the cache can replay.
    sqlx::raw_sql("DELETE FROM idempotency_records")
        .execute(&pool)
        .await
        .unwrap();
    let again = oneshot(&app, request("/charges", "k", CHARGE)).await;
    assert!(again.is_replay(), "{} {:?}", again.status, again.body);
    assert_eq!(again.body, first.body);
    assert_eq!(charges(&db).await, 1);
}

/// Sessions of the test database that sit idle inside a transaction.
const IDLE_IN_TRANSACTION: &str = "SELECT count(*) FROM pg_stat_activity \
     WHERE datname = current_database() AND state = 'idle in transaction'";

/// Transactions that inserted a charge and have not committed it.
const UNCOMMITTED_CHARGES: &str = "SELECT count(*) FROM pg_stat_activity \
     WHERE datname = current_database() AND state = 'idle in transaction' \
     AND query LIKE 'INSERT INTO charges%'";

/// A replay's transaction (nothing to do in it) is rolled back with the
/// next claim or, when none comes, shortly after: no session is left idle in
/// a transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replays_leave_no_transaction_open() {
    let db = TestDatabase::create();
    let server = Server::start(app(transactional(&db).await)).await;
    assert_eq!(
        server.post("/charges", "k", CHARGE).await.status,
        StatusCode::CREATED
    );
    let replies =
        futures_util::future::join_all((0..16).map(|_| server.post("/charges", "k", CHARGE))).await;
    assert!(replies.iter().all(|r| r.is_replay()));
    let left_open = "replays left transactions open for 5 s";
    db.wait_for_count(IDLE_IN_TRANSACTION, |n| n == 0, left_open)
        .await;
    assert_eq!(charges(&db).await, 1);
}

/// A replay's transaction waiting for the next claim can be ended by the
/// server meanwhile (a restart, `idle_in_transaction_session_timeout`): the
/// next claim then runs on a fresh connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_transaction_the_server_closed_does_not_fail_the_next_claim() {
    let db = TestDatabase::create();
    let store = transactional(&db).await;
    // Transactions wait only while the pool has connections to spare: open a
    // few, so the replay's one waits rather than being rolled back at once.
    let held = futures_util::future::join_all((0..3).map(|_| store.pool().acquire())).await;
    drop(held);
    let server = Server::start(app(store)).await;
    assert_eq!(
        server.post("/charges", "k", CHARGE).await.status,
        StatusCode::CREATED
    );
    // The replay's transaction waits up to 200 ms: terminate it within that
    // window (a few tries, for a loaded machine).
    let mut terminated = 0;
    for _ in 0..5 {
        assert!(server.post("/charges", "k", CHARGE).await.is_replay());
        terminated = db
            .count(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
                 WHERE datname = current_database() AND state = 'idle in transaction'",
            )
            .await;
        if terminated >= 1 {
            break;
        }
    }
    assert!(terminated >= 1, "the replay's transaction was not waiting");
    let next = server.post("/charges", "k2", CHARGE).await;
    assert_eq!(next.status, StatusCode::CREATED, "{:?}", next.body);
    assert!(server.post("/charges", "k", CHARGE).await.is_replay());
    assert_eq!(charges(&db).await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_records_are_absent_at_once_and_deleted_in_batches() {
    let db = TestDatabase::create();
    let store = transactional(&db).await;
    let app = Router::new()
        .route("/charges", post(charge))
        .layer(IdempotencyLayer::new(store.clone()).retention(Duration::from_secs(1)))
        .with_state(store.pool().clone());
    for i in 0..5 {
        oneshot(&app, request("/charges", &format!("k{i}"), CHARGE)).await;
    }
    tokio::time::sleep(Duration::from_millis(1200)).await;
    // Expired but not deleted yet: a retry executes again, as retention says.
    let again = oneshot(&app, request("/charges", "k0", CHARGE)).await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert!(!again.is_replay());
    assert_eq!(charges(&db).await, 6);

    assert_eq!(store.delete_expired(3).await.unwrap(), 3);
    assert_eq!(store.delete_expired(3).await.unwrap(), 1);
    assert_eq!(store.delete_expired(3).await.unwrap(), 0);
    assert_eq!(
        db.count("SELECT count(*) FROM idempotency_records").await,
        1,
        "the live record stays"
    );
}

// The point of the transactional store, shown on the example process: kill
// -9 while the handler holds an uncommitted charge.

/// Starts a charge, kills the example with SIGKILL once `charged` (a count
/// in `db`) reaches 1 — the charge row written, its handler waiting for the
/// processor — and restarts it.
async fn kill_mid_charge(
    client: &HttpClient,
    env: &[(&str, &str)],
    db: &TestDatabase,
    charged: &str,
) -> Payments {
    let port = free_port();
    let mut payments = Payments::start(port, env);
    let doomed = tokio::spawn({
        let client = client.clone();
        let addr = payments.addr.clone();
        async move {
            let _ =
                tokio::time::timeout(Duration::from_secs(5), client.send(charge_request(&addr)))
                    .await;
        }
    });
    db.wait_for_count(charged, |n| n == 1, "the charge was never written")
        .await;
    payments.child.kill().unwrap();
    payments.child.wait().unwrap();
    doomed.abort();
    Payments::start(port, env)
}

/// Retries until the charge executes or replays (409 while a claim is held).
async fn retry_until_done(client: &HttpClient, addr: &str) -> (support::http::Reply, usize) {
    for conflicts in 0..80 {
        let reply = client.send(charge_request(addr)).await;
        if reply.status != StatusCode::CONFLICT {
            return (reply, conflicts);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("still 409 after 8 s");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_mid_charge_on_postgres_leaves_nothing_and_the_retry_charges_once() {
    let db = TestDatabase::create();
    let client = HttpClient::default();
    let env = [("DATABASE_URL", db.url()), ("PROCESSOR_LATENCY_MS", "2000")];
    let payments = kill_mid_charge(&client, &env, &db, UNCOMMITTED_CHARGES).await;
    assert_eq!(
        db.count(CHARGES).await,
        0,
        "the uncommitted charge died with the process"
    );

    let (executed, conflicts) = retry_until_done(&client, &payments.addr).await;
    assert_eq!(executed.status, StatusCode::CREATED);
    assert!(!executed.is_replay());
    eprintln!("postgres: the retry executed after {conflicts} × 409 (no lease to wait out)");
    assert!(
        client
            .send(charge_request(&payments.addr))
            .await
            .is_replay()
    );
    assert_eq!(db.count(CHARGES).await, 1, "exactly one charge");
}

/// The documented contrast: with records in Redis and charges committed on
/// their own, the same crash charges twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_mid_charge_on_redis_charges_twice_the_documented_crash_window() {
    let db = TestDatabase::create();
    let redis = RedisServer::start();
    let client = HttpClient::default();
    let url = redis.url();
    let env = [
        ("DATABASE_URL", db.url()),
        ("REDIS_URL", url.as_str()),
        ("PROCESSOR_LATENCY_MS", "2000"),
        ("IDEMPOTENCY_LEASE_MS", "1500"),
    ];
    let payments = kill_mid_charge(&client, &env, &db, CHARGES).await;
    assert_eq!(
        db.count(CHARGES).await,
        1,
        "the charge committed on its own before the crash"
    );

    let (executed, conflicts) = retry_until_done(&client, &payments.addr).await;
    assert!(conflicts > 0, "409 until the dead process's lease expired");
    assert_eq!(executed.status, StatusCode::CREATED);
    assert_eq!(
        db.count(CHARGES).await,
        2,
        "charged twice: the record and the charge were not one transaction"
    );
}

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
        .layer(IdempotencyLayer::new(store))
        .with_state(pool)
}

/// Retries `key` while it is answered `409` (for at most `within`).
async fn retry_while_in_flight(app: &Router, key: &str, within: Duration) -> support::http::Reply {
    let deadline = Instant::now() + within;
    loop {
        let reply = oneshot(app, request("/charges", key, CHARGE)).await;
        if reply.status != StatusCode::CONFLICT || Instant::now() > deadline {
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
            .layer(IdempotencyLayer::new(store))
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
        let back = retry_while_in_flight(&app, "k2", Duration::from_secs(5)).await;
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
    let retry = oneshot(&app, request("/charges", "k", CHARGE)).await;
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
        let retry = retry_while_in_flight(&app, "k", Duration::from_secs(5)).await;
        assert_eq!(
            retry.status,
            StatusCode::CREATED,
            "{mode:?}: {:?}",
            retry.body
        );
        assert_eq!(charges(&db).await, 2, "{mode:?}");
    }
}

// Safety, round 2: retention counted from the commit, a handler's failed
// statement, a paused instance.

/// A handler slower than the retention: its record must still be live once
/// committed (retention counts from the commit, not from `BEGIN`), and a
/// cache in front of another instance never outlives the stored record —
/// both instances replay the one charge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_counts_from_the_commit_and_every_instance_replays_one_charge() {
    let db = TestDatabase::create();
    let instance = async || {
        let store = PostgresStore::builder()
            .transactional()
            .connect(db.url())
            .await
            .unwrap();
        let pool = store.pool().clone();
        Router::new()
            .route("/charges", post(charge))
            .layer(
                IdempotencyLayer::new(CachedStore::new(store, 1 << 20))
                    .retention(Duration::from_secs(1)),
            )
            .with_state(pool)
    };
    drop(transactional(&db).await);
    let (a, b) = (instance().await, instance().await);

    let first = oneshot(&a, request("/charges?ms=1500", "k", CHARGE)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let on_b = oneshot(&b, request("/charges?ms=1500", "k", CHARGE)).await;
    assert!(on_b.is_replay(), "{} {:?}", on_b.status, on_b.body);
    assert_eq!(on_b.body, first.body);
    let on_a = oneshot(&a, request("/charges?ms=1500", "k", CHARGE)).await;
    assert!(on_a.is_replay());
    assert_eq!(charges(&db).await, 1, "one charge for the key");
}

/// Inserts a charge whose note must be unique: a duplicate note is the
/// handler's own `409`, answered after the failed statement.
async fn charge_note(mut tx: Tx, Query(p): Query<NoteParams>) -> (StatusCode, String) {
    let savepoint = p.savepoint;
    if savepoint {
        sqlx::query("SAVEPOINT note")
            .execute(&mut *tx)
            .await
            .unwrap();
    }
    let inserted = sqlx::query("INSERT INTO charges (note) VALUES ($1)")
        .bind(&p.note)
        .execute(&mut *tx)
        .await;
    match inserted {
        Ok(_) => (StatusCode::CREATED, format!("charged {}", p.note)),
        Err(_) if p.swallow => (StatusCode::CREATED, "charged, or so it says".into()),
        Err(_) => {
            if savepoint {
                sqlx::query("ROLLBACK TO SAVEPOINT note")
                    .execute(&mut *tx)
                    .await
                    .unwrap();
            }
            (
                StatusCode::CONFLICT,
                format!("{} was already charged", p.note),
            )
        }
    }
}

#[derive(serde::Deserialize)]
struct NoteParams {
    note: String,
    #[serde(default)]
    swallow: bool,
    #[serde(default)]
    savepoint: bool,
}

/// A handler whose statement failed (PostgreSQL then aborts the whole
/// transaction) gets its own answer to the client — not `503 store
/// unavailable` — with nothing committed and the key released; a handler
/// that claims success over a failed statement gets a distinct `500`; with
/// a SAVEPOINT the transaction survives and the answer is stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_whose_statement_failed_gets_its_own_answer_not_a_store_outage() {
    let db = TestDatabase::create();
    let store = transactional(&db).await;
    sqlx::raw_sql(
        "CREATE UNIQUE INDEX ON charges (note); INSERT INTO charges (note) VALUES ('dup')",
    )
    .execute(store.pool())
    .await
    .unwrap();
    let app = Router::new()
        .route("/notes", post(charge_note))
        .layer(IdempotencyLayer::new(store));
    let records = "SELECT count(*) FROM idempotency_records";

    for attempt in 0..2 {
        let refused = oneshot(&app, request("/notes?note=dup", "k", CHARGE)).await;
        assert_eq!(refused.status, StatusCode::CONFLICT, "{:?}", refused.body);
        assert_eq!(refused.body, "dup was already charged");
        assert!(
            !refused.is_replay(),
            "attempt {attempt}: executed, not stored"
        );
    }
    assert_eq!(db.count(records).await, 0, "nothing stored");

    let swallowed = oneshot(&app, request("/notes?note=dup&swallow=true", "s", CHARGE)).await;
    swallowed.assert_problem(500);
    assert_eq!(
        swallowed.outcome,
        Some(IdempotencyOutcome::Rejected(
            RejectionKind::TransactionRefused
        ))
    );
    assert_eq!(
        swallowed.json()["type"],
        "urn:tower-idempotency:problem:transaction-refused"
    );

    let saved = oneshot(&app, request("/notes?note=dup&savepoint=true", "p", CHARGE)).await;
    assert_eq!(saved.status, StatusCode::CONFLICT);
    let again = oneshot(&app, request("/notes?note=dup&savepoint=true", "p", CHARGE)).await;
    assert!(
        again.is_replay(),
        "the SAVEPOINT kept the transaction: stored"
    );
    assert_eq!(db.count(records).await, 1);
    assert_eq!(charges(&db).await, 1, "only the row inserted up front");
}

/// A process paused (SIGSTOP) while its handler holds an uncommitted charge
/// holds the key no longer than the transaction timeout: the database ends
/// the idle transaction, another instance's retry charges, and the paused
/// one, resumed, cannot commit — its response is withheld. One charge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_instance_holds_its_key_no_longer_than_the_transaction_timeout() {
    let db = TestDatabase::create();
    let client = HttpClient::default();
    let timeout = ("IDEMPOTENCY_TX_TIMEOUT_MS", "1000");
    let paused = Payments::start(
        free_port(),
        &[
            ("DATABASE_URL", db.url()),
            ("PROCESSOR_LATENCY_MS", "3000"),
            timeout,
        ],
    );
    let other = Payments::start(free_port(), &[("DATABASE_URL", db.url()), timeout]);
    let doomed = tokio::spawn({
        let client = client.clone();
        let addr = paused.addr.clone();
        async move { client.send(charge_request(&addr)).await }
    });
    db.wait_for_count(
        UNCOMMITTED_CHARGES,
        |n| n == 1,
        "the charge was never written",
    )
    .await;
    signal(&paused, "STOP");

    let (executed, conflicts) = retry_until_done(&client, &other.addr).await;
    assert_eq!(executed.status, StatusCode::CREATED, "{:?}", executed.body);
    assert!(!executed.is_replay());
    eprintln!("the paused instance's key was free after {conflicts} × 409");

    signal(&paused, "CONT");
    let withheld = tokio::time::timeout(Duration::from_secs(10), doomed)
        .await
        .expect("the resumed instance answered")
        .unwrap();
    withheld.assert_problem(503);
    assert_eq!(db.count(CHARGES).await, 1, "exactly one charge");
    assert!(client.send(charge_request(&paused.addr)).await.is_replay());
}

fn signal(process: &Payments, signal: &str) {
    let status = std::process::Command::new("kill")
        .args([format!("-{signal}"), process.child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill -{signal}");
}

/// Advisory locks are one space for the whole database: two stores on
/// different tables must not block each other's keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stores_on_two_tables_do_not_share_key_locks() {
    let db = TestDatabase::create();
    drop(transactional(&db).await);
    let mut apps = Vec::new();
    for table in ["records_a", "records_b"] {
        let store = PostgresStore::builder()
            .table(table)
            .transactional()
            .connect(db.url())
            .await
            .unwrap();
        store.migrate().await.unwrap();
        apps.push(app(store));
    }
    let slow = {
        let a = apps[0].clone();
        tokio::spawn(async move { oneshot(&a, request("/charges?ms=1000", "k", CHARGE)).await })
    };
    db.wait_for_count(
        UNCOMMITTED_CHARGES,
        |n| n == 1,
        "the slow charge never started",
    )
    .await;
    let other_table = oneshot(&apps[1], request("/charges", "k", CHARGE)).await;
    assert_eq!(
        other_table.status,
        StatusCode::CREATED,
        "{:?}",
        other_table.body
    );
    assert_eq!(slow.await.unwrap().status, StatusCode::CREATED);
}
