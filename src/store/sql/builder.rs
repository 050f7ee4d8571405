//! Configuring and connecting a SQL store: one builder for every engine,
//! whose mode (a typestate) decides which store it connects.

use std::{marker::PhantomData, sync::Arc, time::Duration};

use sqlx::Pool;

use super::{
    Base, EngineCheck, Plain, Records, SqlRecords, SqlStore, SqlTxStore, Transactional,
    dialect::Engine, tx_engine::TxEngine,
};
use crate::{
    record::codec::Compression,
    store::{StoreError, sql::checked_table},
};

/// The settings a builder collects, read by the engine when it opens its
/// pool and by the stores.
#[derive(Clone, Debug)]
struct Settings {
    table: String,
    timeout: Duration,
    max_connections: u32,
    engine_check: EngineCheck,
    compression: Compression,
    transaction_timeout: Duration,
    claim_wait: Duration,
    /// Whether `connect` creates the table if it is missing.
    create_table: bool,
}

/// Configures and connects a SQL store: a [`SqlStore`] (claims are leases),
/// or with [`transactional`](Self::transactional) a [`SqlTxStore`] (the
/// record commits in the handler's transaction). Start one with
/// `PostgresStore::builder()`, `SqliteStore::builder()` or
/// `MySqlStore::builder()`.
///
/// # Examples
///
/// ```no_run
/// # #[cfg(feature = "postgres")]
/// # async fn demo() -> Result<(), tower_idempotency::store::StoreError> {
/// use std::time::Duration;
/// use tower_idempotency::PostgresStore;
///
/// let store = PostgresStore::builder()
///     .table("payments_idempotency")
///     .command_timeout(Duration::from_millis(500))
///     .max_connections(50)
///     .transactional()
///     .transaction_timeout(Duration::from_secs(10))
///     .connect("postgres://postgres@127.0.0.1:5432/payments")
///     .await?;
/// # let _ = store; Ok(()) }
/// ```
pub struct SqlStoreBuilder<D, M = Plain> {
    settings: Settings,
    mode: PhantomData<fn() -> (D, M)>,
}

impl<D, M> Clone for SqlStoreBuilder<D, M> {
    fn clone(&self) -> Self {
        Self {
            settings: self.settings.clone(),
            mode: PhantomData,
        }
    }
}

impl<D, M> std::fmt::Debug for SqlStoreBuilder<D, M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqlStoreBuilder")
            .field("settings", &self.settings)
            .finish()
    }
}

impl<D: Engine> SqlStore<D> {
    /// Starts configuring a store, with the engine's defaults: table
    /// `idempotency_records`; a command timeout of 1 s (SQLite: 5 s); a
    /// pool of 20 connections (SQLite: 8).
    ///
    /// # Examples
    ///
    /// ```
    /// # #[cfg(feature = "sqlite")] {
    /// let builder = tower_idempotency::SqliteStore::builder();
    /// # let _ = builder; }
    /// ```
    pub fn builder() -> SqlStoreBuilder<D, Plain> {
        SqlStoreBuilder {
            settings: Settings {
                table: super::DEFAULT_TABLE.into(),
                timeout: D::DEFAULT_TIMEOUT,
                max_connections: D::DEFAULT_CONNECTIONS,
                engine_check: EngineCheck::Refuse,
                compression: Compression::none(),
                transaction_timeout: Duration::from_secs(30),
                claim_wait: Duration::from_millis(50),
                create_table: false,
            },
            mode: PhantomData,
        }
    }
}
impl<D: Engine, M> SqlStoreBuilder<D, M> {
    /// Creates the records table (and its index) when the store connects,
    /// if they are missing — safe when many instances start together on a
    /// new database. Without it, the table must exist (apply the engine's
    /// `SCHEMA` with your own migrations): a store that connects to a
    /// database without it refuses to start, saying so.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # #[cfg(feature = "sqlite")]
    /// # async fn demo() -> Result<(), tower_idempotency::store::StoreError> {
    /// let store = tower_idempotency::SqliteStore::builder()
    ///     .transactional()
    ///     .create_table_if_missing()
    ///     .connect("sqlite://payments.db")
    ///     .await?;
    /// # let _ = store; Ok(()) }
    /// ```
    pub fn create_table_if_missing(mut self) -> Self {
        self.settings.create_table = true;
        self
    }

