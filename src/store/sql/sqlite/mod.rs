//! The SQLite stores (feature `sqlite`), on sqlx's bundled SQLite: durable
//! records in one file, with nothing to install.
//!
//! # Two stores
//!
//! **[`SqliteTxStore`]** (`SqliteStore::builder().transactional()`): the
//! record and the handler's own writes commit in one transaction, in one
//! file — the durable embedded default. The layer begins an `IMMEDIATE`
//! transaction, inserts the claim's row in it, hands it to the handler
//! through [`IdempotentTx<SqliteTx>`](crate::IdempotentTx) (a message's work
//! receives it as `&mut SqliteTx`), then writes the record into the same
//! transaction and commits. A crash anywhere before the commit leaves
//! neither the effect nor the record — the retry executes at once; after
//! it, both — the retry replays. Exactly one effect. Non-final responses,
//! server errors, handler errors and panics roll back; a commit that fails
//! (a full disk, say) withholds the response (`503`) and closes its
//! connection, so the store serves again as soon as the disk has room; a
//! constraint the commit breaks is the request's own answer.
//!
//! **One writer at a time.** SQLite lets one connection write at a time,
//! and a transactional claim holds the write lock for the whole handler:
//! requests for *other* keys wait for it (up to the command timeout,
//! default 5 s, then `503`), so keep the work inside the transaction short
//! — call the slow card processor before or after, or use PostgreSQL.
//! Replays need no write lock (WAL readers never wait), and a duplicate of
//! a request in flight in this process is answered `409` at once from an
//! in-process registry, without waiting for the lock. A duplicate from
//! another process on the same file waits for the lock like any writer,
//! then replays; two processes on one file never both execute a key. A
//! process that is paused holds the lock until it resumes; one that dies
//! releases it at once (the operating system drops its file locks). A
//! second instance that starts while the first holds the lock waits for
//! it before its start-up check, saying so in its log.
//!
//! **[`SqliteStore`]** (the default): claims are leases, each operation one
//! short autocommit statement, like the Redis store's.
//!
//! The database opens in WAL mode with `synchronous = FULL`: a committed
//! record survives a crash of the process and of the machine. A database
//! file deleted or replaced while the store runs is refused with an error
//! that says so (restart the process), rather than written to.
//!
//! # Schema
//!
//! [`migrate`](SqliteTxStore::migrate) creates the table if it is
//! missing, or run [`SCHEMA`] yourself:
//!
//! ```sql
#![doc = include_str!("schema.sql")]
//! ```
//!
//! The start-up check (when the store opens, if the table exists, and in
//! `migrate()`) makes sure a held claim keeps a second writer out, that the
//! key is unique and compares as bytes; [`EngineCheck::Warn`] opts out.
//! Expired records count as absent at once;
//! [`delete_expired`](SqliteTxStore::delete_expired) and
//! [`spawn_cleaner`](SqliteTxStore::spawn_cleaner) reclaim the space.

mod file;
mod outbox;
mod statements;
mod transactional;

use std::{str::FromStr, sync::Arc, time::Duration};

use sqlx::{
    SqlitePool,
    sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous},
};
use tokio::sync::OwnedMutexGuard;

pub use super::{EngineCheck, Plain, Records, Transactional};
use super::{
    SqlStore, SqlStoreBuilder, SqlTx, SqlTxStore,
    dialect::{Dialect, Engine, ErrorClass, LeaseClaim, Statements, glue, sealed},
};
use crate::store::StoreError;

/// The schema, for the default table name `idempotency_records`; idempotent.
pub const SCHEMA: &str = include_str!("schema.sql");
pub use outbox::OUTBOX_SCHEMA;

/// A [`Store`](crate::store::Store) on SQLite whose claims are leases; see
/// [`SqlStore`].
pub type SqliteStore = SqlStore<Sqlite>;

/// A [`Store`](crate::store::Store) on SQLite whose record commits in the
/// handler's own transaction: exactly one effect per key, across crashes,
/// in one file with nothing to install; see [`SqlTxStore`] and the
/// [module docs](self).
pub type SqliteTxStore = SqlTxStore<Sqlite>;

/// The request's transaction on a [`SqliteTxStore`] (begun `IMMEDIATE`, so
/// it holds the database's write lock); see [`SqlTx`]. It dereferences to
/// the [`SqliteConnection`](sqlx::SqliteConnection).
pub type SqliteTx = SqlTx<Sqlite>;

/// Configures and opens a [`SqliteStore`], or with `transactional()` a
/// [`SqliteTxStore`]; see [`SqlStoreBuilder`].
pub type SqliteStoreBuilder<M = Plain> = SqlStoreBuilder<Sqlite, M>;

