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
    canonical_json::canonical_json,
    config::{MAX_LEASE, MAX_RETENTION},
    fingerprint::{Fingerprint, FingerprintHasher},
    key::{IdempotencyKey, InvalidKey},
    lease::{Finished, Lease},
    observe,
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

/// What [`Idempotent::run`] did with a message.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Processed<T> {
    /// The work ran now; its result is stored. Acknowledge the message.
    Executed(T),
    /// An earlier delivery already did the work: its stored result.
    /// Acknowledge the message without doing anything.
    Duplicate(T),
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

/// Why [`Idempotent::run`] could not process a message. In every case
/// nothing was recorded, so a redelivery may process it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProcessError<E> {
    /// The work returned an error; the key was released.
    #[error("the work failed: {0}")]
    Work(E),
    /// The work panicked; the key was released.
    #[error("the work panicked")]
    Panicked,
    /// The store could not be reached to claim the key; nothing ran.
    #[error(transparent)]
    Store(StoreError),
    /// A transactional store could not commit the work's writes with the
    /// record (or the outcome of the commit is unknown): nothing took
    /// effect, or the redelivery will find the record.
    #[error("the work's writes were not committed: {0}")]
    NotCommitted(StoreError),
    /// The business key is not a valid key (1 to 255 visible ASCII
    /// characters).
    #[error("invalid business key: {0}")]
    InvalidKey(InvalidKey),
    /// The work's result could not be stored, or a stored result read back,
    /// as JSON.
    #[error("the result does not round-trip through JSON: {0}")]
    Result(serde_json::Error),
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
    /// is retried in the background while the lease holds, as for HTTP.
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
                return stored_result(&record).map(Processed::Duplicate);
            }
            Err(error) => return Err(ProcessError::Store(error)),
        };
        let mut extensions = http::Extensions::new();
        self.store.attach(token, &mut extensions);
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
        let body = match serde_json::to_vec(&value) {
            Ok(body) => body,
            Err(error) => {
                lease.release().await;
                return Err(ProcessError::Result(error));
            }
        };
        let record = Arc::new(CompletedRecord::Response(StoredResponse::from_parts(
            StatusCode::OK,
            Vec::new(),
            body.into(),
            SystemTime::now(),
        )));
        match lease.finish(record, self.retention).await {
            Finished::Stored | Finished::Lost | Finished::Pending => Ok(Processed::Executed(value)),
            Finished::NotCommitted(error) => Err(ProcessError::NotCommitted(error)),
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

fn stored_result<T: DeserializeOwned, E>(record: &CompletedRecord) -> Result<T, ProcessError<E>> {
    match record {
        CompletedRecord::Response(stored) => {
            serde_json::from_slice(stored.body()).map_err(ProcessError::Result)
        }
        CompletedRecord::Unreplayable { .. } => Err(ProcessError::Store(StoreError::Corrupt(
            crate::record::CorruptRecord("a message record without its result"),
        ))),
    }
}
