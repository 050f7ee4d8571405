//! The layer's behaviour suite against the in-memory store and a real
//! single-node Redis (each test starts its own `redis-server`). The Redis
//! Cluster run of the same suite is in `cluster.rs`.

#[macro_use]
mod support;

use support::{backend, suite};

macro_rules! memory_tests {
    ($($case:ident),* $(,)?) => {
        mod memory {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $case() {
                    suite::$case(&backend::Memory).await;
                }
            )*
        }
    };
}

macro_rules! redis_tests {
    ($($case:ident),* $(,)?) => {
        mod redis {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $case() {
                    suite::$case(&backend::SingleRedis::start()).await;
                }
            )*
        }
    };
}

behaviour_cases!(memory_tests);
behaviour_cases!(redis_tests);
