//! The messages of a gRPC request body, decoded: what a call's fingerprint
//! covers, so that the same messages match however the client framed or
//! compressed them — gzip at another level or with another header, or not
//! compressed at all.
//!
//! A body is a sequence of frames: a flag byte (1: compressed with the
//! call's `grpc-encoding`), a 4-byte big-endian length, the message.

use std::io::Read;

use bytes::{BufMut, Bytes, BytesMut};
use http::{HeaderMap, HeaderName};

use crate::http::rejection::RejectionKind;

/// The header that names the algorithm compressed messages use.
const GRPC_ENCODING: HeaderName = HeaderName::from_static("grpc-encoding");

/// The body with every message decompressed, in uncompressed frames — the
/// body itself when no message is compressed, or when it is compressed
/// with an algorithm this crate cannot decode (the service refuses it, or
/// reads it its own way: its bytes are then compared as they are). A body
/// that is not whole frames is unreadable; messages that decompress to
/// more than `limit` bytes in all are too large.
pub(crate) fn decoded(
    headers: &HeaderMap,
    body: &Bytes,
    limit: usize,
) -> Result<Bytes, RejectionKind> {
    let frames = frames(body)?;
    if !frames.iter().any(|(compressed, _)| *compressed) {
        return Ok(body.clone());
    }
    let encoding = headers
        .get(GRPC_ENCODING)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("identity");
    let Some(decoder) = Decoder::named(encoding) else {
        return Ok(body.clone());
    };
    let mut out = BytesMut::with_capacity(body.len());
    for (compressed, message) in frames {
        let message = if compressed {
            decoder.decode(message, limit.saturating_sub(out.len()))?
        } else {
            message.to_vec()
        };
        if out.len() + message.len() > limit {
            return Err(RejectionKind::BodyTooLarge { limit });
        }
        out.put_u8(0);
        out.put_u32(message.len() as u32);
        out.put_slice(&message);
    }
    Ok(out.freeze())
}

/// The frames of `body`: whether each is compressed, and its message.
fn frames(body: &[u8]) -> Result<Vec<(bool, &[u8])>, RejectionKind> {
    let mut frames = Vec::new();
    let mut rest = body;
    while !rest.is_empty() {
        let (head, tail) = rest
            .split_at_checked(5)
            .ok_or(RejectionKind::BodyUnreadable)?;
        let compressed = match head[0] {
            0 => false,
            1 => true,
            _ => return Err(RejectionKind::BodyUnreadable),
        };
        let len = u32::from_be_bytes(head[1..5].try_into().expect("4 bytes")) as usize;
        let (message, tail) = tail
            .split_at_checked(len)
            .ok_or(RejectionKind::BodyUnreadable)?;
        frames.push((compressed, message));
        rest = tail;
    }
    Ok(frames)
}

/// The algorithms tonic compresses with.
enum Decoder {
    Gzip,
    /// gRPC's `deflate` is zlib's format.
    Deflate,
    #[cfg(feature = "compression")]
    Zstd,
}

impl Decoder {
    fn named(encoding: &str) -> Option<Self> {
        match encoding {
            "gzip" => Some(Self::Gzip),
            "deflate" => Some(Self::Deflate),
            #[cfg(feature = "compression")]
            "zstd" => Some(Self::Zstd),
            _ => None,
        }
    }

    /// `message` decompressed, reading at most `limit` bytes of it: a
    /// message that would decompress to more is too large (whatever its
    /// compressed size), one that does not decompress is unreadable.
    fn decode(&self, message: &[u8], limit: usize) -> Result<Vec<u8>, RejectionKind> {
        let mut out = Vec::new();
        let bound = limit as u64 + 1;
        let read = match self {
            Self::Gzip => flate2::read::GzDecoder::new(message)
                .take(bound)
                .read_to_end(&mut out),
            Self::Deflate => flate2::read::ZlibDecoder::new(message)
                .take(bound)
                .read_to_end(&mut out),
            #[cfg(feature = "compression")]
            Self::Zstd => zstd::stream::read::Decoder::new(message)
                .and_then(|decoder| decoder.take(bound).read_to_end(&mut out)),
        };
        match read {
            Ok(_) if out.len() > limit => Err(RejectionKind::BodyTooLarge { limit }),
            Ok(_) => Ok(out),
            Err(_) => Err(RejectionKind::BodyUnreadable),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    fn frame(compressed: bool, message: &[u8]) -> Vec<u8> {
        let mut out = vec![u8::from(compressed)];
        out.extend_from_slice(&(message.len() as u32).to_be_bytes());
        out.extend_from_slice(message);
        out
    }

    fn gzip(message: &[u8], level: u32, mtime: u32) -> Vec<u8> {
        let mut encoder = flate2::GzBuilder::new()
            .mtime(mtime)
            .write(Vec::new(), flate2::Compression::new(level));
        encoder.write_all(message).unwrap();
        encoder.finish().unwrap()
    }

    fn gzip_headers() -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(GRPC_ENCODING, "gzip".parse().unwrap());
        headers
    }

    #[test]
    fn a_message_decodes_to_the_same_bytes_however_it_was_sent() {
        let message = b"\x0a\x08order-42\x10\xcf\x0f".repeat(20);
        let plain = Bytes::from(frame(false, &message));
        let decoded =
            |body: Vec<u8>| decoded(&gzip_headers(), &Bytes::from(body), 1 << 20).unwrap();
        assert_eq!(decoded(frame(false, &message)), plain);
        assert_eq!(decoded(frame(true, &gzip(&message, 6, 0))), plain);
        assert_eq!(decoded(frame(true, &gzip(&message, 1, 1234))), plain);
        assert_ne!(gzip(&message, 6, 0), gzip(&message, 1, 1234));
    }

    #[test]
    fn a_body_that_is_not_whole_frames_is_unreadable() {
        let headers = HeaderMap::new();
        for body in [
            &b"\x00\x00"[..],
            b"\x00\x00\x00\x00\x09abc",
            b"\x02\x00\x00\x00\x00",
        ] {
            assert!(matches!(
                decoded(&headers, &Bytes::copy_from_slice(body), 1024),
                Err(RejectionKind::BodyUnreadable)
            ));
        }
    }

    #[test]
    fn a_message_that_decompresses_past_the_limit_is_too_large() {
        let bomb = gzip(&vec![0u8; 4 << 20], 9, 0);
        assert!(bomb.len() < 8 << 10);
        let body = Bytes::from(frame(true, &bomb));
        assert!(matches!(
            decoded(&gzip_headers(), &body, 1 << 20),
            Err(RejectionKind::BodyTooLarge { limit }) if limit == 1 << 20
        ));
    }
}
