//! The relay: claims committed messages, publishes each key's run in
//! order, settles what happened; sweeps what was sent; says when the
//! broker goes away and comes back.

use std::{
    fmt,
    future::Future,
    sync::Mutex,
    time::{Duration, Instant},
};

use tracing::Instrument;

use super::{OutboxBacklog, OutboxMessage, OutboxStats, OutboxTable, Settlement};
use crate::{
    lock::lock,
    observe,
    store::{LeaseToken, StoreError},
};

/// What a [`Publisher`] could not do.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// The broker is out of reach, did not confirm, or answered with
    /// something that may pass (a stream briefly absent, throttling): the
    /// relay tries again after a back-off, with the same id.
    #[error("the broker is unavailable: {0}")]
    Unavailable(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The broker refused the message for good (no such queue, a message
    /// too large): the relay keeps it, marked refused, and logs it.
    #[error("the broker refused the message: {0}")]
    Refused(String),
}

/// Your broker's client, as the [`OutboxRelay`] publishes through it.
/// Pass [`OutboxMessage::id`] on as the broker's deduplication id, and
/// return once the broker has confirmed the message (a publisher confirm,
/// a JetStream ack, a `SendMessage` answer, a Kafka delivery report).
///
/// The publisher owns its connection: when it finds it dead (a broker
/// restarted, a channel closed), it answers
/// [`Unavailable`](PublishError::Unavailable) and connects again on a
/// later call — the relay keeps calling, with back-off, until it can. Only
/// what the broker will never take is
/// [`Refused`](PublishError::Refused).
///
/// # Examples
///
/// ```
/// use tower_idempotency::outbox::{OutboxMessage, PublishError, Publisher};
///
/// /// Publishes to an in-process channel.
/// struct Channel(tokio::sync::mpsc::Sender<OutboxMessage>);
///
/// impl Publisher for Channel {
///     async fn publish(&self, message: &OutboxMessage) -> Result<(), PublishError> {
///         self.0.send(message.clone()).await.map_err(|e| PublishError::Unavailable(e.into()))
///     }
/// }
/// ```
pub trait Publisher: Send + Sync + 'static {
    /// Publishes `message`; `Ok` once the broker has it.
    fn publish(
        &self,
        message: &OutboxMessage,
    ) -> impl Future<Output = Result<(), PublishError>> + Send;
}

/// What one round of the relay did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RelayRound {
    /// Messages claimed this round.
    pub claimed: usize,
    /// Published and marked sent.
    pub published: usize,
    /// The broker was unavailable: due again after a back-off.
    pub retried: usize,
    /// Refused for good: kept, marked refused.
    pub refused: usize,
    /// Not tried, behind a message of their key that failed: due again at
    /// once, in order.
    pub released: usize,
}

/// Publishes an outbox's committed messages through a [`Publisher`]: claims
/// a batch — each ordering key's head and as much of its run as fits —
/// publishes each key's run in order (keys side by side), stops a run at
/// its first failure, and settles the round; backs off per message while
/// the broker is unavailable; sweeps what was sent once it is older than
/// the retention. Run one per instance: relays share the work, and a
/// message another relay claimed is left to it until its claim lapses (the
/// relay died): then it is published again, with the same id.
///
/// # Examples
///
/// See the [module docs](super).
pub struct OutboxRelay<T, P> {
    table: T,
    publisher: P,
    batch: u32,
    poll: Duration,
    claim_for: Duration,
    backoff: (Duration, Duration),
    retention: Duration,
    /// When the broker became unavailable, if it is.
    outage: Mutex<Option<Instant>>,
}

impl<T, P> fmt::Debug for OutboxRelay<T, P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OutboxRelay")
            .field("batch", &self.batch)
            .field("poll", &self.poll)
            .field("claim_for", &self.claim_for)
            .field("retention", &self.retention)
            .finish_non_exhaustive()
    }
}

/// How often [`OutboxRelay::run`] sweeps and reports its backlog.
const UPKEEP_EVERY: Duration = Duration::from_secs(10);

/// The longest one upkeep spends sweeping before it lets the relay publish
/// again.
const SWEEP_FOR: Duration = Duration::from_secs(1);

/// The rows one sweep statement deletes, at most.
const SWEEP_BATCH: u32 = 5_000;

/// How one message of a run came out.
enum Outcome {
    Sent,
    Retried(Duration, String),
    Refused(String),
    Released,
}

