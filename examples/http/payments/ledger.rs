//! Where the example keeps its charges and the payment processor's webhook
//! events: one row (or entry) per execution — in memory, or in SQLite,
//! PostgreSQL or MySQL, whose SQL differs only in its text.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};

use serde::Serialize;
use tower_idempotency::sqlx::{
    self, Database, Decode, Encode, Executor, IntoArguments, Pool, Row, Sqlite, SqlitePool, Type,
};
#[cfg(feature = "mysql")]
use tower_idempotency::sqlx::{MySql, MySqlPool};
#[cfg(feature = "postgres")]
use tower_idempotency::sqlx::{PgPool, Postgres};

/// A charge, as stored and as answered.
#[derive(Clone, Serialize)]
pub struct Charge {
    pub id: String,
    pub account: String,
    pub amount: i64,
    pub currency: String,
    pub description: Option<String>,
}

/// A webhook event from the payment processor, as recorded and listed.
#[derive(Clone, Serialize)]
pub struct Event {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: Option<String>,
}

/// An engine's SQL for the example's tables.
pub trait Engine: Database {
    /// The tables, created if missing.
    const TABLES: &'static str;
    /// A charge: id, account, amount, currency, description.
    const INSERT_CHARGE: &'static str;
    /// A charge under its downstream key: id, account, amount, currency,
    /// description, key — or nothing, when the account's key has a charge.
    const INSERT_CHARGE_ONCE: &'static str;
    /// The charge an account's key made: account, key.
    const CHARGE_BY_KEY: &'static str;
    /// An account's charges, in the order they were made.
    const LIST_CHARGES: &'static str;
    /// An event: id, type (no unique constraint: a double execution shows).
    const INSERT_EVENT: &'static str;
    /// The events, in the order they were recorded.
    const LIST_EVENTS: &'static str;
}

impl Engine for Sqlite {
    const TABLES: &'static str = "CREATE TABLE IF NOT EXISTS charges (
        id TEXT PRIMARY KEY, account TEXT NOT NULL, amount INTEGER NOT NULL,
        currency TEXT NOT NULL, description TEXT, idempotency_key TEXT,
        UNIQUE (account, idempotency_key));
        CREATE TABLE IF NOT EXISTS processor_events (id TEXT NOT NULL, type TEXT)";
    const INSERT_CHARGE: &'static str = "INSERT INTO charges (id, account, amount, currency, description) VALUES (?1, ?2, ?3, ?4, ?5)";
    const INSERT_CHARGE_ONCE: &'static str = "INSERT INTO charges (id, account, amount, currency, description, idempotency_key) \
        VALUES (?1, ?2, ?3, ?4, ?5, ?6) ON CONFLICT DO NOTHING";
    const CHARGE_BY_KEY: &'static str = "SELECT id, account, amount, currency, description \
        FROM charges WHERE account = ?1 AND idempotency_key = ?2";
    const LIST_CHARGES: &'static str = "SELECT id, account, amount, currency, description \
        FROM charges WHERE account = ?1 ORDER BY rowid";
    const INSERT_EVENT: &'static str = "INSERT INTO processor_events (id, type) VALUES (?1, ?2)";
    const LIST_EVENTS: &'static str = "SELECT id, type FROM processor_events ORDER BY rowid";
}

#[cfg(feature = "postgres")]
impl Engine for Postgres {
    // `CREATE TABLE IF NOT EXISTS` races itself: instances started together
    // on a new database take turns on a transaction-scoped advisory lock.
    const TABLES: &'static str = "BEGIN;
        SELECT pg_advisory_xact_lock(hashtext('payments example schema'));
        CREATE TABLE IF NOT EXISTS charges (
        id text PRIMARY KEY, account text NOT NULL, amount bigint NOT NULL,
        currency text NOT NULL, description text, idempotency_key text,
        created_at timestamptz NOT NULL DEFAULT now(),
        UNIQUE (account, idempotency_key));
        CREATE TABLE IF NOT EXISTS processor_events (n bigserial PRIMARY KEY, id text NOT NULL, type text);
        COMMIT";
    const INSERT_CHARGE: &'static str = "INSERT INTO charges (id, account, amount, currency, description) VALUES ($1, $2, $3, $4, $5)";
    const INSERT_CHARGE_ONCE: &'static str = "INSERT INTO charges (id, account, amount, currency, description, idempotency_key) \
        VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (account, idempotency_key) DO NOTHING";
    const CHARGE_BY_KEY: &'static str = "SELECT id, account, amount, currency, description \
        FROM charges WHERE account = $1 AND idempotency_key = $2";
    const LIST_CHARGES: &'static str = "SELECT id, account, amount, currency, description \
        FROM charges WHERE account = $1 ORDER BY created_at, id";
    const INSERT_EVENT: &'static str = "INSERT INTO processor_events (id, type) VALUES ($1, $2)";
    const LIST_EVENTS: &'static str = "SELECT id, type FROM processor_events ORDER BY n";
}

