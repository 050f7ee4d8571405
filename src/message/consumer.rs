//! The consumer loop, written once for every broker: receive, hold each
//! delivery from the moment it is in hand, run one ordering key's
//! deliveries one after the other (keys side by side), settle, answer the
//! broker, dead-letter with the reason, drain on shutdown. A broker is an
//! adapter of [`Broker`]; the application writes only the work.

use std::{
    borrow::Cow,
    collections::{HashMap, HashSet},
    fmt,
    future::Future,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use futures_util::{
    FutureExt, StreamExt,
    future::{Fuse, FusedFuture},
    stream::FuturesUnordered,
};
use serde::{Serialize, de::DeserializeOwned};
use tokio::sync::oneshot;

use super::{
    DeadLetterReason, Delivery, DeliveryLease, Disposition, ExtendError, IdempotencyProcessor,
    ProcessError, ProcessOutcome, Settled,
};
use crate::{fingerprint::PayloadFingerprint, lock::lock, observe, store::Store};

/// What a broker's adapter failed at, said plainly: the broker out of
/// reach, a refusal, the subscription gone.
pub type BrokerError = Box<dyn std::error::Error + Send + Sync>;

/// How long an idle loop's receive waits for a first delivery, at most,
/// where a shutdown can drop it ([`Broker::receive_is_cancel_safe`]).
const LONG_POLL: Duration = Duration::from_secs(20);

/// How long an idle loop's receive waits where a shutdown must let it end
/// (what it takes from the broker is in hand): the bound on an idle
/// consumer's stop.
const IDLE_POLL: Duration = Duration::from_secs(2);

/// One delivery a broker handed over, as the consumer loop reads it.
pub trait Received: Send + Sync + 'static {
    /// The message's bytes.
    fn payload(&self) -> &[u8];

    /// A header (an attribute, an AMQP or Kafka header) by name, if the
    /// message has it and it is text.
    fn header(&self, name: &str) -> Option<&str>;

    /// The broker's id of the message, for telemetry and for saying which
    /// one an invalid message was (never for deciding duplicates).
    fn message_id(&self) -> Option<Cow<'_, str>>;

    /// Whether the broker will not deliver it again once it is given back
    /// (its delivery count has reached the broker's budget).
    fn last(&self) -> bool {
        false
    }
}

/// Why a delivery is acknowledged: for a broker whose acknowledgement is a
/// position stored with the work (Kafka), an execution stored it already.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Acked {
    /// The work ran now, and its transaction committed.
    Executed,
    /// Nothing ran now: a duplicate, or a message moved to the
    /// dead-letter target.
    Decided,
}

/// Where a dead letter went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeadLettered {
    /// To the broker's dead-letter target, with its reason: the delivery
    /// can be acknowledged.
    Moved,
    /// The broker has no dead-letter target: the adapter kept the message
    /// (out of sight for a while, logged as an error), never deleted it.
    Kept,
}

