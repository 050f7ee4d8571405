//! A payments API whose `POST /v1/charges` is safe to retry.
//!
//! Run with:
//!
//! ```not_rust
//! cargo run --release --example payments
//! ```
//!
//! Charges and idempotency records live in one SQLite file, `payments.db` in
//! the working directory, in one transaction per charge: exactly one charge
//! per key, even across crashes and restarts — with nothing to install.
//!
//! SQLite is built in; every other store is a feature of this package
//! (`postgres`, `mysql`, `redis`, `dynamodb`: `cargo run --release -p
//! tower-idempotency-http-examples --features postgres --example
//! payments`), and a build without it, started on that store, exits naming
//! it.
//!
//! Environment: `BIND_ADDR` (default `127.0.0.1:3000`); `DATABASE_URL`
//! (unset: `payments.db`; `sqlite://PATH`: that file, created if missing;
//! `postgres://…` or `mysql://…` (MySQL or MariaDB), an existing database:
//! charges and records there, one transaction per charge); `REDIS_URL` (Redis or Valkey; set: records there; charges in the
//! `DATABASE_URL` database if set, else in memory, committed on their own —
//! the crash window the SQL stores close); `REDIS_CLUSTER_NODES`
//! (comma-separated `redis://host:port` seeds: Redis Cluster, likewise);
//! `DOWNSTREAM_KEY` (default `on`: with Redis, each charge carries its
//! idempotency key under a unique constraint, so a second execution finds
//! the first charge; `off` measures the window it closes);
//! `DYNAMODB_TABLE` (with the `dynamodb` feature: records in that DynamoDB
//! table, through the AWS environment — credentials, region,
//! `AWS_ENDPOINT_URL` — each charge an item of `<table>_charges` written
//! in the request's own `TransactWriteItems`; the tables are created if
//! missing);
//! `IDEMPOTENCY_STORE=memory` (records and charges in memory: nothing
//! persisted); `STARTUP_RETRY_S` (default 60: how long a store out of
//! reach at start-up is connected to again, with back-off, before the
//! example exits 2 — a configuration mistake exits at once);
//! `OUTBOX_DESTINATION` (a SQL store only: each execution
//! enqueues `charge.created` for that destination — a queue URL, a
//! subject, a queue name — in the charge's own transaction, into the
//! outbox table `idempotency_outbox`; the `outbox_relay` example of
//! `examples/consumers` publishes it); `PROCESSOR_LATENCY_MS` (default 0:
//! how long the fake card processor takes); `IDEMPOTENCY_LEASE_MS` (default
//! 30000); `IDEMPOTENCY_TTL_SECS` (default 86400); `REQUEST_TIMEOUT_MS`
//! (default 10000); `IDEMPOTENCY_TX_TIMEOUT_MS` (default 30000: how long a
//! charge's transaction may sit idle before PostgreSQL or MySQL ends it,
//! which bounds how long a paused or cut-off instance holds a key); `IDEMPOTENCY_DOCS_URL`
//! (where the API's idempotency policy is published: every rejection links
//! to it); `ADMIN_TOKEN` (set: the operators' routes shown below, behind
//! `Authorization: Bearer <ADMIN_TOKEN>`; unset: they are `404`).
//!
//! Layers, outermost first: tracing (logs each response with its idempotency
//! outcome), compression, a request timeout, authentication, then the
//! idempotency layer on the charges route. Compression sits outside, so the
//! stored response is the uncompressed one and each retry gets the encoding
//! it asked for. The timeout sits outside too: when it fires the client gets
//! `408`, while the handler, detached from the connection, still finishes and
//! its response is stored; the retry receives it.
//!
//! Prometheus metrics of the idempotency layer are served at `GET /metrics`,
//! and the API's OpenAPI description, with the idempotency contract on the
//! charge route (`tower_idempotency::openapi`), at `GET /openapi.json`.
//!
//! Try it:
//!
//! ```not_rust
//! # First call: 201, a new charge.
//! curl -i -X POST localhost:3000/v1/charges -H 'authorization: Bearer acct_alice' \
//!   -H 'idempotency-key: order-42' -H 'content-type: application/json' \
//!   -d '{"amount": 1999, "currency": "eur", "description": "order 42"}'
//!
//! # Retry (same key, same parameters, any JSON formatting): the same charge,
//! # replayed with `idempotent-replayed: true`; no second execution.
//! curl -i -X POST localhost:3000/v1/charges -H 'authorization: Bearer acct_alice' \
//!   -H 'idempotency-key: order-42' -H 'content-type: application/json' \
//!   -d '{"description": "order 42", "currency": "eur", "amount": 1999}'
//!
//! # Same key, different parameters: 422 problem+json.
//! curl -i -X POST localhost:3000/v1/charges -H 'authorization: Bearer acct_alice' \
//!   -H 'idempotency-key: order-42' -H 'content-type: application/json' \
//!   -d '{"amount": 5000, "currency": "eur"}'
//!
//! # Conflict: while a first call is still running, its duplicate gets 409 with
//! # Retry-After. Start the server with PROCESSOR_LATENCY_MS=5000 and run twice at once:
//! for i in 1 2; do curl -s -X POST localhost:3000/v1/charges -H 'authorization: Bearer acct_alice' \
//!   -H 'idempotency-key: order-43' -H 'content-type: application/json' \
//!   -d '{"amount": 100, "currency": "usd"}' & done; wait
//!
//! # The account's charges: one per execution.
//! curl -s localhost:3000/v1/charges -H 'authorization: Bearer acct_alice'
//!
//! # The processor's webhook, keyed by the event's id in the body (no token):
//! # a redelivery gets the stored answer, the event is recorded once.
//! for i in 1 2 3; do curl -s -X POST localhost:3000/v1/webhooks/processor \
//!   -H 'content-type: application/json' -d '{"id": "evt_1", "type": "charge.succeeded"}'; done
//! curl -s localhost:3000/v1/webhooks/processor
//!
//! # What the layer decided, as Prometheus counters.
//! curl -s localhost:3000/metrics | grep idempotency_
//!
//! # Operators (start with ADMIN_TOKEN=s3cret): what happened to acct_alice's
//! # order-42, then forget it so the next request with it executes again.
//! curl -s localhost:3000/admin/idempotency/acct_alice/order-42 -H 'authorization: Bearer s3cret'
//! curl -i -X DELETE localhost:3000/admin/idempotency/acct_alice/order-42 -H 'authorization: Bearer s3cret'
//! ```

