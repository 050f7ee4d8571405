//! Buffering a body up to a limit, for the request's fingerprint and for the
//! stored response. Most bodies arrive as one chunk, which is kept as it is:
//! no copy and no list of chunks.

use bytes::{Bytes, BytesMut};
use http_body_util::BodyExt;

pub(crate) enum Buffered<B> {
    /// The whole body (trailers are dropped: nothing here replays them).
    Complete(Bytes),
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
    while let Some(frame) = body.frame().await {
        let data = match frame.map(http_body::Frame::into_data) {
            Ok(Ok(data)) => data,
            Ok(Err(_trailers)) => continue,
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
    Buffered::Complete(match (first, more.is_empty()) {
        (None, _) => Bytes::new(),
        (Some(only), true) => only,
        (Some(first), false) => {
            let mut all = BytesMut::with_capacity(len);
            all.extend_from_slice(&first);
            more.iter().for_each(|chunk| all.extend_from_slice(chunk));
            all.freeze()
        }
    })
}
