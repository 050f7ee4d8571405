//! The response future of [`IdempotencyService`](crate::IdempotencyService).

use std::{
    fmt,
    future::Future,
    pin::Pin,
    task::{Context, Poll, ready},
};

use axum_core::{BoxError, body::Body};
use bytes::Bytes;
use http::Response;
use pin_project_lite::pin_project;

use crate::http::outcome::{Answered, BypassReason, IdempotencyOutcome};

/// The claim protocol of a keyed request, boxed: see `crate::http::keyed`.
type Keyed<E> = Pin<Box<dyn Future<Output = Result<Response<Body>, E>> + Send>>;

pin_project! {
    /// The response future of [`IdempotencyService`](crate::IdempotencyService).
    ///
    /// Bypassed requests poll the inner future directly, without boxing;
    /// keyed requests run the claim protocol in a boxed future.
    pub struct ResponseFuture<F, E> {
        #[pin]
        kind: Kind<F, E>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<F, E> {
        Bypass { #[pin] future: F, reason: BypassReason },
        Ready { response: Option<Response<Body>> },
        Keyed { future: Keyed<E> },
    }
}

impl<F, E> ResponseFuture<F, E> {
    pub(crate) fn bypass(future: F, reason: BypassReason) -> Self {
        Self {
            kind: Kind::Bypass { future, reason },
        }
    }

    pub(crate) fn ready(response: Response<Body>) -> Self {
        Self {
            kind: Kind::Ready {
                response: Some(response),
            },
        }
    }

    pub(crate) fn keyed(future: Keyed<E>) -> Self {
        Self {
            kind: Kind::Keyed { future },
        }
    }
}

impl<F, E, B> Future for ResponseFuture<F, E>
where
    F: Future<Output = Result<Response<B>, E>>,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Output = Result<Response<Body>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().kind.project() {
            KindProj::Bypass { future, reason } => {
                let response = ready!(future.poll(cx))?.map(Body::new);
                let answered = Answered::new(response, IdempotencyOutcome::Bypassed(*reason));
                Poll::Ready(Ok(answered.stamped()))
            }
            KindProj::Ready { response } => Poll::Ready(Ok(response
                .take()
                .expect("ResponseFuture polled after completion"))),
            KindProj::Keyed { future } => future.as_mut().poll(cx),
        }
    }
}

impl<F, E> fmt::Debug for ResponseFuture<F, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}
