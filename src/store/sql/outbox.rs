//! The outbox's seam in the SQL family: what an engine supplies for an
//! outbox table — its schema, how its statements read the database's clock
//! and pass over the rows another relay is claiming, how a value is written
//! as a literal, how a claim's rows are read — as narrow as sqlx's
//! `migrate::Migrate`, one file per engine (`postgres/outbox.rs`, …). The
//! outbox itself, relay included, is written once over it (`crate::outbox`);
//! the records' seam ([`Engine`]) knows nothing of it.

use std::{future::Future, sync::Arc};

use sqlx::{AssertSqlSafe, Database, Encode, Pool, Type, query::Query};
use tokio::sync::Notify;

use super::dialect::{Connection, Engine};

/// An engine's outbox: its SQL, and how its rows are read.
pub(crate) trait OutboxEngine: Engine {
    /// How the engine writes the outbox's SQL.
    const OUTBOX: &'static OutboxSql;

    /// Runs a statement; the rows it changed.
    fn outbox_execute(
        on: &mut Connection<Self>,
        stmt: &OutboxStmt,
        args: &OutboxArgs<'_>,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;

    /// Runs a statement that answers with messages' rows (see
    /// [`MessageRow`]).
    fn outbox_fetch(
        on: &mut Connection<Self>,
        stmt: &OutboxStmt,
        args: &OutboxArgs<'_>,
    ) -> impl Future<Output = Result<Vec<MessageRow>, sqlx::Error>> + Send;

    /// Runs a statement that answers with `(state, count)` rows.
    fn outbox_pairs(
        on: &mut Connection<Self>,
        stmt: &OutboxStmt,
        args: &OutboxArgs<'_>,
    ) -> impl Future<Output = Result<Vec<(i64, i64)>, sqlx::Error>> + Send;

    /// Runs a statement that answers with `(state, count, oldest, now)`
    /// rows (see [`OutboxStatements::backlog`]).
    fn outbox_backlog(
        on: &mut Connection<Self>,
        stmt: &OutboxStmt,
        args: &OutboxArgs<'_>,
    ) -> impl Future<Output = Result<Vec<BacklogRow>, sqlx::Error>> + Send;

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
#[cfg_attr(
    not(all(feature = "postgres", feature = "sqlite", feature = "mysql")),
    allow(dead_code)
)]
pub(crate) enum Placeholders {
    /// `$1`, `$2`, … by the order each value first appears (PostgreSQL).
    Dollar,
    /// `?1`, `?2`, … likewise (SQLite).
    QuestionNumbered,
    /// `?` for each occurrence (MySQL).
    Question,
}

/// A value an outbox statement binds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum OutboxParam {
    /// A relay's claim.
    Token,
    /// Now, in Unix milliseconds, by the process's clock (only where the
    /// engine has no clock of its own to read: SQLite).
    Now,
    /// A duration in milliseconds.
    Ms,
    Batch,
    /// How far a claim looks for heads: [`CLAIM_WINDOW`] batches.
    Window,
    Id,
}

/// How many batches of the oldest due messages a claim reads, at most, to
/// find its batch of heads: its cost is bounded by the batch, whatever one
/// ordering key holds (a hot account's thousands of messages are not
/// walked, each one probed, to reach another account's).
pub(crate) const CLAIM_WINDOW: i64 = 4;

/// The values an outbox statement may bind.
#[derive(Default)]
pub(crate) struct OutboxArgs<'a> {
    pub(crate) token: &'a [u8],
    pub(crate) now: i64,
    pub(crate) ms: i64,
    pub(crate) batch: i64,
    pub(crate) id: &'a str,
}

/// An outbox statement: its text, the table in place, and what it binds.
/// The text is the crate's own and the table a checked identifier, which
/// is what `AssertSqlSafe` asserts when it runs.
#[derive(Clone, Debug)]
pub(crate) struct OutboxStmt {
    pub(crate) sql: Arc<str>,
    pub(crate) params: Arc<[OutboxParam]>,
}

impl OutboxStmt {
    pub(crate) fn text(&self) -> AssertSqlSafe<Arc<str>> {
        AssertSqlSafe(self.sql.clone())
    }
}

