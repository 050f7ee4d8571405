//! The PostgreSQL store (feature `postgres`), on [sqlx].
//!
//! # Two modes
//!
//! **Transactional** ([`PostgresStoreBuilder::transactional`]): the record
//! and the handler's own writes commit in one transaction. The layer begins
//! a transaction, claims the key inside it, and hands it to the handler
//! through the [`IdempotentTx`] extractor; the handler writes with
//! `execute(&mut *tx)`; once it returns a final response, the layer writes
//! the completed record in the same transaction and commits. So:
//!
//! - a crash anywhere before the commit leaves neither the effect nor the
//!   record (the claim, inside the transaction, vanishes with it: a retry
//!   executes at once, no lease to wait out); after the commit, both. A
//!   retry replays or executes for the first time: **exactly one effect**.
//! - a first execution costs no commit beyond the handler's own.
//! - a non-final response, an error or a panic rolls everything back.
//! - if the commit fails or its outcome is unknown (the connection dropped
//!   during `COMMIT`), the handler's response is withheld and the client
//!   gets `503`: it retries and gets a replay or a first execution, both
//!   correct because record and effect are one fact.
//! - an [`IdempotentTx`] kept past the handler (moved into a spawned task)
//!   is never silently skipped: the layer answers `500`, and the
//!   transaction rolls back when that holder drops it.
//!
//! The claim is sent with `BEGIN` in one round trip: a function of the schema
//! returns the live record if there is one (a replay needs no lock), else
//! takes the key's transaction-level advisory lock with
//! `pg_try_advisory_xact_lock`, which never waits: a concurrent duplicate
//! gets `409` at once, it never waits on a row lock. Advisory locks are one
//! space for the whole database: the lock's 64-bit key is derived from the
//! table and the record key, so two stores on different tables do not
//! collide, but an application that uses advisory locks for its own
//! purposes may, very rarely, see a spurious `409`. No row is written
//! until the completion, which sends the record with `COMMIT` in one round
//! trip: a first execution costs the handler's own statements plus two round
//! trips, like a transaction the handler began and committed itself. A
//! replay's transaction wrote nothing and holds no row or advisory lock —
//! only the `ACCESS SHARE` lock its read took on the table, which makes DDL
//! on the table (a migration's `ALTER TABLE`) wait for it; it is rolled back in
//! front of the next claim on its connection, or within 200 ms when none
//! comes. Each request in flight holds one pooled
//! connection for the duration of its handler: size the pool for your
//! concurrency. A connection whose transaction is dropped unfinished is
//! closed, not returned to the pool, so no other request inherits it. The
//! transaction runs at `READ COMMITTED`, whatever the database's default:
//! the claim relies on each statement seeing the latest commits.
//!
//! **Plain** (the default): the store implements the claim protocol like the
//! Redis store, each operation one short autocommit statement: a claim with a
//! lease and a fencing token (an expired claim is taken over by compare and
//! swap), heartbeats, fenced completion and release. Use it when the
//! handler's effects live elsewhere; the crash window is then the same as
//! with Redis.
//!
//! Use one mode per table.
//!
//! # Schema
//!
//! [`PostgresStore::migrate`] creates the table if it is missing. To run it
//! with your own migration tool instead, use [`SCHEMA`] (table
//! `idempotency_records`):
//!
//! ```sql
#![doc = include_str!("schema.sql")]
//! ```
//!
//! `record` holds the completed record in the crate's [`codec`]
//! format; `token` the lease token while a plain-mode claim is in flight. The
//! functions are the transactional claim and completion.
//!
//! # Expiry
//!
//! A record counts as absent once `expires_at` has passed, whether or not it
//! was deleted: correctness never depends on a cleaner. To reclaim the
//! space, call [`PostgresStore::delete_expired`] now and then
//! ([`PostgresStore::spawn_cleaner`] does it in the background), or schedule
//! the equivalent SQL with pg_cron:
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

