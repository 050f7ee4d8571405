//! The relay: claims committed messages, publishes them, marks them sent.

use std::{fmt, future::Future, time::Duration};

use super::{Outbox, OutboxMessage};
use crate::store::{
    LeaseToken, StoreError,
    sql::{
        base::now_ms,
        dialect::{Args, Dialect},
    },
};

/// What a [`Publisher`] could not do.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// The broker is out of reach or did not confirm: the relay tries
    /// again after a back-off, with the same id.
    #[error("the broker is unavailable: {0}")]
    Unavailable(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The broker refused the message for good (no such queue, a message
    /// too large): the relay keeps it, marked refused, and logs it.
    #[error("the broker refused the message: {0}")]
    Refused(String),
}

/// Your broker's client, as the [`OutboxRelay`] publishes through it.
/// Pass [`OutboxMessage::id`] on as the broker's deduplication id, and
/// return once the broker has confirmed the message (a publisher
/// confirm, a JetStream ack, a `SendMessage` answer).
///
/// # Examples
///
/// ```
/// # #[cfg(feature = "sqlite")] mod demo {
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
/// # }
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
}

/// Publishes an [`Outbox`]'s committed messages through a [`Publisher`]:
/// claims a batch (each the oldest pending message of its ordering key),
/// publishes them concurrently, marks them sent; backs off per message
/// while the broker is unavailable; deletes sent messages after the
/// retention. Run one per instance: relays share the work, and a message
/// another relay claimed is left to it until its claim lapses (the relay
/// died): then it is published again, with the same id.
///
/// # Examples
///
/// See the [module docs](super).
pub struct OutboxRelay<D: Dialect, P> {
    outbox: Outbox<D>,
    publisher: P,
    /// When the table's statistics were last refreshed (where the engine
    /// needs it: see `OutboxStatements::analyze`).
    analyzed: std::sync::Mutex<Option<std::time::Instant>>,
    batch: u32,
    poll: Duration,
    claim_for: Duration,
    backoff: (Duration, Duration),
    retention: Duration,
}

impl<D: Dialect, P> fmt::Debug for OutboxRelay<D, P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OutboxRelay")
            .field("outbox", &self.outbox)
            .field("batch", &self.batch)
            .field("poll", &self.poll)
            .field("claim_for", &self.claim_for)
            .field("retention", &self.retention)
            .finish_non_exhaustive()
    }
}

impl<D: Dialect, P: Publisher> OutboxRelay<D, P> {
    /// A relay of `outbox` through `publisher`: batches of 256, a poll
    /// every 50 ms while idle, claims of 30 s, back-off from 500 ms to
    /// 30 s, sent messages kept 7 days.
    ///
    /// # Examples
    ///
    /// See the [module docs](super).
    pub fn new(outbox: Outbox<D>, publisher: P) -> Self {
        Self {
            outbox,
            publisher,
            analyzed: std::sync::Mutex::new(None),
            batch: 256,
            poll: Duration::from_millis(50),
            claim_for: Duration::from_secs(30),
            backoff: (Duration::from_millis(500), Duration::from_secs(30)),
            retention: Duration::from_secs(7 * 24 * 3600),
        }
    }

    /// Messages per round (default 256). A round takes at most one message
    /// per ordering key (the next waits for it to be sent), so a batch
    /// larger than the keys with messages waiting is never full.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # #[cfg(feature = "sqlite")]
    /// # fn demo(relay: tower_idempotency::outbox::OutboxRelay<tower_idempotency::store::sql::sqlite::Sqlite, impl tower_idempotency::outbox::Publisher>) {
    /// use std::time::Duration;
    ///
    /// let relay = relay
    ///     .batch(256)
    ///     .poll_interval(Duration::from_millis(20))
    ///     .claim_for(Duration::from_secs(60))
    ///     .retention(Duration::from_secs(24 * 3600));
    /// # let _ = relay; }
    /// ```
    pub fn batch(mut self, batch: u32) -> Self {
        self.batch = batch.max(1);
        self
    }

