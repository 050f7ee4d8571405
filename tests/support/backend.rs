//! The stores the behaviour suite runs against: memory, one Redis node, a
//! Redis Cluster (each on Redis 7 and on Valkey 9, whose fenced writes are
//! plain commands), PostgreSQL, SQLite and MySQL/MariaDB (plain and
//! transactional), DynamoDB (lease and transactional, on dynoxide). Each
//! `store()` call is a fresh namespace (a key prefix, a table).

use std::{
    future::Future,
    ops::DerefMut,
    sync::atomic::{AtomicUsize, Ordering},
};

use tower_idempotency::{
    DynamoDbStore, DynamoDbTxStore, MemoryStore, MySqlStore, MySqlTxStore, PostgresStore,
    PostgresTxStore, RedisStore, SqliteStore, SqliteTxStore, sqlx,
    store::{
        CachedStore, Granted, StorageKey, Store, dynamodb::TransactWrites, redis::FencedWrites,
        sql::DeleteExpired,
    },
    testing::TxEffects,
};

use super::{
    cluster::RedisCluster,
    dynamodb, mysql,
    postgres::TestDatabase,
    redis_server::{Flavour, RedisServer},
    sqlite::TestFile,
};

pub trait Backend {
    type Store: Store;
    /// Whether the store's claims are transactions the handler writes in.
    const TRANSACTIONS: bool = false;
    fn store(&self) -> impl Future<Output = Self::Store>;
    /// Overwrites what `store` holds under a key with bytes it cannot
    /// read, written where its bytes live (the contract's rule on
    /// unreadable records); `None` where a store keeps no bytes.
    fn corrupter(&self, _store: &Self::Store) -> Option<Corrupter> {
        None
    }
}

/// What [`Backend::corrupter`] gives.
pub type Corrupter = std::sync::Arc<
    dyn Fn(StorageKey) -> std::pin::Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync,
>;

/// Bytes no store of the crate can read as a record.
const GARBAGE: &[u8] = b"\x00 not a record";

/// Overwrites the record of `key` in every `records_*` table of the
/// database at `url` (each contract store has a table of its own).
macro_rules! sql_corrupter {
    ($connection:ty, $url:expr, $tables:literal, $update:literal) => {{
        let url: String = $url;
        Some(std::sync::Arc::new(move |key: StorageKey| {
            let url = url.clone();
            Box::pin(async move {
                use sqlx::Connection as _;
                let mut on = <$connection>::connect(&url)
                    .await
                    .expect("connect to corrupt");
                let tables: Vec<String> = sqlx::query_scalar($tables)
                    .fetch_all(&mut on)
                    .await
                    .expect("list the records tables");
                for table in tables {
                    // The names come from the database's own catalogue.
                    sqlx::query(sqlx::AssertSqlSafe(format!($update, table = table)))
                        .bind(GARBAGE)
                        .bind(key.as_str().to_owned())
                        .execute(&mut on)
                        .await
                        .expect("corrupt a record");
                }
            }) as std::pin::Pin<Box<dyn Future<Output = ()> + Send>>
        }) as Corrupter)
    }};
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

    pub fn valkey() -> Self {
        Self(RedisServer::valkey())
    }
}

/// The way a store on `flavour` must have chosen: a detection that fell
/// back to scripts on Valkey 9 fails the suite rather than passing it on
/// the other path.
fn expected_fencing(flavour: Flavour) -> FencedWrites {
    match flavour {
        Flavour::Redis => FencedWrites::Scripts,
        Flavour::Valkey => FencedWrites::Commands,
    }
}

impl Backend for SingleRedis {
    type Store = RedisStore;
    async fn store(&self) -> RedisStore {
        let store = RedisStore::builder()
            .prefix(fresh_prefix())
            .connect(&self.0.url())
            .await
            .expect("connect to the test redis-server");
        assert_eq!(store.fenced_writes(), expected_fencing(self.0.flavour()));
        store
    }

    /// The value cut in half, its TTL kept.
    fn corrupter(&self, store: &RedisStore) -> Option<Corrupter> {
        let (store, url) = (store.clone(), self.0.url());
        Some(std::sync::Arc::new(move |key: StorageKey| {
            let (name, url) = (store.redis_key(&key), url.clone());
            Box::pin(async move {
                rewrite_redis_value(&url, &name, |value| value[..value.len() / 2].to_vec()).await;
            }) as std::pin::Pin<Box<dyn Future<Output = ()> + Send>>
        }))
    }
}

/// Rewrites the value of the Redis key `name` at `url`, its TTL kept.
pub async fn rewrite_redis_value(url: &str, name: &str, rewrite: impl FnOnce(Vec<u8>) -> Vec<u8>) {
    let mut redis = redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let value: Vec<u8> = redis::cmd("GET")
        .arg(name)
        .query_async(&mut redis)
        .await
        .unwrap();
    let () = redis::cmd("SET")
        .arg(name)
        .arg(rewrite(value))
        .arg("KEEPTTL")
        .query_async(&mut redis)
        .await
        .unwrap();
}

