//! Running the handler under a claim, detached from the client connection
//! (SPEC §2.5), and storing or releasing its outcome (SPEC §2.6, §3).

use std::{panic::AssertUnwindSafe, pin::Pin, sync::Arc, time::SystemTime};

use axum::body::Body;
use bytes::{Bytes, BytesMut};
use futures_util::{FutureExt, StreamExt, stream};
use http::{Request, Response, response::Parts};
use http_body_util::{BodyExt, BodyStream, StreamBody};
use tokio::sync::oneshot;
use tower_service::Service;

use crate::{
    CachePolicy, CompletedRecord, Completion, IdempotencyOutcome, RejectionKind, StoredResponse,
    claim::BoxError, layer::Shared, lease::Lease, store::Store,
};

/// What the handler produced, read as far as the layer needs.
enum Handled<E, B> {
    Panicked,
    Failed(E),
    BodyFailed,
    /// Not final per the cache policy.
    NotFinal(Response<B>),
    /// Final, with its whole body.
    Final(Parts, Bytes),
    /// Final, but the body outgrew the storable limit: what was read, and the rest.
    TooLarge(Parts, Vec<Bytes>, Pin<Box<B>>),
}

/// Runs the handler on its own task, so that a client hanging up cannot
/// cancel it between the side effect and the completion.
pub(crate) async fn detached<S, St, Sc, P, F, ResBody>(
    shared: Arc<Shared<St, Sc, P, F>>,
    inner: S,
    request: Request<Body>,
    lease: Lease<St>,
) -> Result<Response<Body>, S::Error>
where
    S: Service<Request<Body>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
    St: Store,
    Sc: Send + Sync + 'static,
    P: CachePolicy,
    F: Send + Sync + 'static,
{
    let (reply, response) = oneshot::channel();
    let task_shared = shared.clone();
    tokio::spawn(async move {
        let shared = task_shared;
        let handled = lease
            .hold_while(run(
                inner,
                request,
                &shared.policy,
                shared.config.max_stored_body,
            ))
            .await;
        settle(&shared, &lease, handled, reply).await;
    });
    // Only a panic outside the handler (in the layer itself) drops `reply`.
    response
        .await
        .unwrap_or_else(|_| Ok(shared.rejection(RejectionKind::HandlerPanicked)))
}

/// Runs the handler when the store is down and the layer fails open.
pub(crate) async fn unprotected<S, ResBody>(
    mut inner: S,
    request: Request<Body>,
) -> Result<Response<Body>, S::Error>
where
    S: Service<Request<Body>, Response = Response<ResBody>>,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let mut response = inner.call(request).await?.map(Body::new);
    response
        .extensions_mut()
        .insert(IdempotencyOutcome::Unprotected);
    Ok(response)
}

async fn run<S, P, ResBody>(
    mut inner: S,
    request: Request<Body>,
    policy: &P,
    limit: usize,
) -> Handled<S::Error, ResBody>
where
    S: Service<Request<Body>, Response = Response<ResBody>>,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    P: CachePolicy,
{
    let work = async move {
        let response = match inner.call(request).await {
            Ok(response) => response,
            Err(error) => return Handled::Failed(error),
        };
        if !policy.should_store(response.status(), response.headers()) {
            return Handled::NotFinal(response);
        }
        let (parts, body) = response.into_parts();
        read_up_to(parts, Box::pin(body), limit).await
    };
    AssertUnwindSafe(work)
        .catch_unwind()
        .await
        .unwrap_or(Handled::Panicked)
}

