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
//! 30000); `IDEMPOTENCY_TTL_SECS` (default 86400); `REQUEST_TIMEOUT_MS`
//! (default 10000).
//!
//! Layers, outermost first: tracing (logs each response with its idempotency
//! outcome), compression, a request timeout, authentication, then the
//! idempotency layer on the charges route. Compression sits outside, so the
//! stored response is the uncompressed one and each retry gets the encoding
//! it asked for. The timeout sits outside too: when it fires the client gets
//! `408`, while the handler, detached from the connection, still finishes and
//! its response is stored; the retry receives it.
//!
//! Prometheus metrics of the idempotency layer are served at `GET /metrics`.
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
//! # What the layer decided, as Prometheus counters.
//! curl -s localhost:3000/metrics | grep idempotency_
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
    routing::{get, post},
};
use metrics_exporter_prometheus::PrometheusBuilder;
use serde::{Deserialize, Serialize};
use tower::ServiceBuilder;
use tower_http::{compression::CompressionLayer, timeout::TimeoutLayer, trace::TraceLayer};
use tower_idempotency::{
    IdempotencyLayer, IdempotencyOutcome, MemoryStore, Problem, RedisStore, store::Store,
};

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

    let metrics = PrometheusBuilder::new()
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

/// The example's configuration, read from the environment.
struct Settings {
    bind_addr: String,
    processor_latency: Duration,
    lease: Duration,
    retention: Duration,
    request_timeout: Duration,
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
            request_timeout: Duration::from_millis(number(
                "REQUEST_TIMEOUT_MS",
                10_000,
                1..=3_600_000,
            )?),
        })
    }
}

/// A configuration mistake: say what to fix and stop, before serving.
fn exit_with(message: &str) -> ! {
    eprintln!("payments: {message}");
    std::process::exit(2)
}

/// The service, without the `/metrics` route (its recorder is global, so
/// `main` adds it once).
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
        // Only on routes that matched; `GET` passes through it untouched.
        .route_layer(idempotency)
        // Authenticate first, so the account is the idempotency scope.
        .layer(middleware::from_fn(authenticate))
        // Outermost first. Whatever rewrites the body (compression) must sit
        // outside the idempotency layer: inside, a gzip body would be stored
        // and replayed to clients that never asked for gzip.
        .layer(
            ServiceBuilder::new()
                .layer(TraceLayer::new_for_http().on_response(log_response))
                .layer(CompressionLayer::new())
                .layer(TimeoutLayer::with_status_code(
                    StatusCode::REQUEST_TIMEOUT,
                    settings.request_timeout,
                )),
        )
        .with_state(state)
}

/// One line per response, with what the idempotency layer did.
fn log_response<B>(response: &Response<B>, latency: Duration, _: &tracing::Span) {
    let outcome = response.extensions().get::<IdempotencyOutcome>();
    tracing::info!(
        status = response.status().as_u16(),
        outcome = outcome.map_or("-", IdempotencyOutcome::name),
        ?latency,
        "response"
    );
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

fn problem(status: StatusCode, title: &'static str, detail: &str) -> Response {
    Problem::new(status, title)
        .detail(detail.to_owned())
        .into_response()
}

#[cfg(test)]
mod tests {
    use axum::body::{Body, to_bytes};
    use tower::ServiceExt;

    use super::*;

    fn settings() -> Settings {
        Settings {
            bind_addr: String::new(),
            processor_latency: Duration::ZERO,
            lease: Duration::from_secs(30),
            retention: Duration::from_secs(86_400),
            request_timeout: Duration::from_secs(10),
        }
    }

    fn charge(key: &str, body: &str) -> Request {
        Request::post("/v1/charges")
            .header("authorization", "Bearer acct_test")
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(Body::from(body.to_owned()))
            .unwrap()
    }

    async fn body(response: Response) -> axum::body::Bytes {
        to_bytes(response.into_body(), usize::MAX).await.unwrap()
    }

    #[tokio::test]
    async fn a_retry_replays_the_charge_and_changed_parameters_are_refused() {
        let app = app(MemoryStore::new(), &settings());
        let first = app
            .clone()
            .oneshot(charge("order-1", r#"{"amount":100,"currency":"eur"}"#))
            .await
            .unwrap();
        assert_eq!(first.status(), StatusCode::CREATED);
        let first = body(first).await;

        let retry = app
            .clone()
            .oneshot(charge("order-1", r#"{ "currency": "eur", "amount": 100 }"#))
            .await
            .unwrap();
        assert_eq!(retry.headers()["idempotent-replayed"], "true");
        assert_eq!(body(retry).await, first);

        let changed = app
            .clone()
            .oneshot(charge("order-1", r#"{"amount":200,"currency":"eur"}"#))
            .await
            .unwrap();
        assert_eq!(changed.status(), StatusCode::UNPROCESSABLE_ENTITY);

        let list = Request::get("/v1/charges")
            .header("authorization", "Bearer acct_test")
            .body(Body::empty())
            .unwrap();
        let charges: serde_json::Value =
            serde_json::from_slice(&body(app.oneshot(list).await.unwrap()).await).unwrap();
        assert_eq!(charges.as_array().unwrap().len(), 1, "one execution");
    }

    #[tokio::test]
    async fn compression_outside_the_layer_never_replays_gzip_to_a_client_that_did_not_ask() {
        let app = app(MemoryStore::new(), &settings());
        // A long description, so the response is worth compressing.
        let new = format!(
            r#"{{"amount":100,"currency":"eur","description":"{}"}}"#,
            "x".repeat(2048)
        );
        let mut gzip = charge("order-2", &new);
        gzip.headers_mut()
            .insert(header::ACCEPT_ENCODING, "gzip".parse().unwrap());
        let first = app.clone().oneshot(gzip).await.unwrap();
        assert_eq!(first.headers()[header::CONTENT_ENCODING], "gzip");

        let retry = app.oneshot(charge("order-2", &new)).await.unwrap();
        assert_eq!(retry.headers()["idempotent-replayed"], "true");
        assert!(retry.headers().get(header::CONTENT_ENCODING).is_none());
        let charge: serde_json::Value = serde_json::from_slice(&body(retry).await).unwrap();
        assert_eq!(charge["amount"], 100);
    }

    #[tokio::test]
    async fn requests_without_credentials_are_refused_before_the_layer() {
        let mut request = charge("order-3", r#"{"amount":100,"currency":"eur"}"#);
        request.headers_mut().remove(header::AUTHORIZATION);
        let response = app(MemoryStore::new(), &settings())
            .oneshot(request)
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
        assert_eq!(
            response.headers()[header::CONTENT_TYPE],
            "application/problem+json"
        );
    }
}
