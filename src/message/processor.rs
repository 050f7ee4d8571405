//! The processor: claims a message's business key, runs its work under the
//! claim (and the broker's hold on the delivery), stores its result.

use std::{
    fmt,
    panic::AssertUnwindSafe,
    sync::Arc,
    time::{Duration, Instant, SystemTime},
};

use futures_util::FutureExt;
use serde::{Serialize, de::DeserializeOwned};
use tokio::sync::watch;
use tracing::Instrument;

use super::{
    DeadLetterReason, Delivery, DeliveryBudget, DeliveryLease, Disposition, NoHold, ProcessError,
    ProcessOutcome, Settled, attempt, delivery, disposition::Verdict,
};
use crate::{
    fingerprint::{DefaultFingerprint, PayloadFingerprint},
    key::IdempotencyKey,
    observe,
    protocol::{self, Claimed, Finished, Wait},
    record::CompletedRecord,
    store::{SensitiveKeys, StorageKey, Store, StoreError},
};

/// Runs each message's work at most once per business key: the queue
/// consumer's sibling of [`IdempotencyLayer`](crate::IdempotencyLayer). See
/// the [module docs](crate::message).
///
/// Cloning is cheap when the store's is; clones share the store, and a
/// [`drain`](Self::drain).
#[derive(Clone, Debug)]
pub struct IdempotencyProcessor<St, F = DefaultFingerprint> {
    pub(super) store: St,
    scope: String,
    lease: Duration,
    pub(super) retention: Duration,
    pub(super) fingerprint: F,
    pub(super) budget: DeliveryBudget,
    /// Whether keys appear in spans and logs only hashed.
    sensitive_keys: Option<SensitiveKeys>,
    /// Set once the consumer drains: deliveries kept in hand go back.
    draining: Arc<watch::Sender<bool>>,
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
            budget: DeliveryBudget::new(),
            sensitive_keys: None,
            draining: Arc::new(watch::Sender::new(false)),
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
            budget: self.budget,
            sensitive_keys: self.sensitive_keys.clone(),
            draining: self.draining,
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

    /// How a delivery is spent by [`settle`](Self::settle): its back-off,
    /// how long it is kept in hand, how many attempts work that outlives
    /// its transaction gets (default [`DeliveryBudget::new`]).
    ///
    /// # Examples
    ///
    /// See [`DeliveryBudget`].
    pub fn budget(mut self, budget: DeliveryBudget) -> Self {
        self.budget = budget;
        self
    }

    /// Keeps business keys out of spans and logs, for keys that may carry
    /// customer data: each is shown there only as a digest of its scope and
    /// key — keyed with the application's secret
    /// ([`SensitiveKeys::keyed`]), or plain ([`SensitiveKeys::unkeyed`]) —
    /// what [`SensitiveKeys::show`] and the operator CLI's `inspect` print:
    /// the sibling of the layer's
    /// [`sensitive_keys`](crate::IdempotencyLayer::sensitive_keys).
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::{MemoryStore, SensitiveKeys, message::IdempotencyProcessor};
    ///
    /// let orders = IdempotencyProcessor::new(MemoryStore::new())
    ///     .sensitive_keys(SensitiveKeys::keyed(b"from the secret store, 16+ bytes"));
    /// # let _ = orders;
    /// ```
    pub fn sensitive_keys(mut self, how: SensitiveKeys) -> Self {
        self.sensitive_keys = Some(how);
        self
    }

    /// The message `key`'s address in the store.
    fn storage_key(&self, key: &IdempotencyKey) -> StorageKey {
        let key = StorageKey::new(&self.scope, key);
        match &self.sensitive_keys {
            Some(how) => key.sensitive(how),
            None => key,
        }
    }

    /// The business key `key` as spans and logs show it.
    pub(super) fn shown(&self, key: &str) -> String {
        match IdempotencyKey::new(key) {
            Ok(_) if self.sensitive_keys.is_none() => key.to_owned(),
            Ok(valid) => self.storage_key(&valid).to_string(),
            Err(_) if self.sensitive_keys.is_none() => key.to_owned(),
            Err(_) => "<invalid key>".to_owned(),
        }
    }

