//! What only a real Redis can show: TTLs, round trips counted by the server,
//! outages, crashes of the application process, eviction policies, storms.
//! The list runs on Redis 7 here and on Valkey 9 in `tests/valkey.rs`, which
//! includes this file: each test starts its server with [`start`].

// The suite runs against every store: `cargo test --all-features`.
#![cfg(every_store)]

pub mod support;

use std::time::Duration;

use axum::Router;
use http::StatusCode;
use tower_idempotency::{
    CompletedRecord, Completion, Fingerprint, IdempotencyKey, IdempotencyLayer, IdempotencyOutcome,
    RedisStore,
    store::{CachedStore, Claim, StorageKey, Store, redis::KeyNames},
};

use support::{
    app::{Counter, routes},
    backend::rewrite_redis_value,
    http::{Server, oneshot, post},
    logs::Logs,
    redis_server::{Flavour, RedisServer, command_calls},
};

const CHARGE: &str = r#"{"amount":1999,"currency":"eur"}"#;

/// The server this list runs on, read at the crate's root: this one when
/// the file is its own test, `tests/valkey.rs`'s when it includes it.
#[allow(dead_code)]
const FLAVOUR: Flavour = Flavour::Redis;

/// A server of the list's flavour.
fn start() -> RedisServer {
    RedisServer::start_flavour(crate::FLAVOUR, &[])
}

async fn store(server: &RedisServer) -> RedisStore {
    RedisStore::builder()
        .command_timeout(Duration::from_millis(500))
        .connect(&server.url())
        .await
        .expect("connect")
}

fn app(store: RedisStore) -> (Router, Counter) {
    let counter = Counter::default();
    (
        routes(counter.clone()).layer(IdempotencyLayer::new(store).single_tenant()),
        counter,
    )
}

/// The Redis key of `key` in the default (global) scope.
fn redis_key_of(store: &RedisStore, key: &str) -> String {
    store.redis_key(&StorageKey::new("", &IdempotencyKey::new(key).unwrap()))
}

fn pttl(server: &RedisServer, key: &str) -> i64 {
    server.command(&["PTTL", key]).trim().parse().unwrap()
}

