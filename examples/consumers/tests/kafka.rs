//! The `kafka_orders` example against a real Kafka-API broker (`tansu`,
//! started on a free port for each test) and real databases (SQLite files,
//! PostgreSQL, MySQL), counting rows of `order_charges` (no unique
//! constraint: a double execution shows), the dead-letter topic and the
//! stored positions.
//!
//! What only this broker has; what every broker promises is in
//! `tests/brokers.rs`, written once.

mod support;

use std::time::Duration;

use support::{
    consumer::{CHARGES, IN_TRANSACTION, OrdersConsumer, TWICE, count, order},
    kafka::{KafkaServer, TestTopic, fetching},
    mysql::TestDatabase as MySqlDatabase,
    postgres::TestDatabase,
    process::{run_example_to_exit, run_example_to_exit_within},
    sqlite::TestFile,
};

/// The poison record's timestamp (ms): a fixed one, not the producer's clock.
const POISON_AT: i64 = 1_796_000_000_000;

const POSITIONS: &str = "SELECT coalesce(sum(next_offset), 0) FROM idempotency_kafka_positions";

/// The consumer on `topic`, in `group`, with `DATABASE_URL` and `extra`.
async fn consumer(
    server: &KafkaServer,
    topic: &TestTopic,
    group: &str,
    db: &str,
    extra: &[(&str, &str)],
) -> OrdersConsumer {
    let mut env = vec![
        ("KAFKA_BROKERS", server.brokers()),
        ("KAFKA_TOPIC", topic.name.as_str()),
        ("KAFKA_GROUP", group),
        ("KAFKA_SESSION_TIMEOUT_MS", "6000"),
        ("DATABASE_URL", db),
    ];
    env.extend_from_slice(extra);
    OrdersConsumer::start_example("kafka_orders", &env, "receiving from ").await
}

/// `n` orders spread over the topic's partitions by key.
async fn produce_orders(topic: &TestTopic, n: usize) {
    for i in 0..n {
        topic
            .produce(
                &format!("acct-{}", i % 4),
                &order(&format!("order-{i}"), 500),
            )
            .await;
    }
}

