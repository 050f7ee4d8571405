//! Load benchmark: a bare axum handler and the same handler behind the layer,
//! driven side by side over loopback by `wrk`, alternating variants over
//! several rounds, with the ratio to bare per round and the median.
//!
//! Run with: `cargo bench --all-features --bench load` (needs `wrk`,
//! `redis-server` and `valkey-server` on PATH, PostgreSQL at `DATABASE_URL` and MySQL/MariaDB at
//! `MYSQL_URL`, or locally as in the tests; Debian/Ubuntu: `sudo apt-get
//! install wrk redis-server postgresql mariadb-server`).
//!
//! Environment: `LOAD_SECS` (per run, default 5), `LOAD_ROUNDS` (default 3),
//! `LOAD_CONNECTIONS` (default 32), `LOAD_VARIANTS` (comma-separated names to
//! run, default all; each brings its references unless `LOAD_REFERENCES=0`). Every run is bounded in time; all traffic stays on
//! 127.0.0.1; the servers and `redis-server` stop when the benchmark ends.

use std::{env, net::SocketAddr, process::Command, sync::Arc, time::Duration};

use axum::{
    Json, Router,
    extract::{Request, State},
    http::{HeaderValue, StatusCode, header},
    middleware::{self, Next},
    response::{IntoResponse, Response},
    routing::post,
};
use http::request::Parts;
use http_body_util::BodyExt;
use redis::AsyncCommands;
use serde::{Deserialize, Serialize};
use tower_idempotency::{
    IdempotencyLayer, IdempotentTx, MemoryStore, MySqlStore, MySqlTxStore, PostgresStore,
    RedisStore, SqliteStore, SqliteTxStore,
    codec::Compression,
    outbox::{Outbox, OutgoingMessage},
    sqlx::{
        self, MySqlConnection, MySqlPool, PgConnection, PgPool, SqliteConnection, SqlitePool,
        mysql::MySqlPoolOptions, postgres::PgPoolOptions,
    },
    store::{
        CachedStore, Store,
        sql::{Dialect, SqlTx},
    },
};
use tower_idempotency_harness::cpu;
use tower_idempotency_harness::mysql::TestDatabase as MySqlDatabase;
use tower_idempotency_harness::postgres::TestDatabase;
use tower_idempotency_harness::redis_server::RedisServer;
use tower_idempotency_harness::sqlite::TestFile;

/// Long enough for every replay of a run of every variant (a record that
/// expired mid-run would execute again), short enough that unique keys do not
/// pile up.
const RETENTION: Duration = Duration::from_secs(600);

#[derive(Clone, Copy, PartialEq)]
enum Keys {
    /// A new key per request: every request executes.
    Unique,
    /// 64 keys, completed during the warm-up: every request replays.
    Replay,
}

struct Variant {
    name: &'static str,
    keys: Keys,
    addr: SocketAddr,
    /// The variants this one is measured against, in the same round: the
    /// first is the table's "x ref".
    references: &'static [&'static str],
    /// Whether it writes to PostgreSQL (its costs there are reported).
    postgres: bool,
    /// Whether it writes to MySQL (its costs there are reported).
    mysql: bool,
}

#[derive(Deserialize, Serialize)]
struct NewCharge {
    amount: i64,
    currency: String,
    description: Option<String>,
}

impl NewCharge {
    /// Its `charge.created`, as the outbox variants enqueue it.
    fn event(&self) -> Vec<u8> {
        format!(
            r#"{{"type":"charge.created","amount":{},"currency":"{}"}}"#,
            self.amount, self.currency
        )
        .into_bytes()
    }
}

/// The handler under test: parse a charge, answer 201 with a Location.
async fn charge(Json(new): Json<NewCharge>) -> Response {
    let location = HeaderValue::from_static("/v1/charges/ch_bench");
    (
        StatusCode::CREATED,
        [(header::LOCATION, location)],
        Json(new),
    )
        .into_response()
}

fn routes() -> Router {
    Router::new().route("/v1/charges", post(charge))
}

async fn insert_charge(connection: &mut PgConnection, new: &NewCharge) {
    sqlx::query("INSERT INTO charges (amount, currency, description) VALUES ($1, $2, $3)")
        .bind(new.amount)
        .bind(&new.currency)
        .bind(&new.description)
        .execute(connection)
        .await
        .expect("insert the charge");
}

/// The Postgres handler without the layer's help: the charge in a
/// transaction of its own.
async fn charge_committed(State(pool): State<PgPool>, Json(new): Json<NewCharge>) -> Response {
    let new = detached(async move {
        let mut tx = pool.begin().await.expect("begin");
        insert_charge(&mut tx, &new).await;
        tx.commit().await.expect("commit");
        new
    })
    .await;
    charge(Json(new)).await
}

/// The Postgres floor for exactly-once effects, hand-written without the
/// layer: the charge and a record row of the same shape (a 100-character
/// key, a 32-byte fingerprint, a 200-byte response) inserted in one
/// transaction of its own — no claim, no lock, no fingerprinting, no
/// replay. It does not give the layer's guarantee: a concurrent duplicate
/// runs the charge too (its record insert then fails), and a retry gets no
/// replay.
async fn charge_and_record(
    State(pool): State<PgPool>,
    headers: http::HeaderMap,
    Json(new): Json<NewCharge>,
) -> Response {
    let key = floor_key(&headers, 0);
    let new = detached(async move {
        let mut tx = pool.begin().await.expect("begin");
        insert_charge(&mut tx, &new).await;
        sqlx::query(
            "INSERT INTO idempotency_records (key, fingerprint, record, expires_at) \
             VALUES ($1, $2, $3, now() + interval '600 seconds')",
        )
        .bind(key)
        .bind(&[7u8; 32][..])
        .bind(&[7u8; 200][..])
        .execute(&mut *tx)
        .await
        .expect("insert the record");
        tx.commit().await.expect("commit");
        new
    })
    .await;
    charge(Json(new)).await
}

/// The Postgres floor for a replay, hand-written without the layer: one
/// prepared lookup of the stored response by key, outside any transaction,
/// and the response sent as stored. (A key not yet stored, during the
/// warm-up only, is stored first.) Not the layer's guarantee either: a
/// lookup outside the claim cannot make a duplicate of a request in
/// flight wait.
async fn replay_by_hand(State(pool): State<PgPool>, headers: http::HeaderMap) -> Response {
    let key = floor_key(&headers, 1);
    let body = detached(async move {
        let found: Option<Vec<u8>> = sqlx::query_scalar(
            "SELECT record FROM idempotency_records WHERE key = $1 AND expires_at > now()",
        )
        .bind(&key)
        .fetch_optional(&pool)
        .await
        .expect("look the response up");
        if let Some(body) = found {
            return body;
        }
        sqlx::query(
            "INSERT INTO idempotency_records (key, fingerprint, record, expires_at) \
             VALUES ($1, $2, $3, now() + interval '1 day') \
             ON CONFLICT (key) DO UPDATE SET record = EXCLUDED.record, expires_at = EXCLUDED.expires_at",
        )
        .bind(&key)
        .bind(&[7u8; 32][..])
        .bind(FLOOR_RESPONSE)
        .execute(&pool)
        .await
        .expect("store the response");
        FLOOR_RESPONSE.to_vec()
    })
    .await;
    floor_replay(body)
}

async fn insert_charge_sqlite(connection: &mut SqliteConnection, new: &NewCharge) {
    sqlx::query("INSERT INTO charges (amount, currency, description) VALUES (?1, ?2, ?3)")
        .bind(new.amount)
        .bind(&new.currency)
        .bind(&new.description)
        .execute(connection)
        .await
        .expect("insert the charge");
}