#[cfg(feature = "mysql")]
impl Engine for MySql {
    const TABLES: &'static str = "CREATE TABLE IF NOT EXISTS charges (
        n BIGINT AUTO_INCREMENT PRIMARY KEY, id VARCHAR(64) NOT NULL UNIQUE,
        account VARCHAR(255) NOT NULL, amount BIGINT NOT NULL,
        currency VARCHAR(3) NOT NULL, description TEXT, idempotency_key VARCHAR(255),
        UNIQUE (account, idempotency_key)) ENGINE = InnoDB;
        CREATE TABLE IF NOT EXISTS processor_events (n BIGINT AUTO_INCREMENT PRIMARY KEY,
        id VARCHAR(255) NOT NULL, type TEXT) ENGINE = InnoDB";
    const INSERT_CHARGE: &'static str =
        "INSERT INTO charges (id, account, amount, currency, description) VALUES (?, ?, ?, ?, ?)";
    // A no-op update on a duplicate key: INSERT IGNORE would also turn
    // every other error into a warning.
    const INSERT_CHARGE_ONCE: &'static str = "INSERT INTO charges (id, account, amount, currency, description, idempotency_key) \
        VALUES (?, ?, ?, ?, ?, ?) ON DUPLICATE KEY UPDATE id = id";
    const CHARGE_BY_KEY: &'static str = "SELECT id, account, amount, currency, description \
        FROM charges WHERE account = ? AND idempotency_key = ?";
    const LIST_CHARGES: &'static str = "SELECT id, account, amount, currency, description \
        FROM charges WHERE account = ? ORDER BY n";
    const INSERT_EVENT: &'static str = "INSERT INTO processor_events (id, type) VALUES (?, ?)";
    const LIST_EVENTS: &'static str = "SELECT id, type FROM processor_events ORDER BY n";
}

/// Creates the tables if they are missing.
pub async fn create_tables<DB: Engine>(pool: &Pool<DB>) -> Result<(), sqlx::Error>
where
    for<'c> &'c Pool<DB>: Executor<'c, Database = DB>,
{
    sqlx::raw_sql(DB::TABLES).execute(pool).await?;
    Ok(())
}

/// Inserts `charge` with `on`: a pooled connection, or the request's
/// transaction.
pub async fn insert<'c, DB: Engine>(
    on: impl Executor<'c, Database = DB>,
    charge: &Charge,
) -> Result<(), sqlx::Error>
where
    <DB as Database>::Arguments: IntoArguments<DB>,
    for<'q> &'q str: Encode<'q, DB> + Type<DB>,
    for<'q> Option<&'q str>: Encode<'q, DB> + Type<DB>,
    for<'q> i64: Encode<'q, DB> + Type<DB>,
{
    sqlx::query(DB::INSERT_CHARGE)
        .bind(charge.id.as_str())
        .bind(charge.account.as_str())
        .bind(charge.amount)
        .bind(charge.currency.as_str())
        .bind(charge.description.as_deref())
        .execute(on)
        .await?;
    Ok(())
}

/// Records `charge` under its downstream key — the account's idempotency
/// key, unique in the table — unless that key already made a charge: the
/// charge that stands.
pub async fn insert_once<DB: Engine>(
    pool: &Pool<DB>,
    charge: &Charge,
    key: &str,
) -> Result<Charge, sqlx::Error>
where
    for<'c> &'c Pool<DB>: Executor<'c, Database = DB>,
    <DB as Database>::Arguments: IntoArguments<DB>,
    for<'q> &'q str: Encode<'q, DB> + Type<DB>,
    for<'q> Option<&'q str>: Encode<'q, DB> + Type<DB>,
    for<'q> i64: Encode<'q, DB> + Type<DB>,
    for<'r> &'r str: sqlx::ColumnIndex<DB::Row>,
    for<'r> String: Decode<'r, DB> + Type<DB>,
    for<'r> i64: Decode<'r, DB> + Type<DB>,
    for<'r> Option<String>: Decode<'r, DB> + Type<DB>,
{
    sqlx::query(DB::INSERT_CHARGE_ONCE)
        .bind(charge.id.as_str())
        .bind(charge.account.as_str())
        .bind(charge.amount)
        .bind(charge.currency.as_str())
        .bind(charge.description.as_deref())
        .bind(key)
        .execute(pool)
        .await?;
    let row = sqlx::query(DB::CHARGE_BY_KEY)
        .bind(charge.account.as_str())
        .bind(key)
        .fetch_one(pool)
        .await?;
    charge_of(&row)
}

