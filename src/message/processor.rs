//! The processor: claims a message's business key, runs its work under the
//! claim (and the broker's hold on the delivery), stores its result.

use std::{
    panic::AssertUnwindSafe,
    sync::Arc,
    time::{Duration, SystemTime},
};

use futures_util::FutureExt;
use serde::{Serialize, de::DeserializeOwned};

use super::{
    DeliveryLease, ProcessError, ProcessOutcome,
    delivery::{self, NoLease},
};
use crate::{
    fingerprint::{DefaultFingerprint, PayloadFingerprint},
    key::IdempotencyKey,
    protocol::{self, Claimed, Finished},
    record::CompletedRecord,
    store::{StorageKey, Store, StoreError},
};

/// Runs each message's work at most once per business key: the queue
/// consumer's sibling of [`IdempotencyLayer`](crate::IdempotencyLayer). See
/// the [module docs](crate::message).
///
/// Cloning is cheap when the store's is; clones share the store.
#[derive(Clone, Debug)]
pub struct IdempotencyProcessor<St, F = DefaultFingerprint> {
    store: St,
    scope: String,
    lease: Duration,
    retention: Duration,
    fingerprint: F,
}

impl<St: Store> IdempotencyProcessor<St> {
    /// Processes messages with records in `store`: a 30 s lease (the
    /// analogue of a visibility timeout, extended while the work runs),
    /// results kept 24 hours, in the scope `messages`.
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::{MemoryStore, message::IdempotencyProcessor};
    ///
    /// let orders = IdempotencyProcessor::new(MemoryStore::new());
    /// # let _ = orders;
    /// ```
    pub fn new(store: St) -> Self {
        Self {
            store,
            scope: "messages".into(),
            lease: protocol::DEFAULT_LEASE,
            retention: protocol::DEFAULT_RETENTION,
            fingerprint: DefaultFingerprint::new(),
        }
    }
}

impl<St: Store, F: PayloadFingerprint> IdempotencyProcessor<St, F> {
    /// Decides which payloads count as the same message (default
    /// [`DefaultFingerprint`]: a JSON payload by its canonical form, any
    /// other byte for byte): the sibling of the layer's
    /// [`fingerprint_with`](crate::IdempotencyLayer::fingerprint_with). Its
    /// JSON Pointer rules apply to payloads too.
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::{DefaultFingerprint, MemoryStore, message::IdempotencyProcessor};
    ///
    /// // A resent order carries a new `sent_at`: still the same order.
    /// let orders = IdempotencyProcessor::new(MemoryStore::new())
    ///     .fingerprint_with(DefaultFingerprint::new().ignore("/sent_at"));
    /// # let _ = orders;
    /// ```
    pub fn fingerprint_with<F2: PayloadFingerprint>(
        self,
        fingerprint: F2,
    ) -> IdempotencyProcessor<St, F2> {
        IdempotencyProcessor {
            store: self.store,
            scope: self.scope,
            lease: self.lease,
            retention: self.retention,
            fingerprint,
        }
    }

    /// Keeps this consumer's keys apart from others in the same store: the
    /// sibling of the layer's
    /// [`scope_with`](crate::IdempotencyLayer::scope_with), fixed for every
    /// message (stored hashed).
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::{MemoryStore, message::IdempotencyProcessor};
    ///
    /// let orders = IdempotencyProcessor::new(MemoryStore::new()).scope("orders-consumer");
    /// # let _ = orders;
    /// ```
    pub fn scope(mut self, scope: impl Into<String>) -> Self {
        self.scope = scope.into();
        self
    }

