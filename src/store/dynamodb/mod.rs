//! The DynamoDB stores (feature `dynamodb`), on the official
//! `aws-sdk-dynamodb` (re-exported as [`crate::aws_sdk_dynamodb`]):
//! the client, its credentials, region and endpoint are the application's,
//! from the SDK's standard environment.
//!
//! - [`DynamoDbStore`]: each claim is a **lease**, as on Redis — an item
//!   written by one conditional `UpdateItem`, kept with heartbeats, fenced by
//!   its token. The record and the handler's effect are two facts: a
//!   holder paused past its lease, or killed between its effect and its
//!   record, leaves a retry free to execute again (see the Redis store's
//!   notes; a downstream key on the effect closes it).
//! - [`DynamoDbTxStore`]: the record is written **in the handler's own
//!   `TransactWriteItems`**. The handler adds its `Put`, `Update`, `Delete`
//!   and `ConditionCheck` items to the [`DynamoDbTx`] it is given; the
//!   completion commits them and the record in one transaction,
//!   conditional on the claim, so the record and the effects are one fact.
//!
//! # Layout
//!
//! One item per key in a table whose partition key is `pk` (a string, the
//! storage key: the scope's SHA-256 and the key, compared byte for byte);
//! no sort key. `st` says in flight or completed, `fp` is the request's
//! fingerprint, `tok` a claim's fencing token, `exp` when the claim lapses
//! or the record expires (Unix ms), `rec` the completed record in the
//! crate's [`crate::codec`], and `ttl` is DynamoDB's TTL attribute
//! (`exp` in seconds, plus an hour). DynamoDB deletes expired items late —
//! hours, sometimes days — so `exp` decides: an item past it reads as
//! absent and is claimed over. [`DynamoDbStoreBuilder::create_table_if_missing`]
//! creates the table (on-demand billing, TTL on `ttl`).
//!
//! # Protocol and cost
//!
//! A claim is one conditional `UpdateItem` (`attribute_not_exists(pk) OR
//! exp < now`) with `ReturnValues=ALL_OLD` and
//! `ReturnValuesOnConditionCheckFailure=ALL_OLD`: a refused claim learns in
//! the same call whether it met a completed record (replay), a live claim
//! (`409`) or another payload (`422`), and a granted one whether it took
//! over a claim that lapsed (counting its attempts on) — one round trip
//! either way. Extend, complete, release and forget are conditional
//! on the token. Per request, in write (WCU) and read (RCU) capacity units
//! for a record under 1 KB:
//!
//! | request | lease store | transactional store |
//! |---|---|---|
//! | first execution | 2 WCU (claim, completion) | 1 WCU claim + 2 WCU per item of the transaction (the record and each of the handler's) |
//! | replay | 1 WCU (the refused conditional update) | the same |
//! | concurrent duplicate (`409`) | 1 WCU | the same |
//!
//! A transaction bills twice the write units of its items, holds at most
//! 100 items and 4 MB, and a record's item at most 400 KB: a record over
//! that is stored without its body (retries are refused as unreplayable,
//! never run again) and logged — compress bodies
//! ([`Compression`](crate::codec::Compression)) or lower the layer's
//! `max_stored_body` to keep them replayable.
//!
//! # Where the lease still applies
//!
//! Even in the transactional store the claim is written before the work
//! (DynamoDB has no open transaction to hold it in): it lasts the
//! builder's `transaction_timeout` (default 30 s). A handler that has not
//! committed by then is fenced off — its commit is refused, nothing of it
//! applies — and a retry runs in its place: one effect either way. A
//! process that dies mid-request leaves its claim until then, so retries
//! get `409` for at most that long.
//!
//! # Regions
//!
//! A global table replicates between regions asynchronously: a retry
//! routed to another region before the record arrived there **executes
//! again**. Pin a key's requests to one region (route by account), or keep
//! the idempotency table single-region.
//!
//! # Clocks
//!
//! Lapses and expiries are judged by the writing instance's clock (`now`
//! travels in each condition): instances whose clocks disagree by more
//! than a lease can take each other's live claims. Keep clocks synchronised
//! (NTP; Amazon Time Sync on AWS).

mod builder;
mod errors;
mod item;
mod transactional;

