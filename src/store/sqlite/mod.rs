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
//! errors and panics roll back; a commit that fails withholds the response
//! (`503`); a constraint the commit breaks is the request's own answer, as
//! for PostgreSQL.
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
//! releases it at once (the operating system drops its file locks).
//!
//! **[`SqliteStore`]** (the default): claims are leases, each operation one
//! short autocommit statement, like the Redis store's.
//!
//! The database opens in WAL mode with `synchronous = FULL`: a committed
//! record survives a crash of the process and of the machine.
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
//! `migrate()`) makes sure a held claim keeps a second writer out and that
//! the key is unique; [`EngineCheck::Warn`] opts out. Expired records count
//! as absent at once; [`delete_expired`](SqliteTxStore::delete_expired) and
//! [`spawn_cleaner`](SqliteTxStore::spawn_cleaner) reclaim the space.

mod builder;
mod plain;
mod sql;
mod transactional;
mod tx;

use std::{
    sync::Arc,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use tokio::sync::OwnedMutexGuard;

use sqlx::SqlitePool;

use self::sql::Sql;
pub use self::{
    builder::SqliteStoreBuilder, plain::SqliteStore, sql::SCHEMA, transactional::SqliteTxStore,
    tx::SqliteTx,
};
use sqlx::Row;

use super::{Forgotten, KeyState, StorageKey, StoreError};
use crate::record::codec::Compression;
pub use crate::store::sql::{EngineCheck, Plain, Transactional};
use crate::store::sql::{forgotten, key_state};

/// What both stores hold: the pool, the busy timeout, the statements, and
/// the process's turn to write.
pub(super) struct Base {
    pool: SqlitePool,
    timeout: Duration,
    sql: Sql,
    engine_check: EngineCheck,
    compression: Compression,
    /// SQLite lets one connection write at a time. Its busy handler makes a
    /// waiting writer sleep and retry, with no order among them: under
    /// contention some wait far longer than others (seconds at 32
    /// requests). The writers of this process take turns here instead, in
    /// arrival order; the busy timeout is left for writers in other
    /// processes.
    writer: Arc<tokio::sync::Mutex<()>>,
}

impl Base {
    /// This process's turn to write, waited for up to the command timeout.
    async fn write_turn(&self) -> Result<OwnedMutexGuard<()>, StoreError> {
        tokio::time::timeout(self.timeout, self.writer.clone().lock_owned())
            .await
            .map_err(|_| StoreError::Timeout(self.timeout))
    }

    /// A live row, as an operator sees it; `None` when there is none.
    async fn inspect_row(&self, key: &StorageKey) -> Result<Option<KeyState>, StoreError> {
        let row = sqlx::query(&self.sql.find)
            .bind(key.as_str())
            .fetch_optional(&self.pool)
            .await?;
        let Some(row) = row else { return Ok(None) };
        let ms_left = row.try_get::<i64, _>("expires_at")? - now_ms();
        if ms_left <= 0 {
            return Ok(None);
        }
        key_state(row.try_get("record")?, ms_left, &self.compression).map(Some)
    }

    /// Deletes a live completed record (or, `force`, a plain claim in
    /// flight); what it deleted, if anything.
    async fn forget_row(
        &self,
        key: &StorageKey,
        force: bool,
    ) -> Result<Option<Forgotten>, StoreError> {
        let deleted: Option<bool> = sqlx::query_scalar(&self.sql.forget)
            .bind(key.as_str())
            .bind(now_ms())
            .bind(force)
            .fetch_optional(&self.pool)
            .await?;
        Ok(forgotten(deleted))
    }

    async fn migrate(&self) -> Result<(), StoreError> {
        sqlx::raw_sql(&self.sql.schema).execute(&self.pool).await?;
        self.check_engine(true).await
    }
}

impl crate::store::sql::DeleteExpired for Base {
    async fn delete_expired(&self, batch: u32) -> Result<u64, StoreError> {
        let _turn = self.write_turn().await?;
        let done = sqlx::query(&self.sql.delete_expired)
            .bind(now_ms())
            .bind(i64::from(batch))
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected())
    }
}

/// Now, as the table keeps times: Unix milliseconds.
fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}
