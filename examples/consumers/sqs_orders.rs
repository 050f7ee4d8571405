//! An orders consumer on Amazon SQS that charges each order exactly once,
//! however often the queue delivers it.
//!
//! Run with (against AWS, or any server speaking the SQS protocol through
//! `AWS_ENDPOINT_URL`, such as `moto_server`):
//!
//! ```not_rust
//! SQS_QUEUE_URL=https://sqs.eu-west-1.amazonaws.com/123456789012/orders \
//! DATABASE_URL=sqlite://orders.db \
//! cargo run --release --example sqs_orders
//! ```
//!
//! Environment: `SQS_QUEUE_URL` (required; a standard or a FIFO queue); the
//! SDK's own `AWS_ENDPOINT_URL`, `AWS_REGION`, `AWS_ACCESS_KEY_ID`,
//! `AWS_SECRET_ACCESS_KEY` (or any other source of credentials the SDK
//! reads); `DATABASE_URL` (required: `sqlite://PATH`, `postgres://…` or `mysql://…`; the
//! tables are created if missing); `WORK_DELAY_MS` (default 0: how long the
//! work takes inside its transaction); `ACK_DELAY_MS` (default 0: a pause
//! between the commit and the delete); `IDEMPOTENCY_LEASE_MS` (default
//! 30000); `IDEMPOTENCY_TX_TIMEOUT_MS` (default 30000: the bound on the
//! work's transaction); `STARTUP_RETRY_S` (default 60: how long a database
//! out of reach at start-up is connected to again before exit 2).
//!
//! A message body is JSON `{"order_id", "amount", "currency"}`; the order id
//! is the business key — never the SQS message id, which is new on every
//! send. Each execution inserts one row into `order_charges`, in the same
//! transaction as the idempotency record.
//!
//! The loop is the library's (`message::Consumer`, over the
//! `tower-idempotency-sqs` adapter): it receives batches of up to 10 with
//! long polling, up to 10 messages in hand at a time (on a FIFO queue,
//! each message group's in order, one after the other). From the moment a
//! message is in hand its visibility timeout is extended every third of it
//! (`ChangeMessageVisibility`), so a job longer than the timeout is never
//! handed to a second consumer mid-work. Then:
//!
//! - executed or a duplicate: deleted (`DeleteMessage`);
//! - in flight elsewhere, the database unavailable or busy: kept in hand
//!   and tried again after a back-off, its visibility extended all the
//!   while — never received again, so the queue's `maxReceiveCount` is not
//!   spent on an outage;
//! - never able to succeed (not a valid order: `invalid <message id>`; the
//!   same order id with another payload, or work that outlived its
//!   transaction on three attempts: `rejected <order_id>`; data the
//!   database refuses: `refused <order_id>`): sent at once to the
//!   dead-letter queue the queue's `RedrivePolicy` names, with the reason
//!   as the `DeadLetterReason` message attribute, and deleted. A queue
//!   without a `RedrivePolicy` keeps it: it is left invisible for 12 hours
//!   and logged as an error each time it comes back — never deleted;
//! - still undecided on its last receive (`maxReceiveCount`, reached only
//!   through crashes and shutdowns) when it must be given back:
//!   dead-lettered as `undecided <order_id>`, so that SQS never moves it
//!   without a reason.
//!
//! One line per message on stdout: `receiving from <queue url>` first, then
//! `executed|duplicate|rejected|refused|undecided <order_id>` or `invalid
//! <message id>`. It exits with status 2, naming the queue, when the queue
//! no longer exists; on SIGTERM it stops receiving (a receive in flight is
//! awaited, at most 20 s, and what it brings is handed back at once),
//! finishes the work in hand and deletes it, hands back at once whatever is
//! waiting between attempts, and exits 0.

use tower_idempotency_sqs::{Sqs, aws_sdk_sqs::Client};

#[path = "orders/mod.rs"]
mod orders;

use orders::{Example, Settings, exit_with};

#[tokio::main]
async fn main() {
    orders::init_tracing("sqs_orders");
    let settings = Settings::from_env().unwrap_or_else(|why| exit_with(&why));
    let url = std::env::var("SQS_QUEUE_URL").unwrap_or_else(|_| {
        exit_with("SQS_QUEUE_URL is required, e.g. https://sqs.eu-west-1.amazonaws.com/123456789012/orders")
    });
    let config = aws_config::load_from_env().await;
    let broker = Sqs::builder(Client::new(&config), url.clone())
        .build()
        .await
        .unwrap_or_else(|e| exit_with(&e.to_string()));
    let example = Example {
        broker,
        scope: "sqs_orders",
        budget: Sqs::budget(),
        invalid: |message| message.message().message_id().unwrap_or("?").to_owned(),
        ready: format!("receiving from {url}"),
    };
    orders::consume(example, settings).await;
    eprintln!("sqs_orders: SIGTERM: stopped receiving, the messages in hand done");
}