    /// The table that holds the records (default `idempotency_records`): a
    /// plain lowercase identifier, optionally schema-qualified
    /// (`billing.idempotency`).
    ///
    /// # Examples
    ///
    /// ```
    /// # #[cfg(feature = "sqlite")] {
    /// let builder = tower_idempotency::SqliteStore::builder().table("payments_idempotency");
    /// # let _ = builder; }
    /// ```
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.settings.table = table.into();
        self
    }

    /// The longest a store operation may take — its statements, the wait
    /// for a pooled connection, and on SQLite the wait for the database's
    /// write lock, which another writer of the file holds — before the
    /// request gets `503` (default 1 s; SQLite 5 s). A lease claim the
    /// database still runs after that (it was blocked, say, by a
    /// migration's table lock) is released once it has run, so it does not
    /// keep the key in flight for a lease.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[cfg(feature = "sqlite")] {
    /// use std::time::Duration;
    ///
    /// let builder = tower_idempotency::SqliteStore::builder().command_timeout(Duration::from_millis(250));
    /// # let _ = builder; }
    /// ```
    pub fn command_timeout(mut self, timeout: Duration) -> Self {
        self.settings.timeout = timeout;
        self
    }

    /// The size of the pool `connect` opens (default 20; SQLite 8). A
    /// transactional store holds one connection per request in flight.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[cfg(feature = "sqlite")] {
    /// let builder = tower_idempotency::SqliteStore::builder().max_connections(4);
    /// # let _ = builder; }
    /// ```
    pub fn max_connections(mut self, connections: u32) -> Self {
        self.settings.max_connections = connections;
        self
    }

    /// What to do when the start-up check fails (default: refuse to start;
    /// see [`EngineCheck`] for what it proves). The check runs when the
    /// store connects (if the table exists) and in `migrate()`.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[cfg(feature = "sqlite")] {
    /// use tower_idempotency::store::sql::EngineCheck;
    ///
    /// let builder = tower_idempotency::SqliteStore::builder().engine_check(EngineCheck::Warn);
    /// # let _ = builder; }
    /// ```
    pub fn engine_check(mut self, check: EngineCheck) -> Self {
        self.settings.engine_check = check;
        self
    }

    /// How stored bodies are written (default: as they are). With the
    /// `compression` feature, `Compression::zstd` compresses large ones;
    /// every store built with the feature reads them.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[cfg(all(feature = "sqlite", feature = "compression"))] {
    /// use tower_idempotency::{SqliteStore, codec::Compression};
    ///
    /// let builder = SqliteStore::builder().compression(Compression::zstd(1));
    /// # let _ = builder; }
    /// ```
    pub fn compression(mut self, compression: Compression) -> Self {
        self.settings.compression = compression;
        self
    }

    /// The base both stores share, on `pool`, checked.
    async fn base(&self, pool: Pool<D::Db>) -> Result<Arc<Base<D>>, StoreError> {
        let base = self.unchecked_base(pool).await?;
        if self.settings.create_table {
            base.create_table().await?;
        }
        super::check::run(&base).await?;
        Ok(base)
    }

    /// The base on `pool`, before the start-up check.
    async fn unchecked_base(&self, pool: Pool<D::Db>) -> Result<Arc<Base<D>>, StoreError> {
        checked_table(&self.settings.table, D::STORE)?;
        let engine = D::new(&pool).await?;
        Ok(Arc::new(Base {
            sql: engine.statements(&self.settings.table),
            engine,
            pool,
            timeout: self.settings.timeout,
            engine_check: self.settings.engine_check,
            compression: self.settings.compression.clone(),
        }))
    }

    async fn open(&self, url: &str) -> Result<Pool<D::Db>, StoreError> {
        D::open(url, self.settings.max_connections, self.settings.timeout).await
    }
}
impl<D: Engine> SqlStoreBuilder<D, Plain> {
    /// Commit the record and the handler's writes in one transaction: the
    /// builder then connects a [`SqlTxStore`], whose transaction the handler
    /// receives through [`IdempotentTx`](crate::IdempotentTx).
    ///
    /// # Examples
    ///
    /// ```
    /// # #[cfg(feature = "sqlite")] {
    /// let builder = tower_idempotency::SqliteStore::builder().transactional();
    /// # let _ = builder; }
    /// ```
    pub fn transactional(self) -> SqlStoreBuilder<D, Transactional> {
        SqlStoreBuilder {
            settings: self.settings,
            mode: PhantomData,
        }
    }

