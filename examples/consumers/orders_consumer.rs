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
//! `IDEMPOTENCY_LEASE_MS` (default 30000); `STARTUP_RETRY_S` (default 60:
//! how long a database out of reach at start-up is connected to again,
//! with back-off, before exit 2); `IDEMPOTENCY_TX_TIMEOUT_MS`
//! (default 30000: the bound on the work's transaction); `QUEUE_TYPE`
//! (`classic` or `quorum`: how missing queues are declared; an existing
//! queue is used as it is, whatever its type); `DELIVERY_LIMIT` (a quorum
//! queue's delivery limit where a policy or the broker's default sets it —
//! one the queue carries as `x-delivery-limit` is learnt, and a quorum
//! queue whose limit is neither is refused at start-up: its last delivery,
//! undecided, is dead-lettered as `undecided <order_id>` rather than
//! dropped).
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
//! The loop is the library's (`message::Consumer`, over the
//! `tower-idempotency-rabbitmq` adapter), up to 10 deliveries in hand
//! (`basic.qos` 10); deliveries with one `ordering-key` header (the outbox
//! relay writes the account) are charged one after the other.
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

use lapin::{Connection, ConnectionProperties};
use tower_idempotency_rabbitmq::RabbitMq;

#[path = "orders/mod.rs"]
mod orders;

use orders::{Example, Settings, exit_with};

#[tokio::main]
async fn main() {
    orders::init_tracing("orders_consumer");
    let settings = Settings::from_env().unwrap_or_else(|why| exit_with(&why));
    let amqp_url = std::env::var("AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let queue = std::env::var("QUEUE").unwrap_or_else(|_| "orders".into());
    let dead_letters =
        std::env::var("DEAD_LETTER_QUEUE").unwrap_or_else(|_| format!("{queue}.dead"));
    let connection = Connection::connect(&amqp_url, ConnectionProperties::default())
        .await
        .unwrap_or_else(|e| exit_with(&format!("AMQP_URL: {e}")));
    let mut broker = RabbitMq::builder(&connection, queue.clone(), dead_letters)
        .consumer_tag("orders_consumer")
        .ordered_by_header("ordering-key");
    if let Ok(queue_type) = std::env::var("QUEUE_TYPE") {
        broker = broker.queue_type(queue_type);
    }
    if let Ok(limit) = std::env::var("DELIVERY_LIMIT") {
        let limit = limit
            .parse()
            .unwrap_or_else(|_| exit_with("DELIVERY_LIMIT must be a whole number"));
        broker = broker.delivery_limit(limit);
    }
    let broker = broker
        .build()
        .await
        .unwrap_or_else(|e| exit_with(&e.to_string()));
    let example = Example {
        broker,
        scope: "orders_consumer",
        budget: RabbitMq::budget(),
        invalid: |delivery| delivery.delivery().delivery_tag.to_string(),
        ready: format!("consuming {queue}"),
    };
    orders::consume(example, settings).await;
    // Every delivery is answered and the channels closed: the connection's
    // close is a courtesy, bounded so that a stop never hangs on it (what a
    // connection still held would go back to the queue with it anyway).
    let closed = connection.close(200, "SIGTERM".into());
    if tokio::time::timeout(std::time::Duration::from_secs(5), closed)
        .await
        .is_err()
    {
        eprintln!("orders_consumer: the broker did not answer the connection's close in 5 s");
    }
    eprintln!("orders_consumer: SIGTERM: stopped consuming, the delivery in hand done");
}
