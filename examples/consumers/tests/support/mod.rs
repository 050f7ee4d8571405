//! Test support for the consumers' tests: the consumer examples as
//! processes, the brokers they consume from (a RabbitMQ queue, an SQS
//! server, a NATS JetStream server, each the test's own), and the databases
//! (from `tower-idempotency-harness`). Not every test file uses every
//! helper.
#![allow(dead_code, unused_imports)]

pub mod amqp;
pub mod consumer;
pub mod fixture;
pub mod kafka;
pub mod nats;
#[path = "../../../support/process.rs"]
pub mod process;
pub mod sqs;

pub use tower_idempotency_harness::{mysql, postgres, redis_server, relay, sqlite};

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
