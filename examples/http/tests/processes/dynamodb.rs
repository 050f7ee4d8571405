//! On DynamoDB (the `dynamodb` feature; a dynoxide server per test): the
//! charge and its record in one `TransactWriteItems`.

use std::time::Duration;

use http::StatusCode;
use tower_idempotency::{
    DynamoDbStore, IdempotencyKey,
    aws_sdk_dynamodb::types::AttributeValue,
    store::{KeyState, StorageKey, Store},
};

use crate::support::{
    dynamodb::{DynamoServer, table_name},
    http::HttpClient,
    payments::{Payments, charge_request, kill_mid_charge, retry_until_done},
    redis_server::free_port,
};

/// The charges the example's table holds for the crash-test account.
async fn charges(server: &DynamoServer, table: &str) -> usize {
    server
        .client()
        .query()
        .table_name(format!("{table}_charges"))
        .key_condition_expression("account = :a")
        .expression_attribute_values(":a", AttributeValue::S("acct_crash".into()))
        .consistent_read(true)
        .send()
        .await
        .expect("query the charges")
        .items()
        .len()
}

fn env(
    server: &DynamoServer,
    table: &str,
    extra: &[(&'static str, &str)],
) -> Vec<(String, String)> {
    let mut env: Vec<(String, String)> = server
        .env()
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
    env.push(("DYNAMODB_TABLE".into(), table.to_owned()));
    env.extend(
        extra
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned())),
    );
    env
}

fn as_env(env: &[(String, String)]) -> Vec<(&str, &str)> {
    env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect()
}

/// Concurrent duplicates over two processes: one execution, one charge
/// item, the rest `409` or replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_processes_on_one_table_charge_a_key_once() {
    let server = DynamoServer::start();
    let table = table_name();
    let env = env(&server, &table, &[("PROCESSOR_LATENCY_MS", "300")]);
    let a = Payments::start(free_port(), &as_env(&env));
    let b = Payments::start(free_port(), &as_env(&env));
    let client = HttpClient::default();
    let replies = futures_util::future::join_all((0..16).map(|i| {
        let addr = if i % 2 == 0 { &a.addr } else { &b.addr };
        client.send(charge_request(addr))
    }))
    .await;
    let executed = replies
        .iter()
        .filter(|r| r.status == StatusCode::CREATED && !r.is_replay())
        .count();
    assert_eq!(
        executed,
        1,
        "{:?}",
        replies.iter().map(|r| r.status).collect::<Vec<_>>()
    );
    let (done, _) = retry_until_done(&client, &b.addr).await;
    assert!(done.is_replay());
    assert_eq!(charges(&server, &table).await, 1, "exactly one charge");
}

/// Killed (-9) mid-charge: nothing was sent to DynamoDB but the claim, so
/// nothing is charged; the claim lapses after the transaction's bound,
/// and the retry charges once. The processor answers well inside that
/// bound: a commit after it is refused (the claim may have passed to
/// another request), so a handler slower than its bound never charges.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_mid_charge_nothing_commits_and_the_retry_charges_once() {
    let server = DynamoServer::start();
    let table = table_name();
    let env = env(
        &server,
        &table,
        &[
            ("PROCESSOR_LATENCY_MS", "1000"),
            ("IDEMPOTENCY_TX_TIMEOUT_MS", "4000"),
        ],
    );
    let client = HttpClient::default();
    let store = async || {
        DynamoDbStore::builder(server.client())
            .table(&table)
            .build()
            .await
            .expect("the example's table")
    };
    let key = StorageKey::new("acct_crash", &IdempotencyKey::new("crash-1").unwrap());
    let restarted = kill_mid_charge(&client, &as_env(&env), async |_| {
        matches!(
            store().await.inspect(&key).await,
            Ok(KeyState::InFlight { .. })
        )
    })
    .await;
    assert_eq!(charges(&server, &table).await, 0, "nothing committed");
    let (done, conflicts) = retry_until_done(&client, &restarted.addr).await;
    assert_eq!(done.status, StatusCode::CREATED, "{:?}", done.body);
    assert!(!done.is_replay());
    assert!(
        conflicts > 0,
        "the dead process's claim held until its bound"
    );
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(charges(&server, &table).await, 1, "charged once");
    let (again, _) = retry_until_done(&client, &restarted.addr).await;
    assert!(again.is_replay());
}

/// A charge whose item is over DynamoDB's 400 KB (a description of half a
/// megabyte) can never be written: `413` that says why, on every retry —
/// never a `500` the client would retry for ever — and nothing charged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_charge_too_large_for_its_item_is_a_413_that_says_why_on_every_retry() {
    let server = DynamoServer::start();
    let table = table_name();
    let env = env(&server, &table, &[]);
    let payments = Payments::start(free_port(), &as_env(&env));
    let client = HttpClient::default();
    let body = serde_json::json!({
        "amount": 1999,
        "currency": "eur",
        "description": "x".repeat(500 * 1024),
    })
    .to_string();
    for _ in 0..2 {
        let request = http::Request::post(format!("http://{}/v1/charges", payments.addr))
            .header("authorization", "Bearer acct_crash")
            .header("idempotency-key", "too-large-1")
            .header("content-type", "application/json")
            .body(axum::body::Body::from(body.clone()))
            .unwrap();
        let reply = client.send(request).await;
        reply.assert_problem(413);
        assert!(
            reply.json()["detail"].as_str().unwrap().contains("size"),
            "{}",
            reply.json()
        );
    }
    assert_eq!(charges(&server, &table).await, 0);
}
