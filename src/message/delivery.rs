//! The broker's hold on a delivery, kept while its work runs: without it, a
//! job longer than the broker's timeout (SQS's visibility timeout,
//! JetStream's `AckWait`) is handed to a second consumer mid-work.

use std::{future::Future, time::Duration};

use futures_util::future::{Either, select};

/// What `extend` fails with: the broker's own error, boxed.
pub type ExtendError = Box<dyn std::error::Error + Send + Sync>;

/// A broker's hold on one delivery, which
/// [`IdempotencyProcessor::process_delivery`](super::IdempotencyProcessor::process_delivery)
/// extends every [`interval`](Self::interval) while the message's work
/// runs: on SQS, `ChangeMessageVisibility` back to the visibility timeout;
/// on JetStream, an "in progress" acknowledgement (`AckKind::Progress`),
/// which restarts `AckWait`.
///
/// Choose an interval well inside the broker's timeout (a third of it
/// leaves room for two late or failed extensions). An extension that fails
/// is logged and the work goes on: the store's claim still keeps a second
/// delivery from running it alongside, it only answers
/// [`InFlight`](super::ProcessOutcome::InFlight).
///
/// [`extend_every`] makes one from a closure.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::message::{DeliveryLease, ExtendError};
///
/// /// A JetStream-like delivery: `AckWait` of 30 s.
/// struct Delivery;
///
/// impl DeliveryLease for Delivery {
///     fn interval(&self) -> Duration {
///         Duration::from_secs(10)
///     }
///
///     async fn extend(&self) -> Result<(), ExtendError> {
///         // message.ack_with(AckKind::Progress).await
///         Ok(())
///     }
/// }
/// ```
pub trait DeliveryLease: Send + Sync {
    /// How often to extend the hold while the work runs; `Duration::MAX`
    /// for never (a broker that cannot extend a delivery, such as
    /// RabbitMQ).
    fn interval(&self) -> Duration;

    /// Extends the hold by the broker's timeout, from now.
    fn extend(&self) -> impl Future<Output = Result<(), ExtendError>> + Send;
}

/// A [`DeliveryLease`] made of a closure: see [`extend_every`].
#[derive(Clone, Debug)]
pub struct ExtendEvery<F> {
    interval: Duration,
    extend: F,
}

/// A [`DeliveryLease`] that calls `extend` every `interval` while the work
/// runs.
///
/// # Examples
///
/// ```
/// # async fn demo(orders: tower_idempotency::message::IdempotencyProcessor<tower_idempotency::MemoryStore>) -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// use tower_idempotency::message::extend_every;
///
/// // An SQS message received with a 30 s visibility timeout.
/// let hold = extend_every(Duration::from_secs(10), || async {
///     // sqs.change_message_visibility().receipt_handle(…).visibility_timeout(30).send().await?;
///     Ok(())
/// });
/// let payload = br#"{"order_id":"order-42","amount":1999}"#;
/// orders
///     .process_delivery("order-42", payload, &hold, async |_: &mut _| {
///         Ok::<_, std::io::Error>("charged".to_owned())
///     })
///     .await?;
/// # Ok(()) }
/// ```
///
/// # Panics
///
/// When `interval` is zero.
pub fn extend_every<F, Fut>(interval: Duration, extend: F) -> ExtendEvery<F>
where
    F: Fn() -> Fut + Send + Sync,
    Fut: Future<Output = Result<(), ExtendError>> + Send,
{
    assert!(
        !interval.is_zero(),
        "extend_every: the interval must not be zero"
    );
    ExtendEvery { interval, extend }
}

impl<F, Fut> DeliveryLease for ExtendEvery<F>
where
    F: Fn() -> Fut + Send + Sync,
    Fut: Future<Output = Result<(), ExtendError>> + Send,
{
    fn interval(&self) -> Duration {
        self.interval
    }

    fn extend(&self) -> impl Future<Output = Result<(), ExtendError>> + Send {
        (self.extend)()
    }
}

