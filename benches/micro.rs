//! Micro-benchmarks: fingerprints, key parsing, record encoding, and the
//! layer's in-process overhead (bare vs layered `oneshot`, memory store).
//!
//! Run with: `cargo bench --bench micro`

use std::{
    hint::black_box,
    sync::atomic::{AtomicU64, Ordering},
    time::Duration,
};

use axum::{Router, body::Body, routing::post};
use bytes::Bytes;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use http::{HeaderMap, HeaderValue, Request, StatusCode, header};
use sha2::{Digest, Sha256};
use tower::ServiceExt;
use tower_idempotency::{
    DefaultFingerprint, FingerprintStrategy, IdempotencyKey, IdempotencyLayer, MemoryStore,
    RawBodyFingerprint, StoredResponse,
};

/// A JSON document of about `size` bytes: an array of small objects.
fn json_body(size: usize) -> Vec<u8> {
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
    out.into_bytes()
}

fn fingerprints(c: &mut Criterion) {
    let mut group = c.benchmark_group("fingerprint");
    let (json_parts, ()) = Request::post("/v1/charges?b=2&a=1")
        .header("content-type", "application/json")
        .body(())
        .unwrap()
        .into_parts();
    for size in [1024, 64 * 1024, 1024 * 1024] {
        let body = json_body(size);
        group.throughput(Throughput::Bytes(body.len() as u64));
        group.bench_with_input(
            BenchmarkId::new("canonical_json", size),
            &body,
            |b, body| {
                b.iter(|| DefaultFingerprint::new().fingerprint(&json_parts, black_box(body)))
            },
        );
        group.bench_with_input(BenchmarkId::new("raw", size), &body, |b, body| {
            b.iter(|| RawBodyFingerprint.fingerprint(&json_parts, black_box(body)))
        });
        group.bench_with_input(BenchmarkId::new("sha2_alone", size), &body, |b, body| {
            b.iter(|| Sha256::digest(black_box(body)))
        });
    }
    group.finish();
}

fn keys(c: &mut Criterion) {
    let bare = HeaderValue::from_static("order-42-charge-2026-11-30");
    let quoted = HeaderValue::from_static("\"order-42-charge-2026-11-30\"");
    c.bench_function("key/parse_bare", |b| {
        b.iter(|| IdempotencyKey::from_header(black_box(&bare)))
    });
    c.bench_function("key/parse_sf_string", |b| {
        b.iter(|| IdempotencyKey::from_header(black_box(&quoted)))
    });
}

fn records(c: &mut Criterion) {
    let mut headers = HeaderMap::new();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    headers.insert(
        header::LOCATION,
        HeaderValue::from_static("/v1/charges/ch_3PqXyZ1234567890abcdef"),
    );
    headers.append(
        "x-request-id",
        HeaderValue::from_static("b5e8a0f6-6c1b-4cc4-9d4b-1f0d8c2f3a11"),
    );
    headers.insert(
        header::SET_COOKIE,
        HeaderValue::from_static("session=secret"),
    );
    let body = Bytes::from(json_body(1024));
    c.bench_function("record/capture", |b| {
        b.iter(|| StoredResponse::capture(StatusCode::CREATED, black_box(&headers), body.clone()))
    });
    let stored = StoredResponse::capture(StatusCode::CREATED, &headers, body);
    let fingerprint = tower_idempotency::Fingerprint::from_bytes([7; 32]);
    let record = tower_idempotency::CompletedRecord::Response(stored);
    c.bench_function("record/encode", |b| {
        b.iter(|| tower_idempotency::codec::encode(&fingerprint, black_box(&record)))
    });
    let bytes = Bytes::from(tower_idempotency::codec::encode(&fingerprint, &record));
    c.bench_function("record/decode", |b| {
        b.iter(|| tower_idempotency::codec::decode(black_box(bytes.clone())).unwrap())
    });
}

const CHARGE: &str = r#"{"amount":1999,"currency":"eur","description":"bench"}"#;

fn handler_router() -> Router {
    Router::new().route(
        "/v1/charges",
        post(|body: Bytes| async move {
            (
                StatusCode::CREATED,
                [(header::LOCATION, "/v1/charges/ch_1")],
                body,
            )
        }),
    )
}

fn request(key: &str) -> Request<Body> {
    Request::post("/v1/charges")
        .header("content-type", "application/json")
        .header("idempotency-key", key)
        .body(Body::from(CHARGE))
        .unwrap()
}

/// The layer's own cost in process: bare router vs the same router layered.
fn layer_overhead(c: &mut Criterion) {
    // One thread, as a server worker runs a request: a multi-thread runtime
    // would add a cross-thread wake-up per iteration to both sides.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut group = c.benchmark_group("oneshot");
    let bare = handler_router();
    // Short retention so unique-key records do not pile up over millions of iterations.
    let layered = handler_router().layer(
        IdempotencyLayer::new(MemoryStore::new())
            .single_tenant()
            .retention(Duration::from_secs(1)),
    );
    let seq = AtomicU64::new(0);
    let unique = || format!("k-{}", seq.fetch_add(1, Ordering::Relaxed));

    group.bench_function("bare", |b| {
        b.to_async(&rt)
            .iter(|| bare.clone().oneshot(request(&unique())))
    });
    group.bench_function("memory_unique_keys", |b| {
        b.to_async(&rt)
            .iter(|| layered.clone().oneshot(request(&unique())))
    });
    let replaying =
        handler_router().layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant());
    rt.block_on(replaying.clone().oneshot(request("replayed")))
        .unwrap();
    group.bench_function("memory_replay", |b| {
        b.to_async(&rt)
            .iter(|| replaying.clone().oneshot(request("replayed")))
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    targets = fingerprints, keys, records, layer_overhead
}
criterion_main!(benches);
