//! The outbox table's operations, written once over every engine: opening
//! it (created or checked), a message's row added to a request's
//! transaction, a relay's claim, settlement and sweep, and an operator's
//! reads — each bounded by the outbox's timeout, this process's turn to
//! write held where it writes. What they answer are rows; the outbox
//! (`crate::outbox`) makes messages and counts of them.

use std::{
    sync::{Arc, Mutex, OnceLock},
    time::{Duration, Instant},
};

use tokio::sync::Notify;

use super::{
    OutboxEngine,
    statements::{CLAIM_WINDOW, Literal, OutboxStatements, statements},
};
use crate::store::{
    StoreError,
    sql::{
        Base, SqlTx, checked_table, create_error,
        dialect::{Args, Columns, Dialect, ErrorClass, FromColumns, Stmt},
        now_ms,
    },
};

/// The outbox table of one database. Cloning is cheap: clones share the
/// table, its wake-ups and its listener.
pub(crate) struct SqlOutbox<D: Dialect> {
    base: Arc<Base<D>>,
    sql: Arc<OutboxStatements>,
    /// Woken by this process's commits that enqueued, by a requeue, and by
    /// the database's notifications once a relay listens.
    wake: Arc<Notify>,
    /// The bound on each of the outbox's own statements.
    timeout: Duration,
    listening: Arc<OnceLock<Listening>>,
    /// When the table's statistics were last refreshed (where the engine
    /// needs it: see `OutboxSql::analyze`).
    analyzed: Arc<Mutex<Option<Instant>>>,
}

impl<D: Dialect> Clone for SqlOutbox<D> {
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

/// A message's row as it is added.
pub(crate) struct NewMessage<'a> {
    pub(crate) destination: &'a str,
    pub(crate) ordering_key: Option<&'a str>,
    pub(crate) payload: &'a [u8],
    /// Its headers, as a JSON object.
    pub(crate) headers: &'a str,
}

/// A message's row, as every statement that reads one answers it, in this
/// order.
#[derive(Debug)]
pub(crate) struct MessageRow {
    pub(crate) id: String,
    pub(crate) destination: String,
    pub(crate) ordering_key: Option<String>,
    pub(crate) payload: Vec<u8>,
    pub(crate) headers: String,
    pub(crate) created_at: i64,
    pub(crate) attempts: i64,
}

impl FromColumns for MessageRow {
    fn from_columns(row: &impl Columns) -> Result<Self, sqlx::Error> {
        Ok(Self {
            id: row.text(0)?,
            destination: row.text(1)?,
            ordering_key: row.opt_text(2)?,
            payload: row.bytes(3)?,
            headers: row.text(4)?,
            created_at: row.int(5)?,
            attempts: row.int(6)?,
        })
    }
}

/// What the backlog statement answers per state.
pub(crate) struct BacklogRow {
    /// `0` pending, `2` refused, `3` sent before the retention (awaiting
    /// the sweep).
    pub(crate) state: i64,
    pub(crate) count: i64,
    /// The oldest one's time (`created_at`, or `sent_at` for state 3).
    pub(crate) oldest: Option<i64>,
    /// The database's clock.
    pub(crate) now: i64,
}

impl FromColumns for BacklogRow {
    fn from_columns(row: &impl Columns) -> Result<Self, sqlx::Error> {
        Ok(Self {
            state: row.int(0)?,
            count: row.int(1)?,
            oldest: row.opt_int(2)?,
            now: row.int(3)?,
        })
    }
}

impl<D: Dialect> SqlOutbox<D> {
    /// The table's name.
    pub(crate) fn table(&self) -> &str {
        &self.sql.table
    }

