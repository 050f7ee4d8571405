//! The transactional outbox: the messages a handler sends commit with its
//! record and its effects, and a relay publishes them afterwards.
//!
//! A payments handler rarely stops at its own table: it tells the rest of
//! the system (`charge.created`). Published before the commit, that
//! message announces a charge that may roll back; published after it, it
//! is lost when the process dies in between, and sent again by a retry
//! that executes again. So the handler does not publish: it
//! [enqueues](Outbox::enqueue) the message with its transaction — a row of
//! the outbox table, committed with the record and the effect or rolled
//! back with them. A replay enqueues nothing, and a key whose handler ran
//! once enqueued its messages once.
//!
//! An [`OutboxRelay`] (one per instance; several may run at once) then
//! claims committed messages, hands each to a [`Publisher`] — your broker's
//! client: SQS, NATS JetStream, RabbitMQ, Kafka — and marks it sent. Each
//! message has a stable id, derived from the request's scope and key, the
//! execution (the claim) that enqueued it and its position (or given by
//! the handler), which the
//! publisher passes on as the broker's deduplication id (SQS FIFO's
//! `MessageDeduplicationId`, JetStream's `Nats-Msg-Id`, AMQP's
//! `message-id`): a relay that died between publishing and marking
//! publishes again with the same id, and the broker's window or the
//! consumer's own idempotency absorbs it. The path end to end:
//!
//! ```text
//! client key ─► layer: record + charge + outbox row, one commit
//!            ─► relay: publish with the message id, mark sent
//!            ─► broker: deduplicates the id within its window
//!            ─► consumer (the consumer door, keyed by the message id):
//!               its record + its effect, one commit
//! ```
//!
//! Messages with one ordering key are published in the order they were
//! enqueued: the next is claimed once the one before it was sent. A
//! message the broker refuses for good is kept, marked refused and logged
//! — never dropped ([`Outbox::refused`], [`Outbox::requeue`]). Sent
//! messages are deleted after a retention ([`OutboxRelay::retention`]).
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
//!     .layer(IdempotencyLayer::new(store).single_tenant())
//!     .with_state(outbox);
//! # let _ = (app, relay); Ok(()) }
//! ```

mod relay;
pub(crate) mod statements;

use std::{fmt, sync::Arc, time::Duration};

use futures_util::future::BoxFuture;
use sha2::{Digest, Sha256};

pub use relay::{OutboxRelay, PublishError, Publisher, RelayRound};

use super::{
    SqlTx, SqlTxStore,
    base::now_ms,
    checked_table,
    dialect::{Args, Dialect, Engine, ErrorClass, MessageRow, OutboxStatements, Stmt},
};
use crate::store::StoreError;

/// The table the outbox uses unless told otherwise.
const DEFAULT_TABLE: &str = "idempotency_outbox";

/// A message for the outbox: where it goes, what it says, and how it is
/// ordered and identified.
///
/// # Examples
///
/// ```
/// # #[cfg(feature = "sqlite")] {
/// use tower_idempotency::outbox::OutgoingMessage;
///
/// let event = OutgoingMessage::new("charges", br#"{"type":"charge.created"}"#.to_vec())
///     .ordering_key("acct_alice")
///     .header("type", "charge.created");
/// # let _ = event; }
/// ```
#[derive(Clone, Debug)]
pub struct OutgoingMessage {
    destination: String,
    payload: Vec<u8>,
    headers: Vec<(String, String)>,
    ordering_key: Option<String>,
    id: Option<String>,
}

impl OutgoingMessage {
    /// A message for `destination` — what the publisher makes of it: a
    /// queue URL, a subject, a routing key.
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

    /// A header the publisher passes on (a message attribute, a NATS or
    /// AMQP header).
    ///
    /// # Examples
    ///
    /// See the [type's docs](Self).
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }

    /// Messages with one ordering key are published in the order they
    /// were enqueued (an SQS FIFO message group); without one, in any
    /// order.
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
    /// # #[cfg(feature = "sqlite")] {
    /// use tower_idempotency::outbox::OutgoingMessage;
    ///
    /// let event = OutgoingMessage::new("charges", b"{}".to_vec()).id("charge.created:ch_42");
    /// # let _ = event; }
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
    /// Deterministic: the same on every publication of the message. Pass
    /// it on as the broker's deduplication id.
    pub id: String,
    /// Where it goes, as the handler said.
    pub destination: String,
    /// What it says.
    pub payload: Vec<u8>,
    /// Its headers, in the handler's order.
    pub headers: Vec<(String, String)>,
    /// Its ordering key, if it has one.
    pub ordering_key: Option<String>,
    /// When it was enqueued, in Unix milliseconds.
    pub enqueued_at_ms: i64,
    /// Its publication attempts so far, this one included.
    pub attempts: u32,
}

