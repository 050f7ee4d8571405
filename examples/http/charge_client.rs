//! A charge made safely from the client side: one idempotency key for the
//! whole operation, kept across retries, against the payments example.
//!
//! Run the payments example, then:
//!
//! ```not_rust
//! cargo run --release --example charge_client -- \
//!     --url http://127.0.0.1:3000 --token tok_alice --amount 1999 --currency usd [--key K]
//! ```
//!
//! Environment: `CLIENT_MAX_ATTEMPTS` (default 5), `CLIENT_TIMEOUT_MS` (per
//! attempt, default 10000), `CLIENT_DEADLINE_MS` (the whole call, default
//! 30000).
//!
//! It POSTs `/v1/charges` with `Authorization: Bearer <token>` and the JSON
//! body `{"amount", "currency"}`, and prints exactly one JSON line on
//! stdout:
//!
//! ```not_rust
//! {"status":201,"key":"…","attempts":2,"replayed":true,"body":{…}}
//! ```
//!
//! `status` is the last answer's (0 when no attempt got one), `attempts` the
//! HTTP requests sent, `body` the last answer's JSON body (a problem+json
//! included; `null` when it is not JSON). It exits 0 for a 2xx, 1 otherwise;
//! everything else goes to stderr.

use std::{process::ExitCode, time::Duration};

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use serde_json::{Value, json};
use tower::{Service, ServiceBuilder, ServiceExt};
use tower_idempotency::client::{ClientError, IdempotentCall, IdempotentClientLayer};

struct Args {
    url: String,
    token: String,
    amount: i64,
    currency: String,
    key: Option<String>,
}

fn usage(why: &str) -> ! {
    eprintln!(
        "charge_client: {why}\nusage: charge_client --url URL --token TOKEN --amount N --currency CUR [--key K]"
    );
    std::process::exit(2)
}

fn args() -> Args {
    let mut args = std::env::args().skip(1);
    let (mut url, mut token, mut amount, mut currency, mut key) = (None, None, None, None, None);
    while let Some(flag) = args.next() {
        let mut value = || {
            args.next()
                .unwrap_or_else(|| usage(&format!("{flag} needs a value")))
        };
        match flag.as_str() {
            "--url" => url = Some(value()),
            "--token" => token = Some(value()),
            "--amount" => {
                amount = Some(
                    value()
                        .parse()
                        .unwrap_or_else(|_| usage("--amount must be a whole number")),
                )
            }
            "--currency" => currency = Some(value()),
            "--key" => key = Some(value()),
            other => usage(&format!("unknown argument {other}")),
        }
    }
    Args {
        url: url.unwrap_or_else(|| usage("--url is required")),
        token: token.unwrap_or_else(|| usage("--token is required")),
        amount: amount.unwrap_or_else(|| usage("--amount is required")),
        currency: currency.unwrap_or_else(|| usage("--currency is required")),
        key,
    }
}

fn millis(name: &str, default: u64) -> Duration {
    match std::env::var(name) {
        Err(_) => Duration::from_millis(default),
        Ok(v) => {
            Duration::from_millis(v.parse().unwrap_or_else(|_| {
                usage(&format!("{name} must be a whole number of milliseconds"))
            }))
        }
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "tower_idempotency=debug".into()),
        )
        .init();
    let args = args();
    let attempts: u32 = std::env::var("CLIENT_MAX_ATTEMPTS")
        .map_or(Ok(5), |v| v.parse())
        .unwrap_or_else(|_| usage("CLIENT_MAX_ATTEMPTS must be a whole number"));
    if attempts == 0 {
        usage("CLIENT_MAX_ATTEMPTS must be at least 1");
    }
    let layer = IdempotentClientLayer::new()
        .max_attempts(attempts)
        .attempt_timeout(millis("CLIENT_TIMEOUT_MS", 10_000))
        .deadline(millis("CLIENT_DEADLINE_MS", 30_000));
    let hyper = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let mut client = ServiceBuilder::new().layer(layer).service(hyper);

    let url = format!("{}/v1/charges", args.url.trim_end_matches('/'));
    let body = json!({"amount": args.amount, "currency": args.currency}).to_string();
    let mut request = http::Request::post(&url)
        .header("authorization", format!("Bearer {}", args.token))
        .header("content-type", "application/json");
    if let Some(key) = &args.key {
        request = request.header("idempotency-key", key);
    }
    let request = request
        .body(Full::new(Bytes::from(body)))
        .unwrap_or_else(|e| usage(&format!("--url: {e}")));

    let called = match ServiceExt::<http::Request<Full<Bytes>>>::ready(&mut client).await {
        Ok(client) => client.call(request).await,
        Err(error) => Err(error),
    };
    let (line, success) = match called {
        Ok(response) => {
            let call = response
                .extensions()
                .get::<IdempotentCall>()
                .cloned()
                .expect("the layer describes every call");
            let body: Value =
                serde_json::from_slice(&response.body().bytes()).unwrap_or(Value::Null);
            let status = response.status();
            (line(status.as_u16(), &call, body), status.is_success())
        }
        Err(error) => {
            eprintln!("charge_client: {error}");
            let call = match &error {
                ClientError::NoAnswer { call, .. } | ClientError::ResponseTooLarge { call, .. } => {
                    call.clone()
                }
                _ => IdempotentCall {
                    key: args.key.clone(),
                    attempts: 0,
                    replayed: false,
                },
            };
            (line(0, &call, Value::Null), false)
        }
    };
    println!("{line}");
    if success {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn line(status: u16, call: &IdempotentCall, body: Value) -> String {
    json!({
        "status": status,
        "key": call.key,
        "attempts": call.attempts,
        "replayed": call.replayed,
        "body": body,
    })
    .to_string()
}
