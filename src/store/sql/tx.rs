//! The granted claim of a transactional SQL store: a pooled connection
//! inside the request's transaction, which the store began with the claim
//! in it.

use std::{
    fmt,
    ops::{Deref, DerefMut},
    sync::Arc,
    time::Instant,
};

use sqlx::{Database, pool::PoolConnection};
use tokio::sync::Notify;

use super::dialect::{Dialect, Engine};
use crate::store::{FailedCompletion, Granted, Held};

/// The request's transaction on a transactional SQL store
/// (`PostgresTx`, `SqliteTx`,
/// `MySqlTx`), with its claim in it: the granted claim of a
/// [`SqlTxStore`](super::SqlTxStore). Handlers receive it through
/// [`IdempotentTx`](crate::IdempotentTx) (`IdempotentTx<PostgresTx>`), a
/// message's work as `&mut PostgresTx`; both dereference to the database
/// connection, so `sqlx::query(…).execute(&mut *tx)` writes in it.
///
/// It is sqlx's `Transaction` for this one purpose: the store sends the
/// claim with `BEGIN` and the record with `COMMIT`, which sqlx's own type
/// cannot. Do not commit or roll back yourself. A transaction that ended
/// in an error — a failed `COMMIT`, a lost connection — or that is dropped
/// still open (a task that crashed, an extractor kept too long) closes its
/// connection instead of returning it to the pool: the database rolls the
/// transaction back, the claim with it, and no later request inherits a
/// connection inside it.
///
/// # Examples
///
/// ```no_run
/// # #[cfg(feature = "postgres")]
/// # async fn demo(orders: tower_idempotency::message::IdempotencyProcessor<tower_idempotency::PostgresTxStore>) -> Result<(), Box<dyn std::error::Error>> {
/// use tower_idempotency::PostgresTx;
///
/// let payload = br#"{"order_id":"order-42","amount":1999}"#;
/// orders
///     .process("order-42", payload, async |tx: &mut PostgresTx| {
///         sqlx::query("INSERT INTO order_charges (order_id, amount) VALUES ($1, $2)")
///             .bind("order-42")
///             .bind(1999_i64)
///             .execute(&mut **tx)
///             .await?;
///         Ok::<_, sqlx::Error>(())
///     })
///     .await?;
/// # Ok(()) }
/// ```
pub struct SqlTx<D: Dialect> {
    /// `None` once committed or rolled back.
    connection: Option<PoolConnection<D::Db>>,
    /// Given up with the connection (dropped after it).
    held: D::Held,
    /// When the transaction began, to tell a commit its bound refused.
    pub(crate) began: Instant,
    /// The storage key it claimed and the execution this claim began
    /// (drawn afresh with each claim), which outgoing messages' ids derive
    /// from, and how many it enqueued.
    origin: Option<Arc<str>>,
    execution: u128,
    messages: u32,
    /// The claim's row lives this many milliseconds from a moment no
    /// earlier than this one (the claim was sent then).
    row_lifetime: Option<(Instant, i64)>,
    /// Statements sent with the commit, as SQL text: the rows of the
    /// outgoing messages it enqueued (one round trip fewer each).
    deferred: String,
    /// Woken once the transaction commits: a relay of this process that
    /// waits for the messages the transaction enqueued.
    wake: Option<Arc<Notify>>,
    /// In a batch, while a key claimed in it is open: how long `deferred`
    /// was at its savepoint (what its work deferred is dropped with it).
    savepoint: Option<usize>,
    /// Sent ahead of the transaction's next statement: a batch's key
    /// undone (its savepoint rolled back) costs no round trip of its own.
    ahead: String,
}
impl<D: Engine> SqlTx<D> {
    /// `connection` has just begun a transaction (with the claim in it).
    pub(crate) fn begun(connection: PoolConnection<D::Db>, held: D::Held, began: Instant) -> Self {
        Self {
            connection: Some(connection),
            held,
            began,
            origin: None,
            execution: 0,
            messages: 0,
            row_lifetime: None,
            deferred: String::new(),
            wake: None,
            savepoint: None,
            ahead: String::new(),
        }
    }

    /// Runs `sql` (simple protocol), which must end the transaction when it
    /// succeeds: the connection then goes back to the pool. On failure it
    /// is closed, and the database rolls back whatever is left — as when
    /// this future is dropped halfway (a timeout), the connection still
    /// held by the transaction, which closes it when dropped.
    pub(crate) async fn end(&mut self, sql: &str) -> Result<(), sqlx::Error> {
        let Some(connection) = self.connection.as_mut() else {
            return Err(sqlx::Error::PoolClosed);
        };
        let ended = D::raw(connection, sql).await;
        if ended.is_err() {
            self.close_on_drop();
        }
        drop(self.connection.take());
        ended
    }

    /// Runs the deferred statements, then `end` (which commits), in one
    /// round trip: see [`end`](Self::end). One of them failing (a
    /// duplicate id) stops the batch before its `COMMIT`.
    pub(crate) async fn commit_with(&mut self, end: &str) -> Result<(), sqlx::Error> {
        if self.deferred.is_empty() && self.ahead.is_empty() {
            return self.end(end).await;
        }
        let mut sql = std::mem::take(&mut self.ahead);
        sql.push_str(&std::mem::take(&mut self.deferred));
        sql.push_str(end);
        self.end(&sql).await?;
        if let Some(wake) = self.wake.take() {
            wake.notify_one();
        }
        Ok(())
    }

    /// The connection of a transaction one of its own statements ended (a
    /// `ROLLBACK` sent ahead of a read), or of a batch that never began one,
    /// to be pooled or reused.
    #[cfg_attr(not(any(feature = "mysql", feature = "sqlite")), allow(dead_code))]
    pub(crate) fn ended(mut self) -> Option<PoolConnection<D::Db>> {
        self.connection.take()
    }

