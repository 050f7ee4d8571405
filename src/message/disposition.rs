//! What to tell the broker about a processed delivery, decided once for
//! every broker: acknowledge, retry after a back-off, or dead-letter.

use std::time::Duration;

use super::{ProcessError, ProcessOutcome};
use crate::store::StoreError;

/// What to tell the broker about a delivery, whatever the broker: the one
/// place where a processing outcome becomes an acknowledgement, a retry or
/// a dead letter. [`Disposition::of`] decides it.
///
/// | disposition | SQS | JetStream | RabbitMQ |
/// |---|---|---|---|
/// | [`Ack`](Self::Ack) | `DeleteMessage` | `Ack` | `basic.ack` |
/// | [`Retry`](Self::Retry) | `ChangeMessageVisibility` to `after` | `Nak` with `after` as its delay | `basic.nack` with requeue, after `after` |
/// | [`DeadLetter`](Self::DeadLetter) | sent to the `RedrivePolicy`'s queue, deleted | published to a dead-letter subject, `Term` | `basic.reject` without requeue (to the dead-letter exchange) |
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::message::{Disposition, ProcessError, ProcessOutcome};
///
/// let done: Result<ProcessOutcome<String>, ProcessError<std::io::Error>> =
///     Ok(ProcessOutcome::Duplicate("ch_1".into()));
/// // The work's own errors are yours to judge: here, all passing.
/// let disposition = Disposition::of(&done, 1, |_| Disposition::backoff(1));
/// assert_eq!(disposition, Disposition::Ack);
///
/// let busy: Result<ProcessOutcome<String>, ProcessError<std::io::Error>> =
///     Ok(ProcessOutcome::InFlight { retry_after: Duration::from_secs(1) });
/// assert_eq!(
///     Disposition::of(&busy, 1, |_| Disposition::DeadLetter),
///     Disposition::Retry { after: Duration::from_secs(1) },
/// );
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Disposition {
    /// Done with, now or by an earlier delivery: acknowledge (delete) it.
    Ack,
    /// Not now: deliver it again after `after`. Nothing took effect, or the
    /// next delivery finds the record.
    Retry {
        /// How long to keep it out of sight.
        after: Duration,
    },
    /// No delivery of it can succeed: move it to the dead-letter queue at
    /// once, and never deliver it again. One message retried forever would
    /// hold up every message behind it.
    DeadLetter,
}

impl Disposition {
    /// How many deliveries work that outlived its transaction's bound gets
    /// before it is dead-lettered: the bound ended it each time, and work
    /// that always takes this long never commits.
    pub const TIMED_OUT_DELIVERIES: u32 = 3;

    /// What to tell the broker about the `delivery`-th delivery (1 for the
    /// first: SQS's `ApproximateReceiveCount`, JetStream's `delivered`) of
    /// a message `processed` came to. `work` judges the work's own errors
    /// ([`ProcessError::Work`]): [`Disposition::backoff`] for a passing
    /// failure, [`Disposition::DeadLetter`] for one the payload meets on
    /// every delivery.
    ///
    /// - executed, duplicate (readable or not): [`Ack`](Self::Ack);
    /// - in flight elsewhere: [`Retry`](Self::Retry) after the hint, at
    ///   least 100 ms and at most 5 s;
    /// - the store unavailable, a commit that failed or whose outcome is
    ///   unknown: [`Retry`](Self::Retry) after [`backoff`](Self::backoff);
    /// - work that outlived its transaction's bound: the same, until its
    ///   [`TIMED_OUT_DELIVERIES`](Self::TIMED_OUT_DELIVERIES)th delivery,
    ///   then [`DeadLetter`](Self::DeadLetter) (logged with the bound to
    ///   raise);
    /// - the key reused with another payload, a refused transaction, a
    ///   panic, an invalid key: [`DeadLetter`](Self::DeadLetter).
    ///
    /// # Examples
    ///
    /// See [`Disposition`].
    pub fn of<T, E>(
        processed: &Result<ProcessOutcome<T>, ProcessError<E>>,
        delivery: u32,
        work: impl FnOnce(&E) -> Disposition,
    ) -> Self {
        match processed {
            Ok(
                ProcessOutcome::Executed(_)
                | ProcessOutcome::Duplicate(_)
                | ProcessOutcome::DuplicateUnreadable { .. },
            ) => Self::Ack,
            Ok(ProcessOutcome::InFlight { retry_after }) => Self::Retry {
                after: (*retry_after).clamp(Duration::from_millis(100), Duration::from_secs(5)),
            },
            Ok(ProcessOutcome::Mismatch) => Self::DeadLetter,
            Err(ProcessError::Work(error)) => work(error),
            Err(ProcessError::NotCommitted(StoreError::TransactionTimedOut { bound, .. })) => {
                if delivery >= Self::TIMED_OUT_DELIVERIES {
                    tracing::error!(
                        ?bound,
                        delivery,
                        "idempotency: the work outlived its transaction's bound on every delivery and was dead-lettered; raise the transactional store's transaction_timeout above the work's duration"
                    );
                    Self::DeadLetter
                } else {
                    Self::backoff(delivery)
                }
            }
            Err(ProcessError::Unavailable(_) | ProcessError::NotCommitted(_)) => {
                Self::backoff(delivery)
            }
            Err(
                ProcessError::Refused(_) | ProcessError::Panicked | ProcessError::InvalidKey(_),
            ) => Self::DeadLetter,
        }
    }

