//! The value stored under a record's key: one binary string, so each script
//! reads and writes it with one command and never re-encodes the body.
//!
//! ```text
//! in flight:     'i' | fingerprint (32) | lease token (16)
//! completed:     the crate's record codec ('r' or 'u' | fingerprint (32) | …)
//! ```
//!
//! The scripts read only the first 49 bytes (state, fingerprint, token), at
//! these offsets.

use crate::{codec::HEAD, fingerprint::Fingerprint, store::LeaseToken};

const IN_FLIGHT: u8 = b'i';

pub(super) fn in_flight(fingerprint: &Fingerprint, token: LeaseToken) -> [u8; HEAD + 16] {
    let mut blob = [0; HEAD + 16];
    blob[0] = IN_FLIGHT;
    blob[1..HEAD].copy_from_slice(fingerprint.as_bytes());
    blob[HEAD..].copy_from_slice(&token.to_bytes());
    blob
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec;

    #[test]
    fn in_flight_layout_matches_the_scripts() {
        let fp = Fingerprint::from_bytes([9; 32]);
        let token = LeaseToken::generate();
        let claim = in_flight(&fp, token);
        assert_eq!(
            (claim[0], &claim[HEAD..]),
            (IN_FLIGHT, &token.to_bytes()[..])
        );
        // The scripts find the fingerprint where the codec puts it.
        assert_eq!(codec::fingerprint(&claim), Some(fp));
        assert_ne!(IN_FLIGHT, codec::RESPONSE);
        assert_ne!(IN_FLIGHT, codec::UNREPLAYABLE);
    }
}
