//! A held claim: heartbeats, release and completion, all fenced by the
//! lease token.

use std::{future::Future, pin::Pin, sync::Arc, time::Duration};

use tokio::time::{Instant, sleep};

use crate::{
    fingerprint::Fingerprint,
    observe,
    record::CompletedRecord,
    store::{LeaseToken, StorageKey, Store, StoreError},
};

/// What became of a completion: decided here, once, for HTTP and messages.
pub(crate) enum Finished {
    /// Stored; retries replay it.
    Stored,
    /// The lease was lost first: the outcome went out unstored, and a retry
    /// may execute again (logged, counted).
    Lost,
    /// Storing failed; it is retried in the background while the lease
    /// holds.
    Pending,
    /// The store commits the work's writes with the record, and that did not
    /// happen (or its outcome is unknown): the work took no effect, and its
    /// result must not be reported as done.
    NotCommitted(StoreError),
}

/// A granted claim, held: dropped before it is released or finished (its
/// future cancelled by a timeout or a shutdown), it releases the key in the
/// background, so a cancelled caller never leaves the key held beyond the
/// moment it let go.
pub(crate) struct Lease<St: Store> {
    store: St,
    key: StorageKey,
    token: LeaseToken,
    fingerprint: Fingerprint,
    duration: Duration,
    /// Still to be released if dropped.
    held: bool,
}

impl<St: Store> Lease<St> {
    pub(crate) fn new(
        store: St,
        key: StorageKey,
        token: LeaseToken,
        fingerprint: Fingerprint,
        duration: Duration,
    ) -> Self {
        Self {
            store,
            key,
            token,
            fingerprint,
            duration,
            held: true,
        }
    }

    pub(crate) fn key(&self) -> &StorageKey {
        &self.key
    }

    /// Extends the lease every third of its duration; returns only once the
    /// lease is lost (re-claimed by another, or unconfirmed for a whole lease
    /// because the store is unreachable).
    async fn heartbeat(&self) {
        let mut confirmed_at = Instant::now();
        // A timer entry is large; boxed, it keeps every request's future small.
        let mut tick = Box::pin(sleep(self.duration / 3));
        loop {
            tick.as_mut().await;
            tick.as_mut().reset(Instant::now() + self.duration / 3);
            // Boxed: a store's future can be large, and this one is rare, so
            // it should not weigh on every request's future.
            let extend = self.store.extend(&self.key, self.token, self.duration);
            match Box::pin(observe::store_call("extend", extend)).await {
                Ok(true) => confirmed_at = Instant::now(),
                Ok(false) => return,
                Err(error) => {
                    tracing::warn!(key = %self.key, %error, "idempotency: lease extension failed");
                    if confirmed_at.elapsed() >= self.duration {
                        return;
                    }
                }
            }
        }
    }

    /// Runs `work` to completion while the heartbeat keeps the claim. It takes
    /// the work already pinned, so this future holds a pointer, not a second
    /// copy of it.
    pub(crate) async fn hold_while<F: Future>(&self, mut work: Pin<&mut F>) -> F::Output {
        tokio::select! {
            biased;
            output = work.as_mut() => output,
            () = self.heartbeat() => {
                tracing::error!(
                    key = %self.key,
                    "idempotency: lease lost while the handler runs; its response will not be stored and a retry may execute again"
                );
                work.await
            }
        }
    }

    /// Deletes the claim so the key may be retried. A failure only delays the
    /// retry until the lease expires, so it is logged, not retried.
    pub(crate) async fn release(mut self) {
        self.held = false;
        // Boxed, like `extend`: rare, and a store's future can be large.
        let release = self.store.release(&self.key, self.token);
        match Box::pin(observe::store_call("release", release)).await {
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

    /// One attempt to store the completed record.
    pub(crate) async fn complete(
        &self,
        record: Arc<CompletedRecord>,
        retention: Duration,
    ) -> Result<bool, StoreError> {
        let complete =
            self.store
                .complete(&self.key, self.token, &self.fingerprint, record, retention);
        observe::store_call("complete", complete).await
    }

    /// Stores the outcome and decides what became of it (see [`Finished`]).
    pub(crate) async fn finish(
        mut self,
        record: Arc<CompletedRecord>,
        retention: Duration,
    ) -> Finished {
        // From here on the claim ends in a completion (fenced, so a release
        // racing it could only delete what it stores): both doors run this
        // detached, so it is not cancelled halfway.
        self.held = false;
        let stored = self.complete(record.clone(), retention).await;
        if self.store.commits_effects() {
            return match stored {
                Ok(true) => Finished::Stored,
                Ok(false) => Finished::NotCommitted(StoreError::Unavailable(
                    "the claim was lost before the commit".into(),
                )),
                Err(error) => Finished::NotCommitted(error),
            };
        }
        match stored {
            Ok(true) => Finished::Stored,
            Ok(false) => {
                observe::completion_lost();
                tracing::error!(
                    key = %self.key,
                    "idempotency: lease lost before completion; the outcome went out unstored, a retry may execute again"
                );
                Finished::Lost
            }
            Err(error) => {
                tracing::warn!(key = %self.key, %error, "idempotency: completion failed; retrying in the background");
                tokio::spawn(async move { self.complete_in_background(record, retention).await });
                Finished::Pending
            }
        }
    }

    /// Keeps retrying the completion with backoff while the heartbeat holds
    /// the lease, so a short store outage does not turn into a second
    /// execution. Bounded: after one lease of failures it stops, the claim
    /// expires within one more lease, and the outcome is logged once.
    pub(crate) async fn complete_in_background(
        &self,
        record: Arc<CompletedRecord>,
        retention: Duration,
    ) {
        let deadline = Instant::now() + self.duration;
        let retry = async {
            let mut backoff = Duration::from_millis(50);
            loop {
                sleep(backoff).await;
                match self.complete(record.clone(), retention).await {
                    Ok(stored) => return stored,
                    Err(error) => {
                        tracing::debug!(key = %self.key, %error, "idempotency: completion retry failed")
                    }
                }
                backoff = (backoff * 2).min(self.duration / 3);
            }
        };
        let stored = tokio::select! {
            biased;
            stored = tokio::time::timeout_at(deadline, retry) => stored.ok(),
            () = self.heartbeat() => Some(false),
        };
        observe::completion_retried(match stored {
            Some(true) => "stored",
            Some(false) => "lost",
            None => "gave_up",
        });
        if stored != Some(true) {
            observe::completion_lost();
        }
        match stored {
            Some(true) => {
                tracing::info!(key = %self.key, "idempotency: completion stored after retrying")
            }
            Some(false) => tracing::error!(
                key = %self.key,
                "idempotency: lease lost before the completion could be stored; a retry may execute again"
            ),
            None => tracing::error!(
                key = %self.key,
                lease = ?self.duration,
                "idempotency: completion could not be stored within one lease; the claim expires and a retry may execute again"
            ),
        }
    }
}

impl<St: Store> Drop for Lease<St> {
    fn drop(&mut self) {
        if !self.held {
            return;
        }
        let (store, key, token) = (self.store.clone(), self.key.clone(), self.token);
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(async move {
                    let released = store.release(&key, token).await;
                    tracing::debug!(%key, ?released, "idempotency: a claim dropped unfinished was released");
                });
            }
            Err(_) => tracing::warn!(
                key = %self.key,
                "idempotency: a claim was dropped outside a Tokio runtime; the key stays in flight until its lease expires"
            ),
        }
    }
}
