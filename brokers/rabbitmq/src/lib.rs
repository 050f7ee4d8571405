//! RabbitMQ for [tower-idempotency], on lapin: the consumer loop's adapter
//! ([`RabbitMq`]) and the outbox's publisher ([`RabbitMqPublisher`]).
//!
//! A consumer writes only its work: the loop
//! ([`Consumer`](tower_idempotency::message::Consumer)) consumes a queue —
//! classic or quorum — with a prefetch of as many deliveries as it keeps in
//! hand, settles each with the processor, and answers: `basic.ack`; for a
//! delivery given back, `basic.nack` with requeue after its delay; for what
//! can never succeed, a persistent publish to the dead-letter queue with
//! its reason in `x-dead-letter-reason`, confirmed by the broker, then
//! `basic.ack`. RabbitMQ cannot extend a delivery: its `consumer_timeout`
//! (30 minutes by default) closes the channel of a consumer holding one
//! longer, so give the processor [`RabbitMq::budget`]. A quorum queue's
//! `x-delivery-count` tells its last delivery, against its delivery limit
//! (learnt from its `x-delivery-limit` argument at start-up; one a policy or
//! the broker's default sets is given with
//! [`delivery_limit`](RabbitMqBuilder::delivery_limit), or the adapter
//! refuses to start): undecided then, a message is dead-lettered as
//! undecided rather than dropped by the broker. At shutdown the consumer
//! is cancelled (`basic.cancel`), what it was sent is worked and
//! answered, and the adapter's channels are closed before the loop
//! returns: the application then closes its connection.
//!
//! # Examples
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! use tower_idempotency::{
//!     SqliteStore, SqliteTx,
//!     message::{Consumer, DeadLetterReason, IdempotencyProcessor, Parsed},
//! };
//! use tower_idempotency_rabbitmq::{RabbitMq, lapin};
//!
//! #[derive(serde::Deserialize)]
//! struct Order { order_id: String, amount: i64 }
//!
//! let connection = lapin::Connection::connect("amqp://guest:guest@127.0.0.1:5672/%2f", Default::default()).await?;
//! let broker = RabbitMq::builder(&connection, "orders", "orders.dead").build().await?;
//! let store = SqliteStore::builder().transactional().create_table_if_missing().connect("sqlite://ledger.db").await?;
//! let orders = IdempotencyProcessor::new(store).scope("ledger").budget(RabbitMq::budget());
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

use std::{
    borrow::Cow,
    fmt,
    sync::atomic::{AtomicBool, Ordering},
    time::Duration,
};

use futures_util::{FutureExt, StreamExt};
pub use lapin;
use lapin::{
    BasicProperties, Channel, Confirmation, Connection, ConnectionProperties, Consumer,
    message::Delivery,
    options::{
        BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions,
        BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions, QueueDeclareOptions,
    },
    protocol::constants::REPLY_SUCCESS,
    types::{AMQPValue, FieldTable, LongString, ShortString},
};
use tokio::sync::Mutex;
use tower_idempotency::{
    message::{
        Acked, Broker, BrokerError, DeadLetterReason, DeadLettered, DeliveryBudget, HeaderStyle,
        Origin, Received,
    },
    outbox::{OutboxMessage, PublishError, Publisher},
};

/// How long a channel's close waits for the broker's answer at shutdown.
const CLOSE_WITHIN: Duration = Duration::from_secs(5);

/// A queue, as the consumer loop drives it: see the [crate docs](crate).
pub struct RabbitMq {
    queue: String,
    dead_letters: String,
    consumer: Mutex<Consumer>,
    /// The consumer's channel and tag, to cancel it at shutdown.
    channel: Channel,
    consumer_tag: String,
    /// Set once the consumer is cancelled: its stream's end is then no
    /// failure.
    cancelled: AtomicBool,
    /// Dead letters are published with confirms, on a channel of their own.
    confirms: Channel,
    delivery_limit: Option<u64>,
    ordering_header: Option<String>,
}

impl fmt::Debug for RabbitMq {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitMq")
            .field("queue", &self.queue)
            .field("dead_letters", &self.dead_letters)
            .field("delivery_limit", &self.delivery_limit)
            .finish_non_exhaustive()
    }
}

