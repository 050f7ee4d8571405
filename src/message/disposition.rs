//! What to tell the broker about a delivery, decided once for every broker:
//! acknowledge, give it back, or dead-letter it with a true reason — and
//! what one attempt at a message came to, on the way there.

use std::{fmt, time::Duration};

use super::{ProcessError, ProcessOutcome};
use crate::store::StoreError;

/// What to tell the broker about a delivery, whatever the broker: the
/// answer [`IdempotencyProcessor::settle`](super::IdempotencyProcessor::settle)
/// comes to.
///
/// | disposition | SQS | JetStream | RabbitMQ |
/// |---|---|---|---|
/// | [`Ack`](Self::Ack) | `DeleteMessage` | `Ack` | `basic.ack` |
/// | [`Retry`](Self::Retry) | `ChangeMessageVisibility` to `after` | `Nak` with `after` as its delay | `basic.nack` with requeue |
/// | [`DeadLetter`](Self::DeadLetter) | sent to the dead-letter queue with its reason, then deleted | published to a dead-letter subject with its reason, then `Term` | published to a dead-letter queue with its reason, then `basic.ack` |
///
/// **Nothing undecided is dead-lettered, and nothing is dropped.** Only
/// what can never succeed is dead-lettered, always with its
/// [`DeadLetterReason`]; a consumer with nowhere to put it keeps it in the
/// queue (and says so loudly) rather than deleting it. `Retry` comes only
/// when the consumer drains or a delivery's
/// [budget](super::DeliveryBudget) says to give it back: passing faults are
/// retried in hand, without spending the broker's deliveries.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::message::{DeadLetterReason, Disposition};
///
/// let given_back = Disposition::Retry { after: Duration::ZERO };
/// let dead = Disposition::DeadLetter(DeadLetterReason::Mismatch);
/// assert_eq!(dead.to_string(), "dead-letter: the key was processed with another payload");
/// # let _ = given_back;
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Disposition {
    /// Done with, now or by an earlier delivery: acknowledge (delete) it.
    Ack,
    /// Not decided here: deliver it again after `after`. Nothing took
    /// effect, or the next delivery finds the record.
    Retry {
        /// How long to keep it out of sight.
        after: Duration,
    },
    /// No delivery of it can succeed: move it to the dead-letter queue with
    /// this reason, and never deliver it again. One message retried forever
    /// would hold up every message behind it.
    DeadLetter(DeadLetterReason),
}

impl Disposition {
    /// A short, stable name: `ack`, `retry` or `dead_letter` (a metric
    /// label).
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::message::Disposition;
    ///
    /// assert_eq!(Disposition::Ack.name(), "ack");
    /// ```
    pub fn name(&self) -> &'static str {
        match self {
            Self::Ack => "ack",
            Self::Retry { .. } => "retry",
            Self::DeadLetter(_) => "dead_letter",
        }
    }
}

impl fmt::Display for Disposition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Ack => f.write_str("ack"),
            Self::Retry { after } => write!(f, "retry after {after:?}"),
            Self::DeadLetter(reason) => write!(f, "dead-letter: {reason}"),
        }
    }
}

/// Why a message can never succeed: what a dead letter carries, so that
/// whoever reads the dead-letter queue knows what to fix. Each reason is
/// true of the message, never of a passing fault.
///
/// # Examples
///
/// ```
/// use tower_idempotency::message::DeadLetterReason;
///
/// let reason = DeadLetterReason::invalid("amount must be positive");
/// assert_eq!(reason.kind(), "invalid");
/// assert_eq!(reason.to_string(), "not a valid message: amount must be positive");
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum DeadLetterReason {
    /// The consumer's own check of the payload refused it before any work:
    /// not the message it expects.
    Invalid(String),
    /// The business key is not a valid key (1 to 255 visible ASCII
    /// characters).
    InvalidKey(String),
    /// The key was processed with another payload: a producer reused a
    /// business key.
    Mismatch,
    /// The database refused the work's transaction: a statement failed, the
    /// commit broke a constraint, or the work kept the transaction past its
    /// end.
    Refused(String),
    /// The work panicked: a bug the same payload meets every time.
    Panicked,
    /// The work failed in a way you judged permanent.
    Work(String),
    /// The work outlived its transaction's bound on this many attempts.
    TimedOut {
        /// The attempts that outlived it.
        attempts: u32,
        /// The bound (the store's `transaction_timeout`).
        bound: Duration,
    },
    /// Still undecided on the broker's last delivery of it (SQS's
    /// `maxReceiveCount`, JetStream's `MaxDeliver`) when the consumer had to
    /// give it back: dead-lettered here, with this reason, rather than left
    /// for the broker to drop or move without one. Redrive it.
    Undecided(String),
}

impl DeadLetterReason {
    /// The consumer's own check refused the payload.
    ///
    /// # Examples
    ///
    /// See [`DeadLetterReason`].
    pub fn invalid(why: impl Into<String>) -> Self {
        Self::Invalid(why.into())
    }

    /// A short, stable name: a metric label, a message attribute's value.
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::message::DeadLetterReason;
    ///
    /// assert_eq!(DeadLetterReason::Mismatch.kind(), "mismatch");
    /// ```
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Invalid(_) => "invalid",
            Self::InvalidKey(_) => "invalid_key",
            Self::Mismatch => "mismatch",
            Self::Refused(_) => "refused",
            Self::Panicked => "panicked",
            Self::Work(_) => "work",
            Self::TimedOut { .. } => "timed_out",
            Self::Undecided(_) => "undecided",
        }
    }
}

