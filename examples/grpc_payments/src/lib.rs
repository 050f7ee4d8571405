//! A tonic payments service whose `Charge` RPC is safe to retry: the
//! `IdempotencyLayer` sits in the server's tower stack, reads the
//! `idempotency-key` metadata, stores each charge's reply with its
//! trailers, and replays it to every retry. The binary (`src/main.rs`)
//! picks the store from the environment; the tests build the same server.

use std::{
    pin::Pin,
    sync::{Arc, Mutex},
    time::Duration,
};

use futures_util::{Stream, stream};
use http::{Request, header, request::Parts};
use tokio::net::TcpListener;
use tonic::{Status, transport::server::TcpIncoming};
use tower::{ServiceBuilder, util::MapRequestLayer};
use tower_idempotency::{IdempotencyLayer, IdempotentTx, PostgresTx, SqliteTx, sqlx, store::Store};

use proto::payments_server::{Payments, PaymentsServer};
pub use proto::{ChargeReply, ChargeRequest, ListChargesRequest, payments_client::PaymentsClient};

/// The code `protoc` generated from `proto/payments.proto`.
pub mod proto {
    tonic::include_proto!("payments.v1");
}

/// The streaming method: it passes through the layer unguarded.
pub const LIST_CHARGES: &str = "/payments.v1.Payments/ListCharges";

/// How the server runs, whatever the store.
#[derive(Clone, Debug)]
pub struct Settings {
    /// How long the fake card processor takes per charge.
    pub processor_latency: Duration,
    /// How long a charge holds its key before a crash frees it.
    pub lease: Duration,
    /// How long a reply is replayed.
    pub retention: Duration,
    /// Whether calls may send gzip-compressed messages (the layer compares
    /// calls by their messages decompressed).
    pub accept_gzip: bool,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            processor_latency: Duration::ZERO,
            lease: Duration::from_secs(30),
            retention: Duration::from_secs(24 * 60 * 60),
            accept_gzip: false,
        }
    }
}

/// The charges table, in SQL both SQLite and PostgreSQL read.
const CHARGES: &str = "CREATE TABLE IF NOT EXISTS charges (
    id TEXT PRIMARY KEY, account TEXT NOT NULL, amount BIGINT NOT NULL,
    currency TEXT NOT NULL, description TEXT NOT NULL)";

/// Where charges are written. With a transactional store (SQLite,
/// PostgreSQL) a charge is written in the call's own transaction, which
/// commits with the stored reply; otherwise on its own.
#[derive(Clone)]
pub enum Ledger {
    /// In this process; lost on exit.
    Memory(Arc<Mutex<Vec<(String, ChargeReply)>>>),
    /// The `charges` table, beside a `SqliteTxStore`'s records.
    Sqlite(sqlx::SqlitePool),
    /// The `charges` table, beside a `PostgresTxStore`'s records.
    Postgres(sqlx::PgPool),
}

impl Ledger {
    /// A ledger in SQLite, its table created if missing.
    pub async fn sqlite(pool: &sqlx::SqlitePool) -> Result<Self, sqlx::Error> {
        sqlx::raw_sql(CHARGES).execute(pool).await?;
        Ok(Self::Sqlite(pool.clone()))
    }

    /// A ledger in PostgreSQL, its table created if missing.
    pub async fn postgres(pool: &sqlx::PgPool) -> Result<Self, sqlx::Error> {
        sqlx::raw_sql(CHARGES).execute(pool).await?;
        Ok(Self::Postgres(pool.clone()))
    }

    /// Writes `charge`, in the call's transaction when the store has one.
    async fn insert(
        &self,
        extensions: &http::Extensions,
        account: &str,
        charge: &ChargeReply,
    ) -> Result<(), Status> {
        const INSERT: &str = "INSERT INTO charges (id, account, amount, currency, description) VALUES ($1, $2, $3, $4, $5)";
        let no_tx = || {
            Status::internal(
                "no idempotent transaction: the layer must sit over the ledger's transactional store",
            )
        };
        let failed =
            |error: sqlx::Error| Status::internal(format!("the charge was not written: {error}"));
        match self {
            Self::Memory(charges) => {
                let mut charges = charges.lock().unwrap_or_else(|p| p.into_inner());
                charges.push((account.to_owned(), charge.clone()));
            }
            Self::Sqlite(_) => {
                let mut tx =
                    IdempotentTx::<SqliteTx>::from_extensions(extensions).ok_or_else(no_tx)?;
                bind(sqlx::query(INSERT), account, charge)
                    .execute(&mut *tx)
                    .await
                    .map_err(failed)?;
            }
            Self::Postgres(_) => {
                let mut tx =
                    IdempotentTx::<PostgresTx>::from_extensions(extensions).ok_or_else(no_tx)?;
                bind(sqlx::query(INSERT), account, charge)
                    .execute(&mut *tx)
                    .await
                    .map_err(failed)?;
            }
        }
        Ok(())
    }

    /// The account's charges, in the order of their ids.
    pub async fn list(&self, account: &str) -> Result<Vec<ChargeReply>, sqlx::Error> {
        const SELECT: &str =
            "SELECT id, amount, currency, description FROM charges WHERE account = $1 ORDER BY id";
        type Columns = (String, i64, String, String);
        let rows: Vec<Columns> = match self {
            Self::Memory(charges) => {
                let charges = charges.lock().unwrap_or_else(|p| p.into_inner());
                return Ok(charges
                    .iter()
                    .filter(|(owner, _)| owner == account)
                    .map(|(_, charge)| charge.clone())
                    .collect());
            }
            Self::Sqlite(pool) => sqlx::query_as(SELECT).bind(account).fetch_all(pool).await?,
            Self::Postgres(pool) => sqlx::query_as(SELECT).bind(account).fetch_all(pool).await?,
        };
        Ok(rows
            .into_iter()
            .map(|(id, amount, currency, description)| ChargeReply {
                id,
                amount,
                currency,
                description,
            })
            .collect())
    }
}

