//! What both stores of an engine hold — the pool, the command timeout, the
//! statements, the engine — and the table's operations that do not depend
//! on how claims are held: a key's row, forgetting it, sweeping expired
//! rows, creating the table.

use std::{
    future::Future,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use sqlx::Pool;

use super::{
    decide::{key_state, store_error},
    dialect::{Args, Dialect, Engine, KeyRow, Stmt},
};
use crate::{
    record::codec::Compression,
    store::{Forgotten, KeyState, StorageKey, StoreError, TableStats},
};

/// What to do when the start-up check finds that the database would not
/// keep a record apart for its key, or make a concurrent duplicate wait or
/// fail: a claim held by one uncommitted transaction did not block a second
/// session's claim of the same key (an engine that detects the conflict
/// only at commit, a table without its primary key), the key column does
/// not compare bytes (a case-insensitive collation), or the table's storage
/// engine has no transactions. Such a store would run a handler twice, or
/// replay one request's answer to another.
///
/// A database that is busy or read-only is not a failed check: the store
/// waits for a busy one and says so, and reports a read-only one as such.
///
/// # Examples
///
/// ```no_run
/// # #[cfg(feature = "sqlite")]
/// # async fn demo() -> Result<(), tower_idempotency::store::StoreError> {
/// use tower_idempotency::{SqliteStore, store::sqlite::EngineCheck};
///
/// // Checked by other means: say so explicitly.
/// let store = SqliteStore::builder()
///     .engine_check(EngineCheck::Warn)
///     .connect("sqlite://records.db")
///     .await?;
/// # let _ = store; Ok(()) }
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum EngineCheck {
    /// Refuse to start (the default).
    #[default]
    Refuse,
    /// Log an error and start anyway: an explicit opt-out.
    Warn,
}

pub(crate) struct Base<D: Dialect> {
    pub(crate) pool: Pool<D::Db>,
    /// The bound on every operation: its statements and the wait for a
    /// pooled connection.
    pub(crate) timeout: Duration,
    pub(crate) sql: super::dialect::Statements,
    pub(crate) engine_check: EngineCheck,
    pub(crate) compression: Compression,
    pub(crate) engine: D,
}

impl<D: Engine> Base<D> {
    /// One operation's worth of work, bounded by the command timeout.
    pub(crate) async fn bounded<T>(
        &self,
        work: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        crate::store::bounded(self.timeout, work).await
    }

    /// `error` as the store reports it.
    pub(crate) fn error(&self, error: sqlx::Error) -> StoreError {
        store_error(&self.engine, &self.sql.table, error)
    }

    /// Runs `stmt` on a pooled connection: the rows it changed.
    pub(crate) async fn execute(&self, stmt: &Stmt, args: &Args<'_>) -> Result<u64, StoreError> {
        self.bounded(async {
            let mut on = self.pool.acquire().await.map_err(|e| self.error(e))?;
            D::execute(&mut on, stmt, args)
                .await
                .map_err(|e| self.error(e))
        })
        .await
    }

    /// Runs `stmt` on a pooled connection: the key's row it answers.
    pub(crate) async fn fetch(
        &self,
        stmt: &Stmt,
        args: &Args<'_>,
    ) -> Result<Option<KeyRow>, StoreError> {
        self.bounded(async {
            let mut on = self.pool.acquire().await.map_err(|e| self.error(e))?;
            D::fetch(&mut on, stmt, args)
                .await
                .map_err(|e| self.error(e))
        })
        .await
    }

    /// The key's live row, if any.
    pub(crate) async fn live_row(&self, key: &StorageKey) -> Result<Option<KeyRow>, StoreError> {
        let args = Args {
            key: key.as_str(),
            now: now_ms(),
            ..Args::default()
        };
        Ok(self
            .fetch(&self.sql.find, &args)
            .await?
            .filter(|row| row.ms_left > 0))
    }

    /// A live row, as an operator sees it; `None` when there is none.
    pub(crate) async fn inspect_row(
        &self,
        key: &StorageKey,
    ) -> Result<Option<KeyState>, StoreError> {
        match self.live_row(key).await? {
            Some(row) => key_state(row, &self.compression).map(Some),
            None => Ok(None),
        }
    }

    /// Forgets what the key holds when asked: a live completed record is
    /// deleted; a lease's claim in flight only with `force`. The row is read
    /// first, and only what was read is deleted: a record committed after
    /// the question (a request in flight when it was asked) is never.
    pub(crate) async fn forget_row(
        &self,
        key: &StorageKey,
        force: bool,
    ) -> Result<Forgotten, StoreError> {
        let Some(row) = self.live_row(key).await? else {
            return Ok(Forgotten::Nothing);
        };
        let args = Args {
            key: key.as_str(),
            now: now_ms(),
            ..Args::default()
        };
        let (stmt, forgotten) = match row.record {
            Some(_) => (&self.sql.forget_completed, Forgotten::Completed),
            None if force => (&self.sql.forget_in_flight, Forgotten::ForcedInFlight),
            None => return Ok(Forgotten::InFlight),
        };
        let _turn = self.engine.turn(Some(self.timeout)).await?;
        Ok(if self.execute(stmt, &args).await? > 0 {
            forgotten
        } else {
            // Gone since it was read: expired, or forgotten by another.
            Forgotten::Nothing
        })
    }

    /// Deletes up to `batch` expired rows; how many.
    pub(crate) async fn delete_expired(&self, batch: u32) -> Result<u64, StoreError> {
        let args = Args {
            now: now_ms(),
            batch: i64::from(batch),
            ..Args::default()
        };
        let _turn = self.engine.turn(Some(self.timeout)).await?;
        self.execute(&self.sql.delete_expired, &args).await
    }

    /// How many rows the table holds, by what they are.
    pub(crate) async fn stats(&self) -> Result<TableStats, StoreError> {
        let args = Args {
            now: now_ms(),
            ..Args::default()
        };
        let pairs = self
            .bounded(async {
                let mut on = self.pool.acquire().await.map_err(|e| self.error(e))?;
                D::fetch_all::<(i64, i64)>(&mut on, &self.sql.counts, &args)
                    .await
                    .map_err(|e| self.error(e))
            })
            .await?;
        let mut stats = TableStats::default();
        for (state, count) in pairs {
            let count = u64::try_from(count).unwrap_or(0);
            match state {
                0 => stats.completed = count,
                1 => stats.in_flight = count,
                _ => stats.expired += count,
            }
        }
        Ok(stats)
    }

    /// Creates the table and its index if they are missing. Safe to run
    /// from many instances at once on a new database: one that loses the
    /// race to create an object runs the schema again, and finds it there.
    pub(crate) async fn create_table(&self) -> Result<(), StoreError> {
        let mut attempt = 0;
        loop {
            attempt += 1;
            let created = async {
                let _turn = self.engine.turn(Some(self.timeout)).await?;
                let mut on = self.pool.acquire().await.map_err(|e| self.error(e))?;
                Ok::<_, StoreError>(D::raw(&mut on, &self.sql.schema).await)
            };
            match created.await? {
                Ok(()) => break,
                Err(error) if attempt < 10 && D::lost_schema_race(&error) => {
                    tracing::debug!(%error, "idempotency: another instance created the schema at the same moment; again");
                    tokio::time::sleep(Duration::from_millis(20 * attempt)).await;
                }
                Err(error) => {
                    return Err(super::decide::create_error(
                        &self.engine,
                        &self.sql.table,
                        error,
                    ));
                }
            }
        }
        Ok(())
    }
}

/// Now, in Unix milliseconds, by this process's clock: what statements
/// bind as `Param::Now` (only SQLite's do: the server's clock decides
/// elsewhere).
pub(crate) fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}
