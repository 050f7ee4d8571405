//! The byte encoding of a completed record, for stores that keep records as
//! bytes (the Redis store as its value, the SQL stores in a `bytea`/`BLOB`
//! column).
//!
//! ```text
//! response:      'R' | fingerprint (32) | status (u16) | created at, Unix ms (u48) | flags (u8)
//!                    | header count (varint) | headers
//!                    | [trailer count (varint) | trailers, as headers] | body
//! unreplayable:  'U' | fingerprint (32) | status (u16) | created at (u48)
//! message:       'M' | fingerprint (32) | created at (u48) | flags (u8) | result
//! header:        name: code (u8), or 0 | length (varint) | name
//!                value: code (u8), or 0 | length (varint) | value
//! flags:         bit 0: the body (the result) is a zstd frame; bit 1: a message has a result;
//!                bit 2: a response has trailers (a gRPC response's `grpc-status` and trailing metadata)
//! ```
//!
//! Fixed-width integers are big-endian, lengths LEB128 varints; times are
//! kept to the millisecond. Common header names and values (`content-type`,
//! `location`, `application/json`, …) are one-byte codes, so a JSON
//! response's fixed part is about 45 bytes. The first byte names the format:
//! a version of this crate that changes the layout uses new tags and keeps
//! decoding the old ones — records written before an upgrade still replay
//! (the 0.1 layout, tags `r`, `u` and `m`, still decodes). A flag or header
//! code this version does not know is refused as written by a newer version.
//! The fingerprint sits at a fixed offset (bytes 1 to 32) in every layout,
//! so a store can compare it without decoding the rest.
//!
//! Bodies are written as they are unless the store was given a
//! [`Compression`]; compression never changes the fingerprint or the bytes
//! a replay sends.
//!
//! # Examples
//!
//! ```
//! use std::time::{Duration, UNIX_EPOCH};
//! use http::{StatusCode, header::{CONTENT_TYPE, LOCATION}};
//! use tower_idempotency::{CompletedRecord, Fingerprint, StoredResponse, codec};
//!
//! let fingerprint = Fingerprint::from_bytes([7; 32]);
//! let record = CompletedRecord::Response(StoredResponse::from_parts(
//!     StatusCode::CREATED,
//!     vec![
//!         (CONTENT_TYPE, "application/json".parse().unwrap()),
//!         (LOCATION, "/v1/charges/ch_1".parse().unwrap()),
//!     ],
//!     "{\"id\":\"ch_1\"}".into(),
//!     UNIX_EPOCH + Duration::from_millis(1_700_000_000_123),
//! ));
//! let bytes = codec::encode(&fingerprint, &record);
//! assert_eq!(bytes.len(), 45 + 19 + 13); // fixed part, the location, the body
//! assert_eq!(codec::fingerprint(&bytes), Some(fingerprint));
//! assert_eq!(codec::decode(bytes).unwrap(), (fingerprint, record));
//! ```

mod compression;
mod header_codes;
pub(crate) mod legacy;
mod wire;

use bytes::Bytes;
use http::{HeaderName, HeaderValue, StatusCode};

pub use self::compression::Compression;
use self::wire::{Reader, from_unix_millis, put_u48, put_varint, unix_millis, varint_len};
use crate::{
    fingerprint::Fingerprint,
    record::{CompletedRecord, CorruptRecord, StoredResponse},
};

const RESPONSE: u8 = b'R';
const UNREPLAYABLE: u8 = b'U';
const MESSAGE: u8 = b'M';
/// Tag and fingerprint: what every encoded record starts with.
const HEAD: usize = 1 + 32;

const COMPRESSED: u8 = 1 << 0;
const HAS_RESULT: u8 = 1 << 1;
/// Only responses with trailers set it, so a record without them is
/// byte for byte what the version before trailers wrote, and still reads
/// there.
const HAS_TRAILERS: u8 = 1 << 2;
const KNOWN_FLAGS: u8 = COMPRESSED | HAS_RESULT | HAS_TRAILERS;

/// Encodes `record`, the answer to requests with `fingerprint`, with its
/// body as it is.
pub fn encode(fingerprint: &Fingerprint, record: &CompletedRecord) -> Vec<u8> {
    encode_with(fingerprint, record, &Compression::none())
}

