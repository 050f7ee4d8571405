//! An orders consumer on RabbitMQ that charges each order exactly once,
//! however often the broker delivers it.
//!
//! Run with:
//!
//! ```not_rust
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/orders cargo run --release --all-features --example orders_consumer
//! ```
//!
//! Environment: `AMQP_URL` (default `amqp://guest:guest@127.0.0.1:5672/%2f`);
//! `QUEUE` (default `orders`, declared durable); `DATABASE_URL` (required: an
//! existing database; the tables are created if missing); `WORK_DELAY_MS`
//! (default 0: how long the work takes after inserting its row, before its
//! commit — the payment processor); `ACK_DELAY_MS` (default 0: a pause
//! between the commit and the acknowledgement, to widen that crash window);
//! `IDEMPOTENCY_LEASE_MS` (default 30000).
//!
//! A message is JSON `{"order_id": string, "amount": integer > 0, "currency":
//! string}`; the order id is the business key. Each execution inserts one row
//! into `order_charges` (no unique constraint: a double execution would show
//! as two rows), in the same transaction as the idempotency record. One line
//! per delivery on stdout: `executed <order_id>`, `duplicate <order_id>`,
//! `in-flight <order_id>`, `rejected <order_id>` (same order id, other
//! payload), `invalid <delivery tag>` (not such JSON).
//!
//! Try it (with `rabbitmqadmin`, or any AMQP client):
//!
//! ```not_rust
//! rabbitmqadmin publish routing_key=orders payload='{"order_id":"order-42","amount":1999,"currency":"eur"}'
//! rabbitmqadmin publish routing_key=orders payload='{"order_id":"order-42","amount":1999,"currency":"eur"}'
//! # stdout: executed order-42, then duplicate order-42
//! psql "$DATABASE_URL" -c 'SELECT * FROM order_charges'   # one row
//! ```

use std::{env, io::Write, time::Duration};

use futures_util::StreamExt;
use lapin::{
    Connection, ConnectionProperties,
    message::Delivery,
    options::{
        BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions,
        BasicRejectOptions, QueueDeclareOptions,
    },
    types::FieldTable,
};
use serde::{Deserialize, Serialize};
use tower_idempotency::{
    PostgresStore,
    message::{Idempotent, Processed},
    sqlx,
};

#[derive(Deserialize, Serialize)]
struct Order {
    order_id: String,
    amount: i64,
    currency: String,
}

struct Settings {
    amqp_url: String,
    queue: String,
    database_url: String,
    work_delay: Duration,
    ack_delay: Duration,
    lease: Duration,
}

impl Settings {
    fn from_env() -> Result<Self, String> {
        let millis = |name: &str, default: u64| -> Result<Duration, String> {
            match env::var(name) {
                Err(_) => Ok(Duration::from_millis(default)),
                Ok(v) => v.parse().map(Duration::from_millis).map_err(|_| {
                    format!("{name} must be a whole number of milliseconds, got {v:?}")
                }),
            }
        };
        let lease = millis("IDEMPOTENCY_LEASE_MS", 30_000)?;
        if !(Duration::from_millis(30)..=tower_idempotency::MAX_LEASE).contains(&lease) {
            return Err("IDEMPOTENCY_LEASE_MS must be from 30 to 86400000".into());
        }
        Ok(Self {
            amqp_url: env::var("AMQP_URL")
                .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into()),
            queue: env::var("QUEUE").unwrap_or_else(|_| "orders".into()),
            database_url: env::var("DATABASE_URL").map_err(|_| {
                "DATABASE_URL is required, e.g. postgres://postgres@127.0.0.1:5432/orders"
                    .to_owned()
            })?,
            work_delay: millis("WORK_DELAY_MS", 0)?,
            ack_delay: millis("ACK_DELAY_MS", 0)?,
            lease,
        })
    }
}

