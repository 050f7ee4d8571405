//! A claim whose answer came too late may still be applied: a stalled server
//! runs what it queued once it wakes, a blocked statement once unblocked.
//! Nobody holds such a claim, and left alone it would keep its key in flight
//! for a whole lease, answering every retry `409`.

use std::{
    future::Future,
    time::{Duration, Instant},
};

use super::{Claim, StorageKey, Store, StoreError};

/// Awaits `claim` until `timeout` after `started`. Past that the request gets
/// [`StoreError::Timeout`], and the claim goes on in the background (for at
/// most `lease`: by then it would have expired anyway); if it turns out to
/// have been acquired, it is released.
pub(crate) async fn within<S: Store>(
    store: &S,
    key: &StorageKey,
    started: Instant,
    timeout: Duration,
    lease: Duration,
    claim: impl Future<Output = Result<Claim, StoreError>> + Send + 'static,
) -> Result<Claim, StoreError> {
    let mut claim = Box::pin(claim);
    let left = timeout.saturating_sub(started.elapsed());
    match tokio::time::timeout(left, &mut claim).await {
        Ok(answer) => answer,
        Err(_) => {
            let store = store.clone();
            let key = key.clone();
            tokio::spawn(async move {
                if let Ok(Ok(Claim::Acquired(token))) = tokio::time::timeout(lease, claim).await {
                    let released = store.release(&key, token).await;
                    tracing::warn!(%key, ?released, "idempotency: a claim that timed out was applied late; released");
                }
            });
            Err(StoreError::Timeout(timeout))
        }
    }
}