mod idle;
mod tx;

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use bytes::Bytes;
use sha2::{Digest, Sha256};
use sqlx::{Executor, PgConnection, PgPool, Row, postgres::PgPoolOptions};

pub use self::tx::IdempotentTx;
use self::{
    idle::IdleTransactions,
    tx::{OpenTx, TxHandle, TxSlot},
};
use super::{Claim, LeaseToken, StorageKey, Store, StoreError, late_claim};
use crate::{
    fingerprint::{Fingerprint, push_hex},
    record::codec,
    record::{CompletedRecord, CorruptRecord},
};

/// The schema, for the default table name `idempotency_records`; idempotent.
pub const SCHEMA: &str = include_str!("schema.sql");

const DEFAULT_TABLE: &str = "idempotency_records";

/// Retry-After for a duplicate of a request whose transaction is running: the
/// remaining time is not known, the transaction usually ends soon.
const IN_FLIGHT_RETRY_AFTER: Duration = Duration::from_secs(1);

/// A [`Store`] on PostgreSQL. See the [module docs](self) for the two modes,
/// the schema and the failure behaviour.
///
/// Cloning is cheap and clones share the pool.
///
/// # Examples
///
/// ```no_run
/// # async fn demo() -> Result<(), tower_idempotency::store::StoreError> {
/// use axum::{Router, http::StatusCode, routing::post};
/// use tower_idempotency::{IdempotencyLayer, IdempotentTx, PostgresStore};
///
/// let store = PostgresStore::builder()
///     .transactional()
///     .connect("postgres://postgres@127.0.0.1:5432/payments")
///     .await?;
/// store.migrate().await?;
///
/// async fn charge(mut tx: IdempotentTx) -> Result<StatusCode, StatusCode> {
///     sqlx::query("INSERT INTO charges (amount) VALUES ($1)")
///         .bind(1999_i64)
///         .execute(&mut *tx)
///         .await
///         .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
///     // The layer commits this insert together with the stored response.
///     Ok(StatusCode::CREATED)
/// }
///
/// let app: Router = Router::new()
///     .route("/v1/charges", post(charge))
///     .layer(IdempotencyLayer::new(store));
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct PostgresStore {
    inner: Arc<Inner>,
}

struct Inner {
    pool: PgPool,
    timeout: Duration,
    sql: Sql,
    /// Sent at the start of every request's transaction: its bounds.
    bounds: String,
    /// `Some` in transactional mode.
    transactions: Option<Transactions>,
}

struct Transactions {
    /// The open transaction of each claim taken.
    claimed: Mutex<HashMap<LeaseToken, Arc<TxSlot>>>,
    /// Transactions of claims that were not taken, to be rolled back.
    idle: Arc<IdleTransactions>,
}

/// Configures and connects a [`PostgresStore`].
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
///     .connect("postgres://postgres@127.0.0.1:5432/payments")
///     .await?;
/// # let _ = store; Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct PostgresStoreBuilder {
    table: String,
    timeout: Duration,
    max_connections: u32,
    transactional: bool,
    transaction_timeout: Duration,
}

impl PostgresStore {
    /// Starts configuring a store.
    pub fn builder() -> PostgresStoreBuilder {
        PostgresStoreBuilder {
            table: DEFAULT_TABLE.into(),
            timeout: Duration::from_secs(1),
            max_connections: 20,
            transactional: false,
            transaction_timeout: Duration::from_secs(30),
        }
    }

    /// The pool, e.g. to share it with the rest of the application.
    pub fn pool(&self) -> &PgPool {
        &self.inner.pool
    }

    /// Creates the table and its index if they are missing and (re)defines
    /// the schema's functions: idempotent.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn demo(store: tower_idempotency::PostgresStore) -> Result<(), tower_idempotency::store::StoreError> {
    /// store.migrate().await?;
    /// # Ok(()) }
    /// ```
    pub async fn migrate(&self) -> Result<(), StoreError> {
        sqlx::raw_sql(&self.inner.sql.schema)
            .execute(&self.inner.pool)
            .await?;
        Ok(())
    }

