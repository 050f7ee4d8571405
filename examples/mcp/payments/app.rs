//! The tool server — its tools, the MCP door in front of them,
//! authentication outside — apart from start-up, so that the benchmark
//! builds the same server.

use std::{sync::Arc, time::Duration};

use axum::{
    Router,
    extract::Request,
    http::{HeaderValue, StatusCode, header, request::Parts},
    middleware::{self, Next},
    response::{IntoResponse, Response},
};
use rmcp::{
    ErrorData, Json, ServerHandler,
    handler::server::{
        router::tool::ToolRouter,
        tool::{Extension, schema_for_type},
        wrapper::Parameters,
    },
    model::{CallToolResult, ContentBlock, Implementation, ServerCapabilities, ServerConfig},
    tool, tool_handler, tool_router,
    transport::streamable_http_server::{
        StreamableHttpServerConfig, StreamableHttpService, session::never::NeverSessionManager,
    },
};
use serde::{Deserialize, Serialize};
use tower_idempotency::{
    IdempotencyLayer, IdempotentTx, SqliteTx, mcp::McpIdempotencyLayer, sqlx, store::Store,
};

use super::charges::{self, Charge};

/// The largest amount the fake card processor accepts; above it, the card
/// is declined.
pub const DECLINED_ABOVE: i64 = 1_000_000;

/// The example's configuration, read from the environment.
pub struct Settings {
    pub processor_latency: Duration,
    pub lease: Duration,
    /// Answer with `application/json` where the tool sends nothing before
    /// its result (`MCP_RESPONSE=json`), rather than an SSE stream.
    pub json_response: bool,
}

/// Where the charges live: the database of the idempotency records.
#[derive(Clone)]
pub enum Ledger {
    Sqlite(sqlx::SqlitePool),
    #[cfg(feature = "postgres")]
    Postgres(sqlx::PgPool),
    #[cfg(feature = "mysql")]
    MySql(sqlx::MySqlPool),
}

impl Ledger {
    /// Records `charge` in the call's own transaction: it commits with the
    /// stored answer, or not at all.
    async fn insert(&self, parts: &Parts, account: &str, charge: &Charge) -> Result<(), ErrorData> {
        let written = match self {
            Self::Sqlite(_) => {
                let mut tx = in_call::<SqliteTx>(parts)?;
                charges::insert::<sqlx::Sqlite>(&mut *tx, account, charge).await
            }
            #[cfg(feature = "postgres")]
            Self::Postgres(_) => {
                let mut tx = in_call::<tower_idempotency::PostgresTx>(parts)?;
                charges::insert::<sqlx::Postgres>(&mut *tx, account, charge).await
            }
            #[cfg(feature = "mysql")]
            Self::MySql(_) => {
                let mut tx = in_call::<tower_idempotency::MySqlTx>(parts)?;
                charges::insert::<sqlx::MySql>(&mut *tx, account, charge).await
            }
        };
        written.map_err(not_written)
    }

    /// Records `charge` on its own, committed at once: the benchmark's
    /// server without the door.
    async fn insert_alone(&self, account: &str, charge: &Charge) -> Result<(), ErrorData> {
        let written = match self {
            Self::Sqlite(pool) => charges::insert(pool, account, charge).await,
            #[cfg(feature = "postgres")]
            Self::Postgres(pool) => charges::insert(pool, account, charge).await,
            #[cfg(feature = "mysql")]
            Self::MySql(pool) => charges::insert(pool, account, charge).await,
        };
        written.map_err(not_written)
    }

    async fn list(&self, account: &str) -> Result<Vec<Charge>, sqlx::Error> {
        match self {
            Self::Sqlite(pool) => charges::list(pool, account).await,
            #[cfg(feature = "postgres")]
            Self::Postgres(pool) => charges::list(pool, account).await,
            #[cfg(feature = "mysql")]
            Self::MySql(pool) => charges::list(pool, account).await,
        }
    }
}

fn not_written(error: sqlx::Error) -> ErrorData {
    tracing::error!(%error, "create_charge: the charge could not be written");
    ErrorData::internal_error(
        "the charge could not be recorded; nothing was charged",
        None,
    )
}

