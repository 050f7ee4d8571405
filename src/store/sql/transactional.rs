//! The transactional store: the claim is the record's row, inserted inside
//! the request's transaction, and the record commits with the handler's
//! writes — the same contract on every engine; how the transaction begins
//! with its claim and ends with its record is each engine's.

use std::{
    sync::{
        Arc,
        atomic::{AtomicI64, Ordering},
    },
    time::{Duration, Instant},
};

use super::{
    Base,
    decide::decide,
    dialect::{Args, Dialect, Engine},
    millis,
    tx::SqlTx,
    tx_engine::{ClaimRequest, End, Expiry, InBatch, Probe, Seam, TxClaim, TxEngine, savepoint},
};
use crate::{
    fingerprint::Fingerprint,
    record::{CompletedRecord, codec},
    store::{Claim, Forgotten, KeyState, LeaseToken, StorageKey, Store, StoreError},
};

/// Retry-After for a duplicate of a request whose transaction is running:
/// the remaining time is not known, and the transaction usually ends soon.
pub(crate) const IN_FLIGHT_RETRY_AFTER: Duration = Duration::from_secs(1);

/// A [`Store`] on a SQL database whose record commits in the handler's own
/// transaction: exactly one effect per key, across crashes.
///
/// The layer begins the request's transaction with the claim in it — the
/// record's row, inserted — and hands it to the handler through
/// [`IdempotentTx`](crate::IdempotentTx) (a message's work receives it as
/// `&mut` [`SqlTx`]); the handler writes with `execute(&mut *tx)`; once it
/// returns a final response, the layer writes the record into the same
/// transaction and commits. So:
///
/// - a crash anywhere before the commit leaves neither the effect nor the
///   record (the claim vanishes with the transaction: a retry executes at
///   once, no lease to wait out); after the commit, both. A retry replays
///   or executes for the first time: **exactly one effect**.
/// - a concurrent duplicate's claim meets the uncommitted row, waits for it
///   briefly at most, and answers `409`: it never waits for the handler.
/// - a response that says "nothing was done" (the store policy's), a
///   server error (`5xx`), a handler error or a panic roll everything back
///   and release the key.
/// - a statement of the handler that aborts the transaction (PostgreSQL),
///   or a commit the database refuses, sends the handler's own answer, not
///   stored, with the key released; a success it answers anyway is
///   withheld with `500` — nothing committed.
/// - if the commit fails or its outcome is unknown (the connection dropped
///   during `COMMIT`), the handler's response is withheld (`503`): the
///   retry replays or executes, both correct.
///
/// Named by engine: `PostgresTxStore`,
/// `SqliteTxStore`, `MySqlTxStore`; each engine's
/// module says what its transactions cost and how they are bounded.
/// Cloning is cheap and clones share the pool.
///
/// # Examples
///
/// ```no_run
/// # #[cfg(feature = "sqlite")]
/// # async fn demo() -> Result<(), tower_idempotency::store::StoreError> {
/// use axum::{Router, http::StatusCode, routing::post};
/// use tower_idempotency::{IdempotencyLayer, IdempotentTx, SqliteStore, SqliteTx};
///
/// let store = SqliteStore::builder()
///     .transactional()
///     .create_table_if_missing()
///     .connect("sqlite://payments.db")
///     .await?;
///
/// async fn charge(mut tx: IdempotentTx<SqliteTx>) -> Result<StatusCode, StatusCode> {
///     sqlx::query("INSERT INTO charges (amount) VALUES (?1)")
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
///     .layer(IdempotencyLayer::new(store).single_tenant());
/// # Ok(()) }
/// ```
pub struct SqlTxStore<D: Dialect> {
    pub(crate) base: Arc<Base<D>>,
    pub(crate) state: Arc<D::TxState>,
    /// How long a request's transaction may live (the database ends it).
    pub(crate) bound: Duration,
    /// How long a claim waits on a duplicate's uncommitted row.
    pub(crate) claim_wait: Duration,
    /// The retention the last completion asked for, in milliseconds: a
    /// claim's row is written to expire after it (and a margin), so that
    /// its completion need not change the expiry — an indexed column — and
    /// the row's update touches no index.
    pub(crate) retention: Arc<AtomicI64>,
}