mod admin;
mod app;
#[cfg(feature = "dynamodb")]
mod dynamo;
mod ledger;
mod openapi;
#[path = "../../support/startup.rs"]
mod startup;

use std::{env, sync::Arc};

use axum::{Router, routing::get};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
#[cfg(feature = "redis")]
use tower_idempotency::RedisStore;
use tower_idempotency::{
    MemoryStore, SqliteStore, SqliteTxStore, outbox::Outbox, store::sql::Dialect,
};
#[cfg(feature = "mysql")]
use tower_idempotency::{MySqlStore, MySqlTxStore};
#[cfg(feature = "postgres")]
use tower_idempotency::{PostgresStore, PostgresTxStore};

use app::{Emit, Settings, app};
use ledger::{Charges, create_tables};

/// Where the example keeps charges and records, from the environment.
#[derive(Clone)]
enum Database {
    Sqlite(String),
    #[cfg(feature = "postgres")]
    Postgres(String),
    #[cfg(feature = "mysql")]
    MySql(String),
}

impl Database {
    fn from_env() -> Result<Self, String> {
        match env::var("DATABASE_URL") {
            Err(_) => Ok(Self::Sqlite("sqlite://payments.db".into())),
            Ok(url) if url.starts_with("sqlite:") => Ok(Self::Sqlite(url)),
            Ok(url) if url.starts_with("postgres:") || url.starts_with("postgresql:") => {
                #[cfg(feature = "postgres")]
                return Ok(Self::Postgres(url));
                #[cfg(not(feature = "postgres"))]
                Err(without("DATABASE_URL=postgres://…", "postgres"))
            }
            Ok(url) if url.starts_with("mysql:") || url.starts_with("mariadb:") => {
                #[cfg(feature = "mysql")]
                return Ok(Self::MySql(url.replacen("mariadb:", "mysql:", 1)));
                #[cfg(not(feature = "mysql"))]
                Err(without("DATABASE_URL=mysql://…", "mysql"))
            }
            Ok(_) => Err(
                "DATABASE_URL must be sqlite://PATH, postgres://… or mysql://… (or unset: payments.db)"
                    .into(),
            ),
        }
    }
}

