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
    pin::Pin,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
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
    NoHold, ProcessError, ProcessOutcome, Settled, batch::Batch,
};
use crate::{fingerprint::PayloadFingerprint, lock::lock, observe, store::Store};

/// What a broker's adapter failed at, said plainly: the broker out of
/// reach, a refusal, the subscription gone.
pub type BrokerError = Box<dyn std::error::Error + Send + Sync>;

/// The most deliveries settled in one transaction, by default.
const DEFAULT_BATCH: usize = 100;

/// How long a batch takes deliveries before it commits, by default.
const DEFAULT_BATCH_WITHIN: Duration = Duration::from_secs(1);

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
    /// The most deliveries of one ordering key settled in one transaction.
    batch: usize,
    /// How long a batch takes deliveries before it commits.
    batch_within: Duration,
    passing: Box<dyn Fn(&E) -> bool + Send + Sync>,
    on_settled: Option<OnSettled<B::Received, M, T, E>>,
}

impl<B: Broker, St, F, M, T, E> fmt::Debug for Consumer<B, St, F, M, T, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Consumer")
            .field("destination", &self.broker.destination())
            .field("in_hand", &self.in_hand)
            .field("batch", &self.batch)
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
            batch: DEFAULT_BATCH,
            batch_within: DEFAULT_BATCH_WITHIN,
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

    /// The most deliveries settled in one transaction, on a store that
    /// batches ([`Store::BATCHES`]: the transactional SQL stores; default
    /// 100; 1 settles each delivery in a transaction of its own).
    ///
    /// A batch is one [ordering key](Broker::ordering_key)'s deliveries in
    /// hand together — those received while the one before them ran — in
    /// the order received: deliveries that would run one after the other
    /// anyway, so a batch never makes side-by-side work wait (a delivery
    /// without an ordering key is settled on its own). It never waits for
    /// more, so it is at most [`in_hand`](Self::in_hand) — raise that too.
    /// Each delivery's key is claimed, worked and recorded in a savepoint
    /// of its own, so one that fails is undone alone; the batch commits
    /// once, and nothing in it is answered before. A delivery that must
    /// wait (its key in flight elsewhere — on SQLite, the batch's own
    /// included — the store unavailable, a work error that may pass)
    /// commits the batch before it and is then settled on its own; if the
    /// commit fails, each of the batch's executions is settled again on its
    /// own — it executes again (nothing committed) or finds its record.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # fn demo<B: tower_idempotency::message::Broker>(consumer: tower_idempotency::message::Consumer<B, tower_idempotency::MemoryStore, tower_idempotency::DefaultFingerprint, (), (), std::io::Error>) {
    /// // Up to 500 in hand, committed 100 at a time.
    /// let consumer = consumer.in_hand(500).batch(100);
    /// # let _ = consumer; }
    /// ```
    pub fn batch(mut self, deliveries: usize) -> Self {
        self.batch = deliveries.max(1);
        self
    }

    /// How long a batch takes deliveries before it commits (default
    /// 1 s): the time bound beside [`batch`](Self::batch)'s size, so that
    /// slow work does not keep a long transaction open, or its first
    /// deliveries unanswered.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # fn demo<B: tower_idempotency::message::Broker>(consumer: tower_idempotency::message::Consumer<B, tower_idempotency::MemoryStore, tower_idempotency::DefaultFingerprint, (), (), std::io::Error>) {
    /// let consumer = consumer.batch_within(std::time::Duration::from_millis(200));
    /// # let _ = consumer; }
    /// ```
    pub fn batch_within(mut self, within: Duration) -> Self {
        self.batch_within = within;
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
        let gathering = Gathering::default();
        let size = if St::BATCHES { self.batch } else { 1 };
        let stopping = AtomicBool::new(false);
        let mut jobs = FuturesUnordered::new();
        // Deliveries in jobs: a job settles a batch of them.
        let mut held = 0;
        // A receive in flight is never dropped halfway: what the broker
        // handed out is in hand, and answered (at shutdown, given back).
        let receive = Fuse::terminated();
        let mut receive = std::pin::pin!(receive);
        let mut receiving = true;
        let mut ended = None;
        loop {
            let room = self.in_hand.saturating_sub(held);
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
                    tracing::info!(destination = self.broker.destination(), in_hand = held, "idempotency: stopping; receiving no more, answering what is in hand");
                    receiving = false;
                    stopping.store(true, Ordering::SeqCst);
                    self.processor.drain();
                    if self.broker.receive_is_cancel_safe() {
                        // The receive in flight took nothing yet: dropped.
                        // What the broker delivered before it stopped is
                        // taken once more, and in hand.
                        receive.set(Fuse::terminated());
                        self.broker.stop_receiving().await;
                        let room = self.in_hand.saturating_sub(held).max(1);
                        receive.set(self.broker.receive(room, Duration::ZERO).fuse());
                    }
                }
                Some(answered) = jobs.next(), if !jobs.is_empty() => held -= answered,
                received = &mut receive, if !receive.is_terminated() => match received {
                    Ok(received) => {
                        held += received.len();
                        for received in received {
                            let key = self.broker.ordering_key(&received).map(Cow::into_owned);
                            // Joins its key's group still gathering, or
                            // begins one: a job of its own, in line.
                            if let Some(group) = gathering.gather(key.as_deref(), received, size) {
                                let (turn, done) = lanes.join(key.as_deref());
                                jobs.push(self.job(group, turn, done, key, &lanes, &gathering, &stopping, &parse, &work));
                            }
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
        tracing::info!(
            destination = self.broker.destination(),
            "idempotency: every delivery in hand answered; closing"
        );
        self.broker.close().await;
        match ended {
            Some(error) => Err(error),
            None => Ok(()),
        }
    }

    /// A group of one key's deliveries, from the moment they are in hand to
    /// their answers: held throughout, their key's turn waited for — the
    /// group takes the key's deliveries received meanwhile. How many it
    /// answered.
    // What the loop lends each job: bundling it would build a struct per
    // group to take it apart again.
    #[allow(clippy::too_many_arguments)]
    async fn job<P, W>(
        &self,
        group: Arc<Group<B::Received>>,
        turn: Option<oneshot::Receiver<()>>,
        done: Option<oneshot::Sender<()>>,
        key: Option<String>,
        lanes: &Lanes,
        gathering: &Gathering<B::Received>,
        stopping: &AtomicBool,
        parse: &P,
        work: &W,
    ) -> usize
    where
        P: Fn(&B::Received) -> Result<Parsed<M>, DeadLetterReason>,
        W: AsyncFn(&mut St::Granted, &B::Received, &M) -> Result<T, E>,
    {
        let hold = Hold {
            broker: &*self.broker,
            group: &group,
        };
        let mut answered = 0;
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
            let group = gathering.start(key.as_deref(), &group);
            answered = group.len();
            let given_back = match group.as_slice() {
                [received] => {
                    boxed(|| self.settle(received, unstarted, stopping, parse, work)).await
                }
                group => boxed(|| self.settle_batch(group, unstarted, stopping, parse, work)).await,
            };
            if given_back && stopping.load(Ordering::SeqCst) {
                lanes.give_back(key.as_deref());
            }
        })
        .await;
        if let Some(done) = done {
            let _ = done.send(());
        }
        lanes.leave(key.as_deref());
        answered
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
        match self.turn(received, unstarted, stopping, parse).await {
            Turn::Answered { given_back } => given_back,
            Turn::Process(parsed) => {
                boxed(|| self.process(received, &parsed, stopping, work)).await
            }
        }
    }

    /// Settles a group of one key's deliveries whose turn it is in
    /// batches — each in one transaction of the store, committed before any
    /// of it is answered — in the order received; `unstarted` as
    /// [`settle`](Self::settle)'s, for the first (those behind it waited
    /// for it). Whether one was given back.
    async fn settle_batch<P, W>(
        &self,
        group: &[Arc<B::Received>],
        unstarted: bool,
        stopping: &AtomicBool,
        parse: &P,
        work: &W,
    ) -> bool
    where
        P: Fn(&B::Received) -> Result<Parsed<M>, DeadLetterReason>,
        W: AsyncFn(&mut St::Granted, &B::Received, &M) -> Result<T, E>,
    {
        let mut given_back = false;
        let mut batch = Batch::new();
        let mut began = Instant::now();
        let mut in_batch = Vec::new();
        for (at, received) in group.iter().enumerate() {
            if !batch.is_empty() && began.elapsed() >= self.batch_within {
                let full = std::mem::replace(&mut batch, Batch::new());
                let settled = std::mem::take(&mut in_batch);
                given_back |= boxed(|| self.commit(full, settled, stopping, work)).await;
            }
            if batch.is_empty() {
                began = Instant::now();
            }
            // Behind the first, each waited for the one before it.
            let unstarted = if at == 0 {
                unstarted
            } else {
                stopping.load(Ordering::SeqCst)
            };
            let parsed = match self.turn(received, unstarted, stopping, parse).await {
                Turn::Answered { given_back: back } => {
                    given_back |= back;
                    continue;
                }
                Turn::Process(parsed) => parsed,
            };
            let id = received.message_id();
            let delivery = self.delivery(received, &parsed, id.as_deref());
            let settled = self
                .processor
                .settle_in_batch(
                    &mut batch,
                    &delivery,
                    async |tx: &mut St::Granted| work(tx, received, &parsed.message).await,
                    |error| (self.passing)(error),
                )
                .await;
            match settled {
                Some(settled) => in_batch.push(InBatch {
                    received,
                    parsed,
                    settled,
                }),
                None => {
                    // It waits, or is tried again: what is before it is
                    // committed and answered first, then it is settled on
                    // its own.
                    let before = std::mem::replace(&mut batch, Batch::new());
                    let settled = std::mem::take(&mut in_batch);
                    given_back |= boxed(|| self.commit(before, settled, stopping, work)).await;
                    given_back |= boxed(|| self.process(received, &parsed, stopping, work)).await;
                }
            }
        }
        given_back | boxed(|| self.commit(batch, in_batch, stopping, work)).await
    }

    /// Commits `batch`, then answers what was settled in it, in order; if
    /// the commit failed, each execution in it is settled again on its own.
    /// Whether one was given back.
    async fn commit<W>(
        &self,
        batch: Batch<St>,
        settled: Vec<InBatch<'_, B::Received, M, T, E>>,
        stopping: &AtomicBool,
        work: &W,
    ) -> bool
    where
        W: AsyncFn(&mut St::Granted, &B::Received, &M) -> Result<T, E>,
    {
        let executed = batch.executed();
        let committed = self.processor.commit_batch(batch).await;
        if let Err(error) = &committed {
            tracing::warn!(%error, executed, "idempotency: a batch did not commit (or its outcome is unknown); its executions are settled again, one by one");
        }
        let mut given_back = false;
        for InBatch {
            received,
            parsed,
            settled: (settled, span),
        } in settled
        {
            let executed = matches!(settled.outcome, Ok(ProcessOutcome::Executed(_)));
            if executed && committed.is_err() {
                given_back |= boxed(|| self.process(received, &parsed, stopping, work)).await;
                continue;
            }
            super::processor::recorded(&span, &settled);
            given_back |= self.conclude(received, &parsed, &settled, stopping).await;
        }
        given_back
    }

    /// A delivery whose turn came: no longer this consumer's, given back
    /// unstarted at a shutdown, not a valid message — each answered here —
    /// or its message, to be processed.
    async fn turn<P>(
        &self,
        received: &B::Received,
        unstarted: bool,
        stopping: &AtomicBool,
        parse: &P,
    ) -> Turn<M>
    where
        P: Fn(&B::Received) -> Result<Parsed<M>, DeadLetterReason>,
    {
        if !self.broker.owns(received) {
            tracing::debug!(message = ?received.message_id(), "idempotency: no longer this consumer's (a rebalance); left to its new owner");
            return Turn::Answered { given_back: false };
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
            return Turn::Answered { given_back };
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
                return Turn::Answered { given_back };
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
            return Turn::Answered { given_back };
        }
        Turn::Process(parsed)
    }

    /// The processor's delivery of `received`, read as `parsed`, the
    /// broker's message id `id`.
    fn delivery<'a>(
        &'a self,
        received: &'a B::Received,
        parsed: &'a Parsed<M>,
        id: Option<&'a str>,
    ) -> Delivery<'a, NoHold> {
        let delivery = Delivery::new(&parsed.key, received.payload())
            .last(received.last())
            .messaging_system(self.broker.system())
            .destination(self.broker.destination())
            .trace_context(
                received.header("traceparent"),
                received.header("tracestate"),
            );
        match id {
            Some(id) => delivery.message_id(id),
            None => delivery,
        }
    }

    /// Settles `received` on its own, in a transaction of its own, and
    /// answers the broker. Whether it was given back.
    async fn process<W>(
        &self,
        received: &B::Received,
        parsed: &Parsed<M>,
        stopping: &AtomicBool,
        work: &W,
    ) -> bool
    where
        W: AsyncFn(&mut St::Granted, &B::Received, &M) -> Result<T, E>,
    {
        let message = &parsed.message;
        let id = received.message_id();
        let settled: Settled<T, E> = self
            .processor
            .settle(
                self.delivery(received, parsed, id.as_deref()),
                async |tx: &mut St::Granted| work(tx, received, message).await,
                |error| (self.passing)(error),
            )
            .await;
        self.conclude(received, parsed, &settled, stopping).await
    }

    /// Answers the broker with what `received` was settled to, and reports
    /// it. Whether it was given back.
    async fn conclude(
        &self,
        received: &B::Received,
        parsed: &Parsed<M>,
        settled: &Settled<T, E>,
        stopping: &AtomicBool,
    ) -> bool {
        let acked = match &settled.outcome {
            Ok(ProcessOutcome::Executed(_)) => Acked::Executed,
            _ => Acked::Decided,
        };
        let given_back = self
            .answer(received, &settled.disposition, acked, stopping)
            .await;
        self.report(
            received,
            Some(parsed),
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

/// What a delivery whose turn came needs.
enum Turn<M> {
    /// Nothing more: it was answered (whether given back).
    Answered { given_back: bool },
    /// Its message processed.
    Process(Parsed<M>),
}

/// A delivery settled in a batch, to be answered once the batch commits:
/// what it was settled to, and the span that is recorded on.
struct InBatch<'a, R, M, T, E> {
    received: &'a R,
    parsed: Parsed<M>,
    settled: (Settled<T, E>, tracing::Span),
}

/// One key's deliveries settled by one job, in the order received: it
/// takes the key's deliveries until its turn comes, up to a batch.
struct Group<R> {
    deliveries: Mutex<Vec<Arc<R>>>,
}

impl<R> Group<R> {
    /// A group that begins with `received`.
    fn of(received: Arc<R>) -> Arc<Self> {
        Arc::new(Self {
            deliveries: Mutex::new(vec![received]),
        })
    }
}

/// Each ordering key's group that has not started yet. A delivery without
/// a key is a group of its own: deliveries that run side by side are never
/// made to wait for each other in a batch.
struct Gathering<R> {
    open: Mutex<HashMap<String, Arc<Group<R>>>>,
}

impl<R> Default for Gathering<R> {
    fn default() -> Self {
        Self {
            open: Mutex::default(),
        }
    }
}

impl<R> Gathering<R> {
    /// `received`, of `key`, joins its key's group if one has not started
    /// and has room for it (`size` in all); else it begins one, returned.
    fn gather(&self, key: Option<&str>, received: R, size: usize) -> Option<Arc<Group<R>>> {
        let received = Arc::new(received);
        let Some(key) = key else {
            return Some(Group::of(received));
        };
        let mut open = lock(&self.open);
        if let Some(gathering) = open.get(key) {
            let mut deliveries = lock(&gathering.deliveries);
            if deliveries.len() < size {
                deliveries.push(received);
                return None;
            }
        }
        let group = Group::of(received);
        open.insert(key.to_owned(), group.clone());
        Some(group)
    }

    /// `group`, of `key`, starts: it takes no more. Its deliveries.
    fn start(&self, key: Option<&str>, group: &Arc<Group<R>>) -> Vec<Arc<R>> {
        if let Some(key) = key {
            let mut open = lock(&self.open);
            if open.get(key).is_some_and(|open| Arc::ptr_eq(open, group)) {
                open.remove(key);
            }
        }
        lock(&group.deliveries).clone()
    }
}

/// A group of deliveries' hold, as the processor's keeping extends it.
struct Hold<'a, B: Broker> {
    broker: &'a B,
    group: &'a Group<B::Received>,
}

impl<B: Broker> DeliveryLease for Hold<'_, B> {
    fn interval(&self) -> Duration {
        self.broker.hold_interval().unwrap_or(Duration::MAX)
    }

    /// Each delivery's, one after the other; the last failure, if any.
    async fn extend(&self) -> Result<(), ExtendError> {
        let mut extended = Ok(());
        let group = lock(&self.group.deliveries).clone();
        for received in group {
            if let Err(error) = self.broker.extend(&received).await {
                extended = Err(error);
            }
        }
        extended
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

/// The future `make` builds, on the heap, built in a frame of its own: an
/// unoptimised build keeps a stack slot in the caller's poll for each
/// future it awaits, and the loop's settling nests deep enough to overflow
/// a thread's 2 MiB stack (measured: 2 to 2.5 MiB before).
#[inline(never)]
fn boxed<F: Future>(make: impl FnOnce() -> F) -> Pin<Box<F>> {
    Box::pin(make())
}
