//! Transactions that a claim opened and found nothing to do in (a replay, a
//! key in flight elsewhere). The next claim ends one with `ROLLBACK AND
//! CHAIN` in front of its own statement, instead of a round trip of its own;
//! a sweeper rolls back the ones no claim picked up within [`IDLE_FOR`].
//!
//! Only transactions that hold no row lock wait here: an idle transaction
//! in `READ COMMITTED` that wrote nothing holds no snapshot and no xid, so it
//! delays neither vacuum nor any claim. It does hold the table-level lock
//! its claim took on the records table (`ROW EXCLUSIVE`), so DDL on that
//! table waits for it (at most [`IDLE_FOR`]), and it keeps a pooled
//! connection out of the pool for that moment — which is why the stash is
//! small and only used while the pool has connections to spare.

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use sqlx::PgPool;

use super::PostgresTx as OpenTx;
use crate::lock::lock;

/// How long a transaction may wait for a claim to end it.
const IDLE_FOR: Duration = Duration::from_millis(200);

/// At most this many transactions wait (and never more than a quarter of
/// the pool).
const MAX_WAITING: usize = 8;

pub(crate) struct IdleTransactions {
    waiting: Mutex<Vec<(OpenTx, Instant)>>,
    capacity: usize,
    sweeping: AtomicBool,
    timeout: Duration,
}

impl IdleTransactions {
    pub(super) fn new(pool: &PgPool, timeout: Duration) -> Self {
        let pool_size = pool.options().get_max_connections() as usize;
        Self {
            waiting: Mutex::new(Vec::new()),
            capacity: MAX_WAITING.min(pool_size / 4),
            sweeping: AtomicBool::new(false),
            timeout,
        }
    }

    /// The most recently parked transaction, to be rolled back by the caller
    /// in front of its own statements.
    pub(super) fn take(&self) -> Option<OpenTx> {
        lock(&self.waiting).pop().map(|(tx, _)| tx)
    }

    /// Parks `tx` (which must hold no row lock) for the next claim, or rolls it
    /// back at once in the background when the stash is full or the pool has
    /// no connection to spare.
    pub(super) fn park(self: &Arc<Self>, tx: OpenTx, pool: &PgPool) {
        let rejected = {
            let mut waiting = lock(&self.waiting);
            if waiting.len() < self.capacity && pool.num_idle() > 0 {
                waiting.push((tx, Instant::now()));
                None
            } else {
                Some(tx)
            }
        };
        match rejected {
            Some(tx) => self.roll_back(tx),
            None => self.ensure_sweeper(),
        }
    }

    /// Rolls `tx` back in the background.
    pub(super) fn roll_back(&self, tx: OpenTx) {
        let timeout = self.timeout;
        tokio::spawn(async move {
            let mut tx = tx;
            // Timed out or failed: dropping `tx` closes its connection.
            if let Ok(Err(error)) = tokio::time::timeout(timeout, tx.end("ROLLBACK")).await {
                tracing::debug!(%error, "idempotency: rolling back an idle claim transaction");
            }
        });
    }

    /// One sweeper runs while anything is parked.
    fn ensure_sweeper(self: &Arc<Self>) {
        if self.sweeping.swap(true, Ordering::AcqRel) {
            return;
        }
        let this = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(IDLE_FOR).await;
                let Some(this) = this.upgrade() else { return };
                let stale: Vec<OpenTx> = {
                    let mut waiting = lock(&this.waiting);
                    let now = Instant::now();
                    let (stale, fresh) = std::mem::take(&mut *waiting)
                        .into_iter()
                        .partition(|(_, since)| now.duration_since(*since) >= IDLE_FOR);
                    *waiting = fresh;
                    stale.into_iter().map(|(tx, _)| tx).collect()
                };
                for tx in stale {
                    this.roll_back(tx);
                }
                // Stop when empty; a `park` racing with this sees `false` and
                // starts a new sweeper, or we see its entry and go on.
                if lock(&this.waiting).is_empty() {
                    this.sweeping.store(false, Ordering::Release);
                    if lock(&this.waiting).is_empty() || this.sweeping.swap(true, Ordering::AcqRel)
                    {
                        return;
                    }
                }
            }
        });
    }
}