/// Records `event` with `on`: a pooled connection, or the request's
/// transaction.
pub async fn insert_event<'c, DB: Engine>(
    on: impl Executor<'c, Database = DB>,
    event: &Event,
) -> Result<(), sqlx::Error>
where
    <DB as Database>::Arguments: IntoArguments<DB>,
    for<'q> &'q str: Encode<'q, DB> + Type<DB>,
    for<'q> Option<&'q str>: Encode<'q, DB> + Type<DB>,
{
    sqlx::query(DB::INSERT_EVENT)
        .bind(event.id.as_str())
        .bind(event.kind.as_deref())
        .execute(on)
        .await?;
    Ok(())
}

/// The recorded events.
pub async fn list_events<DB: Engine>(pool: &Pool<DB>) -> Result<Vec<Event>, sqlx::Error>
where
    for<'c> &'c Pool<DB>: Executor<'c, Database = DB>,
    <DB as Database>::Arguments: IntoArguments<DB>,
    for<'r> &'r str: sqlx::ColumnIndex<DB::Row>,
    for<'r> String: Decode<'r, DB> + Type<DB>,
    for<'r> Option<String>: Decode<'r, DB> + Type<DB>,
{
    let rows = sqlx::query(DB::LIST_EVENTS).fetch_all(pool).await?;
    rows.iter()
        .map(|row| {
            Ok(Event {
                id: row.try_get("id")?,
                kind: row.try_get("type")?,
            })
        })
        .collect()
}

/// An account's charges.
pub async fn list<DB: Engine>(pool: &Pool<DB>, account: &str) -> Result<Vec<Charge>, sqlx::Error>
where
    for<'c> &'c Pool<DB>: Executor<'c, Database = DB>,
    <DB as Database>::Arguments: IntoArguments<DB>,
    for<'q> &'q str: Encode<'q, DB> + Type<DB>,
    for<'r> &'r str: sqlx::ColumnIndex<DB::Row>,
    for<'r> String: Decode<'r, DB> + Type<DB>,
    for<'r> i64: Decode<'r, DB> + Type<DB>,
    for<'r> Option<String>: Decode<'r, DB> + Type<DB>,
{
    let rows = sqlx::query(DB::LIST_CHARGES)
        .bind(account)
        .fetch_all(pool)
        .await?;
    rows.iter().map(charge_of).collect()
}

/// A charge, as a row holds it.
fn charge_of<R: Row>(row: &R) -> Result<Charge, sqlx::Error>
where
    for<'r> &'r str: sqlx::ColumnIndex<R>,
    for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> Option<String>: Decode<'r, R::Database> + Type<R::Database>,
{
    Ok(Charge {
        id: row.try_get("id")?,
        account: row.try_get("account")?,
        amount: row.try_get("amount")?,
        currency: row.try_get("currency")?,
        description: row.try_get("description")?,
    })
}

/// Where charges live.
#[derive(Clone)]
pub enum Charges {
    Memory(Arc<Mutex<Memory>>),
    Sqlite(SqlitePool),
    #[cfg(feature = "postgres")]
    Postgres(PgPool),
    #[cfg(feature = "mysql")]
    MySql(MySqlPool),
    /// DynamoDB's tables beside the records (written only in the request's
    /// transaction).
    #[cfg(feature = "dynamodb")]
    DynamoDb(
        tower_idempotency::aws_sdk_dynamodb::Client,
        crate::dynamo::Tables,
    ),
}

/// A ledger that only a request's transaction writes.
#[cfg(feature = "dynamodb")]
fn in_transactions_only() -> sqlx::Error {
    sqlx::Error::Protocol("DynamoDB charges are written in the request's transaction".into())
}

/// The in-memory ledger: charges by account, each key's charge, and
/// events.
#[derive(Default)]
pub struct Memory {
    charges: HashMap<String, Vec<Charge>>,
    by_key: HashMap<(String, String), Charge>,
    events: Vec<Event>,
}

impl Charges {
    /// Records a charge on its own (committed at once).
    pub async fn insert(&self, charge: &Charge) -> Result<(), sqlx::Error> {
        match self {
            Charges::Memory(memory) => {
                let mut memory = memory.lock().unwrap();
                memory
                    .charges
                    .entry(charge.account.clone())
                    .or_default()
                    .push(charge.clone());
                Ok(())
            }
            Charges::Sqlite(pool) => insert(pool, charge).await,
            #[cfg(feature = "postgres")]
            Charges::Postgres(pool) => insert(pool, charge).await,
            #[cfg(feature = "mysql")]
            Charges::MySql(pool) => insert(pool, charge).await,
            #[cfg(feature = "dynamodb")]
            Charges::DynamoDb(..) => Err(in_transactions_only()),
        }
    }

