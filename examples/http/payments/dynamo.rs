//! The example on DynamoDB (`DYNAMODB_TABLE`, feature `dynamodb`): records
//! in that table, each charge an item of `<table>_charges` (partition key
//! the account, sort key the charge id) and each webhook event an item of
//! `<table>_events`, written in the request's own `TransactWriteItems` —
//! the charge and its idempotency record commit together, or neither does.

use std::sync::OnceLock;

use axum::{
    Json,
    extract::State,
    extract::rejection::JsonRejection,
    response::{IntoResponse, Response},
    routing::{MethodRouter, post},
};
use tower_idempotency::{
    DynamoDbStore, DynamoDbTx, IdempotentTx,
    aws_sdk_dynamodb::{
        Client,
        types::{
            AttributeDefinition, AttributeValue, BillingMode, KeySchemaElement, KeyType, Put,
            ScalarAttributeType, TransactWriteItem,
        },
    },
    store::dynamodb::TransactWrites,
};

use crate::{
    app::{Account, AppState, NewCharge, Recording, Settings, after_recording, app, new_charge},
    ledger::{Charge, Charges, Event, LedgerWrites},
};

/// The tables beside the records, named once at start-up.
static TABLES: OnceLock<Tables> = OnceLock::new();

#[derive(Clone, Debug)]
pub struct Tables {
    pub charges: String,
    pub events: String,
}

fn tables() -> &'static Tables {
    TABLES.get().expect("the tables are named at start-up")
}

/// The service on DynamoDB: the store, and the tables it writes beside.
pub async fn service(
    table: &str,
    settings: &Settings,
) -> Result<axum::Router, Box<dyn std::error::Error>> {
    let config = aws_config::load_from_env().await;
    let client = Client::new(&config);
    let store = DynamoDbStore::builder(client.clone())
        .table(table)
        .create_table_if_missing()
        .transactional()
        .transaction_timeout(settings.transaction_timeout)
        .build()
        .await?;
    let named = Tables {
        charges: format!("{table}_charges"),
        events: format!("{table}_events"),
    };
    create(&client, &named.charges, "account", Some("id")).await?;
    create(&client, &named.events, "kind", Some("id")).await?;
    let named = TABLES.get_or_init(|| named).clone();
    tracing::info!(
        table,
        "store: DynamoDB, one TransactWriteItems per charge (DYNAMODB_TABLE)"
    );
    Ok(app(store, Charges::DynamoDb(client, named), settings))
}

/// Creates `table` (on-demand) unless it exists.
async fn create(
    client: &Client,
    table: &str,
    partition: &str,
    sort: Option<&str>,
) -> Result<(), Box<dyn std::error::Error>> {
    let key = |name: &str, kind| {
        KeySchemaElement::builder()
            .attribute_name(name)
            .key_type(kind)
            .build()
    };
    let attribute = |name: &str| {
        AttributeDefinition::builder()
            .attribute_name(name)
            .attribute_type(ScalarAttributeType::S)
            .build()
    };
    let mut create = client
        .create_table()
        .table_name(table)
        .billing_mode(BillingMode::PayPerRequest)
        .key_schema(key(partition, KeyType::Hash)?)
        .attribute_definitions(attribute(partition)?);
    if let Some(sort) = sort {
        create = create
            .key_schema(key(sort, KeyType::Range)?)
            .attribute_definitions(attribute(sort)?);
    }
    match create.send().await {
        Ok(_) => Ok(()),
        Err(error)
            if error
                .as_service_error()
                .is_some_and(|e| e.is_resource_in_use_exception()) =>
        {
            Ok(())
        }
        Err(error) => Err(Box::new(error)),
    }
}

impl Recording for DynamoDbTx {
    fn create_route() -> MethodRouter<AppState> {
        post(create_charge_in_dynamo_tx)
    }

    fn webhook_route() -> MethodRouter<AppState> {
        post(crate::app::record_event_in_transaction::<DynamoDbTx>)
    }
}