/// SQLite's floor for exactly-once effects, hand-written without the layer:
/// the charge and a record row of the same shape inserted in one
/// `IMMEDIATE` transaction of its own, the writers of the process taking
/// turns on a mutex first (as the store does; SQLite's own busy handler
/// alone starves some of 32 writers for seconds). No claim: not the
/// layer's guarantee (see [`charge_and_record`]).
async fn sqlite_charge_and_record(
    State((pool, writer)): State<(SqlitePool, Arc<tokio::sync::Mutex<()>>)>,
    headers: http::HeaderMap,
    Json(new): Json<NewCharge>,
) -> Response {
    let key = floor_key(&headers, 0);
    let new = detached(async move {
        let _turn = writer.lock().await;
        let mut tx = pool.begin_with("BEGIN IMMEDIATE").await.expect("begin");
        insert_charge_sqlite(&mut tx, &new).await;
        sqlx::query(
            "INSERT INTO idempotency_records (key, fingerprint, record, expires_at) VALUES (?1, ?2, ?3, ?4)",
        )
        .bind(key)
        .bind(&[7u8; 32][..])
        .bind(&[7u8; 200][..])
        .bind(unix_ms() + 600_000)
        .execute(&mut *tx)
        .await
        .expect("insert the record");
        tx.commit().await.expect("commit");
        new
    })
    .await;
    charge(Json(new)).await
}

/// SQLite's floor for a replay: one prepared lookup of the stored response
/// by key, outside any transaction. (A key not yet stored, during the
/// warm-up only, is stored first.)
async fn sqlite_replay_by_hand(
    State(pool): State<SqlitePool>,
    headers: http::HeaderMap,
) -> Response {
    let key = floor_key(&headers, 1);
    let body = detached(async move {
        let found: Option<Vec<u8>> = sqlx::query_scalar(
            "SELECT record FROM idempotency_records WHERE key = ?1 AND expires_at > ?2",
        )
        .bind(&key)
        .bind(unix_ms())
        .fetch_optional(&pool)
        .await
        .expect("look the response up");
        if let Some(body) = found {
            return body;
        }
        sqlx::query(
            "INSERT INTO idempotency_records (key, fingerprint, record, expires_at) VALUES (?1, ?2, ?3, ?4) \
             ON CONFLICT (key) DO UPDATE SET record = excluded.record, expires_at = excluded.expires_at",
        )
        .bind(&key)
        .bind(&[7u8; 32][..])
        .bind(FLOOR_RESPONSE)
        .bind(unix_ms() + 86_400_000)
        .execute(&pool)
        .await
        .expect("store the response");
        FLOOR_RESPONSE.to_vec()
    })
    .await;
    floor_replay(body)
}

fn unix_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

/// The same charge in the request's SQLite transaction, committed by the
/// layer with the record.
async fn sqlite_charge_in_transaction(
    mut tx: IdempotentTx<tower_idempotency::SqliteTx>,
    Json(new): Json<NewCharge>,
) -> Response {
    insert_charge_sqlite(&mut tx, &new).await;
    charge(Json(new)).await
}

async fn insert_charge_mysql(connection: &mut MySqlConnection, new: &NewCharge) {
    sqlx::query("INSERT INTO charges (amount, currency, description) VALUES (?, ?, ?)")
        .bind(new.amount)
        .bind(&new.currency)
        .bind(&new.description)
        .execute(connection)
        .await
        .expect("insert the charge");
}

/// The MySQL handler without the layer's help: the charge in a transaction
/// of its own.
async fn mysql_charge_committed(
    State(pool): State<MySqlPool>,
    Json(new): Json<NewCharge>,
) -> Response {
    let new = detached(async move {
        let mut tx = pool.begin().await.expect("begin");
        insert_charge_mysql(&mut tx, &new).await;
        tx.commit().await.expect("commit");
        new
    })
    .await;
    charge(Json(new)).await
}

/// MySQL's floor for exactly-once effects, hand-written without the layer:
/// the charge and a record row of the same shape inserted in one
/// transaction of its own. No claim: not the layer's guarantee (see
/// [`charge_and_record`]).
async fn mysql_charge_and_record(
    State(pool): State<MySqlPool>,
    headers: http::HeaderMap,
    Json(new): Json<NewCharge>,
) -> Response {
    let key = floor_key(&headers, 0);
    let new = detached(async move {
        let mut tx = pool.begin().await.expect("begin");
        insert_charge_mysql(&mut tx, &new).await;
        sqlx::query(
            "INSERT INTO idempotency_records (`key`, fingerprint, record, expires_at) \
             VALUES (?, ?, ?, UTC_TIMESTAMP(3) + INTERVAL 600 SECOND)",
        )
        .bind(key)
        .bind(&[7u8; 32][..])
        .bind(&[7u8; 200][..])
        .execute(&mut *tx)
        .await
        .expect("insert the record");
        tx.commit().await.expect("commit");
        new
    })
    .await;
    charge(Json(new)).await
}

/// MySQL's floor for a replay: one prepared lookup of the stored response
/// by key, outside any transaction. (A key not yet stored, during the
/// warm-up only, is stored first.)
async fn mysql_replay_by_hand(State(pool): State<MySqlPool>, headers: http::HeaderMap) -> Response {
    let key = floor_key(&headers, 1);
    let body = detached(async move {
        let found: Option<Vec<u8>> = sqlx::query_scalar(
            "SELECT record FROM idempotency_records WHERE `key` = ? AND expires_at > UTC_TIMESTAMP(3)",
        )
        .bind(&key)
        .fetch_optional(&pool)
        .await
        .expect("look the response up");
        if let Some(body) = found {
            return body;
        }
        let stored = sqlx::query(
            "INSERT INTO idempotency_records (`key`, fingerprint, record, expires_at) \
             VALUES (?, ?, ?, UTC_TIMESTAMP(3) + INTERVAL 1 DAY) \
             ON DUPLICATE KEY UPDATE record = VALUES(record), expires_at = VALUES(expires_at)",
        )
        .bind(&key)
        .bind(&[7u8; 32][..])
        .bind(FLOOR_RESPONSE)
        .execute(&pool)
        .await;
        // Warm-up only (64 keys written once): concurrent first writes
        // of one key may deadlock on InnoDB; one of them stores it.
        drop(stored);
        FLOOR_RESPONSE.to_vec()
    })
    .await;
    floor_replay(body)
}

/// The same charge in the request's MySQL transaction, committed by the
/// layer with the record.
async fn mysql_charge_in_transaction(
    mut tx: IdempotentTx<tower_idempotency::MySqlTx>,
    Json(new): Json<NewCharge>,
) -> Response {
    insert_charge_mysql(&mut tx, &new).await;
    charge(Json(new)).await
}

/// The same charge in the request's transaction, committed by the layer with
/// the record.
async fn charge_in_transaction(
    mut tx: IdempotentTx<tower_idempotency::PostgresTx>,
    Json(new): Json<NewCharge>,
) -> Response {
    insert_charge(&mut tx, &new).await;
    charge(Json(new)).await
}

/// The charge's `charge.created`, enqueued in the request's transaction:
/// one outbox row committed with the charge and the record.
async fn enqueue_event<D: Dialect>(
    outbox: &Outbox<D>,
    tx: &mut IdempotentTx<SqlTx<D>>,
    new: &NewCharge,
) {
    outbox
        .enqueue(
            tx,
            OutgoingMessage::new("charges", new.event()).ordering_key("acct"),
        )
        .await
        .expect("enqueue the event");
}

