//! The `sqs_orders` example against a real SQS-compatible server (moto's
//! `moto_server`, started on a free port for each test) and real
//! databases (SQLite files, PostgreSQL), counting rows of `order_charges`
//! (no unique constraint: a double execution shows).
//!
//! What only this broker has; what every broker promises is in
//! `tests/brokers.rs`, written once.

mod support;

use std::time::Duration;

use support::{
    consumer::{CHARGES, IN_TRANSACTION, OrdersConsumer, TWICE, count, order},
    postgres::TestDatabase,
    process::run_example_to_exit,
    relay::Relay,
    sqlite::TestFile,
    sqs::{SqsServer, TestQueue},
};

/// The consumer on `queue`, with `DATABASE_URL` and `extra` settings.
async fn consumer(
    server: &SqsServer,
    queue: &TestQueue,
    db: &str,
    extra: &[(&str, &str)],
) -> OrdersConsumer {
    let sqs = server.env();
    let mut env: Vec<(&str, &str)> = sqs.iter().map(|(k, v)| (*k, v.as_str())).collect();
    env.extend([("SQS_QUEUE_URL", queue.url.as_str()), ("DATABASE_URL", db)]);
    env.extend_from_slice(extra);
    OrdersConsumer::start_example("sqs_orders", &env, "receiving from ").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_charge_once_and_what_can_never_succeed_is_dead_lettered_at_once() {
    let server = SqsServer::start();
    let queue = TestQueue::create(&server, 30).await;
    let file = TestFile::create();
    let c = consumer(&server, &queue, &file.url(), &[]).await;
    for _ in 0..3 {
        queue.send(&order("order-1", 500)).await;
    }
    c.wait_for(|l| l == "executed order-1").await;
    queue.drained().await;
    // The same order id, another amount; not an order; a NUL in its text.
    queue.send(&order("order-1", 900)).await;
    queue.send("{not json").await;
    queue
        .send(r#"{"order_id":"order-nul","amount":5,"currency":"e\u0000r"}"#)
        .await;
    c.wait_for(|l| l == "rejected order-1").await;
    queue.drained().await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let lines = c.lines();
    assert_eq!(count(&[&c], |l| l == "duplicate order-1"), 2, "{lines:?}");
    assert_eq!(count(&[&c], |l| l.starts_with("invalid ")), 2, "{lines:?}");
    assert_eq!(
        count(&[&c], |l| l == "rejected order-1"),
        1,
        "never looped: {lines:?}"
    );
    let mut dead = queue.dead_lettered().await;
    dead.sort();
    assert_eq!(dead.len(), 3, "{dead:?}");
    assert!(dead.contains(&order("order-1", 900)));
    assert!(dead.contains(&"{not json".to_owned()));
    assert_eq!(file.count(CHARGES).await, 1);
}

/// A queue without a dead-letter queue: what can never succeed has nowhere
/// to go, so it is kept in the queue (out of sight), never deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_without_a_dead_letter_queue_keeps_what_can_never_succeed() {
    let server = SqsServer::start();
    let queue = TestQueue::without_dead_letters(&server, 30).await;
    let file = TestFile::create();
    let c = consumer(&server, &queue, &file.url(), &[]).await;
    queue.send("{not json").await;
    queue.send(&order("order-2", 500)).await;
    c.wait_for(|l| l == "executed order-2").await;
    c.wait_for(|l| l.starts_with("invalid ")).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(queue.depth().await, 1, "kept, not deleted");
    assert_eq!(file.count(CHARGES).await, 1);
}
/// The work takes three visibility timeouts, with a second consumer
/// waiting: the visibility is extended while it runs, so the message is
/// never delivered to the other consumer mid-work (it would print
/// `in-flight`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_three_times_the_visibility_timeout_is_never_redelivered_mid_work() {
    let server = SqsServer::start();
    let queue = TestQueue::create(&server, 2).await;
    let file = TestFile::create();
    let extra = [("WORK_DELAY_MS", "6000")];
    let first = consumer(&server, &queue, &file.url(), &extra).await;
    let second = consumer(&server, &queue, &file.url(), &extra).await;
    queue.send(&order("order-long", 500)).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while count(&[&first, &second], |l| l == "executed order-long") == 0 {
        assert!(std::time::Instant::now() < deadline, "never executed");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    queue.drained().await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let lines: Vec<_> = [&first, &second].iter().flat_map(|c| c.lines()).collect();
    assert_eq!(
        count(&[&first, &second], |l| l.ends_with("order-long")),
        1,
        "delivered once: {lines:?}"
    );
    assert_eq!(file.count(CHARGES).await, 1);
}

/// Two consumers, each order sent three times in quick succession (SQS
/// batches them): one charge per order, every message deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_consumers_and_batched_duplicates_one_charge_per_order() {
    let server = SqsServer::start();
    let queue = TestQueue::create(&server, 5).await;
    let db = TestDatabase::create();
    let extra = [("WORK_DELAY_MS", "20")];
    let first = consumer(&server, &queue, db.url(), &extra).await;
    let second = consumer(&server, &queue, db.url(), &extra).await;
    let orders = 20;
    let sends = (0..orders * 3).map(|i| {
        let queue = &queue;
        async move {
            queue
                .send(&order(&format!("order-{}", i % orders), 500))
                .await
        }
    });
    futures_util::future::join_all(sends).await;
    queue.drained().await;
    let twice = db.count(TWICE).await;
    assert_eq!(twice, 0, "no order charged twice");
    assert_eq!(db.count(CHARGES).await, orders);
    assert_eq!(
        count(&[&first, &second], |l| l.starts_with("executed")),
        orders as usize
    );
}