    /// A retry after an exponential back-off: 500 ms after the first
    /// delivery, doubling, at most 30 s.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::message::Disposition;
    ///
    /// assert_eq!(Disposition::backoff(1), Disposition::Retry { after: Duration::from_millis(500) });
    /// assert_eq!(Disposition::backoff(3), Disposition::Retry { after: Duration::from_secs(2) });
    /// assert_eq!(Disposition::backoff(40), Disposition::Retry { after: Duration::from_secs(30) });
    /// ```
    pub fn backoff(delivery: u32) -> Self {
        let doublings = delivery.saturating_sub(1).min(16);
        let after = Duration::from_millis(500 << doublings).min(Duration::from_secs(30));
        Self::Retry { after }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type Processed = Result<ProcessOutcome<()>, ProcessError<&'static str>>;

    fn of(processed: Processed, delivery: u32) -> Disposition {
        Disposition::of(&processed, delivery, |_| Disposition::DeadLetter)
    }

    fn timed_out() -> Processed {
        Err(ProcessError::NotCommitted(
            StoreError::TransactionTimedOut {
                bound: Duration::from_secs(30),
                source: "ended by the server".into(),
            },
        ))
    }

    #[test]
    fn work_past_its_bound_is_retried_a_bounded_number_of_times_then_dead_lettered() {
        for delivery in 1..Disposition::TIMED_OUT_DELIVERIES {
            assert!(matches!(
                of(timed_out(), delivery),
                Disposition::Retry { .. }
            ));
        }
        for delivery in Disposition::TIMED_OUT_DELIVERIES..Disposition::TIMED_OUT_DELIVERIES + 3 {
            assert_eq!(of(timed_out(), delivery), Disposition::DeadLetter);
        }
    }

    #[test]
    fn outages_retry_with_a_growing_capped_backoff_and_never_dead_letter() {
        let outage = || {
            Err(ProcessError::Unavailable(StoreError::Timeout(
                Duration::from_secs(1),
            )))
        };
        let waits: Vec<_> = (1..=12)
            .map(|n| match of(outage(), n) {
                Disposition::Retry { after } => after,
                other => panic!("an outage is retried, not {other:?}"),
            })
            .collect();
        assert!(waits.windows(2).all(|w| w[0] <= w[1]), "{waits:?}");
        assert_eq!(waits[0], Duration::from_millis(500));
        assert_eq!(*waits.last().unwrap(), Duration::from_secs(30));
    }

    #[test]
    fn what_can_never_succeed_is_dead_lettered_and_the_work_judges_its_own_errors() {
        assert_eq!(of(Ok(ProcessOutcome::Mismatch), 1), Disposition::DeadLetter);
        assert_eq!(of(Err(ProcessError::Panicked), 1), Disposition::DeadLetter);
        let refused = Err(ProcessError::Refused(StoreError::Refused(
            "constraint".into(),
        )));
        assert_eq!(of(refused, 1), Disposition::DeadLetter);
        let work: Processed = Err(ProcessError::Work("down"));
        assert_eq!(
            Disposition::of(&work, 2, |_| Disposition::backoff(2)),
            Disposition::Retry {
                after: Duration::from_secs(1)
            }
        );
        assert_eq!(of(Ok(ProcessOutcome::Executed(())), 9), Disposition::Ack);
        let in_flight = Ok(ProcessOutcome::InFlight {
            retry_after: Duration::from_secs(30),
        });
        assert_eq!(
            of(in_flight, 1),
            Disposition::Retry {
                after: Duration::from_secs(5)
            }
        );
    }
}