/// Waits until `lines` of `consumers` say every order 0..n was decided.
async fn all_decided(consumers: &[&OrdersConsumer], n: usize, within: Duration) {
    let deadline = std::time::Instant::now() + within;
    loop {
        let decided = (0..n)
            .filter(|i| {
                let id = format!(" order-{i}");
                count(consumers, |l| {
                    l.ends_with(&id) && (l.starts_with("executed") || l.starts_with("duplicate"))
                }) > 0
            })
            .count();
        if decided == n {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{decided} of {n} decided: {:?}",
            consumers.iter().flat_map(|c| c.lines()).collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The same order on two partitions (two keys), and again: one charge; a
/// mismatch and a poison record go to the dead-letter topic, the value
/// byte for byte, with their reason and origin; the rest are charged, and
/// the positions move past every record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_across_partitions_charge_once_and_what_can_never_succeed_is_dead_lettered() {
    let server = KafkaServer::start();
    let topic = TestTopic::create(&server, 3).await;
    let file = TestFile::create();
    topic.produce("acct-a", &order("order-1", 500)).await;
    topic.produce("acct-b", &order("order-1", 500)).await;
    topic.produce("acct-c", &order("order-1", 500)).await;
    topic.produce("acct-a", &order("order-1", 900)).await;
    topic
        .produce_with("acct-b", "{not json", &[("trace-id", "t-1")], POISON_AT)
        .await;
    topic.produce("acct-c", &order("order-2", 500)).await;
    let c = consumer(&server, &topic, "g1", &file.url(), &[]).await;
    c.wait_for(|l| l == "executed order-2").await;
    c.wait_for(|l| l == "rejected order-1").await;
    c.wait_for(|l| l.starts_with("invalid ")).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while count(&[&c], |l| l.ends_with(" order-1")) < 4 {
        assert!(std::time::Instant::now() < deadline, "{:?}", c.lines());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        count(&[&c], |l| l == "executed order-1"),
        1,
        "{:?}",
        c.lines()
    );
    assert_eq!(file.count(CHARGES).await, 2);
    let mut dead = topic.dead_letters();
    dead.sort_by_key(|r| r.headers["dead-letter-kind"].clone());
    assert_eq!(dead.len(), 2, "{dead:?}");
    assert_eq!(dead[0].headers["dead-letter-kind"], "invalid");
    assert_eq!(dead[0].value, "{not json", "byte for byte");
    assert_eq!(dead[0].key.as_deref(), Some("acct-b"));
    assert_eq!(dead[0].headers["trace-id"], "t-1", "its own headers kept");
    assert_eq!(dead[0].timestamp, Some(POISON_AT), "its timestamp kept");
    assert_eq!(dead[1].headers["dead-letter-kind"], "mismatch");
    assert!(dead[1].headers["dead-letter-reason"].contains("another payload"));
    assert_eq!(dead[1].headers["original-topic"], topic.name);
    assert!(dead[1].headers.contains_key("original-partition"));
    assert!(dead[1].headers.contains_key("original-offset"));
    // Six records in all: the positions sum to their offsets + 1.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while file.count(POSITIONS).await != 6 {
        assert!(std::time::Instant::now() < deadline, "every record decided");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Three consumers joining one group, one killed mid-stream: every order
/// charged once, across the rebalances.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_consumers_with_joins_and_a_kill_charge_each_order_once() {
    let server = KafkaServer::start();
    let topic = TestTopic::create(&server, 6).await;
    let db = TestDatabase::create();
    let extra = [("WORK_DELAY_MS", "20")];
    let a = consumer(&server, &topic, "g1", db.url(), &extra).await;
    produce_orders(&topic, 20).await;
    let mut b = consumer(&server, &topic, "g1", db.url(), &extra).await;
    produce_orders(&topic, 40).await;
    let c = consumer(&server, &topic, "g1", db.url(), &extra).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    b.kill();
    for i in 40..60 {
        topic
            .produce(
                &format!("acct-{}", i % 6),
                &order(&format!("order-{i}"), 500),
            )
            .await;
    }
    all_decided(&[&a, &b, &c], 60, Duration::from_secs(120)).await;
    assert_eq!(db.count(CHARGES).await, 60);
    assert_eq!(db.count(TWICE).await, 0, "no order charged twice");
}

/// The work's transaction open (its row inserted, uncommitted) with records
/// behind it on the partition: no position past the record in hand is
/// committed — the position commits with the effect, never before it — and
/// killed (-9) there, the consumer loses nothing: its restart charges every
/// order once. (A position committed ahead of its effect would show here,
/// whatever the timing, and lose the record at the kill.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_mid_work_the_position_never_passed_the_record_in_hand() {
    let server = KafkaServer::start();
    let topic = TestTopic::create(&server, 1).await;
    let db = TestDatabase::create();
    produce_orders(&topic, 3).await;
    let mut c = consumer(
        &server,
        &topic,
        "g1",
        db.url(),
        &[("WORK_DELAY_MS", "10000")],
    )
    .await;
    db.wait_for_count(
        IN_TRANSACTION,
        |n| n == 1,
        "the work never inserted its row",
    )
    .await;
    assert_eq!(
        db.count("SELECT coalesce(max(next_offset), 0) FROM idempotency_kafka_positions")
            .await,
        0,
        "a position committed before its record's effect"
    );
    c.kill();
    assert_eq!(db.count(CHARGES).await, 0, "nothing committed");
    let after = consumer(&server, &topic, "g1", db.url(), &[]).await;
    all_decided(&[&after], 3, Duration::from_secs(60)).await;
    assert_eq!(db.count(CHARGES).await, 3);
    assert_eq!(
        db.count("SELECT max(next_offset) FROM idempotency_kafka_positions")
            .await,
        3
    );
}

/// In order per key, on one partition: the first order is held in its
/// work (its row inserted, uncommitted) while the three behind it, other
/// accounts, are charged and committed — side by side within the
/// partition, which the partition's order cannot do — yet the stored
/// position never passes the order in work. Killed (-9) there, the restart charges that
/// order; the three decided beyond it are duplicates, never charged
/// again, and the position then stands past all four.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_order_per_key_other_keys_pass_a_record_in_work_and_the_position_never_does() {
    let server = KafkaServer::start();
    let topic = TestTopic::create(&server, 1).await;
    let db = TestDatabase::create();
    produce_orders(&topic, 4).await;
    let mut c = consumer(
        &server,
        &topic,
        "g1",
        db.url(),
        &[
            ("KAFKA_ORDER", "key"),
            ("WORK_DELAY_MS", "120000"),
            ("WORK_DELAY_ORDERS", "order-0"),
        ],
    )
    .await;
    for i in 1..4 {
        c.wait_for(|l| l == format!("executed order-{i}")).await;
    }
    assert_eq!(db.count(CHARGES).await, 3, "{:?}", c.lines());
    assert_eq!(
        db.count(IN_TRANSACTION).await,
        1,
        "order-0 still in its work"
    );
    assert_eq!(
        db.count("SELECT coalesce(max(next_offset), 0) FROM idempotency_kafka_positions")
            .await,
        0,
        "a position past the record in work: {:?}",
        c.lines()
    );
    c.kill();
    let after = consumer(&server, &topic, "g1", db.url(), &[("KAFKA_ORDER", "key")]).await;
    after.wait_for(|l| l == "executed order-0").await;
    all_decided(&[&after], 4, Duration::from_secs(60)).await;
    assert_eq!(db.count(CHARGES).await, 4);
    assert_eq!(db.count(TWICE).await, 0, "no order charged twice");
    assert_eq!(
        count(&[&after], |l| l.starts_with("duplicate")),
        3,
        "{:?}",
        after.lines()
    );
    // Decided beyond the record in work, the duplicates moved the position
    // past all four once order-0 committed.
    db.wait_for_count(
        "SELECT coalesce(max(next_offset), 0) FROM idempotency_kafka_positions",
        |n| n == 4,
        "the position never reached the end",
    )
    .await;
}