/// A FIFO queue: a group's messages are charged in order, and a producer's
/// retry with a new deduplication id — which FIFO deduplication cannot
/// catch — is charged once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_fifo_queue_a_group_runs_in_order_and_a_resend_is_charged_once() {
    let server = SqsServer::start();
    let queue = TestQueue::create_fifo(&server, 30).await;
    let file = TestFile::create();
    let c = consumer(&server, &queue, &file.url(), &[]).await;
    for i in 1..=6 {
        queue
            .send_in(&order(&format!("order-{i}"), 500), "customer-1", None)
            .await;
    }
    // The producer timed out on order-3 and sent it again, with a new id.
    queue
        .send_in(&order("order-3", 500), "customer-1", None)
        .await;
    c.wait_for(|l| l == "duplicate order-3").await;
    queue.drained().await;
    let lines: Vec<_> = c.lines().into_iter().skip(1).collect();
    let expected: Vec<_> = (1..=6)
        .map(|i| format!("executed order-{i}"))
        .chain(["duplicate order-3".to_owned()])
        .collect();
    assert_eq!(lines, expected);
    assert_eq!(file.count(CHARGES).await, 6);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_consumer_exits_non_zero_naming_the_queue_when_it_is_deleted() {
    let server = SqsServer::start();
    let queue = TestQueue::create(&server, 30).await;
    let file = TestFile::create();
    let mut c = consumer(&server, &queue, &file.url(), &[]).await;
    queue.delete().await;
    let status = c.exited(Duration::from_secs(40)).await;
    assert!(!status.success(), "{status}");
}

// Nothing lost: the queue's receive budget (`maxReceiveCount`) is never
// spent on what can pass.

/// The database cut for longer than several visibility timeouts, on a queue
/// that moves a message to its dead-letter queue on its third receive: the
/// message is kept in hand, never received again, and charged once the
/// database is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_outage_never_spends_the_receive_budget() {
    let server = SqsServer::start();
    let queue = TestQueue::with_max_receives(&server, 2, 2).await;
    let db = TestDatabase::create();
    let relay = Relay::start(&db.host_port()).await;
    let url = db.url_via(relay.port());
    let c = consumer(&server, &queue, &url, &[]).await;
    relay.cut();
    queue.send(&order("order-1", 500)).await;
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(queue.dead_depth().await, 0, "not dead-lettered");
    relay.restore();
    c.wait_for_within(|l| l == "executed order-1", Duration::from_secs(60))
        .await;
    queue.drained().await;
    assert_eq!(queue.dead_depth().await, 0);
    assert_eq!(db.count(CHARGES).await, 1);
}

/// One consumer on one SQLite file, orders whose work outlasts the store's
/// 5 s busy timeout, a receive budget of two: each order waits its turn,
/// and every one is charged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_contention_with_one_consumer_charges_every_order() {
    let server = SqsServer::start();
    let queue = TestQueue::with_max_receives(&server, 5, 2).await;
    let file = TestFile::create();
    for i in 1..=3 {
        queue.send(&order(&format!("order-{i}"), 500)).await;
    }
    let c = consumer(&server, &queue, &file.url(), &[("WORK_DELAY_MS", "6000")]).await;
    for i in 1..=3 {
        let line = format!("executed order-{i}");
        c.wait_for_within(|l| l == line, Duration::from_secs(60))
            .await;
    }
    queue.drained().await;
    assert_eq!(queue.dead_depth().await, 0);
    assert_eq!(file.count(CHARGES).await, 3);
}

