//! What processing a message came to: the outcomes and the errors, each
//! saying what a redelivery can do.

use std::time::Duration;

use crate::{key::InvalidKey, store::StoreError};

/// What [`IdempotencyProcessor::process`](super::IdempotencyProcessor::process) did with a message — the sibling
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

/// Why [`IdempotencyProcessor::process`](super::IdempotencyProcessor::process) could not process a message. Each variant says
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

/// What [`IdempotencyProcessor::settle`](super::IdempotencyProcessor::settle)
/// came to for one delivery: what to tell the broker, what its last attempt
/// came to, and how many attempts it took.
///
/// # Examples
///
/// ```
/// # async fn demo() {
/// use tower_idempotency::{MemoryStore, message::{Delivery, Disposition, IdempotencyProcessor, ProcessOutcome}};
///
/// let orders = IdempotencyProcessor::new(MemoryStore::new());
/// let settled = orders
///     .settle(Delivery::new("order-42", b"{}"), async |_: &mut _| Ok::<_, std::io::Error>(7), |_| false)
///     .await;
/// assert_eq!(settled.disposition, Disposition::Ack);
/// assert!(matches!(settled.outcome, Ok(ProcessOutcome::Executed(7))));
/// assert_eq!(settled.attempts, 1);
/// # }
/// ```
#[derive(Debug)]
#[non_exhaustive]
pub struct Settled<T, E> {
    /// What to tell the broker.
    pub disposition: super::Disposition,
    /// What the last attempt came to.
    pub outcome: Result<ProcessOutcome<T>, ProcessError<E>>,
    /// How many attempts the delivery took in hand.
    pub attempts: u32,
}

impl<T, E> Settled<T, E> {
    pub(super) fn new(
        disposition: super::Disposition,
        outcome: Result<ProcessOutcome<T>, ProcessError<E>>,
        attempts: u32,
    ) -> Self {
        Self {
            disposition,
            outcome,
            attempts,
        }
    }
}