/// Builds a [`RabbitMq`]: see [`RabbitMq::builder`].
pub struct RabbitMqBuilder<'a> {
    connection: &'a Connection,
    queue: String,
    dead_letters: String,
    prefetch: u16,
    queue_type: Option<String>,
    delivery_limit: Option<u64>,
    ordering_header: Option<String>,
    consumer_tag: String,
}

impl fmt::Debug for RabbitMqBuilder<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitMqBuilder")
            .field("queue", &self.queue)
            .field("dead_letters", &self.dead_letters)
            .finish_non_exhaustive()
    }
}

/// Why a [`RabbitMq`] would not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    /// A channel, a queue or the consumer could not be set up.
    #[error("{what}: {source}")]
    Broker {
        /// What failed.
        what: String,
        /// What the broker said.
        #[source]
        source: lapin::Error,
    },
    /// The queue is a quorum queue (or may be one) whose delivery limit
    /// could not be learnt from its arguments — it comes from a policy, or
    /// from RabbitMQ 4's default of 20 — and none was given: its last
    /// delivery could not be told, and one given back then would be
    /// dropped by the broker. Give the limit with
    /// [`delivery_limit`](RabbitMqBuilder::delivery_limit).
    #[error(
        "the queue {queue} is a quorum queue whose delivery limit is not one of its arguments \
         ({why}): give the limit its policy sets (RabbitMQ 4's default is 20) with \
         RabbitMqBuilder::delivery_limit, or declare the queue with x-delivery-limit, so that its \
         last delivery is dead-lettered as undecided rather than dropped by the broker"
    )]
    UnknownDeliveryLimit {
        /// The queue.
        queue: String,
        /// What was learnt of it.
        why: String,
    },
}

impl RabbitMq {
    /// `queue` on `connection`, what can never succeed going to the queue
    /// `dead_letters` (both declared durable when missing; an existing
    /// queue, classic or quorum, is used as it is).
    ///
    /// # Examples
    ///
    /// See the [crate docs](crate).
    pub fn builder<'a>(
        connection: &'a Connection,
        queue: impl Into<String>,
        dead_letters: impl Into<String>,
    ) -> RabbitMqBuilder<'a> {
        RabbitMqBuilder {
            connection,
            queue: queue.into(),
            dead_letters: dead_letters.into(),
            prefetch: 10,
            queue_type: None,
            delivery_limit: None,
            ordering_header: None,
            consumer_tag: "tower-idempotency".to_owned(),
        }
    }

    /// The delivery budget for RabbitMQ: a delivery given back well before
    /// `consumer_timeout` (30 minutes by default) would close the channel.
    ///
    /// # Examples
    ///
    /// See the [crate docs](crate).
    pub fn budget() -> DeliveryBudget {
        DeliveryBudget::new().give_back_after(Duration::from_secs(25 * 60))
    }

    /// The queue consumed.
    pub fn queue(&self) -> &str {
        &self.queue
    }
}

