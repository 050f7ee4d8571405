//! SQLite's transactional claim: an `IMMEDIATE` transaction — the file's
//! write lock — with the claim's row in it, and a registry of the keys in
//! flight in this process, so that their duplicates are answered at once
//! instead of waiting for the lock.

use std::{
    collections::HashSet,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use sqlx::SqlitePool;
use tokio::sync::OwnedMutexGuard;

use super::{Sqlite, SqliteTx, statements};
use crate::{
    fingerprint::Fingerprint,
    lock::lock,
    store::{
        Forgotten, StorageKey, StoreError,
        sql::{
            base::now_ms,
            dialect::{Args, Engine, Stmt},
            tx::SqlTx,
            tx_engine::{self, ClaimRequest, Expiry, Probe, Seam, TxClaim, TxEngine},
        },
    },
};

/// What the transactional store keeps: its statements, and the keys this
/// process has claimed and not yet settled.
// Public only as the engine's associated type: nameable by no one.
#[allow(unreachable_pub)]
pub struct TxState {
    complete: Stmt,
    complete_later: Stmt,
    in_flight: Arc<Mutex<HashSet<StorageKey>>>,
}

impl std::fmt::Debug for TxState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TxState").finish_non_exhaustive()
    }
}

impl TxState {
    pub(super) fn new(table: &str) -> Self {
        Self {
            complete: statements::tx_complete(table),
            complete_later: statements::tx_complete_later(table),
            in_flight: Arc::default(),
        }
    }

    pub(super) fn in_flight(&self, key: &StorageKey) -> bool {
        lock(&self.in_flight).contains(key)
    }
}

/// Held with a claim's transaction, given up with it: this process's turn
/// to write, and the key's place among its keys in flight.
#[allow(unreachable_pub)]
pub struct Held {
    _turn: OwnedMutexGuard<()>,
    _registered: Registered,
}

impl std::fmt::Debug for Held {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Held").finish_non_exhaustive()
    }
}

/// A key's place among the keys this process has in flight, given up when
/// dropped (with the transaction that holds the claim).
struct Registered {
    in_flight: Arc<Mutex<HashSet<StorageKey>>>,
    key: StorageKey,
}

impl Registered {
    /// `None` when the key is already in flight in this process.
    fn enter(in_flight: &Arc<Mutex<HashSet<StorageKey>>>, key: &StorageKey) -> Option<Self> {
        lock(in_flight).insert(key.clone()).then(|| Self {
            in_flight: in_flight.clone(),
            key: key.clone(),
        })
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        lock(&self.in_flight).remove(&self.key);
    }
}

/// Takes this process's turn to write (waiting up to `wait`, or as long as
/// it takes), then the database's write lock (waiting for a writer in
/// another process as SQLite does: its busy timeout, the command timeout),
/// and inserts the claim's row: the transaction holding it, or `None` when
/// a live row holds the key.
async fn insert_claim(
    seam: &Seam<Sqlite>,
    registered: Registered,
    key: &StorageKey,
    fingerprint: &Fingerprint,
    lifetime: i64,
    wait: Option<Duration>,
) -> Result<Option<SqliteTx>, StoreError> {
    let turn = seam.engine().turn(wait).await?;
    // The transaction's bound counts from its turn, not from the wait.
    let began = Instant::now();
    let mut connection = seam.connection().await?;
    let now = now_ms();
    let claim = statements::tx_claim(
        seam.table(),
        key.as_str(),
        fingerprint.as_bytes(),
        now,
        now.saturating_add(lifetime),
    );
    let held = Held {
        _turn: turn,
        _registered: registered,
    };
    let claimed =
        sqlx::Executor::fetch_optional(&mut *connection, sqlx::raw_sql(sqlx::AssertSqlSafe(claim)))
            .await;
    // From here on, dropped unfinished, it closes its connection.
    let mut tx = SqlTx::begun(connection, held, began);
    match claimed {
        Ok(Some(_)) => Ok(Some(tx)),
        Ok(None) => {
            // Rolled back (or, failing that, closed).
            let _ = tx.end("ROLLBACK").await;
            Ok(None)
        }
        // Whether `BEGIN` ran is not known: the connection is closed.
        Err(error) => Err(seam.error(error)),
    }
}

/// Takes the file's write lock (`BEGIN IMMEDIATE`) without waiting, and
/// gives it back at once: whether another process holds it.
async fn try_the_write_lock(seam: &Seam<Sqlite>) -> Result<Probe, StoreError> {
    let timeout = seam.timeout();
    let _turn = seam.engine().turn(Some(timeout)).await?;
    let mut connection = seam.connection().await?;
    let began = Sqlite::raw(&mut connection, "PRAGMA busy_timeout = 0; BEGIN IMMEDIATE").await;
    let restore = format!("PRAGMA busy_timeout = {}", timeout.as_millis());
    let end = match &began {
        Ok(()) => format!("ROLLBACK; {restore}"),
        Err(_) => restore,
    };
    if Sqlite::raw(&mut connection, &end).await.is_err() {
        connection.close_on_drop();
    }
    match began {
        Ok(()) => Ok(Probe::Free),
        Err(error) if Sqlite::classify(&error) == super::ErrorClass::Busy => Ok(Probe::InFlight),
        Err(error) => Probe::failed(seam, error),
    }
}