#[tokio::main]
async fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "payments=info,tower_idempotency=info".into()),
        )
        .init();

    let settings = Settings::from_env().unwrap_or_else(|why| exit_with(&why));
    let database = Database::from_env().unwrap_or_else(|why| exit_with(&why));
    let dynamodb_table = env::var("DYNAMODB_TABLE").ok();
    if dynamodb_table.is_some() && settings.outbox_destination.is_some() {
        exit_with(
            "OUTBOX_DESTINATION needs a SQL DATABASE_URL: the outbox is a table of a SQL database",
        );
    }
    let lease_store = env::var("IDEMPOTENCY_STORE").is_ok_and(|s| s == "memory")
        || env::var("REDIS_URL").is_ok()
        || env::var("REDIS_CLUSTER_NODES").is_ok();
    if lease_store && settings.outbox_destination.is_some() {
        exit_with(
            "OUTBOX_DESTINATION needs the charge's own transaction: a SQL DATABASE_URL, \
             without REDIS_URL, REDIS_CLUSTER_NODES or IDEMPOTENCY_STORE=memory",
        );
    }
    // The URLs may carry a password: they are never logged.
    let app = if env::var("IDEMPOTENCY_STORE").is_ok_and(|s| s == "memory") {
        tracing::info!("store: in-memory (IDEMPOTENCY_STORE=memory): nothing persisted");
        app(
            MemoryStore::new(),
            Charges::Memory(Arc::default()),
            &settings,
        )
    } else if let Some(table) = dynamodb_table {
        dynamodb(&table, &settings).await
    } else if env::var("REDIS_CLUSTER_NODES").is_ok() || env::var("REDIS_URL").is_ok() {
        redis(&settings).await
    } else {
        startup::retrying("DATABASE_URL", async || {
            transactional(database.clone(), &settings).await
        })
        .await
        .unwrap_or_else(|e| exit_with(&format!("DATABASE_URL: {e}")))
    };

    // The store's latency as a histogram with buckets, so dashboards and
    // alerts (contrib/) aggregate it across instances.
    let metrics = PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full("idempotency_store_duration_seconds".into()),
            &[
                0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
            ],
        )
        .unwrap_or_else(|e| exit_with(&format!("metric buckets: {e}")))
        .install_recorder()
        .unwrap_or_else(|e| exit_with(&format!("cannot install the metrics recorder: {e}")));
    let app = app.route("/metrics", get(move || async move { metrics.render() }));

    let listener = tokio::net::TcpListener::bind(&settings.bind_addr)
        .await
        .unwrap_or_else(|e| {
            exit_with(&format!(
                "BIND_ADDR: cannot bind {}: {e}",
                settings.bind_addr
            ))
        });
    println!("listening on http://{}", listener.local_addr().unwrap());
    axum::serve(listener, app).await.unwrap();
}

/// Charges and records in DynamoDB, one `TransactWriteItems` per charge.
#[cfg(feature = "dynamodb")]
async fn dynamodb(table: &str, settings: &Settings) -> Router {
    dynamo::service(table, settings)
        .await
        .unwrap_or_else(|e| exit_with(&format!("DYNAMODB_TABLE: {e}")))
}

#[cfg(not(feature = "dynamodb"))]
async fn dynamodb(_: &str, _: &Settings) -> Router {
    exit_with(&without("DYNAMODB_TABLE", "dynamodb"))
}

/// Records in Redis, or Redis Cluster (`REDIS_CLUSTER_NODES`); charges
/// beside them, committed on their own.
#[cfg(feature = "redis")]
async fn redis(settings: &Settings) -> Router {
    let store = if let Ok(nodes) = env::var("REDIS_CLUSTER_NODES") {
        let nodes: Vec<String> = nodes.split(',').map(|n| n.trim().to_owned()).collect();
        let store = startup::retrying("REDIS_CLUSTER_NODES", async || {
            Ok(RedisStore::builder().connect_cluster(nodes.clone()).await?)
        })
        .await
        .unwrap_or_else(|e| exit_with(&format!("REDIS_CLUSTER_NODES: {e}")));
        tracing::info!("store: Redis Cluster (REDIS_CLUSTER_NODES)");
        store
    } else {
        let url = env::var("REDIS_URL").unwrap_or_default();
        let store = startup::retrying("REDIS_URL", async || {
            Ok(RedisStore::builder().connect(&url).await?)
        })
        .await
        .unwrap_or_else(|e| exit_with(&format!("REDIS_URL: {e}")));
        tracing::info!("store: Redis (REDIS_URL)");
        store
    };
    app(store, charges_apart().await, settings)
}

#[cfg(not(feature = "redis"))]
async fn redis(_: &Settings) -> Router {
    exit_with(&without("REDIS_URL or REDIS_CLUSTER_NODES", "redis"))
}

