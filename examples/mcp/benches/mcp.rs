//! The MCP door's cost: the example's `create_charge` through the door
//! (first executions, then replays) against the same rmcp server without
//! it, side by side in each round, on SQLite files of their own — and,
//! with the `postgres` feature, on PostgreSQL databases of their own.
//! First, the door over the memory store with each charge committed on
//! its own, as the bare server commits it: the door's own cost.
//!
//! ```not_rust
//! cargo bench -p tower-idempotency-mcp-examples --features postgres --bench mcp
//! ```
//!
//! `MCP_ROUNDS` (default 3), `MCP_SECS` per variant and round (default 3),
//! `MCP_CONCURRENCY` calls in flight (default 4). Calls go through the
//! router in process (no sockets), so the figures are the door's and the
//! server's work. Every answer is checked: a refusal or an error stops
//! the run.

#[path = "../payments/app.rs"]
#[allow(dead_code)]
mod app;
#[path = "../payments/charges.rs"]
mod charges;

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use axum::{Router, body::Body};
use http_body_util::BodyExt;
use serde_json::{Value, json};
use tower::ServiceExt;
use tower_idempotency::SqliteStore;
use tower_idempotency_harness::sqlite::TestFile;

use app::{Ledger, Settings};

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn settings() -> Settings {
    Settings {
        processor_latency: Duration::ZERO,
        lease: Duration::from_secs(30),
        json_response: false,
    }
}

/// Charges in `file`, each committed on its own.
async fn sqlite_charges(file: &TestFile) -> Ledger {
    let pool = tower_idempotency::sqlx::SqlitePool::connect(&file.url())
        .await
        .unwrap();
    charges::create_table(&pool).await.unwrap();
    Ledger::Sqlite(pool)
}

/// The door over the memory store, each charge committed on its own in a
/// SQLite file: the door's own cost, beside the bare server's.
async fn on_memory() -> (Router, Router, Box<dyn std::any::Any>) {
    let (door_file, bare_file) = (TestFile::create(), TestFile::create());
    let door = app::app_on_leases(
        tower_idempotency::MemoryStore::new(),
        sqlite_charges(&door_file).await,
        &settings(),
    );
    let bare = app::bare(sqlite_charges(&bare_file).await, &settings());
    (door, bare, Box::new((door_file, bare_file)))
}

/// The server with the door and without it, on SQLite files of their own.
async fn on_sqlite() -> (Router, Router, Box<dyn std::any::Any>) {
    let (door_file, bare_file) = (TestFile::create(), TestFile::create());
    let store = SqliteStore::builder()
        .transactional()
        .create_table_if_missing()
        .connect(&door_file.url())
        .await
        .unwrap();
    charges::create_table(store.pool()).await.unwrap();
    let ledger = Ledger::Sqlite(store.pool().clone());
    let door = app::app(store, ledger, &settings());
    let bare = app::bare(sqlite_charges(&bare_file).await, &settings());
    (door, bare, Box::new((door_file, bare_file)))
}

/// The server with the door and without it, on PostgreSQL databases of
/// their own.
#[cfg(feature = "postgres")]
async fn on_postgres() -> (Router, Router, Box<dyn std::any::Any>) {
    use tower_idempotency_harness::postgres::TestDatabase;

    let (door_db, bare_db) = (TestDatabase::create(), TestDatabase::create());
    let store = tower_idempotency::PostgresStore::builder()
        .transactional()
        .create_table_if_missing()
        .connect(door_db.url())
        .await
        .unwrap();
    charges::create_table(store.pool()).await.unwrap();
    let ledger = Ledger::Postgres(store.pool().clone());
    let door = app::app(store, ledger, &settings());
    let pool = tower_idempotency::sqlx::PgPool::connect(bare_db.url())
        .await
        .unwrap();
    charges::create_table(&pool).await.unwrap();
    let bare = app::bare(Ledger::Postgres(pool), &settings());
    (door, bare, Box::new((door_db, bare_db)))
}

/// One `create_charge` call under `key`, as a 2026-07-28 client sends it.
fn call(id: u64, key: &str) -> http::Request<Body> {
    let body = json!({
        "jsonrpc": "2.0",
        "id": id,
        "method": "tools/call",
        "params": {
            "name": "create_charge",
            "arguments": {"amount": 1999, "currency": "eur", "description": "bench"},
            "_meta": {
                "io.modelcontextprotocol/protocolVersion": "2026-07-28",
                "io.modelcontextprotocol/clientCapabilities": {},
                "idempotency-key": key,
            },
        },
    });
    http::Request::post("/mcp")
        .header("host", "127.0.0.1")
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream")
        .header("mcp-protocol-version", "2026-07-28")
        .header("mcp-method", "tools/call")
        .header("mcp-name", "create_charge")
        .header("authorization", "Bearer acct_bench")
        .body(Body::from(body.to_string()))
        .unwrap()
}

