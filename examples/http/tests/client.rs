//! The client layer end to end: the `charge_client` example against the
//! payments example (SQLite) over real TCP, behind a relay that loses the
//! server's answer; and the layer itself against real servers that refuse,
//! throttle or never answer, counting the requests they receive.

mod support;

use std::{
    process::Command,
    sync::{
        Arc,
        atomic::{AtomicU32, Ordering},
    },
    time::{Duration, Instant},
};

use axum::{Router, http::StatusCode, response::IntoResponse, routing::post};
use bytes::Bytes;
use http_body_util::Full;
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use serde_json::Value;
use tower::{Service, ServiceBuilder, ServiceExt};
use tower_idempotency::client::{ClientError, IdempotentCall, IdempotentClientLayer};

use support::{
    payments::Payments, process::example_binary, redis_server::free_port, relay::Relay,
    sqlite::TestFile,
};

/// Runs `charge_client` to its end: its one stdout line, parsed, and
/// whether it exited 0.
fn charge(
    url: &str,
    token: &str,
    amount: i64,
    key: Option<&str>,
    env: &[(&str, &str)],
) -> (Value, bool) {
    let mut command = Command::new(example_binary("charge_client"));
    command
        .args([
            "--url",
            url,
            "--token",
            token,
            "--amount",
            &amount.to_string(),
            "--currency",
            "usd",
        ])
        .env("RUST_LOG", "off")
        .envs(env.iter().copied());
    if let Some(key) = key {
        command.args(["--key", key]);
    }
    let out = command.output().expect("run charge_client");
    let stdout = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<_> = stdout.lines().collect();
    assert_eq!(lines.len(), 1, "exactly one line on stdout: {stdout:?}");
    (
        serde_json::from_str(lines[0]).expect("a JSON line"),
        out.status.success(),
    )
}

async fn async_charge(
    url: String,
    token: &'static str,
    key: Option<&'static str>,
    env: Vec<(&'static str, String)>,
) -> (Value, bool) {
    tokio::task::spawn_blocking(move || {
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        charge(&url, token, 1999, key, &env)
    })
    .await
    .unwrap()
}

const CHARGES: &str = "SELECT count(*) FROM charges";

/// The article's case: the server charged and answered, the answer was lost
/// on the way back. The client retries under the same key and gets the
/// replay: one charge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_answer_is_retried_under_the_same_key_and_replayed() {
    let file = TestFile::create();
    let payments = Payments::start(free_port(), &[("DATABASE_URL", &file.url())]);
    let relay = Relay::start(&payments.addr).await;
    relay.lose_answers(1);
    let url = format!("http://127.0.0.1:{}", relay.port());
    let (line, ok) = async_charge(url, "tok_alice", None, vec![]).await;
    assert!(ok, "{line}");
    assert_eq!(line["status"], 201, "{line}");
    assert_eq!(line["attempts"], 2, "{line}");
    assert_eq!(line["replayed"], true, "{line}");
    assert!(
        line["key"].as_str().is_some_and(|k| k.len() == 36),
        "a generated key: {line}"
    );
    assert!(line["body"].is_object(), "{line}");
    assert_eq!(file.count(CHARGES).await, 1, "charged once");
}

/// The server is not listening for the first second: connection refused,
/// retried with the same key until it is; one charge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_not_yet_listening_is_retried_until_it_is() {
    let file = TestFile::create();
    let port = free_port();
    let url = format!("http://127.0.0.1:{port}");
    let client = tokio::spawn(async_charge(url, "tok_alice", Some("late-1"), vec![]));
    tokio::time::sleep(Duration::from_secs(1)).await;
    let _payments = Payments::start(port, &[("DATABASE_URL", &file.url())]);
    let (line, ok) = client.await.unwrap();
    assert!(ok, "{line}");
    assert_eq!(line["status"], 201);
    assert_eq!(line["key"], "late-1", "the caller's key, kept");
    assert!(line["attempts"].as_u64().unwrap() >= 2, "{line}");
    assert_eq!(line["replayed"], false);
    assert_eq!(file.count(CHARGES).await, 1);
}

/// A key reused with other parameters is refused (`422`): never retried,
/// and the client exits 1 with the problem as its body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_422_is_not_retried() {
    let file = TestFile::create();
    let payments = Payments::start(free_port(), &[("DATABASE_URL", &file.url())]);
    let url = format!("http://{}", payments.addr);
    let (first, ok) = charge(&url, "tok_alice", 1999, Some("k-422"), &[]);
    assert!(ok, "{first}");
    let (line, ok) = charge(&url, "tok_alice", 5000, Some("k-422"), &[]);
    assert!(!ok);
    assert_eq!(line["status"], 422, "{line}");
    assert_eq!(line["attempts"], 1, "{line}");
    assert!(
        line["body"]["type"].is_string(),
        "the problem+json body: {line}"
    );
    assert_eq!(file.count(CHARGES).await, 1);
}

/// Two clients race with one key against a slow charge: one executes, the
/// other is told `409` (in flight) and retries into the replay. Both end
/// with the one charge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_clients_racing_with_one_key_both_end_with_the_one_charge() {
    let file = TestFile::create();
    let payments = Payments::start(
        free_port(),
        &[
            ("DATABASE_URL", &file.url()),
            ("PROCESSOR_LATENCY_MS", "1500"),
        ],
    );
    let url = format!("http://{}", payments.addr);
    let (a, b) = tokio::join!(
        async_charge(url.clone(), "tok_alice", Some("race-1"), vec![]),
        async_charge(url.clone(), "tok_alice", Some("race-1"), vec![]),
    );
    for (line, ok) in [&a, &b] {
        assert!(ok, "{line}");
        assert_eq!(line["status"], 201, "{line}");
    }
    assert_eq!(a.0["body"], b.0["body"], "the same charge");
    let replayed: Vec<_> = [&a.0, &b.0].iter().map(|l| l["replayed"] == true).collect();
    assert_eq!(replayed.iter().filter(|r| **r).count(), 1, "{a:?} {b:?}");
    assert_eq!(file.count(CHARGES).await, 1);
}