/// Binds `stmt`'s values from `args`, in order.
pub(crate) fn bind<'q, 'a, DB: Database>(
    mut query: Query<'q, DB, <DB as Database>::Arguments>,
    stmt: &OutboxStmt,
    args: &'a OutboxArgs<'a>,
) -> Query<'q, DB, <DB as Database>::Arguments>
where
    &'a str: Encode<'a, DB> + Type<DB>,
    &'a [u8]: Encode<'a, DB> + Type<DB>,
    i64: Encode<'a, DB> + Type<DB>,
{
    for param in stmt.params.iter() {
        query = match param {
            OutboxParam::Token => query.bind(args.token),
            OutboxParam::Now => query.bind(args.now),
            OutboxParam::Ms => query.bind(args.ms),
            OutboxParam::Batch => query.bind(args.batch),
            OutboxParam::Window => query.bind(args.batch.saturating_mul(CLAIM_WINDOW)),
            OutboxParam::Id => query.bind(args.id),
        };
    }
    query
}

/// A message's row, as every statement that reads one answers it, in this
/// order.
#[derive(Debug)]
pub(crate) struct MessageRow {
    pub(crate) id: String,
    pub(crate) destination: String,
    pub(crate) ordering_key: Option<String>,
    pub(crate) payload: Vec<u8>,
    pub(crate) headers: String,
    pub(crate) created_at: i64,
    pub(crate) attempts: i64,
}

/// What the backlog statement answers per state: its state (see
/// [`OutboxStatements::backlog`]), how many rows, the oldest one's
/// `created_at`, and the database's now.
pub(crate) type BacklogRow = (i64, i64, Option<i64>, i64);

/// The engine's `outbox_execute`, `outbox_fetch`, `outbox_pairs` and `outbox_backlog` for
/// sqlx's database `$db`.
macro_rules! outbox_glue {
    ($db:ty) => {
        async fn outbox_execute(
            on: &mut <$db as sqlx::Database>::Connection,
            stmt: &$crate::store::sql::outbox::OutboxStmt,
            args: &$crate::store::sql::outbox::OutboxArgs<'_>,
        ) -> Result<u64, sqlx::Error> {
            let query = $crate::store::sql::outbox::bind(sqlx::query(stmt.text()), stmt, args);
            Ok(query.execute(on).await?.rows_affected())
        }

        async fn outbox_fetch(
            on: &mut <$db as sqlx::Database>::Connection,
            stmt: &$crate::store::sql::outbox::OutboxStmt,
            args: &$crate::store::sql::outbox::OutboxArgs<'_>,
        ) -> Result<Vec<$crate::store::sql::outbox::MessageRow>, sqlx::Error> {
            use sqlx::Row as _;
            let query = $crate::store::sql::outbox::bind(sqlx::query(stmt.text()), stmt, args);
            query
                .fetch_all(on)
                .await?
                .iter()
                .map(|row| {
                    Ok($crate::store::sql::outbox::MessageRow {
                        id: row.try_get(0)?,
                        destination: row.try_get(1)?,
                        ordering_key: row.try_get(2)?,
                        payload: row.try_get(3)?,
                        headers: row.try_get(4)?,
                        created_at: row.try_get(5)?,
                        attempts: row.try_get(6)?,
                    })
                })
                .collect()
        }

        async fn outbox_pairs(
            on: &mut <$db as sqlx::Database>::Connection,
            stmt: &$crate::store::sql::outbox::OutboxStmt,
            args: &$crate::store::sql::outbox::OutboxArgs<'_>,
        ) -> Result<Vec<(i64, i64)>, sqlx::Error> {
            use sqlx::Row as _;
            let query = $crate::store::sql::outbox::bind(sqlx::query(stmt.text()), stmt, args);
            query
                .fetch_all(on)
                .await?
                .iter()
                .map(|row| Ok((row.try_get(0)?, row.try_get(1)?)))
                .collect()
        }

        async fn outbox_backlog(
            on: &mut <$db as sqlx::Database>::Connection,
            stmt: &$crate::store::sql::outbox::OutboxStmt,
            args: &$crate::store::sql::outbox::OutboxArgs<'_>,
        ) -> Result<Vec<$crate::store::sql::outbox::BacklogRow>, sqlx::Error> {
            use sqlx::Row as _;
            let query = $crate::store::sql::outbox::bind(sqlx::query(stmt.text()), stmt, args);
            query
                .fetch_all(on)
                .await?
                .iter()
                .map(|row| {
                    Ok((
                        row.try_get(0)?,
                        row.try_get(1)?,
                        row.try_get(2)?,
                        row.try_get(3)?,
                    ))
                })
                .collect()
        }
    };
}
pub(crate) use outbox_glue;