/// Encodes `record` as [`encode`] does, its body compressed as
/// `compression` says.
pub fn encode_with(
    fingerprint: &Fingerprint,
    record: &CompletedRecord,
    compression: &Compression,
) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(encoded_len(record));
    encode_into(&mut bytes, fingerprint, record, compression);
    bytes
}

/// The length of [`encode`]'s output (with compression, an upper bound).
pub(crate) fn encoded_len(record: &CompletedRecord) -> usize {
    HEAD + match record {
        CompletedRecord::Response(r) => {
            let fields = |list: &[(HeaderName, HeaderValue)]| -> usize {
                varint_len(list.len() as u64)
                    + list
                        .iter()
                        .map(|(n, v)| header_codes::len(n, v))
                        .sum::<usize>()
            };
            let trailers = if r.trailers().is_empty() {
                0
            } else {
                fields(r.trailers())
            };
            2 + 6 + 1 + fields(r.headers()) + trailers + r.body().len()
        }
        CompletedRecord::Unreplayable { .. } => 2 + 6,
        CompletedRecord::Message { result, .. } => 6 + 1 + result.as_ref().map_or(0, Bytes::len),
    }
}

/// Appends [`encode_with`]'s output to `bytes`, for a store that puts the
/// record behind a header of its own without copying it a second time.
pub(crate) fn encode_into(
    bytes: &mut Vec<u8>,
    fingerprint: &Fingerprint,
    record: &CompletedRecord,
    compression: &Compression,
) {
    let tag = match record {
        CompletedRecord::Response(_) => RESPONSE,
        CompletedRecord::Unreplayable { .. } => UNREPLAYABLE,
        CompletedRecord::Message { .. } => MESSAGE,
    };
    bytes.push(tag);
    bytes.extend_from_slice(fingerprint.as_bytes());
    match record {
        CompletedRecord::Response(response) => {
            bytes.extend_from_slice(&response.status().as_u16().to_be_bytes());
            put_u48(bytes, unix_millis(response.created_at()));
            let packed = compression.compress(response.body());
            let mut flags = if packed.is_some() { COMPRESSED } else { 0 };
            if !response.trailers().is_empty() {
                flags |= HAS_TRAILERS;
            }
            bytes.push(flags);
            put_fields(bytes, response.headers());
            if flags & HAS_TRAILERS != 0 {
                put_fields(bytes, response.trailers());
            }
            bytes.extend_from_slice(packed.as_deref().unwrap_or(response.body()));
        }
        CompletedRecord::Unreplayable { status, created_at } => {
            bytes.extend_from_slice(&status.as_u16().to_be_bytes());
            put_u48(bytes, unix_millis(*created_at));
        }
        CompletedRecord::Message { result, created_at } => {
            put_u48(bytes, unix_millis(*created_at));
            let packed = result.as_deref().and_then(|r| compression.compress(r));
            let mut flags = if result.is_some() { HAS_RESULT } else { 0 };
            if packed.is_some() {
                flags |= COMPRESSED;
            }
            bytes.push(flags);
            bytes.extend_from_slice(packed.as_deref().or(result.as_deref()).unwrap_or_default());
        }
    }
}

/// The fingerprint of an encoded record, without decoding the rest; `None`
/// if `bytes` is too short to hold one.
pub fn fingerprint(bytes: &[u8]) -> Option<Fingerprint> {
    let fingerprint: [u8; 32] = bytes.get(1..HEAD)?.try_into().ok()?;
    Some(Fingerprint::from_bytes(fingerprint))
}

/// Decodes a record written by [`encode`]. The body is a slice of `bytes`,
/// not a copy. A body compressed with a dictionary needs [`decode_with`];
/// without the `compression` feature, every compressed body is an error
/// that names the feature.
pub fn decode(bytes: impl Into<Bytes>) -> Result<(Fingerprint, CompletedRecord), CorruptRecord> {
    decode_with(bytes, &Compression::none())
}

