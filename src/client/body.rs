//! Bodies held in memory: the request's, to send again on every attempt;
//! the response's, so that an attempt's timeout covers its whole answer.

use std::{
    convert::Infallible,
    pin::Pin,
    task::{Context, Poll},
};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Limited};

use super::BoxError;

/// A response body read in full within its attempt: the data, then the
/// trailers (which carry a gRPC call's status).
#[derive(Debug, Default)]
pub struct BufferedBody {
    data: Option<Bytes>,
    trailers: Option<HeaderMap>,
}

impl BufferedBody {
    /// The body's bytes.
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::client::BufferedBody;
    ///
    /// let body = BufferedBody::default();
    /// assert!(body.bytes().is_empty());
    /// ```
    pub fn bytes(&self) -> Bytes {
        self.data.clone().unwrap_or_default()
    }

    /// The trailers, if the answer had any.
    pub fn trailers(&self) -> Option<&HeaderMap> {
        self.trailers.as_ref()
    }
}

impl Body for BufferedBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if let Some(data) = self.data.take().filter(|d| !d.is_empty()) {
            return Poll::Ready(Some(Ok(Frame::data(data))));
        }
        Poll::Ready(self.trailers.take().map(|t| Ok(Frame::trailers(t))))
    }

    fn is_end_stream(&self) -> bool {
        self.data.as_ref().is_none_or(Bytes::is_empty) && self.trailers.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.data.as_ref().map_or(0, |d| d.len() as u64))
    }
}

/// Why a body could not be read into memory.
pub(crate) enum ReadError {
    /// Over `limit` bytes.
    TooLarge,
    Failed(BoxError),
}

/// Reads `body` in full, data and trailers, refusing more than `limit`
/// bytes.
pub(crate) async fn read<B>(body: B, limit: usize) -> Result<BufferedBody, ReadError>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    match Limited::new(body, limit).collect().await {
        Ok(collected) => {
            let trailers = collected.trailers().cloned();
            Ok(BufferedBody {
                data: Some(collected.to_bytes()),
                trailers,
            })
        }
        Err(error) if error.is::<http_body_util::LengthLimitError>() => Err(ReadError::TooLarge),
        Err(error) => Err(ReadError::Failed(error)),
    }
}