async fn charge_with_event(
    State(outbox): State<Outbox<tower_idempotency::store::sql::postgres::Postgres>>,
    mut tx: IdempotentTx<tower_idempotency::PostgresTx>,
    Json(new): Json<NewCharge>,
) -> Response {
    insert_charge(&mut tx, &new).await;
    enqueue_event(&outbox, &mut tx, &new).await;
    charge(Json(new)).await
}

async fn sqlite_charge_with_event(
    State(outbox): State<Outbox<tower_idempotency::store::sql::sqlite::Sqlite>>,
    mut tx: IdempotentTx<tower_idempotency::SqliteTx>,
    Json(new): Json<NewCharge>,
) -> Response {
    insert_charge_sqlite(&mut tx, &new).await;
    enqueue_event(&outbox, &mut tx, &new).await;
    charge(Json(new)).await
}

async fn mysql_charge_with_event(
    State(outbox): State<Outbox<tower_idempotency::store::sql::mysql::MySql>>,
    mut tx: IdempotentTx<tower_idempotency::MySqlTx>,
    Json(new): Json<NewCharge>,
) -> Response {
    insert_charge_mysql(&mut tx, &new).await;
    enqueue_event(&outbox, &mut tx, &new).await;
    charge(Json(new)).await
}

/// Runs a floor's database work on a task of its own: wrk closes its
/// connections when a run ends, which drops the requests in flight, and a
/// request dropped halfway through `BEGIN` must not hand a connection back
/// to the shared pool inside a transaction (seen: a deadlock in a warm-up,
/// then hundreds of `current transaction is aborted` on the pool). The
/// layer's stores do the same for their claims.
async fn detached<T: Send + 'static>(work: impl Future<Output = T> + Send + 'static) -> T {
    tokio::spawn(work).await.expect("the floor's task")
}

/// The request's idempotency key, as the floors store it: under a fixed
/// 64-character scope (`prefix` repeated) so that each floor keeps its own
/// keys, and a key of the layer's shape (about 100 characters in all).
fn floor_key(headers: &http::HeaderMap, prefix: u8) -> String {
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    format!("{:064}:{key}", prefix)
}

/// The stored response the claim-first floors write and replay: the size
/// of the layer's record of the charge (status, headers, body).
const FLOOR_RESPONSE: &[u8] = br#"{"id":"ch_0000000000000000","amount":1999,"currency":"eur","description":"floor, padded to the layer's record size: status, content type, location and the charge itself ....................."}"#;

/// A replay as the floors send it: the stored body, as stored.
fn floor_replay(body: Vec<u8>) -> Response {
    (
        StatusCode::CREATED,
        [
            (http::header::CONTENT_TYPE, "application/json"),
            (http::HeaderName::from_static("idempotent-replayed"), "true"),
        ],
        body,
    )
        .into_response()
}

/// The stored response a floor's `read` batch answers, every statement
/// of it run (the `ROLLBACK` beside the `SELECT` too: SQLite runs a
/// batch's statements only as its rows are read).
macro_rules! read_stored {
    ($on:expr, $read:expr) => {{
        let rows = sqlx::raw_sql(sqlx::AssertSqlSafe($read))
            .fetch_all(&mut *$on)
            .await
            .expect("read the stored response");
        sqlx::Row::get::<Vec<u8>, _>(&rows[0], 0)
    }};
}

/// The claim-first floors' completion, one batch: the charge's event row
/// in the outbox (`event`: its id, for the outbox variants), the response
/// written into the claim's row (`row`: the key's condition), `COMMIT`;
/// `bytes` writes a byte string as the engine's literal.
fn floor_completion(
    row: &str,
    event: Option<&str>,
    new: &NewCharge,
    bytes: fn(&[u8]) -> String,
) -> String {
    let mut sql = String::new();
    if let Some(id) = event {
        sql.push_str(&format!(
            "INSERT INTO idempotency_outbox (id, destination, ordering_key, payload, headers, created_at) \
             VALUES ('floor-{id}', 'charges', 'acct', {}, '{{}}', {}); ",
            bytes(&new.event()),
            unix_ms()
        ));
    }
    sql.push_str(&format!(
        "UPDATE idempotency_records SET record = {} WHERE {row}; COMMIT",
        bytes(FLOOR_RESPONSE)
    ));
    sql
}

/// `bytes` as hex digits, for the floors' literals.
fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// PostgreSQL's claim-first floor: the founding recipe written by hand
/// with plain sqlx, in the fewest round trips the engine allows, and the
/// same guarantee as the transactional store — `BEGIN` and the claim
/// (`INSERT … ON CONFLICT DO NOTHING`, the record row without its
/// response) in one simple query; the charge; the response written into
/// the claim's row and `COMMIT` in one simple query. A concurrent
/// duplicate waits on the uncommitted row (it never runs the charge); a
/// claim that inserts nothing finds a completed row, whose response is
/// read and sent, and the transaction rolled back, in one more round trip.
async fn pg_claim_first(
    State((pool, event)): State<(PgPool, bool)>,
    headers: http::HeaderMap,
    Json(new): Json<NewCharge>,
) -> Response {
    let key = floor_key(&headers, 2);
    let executed = detached(async move {
        let mut on = pool.acquire().await.expect("a connection");
        let claim = format!(
            "BEGIN ISOLATION LEVEL READ COMMITTED; \
             INSERT INTO idempotency_records (key, fingerprint, expires_at) \
             VALUES ('{key}', '\\x{fp}', now() + interval '600 seconds') \
             ON CONFLICT DO NOTHING RETURNING 1",
            fp = hex(&[7; 32]),
        );
        let claimed = sqlx::raw_sql(sqlx::AssertSqlSafe(claim))
            .fetch_all(&mut *on)
            .await
            .expect("claim");
        if claimed.is_empty() {
            let read =
                format!("SELECT record FROM idempotency_records WHERE key = '{key}'; ROLLBACK");
            return Err(read_stored!(on, read));
        }
        insert_charge(&mut on, &new).await;
        let complete = floor_completion(
            &format!("key = '{key}'"),
            event.then_some(&key[65..]),
            &new,
            |bytes| format!("'\\x{}'", hex(bytes)),
        );
        sqlx::raw_sql(sqlx::AssertSqlSafe(complete))
            .execute(&mut *on)
            .await
            .expect("complete");
        Ok(new)
    })
    .await;
    match executed {
        Ok(new) => charge(Json(new)).await,
        Err(stored) => floor_replay(stored),
    }
}