/// A broker, as the consumer loop drives it: one adapter per broker (SQS,
/// JetStream, RabbitMQ, Kafka — the crate family's `tower-idempotency-*`
/// crates), or your own.
///
/// An adapter answers for what only it can know — how to receive, hold,
/// acknowledge, give back and dead-letter a delivery — and nothing else:
/// what to do with each delivery is decided once, by
/// [`IdempotencyProcessor::settle`], and the loop applies it.
pub trait Broker: Send + Sync + 'static {
    /// A delivery, as the adapter receives it.
    type Received: Received;

    /// The broker, as OpenTelemetry names it (`messaging.system`:
    /// `aws_sqs`, `nats`, `rabbitmq`, `kafka`).
    fn system(&self) -> &'static str;

    /// The queue, stream or topic consumed (`messaging.destination.name`).
    fn destination(&self) -> &str;

    /// Receives up to `room` deliveries, waiting for a first one for at
    /// most `within` (a long poll; an empty batch when none came). Unless
    /// the receive is [cancel safe](Self::receive_is_cancel_safe), the loop
    /// never drops it halfway — what the broker handed out is in hand, and
    /// worked — so `within` bounds how long a shutdown waits: two seconds
    /// while the loop is idle, one while it has work in hand. An error ends
    /// the loop: the subscription is gone, or the broker cannot be reached
    /// (a passing failure is the adapter's to retry).
    fn receive(
        &self,
        room: usize,
        within: Duration,
    ) -> impl Future<Output = Result<Vec<Self::Received>, BrokerError>> + Send;

    /// Whether a [`receive`](Self::receive) may be dropped halfway without
    /// losing what it fetched: the adapter takes deliveries from a buffer
    /// of its own that the broker's client fills (RabbitMQ's consumer
    /// stream, Kafka's poller), so the receive itself takes nothing from
    /// the broker. Then an idle loop waits for the broker's longest poll,
    /// and a shutdown drops it at once. Default `false`: a receive is a
    /// request to the broker (an SQS `ReceiveMessage`, a JetStream pull),
    /// whose deliveries would be lost in flight — counted by the broker as
    /// received, and their budget spent — were it dropped.
    fn receive_is_cancel_safe(&self) -> bool {
        false
    }

    /// Called at shutdown, before the loop's last receive, where the
    /// receive is [cancel safe](Self::receive_is_cancel_safe): stop the
    /// broker's deliveries (RabbitMQ: `basic.cancel`). What the broker
    /// delivered before that — counted by it as delivered — is then taken
    /// by one last receive (`within` zero) and in hand, never left in a
    /// buffer that the connection's close would give back.
    fn stop_receiving(&self) -> impl Future<Output = ()> + Send {
        async {}
    }

    /// How often a delivery in hand must be extended (a third of SQS's
    /// visibility timeout, of JetStream's `AckWait`); `None` where the
    /// broker cannot extend one (RabbitMQ) or needs nothing (Kafka).
    fn hold_interval(&self) -> Option<Duration>;

    /// Extends the broker's hold on `received` by its timeout, from now.
    fn extend(
        &self,
        received: &Self::Received,
    ) -> impl Future<Output = Result<(), ExtendError>> + Send {
        let _ = received;
        async { Ok(()) }
    }

    /// The ordering key of `received` (an SQS FIFO group, a Kafka
    /// partition, an ordering header): deliveries with one key are
    /// settled one after the other, in the order received. `None`: on its
    /// own.
    fn ordering_key<'a>(&self, received: &'a Self::Received) -> Option<Cow<'a, str>>;

    /// Acknowledges: done with — executed now (its work's transaction
    /// committed), or decided before (a duplicate, a dead letter moved):
    /// see [`Acked`].
    fn ack(
        &self,
        received: &Self::Received,
        acked: Acked,
    ) -> impl Future<Output = Result<(), BrokerError>> + Send;

    /// Whether `received` is still this consumer's to settle when its
    /// turn comes (default: always). A Kafka partition revoked by a
    /// rebalance is not: its deliveries not yet started are dropped
    /// unanswered, for the partition's new owner to take from the stored
    /// position.
    fn owns(&self, received: &Self::Received) -> bool {
        let _ = received;
        true
    }

    /// Gives `received` back, to be delivered again after `after`.
    fn give_back(
        &self,
        received: &Self::Received,
        after: Duration,
    ) -> impl Future<Output = Result<(), BrokerError>> + Send;

    /// Moves `received` to the dead-letter target with `reason` (the
    /// payload byte for byte), and says where it went; the loop then
    /// acknowledges a message moved. A failure is retried in hand.
    fn dead_letter(
        &self,
        received: &Self::Received,
        reason: &DeadLetterReason,
    ) -> impl Future<Output = Result<DeadLettered, BrokerError>> + Send;

    /// Called once the loop has answered its last delivery, before it
    /// returns: send what is buffered (acknowledgements published without
    /// waiting), let go of the subscription.
    fn close(&self) -> impl Future<Output = ()> + Send {
        async {}
    }
}

/// What the consumer's work gets to know of a delivery before running:
/// its business key and the message the work reads.
#[derive(Debug)]
pub struct Parsed<M> {
    /// The business key (an order id — never the broker's message id).
    pub key: String,
    /// The message, as the work reads it.
    pub message: M,
}

/// What became of one delivery, for the application's own report (a log
/// line, a count): see [`Consumer::on_settled`].
#[non_exhaustive]
pub struct Report<'a, R, M, T, E> {
    /// The delivery.
    pub received: &'a R,
    /// Its business key and message, unless it was not a valid message or
    /// was given back unread at shutdown (its disposition then says
    /// [`Disposition::Retry`]).
    pub parsed: Option<&'a Parsed<M>>,
    /// What the broker was told.
    pub disposition: &'a Disposition,
    /// What the last attempt came to (`None` for an invalid message, or
    /// one given back unstarted at shutdown).
    pub outcome: Option<&'a Result<ProcessOutcome<T>, ProcessError<E>>>,
}