impl RabbitMqBuilder<'_> {
    /// Deliveries unacknowledged at once (`basic.qos`, default 10): give
    /// the loop as many in hand
    /// ([`Consumer::in_hand`](tower_idempotency::message::Consumer::in_hand)).
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # fn demo(builder: tower_idempotency_rabbitmq::RabbitMqBuilder<'_>) {
    /// let builder = builder.prefetch(32);
    /// # let _ = builder; }
    /// ```
    pub fn prefetch(mut self, deliveries: u16) -> Self {
        self.prefetch = deliveries.max(1);
        self
    }

    /// Declares missing queues as this type (`x-queue-type`: `quorum`,
    /// `classic`); existing queues are used as they are, whatever their
    /// type.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # fn demo(builder: tower_idempotency_rabbitmq::RabbitMqBuilder<'_>) {
    /// let builder = builder.queue_type("quorum").delivery_limit(20);
    /// # let _ = builder; }
    /// ```
    pub fn queue_type(mut self, queue_type: impl Into<String>) -> Self {
        self.queue_type = Some(queue_type.into());
        self
    }

    /// The quorum queue's `delivery-limit`: a delivery whose
    /// `x-delivery-count` has reached it is the broker's last, so an
    /// undecided one is dead-lettered as undecided instead of being given
    /// back (the broker would drop it). Declared on a queue this creates.
    ///
    /// A quorum queue's `x-delivery-limit` argument is learnt at start-up
    /// (the lower of it and this one counts). A limit the queue does not
    /// carry as an argument — set by a policy, or RabbitMQ 4's default of
    /// 20 — cannot be learnt over AMQP: give it here, or the adapter
    /// refuses to start ([`StartError::UnknownDeliveryLimit`]). (A quorum
    /// queue of RabbitMQ 3 without any limit: give one no delivery count
    /// reaches, `u64::MAX`.)
    ///
    /// # Examples
    ///
    /// See [`queue_type`](Self::queue_type).
    pub fn delivery_limit(mut self, limit: u64) -> Self {
        self.delivery_limit = Some(limit);
        self
    }

    /// Deliveries whose header `name` holds one value are settled one
    /// after the other, in the order received.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # fn demo(builder: tower_idempotency_rabbitmq::RabbitMqBuilder<'_>) {
    /// let builder = builder.ordered_by_header("ordering-key");
    /// # let _ = builder; }
    /// ```
    pub fn ordered_by_header(mut self, name: impl Into<String>) -> Self {
        self.ordering_header = Some(name.into());
        self
    }

    /// The consumer's tag (default `tower-idempotency`).
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # fn demo(builder: tower_idempotency_rabbitmq::RabbitMqBuilder<'_>) {
    /// let builder = builder.consumer_tag("ledger-1");
    /// # let _ = builder; }
    /// ```
    pub fn consumer_tag(mut self, tag: impl Into<String>) -> Self {
        self.consumer_tag = tag.into();
        self
    }

    /// The adapter: both queues there (declared if missing), the consumer
    /// started.
    ///
    /// # Errors
    ///
    /// See [`StartError`].
    ///
    /// # Examples
    ///
    /// See the [crate docs](crate).
    pub async fn build(self) -> Result<RabbitMq, StartError> {
        let failed = |what: String| move |source| StartError::Broker { what, source };
        for queue in [&self.queue, &self.dead_letters] {
            self.ensure_queue(queue).await?;
        }
        let delivery_limit = self.learn_delivery_limit().await?;
        let channel = self
            .connection
            .create_channel()
            .await
            .map_err(failed("opening a channel".into()))?;
        channel
            .basic_qos(self.prefetch, BasicQosOptions::default())
            .await
            .map_err(failed("basic_qos".into()))?;
        let confirms = self
            .connection
            .create_channel()
            .await
            .map_err(failed("opening a channel".into()))?;
        confirms
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(failed("confirm_select".into()))?;
        let consumer = channel
            .basic_consume(
                self.queue.as_str().into(),
                self.consumer_tag.as_str().into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(failed(format!("consuming {}", self.queue)))?;
        Ok(RabbitMq {
            queue: self.queue,
            dead_letters: self.dead_letters,
            consumer: Mutex::new(consumer),
            channel,
            consumer_tag: self.consumer_tag,
            cancelled: AtomicBool::new(false),
            confirms,
            delivery_limit,
            ordering_header: self.ordering_header,
        })
    }

    /// The queue's delivery limit: `None` for a queue that has none (a
    /// classic queue); a quorum queue's `x-delivery-limit` argument (the
    /// lower of it and the one given); else the one given, or
    /// [`StartError::UnknownDeliveryLimit`].
    async fn learn_delivery_limit(&self) -> Result<Option<u64>, StartError> {
        let given = self.delivery_limit;
        let unknown = |why: String| match given {
            Some(limit) => Ok(Some(limit)),
            None => Err(StartError::UnknownDeliveryLimit {
                queue: self.queue.clone(),
                why,
            }),
        };
        match self.probe_quorum().await {
            Probe::NotQuorum => Ok(given),
            Probe::Limit(limit) => Ok(Some(given.map_or(limit, |given| given.min(limit)))),
            Probe::NoLimitArgument => unknown(
                "it has no x-delivery-limit argument: a policy or the broker's default sets it"
                    .into(),
            ),
            Probe::Unknown(why) => unknown(why),
        }
    }

    /// What the queue is, learnt by declaring it as a quorum queue with no
    /// other argument, on a channel of its own: the broker accepts that of
    /// a quorum queue without `x-delivery-limit`, and names the argument
    /// that differs otherwise — `x-queue-type` for a classic or stream
    /// queue, `x-delivery-limit` (with its value) for a quorum queue that
    /// has one. Nothing about the queue changes either way.
    async fn probe_quorum(&self) -> Probe {
        let channel = match self.connection.create_channel().await {
            Ok(channel) => channel,
            Err(error) => return Probe::Unknown(format!("a channel could not be opened: {error}")),
        };
        let mut quorum = FieldTable::default();
        quorum.insert(
            "x-queue-type".into(),
            AMQPValue::LongString("quorum".into()),
        );
        let declared = channel
            .queue_declare(
                self.queue.as_str().into(),
                QueueDeclareOptions::durable(),
                quorum,
            )
            .await;
        match declared {
            Ok(_) => {
                let _ = channel.close(200, "probed".into()).await;
                Probe::NoLimitArgument
            }
            Err(error) => Probe::of_refusal(&error.to_string()),
        }
    }

    /// `queue` as it is (a passive declare, whatever its type), or
    /// declared durable with the builder's type when it is missing (a
    /// passive declare of a missing queue closes its channel: each try has
    /// a channel of its own).
    async fn ensure_queue(&self, queue: &str) -> Result<(), StartError> {
        let failed = |source| StartError::Broker {
            what: format!("declaring queue {queue}"),
            source,
        };
        let channel = self.connection.create_channel().await.map_err(failed)?;
        let passive = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        if channel
            .queue_declare(queue.into(), passive, FieldTable::default())
            .await
            .is_ok()
        {
            let _ = channel.close(200, "declared".into()).await;
            return Ok(());
        }
        let channel = self.connection.create_channel().await.map_err(failed)?;
        let mut arguments = FieldTable::default();
        if let Some(queue_type) = &self.queue_type {
            arguments.insert(
                "x-queue-type".into(),
                AMQPValue::LongString(queue_type.as_str().into()),
            );
            if let (Some(limit), true) = (self.delivery_limit, queue_type == "quorum") {
                arguments.insert(
                    "x-delivery-limit".into(),
                    AMQPValue::LongLongInt(limit as i64),
                );
            }
        }
        channel
            .queue_declare(queue.into(), QueueDeclareOptions::durable(), arguments)
            .await
            .map_err(failed)?;
        let _ = channel.close(200, "declared".into()).await;
        Ok(())
    }
}