/// Decodes a record written by [`encode_with`], decompressing its body
/// (with the dictionaries `compression` was given, if it names one).
pub fn decode_with(
    bytes: impl Into<Bytes>,
    compression: &Compression,
) -> Result<(Fingerprint, CompletedRecord), CorruptRecord> {
    let bytes: Bytes = bytes.into();
    let fingerprint = fingerprint(&bytes).ok_or(CorruptRecord("truncated record"))?;
    let mut reader = Reader::new(&bytes, HEAD);
    let record = match bytes[0] {
        RESPONSE => {
            let status = status(reader.u16()?)?;
            let created_at = from_unix_millis(reader.u48()?);
            let flags = flags(reader.u8()?)?;
            let headers = take_fields(&mut reader)?;
            let trailers = if flags & HAS_TRAILERS != 0 {
                take_fields(&mut reader)?
            } else {
                Vec::new()
            };
            let body = body(&bytes, reader.at, flags, compression)?;
            let mut response = StoredResponse::from_parts(status, headers, body, created_at);
            response.trailers = trailers;
            CompletedRecord::Response(response)
        }
        UNREPLAYABLE => CompletedRecord::Unreplayable {
            status: status(reader.u16()?)?,
            created_at: from_unix_millis(reader.u48()?),
        },
        MESSAGE => {
            let created_at = from_unix_millis(reader.u48()?);
            let flags = flags(reader.u8()?)?;
            let result = (flags & HAS_RESULT != 0)
                .then(|| body(&bytes, reader.at, flags, compression))
                .transpose()?;
            CompletedRecord::Message { result, created_at }
        }
        tag => legacy::decode(&bytes, tag)?,
    };
    Ok((fingerprint, record))
}

/// A count, then that many headers (or trailers).
fn put_fields(bytes: &mut Vec<u8>, fields: &[(HeaderName, HeaderValue)]) {
    put_varint(bytes, fields.len() as u64);
    for (name, value) in fields {
        header_codes::put(bytes, name, value);
    }
}

fn take_fields(reader: &mut Reader<'_>) -> Result<Vec<(HeaderName, HeaderValue)>, CorruptRecord> {
    let count = reader.varint()?;
    (0..count).map(|_| header_codes::take(reader)).collect()
}

fn status(code: u16) -> Result<StatusCode, CorruptRecord> {
    StatusCode::from_u16(code).map_err(|_| CorruptRecord("status"))
}

fn flags(flags: u8) -> Result<u8, CorruptRecord> {
    if flags & !KNOWN_FLAGS != 0 {
        return Err(CorruptRecord(
            "unknown flags: written by a newer version of tower-idempotency",
        ));
    }
    Ok(flags)
}

