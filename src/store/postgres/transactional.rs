//! The transactional store: the claim is the record's row, inserted inside
//! the request's transaction, and the record commits with the handler's
//! writes.

use std::{sync::Arc, time::Duration};

use bytes::Bytes;
use sqlx::{Executor, PgConnection, Row, postgres::PgRow};

use super::{Base, PostgresTx, idle::IdleTransactions};
use crate::{
    fingerprint::Fingerprint,
    record::{CompletedRecord, codec},
    store::{
        Claim, Forgotten, KeyState, LeaseToken, StorageKey, Store, StoreError,
        sql::{decide, millis},
    },
};

/// Retry-After for a duplicate of a request whose transaction is running: the
/// remaining time is not known, the transaction usually ends soon.
const IN_FLIGHT_RETRY_AFTER: Duration = Duration::from_secs(1);

/// The SQLSTATE of a wait that `lock_timeout` ended: here, a claim that met
/// a row another transaction inserted and has not committed.
const LOCK_NOT_AVAILABLE: &str = "55P03";

/// The SQLSTATE of a statement sent in a transaction an earlier failure
/// aborted.
const IN_FAILED_TRANSACTION: &str = "25P02";

/// The SQLSTATE of an `EXECUTE` of a statement this connection has not
/// prepared.
const NOT_PREPARED: &str = "26000";

/// A [`Store`] on PostgreSQL whose record commits in the handler's own
/// transaction: exactly one effect per key, across crashes. See the
/// [module docs](super) for how it works and what it costs.
///
/// Handlers take the transaction with
/// [`IdempotentTx<PostgresTx>`](crate::IdempotentTx); a message's work
/// receives it as `&mut PostgresTx`. Cloning is cheap and clones share the
/// pool.
///
/// # Examples
///
/// ```no_run
/// # async fn demo() -> Result<(), tower_idempotency::store::StoreError> {
/// use axum::{Router, http::StatusCode, routing::post};
/// use tower_idempotency::{IdempotencyLayer, IdempotentTx, PostgresStore, PostgresTx};
///
/// let store = PostgresStore::builder()
///     .transactional()
///     .connect("postgres://postgres@127.0.0.1:5432/payments")
///     .await?;
/// store.migrate().await?;
///
/// async fn charge(mut tx: IdempotentTx<PostgresTx>) -> Result<StatusCode, StatusCode> {
///     sqlx::query("INSERT INTO charges (amount) VALUES ($1)")
///         .bind(1999_i64)
///         .execute(&mut *tx)
///         .await
///         .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
///     // The layer commits this insert together with the stored response.
///     Ok(StatusCode::CREATED)
/// }
///
/// let app: Router = Router::new()
///     .route("/v1/charges", post(charge))
///     .layer(IdempotencyLayer::new(store));
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct PostgresTxStore {
    pub(super) base: Arc<Base>,
    /// Transactions of claims that found nothing to do, to be rolled back.
    pub(super) idle: Arc<IdleTransactions>,
    /// The session's `lock_timeout`, restored after the claim.
    pub(super) lock_timeout: Arc<str>,
    /// How long a claim waits on a duplicate's uncommitted row.
    pub(super) claim_wait: Duration,
    pub(super) transaction_timeout: Duration,
}

impl std::fmt::Debug for PostgresTxStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresTxStore")
            .field("table", &self.base.sql.table)
            .field("timeout", &self.base.timeout)
            .field("transaction_timeout", &self.transaction_timeout)
            .finish_non_exhaustive()
    }
}

crate::store::sql::records_methods!(PostgresTxStore, sqlx::PgPool);

/// What the claim statement answered.
enum Answer {
    Acquired,
    /// The row that holds the key: fingerprint, record, milliseconds left
    /// (negative: expired).
    Found(Vec<u8>, Option<Vec<u8>>, i64),
    /// Nothing: a row committed after the statement's snapshot was taken
    /// made the insert do nothing. The next statement sees it.
    Raced,
}

impl Answer {
    fn read(row: Option<PgRow>) -> Result<Self, sqlx::Error> {
        let Some(row) = row else {
            return Ok(Self::Raced);
        };
        if row.try_get::<bool, _>("acquired")? {
            return Ok(Self::Acquired);
        }
        Ok(Self::Found(
            row.try_get("fingerprint")?,
            row.try_get("record")?,
            row.try_get("ms_left")?,
        ))
    }
}

