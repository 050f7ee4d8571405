//! Load benchmark: a bare axum handler and the same handler behind the layer,
//! driven side by side over loopback by `wrk`, alternating variants over
//! several rounds, with the ratio to bare per round and the median.
//!
//! Run with: `cargo bench --bench load` (needs `wrk` and `redis-server` on
//! PATH; Debian/Ubuntu: `sudo apt-get install wrk redis-server`).
//!
//! Environment: `LOAD_SECS` (per run, default 5), `LOAD_ROUNDS` (default 3),
//! `LOAD_CONNECTIONS` (default 32), `LOAD_VARIANTS` (comma-separated names to
//! run, default all). Every run is bounded in time; all traffic stays on
//! 127.0.0.1; the servers and `redis-server` stop when the benchmark ends.

#[path = "../tests/support/redis_server.rs"]
#[allow(dead_code)]
mod redis_server;

use std::{env, net::SocketAddr, process::Command, sync::Arc, time::Duration};

use axum::{
    Json, Router,
    extract::Request,
    http::{HeaderValue, StatusCode, header},
    middleware::{self, Next},
    response::{IntoResponse, Response},
    routing::post,
};
use http::request::Parts;
use http_body_util::BodyExt;
use redis::AsyncCommands;
use redis_server::RedisServer;
use serde::{Deserialize, Serialize};
use tower_idempotency::{
    IdempotencyLayer, MemoryStore, RedisStore,
    store::{CachedStore, Store},
};

/// Long enough for every replay, short enough that unique keys do not pile up.
const RETENTION: Duration = Duration::from_secs(120);

#[derive(Clone, Copy, PartialEq)]
enum Keys {
    /// A new key per request: every request executes.
    Unique,
    /// 64 keys, completed during the warm-up: every request replays.
    Replay,
}

struct Variant {
    name: &'static str,
    keys: Keys,
    addr: SocketAddr,
}

#[derive(Deserialize, Serialize)]
struct NewCharge {
    amount: i64,
    currency: String,
    description: Option<String>,
}

/// The handler under test: parse a charge, answer 201 with a Location.
async fn charge(Json(new): Json<NewCharge>) -> Response {
    let location = HeaderValue::from_static("/v1/charges/ch_bench");
    (
        StatusCode::CREATED,
        [(header::LOCATION, location)],
        Json(new),
    )
        .into_response()
}

fn routes() -> Router {
    Router::new().route("/v1/charges", post(charge))
}

fn scope(parts: &Parts) -> Option<String> {
    parts
        .headers
        .get(header::AUTHORIZATION)?
        .to_str()
        .ok()
        .map(str::to_owned)
}

fn layered<St: Store>(store: St) -> Router {
    routes().layer(
        IdempotencyLayer::new(store)
            .scope_with(scope)
            .retention(RETENTION),
    )
}

/// The floor: a hand-written middleware that does only the unavoidable Redis
/// work — one `SET NX GET` that claims a new key or returns the stored body,
/// and one `SET` to store the response: two round trips for a new key, one
/// for a replay — with no fingerprint, scope, lease, fencing or headers.
async fn floor(redis: redis::aio::ConnectionManager, request: Request, next: Next) -> Response {
    let Some(key) = request
        .headers()
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
    else {
        return StatusCode::BAD_REQUEST.into_response();
    };
    let key = format!("floor:{key}");
    let mut conn = redis.clone();
    let previous: Option<Vec<u8>> = redis::cmd("SET")
        .arg(&key)
        .arg("-")
        .arg("NX")
        .arg("PX")
        .arg(30_000)
        .arg("GET")
        .query_async(&mut conn)
        .await
        .unwrap();
    match previous {
        None => {}
        Some(body) if body != b"-" => {
            return (StatusCode::CREATED, [("idempotent-replayed", "true")], body).into_response();
        }
        Some(_) => return StatusCode::CONFLICT.into_response(),
    }
    let (parts, body) = next.run(request).await.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    let _: () = conn
        .set_ex(&key, body.as_ref(), RETENTION.as_secs())
        .await
        .unwrap();
    Response::from_parts(parts, axum::body::Body::from(body))
}

