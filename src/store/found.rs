//! What a record found under a key decides — the one rule every store
//! calls, its own and custom ones: each maps its row, blob or item to a
//! [`Found`], none decides on its own.

use std::{sync::Arc, time::Duration};

use super::{Claim, LeaseToken, StoreError};
use crate::{
    fingerprint::Fingerprint,
    record::{CompletedRecord, CorruptRecord},
};

/// What a store found under a key, live (not expired), read from its row,
/// blob or item and not yet judged: what [`Found::decide`] reads. Each part
/// the store could not read is an `Err`, so that the rule — not the store —
/// decides what an unreadable record means.
///
/// # Examples
///
/// A store maps what it holds, then lets the rule decide:
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::{
///     CorruptRecord, Fingerprint,
///     store::{Claim, Found, FoundState, LeaseToken},
/// };
///
/// let mine = Fingerprint::from_bytes([1; 32]);
/// let other = Fingerprint::from_bytes([2; 32]);
/// let in_flight = Found::<LeaseToken> {
///     fingerprint: Ok(mine),
///     state: FoundState::InFlight { retry_after: Duration::from_secs(3), ours: None },
/// };
/// assert!(matches!(in_flight.decide(&mine), Ok(Claim::InFlight { .. })));
///
/// // A record that cannot be read is an error under any fingerprint —
/// // never a mismatch, never a claim to run again.
/// let unreadable = Found::<LeaseToken> {
///     fingerprint: Ok(mine),
///     state: FoundState::Completed {
///         record: Err(CorruptRecord("truncated")),
///         expires_in: Duration::from_secs(60),
///     },
/// };
/// assert!(unreadable.decide(&other).is_err());
/// ```
#[derive(Clone, Debug)]
pub struct Found<G = LeaseToken> {
    /// The fingerprint stored with it.
    pub fingerprint: Result<Fingerprint, CorruptRecord>,
    /// What it is.
    pub state: FoundState<G>,
}

/// A found record's state: see [`Found`].
#[derive(Clone, Debug)]
pub enum FoundState<G = LeaseToken> {
    /// A claim in flight, its lease (or its transaction) live for about
    /// `retry_after`.
    InFlight {
        /// How long until it lapses.
        retry_after: Duration,
        /// The caller's own claim, met again — a claim command the store
        /// sent twice after losing its answer: the grant to hand back.
        ours: Option<G>,
    },
    /// A completed record.
    Completed {
        /// The record, decoded.
        record: Result<Arc<CompletedRecord>, CorruptRecord>,
        /// How long the store keeps it.
        expires_in: Duration,
    },
}

impl<G> Found<G> {
    /// What the record tells a claim with `fingerprint`, in this order:
    /// anything unreadable is an error (under any fingerprint — never a
    /// mismatch, never a claim granted over it); another fingerprint is a
    /// [`Claim::Mismatch`]; the caller's own claim met again is its grant;
    /// another claim in flight is [`Claim::InFlight`]; a completed record
    /// is a replay ([`Claim::Completed`]). A record that expired, or a
    /// claim whose lease lapsed, is not found: the store's claim takes it
    /// over, conditionally, and grants it.
    ///
    /// # Errors
    ///
    /// [`StoreError::Corrupt`] when any part of the record is unreadable.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::{sync::Arc, time::{Duration, UNIX_EPOCH}};
    /// use tower_idempotency::{
    ///     CompletedRecord, Fingerprint,
    ///     store::{Claim, Found, FoundState, LeaseToken},
    /// };
    ///
    /// let mine = Fingerprint::from_bytes([1; 32]);
    /// let record = Arc::new(CompletedRecord::Unreplayable {
    ///     status: http::StatusCode::CREATED,
    ///     created_at: UNIX_EPOCH,
    /// });
    /// let done = Found::<LeaseToken> {
    ///     fingerprint: Ok(mine),
    ///     state: FoundState::Completed { record: Ok(record), expires_in: Duration::from_secs(60) },
    /// };
    /// assert!(matches!(done.clone().decide(&mine), Ok(Claim::Completed { .. })));
    /// assert!(matches!(done.decide(&Fingerprint::from_bytes([2; 32])), Ok(Claim::Mismatch)));
    /// ```
    pub fn decide(self, fingerprint: &Fingerprint) -> Result<Claim<G>, StoreError> {
        // All of it read before anything is compared.
        let stored = self.fingerprint?;
        let claim = match self.state {
            FoundState::Completed { record, expires_in } => Claim::Completed {
                record: record?,
                expires_in,
            },
            FoundState::InFlight {
                ours: Some(grant), ..
            } => Claim::Acquired(grant),
            FoundState::InFlight {
                retry_after,
                ours: None,
            } => Claim::InFlight { retry_after },
        };
        Ok(if stored == *fingerprint {
            claim
        } else {
            Claim::Mismatch
        })
    }
}

#[cfg(test)]
mod tests {
    use std::time::UNIX_EPOCH;

    use super::*;

    const MINE: Fingerprint = Fingerprint::from_bytes([1; 32]);
    const OTHER: Fingerprint = Fingerprint::from_bytes([2; 32]);
    const BROKEN: CorruptRecord = CorruptRecord("planted");

    fn record() -> Arc<CompletedRecord> {
        Arc::new(CompletedRecord::Unreplayable {
            status: http::StatusCode::CREATED,
            created_at: UNIX_EPOCH,
        })
    }

    fn found(fingerprint: Result<Fingerprint, CorruptRecord>, state: FoundState<u8>) -> Found<u8> {
        Found { fingerprint, state }
    }

    fn in_flight(ours: Option<u8>) -> FoundState<u8> {
        FoundState::InFlight {
            retry_after: Duration::from_secs(1),
            ours,
        }
    }

    fn completed(record: Result<Arc<CompletedRecord>, CorruptRecord>) -> FoundState<u8> {
        FoundState::Completed {
            record,
            expires_in: Duration::from_secs(1),
        }
    }

    /// Every state, under both fingerprints, readable or not: the table
    /// the rule is.
    #[test]
    fn each_found_record_decides_one_way() {
        for asked in [MINE, OTHER] {
            let same = asked == MINE;
            // Unreadable, under any fingerprint: an error.
            for unreadable in [
                found(Err(BROKEN), in_flight(None)),
                found(Err(BROKEN), completed(Ok(record()))),
                found(Ok(MINE), completed(Err(BROKEN))),
                found(Err(BROKEN), completed(Err(BROKEN))),
            ] {
                assert!(
                    matches!(unreadable.decide(&asked), Err(StoreError::Corrupt(_))),
                    "asked the same fingerprint: {same}"
                );
            }
            let decided = |f: Found<u8>| f.decide(&asked).unwrap();
            for readable in [
                found(Ok(MINE), in_flight(None)),
                found(Ok(MINE), in_flight(Some(7))),
                found(Ok(MINE), completed(Ok(record()))),
            ] {
                let claim = decided(readable.clone());
                if !same {
                    assert!(matches!(claim, Claim::Mismatch));
                    continue;
                }
                match readable.state {
                    FoundState::InFlight { ours: Some(7), .. } => {
                        assert!(matches!(claim, Claim::Acquired(7)))
                    }
                    FoundState::InFlight { .. } => {
                        assert!(matches!(claim, Claim::InFlight { .. }))
                    }
                    FoundState::Completed { .. } => {
                        assert!(matches!(claim, Claim::Completed { .. }))
                    }
                }
            }
        }
    }
}
