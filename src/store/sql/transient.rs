//! Whether an error of the application's own statements can pass: the one
//! classification the stores make of their own, offered to handlers.

use super::dialect::{Engine, ErrorClass};

/// Whether `error`, from one of your own statements — a handler's insert in
/// the store's transaction, a ledger beside a lease store — says that
/// nothing was done and the same request can succeed later: the database
/// busy (SQLite's `database is locked`, a lock wait that timed out), a
/// conflict that rolled the transaction back (a deadlock, a serialization
/// failure, a failed certification on a cluster), or the database out of
/// reach (the connection lost or refused, the pool exhausted or closed, the
/// server shutting down). The stores classify their own errors so.
///
/// Answer such a failure `503 Service Unavailable` (with `Retry-After`):
/// the layer stores no `503`, so the key is released and a retry with it
/// executes. Anything else — a constraint the data breaks, a value the
/// database refuses — is the request's own, and a final answer (`4xx`, or
/// a `500` a lease store keeps and replays) is right. Never answer `500`
/// for a transient failure on a lease store: it would be stored, and every
/// retry would replay the failure of a charge that never happened.
///
/// # Examples
///
/// ```
/// use tower_idempotency::{sqlx, store::sql::is_transient};
///
/// assert!(is_transient(&sqlx::Error::PoolTimedOut));
/// assert!(!is_transient(&sqlx::Error::RowNotFound));
/// ```
pub fn is_transient(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(database) => {
            engine_class(error, &**database).is_some_and(|class| {
                matches!(
                    class,
                    ErrorClass::Busy | ErrorClass::LockTimeout | ErrorClass::Conflict
                )
            }) || database
                .code()
                // SQLSTATE: connection exception; operator intervention (the
                // server shutting down); insufficient resources.
                .is_some_and(|code| {
                    code.starts_with("08") || code.starts_with("57P") || code.starts_with("53")
                })
        }
        _ => false,
    }
}

/// The class the engine `database` came from gives `error`.
fn engine_class(
    error: &sqlx::Error,
    database: &(dyn sqlx::error::DatabaseError + 'static),
) -> Option<ErrorClass> {
    #[cfg(feature = "sqlite")]
    if database
        .try_downcast_ref::<sqlx::sqlite::SqliteError>()
        .is_some()
    {
        return Some(super::sqlite::Sqlite::classify(error));
    }
    #[cfg(feature = "postgres")]
    if database
        .try_downcast_ref::<sqlx::postgres::PgDatabaseError>()
        .is_some()
    {
        return Some(super::postgres::Postgres::classify(error));
    }
    #[cfg(feature = "mysql")]
    if database
        .try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
        .is_some()
    {
        return Some(super::mysql::MySql::classify(error));
    }
    None
}
