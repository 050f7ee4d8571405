//! Several deliveries settled in one transaction of the store, where the
//! store allows it ([`Store::BATCHES`]): each key claimed, worked and
//! recorded in a savepoint of its own — a key that fails is undone alone —
//! and one commit for them all. Nothing in a batch is answered before it
//! commits; if the commit fails, its executions are settled again one by
//! one (each executes again, or finds its record where the commit's
//! outcome was unknown).

use std::{panic::AssertUnwindSafe, sync::Arc};

use futures_util::FutureExt;
use serde::{Serialize, de::DeserializeOwned};
use tracing::Instrument;

use super::{
    Delivery, Disposition, ProcessError, ProcessOutcome, Settled, attempt,
    disposition::Verdict,
    processor::{delivery_span, granted, not_committed},
};
use crate::{
    fingerprint::PayloadFingerprint,
    message::IdempotencyProcessor,
    observe,
    protocol::{self, Attempt},
    store::{StorageKey, Store, StoreError},
};

/// A batch: the store's transaction, once a key needed it, and how many
/// executions wait for its commit.
pub(super) struct Batch<St: Store> {
    open: Option<St::Granted>,
    executed: usize,
    /// Its transaction was given up (a panic mid-work, a failed write):
    /// nothing in it commits.
    lost: bool,
}

impl<St: Store> Batch<St> {
    pub(super) fn new() -> Self {
        Self {
            open: None,
            executed: 0,
            lost: false,
        }
    }

    /// Whether a key's claim or work is in it, to be committed or undone.
    pub(super) fn is_empty(&self) -> bool {
        self.open.is_none() && !self.lost
    }

    /// How many executions wait for its commit.
    pub(super) fn executed(&self) -> usize {
        self.executed
    }

    /// Gives the transaction up: dropped, it rolls back.
    fn lose(&mut self) {
        self.open = None;
        self.lost = true;
    }
}

impl<St: Store, F: PayloadFingerprint> IdempotencyProcessor<St, F> {
    /// Settles `delivery` inside `batch` in one attempt, where that decides
    /// it: its disposition, and the span its answer is recorded on — an
    /// execution is acknowledged only once the batch commits
    /// ([`commit_batch`](Self::commit_batch)). `None` where it would be
    /// tried again (in flight elsewhere, the store unavailable, a work
    /// error that may pass): its key is undone in the batch, to be settled
    /// on its own.
    pub(super) async fn settle_in_batch<T, E, W, L>(
        &self,
        batch: &mut Batch<St>,
        delivery: &Delivery<'_, L>,
        work: W,
        passing: impl Fn(&E) -> bool,
    ) -> Option<(Settled<T, E>, tracing::Span)>
    where
        T: Serialize + DeserializeOwned,
        E: std::fmt::Display,
        W: AsyncFnOnce(&mut St::Granted) -> Result<T, E>,
    {
        let span = delivery_span(delivery, &self.shown(delivery.key));
        let outcome = self
            .attempted(delivery.key, |key| {
                self.process_in_batch(batch, key, delivery.payload, work)
            })
            .instrument(span.clone())
            .await;
        let disposition = match Verdict::of(&outcome, self.budget.backoff(1), passing) {
            Verdict::Done => Disposition::Ack,
            Verdict::Never(reason) => Disposition::DeadLetter(reason),
            Verdict::Again { .. } => return None,
        };
        Some((Settled::new(disposition, outcome, 1), span))
    }

    /// One attempt at `key` inside `batch`, answered as
    /// [`process`](Self::process) answers.
    async fn process_in_batch<T, E, W>(
        &self,
        batch: &mut Batch<St>,
        key: StorageKey,
        payload: &[u8],
        work: W,
    ) -> Result<ProcessOutcome<T>, ProcessError<E>>
    where
        T: Serialize + DeserializeOwned,
        W: AsyncFnOnce(&mut St::Granted) -> Result<T, E>,
    {
        if batch.lost {
            return Err(ProcessError::Unavailable(lost()));
        }
        let fingerprint = self.fingerprint.fingerprint_payload(payload);
        let tx = match &mut batch.open {
            Some(tx) => tx,
            None => {
                let begun = observe::store_call("begin", self.store.begin_batch()).await;
                batch.open.insert(begun.map_err(ProcessError::Unavailable)?)
            }
        };
        let claimed = protocol::claim_in_batch(
            &self.store,
            tx,
            &key,
            &fingerprint,
            protocol::DEFAULT_IN_FLIGHT_HINT,
        );
        let earlier = match granted(claimed.await) {
            Ok(earlier) => earlier,
            Err(answered) => {
                if answered.is_err() {
                    // The store failed: the batch's state is not known.
                    batch.lose();
                }
                return answered;
            }
        };
        let attempt = Attempt::new(earlier, key.clone());
        let outcome = attempt::told(attempt, AssertUnwindSafe(work(tx)).catch_unwind()).await;
        let value = match outcome {
            Ok(Ok(value)) => value,
            Ok(Err(error)) => {
                if let Err(failed) = self.store.release_in_batch(tx, &key).await {
                    tracing::warn!(%key, error = %failed, "idempotency: a key could not be undone in its batch; the batch rolls back");
                    batch.lose();
                }
                return Err(ProcessError::Work(error));
            }
            Err(_panic) => {
                // A statement may have been left halfway: the whole batch
                // rolls back, and its executions are settled again.
                tracing::error!(%key, "idempotency: message work panicked; its batch rolled back");
                batch.lose();
                return Err(ProcessError::Panicked);
            }
        };
        let record = Arc::new(self.record_of(&key, &value));
        let completed =
            self.store
                .complete_in_batch(tx, &key, &fingerprint, record, self.retention);
        match observe::store_call("complete", completed).await {
            Ok(()) => {
                batch.executed += 1;
                Ok(ProcessOutcome::Executed(value))
            }
            Err(error) => {
                batch.lose();
                Err(not_committed(error))
            }
        }
    }

    /// Commits `batch`; an error means none of its executions committed,
    /// or that whether they did is unknown. Detached, as a completion is:
    /// a caller that stops waiting does not cancel it.
    pub(super) async fn commit_batch(&self, batch: Batch<St>) -> Result<(), StoreError> {
        if batch.lost {
            return Err(lost());
        }
        let Some(tx) = batch.open else {
            return Ok(());
        };
        let store = self.store.clone();
        let commit = async move { observe::store_call("commit", store.commit_batch(tx)).await };
        match tokio::spawn(commit).await {
            Ok(committed) => committed,
            Err(panicked) => Err(StoreError::Unavailable(panicked.into())),
        }
    }
}

fn lost() -> StoreError {
    StoreError::Unavailable("the batch's transaction was rolled back".into())
}
