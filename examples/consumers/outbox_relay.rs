//! The outbox relay: publishes what the payments example enqueued in its
//! outbox (`charge.created`, with `OUTBOX_DESTINATION` set) to SQS, NATS
//! JetStream, RabbitMQ or Kafka, each message with its deterministic id as the
//! broker's deduplication id. Run one beside each payments instance, on
//! the same database; several share the work.
//!
//! Run with:
//!
//! ```not_rust
//! DATABASE_URL=sqlite://payments.db OUTBOX_BROKER=nats \
//!     cargo run --release --example outbox_relay
//! ```
//!
//! Environment: `DATABASE_URL` (required: the payments example's database,
//! `sqlite://PATH`, `postgres://…` or `mysql://…`); `OUTBOX_BROKER`
//! (required):
//!
//! - `sqs` — the AWS environment as for `sqs_orders`; a message's
//!   destination is a queue URL. On a FIFO queue (`….fifo`) the message id
//!   is the `MessageDeduplicationId` (SQS drops a repeat within 5 minutes)
//!   and the ordering key the `MessageGroupId`; every message carries a
//!   `message-id` attribute. A queue that does not exist refuses the
//!   message.
//! - `nats` — `NATS_URL` (default `nats://127.0.0.1:4222`); a message's
//!   destination is a subject, its id the `Nats-Msg-Id` (the stream drops
//!   a repeat within its duplicate window); a subject no stream captures
//!   refuses the message.
//! - `rabbitmq` — `AMQP_URL` (default `amqp://guest:guest@127.0.0.1:5672/%2f`);
//!   a message's destination is a queue name (the default exchange), its
//!   id the `message-id` property, published persistent and mandatory with
//!   publisher confirms: a queue that does not exist refuses it. RabbitMQ
//!   does not deduplicate: a repeat is the consumer's to absorb, by its own
//!   idempotency. The publisher reconnects by itself after a broker
//!   restart.
//!
//! - `kafka` — `KAFKA_BROKERS` (default `127.0.0.1:9092`); a message's
//!   destination is a topic, its ordering key the record key (one
//!   account's events in order on one partition), its id the `message-id`
//!   header, through the idempotent producer; an unknown topic refuses the
//!   message. Kafka does not deduplicate a resend after a relay crash: the
//!   consumer's record absorbs it.
//!
//! The publishers are the broker crates' (`tower-idempotency-sqs`,
//! `-nats`, `-rabbitmq`, `-kafka`); a broker that is down is retried with
//! back-off, and the relay says so when an outage starts and when it ends.
//!
//! `RELAY_BATCH` (default 256), `RELAY_POLL_MS` (default 1000: how often
//! an idle relay looks; it wakes at once at a commit it hears of — every
//! commit on PostgreSQL, through `LISTEN`),
//! `RELAY_CLAIM_MS` (default 3000: how long a claim holds its messages
//! without word from its relay — a live relay renews it while it works, a
//! killed one's messages are taken over once it lapses); `PUBLISHED_PAUSE_MS` (default 0: a pause after
//! each publication, before it is marked sent — the window a crash
//! republishes, widened for the tests).
//!
//! One line per message on stdout: `relaying <broker>` first, then
//! `published <id> <destination>` (or `refused <id> <why>`, kept in the
//! outbox as refused). On SIGTERM it finishes its round and exits 0.

use std::{env, time::Duration};

use tokio::signal::unix::{SignalKind, signal};
use tower_idempotency::{
    MySqlStore, PostgresStore, SqliteStore,
    outbox::{Outbox, OutboxMessage, OutboxRelay, OutboxTable, PublishError, Publisher},
};
use tower_idempotency_kafka::{KafkaPublisher, rdkafka::ClientConfig};
use tower_idempotency_nats::JetStreamPublisher;
use tower_idempotency_rabbitmq::RabbitMqPublisher;
use tower_idempotency_sqs::SqsPublisher;

