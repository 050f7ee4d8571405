//! The MySQL/MariaDB stores on a real server (`MYSQL_URL`, else the local
//! one; a throwaway database per test): the transactional store's
//! semantics counted in rows of the handler's own table, MySQL's own traps
//! (lock waits, REPEATABLE READ snapshots, deadlocks, storage engines,
//! collations, the transaction's bound), the example killed mid-charge,
//! and a three-node Galera cluster (`galera.rs`). The behaviour cases run
//! on both stores in `behaviour/`.

// The suite runs against every store: `cargo test --all-features`.
#![cfg(every_store)]

#[path = "../support/mod.rs"]
mod support;

mod galera;

use std::{sync::Arc, time::Duration};

use axum::{Router, extract::Query, http::StatusCode, routing::post};
use tower_idempotency::{
    IdempotencyLayer, MySqlStore, MySqlTx, MySqlTxStore, sqlx,
    store::{StoreError, mysql::EngineCheck},
};

use support::{
    http::{Server, oneshot, post as request},
    mysql::TestDatabase,
};

const CHARGE: &str = r#"{"amount":1999,"currency":"eur"}"#;
const CHARGES: &str = "SELECT count(*) FROM charges";

type Tx = tower_idempotency::IdempotentTx<MySqlTx>;

async fn transactional_on(url: &str, timeout: Duration) -> MySqlTxStore {
    let store = MySqlStore::builder()
        .transactional()
        .transaction_timeout(timeout)
        .create_table_if_missing()
        .connect(url)
        .await
        .expect("connect to the test database");
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS charges (id BIGINT AUTO_INCREMENT PRIMARY KEY, note TEXT) ENGINE = InnoDB",
    )
    .execute(store.pool())
    .await
    .unwrap();
    store
}