/// The SQLite engine of the SQL store family: what a SQLite store holds
/// besides its pool — this process's turn to write, and the database
/// file's identity.
pub struct Sqlite {
    /// SQLite lets one connection write at a time. Its busy handler makes a
    /// waiting writer sleep and retry, with no order among them: under
    /// contention some wait far longer than others (seconds at 32
    /// requests). The writers of this process take turns here instead, in
    /// arrival order; the busy timeout is left for writers in other
    /// processes.
    writer: Arc<tokio::sync::Mutex<()>>,
    /// The file the store opened, to refuse writing once it is gone.
    file: file::DatabaseFile,
}

impl std::fmt::Debug for Sqlite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sqlite").field("file", &self.file).finish()
    }
}

impl Dialect for Sqlite {
    type Db = sqlx::Sqlite;
    type Held = transactional::Held;
    type TxState = transactional::TxState;
}

impl sealed::Sealed for Sqlite {}

impl Engine for Sqlite {
    type Turn = OwnedMutexGuard<()>;

    const STORE: &'static str = "SqliteStore";
    const TX: &'static str = "SqliteTx";
    const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);
    const DEFAULT_CONNECTIONS: u32 = 8;
    const LEASE_CLAIM: LeaseClaim = LeaseClaim::Counts;
    const TAKES_TURNS: bool = true;

    fn key_kept(held: &mut transactional::Held) {
        held.kept();
    }

    fn key_undone(held: &mut transactional::Held) {
        held.undone();
    }

    fn statements(&self, table: &str) -> Statements {
        statements::statements(table)
    }

    /// A pool on the file `url` names (`sqlite://payments.db`, created if
    /// missing), in WAL mode with `synchronous = FULL`: a committed record
    /// survives a crash of the process and of the machine.
    async fn open(
        url: &str,
        connections: u32,
        timeout: Duration,
    ) -> Result<SqlitePool, StoreError> {
        let options = SqliteConnectOptions::from_str(url)?
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full)
            .busy_timeout(timeout);
        let path = options.get_filename().display().to_string();
        SqlitePoolOptions::new()
            .max_connections(connections)
            // In-process connections do not go stale the way network ones
            // do: testing each before use would cost every request a trip
            // to its connection's thread.
            .test_before_acquire(false)
            .connect_with(options)
            .await
            .map_err(|e| file::open_error(&path, e))
    }

    async fn new(pool: &SqlitePool) -> Result<Self, StoreError> {
        Ok(Self {
            writer: Arc::default(),
            file: file::DatabaseFile::of(pool),
        })
    }

    /// Waits for this process's turn, then makes sure the file is still
    /// the one the store opened: a write into a deleted file would be lost
    /// at the next restart.
    async fn turn(&self, timeout: Option<Duration>) -> Result<OwnedMutexGuard<()>, StoreError> {
        let waiting = self.writer.clone().lock_owned();
        let turn = match timeout {
            Some(timeout) => tokio::time::timeout(timeout, waiting)
                .await
                .map_err(|_| StoreError::Timeout(timeout))?,
            None => waiting.await,
        };
        self.file.still_there()?;
        Ok(turn)
    }

    glue!(sqlx::Sqlite);

    /// SQLite's primary result codes (the low byte of the extended code).
    fn classify(error: &sqlx::Error) -> ErrorClass {
        let Some(error) = error.as_database_error() else {
            return ErrorClass::Other;
        };
        let code = error
            .code()
            .and_then(|code| code.parse::<i32>().ok())
            .unwrap_or(0);
        match code & 0xff {
            // SQLITE_BUSY, SQLITE_LOCKED
            5 | 6 => ErrorClass::Busy,
            // SQLITE_READONLY
            8 => ErrorClass::ReadOnly,
            // SQLITE_CONSTRAINT
            19 => ErrorClass::Refused,
            // SQLITE_PERM, SQLITE_AUTH
            3 | 23 => ErrorClass::PermissionDenied,
            // SQLITE_ERROR
            1 if error.message().starts_with("no such table") => ErrorClass::MissingTable,
            _ => ErrorClass::Other,
        }
    }

    fn explain(&self, class: ErrorClass, error: &sqlx::Error) -> Option<String> {
        self.file.explain(class, error)
    }

    async fn describe(
        on: &mut sqlx::SqliteConnection,
        _table: &str,
    ) -> Result<String, sqlx::Error> {
        sqlx::query_scalar("SELECT 'SQLite ' || sqlite_version()")
            .fetch_one(on)
            .await
    }

    async fn check_claim(
        on: &mut sqlx::SqliteConnection,
        sql: &Statements,
        key: &str,
        wait: Duration,
        begun: bool,
    ) -> Result<bool, sqlx::Error> {
        if !begun {
            Self::raw(on, &format!("PRAGMA busy_timeout = {}", wait.as_millis())).await?;
            Self::raw(on, "BEGIN IMMEDIATE").await?;
        }
        let args = super::dialect::Args {
            key,
            fingerprint: &[0],
            now: super::base::now_ms(),
            ms: 60_000,
            ..Default::default()
        };
        Ok(Self::fetch(on, &statements::check_claim(&sql.table), &args)
            .await?
            .is_some())
    }
}
