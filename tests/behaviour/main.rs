//! The layer's behaviour, every case against every store: in memory; a real
//! single-node Redis (each test starts its own `redis-server`), the same
//! behind the in-process replay cache, and a real three-master Redis
//! Cluster — each on Redis 7 (fenced writes by scripts) and on Valkey 9
//! (by plain commands); PostgreSQL, SQLite and MySQL/MariaDB, each plain and
//! transactional (a throwaway database or file per test); DynamoDB, lease
//! and transactional (a dynoxide server per test). The cases are in `cases/`; the
//! lease cases run on the stores whose claims are leases.

// The suite runs against every store: `cargo test --all-features`.
#![cfg(every_store)]

#[path = "../support/mod.rs"]
mod support;

mod cases;

use cases::{behaviour_cases, lease_cases, transaction_cases};
use support::backend;

/// One test per case, in module `$module`, each against a fresh `$backend`.
macro_rules! tests_for {
    ($module:ident, $backend:expr; $($case:ident),* $(,)?) => {
        mod $module {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $case() {
                    cases::$case(&$backend).await;
                }
            )*
        }
    };
}

behaviour_cases!(tests_for, memory, backend::Memory);
behaviour_cases!(tests_for, redis, backend::SingleRedis::start());
behaviour_cases!(tests_for, cached_redis, backend::CachedRedis::start());
behaviour_cases!(tests_for, valkey, backend::SingleRedis::valkey());
behaviour_cases!(tests_for, cached_valkey, backend::CachedRedis::valkey());
behaviour_cases!(tests_for, postgres, backend::Postgres::start());
behaviour_cases!(tests_for, postgres_tx, backend::PostgresTx::start());
behaviour_cases!(tests_for, sqlite, backend::Sqlite::start());
behaviour_cases!(tests_for, sqlite_tx, backend::SqliteTx::start());
behaviour_cases!(tests_for, mysql, backend::MySql::start());
behaviour_cases!(tests_for, mysql_tx, backend::MySqlTx::start());
behaviour_cases!(tests_for, dynamodb, backend::Dynamo::start());
behaviour_cases!(tests_for, dynamodb_tx, backend::DynamoTxBackend::start());

lease_cases!(tests_for, memory_leases, backend::Memory);
lease_cases!(tests_for, redis_leases, backend::SingleRedis::start());
lease_cases!(tests_for, valkey_leases, backend::SingleRedis::valkey());
lease_cases!(
    tests_for,
    cached_redis_leases,
    backend::CachedRedis::start()
);
lease_cases!(tests_for, postgres_leases, backend::Postgres::start());
lease_cases!(tests_for, sqlite_leases, backend::Sqlite::start());
lease_cases!(tests_for, mysql_leases, backend::MySql::start());
lease_cases!(tests_for, dynamodb_leases, backend::Dynamo::start());

transaction_cases!(
    tests_for,
    postgres_tx_transactions,
    backend::PostgresTx::start()
);
transaction_cases!(
    tests_for,
    sqlite_tx_transactions,
    backend::SqliteTx::start()
);
transaction_cases!(tests_for, mysql_tx_transactions, backend::MySqlTx::start());

/// Every case in one test against one cluster (starting one takes seconds);
/// each case gets a fresh key prefix.
macro_rules! on_one_cluster {
    ($name:ident, $cluster:expr; $($case:ident),* $(,)?) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn $name() {
            let cluster = $cluster;
            $(
                eprintln!("cluster case: {}", stringify!($case));
                cases::$case(&cluster).await;
            )*
        }
    };
}

behaviour_cases!(
    on_one_cluster,
    every_case_on_a_three_master_cluster,
    backend::Cluster::start()
);
lease_cases!(
    on_one_cluster,
    lease_cases_on_a_three_master_cluster,
    backend::Cluster::start()
);
behaviour_cases!(
    on_one_cluster,
    every_case_on_a_three_master_valkey_cluster,
    backend::Cluster::valkey()
);
lease_cases!(
    on_one_cluster,
    lease_cases_on_a_three_master_valkey_cluster,
    backend::Cluster::valkey()
);
