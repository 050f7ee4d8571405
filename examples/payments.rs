//! A payments API whose `POST /v1/charges` is safe to retry.
//!
//! Run with:
//!
//! ```not_rust
//! cargo run --release --example payments
//! ```
//!
//! Environment: `BIND_ADDR` (default `127.0.0.1:3000`); `REDIS_URL` (unset: the
//! in-memory store; set: Redis); `REDIS_CLUSTER_NODES` (comma-separated
//! `redis://host:port` seeds: Redis Cluster); `PROCESSOR_LATENCY_MS` (default 0:
//! how long the fake card processor takes); `IDEMPOTENCY_LEASE_MS` (default
//! 30000); `IDEMPOTENCY_TTL_SECS` (default 86400).
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
//! ```

use std::{
    collections::HashMap,
    env,
    sync::{Arc, Mutex},
    time::Duration,
};

use axum::{
    Json, Router,
    extract::{Request, State, rejection::JsonRejection},
    http::{StatusCode, header, request::Parts},
    middleware::{self, Next},
    response::{IntoResponse, Response},
    routing::post,
};
use serde::{Deserialize, Serialize};
use tower_idempotency::{IdempotencyLayer, MemoryStore, RedisStore, store::Store};

#[tokio::main]
async fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "payments=info,tower_idempotency=info".into()),
        )
        .init();

    let settings = Settings::from_env().unwrap_or_else(|why| exit_with(&why));
    // The URLs may carry a password: they are never logged.
    let app = if let Ok(nodes) = env::var("REDIS_CLUSTER_NODES") {
        let nodes: Vec<String> = nodes.split(',').map(|n| n.trim().to_owned()).collect();
        let store = RedisStore::builder()
            .connect_cluster(nodes)
            .await
            .unwrap_or_else(|e| exit_with(&format!("REDIS_CLUSTER_NODES: {e}")));
        tracing::info!("store: Redis Cluster (REDIS_CLUSTER_NODES)");
        app(store, &settings)
    } else if let Ok(url) = env::var("REDIS_URL") {
        let store = RedisStore::builder()
            .connect(&url)
            .await
            .unwrap_or_else(|e| exit_with(&format!("REDIS_URL: {e}")));
        tracing::info!("store: Redis (REDIS_URL)");
        app(store, &settings)
    } else {
        tracing::info!("store: in-memory (set REDIS_URL for Redis)");
        app(MemoryStore::new(), &settings)
    };

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

/// The example's configuration, read from the environment.
struct Settings {
    bind_addr: String,
    processor_latency: Duration,
    lease: Duration,
    retention: Duration,
}

impl Settings {
    /// The settings, or a message that names the variable to fix.
    fn from_env() -> Result<Self, String> {
        fn number(
            name: &str,
            default: u64,
            range: std::ops::RangeInclusive<u64>,
        ) -> Result<u64, String> {
            let Ok(v) = env::var(name) else {
                return Ok(default);
            };
            v.parse().ok().filter(|n| range.contains(n)).ok_or_else(|| {
                format!(
                    "{name} must be a whole number from {} to {}, got {v:?}",
                    range.start(),
                    range.end()
                )
            })
        }
        let max_lease_ms = tower_idempotency::MAX_LEASE.as_millis() as u64;
        let max_ttl_secs = tower_idempotency::MAX_RETENTION.as_secs();
        Ok(Self {
            bind_addr: env::var("BIND_ADDR").unwrap_or_else(|_| "127.0.0.1:3000".into()),
            processor_latency: Duration::from_millis(number(
                "PROCESSOR_LATENCY_MS",
                0,
                0..=600_000,
            )?),
            lease: Duration::from_millis(number(
                "IDEMPOTENCY_LEASE_MS",
                30_000,
                30..=max_lease_ms,
            )?),
            retention: Duration::from_secs(number(
                "IDEMPOTENCY_TTL_SECS",
                86_400,
                1..=max_ttl_secs,
            )?),
        })
    }
}

/// A configuration mistake: say what to fix and stop, before serving.
fn exit_with(message: &str) -> ! {
    eprintln!("payments: {message}");
    std::process::exit(2)
}

