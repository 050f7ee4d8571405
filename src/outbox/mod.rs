//! The transactional outbox: the messages a handler sends commit with its
//! record and its effects, and a relay publishes them afterwards.
//!
//! A payments handler rarely stops at its own table: it tells the rest of
//! the system (`charge.created`). Published before the commit, that
//! message announces a charge that may roll back; published after it, it
//! is lost when the process dies in between, and sent again by a retry
//! that executes again. So the handler does not publish: it
//! enqueues (`Outbox::enqueue`) the message with its transaction — a row of
//! the outbox table, committed with the record and the effect or rolled
//! back with them. A replay enqueues nothing, and a key whose handler ran
//! once enqueued its messages once.
//!
//! An [`OutboxRelay`] (one per instance; several may run at once) then
//! claims committed messages, hands each to a [`Publisher`] — your broker's
//! client: SQS, NATS JetStream, RabbitMQ, Kafka — and marks it sent. The
//! path end to end:
//!
//! ```text
//! client key ─► layer: record + charge + outbox row, one commit
//!            ─► relay: publish with the message id, mark sent
//!            ─► broker: deduplicates the id within its window
//!            ─► consumer (the consumer door, keyed by a business id the
//!               message carries): its record + its effect, one commit
//! ```
//!
//! # Ids
//!
//! Each message has a stable id, derived from the request's scope and key,
//! the execution (the claim) that enqueued it and its position among the
//! messages it enqueued — or given by the handler
//! ([`OutgoingMessage::id`]). The publisher passes it on as the broker's
//! deduplication id (SQS FIFO's `MessageDeduplicationId`, JetStream's
//! `Nats-Msg-Id`, AMQP's `message-id`, a Kafka header): a relay that died
//! between publishing and marking publishes again with the same id, and the
//! broker's window or the consumer's own idempotency absorbs it. A key that
//! executes again after its record was forgotten or expired is a new
//! execution, with new messages: it is never wedged by the rows its first
//! execution left.
//!
//! The consumer should be keyed by a business id the message carries (the
//! charge's id), as the consumer door asks: that holds whichever path a
//! copy took. Keyed by the message id instead, it absorbs the relay's
//! resends just as well — the id is stable across them — but not a
//! producer that sends the same business event under two ids.
//!
//! # Order, and a hot key's backlog
//!
//! Messages with one ordering key (an account) are published in the order
//! they were enqueued, one after the other, never by two relays at once;
//! messages of different keys go out side by side. A relay claims each
//! key's oldest pending message and, behind it, as much of the key's run
//! as its batch has room for, publishes the run in order and stops at the
//! first failure — so one busy account's burst drains at the relay's full
//! speed, not one message a round.
//!
//! # Nothing is lost
//!
//! A broker that is down is retried with back-off, and the relay says so
//! (a warning when an outage starts, another when it ends); a publisher
//! reconnects by itself. A message the broker refuses for good is kept,
//! marked refused and logged — never dropped (`Outbox::refused`,
//! `Outbox::requeue`, the CLI's `tower-idempotency outbox refused` and
//! `requeue`). A relay's claim lapses by the database's clock, so relays
//! whose clocks disagree never take each other's claims for lapsed.
//!
//! # Latency, idle cost, upkeep
//!
//! A relay wakes at once when a commit in its own process enqueued, and on
//! PostgreSQL at every commit anywhere (`LISTEN`/`NOTIFY`); otherwise it
//! looks every [`poll_interval`](OutboxRelay::poll_interval) (1 s). Sent
//! messages are swept after the [retention](OutboxRelay::retention), in
//! batches that keep up with publishing; the relay reports its backlog
//! ([`OutboxRelay::backlog`], and gauges with the `metrics` feature).
//!
//! # The table
//!
//! Each SQL engine publishes its table's schema for migrations
//! (`store::postgres::OUTBOX_SCHEMA`
//! and its siblings), with its columns and states described. Another store
//! can carry an outbox by implementing [`OutboxTable`]: the relay is written
//! once over it.
//!
//! An outbox is typed by its database's dialect, as its store is:
//! `Outbox<Sqlite>` beside a `SqliteTxStore`, `Outbox<Postgres>` beside a
//! `PostgresTxStore`, `Outbox<MySql>` beside a `MySqlTxStore` (the
//! dialects are `store::sql::sqlite::Sqlite`,
//! `store::sql::postgres::Postgres` and `store::sql::mysql::MySql`).
//!
//! # Examples
//!
//! ```no_run
//! # #[cfg(feature = "sqlite")]
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use axum::{Router, http::StatusCode, routing::post, extract::State};
//! use tower_idempotency::{
//!     IdempotencyLayer, IdempotentTx, SqliteStore, SqliteTx,
//!     outbox::{Outbox, OutboxRelay, OutgoingMessage, PublishError, Publisher, OutboxMessage},
//!     store::sql::sqlite::Sqlite,
//! };
//!
//! let store = SqliteStore::builder()
//!     .transactional()
//!     .create_table_if_missing()
//!     .connect("sqlite://payments.db")
//!     .await?;
//! let outbox = Outbox::on(&store).create_table_if_missing().build().await?;
//!
//! async fn charge(State(outbox): State<Outbox<Sqlite>>, mut tx: IdempotentTx<SqliteTx>) -> StatusCode {
//!     // … the charge, written with `&mut *tx` …
//!     let event = OutgoingMessage::new("charges", br#"{"type":"charge.created"}"#.to_vec());
//!     match outbox.enqueue(&mut tx, event).await {
//!         Ok(_id) => StatusCode::CREATED,
//!         Err(_) => StatusCode::SERVICE_UNAVAILABLE,
//!     }
//! }
//!
//! /// Your broker's client.
//! struct Log;
//! impl Publisher for Log {
//!     async fn publish(&self, message: &OutboxMessage) -> Result<(), PublishError> {
//!         println!("{} → {}", message.id, message.destination);
//!         Ok(())
//!     }
//! }
//!
//! let relay = OutboxRelay::new(outbox.clone(), Log).spawn();
//! let app: Router = Router::new()
//!     .route("/v1/charges", post(charge))
//!     .route_layer(IdempotencyLayer::new(store).single_tenant())
//!     .with_state(outbox);
//! # let _ = (app, relay); Ok(()) }
//! ```

