//! Configuring and connecting the PostgreSQL stores, and the start-up check
//! that refuses an engine whose claims would not exclude each other.

use std::{marker::PhantomData, sync::Arc, time::Duration};

use sqlx::{Connection, Executor, PgConnection, PgPool, Row, postgres::PgPoolOptions};

use super::{
    Base, PostgresStore, PostgresTxStore,
    idle::IdleTransactions,
    sql::{DEFAULT_TABLE, Sql},
};
use crate::{
    record::codec::Compression,
    store::{
        StoreError,
        sql::{EngineCheck, Plain, Transactional, self_test_key},
    },
};

/// Configures and connects a [`PostgresStore`], or with
/// [`transactional`](Self::transactional) a [`PostgresTxStore`].
///
/// # Examples
///
/// ```no_run
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
#[derive(Clone, Debug)]
pub struct PostgresStoreBuilder<M = Plain> {
    table: String,
    timeout: Duration,
    max_connections: u32,
    engine_check: EngineCheck,
    compression: Compression,
    transaction_timeout: Duration,
    claim_wait: Duration,
    mode: PhantomData<M>,
}

impl PostgresStore {
    /// Starts configuring a store.
    ///
    /// # Examples
    ///
    /// ```
    /// let builder = tower_idempotency::PostgresStore::builder();
    /// # let _ = builder;
    /// ```
    pub fn builder() -> PostgresStoreBuilder<Plain> {
        PostgresStoreBuilder {
            table: DEFAULT_TABLE.into(),
            timeout: Duration::from_secs(1),
            max_connections: 20,
            engine_check: EngineCheck::Refuse,
            compression: Compression::none(),
            transaction_timeout: Duration::from_secs(30),
            claim_wait: Duration::from_millis(50),
            mode: PhantomData,
        }
    }
}

impl<M> PostgresStoreBuilder<M> {
    /// The table that holds the records (default `idempotency_records`): a
    /// plain lowercase identifier, optionally schema-qualified
    /// (`billing.idempotency`).
    ///
    /// # Examples
    ///
    /// ```
    /// let builder = tower_idempotency::PostgresStore::builder().table("billing.idempotency");
    /// # let _ = builder;
    /// ```
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// The longest a store operation — its statements and the wait for a
    /// pooled connection — may take before the request gets `503` (default
    /// 1 s). A plain-mode claim the database still runs after that (it was
    /// blocked, say, by a migration's table lock) is released once it has
    /// run, so it does not keep the key in flight for a lease.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    ///
    /// let builder = tower_idempotency::PostgresStore::builder().command_timeout(Duration::from_millis(250));
    /// # let _ = builder;
    /// ```
    pub fn command_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The size of the pool [`connect`](PostgresStoreBuilder::<Plain>::connect)
    /// opens (default 20). In transactional mode each request in flight
    /// holds one connection.
    ///
    /// # Examples
    ///
    /// ```
    /// let builder = tower_idempotency::PostgresStore::builder().max_connections(50);
    /// # let _ = builder;
    /// ```
    pub fn max_connections(mut self, connections: u32) -> Self {
        self.max_connections = connections;
        self
    }

    /// What to do when the start-up check fails (default: refuse to start).
    /// The check, run when the store connects (if the table exists) and by
    /// `migrate()`, claims a key in one uncommitted transaction and makes
    /// sure a second session's claim of it waits and fails: an engine that
    /// detects the conflict only at commit, or a table without its primary
    /// key, would let a concurrent duplicate run the handler twice.
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::store::postgres::EngineCheck;
    ///
    /// let builder = tower_idempotency::PostgresStore::builder().engine_check(EngineCheck::Warn);
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
    /// use tower_idempotency::{PostgresStore, codec::Compression};
    ///
    /// # #[cfg(feature = "compression")]
    /// let builder = PostgresStore::builder().compression(Compression::zstd(1));
    /// # #[cfg(feature = "compression")]
    /// # let _ = builder;
    /// ```
    pub fn compression(mut self, compression: Compression) -> Self {
        self.compression = compression;
        self
    }

    async fn pool(&self, url: &str) -> Result<PgPool, StoreError> {
        Ok(PgPoolOptions::new()
            .max_connections(self.max_connections)
            .acquire_timeout(self.timeout)
            .connect(url)
            .await?)
    }

