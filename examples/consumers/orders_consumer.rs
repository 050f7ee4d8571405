//! An orders consumer on RabbitMQ that charges each order exactly once,
//! however often the broker delivers it.
//!
//! Run with:
//!
//! ```not_rust
//! DATABASE_URL=sqlite://orders.db cargo run --release --example orders_consumer
//! ```
//!
//! Environment: `AMQP_URL` (default `amqp://guest:guest@127.0.0.1:5672/%2f`);
//! `QUEUE` (default `orders`, declared durable); `DEAD_LETTER_QUEUE`
//! (default `<QUEUE>.dead`, declared durable); `DATABASE_URL` (required:
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
//! `rejected <order_id>` (same order id, other payload, or work that
//! outlived its transaction on three attempts), `refused <order_id>` (the
//! database refused the order's data), `invalid <delivery tag>` (not such
//! JSON, or an order id that is not a valid key).
//!
//! Rejected, refused and invalid messages are published to the dead-letter
//! queue (with publisher confirms, the reason in the `x-dead-letter-reason`
//! header), then acknowledged: one bad message never holds up the orders
//! behind it, and none is dropped. A store outage, a busy database or a
//! duplicate in flight elsewhere keep the delivery in hand, tried again
//! after a back-off — never requeued, so a quorum queue's `delivery-limit`
//! is not spent on them.
//!
//! Long work: RabbitMQ cannot extend a delivery (its `consumer_timeout`,
//! 30 minutes by default, closes the channel of a consumer that holds one
//! unacknowledged longer, and the message is redelivered). The work's
//! transaction is bounded instead (`IDEMPOTENCY_TX_TIMEOUT_MS`, keep it well
//! under `consumer_timeout`), and a delivery kept in hand through an outage
//! is requeued after 25 minutes. Work that outlives its transaction is
//! rolled back and tried again, and after three attempts it is
//! dead-lettered (`rejected <order_id>`), with a log line naming the bound
//! to raise.
//!
//! The process exits with status 2 and a message when the broker ends the
//! consumer (the queue deleted, a connection forced closed), so a
//! supervisor restarts it; on SIGTERM it finishes the delivery in hand,
//! requeues it at once if it waits between attempts, and exits 0.
//!
//! Try it (with `rabbitmqadmin`, or any AMQP client):
//!
//! ```not_rust
//! rabbitmqadmin publish routing_key=orders payload='{"order_id":"order-42","amount":1999,"currency":"eur"}'
//! rabbitmqadmin publish routing_key=orders payload='{"order_id":"order-42","amount":1999,"currency":"eur"}'
//! # stdout: executed order-42, then duplicate order-42
//! sqlite3 orders.db 'SELECT * FROM order_charges'   # one row
//! ```

use std::time::Duration;

use futures_util::StreamExt;
use lapin::{
    BasicProperties, Channel, Connection, ConnectionProperties,
    message::Delivery,
    options::{
        BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicPublishOptions,
        BasicQosOptions, ConfirmSelectOptions, QueueDeclareOptions,
    },
    types::{AMQPValue, FieldTable, LongString, ShortString},
};
use tokio::signal::unix::{SignalKind, signal};
use tower_idempotency::message::{
    DeadLetterReason, DeliveryBudget, Disposition, IdempotencyProcessor, NoHold,
};

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
    let dead_letters =
        std::env::var("DEAD_LETTER_QUEUE").unwrap_or_else(|_| format!("{queue}.dead"));
    let rabbit = Rabbit {
        amqp_url,
        queue,
        dead_letters,
    };
    orders::run(rabbit, "orders_consumer", settings).await
}

struct Rabbit {
    amqp_url: String,
    queue: String,
    dead_letters: String,
}

impl orders::Consumer for Rabbit {
    /// Given back well before `consumer_timeout` (30 minutes by default)
    /// would close the channel.
    fn budget(&self) -> DeliveryBudget {
        DeliveryBudget::new().give_back_after(Duration::from_secs(25 * 60))
    }

    /// Consumes the queue until the broker ends it, or SIGTERM.
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
        for queue in [&self.queue, &self.dead_letters] {
            channel
                .queue_declare(
                    queue.as_str().into(),
                    QueueDeclareOptions::durable(),
                    FieldTable::default(),
                )
                .await
                .unwrap_or_else(|e| exit_with(&format!("declaring queue {queue}: {e}")));
        }
        // Dead letters are published with confirms, on a channel of their own.
        let dead_letters = connection
            .create_channel()
            .await
            .unwrap_or_else(|e| exit_with(&format!("opening a channel: {e}")));
        dead_letters
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap_or_else(|e| exit_with(&format!("confirm_select: {e}")));
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

