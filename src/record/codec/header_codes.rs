//! Common header names and values as one-byte codes.
//!
//! Code 0 is a literal (its length, then its bytes); codes from 1 name an
//! entry of these tables. The tables are part of the format: entries are
//! only ever appended, never reordered or removed, so every record written
//! since keeps decoding. A reader that meets a code beyond its table is
//! older than the writer and says so instead of guessing.

use http::{HeaderName, HeaderValue, header};

use super::wire::{Reader, put_varint, varint_len};
use crate::record::CorruptRecord;

const LITERAL: u8 = 0;

static NAMES: [HeaderName; 18] = [
    header::CONTENT_TYPE,
    header::LOCATION,
    header::CACHE_CONTROL,
    header::ETAG,
    header::LAST_MODIFIED,
    header::LINK,
    header::VARY,
    header::CONTENT_LANGUAGE,
    header::CONTENT_ENCODING,
    header::CONTENT_LOCATION,
    header::CONTENT_DISPOSITION,
    header::RETRY_AFTER,
    header::EXPIRES,
    header::PRAGMA,
    HeaderName::from_static("x-request-id"),
    HeaderName::from_static("request-id"),
    HeaderName::from_static("grpc-status"),
    HeaderName::from_static("grpc-message"),
];

static VALUES: [HeaderValue; 12] = [
    HeaderValue::from_static("application/json"),
    HeaderValue::from_static("application/json; charset=utf-8"),
    HeaderValue::from_static("application/problem+json"),
    HeaderValue::from_static("text/plain; charset=utf-8"),
    HeaderValue::from_static("text/html; charset=utf-8"),
    HeaderValue::from_static("application/octet-stream"),
    HeaderValue::from_static("application/grpc"),
    HeaderValue::from_static("no-store"),
    HeaderValue::from_static("no-cache"),
    HeaderValue::from_static("private, no-store"),
    HeaderValue::from_static("gzip"),
    HeaderValue::from_static("br"),
];

fn code_of<T: PartialEq>(table: &[T], item: &T) -> Option<u8> {
    table.iter().position(|t| t == item).map(|i| i as u8 + 1)
}

/// Appends one header: name code (or literal), value code (or literal).
pub(super) fn put(out: &mut Vec<u8>, name: &HeaderName, value: &HeaderValue) {
    put_one(out, code_of(&NAMES, name), name.as_str().as_bytes());
    put_one(out, code_of(&VALUES, value), value.as_bytes());
}

fn put_one(out: &mut Vec<u8>, code: Option<u8>, literal: &[u8]) {
    match code {
        Some(code) => out.push(code),
        None => {
            out.push(LITERAL);
            put_varint(out, literal.len() as u64);
            out.extend_from_slice(literal);
        }
    }
}

/// What [`put`] appends, in bytes.
pub(super) fn len(name: &HeaderName, value: &HeaderValue) -> usize {
    let one = |code: Option<u8>, literal: usize| {
        code.map_or(1 + varint_len(literal as u64) + literal, |_| 1)
    };
    one(code_of(&NAMES, name), name.as_str().len()) + one(code_of(&VALUES, value), value.len())
}

/// Reads one header [`put`] wrote.
pub(super) fn take(reader: &mut Reader<'_>) -> Result<(HeaderName, HeaderValue), CorruptRecord> {
    let name = match reader.u8()? {
        LITERAL => {
            HeaderName::from_bytes(reader.prefixed()?).map_err(|_| CorruptRecord("header name"))?
        }
        code => lookup(&NAMES, code)?,
    };
    let value = match reader.u8()? {
        LITERAL => HeaderValue::from_bytes(reader.prefixed()?)
            .map_err(|_| CorruptRecord("header value"))?,
        code => lookup(&VALUES, code)?,
    };
    Ok((name, value))
}

fn lookup<T: Clone>(table: &[T], code: u8) -> Result<T, CorruptRecord> {
    table
        .get(usize::from(code) - 1)
        .cloned()
        .ok_or(CorruptRecord(
            "unknown header code: written by a newer version of tower-idempotency",
        ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_and_literals_round_trip() {
        let headers = [
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            ),
            (
                header::LOCATION,
                HeaderValue::from_static("/v1/charges/ch_1"),
            ),
            (
                HeaderName::from_static("x-custom"),
                HeaderValue::from_static("no-store"),
            ),
            (
                HeaderName::from_static("x-other"),
                HeaderValue::from_static("v"),
            ),
        ];
        let mut out = Vec::new();
        for (name, value) in &headers {
            put(&mut out, name, value);
        }
        assert_eq!(
            out.len(),
            headers.iter().map(|(n, v)| len(n, v)).sum::<usize>()
        );
        assert_eq!(
            &out[..2],
            [1, 1],
            "content-type: application/json is two bytes"
        );
        let mut reader = Reader::new(&out, 0);
        for header in headers {
            assert_eq!(take(&mut reader).unwrap(), header);
        }
    }

    #[test]
    fn a_code_beyond_the_table_is_refused() {
        let error = take(&mut Reader::new(&[200, 1], 0)).unwrap_err();
        assert!(error.0.contains("newer version"));
    }
}
