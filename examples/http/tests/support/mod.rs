//! Test support for the HTTP examples' tests: the `payments` example as a
//! process, and what the library's tests share — HTTP helpers, captured
//! logs, and the real services (from `tower-idempotency-harness`). Not every
//! test file uses every helper.
#![allow(dead_code, unused_imports)]

#[path = "../../../../tests/support/http.rs"]
pub mod http;
#[path = "../../../../tests/support/logs.rs"]
pub mod logs;
pub mod payments;
#[path = "../../../support/process.rs"]
pub mod process;

#[cfg(feature = "dynamodb")]
pub use tower_idempotency_harness::dynamodb;
#[cfg(feature = "mysql")]
pub use tower_idempotency_harness::mysql;
#[cfg(feature = "postgres")]
pub use tower_idempotency_harness::postgres;
pub use tower_idempotency_harness::{redis_server, relay, sqlite, tmpfs};