    async fn base(&self, pool: PgPool) -> Result<Arc<Base>, StoreError> {
        let base = Arc::new(Base {
            pool,
            timeout: self.timeout,
            sql: Sql::new(&self.table)?,
            engine_check: self.engine_check,
            compression: self.compression.clone(),
        });
        base.check_engine(false).await?;
        Ok(base)
    }
}

impl PostgresStoreBuilder<Plain> {
    /// Commit the record and the handler's writes in one transaction: the
    /// builder then connects a [`PostgresTxStore`], whose transaction the
    /// handler receives through [`IdempotentTx`](crate::IdempotentTx).
    ///
    /// # Examples
    ///
    /// ```
    /// let builder = tower_idempotency::PostgresStore::builder().transactional();
    /// # let _ = builder;
    /// ```
    pub fn transactional(self) -> PostgresStoreBuilder<Transactional> {
        PostgresStoreBuilder {
            table: self.table,
            timeout: self.timeout,
            max_connections: self.max_connections,
            engine_check: self.engine_check,
            compression: self.compression.clone(),
            transaction_timeout: self.transaction_timeout,
            claim_wait: self.claim_wait,
            mode: PhantomData,
        }
    }

    /// Opens a pool to `url`, e.g. `postgres://postgres@127.0.0.1:5432/app`,
    /// and runs the start-up check if the table exists.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), tower_idempotency::store::StoreError> {
    /// let store = tower_idempotency::PostgresStore::builder()
    ///     .connect("postgres://postgres@127.0.0.1:5432/app")
    ///     .await?;
    /// # let _ = store; Ok(()) }
    /// ```
    pub async fn connect(self, url: &str) -> Result<PostgresStore, StoreError> {
        let pool = self.pool(url).await?;
        self.with_pool(pool).await
    }

    /// Uses a pool you configured yourself (TLS, credentials, sizes). The
    /// command timeout bounds the wait for one of its connections too,
    /// whatever the pool's own acquire timeout: an exhausted pool answers
    /// `503` once it has passed.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use tower_idempotency::{PostgresStore, sqlx::postgres::PgPoolOptions};
    ///
    /// let pool = PgPoolOptions::new().max_connections(50).connect("postgres://postgres@127.0.0.1/app").await?;
    /// let store = PostgresStore::builder().with_pool(pool).await?;
    /// # let _ = store; Ok(()) }
    /// ```
    pub async fn with_pool(self, pool: PgPool) -> Result<PostgresStore, StoreError> {
        Ok(PostgresStore {
            base: self.base(pool).await?,
        })
    }
}

impl PostgresStoreBuilder<Transactional> {
    /// How long a request's transaction may sit idle between two of its
    /// statements, and how long one statement may run, before the database
    /// ends it (default 30 s). The claim lives inside the transaction, so
    /// this bounds how long a key stays in flight when the process holding
    /// it stops answering: paused (`SIGSTOP`, a VM stall), or cut off by a
    /// network partition. The database enforces it
    /// (`idle_in_transaction_session_timeout` and `statement_timeout`, set
    /// for the transaction only), so it holds whatever the process does; a
    /// transaction it ended cannot commit later, so the paused request's
    /// response is withheld (`503`) and its retry executes once.
    ///
    /// The trade-off: a handler that waits longer than this between two
    /// statements — on a slow card processor, say — loses its transaction
    /// the same way, and its retry executes again (the external call is
    /// made twice). Set it above your slowest handler's wait.
    ///
    /// # Panics
    ///
    /// When configured, never at run time: under 100 ms or over a day.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    ///
    /// let builder = tower_idempotency::PostgresStore::builder()
    ///     .transactional()
    ///     .transaction_timeout(Duration::from_secs(10));
    /// # let _ = builder;
    /// ```
    pub fn transaction_timeout(mut self, timeout: Duration) -> Self {
        assert!(
            (Duration::from_millis(100)..=Duration::from_secs(24 * 60 * 60)).contains(&timeout),
            "PostgresStoreBuilder::transaction_timeout must be from 100 ms to 24 hours, got {timeout:?}"
        );
        self.transaction_timeout = timeout;
        self
    }

    /// Opens a pool to `url` and runs the start-up check if the table
    /// exists.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), tower_idempotency::store::StoreError> {
    /// let store = tower_idempotency::PostgresStore::builder()
    ///     .transactional()
    ///     .connect("postgres://postgres@127.0.0.1:5432/app")
    ///     .await?;
    /// # let _ = store; Ok(()) }
    /// ```
    pub async fn connect(self, url: &str) -> Result<PostgresTxStore, StoreError> {
        let pool = self.pool(url).await?;
        self.with_pool(pool).await
    }