/// The charge as an item of the request's transaction: it commits with
/// the idempotency record.
async fn create_charge_in_dynamo_tx(
    State(state): State<AppState>,
    axum::Extension(Account(account)): axum::Extension<Account>,
    mut tx: IdempotentTx<DynamoDbTx>,
    body: Result<Json<NewCharge>, JsonRejection>,
) -> Response {
    let charge = match new_charge(account, body) {
        Ok(charge) => charge,
        Err(invalid) => return invalid.into_response(),
    };
    let recorded = tx.insert(&charge).await;
    after_recording(&state, charge, recorded).await
}

fn put(table: &str, item: Vec<(&str, AttributeValue)>) -> TransactWriteItem {
    let mut put = Put::builder().table_name(table);
    for (name, value) in item {
        put = put.item(name, value);
    }
    TransactWriteItem::builder()
        .put(put.build().expect("a table and an item"))
        .build()
}

impl LedgerWrites for TransactWrites {
    async fn insert(&mut self, charge: &Charge) -> Result<(), tower_idempotency::sqlx::Error> {
        let mut item = vec![
            ("account", AttributeValue::S(charge.account.clone())),
            ("id", AttributeValue::S(charge.id.clone())),
            ("amount", AttributeValue::N(charge.amount.to_string())),
            ("currency", AttributeValue::S(charge.currency.clone())),
        ];
        if let Some(description) = &charge.description {
            item.push(("description", AttributeValue::S(description.clone())));
        }
        self.push(put(&tables().charges, item));
        Ok(())
    }

    async fn insert_event(&mut self, event: &Event) -> Result<(), tower_idempotency::sqlx::Error> {
        // Keyed by a fresh id: a second execution would show as a second item.
        self.push(put(
            &tables().events,
            vec![
                ("kind", AttributeValue::S("event".into())),
                (
                    "id",
                    AttributeValue::S(format!("{}#{}", event.id, fastrand::u64(..))),
                ),
                ("event_id", AttributeValue::S(event.id.clone())),
                (
                    "type",
                    AttributeValue::S(event.kind.clone().unwrap_or_default()),
                ),
            ],
        ));
        Ok(())
    }
}

/// An account's charges (a query of its partition).
pub async fn list(client: &Client, tables: &Tables, account: &str) -> Result<Vec<Charge>, String> {
    let mut pages = client
        .query()
        .table_name(&tables.charges)
        .key_condition_expression("account = :a")
        .expression_attribute_values(":a", AttributeValue::S(account.to_owned()))
        .consistent_read(true)
        .into_paginator()
        .send();
    let text = |item: &std::collections::HashMap<String, AttributeValue>, name: &str| {
        item.get(name)
            .and_then(|v| v.as_s().ok())
            .cloned()
            .unwrap_or_default()
    };
    let mut charges = Vec::new();
    while let Some(page) = pages.next().await {
        for item in page.map_err(|e| e.to_string())?.items() {
            charges.push(Charge {
                id: text(item, "id"),
                account: text(item, "account"),
                amount: item
                    .get("amount")
                    .and_then(|v| v.as_n().ok())
                    .and_then(|n| n.parse().ok())
                    .unwrap_or_default(),
                currency: text(item, "currency"),
                description: item.get("description").and_then(|v| v.as_s().ok()).cloned(),
            });
        }
    }
    Ok(charges)
}

/// The webhook events recorded.
pub async fn list_events(client: &Client, tables: &Tables) -> Result<Vec<Event>, String> {
    let mut pages = client
        .query()
        .table_name(&tables.events)
        .key_condition_expression("kind = :k")
        .expression_attribute_values(":k", AttributeValue::S("event".into()))
        .consistent_read(true)
        .into_paginator()
        .send();
    let mut events = Vec::new();
    while let Some(page) = pages.next().await {
        for item in page.map_err(|e| e.to_string())?.items() {
            events.push(Event {
                id: item
                    .get("event_id")
                    .and_then(|v| v.as_s().ok())
                    .cloned()
                    .unwrap_or_default(),
                kind: item
                    .get("type")
                    .and_then(|v| v.as_s().ok())
                    .filter(|t| !t.is_empty())
                    .cloned(),
            });
        }
    }
    Ok(events)
}
