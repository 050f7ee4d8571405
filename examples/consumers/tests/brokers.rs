//! What every consumer promises, written once and run on every broker —
//! SQS (moto), NATS JetStream (a private `nats-server -js`), RabbitMQ (the
//! local broker), Kafka (a private `tansu`; each partition in order, and
//! each key in order) — each through its consumer
//! example, counting rows of `order_charges` (no unique constraint: a
//! double execution shows), dead letters and what the broker still holds:
//!
//! - duplicates charge once; a poison message and a key reused with
//!   another payload are dead-lettered, each with its true reason;
//! - killed (-9) mid-work: nothing commits, and each order is charged once;
//! - killed mid-batch (several orders of one key in hand together): no
//!   order was answered before its charge committed, and each is charged
//!   once;
//! - killed between the commit and the acknowledgement: the redelivery is
//!   a duplicate;
//! - the database cut through a relay: nothing dead-lettered, every order
//!   charged once after the heal;
//! - SIGTERM mid-work: the work in hand finishes and is answered, exit 0;
//! - SIGTERM while idle: the consumer exits at once, not after the
//!   broker's long poll;
//! - the database out of reach at start-up: waited for, not an exit;
//! - three consumers over concurrent duplicates: each order once.
//!
//! What only one broker has (a delivery budget, a visibility timeout, a
//! FIFO group, a partition's position) is tested in its own file.

mod support;

use std::time::Duration;

use support::{
    consumer::{CHARGES, IN_TRANSACTION, OrdersConsumer, TWICE, count, order},
    fixture::{Fixture, Kafka, Nats, RabbitMq, Sqs},
    postgres::TestDatabase,
    relay::Relay,
    sqlite::TestFile,
};
use tower_idempotency::message::DeadLetterField;

