//! A claim whose answer came too late may still be applied: a stalled server
//! runs what it queued once it wakes, a blocked statement once unblocked.
//! Nobody holds such a claim, and left alone it would keep its key in flight
//! for a whole lease, answering every retry `409`.

use std::{
    future::Future,
    time::{Duration, Instant},
};

use super::{Claim, StorageKey, Store, StoreError};

/// Awaits `claim` until `timeout` after `started` (when the store began
/// working on it, e.g. before waiting for a connection). Past that the
/// caller gets [`StoreError::Timeout`], and the claim goes on in the
/// background for at most `lease` (by then a leased claim would have
/// expired anyway); if it turns out to have been acquired, it is released
/// with [`Store::release`].
///
/// For stores whose claims are answered over a network, where a reply that
/// did not arrive in time may still be applied.
///
/// # Examples
///
/// ```
/// # async fn demo() {
/// use std::time::{Duration, Instant};
/// use tower_idempotency::{Fingerprint, IdempotencyKey, MemoryStore};
/// use tower_idempotency::store::{StorageKey, Store, claim_within};
///
/// let store = MemoryStore::new();
/// let key = StorageKey::new("acct_1", &IdempotencyKey::new("order-1").unwrap());
/// let fingerprint = Fingerprint::from_bytes([0; 32]);
/// let lease = Duration::from_secs(30);
/// let claim = {
///     let (store, key) = (store.clone(), key.clone());
///     async move { store.claim(&key, &fingerprint, lease).await }
/// };
/// let answer = claim_within(&store, &key, Instant::now(), Duration::from_secs(1), lease, claim).await;
/// assert!(answer.is_ok());
/// # }
/// ```
pub async fn claim_within<S: Store>(
    store: &S,
    key: &StorageKey,
    started: Instant,
    timeout: Duration,
    lease: Duration,
    claim: impl Future<Output = Result<Claim<S::Granted>, StoreError>> + Send + 'static,
) -> Result<Claim<S::Granted>, StoreError> {
    let mut pending = Pending {
        claim: Some(Box::pin(claim)),
        store: store.clone(),
        key: key.clone(),
        lease,
    };
    let left = timeout.saturating_sub(started.elapsed());
    let claim = pending.claim.as_mut().expect("set above");
    match tokio::time::timeout(left, claim).await {
        Ok(answer) => {
            pending.claim = None;
            answer
        }
        // `pending` goes on in the background as it drops.
        Err(_) => Err(StoreError::Timeout(timeout)),
    }
}

/// A claim nobody waits for any more — it timed out, or its caller was
/// dropped — finished in the background and released if it was acquired.
struct Pending<S: Store> {
    claim: Option<Answer<S::Granted>>,
    store: S,
    key: StorageKey,
    lease: Duration,
}

/// A claim's answer, to come.
type Answer<G> = std::pin::Pin<Box<dyn Future<Output = Result<Claim<G>, StoreError>> + Send>>;

impl<S: Store> Drop for Pending<S> {
    fn drop(&mut self) {
        let Some(claim) = self.claim.take() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (store, key, lease) = (self.store.clone(), self.key.clone(), self.lease);
        runtime.spawn(async move {
            if let Ok(Ok(Claim::Acquired(granted) | Claim::TakenOver { granted, .. })) =
                tokio::time::timeout(lease, claim).await
            {
                let released = store.release(&key, granted).await;
                tracing::warn!(%key, ?released, "idempotency: a claim that timed out (or whose caller gave up) was applied late; released");
            }
        });
    }
}