    /// The table as an operator sees it: the builder then connects
    /// [`SqlRecords`], which looks keys up, forgets them, counts and sweeps
    /// the table, and claims nothing (so it runs no start-up check, and
    /// needs no write rights to look up).
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # #[cfg(feature = "postgres")]
    /// # async fn demo() -> Result<(), tower_idempotency::store::StoreError> {
    /// let records = tower_idempotency::PostgresStore::builder()
    ///     .records()
    ///     .connect("postgres://readonly@127.0.0.1:5432/payments")
    ///     .await?;
    /// println!("{:?}", records.stats().await?);
    /// # Ok(()) }
    /// ```
    pub fn records(self) -> SqlStoreBuilder<D, Records> {
        SqlStoreBuilder {
            settings: self.settings,
            mode: PhantomData,
        }
    }

    /// Opens a pool to `url` (`postgres://…`, `sqlite://FILE` — created if
    /// missing —, `mysql://…`) and runs the start-up check if the table
    /// exists.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # #[cfg(feature = "sqlite")]
    /// # async fn demo() -> Result<(), tower_idempotency::store::StoreError> {
    /// let store = tower_idempotency::SqliteStore::builder().connect("sqlite://records.db").await?;
    /// # let _ = store; Ok(()) }
    /// ```
    pub async fn connect(self, url: &str) -> Result<SqlStore<D>, StoreError> {
        let pool = self.open(url).await?;
        self.with_pool(pool).await
    }

    /// Uses a pool you configured yourself (TLS, credentials, sizes). The
    /// command timeout bounds the wait for one of its connections too,
    /// whatever the pool's own acquire timeout. A SQLite pool should be in
    /// WAL mode with a busy timeout: without one, a writer that finds the
    /// lock taken fails at once.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # #[cfg(feature = "postgres")]
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use tower_idempotency::{PostgresStore, sqlx::postgres::PgPoolOptions};
    ///
    /// let pool = PgPoolOptions::new().max_connections(50).connect("postgres://postgres@127.0.0.1/app").await?;
    /// let store = PostgresStore::builder().with_pool(pool).await?;
    /// # let _ = store; Ok(()) }
    /// ```
    pub async fn with_pool(self, pool: Pool<D::Db>) -> Result<SqlStore<D>, StoreError> {
        Ok(SqlStore {
            base: self.base(pool).await?,
        })
    }
}
impl<D: TxEngine> SqlStoreBuilder<D, Transactional> {
    /// How long a request's transaction may sit idle between two of its
    /// statements, and how long one statement may run, before the database
    /// ends it (default 30 s). The claim lives inside the transaction, so
    /// this bounds how long a key stays in flight when the process holding
    /// it stops answering: paused (`SIGSTOP`, a VM stall), or cut off by a
    /// network partition. The database enforces it, so it holds whatever
    /// the process does (PostgreSQL: `idle_in_transaction_session_timeout`
    /// and `statement_timeout`; MariaDB: `idle_transaction_timeout` and
    /// `max_statement_time`, in whole seconds; MySQL: `wait_timeout`); a
    /// transaction it ended cannot commit later, so the paused request's
    /// response is withheld (`503`) and its retry executes once. SQLite
    /// has no server to enforce it: a paused process holds the file's
    /// write lock until it resumes.
    ///
    /// The trade-off: a handler that waits longer than this between two
    /// statements — on a slow card processor, say — loses its transaction
    /// the same way ([`StoreError::TransactionTimedOut`]), and its retry
    /// executes again (the external call is made twice). Set it above your
    /// slowest handler's wait.
    ///
    /// # Panics
    ///
    /// When configured, never at run time: under 100 ms or over a day.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[cfg(feature = "postgres")] {
    /// use std::time::Duration;
    ///
    /// let builder = tower_idempotency::PostgresStore::builder()
    ///     .transactional()
    ///     .transaction_timeout(Duration::from_secs(10));
    /// # let _ = builder; }
    /// ```
    pub fn transaction_timeout(mut self, timeout: Duration) -> Self {
        assert!(
            (Duration::from_millis(100)..=Duration::from_secs(24 * 60 * 60)).contains(&timeout),
            "transaction_timeout must be from 100 ms to 24 hours, got {timeout:?}"
        );
        self.settings.transaction_timeout = timeout;
        self
    }

