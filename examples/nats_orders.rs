//! An orders consumer on NATS JetStream that charges each order exactly
//! once, however often the stream delivers it.
//!
//! Run with:
//!
//! ```not_rust
//! DATABASE_URL=sqlite://orders.db cargo run --release --all-features --example nats_orders
//! ```
//!
//! Environment: `NATS_URL` (default `nats://127.0.0.1:4222`); `STREAM`
//! (default `ORDERS`, created on `SUBJECT` if missing); `SUBJECT` (default
//! `orders`); `DURABLE` (default `orders_consumer`: a durable pull consumer
//! on `SUBJECT`, created if missing, with `AckWait` from `ACK_WAIT_MS`,
//! default 30000, and `MaxDeliver` from `MAX_DELIVER`, default 20);
//! `DEAD_LETTER_SUBJECT` (none by default; `orders.dead`, say: where what
//! can never succeed is published before it is terminated); `DATABASE_URL`
//! (required: `sqlite://PATH`, `postgres://…` or `mysql://…`; the tables are created if
//! missing); `WORK_DELAY_MS`, `ACK_DELAY_MS`, `IDEMPOTENCY_LEASE_MS`,
//! `IDEMPOTENCY_TX_TIMEOUT_MS` as in `orders_consumer`.
//!
//! A message is JSON `{"order_id", "amount", "currency"}`; the order id is
//! the business key — never the `Nats-Msg-Id`, which a producer's retry may
//! change. Each execution inserts one row into `order_charges`, in the same
//! transaction as the idempotency record.
//!
//! Up to 10 messages are processed at a time. While a message's work runs,
//! "in progress" acknowledgements (`AckKind::Progress`) restart its
//! `AckWait` every third of it, so a job longer than `AckWait` is never
//! redelivered mid-work. Then: executed or a duplicate: `Ack`; in flight
//! elsewhere or the database unavailable: `Nak` with a back-off as its
//! delay; never able to succeed (not a valid order: `invalid <stream
//! sequence>`; the same order id with another payload, or work that
//! outlived its transaction on three deliveries: `rejected <order_id>`):
//! published to `DEAD_LETTER_SUBJECT` when set, then `Term` (never
//! redelivered).
//!
//! One line per message on stdout: `receiving from <STREAM>/<DURABLE>`
//! first, then `executed|duplicate|in-flight|rejected|refused <order_id>` or
//! `invalid <stream sequence>`. It exits with status 2 when its consumer or
//! stream is deleted; on SIGTERM it stops pulling, finishes and acknowledges
//! the messages in hand, and exits 0.
//!
//! JetStream's publish deduplication (`Nats-Msg-Id`, within the stream's
//! duplicate window, 2 minutes by default) drops a producer's resend only if
//! it carries the same id; a resend with a new id is delivered twice — and
//! charged once, by the idempotency record.

use std::{
    sync::atomic::{AtomicBool, Ordering},
    time::Duration,
};

use async_nats::jetstream::{
    self, AckKind, Message,
    consumer::{AckPolicy, pull},
    stream,
};
use futures_util::StreamExt;
use tokio::signal::unix::{SignalKind, signal};
use tower_idempotency::message::{Disposition, IdempotencyProcessor, extend_every};

#[path = "orders/mod.rs"]
mod orders;

use orders::{Ledger, Settings, exit_with, millis, say};

#[tokio::main]
async fn main() {
    orders::init_tracing("nats_orders");
    let settings = Settings::from_env().unwrap_or_else(|why| exit_with(&why));
    let var = |name: &str, default: &str| std::env::var(name).unwrap_or_else(|_| default.into());
    let nats = Nats {
        url: var("NATS_URL", "nats://127.0.0.1:4222"),
        stream: var("STREAM", "ORDERS"),
        subject: var("SUBJECT", "orders"),
        durable: var("DURABLE", "orders_consumer"),
        dead_letters: std::env::var("DEAD_LETTER_SUBJECT").ok(),
        ack_wait: millis("ACK_WAIT_MS", 30_000).unwrap_or_else(|why| exit_with(&why)),
        max_deliver: var("MAX_DELIVER", "20")
            .parse()
            .unwrap_or_else(|_| exit_with("MAX_DELIVER must be a whole number")),
    };
    if nats.ack_wait < Duration::from_millis(300) {
        exit_with("ACK_WAIT_MS must be at least 300");
    }
    orders::run(nats, "nats_orders", settings).await
}

struct Nats {
    url: String,
    stream: String,
    subject: String,
    durable: String,
    dead_letters: Option<String>,
    ack_wait: Duration,
    max_deliver: i64,
}