/// MySQL's claim-first floor, as [`pg_claim_first`]: `BEGIN` and the
/// claim's `INSERT` in one round trip (a committed row fails it with a
/// duplicate key, 1062), the charge, the response written and `COMMIT`
/// in one; a duplicate rolls back and reads the stored response in one.
/// The session reads committed data, as the store's claims do.
async fn mysql_claim_first(
    State((pool, event, guarded)): State<(MySqlPool, bool, bool)>,
    headers: http::HeaderMap,
    Json(new): Json<NewCharge>,
) -> Response {
    let plain = floor_key(&headers, 2);
    let key = hex(plain.as_bytes());
    let executed = detached(async move {
        let mut on = pool.acquire().await.expect("a connection");
        // Guarded as the store is: the session's autocommit off (a
        // transaction a deadlock rolled back is not followed by statements
        // that commit on their own), and back on before the connection
        // returns to the pool.
        let begin = if guarded { "SET autocommit = 0" } else { "BEGIN" };
        let claim = format!(
            "{begin}; INSERT INTO idempotency_records (`key`, fingerprint, expires_at) \
             VALUES (X'{key}', X'{fp}', UTC_TIMESTAMP(3) + INTERVAL 600 SECOND)",
            fp = hex(&[7; 32]),
        );
        match sqlx::raw_sql(sqlx::AssertSqlSafe(claim))
            .execute(&mut *on)
            .await
        {
            Ok(_) => {}
            Err(error)
                if error.as_database_error().and_then(|e| e.code()).as_deref() == Some("23000") =>
            {
                let restore = if guarded { " SET autocommit = 1;" } else { "" };
                let read = format!(
                    "ROLLBACK;{restore} SELECT record FROM idempotency_records WHERE `key` = X'{key}'"
                );
                return Err(read_stored!(on, read));
            }
            Err(error) => panic!("claim: {error}"),
        }
        insert_charge_mysql(&mut on, &new).await;
        let mut complete = floor_completion(
            &format!("`key` = X'{key}'"),
            event.then_some(&plain[65..]),
            &new,
            |bytes| format!("X'{}'", hex(bytes)),
        );
        if guarded {
            // The claim's row checked before the commit (gone: the
            // overflow stops the batch), as the store checks it.
            let update = complete
                .strip_suffix("; COMMIT")
                .expect("the floor's completion ends with its COMMIT");
            complete = format!(
                "{update}; SET @floor_row = 9223372036854775807 + (1 - ROW_COUNT()); COMMIT; SET autocommit = 1"
            );
        }
        sqlx::raw_sql(sqlx::AssertSqlSafe(complete))
            .execute(&mut *on)
            .await
            .expect("complete");
        Ok(new)
    })
    .await;
    match executed {
        Ok(new) => charge(Json(new)).await,
        Err(stored) => floor_replay(stored),
    }
}

/// SQLite's claim-first floor, as [`pg_claim_first`]: the writers of the
/// process take turns (as the store's do), `BEGIN IMMEDIATE` and the
/// claim's `INSERT … ON CONFLICT DO NOTHING` in one call, the charge, the
/// response written and `COMMIT`; a claim that inserts nothing reads the
/// stored response and rolls back.
async fn sqlite_claim_first(
    State((pool, writer, event)): State<(SqlitePool, Arc<tokio::sync::Mutex<()>>, bool)>,
    headers: http::HeaderMap,
    Json(new): Json<NewCharge>,
) -> Response {
    let key = floor_key(&headers, 2);
    let executed = detached(async move {
        let _turn = writer.lock().await;
        let mut on = pool.acquire().await.expect("a connection");
        let claim = format!(
            "BEGIN IMMEDIATE; INSERT INTO idempotency_records (key, fingerprint, expires_at) \
             VALUES ('{key}', X'{fp}', {expires}) ON CONFLICT DO NOTHING RETURNING 1",
            fp = hex(&[7; 32]),
            expires = unix_ms() + 600_000,
        );
        let claimed = sqlx::raw_sql(sqlx::AssertSqlSafe(claim))
            .fetch_all(&mut *on)
            .await
            .expect("claim");
        if claimed.is_empty() {
            let read =
                format!("SELECT record FROM idempotency_records WHERE key = '{key}'; ROLLBACK");
            return Err(read_stored!(on, read));
        }
        insert_charge_sqlite(&mut on, &new).await;
        let complete = floor_completion(
            &format!("key = '{key}'"),
            event.then_some(&key[65..]),
            &new,
            |bytes| format!("X'{}'", hex(bytes)),
        );
        sqlx::raw_sql(sqlx::AssertSqlSafe(complete))
            .execute(&mut *on)
            .await
            .expect("complete");
        Ok(new)
    })
    .await;
    match executed {
        Ok(new) => charge(Json(new)).await,
        Err(stored) => floor_replay(stored),
    }
}

fn scope(parts: &Parts) -> Option<String> {
    parts
        .headers
        .get(header::AUTHORIZATION)?
        .to_str()
        .ok()
        .map(str::to_owned)
}

fn layer<St: Store>(store: St) -> IdempotencyLayer<St, impl tower_idempotency::ScopeExtractor> {
    IdempotencyLayer::new(store)
        .scope_with(scope)
        .retention(RETENTION)
}

fn layered<St: Store>(store: St) -> Router {
    routes().layer(layer(store))
}

/// A floor's claim: `SET key value NX PX 30000 GET` — `None` when the key
/// was free and is now claimed, else what it holds.
async fn claim_or_found(
    conn: &mut redis::aio::ConnectionManager,
    key: &str,
    value: &[u8],
) -> Option<Vec<u8>> {
    redis::cmd("SET")
        .arg(key)
        .arg(value)
        .arg("NX")
        .arg("PX")
        .arg(30_000)
        .arg("GET")
        .query_async(conn)
        .await
        .unwrap()
}

/// The floor: a hand-written middleware that does only the unavoidable Redis
/// work — one `SET NX GET` that claims a new key or returns the stored body,
/// and one `SET` to store the response: two round trips for a new key, one
/// for a replay — with no fingerprint, scope, lease, fencing or headers.
async fn floor(redis: redis::aio::ConnectionManager, request: Request, next: Next) -> Response {
    let Some(key) = request
        .headers()
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
    else {
        return StatusCode::BAD_REQUEST.into_response();
    };
    let key = format!("floor:{key}");
    let mut conn = redis.clone();
    match claim_or_found(&mut conn, &key, b"-").await {
        None => {}
        Some(body) if body != b"-" => {
            return (StatusCode::CREATED, [("idempotent-replayed", "true")], body).into_response();
        }
        Some(_) => return StatusCode::CONFLICT.into_response(),
    }
    let (parts, body) = next.run(request).await.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    let _: () = conn
        .set_ex(&key, body.as_ref(), RETENTION.as_secs())
        .await
        .unwrap();
    Response::from_parts(parts, axum::body::Body::from(body))
}

/// The floor with the Redis store's guarantee, written by hand for a server
/// with conditional commands (Valkey 9): the claim carries a lease token and
/// the request's SHA-256 under the caller's scope, a duplicate in flight is
/// told `409` and another body `422`, and the completion is fenced by the
/// token (`SET … IFEQ <claim>`): two commands for a new key, one for a
/// replay. What it leaves out is what the layer adds beyond the guarantee:
/// headers in the record, `Retry-After`, leases kept alive, metrics.
async fn fenced_floor(
    valkey: redis::aio::ConnectionManager,
    request: Request,
    next: Next,
) -> Response {
    use sha2::{Digest, Sha256};

    let (parts, body) = request.into_parts();
    let (Some(key), Some(scope)) = (
        parts
            .headers
            .get("idempotency-key")
            .and_then(|v| v.to_str().ok()),
        parts
            .headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok()),
    ) else {
        return StatusCode::BAD_REQUEST.into_response();
    };
    let key = format!("fenced:{scope}:{key}");
    let body = body.collect().await.unwrap().to_bytes();
    let fingerprint = Sha256::new()
        .chain_update(parts.method.as_str())
        .chain_update(parts.uri.path())
        .chain_update(&body)
        .finalize();
    let mut claim = vec![b'i'];
    claim.extend_from_slice(&fingerprint);
    claim.extend_from_slice(&fastrand::u128(..).to_be_bytes());
    let mut conn = valkey.clone();
    match claim_or_found(&mut conn, &key, &claim).await {
        None => {}
        Some(found) if found.get(1..33) != Some(&fingerprint[..]) => {
            return StatusCode::UNPROCESSABLE_ENTITY.into_response();
        }
        Some(found) if found[0] == b'c' => {
            let body = found[33..].to_vec();
            return (StatusCode::CREATED, [("idempotent-replayed", "true")], body).into_response();
        }
        Some(_) => return StatusCode::CONFLICT.into_response(),
    }
    let request = Request::from_parts(parts, axum::body::Body::from(body));
    let (parts, body) = next.run(request).await.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    let mut record = vec![b'c'];
    record.extend_from_slice(&fingerprint);
    record.extend_from_slice(&body);
    // Written only over this very claim: a holder whose lease lapsed and
    // was taken over never overwrites the newer record.
    let _: Option<Vec<u8>> = redis::cmd("SET")
        .arg(&key)
        .arg(&record)
        .arg("IFEQ")
        .arg(&claim)
        .arg("GET")
        .arg("EX")
        .arg(RETENTION.as_secs())
        .query_async(&mut conn)
        .await
        .unwrap();
    Response::from_parts(parts, axum::body::Body::from(body))
}

