//! Settling a held claim with its outcome: the completion, what became of
//! it, and for a lease the retries that outlast a short store outage.

use std::{sync::Arc, time::Duration};

use tokio::time::{Instant, sleep};

use super::{Hold, hold::heartbeat};
use crate::{
    fingerprint::Fingerprint,
    observe,
    record::CompletedRecord,
    store::{FailedCompletion, LeaseToken, StorageKey, Store, StoreError},
};

/// What became of a completion: decided here, once, for both doors.
pub(crate) enum Finished {
    /// Stored; retries replay it.
    Stored,
    /// The lease was lost first: the outcome went out unstored, and a retry
    /// may execute again (logged, counted).
    Lost,
    /// Storing failed; it is retried in the background while the lease
    /// holds.
    Pending,
    /// The claim is a transaction, and committing the work's writes with the
    /// record did not happen (or its outcome is unknown): the work took no
    /// effect, and its result must not be reported as done.
    NotCommitted(StoreError),
}

impl<St: Store> Hold<St> {
    /// Stores the outcome and decides what became of it (see [`Finished`]).
    /// Both doors run this detached from their caller, so it is not
    /// cancelled halfway.
    pub(crate) async fn finish(
        mut self,
        record: Arc<CompletedRecord>,
        retention: Duration,
    ) -> Finished {
        // From here on the claim ends in a completion (fenced, so a release
        // racing it could only delete what it stores).
        self.held = false;
        let Some(mut granted) = self.granted.take() else {
            // Lent out and never given back: nothing to commit with.
            return Finished::NotCommitted(StoreError::TransactionHeld);
        };
        let complete = self.store.complete(
            &self.key,
            &mut granted,
            &self.fingerprint,
            record.clone(),
            retention,
        );
        let stored = observe::store_call("complete", complete).await;
        if self.failure == FailedCompletion::NothingCommitted {
            return match stored {
                Ok(true) => Finished::Stored,
                Ok(false) => Finished::NotCommitted(StoreError::Unavailable(
                    "the claim was lost before the commit".into(),
                )),
                Err(error) => Finished::NotCommitted(error),
            };
        }
        match (stored, self.token) {
            (Ok(true), _) => Finished::Stored,
            (Ok(false), _) => {
                observe::completion_lost();
                tracing::error!(
                    key = %self.key,
                    "idempotency: lease lost before completion; the outcome went out unstored, a retry may execute again"
                );
                Finished::Lost
            }
            (Err(error), Some(token)) => {
                tracing::warn!(key = %self.key, %error, "idempotency: completion failed; retrying in the background");
                let retry = Retry {
                    store: self.store.clone(),
                    key: self.key.clone(),
                    fingerprint: self.fingerprint,
                    lease: self.lease,
                    token,
                    granted,
                    confirmed: self.confirmed,
                };
                tokio::spawn(retry.run(record, retention));
                Finished::Pending
            }
            (Err(error), None) => {
                // No lease to retry it under: the claim ends at its bound.
                observe::completion_lost();
                tracing::error!(
                    key = %self.key, %error,
                    "idempotency: completion failed and the claim is no lease to retry it under; the outcome went out unstored, a retry may execute again"
                );
                Finished::Lost
            }
        }
    }
}

/// A lease's completion that failed, retried in the background.
struct Retry<St: Store> {
    store: St,
    key: StorageKey,
    fingerprint: Fingerprint,
    lease: Duration,
    token: LeaseToken,
    granted: St::Granted,
    /// When the lease was last renewed (see `Hold::confirmed`).
    confirmed: Instant,
}

impl<St: Store> Retry<St> {
    /// Keeps retrying the completion with backoff while the heartbeat holds
    /// the lease, so a short store outage does not turn into a second
    /// execution. Bounded: after one lease of failures it stops, the claim
    /// expires within one more lease, and the outcome is logged once.
    async fn run(mut self, record: Arc<CompletedRecord>, retention: Duration) {
        let deadline = Instant::now() + self.lease;
        let Self {
            store,
            key,
            fingerprint,
            lease,
            token,
            granted,
            confirmed,
        } = &mut self;
        let retry = async {
            let mut backoff = Duration::from_millis(50);
            loop {
                sleep(backoff).await;
                let complete = store.complete(key, granted, fingerprint, record.clone(), retention);
                match observe::store_call("complete", complete).await {
                    Ok(stored) => return stored,
                    Err(error) => {
                        tracing::debug!(%key, %error, "idempotency: completion retry failed")
                    }
                }
                backoff = (backoff * 2).min(*lease / 3);
            }
        };
        let stored = tokio::select! {
            biased;
            stored = tokio::time::timeout_at(deadline, retry) => Some(stored.ok()),
            () = heartbeat(&*store, key, *token, *lease, confirmed) => None,
        };
        // The lease is gone: another claimed the key, or a completion that
        // timed out was applied after all. One last try tells them apart.
        let stored = match stored {
            Some(stored) => stored,
            None => {
                let complete = store.complete(key, granted, fingerprint, record.clone(), retention);
                Some(matches!(
                    observe::store_call("complete", complete).await,
                    Ok(true)
                ))
            }
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
                tracing::info!(%key, "idempotency: completion stored after retrying")
            }
            Some(false) => tracing::error!(
                %key,
                "idempotency: lease lost before the completion could be stored; a retry may execute again"
            ),
            None => tracing::error!(
                %key,
                lease = ?*lease,
                "idempotency: completion could not be stored within one lease; the claim expires and a retry may execute again"
            ),
        }
    }
}