/// A consumer with a new group id on the same database starts where the
/// last one stood: nothing executed again, nothing decided delivered again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_group_on_the_same_database_executes_nothing_again() {
    let server = KafkaServer::start();
    let topic = TestTopic::create(&server, 2).await;
    let file = TestFile::create();
    produce_orders(&topic, 5).await;
    let mut first = consumer(&server, &topic, "g1", &file.url(), &[]).await;
    all_decided(&[&first], 5, Duration::from_secs(60)).await;
    first.terminate();
    first.exited(Duration::from_secs(30)).await;
    let second = consumer(&server, &topic, "g2", &file.url(), &[]).await;
    topic.produce("acct-0", &order("order-new", 500)).await;
    second.wait_for(|l| l == "executed order-new").await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        second.lines().len(),
        2,
        "only the new order: {:?}",
        second.lines()
    );
    assert_eq!(file.count(CHARGES).await, 6);
}

/// SIGTERM on MySQL: the work in hand finishes and commits with its
/// position, the consumer exits 0, and its restart charges nothing twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_finishes_the_work_in_hand_exits_zero_and_nothing_runs_twice() {
    let server = KafkaServer::start();
    let topic = TestTopic::create(&server, 1).await;
    let db = MySqlDatabase::create();
    produce_orders(&topic, 3).await;
    let mut c = consumer(
        &server,
        &topic,
        "g1",
        db.url(),
        &[("WORK_DELAY_MS", "1500")],
    )
    .await;
    c.wait_for(|l| l == "executed order-0").await;
    c.terminate();
    let status = c.exited(Duration::from_secs(30)).await;
    assert!(status.success(), "{status}");
    let after = consumer(&server, &topic, "g1", db.url(), &[]).await;
    all_decided(&[&c, &after], 3, Duration::from_secs(60)).await;
    assert_eq!(db.count(CHARGES).await, 3);
    assert_eq!(count(&[&after], |l| l.starts_with("executed order-0")), 0);
}