async fn serve(app: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

/// `store` behind a 64 MiB cache of completed records.
fn cached_store<St: Store>(store: St) -> CachedStore<St> {
    CachedStore::new(store, 64 * 1024 * 1024)
}

/// The outbox of a transactional store (its builder is per engine).
macro_rules! outbox_of {
    ($store:expr) => {
        Outbox::on($store)
            .create_table_if_missing()
            .build()
            .await
            .expect("the benchmark's outbox")
    };
}

async fn start_variants(
    redis_url: &str,
    valkey_url: &str,
    pool: PgPool,
    sqlite: SqliteTxStore,
    mysql: MySqlTxStore,
) -> Vec<Variant> {
    let redis = || async {
        RedisStore::builder()
            .connect(redis_url)
            .await
            .expect("connect to the benchmark's redis-server")
    };
    // Bodies of 1 KiB and more compressed: the charge is smaller, so this
    // is what compression costs a small response (the size check).
    let redis_zstd = || async {
        RedisStore::builder()
            .compression(Compression::zstd(1))
            .connect(redis_url)
            .await
            .expect("connect to the benchmark's redis-server")
    };
    let valkey = || async {
        RedisStore::builder()
            .connect(valkey_url)
            .await
            .expect("connect to the benchmark's valkey-server")
    };
    let fenced_floor_app = {
        let client = redis::Client::open(valkey_url).unwrap();
        let manager = redis::aio::ConnectionManager::new(client).await.unwrap();
        routes().layer(middleware::from_fn(move |req, next| {
            fenced_floor(manager.clone(), req, next)
        }))
    };
    let client = redis::Client::open(redis_url).unwrap();
    let manager = redis::aio::ConnectionManager::new(client).await.unwrap();
    let floor_app = {
        let manager = manager.clone();
        routes().layer(middleware::from_fn(move |req, next| {
            floor(manager.clone(), req, next)
        }))
    };
    let transactional = PostgresStore::builder()
        .transactional()
        .with_pool(pool.clone())
        .await
        .unwrap();
    let transactional = || transactional.clone();
    let pg_outbox = outbox_of!(&transactional());
    let sqlite_outbox = outbox_of!(&sqlite);
    let mysql_outbox = outbox_of!(&mysql);
    let committed = || {
        Router::new()
            .route("/v1/charges", post(charge_committed))
            .with_state(pool.clone())
    };
    let in_transaction = || Router::new().route("/v1/charges", post(charge_in_transaction));
    let sqlite_in_transaction =
        || Router::new().route("/v1/charges", post(sqlite_charge_in_transaction));
    let mysql_in_transaction =
        || Router::new().route("/v1/charges", post(mysql_charge_in_transaction));
    let sqlite_writer: Arc<tokio::sync::Mutex<()>> = Arc::default();
    // Each variant, its keys, and what it is measured against in the same
    // round: the first reference is the table's "x ref", the others are
    // printed below it. A variant brings its references along.
    let variants: Vec<(&str, Keys, &'static [&'static str], Router)> = vec![
        ("bare", Keys::Unique, &["bare"], routes()),
        (
            "memory",
            Keys::Unique,
            &["bare"],
            layered(MemoryStore::new()),
        ),
        // The same with a 1 s retention: the store stays small, so this is the
        // layer's own work without a million records kept alive.
        (
            "memory-1s",
            Keys::Unique,
            &["bare"],
            routes().layer(layer(MemoryStore::new()).retention(Duration::from_secs(1))),
        ),
        (
            "memory-replay",
            Keys::Replay,
            &["bare"],
            layered(MemoryStore::new()),
        ),
        ("redis-floor", Keys::Unique, &["bare"], floor_app.clone()),
        (
            "redis",
            Keys::Unique,
            &["redis-floor"],
            layered(redis().await),
        ),
        ("redis-replay-floor", Keys::Replay, &["bare"], floor_app),
        (
            "redis-replay",
            Keys::Replay,
            &["redis-replay-floor"],
            layered(redis().await),
        ),
        (
            "redis-replay-cached",
            Keys::Replay,
            &["bare"],
            layered(cached_store(redis().await)),
        ),
        // Valkey 9: the store's fenced writes are plain commands, measured
        // against the same guarantee by hand on the same server.
        (
            "valkey-floor",
            Keys::Unique,
            &["bare"],
            fenced_floor_app.clone(),
        ),
        (
            "valkey",
            Keys::Unique,
            &["valkey-floor", "redis"],
            layered(valkey().await),
        ),
        (
            "valkey-replay-floor",
            Keys::Replay,
            &["bare"],
            fenced_floor_app,
        ),
        (
            "valkey-replay",
            Keys::Replay,
            &["valkey-replay-floor"],
            layered(valkey().await),
        ),
        (
            "redis-zstd",
            Keys::Unique,
            &["redis"],
            layered(redis_zstd().await),
        ),
        (
            "redis-zstd-replay",
            Keys::Replay,
            &["redis-replay"],
            layered(redis_zstd().await),
        ),
        ("pg-floor", Keys::Unique, &["pg-floor"], committed()),
        (
            "pg-floor-record",
            Keys::Unique,
            &["pg-floor"],
            Router::new()
                .route("/v1/charges", post(charge_and_record))
                .with_state(pool.clone()),
        ),
        (
            "pg-claim-floor",
            Keys::Unique,
            &["pg-floor"],
            Router::new()
                .route("/v1/charges", post(pg_claim_first))
                .with_state((pool.clone(), false)),
        ),
        (
            "pg-replay-floor",
            Keys::Replay,
            &["pg-floor"],
            Router::new()
                .route("/v1/charges", post(replay_by_hand))
                .with_state(pool.clone()),
        ),
        (
            "pg-claim-replay-floor",
            Keys::Replay,
            &["pg-floor"],
            Router::new()
                .route("/v1/charges", post(pg_claim_first))
                .with_state((pool.clone(), false)),
        ),
        (
            "pg-tx",
            Keys::Unique,
            &["pg-claim-floor", "pg-floor", "pg-floor-record"],
            in_transaction().layer(layer(transactional())),
        ),
        (
            "pg-tx-replay",
            Keys::Replay,
            &["pg-claim-replay-floor", "pg-floor", "pg-replay-floor"],
            in_transaction().layer(layer(transactional())),
        ),
        (
            "pg-tx-replay-cached",
            Keys::Replay,
            &["bare", "pg-claim-replay-floor"],
            in_transaction().layer(layer(cached_store(transactional()))),
        ),
        (
            "pg-claim-floor-outbox",
            Keys::Unique,
            &["pg-claim-floor"],
            Router::new()
                .route("/v1/charges", post(pg_claim_first))
                .with_state((pool.clone(), true)),
        ),
        (
            "pg-tx-outbox",
            Keys::Unique,
            &["pg-tx", "pg-claim-floor-outbox"],
            Router::new()
                .route("/v1/charges", post(charge_with_event))
                .with_state(pg_outbox)
                .layer(layer(transactional())),
        ),
        (
            "pg-redis",
            Keys::Unique,
            &["pg-floor"],
            committed().layer(layer(redis().await)),
        ),
        (
            "sqlite-floor-record",
            Keys::Unique,
            &["sqlite-floor-record"],
            Router::new()
                .route("/v1/charges", post(sqlite_charge_and_record))
                .with_state((sqlite.pool().clone(), sqlite_writer.clone())),
        ),
        (
            "sqlite-claim-floor",
            Keys::Unique,
            &["sqlite-floor-record"],
            Router::new()
                .route("/v1/charges", post(sqlite_claim_first))
                .with_state((sqlite.pool().clone(), sqlite_writer.clone(), false)),
        ),
        (
            "sqlite-replay-floor",
            Keys::Replay,
            &["sqlite-replay-floor"],
            Router::new()
                .route("/v1/charges", post(sqlite_replay_by_hand))
                .with_state(sqlite.pool().clone()),
        ),
        (
            "sqlite-claim-replay-floor",
            Keys::Replay,
            &["sqlite-replay-floor"],
            Router::new()
                .route("/v1/charges", post(sqlite_claim_first))
                .with_state((sqlite.pool().clone(), sqlite_writer.clone(), false)),
        ),
        (
            "sqlite-tx",
            Keys::Unique,
            &["sqlite-claim-floor", "sqlite-floor-record"],
            sqlite_in_transaction().layer(layer(sqlite.clone())),
        ),
        (
            "sqlite-claim-floor-outbox",
            Keys::Unique,
            &["sqlite-claim-floor"],
            Router::new()
                .route("/v1/charges", post(sqlite_claim_first))
                .with_state((sqlite.pool().clone(), sqlite_writer.clone(), true)),
        ),
        (
            "sqlite-tx-outbox",
            Keys::Unique,
            &["sqlite-tx", "sqlite-claim-floor-outbox"],
            Router::new()
                .route("/v1/charges", post(sqlite_charge_with_event))
                .with_state(sqlite_outbox)
                .layer(layer(sqlite.clone())),
        ),
        (
            "sqlite-tx-replay",
            Keys::Replay,
            &["sqlite-claim-replay-floor", "sqlite-replay-floor"],
            sqlite_in_transaction().layer(layer(sqlite.clone())),
        ),
        (
            "sqlite-tx-replay-cached",
            Keys::Replay,
            &["bare", "sqlite-claim-replay-floor"],
            sqlite_in_transaction().layer(layer(cached_store(sqlite))),
        ),
        (
            "mysql-floor",
            Keys::Unique,
            &["mysql-floor"],
            Router::new()
                .route("/v1/charges", post(mysql_charge_committed))
                .with_state(mysql.pool().clone()),
        ),
        (
            "mysql-floor-record",
            Keys::Unique,
            &["mysql-floor"],
            Router::new()
                .route("/v1/charges", post(mysql_charge_and_record))
                .with_state(mysql.pool().clone()),
        ),
        (
            "mysql-claim-floor",
            Keys::Unique,
            &["mysql-floor"],
            Router::new()
                .route("/v1/charges", post(mysql_claim_first))
                .with_state((mysql.pool().clone(), false, false)),
        ),
        (
            "mysql-claim-floor-guarded",
            Keys::Unique,
            &["mysql-claim-floor"],
            Router::new()
                .route("/v1/charges", post(mysql_claim_first))
                .with_state((mysql.pool().clone(), false, true)),
        ),
        (
            "mysql-replay-floor",
            Keys::Replay,
            &["mysql-floor"],
            Router::new()
                .route("/v1/charges", post(mysql_replay_by_hand))
                .with_state(mysql.pool().clone()),
        ),
        (
            "mysql-claim-replay-floor",
            Keys::Replay,
            &["mysql-floor"],
            Router::new()
                .route("/v1/charges", post(mysql_claim_first))
                .with_state((mysql.pool().clone(), false, false)),
        ),
        (
            "mysql-tx",
            Keys::Unique,
            &[
                "mysql-claim-floor",
                "mysql-floor",
                "mysql-floor-record",
                "mysql-claim-floor-guarded",
            ],
            mysql_in_transaction().layer(layer(mysql.clone())),
        ),
        (
            "mysql-claim-floor-outbox",
            Keys::Unique,
            &["mysql-claim-floor"],
            Router::new()
                .route("/v1/charges", post(mysql_claim_first))
                .with_state((mysql.pool().clone(), true, false)),
        ),
        (
            "mysql-tx-outbox",
            Keys::Unique,
            &["mysql-tx", "mysql-claim-floor-outbox"],
            Router::new()
                .route("/v1/charges", post(mysql_charge_with_event))
                .with_state(mysql_outbox)
                .layer(layer(mysql.clone())),
        ),
        (
            "mysql-tx-replay",
            Keys::Replay,
            &[
                "mysql-claim-replay-floor",
                "mysql-floor",
                "mysql-replay-floor",
            ],
            mysql_in_transaction().layer(layer(mysql.clone())),
        ),
        (
            "mysql-tx-replay-cached",
            Keys::Replay,
            &["bare", "mysql-claim-replay-floor"],
            mysql_in_transaction().layer(layer(cached_store(mysql))),
        ),
    ];
    let wanted: Option<Vec<String>> = env::var("LOAD_VARIANTS")
        .ok()
        .map(|v| v.split(',').map(|s| s.trim().to_owned()).collect());
    let wanted = |n: &str| wanted.as_ref().is_none_or(|w| w.iter().any(|x| x == n));
    // What runs: `bare`, the variants asked for, their references, and
    // those references' own (an outbox variant's reference is a variant
    // with references of its own) — unless `LOAD_REFERENCES=0`, which runs
    // only what was asked (one set of variants on two builds).
    let with_references = env::var("LOAD_REFERENCES").map_or(true, |v| v != "0");
    let mut running: Vec<&str> = vec!["bare"];
    let mut asked: Vec<&str> = variants.iter().map(|v| v.0).filter(|n| wanted(n)).collect();
    while let Some(name) = asked.pop() {
        if !running.contains(&name) {
            running.push(name);
        }
        if let Some((_, _, references, _)) = variants.iter().find(|v| v.0 == name)
            && with_references
        {
            asked.extend(references.iter().filter(|r| !running.contains(r)));
        }
    }
    let mut out = Vec::new();
    for (name, keys, references, app) in variants {
        if running.contains(&name) {
            out.push(Variant {
                name,
                keys,
                addr: serve(app).await,
                references,
                postgres: name.starts_with("pg-"),
                mysql: name.starts_with("mysql-"),
            });
        }
    }
    out
}

