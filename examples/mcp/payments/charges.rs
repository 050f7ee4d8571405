//! Where the tool server keeps its charges: a table in the database of the
//! idempotency records, written in the call's own transaction. The SQL of
//! each engine differs only in its text.

use serde::Serialize;
use tower_idempotency::sqlx::{
    self, Database, Decode, Encode, Executor, IntoArguments, Pool, Row, Type,
};

/// A charge, as stored and as answered.
#[derive(Clone, Debug, Serialize, schemars::JsonSchema)]
pub struct Charge {
    /// `ch_` and 16 hex digits.
    pub id: String,
    /// In the currency's smallest unit (cents).
    pub amount: i64,
    /// Three lowercase letters (ISO 4217).
    pub currency: String,
    pub description: Option<String>,
}

/// An engine's SQL for the charges table.
pub trait Engine: Database {
    /// The table, created if missing.
    const TABLE: &'static str;
    /// A charge: id, account, amount, currency, description.
    const INSERT: &'static str;
    /// An account's charges, in the order they were made.
    const LIST: &'static str;
}

impl Engine for sqlx::Sqlite {
    const TABLE: &'static str = "CREATE TABLE IF NOT EXISTS mcp_charges (
        id TEXT PRIMARY KEY, account TEXT NOT NULL, amount INTEGER NOT NULL,
        currency TEXT NOT NULL, description TEXT)";
    const INSERT: &'static str = "INSERT INTO mcp_charges (id, account, amount, currency, description) VALUES (?1, ?2, ?3, ?4, ?5)";
    const LIST: &'static str = "SELECT id, amount, currency, description FROM mcp_charges WHERE account = ?1 ORDER BY rowid";
}

#[cfg(feature = "postgres")]
impl Engine for sqlx::Postgres {
    const TABLE: &'static str = "CREATE TABLE IF NOT EXISTS mcp_charges (
        n bigserial PRIMARY KEY, id text NOT NULL UNIQUE, account text NOT NULL,
        amount bigint NOT NULL, currency text NOT NULL, description text)";
    const INSERT: &'static str = "INSERT INTO mcp_charges (id, account, amount, currency, description) VALUES ($1, $2, $3, $4, $5)";
    const LIST: &'static str =
        "SELECT id, amount, currency, description FROM mcp_charges WHERE account = $1 ORDER BY n";
}

#[cfg(feature = "mysql")]
impl Engine for sqlx::MySql {
    const TABLE: &'static str = "CREATE TABLE IF NOT EXISTS mcp_charges (
        n BIGINT AUTO_INCREMENT PRIMARY KEY, id VARCHAR(64) NOT NULL UNIQUE,
        account VARCHAR(255) NOT NULL, amount BIGINT NOT NULL,
        currency VARCHAR(3) NOT NULL, description TEXT) ENGINE = InnoDB";
    const INSERT: &'static str = "INSERT INTO mcp_charges (id, account, amount, currency, description) VALUES (?, ?, ?, ?, ?)";
    const LIST: &'static str =
        "SELECT id, amount, currency, description FROM mcp_charges WHERE account = ? ORDER BY n";
}

/// Creates the table if it is missing.
pub async fn create_table<DB: Engine>(pool: &Pool<DB>) -> Result<(), sqlx::Error>
where
    for<'c> &'c Pool<DB>: Executor<'c, Database = DB>,
{
    sqlx::raw_sql(DB::TABLE).execute(pool).await?;
    Ok(())
}

/// Inserts `account`'s `charge` with `on`: the call's transaction.
pub async fn insert<'c, DB: Engine>(
    on: impl Executor<'c, Database = DB>,
    account: &str,
    charge: &Charge,
) -> Result<(), sqlx::Error>
where
    <DB as Database>::Arguments: IntoArguments<DB>,
    for<'q> &'q str: Encode<'q, DB> + Type<DB>,
    for<'q> Option<&'q str>: Encode<'q, DB> + Type<DB>,
    for<'q> i64: Encode<'q, DB> + Type<DB>,
{
    sqlx::query(DB::INSERT)
        .bind(charge.id.as_str())
        .bind(account)
        .bind(charge.amount)
        .bind(charge.currency.as_str())
        .bind(charge.description.as_deref())
        .execute(on)
        .await?;
    Ok(())
}

/// `account`'s charges.
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
    let rows = sqlx::query(DB::LIST).bind(account).fetch_all(pool).await?;
    rows.iter()
        .map(|row| {
            Ok(Charge {
                id: row.try_get("id")?,
                amount: row.try_get("amount")?,
                currency: row.try_get("currency")?,
                description: row.try_get("description")?,
            })
        })
        .collect()
}
