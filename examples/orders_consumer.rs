//! An orders consumer on RabbitMQ that charges each order exactly once,
//! however often the broker delivers it.
//!
//! Run with:
//!
//! ```not_rust
//! DATABASE_URL=sqlite://orders.db cargo run --release --all-features --example orders_consumer
//! ```
//!
//! Environment: `AMQP_URL` (default `amqp://guest:guest@127.0.0.1:5672/%2f`);
//! `QUEUE` (default `orders`, declared durable); `DATABASE_URL` (required:
//! `sqlite://PATH`, the file created if missing, `postgres://…` or
//! `mysql://…`, an existing database; the tables are created if missing); `WORK_DELAY_MS`
//! (default 0: how long the work takes after inserting its row, before its
//! commit — the payment processor); `ACK_DELAY_MS` (default 0: a pause
//! between the commit and the acknowledgement, to widen that crash window);
//! `IDEMPOTENCY_LEASE_MS` (default 30000); `IDEMPOTENCY_TX_TIMEOUT_MS`
//! (default 30000: the bound on the work's transaction).
//!
//! A message is JSON `{"order_id": string, "amount": integer > 0, "currency":
//! string}`; the order id is the business key. Each execution inserts one row
//! into `order_charges` (no unique constraint: a double execution would show
//! as two rows), in the same transaction as the idempotency record. One line
//! per delivery on stdout: `executed <order_id>`, `duplicate <order_id>`,
//! `in-flight <order_id>` (requeued), `rejected <order_id>` (same order id,
//! other payload), `refused <order_id>` (the database refused the order's
//! data), `invalid <delivery tag>` (not such JSON, or an order id that is
//! not a valid key). Rejected, refused and invalid messages are rejected
//! without requeue (dead-lettered where the queue has a dead-letter
//! exchange): one bad message never holds up the orders behind it. Store
//! outages requeue the message after a back-off.
//!
//! Long work: RabbitMQ cannot extend a delivery (its `consumer_timeout`,
//! 30 minutes by default, closes the channel of a consumer that holds one
//! unacknowledged longer, and the message is redelivered). The work's
//! transaction is bounded instead (`IDEMPOTENCY_TX_TIMEOUT_MS`, keep it well
//! under `consumer_timeout`): work that outlives it is rolled back and
//! requeued, and after three deliveries it is rejected (`rejected
//! <order_id>`), with a log line naming the bound to raise. The count of
//! deliveries is this process's own (classic queues do not count them):
//! a restart starts it again.
//!
//! The process exits with status 2 and a message when the broker ends the
//! consumer (the queue deleted, a connection forced closed), so a
//! supervisor restarts it.
//!
//! Try it (with `rabbitmqadmin`, or any AMQP client):
//!
//! ```not_rust
//! rabbitmqadmin publish routing_key=orders payload='{"order_id":"order-42","amount":1999,"currency":"eur"}'
//! rabbitmqadmin publish routing_key=orders payload='{"order_id":"order-42","amount":1999,"currency":"eur"}'
//! # stdout: executed order-42, then duplicate order-42
//! sqlite3 orders.db 'SELECT * FROM order_charges'   # one row
//! ```

use std::{collections::HashMap, time::Duration};

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
use tower_idempotency::message::{Disposition, IdempotencyProcessor};

#[path = "orders/mod.rs"]
mod orders;

use orders::{Ledger, Settings, exit_with, say};

#[tokio::main]
async fn main() {
    orders::init_tracing("orders_consumer");
    let settings = Settings::from_env().unwrap_or_else(|why| exit_with(&why));
    let amqp_url = std::env::var("AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let queue = std::env::var("QUEUE").unwrap_or_else(|_| "orders".into());
    orders::run(Rabbit { amqp_url, queue }, "orders_consumer", settings).await
}

struct Rabbit {
    amqp_url: String,
    queue: String,
}

impl orders::Consumer for Rabbit {
    /// Consumes the queue until the broker ends it.
    async fn run<St: Ledger>(self, orders: IdempotencyProcessor<St>, settings: Settings) {
        let connection = Connection::connect(&self.amqp_url, ConnectionProperties::default())
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
                self.queue.as_str().into(),
                QueueDeclareOptions::durable(),
                FieldTable::default(),
            )
            .await
            .unwrap_or_else(|e| exit_with(&format!("declaring queue {}: {e}", self.queue)));
        let mut deliveries = channel
            .basic_consume(
                self.queue.as_str().into(),
                "orders_consumer".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap_or_else(|e| exit_with(&format!("consuming {}: {e}", self.queue)));
        println!("consuming {}", self.queue);

        // Deliveries of each message not yet settled for good, by body.
        let mut seen: HashMap<Vec<u8>, u32> = HashMap::new();
        while let Some(delivery) = deliveries.next().await {
            match delivery {
                Ok(delivery) => {
                    if let Err(e) = handle(&orders, &settings, &mut seen, delivery).await {
                        tracing::error!(error = %e, "the broker failed an acknowledgement");
                    }
                }
                Err(e) => exit_with(&format!("the broker connection failed: {e}")),
            }
        }
        // The broker cancelled the consumer: a supervisor must see a failure.
        exit_with(&format!(
            "the broker ended the consumer of {} (queue deleted or consumer cancelled)",
            self.queue
        ))
    }
}

/// Processes one delivery and answers the broker: ack, requeue or reject.
async fn handle<St: Ledger>(
    orders: &IdempotencyProcessor<St>,
    settings: &Settings,
    seen: &mut HashMap<Vec<u8>, u32>,
    delivery: Delivery,
) -> Result<(), lapin::Error> {
    let count = seen.entry(delivery.data.clone()).or_default();
    *count += 1;
    // RabbitMQ cannot extend a delivery: no hold to keep.
    let hold = tower_idempotency::message::extend_every(Duration::MAX, || async { Ok(()) });
    let handled = orders::handle(orders, settings, &delivery.data, *count, &hold).await;
    if !matches!(handled.disposition, Disposition::Retry { .. }) {
        seen.remove(&delivery.data);
    }
    // Each returns whether the delivery was still unsettled, which it is.
    let _ = match handled.disposition {
        Disposition::Ack => delivery.ack(BasicAckOptions::default()).await,
        Disposition::Retry { after } => {
            tokio::time::sleep(after).await;
            let requeue = BasicNackOptions {
                requeue: true,
                multiple: false,
            };
            delivery.nack(requeue).await
        }
        Disposition::DeadLetter => delivery.reject(BasicRejectOptions { requeue: false }).await,
    }?;
    if handled.invalid {
        say(&format!("invalid {}", delivery.delivery_tag));
    } else if let Some(line) = handled.line {
        say(&line);
    }
    Ok(())
}