    /// Deletes up to `batch` expired records; returns how many it deleted.
    /// Rows locked by a running claim are skipped.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn demo(store: tower_idempotency::PostgresStore) -> Result<(), tower_idempotency::store::StoreError> {
    /// while store.delete_expired(1000).await? == 1000 {}
    /// # Ok(()) }
    /// ```
    pub async fn delete_expired(&self, batch: u32) -> Result<u64, StoreError> {
        let done = sqlx::query(&self.inner.sql.delete_expired)
            .bind(i64::from(batch))
            .execute(&self.inner.pool)
            .await?;
        Ok(done.rows_affected())
    }

    /// Deletes expired records in batches of `batch`, every `every`, in a
    /// background task, until the returned handle is aborted. Failures are
    /// logged and retried at the next tick.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn demo(store: tower_idempotency::PostgresStore) {
    /// use std::time::Duration;
    ///
    /// let cleaner = store.spawn_cleaner(Duration::from_secs(60), 1000);
    /// # cleaner.abort(); }
    /// ```
    pub fn spawn_cleaner(&self, every: Duration, batch: u32) -> tokio::task::JoinHandle<()> {
        let store = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            loop {
                tick.tick().await;
                loop {
                    match store.delete_expired(batch).await {
                        Ok(deleted) if deleted == u64::from(batch) => continue,
                        Ok(_) => break,
                        Err(error) => {
                            tracing::warn!(%error, "idempotency: deleting expired records failed");
                            break;
                        }
                    }
                }
            }
        })
    }

    /// One statement's worth of work, bounded by the command timeout.
    async fn bounded<T>(
        &self,
        work: impl Future<Output = Result<T, sqlx::Error>>,
    ) -> Result<T, StoreError> {
        let timeout = self.inner.timeout;
        match tokio::time::timeout(timeout, work).await {
            Ok(result) => Ok(result?),
            Err(_) => Err(StoreError::Timeout(timeout)),
        }
    }

    /// What a completed (or, in plain mode, in-flight) record tells a claim.
    fn found(fingerprint: &Fingerprint, row: &sqlx::postgres::PgRow) -> Result<Claim, StoreError> {
        let stored: Vec<u8> = row.try_get("fingerprint")?;
        let record: Option<Vec<u8>> = row.try_get("record")?;
        let left = row.try_get::<i64, _>("ms_left")?;
        Self::decide(fingerprint, &stored, record.map(Bytes::from), left)
    }

    /// The same, from the transactional claim's answer: after the state
    /// byte, milliseconds left (`i64`) and the fingerprint's length (`u32`),
    /// both big-endian, then the fingerprint and the record.
    fn found_in_answer(fingerprint: &Fingerprint, answer: Bytes) -> Result<Claim, StoreError> {
        let truncated = CorruptRecord("truncated claim answer");
        let left = answer.get(1..9).ok_or(truncated)?;
        let left = i64::from_be_bytes(left.try_into().expect("8 bytes"));
        let len = answer.get(9..13).ok_or(truncated)?;
        let record_at = 13 + u32::from_be_bytes(len.try_into().expect("4 bytes")) as usize;
        let stored = answer.get(13..record_at).ok_or(truncated)?;
        let record = Some(answer.slice(record_at..)).filter(|r| !r.is_empty());
        Self::decide(fingerprint, stored, record, left)
    }

    /// Another fingerprint is a mismatch; a row without a record yet (a
    /// plain-mode claim) is in flight; a record is a replay.
    fn decide(
        fingerprint: &Fingerprint,
        stored: &[u8],
        record: Option<Bytes>,
        ms_left: i64,
    ) -> Result<Claim, StoreError> {
        let left = Duration::from_millis(ms_left.max(0) as u64);
        if stored != fingerprint.as_bytes() {
            return Ok(Claim::Mismatch);
        }
        Ok(match record {
            None => Claim::InFlight { retry_after: left },
            Some(bytes) => Claim::Completed {
                record: Arc::new(codec::decode(bytes)?.1),
                expires_in: left,
            },
        })
    }

    async fn claim_plain(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<Claim, StoreError> {
        let lease_ms = millis(lease, "lease")?;
        let started = Instant::now();
        // Waiting for a connection sends nothing: a claim that times out here
        // is simply abandoned (carrying it on would add load to a pool
        // already exhausted).
        let mut connection = self.bounded(self.inner.pool.acquire()).await?;
        // Owned, so that it can outlive this call (see `late_claim`).
        let (store, owned_key, fingerprint) = (self.clone(), key.clone(), *fingerprint);
        let claim = async move {
            let token = LeaseToken::generate();
            // The read half sees the statement's snapshot: a row committed
            // just after it began, which made the insert conflict, is
            // invisible to it. Then nothing comes back, and the claim is
            // simply asked again.
            for _ in 0..3 {
                let row = sqlx::query(&store.inner.sql.claim)
                    .bind(owned_key.as_str())
                    .bind(&fingerprint.as_bytes()[..])
                    .bind(&token.to_bytes()[..])
                    .bind(lease_ms)
                    .fetch_optional(&mut *connection)
                    .await?;
                match row {
                    Some(row) if row.try_get::<bool, _>("acquired")? => {
                        return Ok(Claim::Acquired(token));
                    }
                    Some(row) => return Self::found(&fingerprint, &row),
                    None => continue,
                }
            }
            Err(StoreError::Unavailable(
                "the claim found a record it could not read three times".into(),
            ))
        };
        late_claim::within(self, key, started, self.inner.timeout, lease, claim).await
    }

    async fn claim_in_transaction(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        transactions: &Transactions,
    ) -> Result<Claim, StoreError> {
        // BEGIN and the claim in one round trip, so in the simple protocol,
        // without parameters. READ COMMITTED whatever the database's default:
        // the claim's second look, after taking the lock, must see what
        // committed since its first.
        let select = format!(
            "SELECT {}({}, {})",
            self.inner.sql.claim_function,
            text_literal(key.as_str()),
            advisory_key(&self.inner.sql.table, key)
        );
        let (tx, row) = self
            .bounded(async {
                // `Executor::fetch_one`, boxed, rather than `RawSql::fetch_one`,
                // an `async fn` whose future trips rustc's inference of
                // higher-ranked `Send` bounds (rust-lang/rust#100013).
                if let Some(mut parked) = transactions.idle.take() {
                    // Its ROLLBACK travels with this claim; AND CHAIN begins
                    // the next transaction at the same (READ COMMITTED) level.
                    let sql = format!("ROLLBACK AND CHAIN; {}{select}", self.inner.bounds);
                    let on: &mut PgConnection = &mut parked;
                    match on.fetch_one(sqlx::raw_sql(&sql)).await {
                        Ok(row) => return Ok((parked, row)),
                        // E.g. closed by the server meanwhile (a restart, an
                        // idle timeout): dropped, which closes it; a fresh
                        // connection gets the claim.
                        Err(error) => {
                            tracing::debug!(%error, "idempotency: a parked claim transaction failed");
                        }
                    }
                }
                let connection = self.inner.pool.acquire().await?;
                // From here on, a failure closes the connection (see `OpenTx`).
                let mut tx = OpenTx::begun(connection);
                let on: &mut PgConnection = &mut tx;
                let sql = format!(
                    "BEGIN ISOLATION LEVEL READ COMMITTED; {}{select}",
                    self.inner.bounds
                );
                let row = on.fetch_one(sqlx::raw_sql(&sql)).await?;
                Ok((tx, row))
            })
            .await?;
        // The schema's claim function answers with one bytea, led by a
        // state byte.
        let answer = match row.try_get::<Vec<u8>, _>(0) {
            Ok(answer) => Bytes::from(answer),
            Err(error) => {
                transactions.idle.roll_back(tx);
                return Err(error.into());
            }
        };
        match answer.first() {
            Some(b'a') => {
                let token = LeaseToken::generate();
                lock(&transactions.claimed).insert(token, Arc::new(TxSlot::new(tx)));
                return Ok(Claim::Acquired(token));
            }
            // Nothing to do in this transaction. One that holds the key's
            // lock ends now, off the request's path; one that holds nothing
            // ends with the next claim.
            Some(b'i') => {
                transactions.idle.park(tx, &self.inner.pool);
                return Ok(Claim::InFlight {
                    retry_after: IN_FLIGHT_RETRY_AFTER,
                });
            }
            Some(b'c') => transactions.idle.park(tx, &self.inner.pool),
            Some(b'C') => transactions.idle.roll_back(tx),
            _ => {
                transactions.idle.roll_back(tx);
                return Err(CorruptRecord("unknown claim answer").into());
            }
        }
        Self::found_in_answer(fingerprint, answer)
    }

    async fn complete_in_transaction(
        &self,
        key: &StorageKey,
        token: LeaseToken,
        fingerprint: &Fingerprint,
        record: Vec<u8>,
        retention: Duration,
        transactions: &Transactions,
    ) -> Result<bool, StoreError> {
        let Some(slot) = lock(&transactions.claimed).remove(&token) else {
            return Ok(false);
        };
        // `None`: the handler still holds it. It rolls back when dropped.
        let tx = slot.take().ok_or(StoreError::TransactionHeld)?;
        // The record and COMMIT in one round trip (simple protocol, so the
        // values are literals). If the record cannot be written, the function
        // raises and COMMIT never runs.
        // Written into one buffer: the record's literal can run to megabytes.
        let retention = millis(retention, "retention")?;
        let mut complete = format!(
            "SELECT {}({}, ",
            self.inner.sql.complete_function,
            text_literal(key.as_str())
        );
        complete.reserve(2 * (fingerprint.as_bytes().len() + record.len()) + 64);
        push_bytea_literal(&mut complete, fingerprint.as_bytes());
        complete.push_str(", ");
        push_bytea_literal(&mut complete, &record);
        complete.push_str(", ");
        complete.push_str(&retention.to_string());
        complete.push(')');
        // Dropping the transaction (inside `commit_after`) on an error closes
        // its connection: everything rolled back.
        let error = match self.bounded(tx.commit_after(complete)).await {
            Ok(()) => return Ok(true),
            Err(StoreError::Unavailable(error)) => error,
            Err(error) => return Err(error),
        };
        let code = error
            .downcast_ref::<sqlx::Error>()
            .and_then(sqlx::Error::as_database_error)
            .and_then(|e| e.code())
            .map(|code| code.into_owned());
        match code.as_deref() {
            Some(RECORD_EXISTS) => Ok(false),
            // The handler's own statement failed and aborted the transaction
            // (25P02 "in failed SQL transaction"), or the commit broke a
            // constraint or refused data (classes 23 and 22): the same
            // request would meet the same refusal, it is not an outage.
            Some(code)
                if code == IN_FAILED_TRANSACTION
                    || code.starts_with("22")
                    || code.starts_with("23") =>
            {
                Err(StoreError::Refused(error))
            }
            _ => Err(StoreError::Unavailable(error)),
        }
    }
}