#[tokio::main]
async fn main() {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "orders_consumer=info,tower_idempotency=info".into()),
        )
        .init();
    let settings = Settings::from_env().unwrap_or_else(|why| exit_with(&why));

    // The URLs may carry passwords: they are never logged.
    let store = PostgresStore::builder()
        .transactional()
        .connect(&settings.database_url)
        .await
        .unwrap_or_else(|e| exit_with(&format!("DATABASE_URL: {e}")));
    store
        .migrate()
        .await
        .unwrap_or_else(|e| exit_with(&format!("creating the idempotency table: {e}")));
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS order_charges (
            order_id text NOT NULL, amount bigint NOT NULL, currency text NOT NULL,
            charged_at timestamptz NOT NULL DEFAULT now())",
    )
    .execute(store.pool())
    .await
    .unwrap_or_else(|e| exit_with(&format!("creating order_charges: {e}")));
    let orders = Idempotent::new(store)
        .namespace("orders_consumer")
        .lease(settings.lease);

    let connection = Connection::connect(&settings.amqp_url, ConnectionProperties::default())
        .await
        .unwrap_or_else(|e| exit_with(&format!("AMQP_URL: {e}")));
    let channel = connection
        .create_channel()
        .await
        .unwrap_or_else(|e| exit_with(&format!("opening a channel: {e}")));
    // One unacknowledged delivery at a time.
    channel
        .basic_qos(1, BasicQosOptions::default())
        .await
        .unwrap_or_else(|e| exit_with(&format!("basic_qos: {e}")));
    channel
        .queue_declare(
            settings.queue.as_str().into(),
            QueueDeclareOptions::durable(),
            FieldTable::default(),
        )
        .await
        .unwrap_or_else(|e| exit_with(&format!("declaring queue {}: {e}", settings.queue)));
    let mut deliveries = channel
        .basic_consume(
            settings.queue.as_str().into(),
            "orders_consumer".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap_or_else(|e| exit_with(&format!("consuming {}: {e}", settings.queue)));
    println!("consuming {}", settings.queue);

    while let Some(delivery) = deliveries.next().await {
        match delivery {
            Ok(delivery) => {
                if let Err(e) = handle(&orders, &settings, delivery).await {
                    tracing::error!(error = %e, "the broker failed an acknowledgement");
                }
            }
            Err(e) => exit_with(&format!("the broker connection failed: {e}")),
        }
    }
}

/// Processes one delivery and answers the broker: ack, requeue or reject.
async fn handle(
    orders: &Idempotent<PostgresStore>,
    settings: &Settings,
    delivery: Delivery,
) -> Result<(), lapin::Error> {
    let Ok(order) = serde_json::from_slice::<Order>(&delivery.data)
        .map_err(|e| e.to_string())
        .and_then(|order| {
            (order.amount > 0)
                .then_some(order)
                .ok_or_else(|| "amount must be positive".into())
        })
        .inspect_err(
            |why| tracing::warn!(tag = delivery.delivery_tag, %why, "invalid order message"),
        )
    else {
        say(&format!("invalid {}", delivery.delivery_tag));
        delivery
            .reject(BasicRejectOptions { requeue: false })
            .await?;
        return Ok(());
    };
    let work_delay = settings.work_delay;
    let id = order.order_id.clone();
    let processed = orders
        .run(&id, &delivery.data, async move |claimed| {
            let mut tx = claimed.transaction().expect("the store is transactional");
            sqlx::query(
                "INSERT INTO order_charges (order_id, amount, currency) VALUES ($1, $2, $3)",
            )
            .bind(&order.order_id)
            .bind(order.amount)
            .bind(&order.currency)
            .execute(&mut *tx)
            .await?;
            // The payment processor, before the commit.
            tokio::time::sleep(work_delay).await;
            Ok::<_, sqlx::Error>(format!("charged {} {}", order.amount, order.currency))
        })
        .await;
    match processed {
        Ok(Processed::Executed(_)) => {
            // Committed: a crash from here to the ack is a redelivery that
            // finds the record.
            tokio::time::sleep(settings.ack_delay).await;
            delivery.ack(BasicAckOptions::default()).await?;
            say(&format!("executed {id}"));
        }
        Ok(Processed::Duplicate(_)) => {
            delivery.ack(BasicAckOptions::default()).await?;
            say(&format!("duplicate {id}"));
        }
        Ok(Processed::InFlight { retry_after }) => {
            // Another consumer runs it now: put it back, after a pause so the
            // requeued message does not spin.
            tokio::time::sleep(
                retry_after.clamp(Duration::from_millis(100), Duration::from_secs(1)),
            )
            .await;
            delivery
                .nack(BasicNackOptions {
                    requeue: true,
                    multiple: false,
                })
                .await?;
            say(&format!("in-flight {id}"));
        }
        Ok(Processed::Mismatch) => {
            delivery
                .reject(BasicRejectOptions { requeue: false })
                .await?;
            say(&format!("rejected {id}"));
        }
        Ok(_) => unreachable!("no other outcome"),
        Err(error) => {
            // Nothing was recorded: try again later.
            tracing::warn!(order = %id, %error, "order not processed; requeued");
            tokio::time::sleep(Duration::from_millis(500)).await;
            delivery
                .nack(BasicNackOptions {
                    requeue: true,
                    multiple: false,
                })
                .await?;
        }
    }
    Ok(())
}

/// One line per delivery on stdout, flushed at once (tests read it).
fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

fn exit_with(message: &str) -> ! {
    eprintln!("orders_consumer: {message}");
    std::process::exit(2)
}
