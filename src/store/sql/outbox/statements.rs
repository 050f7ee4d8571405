//! The outbox's statements, written once: each engine gives its table's
//! schema, its placeholders and how a claim skips the rows another relay
//! is claiming.

use crate::store::sql::dialect::{OutboxStatements, Param, Stmt};

/// How an engine writes the outbox's SQL.
pub(crate) struct OutboxSql {
    /// The table and its indexes, `{t}` for the table and `{i}` for the
    /// indexes' name prefix.
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
    /// How a text value and a byte string are written as literals (see
    /// [`OutboxStatements`]).
    pub(crate) text: fn(&mut String, &str),
    pub(crate) bytes: fn(&mut String, &[u8]),
}

/// A message's row as SQL text: the insert [`Outbox::enqueue`] defers to
/// the transaction's commit, with its values as `engine`'s literals.
///
/// [`Outbox::enqueue`]: super::Outbox::enqueue
pub(crate) struct RowInsert<'a> {
    pub(crate) id: &'a str,
    pub(crate) destination: &'a str,
    pub(crate) ordering_key: Option<&'a str>,
    pub(crate) payload: &'a [u8],
    pub(crate) headers: &'a str,
    pub(crate) created_at: i64,
}

impl RowInsert<'_> {
    /// Appends the insert, and `; `, to `sql`.
    pub(crate) fn write(&self, sql: &mut String, engine: &OutboxStatements) {
        sql.push_str("INSERT INTO ");
        sql.push_str(&engine.table);
        sql.push_str(" (id, destination, ordering_key, payload, headers, created_at) VALUES (");
        (engine.text)(sql, self.id);
        sql.push_str(", ");
        (engine.text)(sql, self.destination);
        sql.push_str(", ");
        match self.ordering_key {
            Some(key) => (engine.text)(sql, key),
            None => sql.push_str("NULL"),
        }
        sql.push_str(", ");
        (engine.bytes)(sql, self.payload);
        sql.push_str(", ");
        (engine.text)(sql, self.headers);
        sql.push_str(&format!(", {}); ", self.created_at));
    }
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

/// `template`, its `{name}`s replaced by the engine's placeholders, and
/// what they bind.
fn stmt(table: &str, template: &str, placeholders: Placeholders) -> Stmt {
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
                sql.push_str(table.rsplit('.').next().unwrap_or(table));
                continue;
            }
            "id" => Param::Id,
            "destination" => Param::Destination,
            "ordering_key" => Param::OrderingKey,
            "payload" => Param::Payload,
            "headers" => Param::Headers,
            "error" => Param::Error,
            "token" => Param::Token,
            "now" => Param::Now,
            "ms" => Param::Ms,
            "batch" => Param::Batch,
            other => unreachable!("no placeholder {other}"),
        };
        match placeholders {
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
                let mark = if matches!(placeholders, Placeholders::Dollar) {
                    '$'
                } else {
                    '?'
                };
                sql.push(mark);
                sql.push_str(&n.to_string());
            }
        }
    }
    sql.push_str(rest);
    Stmt::with_params(sql, params)
}

