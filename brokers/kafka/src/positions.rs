//! Where a consumer's positions live: a small table beside the records,
//! written in the effect's own transaction.

use std::future::Future;

use tower_idempotency::{sqlx, store::Store};

/// The positions table's name.
pub const TABLE: &str = "idempotency_kafka_positions";

/// A transactional SQL store that keeps a Kafka consumer's positions —
/// for each consumer (by name), topic and partition, the next offset to
/// read — in its database, in the table [`TABLE`] (schema:
/// [`POSTGRES_SCHEMA`], [`SQLITE_SCHEMA`], [`MYSQL_SCHEMA`]). A position
/// never moves back: a store of an earlier one leaves a later one as it
/// is, so a late commit of a consumer that lost its partition cannot undo
/// the new owner's progress.
///
/// Implemented, each by its feature of this crate, for
/// `PostgresTxStore` (`postgres`), `SqliteTxStore` (`sqlite`) and
/// `MySqlTxStore` (`mysql`): a store's transactional form, whose
/// transaction the position commits in.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot keep Kafka positions",
    label = "not a transactional SQL store of an enabled feature",
    note = "positions are kept by `PostgresTxStore` (feature `postgres` of tower-idempotency-kafka), \
            `SqliteTxStore` (`sqlite`) or `MySqlTxStore` (`mysql`): build the store with \
            `.transactional()` and enable its feature"
)]
pub trait Positions: Store + Clone {
    /// Creates the table if it is missing.
    fn create_positions_table(&self) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// The stored positions of `consumer` on `topic`: `(partition, next
    /// offset)`.
    fn read_positions(
        &self,
        consumer: &str,
        topic: &str,
    ) -> impl Future<Output = Result<Vec<(i32, i64)>, sqlx::Error>> + Send;

    /// Stores a position on its own (a record decided without work: a
    /// duplicate, a dead letter).
    fn store_position(
        &self,
        position: &Position,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// Stores a position in `tx`, the work's transaction: it commits with
    /// the record and the effect, or not at all.
    fn store_position_in(
        tx: &mut Self::Granted,
        position: &Position,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;
}

/// Where a consumer stands on one partition: the next offset to read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Position {
    /// The consumer's name (what its positions are kept under).
    pub consumer: String,
    /// The topic.
    pub topic: String,
    /// The partition.
    pub partition: i32,
    /// The next offset to read: a record's offset + 1.
    pub next: i64,
}

/// PostgreSQL's positions table; idempotent.
pub const POSTGRES_SCHEMA: &str = "CREATE TABLE IF NOT EXISTS idempotency_kafka_positions (\
    consumer    text    NOT NULL, \
    topic       text    NOT NULL, \
    partition   integer NOT NULL, \
    next_offset bigint  NOT NULL, \
    PRIMARY KEY (consumer, topic, partition))";

/// SQLite's positions table; idempotent.
pub const SQLITE_SCHEMA: &str = "CREATE TABLE IF NOT EXISTS idempotency_kafka_positions (\
    consumer    TEXT    NOT NULL, \
    topic       TEXT    NOT NULL, \
    partition   INTEGER NOT NULL, \
    next_offset INTEGER NOT NULL, \
    PRIMARY KEY (consumer, topic, partition))";

/// MySQL's and MariaDB's positions table; idempotent.
pub const MYSQL_SCHEMA: &str = "CREATE TABLE IF NOT EXISTS idempotency_kafka_positions (\
    consumer    VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL, \
    topic       VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL, \
    `partition` INT    NOT NULL, \
    next_offset BIGINT NOT NULL, \
    PRIMARY KEY (consumer, topic, `partition`)) ENGINE = InnoDB";

/// One engine's `Positions`: its schema, its placeholders, its upsert.
#[allow(unused_macros)]
macro_rules! positions {
    ($store:ty, $db:ty, $schema:expr, $read:expr, $upsert:expr) => {
        impl Positions for $store {
            async fn create_positions_table(&self) -> Result<(), sqlx::Error> {
                sqlx::raw_sql($schema).execute(self.pool()).await.map(drop)
            }

            async fn read_positions(
                &self,
                consumer: &str,
                topic: &str,
            ) -> Result<Vec<(i32, i64)>, sqlx::Error> {
                sqlx::query_as($read)
                    .bind(consumer)
                    .bind(topic)
                    .fetch_all(self.pool())
                    .await
            }

            async fn store_position(&self, position: &Position) -> Result<(), sqlx::Error> {
                upsert::<$db>($upsert, position)
                    .execute(self.pool())
                    .await
                    .map(drop)
            }

            async fn store_position_in(
                tx: &mut Self::Granted,
                position: &Position,
            ) -> Result<(), sqlx::Error> {
                upsert::<$db>($upsert, position)
                    .execute(&mut **tx)
                    .await
                    .map(drop)
            }
        }
    };
}

/// The upsert, bound.
#[cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql"))]
fn upsert<'q, DB: sqlx::Database>(
    sql: &'static str,
    position: &'q Position,
) -> sqlx::query::Query<'q, DB, <DB as sqlx::Database>::Arguments>
where
    &'q str: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    i32: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    i64: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
{
    sqlx::query(sql)
        .bind(position.consumer.as_str())
        .bind(position.topic.as_str())
        .bind(position.partition)
        .bind(position.next)
}

#[cfg(feature = "postgres")]
positions!(
    tower_idempotency::PostgresTxStore,
    sqlx::Postgres,
    POSTGRES_SCHEMA,
    "SELECT partition, next_offset FROM idempotency_kafka_positions WHERE consumer = $1 AND topic = $2",
    "INSERT INTO idempotency_kafka_positions AS p (consumer, topic, partition, next_offset) \
     VALUES ($1, $2, $3, $4) ON CONFLICT (consumer, topic, partition) \
     DO UPDATE SET next_offset = GREATEST(p.next_offset, excluded.next_offset)"
);

#[cfg(feature = "sqlite")]
positions!(
    tower_idempotency::SqliteTxStore,
    sqlx::Sqlite,
    SQLITE_SCHEMA,
    "SELECT partition, next_offset FROM idempotency_kafka_positions WHERE consumer = ?1 AND topic = ?2",
    "INSERT INTO idempotency_kafka_positions AS p (consumer, topic, partition, next_offset) \
     VALUES (?1, ?2, ?3, ?4) ON CONFLICT (consumer, topic, partition) \
     DO UPDATE SET next_offset = MAX(p.next_offset, excluded.next_offset)"
);

#[cfg(feature = "mysql")]
positions!(
    tower_idempotency::MySqlTxStore,
    sqlx::MySql,
    MYSQL_SCHEMA,
    "SELECT `partition`, next_offset FROM idempotency_kafka_positions WHERE consumer = ? AND topic = ?",
    "INSERT INTO idempotency_kafka_positions (consumer, topic, `partition`, next_offset) \
     VALUES (?, ?, ?, ?) ON DUPLICATE KEY UPDATE next_offset = GREATEST(next_offset, VALUES(next_offset))"
);