        let mut term = signal(SignalKind::terminate())
            .unwrap_or_else(|e| exit_with(&format!("listening for SIGTERM: {e}")));
        tokio::spawn({
            let orders = orders.clone();
            async move {
                term.recv().await;
                orders.drain();
            }
        });
        let mut draining = std::pin::pin!(async {
            while !orders.is_draining() {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        });
        loop {
            let delivery = tokio::select! {
                delivery = deliveries.next() => delivery,
                () = &mut draining => break,
            };
            match delivery {
                Some(Ok(delivery)) => {
                    let handled = handle(&orders, &settings, &dead_letters, &self, delivery).await;
                    if let Err(e) = handled {
                        tracing::error!(error = %e, "the broker failed an acknowledgement");
                    }
                }
                Some(Err(e)) => exit_with(&format!("the broker connection failed: {e}")),
                // The broker cancelled the consumer: a supervisor must see a failure.
                None => exit_with(&format!(
                    "the broker ended the consumer of {} (queue deleted or consumer cancelled)",
                    self.queue
                )),
            }
        }
        // Unacknowledged deliveries go back to the queue with the channel.
        let _ = channel.close(200, "SIGTERM".into()).await;
        eprintln!("orders_consumer: SIGTERM: stopped consuming, the delivery in hand done");
    }
}

/// Settles one delivery and answers the broker: ack, requeue, or dead-letter
/// then ack.
async fn handle<St: Ledger>(
    orders: &IdempotencyProcessor<St>,
    settings: &Settings,
    dead_letters: &Channel,
    rabbit: &Rabbit,
    delivery: Delivery,
) -> Result<(), lapin::Error> {
    // RabbitMQ cannot extend a delivery: no hold to keep. Classic queues
    // have no delivery limit; nothing here spends a quorum queue's.
    let origin = orders::Origin {
        system: "rabbitmq",
        destination: &rabbit.queue,
        message_id: delivery
            .properties
            .message_id()
            .as_ref()
            .map(|id| id.as_str()),
    };
    let handled = orders::handle(orders, settings, &origin, &delivery.data, &NoHold, false).await;
    match &handled.disposition {
        Disposition::Ack => {
            delivery.ack(BasicAckOptions::default()).await?;
        }
        Disposition::Retry { after } => {
            tokio::time::sleep(*after).await;
            let requeue = BasicNackOptions {
                requeue: true,
                multiple: false,
            };
            delivery.nack(requeue).await?;
        }
        Disposition::DeadLetter(reason) => {
            match dead_letter(dead_letters, &rabbit.dead_letters, &delivery, reason).await {
                Ok(()) => {
                    delivery.ack(BasicAckOptions::default()).await?;
                }
                Err(error) => {
                    // Not acknowledged: it comes back and is moved then.
                    tracing::error!(%error, queue = %rabbit.dead_letters, "the dead-letter publish failed; requeued");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    let requeue = BasicNackOptions {
                        requeue: true,
                        multiple: false,
                    };
                    delivery.nack(requeue).await?;
                }
            }
        }
    }
    if handled.invalid {
        say(&format!("invalid {}", delivery.delivery_tag));
    } else if let Some(line) = handled.line {
        say(&line);
    }
    Ok(())
}

/// Publishes the message to the dead-letter queue, persistent, with its
/// reason, and waits for the broker's confirm.
async fn dead_letter(
    channel: &Channel,
    queue: &str,
    delivery: &Delivery,
    reason: &DeadLetterReason,
) -> Result<(), String> {
    let mut headers = FieldTable::default();
    let text = |s: String| AMQPValue::LongString(LongString::from(s));
    headers.insert(
        ShortString::from("x-dead-letter-reason"),
        text(reason.to_string()),
    );
    headers.insert(
        ShortString::from("x-dead-letter-kind"),
        text(reason.kind().to_owned()),
    );
    let properties = BasicProperties::default()
        .with_delivery_mode(2)
        .with_headers(headers);
    let confirm = channel
        .basic_publish(
            "".into(),
            queue.into(),
            BasicPublishOptions::default(),
            &delivery.data,
            properties,
        )
        .await
        .map_err(|e| e.to_string())?
        .await
        .map_err(|e| e.to_string())?;
    if confirm.is_ack() {
        Ok(())
    } else {
        Err("the broker refused the dead letter".into())
    }
}
