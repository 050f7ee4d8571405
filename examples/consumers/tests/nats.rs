//! The `nats_orders` example against a real `nats-server -js` (started on a
//! free port for each test) and real databases (SQLite files,
//! PostgreSQL), counting rows of `order_charges` (no unique constraint: a
//! double execution shows).
//!
//! What only this broker has; what every broker promises is in
//! `tests/brokers.rs`, written once.

mod support;

use std::time::Duration;

use support::{
    consumer::{CHARGES, OrdersConsumer, count, order},
    nats::{NatsServer, TestStream},
    postgres::TestDatabase,
    process::run_example_to_exit,
    relay::Relay,
    sqlite::TestFile,
};

const DURABLE: &str = "orders_test";

fn dead(stream: &TestStream) -> String {
    format!("{}.dead", stream.subject)
}

/// The consumer on `stream`'s orders, with `DATABASE_URL` and `extra`.
async fn consumer(
    server: &NatsServer,
    stream: &TestStream,
    db: &str,
    extra: &[(&str, &str)],
) -> OrdersConsumer {
    let (url, dead) = (server.url(), dead(stream));
    let mut env = vec![
        ("NATS_URL", url.as_str()),
        ("STREAM", stream.name.as_str()),
        ("SUBJECT", stream.subject.as_str()),
        ("DURABLE", DURABLE),
        ("DEAD_LETTER_SUBJECT", dead.as_str()),
        ("DATABASE_URL", db),
    ];
    env.extend_from_slice(extra);
    OrdersConsumer::start_example("nats_orders", &env, "receiving from ").await
}

/// JetStream drops a resend with the same `Nats-Msg-Id`; a resend with a
/// new id is delivered, and charged once all the same. What can never
/// succeed goes to the dead-letter subject and is terminated, never looped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resend_with_a_new_message_id_is_delivered_twice_and_charged_once() {
    let server = NatsServer::start();
    let stream = TestStream::create(&server).await;
    let file = TestFile::create();
    let c = consumer(&server, &stream, &file.url(), &[]).await;
    stream.publish(&order("order-1", 500), Some("send-1")).await;
    stream.publish(&order("order-1", 500), Some("send-1")).await;
    stream.publish(&order("order-1", 500), Some("send-2")).await;
    c.wait_for(|l| l == "executed order-1").await;
    c.wait_for(|l| l == "duplicate order-1").await;
    stream.publish(&order("order-1", 900), None).await;
    stream.publish("{not json", None).await;
    c.wait_for(|l| l == "rejected order-1").await;
    c.wait_for(|l| l.starts_with("invalid ")).await;
    stream.drained(DURABLE).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let lines = c.lines();
    // The two deliveries may have met in flight: one of them then came back.
    assert_eq!(count(&[&c], |l| l == "executed order-1"), 1, "{lines:?}");
    assert_eq!(count(&[&c], |l| l == "rejected order-1"), 1, "{lines:?}");
    assert_eq!(stream.count(&stream.subject).await, 4, "one send-1 dropped");
    let mut kinds: Vec<_> = stream
        .messages(&dead(&stream))
        .await
        .into_iter()
        .map(|dead| dead.kind().unwrap_or_default())
        .collect();
    kinds.sort();
    assert_eq!(
        kinds,
        ["invalid", "mismatch"],
        "each dead letter with its reason"
    );
    assert_eq!(file.count(CHARGES).await, 1);
}