/// What declaring a queue as a plain quorum queue said of it.
#[derive(Debug, PartialEq, Eq)]
enum Probe {
    /// A classic or stream queue: no delivery limit.
    NotQuorum,
    /// A quorum queue with this `x-delivery-limit` argument.
    Limit(u64),
    /// A quorum queue without one.
    NoLimitArgument,
    /// Nothing could be told (another argument differs, no permission).
    Unknown(String),
}

impl Probe {
    /// From the broker's refusal: `inequivalent arg 'x-delivery-limit' for
    /// queue … received none but current is the value '5' of type …`.
    fn of_refusal(refusal: &str) -> Self {
        if refusal.contains("inequivalent arg 'x-queue-type'") {
            return Self::NotQuorum;
        }
        if refusal.contains("inequivalent arg 'x-delivery-limit'") {
            let limit = refusal
                .split_once("current is")
                .and_then(|(_, current)| current.split('\'').nth(1))
                .and_then(|value| value.parse().ok());
            if let Some(limit) = limit {
                return Self::Limit(limit);
            }
        }
        Self::Unknown(format!(
            "declaring it as a quorum queue was refused: {refusal}"
        ))
    }
}

/// One RabbitMQ delivery.
pub struct RabbitMqDelivery {
    delivery: Delivery,
    last: bool,
}

impl fmt::Debug for RabbitMqDelivery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitMqDelivery")
            .field("delivery_tag", &self.delivery.delivery_tag)
            .field("last", &self.last)
            .finish_non_exhaustive()
    }
}

impl RabbitMqDelivery {
    /// The delivery, as lapin gives it.
    pub fn delivery(&self) -> &Delivery {
        &self.delivery
    }