/// The rest of the record from `at`: the body, decompressed if it is a frame.
fn body(
    bytes: &Bytes,
    at: usize,
    flags: u8,
    compression: &Compression,
) -> Result<Bytes, CorruptRecord> {
    let rest = bytes.slice(at..);
    if flags & COMPRESSED == 0 {
        return Ok(rest);
    }
    compression.decompress(&rest).map(Bytes::from)
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
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", HeaderValue::from_static("0"));
        trailers.append("x-ledger", HeaderValue::from_static("a"));
        trailers.append("x-ledger", HeaderValue::from_static("b"));
        let grpc = StoredResponse::from_parts(
            StatusCode::OK,
            vec![(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/grpc"),
            )],
            Bytes::from_static(b"\0\0\0\0\x02\x08\x01"),
            UNIX_EPOCH + Duration::from_millis(1_700_000_000_123),
        )
        .with_trailers(&trailers);
        for record in [
            CompletedRecord::Response(grpc),
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
        assert!(decode(vec![b'R'; 10]).is_err());
        assert!(decode(vec![b'x'; 60]).is_err());
        let mut bytes = encode(
            &Fingerprint::from_bytes([0; 32]),
            &CompletedRecord::Unreplayable {
                status: StatusCode::OK,
                created_at: UNIX_EPOCH,
            },
        );
        bytes[0] = b'R';
        assert!(
            decode(bytes).is_err(),
            "a response without flags or headers"
        );
    }

    fn response(body: Bytes) -> CompletedRecord {
        CompletedRecord::Response(StoredResponse::from_parts(
            StatusCode::CREATED,
            vec![(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            )],
            body,
            UNIX_EPOCH + Duration::from_millis(1_700_000_000_123),
        ))
    }

    #[test]
    fn a_flag_from_a_newer_version_is_refused() {
        let fp = Fingerprint::from_bytes([1; 32]);
        let mut bytes = encode(&fp, &response(Bytes::from_static(b"{}")));
        bytes[HEAD + 2 + 6] |= 1 << 7;
        assert!(decode(bytes).unwrap_err().0.contains("newer version"));
    }

    /// A JSON body that compresses, as a charge object does.
    #[cfg(feature = "compression")]
    fn charge(n: usize) -> Bytes {
        let items: Vec<String> = (0..40)
            .map(|i| {
                format!(
                    r#"{{"id":"li_{n:04}{i:04}","amount":{},"currency":"eur"}}"#,
                    i * 7 + n
                )
            })
            .collect();
        format!(r#"{{"object":"charge","lines":[{}]}}"#, items.join(",")).into()
    }

    #[cfg(feature = "compression")]
    #[test]
    fn compressed_bodies_replay_the_original_bytes() {
        let fp = Fingerprint::from_bytes([3; 32]);
        let zstd = Compression::zstd(1);
        for record in [
            response(charge(1)),
            CompletedRecord::Message {
                result: Some(charge(2)),
                created_at: UNIX_EPOCH + Duration::from_millis(7),
            },
        ] {
            let plain = encode(&fp, &record);
            let packed = encode_with(&fp, &record, &zstd);
            assert!(
                packed.len() * 3 < plain.len(),
                "{} vs {}",
                packed.len(),
                plain.len()
            );
            assert_eq!(fingerprint(&packed), Some(fp));
            assert_eq!(
                decode_with(packed.clone(), &zstd).unwrap(),
                (fp, record.clone())
            );
            // Any reader with the feature reads it, configured or not.
            assert_eq!(decode(packed).unwrap(), (fp, record));
        }
        // Below the threshold, and where it would not shrink: as it is.
        let small = response(Bytes::from_static(b"{\"id\":\"ch_1\"}"));
        assert_eq!(encode_with(&fp, &small, &zstd), encode(&fp, &small));
        let noise: Bytes = (0..4096)
            .map(|_| fastrand::u8(..))
            .collect::<Vec<_>>()
            .into();
        let noisy = response(noise);
        assert_eq!(encode_with(&fp, &noisy, &zstd), encode(&fp, &noisy));
    }

    #[cfg(feature = "compression")]
    #[test]
    fn a_dictionary_is_needed_to_read_what_it_wrote() {
        // Small objects that share their field names, not their values.
        let charge = |n: usize| -> Bytes {
            format!(
                r#"{{"id":"ch_{:016x}","object":"charge","amount":{},"currency":"eur","customer":"cus_{:08x}","description":"Order {n}","status":"succeeded","livemode":false}}"#,
                n * 0x9e37_79b9,
                n * 37 % 5000,
                n * 7919
            )
            .into()
        };
        let samples: Vec<Bytes> = (0..300).map(charge).collect();
        let trained = zstd::dict::from_samples(&samples, 4096).unwrap();
        let retrained = zstd::dict::from_samples(&samples[..200], 2048).unwrap();
        let with = Compression::zstd(3).min_size(64).dictionary(&trained);
        let without = Compression::zstd(3).min_size(64);
        let fp = Fingerprint::from_bytes([4; 32]);
        let record = response(charge(1000));
        let packed = encode_with(&fp, &record, &with);
        assert!(packed.len() + 50 < encode_with(&fp, &record, &without).len());
        assert_eq!(decode_with(packed.clone(), &with).unwrap().1, record);
        let error = decode(packed.clone()).unwrap_err();
        assert!(error.0.contains("read_dictionary"), "{error}");
        // After a change of dictionary, the old one still reads.
        let rotated = Compression::zstd(3)
            .dictionary(&retrained)
            .read_dictionary(&trained);
        assert_eq!(decode_with(packed, &rotated).unwrap().1, record);
    }

    #[cfg(not(feature = "compression"))]
    #[test]
    fn a_reader_without_the_feature_names_it() {
        let fp = Fingerprint::from_bytes([5; 32]);
        let mut bytes = encode(&fp, &response(Bytes::from_static(b"(a zstd frame)")));
        bytes[HEAD + 2 + 6] |= COMPRESSED;
        let error = decode(bytes).unwrap_err();
        assert!(error.0.contains("`compression` feature"), "{error}");
    }
}
