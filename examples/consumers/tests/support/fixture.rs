//! One broker fixture per broker, so that a promise every consumer keeps is
//! a case written once (`tests/brokers.rs`) and run for every broker on its
//! real server: moto's SQS, a private `nats-server -js`, the local
//! RabbitMQ, a private `tansu`.

use std::time::Duration;

use super::{
    DeadLetter, amqp,
    consumer::OrdersConsumer,
    kafka::{KafkaServer, TestTopic},
    nats::{NatsServer, TestStream},
    sqs::{SqsServer, TestQueue},
};

/// A broker with a destination of the test's own, and its consumer
/// example.
pub trait Fixture: Sized {
    /// Whether an acknowledgement comes after the commit (so a crash in
    /// between redelivers a duplicate): not on Kafka, whose position
    /// commits with the work.
    const ACKS_AFTER_COMMIT: bool = true;

    async fn start() -> Self;

    /// The consumer example on this destination, with `DATABASE_URL` `db`
    /// and `extra` settings, once it receives.
    async fn consumer(&self, db: &str, extra: &[(&str, &str)]) -> OrdersConsumer;

    /// Publishes `body` (`key` for a broker that partitions or groups by
    /// one), acknowledged by the broker.
    async fn publish(&self, key: &str, body: &str);

    /// Waits until nothing is pending or unacknowledged (where the broker
    /// can tell).
    async fn drained(&self);

    /// The dead letters, read back.
    async fn dead_letters(&self) -> Vec<DeadLetter>;

    /// Where the consumer consumes from, as a dead letter names its
    /// source: the queue, the subject, the topic.
    fn source(&self) -> String;
}

pub struct Sqs {
    server: SqsServer,
    queue: TestQueue,
}

impl Fixture for Sqs {
    async fn start() -> Self {
        let server = SqsServer::start();
        // A short visibility: a crash is redelivered soon.
        let queue = TestQueue::create(&server, 2).await;
        Self { server, queue }
    }

    async fn consumer(&self, db: &str, extra: &[(&str, &str)]) -> OrdersConsumer {
        let sqs = self.server.env();
        let mut env: Vec<(&str, &str)> = sqs.iter().map(|(k, v)| (*k, v.as_str())).collect();
        env.extend([
            ("SQS_QUEUE_URL", self.queue.url.as_str()),
            ("DATABASE_URL", db),
        ]);
        env.extend_from_slice(extra);
        OrdersConsumer::start_example("sqs_orders", &env, "receiving from ").await
    }

    async fn publish(&self, _key: &str, body: &str) {
        self.queue.send(body).await
    }

    async fn drained(&self) {
        self.queue.drained().await
    }

    async fn dead_letters(&self) -> Vec<DeadLetter> {
        self.queue.dead_letters_with_reasons().await
    }

    fn source(&self) -> String {
        self.queue
            .url
            .rsplit('/')
            .next()
            .unwrap_or_default()
            .to_owned()
    }
}

pub struct Nats {
    server: NatsServer,
    stream: TestStream,
}

const DURABLE: &str = "orders_test";

impl Fixture for Nats {
    async fn start() -> Self {
        let server = NatsServer::start();
        let stream = TestStream::create(&server).await;
        Self { server, stream }
    }

    async fn consumer(&self, db: &str, extra: &[(&str, &str)]) -> OrdersConsumer {
        let (url, dead) = (self.server.url(), format!("{}.dead", self.stream.subject));
        let mut env = vec![
            ("NATS_URL", url.as_str()),
            ("STREAM", self.stream.name.as_str()),
            ("SUBJECT", self.stream.subject.as_str()),
            ("DURABLE", DURABLE),
            ("DEAD_LETTER_SUBJECT", dead.as_str()),
            // A short `AckWait`: a crash is redelivered soon.
            ("ACK_WAIT_MS", "1000"),
            ("DATABASE_URL", db),
        ];
        env.extend_from_slice(extra);
        OrdersConsumer::start_example("nats_orders", &env, "receiving from ").await
    }

    async fn publish(&self, _key: &str, body: &str) {
        self.stream.publish(body, None).await
    }

    async fn drained(&self) {
        self.stream.drained(DURABLE).await
    }

    async fn dead_letters(&self) -> Vec<DeadLetter> {
        self.stream
            .messages(&format!("{}.dead", self.stream.subject))
            .await
    }

    fn source(&self) -> String {
        self.stream.subject.clone()
    }
}

pub struct RabbitMq {
    queue: amqp::TestQueue,
}

impl Fixture for RabbitMq {
    async fn start() -> Self {
        Self {
            queue: amqp::TestQueue::declare().await,
        }
    }

    async fn consumer(&self, db: &str, extra: &[(&str, &str)]) -> OrdersConsumer {
        let url = amqp::broker_url();
        let mut env = vec![
            ("AMQP_URL", url.as_str()),
            ("QUEUE", self.queue.name.as_str()),
            ("DATABASE_URL", db),
        ];
        env.extend_from_slice(extra);
        OrdersConsumer::start(&env).await
    }

    async fn publish(&self, _key: &str, body: &str) {
        self.queue.publish(body).await
    }

    /// Nothing ready; deliveries in hand are answered by then (the cases
    /// wait for their lines first).
    async fn drained(&self) {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while self.queue.ready().await > 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "the queue never drained"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn dead_letters(&self) -> Vec<DeadLetter> {
        self.queue.dead_letters().await
    }

    fn source(&self) -> String {
        self.queue.name.clone()
    }
}

/// Kafka, each partition's records in order, or with `BY_KEY` in order
/// per record key.
pub struct Kafka<const BY_KEY: bool = false> {
    server: KafkaServer,
    topic: TestTopic,
}

impl<const BY_KEY: bool> Fixture for Kafka<BY_KEY> {
    const ACKS_AFTER_COMMIT: bool = false;

    async fn start() -> Self {
        let server = KafkaServer::start();
        let topic = TestTopic::create(&server, 3).await;
        Self { server, topic }
    }

    async fn consumer(&self, db: &str, extra: &[(&str, &str)]) -> OrdersConsumer {
        let mut env = vec![
            ("KAFKA_BROKERS", self.server.brokers()),
            ("KAFKA_TOPIC", self.topic.name.as_str()),
            ("KAFKA_SESSION_TIMEOUT_MS", "6000"),
            ("KAFKA_ORDER", if BY_KEY { "key" } else { "partition" }),
            ("DATABASE_URL", db),
        ];
        env.extend_from_slice(extra);
        OrdersConsumer::start_example("kafka_orders", &env, "receiving from ").await
    }

    async fn publish(&self, key: &str, body: &str) {
        self.topic.produce(key, body).await
    }

    /// Kafka keeps what was read: the cases' lines and rows tell.
    async fn drained(&self) {}

    async fn dead_letters(&self) -> Vec<DeadLetter> {
        self.topic.dead_letters_with_kinds().await
    }

    fn source(&self) -> String {
        self.topic.name.clone()
    }
}