    /// Records a charge on its own under its downstream key (the account's
    /// idempotency key), unless that key already made one: the charge that
    /// stands. A second execution of one key — its lease lost to a pause,
    /// or a crash between this commit and the idempotency record — finds
    /// the first charge instead of making another.
    pub async fn insert_once(&self, charge: &Charge, key: &str) -> Result<Charge, sqlx::Error> {
        match self {
            Charges::Memory(memory) => {
                let mut memory = memory.lock().unwrap();
                let index = (charge.account.clone(), key.to_owned());
                if let Some(first) = memory.by_key.get(&index) {
                    return Ok(first.clone());
                }
                memory.by_key.insert(index, charge.clone());
                memory
                    .charges
                    .entry(charge.account.clone())
                    .or_default()
                    .push(charge.clone());
                Ok(charge.clone())
            }
            Charges::Sqlite(pool) => insert_once(pool, charge, key).await,
            #[cfg(feature = "postgres")]
            Charges::Postgres(pool) => insert_once(pool, charge, key).await,
            #[cfg(feature = "mysql")]
            Charges::MySql(pool) => insert_once(pool, charge, key).await,
            #[cfg(feature = "dynamodb")]
            Charges::DynamoDb(..) => Err(in_transactions_only()),
        }
    }

    pub async fn list(&self, account: &str) -> Result<Vec<Charge>, sqlx::Error> {
        match self {
            Charges::Memory(memory) => Ok(memory
                .lock()
                .unwrap()
                .charges
                .get(account)
                .cloned()
                .unwrap_or_default()),
            Charges::Sqlite(pool) => list(pool, account).await,
            #[cfg(feature = "postgres")]
            Charges::Postgres(pool) => list(pool, account).await,
            #[cfg(feature = "mysql")]
            Charges::MySql(pool) => list(pool, account).await,
            #[cfg(feature = "dynamodb")]
            Charges::DynamoDb(client, tables) => crate::dynamo::list(client, tables, account)
                .await
                .map_err(sqlx::Error::Protocol),
        }
    }
}

impl Charges {
    /// Records an event on its own (committed at once).
    pub async fn insert_event(&self, event: &Event) -> Result<(), sqlx::Error> {
        match self {
            Charges::Memory(memory) => {
                memory.lock().unwrap().events.push(event.clone());
                Ok(())
            }
            Charges::Sqlite(pool) => insert_event(pool, event).await,
            #[cfg(feature = "postgres")]
            Charges::Postgres(pool) => insert_event(pool, event).await,
            #[cfg(feature = "mysql")]
            Charges::MySql(pool) => insert_event(pool, event).await,
            #[cfg(feature = "dynamodb")]
            Charges::DynamoDb(..) => Err(in_transactions_only()),
        }
    }

    pub async fn list_events(&self) -> Result<Vec<Event>, sqlx::Error> {
        match self {
            Charges::Memory(memory) => Ok(memory.lock().unwrap().events.clone()),
            Charges::Sqlite(pool) => list_events(pool).await,
            #[cfg(feature = "postgres")]
            Charges::Postgres(pool) => list_events(pool).await,
            #[cfg(feature = "mysql")]
            Charges::MySql(pool) => list_events(pool).await,
            #[cfg(feature = "dynamodb")]
            Charges::DynamoDb(client, tables) => crate::dynamo::list_events(client, tables)
                .await
                .map_err(sqlx::Error::Protocol),
        }
    }
}

/// A connection the example writes on: the request's transaction.
pub trait LedgerWrites: Send {
    fn insert(&mut self, charge: &Charge) -> impl Future<Output = Result<(), sqlx::Error>> + Send;
    fn insert_event(
        &mut self,
        event: &Event,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;
}

/// A SQL engine's connection writes through the engine's SQL (one impl
/// per engine: DynamoDB's transaction writes too, in its own way).
macro_rules! sql_ledger_writes {
    ($($connection:ty),*) => {$(
        impl LedgerWrites for $connection {
            async fn insert(&mut self, charge: &Charge) -> Result<(), sqlx::Error> {
                insert(self, charge).await
            }

            async fn insert_event(&mut self, event: &Event) -> Result<(), sqlx::Error> {
                insert_event(self, event).await
            }
        }
    )*};
}

sql_ledger_writes!(sqlx::SqliteConnection);
#[cfg(feature = "postgres")]
sql_ledger_writes!(sqlx::PgConnection);
#[cfg(feature = "mysql")]
sql_ledger_writes!(sqlx::MySqlConnection);