/// The wrk script: POST a charge, with a fresh key per request (unique) or one
/// of 64 keys (replay).
fn wrk_script(run_id: &str, keys: Keys) -> String {
    let mode = if keys == Keys::Unique {
        "unique"
    } else {
        "replay"
    };
    format!(
        r#"
local threads = 0
function setup(thread)
  threads = threads + 1
  thread:set("tid", threads)
end
wrk.method = "POST"
wrk.body = '{{"amount":1999,"currency":"eur","description":"load benchmark"}}'
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer acct_bench"
local n = 0
local statuses = {{}}
function response(status, headers, body)
  if status >= 300 then
    local seen = statuses[status] or 0
    statuses[status] = seen + 1
    if seen == 0 then
      io.stderr:write("wrk: status " .. status .. ": " .. string.sub(body, 1, 300) .. "\n")
    end
  end
end
function request()
  n = n + 1
  if "{mode}" == "unique" then
    wrk.headers["Idempotency-Key"] = "{run_id}-" .. tid .. "-" .. n
  else
    wrk.headers["Idempotency-Key"] = "replay-" .. (n % 64)
  end
  return wrk.format()
end
"#
    )
}

#[derive(Clone, Copy, Default)]
struct Run {
    rps: f64,
    p50_ms: f64,
    p99_ms: f64,
    errors: u64,
    /// CPU time of this process (the servers, not wrk or Redis) per request.
    cpu_us: f64,
}

