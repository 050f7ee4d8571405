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
//! `sqlite://PATH`, the file created if missing, or `postgres://…`, an
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
//! `in-flight <order_id>` (requeued), `rejected <order_id>` (same order id,
//! other payload), `refused <order_id>` (the database refused the order's
//! data), `invalid <delivery tag>` (not such JSON, or an order id that is
//! not a valid key). Rejected, refused and invalid messages are rejected
//! without requeue (dead-lettered where the queue has a dead-letter
//! exchange): one bad message never holds up the orders behind it. Store
//! outages requeue the message after a pause.
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
    IdempotencyKey, PostgresStore, PostgresTxStore, SqliteStore, SqliteTxStore,
    message::{IdempotencyProcessor, ProcessError, ProcessOutcome},
    sqlx::{self, error::ErrorKind},
    store::Store,
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
                "DATABASE_URL is required, e.g. sqlite://orders.db or postgres://postgres@127.0.0.1:5432/orders"
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
    let url = settings.database_url.clone();
    if url.starts_with("sqlite:") {
        let store = SqliteStore::builder().transactional().connect(&url).await;
        consume(open(store).await, settings).await
    } else {
        let store = PostgresStore::builder().transactional().connect(&url).await;
        consume(open(store).await, settings).await
    }
}

/// The idempotency table and `order_charges`, created if missing.
async fn open<St: Ledger>(store: Result<St, tower_idempotency::store::StoreError>) -> St {
    let store = store.unwrap_or_else(|e| exit_with(&format!("DATABASE_URL: {e}")));
    St::create_tables(&store)
        .await
        .unwrap_or_else(|e| exit_with(&format!("creating the tables: {e}")));
    store
}

/// A transactional store the orders are charged in.
trait Ledger: Store {
    fn create_tables(&self) -> impl Future<Output = Result<(), Box<dyn std::error::Error>>>;
    /// Inserts the order's charge in the claim's transaction.
    fn charge(
        tx: &mut Self::Granted,
        order: &Order,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;
}

impl Ledger for PostgresTxStore {
    async fn create_tables(&self) -> Result<(), Box<dyn std::error::Error>> {
        self.migrate().await?;
        sqlx::raw_sql(
            "CREATE TABLE IF NOT EXISTS order_charges (
                order_id text NOT NULL, amount bigint NOT NULL, currency text NOT NULL,
                charged_at timestamptz NOT NULL DEFAULT now())",
        )
        .execute(self.pool())
        .await?;
        Ok(())
    }

    async fn charge(tx: &mut Self::Granted, order: &Order) -> Result<(), sqlx::Error> {
        sqlx::query("INSERT INTO order_charges (order_id, amount, currency) VALUES ($1, $2, $3)")
            .bind(&order.order_id)
            .bind(order.amount)
            .bind(&order.currency)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }
}

impl Ledger for SqliteTxStore {
    async fn create_tables(&self) -> Result<(), Box<dyn std::error::Error>> {
        self.migrate().await?;
        sqlx::raw_sql(
            "CREATE TABLE IF NOT EXISTS order_charges (
                order_id TEXT NOT NULL, amount INTEGER NOT NULL, currency TEXT NOT NULL,
                charged_at TEXT NOT NULL DEFAULT CURRENT_TIMESTAMP)",
        )
        .execute(self.pool())
        .await?;
        Ok(())
    }

    async fn charge(tx: &mut Self::Granted, order: &Order) -> Result<(), sqlx::Error> {
        sqlx::query("INSERT INTO order_charges (order_id, amount, currency) VALUES (?1, ?2, ?3)")
            .bind(&order.order_id)
            .bind(order.amount)
            .bind(&order.currency)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }
}

/// Consumes the queue until the broker ends it.
async fn consume<St: Ledger>(store: St, settings: Settings) -> ! {
    let orders = IdempotencyProcessor::new(store)
        .scope("orders_consumer")
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
    // The broker cancelled the consumer: a supervisor must see a failure.
    exit_with(&format!(
        "the broker ended the consumer of {} (queue deleted or consumer cancelled)",
        settings.queue
    ))
}

/// What to tell the broker about a delivery.
enum Answer {
    Ack,
    /// Put it back after a pause: a later delivery may succeed.
    Requeue(Duration),
    /// Never requeue: no delivery of this message can succeed.
    Reject,
}