impl PostgresTxStore {
    /// Begins the request's transaction (or chains one on a parked
    /// connection) with the claim in the same round trip: the transaction
    /// and the claim's row, or `None` when the claim met a duplicate's
    /// uncommitted row (in flight).
    async fn begin_claim(
        &self,
        claim: &str,
    ) -> Result<Option<(PostgresTx, Option<PgRow>)>, StoreError> {
        // `Executor::fetch_optional`, boxed, rather than `RawSql`'s async fn,
        // whose future trips rustc's inference of higher-ranked `Send`
        // bounds (rust-lang/rust#100013).
        if let Some(mut parked) = self.idle.take() {
            // Its ROLLBACK travels with this claim; AND CHAIN begins the
            // next transaction at the same (READ COMMITTED) level.
            let sql = format!("ROLLBACK AND CHAIN; {claim}");
            let on: &mut PgConnection = &mut parked;
            match on.fetch_optional(sqlx::raw_sql(&sql)).await {
                Ok(row) => return Ok(Some((parked, row))),
                Err(error) if is_lock_timeout(&error) => {
                    self.idle.park(parked, &self.base.pool);
                    return Ok(None);
                }
                // E.g. closed by the server meanwhile (a restart, an idle
                // timeout): dropped, which closes it; a fresh connection gets
                // the claim.
                Err(error) => {
                    tracing::debug!(%error, "idempotency: a parked claim transaction failed");
                }
            }
        }
        let connection = self.base.pool.acquire().await?;
        // From here on, a failure closes the connection (see `PostgresTx`).
        let mut tx = PostgresTx::begun(connection);
        // READ COMMITTED whatever the database's default: the claim must see
        // the rows committed before it, each statement on a fresh snapshot.
        let begin = format!("BEGIN ISOLATION LEVEL READ COMMITTED; {claim}");
        let on: &mut PgConnection = &mut tx;
        let mut claimed = on.fetch_optional(sqlx::raw_sql(&begin)).await;
        if claimed
            .as_ref()
            .is_err_and(|e| sqlstate(e).as_deref() == Some(NOT_PREPARED))
        {
            // A connection's first claim: its statements prepared first,
            // inside the transaction (a statement before BEGIN would start
            // one at the database's default isolation level).
            let prepare = self.base.sql.prepare();
            let sql = format!("ROLLBACK; BEGIN ISOLATION LEVEL READ COMMITTED; {prepare}; {claim}");
            let on: &mut PgConnection = &mut tx;
            claimed = on.fetch_optional(sqlx::raw_sql(&sql)).await;
        }
        match claimed {
            Ok(row) => Ok(Some((tx, row))),
            // The duplicate's transaction is aborted: parked for the next
            // claim to roll back.
            Err(error) if is_lock_timeout(&error) => {
                self.idle.park(tx, &self.base.pool);
                Ok(None)
            }
            Err(error) => Err(error.into()),
        }
    }

    async fn claim_in_transaction(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
    ) -> Result<Claim<PostgresTx>, StoreError> {
        let claim = self.base.sql.tx_claim(
            key.as_str(),
            fingerprint,
            self.claim_wait,
            self.transaction_timeout,
            &self.lock_timeout,
        );
        let Some((mut tx, row)) = self.begin_claim(&claim).await? else {
            return Ok(Claim::InFlight {
                retry_after: IN_FLIGHT_RETRY_AFTER,
            });
        };
        let mut answer = Answer::read(row);
        // A row committed after the claim's snapshot: the next statement
        // sees it. Asked at most twice more.
        for _ in 0..2 {
            if !matches!(answer, Ok(Answer::Raced)) {
                break;
            }
            let on: &mut PgConnection = &mut tx;
            answer = match on.fetch_optional(sqlx::raw_sql(&claim)).await {
                Ok(row) => Answer::read(row),
                Err(error) if is_lock_timeout(&error) => {
                    self.idle.park(tx, &self.base.pool);
                    return Ok(Claim::InFlight {
                        retry_after: IN_FLIGHT_RETRY_AFTER,
                    });
                }
                Err(error) => return Err(error.into()),
            };
        }
        match answer {
            Ok(Answer::Acquired) => Ok(Claim::Acquired(tx)),
            Ok(Answer::Found(_, _, ms_left)) if ms_left <= 0 => {
                self.take_over(tx, key, fingerprint).await
            }
            Ok(Answer::Found(stored, record, ms_left)) => {
                // Nothing to do in this transaction: it ends with the next
                // claim on its connection.
                self.idle.park(tx, &self.base.pool);
                decide(
                    fingerprint,
                    &stored,
                    record.map(Bytes::from),
                    ms_left,
                    &self.base.compression,
                )
            }
            Ok(Answer::Raced) => {
                self.idle.roll_back(tx);
                Err(StoreError::Unavailable(
                    "the claim found a record it could not read three times".into(),
                ))
            }
            Err(error) => {
                self.idle.roll_back(tx);
                Err(error.into())
            }
        }
    }

    /// The key's record has expired (and was not deleted yet): this claim
    /// replaces it, in its transaction. A concurrent claim doing the same
    /// waits on the row, then finds it live.
    async fn take_over(
        &self,
        mut tx: PostgresTx,
        key: &StorageKey,
        fingerprint: &Fingerprint,
    ) -> Result<Claim<PostgresTx>, StoreError> {
        let bound = millis(self.transaction_timeout, "transaction timeout")?;
        let on: &mut PgConnection = &mut tx;
        let taken = sqlx::query(&self.base.sql.take_over)
            .bind(key.as_str())
            .bind(&fingerprint.as_bytes()[..])
            .bind(bound)
            .execute(on)
            .await;
        match taken {
            Ok(done) if done.rows_affected() == 1 => Ok(Claim::Acquired(tx)),
            // Taken over by another claim meanwhile, which committed.
            Ok(_) => {
                self.idle.roll_back(tx);
                Ok(Claim::InFlight {
                    retry_after: IN_FLIGHT_RETRY_AFTER,
                })
            }
            Err(error) => {
                self.idle.roll_back(tx);
                Err(error.into())
            }
        }
    }
}

