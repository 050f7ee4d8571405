//! The transactional store's half of an engine: how its transaction begins
//! with the claim in it, how it ends — with the record, or without — and
//! how a claim in flight is seen.
//!
//! An engine is handed a [`Seam`], as narrow as sqlx's per-driver
//! `TransactionManager` (which is handed a connection): the pool, the
//! engine's own state, the bound on one operation and how an error is said
//! — never the store. What a claim's row lives for, and whether a
//! completion writes its expiry anew, are the family's decisions
//! (`SqlTxStore`); an engine writes what it is told.

use std::{future::Future, sync::Arc, time::Duration};

use sqlx::{Pool, pool::PoolConnection};

use super::{
    base::Base,
    dialect::{Dialect, Engine, ErrorClass, KeyRow},
    tx::SqlTx,
};
use crate::{
    fingerprint::Fingerprint,
    store::{Forgotten, StorageKey, StoreError},
};

/// What an engine's transactional operations are handed. Cloning is
/// cheap: an engine may take it into a task of its own.
pub(crate) struct Seam<D: TxEngine> {
    base: Arc<Base<D>>,
    /// The engine's own state for this store (its statements, its parked
    /// transactions, its registry of keys in flight).
    pub(crate) state: Arc<D::TxState>,
}

impl<D: TxEngine> Clone for Seam<D> {
    fn clone(&self) -> Self {
        Self {
            base: self.base.clone(),
            state: self.state.clone(),
        }
    }
}

// Each engine uses some: a build with fewer engines leaves some unused.
#[cfg_attr(not(every_sql), allow(dead_code))]
impl<D: TxEngine> Seam<D> {
    pub(crate) fn new(base: Arc<Base<D>>, state: Arc<D::TxState>) -> Self {
        Self { base, state }
    }

    /// The pool the store's transactions run on.
    pub(crate) fn pool(&self) -> &Pool<D::Db> {
        &self.base.pool
    }

    /// The engine.
    pub(crate) fn engine(&self) -> &D {
        &self.base.engine
    }

    /// The table's name (checked).
    pub(crate) fn table(&self) -> &str {
        &self.base.sql.table
    }

    /// The key's live (committed) row, if any.
    pub(crate) async fn live_row(&self, key: &StorageKey) -> Result<Option<KeyRow>, StoreError> {
        self.base.live_row(key).await
    }

    /// The bound on one operation: its statements, and the wait for a
    /// pooled connection.
    pub(crate) fn timeout(&self) -> Duration {
        self.base.timeout
    }

    /// `error` as the store reports it.
    pub(crate) fn error(&self, error: sqlx::Error) -> StoreError {
        self.base.error(error)
    }

    /// A pooled connection.
    pub(crate) async fn connection(&self) -> Result<PoolConnection<D::Db>, StoreError> {
        self.base.pool.acquire().await.map_err(|e| self.error(e))
    }

    /// `work`, bounded by the operation's timeout.
    pub(crate) async fn bounded<T>(
        &self,
        work: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        self.base.bounded(work).await
    }
}

/// A claim, as the family asks an engine for it.
// Each engine uses some: a build with fewer engines leaves some unused.
#[cfg_attr(not(every_sql), allow(dead_code))]
pub(crate) struct ClaimRequest<'a> {
    pub(crate) key: &'a StorageKey,
    pub(crate) fingerprint: &'a Fingerprint,
    /// How long the claim waits on a duplicate's uncommitted row.
    pub(crate) wait: Duration,
    /// How long the transaction may live: the database ends it after.
    pub(crate) bound: Duration,
    /// How long the claim's row says it lives, in milliseconds from its
    /// insert (see `SqlTxStore::claim_lifetime_ms`).
    pub(crate) lifetime_ms: i64,
    /// Whether the claim may wait for this process's turn to write as long
    /// as it takes (an engine whose writers take turns).
    pub(crate) in_line: bool,
}

/// What a transactional claim found.
pub(crate) enum TxClaim<D: Dialect> {
    /// The key is this transaction's.
    Acquired(SqlTx<D>),
    /// A live row holds the key (committed): decided by its fingerprint
    /// and record.
    Found(KeyRow),
    /// An uncommitted row of another transaction holds the key.
    InFlight,
}

/// How a completion writes the claim's row's expiry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Expiry {
    /// As the claim wrote it: it covers the retention from now, and no
    /// more than its margin. The update changes no indexed column.
    Kept,
    /// This many milliseconds from now.
    Retention(i64),
}

/// What a probe for a transaction's claim in flight found: its row is
/// uncommitted, so no read sees it; a write that would meet it does.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Probe {
    /// A transaction (in any process) holds the key: its write waited, or
    /// (SQLite) another process holds the file's write lock.
    InFlight,
    /// None does.
    Free,
    /// It cannot be told with this connection's rights: the database is
    /// read-only, or the user may only read; why.
    Unseen(String),
}

impl Probe {
    /// What a probe's error tells: a database this user cannot write (or
    /// read-only) cannot be probed — anything else is the store's error.
    pub(crate) fn failed<D: TxEngine>(
        seam: &Seam<D>,
        error: sqlx::Error,
    ) -> Result<Self, StoreError> {
        match D::classify(&error) {
            ErrorClass::ReadOnly => {
                Ok(Self::Unseen(format!("the database is read-only ({error})")))
            }
            ErrorClass::PermissionDenied => Ok(Self::Unseen(format!(
                "the database user may only read the table ({error})"
            ))),
            _ => Err(seam.error(error)),
        }
    }
}

/// How a transaction ends without a record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum End {
    /// Everything undone, the claim with it.
    Rollback,
    /// What the transaction wrote kept (its claim's row already deleted).
    Commit,
}