/// No hold to keep: a delivery the broker cannot extend (RabbitMQ's), or
/// none at all ([`IdempotencyProcessor::process`](super::IdempotencyProcessor::process)).
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::message::{DeliveryLease, NoHold};
///
/// assert_eq!(NoHold.interval(), Duration::MAX);
/// ```
#[derive(Clone, Copy, Debug, Default)]
pub struct NoHold;

impl DeliveryLease for NoHold {
    fn interval(&self) -> Duration {
        Duration::MAX
    }

    async fn extend(&self) -> Result<(), ExtendError> {
        Ok(())
    }
}

/// One delivery of a message, as the broker handed it over: its business
/// key, its payload, the broker's hold on it, whether the broker will
/// deliver it again, and where it came from (for telemetry). What
/// [`IdempotencyProcessor::settle`](super::IdempotencyProcessor::settle)
/// settles.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::message::{Delivery, extend_every};
///
/// let payload = br#"{"order_id":"order-42","amount":1999}"#;
/// // JetStream: `AckWait` 30 s, `MaxDeliver` 5, the 5th delivery.
/// let hold = extend_every(Duration::from_secs(10), || async { Ok(()) });
/// let delivery = Delivery::new("order-42", payload)
///     .held_by(&hold)
///     .last(5 >= 5)
///     .messaging_system("nats")
///     .destination("orders")
///     .message_id("ORDERS.42");
/// # let _ = delivery;
/// ```
#[derive(Clone, Copy, Debug)]
pub struct Delivery<'a, L = NoHold> {
    pub(super) key: &'a str,
    pub(super) payload: &'a [u8],
    pub(super) hold: &'a L,
    pub(super) last: bool,
    pub(super) source: Source<'a>,
}

/// Where a delivery came from: OpenTelemetry's messaging attributes of its
/// span.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Source<'a> {
    pub(super) system: Option<&'a str>,
    pub(super) destination: Option<&'a str>,
    pub(super) message_id: Option<&'a str>,
    /// The W3C trace context the message carried (`traceparent`,
    /// `tracestate`).
    pub(super) trace: (Option<&'a str>, Option<&'a str>),
}

impl<'a> Delivery<'a> {
    /// The delivery of the message `key` (its business key: an order id,
    /// never a delivery id) carrying `payload`, with no hold to extend, and
    /// not the broker's last.
    ///
    /// # Examples
    ///
    /// See [`Delivery`].
    pub fn new(key: &'a str, payload: &'a [u8]) -> Self {
        static NO_HOLD: NoHold = NoHold;
        Self {
            key,
            payload,
            hold: &NO_HOLD,
            last: false,
            source: Source::default(),
        }
    }
}