/// Orders produced together share a batch per partition, and tansu 0.6
/// then reports a partition's end (its high watermark) as its last
/// batch's first offset + 1 — below the positions its consumers stored.
/// Three consumers, one stopped by SIGTERM and another started while the
/// rest rebalance, twice: each partition is fetched again from its stored
/// position before anything new is produced (none is taken for a new log
/// while its last decided record is still served), and every order is
/// charged once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumers_stopped_by_sigterm_beside_others_hand_their_partitions_on_and_all_is_charged_once()
 {
    let server = KafkaServer::start();
    let topic = TestTopic::create(&server, 3).await;
    let db = TestDatabase::create();
    let logged = [("RUST_LOG", "tower_idempotency_kafka=info")];
    let together = |from: usize, to: usize| {
        (from..to)
            .map(|i| (format!("acct-{}", i % 6), order(&format!("order-{i}"), 500)))
            .collect::<Vec<_>>()
    };
    let mut consumers = Vec::new();
    for _ in 0..3 {
        consumers.push(consumer(&server, &topic, "g1", db.url(), &logged).await);
    }
    topic.produce_together(&together(0, 30)).await;
    all_decided(
        &consumers.iter().collect::<Vec<_>>(),
        30,
        Duration::from_secs(60),
    )
    .await;
    let mut stopped = Vec::new();
    for round in 1..=2 {
        let mut leaving = consumers.remove(0);
        let marks: Vec<usize> = consumers.iter().map(|c| c.log().len()).collect();
        leaving.terminate();
        let status = leaving.exited(Duration::from_secs(30)).await;
        assert!(status.success(), "{status}");
        stopped.push(leaving);
        consumers.push(consumer(&server, &topic, "g1", db.url(), &logged).await);
        // Every partition fetched again after the stop, by a consumer still
        // running — before new records could lift the watermarks.
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            let fetching: std::collections::HashSet<String> = consumers
                .iter()
                .enumerate()
                .flat_map(|(i, c)| c.log().into_iter().skip(*marks.get(i).unwrap_or(&0)))
                .filter_map(|line| fetching(&line).map(str::to_owned))
                .collect();
            if fetching.len() == 3 {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "round {round}: partitions fetched again: {fetching:?}; logs: {:?}",
                consumers.iter().map(|c| c.log()).collect::<Vec<_>>()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        topic
            .produce_together(&together(30 * round, 30 * (round + 1)))
            .await;
        let all: Vec<_> = consumers.iter().chain(&stopped).collect();
        all_decided(&all, 30 * (round + 1), Duration::from_secs(90)).await;
    }
    assert_eq!(db.count(CHARGES).await, 90);
    assert_eq!(db.count(TWICE).await, 0, "no order charged twice");
}

/// SIGTERM with an order in its work and another order and an invalid
/// record behind it on the partition, received: the one in work commits,
/// the two behind are given back — the invalid one is not dead-lettered
/// then, for its acknowledgement would be a position past the order given
/// back before it — and the restart charges that order and dead-letters
/// the invalid record. (Dead-lettered at the stop, it lost the order.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_sigterm_nothing_behind_a_record_given_back_moves_the_position_past_it() {
    let server = KafkaServer::start();
    let topic = TestTopic::create(&server, 1).await;
    let db = TestDatabase::create();
    topic.produce("acct-0", &order("order-0", 500)).await;
    topic.produce("acct-0", &order("order-1", 500)).await;
    topic.produce("acct-0", "{not an order").await;
    let mut c = consumer(
        &server,
        &topic,
        "g1",
        db.url(),
        &[("WORK_DELAY_MS", "3000")],
    )
    .await;
    db.wait_for_count(
        IN_TRANSACTION,
        |n| n == 1,
        "the work never inserted its row",
    )
    .await;
    c.terminate();
    let status = c.exited(Duration::from_secs(30)).await;
    assert!(status.success(), "{status}");
    assert_eq!(db.count(CHARGES).await, 1, "the order in work committed");
    assert_eq!(
        db.count("SELECT max(next_offset) FROM idempotency_kafka_positions")
            .await,
        1,
        "no position past the order given back: {:?}",
        c.lines()
    );

    let after = consumer(&server, &topic, "g1", db.url(), &[]).await;
    after
        .wait_for_within(|l| l == "executed order-1", Duration::from_secs(60))
        .await;
    after
        .wait_for_within(|l| l.starts_with("invalid "), Duration::from_secs(60))
        .await;
    assert_eq!(db.count(CHARGES).await, 2);
    assert_eq!(topic.dead_letters().len(), 1);
}

/// Mistakes and outages at start-up say so, within a bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_database_and_unreachable_brokers_are_told_at_start_up() {
    let file = TestFile::create();
    let port = support::redis_server::free_port().to_string();
    let closed = format!("127.0.0.1:{port}");
    let (status, output) = run_example_to_exit(
        "kafka_orders",
        &[
            ("KAFKA_BROKERS", closed.as_str()),
            ("DATABASE_URL", file.url().as_str()),
        ],
    );
    assert_eq!(status.code(), Some(2), "{output}");
    assert!(output.contains("no Kafka broker answered"), "{output}");
    let (status, output) = run_example_to_exit("kafka_orders", &[("DATABASE_URL", "oracle://x")]);
    assert_eq!(status.code(), Some(2), "{output}");
    assert!(output.contains("oracle"), "{output}");
}

