//! The codec's integers: big-endian fixed widths and LEB128 lengths, and a
//! reader that turns every short read into a [`CorruptRecord`].

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::record::CorruptRecord;

/// The largest time a `u48` of milliseconds holds: the year 10889.
const U48_MAX: u64 = (1 << 48) - 1;

pub(super) fn put_u48(out: &mut Vec<u8>, value: u64) {
    out.extend_from_slice(&value.min(U48_MAX).to_be_bytes()[2..]);
}

/// LEB128: seven bits per byte, low bits first, the high bit set on every
/// byte but the last.
pub(super) fn put_varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push(value as u8 | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

pub(super) fn varint_len(value: u64) -> usize {
    (64 - (value | 1).leading_zeros() as usize).div_ceil(7)
}

/// Milliseconds since the Unix epoch (0 before it).
pub(super) fn unix_millis(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

pub(super) fn from_unix_millis(ms: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(ms)
}

/// Reads a record front to back.
pub(super) struct Reader<'a> {
    bytes: &'a [u8],
    /// How far into the record: where the unread rest starts.
    pub(super) at: usize,
}

impl<'a> Reader<'a> {
    pub(super) fn new(bytes: &'a [u8], at: usize) -> Self {
        Self { bytes, at }
    }

    pub(super) fn at_end(&self) -> bool {
        self.at >= self.bytes.len()
    }

    pub(super) fn take(&mut self, n: usize) -> Result<&'a [u8], CorruptRecord> {
        let field = self
            .bytes
            .get(self.at..self.at.saturating_add(n))
            .ok_or(CorruptRecord("truncated record"))?;
        self.at += n;
        Ok(field)
    }

    pub(super) fn u8(&mut self) -> Result<u8, CorruptRecord> {
        Ok(self.take(1)?[0])
    }

    pub(super) fn u16(&mut self) -> Result<u16, CorruptRecord> {
        Ok(u16::from_be_bytes(
            self.take(2)?.try_into().expect("2 bytes"),
        ))
    }

    pub(super) fn u32(&mut self) -> Result<u32, CorruptRecord> {
        Ok(u32::from_be_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }

    pub(super) fn u48(&mut self) -> Result<u64, CorruptRecord> {
        let mut wide = [0; 8];
        wide[2..].copy_from_slice(self.take(6)?);
        Ok(u64::from_be_bytes(wide))
    }

    pub(super) fn u64(&mut self) -> Result<u64, CorruptRecord> {
        Ok(u64::from_be_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }

    pub(super) fn varint(&mut self) -> Result<u64, CorruptRecord> {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let byte = self.u8()?;
            value |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                return Ok(value);
            }
        }
        Err(CorruptRecord("length too long"))
    }

    /// A field led by its LEB128 length.
    pub(super) fn prefixed(&mut self) -> Result<&'a [u8], CorruptRecord> {
        let len = usize::try_from(self.varint()?).map_err(|_| CorruptRecord("length too long"))?;
        self.take(len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints_round_trip_and_know_their_length() {
        for value in [
            0,
            1,
            127,
            128,
            300,
            16_383,
            16_384,
            u64::from(u32::MAX),
            u64::MAX,
        ] {
            let mut out = Vec::new();
            put_varint(&mut out, value);
            assert_eq!(out.len(), varint_len(value), "{value}");
            assert_eq!(Reader::new(&out, 0).varint().unwrap(), value);
        }
    }

    #[test]
    fn u48_round_trips_and_saturates() {
        let mut out = Vec::new();
        put_u48(&mut out, 1_700_000_000_123);
        put_u48(&mut out, u64::MAX);
        let mut reader = Reader::new(&out, 0);
        assert_eq!(reader.u48().unwrap(), 1_700_000_000_123);
        assert_eq!(reader.u48().unwrap(), U48_MAX);
        assert!(reader.u8().is_err());
    }
}