impl<'a, L: DeliveryLease> Delivery<'a, L> {
    /// The broker's hold on this delivery, extended while it is kept in
    /// hand: through its work, and through the waits between attempts.
    ///
    /// # Examples
    ///
    /// See [`Delivery`].
    pub fn held_by<L2: DeliveryLease>(self, hold: &'a L2) -> Delivery<'a, L2> {
        Delivery {
            key: self.key,
            payload: self.payload,
            hold,
            last: self.last,
            source: self.source,
        }
    }

    /// Whether the broker will not deliver it again once given back (its
    /// delivery count has reached SQS's `maxReceiveCount` or JetStream's
    /// `MaxDeliver`): then an undecided delivery that must be given back is
    /// dead-lettered instead, as
    /// [`DeadLetterReason::Undecided`](super::DeadLetterReason::Undecided),
    /// so that the broker never drops it.
    ///
    /// # Examples
    ///
    /// See [`Delivery`].
    pub fn last(mut self, last: bool) -> Self {
        self.last = last;
        self
    }

    /// The broker, as OpenTelemetry names it (`messaging.system`:
    /// `"aws_sqs"`, `"rabbitmq"`, `"kafka"`; `"nats"` for NATS): an
    /// attribute of the delivery's span.
    ///
    /// # Examples
    ///
    /// See [`Delivery`].
    pub fn messaging_system(mut self, system: &'a str) -> Self {
        self.source.system = Some(system);
        self
    }

    /// The queue, stream or subject it was delivered from
    /// (`messaging.destination.name`): the span's attribute, and its name,
    /// `process {destination}`.
    ///
    /// # Examples
    ///
    /// See [`Delivery`].
    pub fn destination(mut self, destination: &'a str) -> Self {
        self.source.destination = Some(destination);
        self
    }

    /// The broker's id of the message (`messaging.message.id`: SQS's
    /// `MessageId`, AMQP's `message-id`, JetStream's stream sequence). Only
    /// for telemetry: the business key, never this id, decides duplicates.
    ///
    /// # Examples
    ///
    /// See [`Delivery`].
    pub fn message_id(mut self, id: &'a str) -> Self {
        self.source.message_id = Some(id);
        self
    }

    /// The W3C trace context the message carries (its `traceparent` and
    /// `tracestate` headers, as the outbox writes them): the delivery's
    /// span continues that trace, through the application's global
    /// propagator, with the `opentelemetry` feature (without it, this is
    /// kept and unused).
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::message::Delivery;
    ///
    /// let delivery = Delivery::new("order-42", b"{}")
    ///     .trace_context(Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"), None);
    /// # let _ = delivery;
    /// ```
    pub fn trace_context(
        mut self,
        traceparent: Option<&'a str>,
        tracestate: Option<&'a str>,
    ) -> Self {
        self.source.trace = (traceparent, tracestate);
        self
    }
}

/// Runs `work`, extending `lease` every interval until it ends; the
/// extensions run beside the work, never pausing it.
pub(super) async fn keeping<L: DeliveryLease, F: Future>(
    lease: &L,
    key: &(dyn std::fmt::Display + Sync),
    work: F,
) -> F::Output {
    let interval = lease.interval();
    if interval == Duration::MAX {
        return work.await;
    }
    let extending = async {
        loop {
            tokio::time::sleep(interval).await;
            if let Err(error) = lease.extend().await {
                tracing::warn!(%key, %error, "idempotency: the broker's hold on a delivery could not be extended; the work goes on under its claim");
            }
        }
    };
    let (work, extending) = (std::pin::pin!(work), std::pin::pin!(extending));
    match select(work, extending).await {
        Either::Left((output, _)) => output,
        Either::Right(((), _)) => unreachable!("the extensions never end"),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;

    /// The extensions run beside the work (they do not pause it) and stop
    /// when it ends.
    #[tokio::test(start_paused = true)]
    async fn the_hold_is_extended_every_interval_while_the_work_runs_and_not_after() {
        let extended = AtomicU32::new(0);
        let hold = extend_every(Duration::from_secs(10), || async {
            extended.fetch_add(1, Ordering::SeqCst);
            // A slow broker: the work does not wait for it.
            tokio::time::sleep(Duration::from_secs(3)).await;
            Ok(())
        });
        let started = tokio::time::Instant::now();
        let out = keeping(&hold, &"k", async {
            tokio::time::sleep(Duration::from_secs(95)).await;
            "done"
        })
        .await;
        assert_eq!(out, "done");
        assert_eq!(started.elapsed(), Duration::from_secs(95));
        // At 10, 23, 36, 49, 62, 75, 88 s (each 3 s extension, then 10 s).
        assert_eq!(extended.load(Ordering::SeqCst), 7);
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert_eq!(extended.load(Ordering::SeqCst), 7, "not after the work");
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_extension_does_not_stop_the_work() {
        let tried = AtomicU32::new(0);
        let hold = extend_every(Duration::from_secs(1), || async {
            tried.fetch_add(1, Ordering::SeqCst);
            Err::<(), ExtendError>("receipt handle expired".into())
        });
        let out = keeping(&hold, &"k", async {
            tokio::time::sleep(Duration::from_millis(3500)).await;
            7
        })
        .await;
        assert_eq!(out, 7);
        assert_eq!(tried.load(Ordering::SeqCst), 3);
    }
}