async fn transactional(db: &TestDatabase) -> MySqlTxStore {
    transactional_on(db.url(), Duration::from_secs(30)).await
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
/// `status` with the number of charges it sees; a failed insert is a `500`.
async fn charge(mut tx: Tx, Query(p): Query<Params>) -> (StatusCode, String) {
    if let Err(e) = sqlx::query("INSERT INTO charges (note) VALUES ('charged')")
        .execute(&mut *tx)
        .await
    {
        return (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("charge failed: {e}"),
        );
    }
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

/// Inserts a charge, then waits `ms` (the payment processor) and answers
/// `201` without another statement.
async fn slow_charge(mut tx: Tx, Query(p): Query<Params>) -> StatusCode {
    sqlx::query("INSERT INTO charges (note) VALUES ('charged')")
        .execute(&mut *tx)
        .await
        .expect("insert the charge");
    tokio::time::sleep(Duration::from_millis(p.ms)).await;
    StatusCode::CREATED
}

/// Waits on a row another connection holds (`locks`), then charges: the
/// claim's short lock wait must not be the handler's.
async fn waits_for_a_lock(mut tx: Tx) -> (StatusCode, String) {
    let waited = sqlx::query("UPDATE locks SET n = n + 1 WHERE id = 1")
        .execute(&mut *tx)
        .await;
    match waited {
        Ok(_) => (StatusCode::CREATED, "waited".into()),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}

/// Updates two balances in the order `first`, `second`: two requests in
/// opposite orders deadlock, and InnoDB picks a victim.
#[derive(serde::Deserialize)]
struct Order {
    first: i64,
    second: i64,
}

async fn transfer(mut tx: Tx, Query(order): Query<Order>) -> (StatusCode, String) {
    let step = async |id: i64, tx: &mut Tx| {
        sqlx::query("UPDATE balances SET amount = amount + 1 WHERE id = ?")
            .bind(id)
            .execute(&mut **tx)
            .await
    };
    if let Err(e) = step(order.first, &mut tx).await {
        return (StatusCode::INTERNAL_SERVER_ERROR, e.to_string());
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    if let Err(e) = step(order.second, &mut tx).await {
        return (StatusCode::INTERNAL_SERVER_ERROR, e.to_string());
    }
    if let Err(e) = sqlx::query("INSERT INTO charges (note) VALUES ('transfer')")
        .execute(&mut *tx)
        .await
    {
        return (StatusCode::INTERNAL_SERVER_ERROR, e.to_string());
    }
    (StatusCode::CREATED, "transferred".into())
}

fn app(store: MySqlTxStore) -> Router {
    Router::new()
        .route("/charges", post(charge))
        .route("/slow", post(slow_charge))
        .route("/waits", post(waits_for_a_lock))
        .route("/transfer", post(transfer))
        .layer(IdempotencyLayer::new(store).single_tenant())
}

/// Duplicates of a slow charge wait on its uncommitted row for a bounded
/// time only (the one-charge, answered-at-once half is the behaviour
/// suite's, on every engine): once their lock waits are rolled back, no
/// transaction is left open.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicates_waiting_on_the_row_lock_leave_no_transaction_open() {
    let db = TestDatabase::create();
    let server = Server::start(app(transactional(&db).await)).await;
    let replies = futures_util::future::join_all(
        (0..32).map(|_| server.post("/charges?ms=1500", "k", CHARGE)),
    )
    .await;
    let created = replies
        .iter()
        .filter(|r| r.status == StatusCode::CREATED)
        .count();
    assert_eq!(created, 1, "one execution");
    assert_eq!(db.count(CHARGES).await, 1);
    // This database's sessions only: other tests share the server.
    let open = format!(
        "SELECT count(*) FROM information_schema.INNODB_TRX t \
         JOIN information_schema.PROCESSLIST p ON p.ID = t.trx_mysql_thread_id \
         WHERE p.DB = '{}'",
        db.name()
    );
    db.wait_for_count(
        &open,
        |open| open == 0,
        "the duplicates' transactions were rolled back",
    )
    .await;
}

/// On a server whose default is REPEATABLE READ, with concurrent duplicates arriving
/// just as the first commits: each either gets `409` or replays the
/// committed record — read with a locking read, which sees what a plain
/// `SELECT` of an older snapshot would not. Never a second charge.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicates_around_the_commit_replay_or_conflict_never_charge_twice() {
    let db = TestDatabase::create();
    let store = transactional(&db).await;
    let isolation: String = sqlx::query_scalar("SELECT @@GLOBAL.tx_isolation")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(isolation, "REPEATABLE-READ", "the server's default");
    let server = Server::start(app(store)).await;
    for round in 0..5 {
        let key = format!("k{round}");
        let first = tokio::spawn({
            let (client, url) = (server.client.clone(), server.url("/charges?ms=200"));
            let key = key.clone();
            async move {
                let mut req = request("/charges?ms=200", &key, CHARGE);
                *req.uri_mut() = url.parse().unwrap();
                client.send(req).await
            }
        });
        tokio::time::sleep(Duration::from_millis(180)).await;
        let replies = futures_util::future::join_all((0..16).map(|_| {
            let key = &key;
            let server = &server;
            async move { server.post("/charges?ms=200", key, CHARGE).await }
        }))
        .await;
        let first = first.await.unwrap();
        assert_eq!(first.status, StatusCode::CREATED);
        for reply in &replies {
            assert!(
                reply.status == StatusCode::CONFLICT || reply.is_replay(),
                "{} {:?}",
                reply.status,
                reply.body
            );
            if reply.is_replay() {
                assert_eq!(reply.body, first.body);
            }
        }
    }
    assert_eq!(db.count(CHARGES).await, 5, "one charge per key");
}

/// The isolation level the handler's statements run at.
async fn isolation(mut tx: Tx) -> String {
    sqlx::query_scalar("SELECT @@tx_isolation")
        .fetch_one(&mut *tx)
        .await
        .unwrap()
}

/// The request's transaction runs at READ COMMITTED, whatever the server's
/// default (REPEATABLE READ here): under REPEATABLE READ, gap locks made
/// concurrent claims of different keys wait for each other, and a claim
/// that may not wait answered `409` for a new key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_request_transaction_is_read_committed_whatever_the_server_default() {
    let db = TestDatabase::create();
    let app = Router::new()
        .route("/isolation", post(isolation))
        .layer(IdempotencyLayer::new(transactional(&db).await).single_tenant());
    let reply = oneshot(&app, request("/isolation", "k", CHARGE)).await;
    assert_eq!(reply.body, "READ-COMMITTED");
}

/// The claim fails at once on a duplicate's uncommitted row, but the
/// handler's own statements keep the server's lock wait: a handler that
/// waits 1.5 s for a row another connection holds gets it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_claims_short_lock_wait_is_not_the_handlers() {
    let db = TestDatabase::create();
    let store = transactional(&db).await;
    sqlx::raw_sql("CREATE TABLE locks (id INT PRIMARY KEY, n INT) ENGINE = InnoDB; INSERT INTO locks VALUES (1, 0)")
        .execute(store.pool())
        .await
        .unwrap();
    let app = app(store);
    let mut holder = db.connect().await;
    sqlx::raw_sql("BEGIN; UPDATE locks SET n = n + 1 WHERE id = 1")
        .execute(&mut holder)
        .await
        .unwrap();
    let release = async {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        sqlx::Executor::execute(&mut holder, "COMMIT")
            .await
            .unwrap();
    };
    let (reply, ()) = tokio::join!(oneshot(&app, request("/waits", "k", CHARGE)), release);
    assert_eq!(reply.status, StatusCode::CREATED, "{:?}", reply.body);
}

