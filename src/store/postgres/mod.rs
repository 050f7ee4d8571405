//! The PostgreSQL stores (feature `postgres`), on [sqlx], in plain SQL.
//!
//! # Two stores
//!
//! **[`PostgresTxStore`]** (`PostgresStore::builder().transactional()`):
//! the record and the handler's own writes commit in one transaction. The
//! layer begins a transaction and claims the key inside it, hands it to the
//! handler through [`IdempotentTx<PostgresTx>`](crate::IdempotentTx) (a
//! message's work receives it as `&mut PostgresTx`); the handler writes with
//! `execute(&mut *tx)`; once it returns a final response, the layer writes
//! the completed record in the same transaction and commits. So:
//!
//! - a crash anywhere before the commit leaves neither the effect nor the
//!   record (the claim, inside the transaction, vanishes with it: a retry
//!   executes at once, no lease to wait out); after the commit, both. A
//!   retry replays or executes for the first time: **exactly one effect**.
//! - a first execution costs no commit and no round trip beyond the
//!   handler's own transaction: the claim travels with `BEGIN`, the record
//!   with `COMMIT`.
//! - a non-final response, an error or a panic rolls everything back.
//! - a statement of the handler that fails aborts the transaction: the
//!   handler's own answer is sent (not stored; the key is released), and a
//!   success it answers anyway is withheld with `500` — nothing committed.
//!   A statement that may fail belongs in a `SAVEPOINT`.
//! - if the commit fails or its outcome is unknown (the connection dropped
//!   during `COMMIT`), the handler's response is withheld and the client
//!   gets `503`: it retries and gets a replay or a first execution, both
//!   correct because record and effect are one fact.
//! - an `IdempotentTx` kept past the handler (moved into a spawned task) is
//!   never silently skipped: the layer answers `500`, and the transaction
//!   rolls back when that holder drops it.
//!
//! **The claim is the record's row** — the `processed_messages` pattern: an
//! `INSERT … ON CONFLICT (key) DO NOTHING` inside the request's transaction.
//! A concurrent duplicate's insert meets the uncommitted row and waits for
//! its transaction, at most 50 ms (`lock_timeout`), then answers `409`
//! with `Retry-After`: it never waits for the handler. A duplicate that
//! arrives after the commit finds the record and replays it (one round
//! trip); one after a rollback claims the key and executes. A record that
//! expired but was not deleted yet is replaced inside the claim's
//! transaction. The transaction runs at `READ COMMITTED`, whatever the
//! database's default: the claim relies on each statement seeing the latest
//! commits.
//!
//! A replay's transaction wrote nothing; it is rolled back in front of the
//! next claim on its connection (`ROLLBACK AND CHAIN`), or within 200 ms
//! when none comes, not in a round trip of its own. Until then it holds the
//! table-level lock of its statement (`ROW EXCLUSIVE`), which makes DDL on
//! the records table (a migration's `ALTER TABLE`) wait up to that long.
//!
//! **Bounded like a lease.** The claim lives as long as the transaction,
//! and PostgreSQL ends a transaction that sits idle longer than
//! [`transaction_timeout`](PostgresStoreBuilder::transaction_timeout)
//! (default 30 s): a paused or partitioned process holds its keys at most
//! that long, and cannot commit afterwards. Each request in flight holds
//! one pooled connection for the duration of its handler: size the pool
//! for your concurrency. A connection whose transaction is dropped
//! unfinished is closed, not returned to the pool.
//!
//! **[`PostgresStore`]** (the default): claims are leases, like the Redis
//! store's, each operation one short autocommit statement: a claim with a
//! lease and a fencing token (an expired claim is taken over by compare and
//! swap), heartbeats, fenced completion and release. Use it when the
//! handler's effects live elsewhere; the crash window is then the same as
//! with Redis.
//!
//! Use one store per table.
//!
//! # Portable SQL, and the start-up check
//!
//! The statements use only what PostgreSQL and the PostgreSQL-compatible
//! engines document: `INSERT … ON CONFLICT`, `RETURNING`, CTEs and a plain
//! index — no functions, no advisory locks. What the claim relies on, the
//! store proves when it connects (if the table exists) and in `migrate()`:
//! a claim held by one uncommitted transaction must make a second session's
//! claim of the key wait and fail. An engine that detects such conflicts
//! only at commit, or a table without its primary key, would let a
//! concurrent duplicate run the handler twice: the store refuses to start,
//! naming the engine's `version()` and the reason
//! ([`EngineCheck::Warn`] opts out).
//!
//! # Schema
//!
//! [`migrate`](PostgresTxStore::migrate) creates the table if it is
//! missing. To run it with your own migration tool instead, use [`SCHEMA`]
//! (table `idempotency_records`):
//!
//! ```sql
#![doc = include_str!("schema.sql")]
//! ```
//!
//! `record` holds the completed record in the crate's
//! [`codec`](crate::codec) format; `token` the lease token while a plain
//! claim is in flight. A table created by version 0.1 keeps working as it
//! is; its two functions (`idempotency_records_claim_v2`,
//! `idempotency_records_complete`) and the older
//! `idempotency_records_claim` are no longer used, and can be dropped once
//! no instance of 0.1 runs.
//!
//! # Expiry
//!
//! A record counts as absent once `expires_at` has passed, whether or not it
//! was deleted: correctness never depends on a cleaner. The retention counts
//! from the completion (for a transaction, from the end of the handler, not
//! its start). To reclaim the space, call
//! [`delete_expired`](PostgresTxStore::delete_expired) now and then
//! ([`spawn_cleaner`](PostgresTxStore::spawn_cleaner) does it in the
//! background), or schedule the equivalent SQL:
//!
//! ```sql
//! DELETE FROM idempotency_records WHERE key IN (
//!   SELECT key FROM idempotency_records WHERE expires_at < now()
//!   LIMIT 1000 FOR UPDATE SKIP LOCKED);
//! ```
//!
//! # Failures
//!
//! Every statement is bounded by the command timeout (default 1 s), and so
//! is waiting for a pooled connection: an unreachable database or an
//! exhausted pool answers `503` (fail closed), never a hang.