/// A store this build was compiled without: the feature that brings it,
/// and the command that builds it.
#[cfg_attr(
    all(
        feature = "postgres",
        feature = "mysql",
        feature = "redis",
        feature = "dynamodb"
    ),
    allow(dead_code)
)]
fn without(setting: &str, feature: &str) -> String {
    format!(
        "{setting}: this build has no {feature} store; build with `--features {feature}` \
         (cargo run --release -p tower-idempotency-http-examples --features {feature} --example payments)"
    )
}

/// A configuration mistake: say what to fix and stop, before serving.
fn exit_with(message: &str) -> ! {
    eprintln!("payments: {message}");
    std::process::exit(2)
}

/// The outbox `charge.created` goes through, when `OUTBOX_DESTINATION` is
/// set: its table beside the records.
macro_rules! emit {
    ($store:expr, $settings:expr) => {
        match &$settings.outbox_destination {
            Some(destination) => {
                let outbox = Outbox::on(&$store).create_table_if_missing().build().await?;
                tracing::info!(%destination, "charge.created enqueued in the outbox (OUTBOX_DESTINATION)");
                Some(Emit {
                    outbox,
                    destination: destination.as_str().into(),
                })
            }
            None => None,
        }
    };
}

fn with_outbox<D: Dialect>(app: Router, emit: Option<Emit<D>>) -> Router {
    match emit {
        Some(emit) => app.layer(axum::Extension(emit)),
        None => app,
    }
}

/// Charges and records in one database, one transaction per charge.
async fn transactional(
    database: Database,
    settings: &Settings,
) -> Result<Router, Box<dyn std::error::Error>> {
    Ok(match database {
        Database::Sqlite(url) => {
            let store = SqliteStore::builder()
                .transactional()
                .create_table_if_missing()
                .connect(&url)
                .await?;
            create_tables(store.pool()).await?;
            tracing::info!("store: SQLite, one transaction per charge ({url})");
            let charges = Charges::Sqlite(store.pool().clone());
            let emit = emit!(store, settings);
            with_outbox(app::<SqliteTxStore>(store, charges, settings), emit)
        }
        #[cfg(feature = "postgres")]
        Database::Postgres(url) => {
            let store = PostgresStore::builder()
                .transactional()
                .transaction_timeout(settings.transaction_timeout)
                .create_table_if_missing()
                .connect(&url)
                .await?;
            create_tables(store.pool()).await?;
            tracing::info!("store: PostgreSQL, one transaction per charge (DATABASE_URL)");
            let charges = Charges::Postgres(store.pool().clone());
            let emit = emit!(store, settings);
            with_outbox(app::<PostgresTxStore>(store, charges, settings), emit)
        }
        #[cfg(feature = "mysql")]
        Database::MySql(url) => {
            let store = MySqlStore::builder()
                .transactional()
                .transaction_timeout(settings.transaction_timeout)
                .create_table_if_missing()
                .connect(&url)
                .await?;
            create_tables(store.pool()).await?;
            tracing::info!("store: MySQL, one transaction per charge (DATABASE_URL)");
            let charges = Charges::MySql(store.pool().clone());
            let emit = emit!(store, settings);
            with_outbox(app::<MySqlTxStore>(store, charges, settings), emit)
        }
    })
}

/// Where charges live beside a Redis store: the `DATABASE_URL` database if
/// set (committed on their own), else memory.
#[cfg(feature = "redis")]
async fn charges_apart() -> Charges {
    use tower_idempotency::sqlx;

    if env::var("DATABASE_URL").is_err() {
        return Charges::Memory(Arc::default());
    }
    let charges = async || {
        Ok::<_, Box<dyn std::error::Error>>(match Database::from_env()? {
            Database::Sqlite(url) => {
                let options = url
                    .parse::<sqlx::sqlite::SqliteConnectOptions>()?
                    .create_if_missing(true);
                let pool = sqlx::SqlitePool::connect_with(options).await?;
                create_tables(&pool).await?;
                Charges::Sqlite(pool)
            }
            #[cfg(feature = "postgres")]
            Database::Postgres(url) => {
                let pool = sqlx::PgPool::connect(&url).await?;
                create_tables(&pool).await?;
                Charges::Postgres(pool)
            }
            #[cfg(feature = "mysql")]
            Database::MySql(url) => {
                let pool = sqlx::MySqlPool::connect(&url).await?;
                create_tables(&pool).await?;
                Charges::MySql(pool)
            }
        })
    };
    startup::retrying("DATABASE_URL", async || charges().await)
        .await
        .unwrap_or_else(|e| exit_with(&format!("DATABASE_URL: {e}")))
}
