//! PostgreSQL's outbox table: partial indexes, `FOR UPDATE SKIP LOCKED`
//! between relays, `RETURNING`, the server's clock, and `LISTEN`/`NOTIFY`
//! to wake relays in other processes at each commit that enqueued.

use std::sync::Arc;

use sqlx::{PgPool, postgres::PgListener};
use tokio::sync::Notify;

use super::{Postgres, statements};
use crate::store::sql::outbox::{OutboxEngine, OutboxSql, Placeholders};

/// The outbox table's schema, for the default table name
/// `idempotency_outbox`; idempotent. Run it with your migrations, or let
/// `Outbox::on(&store).create_table_if_missing()` do it.
pub const OUTBOX_SCHEMA: &str = include_str!("outbox.sql");

impl OutboxEngine for Postgres {
    const OUTBOX: &'static OutboxSql = &OutboxSql {
        schema: OUTBOX_SCHEMA,
        placeholders: Placeholders::Dollar,
        claim_lock: "FOR UPDATE SKIP LOCKED",
        delete_limit: false,
        returning: true,
        analyze: Some("ANALYZE {t}"),
        // Fixed for a statement: every row of one claim lapses together.
        now: Some("(extract(epoch from statement_timestamp()) * 1000)::bigint"),
        before_write: None,
        notify: true,
        text: |sql, text| sql.push_str(&statements::text_literal(text)),
        bytes: statements::push_bytea_literal,
    };

    /// A connection of its own that `LISTEN`s, reconnecting after a loss
    /// (a wake-up is owed then: what committed meanwhile was not heard).
    fn listen(
        pool: &PgPool,
        channel: &str,
        wake: Arc<Notify>,
    ) -> Option<tokio::task::JoinHandle<()>> {
        let (pool, channel) = (pool.clone(), channel.to_owned());
        Some(tokio::spawn(async move {
            loop {
                let listening = async {
                    let mut listener = PgListener::connect_with(&pool).await?;
                    listener.listen(&channel).await?;
                    wake.notify_one();
                    loop {
                        listener.recv().await?;
                        wake.notify_one();
                    }
                };
                let ended: Result<(), sqlx::Error> = listening.await;
                if let Err(error) = ended {
                    tracing::debug!(%error, "idempotency: the outbox's LISTEN connection failed; again in a second");
                }
                tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            }
        }))
    }
}
