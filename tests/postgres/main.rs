//! The PostgreSQL stores on a real PostgreSQL: the transactional store's
//! semantics (the handler's writes and the record commit together or not
//! at all, counted in rows of the handler's own table), outages in both
//! stores (the network to the database cut or stalled by a relay, an
//! exhausted pool, a blocked claim), and crashes of the example process
//! (kill -9, SIGSTOP). The behaviour cases run on both stores in
//! `behaviour/`.

// The suite runs against every store: `cargo test --all-features`.
#![cfg(every_store)]

#[path = "../support/mod.rs"]
mod support;

mod outages;
mod startup;
mod transactional;

use std::time::Duration;

use axum::{
    Router,
    extract::{Query, State},
    http::StatusCode,
    routing::post,
};
use tower_idempotency::{
    IdempotencyLayer, PostgresStore, PostgresTx, PostgresTxStore,
    sqlx::{self, PgPool},
};

use support::postgres::TestDatabase;

pub(crate) const CHARGE: &str = r#"{"amount":1999,"currency":"eur"}"#;

/// The request's transaction, as handlers take it.
pub(crate) type Tx = tower_idempotency::IdempotentTx<PostgresTx>;

pub(crate) async fn transactional(db: &TestDatabase) -> PostgresTxStore {
    let store = PostgresStore::builder()
        .transactional()
        .create_table_if_missing()
        .connect(db.url())
        .await
        .expect("connect to the test database");
    sqlx::raw_sql("CREATE TABLE charges (id serial PRIMARY KEY, note text)")
        .execute(store.pool())
        .await
        .unwrap();
    store
}

#[derive(serde::Deserialize)]
pub(crate) struct Params {
    #[serde(default)]
    ms: u64,
    #[serde(default = "created")]
    status: u16,
}

fn created() -> u16 {
    201
}

pub(crate) async fn insert(tx: &mut Tx) {
    sqlx::query("INSERT INTO charges (note) VALUES ('charged')")
        .execute(&mut **tx)
        .await
        .expect("insert the charge");
}

/// Inserts a charge in the request's transaction, waits `ms`, answers
/// `status` with the number of charges it sees.
pub(crate) async fn charge(mut tx: Tx, Query(p): Query<Params>) -> (StatusCode, String) {
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

pub(crate) fn app(store: PostgresTxStore) -> Router {
    let pool = store.pool().clone();
    Router::new()
        .route("/charges", post(charge))
        .route("/panics", post(panics))
        .route("/leaks", post(leaks))
        .route("/loses-its-connection", post(loses_its_connection))
        .layer(IdempotencyLayer::new(store).single_tenant())
        .with_state(pool)
}

pub(crate) const CHARGES: &str = "SELECT count(*) FROM charges";

pub(crate) async fn charges(db: &TestDatabase) -> i64 {
    db.count(CHARGES).await
}

/// Sessions of the test database that sit idle inside a transaction.
pub(crate) const IDLE_IN_TRANSACTION: &str = "SELECT count(*) FROM pg_stat_activity \
     WHERE datname = current_database() AND state = 'idle in transaction'";

/// Transactions that inserted a charge and have not committed it.
pub(crate) const UNCOMMITTED_CHARGES: &str = "SELECT count(*) FROM pg_stat_activity \
     WHERE datname = current_database() AND state = 'idle in transaction' \
     AND query LIKE 'INSERT INTO charges%'";
