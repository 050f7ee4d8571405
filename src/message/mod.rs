//! The same protocol for queue consumers: run a message's work at most once
//! per business key, whatever the broker redelivers.
//!
//! Brokers deliver at least once. SQS makes a message visible again when its
//! visibility timeout (30 s by default) passes without a delete; RabbitMQ
//! requeues an unacknowledged delivery, flagged `redelivered`, when its
//! channel or connection closes. A consumer that did the work and crashed
//! before its acknowledgement gets the message again. [`IdempotencyProcessor::process`]
//! makes that harmless: it claims the message's **business key** (an order
//! id, a payment intent — never a delivery id or a fresh UUID, which differ
//! on every redelivery and defeat the check), runs the work under a lease
//! with heartbeats, stores its result, and answers every later delivery with
//! that stored result.
//!
//! What it does not give you: ordering (a redelivery may overtake newer
//! messages), and exactly-once *processing* — FIFO de-duplication windows
//! only drop duplicates within a few minutes, and no broker can promise that
//! the work ran once. What it does promise depends on the store:
//!
//! - On a transactional store (`SqliteTxStore`, `PostgresTxStore`), the
//!   work receives the store's transaction and the record commits with its
//!   writes: "processed" and the effect are one fact (the
//!   `processed_messages` pattern). A crash before the commit leaves
//!   neither, and the redelivery executes; a crash after it (before the
//!   acknowledgement) leaves both, and the redelivery is a
//!   [`ProcessOutcome::Duplicate`]. Exactly one effect.
//! - On Redis or memory stores the record and the work's effects are **not**
//!   atomic: a crash after the effect and before the record is stored means
//!   the redelivery runs the work again once the lease expires. Retries are
//!   harmless everywhere else.
//!
//! # Examples
//!
//! ```
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use tower_idempotency::{MemoryStore, message::{IdempotencyProcessor, ProcessOutcome}};
//!
//! let orders = IdempotencyProcessor::new(MemoryStore::new()).scope("orders");
//! let payload = br#"{"order_id":"order-42","amount":1999}"#;
//!
//! let charge = async |_: &mut _| Ok::<_, std::io::Error>("ch_1".to_owned());
//! let first = orders.process("order-42", payload, charge).await?;
//! assert_eq!(first, ProcessOutcome::Executed("ch_1".to_owned()));
//!
//! // Redelivered: acknowledged with the stored result, the work does not run.
//! let again = orders
//!     .process("order-42", payload, async |_: &mut _| -> Result<String, std::io::Error> {
//!         unreachable!("a duplicate never runs the work")
//!     })
//!     .await?;
//! assert_eq!(again, ProcessOutcome::Duplicate("ch_1".to_owned()));
//! # Ok(()) }
//! ```

use std::{
    panic::AssertUnwindSafe,
    sync::Arc,
    time::{Duration, SystemTime},
};

use futures_util::FutureExt;
use serde::{Serialize, de::DeserializeOwned};

use crate::{
    fingerprint::{DefaultFingerprint, PayloadFingerprint},
    key::{IdempotencyKey, InvalidKey},
    protocol::{self, Claimed, Finished},
    record::CompletedRecord,
    store::{StorageKey, Store, StoreError},
};

/// Runs each message's work at most once per business key: the queue
/// consumer's sibling of [`IdempotencyLayer`](crate::IdempotencyLayer). See
/// the [module docs](self).
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

/// What [`IdempotencyProcessor::process`] did with a message — the sibling
/// of [`IdempotencyOutcome`](crate::IdempotencyOutcome): each variant says what to
/// tell the broker. Match it exhaustively.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ProcessOutcome<T> {
    /// The work ran now; its result is stored. Acknowledge the message.
    Executed(T),
    /// An earlier delivery already did the work: its stored result.
    /// Acknowledge the message without doing anything.
    Duplicate(T),
    /// An earlier delivery already did the work, but its stored result no
    /// longer reads as `T` (the result type changed between deploys, or the
    /// result could not be stored). The work must not run again:
    /// acknowledge the message.
    DuplicateUnreadable {
        /// Why the stored result could not be read.
        reason: String,
    },
    /// Another delivery of this message is being processed right now. Put
    /// it back (requeue) after a pause, so it is retried later — never run it
    /// alongside.
    InFlight {
        /// How long the other delivery's claim has left, at most.
        retry_after: Duration,
    },
    /// The key was processed with a different payload: a producer reused a
    /// business key. Reject the message (dead-letter it), do not retry.
    Mismatch,
}

/// Why [`IdempotencyProcessor::process`] could not process a message. Each variant says
/// whether a redelivery can succeed, so the consumer knows what to tell the
/// broker: requeue (after a pause) what may succeed later, reject
/// (dead-letter) what never will — one message requeued forever stops every
/// message behind it. Match it exhaustively.
///
/// | variant | nothing took effect? | the message |
/// |---|---|---|
/// | [`Work`](Self::Work) | yes on a transactional store (rolled back) | your error decides |
/// | [`Panicked`](Self::Panicked) | yes on a transactional store | reject |
/// | [`Unavailable`](Self::Unavailable) | yes: nothing ran | requeue after a pause |
/// | [`NotCommitted`](Self::NotCommitted) | yes, or the redelivery finds the record | requeue after a pause |
/// | [`Refused`](Self::Refused) | yes: rolled back | reject |
/// | [`InvalidKey`](Self::InvalidKey) | yes: nothing ran | reject |
#[derive(Debug, thiserror::Error)]
pub enum ProcessError<E> {
    /// The work returned an error; the key was released (on a transactional
    /// store its writes rolled back), so a redelivery runs it again. Whether
    /// that can succeed is for your error to say: requeue after a pause for a
    /// passing failure (a timeout, a deadlock, a processor that is down),
    /// reject for one this payload will always meet (a constraint it breaks,
    /// data the database refuses).
    #[error("the work failed: {0}")]
    Work(E),
    /// The work panicked; the key was released. Reject the message: a panic
    /// is a bug the same payload is likely to hit on every delivery.
    #[error("the work panicked")]
    Panicked,
    /// The store could not be reached (or did not answer in time) to claim
    /// the key: nothing ran. Requeue after a pause.
    #[error(transparent)]
    Unavailable(StoreError),
    /// A transactional store could not commit the work's writes with the
    /// record, or the outcome of the commit is unknown (the connection
    /// dropped during `COMMIT`): either nothing took effect, or the
    /// redelivery finds the record and is a [`ProcessOutcome::Duplicate`].
    /// Requeue after a pause.
    #[error("the work's writes were not committed: {0}")]
    NotCommitted(StoreError),
    /// The database refused the work's transaction: one of its statements
    /// failed (which aborts a PostgreSQL transaction) though the work
    /// returned `Ok`, the commit broke a constraint, or the work kept the
    /// transaction past its end. Nothing took effect, and a redelivery of
    /// the same payload meets the same refusal: reject.
    #[error("the database refused the work's transaction: {0}")]
    Refused(StoreError),
    /// The business key is not a valid key (1 to 255 visible ASCII
    /// characters): nothing ran, and no redelivery can succeed. Reject.
    #[error("invalid business key: {0}")]
    InvalidKey(InvalidKey),
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
    /// See the [module docs](self).
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
        let outcome = hold
            .run(async |granted| AssertUnwindSafe(work(granted)).catch_unwind().await)
            .await;
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