/// The outbox's statements, for one table. Times are Unix milliseconds by
/// the database's clock (`{now}`), save on SQLite (the process's).
pub(crate) struct OutboxStatements {
    /// The table, checked.
    pub(crate) table: String,
    /// The engine's own (its literals, its clock, its isolation).
    pub(crate) engine: &'static OutboxSql,
    /// The channel a commit notifies (where the engine has one).
    pub(crate) channel: Option<String>,
    /// Creates the table and its indexes if missing.
    pub(crate) schema: String,
    /// Fails unless the table exists, with the columns the statements use.
    pub(crate) exists: OutboxStmt,
    /// Up to Batch pending messages due by now, each the oldest pending of
    /// its ordering key (the key's head), claimed for Token until now + Ms;
    /// answering with them when `claim_returns`.
    pub(crate) claim: OutboxStmt,
    pub(crate) claim_returns: bool,
    /// Refreshes the table's statistics, where the engine needs it done.
    pub(crate) analyze: Option<String>,
    /// The messages Token claims, oldest first.
    pub(crate) claimed: OutboxStmt,
    /// (state, count) for each state: 0 pending, 1 sent, 2 refused.
    pub(crate) counts: OutboxStmt,
    /// Read by indexes only, for a relay's gauges: `(0, pending, oldest
    /// pending's created_at, now)`, `(2, refused, …)`, and `(3, sent
    /// before now − Ms, …)` — rows waiting for the sweep.
    pub(crate) backlog: OutboxStmt,
    /// The refused messages, oldest first, up to Batch.
    pub(crate) refused: OutboxStmt,
    /// Id, refused, made pending again.
    pub(crate) requeue: OutboxStmt,
}

/// `template`, its `{name}`s replaced — the table, the index prefix, the
/// clock — and the values it binds, as the engine writes placeholders.
fn stmt(table: &str, template: &str, engine: &OutboxSql) -> OutboxStmt {
    let mut sql = String::with_capacity(template.len());
    let mut params: Vec<OutboxParam> = Vec::new();
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        sql.push_str(&rest[..open]);
        let close = open + rest[open..].find('}').expect("a closed placeholder");
        let name = &rest[open + 1..close];
        rest = &rest[close + 1..];
        let param = match name {
            "t" => {
                sql.push_str(table);
                continue;
            }
            "i" => {
                sql.push_str(index_prefix(table));
                continue;
            }
            "now" => match engine.now {
                Some(clock) => {
                    sql.push_str(clock);
                    continue;
                }
                None => OutboxParam::Now,
            },
            "token" => OutboxParam::Token,
            "ms" => OutboxParam::Ms,
            "batch" => OutboxParam::Batch,
            "window" => OutboxParam::Window,
            "id" => OutboxParam::Id,
            other => unreachable!("no placeholder {other}"),
        };
        match engine.placeholders {
            Placeholders::Question => {
                params.push(param);
                sql.push('?');
            }
            Placeholders::Dollar | Placeholders::QuestionNumbered => {
                let n = match params.iter().position(|p| *p == param) {
                    Some(at) => at + 1,
                    None => {
                        params.push(param);
                        params.len()
                    }
                };
                sql.push(if matches!(engine.placeholders, Placeholders::Dollar) {
                    '$'
                } else {
                    '?'
                });
                sql.push_str(&n.to_string());
            }
        }
    }
    sql.push_str(rest);
    OutboxStmt {
        sql: sql.into(),
        params: params.into(),
    }
}

/// The indexes' name prefix: the table's name without its schema.
fn index_prefix(table: &str) -> &str {
    table.rsplit('.').next().unwrap_or(table)
}

/// The columns every statement that reads messages answers, in order.
const COLUMNS: &str = "id, destination, ordering_key, payload, headers, created_at, attempts";

