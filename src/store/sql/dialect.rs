//! The seam between the SQL family and an engine, at the level of
//! statements: what an engine supplies — its pool, its statements and how
//! they run, its error codes and the engine-specific half of the start-up
//! check. Everything else (the builder, the table's upkeep, the lease
//! store, the claim decision, the check itself) is written once, over this
//! trait; the transactional store's half of an engine is
//! [`TxEngine`](super::tx_engine::TxEngine). This module is the family's
//! lowest: it imports none of its siblings.
//!
//! Statements are data: SQL text with the list of values it binds, in
//! order. The engine binds and runs them through the [`glue!`] macro, so no
//! engine repeats how a value is bound or a row read.

use std::{future::Future, sync::Arc, time::Duration};

use sqlx::{AssertSqlSafe, ColumnIndex, Database, Decode, Encode, Pool, Row, Type, query::Query};

use crate::store::StoreError;

/// The connection of a dialect's database.
pub(crate) type Connection<D> = <<D as Dialect>::Db as Database>::Connection;

/// An engine of the SQL store family: `Postgres`,
/// `Sqlite` or `MySql` —
/// the type parameter of [`SqlStore`](super::SqlStore),
/// [`SqlTxStore`](super::SqlTxStore), [`SqlTx`](super::SqlTx) and
/// [`SqlStoreBuilder`](super::SqlStoreBuilder), usually named through each
/// engine's aliases (`PostgresStore`, `SqliteTx`, …). Implemented by this
/// crate's engines only.
pub trait Dialect: sealed::Sealed + Sized + Send + Sync + 'static {
    /// sqlx's database.
    type Db: Database<Connection: Sync>;
    /// Held with a transactional claim besides its connection (SQLite: this
    /// process's turn to write and the key's place in its registry).
    #[doc(hidden)]
    type Held: Send + Sync + 'static;
    /// What a transactional store keeps besides the shared base.
    #[doc(hidden)]
    type TxState: Send + Sync + 'static;
}

pub(crate) mod sealed {
    // Nameable by no one outside the crate: no engine but this crate's.
    #[allow(unreachable_pub)]
    pub trait Sealed {}
}

/// A SQL engine, as the family needs it: everything but the types a user
/// can see.
pub(crate) trait Engine: Dialect {
    /// Held by this process while it writes: SQLite's one writer at a time
    /// takes turns in arrival order; `()` where the database orders writers.
    type Turn: Send;

    /// The store's name, in messages (`"PostgresStore"`).
    const STORE: &'static str;
    /// The transaction's name, for `Debug` (`"PostgresTx"`).
    const TX: &'static str;
    /// The command timeout and the pool size a builder starts with.
    const DEFAULT_TIMEOUT: Duration;
    const DEFAULT_CONNECTIONS: u32;
    /// How the lease claim says that it claimed the key.
    const LEASE_CLAIM: LeaseClaim;
    /// Whether this process's writers take turns ([`Turn`](Self::Turn) is
    /// more than `()`): a claim may then wait in line for its turn.
    const TAKES_TURNS: bool = false;

    /// The statements, for `table` (already checked).
    fn statements(&self, table: &str) -> Statements;

    /// Opens a pool of up to `connections` to `url`, configured for the
    /// stores, each operation bounded by `timeout`.
    fn open(
        url: &str,
        connections: u32,
        timeout: Duration,
    ) -> impl Future<Output = Result<Pool<Self::Db>, StoreError>> + Send;

    /// The engine's own state for a store on `pool`.
    fn new(pool: &Pool<Self::Db>) -> impl Future<Output = Result<Self, StoreError>> + Send;

    /// Whether `error` says that another instance created the same schema
    /// object at the same moment (instances started together on a new
    /// database): the schema is then there, and running it again succeeds.
    fn lost_schema_race(_error: &sqlx::Error) -> bool {
        false
    }

    /// A batch's open key was kept, its record written: what its
    /// transaction holds for the key (SQLite: its place among the keys in
    /// flight) stays until the batch ends.
    fn key_kept(_held: &mut Self::Held) {}

    /// A batch's open key was undone (rolled back to its savepoint): what
    /// its transaction held for the key is given up.
    fn key_undone(_held: &mut Self::Held) {}

    /// This process's turn to write, waited for up to `timeout` (`None`:
    /// as long as it takes).
    fn turn(
        &self,
        timeout: Option<Duration>,
    ) -> impl Future<Output = Result<Self::Turn, StoreError>> + Send;

