//! The value stored under a record's key: one binary string, so the claim
//! reads it with one plain command and the scripts with one `GET`, and the
//! body is never re-encoded.
//!
//! ```text
//! in flight:  'i' | fingerprint (32) | lease token (16) | lease deadline, Unix ms (u64)
//! completed:  'C' | expiry, Unix ms (u48) | the crate's record codec ('R', 'U' or 'M' | fingerprint | …)
//! ```
//!
//! Integers are big-endian. The scripts read only the state byte and the
//! token (bytes 34 to 49, 1-based), and `extend` rewrites the deadline in
//! place (`SETRANGE` at 49, 0-based), which keeps the key's TTL. The times
//! are the writing server's clock: they inform `Retry-After` and how long
//! a replay cache may keep a record (with a margin), never a decision.
//! Completed values written by 0.1 (`'c'` and a u64 expiry, or a bare codec
//! record from before the expiry was stored) still decode.

use std::{
    sync::Arc,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use bytes::Bytes;

use crate::{
    fingerprint::Fingerprint,
    record::codec::{self, Compression},
    record::{CompletedRecord, CorruptRecord},
    store::{Claim, Found, FoundState, KeyState, LeaseToken, StoreError},
};

const IN_FLIGHT: u8 = b'i';
const COMPLETED: u8 = b'C';
/// 0.1's completed state, with a u64 expiry.
const COMPLETED_0_1: u8 = b'c';
/// State and fingerprint.
const HEAD: usize = 1 + 32;
/// Where an in-flight value's deadline starts (0-based), after the token.
const DEADLINE_AT: usize = HEAD + 16;

/// A replay cache keeps a record this much less than its stored expiry, so
/// that clocks of servers that disagree by up to this much never make it
/// outlive the store's copy.
const CLOCK_SKEW_MARGIN: Duration = Duration::from_secs(5);

fn unix_ms(at: SystemTime) -> u64 {
    at.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn until(unix_ms_at: u64) -> Duration {
    Duration::from_millis(unix_ms_at.saturating_sub(unix_ms(SystemTime::now())))
}

pub(super) fn in_flight(fingerprint: &Fingerprint, token: LeaseToken, lease: Duration) -> Vec<u8> {
    let mut blob = Vec::with_capacity(DEADLINE_AT + 8);
    blob.push(IN_FLIGHT);
    blob.extend_from_slice(fingerprint.as_bytes());
    blob.extend_from_slice(&token.to_bytes());
    blob.extend_from_slice(&deadline(lease));
    blob
}

/// Whether `value` is an in-flight claim held by `token`: what every
/// fenced write checks, whichever way it is sent.
pub(super) fn held_by(value: &[u8], token: LeaseToken) -> bool {
    is_in_flight(value) && value.get(HEAD..DEADLINE_AT) == Some(&token.to_bytes()[..])
}

/// `claim` (an in-flight value) with a lease starting now: what
/// `extend.lua` writes in place.
pub(super) fn extended(claim: &[u8], lease: Duration) -> Vec<u8> {
    let mut value = claim.to_vec();
    value.truncate(DEADLINE_AT);
    value.extend_from_slice(&deadline(lease));
    value
}

/// Whether `value` is an in-flight claim (anyone's).
pub(super) fn is_in_flight(value: &[u8]) -> bool {
    value.first() == Some(&IN_FLIGHT)
}

fn after(at: SystemTime, d: Duration) -> u64 {
    unix_ms(at).saturating_add(d.as_millis().try_into().unwrap_or(u64::MAX))
}

/// The deadline of a lease starting now, as stored.
pub(super) fn deadline(lease: Duration) -> [u8; 8] {
    after(SystemTime::now(), lease).to_be_bytes()
}

/// The expiry is counted from the record's creation, not from now: every
/// attempt at one completion writes the very same bytes (so a retry can
/// recognise an earlier attempt that Redis applied late), and it is never
/// later than Redis's own expiry, counted from the completion.
pub(super) fn completed(
    fingerprint: &Fingerprint,
    record: &CompletedRecord,
    retention: Duration,
    compression: &Compression,
) -> Vec<u8> {
    let expiry = after(record.created_at(), retention).min((1 << 48) - 1);
    let mut blob = Vec::with_capacity(1 + 6 + codec::encoded_len(record));
    blob.push(COMPLETED);
    blob.extend_from_slice(&expiry.to_be_bytes()[2..]);
    codec::encode_into(&mut blob, fingerprint, record, compression);
    blob
}

/// A completed value's expiry (Unix ms; `None` if it was not stored) and
/// its encoded record.
fn split_completed(found: Vec<u8>) -> Result<(Option<u64>, Bytes), CorruptRecord> {
    let truncated = CorruptRecord("truncated record");
    let found = Bytes::from(found);
    let (expiry, at) = match found.first() {
        Some(&COMPLETED) => {
            let mut wide = [0; 8];
            wide[2..].copy_from_slice(found.get(1..7).ok_or(truncated)?);
            (Some(u64::from_be_bytes(wide)), 7)
        }
        Some(&COMPLETED_0_1) => {
            let expiry = found.get(1..9).ok_or(truncated)?;
            (
                Some(u64::from_be_bytes(expiry.try_into().expect("8 bytes"))),
                9,
            )
        }
        // Written by 0.1 before the expiry was stored.
        Some(&(codec::legacy::RESPONSE | codec::legacy::UNREPLAYABLE)) => (None, 0),
        _ => return Err(CorruptRecord("unknown record state")),
    };
    Ok((expiry, found.slice(at..)))
}

/// What a claim found: the value `SET … NX GET` returned (`None`: the key
/// was free and is now ours), decided by the one rule.
pub(super) fn decode_claim(
    found: Option<Vec<u8>>,
    fingerprint: &Fingerprint,
    token: LeaseToken,
    lease: Duration,
    compression: &Compression,
) -> Result<Claim, StoreError> {
    match found {
        None => Ok(Claim::Acquired(token)),
        Some(found) => met(found, token, lease, compression)?.decide(fingerprint),
    }
}

/// A value a claim met, as [`Found::decide`] reads it.
fn met(
    found: Vec<u8>,
    token: LeaseToken,
    lease: Duration,
    compression: &Compression,
) -> Result<Found, CorruptRecord> {
    if is_in_flight(&found) {
        let stored = found.get(1..HEAD).ok_or(CorruptRecord("truncated claim"))?;
        let held = found
            .get(HEAD..DEADLINE_AT)
            .ok_or(CorruptRecord("truncated claim"))?;
        return Ok(Found {
            fingerprint: Ok(Fingerprint::from_bytes(
                stored.try_into().expect("32 bytes"),
            )),
            state: FoundState::InFlight {
                retry_after: until(lease_deadline(&found)?).min(lease),
                // Our own claim, sent twice (a client-side retry).
                ours: (held == token.to_bytes()).then_some(token),
            },
        });
    }
    let (expiry, record) = split_completed(found)?;
    let decoded = codec::decode_with(record, compression);
    // Not cacheable when the expiry is unknown.
    let expires_in = expiry.map_or(Duration::ZERO, |e| {
        until(e).saturating_sub(CLOCK_SKEW_MARGIN)
    });
    Ok(Found {
        fingerprint: decoded.as_ref().map(|(stored, _)| *stored).map_err(|e| *e),
        state: FoundState::Completed {
            record: decoded.map(|(_, record)| Arc::new(record)),
            expires_in,
        },
    })
}

fn lease_deadline(found: &[u8]) -> Result<u64, CorruptRecord> {
    let deadline = found
        .get(DEADLINE_AT..DEADLINE_AT + 8)
        .ok_or(CorruptRecord("truncated claim"))?;
    Ok(u64::from_be_bytes(deadline.try_into().expect("8 bytes")))
}

/// What a value tells an operator (see `Store::inspect`), exact about its
/// expiry: no cache margin.
pub(super) fn inspect(
    found: Option<Vec<u8>>,
    compression: &Compression,
) -> Result<KeyState, CorruptRecord> {
    let Some(found) = found else {
        return Ok(KeyState::Absent);
    };
    if is_in_flight(&found) {
        return Ok(KeyState::InFlight {
            retry_after: until(lease_deadline(&found)?),
        });
    }
    let (expiry, record) = split_completed(found)?;
    Ok(KeyState::Completed {
        record: Arc::new(codec::decode_with(record, compression)?.1),
        expires_in: expiry.map_or(Duration::ZERO, until),
    })
}

#[cfg(test)]
mod tests {
    use std::time::UNIX_EPOCH;

    use http::StatusCode;

    use super::*;

    fn record() -> CompletedRecord {
        CompletedRecord::Unreplayable {
            status: StatusCode::OK,
            created_at: UNIX_EPOCH + Duration::from_millis(unix_ms(SystemTime::now())),
        }
    }

    #[test]
    fn every_state_decodes_as_the_claim_decides() {
        let fp = Fingerprint::from_bytes([9; 32]);
        let other = Fingerprint::from_bytes([8; 32]);
        let (mine, theirs) = (LeaseToken::generate(), LeaseToken::generate());
        let lease = Duration::from_secs(30);
        let decode = |found: Vec<u8>, fp: &Fingerprint| {
            decode_claim(Some(found), fp, mine, lease, &Compression::none()).unwrap()
        };

        assert!(
            matches!(decode_claim(None, &fp, mine, lease, &Compression::none()), Ok(Claim::Acquired(t)) if t == mine)
        );
        let held = in_flight(&fp, theirs, lease);
        // extend.lua rewrites the deadline with SETRANGE at this offset.
        assert_eq!(DEADLINE_AT, 49);
        assert_eq!(held[0], IN_FLIGHT);
        assert_eq!(&held[HEAD..DEADLINE_AT], &theirs.to_bytes());
        assert!(
            matches!(decode(held.clone(), &fp), Claim::InFlight { retry_after } if retry_after <= lease && retry_after > lease - Duration::from_secs(5))
        );
        assert!(matches!(decode(held.clone(), &other), Claim::Mismatch));
        // The fence: the state byte and the token, whatever the deadline.
        assert!(held_by(&held, theirs) && !held_by(&held, mine));
        let later = extended(&held, lease * 2);
        assert_eq!(later.len(), held.len());
        assert_eq!(later[..DEADLINE_AT], held[..DEADLINE_AT]);
        assert!(held_by(&later, theirs) && is_in_flight(&later));
        assert!(
            matches!(decode(in_flight(&fp, mine, lease), &fp), Claim::Acquired(t) if t == mine)
        );

        let none = Compression::none();
        let now = record();
        let done = completed(&fp, &now, Duration::from_secs(3600), &none);
        // Every attempt at one completion writes the same bytes.
        assert_eq!(done, completed(&fp, &now, Duration::from_secs(3600), &none));
        match decode(done.clone(), &fp) {
            Claim::Completed {
                record: r,
                expires_in,
            } => {
                assert_eq!(*r, now);
                assert!(expires_in <= Duration::from_secs(3600) - CLOCK_SKEW_MARGIN);
                assert!(expires_in > Duration::from_secs(3500));
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(decode(done, &other), Claim::Mismatch));
        // 0.1's values: with a u64 expiry (cached), and from before the
        // expiry was stored (replayed, not cached).
        let mut legacy = vec![b'u'];
        legacy.extend_from_slice(fp.as_bytes());
        legacy.extend_from_slice(&200u16.to_be_bytes());
        legacy.extend_from_slice(&unix_ms(now.created_at()).to_be_bytes());
        let mut expiring = vec![b'c'];
        expiring.extend_from_slice(&(unix_ms(SystemTime::now()) + 3_600_000).to_be_bytes());
        expiring.extend_from_slice(&legacy);
        assert!(
            matches!(decode(expiring, &fp), Claim::Completed { record, expires_in } if *record == now && expires_in > Duration::from_secs(3500))
        );
        assert!(
            matches!(decode(legacy, &fp), Claim::Completed { record, expires_in } if *record == now && expires_in == Duration::ZERO)
        );
        // Absurd durations saturate; they never overflow.
        in_flight(&fp, mine, Duration::MAX);
        completed(&fp, &now, Duration::MAX, &none);
        assert!(decode_claim(Some(b"x".to_vec()), &fp, mine, lease, &Compression::none()).is_err());
        assert!(
            decode_claim(
                Some(b"i12".to_vec()),
                &fp,
                mine,
                lease,
                &Compression::none()
            )
            .is_err()
        );
    }
}
