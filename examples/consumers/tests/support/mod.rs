//! Test support for the consumers' tests: the consumer examples as
//! processes, the brokers they consume from (a RabbitMQ queue, an SQS
//! server, a NATS JetStream server, each the test's own), and the databases
//! (from `tower-idempotency-harness`). Not every test file uses every
//! helper.
#![allow(dead_code, unused_imports)]

pub mod amqp;
pub mod consumer;
mod dead_letter;
pub mod fixture;
pub mod kafka;
pub mod nats;
#[path = "../../../support/process.rs"]
pub mod process;
pub mod sqs;

pub use dead_letter::DeadLetter;
pub use tower_idempotency_harness::{mysql, postgres, redis_server, relay, sqlite};
