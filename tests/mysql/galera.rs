//! A real three-node MariaDB Galera cluster on loopback: row locks are
//! local to a node, so duplicates sent to different nodes all claim their
//! key and run their handler; one commits, the others fail certification
//! at `COMMIT`. What must hold: exactly one committed charge per key, and
//! no client ever gets a `2xx` for a charge that was rolled back.

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use axum::{Router, extract::Query, http::StatusCode, routing::post};
use tower_idempotency::{IdempotencyLayer, MySqlStore, MySqlTxStore, sqlx};

use super::{CHARGE, CHARGES, Tx};
use crate::support::{
    galera::GaleraCluster,
    http::{Reply, Server},
    mysql::{TestDatabase, with_database},
};

#[derive(serde::Deserialize)]
struct Wait {
    ms: u64,
}

/// Inserts a charge, then waits (the payment processor), counting its
/// runs: a handler whose transaction loses certification ran anyway.
fn app(store: MySqlTxStore, runs: Arc<AtomicUsize>) -> Router {
    let charge = async move |mut tx: Tx, Query(wait): Query<Wait>| {
        runs.fetch_add(1, Ordering::SeqCst);
        let inserted = sqlx::query("INSERT INTO charges (note) VALUES ('charged')")
            .execute(&mut *tx)
            .await;
        if let Err(e) = inserted {
            return (StatusCode::INTERNAL_SERVER_ERROR, e.to_string());
        }
        tokio::time::sleep(Duration::from_millis(wait.ms)).await;
        (
            StatusCode::CREATED,
            format!("charged by {}", std::process::id()),
        )
    };
    Router::new()
        .route("/charges", post(charge))
        .layer(IdempotencyLayer::new(store).single_tenant())
}

/// One app per node, each on its own store connected to that node.
async fn apps(cluster: &GaleraCluster, db: &TestDatabase, runs: &Arc<AtomicUsize>) -> Vec<Server> {
    let mut servers = Vec::new();
    for i in 0..cluster.len() {
        let url = with_database(&cluster.url(i), db.name());
        let store = MySqlStore::builder()
            .transactional()
            .create_table_if_missing()
            .connect(&url)
            .await
            .expect("connect to the node");
        sqlx::raw_sql(
            "CREATE TABLE IF NOT EXISTS charges (id BIGINT AUTO_INCREMENT PRIMARY KEY, note TEXT) ENGINE = InnoDB",
        )
        .execute(store.pool())
        .await
        .unwrap();
        servers.push(Server::start(app(store, runs.clone())).await);
    }
    servers
}

/// Rows of `sql` as node `i` sees them once it has applied everything
/// committed before (`wsrep_sync_wait`).
async fn count_on(cluster: &GaleraCluster, i: usize, db: &TestDatabase, sql: &str) -> i64 {
    let url = with_database(&cluster.url(i), db.name());
    let mut on = crate::support::mysql::connect(&url).await;
    sqlx::raw_sql("SET SESSION wsrep_sync_wait = 1")
        .execute(&mut on)
        .await
        .unwrap();
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
        .fetch_one(&mut on)
        .await
        .unwrap()
}

