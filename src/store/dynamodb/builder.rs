//! Building the DynamoDB stores: the table, how long calls may take, and
//! the start-up check that tells a missing table, refused credentials, a
//! missing permission, throttling and an unreachable endpoint apart.

use std::{sync::Arc, time::Duration};

use aws_sdk_dynamodb::{
    Client,
    types::{
        AttributeDefinition, BillingMode, KeySchemaElement, KeyType, ScalarAttributeType,
        TableStatus, TimeToLiveSpecification,
    },
};

use super::{
    DEFAULT_TABLE, DEFAULT_TIMEOUT, DynamoDbStore, DynamoDbTxStore, Table,
    errors::{Class, class, describe, store_error},
    item,
};
use crate::{record::codec::Compression, store::StoreError};

/// How long a transactional claim lasts unless told otherwise.
const DEFAULT_TRANSACTION_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a table being created may take to become active.
const CREATING: Duration = Duration::from_secs(60);

/// Builds a [`DynamoDbStore`], or with
/// [`transactional`](Self::transactional) a [`DynamoDbTxStore`].
pub struct DynamoDbStoreBuilder {
    client: Client,
    table: String,
    timeout: Duration,
    compression: Compression,
    create: bool,
}

impl std::fmt::Debug for DynamoDbStoreBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DynamoDbStoreBuilder")
            .field("table", &self.table)
            .field("timeout", &self.timeout)
            .field("create", &self.create)
            .finish_non_exhaustive()
    }
}

impl DynamoDbStoreBuilder {
    pub(super) fn new(client: Client) -> Self {
        Self {
            client,
            table: DEFAULT_TABLE.to_owned(),
            timeout: DEFAULT_TIMEOUT,
            compression: Compression::none(),
            create: false,
        }
    }

    /// The table (default `idempotency_records`).
    ///
    /// # Examples
    ///
    /// ```
    /// # fn demo(client: tower_idempotency::aws_sdk_dynamodb::Client) {
    /// let builder = tower_idempotency::DynamoDbStore::builder(client).table("payments_idempotency");
    /// # let _ = builder; }
    /// ```
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// How long one call to DynamoDB may take (default 2 s): past it the
    /// request is answered `503` (a claim that DynamoDB applied too late is
    /// released in the background).
    ///
    /// # Examples
    ///
    /// ```
    /// # fn demo(client: tower_idempotency::aws_sdk_dynamodb::Client) {
    /// use std::time::Duration;
    ///
    /// let builder = tower_idempotency::DynamoDbStore::builder(client).timeout(Duration::from_millis(500));
    /// # let _ = builder; }
    /// ```
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// How stored bodies are written (default: as they are): with the
    /// `compression` feature, `Compression::zstd` keeps large bodies
    /// under DynamoDB's 400 KB item limit.
    ///
    /// # Examples
    ///
    /// ```
    /// # fn demo(client: tower_idempotency::aws_sdk_dynamodb::Client) {
    /// use tower_idempotency::codec::Compression;
    ///
    /// let builder = tower_idempotency::DynamoDbStore::builder(client).compression(Compression::none());
    /// # let _ = builder; }
    /// ```
    pub fn compression(mut self, compression: Compression) -> Self {
        self.compression = compression;
        self
    }

    /// Creates the table at start-up if it does not exist: partition key
    /// `pk` (a string), on-demand billing, TTL on attribute `ttl`. Without
    /// it, a missing table fails the start-up, naming this fix.
    ///
    /// # Examples
    ///
    /// See [`DynamoDbStore`].
    pub fn create_table_if_missing(mut self) -> Self {
        self.create = true;
        self
    }

    /// The transactional store instead: the record committed in the
    /// handler's own `TransactWriteItems` (see [`DynamoDbTxStore`]).
    ///
    /// # Examples
    ///
    /// See [`DynamoDbTxStore`].
    pub fn transactional(self) -> DynamoDbTxStoreBuilder {
        DynamoDbTxStoreBuilder {
            inner: self,
            transaction_timeout: DEFAULT_TRANSACTION_TIMEOUT,
        }
    }

    /// The lease store, once the table is checked (or created).
    ///
    /// # Errors
    ///
    /// [`StoreError::Misconfigured`] for a missing table (naming
    /// [`create_table_if_missing`](Self::create_table_if_missing)), a table
    /// keyed otherwise, refused credentials or a missing permission;
    /// [`StoreError::Unavailable`] for an endpoint out of reach or
    /// throttling, each said as such.
    ///
    /// # Examples
    ///
    /// See [`DynamoDbStore`].
    pub async fn build(self) -> Result<DynamoDbStore, StoreError> {
        Ok(DynamoDbStore {
            table: Arc::new(self.checked().await?),
        })
    }

