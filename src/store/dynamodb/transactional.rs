//! The transactional DynamoDB store: the handler's writes and the record
//! committed in one `TransactWriteItems`, conditional on the claim.

use std::{
    fmt,
    ops::{Deref, DerefMut},
    sync::Arc,
    time::Duration,
};

use aws_sdk_dynamodb::{
    error::SdkError,
    operation::transact_write_items::TransactWriteItemsError,
    types::{Delete, Put, ReturnValuesOnConditionCheckFailure, TransactWriteItem},
};

use super::{
    DynamoDbStoreBuilder, Table,
    errors::{Class, class, store_error},
    item, now_ms,
};
use crate::{
    fingerprint::{Fingerprint, push_hex},
    record::CompletedRecord,
    store::{
        Claim, FailedCompletion, Forgotten, Granted, Held, KeyState, LeaseToken, StorageKey, Store,
        StoreError,
    },
};

/// The most items one `TransactWriteItems` takes.
const MAX_ITEMS: usize = 100;

/// How often a commit whose outcome is unknown (a timeout, a conflict,
/// throttling) is sent again — with the same `ClientRequestToken`, so that
/// it is applied once.
const COMMIT_TRIES: u32 = 4;

/// A store whose record commits in the handler's own DynamoDB transaction:
/// see the [module docs](super). The handler takes the request's
/// [`DynamoDbTx`] (through [`IdempotentTx`](crate::IdempotentTx)) and adds its
/// writes to it; they commit with the record, or not at all.
///
/// # Examples
///
/// ```no_run
/// # async fn demo() -> Result<(), tower_idempotency::store::StoreError> {
/// use axum::{Router, http::StatusCode, routing::post};
/// use tower_idempotency::{
///     DynamoDbStore, DynamoDbTx, IdempotencyLayer, IdempotentTx,
///     aws_sdk_dynamodb::types::{AttributeValue, Put, TransactWriteItem},
/// };
///
/// async fn charge(mut tx: IdempotentTx<DynamoDbTx>) -> StatusCode {
///     let put = Put::builder()
///         .table_name("charges")
///         .item("id", AttributeValue::S("ch_1".into()))
///         .item("amount", AttributeValue::N("1999".into()))
///         .build()
///         .expect("a table and an item");
///     // Committed with the idempotency record, or not at all.
///     tx.push(TransactWriteItem::builder().put(put).build());
///     StatusCode::CREATED
/// }
///
/// let config = aws_config::load_from_env().await;
/// let store = DynamoDbStore::builder(tower_idempotency::aws_sdk_dynamodb::Client::new(&config))
///     .create_table_if_missing()
///     .transactional()
///     .build()
///     .await?;
/// let app: Router = Router::new()
///     .route("/charges", post(charge))
///     .layer(IdempotencyLayer::new(store).single_tenant());
/// # let _ = app; Ok(()) }
/// ```
#[derive(Clone)]
pub struct DynamoDbTxStore {
    pub(super) table: Arc<Table>,
    pub(super) transaction_timeout: Duration,
}

impl fmt::Debug for DynamoDbTxStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DynamoDbTxStore")
            .field("table", &self.table.name)
            .field("transaction_timeout", &self.transaction_timeout)
            .finish_non_exhaustive()
    }
}

impl DynamoDbTxStore {
    /// A builder over `client`: the same as
    /// [`DynamoDbStore::builder`](super::DynamoDbStore::builder)`(client).transactional()`.
    ///
    /// # Examples
    ///
    /// See the [type's docs](Self).
    pub fn builder(client: aws_sdk_dynamodb::Client) -> super::DynamoDbTxStoreBuilder {
        DynamoDbStoreBuilder::new(client).transactional()
    }
}

