//! The attempt a message's work is, told to it while it runs.

use std::future::Future;

use crate::Attempt;

tokio::task_local! {
    static ATTEMPT: Attempt;
}

/// Which attempt of its key the message's work now running is — the
/// first, or a takeover of attempts whose leases lapsed — and its
/// [downstream key](Attempt::downstream_key), to pass to the next system
/// down as its own idempotency key. `None` outside a work that
/// [`IdempotencyProcessor`](super::IdempotencyProcessor) runs.
///
/// # Examples
///
/// ```
/// # async fn demo() {
/// use tower_idempotency::{Earlier, MemoryStore, message::{self, IdempotencyProcessor, ProcessOutcome}};
///
/// let orders = IdempotencyProcessor::new(MemoryStore::new()).scope("orders");
/// let processed = orders
///     .process("order-42", br#"{"amount":1999}"#, async |_: &mut _| {
///         let attempt = message::attempt().expect("inside the work");
///         assert_eq!(attempt.earlier(), Earlier::None);
///         // The card processor deduplicates on it, across every attempt.
///         Ok::<_, std::io::Error>(attempt.downstream_key())
///     })
///     .await;
/// assert!(matches!(processed, Ok(ProcessOutcome::Executed(_))));
/// assert!(message::attempt().is_none());
/// # }
/// ```
pub fn attempt() -> Option<Attempt> {
    ATTEMPT.try_with(Attempt::clone).ok()
}

/// Runs `work` told it is `attempt`.
pub(super) async fn told<T>(attempt: Attempt, work: impl Future<Output = T>) -> T {
    ATTEMPT.scope(attempt, work).await
}

#[cfg(all(test, feature = "memory"))]
mod tests {
    use std::{future::Future, task::Poll, time::Duration};

    use super::*;
    use crate::{Earlier, MemoryStore, message::IdempotencyProcessor};

    /// A work that takes over from one whose process stopped mid-work (its
    /// future never polled again, never dropped: no release, no heartbeat)
    /// is told so, with the same downstream key.
    #[tokio::test]
    async fn a_work_is_told_it_takes_over_a_lapsed_attempt() {
        let orders = IdempotencyProcessor::new(MemoryStore::new())
            .scope("orders")
            .lease(Duration::from_millis(100));
        let (seen_tx, mut seen) = tokio::sync::mpsc::unbounded_channel();
        let told = |seen: tokio::sync::mpsc::UnboundedSender<Attempt>, forever: bool| {
            async move |_: &mut _| {
                seen.send(attempt().expect("inside the work")).unwrap();
                if forever {
                    std::future::pending::<()>().await;
                }
                Ok::<_, std::io::Error>(())
            }
        };
        let mut stopped = Box::pin(orders.process("order-42", b"{}", told(seen_tx.clone(), true)));
        let polled = std::future::poll_fn(|cx| Poll::Ready(stopped.as_mut().poll(cx))).await;
        assert!(polled.is_pending());
        std::mem::forget(stopped);
        let first = seen.recv().await.unwrap();
        assert_eq!(first.earlier(), Earlier::None);

        tokio::time::sleep(Duration::from_millis(300)).await;
        let done = orders
            .process("order-42", b"{}", told(seen_tx, false))
            .await;
        assert!(done.is_ok());
        let second = seen.recv().await.unwrap();
        assert!(
            matches!(second.earlier(), Earlier::TakenOver { attempts: 1, .. }),
            "{second:?}"
        );
        assert_eq!(second.downstream_key(), first.downstream_key());
    }
}