    /// Stops keeping deliveries in hand, for a graceful shutdown (SIGTERM):
    /// every [`settle`](Self::settle) waiting between attempts gives its
    /// delivery back at once (`Disposition::Retry` with no delay), and none
    /// tries again; work that is running finishes, and its delivery is
    /// acknowledged as usual. Shared by every clone. Stop receiving new
    /// deliveries too.
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::{MemoryStore, message::IdempotencyProcessor};
    ///
    /// let orders = IdempotencyProcessor::new(MemoryStore::new());
    /// // On SIGTERM:
    /// orders.drain();
    /// assert!(orders.is_draining());
    /// ```
    pub fn drain(&self) {
        self.draining.send_replace(true);
    }

    /// Whether [`drain`](Self::drain) was called.
    ///
    /// # Examples
    ///
    /// See [`drain`](Self::drain).
    pub fn is_draining(&self) -> bool {
        *self.draining.borrow()
    }

    /// Settles one delivery: processes it as [`process_delivery`](Self::process_delivery)
    /// does, and keeps it **in hand** until it is decided — retrying what
    /// can pass after a back-off, with the broker's hold extended all the
    /// while — then says what to tell the broker. A consumer never turns
    /// at-least-once delivery into at-most-once:
    ///
    /// - executed, or a duplicate (readable or not): [`Disposition::Ack`];
    /// - can pass — the store unavailable or busy, a commit that failed or
    ///   whose outcome is unknown, the key in flight elsewhere, a work
    ///   error `passing` says may pass: tried again in hand, never spending
    ///   the broker's delivery budget;
    /// - can never succeed — the key reused with another payload, a
    ///   refused transaction, a panic, an invalid key, a work error
    ///   `passing` refuses, work that outlived its transaction on the
    ///   [budget's](DeliveryBudget::timed_out_attempts) attempts:
    ///   [`Disposition::DeadLetter`] with its [`DeadLetterReason`];
    /// - undecided when the consumer [drains](Self::drain) or the budget
    ///   [gives it back](DeliveryBudget::give_back_after):
    ///   [`Disposition::Retry`] — or, on the broker's
    ///   [last](Delivery::last) delivery, [`DeadLetterReason::Undecided`],
    ///   logged as an error, so that the broker never drops it.
    ///
    /// The work may run more than once (each attempt rolls back, or found
    /// nothing claimed), hence `AsyncFnMut`. The key's claim, on every
    /// attempt, waits its turn on a store whose writers take turns
    /// ([`Store::claim_patiently`]) instead of timing out.
    ///
    /// # Examples
    ///
    /// ```
    /// # async fn demo() {
    /// use tower_idempotency::{MemoryStore, message::{Delivery, Disposition, IdempotencyProcessor}};
    ///
    /// let orders = IdempotencyProcessor::new(MemoryStore::new()).scope("orders");
    /// let payload = br#"{"order_id":"order-42","amount":1999}"#;
    /// let settled = orders
    ///     .settle(
    ///         Delivery::new("order-42", payload),
    ///         async |_: &mut _| Ok::<_, std::io::Error>("ch_1".to_owned()),
    ///         // A timeout of the card processor may pass; anything else will not.
    ///         |error| error.kind() == std::io::ErrorKind::TimedOut,
    ///     )
    ///     .await;
    /// assert_eq!(settled.disposition, Disposition::Ack);
    /// # }
    /// ```
    pub async fn settle<T, E, W, L>(
        &self,
        delivery: Delivery<'_, L>,
        mut work: W,
        passing: impl Fn(&E) -> bool,
    ) -> Settled<T, E>
    where
        T: Serialize + DeserializeOwned,
        E: fmt::Display,
        W: AsyncFnMut(&mut St::Granted) -> Result<T, E>,
        L: DeliveryLease,
    {
        let kept = Instant::now();
        let mut draining = self.draining.subscribe();
        let shown = self.shown(delivery.key);
        let span = delivery_span(&delivery, &shown);
        let settling = async {
            let (mut attempts, mut failures, mut timeouts) = (0, 0, 0);
            loop {
                attempts += 1;
                let outcome = self
                    .process_delivery(delivery.key, delivery.payload, &NoHold, &mut work)
                    .await;
                let backoff = self.budget.backoff(failures + 1);
                let after = match Verdict::of(&outcome, backoff, &passing) {
                    Verdict::Done => return Settled::new(Disposition::Ack, outcome, attempts),
                    Verdict::Never(reason) => {
                        return Settled::new(Disposition::DeadLetter(reason), outcome, attempts);
                    }
                    Verdict::Again { after, timed_out } => {
                        failures += 1;
                        timeouts += u32::from(timed_out.is_some());
                        match timed_out {
                            Some(bound) if timeouts >= self.budget.timed_out_limit() => {
                                let reason = DeadLetterReason::TimedOut {
                                    attempts: timeouts,
                                    bound,
                                };
                                return Settled::new(
                                    Disposition::DeadLetter(reason),
                                    outcome,
                                    attempts,
                                );
                            }
                            _ => after,
                        }
                    }
                };
                if *draining.borrow() {
                    return give_back(outcome, attempts, Duration::ZERO, &delivery, &shown);
                }
                if self.budget.spent(kept.elapsed()) {
                    return give_back(outcome, attempts, after, &delivery, &shown);
                }
                if let Err(error) = &outcome {
                    tracing::warn!(key = %shown, %error, ?after, attempts, "idempotency: message not processed; tried again in hand");
                }
                tokio::select! {
                    () = tokio::time::sleep(after) => {}
                    _ = draining.wait_for(|drained| *drained) => {
                        return give_back(outcome, attempts, Duration::ZERO, &delivery, &shown);
                    }
                }
            }
        };
        let settled = delivery::keeping(delivery.hold, &shown, settling)
            .instrument(span.clone())
            .await;
        recorded(&span, &settled);
        settled
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
        self.process_delivery(key, payload, &NoHold, work).await
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
        self.attempted(key, |key| self.process_key(key, payload, broker, work))
            .await
    }