/// The outbox's statements on `table` (checked), as `engine` writes them.
pub(crate) fn statements(table: &str, engine: &OutboxSql) -> OutboxStatements {
    let s = |template: &str| stmt(table, template, engine.placeholders);
    let columns = "id, destination, ordering_key, payload, headers, created_at, attempts";
    let sweep = if engine.delete_limit {
        "DELETE FROM {t} WHERE state = 1 AND sent_at < {now} ORDER BY seq LIMIT {batch}"
    } else {
        "DELETE FROM {t} WHERE seq IN (SELECT seq FROM {t} WHERE state = 1 AND sent_at < {now} \
         ORDER BY seq LIMIT {batch})"
    };
    OutboxStatements {
        table: table.to_owned(),
        text: engine.text,
        bytes: engine.bytes,
        schema: engine
            .schema
            .replace("{t}", table)
            .replace("{i}", table.rsplit('.').next().unwrap_or(table)),
        exists: s(
            "SELECT seq, id, destination, ordering_key, payload, headers, created_at, state, \
             attempts, next_at, claimed_by, last_error, sent_at FROM {t} LIMIT 0",
        ),
        // Each message claimed is the oldest pending one of its ordering
        // key: the next is claimable once it is sent (or refused). Pending
        // rows are indexed by `seq`, so a claim walks the oldest first and
        // stops at the batch, however long the backlog.
        claim: s(&format!(
            "UPDATE {{t}} SET claimed_by = {{token}}, next_at = {{now}} + {{ms}}, attempts = attempts + 1 \
             WHERE state = 0 AND next_at <= {{now}} AND seq IN (SELECT seq FROM (\
             SELECT o.seq FROM {{t}} o WHERE o.state = 0 AND o.next_at <= {{now}} \
             AND (o.ordering_key IS NULL OR NOT EXISTS (SELECT 1 FROM {{t}} e \
             WHERE e.state = 0 AND e.ordering_key = o.ordering_key AND e.seq < o.seq)) \
             ORDER BY o.seq LIMIT {{batch}} {}) AS pick){}",
            engine.claim_lock,
            if engine.returning {
                format!(" RETURNING {columns}")
            } else {
                String::new()
            },
        )),
        claim_returns: engine.returning,
        analyze: engine.analyze.map(|sql| sql.replace("{t}", table)),
        claimed: s(&format!(
            "SELECT {columns} FROM {{t}} WHERE claimed_by = {{token}} AND state = 0 ORDER BY seq"
        )),
        sent: s(
            "UPDATE {t} SET state = 1, sent_at = {now}, claimed_by = NULL \
             WHERE claimed_by = {token} AND state = 0",
        ),
        retry: s(
            "UPDATE {t} SET next_at = {now} + {ms}, claimed_by = NULL, last_error = {error} \
             WHERE id = {id} AND claimed_by = {token} AND state = 0",
        ),
        refuse: s(
            "UPDATE {t} SET state = 2, claimed_by = NULL, last_error = {error} \
             WHERE id = {id} AND claimed_by = {token} AND state = 0",
        ),
        sweep: s(sweep),
        counts: s("SELECT state, count(*) FROM {t} GROUP BY state"),
        refused: s(&format!(
            "SELECT {columns} FROM {{t}} WHERE state = 2 ORDER BY seq LIMIT {{batch}}"
        )),
        requeue: s(
            "UPDATE {t} SET state = 0, next_at = 0, attempts = 0, last_error = NULL \
             WHERE id = {id} AND state = 2",
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_are_numbered_by_first_use_or_repeated_per_use() {
        let template = "UPDATE {t} SET a = {now} WHERE b = {id} AND c = {now}";
        let pg = stmt("x", template, Placeholders::Dollar);
        assert_eq!(&*pg.sql, "UPDATE x SET a = $1 WHERE b = $2 AND c = $1");
        assert_eq!(&*pg.params, &[Param::Now, Param::Id]);
        let lite = stmt("x", template, Placeholders::QuestionNumbered);
        assert_eq!(&*lite.sql, "UPDATE x SET a = ?1 WHERE b = ?2 AND c = ?1");
        let my = stmt("x", template, Placeholders::Question);
        assert_eq!(&*my.sql, "UPDATE x SET a = ? WHERE b = ? AND c = ?");
        assert_eq!(&*my.params, &[Param::Now, Param::Id, Param::Now]);
    }

    #[test]
    fn index_names_leave_the_schema_out() {
        let engine = OutboxSql {
            schema: "CREATE INDEX {i}_pending ON {t} (seq)",
            placeholders: Placeholders::Dollar,
            claim_lock: "",
            delete_limit: false,
            returning: false,
            analyze: None,
            text: |_, _| {},
            bytes: |_, _| {},
        };
        let made = statements("billing.outbox", &engine);
        assert_eq!(
            made.schema,
            "CREATE INDEX outbox_pending ON billing.outbox (seq)"
        );
    }
}