async fn serve(app: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

async fn start_variants(redis_url: &str) -> Vec<Variant> {
    let redis = || async {
        RedisStore::builder()
            .connect(redis_url)
            .await
            .expect("connect to the benchmark's redis-server")
    };
    let client = redis::Client::open(redis_url).unwrap();
    let manager = redis::aio::ConnectionManager::new(client).await.unwrap();
    let floor_app = {
        let manager = manager.clone();
        routes().layer(middleware::from_fn(move |req, next| {
            floor(manager.clone(), req, next)
        }))
    };
    let cached = CachedStore::new(redis().await, 64 * 1024 * 1024);
    let variants = [
        ("bare", Keys::Unique, routes()),
        ("memory", Keys::Unique, layered(MemoryStore::new())),
        ("memory-replay", Keys::Replay, layered(MemoryStore::new())),
        ("redis-floor", Keys::Unique, floor_app.clone()),
        ("redis", Keys::Unique, layered(redis().await)),
        ("redis-replay-floor", Keys::Replay, floor_app),
        ("redis-replay", Keys::Replay, layered(redis().await)),
        ("redis-replay-cached", Keys::Replay, layered(cached)),
    ];
    let wanted: Option<Vec<String>> = env::var("LOAD_VARIANTS")
        .ok()
        .map(|v| v.split(',').map(|s| s.trim().to_owned()).collect());
    let mut out = Vec::new();
    for (name, keys, app) in variants {
        if name == "bare" || wanted.as_ref().is_none_or(|w| w.iter().any(|n| n == name)) {
            out.push(Variant {
                name,
                keys,
                addr: serve(app).await,
            });
        }
    }
    out
}

/// The wrk script: POST a charge, with a fresh key per request (unique) or one
/// of 64 keys (replay).
fn wrk_script(run_id: &str, keys: Keys) -> String {
    let mode = if keys == Keys::Unique {
        "unique"
    } else {
        "replay"
    };
    format!(
        r#"
local threads = 0
function setup(thread)
  threads = threads + 1
  thread:set("tid", threads)
end
wrk.method = "POST"
wrk.body = '{{"amount":1999,"currency":"eur","description":"load benchmark"}}'
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer acct_bench"
local n = 0
function request()
  n = n + 1
  if "{mode}" == "unique" then
    wrk.headers["Idempotency-Key"] = "{run_id}-" .. tid .. "-" .. n
  else
    wrk.headers["Idempotency-Key"] = "replay-" .. (n % 64)
  end
  return wrk.format()
end
"#
    )
}

#[derive(Clone, Copy, Default)]
struct Run {
    rps: f64,
    p50_ms: f64,
    p99_ms: f64,
    errors: u64,
    /// CPU time of this process (the servers, not wrk or Redis) per request.
    cpu_us: f64,
}

/// User + system CPU time of this process so far, in µs (Linux; 0 elsewhere).
fn process_cpu_us() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return 0.0;
    };
    // Fields after the command name, which is parenthesised and may hold spaces.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map_or("", |(_, rest)| rest)
        .split_whitespace()
        .collect();
    let ticks: f64 = fields.get(11..13).map_or(0.0, |t| {
        t.iter().filter_map(|v| v.parse::<f64>().ok()).sum()
    });
    ticks * 1e6 / 100.0 // USER_HZ is 100 on Linux
}

fn wrk(variant: &Variant, run_id: &str, secs: u64, connections: u32) -> Run {
    let script = env::temp_dir().join(format!(
        "tower-idempotency-load-{}-{run_id}.lua",
        std::process::id()
    ));
    std::fs::write(&script, wrk_script(run_id, variant.keys)).unwrap();
    let output = Command::new("wrk")
        .args([
            "-t",
            "1",
            "-c",
            &connections.to_string(),
            "-d",
            &format!("{secs}s"),
        ])
        .args(["--timeout", "5s", "--latency", "-s"])
        .arg(&script)
        .arg(format!("http://{}/v1/charges", variant.addr))
        .output()
        .expect("run wrk (install it: sudo apt-get install wrk)");
    let _ = std::fs::remove_file(&script);
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "wrk failed: {text}");
    parse_wrk(&text)
}

/// One measured run: wrk's numbers plus this process's CPU per request.
fn measure(variant: &Variant, run_id: &str, secs: u64, connections: u32) -> Run {
    let cpu_before = process_cpu_us();
    let mut run = wrk(variant, run_id, secs, connections);
    let requests = run.rps * secs as f64;
    run.cpu_us = (process_cpu_us() - cpu_before) / requests.max(1.0);
    run
}

