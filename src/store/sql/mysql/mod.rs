//! The MySQL and MariaDB stores (feature `mysql`), on [sqlx], for MySQL 8.0+
//! and MariaDB 10.6+ (InnoDB tables).
//!
//! # Two stores
//!
//! **[`MySqlTxStore`]** (`MySqlStore::builder().transactional()`): the
//! record and the handler's own writes commit in one transaction. The
//! claim is the first statement of the request's transaction — the
//! record's row, inserted — sent with the session's settings in one round
//! trip; the handler writes through
//! [`IdempotentTx<MySqlTx>`](crate::IdempotentTx) (a message's work
//! receives `&mut MySqlTx`); the record is written into the claim's row and
//! committed with the handler's writes. A crash anywhere before the commit
//! leaves neither; after it, both: **exactly one effect**.
//!
//! What MySQL's own rules make of that:
//!
//! - **A duplicate of a key in flight** meets the first request's
//!   uncommitted row. Its insert waits for it only for a bounded time —
//!   none at all on MariaDB (`SET STATEMENT innodb_lock_wait_timeout = 0
//!   FOR …`), MySQL's minimum of 1 s on MySQL — then fails (1205), and the
//!   duplicate gets `409` + `Retry-After`. After a lock-wait timeout the
//!   transaction is still open: it is rolled back explicitly.
//! - **A duplicate of a committed key** fails its insert with a duplicate
//!   key (1062), then reads the record with a *locking* read (`LOCK IN
//!   SHARE MODE`), which sees the latest committed row whatever the
//!   isolation level (under REPEATABLE READ a plain `SELECT` would not see
//!   a row committed after the transaction's snapshot).
//! - The session does not commit statements on its own while the request's
//!   transaction runs (`autocommit = 0`), so that after a deadlock (1213)
//!   rolled the transaction back, nothing the handler writes next commits
//!   without its record; the claim's row is gone, and the completion
//!   refuses to commit.
//! - No `INSERT IGNORE` (it turns every error, truncations included, into a
//!   warning), and no row-count logic on `ON DUPLICATE KEY UPDATE` (sqlx
//!   connects with `CLIENT_FOUND_ROWS`, so a row found counts as changed).
//! - **A deadlock or a failed certification is never retried by running
//!   the handler again**: nothing committed, the response is withheld
//!   (`503`), and the client's retry replays or executes once.
//! - **Bounded like a lease.** MariaDB ends a transaction idle longer than
//!   [`transaction_timeout`](SqlStoreBuilder::transaction_timeout)
//!   (`idle_transaction_timeout`, `max_statement_time`, whole seconds);
//!   MySQL closes a connection idle that long (`wait_timeout`). Either way
//!   a paused or cut-off instance holds its keys no longer, and cannot
//!   commit afterwards.
//!
//! The request's transaction runs at READ COMMITTED, whatever the server's
//! default (as on PostgreSQL): under REPEATABLE READ, InnoDB's gap locks
//! make concurrent inserts of *different* keys wait for each other, and a
//! claim that may not wait would report a new key in flight. The store
//! sets it — and on MariaDB the transaction's bounds — once for the
//! session of each connection, before its first claim, in a round trip of
//! its own; like the PostgreSQL store's bounds, they stay with the pooled
//! connection. (A user variable marks the session as ready, and the
//! claim's fingerprint carries it: a connection not set up yet fails its
//! claim, inserting nothing, and is set up.)
//!
//! **[`MySqlStore`]** (the default): claims are leases, each operation one
//! short autocommit statement.
//!
//! # Beyond one server: Galera
//!
//! On a multi-primary MariaDB Galera cluster (`wsrep_on`, which the store
//! detects and logs at start-up), row locks are local to a node: two
//! duplicates sent to two nodes both insert their claim, both run their
//! handler, and one loses at `COMMIT` with a certification failure (1213).
//! The effect still commits once — the loser's response is withheld, its
//! client retries and gets the replay — but its handler ran. So on Galera:
//! **effects in the database commit exactly once**; effects outside it (a
//! call to a payment processor) may run twice: route each scope's writes to
//! one node, or key the outside call downstream (pass the idempotency key
//! on).
//!
//! # Schema
//!
//! [`migrate`](MySqlTxStore::migrate) creates the table if it is missing,
//! or run [`SCHEMA`] yourself:
//!
//! ```sql
#![doc = include_str!("schema.sql")]
//! ```
//!
//! The start-up check refuses a table whose storage engine has no
//! transactions (MyISAM, MEMORY: their "transactions" commit each
//! statement on its own, so exactly-once would silently be lost), a key
//! column that does not compare bytes (a `_ci` collation), and a table
//! without its primary key; [`EngineCheck::Warn`] opts out.