    /// Adds a message's row to `tx`: it travels with the transaction's
    /// `COMMIT`, in the same round trip. Its id is `id` of the request's
    /// origin (its scope and key, and which execution of it this is) and
    /// the message's position among those it enqueued; the commit wakes
    /// this process's relays, and notifies other processes' where the
    /// engine can.
    pub(crate) fn enqueue(
        &self,
        tx: &mut SqlTx<D>,
        id: impl FnOnce((&str, u128), u32) -> String,
        message: NewMessage<'_>,
    ) -> String {
        let position = tx.next_message();
        let id = id(tx.origin(), position);
        let mut row = Literal::new(&self.sql, now_ms());
        row.sql("INSERT INTO {t} (id, destination, ordering_key, payload, headers, created_at) VALUES (")
            .text(&id)
            .sql(", ")
            .text(message.destination)
            .sql(", ");
        match message.ordering_key {
            Some(key) => row.text(key),
            None => row.sql("NULL"),
        };
        row.sql(", ")
            .bytes(message.payload)
            .sql(", ")
            .text(message.headers)
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
        id
    }
}

// See `SqlStore::builder`: the engines are this crate's own.
impl<D: OutboxEngine> SqlOutbox<D> {
    /// The outbox table `table` in `base`'s database, created first if
    /// `create` (and missing); its statements bounded by `timeout`.
    pub(crate) async fn open(
        base: Arc<Base<D>>,
        table: &str,
        create: bool,
        timeout: Duration,
    ) -> Result<Self, StoreError> {
        checked_table(table, "Outbox")?;
        let sql = statements(table, D::OUTBOX);
        if create {
            let _turn = base.engine.turn(Some(timeout)).await?;
            let mut on = base.pool.acquire().await.map_err(|e| base.error(e))?;
            let mut attempt = 0;
            loop {
                attempt += 1;
                match D::raw(&mut on, &sql.schema).await {
                    Ok(()) => break,
                    Err(error) if attempt < 10 && D::lost_schema_race(&error) => {
                        tokio::time::sleep(Duration::from_millis(20 * attempt)).await;
                    }
                    Err(error) => return Err(create_error(&base.engine, table, error)),
                }
            }
        }
        let mut on = base.pool.acquire().await.map_err(|e| base.error(e))?;
        if let Err(error) = D::execute(&mut on, &sql.exists, &Args::default()).await {
            if D::classify(&error) == ErrorClass::MissingTable {
                return Err(StoreError::Misconfigured(format!(
                    "the outbox table {table} does not exist: create it at start-up with \
                     `Outbox::on(&store).create_table_if_missing()`, or run the engine's \
                     OUTBOX_SCHEMA with your migrations"
                )));
            }
            return Err(base.error(error));
        }
        drop(on);
        Ok(Self {
            base,
            sql: Arc::new(sql),
            wake: Arc::new(Notify::new()),
            timeout,
            listening: Arc::new(OnceLock::new()),
            analyzed: Arc::default(),
        })
    }

    /// `(state, count)` for each state: `0` pending, `1` sent, `2`
    /// refused (a scan of the table).
    pub(crate) async fn counts(&self) -> Result<Vec<(i64, i64)>, StoreError> {
        self.read(&self.sql.counts, &Args::default()).await
    }

    /// What waits, read by indexes only: see [`BacklogRow`]; sent rows
    /// count once older than `retention`.
    pub(crate) async fn backlog(&self, retention: Duration) -> Result<Vec<BacklogRow>, StoreError> {
        let args = Args {
            now: now_ms(),
            ms: millis(retention),
            ..Args::default()
        };
        self.read(&self.sql.backlog, &args).await
    }

    /// Up to `limit` refused messages, oldest first.
    pub(crate) async fn refused(&self, limit: u32) -> Result<Vec<MessageRow>, StoreError> {
        let args = Args {
            batch: i64::from(limit),
            ..Args::default()
        };
        self.read(&self.sql.refused, &args).await
    }

    /// Makes the refused message `id` pending again (waking this process's
    /// relays); whether there was one.
    pub(crate) async fn requeue(&self, id: &str) -> Result<bool, StoreError> {
        let args = Args {
            id,
            ..Args::default()
        };
        let base = &self.base;
        let _turn = base.engine.turn(Some(self.timeout)).await?;
        let requeued = self
            .bounded(async {
                let mut on = base.pool.acquire().await.map_err(|e| base.error(e))?;
                D::execute(&mut on, &self.sql.requeue, &args)
                    .await
                    .map_err(|e| base.error(e))
            })
            .await?;
        if requeued > 0 {
            self.wake.notify_one();
        }
        Ok(requeued > 0)
    }

