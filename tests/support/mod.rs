//! Test support shared by the integration tests: an app that counts its
//! executions, the stores under test, HTTP helpers, captured logs, and the
//! real services (from `tower-idempotency-harness`). Not every test file
//! uses every helper.
#![allow(dead_code, unused_imports)]

pub mod app;
pub mod backend;
pub mod http;
pub mod logs;

pub use tower_idempotency_harness::{
    cluster, dynamodb, galera, mysql, postgres, redis_server, relay, sqlite, tmpfs,
};
