//! The outbox's statements, for one table, as an engine writes them: the
//! claim, the reads, the upkeep (bound values), and the SQL text whose
//! values are literals — an enqueued message's row, which travels with the
//! request's `COMMIT`, and a relay's settlements, one round trip each.

use super::{OutboxSql, Placeholders};
use crate::store::sql::dialect::{Param, Stmt};

/// How many batches of the oldest due messages a claim reads, at most, to
/// find its batch of heads: its cost is bounded by the batch, whatever one
/// ordering key holds (a hot account's thousands of messages are not
/// walked, each one probed, to reach another account's).
pub(crate) const CLAIM_WINDOW: i64 = 4;

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
    pub(crate) exists: Stmt,
    /// Up to Batch pending messages due by now, each the oldest pending of
    /// its ordering key (the key's head), claimed for Token until now + Ms;
    /// answering with them when `claim_returns`.
    pub(crate) claim: Stmt,
    pub(crate) claim_returns: bool,
    /// Refreshes the table's statistics, where the engine needs it done.
    pub(crate) analyze: Option<String>,
    /// The messages Token claims, oldest first.
    pub(crate) claimed: Stmt,
    /// (state, count) for each state: 0 pending, 1 sent, 2 refused.
    pub(crate) counts: Stmt,
    /// Read by indexes only, for a relay's gauges: `(0, pending, oldest
    /// pending's created_at, now)`, `(2, refused, …)`, and `(3, sent
    /// before now − Ms, …)` — rows waiting for the sweep.
    pub(crate) backlog: Stmt,
    /// The refused messages, oldest first, up to Batch.
    pub(crate) refused: Stmt,
    /// Id, refused, made pending again.
    pub(crate) requeue: Stmt,
}

/// `template`, its `{name}`s replaced — the table, the index prefix, the
/// clock — and the values it binds, as the engine writes placeholders.
fn stmt(table: &str, template: &str, engine: &OutboxSql) -> Stmt {
    let mut sql = String::with_capacity(template.len());
    let mut params: Vec<Param> = Vec::new();
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
                None => Param::Now,
            },
            "token" => Param::Token,
            "ms" => Param::Ms,
            "batch" => Param::Batch,
            "window" => Param::Window,
            "id" => Param::Id,
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
    Stmt {
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
        assert_eq!(&*pg.params, &[Param::Ms, Param::Id]);
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
        assert_eq!(&*my.params, &[Param::Ms, Param::Id, Param::Ms]);
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
