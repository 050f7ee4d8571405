//! An orders consumer on NATS JetStream that charges each order exactly
//! once, however often the stream delivers it.
//!
//! Run with:
//!
//! ```not_rust
//! DATABASE_URL=sqlite://orders.db cargo run --release --example nats_orders
//! ```
//!
//! Environment: `NATS_URL` (default `nats://127.0.0.1:4222`); `STREAM`
//! (default `ORDERS`, created on `SUBJECT` if missing); `SUBJECT` (default
//! `orders`); `DURABLE` (default `orders_consumer`: a durable pull consumer
//! on `SUBJECT`, created if missing, with `AckWait` from `ACK_WAIT_MS`,
//! default 30000, and `MaxDeliver` from `MAX_DELIVER`, default -1:
//! unlimited); `DEAD_LETTER_SUBJECT` (none by default; `orders.dead`, say:
//! where what can never succeed is published before it is terminated — a
//! subject a stream captures, checked at start-up); `DATABASE_URL`
//! (required: `sqlite://PATH`, `postgres://…` or `mysql://…`; the tables are created if
//! missing); `WORK_DELAY_MS`, `ACK_DELAY_MS`, `IDEMPOTENCY_LEASE_MS`,
//! `IDEMPOTENCY_TX_TIMEOUT_MS`, `STARTUP_RETRY_S` as in `orders_consumer`.
//!
//! A message is JSON `{"order_id", "amount", "currency"}`; the order id is
//! the business key — never the `Nats-Msg-Id`, which a producer's retry may
//! change. Each execution inserts one row into `order_charges`, in the same
//! transaction as the idempotency record.
//!
//! The loop is the library's (`message::Consumer`, over the
//! `tower-idempotency-nats` adapter): up to 10 messages in hand at a time,
//! each held from the moment it is received — "in progress"
//! acknowledgements (`AckKind::Progress`) restart its `AckWait` every third
//! of it, so a job longer than `AckWait` is never redelivered mid-work, nor
//! one waiting its turn; messages with one `Ordering-Key` header (the
//! outbox relay writes the account) are charged one after the other, in
//! stream order. Then: executed or a duplicate: `Ack`; in flight
//! elsewhere, the database unavailable or busy: kept in hand and tried
//! again after a back-off — never `Nak`ed, so no delivery is spent on an
//! outage; never able to succeed (not a valid order: `invalid <stream
//! sequence>`; the same order id with another payload, or work that
//! outlived its transaction on three attempts: `rejected <order_id>`; data
//! the database refuses: `refused <order_id>`): published to
//! `DEAD_LETTER_SUBJECT` with its reason in the `Dead-Letter-Reason` header
//! (and a `Nats-Msg-Id` of its stream and sequence, so a repeat is dropped
//! by the dead-letter stream), then `Term`. Without a dead-letter subject it
//! is kept: `Nak`ed for an hour, logged as an error each time — never
//! terminated. A finite `MAX_DELIVER` needs a dead-letter subject (the
//! consumer refuses to start without one), and a message still undecided on
//! its last delivery — reached only through crashes and shutdowns — is
//! dead-lettered as `undecided <order_id>`, never left for JetStream to
//! drop.
//!
//! One line per message on stdout: `receiving from <STREAM>/<DURABLE>`
//! first, then `executed|duplicate|rejected|refused|undecided <order_id>` or
//! `invalid <stream sequence>`. It exits with status 2 when its consumer or
//! stream is deleted, or when `DEAD_LETTER_SUBJECT` is a subject no stream
//! captures; on SIGTERM it stops pulling, finishes and acknowledges the
//! work in hand, hands back at once (`Nak`) what waits between attempts,
//! and exits 0.
//!
//! JetStream's publish deduplication (`Nats-Msg-Id`, within the stream's
//! duplicate window, 2 minutes by default) drops a producer's resend only if
//! it carries the same id; a resend with a new id is delivered twice — and
//! charged once, by the idempotency record.

use std::time::Duration;

use tower_idempotency::message::DeliveryBudget;
use tower_idempotency_nats::{
    JetStream,
    async_nats::jetstream::{
        self,
        consumer::{AckPolicy, pull},
        stream,
    },
};

#[path = "orders/mod.rs"]
mod orders;

use orders::{Example, Settings, exit_with, millis};

#[tokio::main]
async fn main() {
    orders::init_tracing("nats_orders");
    let settings = Settings::from_env().unwrap_or_else(|why| exit_with(&why));
    let var = |name: &str, default: &str| std::env::var(name).unwrap_or_else(|_| default.into());
    let (url, stream_name, subject, durable) = (
        var("NATS_URL", "nats://127.0.0.1:4222"),
        var("STREAM", "ORDERS"),
        var("SUBJECT", "orders"),
        var("DURABLE", "orders_consumer"),
    );
    let ack_wait = millis("ACK_WAIT_MS", 30_000).unwrap_or_else(|why| exit_with(&why));
    if ack_wait < Duration::from_millis(300) {
        exit_with("ACK_WAIT_MS must be at least 300");
    }
    let max_deliver: i64 = var("MAX_DELIVER", "-1")
        .parse()
        .unwrap_or_else(|_| exit_with("MAX_DELIVER must be a whole number (-1: unlimited)"));
    let dead_letters = std::env::var("DEAD_LETTER_SUBJECT").ok();
    if max_deliver > 0 && dead_letters.is_none() {
        // Before anything is created; the adapter checks again with what
        // the server holds.
        exit_with(&format!(
            "consumer {durable} has MaxDeliver {max_deliver}: set DEAD_LETTER_SUBJECT (a subject a stream captures), \
             or a message undecided on its last delivery would be dropped; or use MAX_DELIVER=-1"
        ));
    }
    let client = async_nats::connect(&url)
        .await
        .unwrap_or_else(|e| exit_with(&format!("NATS_URL: {e}")));
    let js = jetstream::new(client);
    let stream = js
        .get_or_create_stream(stream::Config {
            name: stream_name.clone(),
            subjects: vec![subject.clone()],
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| exit_with(&format!("stream {stream_name}: {e}")));
    let consumer = stream
        .get_or_create_consumer(
            &durable,
            pull::Config {
                durable_name: Some(durable.clone()),
                filter_subject: subject.clone(),
                ack_policy: AckPolicy::Explicit,
                ack_wait,
                max_deliver,
                ..Default::default()
            },
        )
        .await
        .unwrap_or_else(|e| exit_with(&format!("consumer {durable}: {e}")));
    let mut broker = JetStream::builder(js, consumer).ordered_by_header("Ordering-Key");
    if let Some(subject) = dead_letters {
        broker = broker.dead_letter_subject(subject);
    }
    // Checked against the consumer as the server holds it (it may have
    // existed before this process): dead letters need somewhere to go.
    let broker = broker.build().await.unwrap_or_else(|e| {
        exit_with(&match e {
            tower_idempotency_nats::StartError::Uncaptured { subject, why, .. } => format!(
                "DEAD_LETTER_SUBJECT {subject}: no stream captures it ({why}): create one, \
                 e.g. `nats stream add ORDERS_DEAD --subjects {subject}`"
            ),
            other => other.to_string(),
        })
    });
    let example = Example {
        broker,
        scope: "nats_orders",
        budget: DeliveryBudget::new(),
        invalid: |message| message.sequence().to_string(),
        ready: format!("receiving from {stream_name}/{durable}"),
    };
    orders::consume(example, settings).await;
    eprintln!("nats_orders: SIGTERM: stopped pulling, the messages in hand done");
}