impl<T: OutboxTable, P: Publisher> OutboxRelay<T, P> {
    /// A relay of `table` (an `Outbox`, with a SQL feature) through
    /// `publisher`: batches of 256, a poll every second while idle (at once
    /// when a commit is heard of), claims of 3 s kept alive while they are
    /// worked on, back-off from 500 ms to 30 s, sent messages kept 7 days.
    ///
    /// # Examples
    ///
    /// See the [module docs](super).
    pub fn new(table: T, publisher: P) -> Self {
        Self {
            table,
            publisher,
            batch: 256,
            poll: Duration::from_secs(1),
            claim_for: Duration::from_secs(3),
            backoff: (Duration::from_millis(500), Duration::from_secs(30)),
            retention: Duration::from_secs(7 * 24 * 3600),
            outage: Mutex::new(None),
        }
    }

    /// Messages per round (default 256): the heads of as many ordering
    /// keys as wait, and behind them their runs, as far as the batch goes.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # #[cfg(feature = "sqlite")]
    /// # fn demo(relay: tower_idempotency::outbox::OutboxRelay<tower_idempotency::outbox::Outbox<tower_idempotency::store::sql::sqlite::Sqlite>, impl tower_idempotency::outbox::Publisher>) {
    /// use std::time::Duration;
    ///
    /// let relay = relay
    ///     .batch(256)
    ///     .poll_interval(Duration::from_millis(200))
    ///     .claim_for(Duration::from_secs(60))
    ///     .retention(Duration::from_secs(24 * 3600));
    /// # let _ = relay; }
    /// ```
    pub fn batch(mut self, batch: u32) -> Self {
        self.batch = batch.max(1);
        self
    }

    /// How long the relay waits after a round that found nothing, unless a
    /// commit wakes it first (default 1 s): the latency of a message a
    /// relay hears nothing of — committed by another process on an engine
    /// without notifications (MySQL, SQLite) — and the relay's idle cost,
    /// one claim per interval.
    ///
    /// # Examples
    ///
    /// See [`batch`](Self::batch).
    pub fn poll_interval(mut self, poll: Duration) -> Self {
        self.poll = poll;
        self
    }

    /// How long a claim holds its messages without word from its relay
    /// (default 3 s). The relay renews its claim every third of this while
    /// it publishes, however long the broker takes; a relay that died
    /// (killed, its machine gone) stops renewing, and another takes its
    /// messages over once the claim lapses — within this and a poll —
    /// publishing them again with the same id. Longer rides out longer
    /// stalls of the relay itself (a paused process, a database slower than
    /// a third of it to answer a renewal) without a second relay
    /// publishing the same messages meanwhile; a claim answered after it
    /// lapsed is given back unpublished.
    ///
    /// # Examples
    ///
    /// See [`batch`](Self::batch).
    pub fn claim_for(mut self, claim_for: Duration) -> Self {
        self.claim_for = claim_for;
        self
    }

    /// The back-off of a message the broker could not take: from `first`,
    /// doubling per attempt, up to `max` (default 500 ms to 30 s).
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # #[cfg(feature = "sqlite")]
    /// # fn demo(relay: tower_idempotency::outbox::OutboxRelay<tower_idempotency::outbox::Outbox<tower_idempotency::store::sql::sqlite::Sqlite>, impl tower_idempotency::outbox::Publisher>) {
    /// use std::time::Duration;
    ///
    /// let relay = relay.backoff(Duration::from_millis(100), Duration::from_secs(5));
    /// # let _ = relay; }
    /// ```
    pub fn backoff(mut self, first: Duration, max: Duration) -> Self {
        self.backoff = (first, max.max(first));
        self
    }