fn parse_wrk(text: &str) -> Run {
    let ms = |v: &str| -> f64 {
        let (num, unit) = v.split_at(v.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(v.len()));
        let n: f64 = num.parse().unwrap_or(f64::NAN);
        match unit {
            "us" => n / 1000.0,
            "ms" => n,
            "s" => n * 1000.0,
            _ => f64::NAN,
        }
    };
    let mut run = Run::default();
    for line in text.lines().map(str::trim) {
        let fields: Vec<&str> = line.split_whitespace().collect();
        match fields.as_slice() {
            ["Requests/sec:", v] => run.rps = v.parse().unwrap(),
            ["50%", v] => run.p50_ms = ms(v),
            ["99%", v] => run.p99_ms = ms(v),
            ["Non-2xx", "or", "3xx", "responses:", v] => run.errors += v.parse::<u64>().unwrap(),
            ["Socket", "errors:", rest @ ..] => {
                run.errors += rest
                    .iter()
                    .filter_map(|f| f.trim_end_matches(',').parse::<u64>().ok())
                    .sum::<u64>()
            }
            _ => {}
        }
    }
    run
}

fn print_header() {
    println!(
        "{:<22} {:>10} {:>9} {:>9} {:>8} {:>11} {:>7}",
        "variant", "req/s", "p50 ms", "p99 ms", "x bare", "cpu us/req", "errors"
    );
}

fn print_row(name: &str, run: &Run, ratio: f64) {
    println!(
        "{:<22} {:>10.0} {:>9.3} {:>9.3} {:>8.3} {:>11.1} {:>7}",
        name, run.rps, run.p50_ms, run.p99_ms, ratio, run.cpu_us, run.errors
    );
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    }
}

fn main() {
    let number =
        |name: &str, default: u64| env::var(name).map_or(default, |v| v.parse().expect(name));
    let secs = number("LOAD_SECS", 5);
    let rounds = number("LOAD_ROUNDS", 3) as usize;
    let connections = number("LOAD_CONNECTIONS", 32) as u32;
    if Command::new("wrk").arg("--version").output().is_err() {
        panic!("wrk is not installed: sudo apt-get install wrk");
    }

    let redis = RedisServer::start();
    let runtime = Arc::new(
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap(),
    );
    let variants = runtime.block_on(start_variants(&redis.url()));
    let nonce = std::process::id();

    println!(
        "load: {} variants x {rounds} rounds x {secs}s, wrk 1 thread {connections} connections, server 2 tokio workers, {} cores",
        variants.len(),
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    // Warm-up: connections, JIT-free but caches and allocators warm; replay keys completed.
    for v in &variants {
        wrk(v, &format!("warm{nonce}"), 2, connections);
    }

    let mut results: Vec<Vec<Run>> = vec![Vec::new(); variants.len()];
    for round in 1..=rounds {
        println!("\nround {round}");
        print_header();
        let mut bare_rps = 0.0;
        for (i, v) in variants.iter().enumerate() {
            let run = measure(
                v,
                &format!("r{nonce}-{round}-{}", v.name),
                secs,
                connections,
            );
            if v.name == "bare" {
                bare_rps = run.rps;
            }
            print_row(v.name, &run, run.rps / bare_rps);
            results[i].push(run);
        }
    }

    println!("\nmedian over {rounds} rounds (ratio: median of the per-round ratios to bare)");
    print_header();
    let bare: Vec<f64> = results[0].iter().map(|r| r.rps).collect();
    for (v, runs) in variants.iter().zip(&results) {
        let med = |f: fn(&Run) -> f64| median(runs.iter().map(f).collect());
        let run = Run {
            rps: med(|r| r.rps),
            p50_ms: med(|r| r.p50_ms),
            p99_ms: med(|r| r.p99_ms),
            cpu_us: med(|r| r.cpu_us),
            errors: runs.iter().map(|r| r.errors).sum(),
        };
        let ratio = median(runs.iter().zip(&bare).map(|(r, b)| r.rps / b).collect());
        print_row(v.name, &run, ratio);
    }
    let errors: u64 = results.iter().flatten().map(|r| r.errors).sum();
    assert_eq!(
        errors, 0,
        "some requests failed or were rejected; the numbers above are not comparable"
    );
    drop(redis);
}