    /// `attempt` at the message key `given`, handed its address in the
    /// store, in the attempt's span, which records what became of it.
    pub(super) async fn attempted<T, E, A>(
        &self,
        given: &str,
        attempt: impl FnOnce(StorageKey) -> A,
    ) -> Result<ProcessOutcome<T>, ProcessError<E>>
    where
        A: Future<Output = Result<ProcessOutcome<T>, ProcessError<E>>>,
    {
        let (key, span) = self.key_span(given)?;
        let processed = attempt(key).instrument(span.clone()).await;
        span.record("idempotency.outcome", outcome_name(&processed));
        processed
    }

    /// The message key `given`'s address in the store, and the span of an
    /// attempt at it — as the HTTP door's: the key as given (its digest
    /// when sensitive), and the store's address (likewise).
    fn key_span<E>(&self, given: &str) -> Result<(StorageKey, tracing::Span), ProcessError<E>> {
        let key = IdempotencyKey::new(given).map_err(ProcessError::InvalidKey)?;
        let key = self.storage_key(&key);
        let span = tracing::info_span!(
            "idempotency",
            idempotency.key = tracing::field::Empty,
            idempotency.storage_key = %key,
            idempotency.outcome = tracing::field::Empty,
        );
        if key.is_sensitive() {
            span.record("idempotency.key", tracing::field::display(&key));
        } else {
            span.record("idempotency.key", given);
        }
        Ok((key, span))
    }