    /// Opens a pool to `url` and runs the start-up check if the table
    /// exists.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # #[cfg(feature = "sqlite")]
    /// # async fn demo() -> Result<(), tower_idempotency::store::StoreError> {
    /// let store = tower_idempotency::SqliteStore::builder()
    ///     .transactional()
    ///     .connect("sqlite://payments.db")
    ///     .await?;
    /// # let _ = store; Ok(()) }
    /// ```
    pub async fn connect(self, url: &str) -> Result<SqlTxStore<D>, StoreError> {
        let pool = self.open(url).await?;
        self.with_pool(pool).await
    }

    /// Uses a pool you configured yourself; see
    /// [`SqlStoreBuilder::<D, Plain>::with_pool`].
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # #[cfg(feature = "postgres")]
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use tower_idempotency::{PostgresStore, sqlx::postgres::PgPoolOptions};
    ///
    /// let pool = PgPoolOptions::new().max_connections(50).connect("postgres://postgres@127.0.0.1/app").await?;
    /// let store = PostgresStore::builder().transactional().with_pool(pool).await?;
    /// # let _ = store; Ok(()) }
    /// ```
    pub async fn with_pool(self, pool: Pool<D::Db>) -> Result<SqlTxStore<D>, StoreError> {
        let base = self.base(pool).await?;
        let state = D::tx_state(&base.pool, &base.engine, &base.sql.table, base.timeout).await?;
        Ok(SqlTxStore {
            state: Arc::new(state),
            base,
            bound: self.settings.transaction_timeout,
            claim_wait: self.settings.claim_wait,
            retention: Arc::default(),
        })
    }
}
impl<D: TxEngine> SqlStoreBuilder<D, Records> {
    /// Opens a pool to `url` (a SQLite file must exist) and the table in
    /// it, which must exist and be readable.
    ///
    /// # Examples
    ///
    /// See [`records`](SqlStoreBuilder::records).
    pub async fn connect(self, url: &str) -> Result<SqlRecords<D>, StoreError> {
        let pool = self.open(url).await?;
        self.with_pool(pool).await
    }

    /// The table on a pool you configured yourself.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # #[cfg(feature = "postgres")]
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use tower_idempotency::{PostgresStore, sqlx::postgres::PgPoolOptions};
    ///
    /// let pool = PgPoolOptions::new().connect("postgres://postgres@127.0.0.1/app").await?;
    /// let records = PostgresStore::builder().records().with_pool(pool).await?;
    /// # let _ = records; Ok(()) }
    /// ```
    pub async fn with_pool(self, pool: Pool<D::Db>) -> Result<SqlRecords<D>, StoreError> {
        SqlRecords::open(self.unchecked_base(pool).await?).await
    }
}
