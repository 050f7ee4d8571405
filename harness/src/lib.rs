//! The real services tower-idempotency's tests and benchmarks run against.
//! Nothing here is mocked: each fixture is a real server process, database,
//! file or queue, made for one test and removed after it. A service that is
//! missing makes the fixture panic with what to install, never a silent
//! skip.

pub mod cluster;
pub mod cpu;
#[cfg(feature = "dynamodb")]
pub mod dynamodb;
#[cfg(feature = "galera")]
pub mod galera;
#[cfg(feature = "mysql")]
pub mod mysql;
#[cfg(feature = "postgres")]
pub mod postgres;
pub mod redis_server;
pub mod relay;
#[cfg(feature = "sqlite")]
pub mod sqlite;
pub mod tmpfs;

/// Runs `f` on its own thread and runtime: set-up and tear-down happen
/// from synchronous places (constructors, `Drop`), inside tests' runtimes.
#[cfg(any(feature = "postgres", feature = "mysql"))]
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