pub use self::builder::{DynamoDbStoreBuilder, DynamoDbTxStoreBuilder};
pub use self::transactional::{DynamoDbTx, DynamoDbTxStore, TransactWrites};

use std::{
    sync::Arc,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use aws_sdk_dynamodb::{
    Client,
    error::SdkError,
    operation::{put_item::PutItemError, update_item::UpdateItemError},
    types::{AttributeValue, ReturnValue, ReturnValuesOnConditionCheckFailure, Select},
};

use self::{
    errors::{Class, store_error},
    item::{Item, Stored},
};
use super::{
    Claim, Forgotten, Found, FoundState, KeyState, LeaseToken, StorageKey, Store, StoreError,
    TableStats, claim_within, ttl_millis,
};
use crate::{
    fingerprint::Fingerprint,
    record::{CompletedRecord, codec},
};

/// The table the stores use unless told otherwise.
const DEFAULT_TABLE: &str = "idempotency_records";

/// How long a call to DynamoDB may take unless told otherwise.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(2);

/// A lease store on a DynamoDB table: see the [module docs](self). Cloning
/// is cheap (the clones share the client).
///
/// # Examples
///
/// ```no_run
/// # async fn demo() -> Result<(), tower_idempotency::store::StoreError> {
/// use tower_idempotency::{DynamoDbStore, IdempotencyLayer};
///
/// let config = aws_config::load_from_env().await;
/// let store = DynamoDbStore::builder(tower_idempotency::aws_sdk_dynamodb::Client::new(&config))
///     .table("payments_idempotency")
///     .create_table_if_missing()
///     .build()
///     .await?;
/// let layer = IdempotencyLayer::new(store).single_tenant();
/// # let _ = layer; Ok(()) }
/// ```
#[derive(Clone)]
pub struct DynamoDbStore {
    table: Arc<Table>,
}

impl std::fmt::Debug for DynamoDbStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DynamoDbStore")
            .field("table", &self.table.name)
            .finish_non_exhaustive()
    }
}

/// The table and how the stores use it: shared by both stores.
pub(crate) struct Table {
    client: Client,
    name: String,
    timeout: Duration,
    compression: codec::Compression,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The old item a refused conditional write returned, if it did.
fn old_item(error: &SdkError<PutItemError>) -> Option<&Item> {
    match error {
        SdkError::ServiceError(service) => match service.err() {
            PutItemError::ConditionalCheckFailedException(failed) => failed.item(),
            _ => None,
        },
        _ => None,
    }
}

/// The old item a refused conditional update returned, if it did.
fn refused_update_item(error: &SdkError<UpdateItemError>) -> Option<&Item> {
    match error {
        SdkError::ServiceError(service) => match service.err() {
            UpdateItemError::ConditionalCheckFailedException(failed) => failed.item(),
            _ => None,
        },
        _ => None,
    }
}

impl Table {
    /// Bounds `call` by the store's timeout.
    async fn bounded<T>(
        &self,
        call: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        super::bounded(self.timeout, call).await
    }

    /// One conditional `UpdateItem` of a claim held until `hold` from now;
    /// refused, what it met.
    async fn claim(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        hold: Duration,
    ) -> Result<Claim<LeaseToken>, StoreError> {
        let now = now_ms();
        let token = LeaseToken::generate();
        let deadline = now.saturating_add(ttl_millis(hold, "lease")?);
        let mut update = self
            .client
            .update_item()
            .table_name(&self.name)
            .set_key(Some(item::key_of(key)))
            .update_expression(item::CLAIM)
            .condition_expression(item::FREE)
            .return_values(ReturnValue::AllOld)
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld);
        for (name, attribute) in [
            ("#pk", item::PK),
            ("#st", item::STATE),
            ("#fp", item::FINGERPRINT),
            ("#tok", item::TOKEN),
            ("#exp", item::EXPIRES),
            ("#ttl", item::TTL),
            ("#att", item::ATTEMPTS),
            ("#bgn", item::BEGAN),
            ("#rec", item::RECORD),
        ] {
            update = update.expression_attribute_names(name, attribute);
        }
        for (name, value) in item::claim_values(fingerprint, token, deadline, now) {
            update = update.expression_attribute_values(name, value);
        }
        match update.send().await {
            // What it replaced, if anything, has lapsed or expired: a claim
            // that lapsed is taken over.
            Ok(done) => Ok(match done.attributes.as_ref().and_then(item::lapsed) {
                Some(lapsed) => Claim::TakenOver {
                    granted: token,
                    lapsed,
                },
                None => Claim::Acquired(token),
            }),
            Err(error) if errors::class(&error) == Class::ConditionFailed => {
                let old = match refused_update_item(&error) {
                    Some(old) => Some(old.clone()),
                    // A server that does not return the old item: read it.
                    None => self.get(key).await?,
                };
                match old {
                    Some(old) => self.met(Stored::read(&old)?, fingerprint, now),
                    // Gone between the two: a retry claims it.
                    None => Ok(Claim::InFlight {
                        retry_after: Duration::from_millis(100),
                    }),
                }
            }
            Err(error) => Err(store_error(&self.name, error)),
        }
    }