    /// [`process_delivery`](Self::process_delivery) of a valid key.
    async fn process_key<T, E, W, L>(
        &self,
        key: StorageKey,
        payload: &[u8],
        broker: &L,
        work: W,
    ) -> Result<ProcessOutcome<T>, ProcessError<E>>
    where
        T: Serialize + DeserializeOwned,
        W: AsyncFnOnce(&mut St::Granted) -> Result<T, E>,
        L: DeliveryLease,
    {
        let fingerprint = self.fingerprint.fingerprint_payload(payload);
        let claimed = protocol::claim(
            &self.store,
            key,
            fingerprint,
            self.lease,
            protocol::DEFAULT_IN_FLIGHT_HINT,
            // The delivery is held meanwhile: wait in line, not time out.
            Wait::InLine,
        );
        let mut hold = match granted(claimed.await) {
            Ok(hold) => hold,
            Err(answered) => return answered,
        };
        // Held until settled: if this future is dropped while the work runs,
        // the claim is released (and a transaction rolled back).
        let outcome = {
            let shown = hold.key().clone();
            let attempt = hold.attempt();
            let work = hold.run(async |granted| {
                attempt::told(attempt, AssertUnwindSafe(work(granted)).catch_unwind()).await
            });
            delivery::keeping(broker, &shown, work).await
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
        let record = self.record_of(hold.key(), &value);
        // Detached: a caller that stops waiting now (a timeout, a shutdown)
        // does not cancel the completion — the work is done, its record (and
        // on a transactional store its writes) must still be stored.
        let finished = tokio::spawn(hold.finish(Arc::new(record), self.retention)).await;
        match finished {
            Ok(Finished::Stored | Finished::Lost | Finished::Pending) => {
                Ok(ProcessOutcome::Executed(value))
            }
            Ok(Finished::NotCommitted(error)) => Err(not_committed(error)),
            Err(panicked) => Err(ProcessError::NotCommitted(StoreError::Unavailable(
                panicked.into(),
            ))),
        }
    }

    /// The work's result as its record stores it: as JSON, or — when it
    /// cannot be — recorded as processed without it (a redelivery is then
    /// a duplicate whose result cannot be read), never released to run
    /// again.
    pub(super) fn record_of<T: Serialize>(&self, key: &StorageKey, value: &T) -> CompletedRecord {
        let result = serde_json::to_vec(value)
            .inspect_err(|error| tracing::error!(%key, %error, "idempotency: the work's result cannot be stored as JSON; recorded as processed without it"))
            .ok();
        CompletedRecord::Message {
            result: result.map(Into::into),
            created_at: SystemTime::now(),
        }
    }
}

/// The granted claim's hold, or what a claim that found the key (or
/// failed) answers: the one reading of a claim for a message.
pub(super) fn granted<H, T: DeserializeOwned, E>(
    claimed: Claimed<H>,
) -> Result<H, Result<ProcessOutcome<T>, ProcessError<E>>> {
    match claimed {
        Claimed::Granted(hold) => Ok(hold),
        Claimed::InFlight { retry_after } => Err(Ok(ProcessOutcome::InFlight { retry_after })),
        Claimed::Mismatch => Err(Ok(ProcessOutcome::Mismatch)),
        Claimed::Completed { record, .. } => Err(Ok(stored_result(&record))),
        // A record is there, this version cannot read it.
        Claimed::Unavailable(StoreError::Corrupt(corrupt)) => {
            tracing::warn!(%corrupt, "idempotency: duplicate message with an unreadable record");
            Err(Ok(ProcessOutcome::DuplicateUnreadable {
                reason: corrupt.to_string(),
            }))
        }
        Claimed::Unavailable(error) => Err(Err(ProcessError::Unavailable(error))),
    }
}

/// A completion that committed nothing, as the processor reports it:
/// refused for good, or not committed (a redelivery may pass).
pub(super) fn not_committed<E>(error: StoreError) -> ProcessError<E> {
    match error {
        error
        @ (StoreError::Refused(_) | StoreError::TooLarge(_) | StoreError::TransactionHeld) => {
            ProcessError::Refused(error)
        }
        error => ProcessError::NotCommitted(error),
    }
}

/// What a delivery was settled to, on its span and in the metrics.
pub(super) fn recorded<T, E>(span: &tracing::Span, settled: &Settled<T, E>) {
    let reason = match &settled.disposition {
        Disposition::DeadLetter(reason) => reason.kind(),
        _ => "",
    };
    span.record("idempotency.disposition", settled.disposition.name());
    span.record("idempotency.attempts", settled.attempts);
    if !reason.is_empty() {
        // What could never be processed: the delivery failed.
        span.record("idempotency.dead_letter_reason", reason);
        span.record("otel.status_code", "error");
    }
    observe::message_settled(settled.disposition.name(), reason);
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

/// An undecided delivery going back to the broker: after `after` — or, on
/// the broker's last delivery of it, dead-lettered as undecided, so that the
/// broker never drops it.
fn give_back<T, E: fmt::Display, L>(
    outcome: Result<ProcessOutcome<T>, ProcessError<E>>,
    attempts: u32,
    after: Duration,
    delivery: &Delivery<'_, L>,
    shown: &str,
) -> Settled<T, E> {
    let why = match &outcome {
        Ok(ProcessOutcome::InFlight { .. }) => "still in flight elsewhere".to_owned(),
        Err(error) => error.to_string(),
        Ok(_) => "undecided".to_owned(),
    };
    let disposition = handed_back(delivery.last, &why, attempts);
    if let Disposition::DeadLetter(_) = disposition {
        tracing::error!(key = %shown, %why, attempts, "idempotency: a message undecided on the broker's last delivery was dead-lettered, not dropped: redrive it");
    }
    let disposition = match disposition {
        Disposition::Retry { .. } => Disposition::Retry { after },
        other => other,
    };
    Settled::new(disposition, outcome, attempts)
}

/// What an undecided delivery going back comes to — the one rule, for a
/// delivery given back after attempts and for one never started: back to
/// the broker at once, or, on the broker's `last` delivery of it,
/// dead-lettered as undecided (`why`), never left for the broker to drop.
pub(super) fn handed_back(last: bool, why: &str, attempts: u32) -> Disposition {
    if !last {
        return Disposition::Retry {
            after: Duration::ZERO,
        };
    }
    Disposition::DeadLetter(DeadLetterReason::Undecided(format!(
        "{why} (given back after {attempts} attempts)"
    )))
}

/// The span of one delivery, as OpenTelemetry's messaging conventions name
/// it (through `tracing-opentelemetry`'s `otel.*` fields): a consumer span
/// `process {destination}`, with the broker, the destination and the
/// broker's message id as given, and the business key as a field of its
/// own (`shown`: hashed when keys are sensitive). Its status is set only
/// when the delivery is dead-lettered; a duplicate is acknowledged, not an
/// error.
pub(super) fn delivery_span<L>(delivery: &Delivery<'_, L>, shown: &str) -> tracing::Span {
    let source = &delivery.source;
    let name = match source.destination {
        Some(destination) => format!("process {destination}"),
        None => "process".to_owned(),
    };
    let span = tracing::info_span!(
        "idempotency.delivery",
        otel.name = name,
        otel.kind = "consumer",
        otel.status_code = tracing::field::Empty,
        messaging.system = source.system,
        messaging.destination.name = source.destination,
        messaging.message.id = source.message_id,
        messaging.operation.type = "process",
        messaging.operation.name = "process",
        idempotency.key = %shown,
        idempotency.disposition = tracing::field::Empty,
        idempotency.attempts = tracing::field::Empty,
        idempotency.dead_letter_reason = tracing::field::Empty,
    );
    crate::observe::continue_trace(&span, source.trace);
    span
}

/// What became of one attempt, as its span's `idempotency.outcome`.
pub(super) fn outcome_name<T, E>(
    outcome: &Result<ProcessOutcome<T>, ProcessError<E>>,
) -> &'static str {
    match outcome {
        Ok(ProcessOutcome::Executed(_)) => "executed",
        Ok(ProcessOutcome::Duplicate(_)) => "duplicate",
        Ok(ProcessOutcome::DuplicateUnreadable { .. }) => "duplicate_unreadable",
        Ok(ProcessOutcome::InFlight { .. }) => "in_flight",
        Ok(ProcessOutcome::Mismatch) => "mismatch",
        Err(ProcessError::Work(_)) => "work_failed",
        Err(ProcessError::Panicked) => "panicked",
        Err(ProcessError::Unavailable(_)) => "unavailable",
        Err(ProcessError::NotCommitted(_)) => "not_committed",
        Err(ProcessError::Refused(_)) => "refused",
        Err(ProcessError::InvalidKey(_)) => "invalid_key",
    }
}