/// The writes a handler adds to its request's transaction: items of
/// `TransactWriteItems` (`Put`, `Update`, `Delete`, `ConditionCheck`, on
/// any table of the account and region), committed with the record — at
/// most 99 of them beside it.
///
/// # Examples
///
/// ```
/// use tower_idempotency::{
///     DynamoDbTx,
///     aws_sdk_dynamodb::types::{AttributeValue, Put, TransactWriteItem},
/// };
///
/// fn book(tx: &mut DynamoDbTx, id: &str) {
///     let put = Put::builder()
///         .table_name("ledger")
///         .item("id", AttributeValue::S(id.to_owned()))
///         .build()
///         .expect("a table and an item");
///     let mark = tx.len();
///     tx.push(TransactWriteItem::builder().put(put).build());
///     // Changed its mind: what it added since `mark` is taken back.
///     tx.truncate(mark);
/// }
/// # let _ = book;
/// ```
#[derive(Debug, Default)]
pub struct TransactWrites {
    items: Vec<TransactWriteItem>,
}

impl TransactWrites {
    /// Adds `item` to the transaction.
    pub fn push(&mut self, item: TransactWriteItem) {
        self.items.push(item);
    }

    /// How many items it holds.
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Keeps the first `len` items: what was added after is taken back (a
    /// savepoint rolled back).
    pub fn truncate(&mut self, len: usize) {
        self.items.truncate(len);
    }

    /// The items, in the order added.
    pub fn items(&self) -> &[TransactWriteItem] {
        &self.items
    }
}

/// A request's claim in a [`DynamoDbTxStore`], and the writes its handler
/// adds ([`TransactWrites`], which it dereferences to). Completing it
/// commits them with the record; dropping it unsettled (the request
/// cancelled) applies none of them and releases the claim in the
/// background.
pub struct DynamoDbTx {
    table: Arc<Table>,
    key: StorageKey,
    token: LeaseToken,
    writes: TransactWrites,
    settled: bool,
}

impl fmt::Debug for DynamoDbTx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DynamoDbTx")
            .field("key", &self.key)
            .field("writes", &self.writes.len())
            .finish_non_exhaustive()
    }
}

impl Deref for DynamoDbTx {
    type Target = TransactWrites;

    fn deref(&self) -> &TransactWrites {
        &self.writes
    }
}

impl DerefMut for DynamoDbTx {
    fn deref_mut(&mut self) -> &mut TransactWrites {
        &mut self.writes
    }
}

impl Granted for DynamoDbTx {
    fn held(&self) -> Held {
        Held::ForItsLife
    }

    fn lent_to_work(&self) -> bool {
        true
    }

    fn failed_completion(&self) -> FailedCompletion {
        FailedCompletion::NothingCommitted
    }
}

impl Drop for DynamoDbTx {
    fn drop(&mut self) {
        if self.settled {
            return;
        }
        // Nothing was sent; the claim goes, so a retry need not wait for it
        // to lapse.
        let (table, key, token) = (self.table.clone(), self.key.clone(), self.token);
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let _ = table.bounded(table.release(&key, token)).await;
            });
        }
    }
}

/// The claim's `ClientRequestToken`: a commit sent again after an unknown
/// outcome is applied once (within DynamoDB's 10 minutes).
fn request_token(token: LeaseToken) -> String {
    let mut hex = String::with_capacity(32);
    push_hex(&mut hex, &token.to_bytes());
    hex
}

/// Why a transaction was cancelled, from its reasons (one per item, in
/// order; the claim's item last).
enum Cancelled {
    /// The claim's condition failed: another holder has the key.
    ClaimLost,
    /// One of the handler's items was refused (its condition failed, or it
    /// was invalid): the same request meets the same refusal.
    Refused(String),
    /// A conflict with another transaction, or throttling: may pass.
    Transient(String),
}

