//! PostgreSQL's transactional claim: `BEGIN` and the claim in one round
//! trip, the record and `COMMIT` in another; transactions that found
//! nothing to do are ended in front of the next claim on their connection.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use sqlx::{Executor, PgConnection, PgPool, postgres::PgRow};

use super::{
    NOT_PREPARED, Postgres, PostgresTx, idle, idle::IdleTransactions, sqlstate, statements,
    statements::TxStatements,
};
use crate::store::{
    StorageKey, StoreError,
    sql::{
        dialect::{Engine, ErrorClass, FromColumns, KeyRow},
        tx_engine::{ClaimRequest, Expiry, InBatch, Probe, Seam, TxClaim, TxEngine, savepoint},
    },
};

/// What the transactional store keeps beside the base.
// Public only as the engine's associated type: nameable by no one.
#[allow(unreachable_pub)]
pub struct TxState {
    pub(super) sql: TxStatements,
    /// Transactions of claims that found nothing to do, to be rolled back.
    pub(super) idle: Arc<IdleTransactions>,
    /// The session's `lock_timeout`, restored after the claim.
    pub(super) lock_timeout: Arc<str>,
}

impl TxState {
    /// `request`'s claim statement.
    fn claim(&self, request: &ClaimRequest<'_>) -> String {
        self.sql.claim(
            request.key.as_str(),
            request.fingerprint,
            request.wait,
            request.lifetime_ms,
            &self.lock_timeout,
        )
    }
}

impl std::fmt::Debug for TxState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TxState").finish_non_exhaustive()
    }
}

/// What the claim statement answered.
enum Answer {
    Row(KeyRow),
    /// Nothing: a row committed after the claim's snapshot was taken made
    /// the insert do nothing. The next statement sees it.
    Raced,
}

impl Answer {
    fn read(row: Option<PgRow>) -> Result<Self, sqlx::Error> {
        Ok(match row {
            Some(row) => Self::Row(KeyRow::from_columns(&row)?),
            None => Self::Raced,
        })
    }
}

/// Begins the request's transaction (or chains one on a parked connection)
/// with the claim in the same round trip: the transaction and the claim's
/// row, or `None` when the claim met a duplicate's uncommitted row (in
/// flight).
async fn begin_claim(
    seam: &Seam<Postgres>,
    bound: std::time::Duration,
    claim: &str,
) -> Result<Option<(PostgresTx, Option<PgRow>)>, StoreError> {
    let state = &seam.state;
    // `Executor::fetch_optional`, boxed, rather than `RawSql`'s async fn,
    // whose future trips rustc's inference of higher-ranked `Send` bounds
    // (rust-lang/rust#100013).
    if let Some(mut parked) = state.idle.take() {
        // Its ROLLBACK travels with this claim; AND CHAIN begins the next
        // transaction at the same (READ COMMITTED) level.
        let sql = format!("ROLLBACK AND CHAIN; {claim}");
        let on: &mut PgConnection = &mut parked;
        match on
            .fetch_optional(sqlx::raw_sql(sqlx::AssertSqlSafe(sql)))
            .await
        {
            Ok(row) => {
                parked.began = Instant::now();
                return Ok(Some((parked, row)));
            }
            Err(error) if Postgres::classify(&error) == ErrorClass::LockTimeout => {
                state.idle.park(parked, seam.pool());
                return Ok(None);
            }
            // E.g. closed by the server meanwhile (a restart, an idle
            // timeout): dropped, which closes it; a fresh connection gets the
            // claim.
            Err(error) => {
                tracing::debug!(%error, "idempotency: a parked claim transaction failed");
            }
        }
    }
    let connection = seam.connection().await?;
    // From here on, a failure closes the connection (see `SqlTx`).
    let mut tx = PostgresTx::begun(connection, (), Instant::now());
    // READ COMMITTED whatever the database's default: the claim must see the
    // rows committed before it, each statement on a fresh snapshot.
    let begin = format!("BEGIN ISOLATION LEVEL READ COMMITTED; {claim}");
    let on: &mut PgConnection = &mut tx;
    let mut claimed = on
        .fetch_optional(sqlx::raw_sql(sqlx::AssertSqlSafe(begin)))
        .await;
    if claimed
        .as_ref()
        .is_err_and(|e| sqlstate(e).as_deref() == Some(NOT_PREPARED))
    {
        // A connection's first claim: the session's bounds set, in a round
        // trip of its own, then its statements prepared, inside the
        // transaction (a statement before BEGIN would start one at the
        // database's default isolation level).
        let on: &mut PgConnection = &mut tx;
        let session = on
            .execute(sqlx::raw_sql(sqlx::AssertSqlSafe(state.sql.session(bound))))
            .await;
        if let Err(error) = session {
            tx.close_on_drop();
            return Err(seam.error(error));
        }
        let prepare = state.sql.prepare();
        let sql = format!("BEGIN ISOLATION LEVEL READ COMMITTED; {prepare}; {claim}");
        let on: &mut PgConnection = &mut tx;
        claimed = on
            .fetch_optional(sqlx::raw_sql(sqlx::AssertSqlSafe(sql)))
            .await;
    }
    match claimed {
        Ok(row) => Ok(Some((tx, row))),
        // The duplicate's transaction is aborted: parked for the next claim
        // to roll back.
        Err(error) if Postgres::classify(&error) == ErrorClass::LockTimeout => {
            state.idle.park(tx, seam.pool());
            Ok(None)
        }
        Err(error) => Err(seam.error(error)),
    }
}

