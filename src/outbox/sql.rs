//! The outbox of a transactional SQL store: a table in the store's
//! database, whose SQL is the SQL family's (`store::sql::outbox`); here,
//! the rows it answers become messages and counts.

// The SQL engines are this crate's own: an outbox is named by its engine
// (`Outbox<Postgres>`), and the `OutboxEngine` its impls are bounded by
// stays an implementation detail.
#![allow(private_bounds)]

use std::{fmt, sync::Arc, time::Duration};

use super::{
    OutboxBacklog, OutboxMessage, OutboxStats, OutboxTable, OutgoingMessage, Settlement, derived_id,
};
use crate::store::{
    LeaseToken, StoreError,
    sql::{
        Base, SqlRecords, SqlTx, SqlTxStore,
        dialect::Dialect,
        outbox::{MessageRow, NewMessage, OutboxEngine, SqlOutbox},
    },
};

/// The table the outbox uses unless told otherwise.
const DEFAULT_TABLE: &str = "idempotency_outbox";

/// How long one of the outbox's own statements may take unless told
/// otherwise: they claim, mark and sweep whole batches, so the store's
/// bound, sized for one request's record, would fail a relay's round on a
/// loaded database again and again — and a round that never finishes
/// publishes nothing.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// The outbox of a transactional SQL store: a table in its database
/// (schema: each engine's `OUTBOX_SCHEMA`, e.g.
/// `store::postgres::OUTBOX_SCHEMA`).
/// Cloning is cheap. See the [module docs](super).
pub struct Outbox<D: Dialect> {
    table: SqlOutbox<D>,
}

impl<D: Dialect> Clone for Outbox<D> {
    fn clone(&self) -> Self {
        Self {
            table: self.table.clone(),
        }
    }
}

impl<D: Dialect> fmt::Debug for Outbox<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Outbox")
            .field("table", &self.table.table())
            .finish_non_exhaustive()
    }
}

/// Builds an [`Outbox`]: see [`Outbox::on`].
pub struct OutboxBuilder<D: Dialect> {
    base: Arc<Base<D>>,
    table: String,
    create_table: bool,
    timeout: Duration,
}

impl<D: Dialect> fmt::Debug for OutboxBuilder<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OutboxBuilder")
            .field("table", &self.table)
            .field("create_table", &self.create_table)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl<D: Dialect> Outbox<D> {
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
    /// this call. The commit wakes a relay of this process at once, and on
    /// PostgreSQL notifies relays elsewhere.
    ///
    /// # Errors
    ///
    /// None today; kept for stores that write at once.
    ///
    /// # Examples
    ///
    /// See the [module docs](super).
    pub async fn enqueue(
        &self,
        tx: &mut impl AsMut<SqlTx<D>>,
        message: OutgoingMessage,
    ) -> Result<String, StoreError> {
        let mut headers = message.headers;
        crate::observe::trace_context_into(&mut headers);
        let headers = serde_json::to_string(&headers).expect("strings serialize");
        let own = message.id;
        Ok(self.table.enqueue(
            tx.as_mut(),
            |origin, position| own.unwrap_or_else(|| derived_id(origin, position)),
            NewMessage {
                destination: &message.destination,
                ordering_key: message.ordering_key.as_deref(),
                payload: &message.payload,
                headers: &headers,
            },
        ))
    }
}
impl<D: OutboxEngine> Outbox<D> {
    /// The outbox of `store`, in its database: table `idempotency_outbox`,
    /// which must exist unless
    /// [`create_table_if_missing`](OutboxBuilder::create_table_if_missing).
    ///
    /// `store` is the handlers' transactional store, whose start-up check
    /// needs the idempotency records' table too. A process that only
    /// relays, started before any API instance made that table, opens its
    /// store with `create_table_if_missing()` as the API does, or reaches
    /// the outbox through the records alone with [`beside`](Self::beside).
    ///
    /// # Examples
    ///
    /// See the [module docs](super).
    pub fn on(store: &SqlTxStore<D>) -> OutboxBuilder<D> {
        Self::in_database(store.base.clone())
    }

    /// The outbox in the database of `records`, as an operator sees it:
    /// what it holds ([`stats`](Self::stats), [`backlog`](Self::backlog)),
    /// what the broker refused ([`refused`](Self::refused)) and its
    /// [`requeue`](Self::requeue) — without opening a transactional store
    /// (and its start-up check) first.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # #[cfg(feature = "postgres")]
    /// # async fn demo() -> Result<(), tower_idempotency::store::StoreError> {
    /// use tower_idempotency::{PostgresStore, outbox::Outbox};
    ///
    /// let records = PostgresStore::builder()
    ///     .records()
    ///     .connect("postgres://ops@127.0.0.1:5432/payments")
    ///     .await?;
    /// let outbox = Outbox::beside(&records).build().await?;
    /// println!("{:?}", outbox.stats().await?);
    /// # Ok(()) }
    /// ```
    pub fn beside(records: &SqlRecords<D>) -> OutboxBuilder<D> {
        Self::in_database(records.base.clone())
    }

    fn in_database(base: Arc<Base<D>>) -> OutboxBuilder<D> {
        OutboxBuilder {
            base,
            table: DEFAULT_TABLE.to_owned(),
            create_table: false,
            timeout: DEFAULT_TIMEOUT,
        }
    }