    /// How long sent messages are kept before they are swept (default 7
    /// days): what an operator may look up.
    ///
    /// # Examples
    ///
    /// See [`batch`](Self::batch).
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// One round: claims a batch, publishes each key's run in order (the
    /// keys side by side), settles what happened.
    ///
    /// # Errors
    ///
    /// The table's; messages claimed before it failed are published again
    /// once their claim lapses.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # #[cfg(feature = "sqlite")]
    /// # async fn demo(relay: tower_idempotency::outbox::OutboxRelay<tower_idempotency::outbox::Outbox<tower_idempotency::store::sql::sqlite::Sqlite>, impl tower_idempotency::outbox::Publisher>) -> Result<(), tower_idempotency::store::StoreError> {
    /// // Until the outbox is empty, as a test or a drain at shutdown would.
    /// while relay.run_once().await?.claimed > 0 {}
    /// # Ok(()) }
    /// ```
    pub async fn run_once(&self) -> Result<RelayRound, StoreError> {
        let claim = LeaseToken::generate();
        let asked = Instant::now();
        let messages = self.table.claim(claim, self.batch, self.claim_for).await?;
        if messages.is_empty() {
            return Ok(RelayRound::default());
        }
        // A claim answered late may have lapsed on its way back, and another
        // relay taken some of it: kept again at once, and published only if
        // all of it is still this relay's.
        if asked.elapsed() >= self.renew_every() {
            let held = self.table.extend(claim, self.claim_for).await?;
            if held < messages.len() as u64 {
                tracing::warn!(
                    claimed = messages.len(),
                    held,
                    took = ?asked.elapsed(),
                    "idempotency: an outbox claim was answered after it lapsed; given back unpublished (a longer claim_for rides out a slower database)"
                );
                let settled = Settlement {
                    released: messages.iter().map(|m| m.id.as_str()).collect(),
                    ..Settlement::default()
                };
                self.table.settle(claim, &settled).await?;
                return Ok(RelayRound {
                    claimed: messages.len(),
                    released: messages.len(),
                    ..RelayRound::default()
                });
            }
        }
        tokio::select! {
            biased;
            round = self.publish_and_settle(claim, &messages) => round,
            never = self.keep_alive(claim) => match never {},
        }
    }

    /// How often a claim is renewed while its round works: a third of it,
    /// so that a renewal may be late, or fail once, without the claim
    /// lapsing (and never more often than every 10 ms, whatever a tiny
    /// `claim_for` asks).
    fn renew_every(&self) -> Duration {
        (self.claim_for / 3).max(Duration::from_millis(10))
    }

    /// Renews `claim` while the round works; never returns. A relay that
    /// dies stops renewing, and its claim lapses within `claim_for`.
    async fn keep_alive(&self, claim: LeaseToken) -> std::convert::Infallible {
        loop {
            tokio::time::sleep(self.renew_every()).await;
            if let Err(error) = self.table.extend(claim, self.claim_for).await {
                tracing::warn!(%error, "idempotency: an outbox claim could not be renewed; it lapses unless a later renewal succeeds");
            }
        }
    }

    /// Publishes each key's run of a claimed batch in order (the keys side
    /// by side), then settles what happened.
    async fn publish_and_settle(
        &self,
        claim: LeaseToken,
        messages: &[OutboxMessage],
    ) -> Result<RelayRound, StoreError> {
        let runs = runs(messages);
        let outcomes =
            futures_util::future::join_all(runs.iter().map(|run| self.publish_run(run))).await;
        let mut settled = Settlement::default();
        let mut unavailable = None;
        for (run, outcomes) in runs.iter().zip(outcomes) {
            for (message, outcome) in run.iter().zip(outcomes) {
                let id = message.id.as_str();
                match outcome {
                    Outcome::Sent => settled.sent.push(id),
                    Outcome::Retried(after, error) => {
                        unavailable.get_or_insert_with(|| error.clone());
                        settled.retried.push((id, after, error));
                    }
                    Outcome::Refused(why) => settled.refused.push((id, why)),
                    Outcome::Released => settled.released.push(id),
                }
            }
        }
        let round = RelayRound {
            claimed: messages.len(),
            published: settled.sent.len(),
            retried: settled.retried.len(),
            refused: settled.refused.len(),
            released: settled.released.len(),
        };
        self.table.settle(claim, &settled).await?;
        observe::outbox(round.published, round.retried, round.refused);
        self.broker_was(unavailable, &round);
        Ok(round)
    }

    /// One key's run, in order, until a message the broker could not take:
    /// it backs off, and the rest of the run is given back behind it.
    async fn publish_run(&self, run: &[&OutboxMessage]) -> Vec<Outcome> {
        let mut outcomes = Vec::with_capacity(run.len());
        for message in run {
            if outcomes
                .last()
                .is_some_and(|o| matches!(o, Outcome::Retried(..) | Outcome::Released))
            {
                outcomes.push(Outcome::Released);
                continue;
            }
            let span = publish_span(message);
            let published = self
                .publisher
                .publish(message)
                .instrument(span.clone())
                .await;
            outcomes.push(match published {
                Ok(()) => Outcome::Sent,
                Err(PublishError::Unavailable(error)) => {
                    span.record("otel.status_code", "error");
                    Outcome::Retried(self.backoff_after(message.attempts), error.to_string())
                }
                Err(PublishError::Refused(why)) => {
                    span.record("otel.status_code", "error");
                    tracing::error!(id = %message.id, destination = %message.destination, %why, "idempotency: the broker refused an outbox message; kept as refused");
                    Outcome::Refused(why)
                }
            });
        }
        outcomes
    }

