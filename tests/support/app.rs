//! The application under test: handlers that count their executions with a
//! per-test counter.

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use tower_idempotency::Attempt;

use axum::{
    Extension, Json, Router,
    body::Bytes,
    extract::{Path, Query, State},
    http::{HeaderMap, HeaderValue, Method, StatusCode, Uri, header},
    response::{IntoResponse, Response},
    routing::post,
};

/// Counts handler executions for one test.
#[derive(Clone, Default)]
pub struct Counter(Arc<AtomicUsize>);

impl Counter {
    pub fn get(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }

    pub fn incr(&self) -> usize {
        self.0.fetch_add(1, Ordering::SeqCst) + 1
    }
}

/// The routes, unlayered. Every handler counts itself first.
pub fn routes(counter: Counter) -> Router {
    Router::new()
        .route("/charges", post(charge).patch(charge).get(charge))
        .route("/slow", post(slow))
        .route("/panic-once", post(panic_once))
        .route("/status/{code}", post(status))
        .route("/no-store", post(no_store))
        .route("/no-replay", post(no_replay))
        .route("/big/{bytes}", post(big))
        .route("/orders", post(order))
        .with_state(counter)
}

/// A 201 with a Location, a repeated header, a cookie and an echo of the request.
fn created(n: usize, method: &Method, uri: &Uri, body: &[u8]) -> Response {
    let mut headers = HeaderMap::new();
    headers.insert(
        header::LOCATION,
        HeaderValue::from_str(&format!("/charges/ch_{n}")).unwrap(),
    );
    headers.append("x-multi", HeaderValue::from_static("first"));
    headers.append("x-multi", HeaderValue::from_static("second"));
    headers.append("x-multi", HeaderValue::from_static("third"));
    headers.insert(
        header::SET_COOKIE,
        HeaderValue::from_static("session=secret"),
    );
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    let body = serde_json::json!({
        "execution": n,
        "method": method.as_str(),
        "uri": uri.to_string(),
        "body": String::from_utf8_lossy(body),
    });
    (StatusCode::CREATED, headers, body.to_string()).into_response()
}

/// Also says which attempt it was told it is (`x-attempt`: the `Earlier`)
/// and the downstream key (`x-downstream-key`), when the layer granted it.
async fn charge(
    State(c): State<Counter>,
    attempt: Option<Extension<Attempt>>,
    method: Method,
    uri: Uri,
    body: Bytes,
) -> Response {
    let n = c.incr();
    let mut created = created(n, &method, &uri, &body);
    if let Some(Extension(attempt)) = attempt {
        let headers = created.headers_mut();
        let earlier = format!("{:?}", attempt.earlier());
        headers.insert("x-attempt", HeaderValue::from_str(&earlier).unwrap());
        let downstream = HeaderValue::from_str(&attempt.downstream_key()).unwrap();
        headers.insert("x-downstream-key", downstream);
    }
    created
}

#[derive(serde::Deserialize)]
struct Slow {
    ms: u64,
}

async fn slow(
    State(c): State<Counter>,
    Query(q): Query<Slow>,
    method: Method,
    uri: Uri,
    body: Bytes,
) -> Response {
    let n = c.incr();
    tokio::time::sleep(Duration::from_millis(q.ms)).await;
    created(n, &method, &uri, &body)
}

async fn panic_once(State(c): State<Counter>, method: Method, uri: Uri, body: Bytes) -> Response {
    let n = c.incr();
    if n == 1 {
        panic!("the card processor exploded");
    }
    created(n, &method, &uri, &body)
}

async fn status(State(c): State<Counter>, Path(code): Path<u16>) -> Response {
    let n = c.incr();
    (
        StatusCode::from_u16(code).unwrap(),
        format!("status {code}, execution {n}"),
    )
        .into_response()
}

/// A 201 marked `Cache-Control: no-store`: not to be replayed.
async fn no_store(State(c): State<Counter>) -> Response {
    let n = c.incr();
    (
        StatusCode::CREATED,
        [(header::CACHE_CONTROL, "private, no-store")],
        format!("execution {n}"),
    )
        .into_response()
}

/// A 422 the handler marks not to be replayed.
async fn no_replay(State(c): State<Counter>) -> Response {
    let n = c.incr();
    (
        StatusCode::UNPROCESSABLE_ENTITY,
        tower_idempotency::NoReplay::new(),
        format!("execution {n}"),
    )
        .into_response()
}

async fn big(State(c): State<Counter>, Path(bytes): Path<usize>) -> Response {
    c.incr();
    vec![b'x'; bytes].into_response()
}

/// Reads its body with axum's `Json`, which refuses a body not labelled
/// `application/json` (`415`) before the handler runs.
async fn order(State(c): State<Counter>, Json(order): Json<serde_json::Value>) -> Response {
    let n = c.incr();
    (StatusCode::CREATED, format!("order {order}, execution {n}")).into_response()
}