impl<D: Dialect> Clone for SqlTxStore<D> {
    fn clone(&self) -> Self {
        Self {
            base: self.base.clone(),
            state: self.state.clone(),
            bound: self.bound,
            claim_wait: self.claim_wait,
            retention: self.retention.clone(),
        }
    }
}

impl<D: Dialect> SqlTxStore<D> {
    /// How long a claim's row says it lives, in milliseconds: the retention
    /// its record will most likely be kept for, and a margin for the
    /// transaction to run in — a thousandth of the retention, at most the
    /// transaction's bound (30 s of a day's retention). The completion
    /// raises it only when the transaction outlived the margin, so a record
    /// is kept for its retention from the commit, and never more than the
    /// margin longer.
    pub(crate) fn claim_lifetime_ms(&self) -> Result<i64, StoreError> {
        let retention = self.retention.load(Ordering::Relaxed);
        self.longest_kept_ms(retention)
    }

    /// The latest a record kept `retention_ms` from its commit may expire:
    /// its retention and the margin of [`Self::claim_lifetime_ms`]. A
    /// completion keeps the expiry its claim's row was written with when
    /// it lies between the retention and this — no index changes — and
    /// writes the retention from now otherwise: a row written while the
    /// store was asked longer retentions is never kept that long.
    pub(crate) fn longest_kept_ms(&self, retention_ms: i64) -> Result<i64, StoreError> {
        let bound = millis(self.bound, "transaction timeout")?;
        Ok(retention_ms.saturating_add((retention_ms / 1000).min(bound)))
    }

    /// `record`, as the completion of `tx` writes it for `fingerprint`, and
    /// its row's expiry, kept `retention` from now (the retention the
    /// store's next claims' rows are written for).
    fn record(
        &self,
        tx: &SqlTx<D>,
        fingerprint: &Fingerprint,
        record: &CompletedRecord,
        retention: Duration,
    ) -> Result<(Vec<u8>, Expiry), StoreError> {
        let record = codec::encode_with(fingerprint, record, &self.base.compression);
        let retention = millis(retention, "retention")?;
        self.retention.store(retention, Ordering::Relaxed);
        Ok((record, self.expiry(tx, retention)?))
    }

    /// What a commit of a transaction that `began` then came to: a
    /// transaction the database ended for outliving its bound is said to
    /// have, so that work that always takes that long is not retried
    /// forever.
    fn bounded_commit(
        &self,
        began: Instant,
        committed: Result<(), StoreError>,
    ) -> Result<(), StoreError> {
        match committed {
            Err(StoreError::Unavailable(error)) if began.elapsed() >= self.bound => {
                Err(StoreError::TransactionTimedOut {
                    bound: self.bound,
                    source: error,
                })
            }
            committed => committed,
        }
    }

    /// How the completion of `tx` writes its row's expiry, for a record
    /// kept `retention_ms` from now: left as the claim wrote it when it
    /// covers the retention and no more than its margin — no index
    /// changes — and written anew otherwise (the transaction outlived the
    /// margin, or the claim was written while the store was asked another
    /// retention). Judged by this process's clock from before the claim
    /// was sent, so a row is never taken to have longer left than it has.
    fn expiry(&self, tx: &SqlTx<D>, retention_ms: i64) -> Result<Expiry, StoreError> {
        let longest = self.longest_kept_ms(retention_ms)?;
        Ok(match tx.row_lifetime() {
            Some((left, lifetime)) if lifetime <= longest && left >= retention_ms => Expiry::Kept,
            _ => Expiry::Retention(retention_ms),
        })
    }
}
impl<D: TxEngine> SqlTxStore<D> {
    /// What an engine's operations are handed.
    fn seam(&self) -> Seam<D> {
        Seam::new(self.base.clone(), self.state.clone())
    }

