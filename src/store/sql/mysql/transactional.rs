//! MySQL's transactional claim: the claim's row inserted with the
//! transaction's settings in one round trip (the session's own were given
//! once, on the connection's first claim); a duplicate of a committed key
//! read, at READ COMMITTED and after its transaction's rollback, in one
//! more; the record written and committed in one. A batch's keys are
//! claimed the same way, each in a savepoint, their records sent ahead of
//! the next claim.

use std::time::{Duration, Instant};

use sqlx::MySqlPool;

use super::{
    MySql, MySqlTx, number, statements,
    statements::{ROW_GONE, SESSION_NOT_READY, TxStatements},
};
use crate::store::{
    StorageKey, StoreError,
    sql::{
        dialect::{Engine, ErrorClass, FromColumns, KeyRow},
        tx_engine::{
            ClaimRequest, End, Expiry, InBatch, Probe, Seam, TxClaim, TxEngine, savepoint,
        },
    },
};

/// What the transactional store keeps beside the base.
// Public only as the engine's associated type: nameable by no one.
#[allow(unreachable_pub)]
pub struct TxState {
    pub(super) sql: TxStatements,
}

impl std::fmt::Debug for TxState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TxState").finish_non_exhaustive()
    }
}

/// The committed row that holds the key: a replay, a mismatch, or an
/// expired record this claim takes over. The claim's transaction ends in
/// the read's round trip; a take-over begins another.
async fn found(
    seam: &Seam<MySql>,
    mut tx: MySqlTx,
    request: &ClaimRequest<'_>,
) -> Result<TxClaim<MySql>, StoreError> {
    let sql = &seam.state.sql;
    let read = sql.read_after_rollback(request.key.as_str());
    let row = {
        let on: &mut sqlx::MySqlConnection = &mut tx;
        sqlx::Executor::fetch_optional(on, sqlx::raw_sql(sqlx::AssertSqlSafe(read))).await
    };
    let row = match row.map(|row| row.as_ref().map(KeyRow::from_columns).transpose()) {
        Ok(Ok(row)) => row,
        Ok(Err(error)) | Err(error) => {
            tx.close_on_drop();
            return Err(seam.error(error));
        }
    };
    let Some(connection) = tx.ended() else {
        return Err(seam.error(sqlx::Error::PoolClosed));
    };
    match row {
        Some(row) if row.ms_left > 0 => Ok(TxClaim::Found(row)),
        Some(_) => {
            let mut tx = MySqlTx::begun(connection, (), Instant::now());
            let take_over = sql.take_over(
                request.key.as_str(),
                request.fingerprint.as_bytes(),
                request.wait,
                request.bound,
                request.lifetime_ms,
            );
            let taken = {
                let on: &mut sqlx::MySqlConnection = &mut tx;
                sqlx::Executor::execute(on, sqlx::raw_sql(sqlx::AssertSqlSafe(take_over))).await
            };
            match taken {
                Ok(done) if done.rows_affected() == 1 => Ok(TxClaim::Acquired(tx)),
                // Taken over, or deleted, by another request since the read.
                Ok(_) => {
                    roll_back(seam, tx);
                    Ok(TxClaim::InFlight)
                }
                Err(error) => match MySql::classify(&error) {
                    ErrorClass::LockTimeout | ErrorClass::Conflict => {
                        roll_back(seam, tx);
                        Ok(TxClaim::InFlight)
                    }
                    _ => {
                        tx.close_on_drop();
                        Err(seam.error(error))
                    }
                },
            }
        }
        // Deleted since the insert met it: asked again by the retry.
        None => Ok(TxClaim::InFlight),
    }
}