    fn header_value(&self, name: &str) -> Option<&AMQPValue> {
        self.delivery
            .properties
            .headers()
            .as_ref()?
            .inner()
            .get(name)
    }
}

/// `RabbitMq`'s deliveries: see [`Received`].
impl Received for RabbitMqDelivery {
    fn payload(&self) -> &[u8] {
        &self.delivery.data
    }

    fn header(&self, name: &str) -> Option<&str> {
        match self.header_value(name)? {
            AMQPValue::LongString(value) => std::str::from_utf8(value.as_bytes()).ok(),
            AMQPValue::ShortString(value) => Some(value.as_str()),
            _ => None,
        }
    }

    /// Its `message-id` property, else its delivery tag.
    fn message_id(&self) -> Option<Cow<'_, str>> {
        Some(match self.delivery.properties.message_id() {
            Some(id) => Cow::Borrowed(id.as_str()),
            None => Cow::Owned(self.delivery.delivery_tag.to_string()),
        })
    }

    fn last(&self) -> bool {
        self.last
    }
}

impl Broker for RabbitMq {
    type Received = RabbitMqDelivery;

    fn system(&self) -> &'static str {
        "rabbitmq"
    }

    fn destination(&self) -> &str {
        &self.queue
    }

    /// The next delivery (waiting up to `within`), then the ones already
    /// there, up to `room`. The broker cancelling the consumer (the queue
    /// deleted) or the connection failing ends the loop.
    async fn receive(
        &self,
        room: usize,
        within: Duration,
    ) -> Result<Vec<RabbitMqDelivery>, BrokerError> {
        let mut consumer = self.consumer.lock().await;
        let mut deliveries = Vec::new();
        let first = match tokio::time::timeout(within, consumer.next()).await {
            Err(_) => return Ok(deliveries),
            Ok(first) => first,
        };
        let mut next = first;
        loop {
            match next {
                Some(Ok(delivery)) => deliveries.push(self.received(delivery)),
                Some(Err(error)) => {
                    return Err(format!("the broker connection failed: {error}").into());
                }
                None if self.cancelled.load(Ordering::SeqCst) => return Ok(deliveries),
                None => {
                    return Err(format!(
                        "the broker ended the consumer of {} (queue deleted or consumer cancelled)",
                        self.queue
                    )
                    .into());
                }
            }
            if deliveries.len() >= room {
                return Ok(deliveries);
            }
            match consumer.next().now_or_never() {
                Some(ready) => next = ready,
                None => return Ok(deliveries),
            }
        }
    }

    /// Deliveries come from the consumer's own buffer, which lapin fills:
    /// a receive dropped at shutdown leaves them there.
    fn receive_is_cancel_safe(&self) -> bool {
        true
    }

    /// `basic.cancel`: the broker delivers nothing more, and what it
    /// delivered before (the prefetch) is taken by the loop's last receive —
    /// never given back by the connection's close, which on a quorum queue
    /// spends a delivery and could drop a message on its last.
    async fn stop_receiving(&self) {
        self.cancelled.store(true, Ordering::SeqCst);
        if let Err(error) = self
            .channel
            .basic_cancel(
                self.consumer_tag.as_str().into(),
                BasicCancelOptions::default(),
            )
            .await
        {
            tracing::warn!(%error, queue = %self.queue, "rabbitmq: the consumer could not be cancelled; deliveries not taken go back with the connection");
        }
    }

    /// Both channels closed, each answered by the broker (within five
    /// seconds each): every acknowledgement sent before is then in, and a
    /// connection closed next has no channel's close racing its own.
    async fn close(&self) {
        // A channel the broker already closed (the queue deleted, the
        // connection lost) has nothing to close.
        for channel in [&self.channel, &self.confirms] {
            if !channel.status().connected() {
                continue;
            }
            let closed = channel.close(REPLY_SUCCESS, "consumer stopped".into());
            match tokio::time::timeout(CLOSE_WITHIN, closed).await {
                Ok(Ok(())) => {}
                Ok(Err(error)) => {
                    tracing::warn!(%error, queue = %self.queue, "rabbitmq: a channel's close failed; what it holds goes back with the connection");
                }
                Err(_) => {
                    tracing::warn!(queue = %self.queue, within = ?CLOSE_WITHIN, "rabbitmq: a channel's close was not answered; what it holds goes back with the connection");
                }
            }
        }
    }

    /// RabbitMQ cannot extend a delivery.
    fn hold_interval(&self) -> Option<Duration> {
        None
    }

    fn ordering_key<'a>(&self, received: &'a RabbitMqDelivery) -> Option<Cow<'a, str>> {
        let name = self.ordering_header.as_deref()?;
        received.header(name).map(Cow::Borrowed)
    }

    async fn ack(&self, received: &RabbitMqDelivery, _: Acked) -> Result<(), BrokerError> {
        received
            .delivery
            .ack(BasicAckOptions::default())
            .await
            .map(drop)
            .map_err(Into::into)
    }

    /// After `after`, requeued (`basic.nack`): RabbitMQ has no delay of
    /// its own.
    async fn give_back(
        &self,
        received: &RabbitMqDelivery,
        after: Duration,
    ) -> Result<(), BrokerError> {
        tokio::time::sleep(after).await;
        let requeue = BasicNackOptions {
            requeue: true,
            multiple: false,
        };
        received
            .delivery
            .nack(requeue)
            .await
            .map(drop)
            .map_err(Into::into)
    }

    async fn dead_letter(
        &self,
        received: &RabbitMqDelivery,
        reason: &DeadLetterReason,
    ) -> Result<DeadLettered, BrokerError> {
        let mut headers = FieldTable::default();
        let origin = Origin {
            source: &self.queue,
            partition: None,
            position: None,
        };
        for (name, value) in reason.headers(&origin, HeaderStyle::Amqp) {
            headers.insert(
                ShortString::from(name),
                AMQPValue::LongString(LongString::from(value)),
            );
        }
        let properties = BasicProperties::default()
            .with_delivery_mode(2)
            .with_headers(headers);
        let confirm = self
            .confirms
            .basic_publish(
                "".into(),
                self.dead_letters.as_str().into(),
                BasicPublishOptions::default(),
                &received.delivery.data,
                properties,
            )
            .await?
            .await?;
        if confirm.is_ack() {
            Ok(DeadLettered::Moved)
        } else {
            Err(format!(
                "the broker refused the dead letter to {}",
                self.dead_letters
            )
            .into())
        }
    }
}

