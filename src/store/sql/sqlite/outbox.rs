//! SQLite's outbox table: partial indexes, `RETURNING`, one writer at a
//! time (so claims never overlap), and the process's clock, which every
//! writer of the file shares.

use super::{Sqlite, statements};
use crate::store::sql::outbox::{OutboxEngine, OutboxSql, Placeholders};

/// The outbox table's schema, for the default table name
/// `idempotency_outbox`; idempotent. Run it with your migrations, or let
/// `Outbox::on(&store).create_table_if_missing()` do it.
pub const OUTBOX_SCHEMA: &str = include_str!("outbox.sql");

impl OutboxEngine for Sqlite {
    const OUTBOX: &'static OutboxSql = &OutboxSql {
        schema: OUTBOX_SCHEMA,
        placeholders: Placeholders::QuestionNumbered,
        claim_lock: "",
        delete_limit: false,
        returning: true,
        analyze: None,
        now: None,
        before_write: None,
        notify: false,
        // Hex, so that no byte of the text is read as SQL.
        text: |sql, text| {
            sql.push_str("CAST(");
            statements::push_blob_literal(sql, text.as_bytes());
            sql.push_str(" AS TEXT)");
        },
        bytes: statements::push_blob_literal,
    };
}
