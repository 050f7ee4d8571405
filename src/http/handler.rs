//! Running the handler under a claim, detached from the client connection,
//! and storing or releasing its outcome.

use std::{
    future::Future,
    panic::AssertUnwindSafe,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::SystemTime,
};

use axum_core::body::Body;
use bytes::Bytes;
use futures_util::{FutureExt, StreamExt, stream};
use http::{HeaderMap, Request, Response, response::Parts};
use http_body_util::{BodyStream, StreamBody};
use tracing::Instrument;

use crate::{
    http::{
        Inner,
        buffer::{self, Buffered},
        encoding,
        grpc::{self, GrpcCode, Wire},
        opt_out,
        outcome::{Answered, Completion, IdempotencyOutcome},
        rejection::RejectionKind,
        replay,
        shared::Shared,
        store_policy::StorePolicy,
        transaction,
    },
    protocol::{Finished, Hold},
    record::{CompletedRecord, StoredResponse},
    store::{StorageKey, Store, StoreError},
};

/// What the handler produced, read as far as the layer needs.
enum Handled<E> {
    Panicked,
    Failed(E),
    BodyFailed,
    /// Not final per the store policy.
    NotFinal(Response<Body>),
    /// Marked by the handler not to be replayed: sent, not stored; `true`
    /// when a transaction rolls back, `false` when it commits unrecorded.
    OptedOut(Response<Body>, bool),
    /// Final, with its whole body and its trailers.
    Final(Parts, Bytes, Option<HeaderMap>),
    /// Final, but the body outgrew the storable limit: what was read, and the rest.
    TooLarge(Parts, Vec<Bytes>, Body),
}

/// Runs the handler under the lease, then stores or releases its outcome,
/// detached from the caller (see [`Detached`]), so that a client hanging up
/// cannot cancel it between the side effect and the completion.
///
/// A plain function rather than an `async fn`, so the caller's future holds
/// only the small [`Detached`] handle, not a second copy of the arguments.
pub(crate) fn detached<S, St, Sc, P, F>(
    shared: Arc<Shared<St, Sc, P, F>>,
    inner: S,
    request: Request<Body>,
    mut hold: Hold<St>,
    wire: Wire,
) -> impl Future<Output = Result<Answered, S::Error>> + Send
where
    S: Inner,
    St: Store,
    Sc: Send + Sync + 'static,
    P: StorePolicy,
    F: Send + Sync + 'static,
{
    Detached::new(async move {
        let mut request = request;
        let claimed = transaction::ClaimedWith::granted::<St::Granted>(hold.is_lent());
        request.extensions_mut().insert(claimed);
        request.extensions_mut().insert(hold.attempt());
        // A transaction goes to the handler (the `IdempotentTx` extractor),
        // and comes back once it has returned — unless it kept it.
        let lent = hold
            .lend_if_lent()
            .map(|tx| transaction::lend(tx, request.extensions_mut()));
        // Scoped, so that `settle` can reuse the space of the finished work.
        let handled = {
            let work = std::pin::pin!(run(
                inner,
                request,
                &shared.policy,
                shared.config.max_stored_body,
                hold.is_lent(),
            ));
            hold.hold_while(work).await
        };
        if let Some(tx) = lent.and_then(|slot| slot.take()) {
            hold.give_back(tx);
        }
        settle(&shared, hold, handled, wire).await
    })
}

/// A future that finishes even if its caller stops waiting: it runs inline
/// while the client waits (no task, no channel), and if it is dropped before
/// it is done — the client hung up — the rest of it moves to a spawned task.
/// The box keeps it pinned in place through the move.
struct Detached<T: 'static> {
    work: Option<Pin<Box<dyn Future<Output = T> + Send>>>,
}

impl<T: Send + 'static> Detached<T> {
    fn new(work: impl Future<Output = T> + Send + 'static) -> Self {
        Self {
            // In the request's span, wherever it finishes.
            work: Some(Box::pin(work.in_current_span())),
        }
    }
}

impl<T: 'static> Future for Detached<T> {
    type Output = T;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        // Taken out while it runs: if it panics, it unwinds with the panic
        // instead of being spawned again by `drop` (a future that panicked
        // must never be polled again).
        let mut work = self.work.take().expect("Detached polled after completion");
        let poll = work.as_mut().poll(cx);
        if poll.is_pending() {
            self.work = Some(work);
        }
        poll
    }
}

impl<T: 'static> Drop for Detached<T> {
    fn drop(&mut self) {
        let Some(work) = self.work.take() else { return };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(async move {
                    work.await;
                });
            }
            Err(_) => tracing::error!(
                "idempotency: a request was dropped outside a Tokio runtime; its handler cannot finish and its key stays in flight until the lease expires"
            ),
        }
    }
}

/// Runs the handler without a claim: the store is down and the layer fails
/// open, or the body carries no key and the key is optional.
pub(crate) async fn unclaimed<S: Inner>(
    mut inner: S,
    request: Request<Body>,
    outcome: IdempotencyOutcome,
) -> Result<Answered, S::Error> {
    let response = inner.call(request).await?.map(Body::new);
    Ok(Answered::new(response, outcome))
}