/// The row that holds the key a batch's claim met committed, read in the
/// batch's transaction (the key's savepoint undone first): a replay, a
/// mismatch, or an expired record this claim takes over in a savepoint of
/// its own.
async fn found_in_batch(
    seam: &Seam<MySql>,
    tx: &mut MySqlTx,
    request: &ClaimRequest<'_>,
) -> Result<InBatch, StoreError> {
    let sql = &seam.state.sql;
    let key = request.key.as_str();
    let read = sql.read_in_batch(key);
    let row = {
        let on: &mut sqlx::MySqlConnection = tx;
        sqlx::Executor::fetch_optional(on, sqlx::raw_sql(sqlx::AssertSqlSafe(read))).await
    };
    let row = row
        .and_then(|row| row.as_ref().map(KeyRow::from_columns).transpose())
        .map_err(|e| seam.error(e))?;
    match row {
        Some(row) if row.ms_left > 0 => Ok(InBatch::Found(row)),
        Some(_) => {
            let fingerprint = request.fingerprint.as_bytes();
            let take_over =
                sql.take_over_in_batch(key, fingerprint, request.wait, request.lifetime_ms);
            let taken = {
                let on: &mut sqlx::MySqlConnection = tx;
                sqlx::Executor::execute(on, sqlx::raw_sql(sqlx::AssertSqlSafe(take_over))).await
            };
            match taken {
                Ok(done) if done.rows_affected() == 1 => Ok(InBatch::Acquired),
                // Taken over, or deleted, by another request since the read.
                Ok(_) => {
                    tx.undone(savepoint::UNDO);
                    Ok(InBatch::InFlight)
                }
                Err(error) if MySql::classify(&error) == ErrorClass::LockTimeout => {
                    tx.undone(savepoint::UNDO);
                    Ok(InBatch::InFlight)
                }
                Err(error) => Err(seam.error(error)),
            }
        }
        // Deleted since the insert met it: asked again on its own.
        None => Ok(InBatch::InFlight),
    }
}

/// Rolls a transaction that found nothing to do back, in the background:
/// the duplicate's answer does not wait for it.
fn roll_back(seam: &Seam<MySql>, mut tx: MySqlTx) {
    let (end, timeout) = (seam.state.sql.end("ROLLBACK"), seam.timeout());
    tokio::spawn(async move {
        // Timed out or failed: dropping `tx` closes its connection.
        let _ = tokio::time::timeout(timeout, tx.end(&end)).await;
    });
}

impl TxEngine for MySql {
    async fn tx_state(
        pool: &MySqlPool,
        engine: &Self,
        table: &str,
        _: Duration,
    ) -> Result<TxState, StoreError> {
        // What a claim restores on MySQL, where its settings are the session's.
        let (lock_wait, wait_timeout): (i64, i64) = sqlx::query_as(
            "SELECT CAST(@@session.innodb_lock_wait_timeout AS SIGNED), CAST(@@session.wait_timeout AS SIGNED)",
        )
        .fetch_one(pool)
        .await?;
        Ok(TxState {
            sql: statements::TxStatements::new(table, engine.flavor, lock_wait, wait_timeout),
        })
    }

    async fn tx_claim(
        seam: &Seam<Self>,
        request: &ClaimRequest<'_>,
    ) -> Result<TxClaim<Self>, StoreError> {
        let sql = &seam.state.sql;
        let connection = seam.connection().await?;
        // From here on, a failure closes the connection (see `SqlTx`).
        let mut tx = MySqlTx::begun(connection, (), Instant::now());
        let claim = sql.claim(
            request.key.as_str(),
            request.fingerprint.as_bytes(),
            request.wait,
            request.bound,
            request.lifetime_ms,
        );
        let mut inserted = MySql::raw(&mut tx, &claim).await;
        if inserted
            .as_ref()
            .is_err_and(|e| number(e) == Some(SESSION_NOT_READY))
        {
            // The connection's first claim: its session set up, in a round
            // trip of its own, then the claim again.
            if let Err(error) = MySql::raw(&mut tx, &sql.session(request.bound)).await {
                tx.close_on_drop();
                return Err(seam.error(error));
            }
            inserted = MySql::raw(&mut tx, &claim).await;
        }
        let error = match inserted {
            Ok(()) => return Ok(TxClaim::Acquired(tx)),
            Err(error) => error,
        };
        match MySql::classify(&error) {
            // An uncommitted row holds the key. The transaction is still open
            // after a lock-wait timeout: rolled back, in the background.
            ErrorClass::LockTimeout | ErrorClass::Conflict => {
                roll_back(seam, tx);
                Ok(TxClaim::InFlight)
            }
            // A committed row holds the key.
            ErrorClass::Duplicate => found(seam, tx, request).await,
            _ => {
                tx.close_on_drop();
                Err(seam.error(error))
            }
        }
    }