fn bind<'q, DB: sqlx::Database>(
    query: sqlx::query::Query<'q, DB, <DB as sqlx::Database>::Arguments>,
    account: &str,
    charge: &ChargeReply,
) -> sqlx::query::Query<'q, DB, <DB as sqlx::Database>::Arguments>
where
    String: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    i64: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
{
    query
        .bind(charge.id.clone())
        .bind(account.to_owned())
        .bind(charge.amount)
        .bind(charge.currency.clone())
        .bind(charge.description.clone())
}

/// The authenticated account, put in the request's extensions by
/// the demo's authentication; the idempotency scope, so that two accounts' keys never
/// meet.
#[derive(Clone, Debug)]
pub struct Account(pub String);

/// The demo's authentication: the bearer token `tok_<name>` belongs to the
/// account `acct_<name>`. A call without one reaches no account, and
/// `Charge` refuses it.
fn authenticate<B>(mut request: Request<B>) -> Request<B> {
    let account = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer tok_"))
        .filter(|name| !name.is_empty())
        .map(|name| Account(format!("acct_{name}")));
    if let Some(account) = account {
        request.extensions_mut().insert(account);
    }
    request
}

/// The service's methods.
pub struct PaymentsService {
    ledger: Ledger,
    processor_latency: Duration,
}

type ChargeStream = Pin<Box<dyn Stream<Item = Result<ChargeReply, Status>> + Send>>;

#[tonic::async_trait]
impl Payments for PaymentsService {
    async fn charge(
        &self,
        request: tonic::Request<ChargeRequest>,
    ) -> Result<tonic::Response<ChargeReply>, Status> {
        let account = account(&request)?;
        let new = request.get_ref();
        if new.amount <= 0 {
            return Err(Status::invalid_argument(
                "`amount` must be a positive number of cents",
            ));
        }
        if new.currency.len() != 3 {
            return Err(Status::invalid_argument(
                "`currency` must be a three-letter code",
            ));
        }
        // The card processor.
        tokio::time::sleep(self.processor_latency).await;
        let charge = ChargeReply {
            id: format!("ch_{:016x}", fastrand::u64(..)),
            amount: new.amount,
            currency: new.currency.to_lowercase(),
            description: new.description.clone(),
        };
        self.ledger
            .insert(request.extensions(), &account, &charge)
            .await?;
        tracing::info!(id = %charge.id, %account, "charged");
        Ok(tonic::Response::new(charge))
    }

    type ListChargesStream = ChargeStream;

    async fn list_charges(
        &self,
        request: tonic::Request<ListChargesRequest>,
    ) -> Result<tonic::Response<ChargeStream>, Status> {
        let account = account(&request)?;
        let charges = self
            .ledger
            .list(&account)
            .await
            .map_err(|e| Status::unavailable(format!("the ledger cannot be read: {e}")))?;
        Ok(tonic::Response::new(Box::pin(stream::iter(
            charges.into_iter().map(Ok),
        ))))
    }
}

fn account<T>(request: &tonic::Request<T>) -> Result<String, Status> {
    request
        .extensions()
        .get::<Account>()
        .map(|a| a.0.clone())
        .ok_or_else(|| Status::unauthenticated("send `authorization: Bearer tok_<name>`"))
}

/// The idempotency layer as this service uses it: the key is required on
/// every guarded call, the account is the scope, and the streaming method
/// passes through.
pub fn idempotency<St: Store>(
    store: St,
    settings: &Settings,
) -> IdempotencyLayer<St, impl tower_idempotency::ScopeExtractor> {
    IdempotencyLayer::new(store)
        .require_key(true)
        .unguarded_paths([LIST_CHARGES])
        .scope_with(|parts: &Parts| parts.extensions.get::<Account>().map(|a| a.0.clone()))
        .lease(settings.lease)
        .retention(settings.retention)
}

/// Serves the payments service on `listener` until the process ends:
/// authentication, then the idempotency layer, then the service. Says
/// `listening on ADDR` on stdout once the store is ready.
/// The generated server for `service`, accepting gzip if configured to.
fn payments(service: PaymentsService, settings: &Settings) -> PaymentsServer<PaymentsService> {
    let server = PaymentsServer::new(service);
    if settings.accept_gzip {
        server.accept_compressed(tonic::codec::CompressionEncoding::Gzip)
    } else {
        server
    }
}

pub async fn serve<St: Store>(
    listener: TcpListener,
    store: St,
    ledger: Ledger,
    settings: &Settings,
) -> Result<(), tonic::transport::Error> {
    let service = PaymentsService {
        ledger,
        processor_latency: settings.processor_latency,
    };
    if let Ok(addr) = listener.local_addr() {
        println!("listening on {addr}");
    }
    let layers = ServiceBuilder::new()
        .layer(MapRequestLayer::new(authenticate))
        .layer(idempotency(store, settings))
        .into_inner();
    tonic::transport::Server::builder()
        .layer(layers)
        .add_service(payments(service, settings))
        .serve_with_incoming(TcpIncoming::from(listener))
        .await
}
