//! Configuring and opening the SQLite stores, and the start-up check that
//! refuses a database whose claims would not exclude each other.

use std::{
    collections::HashSet,
    marker::PhantomData,
    str::FromStr,
    sync::{Arc, Mutex},
    time::Duration,
};

use sqlx::{
    Connection, Executor, SqliteConnection, SqlitePool,
    sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous},
};

use super::{
    Base, SqliteStore, SqliteTxStore,
    sql::{DEFAULT_TABLE, Sql},
};
use crate::{
    record::codec::Compression,
    store::{
        StoreError,
        sql::{EngineCheck, Plain, Transactional, self_test_key},
    },
};

/// Configures and opens a [`SqliteStore`], or with
/// [`transactional`](Self::transactional) a [`SqliteTxStore`].
///
/// # Examples
///
/// ```no_run
/// # async fn demo() -> Result<(), tower_idempotency::store::StoreError> {
/// use std::time::Duration;
/// use tower_idempotency::SqliteStore;
///
/// let store = SqliteStore::builder()
///     .command_timeout(Duration::from_secs(2))
///     .transactional()
///     .connect("sqlite://payments.db")
///     .await?;
/// # let _ = store; Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct SqliteStoreBuilder<M = Plain> {
    table: String,
    timeout: Duration,
    max_connections: u32,
    engine_check: EngineCheck,
    compression: Compression,
    mode: PhantomData<M>,
}

impl SqliteStore {
    /// Starts configuring a store.
    ///
    /// # Examples
    ///
    /// ```
    /// let builder = tower_idempotency::SqliteStore::builder();
    /// # let _ = builder;
    /// ```
    pub fn builder() -> SqliteStoreBuilder<Plain> {
        SqliteStoreBuilder {
            table: DEFAULT_TABLE.into(),
            timeout: Duration::from_secs(5),
            max_connections: 8,
            engine_check: EngineCheck::Refuse,
            compression: Compression::none(),
            mode: PhantomData,
        }
    }
}

impl<M> SqliteStoreBuilder<M> {
    /// The table that holds the records (default `idempotency_records`): a
    /// plain lowercase identifier, optionally schema-qualified.
    ///
    /// # Examples
    ///
    /// ```
    /// let builder = tower_idempotency::SqliteStore::builder().table("payments_idempotency");
    /// # let _ = builder;
    /// ```
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// How long a write waits for the database's write lock, which any
    /// other writer of the file holds (SQLite's busy timeout; default 5 s):
    /// past it the request gets `503`. A transactional store's handler holds
    /// the lock for its whole transaction, so this is how long a request for
    /// another key waits behind a slow handler.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    ///
    /// let builder = tower_idempotency::SqliteStore::builder().command_timeout(Duration::from_secs(2));
    /// # let _ = builder;
    /// ```
    pub fn command_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The size of the pool [`connect`](SqliteStoreBuilder::<Plain>::connect)
    /// opens (default 8). Readers (replays) use them in parallel; writers
    /// take turns, as SQLite's one writer at a time.
    ///
    /// # Examples
    ///
    /// ```
    /// let builder = tower_idempotency::SqliteStore::builder().max_connections(4);
    /// # let _ = builder;
    /// ```
    pub fn max_connections(mut self, connections: u32) -> Self {
        self.max_connections = connections;
        self
    }

    /// What to do when the start-up check fails (default: refuse to start).
    /// The check, run when the store opens (if the table exists) and by
    /// `migrate()`, holds a claim in one transaction and makes sure a second
    /// connection cannot write meanwhile, and that the table's key is
    /// unique.
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::store::sqlite::EngineCheck;
    ///
    /// let builder = tower_idempotency::SqliteStore::builder().engine_check(EngineCheck::Warn);
    /// # let _ = builder;
    /// ```
    pub fn engine_check(mut self, check: EngineCheck) -> Self {
        self.engine_check = check;
        self
    }

    /// How stored bodies are written (default: as they are). With the
    /// `compression` feature, [`Compression::zstd`] compresses large ones;
    /// every store built with the feature reads them.
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::{SqliteStore, codec::Compression};
    ///
    /// # #[cfg(feature = "compression")]
    /// let builder = SqliteStore::builder().compression(Compression::zstd(1));
    /// # #[cfg(feature = "compression")]
    /// # let _ = builder;
    /// ```
    pub fn compression(mut self, compression: Compression) -> Self {
        self.compression = compression;
        self
    }

    /// A pool on the file `url` names (`sqlite://payments.db`, created if
    /// missing), in WAL mode with `synchronous = FULL`: a committed record
    /// survives a crash of the process and of the machine.
    async fn pool(&self, url: &str) -> Result<SqlitePool, StoreError> {
        let options = SqliteConnectOptions::from_str(url)?
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full)
            .busy_timeout(self.timeout);
        Ok(SqlitePoolOptions::new()
            .max_connections(self.max_connections)
            .connect_with(options)
            .await?)
    }

    async fn base(&self, pool: SqlitePool) -> Result<Arc<Base>, StoreError> {
        let base = Arc::new(Base {
            pool,
            timeout: self.timeout,
            sql: Sql::new(&self.table)?,
            engine_check: self.engine_check,
            compression: self.compression.clone(),
            writer: Arc::default(),
        });
        base.check_engine(false).await?;
        Ok(base)
    }
}

