//! Names for the lists of features the code asks for, each stated once
//! here rather than in every `cfg` that needs it.

fn main() {
    cfg_aliases::cfg_aliases! {
        // Any SQL engine: the SQL store family, its outbox.
        sql: { any(feature = "postgres", feature = "mysql", feature = "sqlite") },
        // A store outside the process, whose TTLs are whole milliseconds.
        outside_store: { any(feature = "redis", sql, feature = "dynamodb") },
        // Every SQL engine: below it, some of an engine's choices go unused.
        every_sql: { all(feature = "postgres", feature = "mysql", feature = "sqlite") },
        // Every store: what the integration tests run against.
        every_store: { all(
            feature = "redis",
            feature = "cluster",
            feature = "cache",
            every_sql,
            feature = "dynamodb",
            feature = "testing"
        ) },
    }
}