impl End {
    pub(crate) fn sql(self) -> &'static str {
        match self {
            Self::Rollback => "ROLLBACK",
            Self::Commit => "COMMIT",
        }
    }
}

/// What a claim inside a batch's transaction found (see
/// [`TxEngine::batch_claim`]).
pub(crate) enum InBatch {
    /// The key is the batch's, in the savepoint its claim opened.
    Acquired,
    /// A live row holds the key (committed); the savepoint is undone.
    Found(KeyRow),
    /// An uncommitted row of another transaction holds the key; the
    /// savepoint is undone.
    InFlight,
}

/// A batch's savepoint, which each key's claim opens: the same SQL on
/// every engine.
pub(crate) mod savepoint {
    /// Opens a key's savepoint.
    pub(crate) const OPEN: &str = "SAVEPOINT idempotency_key; ";
    /// Undoes the key: its claim and what its work wrote.
    pub(crate) const UNDO: &str =
        "ROLLBACK TO SAVEPOINT idempotency_key; RELEASE SAVEPOINT idempotency_key; ";
    /// Keeps the key, its record written.
    pub(crate) const KEEP: &str = "RELEASE SAVEPOINT idempotency_key; ";
}

/// An engine's transactional claim, completion and end.
pub(crate) trait TxEngine: Engine {
    /// The engine's state for a transactional store on `pool`, whose table
    /// is `table` (checked), each operation bounded by `timeout`.
    fn tx_state(
        pool: &Pool<Self::Db>,
        engine: &Self,
        table: &str,
        timeout: Duration,
    ) -> impl Future<Output = Result<Self::TxState, StoreError>> + Send;

    /// Begins the request's transaction with `claim` in it.
    fn tx_claim(
        seam: &Seam<Self>,
        claim: &ClaimRequest<'_>,
    ) -> impl Future<Output = Result<TxClaim<Self>, StoreError>> + Send;

    /// Writes the record into the claim's row, its expiry as told, and
    /// commits with the transaction's deferred statements
    /// ([`SqlTx::commit_with`]) — or fails, the connection then closed:
    /// nothing commits.
    fn tx_complete(
        seam: &Seam<Self>,
        tx: &mut SqlTx<Self>,
        key: &StorageKey,
        record: Vec<u8>,
        expiry: Expiry,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Ends the transaction without a record (a commit with its deferred
    /// statements).
    fn tx_end(
        seam: &Seam<Self>,
        tx: SqlTx<Self>,
        end: End,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        self::end(seam, tx, end)
    }

    /// Begins a batch's transaction — a transaction that takes a batch of
    /// claims, each in a savepoint ([`batch_claim`](Self::batch_claim)) —
    /// holding no claim yet, bounded by `bound` as a request's is.
    fn batch_begin(
        seam: &Seam<Self>,
        bound: Duration,
    ) -> impl Future<Output = Result<SqlTx<Self>, StoreError>> + Send;

    /// Claims inside the batch's transaction `tx`, in a savepoint
    /// ([`savepoint::OPEN`]) left open when the key is acquired and undone
    /// otherwise (sent ahead of the next statement: [`SqlTx::undone`]).
    fn batch_claim(
        seam: &Seam<Self>,
        tx: &mut SqlTx<Self>,
        claim: &ClaimRequest<'_>,
    ) -> impl Future<Output = Result<InBatch, StoreError>> + Send;

    /// Writes the record into the row of the key claimed in the batch
    /// last, and keeps its savepoint ([`savepoint::KEEP`]) — at once, or
    /// sent ahead of the batch's next statement, whose failure then fails
    /// the batch.
    fn batch_complete(
        seam: &Seam<Self>,
        tx: &mut SqlTx<Self>,
        key: &StorageKey,
        record: Vec<u8>,
        expiry: Expiry,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Whether a transaction (in any process) holds `key` in flight: an
    /// uncommitted row other sessions cannot read. Never waits for the
    /// holder: what it says is what holds when it is asked.
    fn tx_in_flight(
        seam: &Seam<Self>,
        key: &StorageKey,
    ) -> impl Future<Output = Result<Probe, StoreError>> + Send;

    /// Forgets the record `key` holds when asked: a committed one is
    /// deleted; none is looked for in flight, whose uncommitted row no
    /// other session can delete — so it is left alone and reported. What
    /// commits after the question is never deleted by it: the row is read
    /// first, and the delete acts only on what was read.
    fn tx_forget(
        seam: &Seam<Self>,
        key: &StorageKey,
    ) -> impl Future<Output = Result<Forgotten, StoreError>> + Send {
        forget(seam, key)
    }
}

/// Ends `tx` with `end`: a commit with its deferred statements, or a
/// rollback.
pub(crate) async fn end<D: TxEngine>(
    seam: &Seam<D>,
    mut tx: SqlTx<D>,
    end: End,
) -> Result<(), StoreError> {
    let ended = match end {
        End::Rollback => tx.end(end.sql()).await,
        End::Commit => tx.commit_with(end.sql()).await,
    };
    ended.map_err(|e| seam.error(e))
}

/// [`TxEngine::tx_forget`] as every engine does it: the committed record
/// read and deleted; none, a probe for a claim in flight.
pub(crate) async fn forget<D: TxEngine>(
    seam: &Seam<D>,
    key: &StorageKey,
) -> Result<Forgotten, StoreError> {
    match seam.base.forget_row(key, false).await? {
        Forgotten::Nothing => {}
        forgotten => return Ok(forgotten),
    }
    Ok(match D::tx_in_flight(seam, key).await? {
        Probe::InFlight => Forgotten::InFlight,
        Probe::Free => Forgotten::Nothing,
        Probe::Unseen(why) => {
            return Err(StoreError::Unavailable(
                format!("whether a request holds the key cannot be told: {why}").into(),
            ));
        }
    })
}