impl SqliteStoreBuilder<Plain> {
    /// Commit the record and the handler's writes in one transaction: the
    /// builder then opens a [`SqliteTxStore`], whose transaction the handler
    /// receives through [`IdempotentTx`](crate::IdempotentTx).
    ///
    /// # Examples
    ///
    /// ```
    /// let builder = tower_idempotency::SqliteStore::builder().transactional();
    /// # let _ = builder;
    /// ```
    pub fn transactional(self) -> SqliteStoreBuilder<Transactional> {
        SqliteStoreBuilder {
            table: self.table,
            timeout: self.timeout,
            max_connections: self.max_connections,
            engine_check: self.engine_check,
            compression: self.compression.clone(),
            mode: PhantomData,
        }
    }

    /// Opens the database file `url` names, e.g. `sqlite://records.db`
    /// (created if missing), and runs the start-up check if the table
    /// exists.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), tower_idempotency::store::StoreError> {
    /// let store = tower_idempotency::SqliteStore::builder().connect("sqlite://records.db").await?;
    /// # let _ = store; Ok(()) }
    /// ```
    pub async fn connect(self, url: &str) -> Result<SqliteStore, StoreError> {
        let pool = self.pool(url).await?;
        self.with_pool(pool).await
    }

    /// Uses a pool you opened yourself. Open it in WAL mode, with a busy
    /// timeout: without one, a writer that finds the lock taken fails at
    /// once.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use tower_idempotency::{SqliteStore, sqlx::SqlitePool};
    ///
    /// let pool = SqlitePool::connect("sqlite://records.db?mode=rwc").await?;
    /// let store = SqliteStore::builder().with_pool(pool).await?;
    /// # let _ = store; Ok(()) }
    /// ```
    pub async fn with_pool(self, pool: SqlitePool) -> Result<SqliteStore, StoreError> {
        Ok(SqliteStore {
            base: self.base(pool).await?,
        })
    }
}

impl SqliteStoreBuilder<Transactional> {
    /// Opens the database file `url` names (created if missing) and runs
    /// the start-up check if the table exists.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), tower_idempotency::store::StoreError> {
    /// let store = tower_idempotency::SqliteStore::builder()
    ///     .transactional()
    ///     .connect("sqlite://payments.db")
    ///     .await?;
    /// # let _ = store; Ok(()) }
    /// ```
    pub async fn connect(self, url: &str) -> Result<SqliteTxStore, StoreError> {
        let pool = self.pool(url).await?;
        self.with_pool(pool).await
    }

    /// Uses a pool you opened yourself; see
    /// [`SqliteStoreBuilder::<Plain>::with_pool`].
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use tower_idempotency::{SqliteStore, sqlx::SqlitePool};
    ///
    /// let pool = SqlitePool::connect("sqlite://payments.db?mode=rwc").await?;
    /// let store = SqliteStore::builder().transactional().with_pool(pool).await?;
    /// # let _ = store; Ok(()) }
    /// ```
    pub async fn with_pool(self, pool: SqlitePool) -> Result<SqliteTxStore, StoreError> {
        Ok(SqliteTxStore {
            base: self.base(pool).await?,
            in_flight: Arc::new(Mutex::new(HashSet::new())),
            bound: Duration::from_secs(30),
        })
    }
}

impl Base {
    /// The start-up check: while one connection holds a claim in an
    /// `IMMEDIATE` transaction, a second must not be able to write (SQLite
    /// serialises writers), and a second claim of the same key in the
    /// holder's transaction must find it taken (the key is unique).
    /// Skipped before the table exists, unless `required`.
    pub(super) async fn check_engine(&self, required: bool) -> Result<(), StoreError> {
        let options = self.pool.connect_options();
        let mut first = SqliteConnection::connect_with(&options).await?;
        let exists = first
            .fetch_optional(sqlx::raw_sql(&format!(
                "SELECT 1 FROM {} LIMIT 0",
                self.sql.table
            )))
            .await;
        if exists.is_err() && !required {
            return Ok(());
        }
        let engine: String = sqlx::query_scalar("SELECT 'SQLite ' || sqlite_version()")
            .fetch_one(&mut first)
            .await?;
        let mut second = SqliteConnection::connect_with(&options).await?;
        let why = self.claims_exclude(&mut first, &mut second).await.err();
        let _ = first.execute("ROLLBACK").await;
        let _ = second.execute("ROLLBACK").await;
        self.engine_check.verdict(&engine, why)
    }

    async fn claims_exclude(
        &self,
        first: &mut SqliteConnection,
        second: &mut SqliteConnection,
    ) -> Result<(), String> {
        let key = self_test_key();
        let claim = || {
            sqlx::query(&self.sql.tx_claim)
                .bind(key.clone())
                .bind(&[0u8][..])
                .bind(i64::MAX)
                .bind(0_i64)
        };
        let failed = |error: sqlx::Error| format!("the claim statement fails ({error})");
        first.execute("BEGIN IMMEDIATE").await.map_err(failed)?;
        match claim().fetch_optional(&mut *first).await.map_err(failed)? {
            Some(_) => {}
            None => return Err("a claim of a fresh key did not insert its row".into()),
        }
        if claim()
            .fetch_optional(&mut *first)
            .await
            .map_err(failed)?
            .is_some()
        {
            return Err(
                "a second claim of a held key inserted a row: the key is not unique".into(),
            );
        }
        second
            .execute("PRAGMA busy_timeout = 100")
            .await
            .map_err(failed)?;
        match second.execute("BEGIN IMMEDIATE").await {
            Err(_) => Ok(()),
            Ok(_) => Err("a second connection could write while a claim was held".into()),
        }
    }
}
