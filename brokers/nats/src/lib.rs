//! NATS JetStream for [tower-idempotency]: the consumer loop's adapter
//! ([`JetStream`]) and the outbox's publisher ([`JetStreamPublisher`]).
//!
//! A consumer writes only its work: the loop
//! ([`Consumer`](tower_idempotency::message::Consumer)) receives from a
//! durable pull consumer, holds each delivery by progress acknowledgements
//! (`AckKind::Progress`, every third of `AckWait`) from the moment it is in
//! hand, settles it with the processor, and answers — `Ack`, `Nak` with a
//! delay, or, for what can never succeed, a dead letter on a subject a
//! stream captures, with its reason in `Dead-Letter-Reason`, then `Term`.
//! Nothing undecided is dropped: an outage, a busy database or a duplicate
//! in flight is retried in hand (no `MaxDeliver` spent); on the last
//! delivery of a finite `MaxDeliver` an undecided message is dead-lettered
//! as undecided; without a dead-letter subject what can never succeed is
//! kept (`Nak` for an hour, logged), never terminated.
//!
//! # Examples
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! use tower_idempotency::{
//!     SqliteStore, SqliteTx,
//!     message::{Consumer, DeadLetterReason, IdempotencyProcessor, Parsed},
//! };
//! use tower_idempotency_nats::{JetStream, async_nats::jetstream};
//!
//! #[derive(serde::Deserialize)]
//! struct Order { order_id: String, amount: i64 }
//!
//! let js = jetstream::new(async_nats::connect("nats://127.0.0.1:4222").await?);
//! let durable = js.get_stream("ORDERS").await?.get_consumer("ledger").await?;
//! let broker = JetStream::builder(js, durable).dead_letter_subject("orders.dead").build().await?;
//! let store = SqliteStore::builder().transactional().create_table_if_missing().connect("sqlite://ledger.db").await?;
//! let orders = IdempotencyProcessor::new(store).scope("ledger");
//! Consumer::new(broker, orders)
//!     .run(
//!         |payload: &[u8]| {
//!             let order: Order = serde_json::from_slice(payload)
//!                 .map_err(|e| DeadLetterReason::invalid(e.to_string()))?;
//!             Ok(Parsed { key: order.order_id.clone(), message: order })
//!         },
//!         async |tx: &mut SqliteTx, order: &Order| {
//!             tower_idempotency::sqlx::query("INSERT INTO ledger (order_id, amount) VALUES (?1, ?2)")
//!                 .bind(&order.order_id)
//!                 .bind(order.amount)
//!                 .execute(&mut **tx)
//!                 .await
//!                 .map(drop)
//!         },
//!         async { tokio::signal::ctrl_c().await.ok(); },
//!     )
//!     .await?;
//! # Ok(()) }
//! ```
//!
//! [tower-idempotency]: https://docs.rs/tower-idempotency
#![forbid(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]

// The README's example compiles with the crate's doctests.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

use std::{borrow::Cow, fmt, time::Duration};

pub use async_nats;
use async_nats::{
    HeaderMap,
    jetstream::{self, AckKind, Message, consumer::PullConsumer, context::PublishErrorKind},
};
use futures_util::StreamExt;
use tokio::sync::Mutex;
use tower_idempotency::{
    message::{
        Acked, Broker, BrokerError, DeadLetterReason, DeadLettered, ExtendError, HeaderStyle,
        Origin, Received,
    },
    outbox::{OutboxMessage, PublishError, Publisher},
};

/// How long a message that can never succeed, with nowhere to go, stays
/// out of sight before it is looked at (and logged) again.
const KEPT_FOR: Duration = Duration::from_secs(3600);

/// How long one receive waits for a first message before it answers
/// empty: a shutdown waits at most this for a pull in flight.
const LONG_POLL: Duration = Duration::from_secs(5);

/// A JetStream durable pull consumer, as the consumer loop drives it: see
/// the [crate docs](crate). Built by [`JetStream::builder`], which checks
/// at start-up that dead letters have somewhere to go.
pub struct JetStream {
    js: jetstream::Context,
    consumer: Mutex<PullConsumer>,
    stream: String,
    durable: String,
    dead_letters: Option<String>,
    ack_wait: Duration,
    /// -1 (or 0): unlimited.
    max_deliver: i64,
    ordering_header: Option<String>,
}

impl fmt::Debug for JetStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JetStream")
            .field("stream", &self.stream)
            .field("durable", &self.durable)
            .field("dead_letters", &self.dead_letters)
            .field("ack_wait", &self.ack_wait)
            .field("max_deliver", &self.max_deliver)
            .finish_non_exhaustive()
    }
}