async fn read_up_to<E, B>(parts: Parts, mut body: Pin<Box<B>>, limit: usize) -> Handled<E, B>
where
    B: http_body::Body<Data = Bytes>,
{
    let mut chunks = Vec::new();
    let mut len = 0;
    while let Some(frame) = body.frame().await {
        let Ok(frame) = frame else {
            return Handled::BodyFailed;
        };
        // Trailers are not stored; a replay has none.
        if let Ok(data) = frame.into_data() {
            len += data.len();
            chunks.push(data);
            if len > limit {
                return Handled::TooLarge(parts, chunks, body);
            }
        }
    }
    let body = match chunks.len() {
        0 => Bytes::new(),
        1 => chunks.pop().expect("one chunk"),
        _ => chunks
            .iter()
            .fold(BytesMut::with_capacity(len), |mut all, c| {
                all.extend_from_slice(c);
                all
            })
            .freeze(),
    };
    Handled::Final(parts, body)
}

/// Stores or releases the outcome, then sends the response (SPEC §2.6: stored
/// before the client sees it; SPEC §4: if storing fails, the response goes
/// out at once and the completion is retried while the lease holds).
async fn settle<St, Sc, P, F, E, B>(
    shared: &Shared<St, Sc, P, F>,
    lease: &Lease<St>,
    handled: Handled<E, B>,
    reply: oneshot::Sender<Result<Response<Body>, E>>,
) where
    St: Store,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let (record, response, completion) = match handled {
        Handled::Panicked => {
            tracing::error!(key = %lease.key(), "idempotency: handler panicked; key released");
            lease.release().await;
            let _ = reply.send(Ok(shared.rejection(RejectionKind::HandlerPanicked)));
            return;
        }
        Handled::Failed(error) => {
            tracing::warn!(key = %lease.key(), "idempotency: handler failed; key released");
            lease.release().await;
            let _ = reply.send(Err(error));
            return;
        }
        Handled::BodyFailed => {
            tracing::warn!(key = %lease.key(), "idempotency: response body failed; key released");
            lease.release().await;
            let _ = reply.send(Ok(shared.rejection(RejectionKind::ResponseBodyFailed)));
            return;
        }
        Handled::NotFinal(response) => {
            tracing::debug!(key = %lease.key(), status = %response.status(), "idempotency: response not final; key released");
            lease.release().await;
            let _ = reply.send(Ok(executed(response.map(Body::new), Completion::Released)));
            return;
        }
        Handled::Final(parts, body) => {
            let stored = StoredResponse::capture(parts.status, &parts.headers, body.clone());
            let response = Response::from_parts(parts, Body::from(body));
            (
                CompletedRecord::Response(stored),
                response,
                Completion::Stored,
            )
        }
        Handled::TooLarge(parts, read, rest) => {
            tracing::warn!(key = %lease.key(), "idempotency: response too large to store; key completes unreplayable");
            let record = CompletedRecord::Unreplayable {
                status: parts.status,
                created_at: SystemTime::now(),
            };
            let read =
                stream::iter(read).map(|data| Ok::<_, BoxError>(http_body::Frame::data(data)));
            let rest = BodyStream::new(rest.map_err(Into::into));
            let body = Body::new(StreamBody::new(read.chain(rest)));
            (
                record,
                Response::from_parts(parts, body),
                Completion::StoredUnreplayable,
            )
        }
    };
    let record = Arc::new(record);
    let retention = shared.config.retention;
    match lease.complete(record.clone(), retention).await {
        Ok(true) => {
            tracing::debug!(key = %lease.key(), ?completion, "idempotency: executed");
            let _ = reply.send(Ok(executed(response, completion)));
        }
        Ok(false) => {
            tracing::error!(
                key = %lease.key(),
                "idempotency: lease lost before completion; response sent but not stored, a retry may execute again"
            );
            let _ = reply.send(Ok(executed(response, Completion::LeaseLost)));
        }
        Err(error) => {
            tracing::warn!(key = %lease.key(), %error, "idempotency: completion failed; retrying in the background");
            let _ = reply.send(Ok(executed(response, Completion::Pending)));
            lease.complete_in_background(record, retention).await;
        }
    }
}

fn executed(mut response: Response<Body>, completion: Completion) -> Response<Body> {
    response
        .extensions_mut()
        .insert(IdempotencyOutcome::Executed(completion));
    response
}