    /// What a refused claim met, for requests with `fingerprint`, decided
    /// by the one rule.
    fn met(
        &self,
        stored: Stored,
        fingerprint: &Fingerprint,
        now: u64,
    ) -> Result<Claim<LeaseToken>, StoreError> {
        match stored {
            Stored::InFlight {
                fingerprint: stored,
                deadline_ms,
                ..
            } => Found {
                fingerprint: Ok(stored),
                state: FoundState::InFlight {
                    retry_after: Duration::from_millis(deadline_ms.saturating_sub(now).max(1)),
                    ours: None,
                },
            },
            Stored::Completed {
                fingerprint: stored,
                record,
                expires_ms,
            } => Found {
                fingerprint: Ok(stored),
                state: FoundState::Completed {
                    record: codec::decode_with(record, &self.compression)
                        .map(|(_, record)| Arc::new(record)),
                    expires_in: Duration::from_millis(expires_ms.saturating_sub(now)),
                },
            },
        }
        .decide(fingerprint)
    }

    /// The item of `key`, read consistently.
    async fn get(&self, key: &StorageKey) -> Result<Option<Item>, StoreError> {
        let got = self
            .client
            .get_item()
            .table_name(&self.name)
            .set_key(Some(item::key_of(key)))
            .consistent_read(true)
            .send()
            .await
            .map_err(|e| store_error(&self.name, e))?;
        Ok(got.item)
    }

    async fn extend(
        &self,
        key: &StorageKey,
        token: LeaseToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let deadline = now_ms().saturating_add(ttl_millis(lease, "lease")?);
        let [(exp, exp_value), (ttl, ttl_value)] = item::extended(deadline);
        let updated = self
            .client
            .update_item()
            .table_name(&self.name)
            .set_key(Some(item::key_of(key)))
            .update_expression("SET #exp = :exp, #ttl = :ttl")
            .condition_expression(item::HELD_LIVE)
            .expression_attribute_names("#exp", item::EXPIRES)
            .expression_attribute_names("#ttl", item::TTL)
            .expression_attribute_names("#tok", item::TOKEN)
            .expression_attribute_names("#st", item::STATE)
            .expression_attribute_values(exp, exp_value)
            .expression_attribute_values(ttl, ttl_value)
            .expression_attribute_values(":tok", item::token_value(token))
            .expression_attribute_values(":i", item::in_flight_value())
            .expression_attribute_values(":now", item::number(now_ms()))
            .send()
            .await;
        match updated {
            Ok(_) => Ok(true),
            Err(error) if errors::class(&error) == Class::ConditionFailed => Ok(false),
            Err(error) => Err(store_error(&self.name, error)),
        }
    }

    /// The completed record's item, and its codec bytes.
    fn completed_item(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        record: &CompletedRecord,
        retention: Duration,
    ) -> Result<Item, StoreError> {
        let expires = now_ms().saturating_add(ttl_millis(retention, "retention")?);
        let encoded = item::encode(key, fingerprint, record, &self.compression);
        Ok(item::completed(key, encoded, fingerprint, expires))
    }