    /// How long a claim survives without a heartbeat (default 30 s): a
    /// crashed consumer's messages become processable again within one lease.
    ///
    /// # Panics
    ///
    /// When configured, never at run time: under 30 ms or over
    /// [`MAX_LEASE`](crate::MAX_LEASE).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::{MemoryStore, message::IdempotencyProcessor};
    ///
    /// let orders = IdempotencyProcessor::new(MemoryStore::new()).lease(Duration::from_secs(10));
    /// # let _ = orders;
    /// ```
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = protocol::checked_lease(lease, "IdempotencyProcessor::lease");
        self
    }

    /// How long results are kept for redeliveries (default 24 hours); make it
    /// longer than the broker can redeliver (SQS keeps messages up to 14 days).
    ///
    /// # Panics
    ///
    /// When configured, never at run time: under 1 s or over
    /// [`MAX_RETENTION`](crate::MAX_RETENTION).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::{MemoryStore, message::IdempotencyProcessor};
    ///
    /// let orders = IdempotencyProcessor::new(MemoryStore::new()).retention(Duration::from_secs(14 * 86_400));
    /// # let _ = orders;
    /// ```
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = protocol::checked_retention(retention, "IdempotencyProcessor::retention");
        self
    }

    /// Runs `work` for the message `key` carrying `payload`, unless this key
    /// was already processed (its stored result comes back as
    /// [`ProcessOutcome::Duplicate`]) or is being processed elsewhere
    /// ([`ProcessOutcome::InFlight`]). A key that comes back with a different
    /// payload is [`ProcessOutcome::Mismatch`]. A JSON payload is compared by its
    /// canonical form (member order and whitespace do not matter), any other
    /// payload byte for byte.
    ///
    /// The work receives the store's granted claim: on a transactional
    /// store, the transaction the record commits in — write the work's
    /// effects with it (`execute(&mut **tx)`); on any other store a lease
    /// token it can ignore.
    ///
    /// The work's result is stored as JSON. If the work fails or panics, the
    /// key is released so a redelivery may try again. If storing the result
    /// fails on a non-transactional store, the result is returned and storing
    /// is retried in the background while the lease holds, as for HTTP. A
    /// result that cannot be serialised is recorded as processed without it
    /// (a redelivery is [`ProcessOutcome::DuplicateUnreadable`]), never run again.
    ///
    /// Cancel-safe: dropping the returned future while the work runs (a
    /// timeout, a shutdown) releases the key at once — a transactional
    /// store's transaction rolls back; once the work has returned, the
    /// completion goes on in the background, so a finished work is recorded.
    /// Either way the key is never held beyond that.
    ///
    /// # Examples
    ///
    /// See the [module docs](crate::message).
    pub async fn process<T, E, W>(
        &self,
        key: &str,
        payload: &[u8],
        work: W,
    ) -> Result<ProcessOutcome<T>, ProcessError<E>>
    where
        T: Serialize + DeserializeOwned,
        W: AsyncFnOnce(&mut St::Granted) -> Result<T, E>,
    {
        self.process_delivery(key, payload, &NoLease, work).await
    }

    /// [`process`](Self::process), extending the broker's hold on the
    /// delivery (`broker`) while the work runs, so that a job longer than the
    /// broker's timeout is not delivered to a second consumer mid-work. The
    /// hold is extended only while the work runs: a duplicate, a mismatch,
    /// an in-flight key are answered at once.
    ///
    /// # Examples
    ///
    /// See [`extend_every`](super::extend_every).
    pub async fn process_delivery<T, E, W, L>(
        &self,
        key: &str,
        payload: &[u8],
        broker: &L,
        work: W,
    ) -> Result<ProcessOutcome<T>, ProcessError<E>>
    where
        T: Serialize + DeserializeOwned,
        W: AsyncFnOnce(&mut St::Granted) -> Result<T, E>,
        L: DeliveryLease,
    {
        let business_key = key;
        let key = IdempotencyKey::new(key).map_err(ProcessError::InvalidKey)?;
        let key = StorageKey::new(&self.scope, &key);
        let fingerprint = self.fingerprint.fingerprint_payload(payload);
        let claimed = protocol::claim(
            &self.store,
            key,
            fingerprint,
            self.lease,
            protocol::DEFAULT_IN_FLIGHT_HINT,
        );
        let mut hold = match claimed.await {
            Claimed::Granted(hold) => hold,
            Claimed::InFlight { retry_after } => {
                return Ok(ProcessOutcome::InFlight { retry_after });
            }
            Claimed::Mismatch => return Ok(ProcessOutcome::Mismatch),
            Claimed::Completed(record) => return Ok(stored_result(&record)),
            // A record is there, this version cannot read it.
            Claimed::Unavailable(StoreError::Corrupt(corrupt)) => {
                tracing::warn!(%corrupt, "idempotency: duplicate message with an unreadable record");
                return Ok(ProcessOutcome::DuplicateUnreadable {
                    reason: corrupt.to_string(),
                });
            }
            Claimed::Unavailable(error) => return Err(ProcessError::Unavailable(error)),
        };
        // Held until settled: if this future is dropped while the work runs,
        // the claim is released (and a transaction rolled back).
        let outcome = {
            let work =
                hold.run(async |granted| AssertUnwindSafe(work(granted)).catch_unwind().await);
            delivery::keeping(broker, business_key, work).await
        };
        let value = match outcome {
            Ok(Ok(value)) => value,
            Ok(Err(error)) => {
                hold.release().await;
                return Err(ProcessError::Work(error));
            }
            Err(_panic) => {
                tracing::error!(key = %hold.key(), "idempotency: message work panicked; key released");
                hold.release().await;
                return Err(ProcessError::Panicked);
            }
        };
        // The work is done: its outcome is recorded even if it cannot be
        // stored as JSON (a redelivery is then a duplicate whose result
        // cannot be read), never released to run again.
        let result = serde_json::to_vec(&value)
            .inspect_err(|error| tracing::error!(key = %hold.key(), %error, "idempotency: the work's result cannot be stored as JSON; recorded as processed without it"))
            .ok();
        let record = CompletedRecord::Message {
            result: result.map(Into::into),
            created_at: SystemTime::now(),
        };
        // Detached: a caller that stops waiting now (a timeout, a shutdown)
        // does not cancel the completion — the work is done, its record (and
        // on a transactional store its writes) must still be stored.
        let finished = tokio::spawn(hold.finish(Arc::new(record), self.retention)).await;
        match finished {
            Ok(Finished::Stored | Finished::Lost | Finished::Pending) => {
                Ok(ProcessOutcome::Executed(value))
            }
            Ok(Finished::NotCommitted(
                error @ (StoreError::Refused(_) | StoreError::TransactionHeld),
            )) => Err(ProcessError::Refused(error)),
            Ok(Finished::NotCommitted(error)) => Err(ProcessError::NotCommitted(error)),
            Err(panicked) => Err(ProcessError::NotCommitted(StoreError::Unavailable(
                panicked.into(),
            ))),
        }
    }
}

/// A duplicate's stored result, read back as `T` if it can be.
fn stored_result<T: DeserializeOwned>(record: &CompletedRecord) -> ProcessOutcome<T> {
    let unreadable = |reason: String| ProcessOutcome::DuplicateUnreadable { reason };
    let result = match record {
        CompletedRecord::Message {
            result: Some(result),
            ..
        } => result,
        // Written by an earlier version, as a response.
        CompletedRecord::Response(stored) => stored.body(),
        CompletedRecord::Message { result: None, .. } | CompletedRecord::Unreplayable { .. } => {
            return unreadable("the work's result could not be stored".to_owned());
        }
    };
    match serde_json::from_slice(result) {
        Ok(value) => ProcessOutcome::Duplicate(value),
        Err(error) => unreadable(format!(
            "the stored result does not read as this type: {error}"
        )),
    }
}