    /// Gives a batch's transaction up after a failure that leaves its
    /// state unknown: the connection is closed (the database rolls back),
    /// and the batch's commit fails.
    pub(crate) fn abandon(&mut self) {
        self.close_on_drop();
        drop(self.connection.take());
    }

    /// The key claimed in the batch last, kept: its savepoint released by
    /// the statement that wrote its record.
    pub(crate) fn kept(&mut self) {
        if self.savepoint.take().is_some() {
            D::key_kept(&mut self.held);
        }
    }

    /// The key claimed in the batch last, undone — its claim and what its
    /// work wrote — by a rollback to its savepoint, sent ahead of the next
    /// statement (`undo`); what its work deferred is dropped. Without an
    /// open key (a claim that found the key taken), only `undo` is sent.
    pub(crate) fn undone(&mut self, undo: &str) {
        if let Some(at) = self.savepoint.take() {
            self.deferred.truncate(at);
            D::key_undone(&mut self.held);
        }
        self.ahead.push_str(undo);
    }

    /// What the transaction holds besides its connection.
    // SQLite's engine alone holds more than `()`.
    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
    pub(crate) fn holding(&mut self) -> &mut D::Held {
        &mut self.held
    }

    /// Marks the connection to be closed, not pooled, once the transaction
    /// ends, whatever ends it: one of its statements failed in a way that
    /// may leave it inside the transaction.
    pub(crate) fn close_on_drop(&mut self) {
        if let Some(connection) = &mut self.connection {
            connection.close_on_drop();
        }
    }
}

impl<D: Dialect> SqlTx<D> {
    /// The key this transaction claimed, with a row that lives
    /// `lifetime_ms` from its insert, which came after `sent`.
    pub(crate) fn claimed(&mut self, key: &str, sent: Instant, lifetime_ms: i64) {
        self.origin = Some(key.into());
        // A later execution of the key (after a forget, or once its record
        // expired) is another claim: its messages are new messages, never
        // the ids of the rows the first one left in the outbox.
        self.execution = fastrand::u128(..);
        self.messages = 0;
        self.row_lifetime = Some((sent, lifetime_ms));
    }

    /// A key claimed in a batch: its savepoint is open.
    pub(crate) fn opened(&mut self) {
        self.savepoint = Some(self.deferred.len());
    }

    /// Sends `sql` ahead of the transaction's next statement (its commit
    /// included): a statement whose failure may wait to be told until then.
    pub(crate) fn send_ahead(&mut self, sql: &str) {
        self.ahead.push_str(sql);
    }

    /// `sql`, after what is to be sent ahead of it.
    pub(crate) fn after_ahead(&mut self, sql: &str) -> String {
        let mut sent = std::mem::take(&mut self.ahead);
        sent.push_str(sql);
        sent
    }

    /// The milliseconds the claim's row is known to live from now at least,
    /// and its whole lifetime; `None` for a transaction without a claim.
    pub(crate) fn row_lifetime(&self) -> Option<(i64, i64)> {
        let (sent, lifetime) = self.row_lifetime?;
        let elapsed = i64::try_from(sent.elapsed().as_millis()).unwrap_or(i64::MAX);
        Some((lifetime.saturating_sub(elapsed), lifetime))
    }

    /// The storage key it claimed (empty for a transaction of the store's
    /// own), and the execution its claim began.
    pub(crate) fn origin(&self) -> (&str, u128) {
        (self.origin.as_deref().unwrap_or_default(), self.execution)
    }

    /// The position of the next message it enqueues.
    pub(crate) fn next_message(&mut self) -> u32 {
        let position = self.messages;
        self.messages += 1;
        position
    }

    /// Where statements to run with the commit are written, as SQL text,
    /// each ending with `; `.
    pub(crate) fn deferred(&mut self) -> &mut String {
        &mut self.deferred
    }

    /// Wakes `wake` once the transaction commits (with its deferred
    /// statements); whether this is the first such wish.
    pub(crate) fn wake_on_commit(&mut self, wake: &Arc<Notify>) -> bool {
        let first = self.wake.is_none();
        self.wake = Some(wake.clone());
        first
    }
}

impl<D: Dialect> Granted for SqlTx<D> {
    fn held(&self) -> Held {
        Held::ForItsLife
    }

    fn lent_to_work(&self) -> bool {
        true
    }

    fn failed_completion(&self) -> FailedCompletion {
        FailedCompletion::NothingCommitted
    }
}

impl<D: Dialect> Deref for SqlTx<D> {
    type Target = <D::Db as Database>::Connection;

    fn deref(&self) -> &Self::Target {
        self.connection
            .as_ref()
            .expect("the transaction is open until the layer ends it")
    }
}

impl<D: Dialect> DerefMut for SqlTx<D> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        self.connection
            .as_mut()
            .expect("the transaction is open until the layer ends it")
    }
}

/// The transaction itself, where a handler holds it wrapped (see
/// [`Outbox::enqueue`](crate::outbox::Outbox::enqueue)).
impl<D: Dialect> AsMut<SqlTx<D>> for SqlTx<D> {
    fn as_mut(&mut self) -> &mut SqlTx<D> {
        self
    }
}

impl<D: Dialect> Drop for SqlTx<D> {
    fn drop(&mut self) {
        if let Some(connection) = &mut self.connection {
            connection.close_on_drop();
        }
    }
}

impl<D: Engine> fmt::Debug for SqlTx<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct(D::TX)
            .field("open", &self.connection.is_some())
            .finish()
    }
}