    /// A claim of `key` as this store asks an engine for it, its row to
    /// live the claim lifetime; `in_line` when it may wait its turn to
    /// write as long as it takes.
    fn request<'a>(
        &self,
        key: &'a StorageKey,
        fingerprint: &'a Fingerprint,
        in_line: bool,
    ) -> Result<ClaimRequest<'a>, StoreError> {
        Ok(ClaimRequest {
            key,
            fingerprint,
            wait: self.claim_wait,
            bound: self.bound,
            lifetime_ms: self.claim_lifetime_ms()?,
            in_line,
        })
    }

    /// A claim of `key` by this store, its row to live the claim lifetime;
    /// `in_line` when it may wait its turn to write as long as it takes.
    async fn claim_in_tx(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        in_line: bool,
    ) -> Result<Claim<SqlTx<D>>, StoreError> {
        let request = self.request(key, fingerprint, in_line)?;
        let sent = Instant::now();
        let seam = self.seam();
        let claimed = if in_line {
            D::tx_claim(&seam, &request).await?
        } else {
            self.base.bounded(D::tx_claim(&seam, &request)).await?
        };
        match claimed {
            TxClaim::Acquired(mut tx) => {
                tx.claimed(key.as_str(), sent, request.lifetime_ms);
                Ok(Claim::Acquired(tx))
            }
            TxClaim::InFlight => Ok(Claim::InFlight {
                retry_after: IN_FLIGHT_RETRY_AFTER,
            }),
            TxClaim::Found(row) => decide(fingerprint, row, &self.base.compression),
        }
    }
}

impl<D: Engine> std::fmt::Debug for SqlTxStore<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct(D::STORE)
            .field("table", &self.base.sql.table)
            .field("timeout", &self.base.timeout)
            .field("transaction_timeout", &self.bound)
            .finish_non_exhaustive()
    }
}

super::table_methods!(SqlTxStore);

impl<D: TxEngine> Store for SqlTxStore<D> {
    type Granted = SqlTx<D>;
    // Its claims commit nothing unless they complete.
    const REPORTS_TAKEOVERS: bool = true;

    async fn claim(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        _lease: Duration,
    ) -> Result<Claim<SqlTx<D>>, StoreError> {
        self.claim_in_tx(key, fingerprint, false).await
    }