/// Two transfers in opposite orders deadlock (1213): InnoDB rolls one back.
/// Its handler sees the error and answers `500`: nothing of it commits, the
/// key is released, and the handler is never run again by the layer; the
/// client's retry executes once. One charge per key.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_deadlock_is_never_retried_by_running_the_handler_again() {
    let db = TestDatabase::create();
    let store = transactional(&db).await;
    sqlx::raw_sql(
        "CREATE TABLE balances (id BIGINT PRIMARY KEY, amount BIGINT) ENGINE = InnoDB; \
         INSERT INTO balances VALUES (1, 0), (2, 0)",
    )
    .execute(store.pool())
    .await
    .unwrap();
    let server = Server::start(app(store)).await;
    let (a, b) = tokio::join!(
        server.post("/transfer?first=1&second=2", "a", CHARGE),
        server.post("/transfer?first=2&second=1", "b", CHARGE),
    );
    let mut statuses = [a.status, b.status];
    statuses.sort();
    assert_eq!(
        statuses,
        [StatusCode::CREATED, StatusCode::INTERNAL_SERVER_ERROR],
        "{:?} {:?}",
        a.body,
        b.body
    );
    assert_eq!(db.count(CHARGES).await, 1, "the victim committed nothing");
    let (victim, path) = if a.status == StatusCode::CREATED {
        ("b", "/transfer?first=2&second=1")
    } else {
        ("a", "/transfer?first=1&second=2")
    };
    let retry = server.post(path, victim, CHARGE).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(!retry.is_replay());
    assert_eq!(db.count(CHARGES).await, 2, "one charge per key");
    assert_eq!(
        db.count("SELECT CAST(SUM(amount) AS SIGNED) FROM balances")
            .await,
        4
    );
}

/// A handler that deletes its own claim's row, then charges: the record
/// has nowhere to go, so nothing commits (the batch that writes it stops
/// before its `COMMIT`); the retry charges once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_deletes_its_claim_commits_nothing_and_the_retry_charges_once() {
    use std::sync::atomic::{AtomicBool, Ordering};

    let db = TestDatabase::create();
    let store = transactional(&db).await;
    let first = Arc::new(AtomicBool::new(true));
    let app = Router::new()
        .route(
            "/charges",
            post(async move |mut tx: Tx| {
                if first.swap(false, Ordering::SeqCst) {
                    sqlx::query("DELETE FROM idempotency_records")
                        .execute(&mut *tx)
                        .await
                        .unwrap();
                }
                sqlx::query("INSERT INTO charges (note) VALUES ('charged')")
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                (StatusCode::CREATED, "charged")
            }),
        )
        .layer(IdempotencyLayer::new(store).single_tenant());
    let lost = oneshot(&app, request("/charges", "k", CHARGE)).await;
    assert!(lost.status.is_server_error(), "{lost:?}");
    assert_eq!(db.count(CHARGES).await, 0, "nothing committed");
    let retry = oneshot(&app, request("/charges", "k", CHARGE)).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(!retry.is_replay());
    let replay = oneshot(&app, request("/charges", "k", CHARGE)).await;
    assert!(replay.is_replay());
    assert_eq!(db.count(CHARGES).await, 1, "charged once");
}

