//! The transactional outbox end to end, on real brokers: the payments
//! example enqueues `charge.created` in each charge's transaction, the
//! `outbox_relay` example publishes it, and the `nats_orders` consumer
//! charges its own ledger once per charge — across a relay killed before
//! it ever published (the charges committed, nothing sent) and a relay
//! killed between publishing and marking (published again with the same
//! id, which the broker drops). Then the relay on SQS FIFO (the same id is
//! the deduplication id) and on RabbitMQ (a queue that does not exist
//! refuses the message: kept, reported, never dropped).

mod support;

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tower_idempotency::{
    Fingerprint, IdempotencyKey, SqliteStore, SqliteTxStore,
    outbox::{Outbox, OutgoingMessage},
    store::{Claim, StorageKey, Store, sql::sqlite::Sqlite},
};

use support::{
    amqp,
    consumer::{CHARGES, OrdersConsumer},
    kafka::{KafkaServer, TestTopic},
    mysql,
    nats::{NatsServer, TestStream},
    postgres, relay,
    sqlite::TestFile,
    sqs::{SqsServer, TestQueue},
};

/// `POST /v1/charges` with `key`, over a connection of its own; the status.
async fn charge(port: u16, key: &str) -> u16 {
    let body = r#"{"amount":1999,"currency":"eur"}"#;
    let request = format!(
        "POST /v1/charges HTTP/1.1\r\nhost: 127.0.0.1\r\nauthorization: Bearer acct_alice\r\n\
         idempotency-key: {key}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
         connection: close\r\n\r\n{body}",
        body.len()
    );
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect to the payments example");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut reply = String::new();
    stream.read_to_string(&mut reply).await.unwrap();
    reply
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("a status line")
}

fn port_of(line: &str) -> u16 {
    line.rsplit(':')
        .next()
        .unwrap()
        .trim()
        .parse()
        .expect("a port")
}

