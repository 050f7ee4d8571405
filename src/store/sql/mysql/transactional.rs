//! MySQL's transactional claim: the claim's row inserted with the session's
//! settings in one round trip; a duplicate of a committed key read, at READ
//! COMMITTED and after its transaction's rollback, in one more; the record
//! written and committed in one.

use std::time::{Duration, Instant};

use super::{MySql, MySqlTx, MySqlTxStore, number, statements::TxStatements};
use crate::{
    fingerprint::Fingerprint,
    store::{
        StorageKey, StoreError,
        sql::dialect::{Engine, ErrorClass, TxClaim},
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

pub(super) async fn claim(
    store: &MySqlTxStore,
    key: &StorageKey,
    fingerprint: &Fingerprint,
) -> Result<TxClaim<MySql>, StoreError> {
    let (base, sql) = (&store.base, &store.state.sql);
    let connection = base.pool.acquire().await.map_err(|e| base.error(e))?;
    // From here on, a failure closes the connection (see `SqlTx`).
    let mut tx = MySqlTx::begun(connection, (), Instant::now());
    let wait = store.claim_wait;
    let inserted = MySql::raw(
        &mut tx,
        &sql.claim(
            key.as_str(),
            fingerprint.as_bytes(),
            wait,
            store.bound,
            store.claim_lifetime_ms()?,
        ),
    )
    .await;
    let error = match inserted {
        Ok(()) => return Ok(TxClaim::Acquired(tx)),
        Err(error) => error,
    };
    match MySql::classify(&error) {
        // An uncommitted row holds the key. The transaction is still open
        // after a lock-wait timeout: rolled back, in the background.
        ErrorClass::LockTimeout | ErrorClass::Conflict => {
            roll_back(store, tx);
            Ok(TxClaim::InFlight)
        }
        // A committed row holds the key.
        ErrorClass::Duplicate => found(store, tx, key, fingerprint, wait).await,
        _ => {
            tx.close_on_drop();
            Err(base.error(error))
        }
    }
}

/// The committed row that holds the key: a replay, a mismatch, or an
/// expired record this claim takes over. The claim's transaction ends in
/// the read's round trip; a take-over begins another.
async fn found(
    store: &MySqlTxStore,
    mut tx: MySqlTx,
    key: &StorageKey,
    fingerprint: &Fingerprint,
    wait: Duration,
) -> Result<TxClaim<MySql>, StoreError> {
    let (base, sql) = (&store.base, &store.state.sql);
    let read = sql.read_after_rollback(key.as_str());
    let row = {
        let on: &mut sqlx::MySqlConnection = &mut tx;
        sqlx::Executor::fetch_optional(on, sqlx::raw_sql(sqlx::AssertSqlSafe(read))).await
    };
    let row = match row.map(|row| row.as_ref().map(MySql::key_row).transpose()) {
        Ok(Ok(row)) => row,
        Ok(Err(error)) | Err(error) => {
            tx.close_on_drop();
            return Err(base.error(error));
        }
    };
    let Some(connection) = tx.ended() else {
        return Err(base.error(sqlx::Error::PoolClosed));
    };
    match row {
        Some(row) if row.ms_left > 0 => Ok(TxClaim::Found(row)),
        Some(_) => {
            let mut tx = MySqlTx::begun(connection, (), Instant::now());
            let take_over = sql.take_over(
                key.as_str(),
                fingerprint.as_bytes(),
                wait,
                store.bound,
                store.claim_lifetime_ms()?,
            );
            let taken = {
                let on: &mut sqlx::MySqlConnection = &mut tx;
                sqlx::Executor::execute(on, sqlx::raw_sql(sqlx::AssertSqlSafe(take_over))).await
            };
            match taken {
                Ok(done) if done.rows_affected() == 1 => Ok(TxClaim::Acquired(tx)),
                // Taken over, or deleted, by another request since the read.
                Ok(_) => {
                    roll_back(store, tx);
                    Ok(TxClaim::InFlight)
                }
                Err(error) => match MySql::classify(&error) {
                    ErrorClass::LockTimeout | ErrorClass::Conflict => {
                        roll_back(store, tx);
                        Ok(TxClaim::InFlight)
                    }
                    _ => {
                        tx.close_on_drop();
                        Err(base.error(error))
                    }
                },
            }
        }
        // Deleted since the insert met it: asked again by the retry.
        None => Ok(TxClaim::InFlight),
    }
}

/// Rolls a transaction that found nothing to do back, in the background:
/// the duplicate's answer does not wait for it.
fn roll_back(store: &MySqlTxStore, mut tx: MySqlTx) {
    let (end, timeout) = (store.state.sql.end("ROLLBACK"), store.base.timeout);
    tokio::spawn(async move {
        // Timed out or failed: dropping `tx` closes its connection.
        let _ = tokio::time::timeout(timeout, tx.end(&end)).await;
    });
}

pub(super) async fn complete(
    store: &MySqlTxStore,
    tx: &mut MySqlTx,
    key: &StorageKey,
    record: Vec<u8>,
    retention_ms: i64,
) -> Result<(), StoreError> {
    let (base, sql) = (&store.base, &store.state.sql);
    // Retention counts from now, the end of the handler. On a multi-node
    // cluster, a duplicate committed on another node first fails this
    // COMMIT's certification (1213): nothing of this request commits.
    let longest = store.longest_kept_ms(retention_ms)?;
    match tx
        .end(&sql.complete(key.as_str(), &record, retention_ms, longest))
        .await
    {
        Ok(()) => Ok(()),
        // The check after the update: the claim's row is gone (the handler
        // deleted it, or a deadlock rolled the transaction back and the
        // handler went on writing). Committing would keep writes without
        // their record; the failed batch never reached its COMMIT, and the
        // closed connection rolls the rest back.
        Err(error) if number(&error) == Some(1242) => Err(StoreError::Refused(
            "the claim's row is no longer in the transaction".into(),
        )),
        Err(error) => Err(base.error(error)),
    }
}

pub(super) async fn release(store: &MySqlTxStore, mut tx: MySqlTx) -> Result<(), StoreError> {
    let end = store.state.sql.end("ROLLBACK");
    tx.end(&end).await.map_err(|e| store.base.error(e))
}

/// Whether a transaction holds `key` in flight: a claim of it in a
/// transaction of its own, rolled back in the same round trip, meets the
/// uncommitted row and fails without waiting (a request claiming the key at
/// that very moment may be told `409`).
pub(super) async fn in_flight(store: &MySqlTxStore, key: &StorageKey) -> Result<bool, StoreError> {
    let (base, sql) = (&store.base, &store.state.sql);
    let connection = base
        .bounded(async { base.pool.acquire().await.map_err(|e| base.error(e)) })
        .await?;
    let mut tx = MySqlTx::begun(connection, (), Instant::now());
    let probe = format!("{}; {}", sql.probe(key.as_str()), sql.end("ROLLBACK"));
    // A probe that fails closes its connection, which rolls it back.
    match base.bounded(async { Ok(tx.end(&probe).await) }).await? {
        Ok(()) => Ok(false),
        Err(error) => match MySql::classify(&error) {
            ErrorClass::LockTimeout => Ok(true),
            ErrorClass::Duplicate => Ok(false),
            _ => Err(base.error(error)),
        },
    }
}