fn app<St: Store>(store: St, settings: &Settings) -> Router {
    let idempotency = IdempotencyLayer::new(store)
        .require_key(true)
        .scope_with(|parts: &Parts| parts.extensions.get::<Account>().map(|a| a.0.clone()))
        .lease(settings.lease)
        .retention(settings.retention);
    let state = AppState {
        charges: Arc::default(),
        processor_latency: settings.processor_latency,
    };
    Router::new()
        .route("/v1/charges", post(create_charge).get(list_charges))
        .layer(idempotency)
        // Outermost: authenticate first, so the account is the idempotency scope.
        .layer(middleware::from_fn(authenticate))
        .with_state(state)
}

#[derive(Clone)]
struct AppState {
    charges: Arc<Mutex<HashMap<String, Vec<Charge>>>>,
    processor_latency: Duration,
}

/// The authenticated account: the bearer token names it.
#[derive(Clone)]
struct Account(String);

async fn authenticate(mut request: Request, next: Next) -> Response {
    let account = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
        .filter(|token| !token.is_empty());
    match account {
        Some(token) => {
            let account = Account(token.to_owned());
            request.extensions_mut().insert(account);
            next.run(request).await
        }
        None => problem(
            StatusCode::UNAUTHORIZED,
            "Unauthorized",
            "Send `Authorization: Bearer <token>`; the token names your account.",
        ),
    }
}

#[derive(Deserialize)]
struct NewCharge {
    amount: i64,
    currency: String,
    description: Option<String>,
}

#[derive(Clone, Serialize)]
struct Charge {
    id: String,
    account: String,
    amount: i64,
    currency: String,
    description: Option<String>,
}

async fn create_charge(
    State(state): State<AppState>,
    axum::Extension(Account(account)): axum::Extension<Account>,
    body: Result<Json<NewCharge>, JsonRejection>,
) -> Response {
    let new = match body {
        Ok(Json(new)) => new,
        Err(rejection) => {
            return problem(
                StatusCode::BAD_REQUEST,
                "Invalid charge",
                &rejection.body_text(),
            );
        }
    };
    if new.amount <= 0 {
        return problem(
            StatusCode::BAD_REQUEST,
            "Invalid charge",
            "`amount` must be a positive integer.",
        );
    }
    if new.currency.len() != 3 || !new.currency.bytes().all(|b| b.is_ascii_alphabetic()) {
        return problem(
            StatusCode::BAD_REQUEST,
            "Invalid charge",
            "`currency` must be 3 letters.",
        );
    }
    // The card processor.
    tokio::time::sleep(state.processor_latency).await;
    let charge = Charge {
        id: format!("ch_{}", fastrand_id()),
        account: account.clone(),
        amount: new.amount,
        currency: new.currency.to_ascii_lowercase(),
        description: new.description,
    };
    state
        .charges
        .lock()
        .unwrap()
        .entry(account)
        .or_default()
        .push(charge.clone());
    let location = format!("/v1/charges/{}", charge.id);
    (
        StatusCode::CREATED,
        [(header::LOCATION, location)],
        Json(charge),
    )
        .into_response()
}

async fn list_charges(
    State(state): State<AppState>,
    axum::Extension(Account(account)): axum::Extension<Account>,
) -> Json<Vec<Charge>> {
    let charges = state.charges.lock().unwrap();
    Json(charges.get(&account).cloned().unwrap_or_default())
}

fn fastrand_id() -> String {
    std::iter::repeat_with(fastrand::alphanumeric)
        .take(24)
        .collect()
}

/// An RFC 9457 problem, members in the RFC's order.
#[derive(Serialize)]
struct Problem<'a> {
    r#type: &'a str,
    title: &'a str,
    status: u16,
    detail: &'a str,
}

fn problem(status: StatusCode, title: &str, detail: &str) -> Response {
    let body = Problem {
        r#type: "about:blank",
        title,
        status: status.as_u16(),
        detail,
    };
    let body = serde_json::to_string(&body).expect("a problem serialises");
    (
        status,
        [(header::CONTENT_TYPE, "application/problem+json")],
        body,
    )
        .into_response()
}