/// Builds a [`JetStream`]: see [`JetStream::builder`].
#[derive(Debug)]
pub struct JetStreamBuilder {
    js: jetstream::Context,
    consumer: PullConsumer,
    dead_letters: Option<String>,
    ordering_header: Option<String>,
}

/// Why a [`JetStream`] would not start: each says what to fix.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    /// A finite `MaxDeliver` without a dead-letter subject: a message
    /// undecided on its last delivery would be dropped.
    #[error(
        "consumer {durable} has MaxDeliver {max_deliver}: give it a dead-letter subject (a subject a stream captures), or a message undecided on its last delivery would be dropped; or set MaxDeliver to -1 (unlimited)"
    )]
    NoDeadLetters {
        /// The durable consumer.
        durable: String,
        /// Its `MaxDeliver`.
        max_deliver: i64,
    },
    /// The dead-letter subject is captured by no stream: a publish to it
    /// would be lost.
    #[error(
        "dead-letter subject {subject}: no stream captures it ({why}): create one, e.g. `nats stream add ORDERS_DEAD --subjects {subject}`"
    )]
    Uncaptured {
        /// The subject.
        subject: String,
        /// What the server said.
        why: String,
    },
    /// The server could not be asked.
    #[error("the JetStream server could not be asked about consumer {durable}: {why}")]
    Unreachable {
        /// The durable consumer.
        durable: String,
        /// What failed.
        why: String,
    },
}

impl JetStream {
    /// The durable pull consumer `consumer` (of the context `js`), which
    /// must acknowledge explicitly.
    ///
    /// # Examples
    ///
    /// See the [crate docs](crate).
    pub fn builder(js: jetstream::Context, consumer: PullConsumer) -> JetStreamBuilder {
        JetStreamBuilder {
            js,
            consumer,
            dead_letters: None,
            ordering_header: None,
        }
    }
}

impl JetStreamBuilder {
    /// Where what can never succeed is published before it is terminated:
    /// a subject a stream captures (checked when built). Without one, such
    /// a message is kept, unacknowledged, and logged each hour.
    ///
    /// # Examples
    ///
    /// See the [crate docs](crate).
    pub fn dead_letter_subject(mut self, subject: impl Into<String>) -> Self {
        self.dead_letters = Some(subject.into());
        self
    }

    /// Messages whose header `name` holds one value are settled one after
    /// the other, in stream order (the outbox's publisher writes the
    /// ordering key as `Ordering-Key`); others side by side.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # fn demo(builder: tower_idempotency_nats::JetStreamBuilder) {
    /// let builder = builder.ordered_by_header("Ordering-Key");
    /// # let _ = builder; }
    /// ```
    pub fn ordered_by_header(mut self, name: impl Into<String>) -> Self {
        self.ordering_header = Some(name.into());
        self
    }

    /// The adapter, once the consumer's own settings (as the server holds
    /// them) are known and its dead letters have somewhere to go.
    ///
    /// # Errors
    ///
    /// See [`StartError`].
    ///
    /// # Examples
    ///
    /// See the [crate docs](crate).
    pub async fn build(mut self) -> Result<JetStream, StartError> {
        let durable = self.consumer.cached_info().name.clone();
        let info = self
            .consumer
            .info()
            .await
            .map_err(|e| StartError::Unreachable {
                durable,
                why: e.to_string(),
            })?
            .clone();
        let (ack_wait, max_deliver) = (info.config.ack_wait, info.config.max_deliver);
        match &self.dead_letters {
            None if max_deliver > 0 => {
                return Err(StartError::NoDeadLetters {
                    durable: info.name,
                    max_deliver,
                });
            }
            None => {}
            Some(subject) => {
                if let Err(error) = self.js.stream_by_subject(subject.clone()).await {
                    return Err(StartError::Uncaptured {
                        subject: subject.clone(),
                        why: error.to_string(),
                    });
                }
            }
        }
        Ok(JetStream {
            js: self.js,
            consumer: Mutex::new(self.consumer),
            stream: info.stream_name,
            durable: info.name,
            dead_letters: self.dead_letters,
            ack_wait,
            max_deliver,
            ordering_header: self.ordering_header,
        })
    }
}