/// The key's record has expired (and was not deleted yet): this claim
/// replaces it, in its transaction. A concurrent claim doing the same waits
/// on the row, then finds it live.
async fn take_over(
    seam: &Seam<Postgres>,
    mut tx: PostgresTx,
    request: &ClaimRequest<'_>,
) -> Result<TxClaim<Postgres>, StoreError> {
    let state = &seam.state;
    match taken_over(state, &mut tx, request).await {
        Ok(true) => Ok(TxClaim::Acquired(tx)),
        // Taken over by another claim meanwhile, which committed.
        Ok(false) => {
            state.idle.roll_back(tx);
            Ok(TxClaim::InFlight)
        }
        Err(error) => {
            state.idle.roll_back(tx);
            Err(seam.error(error))
        }
    }
}

/// Whether the key's expired record was replaced by this claim's row, on
/// `on`, inside its transaction (`lock_timeout` put back for the work).
async fn taken_over(
    state: &TxState,
    on: &mut PgConnection,
    request: &ClaimRequest<'_>,
) -> Result<bool, sqlx::Error> {
    let done = sqlx::query(sqlx::AssertSqlSafe(state.sql.take_over.clone()))
        .bind(request.key.as_str())
        .bind(&request.fingerprint.as_bytes()[..])
        .bind(request.lifetime_ms)
        .bind(&*state.lock_timeout)
        .execute(on)
        .await?;
    Ok(done.rows_affected() == 1)
}

/// The row the last of `sql`'s statements answered, if any: the
/// statements sent ahead of it (a record written) answer rows of their
/// own.
async fn last_statements_row(
    on: &mut PgConnection,
    sql: String,
) -> Result<Option<PgRow>, sqlx::Error> {
    use futures_util::TryStreamExt;
    let mut answers = on.fetch_many(sqlx::raw_sql(sqlx::AssertSqlSafe(sql)));
    let (mut rows, mut last) = (Vec::new(), Vec::new());
    while let Some(answer) = answers.try_next().await? {
        match answer {
            sqlx::Either::Right(row) => rows.push(row),
            // A statement done: its rows are the last so far.
            sqlx::Either::Left(_) => last = std::mem::take(&mut rows),
        }
    }
    Ok(last.into_iter().next())
}

impl TxEngine for Postgres {
    async fn tx_state(
        pool: &PgPool,
        _: &Self,
        table: &str,
        timeout: Duration,
    ) -> Result<TxState, StoreError> {
        // What the claim restores once it no longer needs its short wait.
        let lock_timeout: String = sqlx::query_scalar("SELECT current_setting('lock_timeout')")
            .fetch_one(pool)
            .await?;
        Ok(TxState {
            sql: statements::TxStatements::new(table),
            idle: std::sync::Arc::new(idle::IdleTransactions::new(pool, timeout)),
            lock_timeout: lock_timeout.into(),
        })
    }

    async fn tx_claim(
        seam: &Seam<Self>,
        request: &ClaimRequest<'_>,
    ) -> Result<TxClaim<Self>, StoreError> {
        let state = &seam.state;
        let claim = state.claim(request);
        let Some((mut tx, row)) = begin_claim(seam, request.bound, &claim).await? else {
            return Ok(TxClaim::InFlight);
        };
        let mut answer = Answer::read(row);
        // A row committed after the claim's snapshot: the next statement sees
        // it. Asked at most twice more.
        for _ in 0..2 {
            if !matches!(answer, Ok(Answer::Raced)) {
                break;
            }
            let on: &mut PgConnection = &mut tx;
            let again = sqlx::raw_sql(sqlx::AssertSqlSafe(claim.as_str()));
            answer = match on.fetch_optional(again).await {
                Ok(row) => Answer::read(row),
                Err(error) if Postgres::classify(&error) == ErrorClass::LockTimeout => {
                    state.idle.park(tx, seam.pool());
                    return Ok(TxClaim::InFlight);
                }
                Err(error) => return Err(seam.error(error)),
            };
        }
        match answer {
            Ok(Answer::Row(row)) if row.acquired => Ok(TxClaim::Acquired(tx)),
            Ok(Answer::Row(row)) if row.ms_left <= 0 => take_over(seam, tx, request).await,
            Ok(Answer::Row(row)) => {
                // Nothing to do in this transaction: it ends with the next claim
                // on its connection.
                state.idle.park(tx, seam.pool());
                Ok(TxClaim::Found(row))
            }
            Ok(Answer::Raced) => {
                state.idle.roll_back(tx);
                Err(StoreError::Unavailable(
                    "the claim found a record it could not read three times".into(),
                ))
            }
            Err(error) => {
                state.idle.roll_back(tx);
                Err(seam.error(error))
            }
        }
    }

