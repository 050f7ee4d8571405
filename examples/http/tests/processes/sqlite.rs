//! On the embedded default store: one SQLite file, several processes.

use std::time::{Duration, Instant};

use http::StatusCode;
use tower_idempotency::sqlx::{self, Connection, SqliteConnection};

use crate::support::{
    http::HttpClient,
    payments::{Payments, charge_request, kill_mid_charge, retry_until_done},
    redis_server::free_port,
    sqlite::TestFile,
};

const CHARGES: &str = "SELECT count(*) FROM charges";

/// Two example processes on one database file, concurrent duplicates sent
/// to both: SQLite's write lock keeps the second process out until the
/// first commits, then it replays. One charge.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_processes_on_one_file_never_both_execute_a_key() {
    let file = TestFile::create();
    let url = file.url();
    let env = [
        ("DATABASE_URL", url.as_str()),
        ("PROCESSOR_LATENCY_MS", "300"),
    ];
    let a = Payments::start(free_port(), &env);
    let b = Payments::start(free_port(), &env);
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
    for reply in &replies {
        assert!(
            reply.status == StatusCode::CREATED || reply.status == StatusCode::CONFLICT,
            "{} {:?}",
            reply.status,
            reply.body
        );
    }
    let (done, _) = retry_until_done(&client, &b.addr).await;
    assert!(done.is_replay());
    assert_eq!(file.count(CHARGES).await, 1, "exactly one charge");
}

/// The example's durable default, killed (-9) while its handler holds an
/// uncommitted charge: nothing committed, the key free at once after the
/// restart (the dead process's file locks went with it), and the retry
/// charges once; after another restart the completed charge replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_mid_charge_the_default_example_charges_once_and_replays_after_restarts() {
    let file = TestFile::create();
    let url = file.url();
    let client = HttpClient::default();
    let env = [
        ("DATABASE_URL", url.as_str()),
        ("PROCESSOR_LATENCY_MS", "2000"),
        ("ADMIN_TOKEN", "s3cret"),
    ];
    // In flight, as the operators' route shows it: the handler holds its
    // claim, its charge inserted and uncommitted while the processor works.
    // A client of its own: its kept-alive connection dies with the process.
    let probe = HttpClient::default();
    let in_flight = async |addr: &str| {
        let inspect = http::Request::get(format!(
            "http://{addr}/admin/idempotency/acct_crash/crash-1"
        ))
        .header("authorization", "Bearer s3cret")
        .body(axum::body::Body::empty())
        .unwrap();
        probe.send(inspect).await.json()["state"] == "in_flight"
    };
    let payments = kill_mid_charge(&client, &env, in_flight).await;
    assert_eq!(
        file.count(CHARGES).await,
        0,
        "the uncommitted charge died with the process"
    );

    let (executed, conflicts) = retry_until_done(&client, &payments.addr).await;
    assert_eq!(executed.status, StatusCode::CREATED);
    assert!(!executed.is_replay());
    eprintln!("sqlite: the retry executed after {conflicts} × 409");
    drop(payments);

    let restarted = Payments::start(free_port(), &env);
    let replay = client.send(charge_request(&restarted.addr)).await;
    assert!(
        replay.is_replay(),
        "the record outlived the process: {}",
        replay.status
    );
    assert_eq!(replay.body, executed.body);
    assert_eq!(file.count(CHARGES).await, 1, "exactly one charge");
}

