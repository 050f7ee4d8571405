//! The 0.1 layout, still decoded so that records written before an upgrade
//! replay after it:
//!
//! ```text
//! response:      'r' | fingerprint (32) | status (u16) | created at, Unix ms (u64)
//!                    | header block length (u32) | header block | body
//! unreplayable:  'u' | fingerprint (32) | status (u16) | created at, Unix ms (u64)
//! message:       'm' | fingerprint (32) | has result (u16: 1 or 0) | created at (u64) | result
//! header block:  for each header: name length (u16) | name | value length (u32) | value
//! ```

use bytes::Bytes;
use http::{HeaderName, HeaderValue};

use super::{
    HEAD,
    wire::{Reader, from_unix_millis},
};
use crate::record::{CompletedRecord, CorruptRecord, StoredResponse};

pub(crate) const RESPONSE: u8 = b'r';
pub(crate) const UNREPLAYABLE: u8 = b'u';
const MESSAGE: u8 = b'm';

/// Decodes a 0.1 record whose tag is `tag`.
pub(super) fn decode(bytes: &Bytes, tag: u8) -> Result<CompletedRecord, CorruptRecord> {
    let mut reader = Reader::new(bytes, HEAD);
    let status = reader.u16()?;
    let created_at = from_unix_millis(reader.u64()?);
    if tag == MESSAGE {
        let result = (status == 1).then(|| bytes.slice(reader.at..));
        return Ok(CompletedRecord::Message { result, created_at });
    }
    let status = super::status(status)?;
    match tag {
        UNREPLAYABLE => Ok(CompletedRecord::Unreplayable { status, created_at }),
        RESPONSE => {
            let block_len = reader.u32()? as usize;
            let mut block = Reader::new(reader.take(block_len)?, 0);
            let mut headers = Vec::new();
            while !block.at_end() {
                let name = block.u16()?;
                let name = HeaderName::from_bytes(block.take(usize::from(name))?)
                    .map_err(|_| CorruptRecord("header name"))?;
                let value = block.u32()? as usize;
                let value = HeaderValue::from_bytes(block.take(value)?)
                    .map_err(|_| CorruptRecord("header value"))?;
                headers.push((name, value));
            }
            let body = bytes.slice(reader.at..);
            Ok(CompletedRecord::Response(StoredResponse::from_parts(
                status, headers, body, created_at,
            )))
        }
        _ => Err(CorruptRecord("unknown record format")),
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, UNIX_EPOCH};

    use http::StatusCode;

    use super::*;
    use crate::fingerprint::Fingerprint;

    /// A response exactly as 0.1 wrote it.
    #[test]
    fn a_record_written_by_0_1_still_decodes() {
        let mut bytes = vec![b'r'];
        bytes.extend_from_slice(&[9; 32]);
        bytes.extend_from_slice(&201u16.to_be_bytes());
        bytes.extend_from_slice(&1_700_000_000_123u64.to_be_bytes());
        let name = b"location";
        let value = b"/x";
        bytes.extend_from_slice(&((2 + name.len() + 4 + value.len()) as u32).to_be_bytes());
        bytes.extend_from_slice(&(name.len() as u16).to_be_bytes());
        bytes.extend_from_slice(name);
        bytes.extend_from_slice(&(value.len() as u32).to_be_bytes());
        bytes.extend_from_slice(value);
        bytes.extend_from_slice(b"{}");
        let (fingerprint, record) = super::super::decode(bytes).unwrap();
        assert_eq!(fingerprint, Fingerprint::from_bytes([9; 32]));
        assert_eq!(
            record,
            CompletedRecord::Response(StoredResponse::from_parts(
                StatusCode::CREATED,
                vec![(http::header::LOCATION, HeaderValue::from_static("/x"))],
                Bytes::from_static(b"{}"),
                UNIX_EPOCH + Duration::from_millis(1_700_000_000_123),
            ))
        );

        let mut message = vec![b'm'];
        message.extend_from_slice(&[9; 32]);
        message.extend_from_slice(&1u16.to_be_bytes());
        message.extend_from_slice(&7u64.to_be_bytes());
        message.extend_from_slice(b"\"ch_1\"");
        assert_eq!(
            super::super::decode(message).unwrap().1,
            CompletedRecord::Message {
                result: Some(Bytes::from_static(b"\"ch_1\"")),
                created_at: UNIX_EPOCH + Duration::from_millis(7),
            }
        );
    }
}
