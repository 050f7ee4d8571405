//! The DynamoDB stores on a real DynamoDB-compatible server (dynoxide, a
//! process per test, reached through the AWS SDK over HTTP): what the
//! protocol builds on, checked on the server first (the old item returned
//! by a refused conditional write, a repeated `ClientRequestToken` applied
//! once, the TTL attribute); the handler's writes and the record in one
//! `TransactWriteItems` under concurrent duplicates, a handler condition
//! that fails, a claim that lapsed; a record over the item limit; the
//! start-up check's mistakes and outages. The store contracts and the
//! behaviour cases run on both stores in `contract.rs` and `behaviour/`.
//!
//! dynoxide runs one writer at a time: the race tests prove the protocol's
//! decisions (one grant, the rest told), not DynamoDB's own contention.

// The suite runs against every store: `cargo test --all-features`.
#![cfg(every_store)]

mod support;

use std::time::Duration;

use axum::{Router, http::StatusCode, routing::post};
use support::{
    app::Counter,
    backend::{Backend, Dynamo, DynamoCharges, DynamoTxBackend},
    dynamodb::{DynamoServer, client_of, table_name},
    http::{oneshot, post as request},
};
use tower_idempotency::{
    DynamoDbStore, DynamoDbTx, Fingerprint, IdempotencyKey, IdempotencyLayer, IdempotentTx,
    aws_sdk_dynamodb::{
        Client,
        operation::put_item::PutItemError,
        types::{
            AttributeValue, ReturnValuesOnConditionCheckFailure, TimeToLiveStatus,
            TransactWriteItem, Update,
        },
    },
    store::{Claim, StorageKey, Store, StoreError},
    testing::TxEffects,
};

const CHARGE: &str = r#"{"amount":1999,"currency":"eur"}"#;

/// A table keyed by `pk`, made through the store (and so as it needs it).
async fn table(server: &DynamoServer) -> (Client, String) {
    let name = table_name();
    DynamoDbStore::builder(server.client())
        .table(&name)
        .create_table_if_missing()
        .build()
        .await
        .expect("the table");
    (server.client(), name)
}

/// A refused conditional `PutItem` with `ReturnValuesOnConditionCheckFailure`
/// returns the item it met, in the same call: what makes a replay or a
/// `409` one round trip.
#[tokio::test]
async fn the_server_returns_the_item_a_refused_conditional_put_met() {
    let server = DynamoServer::start();
    let (client, name) = table(&server).await;
    let put = |value: &str| {
        client
            .put_item()
            .table_name(&name)
            .item("pk", AttributeValue::S("k".into()))
            .item("v", AttributeValue::S(value.into()))
            .condition_expression("attribute_not_exists(pk)")
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
            .send()
    };
    put("first").await.expect("the first put");
    let refused = put("second").await.expect_err("a second put is refused");
    let service = refused.into_service_error();
    let PutItemError::ConditionalCheckFailedException(failed) = service else {
        panic!("not a condition failure: {service:?}");
    };
    assert_eq!(
        failed.item().and_then(|item| item.get("v")),
        Some(&AttributeValue::S("first".into())),
        "the old item comes back with the refusal"
    );
}

/// A `TransactWriteItems` sent twice with one `ClientRequestToken` (a
/// commit retried after an unknown outcome) is applied once.
#[tokio::test]
async fn the_server_applies_a_repeated_client_request_token_once() {
    let server = DynamoServer::start();
    let (client, name) = table(&server).await;
    let add = Update::builder()
        .table_name(&name)
        .key("pk", AttributeValue::S("counter".into()))
        .update_expression("ADD n :one")
        .expression_attribute_values(":one", AttributeValue::N("1".into()))
        .build()
        .unwrap();
    for _ in 0..2 {
        client
            .transact_write_items()
            .transact_items(TransactWriteItem::builder().update(add.clone()).build())
            .client_request_token("the-same-commit")
            .send()
            .await
            .expect("the commit, and its retry");
    }
    let item = client
        .get_item()
        .table_name(&name)
        .key("pk", AttributeValue::S("counter".into()))
        .consistent_read(true)
        .send()
        .await
        .unwrap()
        .item
        .unwrap();
    assert_eq!(item["n"], AttributeValue::N("1".into()), "applied once");
}