/// The outbox's statements on `table` (checked), as `engine` writes them.
pub(crate) fn statements(table: &str, engine: &'static OutboxSql) -> OutboxStatements {
    let s = |template: &str| stmt(table, template, engine);
    OutboxStatements {
        table: table.to_owned(),
        engine,
        channel: engine.notify.then(|| index_prefix(table).to_owned()),
        schema: engine
            .schema
            .replace("idempotency_outbox_", &format!("{}_", index_prefix(table)))
            .replace("idempotency_outbox", table),
        exists: s(
            "SELECT seq, id, destination, ordering_key, payload, headers, created_at, state, \
             attempts, next_at, claimed_by, last_error, sent_at FROM {t} LIMIT 0",
        ),
        // Each message claimed is the head of its ordering key (its oldest
        // pending message): whoever holds a key's head holds the key, so
        // the rest of its run is claimed behind it (`Settle::claim_runs`)
        // by that claimer alone. The heads are looked for among the oldest
        // due messages only — a window of `CLAIM_WINDOW` batches, read from
        // the pending index by `seq` — each probed for its key's first
        // pending message, in the key's order (the ordering index, or the
        // pending rows before it, never the whole table): a claim's cost
        // is bounded by the batch, whatever one key holds. (The window is
        // a derived table: MySQL takes no `LIMIT` in an `IN` subquery.)
        claim: s(&format!(
            "UPDATE {{t}} SET claimed_by = {{token}}, next_at = {{now}} + {{ms}}, attempts = attempts + 1 \
             WHERE state = 0 AND next_at <= {{now}} AND seq IN (SELECT seq FROM (\
             SELECT o.seq FROM {{t}} o WHERE o.seq IN (SELECT seq FROM (SELECT w.seq FROM {{t}} w \
             WHERE w.state = 0 AND w.next_at <= {{now}} ORDER BY w.seq LIMIT {{window}}) AS due) \
             AND o.state = 0 AND o.next_at <= {{now}} \
             AND (o.ordering_key IS NULL OR o.seq = (SELECT e.seq FROM {{t}} e \
             WHERE e.state = 0 AND e.ordering_key = o.ordering_key ORDER BY e.ordering_key, e.seq LIMIT 1)) \
             ORDER BY o.seq LIMIT {{batch}} {}) AS pick){}",
            engine.claim_lock,
            if engine.returning {
                format!(" RETURNING {COLUMNS}")
            } else {
                String::new()
            },
        )),
        claim_returns: engine.returning,
        analyze: engine.analyze.map(|sql| sql.replace("{t}", table)),
        claimed: s(&format!(
            "SELECT {COLUMNS} FROM {{t}} WHERE claimed_by = {{token}} AND state = 0 ORDER BY seq"
        )),
        counts: s("SELECT state, count(*) FROM {t} GROUP BY state"),
        // The states as `count(*) * 0 + n`: a 64-bit integer on every
        // engine, as a literal is not.
        backlog: s(
            "SELECT count(*) * 0, count(*), min(created_at), {now} FROM {t} WHERE state = 0 \
             UNION ALL SELECT count(*) * 0 + 2, count(*), min(created_at), {now} FROM {t} WHERE state = 2 \
             UNION ALL SELECT count(*) * 0 + 3, count(*), min(sent_at), {now} FROM {t} \
             WHERE state = 1 AND sent_at < {now} - {ms}",
        ),
        refused: s(&format!(
            "SELECT {COLUMNS} FROM {{t}} WHERE state = 2 ORDER BY seq LIMIT {{batch}}"
        )),
        requeue: s(
            "UPDATE {t} SET state = 0, next_at = 0, attempts = 0, last_error = NULL \
             WHERE id = {id} AND state = 2",
        ),
    }
}

/// SQL text with its values as the engine's literals: what travels with a
/// commit (an enqueued message's row) and a relay's writes.
pub(crate) struct Literal<'a> {
    sql: String,
    statements: &'a OutboxStatements,
    /// The process's clock, where the engine has none of its own.
    now: i64,
}

impl<'a> Literal<'a> {
    /// SQL text for `statements`' table; `now` is this process's clock, in
    /// Unix milliseconds (used where the engine reads none of its own).
    pub(crate) fn new(statements: &'a OutboxStatements, now: i64) -> Self {
        Self {
            sql: String::new(),
            statements,
            now,
        }
    }

