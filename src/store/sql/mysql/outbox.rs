//! MySQL's and MariaDB's outbox table: InnoDB, byte-wise text, the
//! server's clock, and the relay's writes `READ COMMITTED` — no gap locks,
//! so a request's commit, inserting its message, never waits on a relay's
//! claim (nor deadlocks with it).

use super::{MySql, statements};
use crate::store::sql::outbox::{OutboxEngine, OutboxSql, Placeholders};

/// The outbox table's schema, for the default table name
/// `idempotency_outbox`; idempotent. Run it with your migrations, or let
/// `Outbox::on(&store).create_table_if_missing()` do it.
pub const OUTBOX_SCHEMA: &str = include_str!("outbox.sql");

impl OutboxEngine for MySql {
    const OUTBOX: &'static OutboxSql = &OutboxSql {
        schema: OUTBOX_SCHEMA,
        placeholders: Placeholders::Question,
        claim_lock: "",
        delete_limit: true,
        returning: false,
        analyze: None,
        // `NOW(3)` is fixed for a statement: every row of one claim lapses
        // together.
        now: Some("CAST(UNIX_TIMESTAMP(NOW(3)) * 1000 AS SIGNED)"),
        before_write: Some("SET TRANSACTION ISOLATION LEVEL READ COMMITTED"),
        notify: false,
        // Hex, whatever the `sql_mode` says of backslashes; text with its
        // character set named.
        text: |sql, text| {
            sql.push_str("_utf8mb4 ");
            statements::push_hex_literal(sql, text.as_bytes());
        },
        bytes: statements::push_hex_literal,
    };
}
