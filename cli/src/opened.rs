//! A store opened from its URL, and what the commands ask of it.
//!
//! A SQL table is opened as an operator sees it (`SqlRecords`): whichever
//! store writes it, leases or transactions, it reads committed records and
//! probes for a transaction's claim in flight (an uncommitted row no query
//! sees) without waiting for it, and claims nothing — so it needs no
//! start-up check, and no write rights to look up and count.

use std::time::Duration;

use tower_idempotency::{
    DynamoDbStore, MySqlStore, PostgresStore, RedisStore, SqliteStore,
    outbox::{Outbox, OutboxTable},
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
    DynamoDb(DynamoDbStore),
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

/// Deletes a SQL table's expired records, `batch` at a time; how many.
macro_rules! sweep_sql {
    ($sql:expr, $batch:expr) => {{
        let mut deleted = 0;
        loop {
            let swept = $sql.delete_expired($batch).await?;
            deleted += swept;
            if swept < u64::from($batch) {
                break Ok(deleted);
            }
        }
    }};
}

/// `$body` with `$sql` bound to the SQL variant's stores, whichever engine;
/// `$store` bound to a lease store (Redis, DynamoDB) for `$lease`.
macro_rules! each_sql {
    ($opened:expr, $sql:ident => $body:expr, lease $store:ident => $lease:expr) => {
        match $opened {
            Opened::Postgres($sql) => $body,
            Opened::MySql($sql) => $body,
            Opened::Sqlite($sql) => $body,
            Opened::Redis { store: $store, .. } => $lease,
            Opened::DynamoDb($store) => $lease,
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
            // dynamodb://TABLE, through the AWS environment (credentials,
            // region, AWS_ENDPOINT_URL) as any SDK client.
            "dynamodb" => {
                let table = &url["dynamodb://".len()..];
                if table.is_empty() {
                    return Err(Failure::Usage(
                        "dynamodb://TABLE names the table: dynamodb://idempotency_records".into(),
                    ));
                }
                let config = aws_config::load_from_env().await;
                let client = tower_idempotency::aws_sdk_dynamodb::Client::new(&config);
                Opened::DynamoDb(DynamoDbStore::builder(client).table(table).build().await?)
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
                     postgres://, mysql:// (MySQL and MariaDB), sqlite://FILE or dynamodb://TABLE"
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
        each_sql!(self, sql => sql.inspect(key).await, lease store => store.inspect(key).await)
    }

    /// Forgets `key` as the admin routes do: a completed record; a claim
    /// in flight only by `force`, and never a transaction's.
    pub(crate) async fn forget(
        &self,
        key: &StorageKey,
        force: bool,
    ) -> Result<Forgotten, StoreError> {
        each_sql!(self, sql => sql.forget(key, force).await, lease store => store.forget(key, force).await)
    }

    /// Deletes every expired record, `batch` at a time; how many.
    pub(crate) async fn sweep(&self, batch: u32) -> Result<u64, Failure> {
        let expire_themselves = |what: &str| {
            Err(Failure::Usage(format!(
                "{what} records expire by themselves: there is nothing to sweep"
            )))
        };
        match self {
            Opened::Redis { .. } => expire_themselves("Redis (each has a TTL)"),
            Opened::DynamoDb(_) => expire_themselves(
                "DynamoDB (its TTL deletes them; an expired one already reads as absent)",
            ),
            Opened::Postgres(sql) => sweep_sql!(sql, batch),
            Opened::MySql(sql) => sweep_sql!(sql, batch),
            Opened::Sqlite(sql) => sweep_sql!(sql, batch),
        }
    }

    pub(crate) async fn stats(&self) -> Result<Report, Failure> {
        match self {
            Opened::Redis { client, prefix, .. } => redis_stats(client, prefix)
                .await
                .map_err(|e| Failure::Store(e.into())),
            Opened::DynamoDb(store) => Ok(Report::table(store.stats().await?, false)),
            Opened::Postgres(sql) => Ok(Report::table(sql.stats().await?, true)),
            Opened::MySql(sql) => Ok(Report::table(sql.stats().await?, true)),
            Opened::Sqlite(sql) => Ok(Report::table(sql.stats().await?, true)),
        }
    }
}

/// The outbox beside a SQL store's records, whichever engine.
pub(crate) enum OpenedOutbox {
    Postgres(Outbox<Postgres>),
    MySql(Outbox<MySql>),
    Sqlite(Outbox<Sqlite>),
}

/// `$body` with `$outbox` bound to the outbox, whichever engine.
macro_rules! each_outbox {
    ($opened:expr, $outbox:ident => $body:expr) => {
        match $opened {
            OpenedOutbox::Postgres($outbox) => $body,
            OpenedOutbox::MySql($outbox) => $body,
            OpenedOutbox::Sqlite($outbox) => $body,
        }
    };
}

impl Opened {
    /// The outbox in table `table` of this SQL store's database.
    pub(crate) async fn outbox(&self, table: &str) -> Result<OpenedOutbox, Failure> {
        Ok(match self {
            Opened::Postgres(records) => {
                OpenedOutbox::Postgres(Outbox::beside(records).table(table).build().await?)
            }
            Opened::MySql(records) => {
                OpenedOutbox::MySql(Outbox::beside(records).table(table).build().await?)
            }
            Opened::Sqlite(records) => {
                OpenedOutbox::Sqlite(Outbox::beside(records).table(table).build().await?)
            }
            Opened::Redis { .. } | Opened::DynamoDb(_) => {
                return Err(Failure::Usage(
                    "the outbox is a table in a SQL database (it commits with the request's \
                     transaction): pass that database's URL"
                        .into(),
                ));
            }
        })
    }
}

/// A relay's default retention: what `awaiting_sweep` counts against.
const RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);

impl OpenedOutbox {
    pub(crate) async fn stats(&self) -> Result<Report, Failure> {
        each_outbox!(self, outbox => {
            let stats = outbox.stats().await?;
            let backlog = OutboxTable::backlog(outbox, RETENTION).await?;
            Ok(Report::outbox(stats, backlog))
        })
    }

    pub(crate) async fn refused(&self, limit: u32) -> Result<Report, Failure> {
        each_outbox!(self, outbox => Ok(Report::refused(&outbox.refused(limit).await?)))
    }

    pub(crate) async fn requeue(&self, id: &str) -> Result<bool, Failure> {
        each_outbox!(self, outbox => Ok(outbox.requeue(id).await?))
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