impl fmt::Display for DeadLetterReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Invalid(why) => write!(f, "not a valid message: {why}"),
            Self::InvalidKey(why) => write!(f, "not a valid business key: {why}"),
            Self::Mismatch => f.write_str("the key was processed with another payload"),
            Self::Refused(why) => write!(f, "the database refused the work's transaction: {why}"),
            Self::Panicked => f.write_str("the work panicked"),
            Self::Work(why) => write!(f, "the work failed for good: {why}"),
            Self::TimedOut { attempts, bound } => write!(
                f,
                "the work outlived its transaction's bound of {bound:?} on {attempts} attempts: \
                 raise the store's transaction_timeout above the work's duration"
            ),
            Self::Undecided(why) => write!(f, "undecided on the broker's last delivery: {why}"),
        }
    }
}

/// What one attempt at a message came to.
#[derive(Debug)]
pub(super) enum Verdict {
    /// Done with: acknowledge.
    Done,
    /// Can pass: try again after `after`; `timed_out` with the bound when
    /// the work outlived its transaction.
    Again {
        after: Duration,
        timed_out: Option<Duration>,
    },
    /// Can never succeed.
    Never(DeadLetterReason),
}

impl Verdict {
    /// The one place an attempt's outcome is judged: `backoff` is the wait
    /// the budget gives a failure now, `passing` judges the work's own
    /// errors.
    pub(super) fn of<T, E: fmt::Display>(
        processed: &Result<ProcessOutcome<T>, ProcessError<E>>,
        backoff: Duration,
        passing: impl FnOnce(&E) -> bool,
    ) -> Self {
        match processed {
            Ok(
                ProcessOutcome::Executed(_)
                | ProcessOutcome::Duplicate(_)
                | ProcessOutcome::DuplicateUnreadable { .. },
            ) => Self::Done,
            // Its holder is working: come back when it may be done.
            Ok(ProcessOutcome::InFlight { retry_after }) => Self::Again {
                after: (*retry_after).clamp(Duration::from_millis(100), Duration::from_secs(5)),
                timed_out: None,
            },
            Ok(ProcessOutcome::Mismatch) => Self::Never(DeadLetterReason::Mismatch),
            Err(ProcessError::Work(error)) if passing(error) => Self::Again {
                after: backoff,
                timed_out: None,
            },
            Err(ProcessError::Work(error)) => {
                Self::Never(DeadLetterReason::Work(error.to_string()))
            }
            Err(ProcessError::NotCommitted(StoreError::TransactionTimedOut { bound, .. })) => {
                Self::Again {
                    after: backoff,
                    timed_out: Some(*bound),
                }
            }
            Err(ProcessError::Unavailable(_) | ProcessError::NotCommitted(_)) => Self::Again {
                after: backoff,
                timed_out: None,
            },
            Err(ProcessError::Refused(error)) => {
                Self::Never(DeadLetterReason::Refused(error.to_string()))
            }
            Err(ProcessError::Panicked) => Self::Never(DeadLetterReason::Panicked),
            Err(ProcessError::InvalidKey(error)) => {
                Self::Never(DeadLetterReason::InvalidKey(error.to_string()))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type Processed = Result<ProcessOutcome<()>, ProcessError<&'static str>>;

    fn of(processed: Processed) -> Verdict {
        Verdict::of(&processed, Duration::from_secs(2), |e| *e == "passing")
    }

    #[test]
    fn passing_faults_are_tried_again_and_counted_apart_when_the_work_timed_out() {
        let outage: Processed = Err(ProcessError::Unavailable(StoreError::Timeout(
            Duration::from_secs(1),
        )));
        assert!(matches!(
            of(outage),
            Verdict::Again { after, timed_out: None } if after == Duration::from_secs(2)
        ));
        let timed_out: Processed = Err(ProcessError::NotCommitted(
            StoreError::TransactionTimedOut {
                bound: Duration::from_secs(30),
                source: "ended by the server".into(),
            },
        ));
        assert!(matches!(
            of(timed_out),
            Verdict::Again { timed_out: Some(bound), .. } if bound == Duration::from_secs(30)
        ));
        assert!(matches!(
            of(Err(ProcessError::Work("passing"))),
            Verdict::Again { .. }
        ));
        let in_flight: Processed = Ok(ProcessOutcome::InFlight {
            retry_after: Duration::from_secs(30),
        });
        assert!(matches!(
            of(in_flight),
            Verdict::Again { after, .. } if after == Duration::from_secs(5)
        ));
    }

    #[test]
    fn only_what_can_never_succeed_is_dead_lettered_each_with_its_reason() {
        let never = |processed: Processed| match of(processed) {
            Verdict::Never(reason) => reason.kind(),
            other => panic!("{other:?}"),
        };
        assert_eq!(never(Ok(ProcessOutcome::Mismatch)), "mismatch");
        assert_eq!(never(Err(ProcessError::Panicked)), "panicked");
        assert_eq!(
            never(Err(ProcessError::Refused(StoreError::Refused(
                "constraint".into()
            )))),
            "refused"
        );
        assert_eq!(never(Err(ProcessError::Work("permanent"))), "work");
        assert!(matches!(
            of(Ok(ProcessOutcome::Executed(()))),
            Verdict::Done
        ));
        assert!(matches!(
            of(Ok(ProcessOutcome::DuplicateUnreadable {
                reason: "x".into()
            })),
            Verdict::Done
        ));
    }
}
