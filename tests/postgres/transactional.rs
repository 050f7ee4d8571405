//! The transactional store's semantics: record and charge commit
//! together or not at all; duplicates, replays, retention, a handler's
//! failed statement, the start-up check.

use std::time::Duration;

use axum::{Router, extract::Query, http::StatusCode, routing::post};
use tower_idempotency::store::{StoreError, postgres::EngineCheck};
use tower_idempotency::{
    IdempotencyLayer, IdempotencyOutcome, PostgresStore, RejectionKind,
    sqlx::{self},
    store::CachedStore,
};

use super::*;
use crate::support::{
    http::{Server, oneshot, post as request},
    postgres::TestDatabase,
};

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
        .layer(IdempotencyLayer::new(transactional(&db).await).single_tenant());
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
        .layer(IdempotencyLayer::new(store).single_tenant());
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
        .layer(IdempotencyLayer::new(CachedStore::new(store, 1 << 20)).single_tenant())
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
                    .single_tenant()
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
        .layer(IdempotencyLayer::new(store).single_tenant());
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
            .create_table_if_missing()
            .connect(db.url())
            .await
            .unwrap();
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

/// A table made by hand without its primary key would let a second claim
/// of a key succeed while the first is uncommitted: the store refuses to
/// start on it, naming the engine (`version()`) and the opt-out; opting out
/// starts it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_without_its_primary_key_is_refused_at_start_up() {
    let db = TestDatabase::create();
    sqlx::raw_sql(
        "CREATE TABLE idempotency_records (key text NOT NULL, fingerprint bytea NOT NULL, \
         token bytea, record bytea, expires_at timestamptz NOT NULL)",
    )
    .execute(&mut db.connect().await)
    .await
    .unwrap();
    for refused in [
        PostgresStore::builder().connect(db.url()).await.err(),
        PostgresStore::builder()
            .transactional()
            .connect(db.url())
            .await
            .err(),
    ] {
        match refused {
            Some(StoreError::Misconfigured(message)) => {
                assert!(message.contains("PostgreSQL 1"), "{message}");
                assert!(message.contains("EngineCheck::Warn"), "{message}");
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
    }
    let opted_out = PostgresStore::builder()
        .transactional()
        .engine_check(EngineCheck::Warn)
        .connect(db.url())
        .await;
    assert!(opted_out.is_ok(), "{opted_out:?}");
}

/// A key column that does not compare bytes — a nondeterministic
/// (case-insensitive) ICU collation, or `citext` — replayed "Order-1"'s
/// charge for "order-1": the start-up check refuses both, saying why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_column_that_does_not_compare_bytes_is_refused_at_start_up() {
    for key_type in ["text COLLATE case_insensitive", "citext"] {
        let db = TestDatabase::create();
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "CREATE COLLATION case_insensitive (provider = icu, locale = 'und-u-ks-level2', deterministic = false); \
             CREATE EXTENSION citext; \
             CREATE TABLE idempotency_records (key {key_type} PRIMARY KEY, fingerprint bytea NOT NULL, \
             token bytea, record bytea, expires_at timestamptz NOT NULL)"
        )))
        .execute(&mut db.connect().await)
        .await
        .unwrap();
        match PostgresStore::builder()
            .transactional()
            .connect(db.url())
            .await
        {
            Err(StoreError::Misconfigured(message)) => {
                assert!(
                    message.contains("does not compare bytes"),
                    "{key_type}: {message}"
                );
            }
            other => panic!("{key_type}: expected a refusal, got {other:?}"),
        }
    }
}

/// A migration holding the records table (an `ACCESS EXCLUSIVE` lock) while
/// an instance starts: the instance waits for it, then starts — a busy
/// database is not a misconfigured one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_starting_during_a_migration_waits_for_it() {
    let db = TestDatabase::create();
    drop(transactional(&db).await);
    let mut migration = db.connect().await;
    sqlx::raw_sql("BEGIN; LOCK TABLE idempotency_records IN ACCESS EXCLUSIVE MODE")
        .execute(&mut migration)
        .await
        .unwrap();
    let started = std::time::Instant::now();
    let starting = tokio::spawn({
        let url = db.url().to_owned();
        async move { PostgresStore::builder().transactional().connect(&url).await }
    });
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(!starting.is_finished(), "it waits for the migration");
    sqlx::raw_sql("COMMIT")
        .execute(&mut migration)
        .await
        .unwrap();
    let store = starting.await.unwrap();
    assert!(store.is_ok(), "{store:?}");
    assert!(started.elapsed() >= Duration::from_secs(3));
}

/// A table created by version 0.1 (its BRIN index and functions included)
/// keeps working: `migrate()` leaves it as it is, and charges commit and
/// replay on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_created_by_version_0_1_keeps_working() {
    let db = TestDatabase::create();
    sqlx::raw_sql(include_str!("schema_0_1.sql"))
        .execute(&mut db.connect().await)
        .await
        .unwrap();
    let app = app(transactional(&db).await);
    let first = oneshot(&app, request("/charges", "k", CHARGE)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(
        oneshot(&app, request("/charges", "k", CHARGE))
            .await
            .is_replay()
    );
    assert_eq!(charges(&db).await, 1);
}

/// The claim waits at most 50 ms on a duplicate's row; the handler's own
/// statements must not inherit that: one that waits 300 ms on a row
/// another session holds still succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_handlers_statements_do_not_inherit_the_claims_short_lock_wait() {
    let db = TestDatabase::create();
    let store = transactional(&db).await;
    sqlx::raw_sql("INSERT INTO charges (note) VALUES ('held')")
        .execute(store.pool())
        .await
        .unwrap();
    let app = Router::new()
        .route(
            "/waits",
            post(async |mut tx: Tx| {
                sqlx::query("UPDATE charges SET note = 'updated' WHERE note = 'held'")
                    .execute(&mut *tx)
                    .await
                    .map(|_| StatusCode::CREATED)
                    .unwrap_or(StatusCode::CONFLICT)
            }),
        )
        .layer(IdempotencyLayer::new(store).single_tenant());
    let mut holder = db.connect().await;
    sqlx::raw_sql("BEGIN; SELECT * FROM charges FOR UPDATE")
        .execute(&mut holder)
        .await
        .unwrap();
    let reply = tokio::spawn({
        let app = app.clone();
        async move { oneshot(&app, request("/waits", "k", CHARGE)).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    sqlx::raw_sql("COMMIT").execute(&mut holder).await.unwrap();
    let reply = reply.await.unwrap();
    assert_eq!(reply.status, StatusCode::CREATED, "{:?}", reply.body);
}
