//! A store opened from its URL, and what the commands ask of it.
//!
//! A SQL table is opened as an operator sees it (`SqlRecords`): whichever
//! store writes it, leases or transactions, it reads committed records and
//! probes for a transaction's claim in flight (an uncommitted row no query
//! sees) without waiting for it, and claims nothing — so it needs no
//! start-up check, and no write rights to look up and count.

use tower_idempotency::{
    MySqlStore, PostgresStore, RedisStore, SqliteStore,
    redis::{self, AsyncCommands},
    store::{
        Forgotten, KeyState, StorageKey, Store, StoreError, mysql::MySql, postgres::Postgres,
        sql::SqlRecords, sqlite::Sqlite,
    },
};

use crate::{Failure, report::Report};

pub(crate) enum Opened {
    Redis {
        store: RedisStore,
        client: redis::Client,
        prefix: String,
    },
    Postgres(SqlRecords<Postgres>),
    MySql(SqlRecords<MySql>),
    Sqlite(SqlRecords<Sqlite>),
}

/// Opens one engine's table.
macro_rules! sql {
    ($store:ident, $url:expr, $table:expr) => {
        $store::builder()
            .table($table)
            .records()
            .connect($url)
            .await?
    };
}

/// `$body` with `$sql` bound to the SQL variant's stores, whichever engine.
macro_rules! each_sql {
    ($opened:expr, $sql:ident => $body:expr, redis $redis:pat => $other:expr) => {
        match $opened {
            Opened::Postgres($sql) => $body,
            Opened::MySql($sql) => $body,
            Opened::Sqlite($sql) => $body,
            $redis => $other,
        }
    };
}

impl Opened {
    /// The store `url` names: `table` for SQL, `prefix` for Redis.
    pub(crate) async fn connect(url: &str, table: &str, prefix: &str) -> Result<Self, Failure> {
        let scheme = url.split_once("://").map_or("", |(scheme, _)| scheme);
        Ok(match scheme {
            "redis" | "rediss" => Opened::Redis {
                store: RedisStore::builder().prefix(prefix).connect(url).await?,
                client: redis::Client::open(url).map_err(StoreError::from)?,
                prefix: prefix.to_owned(),
            },
            "postgres" | "postgresql" => Opened::Postgres(sql!(PostgresStore, url, table)),
            "mysql" | "mariadb" => {
                let url = url.replacen("mariadb://", "mysql://", 1);
                Opened::MySql(sql!(MySqlStore, &url, table))
            }
            "sqlite" => {
                // An operator's typo must not leave an empty database behind.
                let path = url["sqlite://".len()..].split('?').next().unwrap_or("");
                if !path.is_empty() && !std::path::Path::new(path).exists() {
                    return Err(Failure::Usage(format!("no SQLite database at {path}")));
                }
                Opened::Sqlite(sql!(SqliteStore, url, table))
            }
            _ => {
                return Err(Failure::Usage(format!(
                    "the store URL {url:?} names no store this tool opens: use redis://, rediss://, \
                     postgres://, mysql:// (MySQL and MariaDB) or sqlite://FILE"
                )));
            }
        })
    }

    /// The store's name for `key`, where it has one of its own (Redis).
    pub(crate) fn redis_key(&self, key: &StorageKey) -> Option<String> {
        match self {
            Opened::Redis { store, .. } => Some(store.redis_key(key)),
            _ => None,
        }
    }

    pub(crate) async fn inspect(&self, key: &StorageKey) -> Result<KeyState, StoreError> {
        each_sql!(self, sql => sql.inspect(key).await, redis Opened::Redis { store, .. } => store.inspect(key).await)
    }

    /// Forgets `key` as the admin routes do: a completed record; a claim
    /// in flight only by `force`, and never a transaction's.
    pub(crate) async fn forget(
        &self,
        key: &StorageKey,
        force: bool,
    ) -> Result<Forgotten, StoreError> {
        each_sql!(self, sql => sql.forget(key, force).await, redis Opened::Redis { store, .. } => store.forget(key, force).await)
    }

    /// Deletes every expired record, `batch` at a time; how many.
    pub(crate) async fn sweep(&self, batch: u32) -> Result<u64, Failure> {
        each_sql!(self, sql => {
            let mut deleted = 0;
            loop {
                let swept = sql.delete_expired(batch).await?;
                deleted += swept;
                if swept < u64::from(batch) {
                    return Ok(deleted);
                }
            }
        }, redis Opened::Redis { .. } => Err(Failure::Usage(
            "Redis records expire by themselves (each has a TTL): there is nothing to sweep".into(),
        )))
    }

    pub(crate) async fn stats(&self) -> Result<Report, Failure> {
        each_sql!(self, sql => Ok(Report::table(sql.stats().await?)), redis Opened::Redis { client, prefix, .. } => {
            redis_stats(client, prefix).await.map_err(|e| Failure::Store(e.into()))
        })
    }
}

/// The keys under `prefix` (a `SCAN`, which the server answers in steps),
/// and the server's memory and eviction policy.
async fn redis_stats(client: &redis::Client, prefix: &str) -> redis::RedisResult<Report> {
    let mut connection = client.get_multiplexed_async_connection().await?;
    let pattern = format!("{}*", escape_glob(prefix));
    let mut keys = 0u64;
    {
        let mut scan = connection.scan_match::<_, Vec<u8>>(&pattern).await?;
        while let Some(key) = scan.next_item().await {
            key?;
            keys += 1;
        }
    }
    let memory: String = redis::cmd("INFO")
        .arg("memory")
        .query_async(&mut connection)
        .await?;
    let field = |name: &str| {
        memory
            .lines()
            .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
            .map(|v| v.trim().to_owned())
    };
    Ok(Report::redis(
        keys,
        field("used_memory").and_then(|v| v.parse().ok()),
        field("maxmemory_policy"),
    ))
}

/// `prefix` as a literal in a `SCAN MATCH` pattern.
fn escape_glob(prefix: &str) -> String {
    let mut out = String::with_capacity(prefix.len());
    for c in prefix.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}