/// Runs the handler and reads its response as far as the store policy
/// needs; `in_transaction` when its writes commit with the record, where a
/// server error rolls back unless the policy stores it.
async fn run<S: Inner, P: StorePolicy>(
    mut inner: S,
    request: Request<Body>,
    policy: &P,
    limit: usize,
    in_transaction: bool,
) -> Handled<S::Error> {
    let roll_back_errors = in_transaction && policy.rolls_back_server_errors();
    let work = async move {
        let response = match inner.call(request).await {
            // `Body::new` only boxes bodies that are not already an axum `Body`.
            Ok(response) => response.map(Body::new),
            Err(error) => return Handled::Failed(error),
        };
        let status = response.status();
        if let Some(marker) = opt_out::of(&response) {
            let roll_back = marker.rolls_back() || (roll_back_errors && status.is_server_error());
            return Handled::OptedOut(response, roll_back);
        }
        if !policy.should_store(status, response.headers())
            || (roll_back_errors && status.is_server_error())
        {
            return Handled::NotFinal(response);
        }
        let (parts, body) = response.into_parts();
        match read_up_to(parts, body, limit).await {
            // A gRPC call's outcome is its status, known once the body is done.
            Handled::Final(parts, body, trailers)
                if Wire::of(&parts.headers) == Wire::Grpc
                    && grpc::status(&parts.headers, trailers.as_ref()).is_some_and(
                        |(code, metadata)| {
                            !policy.should_store_grpc(code, metadata)
                                || (roll_back_errors && code.is_server_error())
                        },
                    ) =>
            {
                let body = buffer::body(body, trailers);
                Handled::NotFinal(Response::from_parts(parts, body))
            }
            handled => handled,
        }
    };
    AssertUnwindSafe(work)
        .catch_unwind()
        .await
        .unwrap_or(Handled::Panicked)
}

async fn read_up_to<E>(parts: Parts, body: Body, limit: usize) -> Handled<E> {
    match buffer::buffer(body, limit).await {
        Buffered::Complete(body, trailers) => Handled::Final(parts, body, trailers),
        Buffered::TooLarge(read, rest) => Handled::TooLarge(parts, read, rest),
        Buffered::Failed => Handled::BodyFailed,
    }
}

/// Stores or releases the outcome, then sends the response (stored before
/// the client sees it; if storing fails, the response goes
/// out at once and the completion is retried while the lease holds).
async fn settle<St, Sc, P, F, E>(
    shared: &Shared<St, Sc, P, F>,
    hold: Hold<St>,
    handled: Handled<E>,
    wire: Wire,
) -> Result<Answered, E>
where
    St: Store,
{
    let (record, response, completion, success) = match handled {
        Handled::Panicked => {
            tracing::error!(key = %hold.key(), "idempotency: handler panicked; key released");
            hold.release().await;
            return Ok(shared.rejection(RejectionKind::HandlerPanicked, wire));
        }
        Handled::Failed(error) => {
            tracing::warn!(key = %hold.key(), "idempotency: handler failed; key released");
            hold.release().await;
            return Err(error);
        }
        Handled::BodyFailed => {
            tracing::warn!(key = %hold.key(), "idempotency: response body failed; key released");
            hold.release().await;
            return Ok(shared.rejection(RejectionKind::ResponseBodyFailed, wire));
        }
        Handled::NotFinal(response) => {
            tracing::debug!(key = %hold.key(), status = %response.status(), "idempotency: response not final; key released");
            hold.release().await;
            return Ok(executed(response, Completion::Released));
        }
        Handled::OptedOut(response, roll_back) => {
            tracing::debug!(key = %hold.key(), status = %response.status(), roll_back, "idempotency: the handler opted out of replay; key released");
            if roll_back {
                hold.release().await;
            } else {
                hold.release_keeping_writes().await;
            }
            return Ok(executed(response, Completion::Released));
        }
        Handled::Final(parts, body, trailers) => {
            encoding::note_stored(&parts.headers);
            let success = claims_success(&parts, trailers.as_ref());
            let mut stored = StoredResponse::capture(parts.status, &parts.headers, body.clone());
            if let Some(trailers) = &trailers {
                stored = stored.with_trailers(trailers);
            }
            let response = Response::from_parts(parts, buffer::body(body, trailers));
            (
                CompletedRecord::Response(stored),
                response,
                Completion::Stored,
                success,
            )
        }
        Handled::TooLarge(parts, read, rest) => {
            tracing::warn!(key = %hold.key(), "idempotency: response too large to store; key completes unreplayable");
            let record = CompletedRecord::Unreplayable {
                status: parts.status,
                created_at: SystemTime::now(),
            };
            let read = stream::iter(read)
                .map(|data| Ok::<_, axum_core::Error>(http_body::Frame::data(data)));
            let rest = BodyStream::new(rest);
            let body = Body::new(StreamBody::new(read.chain(rest)));
            // A gRPC call's status is still to come, in the trailers.
            let success = claims_success(&parts, None);
            (
                record,
                Response::from_parts(parts, body),
                Completion::StoredUnreplayable,
                success,
            )
        }
    };
    let key = hold.key().clone();
    Ok(
        match hold.finish(Arc::new(record), shared.config.retention).await {
            Finished::Stored => {
                tracing::debug!(%key, ?completion, "idempotency: executed");
                let mut response = response;
                if completion == Completion::Stored {
                    let retention = shared.config.retention;
                    replay::tell_retention(&shared.config, &mut response, retention);
                }
                executed(response, completion)
            }
            Finished::Lost => executed(response, Completion::LeaseLost),
            Finished::Pending => executed(response, Completion::Pending),
            // The database refused the handler's transaction (its own
            // statement failed): nothing committed, and the handler's answer
            // is the truth about its request — unless it claims a success.
            Finished::NotCommitted(StoreError::TooLarge(why)) => {
                if success {
                    tracing::warn!(%key, %why, "idempotency: the handler's writes are too large for the store; nothing committed");
                    shared.rejection(RejectionKind::WritesTooLarge { why }, wire)
                } else {
                    executed(response, Completion::Released)
                }
            }
            Finished::NotCommitted(StoreError::Refused(error)) => {
                if success {
                    tracing::warn!(%key, %error, "idempotency: the handler answered a success, but its transaction was refused; withheld");
                    shared.rejection(RejectionKind::TransactionRefused, wire)
                } else {
                    tracing::debug!(%key, %error, "idempotency: the handler's transaction was refused; its answer is sent, not stored");
                    executed(response, Completion::Released)
                }
            }
            // The handler's writes committed with the record, or not at all:
            // its response must not go out, since it may describe an effect that
            // was rolled back. The retry replays or executes, both right.
            Finished::NotCommitted(error) => withheld(shared, &key, error, wire),
        },
    )
}