/// The SQLSTATE the completion function raises when a live record holds the
/// key (see the schema).
const RECORD_EXISTS: &str = "IR001";

/// The SQLSTATE of a statement sent in a transaction an earlier failure
/// aborted.
const IN_FAILED_TRANSACTION: &str = "25P02";

/// `s` as an escape string literal: visible ASCII keys, `\` and `'` escaped.
fn text_literal(s: &str) -> String {
    format!("E'{}'", s.replace('\\', "\\\\").replace('\'', "\\'"))
}

/// Appends `bytes` as a `bytea` literal in hex, `E'\\x…'`.
fn push_bytea_literal(out: &mut String, bytes: &[u8]) {
    out.push_str("E'\\\\x");
    push_hex(out, bytes);
    out.push('\'');
}

impl std::fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresStore")
            .field("transactional", &self.inner.transactions.is_some())
            .field("timeout", &self.inner.timeout)
            .finish_non_exhaustive()
    }
}

impl PostgresStoreBuilder {
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

    /// The size of the pool [`connect`](Self::connect) opens (default 20). In
    /// transactional mode each request in flight holds one connection.
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

    /// How long a request's transaction may sit idle between two of its
    /// statements, and how long one statement may run, before the database
    /// ends it (default 30 s; transactional mode). The claim lives inside
    /// the transaction, so this bounds how long a key stays in flight when
    /// the process holding it stops answering: paused (`SIGSTOP`, a VM
    /// stall), or cut off by a network partition. The database enforces it
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

