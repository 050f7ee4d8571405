//! On MySQL/MariaDB: the charge and its record in one transaction.

use http::StatusCode;

use crate::support::{
    http::HttpClient,
    mysql::TestDatabase,
    payments::{Payments, charge_request, kill_mid_charge, retry_until_done},
    redis_server::free_port,
};

const CHARGES: &str = "SELECT count(*) FROM charges";

/// The example on MySQL, killed (-9) while its handler holds an uncommitted
/// charge: nothing committed, the key free once the server sees the
/// connection close, and the retry charges once; after a restart the
/// charge replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_mid_charge_on_mysql_leaves_nothing_and_the_retry_charges_once() {
    let db = TestDatabase::create();
    let client = HttpClient::default();
    let env = [("DATABASE_URL", db.url()), ("PROCESSOR_LATENCY_MS", "2000")];
    // The handler's charge, inserted and not committed yet.
    let uncommitted = async |_: &str| db.count_uncommitted(CHARGES).await > 0;
    let payments = kill_mid_charge(&client, &env, uncommitted).await;
    assert_eq!(
        db.count(CHARGES).await,
        0,
        "the uncommitted charge died with the process"
    );
    let (executed, conflicts) = retry_until_done(&client, &payments.addr).await;
    assert_eq!(executed.status, StatusCode::CREATED);
    assert!(!executed.is_replay());
    eprintln!("mysql: the retry executed after {conflicts} × 409");
    drop(payments);
    let restarted = Payments::start(free_port(), &env);
    let replay = client.send(charge_request(&restarted.addr)).await;
    assert!(replay.is_replay(), "{}", replay.status);
    assert_eq!(db.count(CHARGES).await, 1, "exactly one charge");
}
