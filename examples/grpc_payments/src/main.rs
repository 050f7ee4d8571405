//! A tonic payments service whose `Charge` RPC is safe to retry.
//!
//! Run with (protoc must be installed: `apt-get install protobuf-compiler`):
//!
//! ```not_rust
//! cargo run --release -p grpc-payments
//! ```
//!
//! Charges and idempotency records live in one SQLite file,
//! `grpc_payments.db` in the working directory, in one transaction per
//! charge: exactly one charge per key, even across crashes.
//!
//! Environment, as for the HTTP payments example: `BIND_ADDR` (default
//! `127.0.0.1:50051`); `DATABASE_URL` (unset: `grpc_payments.db`;
//! `sqlite://PATH`: that file; `postgres://…`: charges and records in
//! PostgreSQL, one transaction per charge); `REDIS_URL` (set: records in
//! Redis, charges in memory); `IDEMPOTENCY_STORE=memory` (records and
//! charges in memory: nothing persisted); `PROCESSOR_LATENCY_MS` (default 0);
//! `IDEMPOTENCY_LEASE_MS` (default 30000); `IDEMPOTENCY_TTL_SECS` (default
//! 86400); `GRPC_ACCEPT_GZIP=1` (accept gzip-compressed requests: a retry
//! matches whether it is compressed or not, the layer comparing decoded
//! messages; unset, tonic refuses them with `UNIMPLEMENTED`, which is never
//! stored).
//!
//! Try it with the example's client (or any gRPC client: the service is in
//! `proto/payments.proto`):
//!
//! ```not_rust
//! # A charge: a new charge id.
//! cargo run -p grpc-payments --bin charge -- --token tok_alice --key order-42 --amount 1999
//! # The retry: the same charge id, replayed (`idempotent-replayed: true`).
//! cargo run -p grpc-payments --bin charge -- --token tok_alice --key order-42 --amount 1999
//! # Same key, other parameters: FAILED_PRECONDITION.
//! cargo run -p grpc-payments --bin charge -- --token tok_alice --key order-42 --amount 5000
//! # The account's charges (a stream, not guarded): one per key.
//! cargo run -p grpc-payments --bin charge -- --token tok_alice --list
//! ```
//!
//! With grpcurl, from this directory:
//!
//! ```not_rust
//! grpcurl -plaintext -proto proto/payments.proto -H 'authorization: Bearer tok_alice' \
//!   -H 'idempotency-key: order-42' -d '{"amount": 1999, "currency": "eur"}' \
//!   127.0.0.1:50051 payments.v1.Payments/Charge
//! ```

use std::{env, error::Error, time::Duration};

use grpc_payments::{Ledger, Settings, serve};
use tower_idempotency::{
    MemoryStore, PostgresStore, PostgresTxStore, RedisStore, SqliteStore, SqliteTxStore,
};

#[tokio::main]
async fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "grpc_payments=info,tower_idempotency=info".into()),
        )
        .init();
    let settings = settings().unwrap_or_else(|why| exit_with(&why));
    let bind = env::var("BIND_ADDR").unwrap_or_else(|_| "127.0.0.1:50051".into());
    let listener = tokio::net::TcpListener::bind(&bind)
        .await
        .unwrap_or_else(|e| exit_with(&format!("BIND_ADDR: cannot bind {bind}: {e}")));
    // The URLs may carry a password: they are never logged.
    let served = if env::var("IDEMPOTENCY_STORE").is_ok_and(|s| s == "memory") {
        tracing::info!("store: in-memory (IDEMPOTENCY_STORE=memory): nothing persisted");
        serve(
            listener,
            MemoryStore::new(),
            Ledger::Memory(Default::default()),
            &settings,
        )
        .await
    } else if let Ok(url) = env::var("REDIS_URL") {
        let store = RedisStore::builder()
            .connect(&url)
            .await
            .unwrap_or_else(|e| exit_with(&format!("REDIS_URL: {e}")));
        tracing::info!("store: Redis (REDIS_URL); charges in memory");
        serve(
            listener,
            store,
            Ledger::Memory(Default::default()),
            &settings,
        )
        .await
    } else {
        let url = env::var("DATABASE_URL");
        let url = url.as_deref().unwrap_or("sqlite://grpc_payments.db");
        if url.starts_with("sqlite:") {
            let (store, ledger) = sqlite(url).await.unwrap_or_else(|e| database(&*e));
            tracing::info!("store: SQLite, one transaction per charge ({url})");
            serve(listener, store, ledger, &settings).await
        } else if url.starts_with("postgres:") || url.starts_with("postgresql:") {
            let (store, ledger) = postgres(url).await.unwrap_or_else(|e| database(&*e));
            tracing::info!("store: PostgreSQL, one transaction per charge (DATABASE_URL)");
            serve(listener, store, ledger, &settings).await
        } else {
            exit_with(
                "DATABASE_URL must be sqlite://PATH or postgres://… (or unset: grpc_payments.db)",
            )
        }
    };
    if let Err(error) = served {
        exit_with(&format!("the server stopped: {error}"));
    }
}

/// The database in `DATABASE_URL` cannot serve: say why and stop.
fn database(error: &dyn Error) -> ! {
    exit_with(&format!("DATABASE_URL: {error}"))
}

/// Charges and records in one SQLite file (created if missing), one
/// transaction per charge.
async fn sqlite(url: &str) -> Result<(SqliteTxStore, Ledger), Box<dyn Error>> {
    let url = if url.contains('?') {
        url.to_owned()
    } else {
        format!("{url}?mode=rwc")
    };
    let store = SqliteStore::builder()
        .transactional()
        .create_table_if_missing()
        .connect(&url)
        .await?;
    let ledger = Ledger::sqlite(store.pool()).await?;
    Ok((store, ledger))
}

/// Charges and records in PostgreSQL, one transaction per charge.
async fn postgres(url: &str) -> Result<(PostgresTxStore, Ledger), Box<dyn Error>> {
    let store = PostgresStore::builder()
        .transactional()
        .create_table_if_missing()
        .connect(url)
        .await?;
    let ledger = Ledger::postgres(store.pool()).await?;
    Ok((store, ledger))
}

fn settings() -> Result<Settings, String> {
    fn number(name: &str, default: u64) -> Result<u64, String> {
        match env::var(name) {
            Err(_) => Ok(default),
            Ok(value) => value
                .parse()
                .map_err(|_| format!("{name} must be a whole number, not {value:?}")),
        }
    }
    Ok(Settings {
        processor_latency: Duration::from_millis(number("PROCESSOR_LATENCY_MS", 0)?),
        lease: Duration::from_millis(number("IDEMPOTENCY_LEASE_MS", 30_000)?),
        retention: Duration::from_secs(number("IDEMPOTENCY_TTL_SECS", 86_400)?),
        accept_gzip: env::var("GRPC_ACCEPT_GZIP").is_ok_and(|v| v == "1"),
    })
}

/// A configuration mistake: say what to fix and stop, before serving.
fn exit_with(message: &str) -> ! {
    eprintln!("grpc-payments: {message}");
    std::process::exit(2)
}