/// One Redis node behind the in-process replay cache.
pub struct CachedRedis(pub SingleRedis);

impl CachedRedis {
    pub fn start() -> Self {
        Self(SingleRedis::start())
    }

    pub fn valkey() -> Self {
        Self(SingleRedis::valkey())
    }
}

impl Backend for CachedRedis {
    type Store = CachedStore<RedisStore>;
    async fn store(&self) -> CachedStore<RedisStore> {
        CachedStore::new(self.0.store().await, 1 << 20)
    }
}

pub struct Cluster(pub RedisCluster, Flavour);

impl Cluster {
    pub fn start() -> Self {
        Self(RedisCluster::start(3, 0), Flavour::Redis)
    }

    pub fn valkey() -> Self {
        Self(
            RedisCluster::start_flavour(Flavour::Valkey, 3, 0),
            Flavour::Valkey,
        )
    }
}

impl Backend for Cluster {
    type Store = RedisStore;
    async fn store(&self) -> RedisStore {
        let store = RedisStore::builder()
            .prefix(fresh_prefix())
            .connect_cluster(self.0.urls())
            .await
            .expect("connect to the test cluster");
        assert_eq!(store.fenced_writes(), expected_fencing(self.1));
        store
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

    fn corrupter(&self, _: &PostgresStore) -> Option<Corrupter> {
        sql_corrupter!(
            sqlx::PgConnection,
            self.0.url().to_owned(),
            "SELECT table_name::text FROM information_schema.tables WHERE table_name LIKE 'records%'",
            "UPDATE {table} SET record = $1 WHERE key = $2"
        )
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

    fn corrupter(&self, _: &SqliteStore) -> Option<Corrupter> {
        sql_corrupter!(
            sqlx::SqliteConnection,
            self.0.url(),
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name LIKE 'records%'",
            "UPDATE {table} SET record = ?1 WHERE key = ?2"
        )
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

    fn corrupter(&self, _: &MySqlStore) -> Option<Corrupter> {
        sql_corrupter!(
            sqlx::MySqlConnection,
            self.0.url().to_owned(),
            "SELECT CAST(table_name AS CHAR) FROM information_schema.tables WHERE table_schema = DATABASE() AND table_name LIKE 'records%'",
            "UPDATE {table} SET record = ? WHERE `key` = ?"
        )
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

/// A transactional store's backend: its claims are transactions the
/// handler writes in, and the effects it writes are rows of a `charges`
/// table of the same database ([`Charges`]).
pub trait TxBackend:
    Backend<Store: Store<Granted = Self::Tx> + DeleteExpired> + Send + Sync + 'static
{
    /// The store's transaction, as a handler receives it.
    type Tx: Granted + DerefMut<Target = Self::Connection> + Send + Sync;
    type Connection: Send;
    type Charges: TxEffects<Self::Connection> + Total + Clone;

    /// A fresh store and a new, empty `charges` table beside it.
    fn store_and_charges(&self) -> impl Future<Output = (Self::Store, Self::Charges)>;
}

/// Every effect committed.
pub trait Total: Send + Sync + 'static {
    fn total(&self) -> impl Future<Output = u64> + Send;
}

macro_rules! tx_backend {
    ($backend:ty, $tx:ty, $db:ty) => {
        impl TxBackend for $backend {
            type Tx = $tx;
            type Connection = <$db as sqlx::Database>::Connection;
            type Charges = Charges<$db>;
            async fn store_and_charges(&self) -> (Self::Store, Charges<$db>) {
                let store = self.store().await;
                let charges = Charges::create(store.pool().clone()).await;
                (store, charges)
            }
        }
    };
}

tx_backend!(PostgresTx, tower_idempotency::PostgresTx, sqlx::Postgres);
tx_backend!(SqliteTx, tower_idempotency::SqliteTx, sqlx::Sqlite);
tx_backend!(MySqlTx, tower_idempotency::MySqlTx, sqlx::MySql);

/// The effects of the transactional tests: rows of a `charges` table
/// (each named by its note), written with the request's transaction and
/// counted outside it — the same SQL on every engine.
pub struct Charges<DB: sqlx::Database> {
    pool: sqlx::Pool<DB>,
    table: String,
}

impl<DB: sqlx::Database> Clone for Charges<DB> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            table: self.table.clone(),
        }
    }
}

impl<DB> Charges<DB>
where
    DB: sqlx::Database,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'c> &'c sqlx::Pool<DB>: sqlx::Executor<'c, Database = DB>,
    for<'r> i64: sqlx::Decode<'r, DB> + sqlx::Type<DB>,
    usize: sqlx::ColumnIndex<DB::Row>,
{
    /// A new `charges_<n>` table in the pool's database.
    pub async fn create(pool: sqlx::Pool<DB>) -> Self {
        let table = format!("charges_{}", fresh_prefix().replace(':', ""));
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "CREATE TABLE {table} (note varchar(64) NOT NULL)"
        )))
        .execute(&pool)
        .await
        .expect("create the charges table");
        Self { pool, table }
    }

    async fn count_where(&self, condition: &str) -> Result<u64, String> {
        use sqlx::Row;
        let sql = format!("SELECT count(*) FROM {} WHERE {condition}", self.table);
        let row = sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
            .fetch_one(&self.pool)
            .await
            .map_err(|e| e.to_string())?;
        row.try_get::<i64, _>(0)
            .map(|n| n as u64)
            .map_err(|e| e.to_string())
    }

    async fn run(&self, tx: &mut DB::Connection, sql: String) -> Result<(), String> {
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
            .execute(tx)
            .await
            .map(drop)
            .map_err(|e| e.to_string())
    }
}