/// One JetStream delivery.
pub struct JetStreamMessage {
    message: Message,
    delivered: i64,
    sequence: u64,
    /// Whether its delivery count has reached a finite `MaxDeliver`.
    last: bool,
}

impl fmt::Debug for JetStreamMessage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JetStreamMessage")
            .field("subject", &self.message.subject)
            .field("sequence", &self.sequence)
            .field("delivered", &self.delivered)
            .finish_non_exhaustive()
    }
}

impl JetStreamMessage {
    /// The message, as async-nats gives it.
    pub fn message(&self) -> &Message {
        &self.message
    }

    /// Its stream sequence.
    pub fn sequence(&self) -> u64 {
        self.sequence
    }
}

/// `JetStream`'s deliveries: see [`Received`].
impl Received for JetStreamMessage {
    fn payload(&self) -> &[u8] {
        &self.message.payload
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.message.headers.as_ref()?.get(name).map(|v| v.as_str())
    }

    /// Its `Nats-Msg-Id`, else its stream sequence.
    fn message_id(&self) -> Option<Cow<'_, str>> {
        Some(match self.header("Nats-Msg-Id") {
            Some(id) => Cow::Borrowed(id),
            None => Cow::Owned(self.sequence.to_string()),
        })
    }

    fn last(&self) -> bool {
        self.last
    }
}

impl JetStream {
    /// Pulls one message (waiting up to `within`, at most [`LONG_POLL`]), then whatever else
    /// is there, up to `room`: each pull request ends whole, so nothing is
    /// delivered behind the loop's back (unheld, its `AckWait` running).
    async fn pull(&self, room: usize, within: Duration) -> Result<Vec<Message>, BrokerError> {
        let consumer = self.consumer.lock().await;
        let mut first = consumer
            .batch()
            .max_messages(1)
            .expires(within.min(LONG_POLL))
            .messages()
            .await
            .map_err(|e| self.ended(e))?;
        let mut messages = Vec::new();
        while let Some(message) = first.next().await {
            messages.push(message.map_err(|e| self.ended(e))?);
        }
        if messages.is_empty() || room <= 1 {
            return Ok(messages);
        }
        let mut more = consumer
            .fetch()
            .max_messages(room - 1)
            .messages()
            .await
            .map_err(|e| self.ended(e))?;
        while let Some(message) = more.next().await {
            messages.push(message.map_err(|e| self.ended(e))?);
        }
        Ok(messages)
    }

    /// `Err` when the server says the consumer (or its stream) no longer
    /// exists; a server out of reach is not that.
    async fn still_there(&self) -> Result<(), BrokerError> {
        let mut consumer = self.consumer.lock().await;
        match consumer.info().await {
            Err(error) if error.to_string().contains("not found") => Err(format!(
                "consumer {} of stream {} was deleted ({error})",
                self.durable, self.stream
            )
            .into()),
            _ => Ok(()),
        }
    }

    fn ended(&self, error: impl fmt::Display) -> BrokerError {
        format!(
            "pulling from consumer {} of stream {}: {error}",
            self.durable, self.stream
        )
        .into()
    }
}

impl Broker for JetStream {
    type Received = JetStreamMessage;

