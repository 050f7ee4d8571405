//! The door's choices — where a call's key is, which tools need one, which
//! are never guarded — and the fingerprint it hands the protocol: what
//! the layer builds and the service reads.

use std::collections::HashSet;

use super::call::KeyPlace;
use crate::fingerprint::{Fingerprint, FingerprintStrategy};

/// The door's choices, shared by its services.
#[derive(Clone, Debug)]
pub(crate) struct Door {
    pub(crate) key: KeyPlace,
    pub(crate) require_key: Required,
    /// Tools whose calls pass through unguarded.
    pub(crate) unguarded: HashSet<String>,
}

/// Which guarded tools refuse a call without a key.
#[derive(Clone, Debug)]
pub(crate) enum Required {
    Every,
    These(HashSet<String>),
}

impl Door {
    pub(crate) fn requires_key(&self, tool: &str) -> bool {
        match &self.require_key {
            Required::Every => true,
            Required::These(tools) => tools.contains(tool),
        }
    }
}

/// A call's fingerprint, read by the door before the protocol runs.
#[derive(Clone, Copy, Debug)]
pub(crate) struct CallFingerprint(pub(crate) Fingerprint);

/// The fingerprint the door computed (the tool and its arguments), for
/// the protocol that asks for one.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct ToolCallFingerprint;

impl FingerprintStrategy for ToolCallFingerprint {
    fn fingerprint(&self, parts: &http::request::Parts, _body: &[u8]) -> Fingerprint {
        parts
            .extensions
            .get::<CallFingerprint>()
            .expect("the door fingerprints every call it guards")
            .0
    }
}