impl<DB> Total for Charges<DB>
where
    DB: sqlx::Database,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'c> &'c sqlx::Pool<DB>: sqlx::Executor<'c, Database = DB>,
    for<'r> i64: sqlx::Decode<'r, DB> + sqlx::Type<DB>,
    usize: sqlx::ColumnIndex<DB::Row>,
{
    async fn total(&self) -> u64 {
        self.count_where("1 = 1").await.expect("count the charges")
    }
}

impl<DB> TxEffects<DB::Connection> for Charges<DB>
where
    DB: sqlx::Database,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'c> &'c sqlx::Pool<DB>: sqlx::Executor<'c, Database = DB>,
    for<'r> i64: sqlx::Decode<'r, DB> + sqlx::Type<DB>,
    usize: sqlx::ColumnIndex<DB::Row>,
{
    async fn write(&self, tx: &mut DB::Connection, id: &str) -> Result<(), String> {
        // Ids are the tests' own (letters, digits, dashes): no quoting.
        let sql = format!("INSERT INTO {} (note) VALUES ('{id}')", self.table);
        self.run(tx, sql).await
    }

    async fn write_in_rolled_back_savepoint(
        &self,
        tx: &mut DB::Connection,
        id: &str,
    ) -> Result<(), String> {
        self.run(tx, "SAVEPOINT undone".into()).await?;
        self.write(tx, id).await?;
        self.run(tx, "ROLLBACK TO SAVEPOINT undone".into()).await
    }

    async fn fail_a_statement(&self, tx: &mut DB::Connection) {
        let failed = self
            .run(tx, "INSERT INTO no_such_table (note) VALUES ('x')".into())
            .await;
        assert!(failed.is_err(), "a statement on a missing table fails");
    }

    async fn count(&self, id: &str) -> Result<u64, String> {
        self.count_where(&format!("note = '{id}'")).await
    }
}

/// A DynamoDB-compatible server of the test's own (dynoxide) and a fresh
/// table per store: the lease store.
pub struct Dynamo(pub dynamodb::DynamoServer);

impl Dynamo {
    pub fn start() -> Self {
        Self(dynamodb::DynamoServer::start())
    }
}

impl Backend for Dynamo {
    type Store = DynamoDbStore;
    async fn store(&self) -> DynamoDbStore {
        DynamoDbStore::builder(self.0.client())
            .table(dynamodb::table_name())
            .create_table_if_missing()
            .build()
            .await
            .expect("open the test table")
    }

    /// The item's record attribute (`rec`) garbled, in every table that
    /// holds the key.
    fn corrupter(&self, _: &DynamoDbStore) -> Option<Corrupter> {
        use tower_idempotency::aws_sdk_dynamodb::{primitives::Blob, types::AttributeValue};
        let client = self.0.client();
        Some(std::sync::Arc::new(move |key: StorageKey| {
            let client = client.clone();
            Box::pin(async move {
                let tables = client.list_tables().send().await.expect("list the tables");
                for table in tables.table_names() {
                    let _ = client
                        .update_item()
                        .table_name(table)
                        .key("pk", AttributeValue::S(key.as_str().to_owned()))
                        .update_expression("SET rec = :garbage")
                        .condition_expression("attribute_exists(rec)")
                        .expression_attribute_values(
                            ":garbage",
                            AttributeValue::B(Blob::new(GARBAGE)),
                        )
                        .send()
                        .await;
                }
            }) as std::pin::Pin<Box<dyn Future<Output = ()> + Send>>
        }))
    }
}

/// The same server, the transactional store.
pub struct DynamoTxBackend(pub dynamodb::DynamoServer);

