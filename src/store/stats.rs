//! What a store's table holds, counted: the SQL stores' rows and
//! DynamoDB's items alike.

/// What a store's table holds, counted at one moment (a scan of the table:
/// an operator's question, not a request's). The SQL stores count rows,
/// `DynamoDbStore` items.
///
/// # Examples
///
/// ```no_run
/// # #[cfg(feature = "sqlite")]
/// # async fn demo() -> Result<(), tower_idempotency::store::StoreError> {
/// let store = tower_idempotency::SqliteStore::builder().connect("sqlite://payments.db").await?;
/// let stats = store.stats().await?;
/// println!("{} records, {} expired not yet deleted", stats.completed, stats.expired);
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct TableStats {
    /// Live completed records: what retries replay.
    pub completed: u64,
    /// Live claims without a record: requests in flight under a lease (a
    /// transactional SQL store's claims are uncommitted rows, which no
    /// count sees).
    pub in_flight: u64,
    /// Expired records not deleted yet: they count as absent, and take
    /// space until they are swept (the SQL stores'
    /// `DeleteExpired`, DynamoDB's TTL).
    pub expired: u64,
}