/// The call's transaction, lent by the MCP door.
fn in_call<T: Send + Sync + 'static>(parts: &Parts) -> Result<IdempotentTx<T>, ErrorData> {
    IdempotentTx::from_extensions(&parts.extensions).ok_or_else(|| {
        ErrorData::internal_error(
            "no idempotent transaction for this call: is the MCP door over a transactional store?",
            None,
        )
    })
}

/// Who is calling: the bearer token's account, put in the request's
/// extensions by [`authenticate`].
#[derive(Clone, Debug)]
pub struct Account(pub String);

fn account(parts: &Parts) -> Result<String, ErrorData> {
    parts
        .extensions
        .get::<Account>()
        .map(|Account(account)| account.clone())
        .ok_or_else(|| ErrorData::internal_error("no account: authentication did not run", None))
}

/// `create_charge`'s arguments.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct NewCharge {
    /// In the currency's smallest unit (cents): at least 1.
    #[schemars(range(min = 1))]
    pub amount: i64,
    /// Three lowercase letters (ISO 4217): `eur`, `usd`.
    #[schemars(regex(pattern = "^[a-z]{3}$"))]
    pub currency: String,
    /// What the charge is for, shown on the statement.
    pub description: Option<String>,
}

impl NewCharge {
    fn validate(&self) -> Result<(), ErrorData> {
        if self.amount < 1 {
            return Err(ErrorData::invalid_params("amount: at least 1", None));
        }
        if self.currency.len() != 3 || !self.currency.bytes().all(|b| b.is_ascii_lowercase()) {
            return Err(ErrorData::invalid_params(
                "currency: three lowercase letters, as \"eur\"",
                None,
            ));
        }
        if self.description.as_ref().is_some_and(|d| d.len() > 500) {
            return Err(ErrorData::invalid_params(
                "description: at most 500 bytes",
                None,
            ));
        }
        Ok(())
    }
}

/// `list_charges`' answer.
#[derive(Debug, Serialize, schemars::JsonSchema)]
pub struct ChargeList {
    pub charges: Vec<Charge>,
}

/// The tool server.
#[derive(Clone)]
pub struct Payments {
    ledger: Ledger,
    processor_latency: Duration,
    /// Whether charges go in the call's transaction (behind the door), or
    /// commit on their own (the benchmark's floor).
    in_call: bool,
    tool_router: ToolRouter<Self>,
}

#[tool_router]
impl Payments {
    pub fn new(ledger: Ledger, processor_latency: Duration, in_call: bool) -> Self {
        Self {
            ledger,
            processor_latency,
            in_call,
            tool_router: Self::tool_router(),
        }
    }

    /// Charges the caller's card once per idempotency key.
    #[tool(
        description = "Charge the caller's card. Put a unique string in _meta[\"idempotency-key\"] and re-send the same call with it after any failure: it charges once.",
        output_schema = schema_for_type::<Charge>()
    )]
    async fn create_charge(
        &self,
        Parameters(new): Parameters<NewCharge>,
        Extension(parts): Extension<Parts>,
    ) -> Result<CallToolResult, ErrorData> {
        let account = account(&parts)?;
        new.validate()?;
        tracing::info!(amount = new.amount, currency = %new.currency, "create_charge: charging");
        // The card processor (none by default: even a zero sleep waits for
        // the timer's next millisecond tick).
        if !self.processor_latency.is_zero() {
            tokio::time::sleep(self.processor_latency).await;
        }
        if new.amount > DECLINED_ABOVE {
            // The processor's answer, not a failure of the call: stored and
            // replayed, never charged again.
            return Ok(CallToolResult::error(vec![ContentBlock::text(format!(
                "card_declined: the card was declined for {} {}",
                new.amount, new.currency
            ))]));
        }
        let charge = Charge {
            id: format!("ch_{:016x}", fastrand::u64(..)),
            amount: new.amount,
            currency: new.currency,
            description: new.description,
        };
        if self.in_call {
            self.ledger.insert(&parts, &account, &charge).await?;
        } else {
            self.ledger.insert_alone(&account, &charge).await?;
        }
        let structured = serde_json::to_value(&charge).expect("a charge serialises");
        Ok(CallToolResult::structured(structured))
    }

    /// The caller's charges: a read, unguarded.
    #[tool(description = "The caller's charges, in the order they were made.")]
    async fn list_charges(
        &self,
        Extension(parts): Extension<Parts>,
    ) -> Result<Json<ChargeList>, ErrorData> {
        let account = account(&parts)?;
        let charges = self.ledger.list(&account).await.map_err(|error| {
            tracing::error!(%error, "list_charges");
            ErrorData::internal_error("the charges could not be read", None)
        })?;
        Ok(Json(ChargeList { charges }))
    }
}