mod relay;
#[cfg(sql)]
#[cfg_attr(
    docsrs,
    doc(cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql")))
)]
mod sql;
mod table;

use std::time::Duration;

pub use relay::{OutboxRelay, PublishError, Publisher, RelayRound};
#[cfg(sql)]
#[cfg_attr(
    docsrs,
    doc(cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql")))
)]
pub use sql::{Outbox, OutboxBuilder};
pub use table::{OutboxTable, Settlement};

/// A message for the outbox: where it goes, what it says, and how it is
/// ordered and identified.
///
/// # Examples
///
/// ```
/// use tower_idempotency::outbox::OutgoingMessage;
///
/// let event = OutgoingMessage::new("charges", br#"{"type":"charge.created"}"#.to_vec())
///     .ordering_key("acct_alice")
///     .header("type", "charge.created");
/// # let _ = event;
/// ```
#[derive(Clone, Debug)]
// Read by the stores that enqueue: a build without one reads none.
#[cfg_attr(not(sql), allow(dead_code))]
pub struct OutgoingMessage {
    pub(crate) destination: String,
    pub(crate) payload: Vec<u8>,
    pub(crate) headers: Vec<(String, String)>,
    pub(crate) ordering_key: Option<String>,
    pub(crate) id: Option<String>,
}

impl OutgoingMessage {
    /// A message for `destination` — what the publisher makes of it: a
    /// queue URL, a subject, a topic, a routing key.
    ///
    /// # Examples
    ///
    /// See the [type's docs](Self).
    pub fn new(destination: impl Into<String>, payload: impl Into<Vec<u8>>) -> Self {
        Self {
            destination: destination.into(),
            payload: payload.into(),
            headers: Vec::new(),
            ordering_key: None,
            id: None,
        }
    }

    /// A header the publisher passes on (a message attribute, a NATS, AMQP
    /// or Kafka header).
    ///
    /// # Examples
    ///
    /// See the [type's docs](Self).
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }

    /// Messages with one ordering key are published in the order they
    /// were enqueued (an SQS FIFO message group, a Kafka record key);
    /// without one, in any order.
    ///
    /// # Examples
    ///
    /// See the [type's docs](Self).
    pub fn ordering_key(mut self, key: impl Into<String>) -> Self {
        self.ordering_key = Some(key.into());
        self
    }

    /// The message's id, instead of the one derived from the request's
    /// scope, key, execution and the message's position: unique in the
    /// outbox (an id already there refuses the commit), so name what the
    /// execution made — the charge's own id — rather than the request: a
    /// key that executes again after a forget or an expiry must not give
    /// an id its first execution used.
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::outbox::OutgoingMessage;
    ///
    /// let event = OutgoingMessage::new("charges", b"{}".to_vec()).id("charge.created:ch_42");
    /// # let _ = event;
    /// ```
    pub fn id(mut self, id: impl Into<String>) -> Self {
        self.id = Some(id.into());
        self
    }
}

/// A committed message, as a [`Publisher`] receives it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct OutboxMessage {
    /// Stable: the same on every publication of the message. Pass it on as
    /// the broker's deduplication id.
    pub id: String,
    /// Where it goes, as the handler said.
    pub destination: String,
    /// What it says.
    pub payload: Vec<u8>,
    /// Its headers, in the handler's order (with the trace context of the
    /// request that enqueued it, when the `opentelemetry` feature is on).
    pub headers: Vec<(String, String)>,
    /// Its ordering key, if it has one.
    pub ordering_key: Option<String>,
    /// When it was committed, in Unix milliseconds (by the database's
    /// clock where it has one).
    pub enqueued_at_ms: i64,
    /// Its publication attempts so far, this one included.
    pub attempts: u32,
}