/// A real server that answers each request with `status` (and
/// `Retry-After` when given), counting the requests.
async fn answering(
    status: StatusCode,
    retry_after: Option<&'static str>,
) -> (String, Arc<AtomicU32>) {
    let seen = Arc::new(AtomicU32::new(0));
    let counter = seen.clone();
    let app = Router::new().route(
        "/v1/charges",
        post(move || {
            let counter = counter.clone();
            async move {
                counter.fetch_add(1, Ordering::SeqCst);
                let mut response = status.into_response();
                if let Some(after) = retry_after {
                    response
                        .headers_mut()
                        .insert("retry-after", after.parse().unwrap());
                }
                response
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/v1/charges", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (url, seen)
}

type HyperClient = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

async fn send(
    layer: IdempotentClientLayer,
    url: &str,
) -> Result<http::Response<tower_idempotency::client::BufferedBody>, ClientError> {
    let hyper: HyperClient = Client::builder(TokioExecutor::new()).build_http();
    let mut client = ServiceBuilder::new().layer(layer).service(hyper);
    let request = http::Request::post(url)
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap();
    ServiceExt::<http::Request<Full<Bytes>>>::ready(&mut client)
        .await?
        .call(request)
        .await
}

fn fast() -> IdempotentClientLayer {
    IdempotentClientLayer::new().backoff(Duration::from_millis(20), Duration::from_millis(50))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_attempt_limit_holds_and_the_last_answer_is_returned() {
    let (url, seen) = answering(StatusCode::SERVICE_UNAVAILABLE, None).await;
    let response = send(fast().max_attempts(3), &url).await.unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    let call = response.extensions().get::<IdempotentCall>().unwrap();
    assert_eq!(call.attempts, 3);
    assert_eq!(
        seen.load(Ordering::SeqCst),
        3,
        "three requests reached the server"
    );
}

/// A `Retry-After` past the deadline ends the call with that answer at
/// once, instead of sleeping through the deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_after_past_the_deadline_ends_the_call_with_that_answer() {
    let (url, seen) = answering(StatusCode::TOO_MANY_REQUESTS, Some("60")).await;
    let started = Instant::now();
    let response = send(fast().deadline(Duration::from_secs(5)), &url)
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(seen.load(Ordering::SeqCst), 1);
    assert!(started.elapsed() < Duration::from_secs(5));
}

/// A server that never answers: each attempt times out, no attempt starts
/// after the deadline, and the error carries the key to retry with later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_deadline_holds_against_a_server_that_never_answers() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/v1/charges", listener.local_addr().unwrap());
    let accepted = Arc::new(AtomicU32::new(0));
    let counting = accepted.clone();
    let _held = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            counting.fetch_add(1, Ordering::SeqCst);
            held.push(socket); // read nothing, answer nothing
        }
    });
    let layer = fast()
        .max_attempts(100)
        .attempt_timeout(Duration::from_millis(300))
        .deadline(Duration::from_millis(1000));
    let started = Instant::now();
    let error = send(layer, &url).await.unwrap_err();
    let elapsed = started.elapsed();
    let ClientError::NoAnswer { call, .. } = &error else {
        panic!("{error}");
    };
    assert!(call.key.is_some());
    assert!((2..=4).contains(&call.attempts), "{call:?}");
    assert_eq!(
        accepted.load(Ordering::SeqCst),
        call.attempts,
        "one connection per attempt"
    );
    assert!(elapsed < Duration::from_millis(1500), "{elapsed:?}");
}

/// The key is the same on every attempt of one call, and new for the next
/// call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_key_per_call_the_same_on_every_attempt() {
    let keys = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let seen = keys.clone();
    let app = Router::new().route(
        "/v1/charges",
        post(move |headers: http::HeaderMap| {
            let seen = seen.clone();
            async move {
                let key = headers["idempotency-key"].to_str().unwrap().to_owned();
                let mut seen = seen.lock().unwrap();
                seen.push(key);
                if seen.len().is_multiple_of(3) {
                    StatusCode::CREATED
                } else {
                    StatusCode::SERVICE_UNAVAILABLE
                }
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/v1/charges", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    for _ in 0..2 {
        let response = send(fast(), &url).await.unwrap();
        assert_eq!(response.status(), StatusCode::CREATED);
    }
    let keys = keys.lock().unwrap().clone();
    assert_eq!(keys.len(), 6);
    assert!(keys[..3].iter().all(|k| *k == keys[0]), "{keys:?}");
    assert!(keys[3..].iter().all(|k| *k == keys[3]), "{keys:?}");
    assert_ne!(keys[0], keys[3], "a new key per call");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_over_the_limit_fails_before_anything_is_sent() {
    let (url, seen) = answering(StatusCode::CREATED, None).await;
    let hyper: HyperClient = Client::builder(TokioExecutor::new()).build_http();
    let mut client = ServiceBuilder::new()
        .layer(fast().max_body(8))
        .service(hyper);
    let request = http::Request::post(&url)
        .body(Full::new(Bytes::from_static(b"0123456789")))
        .unwrap();
    let error = ServiceExt::<http::Request<Full<Bytes>>>::ready(&mut client)
        .await
        .unwrap()
        .call(request)
        .await
        .unwrap_err();
    assert!(
        matches!(error, ClientError::BodyTooLarge { limit: 8 }),
        "{error}"
    );
    assert_eq!(seen.load(Ordering::SeqCst), 0);
}