    async fn tx_complete(
        seam: &Seam<Self>,
        tx: &mut MySqlTx,
        key: &StorageKey,
        record: Vec<u8>,
        expiry: Expiry,
    ) -> Result<(), StoreError> {
        // On a multi-node cluster, a duplicate committed on another node first
        // fails this COMMIT's certification (1213): nothing of this request
        // commits.
        let complete = seam.state.sql.complete(key.as_str(), &record, expiry);
        match tx.commit_with(&complete).await {
            Ok(()) => Ok(()),
            // The check after the update: the claim's row is gone (the handler
            // deleted it, or a deadlock rolled the transaction back and the
            // handler went on writing). Committing would keep writes without
            // their record; the failed batch never reached its COMMIT, and the
            // closed connection rolls the rest back.
            Err(error) if number(&error) == Some(ROW_GONE) => Err(StoreError::Refused(
                "the claim's row is no longer in the transaction".into(),
            )),
            Err(error) => Err(seam.error(error)),
        }
    }

    /// The session's settings and the transaction's, in one round trip.
    async fn batch_begin(seam: &Seam<Self>, bound: Duration) -> Result<MySqlTx, StoreError> {
        let connection = seam.connection().await?;
        // Dropped on a failure: the connection is closed.
        let mut tx = MySqlTx::begun(connection, (), Instant::now());
        let begin = seam.state.sql.begin_batch(bound);
        MySql::raw(&mut tx, &begin)
            .await
            .map_err(|e| seam.error(e))?;
        Ok(tx)
    }

    /// The claim's row inserted in the key's savepoint (after what the
    /// batch sends ahead), answered as a request's claim is. A lock wait
    /// that timed out ended the insert alone, which the undo sent next
    /// confirms: where the server ended the whole transaction (a deadlock,
    /// `innodb_rollback_on_timeout`), that undo fails, and the batch with
    /// it.
    async fn batch_claim(
        seam: &Seam<Self>,
        tx: &mut MySqlTx,
        request: &ClaimRequest<'_>,
    ) -> Result<InBatch, StoreError> {
        let claim = seam.state.sql.claim_in_batch(
            request.key.as_str(),
            request.fingerprint.as_bytes(),
            request.wait,
            request.lifetime_ms,
        );
        let claim = tx.after_ahead(&claim);
        let error = match MySql::raw(tx, &claim).await {
            Ok(()) => return Ok(InBatch::Acquired),
            Err(error) => error,
        };
        match MySql::classify(&error) {
            // An uncommitted row holds the key.
            ErrorClass::LockTimeout => {
                tx.undone(savepoint::UNDO);
                Ok(InBatch::InFlight)
            }
            // A committed row holds the key.
            ErrorClass::Duplicate => found_in_batch(seam, tx, request).await,
            // A deadlock, a failed certification: the transaction is over.
            _ => Err(seam.error(error)),
        }
    }

    /// The record and its check, and the savepoint released, sent ahead of
    /// the batch's next claim (or its commit): if the row is gone, nothing
    /// after it runs — that claim fails, and the batch with it.
    async fn batch_complete(
        seam: &Seam<Self>,
        tx: &mut MySqlTx,
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

    /// Ends the transaction with `end`, the session's settings restored.
    async fn tx_end(seam: &Seam<Self>, mut tx: MySqlTx, end: End) -> Result<(), StoreError> {
        let sql = seam.state.sql.end(end.sql());
        let ended = match end {
            End::Rollback => tx.end(&sql).await,
            End::Commit => tx.commit_with(&sql).await,
        };
        ended.map_err(|e| seam.error(e))
    }

    /// Whether a transaction holds `key` in flight: a claim of it in a
    /// transaction of its own, rolled back in the same round trip, meets the
    /// uncommitted row and fails without waiting (a request claiming the key at
    /// that very moment may be told `409`).
    async fn tx_in_flight(seam: &Seam<Self>, key: &StorageKey) -> Result<Probe, StoreError> {
        let sql = &seam.state.sql;
        let connection = seam.bounded(seam.connection()).await?;
        let mut tx = MySqlTx::begun(connection, (), Instant::now());
        let probe = format!("{}; {}", sql.probe(key.as_str()), sql.end("ROLLBACK"));
        // A probe that fails closes its connection, which rolls it back.
        match seam.bounded(async { Ok(tx.end(&probe).await) }).await? {
            Ok(()) => Ok(Probe::Free),
            Err(error) => match MySql::classify(&error) {
                ErrorClass::LockTimeout => Ok(Probe::InFlight),
                ErrorClass::Duplicate => Ok(Probe::Free),
                _ => Probe::failed(seam, error),
            },
        }
    }
}