/// PostgreSQL's own counters, read at once (the `pg_stat_*` views lag by up
/// to seconds, so they cannot be cut at a run's edges): transaction ids
/// handed out (one per transaction that wrote, committed or not), WAL bytes
/// written, and the CPU time of every `postgres` process on the machine.
#[derive(Clone, Copy, Default)]
struct PgCounters {
    xids: f64,
    wal_bytes: f64,
    cpu_us: f64,
}

async fn pg_counters(pool: &PgPool) -> PgCounters {
    let (xids, wal_bytes): (i64, i64) = sqlx::query_as(
        "SELECT txid_snapshot_xmax(txid_current_snapshot()), \
                pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')::bigint",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    PgCounters {
        xids: xids as f64,
        wal_bytes: wal_bytes as f64,
        cpu_us: cpu::processes_us("postgres"),
    }
}

/// MySQL's own counters: bytes of redo log written, and the CPU time of its
/// server processes.
#[derive(Clone, Copy, Default)]
struct MyCounters {
    redo_bytes: f64,
    cpu_us: f64,
}

async fn my_counters(pool: &MySqlPool) -> MyCounters {
    let (_, written): (String, String) =
        sqlx::query_as("SHOW GLOBAL STATUS LIKE 'Innodb_os_log_written'")
            .fetch_one(pool)
            .await
            .unwrap();
    MyCounters {
        redo_bytes: written.parse().unwrap_or(0.0),
        cpu_us: cpu::processes_us("mariadbd") + cpu::processes_us("mysqld"),
    }
}

fn wrk(variant: &Variant, run_id: &str, secs: u64, connections: u32) -> Run {
    let script = env::temp_dir().join(format!(
        "tower-idempotency-load-{}-{run_id}.lua",
        std::process::id()
    ));
    std::fs::write(&script, wrk_script(run_id, variant.keys)).unwrap();
    let output = Command::new("wrk")
        .args([
            "-t",
            "1",
            "-c",
            &connections.to_string(),
            "-d",
            &format!("{secs}s"),
        ])
        .args(["--timeout", "5s", "--latency", "-s"])
        .arg(&script)
        .arg(format!("http://{}/v1/charges", variant.addr))
        .output()
        .expect("run wrk (install it: sudo apt-get install wrk)");
    let _ = std::fs::remove_file(&script);
    // The first answer of each failing status, from the script.
    eprint!("{}", String::from_utf8_lossy(&output.stderr));
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "wrk failed: {text}");
    parse_wrk(&text)
}

/// One measured run: wrk's numbers plus this process's CPU per request.
fn measure(variant: &Variant, run_id: &str, secs: u64, connections: u32) -> Run {
    let cpu_before = cpu::own_us();
    let mut run = wrk(variant, run_id, secs, connections);
    let requests = run.rps * secs as f64;
    run.cpu_us = (cpu::own_us() - cpu_before) / requests.max(1.0);
    run
}

fn parse_wrk(text: &str) -> Run {
    let ms = |v: &str| -> f64 {
        let (num, unit) = v.split_at(v.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(v.len()));
        let n: f64 = num.parse().unwrap_or(f64::NAN);
        match unit {
            "us" => n / 1000.0,
            "ms" => n,
            "s" => n * 1000.0,
            _ => f64::NAN,
        }
    };
    let mut run = Run::default();
    for line in text.lines().map(str::trim) {
        let fields: Vec<&str> = line.split_whitespace().collect();
        match fields.as_slice() {
            ["Requests/sec:", v] => run.rps = v.parse().unwrap(),
            ["50%", v] => run.p50_ms = ms(v),
            ["99%", v] => run.p99_ms = ms(v),
            ["Non-2xx", "or", "3xx", "responses:", v] => run.errors += v.parse::<u64>().unwrap(),
            ["Socket", "errors:", rest @ ..] => {
                run.errors += rest
                    .iter()
                    .filter_map(|f| f.trim_end_matches(',').parse::<u64>().ok())
                    .sum::<u64>()
            }
            _ => {}
        }
    }
    run
}

fn print_header() {
    println!(
        "{:<20} {:>9} {:>8} {:>8} {:>7} {:>7} {:>19} {:>10} {:>6}  per request",
        "variant", "req/s", "p50 ms", "p99 ms", "x bare", "x ref", "ref", "cpu us/req", "errors"
    );
}

fn print_row(v: &Variant, run: &Run, ratio: f64, ratio_ref: f64, extra: &str) {
    println!(
        "{:<20} {:>9.0} {:>8.3} {:>8.3} {:>7.3} {:>7.3} {:>19} {:>10.1} {:>6}  {}",
        v.name,
        run.rps,
        run.p50_ms,
        run.p99_ms,
        ratio,
        ratio_ref,
        v.references[0],
        run.cpu_us,
        run.errors,
        extra
    );
}

/// What a variant costs its backing service per request.
#[derive(Clone, Copy, Default)]
struct Costs {
    my_redo_bytes: f64,
    my_cpu_us: f64,
    pg_xids: f64,
    pg_wal_bytes: f64,
    pg_cpu_us: f64,
    redis_calls: f64,
}

impl Costs {
    fn describe(&self, v: &Variant) -> String {
        if v.mysql {
            format!(
                "{:.0} redo bytes, {:.1} mysqld cpu us",
                self.my_redo_bytes, self.my_cpu_us
            )
        } else if v.postgres {
            format!(
                "{:.2} write xacts, {:.0} WAL bytes, {:.1} pg cpu us",
                self.pg_xids, self.pg_wal_bytes, self.pg_cpu_us
            )
        } else if v.name.starts_with("redis") || v.name.starts_with("valkey") {
            format!("{:.2} Redis calls", self.redis_calls)
        } else {
            String::new()
        }
    }
}

/// Every command Redis ran (`INFO commandstats`), those inside scripts too.
fn redis_calls(port: u16) -> f64 {
    tower_idempotency_harness::redis_server::command_calls(port)
        .iter()
        .filter(|(name, _)| name != "info")
        .map(|(_, calls)| *calls as f64)
        .sum()
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    }
}