/// Sends one call and checks that it was answered with a charge.
async fn send(router: &Router, request: http::Request<Body>) {
    let response = router.clone().oneshot(request).await.unwrap();
    assert_eq!(response.status(), 200);
    let body = response.into_body().collect().await.unwrap().to_bytes();
    let text = std::str::from_utf8(&body).unwrap();
    let message: Value = text
        .lines()
        .filter_map(|line| line.strip_prefix("data:"))
        .find_map(|data| serde_json::from_str(data.trim()).ok())
        .or_else(|| serde_json::from_str(text).ok())
        .unwrap_or_else(|| panic!("no message: {text}"));
    assert!(
        message["result"]["structuredContent"]["id"].is_string(),
        "not a charge: {message}"
    );
}

/// Calls per second for `secs` with `concurrency` in flight; `key` names
/// each call's key from a sequence number.
async fn rate(router: &Router, secs: u64, concurrency: u64, key: fn(u64) -> String) -> f64 {
    let sequence = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let until = started + Duration::from_secs(secs);
    let workers: Vec<_> = (0..concurrency)
        .map(|_| {
            let router = router.clone();
            let sequence = sequence.clone();
            tokio::spawn(async move {
                let mut done = 0u64;
                while Instant::now() < until {
                    let n = sequence.fetch_add(1, Ordering::Relaxed);
                    send(&router, call(n, &key(n))).await;
                    done += 1;
                }
                done
            })
        })
        .collect();
    let mut calls = 0;
    for worker in workers {
        calls += worker.await.unwrap();
    }
    calls as f64 / started.elapsed().as_secs_f64()
}

static ROUND: AtomicU64 = AtomicU64::new(0);

/// Keys the replays cycle through, executed once before the rounds.
const REPLAY_KEYS: u64 = 256;

fn first_key(n: u64) -> String {
    format!("first-{}-{n}", ROUND.load(Ordering::Relaxed))
}

fn replay_key(n: u64) -> String {
    format!("replay-{}", n % REPLAY_KEYS)
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let rounds = env("MCP_ROUNDS", 3);
    let secs = env("MCP_SECS", 3);
    let concurrency = env("MCP_CONCURRENCY", 4);
    println!("rounds {rounds}, {secs} s each, {concurrency} in flight; calls/s");
    let memory = on_memory().await;
    run(
        "memory (the door's own cost)",
        memory,
        rounds,
        secs,
        concurrency,
    )
    .await;
    let sqlite = on_sqlite().await;
    run("sqlite", sqlite, rounds, secs, concurrency).await;
    #[cfg(feature = "postgres")]
    {
        let postgres = on_postgres().await;
        run("postgres", postgres, rounds, secs, concurrency).await;
    }
    #[cfg(not(feature = "postgres"))]
    println!("postgres: not built (--features postgres)");
}

async fn run(
    store: &str,
    (door, bare, _databases): (Router, Router, Box<dyn std::any::Any>),
    rounds: u64,
    secs: u64,
    concurrency: u64,
) {
    for n in 0..REPLAY_KEYS {
        send(&door, call(n, &replay_key(n))).await;
    }
    println!("{store}");
    println!("round  bare  door-first  door-replay  first/bare  replay/bare  replay/first");
    let (mut firsts, mut replays, mut replay_vs_first) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..rounds {
        ROUND.store(round, Ordering::Relaxed);
        let bare_rate = rate(&bare, secs, concurrency, first_key).await;
        let first = rate(&door, secs, concurrency, first_key).await;
        let replay = rate(&door, secs, concurrency, replay_key).await;
        println!(
            "{round:>5}  {bare_rate:>4.0}  {first:>10.0}  {replay:>11.0}  {:>10.3}  {:>11.3}  {:>12.3}",
            first / bare_rate,
            replay / bare_rate,
            replay / first
        );
        firsts.push(first / bare_rate);
        replays.push(replay / bare_rate);
        replay_vs_first.push(replay / first);
    }
    println!(
        "{store} median  first/bare {:.3}×  replay/bare {:.3}×  replay/first {:.3}×",
        median(&mut firsts),
        median(&mut replays),
        median(&mut replay_vs_first)
    );
}