#[tool_handler(router = self.tool_router)]
impl ServerHandler for Payments {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::from_build_env())
            .with_instructions(
                "Payments. create_charge charges once per _meta[\"idempotency-key\"]: re-send a failed call with the same key.",
            )
    }
}

/// The router: `POST /mcp`, the door in front of the tool server, and
/// authentication outside it.
pub fn app<St: Store + Clone>(store: St, ledger: Ledger, settings: &Settings) -> Router {
    let server = Payments::new(ledger, settings.processor_latency, true);
    behind_the_door(store, server, settings)
}

/// The door over a store whose claims are leases (the memory store, say),
/// each charge committed on its own: what the benchmark measures the
/// door's own cost with.
#[allow(dead_code)] // the benchmark's, not the example's
pub fn app_on_leases<St: Store + Clone>(store: St, ledger: Ledger, settings: &Settings) -> Router {
    let server = Payments::new(ledger, settings.processor_latency, false);
    behind_the_door(store, server, settings)
}

fn behind_the_door<St: Store + Clone>(store: St, server: Payments, settings: &Settings) -> Router {
    let door = McpIdempotencyLayer::new(
        IdempotencyLayer::new(store)
            .lease(settings.lease)
            .scope_with(|parts: &Parts| parts.extensions.get::<Account>().map(|a| a.0.clone())),
    )
    .require_key_for(["create_charge"])
    .unguarded(["list_charges"]);
    routed(door.layer(tool_server(server, settings)))
}

/// The same tool server without the door, each charge committed on its
/// own: what the benchmark compares the door with.
#[allow(dead_code)] // the benchmark's, not the example's
pub fn bare(ledger: Ledger, settings: &Settings) -> Router {
    let server = Payments::new(ledger, settings.processor_latency, false);
    routed(tool_server(server, settings))
}

/// rmcp's Streamable HTTP service: stateless (protocol 2026-07-28).
fn tool_server(
    server: Payments,
    settings: &Settings,
) -> StreamableHttpService<Payments, NeverSessionManager> {
    StreamableHttpService::new(
        move || Ok(server.clone()),
        Arc::new(NeverSessionManager::default()),
        StreamableHttpServerConfig::default()
            .with_legacy_session_mode(false)
            .with_json_response(settings.json_response)
            .with_sse_keep_alive(None),
    )
}

fn routed<S>(mcp: S) -> Router
where
    S: tower::Service<Request, Error = std::convert::Infallible> + Clone + Send + Sync + 'static,
    S::Response: IntoResponse,
    S::Future: Send + 'static,
{
    Router::new()
        .route_service("/mcp", mcp)
        .layer(middleware::from_fn(authenticate))
}

/// `Authorization: Bearer <account>`: the account is the tenant. None:
/// `401`.
async fn authenticate(mut request: Request, next: Next) -> Response {
    let account = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.strip_prefix("Bearer "))
        .map(str::trim)
        .filter(|account| !account.is_empty() && account.len() <= 255)
        .map(str::to_owned);
    let Some(account) = account else {
        return (
            StatusCode::UNAUTHORIZED,
            [(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"))],
            "Authorization: Bearer <account> is required",
        )
            .into_response();
    };
    request.extensions_mut().insert(Account(account));
    next.run(request).await
}