impl<R, M, T, E> fmt::Debug for Report<'_, R, M, T, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Report")
            .field("disposition", &self.disposition)
            .finish_non_exhaustive()
    }
}

type OnSettled<R, M, T, E> = Box<dyn Fn(&Report<'_, R, M, T, E>) + Send + Sync>;

/// The consumer loop over one broker: see the [module docs](super) and
/// [`Broker`].
///
/// # Examples
///
/// A consumer over an adapter (`broker`), charging each order once:
///
/// ```no_run
/// # async fn demo<B: tower_idempotency::message::Broker>(broker: B) -> Result<(), tower_idempotency::message::BrokerError> {
/// use tower_idempotency::{MemoryStore, message::{Consumer, DeadLetterReason, IdempotencyProcessor, Parsed}};
///
/// #[derive(serde::Deserialize)]
/// struct Order { order_id: String, amount: i64 }
///
/// let orders = IdempotencyProcessor::new(MemoryStore::new()).scope("orders");
/// Consumer::new(broker, orders)
///     .run(
///         |payload: &[u8]| {
///             let order: Order = serde_json::from_slice(payload).map_err(|e| DeadLetterReason::invalid(e.to_string()))?;
///             Ok(Parsed { key: order.order_id.clone(), message: order })
///         },
///         async |_tx: &mut _, order: &Order| Ok::<_, std::io::Error>(order.amount),
///         async { tokio::signal::ctrl_c().await.ok(); },
///     )
///     .await
/// # }
/// ```
pub struct Consumer<B: Broker, St, F, M, T, E> {
    broker: Arc<B>,
    processor: IdempotencyProcessor<St, F>,
    in_hand: usize,
    passing: Box<dyn Fn(&E) -> bool + Send + Sync>,
    on_settled: Option<OnSettled<B::Received, M, T, E>>,
}

impl<B: Broker, St, F, M, T, E> fmt::Debug for Consumer<B, St, F, M, T, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Consumer")
            .field("destination", &self.broker.destination())
            .field("in_hand", &self.in_hand)
            .finish_non_exhaustive()
    }
}

