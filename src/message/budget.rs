//! A delivery's budget: how long it is kept and retried in hand, and when
//! work that keeps outliving its transaction is given up on — decided once,
//! for every broker.

use std::time::Duration;

/// How [`IdempotencyProcessor::settle`](super::IdempotencyProcessor::settle)
/// spends one delivery: the one place a delivery's budget is decided.
///
/// Whatever can pass — the store unavailable or busy, a commit whose outcome
/// is unknown, the same message in flight elsewhere, a failure of the work
/// you judge passing — is retried **in hand**: the consumer keeps the
/// delivery (its hold extended by the broker's
/// [`DeliveryLease`](super::DeliveryLease)) and tries again after a
/// back-off, so the broker's own delivery budget (SQS's `maxReceiveCount`,
/// JetStream's `MaxDeliver`, a quorum queue's `delivery-limit`) is never
/// spent on a fault that heals. The delivery goes back to the broker only
/// when the consumer [drains](super::IdempotencyProcessor::drain) or after
/// [`give_back_after`](Self::give_back_after).
///
/// What can never succeed is dead-lettered at once, save work that outlived
/// its transaction's bound: a slow database can do that once, so it is
/// given [`timed_out_attempts`](Self::timed_out_attempts) attempts —
/// counted by the consumer, not read off the broker's delivery counter.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::{MemoryStore, message::{DeliveryBudget, IdempotencyProcessor}};
///
/// // RabbitMQ cannot extend a delivery: give it back well before its
/// // `consumer_timeout` (30 minutes) closes the channel.
/// let orders = IdempotencyProcessor::new(MemoryStore::new()).budget(
///     DeliveryBudget::new()
///         .timed_out_attempts(5)
///         .give_back_after(Duration::from_secs(20 * 60)),
/// );
/// # let _ = orders;
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeliveryBudget {
    timed_out_attempts: u32,
    first_backoff: Duration,
    max_backoff: Duration,
    give_back_after: Option<Duration>,
}

impl Default for DeliveryBudget {
    fn default() -> Self {
        Self::new()
    }
}

impl DeliveryBudget {
    /// Three attempts for work that outlives its transaction; back-off from
    /// 500 ms, doubling, at most 30 s; a delivery kept in hand until it is
    /// decided or the consumer drains.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::message::DeliveryBudget;
    ///
    /// let budget = DeliveryBudget::new();
    /// assert_eq!(budget.backoff(1), Duration::from_millis(500));
    /// assert_eq!(budget.backoff(3), Duration::from_secs(2));
    /// assert_eq!(budget.backoff(40), Duration::from_secs(30));
    /// ```
    pub const fn new() -> Self {
        Self {
            timed_out_attempts: 3,
            first_backoff: Duration::from_millis(500),
            max_backoff: Duration::from_secs(30),
            give_back_after: None,
        }
    }

    /// How many attempts work gets that outlive the transactional store's
    /// bound (`transaction_timeout`) before the message is dead-lettered as
    /// timed out (default 3). Work that always takes that long never
    /// commits; work that did so once behind a slow database is retried.
    ///
    /// # Panics
    ///
    /// When `attempts` is zero.
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::message::DeliveryBudget;
    ///
    /// let budget = DeliveryBudget::new().timed_out_attempts(5);
    /// # let _ = budget;
    /// ```
    pub const fn timed_out_attempts(mut self, attempts: u32) -> Self {
        assert!(
            attempts > 0,
            "DeliveryBudget::timed_out_attempts: at least one attempt"
        );
        self.timed_out_attempts = attempts;
        self
    }

    /// The back-off between attempts in hand: `first` after the first
    /// failure, doubling, at most `max` (default 500 ms and 30 s).
    ///
    /// # Panics
    ///
    /// When `first` is zero or longer than `max`.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::message::DeliveryBudget;
    ///
    /// let budget = DeliveryBudget::new().backoff_between(Duration::from_millis(100), Duration::from_secs(5));
    /// assert_eq!(budget.backoff(2), Duration::from_millis(200));
    /// ```
    pub fn backoff_between(mut self, first: Duration, max: Duration) -> Self {
        assert!(
            !first.is_zero() && first <= max,
            "DeliveryBudget::backoff_between: the first back-off ({first:?}) must be above zero and at most the longest ({max:?})"
        );
        (self.first_backoff, self.max_backoff) = (first, max);
        self
    }

    /// Gives an undecided delivery back to the broker once it has been kept
    /// this long in hand (default: never, until it is decided or the
    /// consumer drains). For a broker whose hold on a delivery has a hard
    /// end: RabbitMQ's `consumer_timeout` (30 minutes by default) closes
    /// the channel of a consumer holding one longer; SQS ends a message's
    /// visibility 12 hours after it was received.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::message::DeliveryBudget;
    ///
    /// let budget = DeliveryBudget::new().give_back_after(Duration::from_secs(11 * 3600));
    /// # let _ = budget;
    /// ```
    pub const fn give_back_after(mut self, kept: Duration) -> Self {
        self.give_back_after = Some(kept);
        self
    }

    /// The wait before the next attempt after `failures` failed ones in a
    /// row (1 for the first).
    ///
    /// # Examples
    ///
    /// See [`DeliveryBudget::new`].
    pub fn backoff(&self, failures: u32) -> Duration {
        let doublings = failures.saturating_sub(1).min(30);
        self.first_backoff
            .saturating_mul(1 << doublings)
            .min(self.max_backoff)
    }

    /// The attempts allowed to outlive the transaction.
    pub(super) fn timed_out_limit(&self) -> u32 {
        self.timed_out_attempts
    }

    /// Whether a delivery kept `kept` in hand must go back now.
    pub(super) fn spent(&self, kept: Duration) -> bool {
        self.give_back_after.is_some_and(|limit| kept >= limit)
    }
}