    /// Runs a statement; the number of rows it changed (or matched).
    fn execute(
        on: &mut Connection<Self>,
        stmt: &Stmt,
        args: &Args<'_>,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;

    /// Runs a statement that answers with a key's row, or none.
    fn fetch(
        on: &mut Connection<Self>,
        stmt: &Stmt,
        args: &Args<'_>,
    ) -> impl Future<Output = Result<Option<KeyRow>, sqlx::Error>> + Send;

    /// Runs a statement that answers with rows, each read as a `T` (pairs
    /// of numbers, an outbox message's row).
    fn fetch_all<T: FromColumns + Send>(
        on: &mut Connection<Self>,
        stmt: &Stmt,
        args: &Args<'_>,
    ) -> impl Future<Output = Result<Vec<T>, sqlx::Error>> + Send;

    /// Runs SQL text whose values are literals (simple protocol), which may
    /// hold several statements.
    fn raw(
        on: &mut Connection<Self>,
        sql: &str,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// [`raw`](Self::raw), answering how many rows its statements changed.
    fn raw_counted(
        on: &mut Connection<Self>,
        sql: &str,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;

    /// What an error means to the family.
    fn classify(error: &sqlx::Error) -> ErrorClass;

    /// Why a statement fails on this engine, for messages a person reads:
    /// an engine may add what it knows (SQLite: the file is gone).
    fn explain(&self, class: ErrorClass, error: &sqlx::Error) -> Option<String> {
        let _ = (class, error);
        None
    }

    /// The engine's name and version, and anything the start-up check
    /// should say about it, for its messages.
    fn describe(
        on: &mut Connection<Self>,
        table: &str,
    ) -> impl Future<Output = Result<String, sqlx::Error>> + Send;

    /// For the start-up check, in a transaction of its own on `on` (begun
    /// on the first call): claims `key` as a transactional claim would,
    /// waiting at most `wait` for a transaction that holds it. `Ok(true)`
    /// when the row was inserted, `Ok(false)` when the key was found taken;
    /// an error as it comes (a wait that ended is classified
    /// [`ErrorClass::LockTimeout`] or [`ErrorClass::Busy`]).
    fn check_claim(
        on: &mut Connection<Self>,
        sql: &Statements,
        key: &str,
        wait: Duration,
        begun: bool,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;
}

/// How a lease claim says that it claimed the key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
// Each engine uses one: a build with fewer engines leaves some unused.
#[cfg_attr(not(every_sql), allow(dead_code))]
pub(crate) enum LeaseClaim {
    /// It answers with a row: the claimed one (`acquired`), or the one
    /// that holds the key; no row when a row committed after its snapshot
    /// made it do nothing (ask again).
    Answers,
    /// Its row count says whether it inserted (or took over) the row;
    /// else the row that holds the key is read next.
    Counts,
    /// Only the row read back tells: the key is this claim's when the row
    /// carries its token (`ON DUPLICATE KEY UPDATE` counts a row it only
    /// found as changed).
    ReadsBack,
}

/// What the family needs to know of an error.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
// Each engine raises some: a build with fewer engines leaves some unused.
#[cfg_attr(not(every_sql), allow(dead_code))]
pub(crate) enum ErrorClass {
    /// A wait for a row another transaction holds was ended by its
    /// timeout: that key is in flight.
    LockTimeout,
    /// The database is busy: another connection holds the lock a write
    /// needs (SQLite's write lock).
    Busy,
    /// The request's own transaction is refused: a statement of it failed
    /// in a way that aborts it, it broke a constraint, or the database
    /// refused its data. The same request meets the same refusal.
    Refused,
    /// The database ended the transaction to resolve a conflict with
    /// another (a deadlock; on a multi-node cluster, a failed
    /// certification): nothing committed.
    Conflict,
    /// A duplicate key.
    Duplicate,
    /// The database (or the file) is read-only.
    ReadOnly,
    /// The records table does not exist.
    MissingTable,
    /// The database user may not do this (no grant on the table, the
    /// database or the server).
    PermissionDenied,
    /// The server refuses the credentials: no such user (role), or a wrong
    /// password.
    BadCredentials,
    /// The database the URL names does not exist on the server.
    NoDatabase,
    /// Anything else: the database failing or out of reach.
    Other,
}

/// A value a statement binds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Param {
    Key,
    Fingerprint,
    Token,
    Record,
    /// A duration in milliseconds: a lease, a retention, a bound.
    Ms,
    /// Now, in Unix milliseconds, by this process's clock (SQLite's, which
    /// is embedded: every writer of the file shares the host's clock).
    Now,
    Batch,
    /// How far an outbox claim looks for heads (a multiple of its batch).
    Window,
    /// An outbox message's id.
    Id,
}

/// A statement: its text, with the table name in place, and the values it
/// binds, in order. The text is the crate's own, and the table name was
/// checked to be a plain identifier: no input reaches it, which is what
/// `AssertSqlSafe` asserts when it is run.
#[derive(Clone, Debug)]
pub(crate) struct Stmt {
    pub(crate) sql: Arc<str>,
    pub(crate) params: Arc<[Param]>,
}

impl Stmt {
    /// `sql` (with `{t}` for the table) binding `params`.
    pub(crate) fn new(table: &str, sql: &str, params: &[Param]) -> Self {
        Self {
            sql: sql.replace("{t}", table).into(),
            params: params.into(),
        }
    }

    /// The statement as sqlx runs it (shared, not copied).
    pub(crate) fn text(&self) -> AssertSqlSafe<Arc<str>> {
        AssertSqlSafe(self.sql.clone())
    }
}

/// The values a statement may bind.
#[derive(Default)]
pub(crate) struct Args<'a> {
    pub(crate) key: &'a str,
    pub(crate) fingerprint: &'a [u8],
    pub(crate) token: &'a [u8],
    pub(crate) record: &'a [u8],
    pub(crate) ms: i64,
    pub(crate) now: i64,
    pub(crate) batch: i64,
    pub(crate) window: i64,
    pub(crate) id: &'a str,
}

/// A key's row, as every statement that reads one answers it, in this
/// order: whether this statement claimed it, the fingerprint, the lease
/// token, the record, and the milliseconds left (zero or less: expired).
#[derive(Debug)]
pub(crate) struct KeyRow {
    pub(crate) acquired: bool,
    pub(crate) fingerprint: Vec<u8>,
    pub(crate) token: Option<Vec<u8>>,
    pub(crate) record: Option<Vec<u8>>,
    pub(crate) ms_left: i64,
}

impl FromColumns for KeyRow {
    fn from_columns(row: &impl Columns) -> Result<Self, sqlx::Error> {
        Ok(Self {
            acquired: row.int(0)? != 0,
            fingerprint: row.bytes(1)?,
            token: row.opt_bytes(2)?,
            record: row.opt_bytes(3)?,
            ms_left: row.int(4)?,
        })
    }
}

impl FromColumns for (i64, i64) {
    fn from_columns(row: &impl Columns) -> Result<Self, sqlx::Error> {
        Ok((row.int(0)?, row.int(1)?))
    }
}

/// A row the family reads, column by column, by position: what a
/// statement answers, in the order it answers it.
pub(crate) trait FromColumns: Sized {
    fn from_columns(row: &impl Columns) -> Result<Self, sqlx::Error>;
}

/// Any engine's row, read as the family's few column types: so that a row
/// is read once for every engine (each engine's glue knows its row type;
/// the family's generic code need not know what it decodes).
pub(crate) trait Columns {
    fn int(&self, at: usize) -> Result<i64, sqlx::Error>;
    fn opt_int(&self, at: usize) -> Result<Option<i64>, sqlx::Error>;
    fn text(&self, at: usize) -> Result<String, sqlx::Error>;
    fn opt_text(&self, at: usize) -> Result<Option<String>, sqlx::Error>;
    fn bytes(&self, at: usize) -> Result<Vec<u8>, sqlx::Error>;
    fn opt_bytes(&self, at: usize) -> Result<Option<Vec<u8>>, sqlx::Error>;
}

impl<R: Row> Columns for R
where
    usize: ColumnIndex<R>,
    i64: for<'r> Decode<'r, R::Database> + Type<R::Database>,
    String: for<'r> Decode<'r, R::Database> + Type<R::Database>,
    Vec<u8>: for<'r> Decode<'r, R::Database> + Type<R::Database>,
{
    fn int(&self, at: usize) -> Result<i64, sqlx::Error> {
        self.try_get(at)
    }
    fn opt_int(&self, at: usize) -> Result<Option<i64>, sqlx::Error> {
        self.try_get(at)
    }
    fn text(&self, at: usize) -> Result<String, sqlx::Error> {
        self.try_get(at)
    }
    fn opt_text(&self, at: usize) -> Result<Option<String>, sqlx::Error> {
        self.try_get(at)
    }
    fn bytes(&self, at: usize) -> Result<Vec<u8>, sqlx::Error> {
        self.try_get(at)
    }
    fn opt_bytes(&self, at: usize) -> Result<Option<Vec<u8>>, sqlx::Error> {
        self.try_get(at)
    }
}

/// The statements every engine has, for one table.
pub(crate) struct Statements {
    pub(crate) table: String,
    pub(crate) schema: String,
    /// A query that fails when the table is missing.
    pub(crate) exists: Stmt,
    /// The key's row, live or expired. Key (and Now).
    pub(crate) find: Stmt,
    /// The lease claim: the in-flight row inserted, or an expired one taken
    /// over (see [`LeaseClaim`]).
    pub(crate) claim: Stmt,
    /// A lease pushed to Ms from now, if the token holds it.
    pub(crate) extend: Stmt,
    /// The record written, for Ms, if the token holds the claim (or the
    /// row already holds this very record).
    pub(crate) complete: Stmt,
    /// The in-flight row deleted, if the token holds it.
    pub(crate) release: Stmt,
    /// A live completed record deleted.
    pub(crate) forget_completed: Stmt,
    /// A live claim in flight (a lease's row) deleted.
    pub(crate) forget_in_flight: Stmt,
    /// The key's row deleted, whatever it holds: a transaction's own claim,
    /// given up while its writes commit. Key.
    pub(crate) delete_claim: Stmt,
    /// Up to Batch expired rows deleted.
    pub(crate) delete_expired: Stmt,
    /// (state, count) for each state of the table's rows: 0 a live record,
    /// 1 a live claim without one, 2 expired (and not deleted yet). Now.
    pub(crate) counts: Stmt,
}

/// Binds `stmt`'s values from `args`, in order.
pub(crate) fn bind<'q, 'a, DB: Database>(
    mut query: Query<'q, DB, <DB as Database>::Arguments>,
    stmt: &Stmt,
    args: &'a Args<'a>,
) -> Query<'q, DB, <DB as Database>::Arguments>
where
    &'a str: Encode<'a, DB> + Type<DB>,
    &'a [u8]: Encode<'a, DB> + Type<DB>,
    i64: Encode<'a, DB> + Type<DB>,
{
    for param in stmt.params.iter() {
        query = match param {
            Param::Key => query.bind(args.key),
            Param::Fingerprint => query.bind(args.fingerprint),
            Param::Token => query.bind(args.token),
            Param::Record => query.bind(args.record),
            Param::Ms => query.bind(args.ms),
            Param::Now => query.bind(args.now),
            Param::Batch => query.bind(args.batch),
            Param::Window => query.bind(args.window),
            Param::Id => query.bind(args.id),
        };
    }
    query
}

/// The dialect's `execute`, `fetch`, `fetch_all` and `raw` for sqlx's database `$db`:
/// the one way a statement is bound, run and its row read.
macro_rules! glue {
    ($db:ty) => {
        async fn execute(
            on: &mut <$db as sqlx::Database>::Connection,
            stmt: &$crate::store::sql::dialect::Stmt,
            args: &$crate::store::sql::dialect::Args<'_>,
        ) -> Result<u64, sqlx::Error> {
            let query = $crate::store::sql::dialect::bind(sqlx::query(stmt.text()), stmt, args);
            Ok(query.execute(on).await?.rows_affected())
        }

        async fn fetch(
            on: &mut <$db as sqlx::Database>::Connection,
            stmt: &$crate::store::sql::dialect::Stmt,
            args: &$crate::store::sql::dialect::Args<'_>,
        ) -> Result<Option<$crate::store::sql::dialect::KeyRow>, sqlx::Error> {
            let query = $crate::store::sql::dialect::bind(sqlx::query(stmt.text()), stmt, args);
            match query.fetch_optional(on).await? {
                Some(row) => Ok(Some(
                    <$crate::store::sql::dialect::KeyRow as $crate::store::sql::dialect::FromColumns>::from_columns(&row)?,
                )),
                None => Ok(None),
            }
        }

        async fn fetch_all<T: $crate::store::sql::dialect::FromColumns + Send>(
            on: &mut <$db as sqlx::Database>::Connection,
            stmt: &$crate::store::sql::dialect::Stmt,
            args: &$crate::store::sql::dialect::Args<'_>,
        ) -> Result<Vec<T>, sqlx::Error> {
            let query = $crate::store::sql::dialect::bind(sqlx::query(stmt.text()), stmt, args);
            query.fetch_all(on).await?.iter().map(T::from_columns).collect()
        }

        async fn raw(
            on: &mut <$db as sqlx::Database>::Connection,
            sql: &str,
        ) -> Result<(), sqlx::Error> {
            sqlx::Executor::execute(on, sqlx::raw_sql(sqlx::AssertSqlSafe(sql))).await?;
            Ok(())
        }

        async fn raw_counted(
            on: &mut <$db as sqlx::Database>::Connection,
            sql: &str,
        ) -> Result<u64, sqlx::Error> {
            let done = sqlx::Executor::execute(on, sqlx::raw_sql(sqlx::AssertSqlSafe(sql))).await?;
            Ok(done.rows_affected())
        }
    };
}
pub(crate) use glue;