impl<B, St, F, M, T, E> Consumer<B, St, F, M, T, E>
where
    B: Broker,
    St: Store,
    F: PayloadFingerprint,
    M: Send + Sync,
    T: Serialize + DeserializeOwned,
    E: fmt::Display,
{
    /// The loop over `broker`, settling each delivery with `processor`: at
    /// most 10 deliveries in hand at once; every failure of the work
    /// judged passing (retried in hand: see
    /// [`passing_when`](Self::passing_when)).
    ///
    /// # Examples
    ///
    /// See [`Consumer`].
    pub fn new(broker: B, processor: IdempotencyProcessor<St, F>) -> Self {
        Self {
            broker: Arc::new(broker),
            processor,
            in_hand: 10,
            passing: Box::new(|_| true),
            on_settled: None,
        }
    }

    /// The broker's adapter.
    pub fn broker(&self) -> &B {
        &self.broker
    }

    /// The most deliveries in hand at once (received and not answered yet,
    /// each held): keys side by side up to this many; a key's own one
    /// after the other (default 10).
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # fn demo<B: tower_idempotency::message::Broker>(consumer: tower_idempotency::message::Consumer<B, tower_idempotency::MemoryStore, tower_idempotency::DefaultFingerprint, (), (), std::io::Error>) {
    /// let consumer = consumer.in_hand(32);
    /// # let _ = consumer; }
    /// ```
    pub fn in_hand(mut self, deliveries: usize) -> Self {
        self.in_hand = deliveries.max(1);
        self
    }

    /// Which failures of the work may pass (retried in hand, the broker's
    /// budget unspent) — the others can never succeed, and are
    /// dead-lettered with their error as the reason. Default: every
    /// failure may pass, so nothing is dead-lettered for a fault that
    /// heals; a failure this payload always meets (a constraint it
    /// breaks) should be judged permanent.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # fn demo<B: tower_idempotency::message::Broker>(consumer: tower_idempotency::message::Consumer<B, tower_idempotency::MemoryStore, tower_idempotency::DefaultFingerprint, (), (), std::io::Error>) {
    /// // A card processor's timeout may pass; anything else will not.
    /// let consumer = consumer.passing_when(|error| error.kind() == std::io::ErrorKind::TimedOut);
    /// # let _ = consumer; }
    /// ```
    pub fn passing_when(mut self, passing: impl Fn(&E) -> bool + Send + Sync + 'static) -> Self {
        self.passing = Box::new(passing);
        self
    }

    /// Called once per delivery, after the broker was answered: what
    /// became of it (a log line, a count).
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # fn demo<B: tower_idempotency::message::Broker>(consumer: tower_idempotency::message::Consumer<B, tower_idempotency::MemoryStore, tower_idempotency::DefaultFingerprint, (), (), std::io::Error>) {
    /// let consumer = consumer.on_settled(|report| println!("{}", report.disposition));
    /// # let _ = consumer; }
    /// ```
    pub fn on_settled(
        mut self,
        report: impl Fn(&Report<'_, B::Received, M, T, E>) + Send + Sync + 'static,
    ) -> Self {
        self.on_settled = Some(Box::new(report));
        self
    }

    /// Runs until `shutdown` completes (SIGTERM) or the broker ends the
    /// subscription:
    ///
    /// 1. receives while fewer than [`in_hand`](Self::in_hand) deliveries
    ///    are in hand, and holds each from that moment (its broker's
    ///    extension every [`hold_interval`](Broker::hold_interval)) until it
    ///    is answered — waiting for its turn included;
    /// 2. `parse` reads each delivery's business key and message; what it
    ///    refuses is dead-lettered as invalid, never retried;
    /// 3. deliveries with one [ordering key](Broker::ordering_key) are
    ///    settled one after the other, in the order received; others side
    ///    by side;
    /// 4. each is settled by the processor with `work` (what can pass is
    ///    retried in hand, what can never succeed dead-lettered with a true
    ///    reason), and the broker answered; a dead-letter move that fails is
    ///    retried in hand, never given back on the broker's last delivery;
    /// 5. at `shutdown`, it stops receiving (a receive in flight that is not
    ///    [cancel safe](Broker::receive_is_cancel_safe) runs to its end, and
    ///    what it brought is in hand), finishes the work in hand and answers
    ///    it, and gives back at once what waits — for its key's turn, or
    ///    between attempts (on its broker's last delivery, dead-lettered as
    ///    undecided instead, never dropped) — then returns `Ok`: an idle
    ///    loop within two seconds.
    ///
    /// # Errors
    ///
    /// The broker's, when it ended the subscription or cannot be reached:
    /// the deliveries in hand were answered or given back first.
    ///
    /// # Examples
    ///
    /// See [`Consumer`].
    pub async fn run<P, W>(
        self,
        parse: P,
        work: W,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), BrokerError>
    where
        P: Fn(&[u8]) -> Result<Parsed<M>, DeadLetterReason>,
        W: AsyncFn(&mut St::Granted, &M) -> Result<T, E>,
    {
        self.run_received(
            |received| parse(received.payload()),
            async |tx: &mut St::Granted, _: &B::Received, message: &M| work(tx, message).await,
            shutdown,
        )
        .await
    }

    /// [`run`](Self::run), with `parse` and `work` given the whole delivery
    /// (its headers, what the adapter knows of it) as well: for an adapter
    /// whose work needs more of a delivery than its message (Kafka writes
    /// each record's position in the work's transaction).
    ///
    /// # Errors
    ///
    /// See [`run`](Self::run).
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn demo<B: tower_idempotency::message::Broker>(consumer: tower_idempotency::message::Consumer<B, tower_idempotency::MemoryStore, tower_idempotency::DefaultFingerprint, (), (), std::io::Error>) -> Result<(), tower_idempotency::message::BrokerError> {
    /// use tower_idempotency::message::{DeadLetterReason, Parsed, Received};
    ///
    /// consumer
    ///     .run_received(
    ///         |received: &B::Received| match received.header("order-id") {
    ///             Some(id) => Ok(Parsed { key: id.to_owned(), message: () }),
    ///             None => Err(DeadLetterReason::invalid("no order-id header")),
    ///         },
    ///         async |_: &mut _, _: &B::Received, _: &()| Ok(()),
    ///         std::future::pending(),
    ///     )
    ///     .await
    /// # }
    /// ```
    pub async fn run_received<P, W>(
        self,
        parse: P,
        work: W,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), BrokerError>
    where
        P: Fn(&B::Received) -> Result<Parsed<M>, DeadLetterReason>,
        W: AsyncFn(&mut St::Granted, &B::Received, &M) -> Result<T, E>,
    {
        let mut shutdown = std::pin::pin!(shutdown);
        let lanes = Lanes::default();
        let stopping = AtomicBool::new(false);
        let mut jobs = FuturesUnordered::new();
        // A receive in flight is never dropped halfway: what the broker
        // handed out is in hand, and answered (at shutdown, given back).
        let receive = Fuse::terminated();
        let mut receive = std::pin::pin!(receive);
        let mut receiving = true;
        let mut ended = None;
        loop {
            let room = self.in_hand.saturating_sub(jobs.len());
            if receiving && room > 0 && receive.is_terminated() {
                // Idle, as long as the broker's long poll where a shutdown
                // drops it, else two seconds; busy, briefly: a shutdown is
                // then held up by a second at most.
                let within = match (jobs.is_empty(), self.broker.receive_is_cancel_safe()) {
                    (true, true) => LONG_POLL,
                    (true, false) => IDLE_POLL,
                    (false, _) => Duration::from_secs(1),
                };
                receive.set(self.broker.receive(room, within).fuse());
            }
            if !receiving && receive.is_terminated() && jobs.is_empty() {
                break;
            }
            tokio::select! {
                biased;
                () = &mut shutdown, if receiving => {
                    receiving = false;
                    stopping.store(true, Ordering::SeqCst);
                    self.processor.drain();
                    if self.broker.receive_is_cancel_safe() {
                        // The receive in flight took nothing yet: dropped.
                        // What the broker delivered before it stopped is
                        // taken once more, and in hand.
                        receive.set(Fuse::terminated());
                        self.broker.stop_receiving().await;
                        let room = self.in_hand.saturating_sub(jobs.len()).max(1);
                        receive.set(self.broker.receive(room, Duration::ZERO).fuse());
                    }
                }
                Some(()) = jobs.next(), if !jobs.is_empty() => {}
                received = &mut receive, if !receive.is_terminated() => match received {
                    Ok(batch) => {
                        for received in batch {
                            let key = self
                                .broker
                                .ordering_key(&received)
                                .map(Cow::into_owned);
                            let (turn, done) = lanes.join(key.as_deref());
                            jobs.push(self.job(received, turn, done, key, &lanes, &stopping, &parse, &work));
                        }
                    }
                    Err(error) => {
                        tracing::error!(%error, destination = self.broker.destination(), "idempotency: the broker ended the subscription; answering what is in hand");
                        receiving = false;
                        stopping.store(true, Ordering::SeqCst);
                        self.processor.drain();
                        ended = Some(error);
                    }
                },
            }
        }
        self.broker.close().await;
        match ended {
            Some(error) => Err(error),
            None => Ok(()),
        }
    }

    /// One delivery, from the moment it is in hand to its answer: held
    /// throughout, its turn among its key's waited for.
    // What the loop lends each job: bundling it would build a struct per
    // delivery to take it apart again.
    #[allow(clippy::too_many_arguments)]
    async fn job<P, W>(
        &self,
        received: B::Received,
        turn: Option<oneshot::Receiver<()>>,
        done: Option<oneshot::Sender<()>>,
        key: Option<String>,
        lanes: &Lanes,
        stopping: &AtomicBool,
        parse: &P,
        work: &W,
    ) where
        P: Fn(&B::Received) -> Result<Parsed<M>, DeadLetterReason>,
        W: AsyncFn(&mut St::Granted, &B::Received, &M) -> Result<T, E>,
    {
        let hold = Hold {
            broker: &*self.broker,
            received: &received,
        };
        super::delivery::keeping(&hold, &"a delivery in hand", async {
            // Received, it is in hand and worked, a shutdown or not; one
            // that waits for its key's turn is not started yet when the
            // turn comes at a shutdown.
            let waited = turn.is_some();
            if let Some(turn) = turn {
                // The delivery before it on its key: answered, or dropped
                // with the loop.
                let _ = turn.await;
            }
            // At a shutdown, nothing behind a delivery given back on its
            // key is worked either — not even one received after it was
            // answered: acknowledged, it would pass it (Kafka's
            // acknowledgement is its partition's position).
            let stopped = stopping.load(Ordering::SeqCst);
            let unstarted = stopped && (waited || lanes.gave_back(key.as_deref()));
            if self
                .settle(&received, unstarted, stopping, parse, work)
                .await
                && stopping.load(Ordering::SeqCst)
            {
                lanes.give_back(key.as_deref());
            }
        })
        .await;
        if let Some(done) = done {
            let _ = done.send(());
        }
        lanes.leave(key.as_deref());
    }

    /// Settles one delivery whose turn it is, and answers the broker;
    /// `unstarted`: the loop is stopping, and it waited for its turn or its
    /// key had a delivery given back. Whether it was given back.
    async fn settle<P, W>(
        &self,
        received: &B::Received,
        unstarted: bool,
        stopping: &AtomicBool,
        parse: &P,
        work: &W,
    ) -> bool
    where
        P: Fn(&B::Received) -> Result<Parsed<M>, DeadLetterReason>,
        W: AsyncFn(&mut St::Granted, &B::Received, &M) -> Result<T, E>,
    {
        if !self.broker.owns(received) {
            tracing::debug!(message = ?received.message_id(), "idempotency: no longer this consumer's (a rebalance); left to its new owner");
            return false;
        }
        if unstarted && !received.last() {
            // Unstarted at shutdown: back at once, read or not. Not even an
            // invalid message is dead-lettered now: behind a record given
            // back on its partition, its acknowledgement would move a
            // position past that record (Kafka's is the partition's).
            let disposition = Disposition::Retry {
                after: Duration::ZERO,
            };
            let given_back = self
                .answer(received, &disposition, Acked::Decided, stopping)
                .await;
            self.report(received, None, &disposition, None);
            return given_back;
        }
        let parsed = match parse(received) {
            Ok(parsed) => parsed,
            Err(reason) => {
                tracing::warn!(%reason, message = ?received.message_id(), "idempotency: not a valid message; dead-lettered");
                observe::message_settled("dead_letter", reason.kind());
                let disposition = Disposition::DeadLetter(reason);
                let given_back = self
                    .answer(received, &disposition, Acked::Decided, stopping)
                    .await;
                self.report(received, None, &disposition, None);
                return given_back;
            }
        };
        if unstarted {
            // Unstarted at shutdown on its last delivery: dead-lettered as
            // undecided.
            let disposition = super::processor::handed_back(
                true,
                "received, not started when the consumer stopped",
                0,
            );
            let given_back = self
                .answer(received, &disposition, Acked::Decided, stopping)
                .await;
            self.report(received, Some(&parsed), &disposition, None);
            return given_back;
        }
        let id = received.message_id();
        let delivery = Delivery::new(&parsed.key, received.payload())
            .last(received.last())
            .messaging_system(self.broker.system())
            .destination(self.broker.destination())
            .trace_context(
                received.header("traceparent"),
                received.header("tracestate"),
            );
        let delivery = match id.as_deref() {
            Some(id) => delivery.message_id(id),
            None => delivery,
        };
        let message = &parsed.message;
        let settled: Settled<T, E> = self
            .processor
            .settle(
                delivery,
                async |tx: &mut St::Granted| work(tx, received, message).await,
                |error| (self.passing)(error),
            )
            .await;
        let acked = match &settled.outcome {
            Ok(ProcessOutcome::Executed(_)) => Acked::Executed,
            _ => Acked::Decided,
        };
        let given_back = self
            .answer(received, &settled.disposition, acked, stopping)
            .await;
        self.report(
            received,
            Some(&parsed),
            &settled.disposition,
            Some(&settled.outcome),
        );
        given_back
    }

    /// Tells the broker; a dead letter whose move fails is retried in hand
    /// (with back-off), never given back on the broker's last delivery.
    /// Whether it was given back.
    async fn answer(
        &self,
        received: &B::Received,
        disposition: &Disposition,
        acked: Acked,
        stopping: &AtomicBool,
    ) -> bool {
        let broker = &*self.broker;
        let mut given_back = matches!(disposition, Disposition::Retry { .. });
        let answered = match disposition {
            Disposition::Ack => broker.ack(received, acked).await,
            Disposition::Retry { after } => broker.give_back(received, *after).await,
            Disposition::DeadLetter(reason) => {
                let mut backoff = Duration::from_millis(200);
                loop {
                    match broker.dead_letter(received, reason).await {
                        Ok(DeadLettered::Moved) => {
                            break broker.ack(received, Acked::Decided).await;
                        }
                        Ok(DeadLettered::Kept) => break Ok(()),
                        Err(error) if stopping.load(Ordering::SeqCst) && !received.last() => {
                            tracing::error!(%error, "idempotency: the dead-letter move failed while stopping; given back, to be moved on its next delivery");
                            given_back = true;
                            break broker.give_back(received, Duration::ZERO).await;
                        }
                        Err(error) => {
                            tracing::error!(%error, ?backoff, "idempotency: the dead-letter move failed; the message is kept in hand and tried again");
                            tokio::time::sleep(backoff).await;
                            backoff = (backoff * 2).min(Duration::from_secs(30));
                        }
                    }
                }
            }
        };
        if let Err(error) = answered {
            // Redelivered then: a duplicate, or tried again.
            tracing::warn!(%error, disposition = disposition.name(), "idempotency: the broker's answer failed");
        }
        given_back
    }

    fn report(
        &self,
        received: &B::Received,
        parsed: Option<&Parsed<M>>,
        disposition: &Disposition,
        outcome: Option<&Result<ProcessOutcome<T>, ProcessError<E>>>,
    ) {
        if let Some(report) = &self.on_settled {
            report(&Report {
                received,
                parsed,
                disposition,
                outcome,
            });
        }
    }
}

/// A delivery's hold, as the processor's keeping extends it.
struct Hold<'a, B: Broker> {
    broker: &'a B,
    received: &'a B::Received,
}

impl<B: Broker> DeliveryLease for Hold<'_, B> {
    fn interval(&self) -> Duration {
        self.broker.hold_interval().unwrap_or(Duration::MAX)
    }

    fn extend(&self) -> impl Future<Output = Result<(), ExtendError>> + Send {
        self.broker.extend(self.received)
    }
}