/// The file system under the example's database fills up, so COMMITs fail;
/// once the space is back, the very next charges succeed — no connection
/// is left inside the transaction whose COMMIT failed (it was one pooled
/// connection's wedge: every later claim on it answered 503 until a
/// restart). Each key charges at most once throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_fails_charges_and_the_store_recovers_when_space_returns() {
    let disk = crate::support::tmpfs::Tmpfs::mount(4 << 20);
    let url = format!("sqlite://{}/payments.db", disk.path().display());
    let payments = Payments::start(free_port(), &[("DATABASE_URL", url.as_str())]);
    let client = HttpClient::default();
    // Charges of 150 KB until the disk is full and one fails.
    let filler = disk.fill("filler");
    std::fs::write(disk.path().join("headroom"), vec![0u8; 0]).unwrap();
    let mut failed = 0;
    for i in 0..40 {
        let reply = client
            .send(large_charge(&payments.addr, &format!("fill-{i}"), 150_000))
            .await;
        assert_ne!(reply.status, StatusCode::CREATED, "the disk is full: {i}");
        failed += 1;
        if failed >= 8 {
            break;
        }
    }
    assert!(failed >= 8);
    // Space back: every connection of the pool must serve again.
    std::fs::remove_file(&filler).unwrap();
    for i in 0..16 {
        let reply = client
            .send(large_charge(&payments.addr, &format!("after-{i}"), 1_000))
            .await;
        assert_eq!(
            reply.status,
            StatusCode::CREATED,
            "charge {i} after the space came back: {:?}",
            reply.body
        );
    }
    let file = disk.path().join("payments.db");
    let count = |sql: &'static str| {
        let url = format!("sqlite://{}", file.display());
        async move {
            let mut connection = SqliteConnection::connect(&url).await.unwrap();
            sqlx::query_scalar::<_, i64>(sql)
                .fetch_one(&mut connection)
                .await
                .unwrap()
        }
    };
    assert_eq!(
        count("SELECT count(*) FROM charges WHERE account = 'acct_disk'").await,
        16
    );
    assert_eq!(count("SELECT count(DISTINCT id) FROM charges").await, 16);
}

/// A second instance on the file of one whose charge holds the write lock
/// (a slow charge here; a paused process alike) is not misconfigured: it
/// waits for the lock, saying so, starts, and replays the charge. It never
/// advises turning the start-up check off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_instance_waits_for_a_busy_database_instead_of_refusing_to_start() {
    let file = TestFile::create();
    let url = file.url();
    let first = Payments::start(
        free_port(),
        &[
            ("DATABASE_URL", url.as_str()),
            ("PROCESSOR_LATENCY_MS", "7000"),
        ],
    );
    let client = HttpClient::default();
    let charge = tokio::spawn({
        let (client, addr) = (client.clone(), first.addr.clone());
        async move { client.send(charge_request(&addr)).await }
    });
    // The charge holds the write lock for 7 s.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let started = Instant::now();
    let second = Payments::start(
        free_port(),
        &[
            ("DATABASE_URL", url.as_str()),
            ("RUST_LOG", "tower_idempotency=warn"),
        ],
    );
    let output = second.output();
    assert!(
        started.elapsed() >= Duration::from_secs(5),
        "it waited for the lock"
    );
    assert!(output.contains("waiting for the database"), "{output}");
    assert!(!output.contains("EngineCheck::Warn"), "{output}");
    assert_eq!(charge.await.unwrap().status, StatusCode::CREATED);
    let replay = client.send(charge_request(&second.addr)).await;
    assert!(replay.is_replay(), "{}", replay.status);
    assert_eq!(file.count(CHARGES).await, 1);
}

/// On a read-only file system the example refuses to start with an error
/// that says the database is read-only — not that it failed the start-up
/// check, and never advice to disable it.
#[test]
fn a_read_only_database_says_so_at_start_up() {
    let disk = crate::support::tmpfs::Tmpfs::mount(4 << 20);
    let url = format!("sqlite://{}/payments.db", disk.path().display());
    // Created, with its tables, while writable.
    drop(Payments::start(
        free_port(),
        &[("DATABASE_URL", url.as_str())],
    ));
    disk.set_read_only(true);
    let (status, output) = crate::support::payments::run_to_exit(&[
        ("DATABASE_URL", url.as_str()),
        ("RUST_LOG", "off"),
    ]);
    assert!(!status.success(), "{output}");
    assert!(output.contains("read-only"), "{output}");
    assert!(!output.contains("EngineCheck::Warn"), "{output}");
    assert!(!output.contains("failed the start-up check"), "{output}");
}

