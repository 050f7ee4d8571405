//! The same protocol for queue consumers: run a message's work at most once
//! per business key, whatever the broker redelivers.
//!
//! Brokers deliver at least once. SQS makes a message visible again when its
//! visibility timeout (30 s by default) passes without a delete; RabbitMQ
//! requeues an unacknowledged delivery, flagged `redelivered`, when its
//! channel or connection closes. A consumer that did the work and crashed
//! before its acknowledgement gets the message again. [`Idempotent::run`]
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
//! - On a transactional [`PostgresStore`](crate::PostgresStore), the work
//!   receives the transaction ([`Claimed::transaction`]) and the record
//!   commits with its writes: "processed" and the effect are one fact. A
//!   crash before the commit leaves neither, and the redelivery executes; a
//!   crash after it (before the acknowledgement) leaves both, and the
//!   redelivery is a [`Processed::Duplicate`]. Exactly one effect.
//! - On Redis or memory stores the record and the work's effects are **not**
//!   atomic: a crash after the effect and before the record is stored means
//!   the redelivery runs the work again once the lease expires. Retries are
//!   harmless everywhere else.
//!
//! # Examples
//!
//! ```
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use tower_idempotency::{MemoryStore, message::{Idempotent, Processed}};
//!
//! let orders = Idempotent::new(MemoryStore::new()).namespace("orders");
//! let payload = br#"{"order_id":"order-42","amount":1999}"#;
//!
//! let charge = async |_| Ok::<_, std::io::Error>("ch_1".to_owned());
//! let first = orders.run("order-42", payload, charge).await?;
//! assert_eq!(first, Processed::Executed("ch_1".to_owned()));
//!
//! // Redelivered: acknowledged with the stored result, the work does not run.
//! let again = orders
//!     .run("order-42", payload, async |_| Ok::<String, std::io::Error>(unreachable!()))
//!     .await?;
//! assert_eq!(again, Processed::Duplicate("ch_1".to_owned()));
//! # Ok(()) }
//! ```

use std::{
    panic::AssertUnwindSafe,
    sync::Arc,
    time::{Duration, SystemTime},
};

use futures_util::FutureExt;
use http::StatusCode;
use serde::{Serialize, de::DeserializeOwned};

use crate::{
    fingerprint::canonical_json::canonical_json,
    fingerprint::{Fingerprint, FingerprintHasher},
    key::{IdempotencyKey, InvalidKey},
    observe,
    protocol::hold::{Finished, Lease},
    protocol::{MAX_LEASE, MAX_RETENTION},
    record::{CompletedRecord, StoredResponse},
    store::{Claim, StorageKey, Store, StoreError},
};

/// Runs each message's work at most once per business key. See the
/// [module docs](self).
///
/// Cloning is cheap when the store's is; clones share the store.
#[derive(Clone, Debug)]
pub struct Idempotent<St> {
    store: St,
    namespace: String,
    lease: Duration,
    retention: Duration,
}

/// What [`Idempotent::run`] did with a message: each variant says what to
/// tell the broker. Match it exhaustively.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Processed<T> {
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

/// Why [`Idempotent::run`] could not process a message. Each variant says
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
    /// redelivery finds the record and is a [`Processed::Duplicate`].
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

/// The claim the work runs under. With a transactional
/// [`PostgresStore`](crate::PostgresStore) it carries the transaction.
#[derive(Debug)]
pub struct Claimed {
    /// What the store attached for the work (the Postgres transaction).
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    extensions: http::Extensions,
}

impl Claimed {
    /// The transaction the record will commit in, from a transactional
    /// [`PostgresStore`](crate::PostgresStore); `None` with any other store.
    /// Write the work's effects with it and drop it before the work returns.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn demo(orders: tower_idempotency::message::Idempotent<tower_idempotency::PostgresStore>) -> Result<(), Box<dyn std::error::Error>> {
    /// let payload = br#"{"order_id":"order-42","amount":1999}"#;
    /// orders
    ///     .run("order-42", payload, async |claimed| {
    ///         let mut tx = claimed.transaction().expect("a transactional store");
    ///         sqlx::query("INSERT INTO order_charges (order_id, amount) VALUES ($1, $2)")
    ///             .bind("order-42")
    ///             .bind(1999_i64)
    ///             .execute(&mut *tx)
    ///             .await?;
    ///         Ok::<_, sqlx::Error>(())
    ///     })
    ///     .await?;
    /// # Ok(()) }
    /// ```
    #[cfg(feature = "postgres")]
    #[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
    pub fn transaction(&self) -> Option<crate::IdempotentTx> {
        crate::IdempotentTx::take_from(&self.extensions)
    }
}