    /// How long the relay waits after a round that found nothing (default
    /// 50 ms): the latency of a message published after an idle spell.
    ///
    /// # Examples
    ///
    /// See [`batch`](Self::batch).
    pub fn poll_interval(mut self, poll: Duration) -> Self {
        self.poll = poll;
        self
    }

    /// How long a claimed message is left to its relay (default 30 s):
    /// longer than a publication takes. A relay that died is replaced
    /// after it, publishing again with the same id.
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
    /// # fn demo(relay: tower_idempotency::outbox::OutboxRelay<tower_idempotency::store::sql::sqlite::Sqlite, impl tower_idempotency::outbox::Publisher>) {
    /// use std::time::Duration;
    ///
    /// let relay = relay.backoff(Duration::from_millis(100), Duration::from_secs(5));
    /// # let _ = relay; }
    /// ```
    pub fn backoff(mut self, first: Duration, max: Duration) -> Self {
        self.backoff = (first, max.max(first));
        self
    }

    /// How long sent messages are kept before they are deleted (default
    /// 7 days): what an operator may look up.
    ///
    /// # Examples
    ///
    /// See [`batch`](Self::batch).
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// One round: claims a batch, publishes it, marks what happened.
    ///
    /// # Errors
    ///
    /// The database's; messages claimed before it failed are published
    /// again once their claim lapses.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # #[cfg(feature = "sqlite")]
    /// # async fn demo(relay: tower_idempotency::outbox::OutboxRelay<tower_idempotency::store::sql::sqlite::Sqlite, impl tower_idempotency::outbox::Publisher>) -> Result<(), tower_idempotency::store::StoreError> {
    /// // Until the outbox is empty, as a test or a drain at shutdown would.
    /// while relay.run_once().await?.claimed > 0 {}
    /// # Ok(()) }
    /// ```
    pub async fn run_once(&self) -> Result<RelayRound, StoreError> {
        let token = LeaseToken::generate().to_bytes();
        let sql = &self.outbox.sql;
        self.refresh_statistics(false).await;
        let claim = Args {
            token: &token,
            now: now_ms(),
            ms: millis(self.claim_for),
            batch: i64::from(self.batch),
            ..Args::default()
        };
        let messages = if sql.claim_returns {
            self.outbox.messages(&sql.claim, &claim).await?
        } else {
            if self.outbox.execute(&sql.claim, &claim).await? == 0 {
                return Ok(RelayRound::default());
            }
            let find = Args {
                token: &token,
                ..Args::default()
            };
            self.outbox.messages(&sql.claimed, &find).await?
        };
        let mut round = RelayRound::default();
        if messages.is_empty() {
            return Ok(round);
        }
        round.claimed = messages.len();
        // One per ordering key in a batch: published side by side.
        let outcomes = futures_util::future::join_all(
            messages
                .iter()
                .map(|message| self.publisher.publish(message)),
        )
        .await;
        for (message, outcome) in messages.iter().zip(outcomes) {
            let (stmt, error, ms) = match outcome {
                Ok(()) => continue,
                Err(PublishError::Unavailable(error)) => {
                    round.retried += 1;
                    tracing::debug!(id = %message.id, %error, "idempotency: outbox message not published yet");
                    (
                        &sql.retry,
                        error.to_string(),
                        self.backoff_after(message.attempts),
                    )
                }
                Err(PublishError::Refused(why)) => {
                    round.refused += 1;
                    tracing::error!(id = %message.id, destination = %message.destination, %why, "idempotency: the broker refused an outbox message; kept as refused");
                    (&sql.refuse, why, 0)
                }
            };
            let args = Args {
                id: &message.id,
                token: &token,
                error: &error,
                now: now_ms(),
                ms,
                ..Args::default()
            };
            self.outbox.execute(stmt, &args).await?;
        }
        let sent = Args {
            token: &token,
            now: now_ms(),
            ..Args::default()
        };
        let marked = self.outbox.execute(&sql.sent, &sent).await?;
        round.published = usize::try_from(marked).unwrap_or(usize::MAX);
        crate::observe::outbox(round.published, round.retried, round.refused);
        if round.claimed == self.batch as usize {
            // A backlog: the claim's plan depends on the table's size.
            self.refresh_statistics(true).await;
        }
        Ok(round)
    }

