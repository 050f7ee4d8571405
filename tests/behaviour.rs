//! The layer's behaviour suite against the in-memory store, a real
//! single-node Redis (each test starts its own `redis-server`), and the same
//! Redis behind the in-process replay cache. The Redis
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

macro_rules! cached_redis_tests {
    ($($case:ident),* $(,)?) => {
        mod cached_redis {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $case() {
                    suite::$case(&backend::CachedRedis::start()).await;
                }
            )*
        }
    };
}

behaviour_cases!(memory_tests);
behaviour_cases!(redis_tests);
behaviour_cases!(cached_redis_tests);
