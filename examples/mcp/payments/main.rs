//! A payments tool server for AI agents (MCP), whose `create_charge`
//! charges once per idempotency key however often an agent re-sends it.
//!
//! Run with:
//!
//! ```not_rust
//! cargo run --release --example mcp_payments
//! ```
//!
//! An rmcp Streamable HTTP server (protocol 2026-07-28, stateless) at
//! `POST /mcp`, behind tower-idempotency's MCP door. Each charge and its
//! call's stored answer commit in one transaction, in one SQLite file,
//! `mcp_payments.db` in the working directory: one charge per key, across
//! crashes and restarts.
//!
//! Tools: `create_charge` {`amount`: integer ≥ 1, `currency`: three
//! lowercase letters, `description`?} — the charge `{id, amount, currency,
//! description}` as `structuredContent`; an amount over 1 000 000 is a
//! declined card, a tool result with `isError: true` (stored: replayed,
//! never charged again); invalid arguments are a JSON-RPC `-32602` (the
//! key is released). Its key goes in `params._meta["idempotency-key"]`:
//! a call without one is refused. `list_charges` {} — `{charges: [...]}`,
//! the caller's charges, unguarded.
//!
//! `Authorization: Bearer <account>` is the tenant (none: HTTP `401`).
//!
//! Environment: `BIND_ADDR` (default `127.0.0.1:3001`; the server accepts
//! loopback `Host`s only, rmcp's default against DNS rebinding);
//! `DATABASE_URL` (unset: `mcp_payments.db`; `sqlite://PATH`: that file,
//! created if missing; `postgres://…` or `mysql://…`, an existing
//! database, with this package's `postgres` or `mysql` feature: `cargo run
//! --release -p tower-idempotency-mcp-examples --features postgres
//! --example mcp_payments`); `PROCESSOR_LATENCY_MS` (default 0: how long
//! the fake card processor takes); `IDEMPOTENCY_LEASE_MS` (default 30000:
//! how long a claim is held); `MCP_RESPONSE` (`sse`, the default: each
//! answer an SSE stream; `json`: `application/json` where the tool sends
//! nothing before its result — the door answers a guarded call with
//! `application/json` either way); `STARTUP_RETRY_S` (default 60: how long
//! a database out of reach at start-up is tried again).
//!
//! Try it:
//!
//! ```not_rust
//! call() { curl -s localhost:3001/mcp -H 'authorization: Bearer acct_alice' \
//!   -H 'content-type: application/json' -H 'accept: application/json, text/event-stream' \
//!   -H 'mcp-protocol-version: 2026-07-28' -H 'mcp-method: tools/call' -H "mcp-name: $1" -d "$2"; }
//! meta='"_meta":{"io.modelcontextprotocol/protocolVersion":"2026-07-28","io.modelcontextprotocol/clientCapabilities":{},"idempotency-key":"order-42"}'
//!
//! # The charge; then the same call re-sent with a new id: the same answer,
//! # with `idempotent-replayed: true` and the new id; one charge.
//! call create_charge '{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"create_charge","arguments":{"amount":1999,"currency":"eur"},'"$meta"'}}'
//! call create_charge '{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"create_charge","arguments":{"amount":1999,"currency":"eur"},'"$meta"'}}'
//!
//! # The same key with another amount: error -32011, nothing charged.
//! call create_charge '{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"create_charge","arguments":{"amount":5000,"currency":"eur"},'"$meta"'}}'
//! ```

mod app;
mod charges;
#[path = "../../support/startup.rs"]
mod startup;

use std::{env, time::Duration};

use axum::Router;
use tower_idempotency::SqliteStore;

use app::{Ledger, Settings, app};

