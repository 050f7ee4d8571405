//! The `orders_consumer` example on a real RabbitMQ and real databases
//! (PostgreSQL, SQLite, MySQL), counting rows of `order_charges` (no unique
//! constraint: a double execution shows).
//!
//! What only this broker has; what every broker promises is in
//! `tests/brokers.rs`, written once.

mod support;

use std::time::Duration;

use support::{
    DeadLetter,
    amqp::TestQueue,
    consumer::{CHARGES, OrdersConsumer, count, order},
    postgres::TestDatabase,
    relay::Relay,
    sqlite::TestFile,
};

async fn charges(db: &TestDatabase) -> i64 {
    db.count(CHARGES).await
}

/// Waits until the queue holds no ready message (up to 20 s).
async fn drained(queue: &TestQueue) {
    for _ in 0..200 {
        if queue.ready().await == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("{} still has {} messages", queue.name, queue.ready().await);
}

/// Orders that can never be processed — an order id that is no valid key, a
/// currency the database refuses (a NUL byte) — are rejected, not requeued
/// at the head of the queue: the valid order behind them is charged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_malformed_order_never_holds_up_the_orders_behind_it() {
    let db = TestDatabase::create();
    let queue = TestQueue::declare().await;
    let consumer =
        OrdersConsumer::start(&[("DATABASE_URL", db.url()), ("QUEUE", &queue.name)]).await;

    let too_long = "x".repeat(256);
    for bad_id in ["order 42", "", "ördér-1", too_long.as_str()] {
        queue.publish(&order(bad_id, 500)).await;
    }
    queue
        .publish(r#"{"order_id":"order-nul","amount":500,"currency":"e\u0000r"}"#)
        .await;
    queue.publish(&order("order-1", 500)).await;

    consumer.wait_for(|l| l == "executed order-1").await;
    drained(&queue).await;
    // Rejected for good: no redelivery comes back.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let lines = consumer.lines();
    assert_eq!(
        lines.iter().filter(|l| l.starts_with("invalid ")).count(),
        5,
        "each invalid order rejected once: {lines:?}"
    );
    let kinds: Vec<_> = queue
        .dead_letters()
        .await
        .into_iter()
        .map(|dead| dead.kind().unwrap_or_default())
        .collect();
    assert_eq!(
        kinds, ["invalid"; 5],
        "each in the dead-letter queue, with its reason"
    );
    assert_eq!(charges(&db).await, 1);
    queue.delete().await;
}

/// Work longer than its transaction's bound can never commit: it is
/// rolled back on each delivery, and after a bounded number of them
/// rejected for good (`rejected <order_id>`) instead of looping.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_longer_than_its_transaction_bound_is_rejected_after_bounded_deliveries() {
    let db = TestDatabase::create();
    let queue = TestQueue::declare().await;
    let consumer = OrdersConsumer::start(&[
        ("DATABASE_URL", db.url()),
        ("QUEUE", &queue.name),
        ("WORK_DELAY_MS", "1500"),
        ("IDEMPOTENCY_TX_TIMEOUT_MS", "500"),
    ])
    .await;
    queue.publish(&order("order-slow", 500)).await;
    consumer
        .wait_for_within(|l| l == "rejected order-slow", Duration::from_secs(40))
        .await;
    drained(&queue).await;
    // Not redelivered again.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(consumer.lines()[1..], ["rejected order-slow"]);
    assert_eq!(charges(&db).await, 0, "nothing ever committed");
    let dead: Vec<_> = queue
        .dead_letters()
        .await
        .iter()
        .map(DeadLetter::body_and_kind)
        .collect();
    assert_eq!(dead, [(order("order-slow", 500), Some("timed_out".into()))]);
    // The bound raised, the order (published again) is charged.
    drop(consumer);
    let consumer = OrdersConsumer::start(&[
        ("DATABASE_URL", db.url()),
        ("QUEUE", &queue.name),
        ("WORK_DELAY_MS", "1500"),
        ("IDEMPOTENCY_TX_TIMEOUT_MS", "5000"),
    ])
    .await;
    queue.publish(&order("order-slow", 500)).await;
    consumer.wait_for(|l| l == "executed order-slow").await;
    assert_eq!(charges(&db).await, 1);
    queue.delete().await;
}