/// A transaction that outlives its bound (MariaDB's
/// `idle_transaction_timeout`) is ended by the server: its commit fails,
/// the response is withheld, nothing commits, and the retry charges once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_past_its_bound_is_ended_by_the_server_and_the_retry_charges_once() {
    let db = TestDatabase::create();
    let app = app(transactional_on(db.url(), Duration::from_secs(1)).await);
    let late = oneshot(&app, request("/slow?ms=2500", "k", CHARGE)).await;
    late.assert_problem(503);
    assert_eq!(db.count(CHARGES).await, 0, "the server rolled it back");
    let retry = oneshot(&app, request("/slow?ms=0", "k", CHARGE)).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{:?}", retry.body);
    assert_eq!(db.count(CHARGES).await, 1);
}

/// The start-up check refuses a records table that cannot keep exactly-once:
/// a non-transactional storage engine (MyISAM, MEMORY: each statement
/// commits on its own), a key column with a case-insensitive collation,
/// and a table without its primary key — naming the engine and the reason.
/// Opting out starts it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tables_that_cannot_keep_exactly_once_are_refused_at_start_up() {
    let columns = "fingerprint VARBINARY(64) NOT NULL, token VARBINARY(16), record LONGBLOB, \
                   expires_at DATETIME(3) NOT NULL";
    for (table, why) in [
        (
            format!("`key` VARBINARY(320) NOT NULL PRIMARY KEY, {columns}) ENGINE = MyISAM"),
            "no transactions",
        ),
        (
            "`key` VARBINARY(320) NOT NULL PRIMARY KEY, fingerprint VARBINARY(64) NOT NULL, \
             token VARBINARY(16), record VARBINARY(4096), expires_at DATETIME(3) NOT NULL) ENGINE = MEMORY"
                .to_owned(),
            "no transactions",
        ),
        (
            format!(
                "`key` VARCHAR(320) CHARACTER SET utf8mb4 COLLATE utf8mb4_general_ci NOT NULL PRIMARY KEY, \
                 {columns}) ENGINE = InnoDB"
            ),
            "does not compare bytes",
        ),
        (
            format!("`key` VARBINARY(320) NOT NULL, {columns}) ENGINE = InnoDB"),
            "not unique",
        ),
    ] {
        let db = TestDatabase::create();
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE TABLE idempotency_records ({table}")))
            .execute(&mut db.connect().await)
            .await
            .unwrap();
        match MySqlStore::builder()
            .transactional()
            .connect(db.url())
            .await
        {
            Err(StoreError::Misconfigured(message)) => {
                assert!(message.contains(why), "{table}: {message}");
                assert!(
                    message.contains("MariaDB") || message.contains("MySQL"),
                    "{message}"
                );
            }
            other => panic!("{table}: expected a refusal, got {other:?}"),
        }
        let opted_out = MySqlStore::builder()
            .transactional()
            .engine_check(EngineCheck::Warn)
            .connect(db.url())
            .await;
        assert!(opted_out.is_ok(), "{opted_out:?}");
    }
}

