//! The layer's own cost in instructions, under Callgrind (gungraun): the
//! same binary and input give the same count whatever else the machine is
//! doing, so a small change shows and a regression cannot hide in noise.
//!
//! Each path runs once per benchmark, after a warm-up in its set-up (not
//! counted): the layer on the memory store — a first execution, a replay,
//! a concurrent duplicate's `409`, a reused key's `422`, a missing key's
//! `400`, with a 200 B and a 16 KiB JSON body — beside the same request
//! through the bare router, so the layer's own instructions are the
//! difference; and the pieces: the canonical-JSON fingerprint of 1 KiB and
//! 16 KiB, the record codec both ways, a storage key, the consumer door's
//! settle of one delivery.
//!
//! Run with: `scripts/instructions` (beside the committed baseline), or
//! `cargo bench -p tower-idempotency-cost --bench instructions` (needs `valgrind` and
//! `gungraun-runner` 0.20: `cargo install gungraun-runner --version 0.20.0`;
//! scripts/services installs both). Allocations per request are counted by
//! `benches/cost/benches/allocations.rs`.

mod paths;

use std::hint::black_box;

use bytes::Bytes;
use gungraun::{library_benchmark, library_benchmark_group, main};
use http::{HeaderMap, StatusCode};
use tower_idempotency::{
    CompletedRecord, DefaultFingerprint, Fingerprint, FingerprintStrategy, IdempotencyKey,
    MemoryStore, StoredResponse, codec,
    message::{Delivery, IdempotencyProcessor},
    store::StorageKey,
};

use paths::{Path, body, json_body, request, runtime, setup};

#[library_benchmark]
#[bench::first_200b(setup("first", 200, true))]
#[bench::first_200b_bare(setup("first", 200, false))]
#[bench::first_16k(setup("first", 16 * 1024, true))]
#[bench::first_16k_bare(setup("first", 16 * 1024, false))]
#[bench::replay_200b(setup("replay", 200, true))]
#[bench::replay_16k(setup("replay", 16 * 1024, true))]
#[bench::conflict_200b(setup("conflict", 200, true))]
#[bench::mismatch_200b(setup("mismatch", 200, true))]
#[bench::missing_key_200b(setup("missing_key", 200, true))]
fn layer(path: Path) -> StatusCode {
    black_box(path.run())
}

fn fingerprint_input(size: usize) -> (http::request::Parts, String) {
    (request(Some("k"), "").into_parts().0, json_body(size))
}

#[library_benchmark]
#[bench::json_1k(fingerprint_input(1024))]
#[bench::json_16k(fingerprint_input(16 * 1024))]
fn fingerprint((parts, body): (http::request::Parts, String)) -> Fingerprint {
    black_box(DefaultFingerprint::new().fingerprint(&parts, black_box(body.as_bytes())))
}

fn record(size: usize) -> CompletedRecord {
    let mut headers = HeaderMap::new();
    headers.insert("content-type", "application/json".parse().unwrap());
    headers.insert("location", "/v1/charges/ch_1".parse().unwrap());
    CompletedRecord::Response(StoredResponse::capture(
        StatusCode::CREATED,
        &headers,
        Bytes::from(body(size)),
    ))
}

#[library_benchmark]
#[bench::encode_200b(record(200))]
#[bench::encode_16k(record(16 * 1024))]
fn encode(record: CompletedRecord) -> Vec<u8> {
    black_box(codec::encode(
        &Fingerprint::from_bytes([7; 32]),
        black_box(&record),
    ))
}

#[library_benchmark]
#[bench::decode_200b(codec::encode(&Fingerprint::from_bytes([7; 32]), &record(200)))]
#[bench::decode_16k(codec::encode(&Fingerprint::from_bytes([7; 32]), &record(16 * 1024)))]
fn decode(bytes: Vec<u8>) -> CompletedRecord {
    black_box(codec::decode(black_box(bytes)).unwrap().1)
}

#[library_benchmark]
fn storage_key() -> StorageKey {
    let key = IdempotencyKey::new(black_box("order-42-7f3a9c")).unwrap();
    black_box(StorageKey::new(black_box("acct_alice"), &key))
}

/// A consumer's processor on the memory store, warmed, and its runtime.
fn processor() -> (tokio::runtime::Runtime, IdempotencyProcessor<MemoryStore>) {
    let runtime = runtime();
    let orders = IdempotencyProcessor::new(MemoryStore::new()).scope("orders");
    runtime.block_on(async {
        for i in 0..8 {
            let id = format!("warm-{i}");
            orders
                .settle(
                    Delivery::new(&id, br#"{"amount":1999}"#),
                    async |_: &mut _| Ok::<_, std::io::Error>(()),
                    |_: &std::io::Error| false,
                )
                .await;
        }
    });
    (runtime, orders)
}

#[library_benchmark]
#[bench::one_delivery(processor())]
fn settle((runtime, orders): (tokio::runtime::Runtime, IdempotencyProcessor<MemoryStore>)) {
    let settled = runtime.block_on(orders.settle(
        Delivery::new("order-42", br#"{"amount":1999}"#),
        async |_: &mut _| Ok::<_, std::io::Error>(()),
        |_: &std::io::Error| false,
    ));
    black_box(settled.disposition);
    std::mem::forget(runtime);
}

library_benchmark_group!(name = requests, benchmarks = [layer]);
library_benchmark_group!(
    name = pieces,
    benchmarks = [fingerprint, encode, decode, storage_key, settle]
);
main!(library_benchmark_groups = requests, pieces);
