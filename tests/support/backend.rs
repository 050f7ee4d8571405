//! The stores the behaviour suite runs against: memory, one Redis node, a
//! Redis Cluster, PostgreSQL, SQLite and MySQL/MariaDB (plain and
//! transactional). Each
//! `store()` call is a fresh namespace (a key prefix, a table).

use std::{
    future::Future,
    sync::atomic::{AtomicUsize, Ordering},
};

use tower_idempotency::{
    MemoryStore, MySqlStore, MySqlTxStore, PostgresStore, PostgresTxStore, RedisStore, SqliteStore,
    SqliteTxStore,
    store::{CachedStore, Store},
};

use super::{
    cluster::RedisCluster, mysql, postgres::TestDatabase, redis_server::RedisServer,
    sqlite::TestFile,
};

pub trait Backend {
    type Store: Store;
    /// Whether the store's claims are transactions the handler writes in.
    const TRANSACTIONS: bool = false;
    fn store(&self) -> impl Future<Output = Self::Store>;
}

pub struct Memory;

impl Backend for Memory {
    type Store = MemoryStore;
    async fn store(&self) -> MemoryStore {
        MemoryStore::new()
    }
}

fn fresh_prefix() -> String {
    static SEQ: AtomicUsize = AtomicUsize::new(0);
    format!("test{}:", SEQ.fetch_add(1, Ordering::Relaxed))
}

pub struct SingleRedis(pub RedisServer);

impl SingleRedis {
    pub fn start() -> Self {
        Self(RedisServer::start())
    }
}

impl Backend for SingleRedis {
    type Store = RedisStore;
    async fn store(&self) -> RedisStore {
        RedisStore::builder()
            .prefix(fresh_prefix())
            .connect(&self.0.url())
            .await
            .expect("connect to the test redis-server")
    }
}

/// One Redis node behind the in-process replay cache.
pub struct CachedRedis(pub SingleRedis);

impl CachedRedis {
    pub fn start() -> Self {
        Self(SingleRedis::start())
    }
}

impl Backend for CachedRedis {
    type Store = CachedStore<RedisStore>;
    async fn store(&self) -> CachedStore<RedisStore> {
        CachedStore::new(self.0.store().await, 1 << 20)
    }
}

pub struct Cluster(pub RedisCluster);

impl Cluster {
    pub fn start() -> Self {
        Self(RedisCluster::start(3, 0))
    }
}

impl Backend for Cluster {
    type Store = RedisStore;
    async fn store(&self) -> RedisStore {
        RedisStore::builder()
            .prefix(fresh_prefix())
            .connect_cluster(self.0.urls())
            .await
            .expect("connect to the test cluster")
    }
}

/// PostgreSQL in plain mode: a throwaway database, a fresh table per store.
pub struct Postgres(pub TestDatabase);

impl Postgres {
    pub fn start() -> Self {
        Self(TestDatabase::create())
    }
}

impl Backend for Postgres {
    type Store = PostgresStore;
    async fn store(&self) -> PostgresStore {
        let table = fresh_prefix().replace(':', "");

        PostgresStore::builder()
            .table(format!("records_{table}"))
            .create_table_if_missing()
            .connect(self.0.url())
            .await
            .expect("connect to the test database")
    }
}

/// PostgreSQL, transactional: a throwaway database, a fresh table per store.
pub struct PostgresTx(pub TestDatabase);

impl PostgresTx {
    pub fn start() -> Self {
        Self(TestDatabase::create())
    }
}

impl Backend for PostgresTx {
    type Store = PostgresTxStore;
    const TRANSACTIONS: bool = true;
    async fn store(&self) -> PostgresTxStore {
        let table = fresh_prefix().replace(':', "");

        PostgresStore::builder()
            .table(format!("records_{table}"))
            .transactional()
            .create_table_if_missing()
            .connect(self.0.url())
            .await
            .expect("connect to the test database")
    }
}

/// SQLite in plain mode: a file in a temporary directory, a fresh table per
/// store.
pub struct Sqlite(pub TestFile);

impl Sqlite {
    pub fn start() -> Self {
        Self(TestFile::create())
    }
}

impl Backend for Sqlite {
    type Store = SqliteStore;
    async fn store(&self) -> SqliteStore {
        let table = fresh_prefix().replace(':', "");

        SqliteStore::builder()
            .table(format!("records_{table}"))
            .create_table_if_missing()
            .connect(&self.0.url())
            .await
            .expect("open the test database")
    }
}

/// SQLite, transactional: a file in a temporary directory, a fresh table
/// per store.
pub struct SqliteTx(pub TestFile);

impl SqliteTx {
    pub fn start() -> Self {
        Self(TestFile::create())
    }
}

impl Backend for SqliteTx {
    type Store = SqliteTxStore;
    const TRANSACTIONS: bool = true;
    async fn store(&self) -> SqliteTxStore {
        let table = fresh_prefix().replace(':', "");

        SqliteStore::builder()
            .table(format!("records_{table}"))
            .transactional()
            .create_table_if_missing()
            .connect(&self.0.url())
            .await
            .expect("open the test database")
    }
}

/// MySQL/MariaDB in plain mode: a throwaway database, a fresh table per
/// store.
pub struct MySql(pub mysql::TestDatabase);

impl MySql {
    pub fn start() -> Self {
        Self(mysql::TestDatabase::create())
    }
}

impl Backend for MySql {
    type Store = MySqlStore;
    async fn store(&self) -> MySqlStore {
        let table = fresh_prefix().replace(':', "");

        MySqlStore::builder()
            .table(format!("records_{table}"))
            .create_table_if_missing()
            .connect(self.0.url())
            .await
            .expect("connect to the test database")
    }
}

/// MySQL/MariaDB, transactional: a throwaway database, a fresh table per
/// store.
pub struct MySqlTx(pub mysql::TestDatabase);

impl MySqlTx {
    pub fn start() -> Self {
        Self(mysql::TestDatabase::create())
    }
}

impl Backend for MySqlTx {
    type Store = MySqlTxStore;
    const TRANSACTIONS: bool = true;
    async fn store(&self) -> MySqlTxStore {
        let table = fresh_prefix().replace(':', "");

        MySqlStore::builder()
            .table(format!("records_{table}"))
            .transactional()
            .create_table_if_missing()
            .connect(self.0.url())
            .await
            .expect("connect to the test database")
    }
}
