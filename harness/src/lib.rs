//! The real services tower-idempotency's tests and benchmarks run against.
//! Nothing here is mocked: each fixture is a real server process, database,
//! file or queue, made for one test and removed after it. A service that is
//! missing makes the fixture panic with what to install, never a silent
//! skip.

pub mod amqp;
pub mod cluster;
pub mod mysql;
pub mod postgres;
pub mod redis_server;
pub mod relay;
pub mod sqlite;
pub mod tmpfs;