impl OutboxMessage {
    fn from_row(row: MessageRow) -> Self {
        Self {
            id: row.id,
            destination: row.destination,
            payload: row.payload,
            headers: serde_json::from_str(&row.headers).unwrap_or_default(),
            ordering_key: row.ordering_key,
            enqueued_at_ms: row.created_at,
            attempts: u32::try_from(row.attempts).unwrap_or(u32::MAX),
        }
    }
}

/// How many messages the outbox holds, by state.
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

/// The outbox of a transactional SQL store: a table in the store's
/// database. Cloning is cheap. See the [module docs](self).
pub struct Outbox<D: Dialect> {
    store: SqlTxStore<D>,
    sql: Arc<OutboxStatements>,
    table: Arc<str>,
    ops: Ops<D>,
}

impl<D: Dialect> Clone for Outbox<D> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
            sql: self.sql.clone(),
            table: self.table.clone(),
            ops: self.ops,
        }
    }
}

type Done<'a, T> = BoxFuture<'a, Result<T, StoreError>>;
/// A query on a pooled connection, answering `T`.
type Query<D, T> = for<'a> fn(&'a Outbox<D>, &'a Stmt, &'a Args<'a>) -> Done<'a, T>;

/// The engine's ways to run the outbox's statements, chosen when the
/// outbox is built (where the engine is known), so that its methods ask
/// nothing of `D` but that it is a [`Dialect`].
struct Ops<D: Dialect> {
    /// On a pooled connection, this process's turn to write held.
    execute: Query<D, u64>,
    /// On a pooled connection, this process's turn to write held (a claim
    /// that answers with its rows writes them).
    messages: Query<D, Vec<OutboxMessage>>,
    pairs: Query<D, Vec<(i64, i64)>>,
    /// SQL text, on a pooled connection.
    raw: for<'a> fn(&'a Outbox<D>, &'a str) -> Done<'a, ()>,
}

impl<D: Dialect> Clone for Ops<D> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<D: Dialect> Copy for Ops<D> {}

impl<D: Engine> Ops<D> {
    fn new() -> Self {
        Self {
            execute: |outbox, stmt, args| {
                Box::pin(async move {
                    let base = &outbox.store.base;
                    let _turn = base.engine.turn(Some(base.timeout)).await?;
                    base.execute(stmt, args).await
                })
            },
            messages: |outbox, stmt, args| {
                Box::pin(async move {
                    let base = &outbox.store.base;
                    let _turn = base.engine.turn(Some(base.timeout)).await?;
                    let rows = base
                        .bounded(async {
                            let mut on = base.pool.acquire().await.map_err(|e| base.error(e))?;
                            D::fetch_messages(&mut on, stmt, args)
                                .await
                                .map_err(|e| base.error(e))
                        })
                        .await?;
                    Ok(rows.into_iter().map(OutboxMessage::from_row).collect())
                })
            },
            raw: |outbox, sql| {
                Box::pin(async move {
                    let base = &outbox.store.base;
                    base.bounded(async {
                        let mut on = base.pool.acquire().await.map_err(|e| base.error(e))?;
                        D::raw(&mut on, sql).await.map_err(|e| base.error(e))
                    })
                    .await
                })
            },
            pairs: |outbox, stmt, args| {
                Box::pin(async move {
                    let base = &outbox.store.base;
                    base.bounded(async {
                        let mut on = base.pool.acquire().await.map_err(|e| base.error(e))?;
                        D::fetch_pairs(&mut on, stmt, args)
                            .await
                            .map_err(|e| base.error(e))
                    })
                    .await
                })
            },
        }
    }
}

impl<D: Dialect> fmt::Debug for Outbox<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Outbox")
            .field("table", &self.table)
            .finish_non_exhaustive()
    }
}