/// The table the store creates has its TTL on `ttl`.
#[tokio::test]
async fn a_created_table_expires_items_by_their_ttl_attribute() {
    let server = DynamoServer::start();
    let (client, name) = table(&server).await;
    let ttl = client
        .describe_time_to_live()
        .table_name(&name)
        .send()
        .await
        .unwrap();
    let description = ttl.time_to_live_description().unwrap();
    assert_eq!(description.attribute_name(), Some("ttl"));
    assert!(matches!(
        description.time_to_live_status(),
        Some(TimeToLiveStatus::Enabled | TimeToLiveStatus::Enabling)
    ));
}

/// A charge handler that adds its charge to the request's transaction;
/// `?fail` adds a condition that fails at the commit.
fn charges_app(
    store: tower_idempotency::DynamoDbTxStore,
    charges: DynamoCharges,
    runs: Counter,
) -> Router {
    Router::new()
        .route(
            "/charges",
            post(
                move |uri: axum::http::Uri, mut tx: IdempotentTx<DynamoDbTx>| {
                    let (charges, runs) = (charges.clone(), runs.clone());
                    async move {
                        runs.incr();
                        charges.write(&mut tx, "charge").await.unwrap();
                        if uri.query() == Some("fail") {
                            charges.fail_a_statement(&mut tx).await;
                        }
                        // A handler that takes its time: duplicates overlap it.
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        StatusCode::CREATED
                    }
                },
            ),
        )
        .layer(IdempotencyLayer::new(store).single_tenant())
}

/// Twenty concurrent duplicates of one charge: one execution, one charge
/// item committed with the record; the others are told `409` or replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_duplicates_commit_one_charge_with_the_record() {
    let backend = DynamoTxBackend::start();
    let (store, charges) = backend.store_and_charges().await;
    let runs = Counter::default();
    let app = charges_app(store, charges.clone(), runs.clone());
    let replies = futures_util::future::join_all(
        (0..20).map(|_| oneshot(&app, request("/charges", "order-1", CHARGE))),
    )
    .await;
    let created = replies
        .iter()
        .filter(|r| r.status == StatusCode::CREATED)
        .count();
    let busy = replies
        .iter()
        .filter(|r| r.status == StatusCode::CONFLICT)
        .count();
    assert_eq!(
        created + busy,
        20,
        "{:?}",
        replies.iter().map(|r| r.status).collect::<Vec<_>>()
    );
    assert_eq!(runs.get(), 1, "one execution");
    assert_eq!(charges.count("charge").await.unwrap(), 1, "one charge item");
    let retry = oneshot(&app, request("/charges", "order-1", CHARGE)).await;
    assert!(retry.is_replay());
    assert_eq!(runs.get(), 1);
}

/// The handler's own condition fails at the commit: nothing of it
/// applies, no record is kept, and the key runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_condition_that_fails_commits_nothing_and_frees_the_key() {
    let backend = DynamoTxBackend::start();
    let (store, charges) = backend.store_and_charges().await;
    let runs = Counter::default();
    let app = charges_app(store, charges.clone(), runs.clone());
    let refused = oneshot(&app, request("/charges?fail", "order-2", CHARGE)).await;
    assert!(refused.status.is_server_error(), "{:?}", refused.status);
    assert!(!refused.is_replay());
    assert_eq!(charges.count("charge").await.unwrap(), 0, "nothing applied");
    let again = oneshot(&app, request("/charges", "order-2", CHARGE)).await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert_eq!(runs.get(), 2, "the key ran again");
    assert_eq!(charges.count("charge").await.unwrap(), 1);
}