    async fn complete(
        &self,
        key: &StorageKey,
        token: LeaseToken,
        fingerprint: &Fingerprint,
        record: &CompletedRecord,
        retention: Duration,
    ) -> Result<bool, StoreError> {
        let item = self.completed_item(key, fingerprint, record, retention)?;
        let encoded = item.get(item::RECORD).cloned();
        let put = self
            .client
            .put_item()
            .table_name(&self.name)
            .set_item(Some(item))
            .condition_expression(item::HELD_LIVE)
            .expression_attribute_names("#tok", item::TOKEN)
            .expression_attribute_names("#st", item::STATE)
            .expression_attribute_values(":tok", item::token_value(token))
            .expression_attribute_values(":i", item::in_flight_value())
            .expression_attribute_names("#exp", item::EXPIRES)
            .expression_attribute_values(":now", item::number(now_ms()))
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
            .send()
            .await;
        match put {
            Ok(_) => Ok(true),
            Err(error) if errors::class(&error) == Class::ConditionFailed => {
                // A retry of a completion that was applied meets its own
                // record: stored.
                let old = match old_item(&error) {
                    Some(old) => Some(old.clone()),
                    None => self.get(key).await?,
                };
                Ok(old.is_some_and(|old| {
                    matches!(Stored::read(&old), Ok(Stored::Completed { fingerprint: f, .. }) if f == *fingerprint)
                        && old.get(item::RECORD) == encoded.as_ref()
                }))
            }
            Err(error) => Err(store_error(&self.name, error)),
        }
    }

    /// Deletes the claim `token` holds; whether it did.
    async fn release(&self, key: &StorageKey, token: LeaseToken) -> Result<bool, StoreError> {
        let deleted = self
            .client
            .delete_item()
            .table_name(&self.name)
            .set_key(Some(item::key_of(key)))
            .condition_expression(item::HELD_LIVE)
            .expression_attribute_names("#tok", item::TOKEN)
            .expression_attribute_names("#st", item::STATE)
            .expression_attribute_values(":tok", item::token_value(token))
            .expression_attribute_values(":i", item::in_flight_value())
            .expression_attribute_names("#exp", item::EXPIRES)
            .expression_attribute_values(":now", item::number(now_ms()))
            .send()
            .await;
        match deleted {
            Ok(_) => Ok(true),
            Err(error) if errors::class(&error) == Class::ConditionFailed => Ok(false),
            Err(error) => Err(store_error(&self.name, error)),
        }
    }

    async fn inspect(&self, key: &StorageKey) -> Result<KeyState, StoreError> {
        let now = now_ms();
        let Some(found) = self.get(key).await? else {
            return Ok(KeyState::Absent);
        };
        let stored = Stored::read(&found)?;
        if !stored.live(now) {
            return Ok(KeyState::Absent);
        }
        Ok(match stored {
            Stored::InFlight { deadline_ms, .. } => KeyState::InFlight {
                retry_after: Duration::from_millis(deadline_ms.saturating_sub(now)),
            },
            Stored::Completed {
                record, expires_ms, ..
            } => KeyState::Completed {
                record: Arc::new(codec::decode_with(record, &self.compression)?.1),
                expires_in: Duration::from_millis(expires_ms.saturating_sub(now)),
            },
        })
    }

    /// Forgets what `key` holds when asked — read first, then deleted only
    /// if it is still what was read (a record committed after the question
    /// is kept).
    async fn forget(&self, key: &StorageKey, force: bool) -> Result<Forgotten, StoreError> {
        let now = now_ms();
        let Some(found) = self.get(key).await? else {
            return Ok(Forgotten::Nothing);
        };
        let stored = Stored::read(&found)?;
        if !stored.live(now) {
            return Ok(Forgotten::Nothing);
        }
        let delete = self
            .client
            .delete_item()
            .table_name(&self.name)
            .set_key(Some(item::key_of(key)));
        let (delete, forgotten) = match stored {
            Stored::Completed { expires_ms, .. } => (
                delete
                    .condition_expression(item::THE_RECORD)
                    .expression_attribute_names("#st", item::STATE)
                    .expression_attribute_names("#exp", item::EXPIRES)
                    .expression_attribute_values(":c", item::completed_value())
                    .expression_attribute_values(":exp", item::number(expires_ms)),
                Forgotten::Completed,
            ),
            Stored::InFlight { .. } if !force => return Ok(Forgotten::InFlight),
            Stored::InFlight { token, .. } => (
                delete
                    .condition_expression(item::HELD)
                    .expression_attribute_names("#tok", item::TOKEN)
                    .expression_attribute_names("#st", item::STATE)
                    .expression_attribute_values(":tok", item::token_value(token))
                    .expression_attribute_values(":i", item::in_flight_value()),
                Forgotten::ForcedInFlight,
            ),
        };
        match delete.send().await {
            Ok(_) => Ok(forgotten),
            // It changed since it was read: a claim took the key, or its
            // record was committed — left alone.
            Err(error) if errors::class(&error) == Class::ConditionFailed => {
                Ok(Forgotten::InFlight)
            }
            Err(error) => Err(store_error(&self.name, error)),
        }
    }