#[tokio::main]
async fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "mcp_payments=info,tower_idempotency=info".into()),
        )
        .init();
    let settings = Settings {
        processor_latency: Duration::from_millis(number("PROCESSOR_LATENCY_MS", 0)),
        lease: Duration::from_millis(number("IDEMPOTENCY_LEASE_MS", 30_000)),
        json_response: match env::var("MCP_RESPONSE").as_deref() {
            Err(_) | Ok("sse") => false,
            Ok("json") => true,
            Ok(other) => exit_with(&format!("MCP_RESPONSE: {other:?} is not sse or json")),
        },
    };
    let bind_addr = env::var("BIND_ADDR").unwrap_or_else(|_| "127.0.0.1:3001".into());
    let url = env::var("DATABASE_URL").unwrap_or_else(|_| "sqlite://mcp_payments.db".into());
    // The URL may carry a password: it is never logged.
    let app = startup::retrying("DATABASE_URL", async || connect(&url, &settings).await)
        .await
        .unwrap_or_else(|e| exit_with(&format!("DATABASE_URL: {e}")));
    let listener = tokio::net::TcpListener::bind(&bind_addr)
        .await
        .unwrap_or_else(|e| exit_with(&format!("BIND_ADDR: cannot bind {bind_addr}: {e}")));
    println!("listening on http://{}", listener.local_addr().unwrap());
    axum::serve(listener, app).await.unwrap();
}

/// The store and the charges in the database at `url`, one transaction per
/// charge.
async fn connect(url: &str, settings: &Settings) -> Result<Router, Box<dyn std::error::Error>> {
    if url.starts_with("sqlite:") {
        let store = SqliteStore::builder()
            .transactional()
            .create_table_if_missing()
            .connect(url)
            .await?;
        charges::create_table(store.pool()).await?;
        tracing::info!("store: SQLite, one transaction per charge");
        let ledger = Ledger::Sqlite(store.pool().clone());
        return Ok(app(store, ledger, settings));
    }
    if url.starts_with("postgres:") || url.starts_with("postgresql:") {
        return postgres(url, settings).await;
    }
    if url.starts_with("mysql:") || url.starts_with("mariadb:") {
        return mysql(url, settings).await;
    }
    exit_with(
        "DATABASE_URL must be sqlite://PATH, postgres://… or mysql://… (or unset: mcp_payments.db)",
    )
}

#[cfg(feature = "postgres")]
async fn postgres(url: &str, settings: &Settings) -> Result<Router, Box<dyn std::error::Error>> {
    let store = tower_idempotency::PostgresStore::builder()
        .transactional()
        .create_table_if_missing()
        .connect(url)
        .await?;
    charges::create_table(store.pool()).await?;
    tracing::info!("store: PostgreSQL, one transaction per charge");
    let ledger = Ledger::Postgres(store.pool().clone());
    Ok(app(store, ledger, settings))
}

#[cfg(not(feature = "postgres"))]
async fn postgres(_: &str, _: &Settings) -> Result<Router, Box<dyn std::error::Error>> {
    exit_with(&without("postgres"))
}

#[cfg(feature = "mysql")]
async fn mysql(url: &str, settings: &Settings) -> Result<Router, Box<dyn std::error::Error>> {
    let store = tower_idempotency::MySqlStore::builder()
        .transactional()
        .create_table_if_missing()
        .connect(url)
        .await?;
    charges::create_table(store.pool()).await?;
    tracing::info!("store: MySQL, one transaction per charge");
    let ledger = Ledger::MySql(store.pool().clone());
    Ok(app(store, ledger, settings))
}

#[cfg(not(feature = "mysql"))]
async fn mysql(_: &str, _: &Settings) -> Result<Router, Box<dyn std::error::Error>> {
    exit_with(&without("mysql"))
}

/// A database this build was compiled without: the feature that brings it.
#[cfg_attr(all(feature = "postgres", feature = "mysql"), allow(dead_code))]
fn without(feature: &str) -> String {
    format!(
        "DATABASE_URL: this build has no {feature} store; build with `--features {feature}` \
         (cargo run --release -p tower-idempotency-mcp-examples --features {feature} --example mcp_payments)"
    )
}

/// A whole number from the environment, or `default`.
fn number(name: &str, default: u64) -> u64 {
    match env::var(name) {
        Err(_) => default,
        Ok(value) => value
            .parse()
            .unwrap_or_else(|_| exit_with(&format!("{name}: {value:?} is not a whole number"))),
    }
}

/// A configuration mistake: say what to fix and stop, before serving.
fn exit_with(message: &str) -> ! {
    eprintln!("mcp_payments: {message}");
    std::process::exit(2)
}
