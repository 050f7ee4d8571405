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
//! - a non-final response, a server error (`5xx`), an error or a panic
//!   rolls everything back and releases the key.
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
//! [`transaction_timeout`](SqlStoreBuilder::transaction_timeout)
//! (default 30 s): a paused or partitioned process holds its keys at most
//! that long, and cannot commit afterwards. The store sets
//! `idle_in_transaction_session_timeout` and `statement_timeout` to it for
//! the session of each connection it claims on, once, before its first
//! claim: a pool given with `with_pool` should serve this store alone (the
//! bounds apply to whatever else runs on its connections). Each request in flight holds
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
//! claim is in flight. The key column compares bytes (`COLLATE "C"`): the
//! start-up check refuses one that does not (a case-insensitive collation,
//! `citext`), which would replay one key's answer to another. A table created by version 0.1 keeps working as it
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

mod idle;
mod outbox;
mod statements;
mod transactional;

use std::time::Duration;

use sqlx::{PgConnection, PgPool, postgres::PgPoolOptions};

pub use super::{EngineCheck, Plain, Records, Transactional};
use super::{
    SqlStore, SqlStoreBuilder, SqlTx, SqlTxStore,
    dialect::{Args, Dialect, Engine, ErrorClass, LeaseClaim, Statements, glue, sealed},
};
use crate::store::StoreError;

/// The schema, for the default table name `idempotency_records`; idempotent.
pub const SCHEMA: &str = include_str!("schema.sql");
pub use outbox::OUTBOX_SCHEMA;

/// A [`Store`](crate::store::Store) on PostgreSQL whose claims are leases;
/// see [`SqlStore`].
pub type PostgresStore = SqlStore<Postgres>;

/// A [`Store`](crate::store::Store) on PostgreSQL whose record commits in
/// the handler's own transaction: exactly one effect per key, across
/// crashes; see [`SqlTxStore`] and the [module docs](self).
pub type PostgresTxStore = SqlTxStore<Postgres>;

/// The request's transaction on a [`PostgresTxStore`]; see [`SqlTx`]. It
/// dereferences to the [`PgConnection`].
pub type PostgresTx = SqlTx<Postgres>;

/// Configures and connects a [`PostgresStore`], or with `transactional()` a
/// [`PostgresTxStore`]; see [`SqlStoreBuilder`].
pub type PostgresStoreBuilder<M = Plain> = SqlStoreBuilder<Postgres, M>;

/// The PostgreSQL engine of the SQL store family.
#[derive(Debug)]
pub struct Postgres(());

/// The SQLSTATE of an `EXECUTE` of a statement this connection has not
/// prepared.
const NOT_PREPARED: &str = "26000";

fn sqlstate(error: &sqlx::Error) -> Option<String> {
    error
        .as_database_error()
        .and_then(|e| e.code())
        .map(|code| code.into_owned())
}

impl Dialect for Postgres {
    type Db = sqlx::Postgres;
    type Held = ();
    type TxState = transactional::TxState;
}

impl sealed::Sealed for Postgres {}

impl Engine for Postgres {
    type Turn = ();

    const STORE: &'static str = "PostgresStore";
    const TX: &'static str = "PostgresTx";
    const DEFAULT_TIMEOUT: Duration = Duration::from_secs(1);
    const DEFAULT_CONNECTIONS: u32 = 20;
    const LEASE_CLAIM: LeaseClaim = LeaseClaim::Answers;

    fn statements(&self, table: &str) -> Statements {
        statements::statements(table)
    }

    async fn open(url: &str, connections: u32, timeout: Duration) -> Result<PgPool, StoreError> {
        let pool = PgPoolOptions::new()
            .max_connections(connections)
            .acquire_timeout(timeout);
        super::connect_pool::<Self>(pool, url.parse()?).await
    }

    async fn new(_: &PgPool) -> Result<Self, StoreError> {
        Ok(Self(()))
    }

    async fn turn(&self, _: Option<Duration>) -> Result<(), StoreError> {
        Ok(())
    }

    glue!(sqlx::Postgres);

    /// `CREATE … IF NOT EXISTS` is not safe against itself: two sessions
    /// creating one table both pass the check, and the second fails on the
    /// catalog's unique index (`pg_type_typname_nsp_index`) or says the
    /// relation exists.
    fn lost_schema_race(error: &sqlx::Error) -> bool {
        // unique_violation, duplicate_table, duplicate_object
        matches!(
            sqlstate(error).as_deref(),
            Some("23505" | "42P07" | "42710")
        )
    }

    /// By SQLSTATE.
    fn classify(error: &sqlx::Error) -> ErrorClass {
        let Some(code) = sqlstate(error) else {
            return ErrorClass::Other;
        };
        match code.as_str() {
            // lock_not_available: a wait `lock_timeout` ended.
            "55P03" => ErrorClass::LockTimeout,
            // in_failed_transaction: the handler's own statement failed and
            // aborted the transaction.
            "25P02" => ErrorClass::Refused,
            "40001" | "40P01" => ErrorClass::Conflict,
            "25006" => ErrorClass::ReadOnly,
            "42P01" => ErrorClass::MissingTable,
            // insufficient_privilege
            "42501" => ErrorClass::PermissionDenied,
            // invalid_password; invalid_authorization_specification (no
            // such role, or pg_hba refuses it)
            "28P01" | "28000" => ErrorClass::BadCredentials,
            // invalid_catalog_name: no such database
            "3D000" => ErrorClass::NoDatabase,
            // Data exceptions and integrity constraints (the completion's own
            // guard is a division by zero).
            code if code.starts_with("22") || code.starts_with("23") => ErrorClass::Refused,
            _ => ErrorClass::Other,
        }
    }

    async fn describe(on: &mut PgConnection, _table: &str) -> Result<String, sqlx::Error> {
        sqlx::query_scalar("SELECT version()").fetch_one(on).await
    }

    async fn check_claim(
        on: &mut PgConnection,
        sql: &Statements,
        key: &str,
        wait: Duration,
        begun: bool,
    ) -> Result<bool, sqlx::Error> {
        if !begun {
            let begin = format!(
                "BEGIN ISOLATION LEVEL READ COMMITTED; SET LOCAL lock_timeout = {}",
                wait.as_millis().max(1)
            );
            Self::raw(on, &begin).await?;
        }
        let args = Args {
            key,
            ..Args::default()
        };
        Ok(Self::fetch(on, &statements::check_claim(&sql.table), &args)
            .await?
            .is_some())
    }
}