    /// Uses a pool you configured yourself; see
    /// [`PostgresStoreBuilder::<Plain>::with_pool`].
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use tower_idempotency::{PostgresStore, sqlx::postgres::PgPoolOptions};
    ///
    /// let pool = PgPoolOptions::new().max_connections(50).connect("postgres://postgres@127.0.0.1/app").await?;
    /// let store = PostgresStore::builder().transactional().with_pool(pool).await?;
    /// # let _ = store; Ok(()) }
    /// ```
    pub async fn with_pool(self, pool: PgPool) -> Result<PostgresTxStore, StoreError> {
        // What the claim restores once it no longer needs its short wait.
        let lock_timeout: String = sqlx::query_scalar("SELECT current_setting('lock_timeout')")
            .fetch_one(&pool)
            .await?;
        let idle = Arc::new(IdleTransactions::new(&pool, self.timeout));
        Ok(PostgresTxStore {
            base: self.base(pool).await?,
            idle,
            lock_timeout: lock_timeout.into(),
            claim_wait: self.claim_wait,
            transaction_timeout: self.transaction_timeout,
        })
    }
}

impl Base {
    /// The start-up check: a claim held by one uncommitted transaction must
    /// make a second session's claim of the same key wait and fail (or
    /// fail), never succeed. Skipped before the table exists, unless
    /// `required` (after `migrate()` created it). Two connections of their
    /// own, so a small pool is not exhausted by it.
    pub(super) async fn check_engine(&self, required: bool) -> Result<(), StoreError> {
        let options = self.pool.connect_options();
        let mut first = PgConnection::connect_with(&options).await?;
        let mut second = PgConnection::connect_with(&options).await?;
        let exists = first
            .fetch_optional(sqlx::raw_sql(&format!(
                "SELECT 1 FROM {} LIMIT 0",
                self.sql.table
            )))
            .await;
        if exists.is_err() && !required {
            return Ok(());
        }
        let engine: String = sqlx::query_scalar("SELECT version()")
            .fetch_one(&mut first)
            .await?;
        let why = self.claims_exclude(&mut first, &mut second).await.err();
        // Whatever happened, neither transaction commits.
        let _ = first.execute("ROLLBACK").await;
        let _ = second.execute("ROLLBACK").await;
        self.engine_check.verdict(&engine, why)
    }

    /// `Err(why)` when a second claim of a key held by an uncommitted
    /// transaction succeeded, or the claim cannot run at all.
    async fn claims_exclude(
        &self,
        first: &mut PgConnection,
        second: &mut PgConnection,
    ) -> Result<(), String> {
        let claim = format!(
            "INSERT INTO {} (key, fingerprint, record, expires_at) VALUES ($1, '\\x00', NULL, now() + interval '1 minute') \
             ON CONFLICT (key) DO NOTHING RETURNING 1",
            self.sql.table
        );
        let key = self_test_key();
        let claim_in = async |on: &mut PgConnection, wait: &str| {
            on.execute(format!("BEGIN; SET LOCAL lock_timeout = {wait}").as_str())
                .await?;
            sqlx::query(&claim)
                .bind(&key)
                .fetch_optional(&mut *on)
                .await
        };
        match claim_in(first, "1000").await {
            Ok(Some(row)) if row.try_get::<i32, _>(0).is_ok() => {}
            Ok(_) => return Err("a claim of a fresh key did not insert its row".into()),
            Err(error) => return Err(format!("the claim statement fails ({error})")),
        }
        match claim_in(second, "200").await {
            Ok(Some(_)) => Err(
                "a second session claimed a key that an uncommitted transaction holds (no unique key on the key column, or conflicts detected only at commit)"
                    .into(),
            ),
            // It waited and failed (lock_timeout), or saw the conflict and did
            // nothing: either way it did not claim the key.
            Ok(None) => Ok(()),
            Err(error)
                if error
                    .as_database_error()
                    .and_then(|e| e.code())
                    .is_some_and(|code| code == "55P03") =>
            {
                Ok(())
            }
            Err(error) => Err(format!("the second claim failed unexpectedly ({error})")),
        }
    }
}
