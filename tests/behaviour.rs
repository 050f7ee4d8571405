//! The layer's behaviour suite against the in-memory store, a real
//! single-node Redis (each test starts its own `redis-server`), the same
//! Redis behind the in-process replay cache, and PostgreSQL (plain mode, a
//! throwaway database per test). The Redis
//! Cluster run of the same suite is in `cluster.rs`.

#[macro_use]
mod support;

use support::{backend, suite};

/// One test per case, in module `$module`, each against a fresh `$backend`.
macro_rules! tests_for {
    ($module:ident, $backend:expr; $($case:ident),* $(,)?) => {
        mod $module {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $case() {
                    suite::$case(&$backend).await;
                }
            )*
        }
    };
}

behaviour_cases!(tests_for, memory, backend::Memory);
behaviour_cases!(tests_for, redis, backend::SingleRedis::start());
behaviour_cases!(tests_for, cached_redis, backend::CachedRedis::start());
behaviour_cases!(tests_for, postgres, backend::Postgres::start());
behaviour_cases!(tests_for, postgres_tx, backend::PostgresTx::start());
behaviour_cases!(tests_for, sqlite, backend::Sqlite::start());
behaviour_cases!(tests_for, sqlite_tx, backend::SqliteTx::start());

lease_cases!(tests_for, memory_leases, backend::Memory);
lease_cases!(tests_for, redis_leases, backend::SingleRedis::start());
lease_cases!(
    tests_for,
    cached_redis_leases,
    backend::CachedRedis::start()
);
lease_cases!(tests_for, postgres_leases, backend::Postgres::start());
lease_cases!(tests_for, sqlite_leases, backend::Sqlite::start());