impl<St: Store> Idempotent<St> {
    /// Processes messages with records in `store`: a 30 s lease (the
    /// analogue of a visibility timeout, extended while the work runs),
    /// results kept 24 hours, in the namespace `messages`.
    pub fn new(store: St) -> Self {
        Self {
            store,
            namespace: "messages".into(),
            lease: Duration::from_secs(30),
            retention: Duration::from_secs(24 * 60 * 60),
        }
    }

    /// Keeps this consumer's keys apart from others in the same store (like
    /// the scope of an HTTP request; stored hashed).
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::{MemoryStore, message::Idempotent};
    ///
    /// let orders = Idempotent::new(MemoryStore::new()).namespace("orders-consumer");
    /// # let _ = orders;
    /// ```
    pub fn namespace(mut self, namespace: impl Into<String>) -> Self {
        self.namespace = namespace.into();
        self
    }

    /// How long a claim survives without a heartbeat (default 30 s): a
    /// crashed consumer's messages become processable again within one lease.
    ///
    /// # Panics
    ///
    /// When configured, never at run time: under 30 ms or over
    /// [`MAX_LEASE`].
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::{MemoryStore, message::Idempotent};
    ///
    /// let orders = Idempotent::new(MemoryStore::new()).lease(Duration::from_secs(10));
    /// # let _ = orders;
    /// ```
    pub fn lease(mut self, lease: Duration) -> Self {
        assert!(
            (Duration::from_millis(30)..=MAX_LEASE).contains(&lease),
            "Idempotent::lease must be from 30 ms to MAX_LEASE (24 hours), got {lease:?}"
        );
        self.lease = lease;
        self
    }

    /// How long results are kept for redeliveries (default 24 hours); make it
    /// longer than the broker can redeliver (SQS keeps messages up to 14 days).
    ///
    /// # Panics
    ///
    /// When configured, never at run time: under 1 s or over
    /// [`MAX_RETENTION`].
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::{MemoryStore, message::Idempotent};
    ///
    /// let orders = Idempotent::new(MemoryStore::new()).retention(Duration::from_secs(14 * 86_400));
    /// # let _ = orders;
    /// ```
    pub fn retention(mut self, retention: Duration) -> Self {
        assert!(
            (Duration::from_secs(1)..=MAX_RETENTION).contains(&retention),
            "Idempotent::retention must be from 1 s to MAX_RETENTION (365 days), got {retention:?}"
        );
        self.retention = retention;
        self
    }