    /// Commit the record and the handler's writes in one transaction, handed
    /// to the handler through [`IdempotentTx`]. See the [module docs](self).
    ///
    /// # Examples
    ///
    /// ```
    /// let builder = tower_idempotency::PostgresStore::builder().transactional();
    /// # let _ = builder;
    /// ```
    pub fn transactional(mut self) -> Self {
        self.transactional = true;
        self
    }

    /// Opens a pool to `url`, e.g. `postgres://postgres@127.0.0.1:5432/app`.
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
        let pool = PgPoolOptions::new()
            .max_connections(self.max_connections)
            .acquire_timeout(self.timeout)
            .connect(url)
            .await?;
        self.with_pool(pool)
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
    /// let store = PostgresStore::builder().transactional().with_pool(pool)?;
    /// # let _ = store; Ok(()) }
    /// ```
    pub fn with_pool(self, pool: PgPool) -> Result<PostgresStore, StoreError> {
        let sql = Sql::new(&self.table)?;
        let transactions = self.transactional.then(|| Transactions {
            claimed: Mutex::default(),
            idle: Arc::new(IdleTransactions::new(&pool, self.timeout)),
        });
        let ms = self.transaction_timeout.as_millis();
        let bounds = format!(
            "SET LOCAL idle_in_transaction_session_timeout = {ms}; SET LOCAL statement_timeout = {ms}; "
        );
        Ok(PostgresStore {
            inner: Arc::new(Inner {
                pool,
                timeout: self.timeout,
                sql,
                bounds,
                transactions,
            }),
        })
    }
}