/// What stops a store at start-up is told apart, each with its own fix: a
/// missing table, a user without grants on it — not an unsafe engine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_table_and_a_user_without_grants_say_what_they_are() {
    use tower_idempotency::store::StoreError;

    let db = TestDatabase::create();
    let connect = async |url: &str| {
        MySqlStore::builder()
            .transactional()
            .connect(url)
            .await
            .map(drop)
    };
    let missing = connect(db.url()).await.unwrap_err();
    assert!(matches!(missing, StoreError::Misconfigured(_)), "{missing}");
    assert!(
        missing.to_string().contains("create_table_if_missing"),
        "{missing}"
    );
    MySqlStore::builder()
        .transactional()
        .create_table_if_missing()
        .connect(db.url())
        .await
        .unwrap();

    let user = format!("tiu_{}", db.name());
    let user = &user[..user.len().min(32)];
    let mut root = db.connect().await;
    let admin = async |root: &mut sqlx::MySqlConnection, sql: String| {
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
            .execute(root)
            .await
            .unwrap();
    };
    admin(
        &mut root,
        format!(
            "DROP USER IF EXISTS '{user}'@'%'; CREATE USER '{user}'@'%' IDENTIFIED BY 'secret'"
        ),
    )
    .await;
    let url = db
        .url()
        .replacen("root@", &format!("{user}:secret@"), 1)
        .replacen("root:@", &format!("{user}:secret@"), 1);
    assert!(
        url.contains(user),
        "the test database's URL names root: {url}"
    );
    for grant in [
        None,
        Some(format!(
            "GRANT SELECT ON {}.idempotency_records TO '{user}'@'%'",
            db.name()
        )),
    ] {
        if let Some(grant) = grant {
            admin(&mut root, grant).await;
        }
        let error = connect(&url).await.unwrap_err();
        let said = error.to_string();
        assert!(matches!(error, StoreError::Misconfigured(_)), "{said}");
        assert!(said.contains("SELECT, INSERT, UPDATE"), "{said}");
        assert!(
            !said.contains("EngineCheck::Warn"),
            "not an unsafe engine: {said}"
        );
    }
    admin(
        &mut root,
        format!(
            "GRANT SELECT, INSERT, UPDATE, DELETE ON {}.idempotency_records TO '{user}'@'%'",
            db.name()
        ),
    )
    .await;
    connect(&url).await.unwrap();
    admin(&mut root, format!("DROP USER '{user}'@'%'")).await;
}

/// A database that does not exist, or wrong credentials, are mistakes in
/// the URL, not outages; a user who may not create tables, asked to create
/// the table, is told to grant CREATE or migrate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_database_bad_credentials_and_a_missing_create_right_say_what_they_are() {
    use tower_idempotency::store::StoreError;

    let db = TestDatabase::create();
    let open = async |url: &str, create: bool| {
        let builder = MySqlStore::builder().transactional();
        let builder = if create {
            builder.create_table_if_missing()
        } else {
            builder
        };
        builder.connect(url).await.map(drop)
    };
    let unknown = db.url().replace(db.name(), "tiu_no_such_database");
    let error = open(&unknown, false).await.unwrap_err();
    assert!(matches!(error, StoreError::Misconfigured(_)), "{error}");
    assert!(error.to_string().contains("does not exist"), "{error}");
    let wrong = db.url().replacen("root@", "root:wrong@", 1);
    let error = open(&wrong, false).await.unwrap_err();
    assert!(matches!(error, StoreError::Misconfigured(_)), "{error}");
    assert!(error.to_string().contains("credentials"), "{error}");

    let user = format!("tic_{}", db.name());
    let user = &user[..user.len().min(32)];
    let mut root = db.connect().await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP USER IF EXISTS '{user}'@'%'; CREATE USER '{user}'@'%' IDENTIFIED BY 'secret'; \
         GRANT SELECT, INSERT, UPDATE, DELETE ON {}.* TO '{user}'@'%'",
        db.name()
    )))
    .execute(&mut root)
    .await
    .unwrap();
    let url = db.url().replacen("root@", &format!("{user}:secret@"), 1);
    let error = open(&url, true).await.unwrap_err();
    let said = error.to_string();
    assert!(matches!(error, StoreError::Misconfigured(_)), "{said}");
    assert!(said.contains("may not create the table"), "{said}");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP USER '{user}'@'%'")))
        .execute(&mut root)
        .await
        .unwrap();
}
