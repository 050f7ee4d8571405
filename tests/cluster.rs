//! The Redis store on a real local Redis Cluster: key spread across
//! masters, timeouts, and a master failover with `WAIT`. (The behaviour
//! cases run on a cluster too, in `behaviour/`.)

// The suite runs against every store: `cargo test --all-features`.
#![cfg(every_store)]

mod support;

use std::time::Duration;

use http::StatusCode;
use tower_idempotency::{IdempotencyLayer, RedisStore};

use support::{
    app::{Counter, routes},
    backend::{self, Backend},
    cluster::RedisCluster,
    http::{oneshot, post},
    redis_server::raw_command,
};

const CHARGE: &str = r#"{"amount":1999,"currency":"eur"}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn records_spread_over_every_master() {
    let cluster = backend::Cluster::start();
    let counter = Counter::default();
    let app =
        routes(counter.clone()).layer(IdempotencyLayer::new(cluster.store().await).single_tenant());
    for i in 0..300 {
        let reply = oneshot(&app, post("/charges", &format!("order-{i}"), CHARGE)).await;
        assert_eq!(reply.status, StatusCode::CREATED);
    }
    assert_eq!(counter.get(), 300);
    let masters = cluster.0.master_ports();
    assert_eq!(masters.len(), 3);
    let sizes: Vec<u64> = masters.iter().map(|&p| RedisCluster::dbsize(p)).collect();
    assert_eq!(
        sizes.iter().sum::<u64>(),
        301,
        "300 records and the key-names marker: {sizes:?}"
    );
    assert!(
        sizes.iter().all(|&n| n > 0),
        "every master holds records: {sizes:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn completed_records_survive_a_master_failover_with_wait() {
    let mut cluster = RedisCluster::start(3, 1);
    let store = RedisStore::builder()
        .wait_for_replicas(1, Duration::from_secs(2))
        .command_timeout(Duration::from_millis(500))
        .connect_cluster(cluster.urls())
        .await
        .unwrap();
    let counter = Counter::default();
    let app = routes(counter.clone()).layer(IdempotencyLayer::new(store).single_tenant());
    let keys: Vec<String> = (0..60).map(|i| format!("pay-{i}")).collect();
    let mut first = Vec::new();
    for key in &keys {
        let reply = oneshot(&app, post("/charges", key, CHARGE)).await;
        assert_eq!(reply.status, StatusCode::CREATED);
        first.push(reply.body);
    }
    assert_eq!(counter.get(), 60);

    // Stop a master that holds records; its replica must take over.
    let victim = *cluster
        .master_ports()
        .iter()
        .find(|&&p| RedisCluster::dbsize(p) > 0)
        .expect("a master with records");
    cluster.node_mut(victim).kill();
    cluster.wait_for_masters(3, Duration::from_secs(30));

    // Every completed key replays: zero re-executions. Requests may get 503
    // while the client learns the new topology; they are retried like a
    // client would.
    let mut unavailable = 0;
    for (key, body) in keys.iter().zip(&first) {
        let mut replay = None;
        for _ in 0..100 {
            let reply = oneshot(&app, post("/charges", key, CHARGE)).await;
            if reply.status == StatusCode::SERVICE_UNAVAILABLE {
                unavailable += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
            replay = Some(reply);
            break;
        }
        let replay = replay.unwrap_or_else(|| panic!("{key}: no answer after the failover"));
        assert!(
            replay.is_replay(),
            "{key} must replay after the failover, got {}",
            replay.status
        );
        assert_eq!(&replay.body, body);
    }
    assert_eq!(counter.get(), 60, "zero re-executions after the failover");
    eprintln!(
        "failover: 60 keys replayed, 0 re-executions, {unavailable} transient 503s while the client refreshed its slot map"
    );

    // New keys keep working.
    let fresh = oneshot(&app, post("/charges", "after-failover", CHARGE)).await;
    assert_eq!(fresh.status, StatusCode::CREATED);
    assert!(
        oneshot(&app, post("/charges", "after-failover", CHARGE))
            .await
            .is_replay()
    );
    assert_eq!(counter.get(), 61);
}

/// The command timeout on a cluster is the documented one, and a claim the
/// cluster runs after that timeout is released rather than blocking the key
/// for a lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cluster_timeouts_are_the_documented_ones_and_late_claims_are_released() {
    let cluster = RedisCluster::start(3, 0);
    let pause_every_master = || {
        for port in cluster.master_ports() {
            raw_command(port, &["CLIENT", "PAUSE", "1500", "ALL"]);
        }
    };
    let store = |timeout| {
        RedisStore::builder()
            .command_timeout(timeout)
            .connect_cluster(cluster.urls())
    };
    let counter = Counter::default();

    let patient = store(Duration::from_secs(3)).await.unwrap();
    let app = routes(counter.clone()).layer(IdempotencyLayer::new(patient).single_tenant());
    pause_every_master();
    let reply = oneshot(&app, post("/charges", "patient", CHARGE)).await;
    assert_eq!(
        reply.status,
        StatusCode::CREATED,
        "a 1.5 s stall is within the 3 s timeout"
    );

    let hasty = store(Duration::from_millis(300)).await.unwrap();
    let app = routes(counter.clone()).layer(IdempotencyLayer::new(hasty).single_tenant());
    pause_every_master();
    oneshot(&app, post("/charges", "late", CHARGE))
        .await
        .assert_problem(503);
    tokio::time::sleep(Duration::from_millis(1300)).await;
    let mut executed = false;
    for _ in 0..30 {
        let reply = oneshot(&app, post("/charges", "late", CHARGE)).await;
        if reply.status == StatusCode::CREATED {
            executed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(executed, "the late claim was released: the retry executes");
    assert_eq!(counter.get(), 2);
}