/// Retries `path` with `key` on `server` while the answer is "try again"
/// (`409`, `503`): the first definitive answer.
async fn settled(server: &Server, path: &str, key: &str) -> Reply {
    for _ in 0..100 {
        let reply = server.post(path, key, CHARGE).await;
        if !matches!(
            reply.status,
            StatusCode::CONFLICT | StatusCode::SERVICE_UNAVAILABLE
        ) {
            return reply;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("{key} never settled");
}

/// One cluster (starting one takes seconds) for every case, each in a
/// database of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_a_three_node_galera_cluster() {
    let mut cluster = GaleraCluster::start(3);
    concurrent_duplicates_on_three_nodes_commit_one_charge_per_key(&cluster).await;
    a_node_killed_mid_charge_leaves_one_charge_after_retries(&mut cluster).await;
}

/// Twelve duplicates of each of five keys, four sent to each node at once:
/// each node lets one run; at `COMMIT` one wins and the others fail
/// certification, their responses withheld (`503`). Every client's retry
/// then replays the winner's charge. One charge per key, on every node;
/// a `201` only ever for the charge that committed.
async fn concurrent_duplicates_on_three_nodes_commit_one_charge_per_key(cluster: &GaleraCluster) {
    let db = TestDatabase::on(&cluster.url(0));
    let runs = Arc::new(AtomicUsize::new(0));
    let servers = apps(cluster, &db, &runs).await;
    let keys: Vec<String> = (0..5).map(|k| format!("order-{k}")).collect();
    let sends = keys.iter().flat_map(|key| {
        servers.iter().flat_map(move |server| {
            (0..4).map(
                move |_| async move { (key, server.post("/charges?ms=300", key, CHARGE).await) },
            )
        })
    });
    let replies = futures_util::future::join_all(sends).await;
    for key in &keys {
        let executed: Vec<&Reply> = replies
            .iter()
            .filter(|(k, r)| *k == key && r.status.is_success() && !r.is_replay())
            .map(|(_, r)| r)
            .collect();
        assert!(
            executed.len() <= 1,
            "{key}: a 2xx for a charge that was rolled back: {executed:?}"
        );
        for (_, reply) in replies.iter().filter(|(k, _)| *k == key) {
            assert!(
                matches!(
                    reply.status,
                    StatusCode::CREATED | StatusCode::CONFLICT | StatusCode::SERVICE_UNAVAILABLE
                ),
                "{key}: {} {:?}",
                reply.status,
                reply.body
            );
        }
        // Every node's clients end with the one charge.
        let answers: Vec<Reply> = futures_util::future::join_all(
            servers.iter().map(|s| settled(s, "/charges?ms=300", key)),
        )
        .await;
        let first = executed
            .first()
            .map(|r| r.body.clone())
            .unwrap_or_else(|| answers[0].body.clone());
        for answer in &answers {
            assert_eq!(answer.status, StatusCode::CREATED, "{:?}", answer.body);
            assert_eq!(answer.body, first, "{key}: the one charge, replayed");
        }
    }
    for node in 0..cluster.len() {
        assert_eq!(
            count_on(cluster, node, &db, CHARGES).await,
            keys.len() as i64,
            "one charge per key, on node {node}"
        );
    }
    eprintln!(
        "galera: {} handler runs for {} keys over 3 nodes (the losers' ran, then lost certification)",
        runs.load(Ordering::SeqCst),
        keys.len()
    );
}

/// A charge in flight on node 1 when node 1 is killed (-9): its uncommitted
/// transaction dies with the node; the client's retry, sent to node 2,
/// charges once, and every surviving node agrees.
async fn a_node_killed_mid_charge_leaves_one_charge_after_retries(cluster: &mut GaleraCluster) {
    let db = TestDatabase::on(&cluster.url(0));
    let runs = Arc::new(AtomicUsize::new(0));
    let servers = apps(cluster, &db, &runs).await;
    let doomed = tokio::spawn({
        let (client, url) = (
            servers[1].client.clone(),
            servers[1].url("/charges?ms=3000"),
        );
        async move {
            let mut request = crate::support::http::post("/charges?ms=3000", "crash-1", CHARGE);
            *request.uri_mut() = url.parse().unwrap();
            client.send(request).await
        }
    });
    while runs.load(Ordering::SeqCst) == 0 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    cluster.kill(1);
    let lost = doomed.await.unwrap();
    assert!(
        !lost.status.is_success(),
        "the killed node's charge is never answered as done: {} {:?}",
        lost.status,
        lost.body
    );
    let retry = settled(&servers[2], "/charges?ms=3000", "crash-1").await;
    assert_eq!(retry.status, StatusCode::CREATED, "{:?}", retry.body);
    assert!(
        settled(&servers[0], "/charges?ms=3000", "crash-1")
            .await
            .is_replay()
    );
    for node in [0, 2] {
        assert_eq!(
            count_on(cluster, node, &db, CHARGES).await,
            1,
            "one charge, on node {node}"
        );
    }
}