/// The broker loses its log (tansu on memory storage restarted, as a topic
/// deleted and created again or a move to a new cluster would): the new
/// log's offsets start again below the stored positions. The consumer takes
/// none of its records for decided — it stops, exit 2, saying what happened
/// and which positions to delete — and once they are deleted as it says,
/// every new order is charged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_that_restarts_below_the_stored_positions_stops_the_consumer_and_loses_nothing() {
    let mut server = KafkaServer::start();
    let topic = TestTopic::create(&server, 1).await;
    let db = TestDatabase::create();
    produce_orders(&topic, 6).await;
    let mut c = consumer(&server, &topic, "g1", db.url(), &[]).await;
    all_decided(&[&c], 6, Duration::from_secs(60)).await;
    c.terminate();
    c.exited(Duration::from_secs(30)).await;
    assert_eq!(
        db.count("SELECT max(next_offset) FROM idempotency_kafka_positions")
            .await,
        6
    );

    server.restart_empty();
    let topic = TestTopic::create_named(&server, topic.name.clone(), 1).await;
    for i in 0..3 {
        topic
            .produce("acct-0", &order(&format!("new-order-{i}"), 500))
            .await;
    }
    // A bound on a wait for an event (the exit), generous for a loaded machine.
    let (status, output) = run_example_to_exit_within(
        "kafka_orders",
        &[
            ("KAFKA_BROKERS", server.brokers()),
            ("KAFKA_TOPIC", topic.name.as_str()),
            ("KAFKA_GROUP", "g1"),
            ("KAFKA_SESSION_TIMEOUT_MS", "6000"),
            ("DATABASE_URL", db.url()),
        ],
        Duration::from_secs(60),
    );
    assert_eq!(status.code(), Some(2), "{output}");
    assert!(
        output.contains("ends at offset 3, below the position stored")
            && output.contains("DELETE FROM idempotency_kafka_positions"),
        "{output}"
    );
    assert_eq!(db.count(CHARGES).await, 6, "nothing of the new log taken");

    tower_idempotency::sqlx::query(
        "DELETE FROM idempotency_kafka_positions WHERE consumer = 'kafka_orders' AND topic = $1",
    )
    .bind(&topic.name)
    .execute(&mut db.connect().await)
    .await
    .unwrap();
    let c = consumer(&server, &topic, "g1", db.url(), &[]).await;
    for i in 0..3 {
        let line = format!("executed new-order-{i}");
        c.wait_for_within(|l| l == line, Duration::from_secs(60))
            .await;
    }
    assert_eq!(db.count(CHARGES).await, 9);
}

/// The outbox's Kafka publisher across a broker that restarts with its
/// log and producer state lost: a delivery is bounded (it answers
/// unavailable rather than wait librdkafka's five minutes), and a producer
/// whose idempotent session the broker no longer knows is replaced, so a
/// message published after the restart is delivered — by the same
/// publisher, as a relay that keeps running would.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_publisher_delivers_again_after_the_broker_lost_its_producer_state() {
    use tower_idempotency::outbox::{OutboxMessage, Publisher};
    use tower_idempotency_kafka::{KafkaPublisher, rdkafka::ClientConfig};

    let mut server = KafkaServer::start();
    let topic = TestTopic::create(&server, 1).await;
    let publisher =
        KafkaPublisher::new(ClientConfig::new().set("bootstrap.servers", server.brokers()))
            .unwrap();
    let message =
        |id: &str| OutboxMessage::new(id, topic.name.clone(), order(id, 500).into_bytes());
    publisher.publish(&message("before")).await.unwrap();

    server.restart_empty();
    let topic = TestTopic::create_named(&server, topic.name.clone(), 1).await;
    // As the relay does: publish, and on an unavailable broker try again.
    // A bound on a wait for an event (a delivery), generous for a loaded
    // machine, and far below librdkafka's own 300 s per attempt.
    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    let mut failures = Vec::new();
    loop {
        match tokio::time::timeout(
            Duration::from_secs(30),
            publisher.publish(&message("after")),
        )
        .await
        {
            Ok(Ok(())) => break,
            Ok(Err(error)) => failures.push(error.to_string()),
            Err(_) => panic!("a delivery waited more than 30 s: unbounded"),
        }
        assert!(
            std::time::Instant::now() < deadline,
            "never delivered after the restart: {failures:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let values: Vec<String> = topic
        .read(&topic.name)
        .into_iter()
        .map(|r| r.value)
        .collect();
    assert_eq!(values, [order("after", 500)], "{failures:?}");
}
