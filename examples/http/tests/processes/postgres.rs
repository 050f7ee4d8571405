//! On PostgreSQL: the charge and its record in one transaction.

use std::time::Duration;

use http::StatusCode;

use crate::support::{
    http::HttpClient,
    payments::{Payments, charge_request, kill_mid_charge, retry_until_done},
    postgres::TestDatabase,
    redis_server::free_port,
    relay::Relay,
};

const CHARGES: &str = "SELECT count(*) FROM charges";
/// The charges written by a transaction still open: the handler's, before
/// its commit.
const UNCOMMITTED_CHARGES: &str = "SELECT count(*) FROM pg_stat_activity \
    WHERE datname = current_database() AND state = 'idle in transaction' \
    AND query LIKE 'INSERT INTO charges%'";

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
    paused.signal("STOP");

    let (executed, conflicts) = retry_until_done(&client, &other.addr).await;
    assert_eq!(executed.status, StatusCode::CREATED, "{:?}", executed.body);
    assert!(!executed.is_replay());
    eprintln!("the paused instance's key was free after {conflicts} × 409");

    paused.signal("CONT");
    let withheld = tokio::time::timeout(Duration::from_secs(10), doomed)
        .await
        .expect("the resumed instance answered")
        .unwrap();
    withheld.assert_problem(503);
    assert_eq!(db.count(CHARGES).await, 1, "exactly one charge");
    assert!(client.send(charge_request(&paused.addr)).await.is_replay());
}

/// Four instances started at once on a new database: every one comes up
/// (`CREATE TABLE IF NOT EXISTS` races itself on PostgreSQL: the store's
/// table and the example's own).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn instances_started_together_on_a_new_database_all_come_up() {
    let db = TestDatabase::create();
    let started = (0..4).map(|_| {
        let url = db.url().to_owned();
        std::thread::spawn(move || Payments::start(free_port(), &[("DATABASE_URL", &url)]))
    });
    let instances: Vec<Payments> = started
        .collect::<Vec<_>>()
        .into_iter()
        .map(|t| t.join().expect("an instance came up"))
        .collect();
    let client = HttpClient::default();
    let (reply, _) = retry_until_done(&client, &instances[3].addr).await;
    assert_eq!(reply.status, StatusCode::CREATED);
    assert_eq!(db.count(CHARGES).await, 1);
}

/// The database out of reach while the example starts (the relay to it
/// cut: a restart, a failover, a connection dropped mid-start): it connects
/// again with back-off (for up to a minute) instead of exiting, and serves
/// once the database is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_out_of_reach_at_start_up_is_waited_for_not_an_exit() {
    let db = TestDatabase::create();
    let relay = Relay::start(&db.host_port()).await;
    relay.cut();
    let url = db.url_via(relay.port());
    let port = free_port();
    let starting =
        std::thread::spawn(move || Payments::start(port, &[("DATABASE_URL", url.as_str())]));
    // Still trying, not exited: the connection is refused for two seconds.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!starting.is_finished(), "it must wait for its database");
    relay.restore();
    let payments = tokio::task::spawn_blocking(move || starting.join().expect("it starts"))
        .await
        .unwrap();
    let reply = HttpClient::default()
        .send(charge_request(&payments.addr))
        .await;
    assert_eq!(reply.status, StatusCode::CREATED);
    assert_eq!(db.count(CHARGES).await, 1);
}