/// The work takes three `AckWait`s, with a second consumer pulling from the
/// same durable: progress acknowledgements keep it from being redelivered
/// mid-work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_three_times_ack_wait_is_never_redelivered_mid_work() {
    let server = NatsServer::start();
    let stream = TestStream::create(&server).await;
    let file = TestFile::create();
    let extra = [("WORK_DELAY_MS", "3000"), ("ACK_WAIT_MS", "1000")];
    let first = consumer(&server, &stream, &file.url(), &extra).await;
    let second = consumer(&server, &stream, &file.url(), &extra).await;
    stream.publish(&order("order-long", 500), None).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while count(&[&first, &second], |l| l == "executed order-long") == 0 {
        assert!(std::time::Instant::now() < deadline, "never executed");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stream.drained(DURABLE).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let lines: Vec<_> = [&first, &second].iter().flat_map(|c| c.lines()).collect();
    assert_eq!(
        count(&[&first, &second], |l| l.ends_with("order-long")),
        1,
        "delivered once: {lines:?}"
    );
    assert_eq!(file.count(CHARGES).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_consumer_exits_non_zero_when_its_consumer_is_deleted() {
    let server = NatsServer::start();
    let stream = TestStream::create(&server).await;
    let file = TestFile::create();
    let mut c = consumer(&server, &stream, &file.url(), &[]).await;
    let js_stream = stream.js.get_stream(&stream.name).await.unwrap();
    js_stream.delete_consumer(DURABLE).await.unwrap();
    let status = c.exited(Duration::from_secs(40)).await;
    assert!(!status.success(), "{status}");
}

// Nothing lost: `MaxDeliver` is never spent on what can pass, and a dead
// letter always has somewhere to go.

/// The database cut for longer than several `AckWait`s, on a consumer with
/// `MaxDeliver` 2: the message is kept in hand (progress acknowledgements),
/// never redelivered, and charged once the database is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_outage_never_spends_max_deliver() {
    let server = NatsServer::start();
    let stream = TestStream::create(&server).await;
    let db = TestDatabase::create();
    let relay = Relay::start(&db.host_port()).await;
    let url = db.url_via(relay.port());
    let extra = [("MAX_DELIVER", "2"), ("ACK_WAIT_MS", "1000")];
    let c = consumer(&server, &stream, &url, &extra).await;
    relay.cut();
    stream.publish(&order("order-1", 500), None).await;
    tokio::time::sleep(Duration::from_secs(8)).await;
    relay.restore();
    c.wait_for_within(|l| l == "executed order-1", Duration::from_secs(60))
        .await;
    stream.drained(DURABLE).await;
    assert_eq!(stream.count(&dead(&stream)).await, 0, "not dead-lettered");
    assert_eq!(db.count(CHARGES).await, 1);
}

/// One consumer on one SQLite file, orders whose work outlasts the store's
/// 5 s busy timeout, `MaxDeliver` 2: each order waits its turn, and every
/// one is charged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_contention_with_one_consumer_charges_every_order() {
    let server = NatsServer::start();
    let stream = TestStream::create(&server).await;
    let file = TestFile::create();
    for i in 1..=3 {
        stream
            .publish(&order(&format!("order-{i}"), 500), None)
            .await;
    }
    let extra = [
        ("MAX_DELIVER", "2"),
        ("ACK_WAIT_MS", "2000"),
        ("WORK_DELAY_MS", "6000"),
    ];
    let c = consumer(&server, &stream, &file.url(), &extra).await;
    for i in 1..=3 {
        let line = format!("executed order-{i}");
        c.wait_for_within(|l| l == line, Duration::from_secs(60))
            .await;
    }
    stream.drained(DURABLE).await;
    assert_eq!(stream.count(&dead(&stream)).await, 0);
    assert_eq!(file.count(CHARGES).await, 3);
}

/// A dead-letter subject no stream captures would lose every dead letter:
/// refused at start-up, naming it; so is a finite `MaxDeliver` with no
/// dead-letter subject at all (its last delivery would be dropped).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_with_nowhere_to_go_are_refused_at_start_up() {
    let server = NatsServer::start();
    let stream = TestStream::create(&server).await;
    let file = TestFile::create();
    let (url, db) = (server.url(), file.url());
    let base = [
        ("NATS_URL", url.as_str()),
        ("STREAM", stream.name.as_str()),
        ("SUBJECT", stream.subject.as_str()),
        ("DURABLE", DURABLE),
        ("DATABASE_URL", db.as_str()),
    ];
    let mut nowhere = base.to_vec();
    nowhere.push(("DEAD_LETTER_SUBJECT", "nowhere.dead"));
    let (status, output) = run_example_to_exit("nats_orders", &nowhere);
    assert_eq!(status.code(), Some(2), "{output}");
    assert!(
        output.contains("DEAD_LETTER_SUBJECT nowhere.dead"),
        "{output}"
    );

    let mut finite = base.to_vec();
    finite.push(("MAX_DELIVER", "5"));
    let (status, output) = run_example_to_exit("nats_orders", &finite);
    assert_eq!(status.code(), Some(2), "{output}");
    assert!(output.contains("MaxDeliver 5"), "{output}");
}

/// Without a dead-letter subject, what can never succeed is kept in the
/// stream, unacknowledged: never terminated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_dead_letter_subject_what_can_never_succeed_is_kept() {
    let server = NatsServer::start();
    let stream = TestStream::create(&server).await;
    let file = TestFile::create();
    let (url, db) = (server.url(), file.url());
    let env = [
        ("NATS_URL", url.as_str()),
        ("STREAM", stream.name.as_str()),
        ("SUBJECT", stream.subject.as_str()),
        ("DURABLE", DURABLE),
        ("DATABASE_URL", db.as_str()),
    ];
    let c = OrdersConsumer::start_example("nats_orders", &env, "receiving from ").await;
    stream.publish("{not json", None).await;
    stream.publish(&order("order-1", 500), None).await;
    c.wait_for(|l| l == "executed order-1").await;
    c.wait_for(|l| l.starts_with("invalid ")).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let js_stream = stream.js.get_stream(&stream.name).await.unwrap();
    let mut durable: async_nats::jetstream::consumer::PullConsumer =
        js_stream.get_consumer(DURABLE).await.unwrap();
    let info = durable.info().await.unwrap();
    assert_eq!(
        info.ack_floor.stream_sequence, 0,
        "the invalid message (sequence 1) is not acknowledged: {info:?}"
    );
    assert_eq!(info.num_ack_pending, 1, "{info:?}");
    assert_eq!(file.count(CHARGES).await, 1);
}
