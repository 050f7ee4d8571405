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
//! `IDEMPOTENCY_TX_TIMEOUT_MS` as in `orders_consumer`.
//!
//! A message is JSON `{"order_id", "amount", "currency"}`; the order id is
//! the business key — never the `Nats-Msg-Id`, which a producer's retry may
//! change. Each execution inserts one row into `order_charges`, in the same
//! transaction as the idempotency record.
//!
//! Up to 10 messages are processed at a time. While a message is in hand,
//! "in progress" acknowledgements (`AckKind::Progress`) restart its
//! `AckWait` every third of it, so a job longer than `AckWait` is never
//! redelivered mid-work. Then: executed or a duplicate: `Ack`; in flight
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
use tower_idempotency::message::{
    DeadLetterReason, Disposition, IdempotencyProcessor, extend_every,
};

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
        max_deliver: var("MAX_DELIVER", "-1")
            .parse()
            .unwrap_or_else(|_| exit_with("MAX_DELIVER must be a whole number (-1: unlimited)")),
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
        // Before anything is created, and again with what the server holds.
        self.check_dead_letters(&js, self.max_deliver).await;
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
        let config = &consumer.cached_info().config;
        // The consumer's own, if it existed before this process.
        let (ack_wait, max_deliver) = (config.ack_wait, config.max_deliver);
        self.check_dead_letters(&js, max_deliver).await;
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
            // What waits between attempts goes back at once.
            orders.drain();
        });
        let this = &self;
        let (orders, settings, js) = (&orders, &settings, &js);
        let limits = Limits {
            ack_wait,
            max_deliver,
        };
        messages
            .take_until(until_term)
            .for_each_concurrent(10, |message| async move {
                match message {
                    Ok(message) => this.one(orders, settings, js, limits, message).await,
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

/// The durable consumer's own settings, as the server holds them.
#[derive(Clone, Copy)]
struct Limits {
    ack_wait: Duration,
    /// -1 (or 0): unlimited.
    max_deliver: i64,
}

/// How long a message that can never succeed, with nowhere to go, stays
/// out of sight before it is looked at (and logged) again.
const KEPT_FOR: Duration = Duration::from_secs(3600);

impl Nats {
    /// A finite `MaxDeliver` needs a dead-letter subject (its last delivery
    /// must go somewhere), and a dead-letter subject needs a stream that
    /// captures it (a publish to no stream is lost): else exit 2, naming it.
    async fn check_dead_letters(&self, js: &jetstream::Context, max_deliver: i64) {
        match &self.dead_letters {
            None if max_deliver > 0 => exit_with(&format!(
                "consumer {} has MaxDeliver {max_deliver}: set DEAD_LETTER_SUBJECT (a subject a stream captures), \
                 or a message undecided on its last delivery would be dropped; or use MAX_DELIVER=-1",
                self.durable
            )),
            None => {}
            Some(subject) => {
                if let Err(error) = js.stream_by_subject(subject.clone()).await {
                    exit_with(&format!(
                        "DEAD_LETTER_SUBJECT {subject}: no stream captures it ({error}): create one, \
                         e.g. `nats stream add ORDERS_DEAD --subjects {subject}`"
                    ))
                }
            }
        }
    }

    async fn one<St: Ledger>(
        &self,
        orders: &IdempotencyProcessor<St>,
        settings: &Settings,
        js: &jetstream::Context,
        limits: Limits,
        message: Message,
    ) {
        let (delivered, sequence) = match message.info() {
            Ok(info) => (info.delivered, info.stream_sequence),
            Err(_) => (1, 0),
        };
        let last = limits.max_deliver > 0 && delivered >= limits.max_deliver;
        let hold = extend_every(
            (limits.ack_wait / 3).max(Duration::from_millis(100)),
            || message.ack_with(AckKind::Progress),
        );
        let message_id = message
            .headers
            .as_ref()
            .and_then(|headers| headers.get("Nats-Msg-Id"))
            .map(|id| id.as_str().to_owned())
            .unwrap_or_else(|| sequence.to_string());
        let origin = orders::Origin {
            system: "nats",
            destination: &self.stream,
            message_id: Some(&message_id),
        };
        let handled =
            orders::handle(orders, settings, &origin, &message.payload, &hold, last).await;
        let acked = match &handled.disposition {
            Disposition::Ack => message.ack().await,
            Disposition::Retry { after } => message.ack_with(AckKind::Nak(Some(*after))).await,
            Disposition::DeadLetter(reason) => {
                match self.dead_letter(js, &message, sequence, reason).await {
                    Ok(true) => message.ack_with(AckKind::Term).await,
                    // Kept: never terminated.
                    Ok(false) => message.ack_with(AckKind::Nak(Some(KEPT_FOR))).await,
                    Err(error) => {
                        // Not terminated: it comes back and is moved then.
                        tracing::error!(%error, "the dead-letter publish failed; retried later");
                        message
                            .ack_with(AckKind::Nak(Some(Duration::from_secs(1))))
                            .await
                    }
                }
            }
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

    /// Published to the dead-letter subject with its reason, acknowledged
    /// by its stream (`true`); without one, kept (`false`) and logged.
    async fn dead_letter(
        &self,
        js: &jetstream::Context,
        message: &Message,
        sequence: u64,
        reason: &DeadLetterReason,
    ) -> Result<bool, async_nats::Error> {
        let Some(subject) = &self.dead_letters else {
            tracing::error!(subject = %message.subject, %reason, "a message that can never succeed has no DEAD_LETTER_SUBJECT: kept, out of sight for an hour; set one");
            return Ok(false);
        };
        let mut headers = async_nats::HeaderMap::new();
        // One dead letter per message, however often it is published.
        headers.insert(
            "Nats-Msg-Id",
            format!("dead-{}-{sequence}", self.stream).as_str(),
        );
        // A header value holds one line.
        let why = reason.to_string().replace(['\r', '\n'], " ");
        headers.insert("Dead-Letter-Reason", why.as_str());
        headers.insert("Dead-Letter-Kind", reason.kind());
        js.publish_with_headers(subject.clone(), headers, message.payload.clone())
            .await?
            .await?;
        Ok(true)
    }
}