    /// Appends plain SQL; `{t}` is the table.
    pub(crate) fn sql(&mut self, sql: &str) -> &mut Self {
        match sql.split_once("{t}") {
            Some((before, after)) => {
                self.sql.push_str(before);
                self.sql.push_str(&self.statements.table);
                self.sql(after)
            }
            None => {
                self.sql.push_str(sql);
                self
            }
        }
    }

    pub(crate) fn text(&mut self, text: &str) -> &mut Self {
        (self.statements.engine.text)(&mut self.sql, text);
        self
    }

    pub(crate) fn bytes(&mut self, bytes: &[u8]) -> &mut Self {
        (self.statements.engine.bytes)(&mut self.sql, bytes);
        self
    }

    pub(crate) fn number(&mut self, n: i64) -> &mut Self {
        self.sql.push_str(&n.to_string());
        self
    }

    /// Now, in Unix milliseconds: the database's clock, or the process's.
    pub(crate) fn now(&mut self) -> &mut Self {
        match self.statements.engine.now {
            Some(clock) => {
                self.sql.push_str(clock);
                self
            }
            None => self.number(self.now),
        }
    }

    /// `(a, b, …)` of text literals.
    pub(crate) fn texts<'t>(&mut self, texts: impl IntoIterator<Item = &'t str>) -> &mut Self {
        self.sql.push('(');
        for (n, text) in texts.into_iter().enumerate() {
            if n > 0 {
                self.sql.push_str(", ");
            }
            self.text(text);
        }
        self.sql.push(')');
        self
    }

    /// Starts a write of the relay's (the engine's isolation first, if it
    /// has one).
    pub(crate) fn write(&mut self) -> &mut Self {
        if let Some(before) = self.statements.engine.before_write {
            self.sql.push_str(before);
            self.sql.push_str("; ");
        }
        self
    }

    /// Ends a statement.
    pub(crate) fn end(&mut self) -> &mut Self {
        self.sql.push_str("; ");
        self
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.sql.is_empty()
    }

    pub(crate) fn into_sql(self) -> String {
        self.sql
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ENGINE: OutboxSql = OutboxSql {
        schema: "CREATE INDEX idempotency_outbox_pending ON idempotency_outbox (seq)",
        placeholders: Placeholders::Dollar,
        claim_lock: "",
        delete_limit: false,
        returning: false,
        analyze: None,
        now: Some("NOW_MS"),
        before_write: None,
        notify: false,
        text: |sql, text| sql.push_str(&format!("'{text}'")),
        bytes: |_, _| {},
    };

    #[test]
    fn placeholders_are_numbered_by_first_use_or_repeated_per_use_and_the_clock_is_the_engines() {
        let template = "UPDATE {t} SET a = {ms} WHERE b = {id} AND c = {ms} AND d < {now}";
        let pg = stmt("x", template, &ENGINE);
        assert_eq!(
            &*pg.sql,
            "UPDATE x SET a = $1 WHERE b = $2 AND c = $1 AND d < NOW_MS"
        );
        assert_eq!(&*pg.params, &[OutboxParam::Ms, OutboxParam::Id]);
        const LITE: OutboxSql = OutboxSql {
            placeholders: Placeholders::QuestionNumbered,
            now: None,
            ..ENGINE
        };
        let lite = stmt("x", template, &LITE);
        assert_eq!(
            &*lite.sql,
            "UPDATE x SET a = ?1 WHERE b = ?2 AND c = ?1 AND d < ?3"
        );
        const MY: OutboxSql = OutboxSql {
            placeholders: Placeholders::Question,
            ..ENGINE
        };
        let my = stmt("x", template, &MY);
        assert_eq!(
            &*my.sql,
            "UPDATE x SET a = ? WHERE b = ? AND c = ? AND d < NOW_MS"
        );
        assert_eq!(
            &*my.params,
            &[OutboxParam::Ms, OutboxParam::Id, OutboxParam::Ms]
        );
    }

    #[test]
    fn index_names_leave_the_schema_out() {
        static SQL: OutboxSql = ENGINE;
        let made = statements("billing.outbox", &SQL);
        assert_eq!(
            made.schema,
            "CREATE INDEX outbox_pending ON billing.outbox (seq)"
        );
    }
}