    /// Counts the items by state (a scan: it reads the whole table).
    async fn stats(&self) -> Result<TableStats, StoreError> {
        let now = now_ms();
        let mut stats = TableStats::default();
        let mut pages = self
            .client
            .scan()
            .table_name(&self.name)
            .projection_expression("#st, #exp")
            .expression_attribute_names("#st", item::STATE)
            .expression_attribute_names("#exp", item::EXPIRES)
            .select(Select::SpecificAttributes)
            .into_paginator()
            .send();
        while let Some(page) = pages.next().await {
            let page = page.map_err(|e| store_error(&self.name, e))?;
            for found in page.items() {
                let expires = match found.get(item::EXPIRES) {
                    Some(AttributeValue::N(n)) => n.parse::<u64>().unwrap_or(0),
                    _ => 0,
                };
                let completed =
                    matches!(found.get(item::STATE), Some(AttributeValue::S(s)) if s == "c");
                match (expires >= now, completed) {
                    (false, _) => stats.expired += 1,
                    (true, true) => stats.completed += 1,
                    (true, false) => stats.in_flight += 1,
                }
            }
        }
        Ok(stats)
    }
}

impl DynamoDbStore {
    /// A builder over `client` (its credentials, region and endpoint):
    /// table `idempotency_records`, which must exist unless
    /// [`create_table_if_missing`](DynamoDbStoreBuilder::create_table_if_missing).
    ///
    /// # Examples
    ///
    /// See the [type's docs](Self).
    pub fn builder(client: Client) -> DynamoDbStoreBuilder {
        DynamoDbStoreBuilder::new(client)
    }

    /// Counts what the table holds, by state: a scan of the whole table
    /// (it costs a read unit per 4 KB read), for an operator.
    ///
    /// # Errors
    ///
    /// DynamoDB's.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn demo(store: tower_idempotency::DynamoDbStore) -> Result<(), tower_idempotency::store::StoreError> {
    /// let stats = store.stats().await?;
    /// println!("{} completed, {} in flight", stats.completed, stats.in_flight);
    /// # Ok(()) }
    /// ```
    pub async fn stats(&self) -> Result<TableStats, StoreError> {
        self.table.stats().await
    }
}

impl Store for DynamoDbStore {
    type Granted = LeaseToken;
    const REPORTS_TAKEOVERS: bool = true;

    async fn claim(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<Claim, StoreError> {
        // Owned, so that it can outlive this call (see `claim_within`).
        let claim = {
            let (table, key, fingerprint) = (self.table.clone(), key.clone(), *fingerprint);
            async move { table.claim(&key, &fingerprint, lease).await }
        };
        claim_within(self, key, Instant::now(), self.table.timeout, lease, claim).await
    }

    async fn extend(
        &self,
        key: &StorageKey,
        token: LeaseToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        self.table
            .bounded(self.table.extend(key, token, lease))
            .await
    }

    async fn complete(
        &self,
        key: &StorageKey,
        token: &mut LeaseToken,
        fingerprint: &Fingerprint,
        record: Arc<CompletedRecord>,
        retention: Duration,
    ) -> Result<bool, StoreError> {
        self.table
            .bounded(
                self.table
                    .complete(key, *token, fingerprint, &record, retention),
            )
            .await
    }

    async fn release(&self, key: &StorageKey, token: LeaseToken) -> Result<bool, StoreError> {
        self.table.bounded(self.table.release(key, token)).await
    }

    async fn inspect(&self, key: &StorageKey) -> Result<KeyState, StoreError> {
        self.table.bounded(self.table.inspect(key)).await
    }

    async fn forget(&self, key: &StorageKey, force: bool) -> Result<Forgotten, StoreError> {
        self.table.bounded(self.table.forget(key, force)).await
    }
}