impl RabbitMq {
    fn received(&self, delivery: Delivery) -> RabbitMqDelivery {
        // A quorum queue counts the deliveries before this one.
        let count = match delivery
            .properties
            .headers()
            .as_ref()
            .and_then(|headers| headers.inner().get("x-delivery-count"))
        {
            Some(AMQPValue::LongLongInt(n)) => u64::try_from(*n).ok(),
            Some(AMQPValue::LongInt(n)) => u64::try_from(*n).ok(),
            Some(AMQPValue::LongUInt(n)) => Some(u64::from(*n)),
            Some(AMQPValue::ShortInt(n)) => u64::try_from(*n).ok(),
            _ => None,
        };
        // No count: its first delivery.
        let last = self
            .delivery_limit
            .is_some_and(|limit| count.unwrap_or(0) >= limit);
        RabbitMqDelivery { delivery, last }
    }
}

/// The outbox's publisher to RabbitMQ: each message to the queue its
/// destination names (through the default exchange), persistent and
/// mandatory, its id as the `message-id` property, its headers as AMQP
/// headers, its ordering key as `ordering-key`, confirmed by the broker. A
/// queue that does not exist refuses the message (returned unroutable). The
/// publisher owns its connection: one that fails (the broker restarted, the
/// channel closed) answers unavailable, and the next publication connects
/// again. RabbitMQ does not deduplicate: a resend is the consumer's to
/// absorb, by its own idempotency.
///
/// # Examples
///
/// ```no_run
/// use tower_idempotency_rabbitmq::RabbitMqPublisher;
///
/// let publisher = RabbitMqPublisher::new("amqp://guest:guest@127.0.0.1:5672/%2f");
/// # let _ = publisher;
/// ```
pub struct RabbitMqPublisher {
    url: String,
    /// The connection and its confirming channel, while they work.
    open: Mutex<Option<(Connection, Channel)>>,
}

impl fmt::Debug for RabbitMqPublisher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitMqPublisher").finish_non_exhaustive()
    }
}