    /// Runs `work` for the message `key` carrying `payload`, unless this key
    /// was already processed (its stored result comes back as
    /// [`Processed::Duplicate`]) or is being processed elsewhere
    /// ([`Processed::InFlight`]). A key that comes back with a different
    /// payload is [`Processed::Mismatch`]. A JSON payload is compared by its
    /// canonical form (member order and whitespace do not matter), any other
    /// payload byte for byte.
    ///
    /// The work's result is stored as JSON. If the work fails or panics, the
    /// key is released so a redelivery may try again. If storing the result
    /// fails on a non-transactional store, the result is returned and storing
    /// is retried in the background while the lease holds, as for HTTP. A
    /// result that cannot be serialised is recorded as processed without it
    /// (a redelivery is [`Processed::DuplicateUnreadable`]), never run again.
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
    pub async fn run<T, E, F>(
        &self,
        key: &str,
        payload: &[u8],
        work: F,
    ) -> Result<Processed<T>, ProcessError<E>>
    where
        T: Serialize + DeserializeOwned,
        F: AsyncFnOnce(Claimed) -> Result<T, E>,
    {
        let key = IdempotencyKey::new(key).map_err(ProcessError::InvalidKey)?;
        let storage_key = StorageKey::new(&self.namespace, &key);
        let fingerprint = fingerprint(payload);
        let claim = self.store.claim(&storage_key, &fingerprint, self.lease);
        let token = match observe::store_call("claim", claim).await {
            Ok(Claim::Acquired(token)) => token,
            Ok(Claim::InFlight { retry_after }) => {
                tracing::debug!(key = %storage_key, "idempotency: message in flight elsewhere");
                return Ok(Processed::InFlight { retry_after });
            }
            Ok(Claim::Mismatch) => {
                tracing::info!(key = %storage_key, "idempotency: business key reused with another payload");
                return Ok(Processed::Mismatch);
            }
            Ok(Claim::Completed { record, .. }) => {
                tracing::debug!(key = %storage_key, "idempotency: duplicate message");
                return Ok(stored_result(&record));
            }
            // A record is there, this version cannot read it.
            Err(StoreError::Corrupt(corrupt)) => {
                tracing::warn!(key = %storage_key, %corrupt, "idempotency: duplicate message with an unreadable record");
                return Ok(Processed::DuplicateUnreadable {
                    reason: corrupt.to_string(),
                });
            }
            Err(error) => return Err(ProcessError::Unavailable(error)),
        };
        let mut extensions = http::Extensions::new();
        self.store.attach(token, &mut extensions);
        // Held until settled: if this future is dropped while the work runs,
        // the claim is released (and a transaction rolled back).
        let lease = Lease::new(
            self.store.clone(),
            storage_key,
            token,
            fingerprint,
            self.lease,
        );
        let outcome = {
            let work = AssertUnwindSafe(work(Claimed { extensions })).catch_unwind();
            lease.hold_while(std::pin::pin!(work)).await
        };
        let value = match outcome {
            Ok(Ok(value)) => value,
            Ok(Err(error)) => {
                lease.release().await;
                return Err(ProcessError::Work(error));
            }
            Err(_panic) => {
                tracing::error!(key = %lease.key(), "idempotency: message work panicked; key released");
                lease.release().await;
                return Err(ProcessError::Panicked);
            }
        };
        // The work is done: its outcome is recorded even if it cannot be
        // stored as JSON (a redelivery is then a duplicate whose result
        // cannot be read), never released to run again.
        let created_at = SystemTime::now();
        let record = match serde_json::to_vec(&value) {
            Ok(body) => CompletedRecord::Response(StoredResponse::from_parts(
                StatusCode::OK,
                Vec::new(),
                body.into(),
                created_at,
            )),
            Err(error) => {
                tracing::error!(key = %lease.key(), %error, "idempotency: the work's result cannot be stored as JSON; recorded as processed without it");
                CompletedRecord::Unreplayable {
                    status: StatusCode::OK,
                    created_at,
                }
            }
        };
        // Detached: a caller that stops waiting now (a timeout, a shutdown)
        // does not cancel the completion — the work is done, its record (and
        // on a transactional store its writes) must still be stored.
        let retention = self.retention;
        let finished = tokio::spawn(lease.finish(Arc::new(record), retention)).await;
        match finished {
            Ok(Finished::Stored | Finished::Lost | Finished::Pending) => {
                Ok(Processed::Executed(value))
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

/// The fingerprint of a message payload: its canonical JSON form if it is
/// JSON, else its bytes.
///
/// # Examples
///
/// ```
/// use tower_idempotency::message::fingerprint;
///
/// assert_eq!(fingerprint(br#"{"a":1,"b":2}"#), fingerprint(br#"{ "b": 2, "a": 1.0 }"#));
/// assert_ne!(fingerprint(br#"{"a":1}"#), fingerprint(br#"{"a":2}"#));
/// ```
pub fn fingerprint(payload: &[u8]) -> Fingerprint {
    let mut h = FingerprintHasher::new("tower-idempotency/message/v1");
    match canonical_json(payload) {
        Some(canonical) => {
            h.field(b"json");
            h.field(&canonical);
        }
        None => {
            h.field(b"raw");
            h.field(payload);
        }
    }
    h.finish()
}

/// A duplicate's stored result, read back as `T` if it can be.
fn stored_result<T: DeserializeOwned>(record: &CompletedRecord) -> Processed<T> {
    let unreadable = |reason: String| Processed::DuplicateUnreadable { reason };
    match record {
        CompletedRecord::Response(stored) => match serde_json::from_slice(stored.body()) {
            Ok(value) => Processed::Duplicate(value),
            Err(error) => unreadable(format!(
                "the stored result does not read as this type: {error}"
            )),
        },
        CompletedRecord::Unreplayable { .. } => {
            unreadable("the work's result could not be stored".to_owned())
        }
    }
}