impl Store for PostgresStore {
    async fn claim(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<Claim, StoreError> {
        match &self.inner.transactions {
            Some(transactions) => {
                self.claim_in_transaction(key, fingerprint, transactions)
                    .await
            }
            None => self.claim_plain(key, fingerprint, lease).await,
        }
    }

    async fn extend(
        &self,
        key: &StorageKey,
        token: LeaseToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        if let Some(transactions) = &self.inner.transactions {
            // The claim lives as long as its transaction.
            return Ok(lock(&transactions.claimed).contains_key(&token));
        }
        let updated = self
            .bounded(
                sqlx::query(&self.inner.sql.extend)
                    .bind(key.as_str())
                    .bind(&token.to_bytes()[..])
                    .bind(millis(lease, "lease")?)
                    .execute(&self.inner.pool),
            )
            .await?;
        Ok(updated.rows_affected() == 1)
    }

    async fn complete(
        &self,
        key: &StorageKey,
        token: LeaseToken,
        fingerprint: &Fingerprint,
        record: Arc<CompletedRecord>,
        retention: Duration,
    ) -> Result<bool, StoreError> {
        let record = codec::encode(fingerprint, &record);
        if let Some(transactions) = &self.inner.transactions {
            return self
                .complete_in_transaction(key, token, fingerprint, record, retention, transactions)
                .await;
        }
        let updated = self
            .bounded(
                sqlx::query(&self.inner.sql.complete)
                    .bind(key.as_str())
                    .bind(&token.to_bytes()[..])
                    .bind(record)
                    .bind(millis(retention, "retention")?)
                    .execute(&self.inner.pool),
            )
            .await?;
        Ok(updated.rows_affected() == 1)
    }

    async fn release(&self, key: &StorageKey, token: LeaseToken) -> Result<bool, StoreError> {
        if let Some(transactions) = &self.inner.transactions {
            let Some(slot) = lock(&transactions.claimed).remove(&token) else {
                return Ok(false);
            };
            // If the handler still holds it, it rolls back when dropped.
            if let Some(tx) = slot.take() {
                self.bounded(tx.rollback()).await?;
            }
            return Ok(true);
        }
        let deleted = self
            .bounded(
                sqlx::query(&self.inner.sql.release)
                    .bind(key.as_str())
                    .bind(&token.to_bytes()[..])
                    .execute(&self.inner.pool),
            )
            .await?;
        Ok(deleted.rows_affected() == 1)
    }

    fn attach(&self, token: LeaseToken, extensions: &mut http::Extensions) {
        let Some(transactions) = &self.inner.transactions else {
            return;
        };
        if let Some(slot) = lock(&transactions.claimed).get(&token) {
            extensions.insert(TxHandle(slot.clone()));
        }
    }

    fn commits_effects(&self) -> bool {
        self.inner.transactions.is_some()
    }
}

/// A panic while holding one of the store's locks cannot leave its map or
/// list half-written (every critical section is one operation on it), so a
/// poisoned lock is safe to use.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The advisory lock of a key in a table: 64 bits of a SHA-256 of both
/// (advisory locks are one space for the whole database).
fn advisory_key(table: &str, key: &StorageKey) -> i64 {
    let mut hash = Sha256::new();
    // The table's own name is a plain identifier: no separator can occur in it.
    hash.update(table.as_bytes());
    hash.update(b"\0");
    hash.update(key.as_str().as_bytes());
    let digest = hash.finalize();
    i64::from_be_bytes(digest[..8].try_into().expect("8 bytes"))
}

/// Whole milliseconds, at least 1; a TTL of over a century is a mistake.
fn millis(d: Duration, what: &str) -> Result<i64, StoreError> {
    const CENTURY: Duration = Duration::from_secs(100 * 365 * 24 * 60 * 60);
    if d > CENTURY {
        return Err(StoreError::Misconfigured(format!(
            "a {what} of {d:?} is longer than the Postgres store keeps a record (100 years)"
        )));
    }
    Ok((d.as_millis() as i64).max(1))
}

/// The statements, with the table name in place.
struct Sql {
    table: String,
    schema: String,
    claim: String,
    claim_function: String,
    extend: String,
    complete: String,
    complete_function: String,
    release: String,
    delete_expired: String,
}

impl Sql {
    fn new(table: &str) -> Result<Self, StoreError> {
        let valid = |part: &str| {
            part.starts_with(|c: char| c.is_ascii_lowercase() || c == '_')
                && part
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        };
        let parts: Vec<&str> = table.split('.').collect();
        if parts.len() > 2 || !parts.iter().all(|p| valid(p)) {
            return Err(StoreError::Misconfigured(format!(
                "PostgresStore table {table:?} must be a lowercase identifier (letters, digits, _), optionally schema-qualified"
            )));
        }
        let t = |sql: &str| sql.replace("{t}", table);
        Ok(Self {
            table: table.to_owned(),
            schema: SCHEMA.replace(DEFAULT_TABLE, table),
            claim: t(CLAIM),
            claim_function: format!("{table}_claim_v2"),
            extend: t(EXTEND),
            complete: t(COMPLETE),
            complete_function: format!("{table}_complete"),
            release: t(RELEASE),
            delete_expired: t(DELETE_EXPIRED),
        })
    }
}

/// Plain claim, one statement: the in-flight row inserted (or an expired
/// record taken over), or else the live record. $1 key, $2 fingerprint,
/// $3 token, $4 lease ms.
const CLAIM: &str = concat!(
    "WITH claimed AS (INSERT INTO {t} AS r (key, fingerprint, token, record, expires_at) \
     VALUES ($1, $2, $3, NULL, now() + $4 * interval '1 millisecond') \
     ON CONFLICT (key) DO UPDATE SET fingerprint = EXCLUDED.fingerprint, \
     token = EXCLUDED.token, record = NULL, expires_at = EXCLUDED.expires_at \
     WHERE r.expires_at <= now() RETURNING 1",
    ") SELECT true AS acquired, NULL::bytea AS fingerprint, NULL::bytea AS record, 0::bigint AS ms_left FROM claimed \
     UNION ALL SELECT false, fingerprint, record, \
     (extract(epoch FROM expires_at - now()) * 1000)::bigint \
     FROM {t} WHERE key = $1 AND expires_at > now() AND NOT EXISTS (SELECT 1 FROM claimed)"
);

const EXTEND: &str = "UPDATE {t} SET expires_at = now() + $3 * interval '1 millisecond' \
     WHERE key = $1 AND token = $2 AND expires_at > now()";

/// Fenced by the token; a repeat of this very completion (its reply lost)
/// also counts as stored.
const COMPLETE: &str = "UPDATE {t} SET token = NULL, record = $3, expires_at = now() + $4 * interval '1 millisecond' \
     WHERE key = $1 AND ((token = $2 AND expires_at > now()) OR record = $3)";

const RELEASE: &str = "DELETE FROM {t} WHERE key = $1 AND token = $2";

const DELETE_EXPIRED: &str = "DELETE FROM {t} WHERE key IN (SELECT key FROM {t} WHERE expires_at < now() \
     LIMIT $1 FOR UPDATE SKIP LOCKED)";

impl From<sqlx::Error> for StoreError {
    fn from(error: sqlx::Error) -> Self {
        StoreError::Unavailable(Box::new(error))
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, UNIX_EPOCH};

