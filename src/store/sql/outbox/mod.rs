//! The outbox's seam in the SQL family: what an engine supplies for an
//! outbox table — its schema, how its statements read the database's clock
//! and pass over the rows another relay is claiming, how a value is written
//! as a literal — as narrow as sqlx's `migrate::Migrate`, one file per
//! engine (`postgres/outbox.rs`, …). The table's operations are written
//! once over it ([`SqlOutbox`]), on the family's one statement type; the
//! outbox itself (`crate::outbox`) reads its rows and nothing of the
//! family's insides. The records' seam ([`Engine`]) knows nothing of it.

mod statements;
mod table;

use std::sync::Arc;

use sqlx::Pool;
use tokio::sync::Notify;

use super::dialect::Engine;
pub(crate) use table::{MessageRow, NewMessage, SqlOutbox};

/// An engine's outbox: how it writes the outbox's SQL, and how it hears
/// other processes' commits. Its statements run as the records' do
/// ([`Engine`]'s `execute` and `fetch_all`).
pub(crate) trait OutboxEngine: Engine {
    /// How the engine writes the outbox's SQL.
    const OUTBOX: &'static OutboxSql;

    /// Wakes `wake` whenever a commit notifies `channel` (PostgreSQL's
    /// `LISTEN`), from a task of its own; `None` where the engine has no
    /// notifications.
    fn listen(
        pool: &Pool<Self::Db>,
        channel: &str,
        wake: Arc<Notify>,
    ) -> Option<tokio::task::JoinHandle<()>> {
        let _ = (pool, channel, wake);
        None
    }
}

/// How an engine writes the outbox's SQL.
pub(crate) struct OutboxSql {
    /// The table and its indexes, as the engine publishes them (its
    /// `OUTBOX_SCHEMA`): the default table `idempotency_outbox`, its
    /// indexes named `idempotency_outbox_…`.
    pub(crate) schema: &'static str,
    pub(crate) placeholders: Placeholders,
    /// After the claim's inner `SELECT … LIMIT`: PostgreSQL skips rows
    /// another relay is claiming (`FOR UPDATE SKIP LOCKED`); elsewhere the
    /// claim's outer conditions, evaluated again on the row it waited for,
    /// leave it to its first claimer.
    pub(crate) claim_lock: &'static str,
    /// `DELETE … LIMIT` (MySQL) or `DELETE … WHERE seq IN (SELECT … LIMIT)`.
    pub(crate) delete_limit: bool,
    /// Whether an `UPDATE` answers with the rows it changed (`RETURNING`):
    /// the claim then reads its messages in the same statement.
    pub(crate) returning: bool,
    /// What refreshes the planner's statistics of the table, where a
    /// stale estimate makes the claim read every pending row (PostgreSQL,
    /// whose never-analyzed table is thought nearly empty).
    pub(crate) analyze: Option<&'static str>,
    /// The database's clock, in Unix milliseconds, as an expression the
    /// same for a whole statement: claims lapse by it, so relays whose own
    /// clocks disagree never take each other's claims for lapsed. `None`:
    /// the process's clock, bound (SQLite, embedded: its writers share the
    /// host's clock).
    pub(crate) now: Option<&'static str>,
    /// Sent on the connection before each of the relay's writes: MySQL and
    /// MariaDB run them `READ COMMITTED`, so they take no gap locks that a
    /// request's commit (inserting its message) would wait on.
    pub(crate) before_write: Option<&'static str>,
    /// Whether a commit that enqueued messages notifies the table's
    /// channel (`NOTIFY`), which relays in other processes listen on.
    pub(crate) notify: bool,
    /// How a text value (valid UTF-8) and a byte string are written as
    /// literals: an enqueued message's row travels as SQL text with the
    /// transaction's `COMMIT`, and so do the relay's settlements.
    pub(crate) text: fn(&mut String, &str),
    pub(crate) bytes: fn(&mut String, &[u8]),
}

/// How values are written into the text.
#[derive(Clone, Copy)]
// Each engine uses one: a build with fewer engines leaves some unused.
#[cfg_attr(not(every_sql), allow(dead_code))]
pub(crate) enum Placeholders {
    /// `$1`, `$2`, … by the order each value first appears (PostgreSQL).
    Dollar,
    /// `?1`, `?2`, … likewise (SQLite).
    QuestionNumbered,
    /// `?` for each occurrence (MySQL).
    Question,
}