    /// The table, checked: it exists (or was created), is keyed by `pk`
    /// alone, and these credentials reach it.
    async fn checked(self) -> Result<Table, StoreError> {
        let table = Table {
            client: self.client,
            name: self.table,
            timeout: self.timeout,
            compression: self.compression,
        };
        let startup = self.timeout.max(Duration::from_secs(5));
        let described = tokio::time::timeout(
            startup,
            table.client.describe_table().table_name(&table.name).send(),
        )
        .await
        .map_err(|_| {
            StoreError::Unavailable(
                format!(
                    "DynamoDB did not answer within {startup:?}: check the endpoint and the \
                     region the client was built with"
                )
                .into(),
            )
        })?;
        let described = match described {
            Ok(described) => described,
            Err(error) if class(&error) == Class::MissingTable && self.create => {
                create(&table).await?;
                return Ok(table);
            }
            Err(error) if class(&error) == Class::Outage => {
                return Err(StoreError::Unavailable(
                    format!(
                        "DynamoDB could not be reached ({}): check the endpoint and the region the \
                         client was built with",
                        describe(&error)
                    )
                    .into(),
                ));
            }
            Err(error) => return Err(store_error(&table.name, error)),
        };
        let keys = described
            .table()
            .map(|t| t.key_schema().to_vec())
            .unwrap_or_default();
        let keyed_by_pk = keys.len() == 1
            && keys[0].attribute_name() == item::PK
            && keys[0].key_type() == &KeyType::Hash;
        if !keyed_by_pk {
            return Err(StoreError::Misconfigured(format!(
                "the DynamoDB table {} is keyed by {:?}: the store needs partition key `pk` (a \
                 string) and no sort key — give it a table of its own",
                table.name,
                keys.iter()
                    .map(|k| k.attribute_name().to_owned())
                    .collect::<Vec<_>>()
            )));
        }
        Ok(table)
    }
}

/// Creates the table (losing a race to another instance creating it is
/// fine), waits until it is active, and enables its TTL.
async fn create(table: &Table) -> Result<(), StoreError> {
    let key = KeySchemaElement::builder()
        .attribute_name(item::PK)
        .key_type(KeyType::Hash)
        .build()
        .expect("a complete key schema");
    let attribute = AttributeDefinition::builder()
        .attribute_name(item::PK)
        .attribute_type(ScalarAttributeType::S)
        .build()
        .expect("a complete attribute definition");
    let created = table
        .client
        .create_table()
        .table_name(&table.name)
        .key_schema(key)
        .attribute_definitions(attribute)
        .billing_mode(BillingMode::PayPerRequest)
        .send()
        .await;
    if let Err(error) = created {
        let exists = matches!(&error, aws_sdk_dynamodb::error::SdkError::ServiceError(s)
            if aws_sdk_dynamodb::error::ProvideErrorMetadata::code(s.err()) == Some("ResourceInUseException"));
        if !exists {
            return Err(match class(&error) {
                Class::Permission => StoreError::Misconfigured(format!(
                    "these credentials may not create the DynamoDB table {} ({}): create it with \
                     your infrastructure (partition key `pk`, a string; TTL on attribute `ttl`), \
                     or grant dynamodb:CreateTable",
                    table.name,
                    describe(&error)
                )),
                _ => store_error(&table.name, error),
            });
        }
    }
    let deadline = tokio::time::Instant::now() + CREATING;
    loop {
        let described = table
            .client
            .describe_table()
            .table_name(&table.name)
            .send()
            .await
            .map_err(|e| store_error(&table.name, e))?;
        if described.table().and_then(|t| t.table_status()) == Some(&TableStatus::Active) {
            break;
        }
        if tokio::time::Instant::now() > deadline {
            return Err(StoreError::Unavailable(
                format!(
                    "the DynamoDB table {} was created but is not active after {CREATING:?}",
                    table.name
                )
                .into(),
            ));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let ttl = TimeToLiveSpecification::builder()
        .enabled(true)
        .attribute_name(item::TTL)
        .build()
        .expect("a complete TTL specification");
    if let Err(error) = table
        .client
        .update_time_to_live()
        .table_name(&table.name)
        .time_to_live_specification(ttl)
        .send()
        .await
    {
        // Expiry does not depend on it (`exp` decides); only space does.
        tracing::warn!(table = %table.name, error = %describe(&error), "idempotency: TTL could not be enabled on the DynamoDB table; expired records stay until deleted");
    }
    Ok(())
}

/// Builds a [`DynamoDbTxStore`]: see [`DynamoDbStoreBuilder::transactional`].
#[derive(Debug)]
pub struct DynamoDbTxStoreBuilder {
    inner: DynamoDbStoreBuilder,
    transaction_timeout: Duration,
}

impl DynamoDbTxStoreBuilder {
    /// How long a claim lasts before its commit (default 30 s): a handler
    /// that has not committed by then is fenced off — its transaction is
    /// refused, none of it applies — and a retry runs in its place.
    ///
    /// # Examples
    ///
    /// ```
    /// # fn demo(client: tower_idempotency::aws_sdk_dynamodb::Client) {
    /// use std::time::Duration;
    ///
    /// let builder = tower_idempotency::DynamoDbStore::builder(client)
    ///     .transactional()
    ///     .transaction_timeout(Duration::from_secs(10));
    /// # let _ = builder; }
    /// ```
    pub fn transaction_timeout(mut self, timeout: Duration) -> Self {
        self.transaction_timeout = timeout;
        self
    }

    /// The transactional store, once the table is checked (or created).
    ///
    /// # Errors
    ///
    /// As [`DynamoDbStoreBuilder::build`].
    ///
    /// # Examples
    ///
    /// See [`DynamoDbTxStore`].
    pub async fn build(self) -> Result<DynamoDbTxStore, StoreError> {
        Ok(DynamoDbTxStore {
            table: Arc::new(self.inner.checked().await?),
            transaction_timeout: self.transaction_timeout,
        })
    }
}
