//! Test support shared by the integration tests: the example processes,
//! an app that counts its executions, HTTP helpers, captured logs, and the
//! real services (from `tower-idempotency-harness`). Not every test file
//! uses every helper.
#![allow(dead_code, unused_imports)]

pub mod app;
pub mod backend;
pub mod consumer;
pub mod http;
pub mod logs;
pub mod payments;

pub use tower_idempotency_harness::{
    amqp, cluster, galera, mysql, nats, postgres, redis_server, relay, sqlite, sqs, tmpfs,
};