    /// How many messages the outbox holds, by state (a scan of the table).
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
        let mut stats = OutboxStats::default();
        for (state, count) in self.table.counts().await? {
            let count = u64::try_from(count).unwrap_or(0);
            match state {
                0 => stats.pending = count,
                1 => stats.sent = count,
                _ => stats.refused += count,
            }
        }
        Ok(stats)
    }

    /// What waits, read by indexes only: see [`OutboxBacklog`].
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
    /// use std::time::Duration;
    ///
    /// let backlog = outbox.backlog(Duration::from_secs(7 * 86_400)).await?;
    /// println!("{} pending, the oldest for {:?}", backlog.pending, backlog.oldest_pending);
    /// # Ok(()) }
    /// ```
    pub async fn backlog(&self, retention: Duration) -> Result<OutboxBacklog, StoreError> {
        let mut backlog = OutboxBacklog::default();
        for row in self.table.backlog(retention).await? {
            let count = u64::try_from(row.count).unwrap_or(0);
            match row.state {
                0 => {
                    backlog.pending = count;
                    backlog.oldest_pending = row.oldest.map(|at| {
                        let age = row.now.saturating_sub(at);
                        Duration::from_millis(u64::try_from(age).unwrap_or(0))
                    });
                }
                2 => backlog.refused = count,
                _ => backlog.awaiting_sweep = count,
            }
        }
        Ok(backlog)
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
        let rows = self.table.refused(limit).await?;
        Ok(rows.into_iter().map(from_row).collect())
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
        self.table.requeue(id).await
    }
}
impl<D: OutboxEngine> OutboxTable for Outbox<D> {
    /// The heads of due keys, then their runs behind them: one statement,
    /// and a second only when a head has a run behind it.
    async fn claim(
        &self,
        claim: LeaseToken,
        batch: u32,
        claim_for: Duration,
    ) -> Result<Vec<OutboxMessage>, StoreError> {
        let rows = self
            .table
            .claim(&claim.to_bytes(), batch, claim_for)
            .await?;
        Ok(rows.into_iter().map(from_row).collect())
    }

    /// One statement.
    async fn extend(&self, claim: LeaseToken, claim_for: Duration) -> Result<u64, StoreError> {
        self.table.extend(&claim.to_bytes(), claim_for).await
    }

    /// One round trip: every statement of the settlement as text.
    async fn settle(&self, claim: LeaseToken, settled: &Settlement<'_>) -> Result<(), StoreError> {
        self.table
            .settle(
                &claim.to_bytes(),
                &settled.sent,
                &settled.retried,
                &settled.refused,
                &settled.released,
            )
            .await
    }

    async fn sweep(&self, sent_before: Duration, batch: u32) -> Result<u64, StoreError> {
        self.table.sweep(sent_before, batch).await
    }

    async fn stats(&self) -> Result<OutboxStats, StoreError> {
        Outbox::stats(self).await
    }

    async fn backlog(&self, retention: Duration) -> Result<OutboxBacklog, StoreError> {
        Outbox::backlog(self, retention).await
    }

    async fn refused(&self, limit: u32) -> Result<Vec<OutboxMessage>, StoreError> {
        Outbox::refused(self, limit).await
    }

    async fn requeue(&self, id: &str) -> Result<bool, StoreError> {
        Outbox::requeue(self, id).await
    }

    /// This process's commits that enqueued, and — once a relay asks, on
    /// PostgreSQL — every commit's `NOTIFY`, heard on a connection of its
    /// own.
    async fn committed(&self) {
        self.table.committed().await
    }
}
impl<D: OutboxEngine> OutboxBuilder<D> {
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

    /// How long each of the outbox's own statements — a relay's claim, its
    /// marks and sweeps, `stats`, `requeue` — may take before it fails
    /// with [`StoreError::Timeout`] (default 10 s). Enqueueing is not
    /// bounded by it: it runs in the request's transaction, under the
    /// store's own timeout. A claim answered after the relay's
    /// [`claim_for`](super::OutboxRelay::claim_for) lapsed is given back
    /// unpublished.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # #[cfg(feature = "sqlite")]
    /// # async fn demo(store: tower_idempotency::SqliteTxStore) -> Result<(), tower_idempotency::store::StoreError> {
    /// use std::time::Duration;
    /// use tower_idempotency::outbox::Outbox;
    ///
    /// let outbox = Outbox::on(&store).timeout(Duration::from_secs(5)).build().await?;
    /// # let _ = outbox; Ok(()) }
    /// ```
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Creates the table and its indexes at start-up if they are missing
    /// (or run the engine's `OUTBOX_SCHEMA` with your migrations).
    ///
    /// # Examples
    ///
    /// See the [module docs](super).
    pub fn create_table_if_missing(mut self) -> Self {
        self.create_table = true;
        self
    }

    /// The outbox; checks (or creates) its table.
    ///
    /// # Errors
    ///
    /// [`StoreError::Misconfigured`] for a table name that is not a plain
    /// identifier, a missing table (naming the fix), or a user who may not
    /// create it when asked to; the database's errors otherwise.
    ///
    /// # Examples
    ///
    /// See the [module docs](super).
    pub async fn build(self) -> Result<Outbox<D>, StoreError> {
        let table =
            SqlOutbox::open(self.base, &self.table, self.create_table, self.timeout).await?;
        Ok(Outbox { table })
    }
}

/// A row as a publisher receives it.
fn from_row(row: MessageRow) -> OutboxMessage {
    OutboxMessage {
        id: row.id,
        destination: row.destination,
        payload: row.payload,
        headers: serde_json::from_str(&row.headers).unwrap_or_default(),
        ordering_key: row.ordering_key,
        enqueued_at_ms: row.created_at,
        attempts: u32::try_from(row.attempts).unwrap_or(u32::MAX),
    }
}
