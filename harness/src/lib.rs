//! The real services tower-idempotency's tests and benchmarks run against.
//! Nothing here is mocked: each fixture is a real server process, database,
//! file or queue, made for one test and removed after it. A service that is
//! missing makes the fixture panic with what to install, never a silent
//! skip.

pub mod amqp;
pub mod cluster;
pub mod galera;
pub mod mysql;
pub mod nats;
pub mod postgres;
pub mod redis_server;
pub mod relay;
pub mod sqlite;
pub mod sqs;
pub mod tmpfs;

/// Runs `f` on its own thread and runtime: set-up and tear-down happen
/// from synchronous places (constructors, `Drop`), inside tests' runtimes.
pub(crate) fn blocking<T: Send + 'static>(f: impl AsyncFnOnce() -> T + Send + 'static) -> T {
    std::thread::spawn(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(f())
    })
    .join()
    .expect("set-up thread")
}