/// A producer's resend of an order whose long work runs on another
/// consumer: the resend waits in hand, and is acknowledged as a duplicate —
/// one charge, nothing dead-lettered, on a queue with a receive budget of
/// two.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_resend_during_long_work_is_charged_once_and_never_dead_lettered() {
    let server = SqsServer::start();
    let queue = TestQueue::with_max_receives(&server, 2, 2).await;
    let db = TestDatabase::create();
    let extra = [("WORK_DELAY_MS", "8000")];
    let first = consumer(&server, &queue, db.url(), &extra).await;
    queue.send(&order("order-1", 500)).await;
    db.wait_for_count(IN_TRANSACTION, |n| n == 1, "the work never started")
        .await;
    let second = consumer(&server, &queue, db.url(), &extra).await;
    queue.send(&order("order-1", 500)).await;
    let both = [&first, &second];
    let deadline = std::time::Instant::now() + Duration::from_secs(40);
    while count(&both, |l| l == "duplicate order-1") == 0 {
        assert!(std::time::Instant::now() < deadline, "no duplicate line");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    queue.drained().await;
    assert_eq!(count(&both, |l| l == "executed order-1"), 1);
    assert_eq!(queue.dead_depth().await, 0);
    assert_eq!(db.count(CHARGES).await, 1);
}

/// What can never succeed is dead-lettered with a reason that is true, as a
/// message attribute.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_carry_their_reason() {
    let server = SqsServer::start();
    let queue = TestQueue::create(&server, 30).await;
    let file = TestFile::create();
    let c = consumer(&server, &queue, &file.url(), &[]).await;
    queue.send(&order("order-1", 500)).await;
    c.wait_for(|l| l == "executed order-1").await;
    queue.send(&order("order-1", 900)).await;
    queue.send("{not json").await;
    c.wait_for(|l| l == "rejected order-1").await;
    c.wait_for(|l| l.starts_with("invalid ")).await;
    queue.drained().await;
    let mut kinds: Vec<_> = queue
        .dead_letters_with_reasons()
        .await
        .into_iter()
        .map(|dead| dead.kind().unwrap_or_default())
        .collect();
    kinds.sort();
    assert_eq!(kinds, ["invalid", "mismatch"]);
}

/// SIGTERM while the consumer waits in a long poll, on a queue that moves a
/// message to its dead-letter queue on its second receive: the receive is
/// not dropped (SQS may have handed out its message), and what it brings is
/// in hand — charged before the exit, never given back on its last receive
/// and dead-lettered as undecided. (A message the poll missed stays in the
/// queue, unreceived: the second consumer charges it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_during_a_receive_charges_what_it_brings() {
    let server = SqsServer::start();
    let queue = TestQueue::with_max_receives(&server, 30, 1).await;
    let file = TestFile::create();
    let mut first = consumer(&server, &queue, &file.url(), &[]).await;
    first.terminate();
    queue.send(&order("order-1", 500)).await;
    let status = first.exited(Duration::from_secs(25)).await;
    assert!(status.success(), "{status}");
    assert_eq!(queue.dead_depth().await, 0, "{:?}", first.lines());
    if !first.lines().iter().any(|l| l == "executed order-1") {
        let second = consumer(&server, &queue, &file.url(), &[]).await;
        second.wait_for(|l| l == "executed order-1").await;
    }
    queue.drained().await;
    assert_eq!(queue.dead_depth().await, 0);
    assert_eq!(file.count(CHARGES).await, 1);
}

/// A typo in `DATABASE_URL` reads as a typo, not as an outage.
#[test]
fn an_unknown_database_scheme_is_refused_by_name() {
    for example in ["sqs_orders", "nats_orders", "orders_consumer"] {
        let (status, output) = run_example_to_exit(
            example,
            &[
                ("DATABASE_URL", "postgress://postgres@127.0.0.1/orders"),
                ("SQS_QUEUE_URL", "http://127.0.0.1:1/queue/orders"),
            ],
        );
        assert_eq!(status.code(), Some(2), "{example}: {output}");
        assert!(
            output.contains("unknown scheme \"postgress\""),
            "{example}: {output}"
        );
    }
}
