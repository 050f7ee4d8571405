//! The table's upkeep: expired rows count as absent at once, and are
//! deleted in bounded batches by whoever schedules it.

use std::{future::Future, time::Duration};

use crate::store::StoreError;

/// A store whose expired records take space until they are deleted: the
/// SQL stores. Correctness never depends on it — an expired record counts
/// as absent the moment it expires — so schedule it as suits the database:
/// [`spawn_cleaner`](Self::spawn_cleaner) in the process, or a job of your
/// own calling [`delete_expired`](Self::delete_expired).
///
/// # Examples
///
/// ```no_run
/// # #[cfg(feature = "sqlite")]
/// # async fn demo() -> Result<(), tower_idempotency::store::StoreError> {
/// use std::time::Duration;
/// use tower_idempotency::{SqliteStore, store::sql::DeleteExpired};
///
/// /// Any SQL store, swept by the application's own scheduler.
/// async fn sweep(store: &impl DeleteExpired) -> Result<u64, tower_idempotency::store::StoreError> {
///     let mut deleted = 0;
///     loop {
///         let batch = store.delete_expired(1000).await?;
///         deleted += batch;
///         if batch < 1000 {
///             return Ok(deleted);
///         }
///     }
/// }
///
/// let store = SqliteStore::builder().transactional().connect("sqlite://payments.db").await?;
/// sweep(&store).await?;
/// # Ok(()) }
/// ```
pub trait DeleteExpired: Clone + Send + Sync + 'static {
    /// Deletes up to `batch` expired records; returns how many it deleted.
    /// Rows a running claim holds are skipped.
    fn delete_expired(&self, batch: u32) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Deletes expired records in batches of `batch`, every `every`, in a
    /// background task, until the returned handle is aborted. Failures are
    /// logged and retried at the next tick.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # #[cfg(feature = "sqlite")]
    /// # async fn demo(store: tower_idempotency::SqliteTxStore) {
    /// use std::time::Duration;
    /// use tower_idempotency::store::sql::DeleteExpired;
    ///
    /// let cleaner = store.spawn_cleaner(Duration::from_secs(60), 1000);
    /// # cleaner.abort(); }
    /// ```
    fn spawn_cleaner(&self, every: Duration, batch: u32) -> tokio::task::JoinHandle<()> {
        let store = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            loop {
                tick.tick().await;
                loop {
                    match store.delete_expired(batch).await {
                        Ok(deleted) if deleted == u64::from(batch) => continue,
                        Ok(_) => break,
                        Err(error) => {
                            tracing::warn!(%error, "idempotency: deleting expired records failed");
                            break;
                        }
                    }
                }
            }
        })
    }
}