    /// Waits in line for this process's turn to write, as long as it takes,
    /// where the engine's writers take turns (SQLite); elsewhere the
    /// database orders its writers, and this is [`claim`](Self::claim).
    async fn claim_patiently(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<Claim<SqlTx<D>>, StoreError> {
        if !D::TAKES_TURNS {
            return self.claim(key, fingerprint, lease).await;
        }
        self.claim_in_tx(key, fingerprint, true).await
    }

    /// The claim lives as long as its transaction: nothing to extend.
    async fn extend(&self, _: &StorageKey, _: LeaseToken, _: Duration) -> Result<bool, StoreError> {
        Ok(true)
    }

    async fn complete(
        &self,
        key: &StorageKey,
        tx: &mut SqlTx<D>,
        fingerprint: &Fingerprint,
        record: Arc<CompletedRecord>,
        retention: Duration,
    ) -> Result<bool, StoreError> {
        let (record, expiry) = self.record(tx, fingerprint, &record, retention)?;
        let committed = self
            .base
            .bounded(D::tx_complete(&self.seam(), tx, key, record, expiry))
            .await;
        self.bounded_commit(tx.began, committed).map(|()| true)
    }

    async fn release(&self, _: &StorageKey, tx: SqlTx<D>) -> Result<bool, StoreError> {
        self.base
            .bounded(D::tx_end(&self.seam(), tx, End::Rollback))
            .await?;
        Ok(true)
    }

    /// The claim's row deleted in the transaction, then `COMMIT`: the
    /// handler's writes stay, no record does. A transaction the database
    /// already aborted (a failed statement) rolls back instead.
    async fn release_keeping_writes(
        &self,
        key: &StorageKey,
        mut tx: SqlTx<D>,
    ) -> Result<bool, StoreError> {
        let args = Args {
            key: key.as_str(),
            ..Args::default()
        };
        if let Err(error) = D::execute(&mut tx, &self.base.sql.delete_claim, &args).await {
            // Dropped, the connection closes: the transaction rolls back.
            tracing::warn!(%key, %error, "idempotency: the claim could not be removed; the handler's writes roll back");
            tx.close_on_drop();
            return Ok(true);
        }
        self.base
            .bounded(D::tx_end(&self.seam(), tx, End::Commit))
            .await?;
        Ok(true)
    }

    /// Every SQL engine's transaction takes savepoints.
    const BATCHES: bool = true;

    async fn begin_batch(&self) -> Result<SqlTx<D>, StoreError> {
        self.base
            .bounded(D::batch_begin(&self.seam(), self.bound))
            .await
    }

    /// The claim as a request's transaction makes it, in a savepoint; a
    /// failure other than an answer (a timeout, a lost connection)
    /// abandons the batch: its commit then fails, and nothing in it
    /// commits.
    async fn claim_in_batch(
        &self,
        batch: &mut SqlTx<D>,
        key: &StorageKey,
        fingerprint: &Fingerprint,
    ) -> Result<Claim<()>, StoreError> {
        let request = self.request(key, fingerprint, false)?;
        let sent = Instant::now();
        let claimed = self
            .base
            .bounded(D::batch_claim(&self.seam(), batch, &request))
            .await
            .inspect_err(|_| batch.abandon())?;
        match claimed {
            InBatch::Acquired => {
                batch.claimed(key.as_str(), sent, request.lifetime_ms);
                batch.opened();
                Ok(Claim::Acquired(()))
            }
            InBatch::InFlight => Ok(Claim::InFlight {
                retry_after: IN_FLIGHT_RETRY_AFTER,
            }),
            InBatch::Found(row) => decide(fingerprint, row, &self.base.compression),
        }
    }

    /// A failure abandons the batch, as a claim's does.
    async fn complete_in_batch(
        &self,
        batch: &mut SqlTx<D>,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        record: Arc<CompletedRecord>,
        retention: Duration,
    ) -> Result<(), StoreError> {
        let (record, expiry) = self.record(batch, fingerprint, &record, retention)?;
        self.base
            .bounded(D::batch_complete(&self.seam(), batch, key, record, expiry))
            .await
            .inspect_err(|_| batch.abandon())?;
        batch.kept();
        Ok(())
    }

    /// Rolled back to the key's savepoint, sent ahead of the batch's next
    /// statement.
    async fn release_in_batch(
        &self,
        batch: &mut SqlTx<D>,
        _: &StorageKey,
    ) -> Result<(), StoreError> {
        batch.undone(savepoint::UNDO);
        Ok(())
    }

    async fn commit_batch(&self, batch: SqlTx<D>) -> Result<(), StoreError> {
        let began = batch.began;
        let committed = self
            .base
            .bounded(D::tx_end(&self.seam(), batch, End::Commit))
            .await;
        self.bounded_commit(began, committed)
    }

    /// A committed record is read; a claim in flight is an uncommitted row
    /// no other session sees, so the engine probes for it (a request
    /// claiming the key at that very moment may be told `409`).
    async fn inspect(&self, key: &StorageKey) -> Result<KeyState, StoreError> {
        if let Some(found) = self.base.inspect_row(key).await? {
            return Ok(found);
        }
        Ok(match D::tx_in_flight(&self.seam(), key).await? {
            Probe::InFlight => KeyState::InFlight {
                retry_after: IN_FLIGHT_RETRY_AFTER,
            },
            Probe::Free => KeyState::Absent,
            Probe::Unseen(why) => {
                tracing::warn!(%key, %why, "idempotency: whether a transaction holds the key in flight cannot be told; only committed records are seen");
                KeyState::Absent
            }
        })
    }

    async fn forget(&self, key: &StorageKey, force: bool) -> Result<Forgotten, StoreError> {
        match D::tx_forget(&self.seam(), key).await? {
            Forgotten::InFlight if force => Err(StoreError::Unsupported(
                "forcing a transactional claim in flight: it is the handler's open transaction, which ends when the handler does or at the transaction timeout",
            )),
            forgotten => Ok(forgotten),
        }
    }
}
