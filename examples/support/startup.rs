//! Start-up against a database (or a Redis) that may be out of reach for a
//! moment — a restart, a failover, a connection dropped while starting: an
//! attempt that fails in a way that can pass is made again with back-off,
//! for a bound (`STARTUP_RETRY_S`, default 60 s); a configuration mistake,
//! or the bound passed, is the caller's exit.

use std::{error::Error, time::Duration};

use tower_idempotency::{sqlx, store::StoreError};

/// `attempt` until it succeeds, fails in a way that cannot pass, or the
/// bound has passed: the last failure then.
pub async fn retrying<T>(
    what: &str,
    mut attempt: impl AsyncFnMut() -> Result<T, Box<dyn Error>>,
) -> Result<T, Box<dyn Error>> {
    let bound = std::env::var("STARTUP_RETRY_S")
        .ok()
        .and_then(|s| s.parse().ok())
        .map_or(Duration::from_secs(60), Duration::from_secs);
    let deadline = std::time::Instant::now() + bound;
    let mut backoff = Duration::from_millis(250);
    loop {
        match attempt().await {
            Ok(done) => return Ok(done),
            Err(error) if transient(&*error) && std::time::Instant::now() + backoff < deadline => {
                tracing::warn!(%error, ?backoff, "{what}: unavailable while starting; trying again");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
            Err(error) => return Err(error),
        }
    }
}

/// Whether `error` can pass: a store out of reach or slow, or a statement
/// of the example's own that met a busy, conflicting or unreachable
/// database.
fn transient(error: &(dyn Error + 'static)) -> bool {
    if let Some(error) = error.downcast_ref::<StoreError>() {
        return error.is_transient();
    }
    if let Some(error) = error.downcast_ref::<sqlx::Error>() {
        return tower_idempotency::store::sql::is_transient(error);
    }
    false
}