    use http::StatusCode;

    use super::*;

    /// What the schema's claim function sends for a found record.
    fn answer(state: u8, ms_left: i64, fingerprint: &[u8], record: &[u8]) -> Bytes {
        let mut bytes = vec![state];
        bytes.extend_from_slice(&ms_left.to_be_bytes());
        bytes.extend_from_slice(&(fingerprint.len() as u32).to_be_bytes());
        bytes.extend_from_slice(fingerprint);
        bytes.extend_from_slice(record);
        bytes.into()
    }

    #[test]
    fn a_found_answer_decodes_as_the_claim_decides() {
        let fp = Fingerprint::from_bytes([3; 32]);
        let record = CompletedRecord::Unreplayable {
            status: StatusCode::CREATED,
            created_at: UNIX_EPOCH,
        };
        let encoded = codec::encode(&fp, &record);
        let found = |a| PostgresStore::found_in_answer(&fp, a).unwrap();
        assert!(matches!(
            found(answer(b'c', 1500, fp.as_bytes(), &encoded)),
            Claim::Completed { record: r, expires_in } if *r == record && expires_in == Duration::from_millis(1500)
        ));
        assert!(matches!(
            found(answer(b'c', 10, &[0], &encoded)),
            Claim::Mismatch
        ));
        assert!(matches!(
            found(answer(b'c', 10, fp.as_bytes(), &[])),
            Claim::InFlight { .. }
        ));
        let whole = answer(b'c', 10, fp.as_bytes(), &encoded);
        for cut in [1, 9, 12, 20] {
            assert!(PostgresStore::found_in_answer(&fp, whole.slice(..cut)).is_err());
        }
    }
}