fn is_lock_timeout(error: &sqlx::Error) -> bool {
    sqlstate(error).as_deref() == Some(LOCK_NOT_AVAILABLE)
}

fn sqlstate(error: &sqlx::Error) -> Option<String> {
    error
        .as_database_error()
        .and_then(|e| e.code())
        .map(|code| code.into_owned())
}

impl Store for PostgresTxStore {
    type Granted = PostgresTx;

    async fn claim(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        _lease: Duration,
    ) -> Result<Claim<PostgresTx>, StoreError> {
        self.base
            .bounded(self.claim_in_transaction(key, fingerprint))
            .await
    }

    /// The claim lives as long as its transaction: nothing to extend.
    async fn extend(&self, _: &StorageKey, _: LeaseToken, _: Duration) -> Result<bool, StoreError> {
        Ok(true)
    }

    async fn complete(
        &self,
        key: &StorageKey,
        tx: &mut PostgresTx,
        fingerprint: &Fingerprint,
        record: Arc<CompletedRecord>,
        retention: Duration,
    ) -> Result<bool, StoreError> {
        let record = codec::encode_with(fingerprint, &record, &self.base.compression);
        // The record and COMMIT in one round trip (simple protocol, so the
        // values are literals); if the record cannot be written, COMMIT
        // never runs. Written into one buffer: the record's literal can run
        // to megabytes.
        let complete =
            self.base
                .sql
                .tx_complete(key.as_str(), &record, millis(retention, "retention")?);
        // On an error `end` closes the connection: everything rolled back.
        let error = match self.base.bounded(tx.end(&complete)).await {
            Ok(()) => return Ok(true),
            Err(StoreError::Unavailable(error)) => error,
            Err(error) => return Err(error),
        };
        let code = error.downcast_ref::<sqlx::Error>().and_then(sqlstate);
        match code.as_deref() {
            // The handler's own statement failed and aborted the transaction,
            // or the commit broke a constraint or refused data (classes 23
            // and 22; the completion's own guard is a division by zero): the
            // same request would meet the same refusal, it is not an outage.
            Some(code)
                if code == IN_FAILED_TRANSACTION
                    || code.starts_with("22")
                    || code.starts_with("23") =>
            {
                Err(StoreError::Refused(error))
            }
            _ => Err(StoreError::Unavailable(error)),
        }
    }

    async fn release(&self, _: &StorageKey, tx: PostgresTx) -> Result<bool, StoreError> {
        self.base.bounded(tx.rollback()).await?;
        Ok(true)
    }

    /// A committed record is read; a claim in flight is an uncommitted row
    /// no other session sees, so it is probed: a claim in a transaction of
    /// its own, rolled back at once, that meets it waits 50 ms and fails. (A
    /// request claiming the key at that very moment may be told `409`.)
    async fn inspect(&self, key: &StorageKey) -> Result<KeyState, StoreError> {
        if let Some(found) = self.base.inspect_row(key).await? {
            return Ok(found);
        }
        Ok(if self.in_flight(key).await? {
            KeyState::InFlight {
                retry_after: IN_FLIGHT_RETRY_AFTER,
            }
        } else {
            KeyState::Absent
        })
    }

    async fn forget(&self, key: &StorageKey, force: bool) -> Result<Forgotten, StoreError> {
        // Only committed (completed) records: a claim in flight is a row no
        // other session can delete.
        if let Some(forgotten) = self.base.forget_row(key, false).await? {
            return Ok(forgotten);
        }
        match self.in_flight(key).await? {
            false => Ok(Forgotten::Nothing),
            true if force => Err(StoreError::Unsupported(
                "forcing a transactional claim in flight: it is the handler's open transaction, which ends when the handler does or at the transaction timeout",
            )),
            true => Ok(Forgotten::InFlight),
        }
    }
}

impl PostgresTxStore {
    /// Whether a transaction holds `key` in flight (see `inspect`).
    async fn in_flight(&self, key: &StorageKey) -> Result<bool, StoreError> {
        let probe = self.base.sql.tx_probe(key.as_str());
        let connection = self.base.bounded(self.base.pool.acquire()).await?;
        // Closed if the probe fails halfway: never back in the pool inside
        // its transaction.
        let mut tx = PostgresTx::begun(connection);
        match self.base.bounded(tx.end(&probe)).await {
            Ok(()) => Ok(false),
            Err(StoreError::Unavailable(error))
                if error
                    .downcast_ref::<sqlx::Error>()
                    .is_some_and(is_lock_timeout) =>
            {
                Ok(true)
            }
            Err(error) => Err(error),
        }
    }
}
