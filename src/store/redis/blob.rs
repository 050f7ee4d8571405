//! The value stored under a record's key: one binary string, so each script
//! reads and writes it with one command and never re-encodes the body.
//!
//! ```text
//! in flight:     'i' | fingerprint (32) | lease token (16)
//! response:      'r' | fingerprint (32) | status (u16) | created at, Unix ms (u64)
//!                    | header block length (u32) | header block | body
//! unreplayable:  'u' | fingerprint (32) | status (u16) | created at, Unix ms (u64)
//! ```
//!
//! Integers are big-endian. The scripts read only the first 49 bytes (state,
//! fingerprint, token), at the offsets below.

use bytes::Bytes;
use http::StatusCode;

use crate::{
    CompletedRecord, CorruptRecord, Fingerprint, StoredResponse,
    record::{from_unix_millis, to_unix_millis},
    store::LeaseToken,
};

const IN_FLIGHT: u8 = b'i';
const RESPONSE: u8 = b'r';
const UNREPLAYABLE: u8 = b'u';
/// State and fingerprint: what every record starts with.
const HEAD: usize = 1 + 32;
/// Head, status and created-at: where a response's header block length starts.
const META: usize = HEAD + 2 + 8;

pub(super) fn in_flight(fingerprint: &Fingerprint, token: LeaseToken) -> [u8; HEAD + 16] {
    let mut blob = [0; HEAD + 16];
    blob[0] = IN_FLIGHT;
    blob[1..HEAD].copy_from_slice(fingerprint.as_bytes());
    blob[HEAD..].copy_from_slice(&token.to_bytes());
    blob
}

pub(super) fn completed(fingerprint: &Fingerprint, record: &CompletedRecord) -> Vec<u8> {
    let (state, status, created_at, response) = match record {
        CompletedRecord::Response(r) => (RESPONSE, r.status(), r.created_at(), Some(r)),
        CompletedRecord::Unreplayable { status, created_at } => {
            (UNREPLAYABLE, *status, *created_at, None)
        }
    };
    let headers = response
        .map(StoredResponse::encode_headers)
        .unwrap_or_default();
    let body = response.map_or(&[][..], |r| r.body());
    let mut blob = Vec::with_capacity(META + 4 + headers.len() + body.len());
    blob.push(state);
    blob.extend_from_slice(fingerprint.as_bytes());
    blob.extend_from_slice(&status.as_u16().to_be_bytes());
    blob.extend_from_slice(&to_unix_millis(created_at).to_be_bytes());
    if response.is_some() {
        blob.extend_from_slice(&(headers.len() as u32).to_be_bytes());
        blob.extend_from_slice(&headers);
        blob.extend_from_slice(body);
    }
    blob
}

/// Decodes a completed record; the body is a slice of `blob`, not a copy.
pub(super) fn decode_completed(blob: Vec<u8>) -> Result<CompletedRecord, CorruptRecord> {
    let blob = Bytes::from(blob);
    let meta = blob
        .get(HEAD..META)
        .ok_or(CorruptRecord("truncated record"))?;
    let status = u16::from_be_bytes([meta[0], meta[1]]);
    let status = StatusCode::from_u16(status).map_err(|_| CorruptRecord("status"))?;
    let created_at = from_unix_millis(u64::from_be_bytes(meta[2..10].try_into().expect("8 bytes")));
    match blob[0] {
        UNREPLAYABLE => Ok(CompletedRecord::Unreplayable { status, created_at }),
        RESPONSE => {
            let len = blob
                .get(META..META + 4)
                .ok_or(CorruptRecord("truncated record"))?;
            let headers_end =
                META + 4 + u32::from_be_bytes(len.try_into().expect("4 bytes")) as usize;
            let block = blob
                .get(META + 4..headers_end)
                .ok_or(CorruptRecord("truncated headers"))?;
            let headers = StoredResponse::decode_headers(block)?;
            let body = blob.slice(headers_end..);
            Ok(CompletedRecord::Response(StoredResponse::from_parts(
                status, headers, body, created_at,
            )))
        }
        _ => Err(CorruptRecord("unknown record state")),
    }
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
        ] {
            let blob = completed(&fp, &record);
            assert_eq!(&blob[1..HEAD], fp.as_bytes());
            assert_eq!(decode_completed(blob).unwrap(), record);
        }
        let token = LeaseToken::generate();
        let claim = in_flight(&fp, token);
        assert_eq!(
            (claim[0], &claim[HEAD..]),
            (IN_FLIGHT, &token.to_bytes()[..])
        );
    }

    #[test]
    fn corrupt_records_are_errors() {
        assert!(decode_completed(vec![b'r'; 10]).is_err());
        assert!(decode_completed(vec![b'x'; 60]).is_err());
        let mut blob = completed(
            &Fingerprint::from_bytes([0; 32]),
            &CompletedRecord::Unreplayable {
                status: StatusCode::OK,
                created_at: UNIX_EPOCH,
            },
        );
        blob[0] = b'r';
        assert!(
            decode_completed(blob).is_err(),
            "a response without its header block"
        );
    }
}