    /// Says when the broker became unavailable — once, at the first
    /// failure of an outage — and when it is back.
    fn broker_was(&self, unavailable: Option<String>, round: &RelayRound) {
        let mut outage = lock(&self.outage);
        match (unavailable, *outage) {
            (Some(error), None) => {
                *outage = Some(Instant::now());
                tracing::warn!(%error, retried = round.retried, "idempotency: the outbox's broker is unavailable; its messages are kept and retried with back-off");
            }
            (Some(error), Some(since)) => {
                tracing::debug!(%error, since = ?since.elapsed(), "idempotency: the outbox's broker is still unavailable");
            }
            (None, Some(since)) if round.published > 0 => {
                *outage = None;
                tracing::warn!(after = ?since.elapsed(), published = round.published, "idempotency: the outbox's broker is back; publishing again");
            }
            (None, _) => {}
        }
    }

    /// Deletes what was sent longer ago than the retention, in batches,
    /// until less than a batch is left or a second has gone (the rest is
    /// for the next time); how many. [`run`](Self::run) sweeps every ten
    /// seconds, faster than a relay publishes.
    ///
    /// # Errors
    ///
    /// The table's.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # #[cfg(feature = "sqlite")]
    /// # async fn demo(relay: tower_idempotency::outbox::OutboxRelay<tower_idempotency::outbox::Outbox<tower_idempotency::store::sql::sqlite::Sqlite>, impl tower_idempotency::outbox::Publisher>) -> Result<(), tower_idempotency::store::StoreError> {
    /// let deleted = relay.sweep().await?;
    /// # let _ = deleted; Ok(()) }
    /// ```
    pub async fn sweep(&self) -> Result<u64, StoreError> {
        let started = Instant::now();
        let mut deleted = 0;
        loop {
            let swept = self.table.sweep(self.retention, SWEEP_BATCH).await?;
            deleted += swept;
            if swept < u64::from(SWEEP_BATCH) || started.elapsed() >= SWEEP_FOR {
                return Ok(deleted);
            }
        }
    }

    /// What waits in the outbox, for this relay's retention: see
    /// [`OutboxBacklog`]. With the `metrics` feature it is also reported as
    /// the `idempotency_outbox_*` gauges (pending, oldest pending's age,
    /// refused, awaiting sweep); a running relay does so every 10 s.
    ///
    /// # Errors
    ///
    /// The table's.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # #[cfg(feature = "sqlite")]
    /// # async fn demo(relay: tower_idempotency::outbox::OutboxRelay<tower_idempotency::outbox::Outbox<tower_idempotency::store::sql::sqlite::Sqlite>, impl tower_idempotency::outbox::Publisher>) -> Result<(), tower_idempotency::store::StoreError> {
    /// let backlog = relay.backlog().await?;
    /// if backlog.oldest_pending.is_some_and(|age| age.as_secs() > 60) {
    ///     eprintln!("{} messages wait, the oldest for over a minute", backlog.pending);
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn backlog(&self) -> Result<OutboxBacklog, StoreError> {
        let backlog = self.table.backlog(self.retention).await?;
        backlog.report();
        Ok(backlog)
    }

    /// How many messages the outbox holds, by state.
    ///
    /// # Errors
    ///
    /// The table's.
    ///
    /// # Examples
    ///
    /// See [`backlog`](Self::backlog).
    pub async fn stats(&self) -> Result<OutboxStats, StoreError> {
        self.table.stats().await
    }

