//! An orders consumer on Kafka that charges each order exactly once,
//! however often a record is read, with the consumed position committed in
//! the charge's own transaction.
//!
//! Run with:
//!
//! ```not_rust
//! KAFKA_BROKERS=127.0.0.1:9092 DATABASE_URL=sqlite://orders.db \
//!     cargo run --release --example kafka_orders
//! ```
//!
//! Environment: `KAFKA_BROKERS` (default `127.0.0.1:9092`); `KAFKA_TOPIC`
//! (default `orders`); `KAFKA_GROUP` (default `orders_consumer`: the
//! consumer group; its committed offsets are only a hint);
//! `DEAD_LETTER_TOPIC` (default `<topic>.dead`, created at start-up);
//! `KAFKA_SESSION_TIMEOUT_MS` (default 10000); `KAFKA_ORDER` (`partition`,
//! the default: each partition's records one after another; `key`: in
//! order per record key — an account's orders in order, accounts side by
//! side); `KAFKA_IN_HAND` (default 10: records in work at once, in all);
//! `DATABASE_URL` (required:
//! `sqlite://PATH`, `postgres://…` or `mysql://…`; the tables are created
//! if missing, the positions table `idempotency_kafka_positions` too);
//! `WORK_DELAY_MS`, `WORK_DELAY_ORDERS`, `IDEMPOTENCY_LEASE_MS`,
//! `IDEMPOTENCY_TX_TIMEOUT_MS`, `STARTUP_RETRY_S` as in `orders_consumer`.
//!
//! A record's value is JSON `{"order_id", "amount", "currency"}`; the order
//! id is the business key. Each execution inserts one row into
//! `order_charges` and the record's position (topic, partition, offset +
//! 1), in the same transaction as the idempotency record. On assignment a
//! partition seeks to its stored position (its earliest offset when none is
//! stored), so a new `KAFKA_GROUP` on the same database executes nothing
//! again. The loop is the library's (`tower-idempotency-kafka`):
//! partitions side by side, each in order (or each key in order); the
//! stored position moves only past records decided, so an outage keeps a
//! record in hand (the records behind it on its partition or key wait),
//! never skips it; what can never
//! succeed goes to the dead-letter topic with `dead-letter-reason`,
//! `original-topic`, `original-partition` and `original-offset` headers
//! before the position moves past it.
//!
//! One line per record on stdout: `receiving from <topic>` once polling,
//! then `executed|duplicate|rejected|refused <order_id>` or `invalid
//! <topic>/<partition>@<offset>`. It exits with status 2 naming what to fix
//! for an unknown `DATABASE_URL` scheme, a dead-letter topic that cannot be
//! created, or brokers that do not answer within 5 s; on SIGTERM it stops
//! polling, finishes and commits what is in hand, and exits 0.

use std::time::Duration;

use tower_idempotency_kafka::{Kafka, KafkaConsumer, rdkafka::ClientConfig};

#[path = "orders/mod.rs"]
mod orders;

use orders::{Ledger, OnLedger, Settings, exit_with, millis, say};

#[tokio::main]
async fn main() {
    orders::init_tracing("kafka_orders");
    let settings = Settings::from_env().unwrap_or_else(|why| exit_with(&why));
    let var = |name: &str, default: &str| std::env::var(name).unwrap_or_else(|_| default.into());
    let topic = var("KAFKA_TOPIC", "orders");
    let consumer = KafkaOrders {
        brokers: var("KAFKA_BROKERS", "127.0.0.1:9092"),
        dead_letters: var("DEAD_LETTER_TOPIC", &format!("{topic}.dead")),
        group: var("KAFKA_GROUP", "orders_consumer"),
        session_timeout: millis("KAFKA_SESSION_TIMEOUT_MS", 10_000)
            .unwrap_or_else(|why| exit_with(&why)),
        by_key: match var("KAFKA_ORDER", "partition").as_str() {
            "partition" => false,
            "key" => true,
            other => exit_with(&format!(
                "KAFKA_ORDER must be partition or key, not {other:?}"
            )),
        },
        in_hand: count("KAFKA_IN_HAND", 10).unwrap_or_else(|why| exit_with(&why)),
        topic,
    };
    orders::with_ledger(consumer, settings).await;
    eprintln!("kafka_orders: SIGTERM: stopped polling, the records in hand done");
}

struct KafkaOrders {
    brokers: String,
    topic: String,
    group: String,
    dead_letters: String,
    session_timeout: Duration,
    by_key: bool,
    in_hand: usize,
}

/// A count from the environment, at least 1.
fn count(name: &str, default: usize) -> Result<usize, String> {
    match std::env::var(name) {
        Err(_) => Ok(default),
        Ok(value) => match value.parse() {
            Ok(n) if n >= 1 => Ok(n),
            _ => Err(format!(
                "{name} must be a whole number from 1, not {value:?}"
            )),
        },
    }
}

impl OnLedger for KafkaOrders {
    async fn run<St: Ledger>(
        self,
        store: St,
        settings: Settings,
    ) -> Result<(), tower_idempotency::message::BrokerError> {
        let mut config = ClientConfig::new();
        config
            .set("bootstrap.servers", &self.brokers)
            .set("group.id", &self.group)
            .set(
                "session.timeout.ms",
                self.session_timeout.as_millis().to_string(),
            );
        let kafka = Kafka::builder(config, self.topic.clone(), "kafka_orders", store.clone())
            .dead_letter_topic(self.dead_letters)
            .in_order_per_key(self.by_key)
            .build()
            .await
            .unwrap_or_else(|e| exit_with(&e.to_string()));
        say(&format!("receiving from {}", self.topic));
        let orders = orders::processor(store, "kafka_orders", &settings);
        KafkaConsumer::new(kafka, orders)
            .in_hand(self.in_hand)
            .passing_when(orders::passing)
            .on_settled(|report| {
                if let Some(line) = orders::line(report, |record| record.coordinates()) {
                    say(&line);
                }
            })
            .run(
                orders::parse,
                orders::charging::<St>(settings.work_delay.clone()),
                orders::sigterm(),
            )
            .await
    }
}