async fn count(file: &TestFile, sql: &str) -> i64 {
    file.count(sql).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn each_charge_reaches_the_downstream_ledger_once_across_relay_crashes() {
    let server = NatsServer::start();
    let stream = TestStream::create(&server).await;
    let (payments_db, downstream_db) = (TestFile::create(), TestFile::create());
    let payments = OrdersConsumer::start_example(
        "payments",
        &[
            ("BIND_ADDR", "127.0.0.1:0"),
            ("DATABASE_URL", &payments_db.url()),
            ("OUTBOX_DESTINATION", &stream.subject),
        ],
        "listening on",
    )
    .await;
    let port = port_of(&payments.wait_for(|l| l.starts_with("listening on")).await);

    // No relay yet: the charges commit, nothing is published — as if the
    // relay had died between the commit and the publish.
    for i in 0..10 {
        for _ in 0..2 {
            assert_eq!(charge(port, &format!("order-{i}")).await, 201);
        }
    }
    assert_eq!(
        count(&payments_db, "SELECT count(*) FROM charges").await,
        10
    );
    assert_eq!(stream.count(&stream.subject).await, 0);

    // A relay that dies after publishing, before marking.
    let relay_env = |pause: &'static str| {
        vec![
            ("DATABASE_URL", payments_db.url()),
            ("OUTBOX_BROKER", "nats".to_owned()),
            ("NATS_URL", server.url()),
            ("RELAY_CLAIM_MS", "1000".to_owned()),
            ("RELAY_BATCH", "4".to_owned()),
            ("PUBLISHED_PAUSE_MS", pause.to_owned()),
        ]
    };
    let env = relay_env("5000");
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let mut dying = OrdersConsumer::start_example("outbox_relay", &env, "relaying").await;
    dying.wait_for(|l| l.starts_with("published")).await;
    dying.kill();
    let republished: Vec<String> = dying
        .lines()
        .iter()
        .filter_map(|l| {
            l.strip_prefix("published ")
                .map(|r| r.split(' ').next().unwrap().to_owned())
        })
        .collect();
    assert!(!republished.is_empty());

    // Its successor publishes everything, the dead one's messages again
    // once their claim lapses, with the same ids.
    let env = relay_env("0");
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let relay = OrdersConsumer::start_example("outbox_relay", &env, "relaying").await;
    for i in 10..20 {
        assert_eq!(charge(port, &format!("order-{i}")).await, 201);
    }
    let consumer = OrdersConsumer::start_example(
        "nats_orders",
        &[
            ("NATS_URL", &server.url()),
            ("STREAM", &stream.name),
            ("SUBJECT", &stream.subject),
            ("DURABLE", "ledger"),
            ("DATABASE_URL", &downstream_db.url()),
        ],
        "receiving from",
    )
    .await;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while count(&downstream_db, CHARGES).await < 20 {
        assert!(
            std::time::Instant::now() < deadline,
            "relay: {:?}",
            relay.lines()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stream.drained("ledger").await;
    let relayed = relay.lines();
    for id in &republished {
        assert!(
            relayed
                .iter()
                .any(|l| l.starts_with(&format!("published {id} "))),
            "{id} published again with the same id"
        );
    }
    assert_eq!(
        stream.count(&stream.subject).await,
        20,
        "the stream dropped the repeats by id"
    );
    assert_eq!(
        count(&downstream_db, CHARGES).await,
        20,
        "one downstream charge per charge"
    );
    assert_eq!(
        consumer
            .lines()
            .iter()
            .filter(|l| l.starts_with("executed"))
            .count(),
        20
    );
}

/// The chain on Kafka: payments → outbox → `outbox_relay` (killed between
/// publishing and marking: Kafka keeps the resend, it deduplicates no
/// relay's) → `kafka_orders`. One downstream charge per charge, the
/// resends absorbed by the consumer's record.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_kafka_each_charge_reaches_the_downstream_ledger_once_across_a_relay_crash() {
    let server = KafkaServer::start();
    let topic = TestTopic::create(&server, 3).await;
    let (payments_db, downstream_db) = (TestFile::create(), TestFile::create());
    let payments = OrdersConsumer::start_example(
        "payments",
        &[
            ("BIND_ADDR", "127.0.0.1:0"),
            ("DATABASE_URL", &payments_db.url()),
            ("OUTBOX_DESTINATION", &topic.name),
        ],
        "listening on",
    )
    .await;
    let port = port_of(&payments.wait_for(|l| l.starts_with("listening on")).await);
    for i in 0..8 {
        assert_eq!(charge(port, &format!("order-{i}")).await, 201);
    }
    let relay_env = |pause: &str| {
        vec![
            ("DATABASE_URL".to_owned(), payments_db.url()),
            ("OUTBOX_BROKER".to_owned(), "kafka".to_owned()),
            ("KAFKA_BROKERS".to_owned(), server.brokers().to_owned()),
            ("RELAY_CLAIM_MS".to_owned(), "1000".to_owned()),
            ("PUBLISHED_PAUSE_MS".to_owned(), pause.to_owned()),
        ]
    };
    let env = relay_env("5000");
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let mut dying = OrdersConsumer::start_example("outbox_relay", &env, "relaying").await;
    dying.wait_for(|l| l.starts_with("published")).await;
    dying.kill();
    let env = relay_env("0");
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let _relay = OrdersConsumer::start_example("outbox_relay", &env, "relaying").await;
    let consumer = OrdersConsumer::start_example(
        "kafka_orders",
        &[
            ("KAFKA_BROKERS", server.brokers()),
            ("KAFKA_TOPIC", &topic.name),
            ("KAFKA_SESSION_TIMEOUT_MS", "6000"),
            ("DATABASE_URL", &downstream_db.url()),
        ],
        "receiving from",
    )
    .await;
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while count(&downstream_db, CHARGES).await < 8 {
        assert!(
            std::time::Instant::now() < deadline,
            "consumer: {:?}",
            consumer.lines()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let records = topic.read(&topic.name);
    assert!(
        records.len() > 8,
        "the dead relay's message is in the topic twice"
    );
    // One account: one partition, in order.
    assert!(
        records
            .iter()
            .all(|r| r.key.as_deref() == Some("acct_alice"))
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        count(&downstream_db, CHARGES).await,
        8,
        "one downstream charge per charge"
    );
    assert!(consumer.lines().iter().any(|l| l.starts_with("duplicate")));
}

/// A transactional SQLite store and its outbox, in a file of its own.
async fn outbox_on(file: &TestFile) -> (SqliteTxStore, Outbox<Sqlite>) {
    let store = SqliteStore::builder()
        .transactional()
        .create_table_if_missing()
        .connect(&file.url())
        .await
        .expect("the store");
    let outbox = Outbox::on(&store)
        .create_table_if_missing()
        .build()
        .await
        .expect("the outbox");
    (store, outbox)
}

/// Enqueues `messages` in one request's transaction, committed.
async fn commit_messages(
    store: &SqliteTxStore,
    outbox: &Outbox<Sqlite>,
    key: &str,
    messages: Vec<OutgoingMessage>,
) {
    let key = StorageKey::new("outbox-test", &IdempotencyKey::new(key).unwrap());
    let fp = Fingerprint::from_bytes([3; 32]);
    let Claim::Acquired(mut tx) = store
        .claim(&key, &fp, Duration::from_secs(5))
        .await
        .unwrap()
    else {
        panic!("a fresh key is claimed")
    };
    for message in messages {
        outbox.enqueue(&mut tx, message).await.unwrap();
    }
    let record = tower_idempotency::CompletedRecord::Message {
        result: None,
        created_at: std::time::SystemTime::now(),
    };
    assert!(
        store
            .complete(
                &key,
                &mut tx,
                &fp,
                std::sync::Arc::new(record),
                Duration::from_secs(60)
            )
            .await
            .unwrap()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_sqs_fifo_a_republished_message_is_dropped_by_its_deduplication_id() {
    let server = SqsServer::start();
    let queue = TestQueue::create_fifo(&server, 30).await;
    let file = TestFile::create();
    let (store, outbox) = outbox_on(&file).await;
    for i in 0..5 {
        let event = OutgoingMessage::new(queue.url.clone(), format!(r#"{{"n":{i}}}"#))
            .ordering_key("acct_alice");
        commit_messages(&store, &outbox, &format!("k{i}"), vec![event]).await;
    }
    let mut env: Vec<(String, String)> = server
        .env()
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
    env.extend([
        ("DATABASE_URL".to_owned(), file.url()),
        ("OUTBOX_BROKER".to_owned(), "sqs".to_owned()),
        ("RELAY_CLAIM_MS".to_owned(), "1000".to_owned()),
        ("PUBLISHED_PAUSE_MS".to_owned(), "5000".to_owned()),
    ]);
    let as_env = |env: &[(String, String)]| -> Vec<(String, String)> { env.to_vec() };
    let dying_env = as_env(&env);
    let dying_env: Vec<(&str, &str)> = dying_env
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let mut dying = OrdersConsumer::start_example("outbox_relay", &dying_env, "relaying").await;
    dying.wait_for(|l| l.starts_with("published")).await;
    dying.kill();
    env.retain(|(k, _)| k != "PUBLISHED_PAUSE_MS");
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let relay = OrdersConsumer::start_example("outbox_relay", &env, "relaying").await;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while outbox.stats().await.unwrap().pending > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "relay: {:?}",
            relay.lines()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        relay
            .lines()
            .iter()
            .filter(|l| l.starts_with("published"))
            .count()
            >= 5,
        "the dead relay's message went again: {:?}",
        relay.lines()
    );
    assert_eq!(queue.depth().await, 5, "one message per id in the queue");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_rabbitmq_a_missing_queue_refuses_the_message_which_is_kept_and_reported() {
    let queue = amqp::TestQueue::declare().await;
    let file = TestFile::create();
    let (store, outbox) = outbox_on(&file).await;
    let missing = format!("{}.missing", queue.name);
    commit_messages(
        &store,
        &outbox,
        "k",
        vec![
            OutgoingMessage::new(missing.clone(), "lost?".to_owned()),
            OutgoingMessage::new(queue.name.clone(), "one".to_owned()),
            OutgoingMessage::new(queue.name.clone(), "two".to_owned()),
        ],
    )
    .await;
    let relay = OrdersConsumer::start_example(
        "outbox_relay",
        &[
            ("DATABASE_URL", &file.url()),
            ("OUTBOX_BROKER", "rabbitmq"),
            ("AMQP_URL", &amqp::broker_url()),
        ],
        "relaying",
    )
    .await;
    relay.wait_for(|l| l.starts_with("refused")).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while outbox.stats().await.unwrap().pending > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "relay: {:?}",
            relay.lines()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let stats = outbox.stats().await.unwrap();
    assert_eq!((stats.sent, stats.refused), (2, 1));
    let refused = outbox.refused(10).await.unwrap();
    assert_eq!(
        refused[0].destination, missing,
        "kept, with where it was going"
    );
    assert_eq!(queue.ready().await, 2);
    queue.delete().await;
}

/// The outbox's rows in `state` (0 pending, 1 sent, 2 refused).
const IN_STATE: &str = "SELECT count(*) FROM idempotency_outbox WHERE state = ";

/// Each id once, and how many ids there are.
fn once_each(ids: &[String]) -> usize {
    let distinct: std::collections::HashSet<&String> = ids.iter().collect();
    assert_eq!(distinct.len(), ids.len(), "an id published twice: {ids:?}");
    distinct.len()
}

/// The broker goes away under a backlog — every connection cut, nothing
/// listening for a while, as in a restart — and comes back: the relay
/// says so, reconnects by itself, and everything is delivered; a message
/// whose confirmation was lost in the cut goes again with the same id.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_rabbitmq_a_broker_restart_under_a_backlog_delivers_everything() {
    let queue = amqp::TestQueue::declare().await;
    let file = TestFile::create();
    let (store, outbox) = outbox_on(&file).await;
    for key in 0..40 {
        let events = (0..10)
            .map(|n| {
                OutgoingMessage::new(queue.name.clone(), format!(r#"{{"n":{n}}}"#))
                    .ordering_key(format!("acct-{}", key % 8))
            })
            .collect();
        commit_messages(&store, &outbox, &format!("k{key}"), events).await;
    }
    let broker = relay::Relay::start(&amqp::broker_host_port()).await;
    let via = amqp::broker_url_via(broker.port());
    let relay = OrdersConsumer::start_example(
        "outbox_relay",
        &[
            ("DATABASE_URL", &file.url()),
            ("OUTBOX_BROKER", "rabbitmq"),
            ("AMQP_URL", &via),
            ("RELAY_BATCH", "16"),
            ("PUBLISHED_PAUSE_MS", "5"),
        ],
        "relaying",
    )
    .await;
    relay.wait_for(|l| l.starts_with("published")).await;
    broker.cut();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let during = count(&file, &format!("{IN_STATE}0")).await;
    assert!(during > 0, "the cut came under a backlog");
    broker.restore();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while count(&file, &format!("{IN_STATE}0")).await > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "relay: {:?}",
            relay.lines()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(
        count(&file, &format!("{IN_STATE}2")).await,
        0,
        "nothing refused"
    );
    let ids = queue.take_message_ids().await;
    let distinct: std::collections::HashSet<&String> = ids.iter().collect();
    assert_eq!(distinct.len(), 400, "every message delivered");
    assert!(
        ids.len() - 400 <= 16,
        "only a round in flight goes again: {}",
        ids.len()
    );
    queue.delete().await;
}

/// The stream deleted while messages wait, then created again: the relay
/// keeps them pending (a missing stream may pass) and delivers them once
/// it is back — none refused for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_nats_a_stream_deleted_and_created_again_gets_everything() {
    let server = NatsServer::start();
    let stream = TestStream::create(&server).await;
    let file = TestFile::create();
    let (store, outbox) = outbox_on(&file).await;
    let jetstream = server.jetstream().await;
    jetstream.delete_stream(&stream.name).await.unwrap();
    let events = (0..3)
        .map(|n| OutgoingMessage::new(stream.subject.clone(), format!(r#"{{"n":{n}}}"#)))
        .collect();
    commit_messages(&store, &outbox, "k", events).await;
    let relay = OrdersConsumer::start_example(
        "outbox_relay",
        &[
            ("DATABASE_URL", &file.url()),
            ("OUTBOX_BROKER", "nats"),
            ("NATS_URL", &server.url()),
        ],
        "relaying",
    )
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let stats = outbox.stats().await.unwrap();
    assert_eq!(
        (stats.pending, stats.refused),
        (3, 0),
        "kept pending: {:?}",
        relay.lines()
    );
    let recreated = TestStream::recreate(&server, &stream).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while outbox.stats().await.unwrap().pending > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "relay: {:?}",
            relay.lines()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(outbox.stats().await.unwrap().refused, 0);
    assert_eq!(recreated.count(&stream.subject).await, 3);
}

/// Two relays whose clocks are 40 s apart (one under `faketime`) share an
/// outbox on PostgreSQL: a claim lapses by the database's clock, so
/// neither takes the other's live claim, and no message is published
/// twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_relays_with_skewed_clocks_publish_nothing_twice() {
    let queue = amqp::TestQueue::declare().await;
    let db = postgres::TestDatabase::create();
    let store = tower_idempotency::PostgresStore::builder()
        .transactional()
        .create_table_if_missing()
        .connect(db.url())
        .await
        .unwrap();
    Outbox::on(&store)
        .create_table_if_missing()
        .build()
        .await
        .unwrap();
    let payments = OrdersConsumer::start_example(
        "payments",
        &[
            ("BIND_ADDR", "127.0.0.1:0"),
            ("DATABASE_URL", db.url()),
            ("OUTBOX_DESTINATION", &queue.name),
        ],
        "listening on",
    )
    .await;
    let port = port_of(&payments.wait_for(|l| l.starts_with("listening on")).await);
    let url = amqp::broker_url();
    let env = [
        ("DATABASE_URL", db.url()),
        ("OUTBOX_BROKER", "rabbitmq"),
        ("AMQP_URL", url.as_str()),
        ("RELAY_BATCH", "4"),
        // Long enough that each relay's rounds overlap the other's claims.
        ("PUBLISHED_PAUSE_MS", "50"),
        ("RELAY_CLAIM_MS", "30000"),
    ];
    let ahead = OrdersConsumer::start_under(
        &["faketime", "-f", "+40s"],
        "outbox_relay",
        &[&env[..], &[("FAKETIME_DONT_FAKE_MONOTONIC", "1")]].concat(),
        "relaying",
    )
    .await;
    let on_time = OrdersConsumer::start_example("outbox_relay", &env, "relaying").await;
    let published = |relay: &OrdersConsumer| {
        relay
            .lines()
            .iter()
            .filter(|l| l.starts_with("published"))
            .count()
    };
    // Both wait on the database's notifications; each charge wakes both.
    // Charged in batches until both relays have worked (on a loaded
    // machine one may win many rounds in a row), each batch drained.
    let mut charged = 0;
    while charged < 100 || published(&ahead) == 0 || published(&on_time) == 0 {
        assert!(
            charged < 1000,
            "one relay never worked: {:?} {:?}",
            ahead.lines(),
            on_time.lines()
        );
        for i in charged..charged + 20 {
            assert_eq!(charge(port, &format!("order-{i}")).await, 201);
        }
        charged += 20;
        let deadline = std::time::Instant::now() + Duration::from_secs(90);
        while db.count(&format!("{IN_STATE}0")).await > 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "{:?} {:?}",
                ahead.lines(),
                on_time.lines()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    let ids = queue.take_message_ids().await;
    assert_eq!(once_each(&ids), charged);
    queue.delete().await;
}

/// A relay claiming and marking on MariaDB beside 300 concurrent charges
/// (each enqueueing its event): its statements never take locks a
/// charge's commit waits on, so every charge is answered 201.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_mariadb_a_relay_beside_300_concurrent_charges_answers_every_one() {
    let queue = amqp::TestQueue::declare().await;
    let db = mysql::TestDatabase::create();
    let payments = OrdersConsumer::start_example(
        "payments",
        &[
            ("BIND_ADDR", "127.0.0.1:0"),
            ("DATABASE_URL", db.url()),
            ("OUTBOX_DESTINATION", &queue.name),
        ],
        "listening on",
    )
    .await;
    let port = port_of(&payments.wait_for(|l| l.starts_with("listening on")).await);
    let url = amqp::broker_url();
    let relay = OrdersConsumer::start_example(
        "outbox_relay",
        &[
            ("DATABASE_URL", db.url()),
            ("OUTBOX_BROKER", "rabbitmq"),
            ("AMQP_URL", url.as_str()),
            ("RELAY_POLL_MS", "10"),
        ],
        "relaying",
    )
    .await;
    let mut statuses = std::collections::BTreeMap::<u16, usize>::new();
    let answers = futures_util::future::join_all(
        (0..300).map(|i| async move { charge(port, &format!("order-{i}")).await }),
    )
    .await;
    for status in answers {
        *statuses.entry(status).or_default() += 1;
    }
    assert_eq!(statuses, [(201, 300)].into(), "every charge answered 201");
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while db.count(&format!("{IN_STATE}0")).await > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "relay: {:?}",
            relay.lines()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(once_each(&queue.take_message_ids().await), 300);
    queue.delete().await;
}