fn main() {
    let number =
        |name: &str, default: u64| env::var(name).map_or(default, |v| v.parse().expect(name));
    let secs = number("LOAD_SECS", 5);
    let rounds = number("LOAD_ROUNDS", 3) as usize;
    let connections = number("LOAD_CONNECTIONS", 32) as u32;
    if Command::new("wrk").arg("--version").output().is_err() {
        panic!("wrk is not installed: sudo apt-get install wrk");
    }

    let redis = RedisServer::start();
    let valkey = RedisServer::valkey();
    let database = TestDatabase::create();
    let runtime = Arc::new(
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap(),
    );
    // One pool for every Postgres variant (one runs at a time), larger than
    // wrk's connections: in transactional mode each request holds one.
    let pool = runtime.block_on(async {
        let pool = PgPoolOptions::new()
            .max_connections(connections + 8)
            .test_before_acquire(false)
            .connect(database.url())
            .await
            .expect("connect to the benchmark's database");
        // The records table, created once for every variant.
        PostgresStore::builder()
            .create_table_if_missing()
            .with_pool(pool.clone())
            .await
            .unwrap();
        sqlx::raw_sql(
            "CREATE TABLE charges (id bigserial PRIMARY KEY, amount bigint, currency text, description text)",
        )
        .execute(&pool)
        .await
        .unwrap();
        pool
    });
    let sqlite_file = TestFile::create();
    let sqlite = runtime.block_on(async {
        let store = SqliteStore::builder()
            .transactional()
            .max_connections(connections + 8)
            .create_table_if_missing()
            .connect(&sqlite_file.url())
            .await
            .expect("open the benchmark's SQLite file");
        sqlx::raw_sql(
            "CREATE TABLE charges (id INTEGER PRIMARY KEY, amount INTEGER, currency TEXT, description TEXT)",
        )
        .execute(store.pool())
        .await
        .unwrap();
        store
    });
    let mysql_database = MySqlDatabase::create();
    let mysql = runtime.block_on(async {
        let pool = MySqlPoolOptions::new()
            .max_connections(connections + 8)
            .test_before_acquire(false)
            .connect(mysql_database.url())
            .await
            .expect("connect to the benchmark's MySQL database");
        let store = MySqlStore::builder()
            .transactional()
            .create_table_if_missing()
            .with_pool(pool)
            .await
            .unwrap();
        sqlx::raw_sql(
            "CREATE TABLE charges (id BIGINT AUTO_INCREMENT PRIMARY KEY, amount BIGINT, currency TEXT, description TEXT) ENGINE = InnoDB",
        )
        .execute(store.pool())
        .await
        .unwrap();
        store
    });
    let mysql_pool = mysql.pool().clone();
    let sqlite_pool = sqlite.pool().clone();
    let variants = runtime.block_on(start_variants(
        &redis.url(),
        &valkey.url(),
        pool.clone(),
        sqlite,
        mysql,
    ));
    let nonce = std::process::id();

    println!(
        "load: {} variants x {rounds} rounds x {secs}s, wrk 1 thread {connections} connections, server 2 tokio workers, {} cores",
        variants.len(),
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    // Warm-up: connections, caches and allocators warm; replay keys completed.
    for v in &variants {
        wrk(v, &format!("warm{nonce}"), 2, connections);
    }

    // A reference that did not run (`LOAD_REFERENCES=0`) has no ratio.
    let index = |name: &str| variants.iter().position(|v| v.name == name);
    let mut results: Vec<Vec<(Run, Costs)>> = vec![Vec::new(); variants.len()];
    for round in 1..=rounds {
        println!("\nround {round}");
        print_header();
        // Every other round in reverse, so that no variant always runs
        // after the same one (a run that writes leaves its successor a
        // larger table, a longer WAL, a busier autovacuum).
        let mut order: Vec<usize> = (0..variants.len()).collect();
        if round % 2 == 0 {
            order.reverse();
        }
        for i in order {
            let v = &variants[i];
            if v.name.starts_with("sqlite") {
                // Each SQLite run starts from an empty write-ahead log.
                runtime.block_on(async {
                    sqlx::raw_sql("PRAGMA wal_checkpoint(TRUNCATE)")
                        .execute(&sqlite_pool)
                        .await
                        .expect("checkpoint")
                });
            }
            let pg_before = runtime.block_on(pg_counters(&pool));
            let my_before = runtime.block_on(my_counters(&mysql_pool));
            // Only one variant runs at a time: the two servers' calls are
            // that variant's.
            let servers_calls = || redis_calls(redis.port()) + redis_calls(valkey.port());
            let redis_before = servers_calls();
            let run = measure(
                v,
                &format!("r{nonce}-{round}-{}", v.name),
                secs,
                connections,
            );
            let pg_after = runtime.block_on(pg_counters(&pool));
            let my_after = runtime.block_on(my_counters(&mysql_pool));
            let requests = (run.rps * secs as f64).max(1.0);
            let costs = Costs {
                my_redo_bytes: (my_after.redo_bytes - my_before.redo_bytes) / requests,
                my_cpu_us: (my_after.cpu_us - my_before.cpu_us) / requests,
                pg_xids: (pg_after.xids - pg_before.xids) / requests,
                pg_wal_bytes: (pg_after.wal_bytes - pg_before.wal_bytes) / requests,
                pg_cpu_us: (pg_after.cpu_us - pg_before.cpu_us) / requests,
                redis_calls: (servers_calls() - redis_before) / requests,
            };
            results[i].push((run, costs));
        }
        // This round's rows, in the list's order, once all have run.
        let rps_of = |name: &str| {
            index(name)
                .and_then(|i| results[i].last())
                .map_or(f64::NAN, |r| r.0.rps)
        };
        for (v, runs) in variants.iter().zip(&results) {
            let (run, costs) = runs.last().expect("ran this round");
            print_row(
                v,
                run,
                run.rps / rps_of("bare"),
                run.rps / rps_of(v.references[0]),
                &costs.describe(v),
            );
        }
    }

    println!(
        "\nmedian over {rounds} rounds (ratios: medians of the per-round ratios to bare and to the variant's reference)"
    );
    print_header();
    for (v, runs) in variants.iter().zip(&results) {
        let med = |f: &dyn Fn(&(Run, Costs)) -> f64| median(runs.iter().map(f).collect());
        let run = Run {
            rps: med(&|r| r.0.rps),
            p50_ms: med(&|r| r.0.p50_ms),
            p99_ms: med(&|r| r.0.p99_ms),
            cpu_us: med(&|r| r.0.cpu_us),
            errors: runs.iter().map(|r| r.0.errors).sum(),
        };
        let costs = Costs {
            my_redo_bytes: med(&|r| r.1.my_redo_bytes),
            my_cpu_us: med(&|r| r.1.my_cpu_us),
            pg_xids: med(&|r| r.1.pg_xids),
            pg_wal_bytes: med(&|r| r.1.pg_wal_bytes),
            pg_cpu_us: med(&|r| r.1.pg_cpu_us),
            redis_calls: med(&|r| r.1.redis_calls),
        };
        let ratio_to = |name: &str| {
            let Some(reference) = index(name).map(|i| &results[i]) else {
                return f64::NAN;
            };
            median(
                runs.iter()
                    .zip(reference)
                    .map(|(r, b)| r.0.rps / b.0.rps)
                    .collect(),
            )
        };
        print_row(
            v,
            &run,
            ratio_to("bare"),
            ratio_to(v.references[0]),
            &costs.describe(v),
        );
    }
    // Ratios to the other references.
    for (v, runs) in variants.iter().zip(&results) {
        for reference in &v.references[1..] {
            let Some(r) = variants.iter().position(|x| x.name == *reference) else {
                continue;
            };
            let ratio = median(
                runs.iter()
                    .zip(&results[r])
                    .map(|(a, b)| a.0.rps / b.0.rps)
                    .collect(),
            );
            println!(
                "{} x {reference}: {ratio:.3} (median of the per-round ratios)",
                v.name
            );
        }
    }
    let errors: u64 = results.iter().flatten().map(|r| r.0.errors).sum();
    assert_eq!(
        errors, 0,
        "some requests failed or were rejected; the numbers above are not comparable"
    );
    drop((redis, valkey));
}