#[tokio::main]
async fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "outbox_relay=info,tower_idempotency=info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let url = env::var("DATABASE_URL").unwrap_or_else(|_| exit_with("DATABASE_URL is required"));
    let broker = match env::var("OUTBOX_BROKER").as_deref() {
        Ok("sqs") => Broker::Sqs(SqsPublisher::new(aws_sdk_sqs::Client::new(
            &aws_config::load_from_env().await,
        ))),
        Ok("nats") => {
            let nats_url = env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
            let client = async_nats::connect(&nats_url)
                .await
                .unwrap_or_else(|e| exit_with(&format!("NATS_URL: {e}")));
            Broker::Nats(JetStreamPublisher::new(async_nats::jetstream::new(client)))
        }
        Ok("rabbitmq") => {
            let amqp_url = env::var("AMQP_URL")
                .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
            let publisher = RabbitMqPublisher::new(amqp_url);
            publisher
                .connect()
                .await
                .unwrap_or_else(|e| exit_with(&format!("AMQP_URL: {e}")));
            Broker::Rabbit(publisher)
        }
        Ok("kafka") => {
            let brokers = env::var("KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into());
            let publisher =
                KafkaPublisher::new(ClientConfig::new().set("bootstrap.servers", brokers))
                    .unwrap_or_else(|e| exit_with(&format!("KAFKA_BROKERS: {e}")));
            Broker::Kafka(publisher)
        }
        Ok(other) => exit_with(&format!(
            "OUTBOX_BROKER must be sqs, nats, rabbitmq or kafka, got {other:?}"
        )),
        Err(_) => exit_with("OUTBOX_BROKER is required: sqs, nats, rabbitmq or kafka"),
    };
    let publisher = Announced {
        broker,
        pause: Duration::from_millis(number("PUBLISHED_PAUSE_MS", 0)),
    };
    let scheme = url.split_once(':').map_or("", |(scheme, _)| scheme);
    // The engines' builders are types of their own; the steps are the same.
    macro_rules! relay_on {
        ($store:ty) => {{
            let store = <$store>::builder()
                .transactional()
                .create_table_if_missing()
                .connect(&url)
                .await
                .unwrap_or_else(|e| failed(e));
            let outbox = Outbox::on(&store)
                .create_table_if_missing()
                .build()
                .await
                .unwrap_or_else(|e| failed(e));
            relay(outbox, publisher).await;
        }};
    }
    match scheme {
        "sqlite" => relay_on!(SqliteStore),
        "postgres" | "postgresql" => relay_on!(PostgresStore),
        "mysql" | "mariadb" => relay_on!(MySqlStore),
        other => exit_with(&format!(
            "DATABASE_URL: unknown scheme {other:?}: use sqlite://, postgres:// or mysql://"
        )),
    }
}

fn failed(error: tower_idempotency::store::StoreError) -> ! {
    exit_with(&format!("DATABASE_URL: {error}"))
}

/// Relays until SIGTERM.
async fn relay(outbox: impl OutboxTable, publisher: Announced) {
    let relay = OutboxRelay::new(outbox, publisher)
        .batch(number("RELAY_BATCH", 256) as u32)
        .poll_interval(Duration::from_millis(number("RELAY_POLL_MS", 1000)))
        .claim_for(Duration::from_millis(number("RELAY_CLAIM_MS", 3_000)));
    let mut term = signal(SignalKind::terminate())
        .unwrap_or_else(|e| exit_with(&format!("listening for SIGTERM: {e}")));
    println!("relaying {}", env::var("OUTBOX_BROKER").unwrap_or_default());
    relay
        .run(async move {
            term.recv().await;
        })
        .await;
}

/// The broker, and a line on stdout for each message it took.
struct Announced {
    broker: Broker,
    pause: Duration,
}

impl Publisher for Announced {
    async fn publish(&self, message: &OutboxMessage) -> Result<(), PublishError> {
        let published = match &self.broker {
            Broker::Sqs(sqs) => sqs.publish(message).await,
            Broker::Nats(nats) => nats.publish(message).await,
            Broker::Rabbit(rabbit) => rabbit.publish(message).await,
            Broker::Kafka(kafka) => kafka.publish(message).await,
        };
        match published {
            Ok(()) => {
                println!("published {} {}", message.id, message.destination);
                tokio::time::sleep(self.pause).await;
                Ok(())
            }
            Err(PublishError::Refused(why)) => {
                println!("refused {} {why}", message.id);
                Err(PublishError::Refused(why))
            }
            Err(error) => Err(error),
        }
    }
}

enum Broker {
    Sqs(SqsPublisher),
    Nats(JetStreamPublisher),
    Rabbit(RabbitMqPublisher),
    Kafka(KafkaPublisher),
}

fn number(name: &str, default: u64) -> u64 {
    match env::var(name) {
        Ok(value) => value.parse().unwrap_or_else(|_| {
            exit_with(&format!("{name} must be a whole number, got {value:?}"))
        }),
        Err(_) => default,
    }
}

/// A configuration mistake: say what to fix and stop.
fn exit_with(message: &str) -> ! {
    eprintln!("outbox_relay: {message}");
    std::process::exit(2)
}
