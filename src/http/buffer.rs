//! Buffering a body up to a limit, for the request's fingerprint and for the
//! stored response, and a body again from what was buffered. Most bodies
//! arrive as one chunk, which is kept as it is: no copy and no list of
//! chunks.

use std::convert::Infallible;

use axum_core::body::Body;
use bytes::{Bytes, BytesMut};
use http::HeaderMap;
use http_body_util::{BodyExt, Full};

pub(crate) enum Buffered<B> {
    /// The whole body, and its trailers if it had some (a gRPC response's
    /// status is there).
    Complete(Bytes, Option<HeaderMap>),
    /// The body outgrew the limit: the chunks read so far, and the rest.
    TooLarge(Vec<Bytes>, B),
    /// A chunk could not be read.
    Failed,
}

pub(crate) async fn buffer<B>(mut body: B, limit: usize) -> Buffered<B>
where
    B: http_body::Body<Data = Bytes> + Unpin,
{
    let mut first: Option<Bytes> = None;
    let mut more: Vec<Bytes> = Vec::new();
    let mut len = 0;
    let mut trailers: Option<HeaderMap> = None;
    while let Some(frame) = body.frame().await {
        let data = match frame.map(http_body::Frame::into_data) {
            Ok(Ok(data)) => data,
            Ok(Err(frame)) => {
                if let Ok(more) = frame.into_trailers() {
                    trailers.get_or_insert_default().extend(more);
                }
                continue;
            }
            Err(_) => return Buffered::Failed,
        };
        len += data.len();
        match first {
            None => first = Some(data),
            Some(_) => more.push(data),
        }
        if len > limit {
            return Buffered::TooLarge(first.into_iter().chain(more).collect(), body);
        }
    }
    let data = match (first, more.is_empty()) {
        (None, _) => Bytes::new(),
        (Some(only), true) => only,
        (Some(first), false) => {
            let mut all = BytesMut::with_capacity(len);
            all.extend_from_slice(&first);
            more.iter().for_each(|chunk| all.extend_from_slice(chunk));
            all.freeze()
        }
    };
    Buffered::Complete(data, trailers)
}

/// A body of `data`, then `trailers` if there are any. Without trailers
/// its length is exact, so the response gets a `Content-Length`.
pub(crate) fn body(data: Bytes, trailers: Option<HeaderMap>) -> Body {
    match trailers {
        None => Body::from(data),
        Some(trailers) => {
            Body::new(
                Full::new(data)
                    .with_trailers(std::future::ready(Some(Ok::<_, Infallible>(trailers)))),
            )
        }
    }
}
