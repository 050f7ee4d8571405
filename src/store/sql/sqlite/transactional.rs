//! SQLite's transactional claim: an `IMMEDIATE` transaction — the file's
//! write lock — with the claim's row in it, and a registry of the keys in
//! flight in this process, so that their duplicates are answered at once
//! instead of waiting for the lock. A batch takes the lock with its first
//! key's claim, each key in a savepoint.

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
            tx_engine::{
                self, ClaimRequest, End, Expiry, InBatch, Probe, Seam, TxClaim, TxEngine, savepoint,
            },
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
/// to write, and the key's place among its keys in flight — a batch's
/// keys' places, from their claims to its end.
#[allow(unreachable_pub)]
pub struct Held {
    /// `None` in a batch until its first key is claimed: the transaction
    /// has not begun.
    turn: Option<OwnedMutexGuard<()>>,
    /// The request's key; a batch's key claimed last, until kept or undone.
    open: Option<Registered>,
    /// A batch's keys kept.
    kept: Vec<Registered>,
}

impl Held {
    fn batch() -> Self {
        Self {
            turn: None,
            open: None,
            kept: Vec::new(),
        }
    }

    /// The batch's open key kept: registered until the batch ends.
    pub(super) fn kept(&mut self) {
        self.kept.extend(self.open.take());
    }

    /// The batch's open key undone: no longer in flight.
    pub(super) fn undone(&mut self) {
        self.open = None;
    }
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
        "BEGIN IMMEDIATE; ",
        seam.table(),
        key.as_str(),
        fingerprint.as_bytes(),
        now,
        now.saturating_add(lifetime),
    );
    let held = Held {
        turn: Some(turn),
        open: Some(registered),
        kept: Vec::new(),
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

/// Writes the record into the claim's row in `tx`, its expiry as told. A
/// failure marks the connection to be closed: nothing commits. So does a
/// row that is gone (the handler deleted it): committing would keep the
/// handler's writes without their record.
async fn write_record(
    seam: &Seam<Sqlite>,
    tx: &mut SqliteTx,
    key: &StorageKey,
    record: &[u8],
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
        record,
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
        tx.close_on_drop();
        return Err(StoreError::Refused(
            "the claim's row is no longer in the transaction".into(),
        ));
    }
    Ok(())
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
        write_record(seam, tx, key, &record, expiry).await?;
        // A COMMIT that fails (a full disk) closes the connection: SQLite may
        // have rolled the transaction back on its own, and a connection that
        // believes itself inside one must never serve another request.
        tx.commit_with("COMMIT").await.map_err(|e| seam.error(e))
    }

    /// A connection, the transaction not begun: a batch whose keys are all
    /// found takes no write lock.
    async fn batch_begin(seam: &Seam<Self>, _: Duration) -> Result<SqliteTx, StoreError> {
        Ok(SqlTx::begun(
            seam.connection().await?,
            Held::batch(),
            Instant::now(),
        ))
    }

    /// Answered as a request's claim is — the registry, then (until the
    /// batch holds the write lock) the committed row — and otherwise claimed
    /// in a savepoint, the key registered for the batch. The batch's first
    /// claim takes this process's turn and begins its transaction. A key the
    /// batch itself holds is in flight: answered once the batch has
    /// committed.
    async fn batch_claim(
        seam: &Seam<Self>,
        tx: &mut SqliteTx,
        request: &ClaimRequest<'_>,
    ) -> Result<InBatch, StoreError> {
        let key = request.key;
        if seam.state.in_flight(key) {
            return Ok(InBatch::InFlight);
        }
        let began = tx.holding().turn.is_some();
        // Before the batch holds the write lock, a committed record is read
        // without it; after, the claim's insert tells.
        if !began && let Some(row) = seam.live_row(key).await? {
            return Ok(InBatch::Found(row));
        }
        let Some(registered) = Registered::enter(&seam.state.in_flight, key) else {
            return Ok(InBatch::InFlight);
        };
        let begin = if began {
            ""
        } else {
            tx.holding().turn = Some(seam.engine().turn(Some(seam.timeout())).await?);
            "BEGIN IMMEDIATE; "
        };
        let now = now_ms();
        let claim = statements::tx_claim(
            &format!("{begin}{}", savepoint::OPEN),
            seam.table(),
            key.as_str(),
            request.fingerprint.as_bytes(),
            now,
            now.saturating_add(request.lifetime_ms),
        );
        let claim = tx.after_ahead(&claim);
        let on: &mut sqlx::SqliteConnection = tx;
        match sqlx::Executor::fetch_optional(on, sqlx::raw_sql(sqlx::AssertSqlSafe(claim))).await {
            Ok(Some(_)) => {
                tx.holding().open = Some(registered);
                Ok(InBatch::Acquired)
            }
            // A live row holds the key, committed: the batch's own keys are
            // in the registry, and another writer's rows are committed
            // before the batch holds the write lock.
            Ok(None) => {
                tx.undone(savepoint::UNDO);
                Ok(seam
                    .live_row(key)
                    .await?
                    .map_or(InBatch::InFlight, InBatch::Found))
            }
            Err(error) => Err(seam.error(error)),
        }
    }

    /// The record written at once (a row gone is refused, as a request's
    /// completion is), its savepoint released ahead of the next statement.
    async fn batch_complete(
        seam: &Seam<Self>,
        tx: &mut SqliteTx,
        key: &StorageKey,
        record: Vec<u8>,
        expiry: Expiry,
    ) -> Result<(), StoreError> {
        let ahead = tx.after_ahead("");
        if !ahead.is_empty() {
            Sqlite::raw(&mut **tx, &ahead)
                .await
                .map_err(|e| seam.error(e))?;
        }
        write_record(seam, tx, key, &record, expiry).await?;
        tx.send_ahead(savepoint::KEEP);
        Ok(())
    }

    /// A batch that claimed no key began no transaction: its connection
    /// goes back to the pool as it is.
    async fn tx_end(seam: &Seam<Self>, mut tx: SqliteTx, end: End) -> Result<(), StoreError> {
        if tx.holding().turn.is_none() {
            drop(tx.ended());
            return Ok(());
        }
        tx_engine::end(seam, tx, end).await
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
