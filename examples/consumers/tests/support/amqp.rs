//! RabbitMQ for the tests: `AMQP_URL` when set, else the local broker at
//! `amqp://guest:guest@127.0.0.1:5672/%2f`. Each test uses its own queue,
//! deleted when it ends.

use std::sync::atomic::{AtomicUsize, Ordering};

use lapin::{
    BasicProperties, Channel, Connection, ConnectionProperties,
    options::{BasicGetOptions, BasicPublishOptions, QueueDeclareOptions, QueueDeleteOptions},
    types::{AMQPValue, FieldTable},
};

const LOCAL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

pub fn broker_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| LOCAL.to_owned())
}

/// The broker's `host:port`.
pub fn broker_host_port() -> String {
    let url = broker_url();
    let authority = url.split_once("://").map_or(url.as_str(), |(_, rest)| rest);
    let authority = authority
        .rsplit_once('@')
        .map_or(authority, |(_, host)| host);
    authority.split('/').next().unwrap_or(authority).to_owned()
}

/// The broker's URL through a relay on loopback port `port`.
pub fn broker_url_via(port: u16) -> String {
    broker_url().replacen(&broker_host_port(), &format!("127.0.0.1:{port}"), 1)
}

/// A queue that exists for one test.
pub struct TestQueue {
    pub name: String,
    channel: Channel,
    _connection: Connection,
}

impl TestQueue {
    pub async fn declare() -> Self {
        Self::declare_with(FieldTable::default()).await
    }

    /// A quorum queue whose `x-delivery-limit` is `limit`: its message is
    /// delivered at most `limit + 1` times, then dropped by the broker.
    pub async fn declare_quorum(limit: i64) -> Self {
        let mut arguments = FieldTable::default();
        arguments.insert(
            "x-queue-type".into(),
            AMQPValue::LongString("quorum".into()),
        );
        arguments.insert("x-delivery-limit".into(), AMQPValue::LongLongInt(limit));
        Self::declare_with(arguments).await
    }

    async fn declare_with(arguments: FieldTable) -> Self {
        static SEQ: AtomicUsize = AtomicUsize::new(0);
        let url = broker_url();
        let connection = Connection::connect(&url, ConnectionProperties::default())
            .await
            .unwrap_or_else(|e| {
                panic!(
                    "cannot reach RabbitMQ at {url} ({e}). The consumer tests need a real broker: \
                     install and start one (Debian/Ubuntu: `sudo apt-get install rabbitmq-server`, then \
                     `sudo service rabbitmq-server start`; macOS: `brew install rabbitmq`), or set AMQP_URL."
                )
            });
        let channel = connection.create_channel().await.unwrap();
        let name = format!(
            "orders_test_{}_{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        );
        channel
            .queue_declare(
                name.as_str().into(),
                QueueDeclareOptions::durable(),
                arguments,
            )
            .await
            .unwrap();
        Self {
            name,
            channel,
            _connection: connection,
        }
    }

    /// Publishes `payload` and waits for the broker's confirmation.
    pub async fn publish(&self, payload: &str) {
        self.channel
            .basic_publish(
                "".into(),
                self.name.as_str().into(),
                BasicPublishOptions::default(),
                payload.as_bytes(),
                BasicProperties::default().with_delivery_mode(2),
            )
            .await
            .unwrap()
            .await
            .unwrap();
    }

    /// Messages ready in the queue (not counting unacknowledged deliveries).
    pub async fn ready(&self) -> u32 {
        self.passive().await.message_count()
    }

    /// Consumers of the queue.
    pub async fn consumers(&self) -> u32 {
        self.passive().await.consumer_count()
    }

    /// The queue as the broker describes it (a passive declare).
    async fn passive(&self) -> lapin::Queue {
        let passive = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        self.channel
            .queue_declare(self.name.as_str().into(), passive, FieldTable::default())
            .await
            .unwrap()
    }

    /// The name of the dead-letter queue the `orders_consumer` example
    /// declares for this one by default.
    pub fn dead_letter_queue(&self) -> String {
        format!("{}.dead", self.name)
    }

    /// The dead letters, taken from the dead-letter queue.
    pub async fn dead_letters(&self) -> Vec<super::DeadLetter> {
        let mut found = Vec::new();
        let queue = self.dead_letter_queue();
        while let Ok(Some(message)) = self
            .channel
            .basic_get(queue.as_str().into(), BasicGetOptions { no_ack: true })
            .await
        {
            let headers = message
                .properties
                .headers()
                .as_ref()
                .map(|h| {
                    h.inner()
                        .iter()
                        .filter_map(|(name, value)| match value {
                            AMQPValue::LongString(s) => Some((name.to_string(), s.to_string())),
                            _ => None,
                        })
                        .collect()
                })
                .unwrap_or_default();
            found.push(super::DeadLetter {
                body: String::from_utf8_lossy(&message.data).into_owned(),
                headers,
                style: tower_idempotency::message::HeaderStyle::Amqp,
            });
        }
        found
    }

    /// Takes every message ready in the queue: their `message-id`s.
    pub async fn take_message_ids(&self) -> Vec<String> {
        let mut ids = Vec::new();
        while let Ok(Some(message)) = self
            .channel
            .basic_get(self.name.as_str().into(), BasicGetOptions { no_ack: true })
            .await
        {
            let id = message
                .properties
                .message_id()
                .as_ref()
                .map(|id| id.to_string());
            ids.push(id.expect("every relayed message carries its id"));
        }
        ids
    }

    pub async fn delete(self) {
        for queue in [self.name.clone(), self.dead_letter_queue()] {
            let _ = self
                .channel
                .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
                .await;
        }
    }
}

/// Deletes `queue`, if it is there.
pub async fn delete_queue(queue: &str) {
    let connection = Connection::connect(&broker_url(), ConnectionProperties::default())
        .await
        .unwrap();
    let channel = connection.create_channel().await.unwrap();
    let _ = channel
        .queue_delete(queue.into(), QueueDeleteOptions::default())
        .await;
}