    async fn tx_complete(
        seam: &Seam<Self>,
        tx: &mut PostgresTx,
        key: &StorageKey,
        record: Vec<u8>,
        expiry: Expiry,
    ) -> Result<(), StoreError> {
        // The record and COMMIT in one round trip (simple protocol, so the
        // values are literals); if the record cannot be written, COMMIT never
        // runs. Written into one buffer: the record's literal can run to
        // megabytes. On an error `end` closes the connection: everything rolled
        // back.
        let complete = seam.state.sql.complete(key.as_str(), &record, expiry);
        tx.commit_with(&complete).await.map_err(|e| seam.error(e))
    }

    /// The session's bounds as a request's connection has them, and
    /// `BEGIN`, in one round trip.
    async fn batch_begin(seam: &Seam<Self>, bound: Duration) -> Result<PostgresTx, StoreError> {
        let connection = seam.connection().await?;
        // Dropped on a failure: the connection is closed.
        let mut tx = PostgresTx::begun(connection, (), Instant::now());
        let begin = format!(
            "{}; BEGIN ISOLATION LEVEL READ COMMITTED",
            seam.state.sql.session(bound)
        );
        let on: &mut PgConnection = &mut tx;
        on.execute(sqlx::raw_sql(sqlx::AssertSqlSafe(begin)))
            .await
            .map_err(|e| seam.error(e))?;
        Ok(tx)
    }

    /// The request's claim, after the key's savepoint, in one round trip
    /// (with what the batch sends ahead): answered as a request's is.
    async fn batch_claim(
        seam: &Seam<Self>,
        tx: &mut PostgresTx,
        request: &ClaimRequest<'_>,
    ) -> Result<InBatch, StoreError> {
        let state = &seam.state;
        let claim = state.claim(request);
        let mut sql = tx.after_ahead(&format!("{}{claim}", savepoint::OPEN));
        let mut prepared = false;
        // A connection's first claim prepares its statements; a row
        // committed after the claim's snapshot is asked for twice more.
        for _ in 0..4 {
            let on: &mut PgConnection = tx;
            let answer = last_statements_row(on, sql).await;
            match answer.and_then(Answer::read) {
                Ok(Answer::Row(row)) if row.acquired => return Ok(InBatch::Acquired),
                Ok(Answer::Row(row)) if row.ms_left <= 0 => {
                    let on: &mut PgConnection = tx;
                    if taken_over(state, on, request)
                        .await
                        .map_err(|e| seam.error(e))?
                    {
                        return Ok(InBatch::Acquired);
                    }
                    tx.undone(savepoint::UNDO);
                    return Ok(InBatch::InFlight);
                }
                Ok(Answer::Row(row)) => {
                    tx.undone(savepoint::UNDO);
                    return Ok(InBatch::Found(row));
                }
                Ok(Answer::Raced) => sql = claim.clone(),
                Err(error) if Postgres::classify(&error) == ErrorClass::LockTimeout => {
                    tx.undone(savepoint::UNDO);
                    return Ok(InBatch::InFlight);
                }
                Err(error) if !prepared && sqlstate(&error).as_deref() == Some(NOT_PREPARED) => {
                    prepared = true;
                    sql = format!(
                        "{}{}; {}{claim}",
                        savepoint::UNDO,
                        state.sql.prepare(),
                        savepoint::OPEN
                    );
                }
                Err(error) => return Err(seam.error(error)),
            }
        }
        Err(StoreError::Unavailable(
            "the claim found a record it could not read three times".into(),
        ))
    }

    /// The record and the savepoint kept, sent ahead of the batch's next
    /// claim (or its commit): no round trip of their own. If the record
    /// cannot be written, nothing after it runs — that claim fails, and the
    /// batch with it: nothing in it commits.
    async fn batch_complete(
        seam: &Seam<Self>,
        tx: &mut PostgresTx,
        key: &StorageKey,
        record: Vec<u8>,
        expiry: Expiry,
    ) -> Result<(), StoreError> {
        let complete = seam
            .state
            .sql
            .record(key.as_str(), &record, expiry, savepoint::KEEP);
        tx.send_ahead(&complete);
        Ok(())
    }

    /// Whether a transaction holds `key` in flight: a claim in a transaction of
    /// its own, rolled back at once, that meets it waits 50 ms and fails.
    async fn tx_in_flight(seam: &Seam<Self>, key: &StorageKey) -> Result<Probe, StoreError> {
        let probe = seam.state.sql.probe(key.as_str());
        let connection = seam.bounded(seam.connection()).await?;
        // Closed if the probe fails halfway: never back in the pool inside its
        // transaction.
        let mut tx = PostgresTx::begun(connection, (), Instant::now());
        match seam.bounded(async { Ok(tx.end(&probe).await) }).await? {
            Ok(()) => Ok(Probe::Free),
            Err(error) if Postgres::classify(&error) == ErrorClass::LockTimeout => {
                Ok(Probe::InFlight)
            }
            Err(error) => Probe::failed(seam, error),
        }
    }
}