#[tokio::test]
async fn ttl_is_the_lease_in_flight_and_the_retention_once_complete() {
    let server = start();
    let counter = Counter::default();
    let store = store(&server).await;
    let redis_key = &redis_key_of(&store, "k");
    let layer = IdempotencyLayer::new(store)
        .single_tenant()
        .lease(Duration::from_secs(5));
    let app = routes(counter.clone()).layer(layer);

    let slow = tokio::spawn({
        let app = app.clone();
        async move { oneshot(&app, post("/slow?ms=300", "k", CHARGE)).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let in_flight = pttl(&server, redis_key);
    assert!(
        (1..=5_000).contains(&in_flight),
        "in flight, PTTL is the lease: {in_flight}"
    );

    assert_eq!(slow.await.unwrap().status, StatusCode::CREATED);
    let completed = pttl(&server, redis_key);
    let day_ms = 24 * 60 * 60 * 1000;
    assert!(
        completed > day_ms - 10_000 && completed <= day_ms,
        "completed, PTTL is the 24 h retention: {completed}"
    );
}

/// Every command Redis ran since `before`, by name, from `INFO
/// commandstats` (which also counts the commands a script runs inside Redis).
fn calls_since(server: &RedisServer, before: &[(String, u64)]) -> Vec<(String, u64)> {
    let mut calls: Vec<(String, u64)> = command_calls(server.port())
        .into_iter()
        .filter(|(name, _)| name != "info")
        .filter_map(|(name, calls)| {
            let old = before
                .iter()
                .find(|(n, _)| *n == name)
                .map_or(0, |(_, c)| *c);
            (calls > old).then(|| (name, calls - old))
        })
        .collect();
    calls.sort();
    calls
}

#[tokio::test]
async fn first_execution_costs_two_round_trips_and_a_replay_one() {
    let server = start();
    let (app, runs) = app(store(&server).await);

    let before = command_calls(server.port());
    let first = oneshot(&app, post("/charges", "k", CHARGE)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let calls = |named: &[(&str, u64)]| -> Vec<(String, u64)> {
        named.iter().map(|(n, c)| (n.to_string(), *c)).collect()
    };
    match crate::FLAVOUR {
        Flavour::Redis => assert_eq!(
            calls_since(&server, &before),
            calls(&[("evalsha", 1), ("get", 1), ("set", 2)]),
            "first execution, two round trips: the claim (one plain SET NX PX GET) and \
             the completion (one EVALSHA, whose script runs a GET and a SET inside Redis)"
        ),
        Flavour::Valkey => assert_eq!(
            calls_since(&server, &before),
            calls(&[("set", 2)]),
            "first execution, two round trips and two commands: the claim (SET NX PX GET) \
             and the completion (SET IFEQ GET PX), no script"
        ),
    }

    let before = command_calls(server.port());
    assert!(
        oneshot(&app, post("/charges", "k", CHARGE))
            .await
            .is_replay()
    );
    assert_eq!(
        calls_since(&server, &before),
        calls(&[("set", 1)]),
        "replay: the claim's SET NX GET returns the record"
    );
    assert_eq!(runs.get(), 1);
}

#[tokio::test]
async fn cached_replays_cost_no_round_trip_check_the_fingerprint_and_stay_bounded() {
    // Scope isolation with the cache is covered by the `cached_redis` behaviour suite.
    let server = start();
    let cached = CachedStore::new(store(&server).await, 64 * 1024);
    let counter = Counter::default();
    let app = routes(counter.clone()).layer(IdempotencyLayer::new(cached.clone()).single_tenant());
    // A second process: its own cache over the same Redis.
    let other = routes(counter.clone()).layer(
        IdempotencyLayer::new(CachedStore::new(store(&server).await, 64 * 1024)).single_tenant(),
    );

    oneshot(&app, post("/charges", "k", CHARGE)).await;
    let before = command_calls(server.port());
    for _ in 0..10 {
        assert!(
            oneshot(&app, post("/charges", "k", CHARGE))
                .await
                .is_replay()
        );
    }
    oneshot(&app, post("/charges", "k", "{}"))
        .await
        .assert_problem(422);
    assert_eq!(
        calls_since(&server, &before),
        [],
        "the completing process replays from memory"
    );

    let before = command_calls(server.port());
    assert!(
        oneshot(&other, post("/charges", "k", CHARGE))
            .await
            .is_replay()
    );
    assert!(
        oneshot(&other, post("/charges", "k", CHARGE))
            .await
            .is_replay()
    );
    assert_eq!(
        calls_since(&server, &before),
        [("set".to_string(), 1)],
        "another process fetches the record once (its claim's SET NX GET), then replays from memory"
    );
    assert_eq!(counter.get(), 1);

    // Bounded: 200 records of 1 KiB never exceed the 64 KiB budget.
    for i in 0..200 {
        let key = format!("big-{i}");
        oneshot(&app, post("/big/1024", &key, "")).await;
        oneshot(&app, post("/big/1024", &key, "")).await;
    }
    assert!(
        cached.len() < 64,
        "cached {} records in 64 KiB",
        cached.len()
    );
}

/// The layer-level view of fencing: a request whose claim vanished (here
/// deleted, as if its lease expired during a long pause) and was taken by a
/// newer request finishes later, and its completion must not overwrite the
/// newer record.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_late_completion_never_overwrites_the_newer_record() {
    let server = start();
    let store = store(&server).await;
    let redis_key = &redis_key_of(&store, "k");
    let (app, runs) = app(store);

    let stale = tokio::spawn({
        let app = app.clone();
        async move { oneshot(&app, post("/slow?ms=600", "k", CHARGE)).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        server.command(&["DEL", redis_key]).trim(),
        "1",
        "the claim existed"
    );
    let newer = tokio::spawn({
        let app = app.clone();
        async move { oneshot(&app, post("/slow?ms=600", "k", CHARGE)).await }
    });

    let stale = stale.await.unwrap();
    assert_eq!(
        stale.outcome,
        Some(IdempotencyOutcome::Executed(Completion::LeaseLost)),
        "the stale request's completion was refused"
    );
    let newer = newer.await.unwrap();
    assert_eq!(
        newer.outcome,
        Some(IdempotencyOutcome::Executed(Completion::Stored))
    );
    let retry = oneshot(&app, post("/slow?ms=600", "k", CHARGE)).await;
    assert!(retry.is_replay());
    assert_eq!(retry.body, newer.body, "the newer record survived");
    assert_ne!(retry.body, stale.body);
    assert_eq!(runs.get(), 2);
}

#[tokio::test]
async fn redis_outage_fails_closed_and_recovers_without_restart() {
    let mut server = start();
    let (app, runs) = app(store(&server).await);
    assert_eq!(
        oneshot(&app, post("/charges", "before", CHARGE))
            .await
            .status,
        StatusCode::CREATED
    );

    server.kill();
    for i in 0..5 {
        let reply = oneshot(&app, post("/charges", &format!("during-{i}"), CHARGE)).await;
        reply.assert_problem(503);
        assert_eq!(reply.header("retry-after"), Some("1"));
    }
    assert_eq!(runs.get(), 1, "no handler runs while Redis is away");

    server.restart();
    let mut recovered = None;
    for _ in 0..50 {
        let reply = oneshot(&app, post("/charges", "after", CHARGE)).await;
        if reply.status == StatusCode::CREATED {
            recovered = Some(reply);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        recovered.is_some(),
        "the same app recovers once Redis is back"
    );
    assert!(
        oneshot(&app, post("/charges", "after", CHARGE))
            .await
            .is_replay()
    );
    assert_eq!(runs.get(), 2);
}

#[tokio::test]
async fn fail_open_runs_the_handler_unprotected_only_when_asked() {
    let mut server = start();
    let counter = Counter::default();
    let layer = IdempotencyLayer::new(store(&server).await)
        .single_tenant()
        .fail_open(true);
    let app = routes(counter.clone()).layer(layer);
    server.kill();
    let reply = oneshot(&app, post("/charges", "k", CHARGE)).await;
    assert_eq!(reply.status, StatusCode::CREATED);
    assert_eq!(reply.outcome, Some(IdempotencyOutcome::Unprotected));
    assert_eq!(counter.get(), 1);
}

/// Also: the completion that timed out on the client is applied by Redis when
/// it wakes, and the background retry that finds it must count it as stored,
/// not raise a false alarm.
#[tokio::test] // Current-thread: the captured logs see every task.
async fn a_hung_redis_cannot_hang_requests_and_completion_is_retried() {
    let (logs, _guard) = Logs::capture("tower_idempotency=info");
    let server = start();
    let store = RedisStore::builder()
        .command_timeout(Duration::from_millis(200))
        .connect(&server.url())
        .await
        .unwrap();
    let counter = Counter::default();
    let app = routes(counter.clone()).layer(
        IdempotencyLayer::new(store)
            .single_tenant()
            .lease(Duration::from_secs(5)),
    );

    let first = tokio::spawn({
        let app = app.clone();
        async move { oneshot(&app, post("/slow?ms=300", "k", CHARGE)).await }
    });
    tokio::time::sleep(Duration::from_millis(150)).await;
    // Redis stops answering while the handler runs: its completion times out.
    server.command(&["CLIENT", "PAUSE", "1500", "ALL"]);
    let first = first.await.unwrap();
    assert_eq!(
        first.status,
        StatusCode::CREATED,
        "the client gets its answer at once"
    );
    assert_eq!(
        first.outcome,
        Some(IdempotencyOutcome::Executed(Completion::Pending))
    );

    let during = oneshot(&app, post("/slow?ms=300", "k", CHARGE)).await;
    during.assert_problem(503);

    // Once Redis answers again, the background retry stores the record.
    let mut replay = None;
    for _ in 0..40 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let reply = oneshot(&app, post("/slow?ms=300", "k", CHARGE)).await;
        if reply.status == StatusCode::CREATED {
            replay = Some(reply);
            break;
        }
        assert!(
            matches!(reply.status.as_u16(), 503 | 409),
            "{:?}",
            reply.status
        );
    }
    let replay = replay.expect("the record was stored after the pause");
    assert!(replay.is_replay());
    assert_eq!(replay.body, first.body);
    assert_eq!(
        counter.get(),
        1,
        "a Redis blip never becomes a second execution"
    );
    let mut outcome = String::new();
    for _ in 0..50 {
        outcome = logs.text();
        if outcome.contains("after retrying") || outcome.contains("may execute again") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        outcome.contains("completion stored after retrying"),
        "{outcome}"
    );
    assert!(
        !outcome.contains("may execute again"),
        "no false alarm: {outcome}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn storm_of_200_requests_over_20_keys_executes_20_times() {
    let server = start();
    let layer = IdempotencyLayer::new(store(&server).await)
        .single_tenant()
        .wait_for_in_flight(Duration::from_secs(10));
    let counter = Counter::default();
    let http = Server::start(routes(counter.clone()).layer(layer)).await;
    let keys: Vec<String> = (0..200).map(|i| format!("storm-{}", i % 20)).collect();
    let requests = keys.iter().map(|key| http.post("/slow?ms=50", key, CHARGE));
    let replies = futures_util::future::join_all(requests).await;
    assert!(replies.iter().all(|r| r.status == StatusCode::CREATED));
    assert_eq!(counter.get(), 20, "exactly one execution per key");
    // One record per key, and the key-names marker.
    assert_eq!(server.command(&["DBSIZE"]).trim(), "21");
}

#[tokio::test]
async fn key_names_are_compact_and_every_instance_on_a_prefix_must_agree() {
    let server = start();
    let store = store(&server).await;
    let key = redis_key_of(&store, "order-42");
    assert_eq!(key.len(), "idempotency:".len() + 22, "{key}");
    assert_eq!(
        server.command(&["GET", "idempotency:key-names"]).trim(),
        "compact"
    );

    // An instance that would name the same records differently would not
    // find them: it refuses to start, and says what to configure.
    let readable = RedisStore::builder()
        .key_names(KeyNames::Readable)
        .connect(&server.url())
        .await
        .expect_err("a second naming on one prefix");
    assert!(
        readable.to_string().contains("KeyNames::Compact"),
        "{readable}"
    );
    // On a prefix of its own it starts.
    let other = RedisStore::builder()
        .prefix("legacy:")
        .key_names(KeyNames::Readable)
        .connect(&server.url())
        .await
        .expect("another prefix");
    assert!(redis_key_of(&other, "order-42").ends_with(":order-42"));
}

/// A completed record exactly as 0.1 wrote it: `c`, a u64 expiry, and the
/// 0.1 codec (`r`, fingerprint, status, u64 created-at, header block, body).
fn record_written_by_0_1(fingerprint: &Fingerprint, body: &[u8]) -> Vec<u8> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let mut value = vec![b'c'];
    value.extend_from_slice(&(now + 3_600_000).to_be_bytes());
    value.push(b'r');
    value.extend_from_slice(fingerprint.as_bytes());
    value.extend_from_slice(&201u16.to_be_bytes());
    value.extend_from_slice(&now.to_be_bytes());
    let (name, header) = (b"content-type", b"application/json");
    value.extend_from_slice(&((2 + name.len() + 4 + header.len()) as u32).to_be_bytes());
    value.extend_from_slice(&(name.len() as u16).to_be_bytes());
    value.extend_from_slice(name);
    value.extend_from_slice(&(header.len() as u32).to_be_bytes());
    value.extend_from_slice(header);
    value.extend_from_slice(body);
    value
}

#[tokio::test]
async fn an_upgrade_from_0_1_keeps_its_records_or_refuses_to_start() {
    let server = start();
    let fingerprint = Fingerprint::from_bytes([7; 32]);
    let key = StorageKey::new("", &IdempotencyKey::new("order-1").unwrap());
    // What 0.1 left: a completed record under its readable name.
    let client = redis::Client::open(server.url()).unwrap();
    let mut redis = client.get_multiplexed_async_connection().await.unwrap();
    let () = redis::cmd("SET")
        .arg(format!("idempotency:{key}"))
        .arg(record_written_by_0_1(&fingerprint, br#"{"id":"ch_1"}"#))
        .query_async(&mut redis)
        .await
        .unwrap();

    // Compact names would miss it, and its retry would charge again.
    let refused = RedisStore::builder()
        .connect(&server.url())
        .await
        .expect_err("compact names over 0.1's records");
    assert!(
        refused.to_string().contains("KeyNames::Readable"),
        "{refused}"
    );

    // Kept readable, the 0.1 record replays.
    let store = RedisStore::builder()
        .key_names(KeyNames::Readable)
        .connect(&server.url())
        .await
        .unwrap();
    match store
        .claim(&key, &fingerprint, Duration::from_secs(5))
        .await
        .unwrap()
    {
        Claim::Completed { record, .. } => match &*record {
            CompletedRecord::Response(response) => {
                assert_eq!(response.status(), StatusCode::CREATED);
                assert_eq!(&response.body()[..], br#"{"id":"ch_1"}"#);
            }
            other => panic!("{other:?}"),
        },
        other => panic!("{other:?}"),
    }
}

#[cfg(feature = "compression")]
#[tokio::test]
async fn compressed_records_replay_the_original_bytes_and_store_fewer() {
    use axum::{extract::State, routing::post as route_post};
    use tower_idempotency::codec::Compression;

    let server = start();
    let counter = Counter::default();
    // A 4 KiB charge-like body: JSON that compresses.
    async fn big_charge(State(counter): State<Counter>) -> (StatusCode, String) {
        counter.incr();
        let lines: Vec<String> = (0..60)
            .map(|i| {
                format!(
                    r#"{{"id":"li_{i:04}","amount":{},"currency":"eur"}}"#,
                    i * 7
                )
            })
            .collect();
        (
            StatusCode::CREATED,
            format!(r#"{{"lines":[{}]}}"#, lines.join(",")),
        )
    }
    let app = |store: RedisStore| {
        Router::new()
            .route("/charges", route_post(big_charge))
            .with_state(counter.clone())
            .layer(IdempotencyLayer::new(store).single_tenant())
    };
    let compressing = RedisStore::builder()
        .compression(Compression::zstd(1))
        .connect(&server.url())
        .await
        .unwrap();
    let key = redis_key_of(&compressing, "big-1");
    let first = oneshot(&app(compressing), post("/charges", "big-1", CHARGE)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(first.body.len() > 2000);
    let stored: usize = server.command(&["STRLEN", &key]).trim().parse().unwrap();
    assert!(
        stored * 3 < first.body.len(),
        "{stored} B stored for {} B",
        first.body.len()
    );

    // Any instance built with the feature replays it, byte for byte.
    let plain = store(&server).await;
    let replay = oneshot(&app(plain), post("/charges", "big-1", CHARGE)).await;
    assert!(replay.is_replay());
    assert_eq!(replay.body, first.body);
    assert_eq!(counter.get(), 1);
}

/// A record tampered in Redis — its zstd frame swapped for one that claims
/// 64 MiB, or the value cut short — is a clear `503`: decompression is
/// bounded by the largest body the store keeps (1 MiB by default), not by
/// what a frame claims (it allocated 256 MiB per replay), and a corrupt
/// record is never taken for another request's (`422`).
#[tokio::test]
async fn a_tampered_record_is_a_503_and_never_decompresses_past_the_limit() {
    use std::io::Read;
    use tower_idempotency::codec::Compression;

    let server = start();
    let compressing = || async {
        RedisStore::builder()
            .compression(Compression::zstd(1).min_size(64))
            .connect(&server.url())
            .await
            .unwrap()
    };
    let store = compressing().await;
    let (app, counter) = app(store.clone());
    let body = format!(r#"{{"note":"{}"}}"#, "abc".repeat(200));
    for key in ["bomb", "cut"] {
        let first = oneshot(&app, post("/charges", key, &body)).await;
        assert_eq!(first.status, StatusCode::CREATED);
    }
    let frame_at = |value: &[u8]| {
        value
            .windows(4)
            .position(|w| w == [0x28, 0xb5, 0x2f, 0xfd])
            .expect("a zstd frame")
    };
    // 64 MiB of zeros, a few KiB compressed, its size in the frame header.
    let mut encoder = zstd::stream::Encoder::new(Vec::new(), 1).unwrap();
    encoder.set_pledged_src_size(Some(64 << 20)).unwrap();
    std::io::copy(&mut std::io::repeat(0).take(64 << 20), &mut encoder).unwrap();
    let bomb = encoder.finish().unwrap();
    rewrite_redis_value(&server.url(), &redis_key_of(&store, "bomb"), |value| {
        [&value[..frame_at(&value)], &bomb[..]].concat()
    })
    .await;
    rewrite_redis_value(&server.url(), &redis_key_of(&store, "cut"), |value| {
        value[..value.len() / 2].to_vec()
    })
    .await;
    for key in ["bomb", "cut"] {
        let replay = oneshot(&app, post("/charges", key, &body)).await;
        replay.assert_problem(503);
    }
    assert_eq!(counter.get(), 2, "nothing ran again");
}

/// A duplicate of a request in flight on Redis (and in memory) used to be
/// told to come back when the lease ran out — `Retry-After: 30`, or a
/// 29 s gRPC pushback — for a handler that takes half a second: a client
/// that honours it waits 60 times too long. The hint is short, 1 s by
/// default, or what the layer is configured with.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_duplicate_in_flight_is_told_to_come_back_soon_not_when_the_lease_ends() {
    let server = start();
    for (layer, expected) in [
        (
            IdempotencyLayer::new(store(&server).await).single_tenant(),
            "1",
        ),
        (
            IdempotencyLayer::new(store(&server).await)
                .single_tenant()
                .in_flight_retry_after(Duration::from_secs(3)),
            "3",
        ),
    ] {
        let counter = Counter::default();
        let app = routes(counter.clone()).layer(layer);
        let key = format!("slow-{expected}");
        let first = tokio::spawn({
            let (app, key) = (app.clone(), key.clone());
            async move { oneshot(&app, post("/slow?ms=500", &key, CHARGE)).await }
        });
        while counter.get() == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let duplicate = oneshot(&app, post("/slow?ms=500", &key, CHARGE)).await;
        duplicate.assert_problem(409);
        assert_eq!(duplicate.header("retry-after"), Some(expected));
        assert_eq!(first.await.unwrap().status, StatusCode::CREATED);
    }
}

/// A Redis URL that does not parse is a configuration mistake, said as
/// such — not "unavailable", which would send an operator after an outage.
#[tokio::test]
async fn a_redis_url_that_does_not_parse_is_a_misconfiguration() {
    for url in ["redis://127.0.0.1:notaport", "http://127.0.0.1:6379"] {
        let error = RedisStore::builder().connect(url).await.unwrap_err();
        assert!(
            matches!(
                error,
                tower_idempotency::store::StoreError::Misconfigured(_)
            ),
            "{url}: {error}"
        );
    }
}
