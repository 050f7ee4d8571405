//! Where the example keeps its charges: one row (or entry) per execution of
//! a charge — in memory, or in SQLite, PostgreSQL or MySQL, whose SQL
//! differs only in its text.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};

use serde::Serialize;
use tower_idempotency::sqlx::{
    self, Database, Decode, Encode, Executor, IntoArguments, MySql, MySqlPool, PgPool, Pool,
    Postgres, Row, Sqlite, SqlitePool, Type,
};

/// A charge, as stored and as answered.
#[derive(Clone, Serialize)]
pub struct Charge {
    pub id: String,
    pub account: String,
    pub amount: i64,
    pub currency: String,
    pub description: Option<String>,
}

/// An engine's SQL for the example's tables.
pub trait Engine: Database {
    /// The tables, created if missing.
    const TABLES: &'static str;
    /// A charge: id, account, amount, currency, description.
    const INSERT_CHARGE: &'static str;
    /// An account's charges, in the order they were made.
    const LIST_CHARGES: &'static str;
}

impl Engine for Sqlite {
    const TABLES: &'static str = "CREATE TABLE IF NOT EXISTS charges (
        id TEXT PRIMARY KEY, account TEXT NOT NULL, amount INTEGER NOT NULL,
        currency TEXT NOT NULL, description TEXT)";
    const INSERT_CHARGE: &'static str = "INSERT INTO charges (id, account, amount, currency, description) VALUES (?1, ?2, ?3, ?4, ?5)";
    const LIST_CHARGES: &'static str = "SELECT id, account, amount, currency, description \
        FROM charges WHERE account = ?1 ORDER BY rowid";
}

impl Engine for Postgres {
    const TABLES: &'static str = "CREATE TABLE IF NOT EXISTS charges (
        id text PRIMARY KEY, account text NOT NULL, amount bigint NOT NULL,
        currency text NOT NULL, description text,
        created_at timestamptz NOT NULL DEFAULT now())";
    const INSERT_CHARGE: &'static str = "INSERT INTO charges (id, account, amount, currency, description) VALUES ($1, $2, $3, $4, $5)";
    const LIST_CHARGES: &'static str = "SELECT id, account, amount, currency, description \
        FROM charges WHERE account = $1 ORDER BY created_at, id";
}

impl Engine for MySql {
    const TABLES: &'static str = "CREATE TABLE IF NOT EXISTS charges (
        n BIGINT AUTO_INCREMENT PRIMARY KEY, id VARCHAR(64) NOT NULL UNIQUE,
        account VARCHAR(255) NOT NULL, amount BIGINT NOT NULL,
        currency VARCHAR(3) NOT NULL, description TEXT) ENGINE = InnoDB";
    const INSERT_CHARGE: &'static str =
        "INSERT INTO charges (id, account, amount, currency, description) VALUES (?, ?, ?, ?, ?)";
    const LIST_CHARGES: &'static str = "SELECT id, account, amount, currency, description \
        FROM charges WHERE account = ? ORDER BY n";
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
    for<'q> <DB as Database>::Arguments<'q>: IntoArguments<'q, DB>,
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

/// An account's charges.
pub async fn list<DB: Engine>(pool: &Pool<DB>, account: &str) -> Result<Vec<Charge>, sqlx::Error>
where
    for<'c> &'c Pool<DB>: Executor<'c, Database = DB>,
    for<'q> <DB as Database>::Arguments<'q>: IntoArguments<'q, DB>,
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
    rows.iter()
        .map(|row| {
            Ok(Charge {
                id: row.try_get("id")?,
                account: row.try_get("account")?,
                amount: row.try_get("amount")?,
                currency: row.try_get("currency")?,
                description: row.try_get("description")?,
            })
        })
        .collect()
}

/// Where charges live.
#[derive(Clone)]
pub enum Charges {
    Memory(Arc<Mutex<HashMap<String, Vec<Charge>>>>),
    Sqlite(SqlitePool),
    Postgres(PgPool),
    MySql(MySqlPool),
}

impl Charges {
    /// Records a charge on its own (committed at once).
    pub async fn insert(&self, charge: &Charge) -> Result<(), sqlx::Error> {
        match self {
            Charges::Memory(charges) => {
                let mut charges = charges.lock().unwrap();
                charges
                    .entry(charge.account.clone())
                    .or_default()
                    .push(charge.clone());
                Ok(())
            }
            Charges::Sqlite(pool) => insert(pool, charge).await,
            Charges::Postgres(pool) => insert(pool, charge).await,
            Charges::MySql(pool) => insert(pool, charge).await,
        }
    }

    pub async fn list(&self, account: &str) -> Result<Vec<Charge>, sqlx::Error> {
        match self {
            Charges::Memory(charges) => Ok(charges
                .lock()
                .unwrap()
                .get(account)
                .cloned()
                .unwrap_or_default()),
            Charges::Sqlite(pool) => list(pool, account).await,
            Charges::Postgres(pool) => list(pool, account).await,
            Charges::MySql(pool) => list(pool, account).await,
        }
    }
}

/// A connection a charge can be inserted on: the request's transaction.
pub trait InsertCharge: Send {
    fn insert(&mut self, charge: &Charge) -> impl Future<Output = Result<(), sqlx::Error>> + Send;
}

impl<C> InsertCharge for C
where
    C: sqlx::Connection<Database: Engine>,
    for<'c> &'c mut C: Executor<'c, Database = C::Database>,
    for<'q> <C::Database as Database>::Arguments<'q>: IntoArguments<'q, C::Database>,
    for<'q> &'q str: Encode<'q, C::Database> + Type<C::Database>,
    for<'q> Option<&'q str>: Encode<'q, C::Database> + Type<C::Database>,
    for<'q> i64: Encode<'q, C::Database> + Type<C::Database>,
{
    async fn insert(&mut self, charge: &Charge) -> Result<(), sqlx::Error> {
        insert(self, charge).await
    }
}