mod outbox;
mod statements;
mod transactional;

use std::time::Duration;

use sqlx::{MySqlConnection, MySqlPool, mysql::MySqlPoolOptions};

pub use super::{EngineCheck, Plain, Records, Transactional};
use super::{
    SqlStore, SqlStoreBuilder, SqlTx, SqlTxStore,
    dialect::{Dialect, Engine, ErrorClass, LeaseClaim, Statements, glue, sealed},
};
use crate::store::StoreError;

/// The schema, for the default table name `idempotency_records`; idempotent.
pub const SCHEMA: &str = include_str!("schema.sql");
pub use outbox::OUTBOX_SCHEMA;

/// A [`Store`](crate::store::Store) on MySQL or MariaDB whose claims are
/// leases; see [`SqlStore`].
pub type MySqlStore = SqlStore<MySql>;

/// A [`Store`](crate::store::Store) on MySQL or MariaDB whose record
/// commits in the handler's own transaction: exactly one effect per key,
/// across crashes; see [`SqlTxStore`] and the [module docs](self).
pub type MySqlTxStore = SqlTxStore<MySql>;

/// The request's transaction on a [`MySqlTxStore`]; see [`SqlTx`]. It
/// dereferences to the [`MySqlConnection`].
pub type MySqlTx = SqlTx<MySql>;

/// Configures and connects a [`MySqlStore`], or with `transactional()` a
/// [`MySqlTxStore`]; see [`SqlStoreBuilder`].
pub type MySqlStoreBuilder<M = Plain> = SqlStoreBuilder<MySql, M>;

/// The MySQL and MariaDB engine of the SQL store family.
#[derive(Debug)]
pub struct MySql {
    flavor: Flavor,
}

/// Which server: they differ in how a wait is scoped and a transaction
/// bounded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Flavor {
    MariaDb,
    MySql,
}

/// MySQL's error number of a database error.
fn number(error: &sqlx::Error) -> Option<u16> {
    error
        .as_database_error()?
        .try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
        .map(|e| e.number())
}

impl Dialect for MySql {
    type Db = sqlx::MySql;
    type Held = ();
    type TxState = transactional::TxState;
}

impl sealed::Sealed for MySql {}

impl Engine for MySql {
    type Turn = ();

    const STORE: &'static str = "MySqlStore";
    const TX: &'static str = "MySqlTx";
    const DEFAULT_TIMEOUT: Duration = Duration::from_secs(1);
    const DEFAULT_CONNECTIONS: u32 = 20;
    const LEASE_CLAIM: LeaseClaim = LeaseClaim::ReadsBack;

    fn statements(&self, table: &str) -> Statements {
        statements::statements(table, self.flavor)
    }

    async fn open(url: &str, connections: u32, timeout: Duration) -> Result<MySqlPool, StoreError> {
        let pool = MySqlPoolOptions::new()
            .max_connections(connections)
            .acquire_timeout(timeout);
        super::connect_pool::<Self>(pool, url.parse()?).await
    }

    async fn new(pool: &MySqlPool) -> Result<Self, StoreError> {
        let version: String = sqlx::query_scalar("SELECT VERSION()")
            .fetch_one(pool)
            .await?;
        let flavor = if version.contains("MariaDB") {
            Flavor::MariaDb
        } else {
            Flavor::MySql
        };
        let galera: Option<(String, String)> = sqlx::query_as("SHOW VARIABLES LIKE 'wsrep_on'")
            .fetch_optional(pool)
            .await?;
        if galera.is_some_and(|(_, on)| on.eq_ignore_ascii_case("ON")) {
            tracing::warn!(
                "idempotency: {version} is a Galera cluster node (wsrep_on): row locks are local to a node, so \
                 two duplicates sent to two nodes both run their handler and one loses at COMMIT. Effects in \
                 this database commit exactly once; effects outside it (a call to a payment processor) may run \
                 twice: route each scope's writes to one node, or key the outside call downstream"
            );
        }
        Ok(Self { flavor })
    }