fn cancelled(error: &SdkError<TransactWriteItemsError>) -> Option<Cancelled> {
    let SdkError::ServiceError(service) = error else {
        return None;
    };
    let TransactWriteItemsError::TransactionCanceledException(cancelled) = service.err() else {
        return None;
    };
    let reasons = cancelled.cancellation_reasons();
    let code = |i: usize| reasons.get(i).and_then(|r| r.code()).unwrap_or("None");
    let last = reasons.len().checked_sub(1)?;
    if code(last) == "ConditionalCheckFailed" {
        return Some(Cancelled::ClaimLost);
    }
    for (i, reason) in reasons.iter().enumerate() {
        match reason.code().unwrap_or("None") {
            "None" => {}
            "TransactionConflict" | "ThrottlingError" | "ProvisionedThroughputExceeded" => {
                return Some(Cancelled::Transient(format!("item {i}: {}", code(i))));
            }
            other => {
                return Some(Cancelled::Refused(format!(
                    "the handler's item {i} was refused: {other}{}",
                    reason
                        .message()
                        .map(|m| format!(" ({m})"))
                        .unwrap_or_default()
                )));
            }
        }
    }
    Some(Cancelled::Transient("cancelled without a reason".into()))
}

/// A transaction DynamoDB refused for the request's own sake: too large
/// (an item over 400 KB, the request over 4 MB), which the same request
/// always is, or otherwise refused.
fn refusal(why: String) -> StoreError {
    if super::errors::too_large(&why) {
        StoreError::TooLarge(why)
    } else {
        StoreError::Refused(why.into())
    }
}

impl DynamoDbTxStore {
    /// Commits `tx`'s writes and `last` (the record's put, or the claim's
    /// delete) in one transaction, conditional on the claim; retried with
    /// the same request token while its outcome is unknown.
    async fn commit(
        &self,
        tx: &mut DynamoDbTx,
        last: TransactWriteItem,
    ) -> Result<bool, StoreError> {
        let table = &self.table;
        if tx.writes.len() >= MAX_ITEMS {
            let refused = StoreError::TooLarge(format!(
                "a DynamoDB transaction holds at most {MAX_ITEMS} items: the handler added {} \
                     beside the record",
                tx.writes.len()
            ));
            tx.settled = true;
            let _ = table.bounded(table.release(&tx.key, tx.token)).await;
            return Err(refused);
        }
        let mut items = std::mem::take(&mut tx.writes.items);
        items.push(last);
        let mut backoff = Duration::from_millis(25);
        let mut tried = 0;
        loop {
            tried += 1;
            let sent = table
                .client
                .transact_write_items()
                .set_transact_items(Some(items.clone()))
                .client_request_token(request_token(tx.token))
                .send();
            let sent = match tokio::time::timeout(table.timeout, sent).await {
                Ok(sent) => sent,
                Err(_) if tried < COMMIT_TRIES => {
                    tokio::time::sleep(backoff).await;
                    backoff *= 2;
                    continue;
                }
                Err(_) => {
                    tx.settled = true;
                    return Err(StoreError::Timeout(table.timeout));
                }
            };
            let error = match sent {
                Ok(_) => {
                    tx.settled = true;
                    return Ok(true);
                }
                Err(error) => error,
            };
            match cancelled(&error) {
                Some(Cancelled::ClaimLost) => {
                    tx.settled = true;
                    return Ok(false);
                }
                Some(Cancelled::Refused(why)) => {
                    // Nothing applied: the key is free for a retry.
                    tx.settled = true;
                    let _ = table.bounded(table.release(&tx.key, tx.token)).await;
                    return Err(refusal(why));
                }
                Some(Cancelled::Transient(_)) if tried < COMMIT_TRIES => {}
                None if class(&error) == Class::Outage && tried < COMMIT_TRIES => {}
                None if class(&error) == Class::Invalid => {
                    tx.settled = true;
                    let _ = table.bounded(table.release(&tx.key, tx.token)).await;
                    return Err(refusal(super::errors::describe(&error)));
                }
                Some(Cancelled::Transient(why)) => {
                    tx.settled = true;
                    return Err(StoreError::Unavailable(why.into()));
                }
                None => {
                    tx.settled = true;
                    return Err(store_error(&table.name, error));
                }
            }
            tokio::time::sleep(backoff).await;
            backoff *= 2;
        }
    }
}

