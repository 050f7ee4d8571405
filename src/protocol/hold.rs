//! A granted claim, held while the work runs: heartbeats keep a lease; a
//! transaction needs nothing but to be handed to the work.

use std::{future::Future, pin::Pin, time::Duration};

use tokio::time::{Instant, sleep_until};

use super::{Attempt, Earlier};
use crate::{
    fingerprint::Fingerprint,
    observe,
    store::{FailedCompletion, Granted, Held, LeaseToken, StorageKey, Store, StoreError},
};

/// A granted claim, held. Dropped before it is released or finished (its
/// future cancelled by a timeout or a shutdown), it releases the key in the
/// background — a transaction rolls back — so a cancelled caller never
/// leaves the key held beyond the moment it let go.
pub(crate) struct Hold<St: Store> {
    pub(super) store: St,
    pub(super) key: StorageKey,
    pub(super) fingerprint: Fingerprint,
    pub(super) lease: Duration,
    /// `Some` when the claim is held as a lease: the heartbeat's token.
    pub(super) token: Option<LeaseToken>,
    /// Whether the work writes its effects with the claim.
    pub(super) lent: bool,
    /// What a failed completion means.
    pub(super) failure: FailedCompletion,
    /// `None` while lent out (to an HTTP handler), or once settled.
    pub(super) granted: Option<St::Granted>,
    /// Still to be released if dropped.
    pub(super) held: bool,
    /// When the lease was last known to be renewed: the claim's grant, then
    /// each confirmed extension's sending. Carried from the work's heartbeat
    /// to the completion's retries, so an extension cut short when the work
    /// ends is made up at once rather than a whole interval later.
    pub(super) confirmed: Instant,
    /// Which attempt of its key this is: told to the work.
    pub(super) earlier: Earlier,
}

impl<St: Store> Hold<St> {
    pub(super) fn new(
        store: St,
        key: StorageKey,
        granted: St::Granted,
        fingerprint: Fingerprint,
        lease: Duration,
        earlier: Earlier,
    ) -> Self {
        Self {
            store,
            key,
            fingerprint,
            lease,
            token: match granted.held() {
                Held::Lease(token) => Some(token),
                Held::ForItsLife => None,
            },
            lent: granted.lent_to_work(),
            failure: granted.failed_completion(),
            granted: Some(granted),
            held: true,
            confirmed: Instant::now(),
            earlier,
        }
    }

    /// Which attempt of its key the work is.
    pub(crate) fn attempt(&self) -> Attempt {
        Attempt::new(self.earlier, self.key.clone())
    }

    pub(crate) fn key(&self) -> &StorageKey {
        &self.key
    }

    /// Whether the work writes its effects with the claim (a transaction
    /// the record commits in).
    pub(crate) fn is_lent(&self) -> bool {
        self.lent
    }

    /// Lends the claim out, to a handler that cannot borrow it, when the
    /// work writes with it; [`give_back`](Self::give_back) returns it. A
    /// lease is not lent: the handler has nothing to do with it.
    pub(crate) fn lend_if_lent(&mut self) -> Option<St::Granted> {
        if self.lent { self.granted.take() } else { None }
    }

    pub(crate) fn give_back(&mut self, granted: St::Granted) {
        self.granted = Some(granted);
    }

    /// Runs `work` to completion while the heartbeat keeps a lease. It takes
    /// the work already pinned, so this future holds a pointer, not a second
    /// copy of it.
    pub(crate) async fn hold_while<F: Future>(&mut self, work: Pin<&mut F>) -> F::Output {
        let Self {
            store,
            key,
            token,
            lease,
            confirmed,
            ..
        } = self;
        keep(store, key, *token, *lease, confirmed, work).await
    }

    /// Runs `work` with the granted claim (the transaction, for a store that
    /// has one) while the heartbeat keeps a lease.
    pub(crate) async fn run<T>(&mut self, work: impl AsyncFnOnce(&mut St::Granted) -> T) -> T {
        let Self {
            store,
            key,
            token,
            lease,
            granted,
            confirmed,
            ..
        } = self;
        let granted = granted.as_mut().expect("held until settled");
        let work = std::pin::pin!(work(granted));
        keep(store, key, *token, *lease, confirmed, work).await
    }

