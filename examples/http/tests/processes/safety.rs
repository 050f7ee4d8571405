//! The example's own safety: credentials kept out of logs and Redis, a
//! configuration mistake refused at start-up.

use std::time::Duration;

use axum::body::Body;
use http::{Request, StatusCode};
use tower_idempotency::store::StorageKey;

use crate::support::{
    http::HttpClient,
    payments::{Payments, run_to_exit},
    redis_server::{RedisServer, free_port},
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_payments_example_keeps_bearer_tokens_out_of_logs_and_redis() {
    let redis = RedisServer::start();
    let url = redis.url();
    let payments = Payments::start(free_port(), &[("REDIS_URL", &url), ("RUST_LOG", "debug")]);
    let secret = "sk_live_4eC39HqLyjWDarjtT1zdp7dc";
    let client = HttpClient::default();
    let charge = || {
        Request::post(format!("http://{}/v1/charges", payments.addr))
            .header("authorization", format!("Bearer {secret}"))
            .header("idempotency-key", "order-1")
            .header("content-type", "application/json")
            .body(Body::from(r#"{"amount":500,"currency":"usd"}"#))
            .unwrap()
    };
    assert_eq!(client.send(charge()).await.status, StatusCode::CREATED);
    assert!(client.send(charge()).await.is_replay());
    tokio::time::sleep(Duration::from_millis(200)).await;

    let keys = redis.command(&["KEYS", "*"]);
    assert_eq!(
        keys.lines().count(),
        2,
        "the record, the key-names marker: {keys}"
    );
    assert!(!keys.contains("sk_live"), "Redis key names: {keys}");
    let output = payments.output();
    assert!(
        output.contains("order-1"),
        "the example logs at debug: {output}"
    );
    assert!(!output.contains("sk_live"), "log output: {output}");
}

#[test]
fn the_payments_example_refuses_an_absurd_ttl_at_start_up() {
    for (name, value) in [
        ("IDEMPOTENCY_TTL_SECS", "18446744073709551615"),
        ("IDEMPOTENCY_LEASE_MS", "18446744073709551615"),
    ] {
        let (status, output) = run_to_exit(&[(name, value)]);
        assert!(!status.success(), "{name}={value} must not start");
        assert!(
            output.contains(name),
            "the message names the setting: {output}"
        );
    }
}

/// An operator looks up, and forgets, a tenant's key through the admin
/// routes, whose path names the account: at any log level the account
/// appears only hashed, as the layer logs scopes. The key in the path is
/// read as the layer reads the header: `"order-1"` is `order-1`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_routes_log_the_account_hashed_and_read_quoted_keys() {
    let payments = Payments::start(
        free_port(),
        &[
            ("IDEMPOTENCY_STORE", "memory"),
            ("ADMIN_TOKEN", "s3cret"),
            ("RUST_LOG", "debug"),
        ],
    );
    let account = "acct_tenant_7f3a";
    let client = HttpClient::default();
    let charge = Request::post(format!("http://{}/v1/charges", payments.addr))
        .header("authorization", format!("Bearer {account}"))
        .header("idempotency-key", "\"order-1\"")
        .header("content-type", "application/json")
        .body(Body::from(r#"{"amount":500,"currency":"usd"}"#))
        .unwrap();
    assert_eq!(client.send(charge).await.status, StatusCode::CREATED);
    let admin = |method: &str| {
        Request::builder()
            .method(method)
            .uri(format!(
                "http://{}/admin/idempotency/{account}/%22order-1%22",
                payments.addr
            ))
            .header("authorization", "Bearer s3cret")
            .body(Body::empty())
            .unwrap()
    };
    let found = client.send(admin("GET")).await;
    assert_eq!(found.status, StatusCode::OK, "{:?}", found.body);
    assert_eq!(found.json()["state"], "completed");
    assert_eq!(
        client.send(admin("DELETE")).await.status,
        StatusCode::NO_CONTENT
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    let output = payments.output();
    let hashed = StorageKey::new(
        account,
        &tower_idempotency::IdempotencyKey::new("order-1").unwrap(),
    );
    let (hash, _) = hashed.as_str().split_once(':').unwrap();
    assert!(output.contains(hash), "the account, hashed: {output}");
    assert!(
        !output.contains("/admin/idempotency/acct_tenant"),
        "log output: {output}"
    );
}