impl OutboxMessage {
    /// A message as an [`OutboxTable`] read it back.
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::outbox::OutboxMessage;
    ///
    /// let message = OutboxMessage::new("m-1", "charges", b"{}".to_vec())
    ///     .with_ordering_key(Some("acct_alice".into()))
    ///     .with_attempts(2);
    /// assert_eq!(message.attempts, 2);
    /// ```
    pub fn new(
        id: impl Into<String>,
        destination: impl Into<String>,
        payload: impl Into<Vec<u8>>,
    ) -> Self {
        Self {
            id: id.into(),
            destination: destination.into(),
            payload: payload.into(),
            headers: Vec::new(),
            ordering_key: None,
            enqueued_at_ms: 0,
            attempts: 1,
        }
    }

    /// With these headers.
    ///
    /// # Examples
    ///
    /// See [`OutboxMessage::new`].
    pub fn with_headers(mut self, headers: Vec<(String, String)>) -> Self {
        self.headers = headers;
        self
    }

    /// With this ordering key.
    ///
    /// # Examples
    ///
    /// See [`OutboxMessage::new`].
    pub fn with_ordering_key(mut self, key: Option<String>) -> Self {
        self.ordering_key = key;
        self
    }

    /// Committed at this moment, in Unix milliseconds.
    ///
    /// # Examples
    ///
    /// See [`OutboxMessage::new`].
    pub fn with_enqueued_at_ms(mut self, at: i64) -> Self {
        self.enqueued_at_ms = at;
        self
    }

    /// With this many publication attempts so far, this one included.
    ///
    /// # Examples
    ///
    /// See [`OutboxMessage::new`].
    pub fn with_attempts(mut self, attempts: u32) -> Self {
        self.attempts = attempts;
        self
    }
}

/// How many messages an outbox holds, by state.
///
/// # Examples
///
/// ```
/// use tower_idempotency::outbox::OutboxStats;
///
/// let stats = OutboxStats::default();
/// assert_eq!(stats.pending + stats.sent + stats.refused, 0);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct OutboxStats {
    /// Committed, not yet published (or published and not yet marked).
    pub pending: u64,
    /// Published, kept until the relay's retention has passed.
    pub sent: u64,
    /// Refused by the broker for good: kept, never published.
    pub refused: u64,
}

/// What waits in an outbox, as a relay watches it (read by indexes only,
/// cheap to ask often): what an alert on a dead or lagging relay reads.
///
/// # Examples
///
/// ```
/// use tower_idempotency::outbox::OutboxBacklog;
///
/// let idle = OutboxBacklog::default();
/// assert!(idle.oldest_pending.is_none());
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct OutboxBacklog {
    /// Committed, not yet published.
    pub pending: u64,
    /// How long the oldest of them has waited, if any waits.
    pub oldest_pending: Option<Duration>,
    /// Refused by the broker for good: kept until requeued.
    pub refused: u64,
    /// Sent longer ago than the retention: what the next sweep deletes.
    pub awaiting_sweep: u64,
}

impl OutboxBacklog {
    /// Sets the outbox's gauges (feature `metrics`) to what a relay last
    /// read.
    pub(crate) fn report(&self) {
        #[cfg(feature = "metrics")]
        {
            use crate::observe::names;
            metrics::gauge!(names::OUTBOX_PENDING).set(self.pending as f64);
            metrics::gauge!(names::OUTBOX_OLDEST_PENDING)
                .set(self.oldest_pending.map_or(0.0, |age| age.as_secs_f64()));
            metrics::gauge!(names::OUTBOX_REFUSED).set(self.refused as f64);
            metrics::gauge!(names::OUTBOX_AWAITING_SWEEP).set(self.awaiting_sweep as f64);
        }
    }
}

/// A message's id derived from the request's storage key (its scope,
/// hashed, and its key), the execution its claim began, and its position:
/// the same on every publication of the message, and new with each
/// execution of the key — one that runs again after a forget or an expiry
/// sends new messages, never the ids of the rows the first one left.
#[cfg(sql)]
pub(crate) fn derived_id((key, execution): (&str, u128), position: u32) -> String {
    use sha2::{Digest, Sha256};

    let mut hash = Sha256::new();
    hash.update(key.as_bytes());
    hash.update([0]);
    hash.update(execution.to_be_bytes());
    hash.update(position.to_be_bytes());
    let digest = hash.finalize();
    let mut id = String::with_capacity(32);
    crate::fingerprint::push_hex(&mut id, &digest[..16]);
    id
}

#[cfg(all(test, sql))]
mod tests {
    use super::derived_id;

    #[test]
    fn derived_ids_are_stable_and_apart() {
        let first = derived_id(("scope:order-42", 7), 0);
        assert_eq!(first, derived_id(("scope:order-42", 7), 0));
        assert_eq!(first.len(), 32);
        assert_ne!(first, derived_id(("scope:order-42", 7), 1));
        assert_ne!(first, derived_id(("scope:order-43", 7), 0));
        assert_ne!(
            first,
            derived_id(("scope:order-42", 8), 0),
            "another execution"
        );
    }
}
