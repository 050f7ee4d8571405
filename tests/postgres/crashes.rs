//! The point of the transactional store, shown on the example process:
//! killed (-9) or paused (SIGSTOP) while its handler holds an uncommitted
//! charge.

use std::time::Duration;

use axum::http::StatusCode;

use super::*;
use crate::support::{
    http::HttpClient,
    payments::{Payments, charge_request, kill_mid_charge, retry_until_done},
    postgres::TestDatabase,
    redis_server::free_port,
};

// The point of the transactional store, shown on the example process: kill
// -9 while the handler holds an uncommitted charge.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_mid_charge_on_postgres_leaves_nothing_and_the_retry_charges_once() {
    let db = TestDatabase::create();
    let client = HttpClient::default();
    let env = [("DATABASE_URL", db.url()), ("PROCESSOR_LATENCY_MS", "2000")];
    let uncommitted = async |_: &str| db.count(UNCOMMITTED_CHARGES).await == 1;
    let payments = kill_mid_charge(&client, &env, uncommitted).await;
    assert_eq!(
        db.count(CHARGES).await,
        0,
        "the uncommitted charge died with the process"
    );

    let (executed, conflicts) = retry_until_done(&client, &payments.addr).await;
    assert_eq!(executed.status, StatusCode::CREATED);
    assert!(!executed.is_replay());
    eprintln!("postgres: the retry executed after {conflicts} × 409 (no lease to wait out)");
    assert!(
        client
            .send(charge_request(&payments.addr))
            .await
            .is_replay()
    );
    assert_eq!(db.count(CHARGES).await, 1, "exactly one charge");
}

/// A process paused (SIGSTOP) while its handler holds an uncommitted charge
/// holds the key no longer than the transaction timeout: the database ends
/// the idle transaction, another instance's retry charges, and the paused
/// one, resumed, cannot commit — its response is withheld. One charge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_instance_holds_its_key_no_longer_than_the_transaction_timeout() {
    let db = TestDatabase::create();
    let client = HttpClient::default();
    let timeout = ("IDEMPOTENCY_TX_TIMEOUT_MS", "1000");
    let paused = Payments::start(
        free_port(),
        &[
            ("DATABASE_URL", db.url()),
            ("PROCESSOR_LATENCY_MS", "3000"),
            timeout,
        ],
    );
    let other = Payments::start(free_port(), &[("DATABASE_URL", db.url()), timeout]);
    let doomed = tokio::spawn({
        let client = client.clone();
        let addr = paused.addr.clone();
        async move { client.send(charge_request(&addr)).await }
    });
    db.wait_for_count(
        UNCOMMITTED_CHARGES,
        |n| n == 1,
        "the charge was never written",
    )
    .await;
    signal(&paused, "STOP");

    let (executed, conflicts) = retry_until_done(&client, &other.addr).await;
    assert_eq!(executed.status, StatusCode::CREATED, "{:?}", executed.body);
    assert!(!executed.is_replay());
    eprintln!("the paused instance's key was free after {conflicts} × 409");

    signal(&paused, "CONT");
    let withheld = tokio::time::timeout(Duration::from_secs(10), doomed)
        .await
        .expect("the resumed instance answered")
        .unwrap();
    withheld.assert_problem(503);
    assert_eq!(db.count(CHARGES).await, 1, "exactly one charge");
    assert!(client.send(charge_request(&paused.addr)).await.is_replay());
}

fn signal(process: &Payments, signal: &str) {
    let status = std::process::Command::new("kill")
        .args([format!("-{signal}"), process.child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill -{signal}");
}