    /// Claims for `token`, for `claim_for`: the heads of due keys (one
    /// statement: `RETURNING` where the engine has it), then behind them
    /// their runs, as far as the batch goes (a second, only when a head
    /// has a run behind it). The claimed rows, oldest first.
    pub(crate) async fn claim(
        &self,
        token: &[u8],
        batch: u32,
        claim_for: Duration,
    ) -> Result<Vec<MessageRow>, StoreError> {
        let args = Args {
            token,
            now: now_ms(),
            ms: millis(claim_for),
            batch: i64::from(batch),
            window: i64::from(batch).saturating_mul(CLAIM_WINDOW),
            ..Args::default()
        };
        let heads: Vec<MessageRow> = if self.sql.claim_returns {
            self.fetch(&self.sql.claim, &args, true).await?
        } else {
            let base = &self.base;
            let claimed = {
                let _turn = base.engine.turn(Some(self.timeout)).await?;
                self.bounded(async {
                    let mut on = base.pool.acquire().await.map_err(|e| base.error(e))?;
                    if let Some(before) = D::OUTBOX.before_write {
                        D::raw(&mut on, before).await.map_err(|e| base.error(e))?;
                    }
                    D::execute(&mut on, &self.sql.claim, &args)
                        .await
                        .map_err(|e| base.error(e))
                })
                .await?
            };
            if claimed == 0 {
                return Ok(Vec::new());
            }
            self.read(&self.sql.claimed, &args).await?
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
        // head, a moment later) is left for the next round. What this claim
        // holds already (its heads, should they read as lapsed by now) is
        // not counted again. Should a head have lapsed and been taken since,
        // the relay finds out by renewing before it publishes.
        let mut runs = Literal::new(&self.sql, args.now);
        runs.write()
            .sql("UPDATE {t} SET claimed_by = ")
            .bytes(token)
            .sql(", next_at = ")
            .now()
            .sql(&format!(" + {}, attempts = attempts + 1 WHERE state = 0 AND ordering_key IN ", args.ms))
            .texts(keys.iter().copied())
            .sql(" AND (claimed_by IS NULL OR (next_at <= ")
            .now()
            .sql(" AND claimed_by <> ")
            .bytes(token)
            .sql(")) AND seq IN (SELECT seq FROM (SELECT r.seq FROM {t} r WHERE r.state = 0 AND r.ordering_key IN ")
            .texts(keys.iter().copied())
            .sql(" AND (r.claimed_by IS NULL OR (r.next_at <= ")
            .now()
            .sql(" AND r.claimed_by <> ")
            .bytes(token)
            .sql(&format!(")) ORDER BY r.seq LIMIT {room}) AS pick)"))
            .end();
        if self.write(runs.into_sql()).await? == 0 {
            return Ok(heads);
        }
        self.read(&self.sql.claimed, &args).await
    }

    /// Keeps what `token` holds claimed for `claim_for` more, from now:
    /// how many messages it still holds.
    pub(crate) async fn extend(
        &self,
        token: &[u8],
        claim_for: Duration,
    ) -> Result<u64, StoreError> {
        let mut sql = Literal::new(&self.sql, now_ms());
        sql.write()
            .sql("UPDATE {t} SET next_at = ")
            .now()
            .sql(&format!(" + {} WHERE claimed_by = ", millis(claim_for)))
            .bytes(token)
            .sql(" AND state = 0")
            .end();
        self.write(sql.into_sql()).await
    }

    /// Settles what `token` claimed, in one round trip: `sent` marked sent;
    /// `retried` due again after their back-off, with their error;
    /// `refused` kept for good, with why; `released` due again at once.
    /// A row `token` no longer holds is left as it is.
    pub(crate) async fn settle(
        &self,
        token: &[u8],
        sent: &[&str],
        retried: &[(&str, Duration, String)],
        refused: &[(&str, String)],
        released: &[&str],
    ) -> Result<(), StoreError> {
        let mut sql = Literal::new(&self.sql, now_ms());
        if !sent.is_empty() {
            sql.write()
                .sql("UPDATE {t} SET state = 1, sent_at = ")
                .now()
                .sql(", claimed_by = NULL WHERE claimed_by = ")
                .bytes(token)
                .sql(" AND state = 0 AND id IN ")
                .texts(sent.iter().copied())
                .end();
        }
        for (id, after, error) in retried {
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
                .bytes(token)
                .sql(" AND state = 0")
                .end();
        }
        for (id, why) in refused {
            sql.write()
                .sql("UPDATE {t} SET state = 2, claimed_by = NULL, last_error = ")
                .text(why)
                .sql(" WHERE id = ")
                .text(id)
                .sql(" AND claimed_by = ")
                .bytes(token)
                .sql(" AND state = 0")
                .end();
        }
        if !released.is_empty() {
            sql.write()
                .sql("UPDATE {t} SET claimed_by = NULL, next_at = ")
                .now()
                .sql(" WHERE claimed_by = ")
                .bytes(token)
                .sql(" AND state = 0 AND id IN ")
                .texts(released.iter().copied())
                .end();
        }
        if sql.is_empty() {
            return Ok(());
        }
        self.write(sql.into_sql()).await.map(drop)
    }

    /// Deletes up to `batch` rows sent longer ago than `sent_before`; how
    /// many.
    pub(crate) async fn sweep(&self, sent_before: Duration, batch: u32) -> Result<u64, StoreError> {
        let mut sql = Literal::new(&self.sql, now_ms());
        let before = format!(" - {} ORDER BY seq LIMIT {batch}", millis(sent_before));
        sql.write();
        if D::OUTBOX.delete_limit {
            sql.sql("DELETE FROM {t} WHERE state = 1 AND sent_at < ")
                .now()
                .sql(&before);
        } else {
            sql.sql(
                "DELETE FROM {t} WHERE seq IN (SELECT seq FROM {t} WHERE state = 1 AND sent_at < ",
            )
            .now()
            .sql(&before)
            .sql(")");
        }
        self.write(sql.into_sql()).await
    }

    /// Until this process commits an enqueue, a requeue happens, or —
    /// once asked, on PostgreSQL — any process's commit `NOTIFY`s, heard on
    /// a connection of its own.
    pub(crate) async fn committed(&self) {
        self.listening.get_or_init(|| {
            Listening(
                self.sql
                    .channel
                    .as_deref()
                    .and_then(|channel| D::listen(&self.base.pool, channel, self.wake.clone())),
            )
        });
        self.wake.notified().await
    }

    /// `work`, failed with [`StoreError::Timeout`] past the outbox's bound.
    async fn bounded<T>(
        &self,
        work: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        crate::store::bounded(self.timeout, work).await
    }

    /// The rows `stmt` answers, on a pooled connection.
    async fn read<T: FromColumns + Send>(
        &self,
        stmt: &Stmt,
        args: &Args<'_>,
    ) -> Result<Vec<T>, StoreError> {
        self.fetch(stmt, args, false).await
    }

    /// The rows `stmt` answers, on a pooled connection — this process's
    /// turn to write held, and the engine's isolation set first, when it
    /// `writes`.
    async fn fetch<T: FromColumns + Send>(
        &self,
        stmt: &Stmt,
        args: &Args<'_>,
        writes: bool,
    ) -> Result<Vec<T>, StoreError> {
        let base = &self.base;
        let _turn = match writes {
            true => Some(base.engine.turn(Some(self.timeout)).await?),
            false => None,
        };
        self.bounded(async {
            let mut on = base.pool.acquire().await.map_err(|e| base.error(e))?;
            if let (true, Some(before)) = (writes, D::OUTBOX.before_write) {
                D::raw(&mut on, before).await.map_err(|e| base.error(e))?;
            }
            D::fetch_all(&mut on, stmt, args)
                .await
                .map_err(|e| base.error(e))
        })
        .await
    }

    /// Runs SQL text whose values are literals (several statements, one
    /// round trip), this process's turn to write held: the rows changed.
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
                *last = Some(Instant::now());
            }
            due
        };
        if !due {
            return;
        }
        let base = &self.base;
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

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}
