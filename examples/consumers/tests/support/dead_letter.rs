//! A dead letter as the tests read it back, on every broker.

use std::collections::HashMap;

use tower_idempotency::message::{DeadLetterField, HeaderStyle};

/// A dead letter read back: its body and its headers (message attributes
/// on SQS), named as its broker spells the dead-letter contract.
#[derive(Debug)]
pub struct DeadLetter {
    pub body: String,
    pub headers: HashMap<String, String>,
    pub style: HeaderStyle,
}

impl DeadLetter {
    /// The contract's `field`, if the dead letter carries it.
    pub fn field(&self, field: DeadLetterField) -> Option<&str> {
        self.headers
            .get(field.name(self.style)?)
            .map(String::as_str)
    }

    /// Its reason's kind (none where the broker moved it itself).
    pub fn kind(&self) -> Option<String> {
        self.field(DeadLetterField::Kind).map(str::to_owned)
    }

    /// Its body and its reason's kind.
    pub fn body_and_kind(&self) -> (String, Option<String>) {
        (self.body.clone(), self.kind())
    }
}