    /// Runs rounds until `shutdown` completes: at once while there is
    /// work, and when idle after a commit is heard of or the poll
    /// interval; every ten seconds it sweeps and reports its backlog (to
    /// the metrics). A table that fails is logged — once, then when it is
    /// back — and tried again after the poll interval (at least 500 ms).
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # #[cfg(feature = "sqlite")]
    /// # async fn demo(relay: tower_idempotency::outbox::OutboxRelay<tower_idempotency::outbox::Outbox<tower_idempotency::store::sql::sqlite::Sqlite>, impl tower_idempotency::outbox::Publisher>) {
    /// relay.run(async { tokio::signal::ctrl_c().await.ok(); }).await;
    /// # }
    /// ```
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) {
        let mut shutdown = std::pin::pin!(shutdown);
        let mut upkeep = Instant::now();
        self.keep_up().await;
        let mut failing: Option<Instant> = None;
        loop {
            let busy = match self.run_once().await {
                Ok(round) => {
                    if let Some(since) = failing.take() {
                        tracing::warn!(after = ?since.elapsed(), "idempotency: the outbox relay reaches its table again");
                    }
                    round.claimed > 0 && round.retried < round.claimed
                }
                Err(error) => {
                    if failing.is_none() {
                        failing = Some(Instant::now());
                        match &error {
                            // Reached, but a round's statement outlived its
                            // bound: not an outage, a slow statement.
                            StoreError::Timeout(bound) => tracing::warn!(
                                ?bound,
                                "idempotency: an outbox relay statement outlived its bound (OutboxBuilder::timeout); \
                                 the table was reached but the statement was slow — a loaded database, or a plan \
                                 that reads the whole backlog; trying again"
                            ),
                            _ => {
                                tracing::warn!(%error, "idempotency: the outbox relay cannot reach its table; trying again")
                            }
                        }
                    }
                    false
                }
            };
            if upkeep.elapsed() >= UPKEEP_EVERY {
                upkeep = Instant::now();
                self.keep_up().await;
            }
            if busy {
                tokio::select! {
                    () = &mut shutdown => return,
                    () = tokio::task::yield_now() => {}
                }
                continue;
            }
            let pause = if failing.is_some() {
                self.poll.max(Duration::from_millis(500))
            } else {
                self.poll
            };
            tokio::select! {
                () = &mut shutdown => return,
                () = tokio::time::sleep(pause) => {}
                () = self.table.committed(), if failing.is_none() => {}
            }
        }
    }

    /// [`run`](Self::run) in a background task, until it is aborted.
    ///
    /// # Examples
    ///
    /// See the [module docs](super).
    pub fn spawn(self) -> tokio::task::JoinHandle<()>
    where
        T: 'static,
    {
        tokio::spawn(self.run(std::future::pending()))
    }

    /// Sweeps, then reports the backlog (a failure is logged: publishing
    /// does not depend on it).
    async fn keep_up(&self) {
        if let Err(error) = self.sweep().await {
            tracing::warn!(%error, "idempotency: sweeping the outbox failed");
        }
        if let Err(error) = self.backlog().await {
            tracing::debug!(%error, "idempotency: the outbox's backlog could not be read");
        }
    }

    fn backoff_after(&self, attempts: u32) -> Duration {
        let (first, max) = self.backoff;
        first
            .saturating_mul(1 << attempts.saturating_sub(1).min(16))
            .min(max)
    }
}

/// Each ordering key's messages, in the order claimed; a message without
/// one is a run of its own.
fn runs(messages: &[OutboxMessage]) -> Vec<Vec<&OutboxMessage>> {
    let mut runs: Vec<Vec<&OutboxMessage>> = Vec::new();
    let mut by_key: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
    for message in messages {
        match message.ordering_key.as_deref() {
            Some(key) => match by_key.get(key) {
                Some(&at) => runs[at].push(message),
                None => {
                    by_key.insert(key, runs.len());
                    runs.push(vec![message]);
                }
            },
            None => runs.push(vec![message]),
        }
    }
    runs
}

/// The span of one publication, as OpenTelemetry's messaging conventions
/// name it: a producer span `publish {destination}`.
fn publish_span(message: &OutboxMessage) -> tracing::Span {
    let span = tracing::info_span!(
        "idempotency.publish",
        otel.name = format!("publish {}", message.destination),
        otel.kind = "producer",
        otel.status_code = tracing::field::Empty,
        messaging.destination.name = %message.destination,
        messaging.message.id = %message.id,
        messaging.operation.type = "send",
        messaging.operation.name = "publish",
    );
    let header = |name: &str| {
        message
            .headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    };
    observe::link_trace(&span, (header("traceparent"), header("tracestate")));
    span
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_keep_each_keys_order_and_give_keyless_messages_their_own() {
        let message = |id: &str, key: Option<&str>| {
            OutboxMessage::new(id, "d", Vec::new()).with_ordering_key(key.map(Into::into))
        };
        let messages = [
            message("a1", Some("a")),
            message("x", None),
            message("b1", Some("b")),
            message("a2", Some("a")),
            message("y", None),
            message("a3", Some("a")),
        ];
        let ids: Vec<Vec<&str>> = runs(&messages)
            .iter()
            .map(|run| run.iter().map(|m| m.id.as_str()).collect())
            .collect();
        assert_eq!(
            ids,
            vec![vec!["a1", "a2", "a3"], vec!["x"], vec!["b1"], vec!["y"]]
        );
    }
}
