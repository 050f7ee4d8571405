//! The requests the instruction and allocation benchmarks measure, built
//! once: the layer on the memory store (or the bare router) warmed up, and
//! one request of a path — a first execution, a replay, a concurrent
//! duplicate's `409`, a reused key's `422`, a missing key's `400`.

use std::time::Duration;

use axum::{Router, body::Body, routing::post};
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_idempotency::{
    DefaultFingerprint, FingerprintStrategy, IdempotencyKey, IdempotencyLayer, MemoryStore,
    store::{Claim, StorageKey, Store},
};

/// A JSON document of about `size` bytes: an array of small objects.
pub fn json_body(size: usize) -> String {
    let mut out = String::from("[");
    let mut i = 0;
    while out.len() < size {
        if i > 0 {
            out.push(',');
        }
        out.push_str(&format!(
            r#"{{"id":{i},"currency":"eur","amount":{},"description":"line item {i}","paid":true}}"#,
            i * 100
        ));
        i += 1;
    }
    out.push(']');
    out
}

/// The charge body of a path's size: 200 B or 16 KiB.
pub fn body(size: usize) -> String {
    match size {
        200 => r#"{"amount":1999,"currency":"eur","description":"order 42: two books and a lamp","customer":"cus_8fj3k2","metadata":{"order":"42","channel":"web","campaign":"winter"}}"#.to_owned(),
        size => json_body(size),
    }
}

pub fn request(key: Option<&str>, body: &str) -> Request<Body> {
    let mut request = Request::post("/charges").header("content-type", "application/json");
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    request.body(Body::from(body.to_owned())).unwrap()
}

async fn created(body: Bytes) -> (StatusCode, Bytes) {
    (StatusCode::CREATED, body.slice(..body.len().min(64)))
}

/// What a path runs in: a current-thread runtime (its spawned work runs
/// within the measured call), the router and the request.
pub struct Path {
    runtime: tokio::runtime::Runtime,
    app: Router,
    request: Option<Request<Body>>,
}

impl Path {
    pub fn run(self) -> StatusCode {
        let Path {
            runtime,
            app,
            request,
        } = self;
        let request = request.expect("one request");
        let status = runtime.block_on(async {
            let response = app.clone().oneshot(request).await.unwrap();
            let status = response.status();
            std::hint::black_box(response.into_body().collect().await.unwrap());
            status
        });
        // Their teardown is not the request's — the runtime's, and the
        // store's with every record in it (the router holds the last
        // reference): kept out of the count.
        std::mem::forget((runtime, app));
        status
    }
}

pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// A router (bare, or behind the layer on a memory store) warmed up with
/// a few requests of this shape, and the measured request: `kind` names
/// the path.
pub fn setup(kind: &str, size: usize, layered: bool) -> Path {
    let runtime = runtime();
    let store = MemoryStore::new();
    let bare = Router::new().route("/charges", post(created));
    let app = match layered {
        true => bare.layer(IdempotencyLayer::new(store.clone()).single_tenant()),
        false => bare,
    };
    let charge = body(size);
    runtime.block_on(async {
        for i in 0..8 {
            let warm = request(Some(&format!("warm-{i}")), &charge);
            let _ = app
                .clone()
                .oneshot(warm)
                .await
                .unwrap()
                .into_body()
                .collect()
                .await;
        }
        match kind {
            "replay" | "mismatch" => {
                let first = request(Some("k"), &charge);
                let _ = app
                    .clone()
                    .oneshot(first)
                    .await
                    .unwrap()
                    .into_body()
                    .collect()
                    .await;
            }
            "conflict" => {
                // A claim held by a request still running.
                let key = StorageKey::new("", &IdempotencyKey::new("k").unwrap());
                let fingerprint = DefaultFingerprint::new().fingerprint(
                    &request(Some("k"), &charge).into_parts().0,
                    charge.as_bytes(),
                );
                let claim = store
                    .claim(&key, &fingerprint, Duration::from_secs(60))
                    .await;
                assert!(matches!(claim, Ok(Claim::Acquired(_))));
            }
            _ => {}
        }
    });
    let measured = match kind {
        "first" | "replay" | "conflict" => request(Some("k"), &charge),
        "mismatch" => request(Some("k"), r#"{"amount":1}"#),
        "missing_key" => request(None, &charge),
        other => unreachable!("{other}"),
    };
    Path {
        runtime,
        app,
        request: Some(measured),
    }
}