/// A consumer whose queue is deleted is ended by the broker: the process
/// must fail, so that a supervisor restarts it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_consumer_exits_non_zero_when_the_broker_ends_it() {
    let db = TestDatabase::create();
    let queue = TestQueue::declare().await;
    let mut consumer =
        OrdersConsumer::start(&[("DATABASE_URL", db.url()), ("QUEUE", &queue.name)]).await;
    queue.delete().await;
    for _ in 0..100 {
        if let Some(status) = consumer.child.try_wait().unwrap() {
            assert!(!status.success(), "exited with {status}");
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("still running 10 s after its queue was deleted");
}

/// The example on SQLite (`DATABASE_URL=sqlite://…`): the order's charge
/// and its record commit together in one file; the duplicate is
/// acknowledged without a second charge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_sqlite_an_order_published_twice_charges_once() {
    let file = TestFile::create();
    let queue = TestQueue::declare().await;
    let url = file.url();
    let consumer = OrdersConsumer::start(&[("DATABASE_URL", &url), ("QUEUE", &queue.name)]).await;
    queue.publish(&order("order-1", 500)).await;
    queue.publish(&order("order-1", 500)).await;
    consumer.wait_for(|l| l == "executed order-1").await;
    consumer.wait_for(|l| l == "duplicate order-1").await;
    drained(&queue).await;
    assert_eq!(file.count(CHARGES).await, 1);
    queue.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_mysql_an_order_published_twice_charges_once_and_a_kill_mid_work_commits_nothing() {
    let db = support::mysql::TestDatabase::create();
    let queue = TestQueue::declare().await;
    let env = [("DATABASE_URL", db.url()), ("QUEUE", queue.name.as_str())];
    let mut consumer = OrdersConsumer::start(&[env[0], env[1], ("WORK_DELAY_MS", "5000")]).await;
    queue.publish(&order("order-1", 500)).await;
    // Killed while the work's row is inserted, uncommitted.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while db.count_uncommitted(CHARGES).await == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the work never inserted its row"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    consumer.kill();
    assert_eq!(db.count(CHARGES).await, 0, "nothing committed");
    let consumer = OrdersConsumer::start(&env).await;
    consumer.wait_for(|l| l == "executed order-1").await;
    queue.publish(&order("order-1", 500)).await;
    consumer.wait_for(|l| l == "duplicate order-1").await;
    drained(&queue).await;
    assert_eq!(db.count(CHARGES).await, 1);
    queue.delete().await;
}

/// Four consumers started at once on a new database: every one comes up
/// (`CREATE TABLE IF NOT EXISTS` races itself on PostgreSQL), and the order
/// is charged once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn consumers_started_together_on_a_new_database_all_come_up() {
    let db = TestDatabase::create();
    let queue = TestQueue::declare().await;
    let env = [("DATABASE_URL", db.url()), ("QUEUE", queue.name.as_str())];
    let consumers =
        futures_util::future::join_all((0..4).map(|_| OrdersConsumer::start(&env))).await;
    queue.publish(&order("order-1", 500)).await;
    let all: Vec<&OrdersConsumer> = consumers.iter().collect();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while count(&all, |l| l == "executed order-1") == 0 {
        assert!(std::time::Instant::now() < deadline, "never charged");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(charges(&db).await, 1);
    queue.delete().await;
}

/// A quorum queue with an `x-delivery-limit` of 1 (RabbitMQ 4 gives every
/// quorum queue a limit, 20 by default), the consumers given none: they
/// learn the queue's. The order is held undecided through a database
/// outage by two consumers in turn, each stopped by SIGTERM: the first
/// gives it back; on the broker's last delivery the second dead-letters it
/// as undecided — never gives it back for the broker to drop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_quorum_queue_the_last_delivery_is_dead_lettered_never_dropped() {
    let db = TestDatabase::create();
    let (first_relay, second_relay) = (
        Relay::start(&db.host_port()).await,
        Relay::start(&db.host_port()).await,
    );
    let queue = TestQueue::declare_quorum(1).await;
    let via = |relay: &Relay| db.url_via(relay.port());
    let (first_url, second_url) = (via(&first_relay), via(&second_relay));
    // Logging, so that a consumer that does not stop says where it is.
    let logged = ("RUST_LOG", "info,tower_idempotency=debug");
    let mut first =
        OrdersConsumer::start(&[("DATABASE_URL", &first_url), ("QUEUE", &queue.name), logged])
            .await;
    first_relay.cut();
    queue.publish(&order("order-1", 500)).await;
    drained(&queue).await;
    // The second one starts while the first holds the order, then loses
    // its database too.
    let mut second = OrdersConsumer::start(&[
        ("DATABASE_URL", &second_url),
        ("QUEUE", &queue.name),
        logged,
    ])
    .await;
    second_relay.cut();
    first.terminate();
    assert!(first.exited(Duration::from_secs(60)).await.success());
    // The broker gives the order back as it lets go of the first consumer,
    // then delivers it to the second: its last delivery.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while queue.consumers().await != 1 || queue.ready().await != 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "never delivered to the second"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    second.terminate();
    assert!(second.exited(Duration::from_secs(60)).await.success());
    assert_eq!(
        queue
            .dead_letters()
            .await
            .iter()
            .map(DeadLetter::body_and_kind)
            .collect::<Vec<_>>(),
        [(order("order-1", 500), Some("undecided".into()))],
        "{:?} {:?}",
        first.lines(),
        second.lines()
    );
    assert_eq!(
        second.lines().last().map(String::as_str),
        Some("undecided order-1")
    );
    assert_eq!(db.count(CHARGES).await, 0);
    queue.delete().await;
}

/// A quorum queue without an `x-delivery-limit` argument: its limit comes
/// from a policy or the broker's default, which AMQP cannot read — the
/// consumer refuses to start, naming the setting, unless it is given.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quorum_queue_whose_limit_cannot_be_learnt_needs_it_given() {
    let file = TestFile::create();
    let name = format!("orders_test_quorum_{}", std::process::id());
    let url = file.url();
    let env = [
        ("DATABASE_URL", url.as_str()),
        ("QUEUE", name.as_str()),
        ("QUEUE_TYPE", "quorum"),
    ];
    let (status, output) = support::process::run_example_to_exit("orders_consumer", &env);
    assert_eq!(status.code(), Some(2), "{output}");
    assert!(output.contains("delivery_limit"), "{output}");
    let given = OrdersConsumer::start(&[env[0], env[1], env[2], ("DELIVERY_LIMIT", "20")]).await;
    drop(given);
    for queue in [name.clone(), format!("{name}.dead")] {
        support::amqp::delete_queue(&queue).await;
    }
}