impl TxEngine for Sqlite {
    async fn tx_state(
        _: &SqlitePool,
        _: &Self,
        table: &str,
        _: Duration,
    ) -> Result<TxState, StoreError> {
        Ok(TxState::new(table))
    }

    async fn tx_claim(
        seam: &Seam<Self>,
        request: &ClaimRequest<'_>,
    ) -> Result<TxClaim<Self>, StoreError> {
        let key = request.key;
        // A replay (or a mismatch) needs no write lock, and no place in the
        // registry: concurrent replays of one key all replay.
        if seam.state.in_flight(key) {
            return Ok(TxClaim::InFlight);
        }
        if let Some(row) = seam.live_row(key).await? {
            return Ok(TxClaim::Found(row));
        }
        let Some(registered) = Registered::enter(&seam.state.in_flight, key) else {
            return Ok(TxClaim::InFlight);
        };
        // On a task of its own, which makes the transaction whole (connection,
        // turn, registry place) before it returns it: a caller that stops
        // waiting halfway must not leave a connection in the pool inside the
        // transaction. A transaction nobody took closes its connection when
        // dropped, which rolls it back.
        let claim = tokio::spawn({
            let seam = seam.clone();
            let (key, fingerprint) = (key.clone(), *request.fingerprint);
            let lifetime = request.lifetime_ms;
            let wait = (!request.in_line).then_some(seam.timeout());
            async move { insert_claim(&seam, registered, &key, &fingerprint, lifetime, wait).await }
        });
        match claim
            .await
            .map_err(|e| StoreError::Unavailable(e.into()))??
        {
            Some(tx) => Ok(TxClaim::Acquired(tx)),
            // Committed by another process since the first look.
            None => Ok(seam
                .live_row(key)
                .await?
                .map_or(TxClaim::InFlight, TxClaim::Found)),
        }
    }

    async fn tx_complete(
        seam: &Seam<Self>,
        tx: &mut SqliteTx,
        key: &StorageKey,
        record: Vec<u8>,
        expiry: Expiry,
    ) -> Result<(), StoreError> {
        // Retention counts from now, the end of the handler: a kept expiry
        // changes no index.
        let (complete, ms) = match expiry {
            Expiry::Kept => (&seam.state.complete, 0),
            Expiry::Retention(ms) => (&seam.state.complete_later, ms),
        };
        let args = Args {
            key: key.as_str(),
            record: &record,
            now: now_ms(),
            ms,
            ..Args::default()
        };
        let written = match Sqlite::execute(&mut **tx, complete, &args).await {
            Ok(written) => written,
            Err(error) => {
                tx.close_on_drop();
                return Err(seam.error(error));
            }
        };
        if written != 1 {
            // The claim's row is gone (the handler deleted it): committing now
            // would keep the handler's writes without their record.
            tx.close_on_drop();
            return Err(StoreError::Refused(
                "the claim's row is no longer in the transaction".into(),
            ));
        }
        // A COMMIT that fails (a full disk) closes the connection: SQLite may
        // have rolled the transaction back on its own, and a connection that
        // believes itself inside one must never serve another request.
        tx.commit_with("COMMIT").await.map_err(|e| seam.error(e))
    }

    /// Whether a claim is in flight for `key`: in this process (the registry),
    /// or in another one — a writer there holds the file's write lock, and its
    /// uncommitted row is invisible, so that is all that can be known of it.
    /// The lock is tried without waiting: a writer that holds it now may be
    /// this key's, whatever it commits a moment later.
    async fn tx_in_flight(seam: &Seam<Self>, key: &StorageKey) -> Result<Probe, StoreError> {
        if seam.state.in_flight(key) {
            return Ok(Probe::InFlight);
        }
        // On a task of its own: a caller that stops waiting must not leave the
        // connection inside the transaction.
        let seam = seam.clone();
        tokio::spawn(async move { try_the_write_lock(&seam).await })
            .await
            .map_err(|e| StoreError::Unavailable(e.into()))?
    }

    /// Forgets a committed record, unless a claim of the key is in flight in
    /// this process (the registry, answered at once) — then as every engine
    /// does (see `TxEngine::tx_forget`): the record read first, and only what
    /// was read deleted.
    async fn tx_forget(seam: &Seam<Self>, key: &StorageKey) -> Result<Forgotten, StoreError> {
        if seam.state.in_flight(key) {
            return Ok(Forgotten::InFlight);
        }
        tx_engine::forget(seam, key).await
    }
}