/// A claim that outlived the transaction's bound is fenced off: its commit
/// applies nothing, and the retry that took the key commits once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_past_its_bound_is_fenced_off_and_the_retry_commits_once() {
    let server = DynamoServer::start();
    let store = DynamoDbStore::builder(server.client())
        .table(table_name())
        .create_table_if_missing()
        .transactional()
        .transaction_timeout(Duration::from_millis(300))
        .build()
        .await
        .unwrap();
    let charges = DynamoCharges::create(&server).await;
    let key = StorageKey::new("acct", &IdempotencyKey::new("order-3").unwrap());
    let fp = Fingerprint::from_bytes([1; 32]);
    let Ok(Claim::Acquired(mut paused)) = store.claim(&key, &fp, Duration::from_secs(30)).await
    else {
        panic!("a free key is claimed");
    };
    charges.write(&mut paused, "charge").await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let Ok(Claim::Acquired(mut retry)) = store.claim(&key, &fp, Duration::from_secs(30)).await
    else {
        panic!("a lapsed claim is taken over");
    };
    charges.write(&mut retry, "charge").await.unwrap();
    let record = std::sync::Arc::new(tower_idempotency::CompletedRecord::Message {
        result: None,
        created_at: std::time::SystemTime::now(),
    });
    let day = Duration::from_secs(86_400);
    assert!(
        store
            .complete(&key, &mut retry, &fp, record.clone(), day)
            .await
            .unwrap()
    );
    let late = store.complete(&key, &mut paused, &fp, record, day).await;
    assert!(
        matches!(late, Ok(false)),
        "the paused holder is fenced off: {late:?}"
    );
    assert_eq!(charges.count("charge").await.unwrap(), 1, "one effect");
}

/// A response whose record exceeds DynamoDB's 400 KB item: sent once,
/// stored without its body, and a retry is refused — never run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_over_the_item_limit_is_stored_unreplayable_never_run_twice() {
    let backend = Dynamo::start();
    let store = backend.store().await;
    let runs = Counter::default();
    let app = support::app::routes(runs.clone()).layer(
        IdempotencyLayer::new(store)
            .single_tenant()
            .max_stored_body(1 << 20),
    );
    let first = oneshot(&app, request("/big/500000", "big-1", CHARGE)).await;
    assert_eq!(first.status, StatusCode::OK);
    assert_eq!(first.body.len(), 500_000, "the answer goes out whole");
    let retry = oneshot(&app, request("/big/500000", "big-1", CHARGE)).await;
    retry.assert_problem(409);
    assert_eq!(runs.get(), 1, "never run twice");
}

/// The start-up check: a missing table names its fix, a table keyed
/// otherwise is refused, an endpoint out of reach is an outage.
#[tokio::test]
async fn start_up_tells_a_missing_table_a_wrong_key_and_an_unreachable_endpoint_apart() {
    let server = DynamoServer::start();
    let missing = DynamoDbStore::builder(server.client())
        .table("no_such_table")
        .build()
        .await;
    match missing {
        Err(StoreError::Misconfigured(why)) => {
            assert!(why.contains("create_table_if_missing"), "{why}")
        }
        other => panic!("a missing table: {other:?}"),
    }
    let (client, other) = (server.client(), table_name());
    support::backend::DynamoCharges::create_named(&server, &other).await;
    match DynamoDbStore::builder(client).table(&other).build().await {
        Err(StoreError::Misconfigured(why)) => assert!(why.contains("`pk`"), "{why}"),
        other => panic!("a table keyed otherwise: {other:?}"),
    }
    let port = support::redis_server::free_port();
    let nowhere = client_of(&format!("http://127.0.0.1:{port}"));
    match DynamoDbStore::builder(nowhere).build().await {
        Err(StoreError::Unavailable(why)) => assert!(why.to_string().contains("reached"), "{why}"),
        other => panic!("an unreachable endpoint: {other:?}"),
    }
}

/// The server killed mid-request: the layer answers `503` and runs
/// nothing (fail closed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_gone_is_a_503_and_nothing_runs() {
    let mut backend = Dynamo::start();
    let store = backend.store().await;
    let runs = Counter::default();
    let app =
        support::app::routes(runs.clone()).layer(IdempotencyLayer::new(store).single_tenant());
    backend.0.kill();
    let reply = oneshot(&app, request("/charges", "order-4", CHARGE)).await;
    reply.assert_problem(503);
    assert_eq!(runs.get(), 0);
}
