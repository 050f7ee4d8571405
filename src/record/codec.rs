//! The byte encoding of a completed record, for stores that keep records as
//! bytes (the Redis store uses it as its value format).
//!
//! ```text
//! response:      'r' | fingerprint (32) | status (u16) | created at, Unix ms (u64)
//!                    | header block length (u32) | header block | body
//! unreplayable:  'u' | fingerprint (32) | status (u16) | created at, Unix ms (u64)
//! message:       'm' | fingerprint (32) | has result (u16: 1 or 0) | created at, Unix ms (u64)
//!                    | result
//! header block:  for each header: name length (u16) | name | value length (u32) | value
//! ```
//!
//! Integers are big-endian; `created_at` is kept to the millisecond. The
//! first byte names the format: a later version of this crate that changes
//! the layout uses a new tag and keeps decoding these, so records written
//! before an upgrade still replay. The fingerprint sits at a fixed offset
//! (bytes 1 to 32), so a store can compare it without decoding the rest.
//!
//! # Examples
//!
//! ```
//! use std::time::{Duration, UNIX_EPOCH};
//! use http::{StatusCode, header::LOCATION};
//! use tower_idempotency::{CompletedRecord, Fingerprint, StoredResponse, codec};
//!
//! let fingerprint = Fingerprint::from_bytes([7; 32]);
//! let record = CompletedRecord::Response(StoredResponse::from_parts(
//!     StatusCode::CREATED,
//!     vec![(LOCATION, "/v1/charges/ch_1".parse().unwrap())],
//!     "{\"id\":\"ch_1\"}".into(),
//!     UNIX_EPOCH + Duration::from_millis(1_700_000_000_123),
//! ));
//! let bytes = codec::encode(&fingerprint, &record);
//! assert_eq!(codec::fingerprint(&bytes), Some(fingerprint));
//! assert_eq!(codec::decode(bytes).unwrap(), (fingerprint, record));
//! ```

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::StatusCode;

use http::{HeaderName, HeaderValue};

use crate::{
    fingerprint::Fingerprint,
    record::{CompletedRecord, CorruptRecord, StoredResponse},
};

/// The tag of a stored response.
pub(crate) const RESPONSE: u8 = b'r';
/// The tag of an unreplayable completion.
pub(crate) const UNREPLAYABLE: u8 = b'u';
/// The tag of a processed message.
pub(crate) const MESSAGE: u8 = b'm';
/// Tag and fingerprint: what every encoded record starts with.
const HEAD: usize = 1 + 32;
/// Head, status and created-at: where a response's header block length starts.
const META: usize = HEAD + 2 + 8;

/// Encodes `record`, the answer to requests with `fingerprint`.
pub fn encode(fingerprint: &Fingerprint, record: &CompletedRecord) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(encoded_len(record));
    encode_into(&mut bytes, fingerprint, record);
    bytes
}

/// The length of [`encode`]'s output.
pub(crate) fn encoded_len(record: &CompletedRecord) -> usize {
    match record {
        CompletedRecord::Response(r) => META + 4 + headers_len(r) + r.body().len(),
        CompletedRecord::Unreplayable { .. } => META,
        CompletedRecord::Message { result, .. } => META + result.as_ref().map_or(0, Bytes::len),
    }
}

/// Appends [`encode`]'s output to `bytes`, for a store that puts the record
/// behind a header of its own without copying it a second time.
pub(crate) fn encode_into(
    bytes: &mut Vec<u8>,
    fingerprint: &Fingerprint,
    record: &CompletedRecord,
) {
    let (tag, status, created_at) = match record {
        CompletedRecord::Response(r) => (RESPONSE, r.status().as_u16(), r.created_at()),
        CompletedRecord::Unreplayable { status, created_at } => {
            (UNREPLAYABLE, status.as_u16(), *created_at)
        }
        CompletedRecord::Message { result, created_at } => {
            (MESSAGE, u16::from(result.is_some()), *created_at)
        }
    };
    bytes.push(tag);
    bytes.extend_from_slice(fingerprint.as_bytes());
    bytes.extend_from_slice(&status.to_be_bytes());
    bytes.extend_from_slice(&to_unix_millis(created_at).to_be_bytes());
    match record {
        CompletedRecord::Response(response) => {
            bytes.extend_from_slice(&(headers_len(response) as u32).to_be_bytes());
            for (name, value) in response.headers() {
                bytes.extend_from_slice(&(name.as_str().len() as u16).to_be_bytes());
                bytes.extend_from_slice(name.as_str().as_bytes());
                bytes.extend_from_slice(&(value.len() as u32).to_be_bytes());
                bytes.extend_from_slice(value.as_bytes());
            }
            bytes.extend_from_slice(response.body());
        }
        CompletedRecord::Message {
            result: Some(result),
            ..
        } => bytes.extend_from_slice(result),
        CompletedRecord::Message { result: None, .. } | CompletedRecord::Unreplayable { .. } => {}
    }
}

/// The length of a response's header block.
fn headers_len(response: &StoredResponse) -> usize {
    response
        .headers()
        .iter()
        .map(|(n, v)| 6 + n.as_str().len() + v.len())
        .sum()
}