impl DynamoTxBackend {
    pub fn start() -> Self {
        Self(dynamodb::DynamoServer::start())
    }

    /// A fresh store and a new, empty `charges` table beside it.
    pub async fn store_and_charges(&self) -> (DynamoDbTxStore, DynamoCharges) {
        let store = self.store().await;
        (store, DynamoCharges::create(&self.0).await)
    }
}

impl Backend for DynamoTxBackend {
    type Store = DynamoDbTxStore;
    const TRANSACTIONS: bool = true;
    async fn store(&self) -> DynamoDbTxStore {
        DynamoDbStore::builder(self.0.client())
            .table(dynamodb::table_name())
            .create_table_if_missing()
            .transactional()
            .build()
            .await
            .expect("open the test table")
    }
}

/// The effects of the DynamoDB transactional tests: items of a `charges`
/// table (each write an item of its own, named after its id), added to the
/// request's transaction and counted outside it.
#[derive(Clone)]
pub struct DynamoCharges {
    client: tower_idempotency::aws_sdk_dynamodb::Client,
    table: String,
}

impl DynamoCharges {
    pub async fn create(server: &dynamodb::DynamoServer) -> Self {
        Self::create_named(server, &format!("charges_{}", dynamodb::table_name())).await
    }

    /// A charges table named `table` (keyed by `id`).
    pub async fn create_named(server: &dynamodb::DynamoServer, table: &str) -> Self {
        use tower_idempotency::aws_sdk_dynamodb::types::{
            AttributeDefinition, BillingMode, KeySchemaElement, KeyType, ScalarAttributeType,
        };
        let (client, table) = (server.client(), table.to_owned());
        client
            .create_table()
            .table_name(&table)
            .key_schema(
                KeySchemaElement::builder()
                    .attribute_name("id")
                    .key_type(KeyType::Hash)
                    .build()
                    .unwrap(),
            )
            .attribute_definitions(
                AttributeDefinition::builder()
                    .attribute_name("id")
                    .attribute_type(ScalarAttributeType::S)
                    .build()
                    .unwrap(),
            )
            .billing_mode(BillingMode::PayPerRequest)
            .send()
            .await
            .expect("the charges table");
        Self { client, table }
    }

    fn put(&self, id: &str) -> tower_idempotency::aws_sdk_dynamodb::types::TransactWriteItem {
        use tower_idempotency::aws_sdk_dynamodb::types::{AttributeValue, Put, TransactWriteItem};
        // Each write an item of its own: a second execution shows.
        let put = Put::builder()
            .table_name(&self.table)
            .item(
                "id",
                AttributeValue::S(format!("{id}#{}", fastrand::u64(..))),
            )
            .item("note", AttributeValue::S(id.to_owned()))
            .build()
            .unwrap();
        TransactWriteItem::builder().put(put).build()
    }

    async fn count_where(&self, note: Option<&str>) -> Result<u64, String> {
        use tower_idempotency::aws_sdk_dynamodb::types::AttributeValue;
        let mut scan = self
            .client
            .scan()
            .table_name(&self.table)
            .consistent_read(true);
        if let Some(note) = note {
            scan = scan
                .filter_expression("note = :note")
                .expression_attribute_values(":note", AttributeValue::S(note.to_owned()));
        }
        let mut pages = scan.into_paginator().send();
        let mut n = 0;
        while let Some(page) = pages.next().await {
            n += page.map_err(|e| format!("{e:?}"))?.items().len() as u64;
        }
        Ok(n)
    }
}

impl Total for DynamoCharges {
    async fn total(&self) -> u64 {
        self.count_where(None).await.expect("count the charges")
    }
}

impl TxEffects<TransactWrites> for DynamoCharges {
    async fn write(&self, tx: &mut TransactWrites, id: &str) -> Result<(), String> {
        tx.push(self.put(id));
        Ok(())
    }

    async fn write_in_rolled_back_savepoint(
        &self,
        tx: &mut TransactWrites,
        id: &str,
    ) -> Result<(), String> {
        let mark = tx.len();
        tx.push(self.put(id));
        tx.truncate(mark);
        Ok(())
    }

    /// A condition on an item that does not exist: it fails at the commit,
    /// and with it the whole transaction.
    async fn fail_a_statement(&self, tx: &mut TransactWrites) {
        use tower_idempotency::aws_sdk_dynamodb::types::{
            AttributeValue, ConditionCheck, TransactWriteItem,
        };
        let check = ConditionCheck::builder()
            .table_name(&self.table)
            .key("id", AttributeValue::S("no-such-charge".into()))
            .condition_expression("attribute_exists(id)")
            .build()
            .unwrap();
        tx.push(TransactWriteItem::builder().condition_check(check).build());
    }

    async fn count(&self, id: &str) -> Result<u64, String> {
        self.count_where(Some(id)).await
    }
}