/// The example's database file deleted while it runs: new connections
/// would open an empty file, existing ones write into one that no longer
/// exists. Every charge is refused (`503`) and the log says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_file_deleted_while_running_is_refused_and_said_in_the_log() {
    let file = TestFile::create();
    let url = file.url();
    let payments = Payments::start(
        free_port(),
        &[
            ("DATABASE_URL", url.as_str()),
            ("RUST_LOG", "tower_idempotency=error"),
        ],
    );
    let client = HttpClient::default();
    assert_eq!(
        client.send(charge_request(&payments.addr)).await.status,
        StatusCode::CREATED
    );
    std::fs::remove_file(file.path()).unwrap();
    let mut next = charge_request(&payments.addr);
    next.headers_mut()
        .insert("idempotency-key", "after-delete".parse().unwrap());
    let refused = client.send(next).await;
    refused.assert_problem(503);
    let deadline = Instant::now() + Duration::from_secs(5);
    while !payments.output().contains("was deleted or replaced") {
        assert!(Instant::now() < deadline, "{}", payments.output());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// An operator looks up, then forgets without force, a key whose charge is
/// in flight in another process on the same file: its claim is an
/// uncommitted row no reader sees. The look-up answers what is known — a
/// writer of the file holds it, so it may be in flight — not "the next
/// request executes"; the forget must not wait for that commit and then
/// delete the fresh record (the retry charged again): it is refused as in
/// flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_in_flight_in_another_process_is_reported_and_not_forgotten() {
    let file = TestFile::create();
    let url = file.url();
    let env = [
        ("DATABASE_URL", url.as_str()),
        ("PROCESSOR_LATENCY_MS", "1500"),
        ("ADMIN_TOKEN", "s3cret"),
    ];
    let a = Payments::start(free_port(), &env);
    let b = Payments::start(free_port(), &env);
    let client = HttpClient::default();
    let charge = tokio::spawn({
        let (client, addr) = (client.clone(), a.addr.clone());
        async move { client.send(charge_request(&addr)).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let inspect = http::Request::get(format!(
        "http://{}/admin/idempotency/acct_crash/crash-1",
        b.addr
    ))
    .header("authorization", "Bearer s3cret")
    .body(axum::body::Body::empty())
    .unwrap();
    let looked_up = client.send(inspect).await;
    assert_eq!(looked_up.status, StatusCode::OK, "{:?}", looked_up.body);
    let state: serde_json::Value = serde_json::from_slice(&looked_up.body).unwrap();
    assert_eq!(state["state"], "in_flight", "{state}");
    let forget = http::Request::delete(format!(
        "http://{}/admin/idempotency/acct_crash/crash-1",
        b.addr
    ))
    .header("authorization", "Bearer s3cret")
    .body(axum::body::Body::empty())
    .unwrap();
    let refused = client.send(forget).await;
    refused.assert_problem(409);
    assert_eq!(charge.await.unwrap().status, StatusCode::CREATED);
    let replay = client.send(charge_request(&b.addr)).await;
    assert!(replay.is_replay(), "the record was kept: {}", replay.status);
    assert_eq!(file.count(CHARGES).await, 1, "charged once");
}

/// A charge as the example takes it, with a description of `bytes` bytes,
/// from `acct_disk` under `key`.
fn large_charge(addr: &str, key: &str, bytes: usize) -> http::Request<axum::body::Body> {
    let body = format!(
        r#"{{"amount":500,"currency":"usd","description":"{}"}}"#,
        "x".repeat(bytes)
    );
    http::Request::post(format!("http://{addr}/v1/charges"))
        .header("authorization", "Bearer acct_disk")
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(axum::body::Body::from(body))
        .unwrap()
}