/// Decodes a header block.
fn decode_headers(mut block: &[u8]) -> Result<Vec<(HeaderName, HeaderValue)>, CorruptRecord> {
    let mut headers = Vec::new();
    while !block.is_empty() {
        let name = take_prefixed(&mut block, 2)?;
        let value = take_prefixed(&mut block, 4)?;
        let name = HeaderName::from_bytes(name).map_err(|_| CorruptRecord("header name"))?;
        let value = HeaderValue::from_bytes(value).map_err(|_| CorruptRecord("header value"))?;
        headers.push((name, value));
    }
    Ok(headers)
}

/// A field led by its big-endian length of `width` bytes.
fn take_prefixed<'a>(block: &mut &'a [u8], width: usize) -> Result<&'a [u8], CorruptRecord> {
    let truncated = CorruptRecord("truncated header block");
    let (len, rest) = block.split_at_checked(width).ok_or(truncated)?;
    let len = len.iter().fold(0usize, |acc, b| acc << 8 | usize::from(*b));
    let (field, rest) = rest.split_at_checked(len).ok_or(truncated)?;
    *block = rest;
    Ok(field)
}

/// The fingerprint of an encoded record, without decoding the rest; `None`
/// if `bytes` is too short to hold one.
pub fn fingerprint(bytes: &[u8]) -> Option<Fingerprint> {
    let fingerprint: [u8; 32] = bytes.get(1..HEAD)?.try_into().ok()?;
    Some(Fingerprint::from_bytes(fingerprint))
}

/// Decodes a record written by [`encode`]. The body is a slice of `bytes`,
/// not a copy.
pub fn decode(bytes: impl Into<Bytes>) -> Result<(Fingerprint, CompletedRecord), CorruptRecord> {
    let bytes: Bytes = bytes.into();
    let fingerprint = fingerprint(&bytes).ok_or(CorruptRecord("truncated record"))?;
    let meta = bytes
        .get(HEAD..META)
        .ok_or(CorruptRecord("truncated record"))?;
    let status = u16::from_be_bytes([meta[0], meta[1]]);
    let created_at = from_unix_millis(u64::from_be_bytes(meta[2..10].try_into().expect("8 bytes")));
    if bytes[0] == MESSAGE {
        let result = (status == 1).then(|| bytes.slice(META..));
        return Ok((fingerprint, CompletedRecord::Message { result, created_at }));
    }
    let status = StatusCode::from_u16(status).map_err(|_| CorruptRecord("status"))?;
    let record = match bytes[0] {
        UNREPLAYABLE => CompletedRecord::Unreplayable { status, created_at },
        RESPONSE => {
            let len = bytes
                .get(META..META + 4)
                .ok_or(CorruptRecord("truncated record"))?;
            let headers_end =
                META + 4 + u32::from_be_bytes(len.try_into().expect("4 bytes")) as usize;
            let block = bytes
                .get(META + 4..headers_end)
                .ok_or(CorruptRecord("truncated headers"))?;
            let headers = decode_headers(block)?;
            let body = bytes.slice(headers_end..);
            CompletedRecord::Response(StoredResponse::from_parts(
                status, headers, body, created_at,
            ))
        }
        _ => return Err(CorruptRecord("unknown record format")),
    };
    Ok((fingerprint, record))
}

/// Milliseconds since the Unix epoch, the wire form of `created_at`.
fn to_unix_millis(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn from_unix_millis(ms: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(ms)
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, UNIX_EPOCH};

    use http::{HeaderMap, HeaderValue, header};

    use super::*;

    #[test]
    fn round_trip() {
        let fp = Fingerprint::from_bytes([9; 32]);
        let mut headers = HeaderMap::new();
        headers.insert(header::LOCATION, HeaderValue::from_static("/x"));
        headers.append("x-multi", HeaderValue::from_static("a"));
        headers.append("x-multi", HeaderValue::from_static("b"));
        let response = StoredResponse::from_parts(
            StatusCode::CREATED,
            StoredResponse::capture(StatusCode::CREATED, &headers, Bytes::new())
                .headers()
                .to_vec(),
            Bytes::from_static(b"{\"ok\":true}"),
            UNIX_EPOCH + Duration::from_millis(1_700_000_000_123),
        );
        for record in [
            CompletedRecord::Response(response),
            CompletedRecord::Unreplayable {
                status: StatusCode::OK,
                created_at: UNIX_EPOCH + Duration::from_millis(42),
            },
            CompletedRecord::Message {
                result: Some(Bytes::from_static(b"\"ch_1\"")),
                created_at: UNIX_EPOCH + Duration::from_millis(7),
            },
            CompletedRecord::Message {
                result: None,
                created_at: UNIX_EPOCH + Duration::from_millis(7),
            },
        ] {
            let bytes = encode(&fp, &record);
            assert_eq!(bytes.len(), encoded_len(&record));
            assert_eq!(&bytes[1..HEAD], fp.as_bytes());
            assert_eq!(decode(bytes).unwrap(), (fp, record));
        }
    }

    #[test]
    fn corrupt_records_are_errors() {
        assert!(decode(vec![b'r'; 10]).is_err());
        assert!(decode(vec![b'x'; 60]).is_err());
        let mut bytes = encode(
            &Fingerprint::from_bytes([0; 32]),
            &CompletedRecord::Unreplayable {
                status: StatusCode::OK,
                created_at: UNIX_EPOCH,
            },
        );
        bytes[0] = b'r';
        assert!(
            decode(bytes).is_err(),
            "a response without its header block"
        );
    }
}