mod builder;
mod idle;
mod plain;
mod sql;
mod transactional;
mod tx;

use std::time::Duration;

use sqlx::PgPool;

use self::sql::Sql;
pub use self::{
    builder::PostgresStoreBuilder, plain::PostgresStore, sql::SCHEMA,
    transactional::PostgresTxStore, tx::PostgresTx,
};
use sqlx::Row;

use super::{Forgotten, KeyState, StorageKey, StoreError};
use crate::record::codec::Compression;
pub use crate::store::sql::{EngineCheck, Plain, Transactional};
use crate::store::sql::{forgotten, key_state};

/// What both stores hold: the pool, the command timeout, the statements.
pub(super) struct Base {
    pool: PgPool,
    timeout: Duration,
    sql: Sql,
    engine_check: EngineCheck,
    compression: Compression,
}

impl Base {
    /// One operation's worth of work, bounded by the command timeout.
    async fn bounded<T, E: Into<StoreError>>(
        &self,
        work: impl Future<Output = Result<T, E>>,
    ) -> Result<T, StoreError> {
        match tokio::time::timeout(self.timeout, work).await {
            Ok(result) => result.map_err(Into::into),
            Err(_) => Err(StoreError::Timeout(self.timeout)),
        }
    }

    /// A live row, as an operator sees it; `None` when there is none.
    async fn inspect_row(&self, key: &StorageKey) -> Result<Option<KeyState>, StoreError> {
        let row = self
            .bounded(
                sqlx::query(&self.sql.inspect)
                    .bind(key.as_str())
                    .fetch_optional(&self.pool),
            )
            .await?;
        let Some(row) = row else { return Ok(None) };
        key_state(
            row.try_get("record")?,
            row.try_get("ms_left")?,
            &self.compression,
        )
        .map(Some)
    }

    /// Deletes a live completed record (or, `force`, a plain claim in
    /// flight); what it deleted, if anything.
    async fn forget_row(
        &self,
        key: &StorageKey,
        force: bool,
    ) -> Result<Option<Forgotten>, StoreError> {
        let deleted: Option<bool> = self
            .bounded(
                sqlx::query_scalar(&self.sql.forget)
                    .bind(key.as_str())
                    .bind(force)
                    .fetch_optional(&self.pool),
            )
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
        let done = sqlx::query(&self.sql.delete_expired)
            .bind(i64::from(batch))
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected())
    }
}