/// Builds an [`Outbox`]: see [`Outbox::on`].
pub struct OutboxBuilder<D: Dialect> {
    store: SqlTxStore<D>,
    table: String,
    create_table: bool,
}

impl<D: Dialect> fmt::Debug for OutboxBuilder<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OutboxBuilder")
            .field("table", &self.table)
            .field("create_table", &self.create_table)
            .finish_non_exhaustive()
    }
}

impl<D: Dialect> Outbox<D> {
    /// The outbox of `store`, in its database: table `idempotency_outbox`,
    /// which must exist unless
    /// [`create_table_if_missing`](OutboxBuilder::create_table_if_missing).
    ///
    /// # Examples
    ///
    /// See the [module docs](self).
    pub fn on(store: &SqlTxStore<D>) -> OutboxBuilder<D> {
        OutboxBuilder {
            store: store.clone(),
            table: DEFAULT_TABLE.to_owned(),
            create_table: false,
        }
    }

    /// Adds `message` to the request's transaction (an
    /// [`IdempotentTx`](crate::IdempotentTx) or, in a message's work, the
    /// [`SqlTx`] itself): it commits with the record and the effects, or
    /// rolls back with them. Its id, which it returns, is derived from the
    /// request's scope and key, the execution (each claim of the key is
    /// one: a key that executes again after a forget or an expiry sends
    /// new messages) and the message's position among the ones it
    /// enqueued, unless the message names its own.
    ///
    /// The message's row travels with the transaction's `COMMIT`, in the
    /// same round trip, rather than in one of its own: an id already in
    /// the outbox (one the handler gave twice) fails the commit — nothing
    /// of the request commits, and its answer is withheld (`500`) — not
    /// this call.
    ///
    /// # Errors
    ///
    /// None today; kept for stores that write at once.
    ///
    /// # Examples
    ///
    /// See the [module docs](self).
    pub async fn enqueue(
        &self,
        tx: &mut impl AsMut<SqlTx<D>>,
        message: OutgoingMessage,
    ) -> Result<String, StoreError> {
        let tx = tx.as_mut();
        let position = tx.next_message();
        let id = match message.id {
            Some(id) => id,
            None => derived_id(tx.origin(), position),
        };
        let headers = serde_json::to_string(&message.headers).expect("strings serialize");
        statements::RowInsert {
            id: &id,
            destination: &message.destination,
            ordering_key: message.ordering_key.as_deref(),
            payload: &message.payload,
            headers: &headers,
            created_at: now_ms(),
        }
        .write(tx.deferred(), &self.sql);
        Ok(id)
    }

    /// How many messages the outbox holds, by state.
    ///
    /// # Errors
    ///
    /// The database's.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # #[cfg(feature = "sqlite")]
    /// # async fn demo(outbox: tower_idempotency::outbox::Outbox<tower_idempotency::store::sql::sqlite::Sqlite>) -> Result<(), tower_idempotency::store::StoreError> {
    /// let stats = outbox.stats().await?;
    /// if stats.refused > 0 {
    ///     eprintln!("{} messages refused by the broker", stats.refused);
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn stats(&self) -> Result<OutboxStats, StoreError> {
        let pairs = (self.ops.pairs)(self, &self.sql.counts, &Args::default()).await?;
        let mut stats = OutboxStats::default();
        for (state, count) in pairs {
            let count = u64::try_from(count).unwrap_or(0);
            match state {
                0 => stats.pending = count,
                1 => stats.sent = count,
                _ => stats.refused += count,
            }
        }
        Ok(stats)
    }

    /// Up to `limit` messages the broker refused for good, oldest first:
    /// kept, never published, until [requeued](Self::requeue).
    ///
    /// # Errors
    ///
    /// The database's.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # #[cfg(feature = "sqlite")]
    /// # async fn demo(outbox: tower_idempotency::outbox::Outbox<tower_idempotency::store::sql::sqlite::Sqlite>) -> Result<(), tower_idempotency::store::StoreError> {
    /// for message in outbox.refused(100).await? {
    ///     // Fix what the broker refused (a missing queue, say), then:
    ///     outbox.requeue(&message.id).await?;
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn refused(&self, limit: u32) -> Result<Vec<OutboxMessage>, StoreError> {
        let args = Args {
            batch: i64::from(limit),
            ..Args::default()
        };
        self.messages(&self.sql.refused, &args).await
    }

