//! The outbox of a transactional SQL store: a table in the store's
//! database, written once over each engine's outbox SQL
//! (`store::sql::outbox`).

use std::{
    fmt,
    sync::{Arc, OnceLock},
    time::Duration,
};

use tokio::sync::Notify;

use super::{
    OutboxBacklog, OutboxMessage, OutboxStats, OutboxTable, OutgoingMessage, Settlement, derived_id,
};
use crate::store::{
    LeaseToken, StoreError,
    sql::{
        Base, SqlRecords, SqlTx, SqlTxStore, checked_table, create_error,
        dialect::{Dialect, ErrorClass},
        now_ms,
        outbox::{
            Literal, MessageRow, OutboxArgs, OutboxEngine, OutboxStatements, OutboxStmt, statements,
        },
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
    base: Arc<Base<D>>,
    sql: Arc<OutboxStatements>,
    /// Woken by this process's commits that enqueued, and by the database's
    /// notifications once a relay listens.
    wake: Arc<Notify>,
    /// The bound on each of the outbox's own statements: see
    /// [`OutboxBuilder::timeout`].
    timeout: Duration,
    listening: Arc<OnceLock<Listening>>,
    /// When the table's statistics were last refreshed (where the engine
    /// needs it: see `OutboxSql::analyze`).
    analyzed: Arc<std::sync::Mutex<Option<std::time::Instant>>>,
}

/// The task that listens for other processes' commits, stopped with the
/// last clone of its outbox.
struct Listening(Option<tokio::task::JoinHandle<()>>);

impl Drop for Listening {
    fn drop(&mut self) {
        if let Some(task) = &self.0 {
            task.abort();
        }
    }
}

impl<D: Dialect> Clone for Outbox<D> {
    fn clone(&self) -> Self {
        Self {
            base: self.base.clone(),
            sql: self.sql.clone(),
            wake: self.wake.clone(),
            timeout: self.timeout,
            listening: self.listening.clone(),
            analyzed: self.analyzed.clone(),
        }
    }
}

impl<D: Dialect> fmt::Debug for Outbox<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Outbox")
            .field("table", &self.sql.table)
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
        let tx = tx.as_mut();
        let position = tx.next_message();
        let id = match message.id {
            Some(id) => id,
            None => derived_id(tx.origin(), position),
        };
        let mut headers = message.headers;
        crate::observe::trace_context_into(&mut headers);
        let headers = serde_json::to_string(&headers).expect("strings serialize");
        let mut row = Literal::new(&self.sql, now_ms());
        row.sql("INSERT INTO {t} (id, destination, ordering_key, payload, headers, created_at) VALUES (")
            .text(&id)
            .sql(", ")
            .text(&message.destination)
            .sql(", ");
        match &message.ordering_key {
            Some(key) => row.text(key),
            None => row.sql("NULL"),
        };
        row.sql(", ")
            .bytes(&message.payload)
            .sql(", ")
            .text(&headers)
            .sql(", ")
            .now()
            .sql(")")
            .end();
        if tx.wake_on_commit(&self.wake)
            && let Some(channel) = &self.sql.channel
        {
            row.sql("NOTIFY ").sql(channel).end();
        }
        tx.deferred().push_str(&row.into_sql());
        Ok(id)
    }
}