    fn system(&self) -> &'static str {
        "nats"
    }

    fn destination(&self) -> &str {
        &self.stream
    }

    /// A pull failing for a moment (a reconnect) is tried again; the
    /// consumer or its stream gone (a pull to a deleted consumer only
    /// comes back empty: asked after each quiet one) ends the loop.
    async fn receive(
        &self,
        room: usize,
        within: Duration,
    ) -> Result<Vec<JetStreamMessage>, BrokerError> {
        let mut backoff = Duration::from_millis(200);
        loop {
            match self.pull(room, within).await {
                Ok(messages) if messages.is_empty() => {
                    self.still_there().await?;
                    return Ok(Vec::new());
                }
                Ok(messages) => {
                    return Ok(messages
                        .into_iter()
                        .map(|message| {
                            let (delivered, sequence) = match message.info() {
                                Ok(info) => (info.delivered, info.stream_sequence),
                                Err(_) => (1, 0),
                            };
                            JetStreamMessage {
                                message,
                                delivered,
                                sequence,
                                last: self.max_deliver > 0 && delivered >= self.max_deliver,
                            }
                        })
                        .collect());
                }
                Err(error) => {
                    self.still_there().await?;
                    tracing::warn!(%error, "pulling failed; retrying");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
            }
        }
    }

    fn hold_interval(&self) -> Option<Duration> {
        Some((self.ack_wait / 3).max(Duration::from_millis(100)))
    }

    async fn extend(&self, received: &JetStreamMessage) -> Result<(), ExtendError> {
        received.message.ack_with(AckKind::Progress).await
    }

    fn ordering_key<'a>(&self, received: &'a JetStreamMessage) -> Option<Cow<'a, str>> {
        let name = self.ordering_header.as_deref()?;
        received.header(name).map(Cow::Borrowed)
    }

    async fn ack(&self, received: &JetStreamMessage, _: Acked) -> Result<(), BrokerError> {
        received.message.ack().await
    }

    async fn give_back(
        &self,
        received: &JetStreamMessage,
        after: Duration,
    ) -> Result<(), BrokerError> {
        received.message.ack_with(AckKind::Nak(Some(after))).await
    }

    async fn dead_letter(
        &self,
        received: &JetStreamMessage,
        reason: &DeadLetterReason,
    ) -> Result<DeadLettered, BrokerError> {
        let Some(subject) = &self.dead_letters else {
            tracing::error!(subject = %received.message.subject, %reason, "a message that can never succeed has no dead-letter subject: kept, out of sight for an hour; give the consumer one");
            received
                .message
                .ack_with(AckKind::Nak(Some(KEPT_FOR)))
                .await?;
            return Ok(DeadLettered::Kept);
        };
        let mut headers = HeaderMap::new();
        // One dead letter per message, however often it is published.
        headers.insert(
            "Nats-Msg-Id",
            format!("dead-{}-{}", self.stream, received.sequence).as_str(),
        );
        let sequence = received.sequence.to_string();
        let origin = Origin {
            source: received.message.subject.as_str(),
            partition: None,
            position: Some(&sequence),
        };
        for (name, value) in reason.headers(&origin, HeaderStyle::Nats) {
            headers.insert(name, value.as_str());
        }
        self.js
            .publish_with_headers(subject.clone(), headers, received.message.payload.clone())
            .await?
            .await?;
        Ok(DeadLettered::Moved)
    }

    /// Acknowledgements are published without waiting: sent before the
    /// loop returns.
    async fn close(&self) {
        if let Err(error) = self.js.client().flush().await {
            tracing::warn!(%error, "the last acknowledgements could not be flushed; those messages come back as duplicates");
        }
    }
}

/// The outbox's publisher to JetStream: each message to its destination
/// subject, its id as `Nats-Msg-Id` (the stream drops a resend within its
/// duplicate window), its headers as NATS headers, its ordering key as
/// `Ordering-Key`. A subject no stream captures now (a stream briefly
/// absent), a server out of reach or a publish not acknowledged is retried
/// by the relay; the client reconnects by itself.
///
/// # Examples
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// use tower_idempotency_nats::{JetStreamPublisher, async_nats};
///
/// let publisher = JetStreamPublisher::new(async_nats::jetstream::new(
///     async_nats::connect("nats://127.0.0.1:4222").await?,
/// ));
/// # let _ = publisher; Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct JetStreamPublisher {
    js: jetstream::Context,
}

impl JetStreamPublisher {
    /// Publishes through `js`.
    ///
    /// # Examples
    ///
    /// See [`JetStreamPublisher`].
    pub fn new(js: jetstream::Context) -> Self {
        Self { js }
    }
}

impl Publisher for JetStreamPublisher {
    async fn publish(&self, message: &OutboxMessage) -> Result<(), PublishError> {
        let mut headers = HeaderMap::new();
        headers.insert("Nats-Msg-Id", message.id.as_str());
        if let Some(key) = &message.ordering_key {
            headers.insert("Ordering-Key", key.as_str());
        }
        for (name, value) in &message.headers {
            headers.insert(name.as_str(), value.as_str());
        }
        let acked = async {
            self.js
                .publish_with_headers(
                    message.destination.clone(),
                    headers,
                    message.payload.clone().into(),
                )
                .await?
                .await
        }
        .await;
        match acked {
            Ok(_) => Ok(()),
            Err(error) if error.kind() == PublishErrorKind::StreamNotFound => {
                Err(PublishError::Unavailable(
                    format!(
                        "no stream captures {} (now): published once one does",
                        message.destination
                    )
                    .into(),
                ))
            }
            Err(error) => Err(PublishError::Unavailable(error.into())),
        }
    }
}