/// Processes one delivery and answers the broker: ack, requeue or reject.
async fn handle<St: Ledger>(
    orders: &IdempotencyProcessor<St>,
    settings: &Settings,
    delivery: Delivery,
) -> Result<(), lapin::Error> {
    // What can be checked up front is: a message that fails it can never
    // succeed, so it is rejected, not requeued.
    let order = match parse(&delivery.data) {
        Ok(order) => order,
        Err(why) => {
            tracing::warn!(tag = delivery.delivery_tag, %why, "invalid order message");
            say(&format!("invalid {}", delivery.delivery_tag));
            return answer(&delivery, Answer::Reject).await;
        }
    };
    let work_delay = settings.work_delay;
    let id = order.order_id.clone();
    let processed = orders
        .process(&id, &delivery.data, async move |tx: &mut St::Granted| {
            St::charge(tx, &order).await?;
            // The payment processor, before the commit.
            tokio::time::sleep(work_delay).await;
            Ok::<_, sqlx::Error>(format!("charged {} {}", order.amount, order.currency))
        })
        .await;
    let (line, then) = match processed {
        // Committed: a crash from here to the ack is a redelivery that finds
        // the record.
        Ok(ProcessOutcome::Executed(_)) => {
            tokio::time::sleep(settings.ack_delay).await;
            ("executed", Answer::Ack)
        }
        Ok(ProcessOutcome::Duplicate(_) | ProcessOutcome::DuplicateUnreadable { .. }) => {
            ("duplicate", Answer::Ack)
        }
        // Another consumer runs it now: put it back, after a pause so the
        // requeued message does not spin.
        Ok(ProcessOutcome::InFlight { retry_after }) => (
            "in-flight",
            Answer::Requeue(retry_after.clamp(Duration::from_millis(100), Duration::from_secs(1))),
        ),
        Ok(ProcessOutcome::Mismatch) => ("rejected", Answer::Reject),
        Err(ProcessError::Work(error)) if refuses_the_data(&error) => {
            tracing::warn!(order = %id, %error, "the database refused the order; rejected");
            ("refused", Answer::Reject)
        }
        Err(
            error @ (ProcessError::Panicked
            | ProcessError::Refused(_)
            | ProcessError::InvalidKey(_)),
        ) => {
            tracing::warn!(order = %id, %error, "the order cannot be processed; rejected");
            ("refused", Answer::Reject)
        }
        Err(
            error @ (ProcessError::Work(_)
            | ProcessError::Unavailable(_)
            | ProcessError::NotCommitted(_)),
        ) => {
            // Nothing took effect (or the redelivery finds the record): try
            // again later.
            tracing::warn!(order = %id, %error, "order not processed; requeued");
            answer(&delivery, Answer::Requeue(Duration::from_millis(500))).await?;
            return Ok(());
        }
    };
    answer(&delivery, then).await?;
    say(&format!("{line} {id}"));
    Ok(())
}

/// An order as the work needs it: JSON of the right shape, a positive
/// amount, and an order id that is a valid idempotency key.
fn parse(data: &[u8]) -> Result<Order, String> {
    let order: Order = serde_json::from_slice(data).map_err(|e| e.to_string())?;
    if order.amount <= 0 {
        return Err("amount must be positive".into());
    }
    IdempotencyKey::new(&order.order_id).map_err(|e| format!("order_id: {e}"))?;
    Ok(order)
}

/// Whether the database refused the order's data itself, which no
/// redelivery changes: a constraint it breaks, or (PostgreSQL's SQLSTATE
/// class 22) data it cannot store, such as a NUL byte in text. Anything else
/// — a lost connection, a deadlock, a serialization failure — may pass next
/// time.
fn refuses_the_data(error: &sqlx::Error) -> bool {
    let Some(error) = error.as_database_error() else {
        return false;
    };
    let data_exception = error
        .code()
        .is_some_and(|code| code.len() == 5 && code.starts_with("22"));
    data_exception || !matches!(error.kind(), ErrorKind::Other)
}

async fn answer(delivery: &Delivery, answer: Answer) -> Result<(), lapin::Error> {
    // Each returns whether the delivery was still unsettled, which it is.
    let _ = match answer {
        Answer::Ack => delivery.ack(BasicAckOptions::default()).await,
        Answer::Requeue(after) => {
            tokio::time::sleep(after).await;
            let requeue = BasicNackOptions {
                requeue: true,
                multiple: false,
            };
            delivery.nack(requeue).await
        }
        Answer::Reject => delivery.reject(BasicRejectOptions { requeue: false }).await,
    }?;
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