/// Whether the handler's answer may claim a success: a `2xx`, and for a
/// gRPC call a status that is `OK` — or not known, which is taken for one,
/// so that an answer that might describe a rolled-back effect is withheld.
fn claims_success(parts: &Parts, trailers: Option<&HeaderMap>) -> bool {
    if !parts.status.is_success() {
        return false;
    }
    match Wire::of(&parts.headers) {
        Wire::Http => true,
        Wire::Grpc => {
            grpc::status(&parts.headers, trailers).is_none_or(|(code, _)| code == GrpcCode::OK)
        }
    }
}

/// The answer when a transactional store could not commit the handler's
/// writes with the record.
fn withheld<St, Sc, P, F>(
    shared: &Shared<St, Sc, P, F>,
    key: &StorageKey,
    error: StoreError,
    wire: Wire,
) -> Answered {
    if let StoreError::TransactionHeld = error {
        tracing::error!(
            %key,
            "idempotency: the handler's transaction is still held elsewhere (an IdempotentTx kept past the handler); rolled back"
        );
        return shared.rejection(RejectionKind::TransactionHeld, wire);
    }
    tracing::warn!(%key, %error, "idempotency: the transaction did not commit (or its outcome is unknown); response withheld");
    let retry_after = shared.config.unavailable_retry_after;
    shared.rejection(RejectionKind::StoreUnavailable { retry_after }, wire)
}

fn executed(response: Response<Body>, completion: Completion) -> Answered {
    Answered::new(response, IdempotencyOutcome::Executed(completion))
}

#[cfg(test)]
mod tests {
    use std::{
        panic::AssertUnwindSafe,
        sync::{
            Arc,
            atomic::{AtomicUsize, Ordering},
        },
    };

    use futures_util::FutureExt;

    use super::Detached;
    use std::future::Future;

    #[tokio::test]
    async fn a_panicked_future_is_never_polled_again() {
        let polls = Arc::new(AtomicUsize::new(0));
        let detached = Detached::new({
            let polls = polls.clone();
            std::future::poll_fn(move |_| -> std::task::Poll<()> {
                polls.fetch_add(1, Ordering::SeqCst);
                panic!("the store panicked")
            })
        });
        // The caller sees the panic, and drops the future while unwinding.
        let caught = AssertUnwindSafe(detached).catch_unwind().await;
        assert!(caught.is_err());
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert_eq!(
            polls.load(Ordering::SeqCst),
            1,
            "not spawned again after its panic"
        );
    }

    #[tokio::test]
    async fn a_dropped_future_finishes_on_a_task() {
        let (done, finished) = tokio::sync::oneshot::channel();
        let detached = Detached::new(async move {
            tokio::task::yield_now().await;
            let _ = done.send(());
        });
        // Polled once, then dropped: the client hung up.
        let mut detached = Box::pin(detached);
        let waker = futures_util::task::noop_waker();
        let polled = detached
            .as_mut()
            .poll(&mut std::task::Context::from_waker(&waker));
        assert!(polled.is_pending());
        drop(detached);
        finished.await.expect("the rest of the work ran on a task");
    }
}