impl RabbitMqPublisher {
    /// Publishes to the broker at `url` (`amqp://user:password@host:port/vhost`),
    /// connecting on the first publication.
    ///
    /// # Examples
    ///
    /// See [`RabbitMqPublisher`].
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            open: Mutex::new(None),
        }
    }

    /// Connects now (to fail at start-up on a wrong URL).
    ///
    /// # Errors
    ///
    /// The broker's.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), tower_idempotency_rabbitmq::lapin::Error> {
    /// let publisher = tower_idempotency_rabbitmq::RabbitMqPublisher::new("amqp://127.0.0.1:5672/%2f");
    /// publisher.connect().await?;
    /// # Ok(()) }
    /// ```
    pub async fn connect(&self) -> Result<(), lapin::Error> {
        let mut open = self.open.lock().await;
        if open.is_none() {
            *open = Some(self.open_channel().await?);
        }
        Ok(())
    }

    async fn open_channel(&self) -> Result<(Connection, Channel), lapin::Error> {
        let connection = Connection::connect(&self.url, ConnectionProperties::default()).await?;
        let channel = connection.create_channel().await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        Ok((connection, channel))
    }
}

impl Publisher for RabbitMqPublisher {
    async fn publish(&self, message: &OutboxMessage) -> Result<(), PublishError> {
        let unavailable = |e: String| PublishError::Unavailable(e.into());
        let channel = {
            let mut open = self.open.lock().await;
            if open.as_ref().is_some_and(|(connection, channel)| {
                !connection.status().connected() || !channel.status().connected()
            }) {
                tracing::warn!("the RabbitMQ connection is gone; connecting again");
                *open = None;
            }
            if open.is_none() {
                *open = Some(
                    self.open_channel()
                        .await
                        .map_err(|e| unavailable(e.to_string()))?,
                );
            }
            open.as_ref().expect("just opened").1.clone()
        };
        let mut headers = FieldTable::default();
        for (name, value) in &message.headers {
            headers.insert(
                name.as_str().into(),
                AMQPValue::LongString(value.as_str().into()),
            );
        }
        if let Some(key) = &message.ordering_key {
            headers.insert(
                "ordering-key".into(),
                AMQPValue::LongString(key.as_str().into()),
            );
        }
        let properties = BasicProperties::default()
            .with_delivery_mode(2)
            .with_message_id(ShortString::from(message.id.as_str()))
            .with_headers(headers);
        let published = async {
            channel
                .basic_publish(
                    "".into(),
                    message.destination.as_str().into(),
                    BasicPublishOptions {
                        mandatory: true,
                        ..BasicPublishOptions::default()
                    },
                    &message.payload,
                    properties,
                )
                .await?
                .await
        }
        .await;
        match published {
            Ok(Confirmation::Ack(None)) => Ok(()),
            Ok(Confirmation::Ack(Some(_))) => Err(PublishError::Refused(format!(
                "no queue {} (returned unroutable)",
                message.destination
            ))),
            Ok(other) => Err(unavailable(format!(
                "the broker did not confirm: {other:?}"
            ))),
            Err(error) => {
                // The next publication connects again.
                *self.open.lock().await = None;
                Err(unavailable(error.to_string()))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Probe;

    /// RabbitMQ 3.10's refusals, as the broker words them.
    #[test]
    fn a_refused_quorum_declaration_says_what_the_queue_is() {
        assert_eq!(
            Probe::of_refusal(
                "PRECONDITION_FAILED - inequivalent arg 'x-delivery-limit' for queue 'q' in vhost '/': received none but current is the value '2' of type 'signedint'"
            ),
            Probe::Limit(2)
        );
        assert_eq!(
            Probe::of_refusal(
                "PRECONDITION_FAILED - inequivalent arg 'x-queue-type' for queue 'q' in vhost '/': received the value 'quorum' of type 'longstr' but current is none"
            ),
            Probe::NotQuorum
        );
        assert!(matches!(
            Probe::of_refusal(
                "PRECONDITION_FAILED - inequivalent arg 'x-max-length' for queue 'q' in vhost '/': received none but current is the value '10' of type 'signedint'"
            ),
            Probe::Unknown(_)
        ));
    }
}