    async fn turn(&self, _: Option<Duration>) -> Result<(), StoreError> {
        Ok(())
    }

    glue!(sqlx::MySql);

    /// By MySQL's error number.
    /// MySQL's DDL takes a metadata lock, but a table created between the
    /// check and the create is still "already exists", and its index a
    /// duplicate name.
    fn lost_schema_race(error: &sqlx::Error) -> bool {
        // ER_TABLE_EXISTS_ERROR, ER_DUP_KEYNAME, ER_LOCK_DEADLOCK
        matches!(number(error), Some(1050 | 1061 | 1213))
    }

    fn classify(error: &sqlx::Error) -> ErrorClass {
        match number(error) {
            // ER_LOCK_WAIT_TIMEOUT
            Some(1205) => ErrorClass::LockTimeout,
            // ER_LOCK_DEADLOCK: a deadlock, or Galera's failed certification.
            Some(1213) => ErrorClass::Conflict,
            // ER_DUP_ENTRY
            Some(1062) => ErrorClass::Duplicate,
            // ER_NO_SUCH_TABLE
            Some(1146) => ErrorClass::MissingTable,
            // ER_TABLEACCESS_DENIED_ERROR, ER_COLUMNACCESS_DENIED_ERROR,
            // ER_DBACCESS_DENIED_ERROR, ER_SPECIFIC_ACCESS_DENIED_ERROR
            Some(1142 | 1143 | 1044 | 1227) => ErrorClass::PermissionDenied,
            // ER_ACCESS_DENIED_ERROR: no such user, or a wrong password
            Some(1045) => ErrorClass::BadCredentials,
            // ER_BAD_DB_ERROR
            Some(1049) => ErrorClass::NoDatabase,
            // --read-only, a read-only transaction, innodb_read_only.
            Some(1290 | 1792 | 1836 | 1015) => ErrorClass::ReadOnly,
            Some(_) => {
                let sqlstate = error.as_database_error().and_then(|e| e.code());
                match sqlstate.as_deref() {
                    // Data exceptions and integrity constraints: the request's own.
                    Some(code) if code.starts_with("22") || code.starts_with("23") => {
                        ErrorClass::Refused
                    }
                    _ => ErrorClass::Other,
                }
            }
            None => ErrorClass::Other,
        }
    }

    async fn describe(on: &mut MySqlConnection, table: &str) -> Result<String, sqlx::Error> {
        let (version, comment): (String, String) =
            sqlx::query_as("SELECT VERSION(), @@version_comment")
                .fetch_one(&mut *on)
                .await?;
        let (schema, name) = match table.split_once('.') {
            Some((schema, name)) => (Some(schema), name),
            None => (None, table),
        };
        let engine: Option<String> = sqlx::query_scalar(
            "SELECT ENGINE FROM information_schema.TABLES WHERE TABLE_SCHEMA = COALESCE(?, DATABASE()) AND TABLE_NAME = ?",
        )
        .bind(schema)
        .bind(name)
        .fetch_optional(on)
        .await?
        .flatten();
        let engine = engine.map_or(String::new(), |e| format!(", table engine {e}"));
        Ok(format!("{version} ({comment}){engine}"))
    }

    async fn check_claim(
        on: &mut MySqlConnection,
        sql: &Statements,
        key: &str,
        wait: Duration,
        begun: bool,
    ) -> Result<bool, sqlx::Error> {
        let flavor = if sqlx::query_scalar::<_, String>("SELECT VERSION()")
            .fetch_one(&mut *on)
            .await?
            .contains("MariaDB")
        {
            Flavor::MariaDb
        } else {
            Flavor::MySql
        };
        // The probe's claim never waits longer than MySQL must.
        let _ = (wait, begun);
        match Self::raw(on, &statements::probe(&sql.table, flavor, key)).await {
            Ok(()) => Ok(true),
            Err(error) if Self::classify(&error) == ErrorClass::Duplicate => Ok(false),
            Err(error) => Err(error),
        }
    }
}