impl Store for DynamoDbTxStore {
    type Granted = DynamoDbTx;
    // Its claims commit nothing unless they complete.
    const REPORTS_TAKEOVERS: bool = true;

    async fn claim(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        _lease: Duration,
    ) -> Result<Claim<DynamoDbTx>, StoreError> {
        // The claim lasts the transaction's bound, not a lease: nothing
        // extends it, and a commit past it is fenced off.
        let table = &self.table;
        let claimed = table
            .bounded(table.claim(key, fingerprint, self.transaction_timeout))
            .await?;
        let granted = claimed.map(|token| DynamoDbTx {
            table: table.clone(),
            key: key.clone(),
            token,
            writes: TransactWrites::default(),
            settled: false,
        });
        Ok(match granted {
            // A lapsed transaction committed nothing: no takeover to tell.
            Claim::TakenOver { granted, .. } => Claim::Acquired(granted),
            answer => answer,
        })
    }

    async fn extend(&self, _: &StorageKey, _: LeaseToken, _: Duration) -> Result<bool, StoreError> {
        Ok(false)
    }

    async fn complete(
        &self,
        key: &StorageKey,
        tx: &mut DynamoDbTx,
        fingerprint: &Fingerprint,
        record: Arc<CompletedRecord>,
        retention: Duration,
    ) -> Result<bool, StoreError> {
        let table = &self.table;
        let put = Put::builder()
            .table_name(&table.name)
            .set_item(Some(table.completed_item(
                key,
                fingerprint,
                &record,
                retention,
            )?))
            .condition_expression(item::HELD_LIVE)
            .expression_attribute_names("#tok", item::TOKEN)
            .expression_attribute_names("#st", item::STATE)
            .expression_attribute_values(":tok", item::token_value(tx.token))
            .expression_attribute_values(":i", item::in_flight_value())
            .expression_attribute_names("#exp", item::EXPIRES)
            .expression_attribute_values(":now", item::number(now_ms()))
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
            .build()
            .expect("a table and an item");
        self.commit(tx, TransactWriteItem::builder().put(put).build())
            .await
    }

    async fn release(&self, key: &StorageKey, mut tx: DynamoDbTx) -> Result<bool, StoreError> {
        tx.settled = true;
        let table = &self.table;
        table.bounded(table.release(key, tx.token)).await
    }

    async fn release_keeping_writes(
        &self,
        key: &StorageKey,
        mut tx: DynamoDbTx,
    ) -> Result<bool, StoreError> {
        let table = &self.table;
        let delete = Delete::builder()
            .table_name(&table.name)
            .set_key(Some(item::key_of(key)))
            .condition_expression(item::HELD_LIVE)
            .expression_attribute_names("#tok", item::TOKEN)
            .expression_attribute_names("#st", item::STATE)
            .expression_attribute_values(":tok", item::token_value(tx.token))
            .expression_attribute_values(":i", item::in_flight_value())
            .expression_attribute_names("#exp", item::EXPIRES)
            .expression_attribute_values(":now", item::number(now_ms()))
            .build()
            .expect("a table and a key");
        self.commit(&mut tx, TransactWriteItem::builder().delete(delete).build())
            .await
    }

    async fn inspect(&self, key: &StorageKey) -> Result<KeyState, StoreError> {
        self.table.bounded(self.table.inspect(key)).await
    }

    /// A claim in flight is a handler's transaction to be: it cannot be
    /// forced here (forcing it through the lease store fences its commit
    /// off, and a retry then runs in its place).
    async fn forget(&self, key: &StorageKey, force: bool) -> Result<Forgotten, StoreError> {
        match self.table.bounded(self.table.forget(key, false)).await? {
            Forgotten::InFlight if force => Err(StoreError::Unsupported(
                "forcing a transactional claim in flight (its open transaction)",
            )),
            forgotten => Ok(forgotten),
        }
    }
}