impl orders::Consumer for Nats {
    /// Pulls until SIGTERM, or until the consumer is gone.
    async fn run<St: Ledger>(self, orders: IdempotencyProcessor<St>, settings: Settings) {
        let client = async_nats::connect(&self.url)
            .await
            .unwrap_or_else(|e| exit_with(&format!("NATS_URL: {e}")));
        let js = jetstream::new(client.clone());
        let stream = js
            .get_or_create_stream(stream::Config {
                name: self.stream.clone(),
                subjects: vec![self.subject.clone()],
                ..Default::default()
            })
            .await
            .unwrap_or_else(|e| exit_with(&format!("stream {}: {e}", self.stream)));
        let consumer: jetstream::consumer::PullConsumer = stream
            .get_or_create_consumer(
                &self.durable,
                pull::Config {
                    durable_name: Some(self.durable.clone()),
                    filter_subject: self.subject.clone(),
                    ack_policy: AckPolicy::Explicit,
                    ack_wait: self.ack_wait,
                    max_deliver: self.max_deliver,
                    ..Default::default()
                },
            )
            .await
            .unwrap_or_else(|e| exit_with(&format!("consumer {}: {e}", self.durable)));
        let ack_wait = consumer.cached_info().config.ack_wait;
        let messages = consumer
            .stream()
            .max_messages_per_batch(10)
            .heartbeat(Duration::from_secs(5))
            .expires(Duration::from_secs(10))
            .messages()
            .await
            .unwrap_or_else(|e| exit_with(&format!("pulling from {}: {e}", self.durable)));
        say(&format!("receiving from {}/{}", self.stream, self.durable));

        let mut term = signal(SignalKind::terminate())
            .unwrap_or_else(|e| exit_with(&format!("listening for SIGTERM: {e}")));
        // Stops pulling at SIGTERM; the messages in hand are finished.
        let terminated = AtomicBool::new(false);
        let until_term = Box::pin(async {
            term.recv().await;
            terminated.store(true, Ordering::SeqCst);
        });
        let this = &self;
        let (orders, settings, js) = (&orders, &settings, &js);
        messages
            .take_until(until_term)
            .for_each_concurrent(10, |message| async move {
                match message {
                    Ok(message) => this.one(orders, settings, js, ack_wait, message).await,
                    Err(error) => match error.kind() {
                        pull::MessagesErrorKind::ConsumerDeleted => exit_with(&format!(
                            "consumer {} of stream {} was deleted",
                            this.durable, this.stream
                        )),
                        _ => tracing::warn!(%error, "pulling failed; retrying"),
                    },
                }
            })
            .await;
        if !terminated.load(Ordering::SeqCst) {
            exit_with(&format!(
                "the server ended the consumer {} of stream {}",
                self.durable, self.stream
            ));
        }
        // Acknowledgements are published without waiting: sent before exit.
        if let Err(e) = client.flush().await {
            exit_with(&format!("flushing the last acknowledgements: {e}"));
        }
        eprintln!("nats_orders: SIGTERM: stopped pulling, the messages in hand done");
    }
}

impl Nats {
    async fn one<St: Ledger>(
        &self,
        orders: &IdempotencyProcessor<St>,
        settings: &Settings,
        js: &jetstream::Context,
        ack_wait: Duration,
        message: Message,
    ) {
        let (delivery, sequence) = match message.info() {
            Ok(info) => (
                u32::try_from(info.delivered).unwrap_or(u32::MAX),
                info.stream_sequence,
            ),
            Err(_) => (1, 0),
        };
        let hold = extend_every((ack_wait / 3).max(Duration::from_millis(100)), || {
            message.ack_with(AckKind::Progress)
        });
        let handled = orders::handle(orders, settings, &message.payload, delivery, &hold).await;
        let acked = match handled.disposition {
            Disposition::Ack => message.ack().await,
            Disposition::Retry { after } => message.ack_with(AckKind::Nak(Some(after))).await,
            Disposition::DeadLetter => match self.dead_letter(js, &message).await {
                Ok(()) => message.ack_with(AckKind::Term).await,
                Err(error) => {
                    // Not terminated: it comes back and is moved then.
                    tracing::error!(%error, "the dead-letter publish failed; retried later");
                    message
                        .ack_with(AckKind::Nak(Some(Duration::from_secs(1))))
                        .await
                }
            },
        };
        if let Err(error) = acked {
            // Redelivered after AckWait, then a duplicate.
            tracing::warn!(%error, "an acknowledgement failed");
        }
        if handled.invalid {
            say(&format!("invalid {sequence}"));
        } else if let Some(line) = handled.line {
            say(&line);
        }
    }

    /// Published to the dead-letter subject, acknowledged by its stream;
    /// without one, only logged.
    async fn dead_letter(
        &self,
        js: &jetstream::Context,
        message: &Message,
    ) -> Result<(), async_nats::Error> {
        let Some(subject) = &self.dead_letters else {
            tracing::warn!(subject = %message.subject, "no DEAD_LETTER_SUBJECT: the message is terminated");
            return Ok(());
        };
        js.publish(subject.clone(), message.payload.clone())
            .await?
            .await?;
        Ok(())
    }
}