/// Waits until `consumers` have said `line`.
async fn said(consumers: &[&OrdersConsumer], line: &str, within: Duration) {
    let deadline = std::time::Instant::now() + within;
    while count(consumers, |l| l == line) == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "no {line:?} within {within:?}: {:?}",
            consumers.iter().flat_map(|c| c.lines()).collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn duplicates_charge_once_and_what_can_never_succeed_is_dead_lettered<B: Fixture>() {
    let broker = B::start().await;
    let file = TestFile::create();
    let c = broker.consumer(&file.url(), &[]).await;
    for _ in 0..3 {
        broker.publish("acct-1", &order("order-1", 500)).await;
    }
    said(&[&c], "executed order-1", Duration::from_secs(30)).await;
    broker.publish("acct-1", &order("order-1", 900)).await;
    broker.publish("acct-2", "{not json").await;
    broker.publish("acct-2", &order("order-2", 500)).await;
    said(&[&c], "rejected order-1", Duration::from_secs(30)).await;
    said(&[&c], "executed order-2", Duration::from_secs(30)).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while count(&[&c], |l| l.starts_with("invalid ")) == 0 {
        assert!(std::time::Instant::now() < deadline, "{:?}", c.lines());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    broker.drained().await;
    assert_eq!(
        count(&[&c], |l| l == "executed order-1"),
        1,
        "{:?}",
        c.lines()
    );
    // A dead letter is published before its delivery is answered, but a
    // broker may show it a moment after the line.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let dead = loop {
        let dead = broker.dead_letters().await;
        if dead.len() >= 2 || std::time::Instant::now() > deadline {
            break dead;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let mut kinds: Vec<String> = dead.iter().map(|d| d.kind().unwrap_or_default()).collect();
    kinds.sort();
    assert_eq!(kinds, ["invalid", "mismatch"], "each with its reason");
    // The contract's fields, on every broker that can carry them: the
    // reason on one line, and where the message came from.
    for letter in &dead {
        let reason = letter.field(DeadLetterField::Reason).unwrap_or_default();
        assert!(!reason.is_empty() && !reason.contains('\n'), "{letter:?}");
        assert_eq!(
            letter.field(DeadLetterField::Source),
            Some(broker.source().as_str()),
            "{letter:?}"
        );
        for field in [DeadLetterField::Partition, DeadLetterField::Position] {
            assert_eq!(
                letter.field(field).is_some(),
                field.name(letter.style).is_some(),
                "{field:?} wherever the broker names it: {letter:?}"
            );
        }
    }
    assert_eq!(file.count(CHARGES).await, 2);
}

async fn killed_mid_work_nothing_commits_and_each_order_is_charged_once<B: Fixture>() {
    let broker = B::start().await;
    let db = TestDatabase::create();
    let mut c = broker
        .consumer(db.url(), &[("WORK_DELAY_MS", "10000")])
        .await;
    broker.publish("acct-1", &order("order-1", 500)).await;
    db.wait_for_count(
        IN_TRANSACTION,
        |n| n == 1,
        "the work never inserted its row",
    )
    .await;
    c.kill();
    assert_eq!(db.count(CHARGES).await, 0, "nothing committed");
    let c = broker.consumer(db.url(), &[]).await;
    said(&[&c], "executed order-1", Duration::from_secs(60)).await;
    broker.drained().await;
    assert_eq!(db.count(CHARGES).await, 1);
}

/// Five orders of one account in hand together — in a batch where the
/// broker gives them one ordering key (Kafka's partition or key), side by
/// side where it gives none — the last held in its work: killed (-9)
/// there, no order was answered before its charge committed, and what was
/// not answered is charged by the restart: each order once.
async fn killed_mid_batch_nothing_was_answered_uncommitted_and_each_order_is_charged_once<
    B: Fixture,
>() {
    let broker = B::start().await;
    let db = TestDatabase::create();
    for i in 0..5 {
        broker
            .publish("acct-1", &order(&format!("order-{i}"), 500))
            .await;
    }
    let mut killed = broker
        .consumer(
            db.url(),
            &[
                ("WORK_DELAY_MS", "120000"),
                ("WORK_DELAY_ORDERS", "order-4"),
            ],
        )
        .await;
    db.wait_for_count(IN_TRANSACTION, |n| n == 1, "the work never began")
        .await;
    killed.kill();
    for line in killed.lines() {
        if let Some(id) = line.strip_prefix("executed ") {
            let committed = format!("SELECT count(*) FROM order_charges WHERE order_id = '{id}'");
            assert_eq!(db.count(&committed).await, 1, "{id} answered, uncommitted");
        }
    }
    // What was answered before the kill is not delivered again (and may
    // have been answered without its line: killed between the two).
    let _c = broker.consumer(db.url(), &[]).await;
    // A bound on a wait for an event (the last charge), generous for a
    // loaded machine.
    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    while db.count(CHARGES).await < 5 {
        assert!(
            std::time::Instant::now() < deadline,
            "not every order was charged"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    broker.drained().await;
    assert_eq!(db.count(CHARGES).await, 5);
    assert_eq!(db.count(TWICE).await, 0, "no order charged twice");
}

async fn killed_between_commit_and_ack_the_redelivery_is_a_duplicate<B: Fixture>() {
    let broker = B::start().await;
    let db = TestDatabase::create();
    let mut c = broker
        .consumer(db.url(), &[("ACK_DELAY_MS", "10000")])
        .await;
    broker.publish("acct-1", &order("order-1", 500)).await;
    db.wait_for_count(CHARGES, |n| n == 1, "the order was never charged")
        .await;
    c.kill();
    let c = broker.consumer(db.url(), &[]).await;
    if B::ACKS_AFTER_COMMIT {
        said(&[&c], "duplicate order-1", Duration::from_secs(60)).await;
    }
    broker.drained().await;
    assert_eq!(db.count(CHARGES).await, 1);
    assert_eq!(count(&[&c], |l| l.starts_with("executed")), 0);
}

async fn a_database_outage_dead_letters_nothing_and_charges_each_order_once<B: Fixture>() {
    let broker = B::start().await;
    let db = TestDatabase::create();
    let relay = Relay::start(&db.host_port()).await;
    let url = db.url_via(relay.port());
    let c = broker.consumer(&url, &[]).await;
    relay.cut();
    for i in 0..3 {
        broker
            .publish(&format!("acct-{i}"), &order(&format!("order-{i}"), 500))
            .await;
    }
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert!(
        !c.lines().iter().any(|l| l.contains(" order-")),
        "nothing decided during the outage: {:?}",
        c.lines()
    );
    relay.restore();
    for i in 0..3 {
        said(
            &[&c],
            &format!("executed order-{i}"),
            Duration::from_secs(90),
        )
        .await;
    }
    broker.drained().await;
    assert!(
        broker.dead_letters().await.is_empty(),
        "nothing dead-lettered"
    );
    assert_eq!(db.count(CHARGES).await, 3);
}

async fn sigterm_finishes_and_answers_the_work_in_hand_then_exits_zero<B: Fixture>() {
    let broker = B::start().await;
    let db = TestDatabase::create();
    // Its log at `info`: a stop that hangs shows how far it got.
    let mut c = broker
        .consumer(db.url(), &[("WORK_DELAY_MS", "2000"), ("RUST_LOG", "info")])
        .await;
    broker.publish("acct-1", &order("order-1", 500)).await;
    db.wait_for_count(IN_TRANSACTION, |n| n == 1, "the work never started")
        .await;
    c.terminate();
    // A bound on a wait for an event (the exit), generous for a loaded machine.
    let status = c.exited(Duration::from_secs(60)).await;
    assert!(status.success(), "{status}");
    assert_eq!(
        c.lines().last().map(String::as_str),
        Some("executed order-1")
    );
    broker.drained().await;
    assert_eq!(db.count(CHARGES).await, 1);
}

/// The database out of reach while the consumer starts (its relay cut):
/// it connects again with back-off instead of exiting, and charges the
/// order once the database is back.
async fn a_database_out_of_reach_at_start_up_is_waited_for<B: Fixture>() {
    let broker = B::start().await;
    let db = TestDatabase::create();
    let relay = Relay::start(&db.host_port()).await;
    relay.cut();
    let url = db.url_via(relay.port());
    broker.publish("acct-1", &order("order-1", 500)).await;
    // Ready only once its store is open: an exit (the old answer to an
    // outage) never says it.
    let back_later = async {
        tokio::time::sleep(Duration::from_secs(2)).await;
        relay.restore();
    };
    let (c, ()) = tokio::join!(broker.consumer(&url, &[]), back_later);
    said(&[&c], "executed order-1", Duration::from_secs(60)).await;
    assert_eq!(db.count(CHARGES).await, 1);
}

/// Terminated as soon as it receives — its first poll just begun, the
/// broker's whole long poll (20 s) ahead of it — an idle consumer exits
/// within its two-second idle poll. The bound is on an event (the exit),
/// ten times the poll, and half the long poll it used to wait out.
async fn an_idle_consumer_stops_at_once_on_sigterm<B: Fixture>() {
    let broker = B::start().await;
    let file = TestFile::create();
    let mut c = broker.consumer(&file.url(), &[]).await;
    c.terminate();
    let status = c.exited(Duration::from_secs(10)).await;
    assert!(status.success(), "{status}");
}

async fn three_consumers_and_concurrent_duplicates_charge_each_order_once<B: Fixture>() {
    let broker = B::start().await;
    let db = TestDatabase::create();
    let extra = [("WORK_DELAY_MS", "20")];
    let a = broker.consumer(db.url(), &extra).await;
    let b = broker.consumer(db.url(), &extra).await;
    let c = broker.consumer(db.url(), &extra).await;
    let orders = 20;
    for i in 0..orders * 3 {
        broker
            .publish(
                &format!("acct-{}", i % 5),
                &order(&format!("order-{}", i % orders), 500),
            )
            .await;
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    while db.count(CHARGES).await < orders {
        assert!(
            std::time::Instant::now() < deadline,
            "not every order charged"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    broker.drained().await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(db.count(TWICE).await, 0, "no order charged twice");
    assert_eq!(db.count(CHARGES).await, orders);
    assert_eq!(
        count(&[&a, &b, &c], |l| l.starts_with("executed")),
        orders as usize
    );
}

/// The cases, on one broker.
macro_rules! broker_cases {
    ($module:ident, $fixture:ty) => {
        mod $module {
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn duplicates_and_dead_letters() {
                duplicates_charge_once_and_what_can_never_succeed_is_dead_lettered::<$fixture>()
                    .await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn killed_mid_work() {
                killed_mid_work_nothing_commits_and_each_order_is_charged_once::<$fixture>().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn killed_mid_batch() {
                killed_mid_batch_nothing_was_answered_uncommitted_and_each_order_is_charged_once::<
                    $fixture,
                >()
                .await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn killed_between_commit_and_ack() {
                killed_between_commit_and_ack_the_redelivery_is_a_duplicate::<$fixture>().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn database_outage() {
                a_database_outage_dead_letters_nothing_and_charges_each_order_once::<$fixture>()
                    .await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn sigterm() {
                sigterm_finishes_and_answers_the_work_in_hand_then_exits_zero::<$fixture>().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn database_out_of_reach_at_start_up() {
                a_database_out_of_reach_at_start_up_is_waited_for::<$fixture>().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn idle_sigterm() {
                an_idle_consumer_stops_at_once_on_sigterm::<$fixture>().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn three_consumers() {
                three_consumers_and_concurrent_duplicates_charge_each_order_once::<$fixture>()
                    .await;
            }
        }
    };
}

broker_cases!(sqs, Sqs);
broker_cases!(nats, Nats);
broker_cases!(rabbitmq, RabbitMq);
broker_cases!(kafka, Kafka);
broker_cases!(kafka_by_key, Kafka<true>);
