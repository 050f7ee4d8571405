//! On Redis, whose records live apart from the charges: the windows a lease
//! store leaves, and the downstream key that closes them.

use std::time::Duration;

use http::StatusCode;
use tower_idempotency::sqlx;

use crate::support::{
    http::HttpClient,
    payments::{Payments, charge_request, kill_mid_charge, retry_until_done},
    redis_server::{RedisServer, free_port},
    sqlite::TestFile,
};

const CHARGES: &str = "SELECT count(*) FROM charges";

fn start_payments(redis_url: &str, port: u16) -> Payments {
    Payments::start(
        port,
        &[
            ("REDIS_URL", redis_url),
            ("PROCESSOR_LATENCY_MS", "2000"),
            ("IDEMPOTENCY_LEASE_MS", "1500"),
        ],
    )
}

/// The crash window of a lease store: records in Redis, charges committed
/// on their own (here in SQLite). Killed after the charge's commit and
/// before the record, the key executes again once the dead process's lease
/// expires — and the example's downstream key (the charge carries the
/// account's idempotency key under a unique constraint) makes that second
/// execution find the first charge: one charge, answered with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_the_charge_on_redis_the_downstream_key_keeps_one_charge() {
    let file = TestFile::create();
    let redis = RedisServer::start();
    let client = HttpClient::default();
    let (database, url) = (file.url(), redis.url());
    let env = [
        ("DATABASE_URL", database.as_str()),
        ("REDIS_URL", url.as_str()),
        ("PROCESSOR_LATENCY_MS", "2000"),
        ("IDEMPOTENCY_LEASE_MS", "1500"),
    ];
    let charged = async |_: &str| file.count(CHARGES).await == 1;
    let payments = kill_mid_charge(&client, &env, charged).await;
    assert_eq!(
        file.count(CHARGES).await,
        1,
        "the charge committed on its own before the crash"
    );
    let first_id: String = file_value(&file, "SELECT id FROM charges").await;

    let (executed, conflicts) = retry_until_done(&client, &payments.addr).await;
    assert!(conflicts > 0, "409 until the dead process's lease expired");
    assert_eq!(executed.status, StatusCode::CREATED);
    assert!(!executed.is_replay(), "executed again: the window is real");
    assert_eq!(
        file.count(CHARGES).await,
        1,
        "the second execution found the first charge"
    );
    let body: serde_json::Value = serde_json::from_slice(&executed.body).unwrap();
    assert_eq!(
        body["id"],
        first_id.as_str(),
        "answered with the first charge"
    );
}

/// A lease store and a paused process: the instance holding a key is
/// stopped (SIGSTOP, a VM stall) longer than its lease, the retry executes
/// on another instance, and the paused one resumes and finishes its charge
/// too. Two executions of one key — and one charge, by the downstream key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_paused_past_its_lease_on_redis_executes_twice_and_charges_once() {
    let file = TestFile::create();
    let redis = RedisServer::start();
    let client = HttpClient::default();
    let (database, url) = (file.url(), redis.url());
    let env = [
        ("DATABASE_URL", database.as_str()),
        ("REDIS_URL", url.as_str()),
        ("PROCESSOR_LATENCY_MS", "1500"),
        ("IDEMPOTENCY_LEASE_MS", "600"),
    ];
    let paused = Payments::start(free_port(), &env);
    let other = Payments::start(free_port(), &env);
    let first = tokio::spawn({
        let (client, addr) = (client.clone(), paused.addr.clone());
        async move { client.send(charge_request(&addr)).await }
    });
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while file.count(CHARGES).await == 0 {
        assert!(std::time::Instant::now() < deadline, "never charged");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    paused.signal("STOP");
    // Past the lease: its heartbeats stopped with it.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let (retried, _) = retry_until_done(&client, &other.addr).await;
    assert_eq!(retried.status, StatusCode::CREATED);
    assert!(!retried.is_replay(), "the key executed a second time");
    paused.signal("CONT");
    let first = first.await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(file.count(CHARGES).await, 1, "one charge all the same");
    let (a, b): (serde_json::Value, serde_json::Value) = (
        serde_json::from_slice(&first.body).unwrap(),
        serde_json::from_slice(&retried.body).unwrap(),
    );
    assert_eq!(a["id"], b["id"], "both answers name the one charge");
}

/// One text value from the file's database.
async fn file_value(file: &TestFile, sql: &str) -> String {
    use sqlx::Connection;
    let mut connection = sqlx::SqliteConnection::connect(&file.url()).await.unwrap();
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
        .fetch_one(&mut connection)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payments_process_killed_mid_handler_retry_waits_for_the_lease_then_executes() {
    let redis = RedisServer::start();
    let port = free_port();
    let client = HttpClient::default();

    let mut payments = start_payments(&redis.url(), port);
    let doomed = tokio::spawn({
        let client = client.clone();
        let addr = payments.addr.clone();
        async move {
            // The connection dies with the process; only the attempt matters.
            let _ = tokio::time::timeout(Duration::from_secs(5), async move {
                client.send(charge_request(&addr)).await
            })
            .await;
        }
    });
    // Killed once its claim is in Redis (beside the key-names marker): the
    // handler is running.
    for _ in 0..100 {
        if redis.command(&["DBSIZE"]).trim() == "2" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(redis.command(&["DBSIZE"]).trim(), "2", "never claimed");
    payments.child.kill().unwrap(); // SIGKILL, mid-handler
    payments.child.wait().unwrap();
    doomed.abort();

    let payments = start_payments(&redis.url(), port);
    let retry = client.send(charge_request(&payments.addr)).await;
    retry.assert_problem(409);
    assert!(retry.header("retry-after").is_some());

    // Once the dead process's lease expires, the retry executes.
    let mut executed = None;
    for _ in 0..60 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let reply = client.send(charge_request(&payments.addr)).await;
        if reply.status != StatusCode::CONFLICT {
            executed = Some(reply);
            break;
        }
    }
    let executed = executed.expect("the lease expired within a few seconds");
    assert_eq!(executed.status, StatusCode::CREATED);
    assert!(!executed.is_replay());

    let list = http::Request::get(format!("http://{}/v1/charges", payments.addr))
        .header("authorization", "Bearer acct_crash")
        .body(axum::body::Body::empty())
        .unwrap();
    let charges = client.send(list).await.json();
    assert_eq!(
        charges.as_array().unwrap().len(),
        1,
        "the killed attempt never charged; the retry did once"
    );
}