    /// Gives the claim up so the key may be retried. A failure only delays
    /// the retry until the lease expires (or the transaction's connection is
    /// closed), so it is logged, not retried.
    pub(crate) async fn release(mut self) {
        self.held = false;
        let Some(granted) = self.granted.take() else {
            return;
        };
        // Boxed: rare, and a store's future can be large.
        let release = self.store.release(&self.key, granted);
        self.released(Box::pin(observe::store_call("release", release)).await);
    }

    /// Releases the claim without a record, keeping what the work wrote (a
    /// transaction commits): an answer the handler marked not to be
    /// replayed.
    pub(crate) async fn release_keeping_writes(mut self) {
        self.held = false;
        let Some(granted) = self.granted.take() else {
            return;
        };
        let release = self.store.release_keeping_writes(&self.key, granted);
        self.released(Box::pin(observe::store_call("release", release)).await);
    }

    fn released(&self, released: Result<bool, StoreError>) {
        match released {
            Ok(true) => {}
            Ok(false) => {
                tracing::warn!(key = %self.key, "idempotency: release refused, the lease was already lost")
            }
            Err(error) => tracing::warn!(
                key = %self.key, %error,
                "idempotency: release failed; the key stays in flight until its lease expires"
            ),
        }
    }
}

/// Runs `work` to completion; for a lease, extends it every third of its
/// duration meanwhile.
async fn keep<St: Store, F: Future>(
    store: &St,
    key: &StorageKey,
    token: Option<LeaseToken>,
    lease: Duration,
    confirmed: &mut Instant,
    mut work: Pin<&mut F>,
) -> F::Output {
    let Some(token) = token else {
        return work.await;
    };
    tokio::select! {
        biased;
        output = work.as_mut() => output,
        () = heartbeat(store, key, token, lease, confirmed) => {
            tracing::error!(
                %key,
                "idempotency: lease lost while the work runs; its outcome will not be stored and a retry may execute again"
            );
            work.await
        }
    }
}

/// Extends the lease a third of its duration after it was last
/// `confirmed` (at once if that is past: an extension cut short by the end
/// of the work is made up), then every third; returns only once the lease is
/// lost (re-claimed by another, or unconfirmed for a whole lease because the
/// store is unreachable).
pub(super) async fn heartbeat<St: Store>(
    store: &St,
    key: &StorageKey,
    token: LeaseToken,
    lease: Duration,
    confirmed: &mut Instant,
) {
    // A timer entry is large; boxed, it keeps every request's future small.
    let mut tick = Box::pin(sleep_until(*confirmed + lease / 3));
    loop {
        tick.as_mut().await;
        // The store renews the lease no earlier than this, so a confirmed
        // extension holds at least one lease from here.
        let sent = Instant::now();
        tick.as_mut().reset(sent + lease / 3);
        // Boxed: a store's future can be large, and this one is rare, so it
        // should not weigh on every request's future.
        let extend = store.extend(key, token, lease);
        match Box::pin(observe::store_call("extend", extend)).await {
            Ok(true) => *confirmed = sent,
            Ok(false) => return,
            Err(error) => {
                tracing::warn!(%key, %error, "idempotency: lease extension failed");
                if confirmed.elapsed() >= lease {
                    return;
                }
            }
        }
    }
}

impl<St: Store> Drop for Hold<St> {
    fn drop(&mut self) {
        if !self.held {
            return;
        }
        // Lent out and not given back: its holder's drop ends it (a
        // transaction rolls back when dropped).
        let Some(granted) = self.granted.take() else {
            return;
        };
        let (store, key) = (self.store.clone(), self.key.clone());
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(async move {
                    let released = store.release(&key, granted).await;
                    tracing::debug!(%key, ?released, "idempotency: a claim dropped unsettled was released");
                });
            }
            Err(_) => tracing::warn!(
                key = %self.key,
                "idempotency: a claim was dropped outside a Tokio runtime; the key stays in flight until its lease expires"
            ),
        }
    }
}