/// Each ordering key's turn: a delivery waits for the one received before
/// it on its key. Holds only keys with a delivery in hand, and the keys
/// with a delivery given back at the shutdown.
#[derive(Default)]
struct Lanes {
    lanes: Mutex<HashMap<String, Lane>>,
    given_back: Mutex<HashSet<String>>,
}

struct Lane {
    /// Resolves once the key's last delivery in hand is answered.
    last: oneshot::Receiver<()>,
    in_hand: usize,
}

impl Lanes {
    /// A place on `key`'s lane: what to wait for before settling, and what
    /// to resolve when done.
    fn join(
        &self,
        key: Option<&str>,
    ) -> (Option<oneshot::Receiver<()>>, Option<oneshot::Sender<()>>) {
        let Some(key) = key else {
            return (None, None);
        };
        let (done, last) = oneshot::channel();
        let mut lanes = lock(&self.lanes);
        let turn = match lanes.get_mut(key) {
            Some(lane) => {
                lane.in_hand += 1;
                Some(std::mem::replace(&mut lane.last, last))
            }
            None => {
                lanes.insert(key.to_owned(), Lane { last, in_hand: 1 });
                None
            }
        };
        (turn, Some(done))
    }

    /// A delivery of `key` was given back at the shutdown.
    fn give_back(&self, key: Option<&str>) {
        if let Some(key) = key {
            lock(&self.given_back).insert(key.to_owned());
        }
    }

    /// Whether a delivery of `key` was given back at the shutdown.
    fn gave_back(&self, key: Option<&str>) -> bool {
        key.is_some_and(|key| lock(&self.given_back).contains(key))
    }

    /// A delivery of `key` answered: the lane goes once none is in hand.
    fn leave(&self, key: Option<&str>) {
        let Some(key) = key else { return };
        let mut lanes = lock(&self.lanes);
        if let Some(lane) = lanes.get_mut(key) {
            lane.in_hand -= 1;
            if lane.in_hand == 0 {
                lanes.remove(key);
            }
        }
    }
}