    /// Makes a refused message pending again; whether there was one.
    ///
    /// # Errors
    ///
    /// The database's.
    ///
    /// # Examples
    ///
    /// See [`refused`](Self::refused).
    pub async fn requeue(&self, id: &str) -> Result<bool, StoreError> {
        let args = Args {
            id,
            ..Args::default()
        };
        self.execute(&self.sql.requeue, &args).await.map(|n| n > 0)
    }

    /// Runs `stmt`, this process's turn to write held (SQLite).
    async fn execute(&self, stmt: &Stmt, args: &Args<'_>) -> Result<u64, StoreError> {
        (self.ops.execute)(self, stmt, args).await
    }

    async fn messages(
        &self,
        stmt: &Stmt,
        args: &Args<'_>,
    ) -> Result<Vec<OutboxMessage>, StoreError> {
        (self.ops.messages)(self, stmt, args).await
    }

    async fn raw(&self, sql: &str) -> Result<(), StoreError> {
        (self.ops.raw)(self, sql).await
    }
}

// See `SqlStore::builder`: the engines are this crate's own.
#[allow(private_bounds)]
impl<D: Engine> OutboxBuilder<D> {
    /// The outbox's table (default `idempotency_outbox`): a plain
    /// lowercase identifier, optionally schema-qualified.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # #[cfg(feature = "sqlite")]
    /// # async fn demo(store: tower_idempotency::SqliteTxStore) -> Result<(), tower_idempotency::store::StoreError> {
    /// use tower_idempotency::outbox::Outbox;
    ///
    /// let outbox = Outbox::on(&store).table("payments_outbox").build().await?;
    /// # let _ = outbox; Ok(()) }
    /// ```
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// Creates the table and its indexes at start-up if they are missing.
    ///
    /// # Examples
    ///
    /// See the [module docs](self).
    pub fn create_table_if_missing(mut self) -> Self {
        self.create_table = true;
        self
    }

    /// The outbox; checks (or creates) its table.
    ///
    /// # Errors
    ///
    /// [`StoreError::Misconfigured`] for a table name that is not a plain
    /// identifier, or a missing table (naming the fix); the database's
    /// errors otherwise.
    ///
    /// # Examples
    ///
    /// See the [module docs](self).
    pub async fn build(self) -> Result<Outbox<D>, StoreError> {
        checked_table(&self.table, "Outbox")?;
        let sql = D::outbox_statements(&self.table);
        let store = self.store;
        let base = &store.base;
        if self.create_table {
            let _turn = base.engine.turn(Some(base.timeout)).await?;
            let mut on = base.pool.acquire().await.map_err(|e| base.error(e))?;
            let mut attempt = 0;
            loop {
                attempt += 1;
                match D::raw(&mut on, &sql.schema).await {
                    Ok(()) => break,
                    Err(error) if attempt < 10 && D::lost_schema_race(&error) => {
                        tokio::time::sleep(Duration::from_millis(20 * attempt)).await;
                    }
                    Err(error) => {
                        return Err(crate::store::sql::decide::create_error(
                            &base.engine,
                            &self.table,
                            error,
                        ));
                    }
                }
            }
        }
        let mut on = base.pool.acquire().await.map_err(|e| base.error(e))?;
        if let Err(error) = D::execute(&mut on, &sql.exists, &Args::default()).await {
            if D::classify(&error) == ErrorClass::MissingTable {
                return Err(StoreError::Misconfigured(format!(
                    "the outbox table {} does not exist: create it at start-up with \
                     `Outbox::on(&store).create_table_if_missing()`, or run its schema \
                     with your migrations",
                    self.table
                )));
            }
            return Err(base.error(error));
        }
        Ok(Outbox {
            store: store.clone(),
            sql: Arc::new(sql),
            table: self.table.into(),
            ops: Ops::new(),
        })
    }
}

/// A message's id derived from the request's storage key (its scope,
/// hashed, and its key), the execution its claim began, and its position:
/// the same on every publication of the message, and new with each
/// execution of the key — one that runs again after a forget or an expiry
/// sends new messages, never the ids of the rows the first one left.
fn derived_id((key, execution): (&str, u128), position: u32) -> String {
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

#[cfg(test)]
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