// See `SqlStore::builder`: the engines are this crate's own.
#[allow(private_bounds)]
impl<D: OutboxEngine> Outbox<D> {
    /// The outbox of `store`, in its database: table `idempotency_outbox`,
    /// which must exist unless
    /// [`create_table_if_missing`](OutboxBuilder::create_table_if_missing).
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
        let base = &self.base;
        let pairs = self
            .bounded(async {
                let mut on = base.pool.acquire().await.map_err(|e| base.error(e))?;
                D::outbox_pairs(&mut on, &self.sql.counts, &OutboxArgs::default())
                    .await
                    .map_err(|e| base.error(e))
            })
            .await?;
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
        let args = OutboxArgs {
            now: now_ms(),
            ms: millis(retention),
            ..OutboxArgs::default()
        };
        let base = &self.base;
        let rows = self
            .bounded(async {
                let mut on = base.pool.acquire().await.map_err(|e| base.error(e))?;
                D::outbox_backlog(&mut on, &self.sql.backlog, &args)
                    .await
                    .map_err(|e| base.error(e))
            })
            .await?;
        let mut backlog = OutboxBacklog::default();
        for (state, count, oldest, now) in rows {
            let count = u64::try_from(count).unwrap_or(0);
            match state {
                0 => {
                    backlog.pending = count;
                    backlog.oldest_pending = oldest.map(|at| {
                        Duration::from_millis(u64::try_from(now.saturating_sub(at)).unwrap_or(0))
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
        let args = OutboxArgs {
            batch: i64::from(limit),
            ..OutboxArgs::default()
        };
        self.messages(&self.sql.refused, &args, false).await
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
        let args = OutboxArgs {
            id,
            ..OutboxArgs::default()
        };
        let base = &self.base;
        let _turn = base.engine.turn(Some(self.timeout)).await?;
        let requeued = self
            .bounded(async {
                let mut on = base.pool.acquire().await.map_err(|e| base.error(e))?;
                D::outbox_execute(&mut on, &self.sql.requeue, &args)
                    .await
                    .map_err(|e| base.error(e))
            })
            .await?;
        if requeued > 0 {
            self.wake.notify_one();
        }
        Ok(requeued > 0)
    }

    /// `work`, failed with [`StoreError::Timeout`] past the outbox's bound.
    async fn bounded<T>(
        &self,
        work: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        crate::store::bounded(self.timeout, work).await
    }

    /// Runs `stmt` on a pooled connection — this process's turn to write
    /// held, and the engine's isolation set first, when it `writes` — and
    /// reads the messages it answers.
    async fn messages(
        &self,
        stmt: &OutboxStmt,
        args: &OutboxArgs<'_>,
        writes: bool,
    ) -> Result<Vec<OutboxMessage>, StoreError> {
        let base = &self.base;
        let _turn = match writes {
            true => Some(base.engine.turn(Some(self.timeout)).await?),
            false => None,
        };
        let rows = self
            .bounded(async {
                let mut on = base.pool.acquire().await.map_err(|e| base.error(e))?;
                if let (true, Some(before)) = (writes, D::OUTBOX.before_write) {
                    D::raw(&mut on, before).await.map_err(|e| base.error(e))?;
                }
                D::outbox_fetch(&mut on, stmt, args)
                    .await
                    .map_err(|e| base.error(e))
            })
            .await?;
        Ok(rows.into_iter().map(from_row).collect())
    }

    /// Runs SQL text whose values are literals (several statements, one
    /// round trip), this process's turn to write held.
    async fn write(&self, sql: String) -> Result<u64, StoreError> {
        let base = &self.base;
        let _turn = base.engine.turn(Some(self.timeout)).await?;
        self.bounded(async {
            let mut on = base.pool.acquire().await.map_err(|e| base.error(e))?;
            D::raw_counted(&mut on, &sql)
                .await
                .map_err(|e| base.error(e))
        })
        .await
    }

    /// Refreshes the table's statistics where the engine needs it, at most
    /// once a minute — a plan made for a nearly empty table reads every
    /// pending row on each claim. A failure is logged: only speed depends on
    /// it.
    async fn refresh_statistics(&self, claimed: usize, batch: u32) {
        let Some(analyze) = &self.sql.analyze else {
            return;
        };
        let due = {
            let mut last = crate::lock::lock(&self.analyzed);
            let due = match *last {
                None => true,
                Some(at) => claimed >= batch as usize && at.elapsed() >= Duration::from_secs(60),
            };
            if due {
                *last = Some(std::time::Instant::now());
            }
            due
        };
        let base = &self.base;
        if due {
            let analyzed = self
                .bounded(async {
                    let mut on = base.pool.acquire().await.map_err(|e| base.error(e))?;
                    D::raw(&mut on, analyze).await.map_err(|e| base.error(e))
                })
                .await;
            if let Err(error) = analyzed {
                tracing::debug!(%error, "idempotency: the outbox's statistics could not be refreshed");
            }
        }
    }
}

// See `SqlStore::builder`: the engines are this crate's own.
#[allow(private_bounds)]
impl<D: OutboxEngine> OutboxTable for Outbox<D> {
    /// The heads of due keys (one statement: `RETURNING` where the engine
    /// has it), then behind them their runs, as far as the batch goes (a
    /// second, only when a head has a run behind it).
    async fn claim(
        &self,
        claim: LeaseToken,
        batch: u32,
        claim_for: Duration,
    ) -> Result<Vec<OutboxMessage>, StoreError> {
        let token = claim.to_bytes();
        let args = OutboxArgs {
            token: &token,
            now: now_ms(),
            ms: millis(claim_for),
            batch: i64::from(batch),
            ..OutboxArgs::default()
        };
        let mut heads = if self.sql.claim_returns {
            self.messages(&self.sql.claim, &args, true).await?
        } else {
            let base = &self.base;
            let claimed = {
                let _turn = base.engine.turn(Some(self.timeout)).await?;
                self.bounded(async {
                    let mut on = base.pool.acquire().await.map_err(|e| base.error(e))?;
                    if let Some(before) = D::OUTBOX.before_write {
                        D::raw(&mut on, before).await.map_err(|e| base.error(e))?;
                    }
                    D::outbox_execute(&mut on, &self.sql.claim, &args)
                        .await
                        .map_err(|e| base.error(e))
                })
                .await?
            };
            if claimed == 0 {
                return Ok(Vec::new());
            }
            self.messages(&self.sql.claimed, &args, false).await?
        };
        self.refresh_statistics(heads.len(), batch).await;
        let room = (batch as usize).saturating_sub(heads.len());
        let keys: Vec<&str> = heads
            .iter()
            .filter_map(|m| m.ordering_key.as_deref())
            .collect();
        if room == 0 || keys.is_empty() {
            return Ok(heads);
        }
        // Behind a head this claim holds, nobody else can claim: the run
        // is this claim's. A row of it another claim took and let lapse is
        // taken again; one whose claim has not lapsed (it lapses with its
        // head, a moment later) is left for the next round.
        let mut runs = Literal::new(&self.sql, args.now);
        runs.write()
            .sql("UPDATE {t} SET claimed_by = ")
            .bytes(&token)
            .sql(", next_at = ")
            .now()
            .sql(&format!(" + {}, attempts = attempts + 1 WHERE state = 0 AND ordering_key IN ", args.ms))
            .texts(keys.iter().copied())
            .sql(" AND (claimed_by IS NULL OR next_at <= ")
            .now()
            .sql(") AND seq IN (SELECT seq FROM (SELECT r.seq FROM {t} r WHERE r.state = 0 AND r.ordering_key IN ")
            .texts(keys.iter().copied())
            .sql(" AND (r.claimed_by IS NULL OR r.next_at <= ")
            .now()
            .sql(&format!(") ORDER BY r.seq LIMIT {room}) AS pick)"))
            .end();
        if self.write(runs.into_sql()).await? == 0 {
            return Ok(heads);
        }
        heads = self.messages(&self.sql.claimed, &args, false).await?;
        Ok(heads)
    }

    /// One round trip: every statement of the settlement as text.
    async fn settle(&self, claim: LeaseToken, settled: &Settlement<'_>) -> Result<(), StoreError> {
        let token = claim.to_bytes();
        let mut sql = Literal::new(&self.sql, now_ms());
        if !settled.sent.is_empty() {
            sql.write()
                .sql("UPDATE {t} SET state = 1, sent_at = ")
                .now()
                .sql(", claimed_by = NULL WHERE claimed_by = ")
                .bytes(&token)
                .sql(" AND state = 0 AND id IN ")
                .texts(settled.sent.iter().copied())
                .end();
        }
        for (id, after, error) in &settled.retried {
            sql.write()
                .sql("UPDATE {t} SET next_at = ")
                .now()
                .sql(&format!(
                    " + {}, claimed_by = NULL, last_error = ",
                    millis(*after)
                ))
                .text(error)
                .sql(" WHERE id = ")
                .text(id)
                .sql(" AND claimed_by = ")
                .bytes(&token)
                .sql(" AND state = 0")
                .end();
        }
        for (id, why) in &settled.refused {
            sql.write()
                .sql("UPDATE {t} SET state = 2, claimed_by = NULL, last_error = ")
                .text(why)
                .sql(" WHERE id = ")
                .text(id)
                .sql(" AND claimed_by = ")
                .bytes(&token)
                .sql(" AND state = 0")
                .end();
        }
        if !settled.released.is_empty() {
            sql.write()
                .sql("UPDATE {t} SET claimed_by = NULL, next_at = ")
                .now()
                .sql(" WHERE claimed_by = ")
                .bytes(&token)
                .sql(" AND state = 0 AND id IN ")
                .texts(settled.released.iter().copied())
                .end();
        }
        if sql.is_empty() {
            return Ok(());
        }
        self.write(sql.into_sql()).await.map(drop)
    }

    async fn sweep(&self, sent_before: Duration, batch: u32) -> Result<u64, StoreError> {
        let mut sql = Literal::new(&self.sql, now_ms());
        sql.write();
        if D::OUTBOX.delete_limit {
            sql.sql("DELETE FROM {t} WHERE state = 1 AND sent_at < ")
                .now()
                .sql(&format!(
                    " - {} ORDER BY seq LIMIT {batch}",
                    millis(sent_before)
                ));
        } else {
            sql.sql(
                "DELETE FROM {t} WHERE seq IN (SELECT seq FROM {t} WHERE state = 1 AND sent_at < ",
            )
            .now()
            .sql(&format!(
                " - {} ORDER BY seq LIMIT {batch})",
                millis(sent_before)
            ));
        }
        self.write(sql.into_sql()).await
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
        self.listening.get_or_init(|| {
            let channel = self.sql.channel.as_deref().unwrap_or_default();
            Listening(
                self.sql
                    .channel
                    .as_ref()
                    .and_then(|_| D::listen(&self.base.pool, channel, self.wake.clone())),
            )
        });
        self.wake.notified().await
    }
}

// See `SqlStore::builder`: the engines are this crate's own.
#[allow(private_bounds)]
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
    /// store's own timeout. Keep it well below the relay's
    /// [`claim_for`](super::OutboxRelay::claim_for), so that a claim
    /// answered late still holds its messages.
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
        checked_table(&self.table, "Outbox")?;
        let sql = statements(&self.table, D::OUTBOX);
        let base = &self.base;
        if self.create_table {
            let _turn = base.engine.turn(Some(self.timeout)).await?;
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
                        return Err(create_error(&base.engine, &self.table, error));
                    }
                }
            }
        }
        let mut on = base.pool.acquire().await.map_err(|e| base.error(e))?;
        if let Err(error) = D::outbox_execute(&mut on, &sql.exists, &OutboxArgs::default()).await {
            if D::classify(&error) == ErrorClass::MissingTable {
                return Err(StoreError::Misconfigured(format!(
                    "the outbox table {} does not exist: create it at start-up with \
                     `Outbox::on(&store).create_table_if_missing()`, or run the engine's \
                     OUTBOX_SCHEMA with your migrations",
                    self.table
                )));
            }
            return Err(base.error(error));
        }
        Ok(Outbox {
            base: self.base.clone(),
            sql: Arc::new(sql),
            wake: Arc::new(Notify::new()),
            timeout: self.timeout,
            listening: Arc::new(OnceLock::new()),
            analyzed: Arc::default(),
        })
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

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}
