//! The consumers' guarantee written by hand, batched, as the article does
//! it: the batch's message ids into `processed_messages`, and only the ids
//! new there charged — all in the caller's transaction.

use tower_idempotency::sqlx::{self, PgConnection};

/// Inserts `ids` into `processed_messages` (`ON CONFLICT DO NOTHING`), and
/// returns those it inserted: the ones not processed before.
pub async fn new_ids(tx: &mut PgConnection, ids: &[&str]) -> Vec<String> {
    sqlx::query_scalar(
        "INSERT INTO processed_messages (id) SELECT unnest($1::text[]) \
         ON CONFLICT DO NOTHING RETURNING id",
    )
    .bind(ids)
    .fetch_all(tx)
    .await
    .unwrap()
}