    /// Deletes up to one batch of messages sent longer ago than the
    /// retention; how many.
    ///
    /// # Errors
    ///
    /// The database's.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # #[cfg(feature = "sqlite")]
    /// # async fn demo(relay: tower_idempotency::outbox::OutboxRelay<tower_idempotency::store::sql::sqlite::Sqlite, impl tower_idempotency::outbox::Publisher>) -> Result<(), tower_idempotency::store::StoreError> {
    /// let deleted = relay.sweep().await?;
    /// # let _ = deleted; Ok(()) }
    /// ```
    pub async fn sweep(&self) -> Result<u64, StoreError> {
        let args = Args {
            now: now_ms() - millis(self.retention),
            batch: i64::from(self.batch) * 16,
            ..Args::default()
        };
        self.outbox.execute(&self.outbox.sql.sweep, &args).await
    }

    /// Runs rounds until `shutdown` completes: at once while there is
    /// work, after the poll interval when there is none or the database
    /// failed (logged); sweeps about once a minute.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # #[cfg(feature = "sqlite")]
    /// # async fn demo(relay: tower_idempotency::outbox::OutboxRelay<tower_idempotency::store::sql::sqlite::Sqlite, impl tower_idempotency::outbox::Publisher>) {
    /// relay.run(async { tokio::signal::ctrl_c().await.ok(); }).await;
    /// # }
    /// ```
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) {
        let mut shutdown = std::pin::pin!(shutdown);
        let mut last_sweep = tokio::time::Instant::now();
        loop {
            let pause = match self.run_once().await {
                Ok(round) if round.claimed > 0 && round.retried < round.claimed => Duration::ZERO,
                Ok(_) => self.poll,
                Err(error) => {
                    tracing::warn!(%error, "idempotency: the outbox relay could not reach the database");
                    self.poll.max(Duration::from_millis(500))
                }
            };
            if last_sweep.elapsed() >= Duration::from_secs(60) {
                last_sweep = tokio::time::Instant::now();
                if let Err(error) = self.sweep().await {
                    tracing::warn!(%error, "idempotency: sweeping the outbox failed");
                }
            }
            tokio::select! {
                () = &mut shutdown => return,
                () = tokio::time::sleep(pause) => {}
            }
        }
    }

    /// [`run`](Self::run) in a background task, until it is aborted.
    ///
    /// # Examples
    ///
    /// See the [module docs](super).
    pub fn spawn(self) -> tokio::task::JoinHandle<()> {
        tokio::spawn(self.run(std::future::pending()))
    }

    /// Refreshes the table's statistics where the engine needs it
    /// (PostgreSQL): on the first round, and on a backlog (`full`) at most
    /// once a minute — a plan made for a nearly empty table reads every
    /// pending row on each claim. A failure is logged: only speed depends
    /// on it.
    async fn refresh_statistics(&self, full: bool) {
        let Some(analyze) = &self.outbox.sql.analyze else {
            return;
        };
        let due = {
            let mut last = crate::lock::lock(&self.analyzed);
            let due = match *last {
                None => true,
                Some(at) => full && at.elapsed() >= Duration::from_secs(60),
            };
            if due {
                *last = Some(std::time::Instant::now());
            }
            due
        };
        if due && let Err(error) = self.outbox.raw(analyze).await {
            tracing::debug!(%error, "idempotency: the outbox's statistics could not be refreshed");
        }
    }

    fn backoff_after(&self, attempts: u32) -> i64 {
        let (first, max) = self.backoff;
        let doubled = first.saturating_mul(1 << attempts.saturating_sub(1).min(16));
        millis(doubled.min(max))
    }
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}
