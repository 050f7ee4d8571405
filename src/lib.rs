//! Stripe-style `Idempotency-Key` semantics for [tower] and [axum] services
//! (and tonic), for queue consumers, and for the clients that call them: a
//! retry never runs the work twice, never runs it alongside the original,
//! never receives another tenant's answer, a key reused with other
//! parameters is refused — and nothing is lost.
//!
//! Networks and processes fail between "the work was done" and "the caller
//! heard about it", so clients retry and brokers redeliver. The layer names
//! each operation by its `Idempotency-Key`, claims the key atomically, runs
//! the handler once, stores its response and replays it — byte for byte,
//! with `Idempotent-Replayed: true` — to every retry. What each request gets
//! is in [`guide::semantics`].
//!
//! # Quick start
//!
//! ```
//! use axum::{Router, routing::post};
//! use http::request::Parts;
//! use tower_idempotency::{IdempotencyLayer, MemoryStore};
//!
//! /// Put in the request's extensions by your authentication middleware.
//! #[derive(Clone)]
//! struct AccountId(String);
//!
//! let idempotency = IdempotencyLayer::new(MemoryStore::new())
//!     .require_key(true)
//!     // Records are per account: never replay one tenant's response to another.
//!     .scope_with(|parts: &Parts| parts.extensions.get::<AccountId>().map(|a| a.0.clone()));
//!
//! let app: Router = Router::new()
//!     .route("/v1/charges", post(|| async { "charged once" }))
//!     .route_layer(idempotency);
//! // Authentication goes outside, so it runs first: `.layer(auth)` here.
//! ```
//!
//! # The record and the charge in one transaction
//!
//! With a transactional store, the handler writes its effect in the
//! request's own transaction ([`IdempotentTx`]) and the layer commits the
//! stored response with it: a crash anywhere leaves both or neither —
//! exactly one effect. SQLite is built in; PostgreSQL and MySQL/MariaDB are
//! the same family ([`guide::sql`]).
//!
//! ```no_run
//! # #[cfg(feature = "postgres")]
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use axum::{Router, http::StatusCode, routing::post};
//! use tower_idempotency::{IdempotencyLayer, IdempotentTx, PostgresStore, PostgresTx};
//!
//! async fn charge(mut tx: IdempotentTx<PostgresTx>) -> Result<StatusCode, StatusCode> {
//!     sqlx::query("INSERT INTO charges (amount) VALUES (1999)")
//!         .execute(&mut *tx)
//!         .await
//!         .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
//!     Ok(StatusCode::CREATED) // committed with the stored response, or not at all
//! }
//!
//! let store = PostgresStore::builder()
//!     .transactional()
//!     .create_table_if_missing()
//!     .connect("postgres://postgres@127.0.0.1:5432/payments")
//!     .await?;
//! let app: Router = Router::new()
//!     .route("/v1/charges", post(charge))
//!     .route_layer(IdempotencyLayer::new(store).single_tenant().require_key(true));
//! # let _ = app; Ok(()) }
//! ```
//!
//! # The doors
//!
//! - **HTTP** — [`IdempotencyLayer`], for any tower service: axum routes,
//!   webhook receivers whose key is in the body
//!   ([`key_from_body`](IdempotencyLayer::key_from_body)). Its settings:
//!   [`guide::configuration`].
//! - **gRPC** — the same layer on a tonic server: unary calls guarded, the
//!   reply replayed with its trailers, rejections as gRPC statuses
//!   ([`guide::grpc`]).
//! - **MCP** — `mcp::McpIdempotencyLayer` (feature `mcp`) in front of a
//!   Streamable HTTP MCP server: an AI agent's `tools/call`, re-sent with a
//!   new id, runs once; the final JSON-RPC response is replayed with the
//!   retry's id ([`guide::mcp`]).
//! - **Queue consumers** — [`message::IdempotencyProcessor`]: the same
//!   protocol keyed by a business identifier, which keeps each delivery in
//!   hand until it is decided, so that no order is lost ([`message`],
//!   [`guide::consumers`]).
//! - **Clients** — `client::IdempotentClientLayer` (feature `client`): one
//!   key per operation, kept across its retries; only what is safe retried
//!   ([`guide::client`]).
//! - **Operators** — every store answers "what happened to this key?" and
//!   can forget one ([`store::Store::inspect`], [`store::Store::forget`]);
//!   tracing spans and metrics ([`guide::operations`]).
//!
//! # Stores
//!
//! | Store | Feature | Claims | For |
//! |---|---|---|---|
//! | [`MemoryStore`] | `memory` (default) | leases | tests, one process |
//! | [`SqliteTxStore`] | `sqlite` | transactions | one machine, durable, nothing to install |
//! | [`PostgresTxStore`] | `postgres` | transactions | effects in PostgreSQL (or a compatible engine) |
//! | [`MySqlTxStore`] | `mysql` | transactions | effects in MySQL or MariaDB (Galera too) |
//! | [`SqliteStore`], [`PostgresStore`], [`MySqlStore`] | `sqlite`, `postgres`, `mysql` | leases | effects elsewhere |
//! | [`RedisStore`] | `redis` (`cluster`) | leases | effects elsewhere, many instances |
//! | [`DynamoDbTxStore`] | `dynamodb` | the record in the handler's own `TransactWriteItems` | effects in DynamoDB |
//! | [`DynamoDbStore`] | `dynamodb` | leases | effects elsewhere, on AWS |
//! | [`CachedStore`] | `cache` | the inner store's | replays without a round trip |
//!
//! A store whose claims are **transactions** commits the record with the
//! handler's own writes. A store whose claims are **leases** keeps the record
//! apart from the effect: a crash between them, or a pause longer than the
//! lease, lets the retry execute again — give the effect a downstream key
//! ([`store::redis`] shows how). Custom stores implement [`store::Store`]
//! and can run the contract suite (`testing`). More: [`guide::stores`],
//! [`guide::capacity`].
//!
//! # Feature flags
//!
//! | Feature | Default | Adds |
//! |---|---|---|
//! | `memory` | yes | [`MemoryStore`] |
//! | `redis` | | [`RedisStore`] on one Redis or Valkey node (re-exports `redis`) |
//! | `cluster` | | Redis Cluster or Valkey Cluster for [`RedisStore`] |
//! | `sqlite` | | [`SqliteStore`], [`SqliteTxStore`] (bundled SQLite; re-exports `sqlx`) |
//! | `postgres` | | [`PostgresStore`], [`PostgresTxStore`] (re-exports `sqlx`) |
//! | `mysql` | | [`MySqlStore`], [`MySqlTxStore`] for MySQL 8.0+ and MariaDB 10.6+ (re-exports `sqlx`) |
//! | `dynamodb` | | [`DynamoDbStore`], [`DynamoDbTxStore`] on the official SDK (re-exports `aws_sdk_dynamodb`) |
//! | `cache` | | [`CachedStore`] |
//! | `metrics` | | counters and histograms through the `metrics` facade |
//! | `compression` | | zstd for stored bodies ([`codec::Compression`], opt-in per store) |
//! | `client` | | `client::IdempotentClientLayer`: one key per call, safe retries |
//! | `mcp` | | `mcp::McpIdempotencyLayer`: an MCP `tools/call` runs once, in front of any Streamable HTTP MCP server |
//! | `openapi` | | `openapi::IdempotencyDocs`: the layer's headers and refusals in a utoipa 6 document (re-exports `utoipa`) |
//! | `testing` | | `testing::StoreContract`: the store contract, for a custom store's tests |
//! | `opentelemetry` | | W3C trace context across a chain: the outbox writes the request's `traceparent` into its messages, the consumer door continues it |
//!
//! The SQL features also bring the transactional outbox ([`outbox`]:
//! messages enqueued in the handler's transaction, relayed to a broker).
//! Beside the crate: one adapter crate per broker for the consumer loop and
//! the outbox's publisher (`tower-idempotency-sqs`, `-nats`, `-rabbitmq`,
//! `-kafka`), and the operator CLI (`tower-idempotency-cli`).
//!
//! # Versions
//!
//! For axum 0.8, tower 0.5, tonic 0.14, sqlx 0.9, redis 1 and tokio 1.
//! The minimum supported Rust version is 1.94, and follows this rule: a
//! Rust release at least six months old, raised only in a minor release
//! (before 1.0) and said in the changelog. A new major of a re-exported
//! client (`sqlx`, `redis`) is a minor release of this crate before 1.0
//! that moves to it; the previous release line keeps the previous major.
//!
//! [tower]: https://docs.rs/tower
//! [axum]: https://docs.rs/axum
// The tables above name every store; each link resolves whatever features
// build the docs: to the item where it is compiled in, else to docs.rs.
#![cfg_attr(feature = "memory", doc = "[`MemoryStore`]: crate::MemoryStore")]
#![cfg_attr(
    not(feature = "memory"),
    doc = "[`MemoryStore`]: https://docs.rs/tower-idempotency/latest/tower_idempotency/struct.MemoryStore.html"
)]
#![cfg_attr(feature = "sqlite", doc = "[`SqliteStore`]: crate::SqliteStore")]
#![cfg_attr(
    not(feature = "sqlite"),
    doc = "[`SqliteStore`]: https://docs.rs/tower-idempotency/latest/tower_idempotency/store/sql/struct.SqlStore.html"
)]
#![cfg_attr(feature = "sqlite", doc = "[`SqliteTxStore`]: crate::SqliteTxStore")]
#![cfg_attr(
    not(feature = "sqlite"),
    doc = "[`SqliteTxStore`]: https://docs.rs/tower-idempotency/latest/tower_idempotency/store/sql/struct.SqlTxStore.html"
)]
#![cfg_attr(feature = "postgres", doc = "[`PostgresStore`]: crate::PostgresStore")]
#![cfg_attr(
    not(feature = "postgres"),
    doc = "[`PostgresStore`]: https://docs.rs/tower-idempotency/latest/tower_idempotency/store/sql/struct.SqlStore.html"
)]
#![cfg_attr(
    feature = "postgres",
    doc = "[`PostgresTxStore`]: crate::PostgresTxStore"
)]
#![cfg_attr(
    not(feature = "postgres"),
    doc = "[`PostgresTxStore`]: https://docs.rs/tower-idempotency/latest/tower_idempotency/store/sql/struct.SqlTxStore.html"
)]
#![cfg_attr(feature = "mysql", doc = "[`MySqlStore`]: crate::MySqlStore")]
#![cfg_attr(
    not(feature = "mysql"),
    doc = "[`MySqlStore`]: https://docs.rs/tower-idempotency/latest/tower_idempotency/store/sql/struct.SqlStore.html"
)]
#![cfg_attr(feature = "mysql", doc = "[`MySqlTxStore`]: crate::MySqlTxStore")]
#![cfg_attr(
    not(feature = "mysql"),
    doc = "[`MySqlTxStore`]: https://docs.rs/tower-idempotency/latest/tower_idempotency/store/sql/struct.SqlTxStore.html"
)]
#![cfg_attr(feature = "redis", doc = "[`RedisStore`]: crate::RedisStore")]
#![cfg_attr(
    not(feature = "redis"),
    doc = "[`RedisStore`]: https://docs.rs/tower-idempotency/latest/tower_idempotency/struct.RedisStore.html"
)]
#![cfg_attr(feature = "redis", doc = "[`store::redis`]: crate::store::redis")]
#![cfg_attr(
    not(feature = "redis"),
    doc = "[`store::redis`]: https://docs.rs/tower-idempotency/latest/tower_idempotency/store/redis/index.html"
)]
#![cfg_attr(feature = "dynamodb", doc = "[`DynamoDbStore`]: crate::DynamoDbStore")]
#![cfg_attr(
    not(feature = "dynamodb"),
    doc = "[`DynamoDbStore`]: https://docs.rs/tower-idempotency/latest/tower_idempotency/struct.DynamoDbStore.html"
)]
#![cfg_attr(
    feature = "dynamodb",
    doc = "[`DynamoDbTxStore`]: crate::DynamoDbTxStore"
)]
#![cfg_attr(
    not(feature = "dynamodb"),
    doc = "[`DynamoDbTxStore`]: https://docs.rs/tower-idempotency/latest/tower_idempotency/struct.DynamoDbTxStore.html"
)]
#![cfg_attr(feature = "cache", doc = "[`CachedStore`]: crate::CachedStore")]
#![cfg_attr(
    not(feature = "cache"),
    doc = "[`CachedStore`]: https://docs.rs/tower-idempotency/latest/tower_idempotency/struct.CachedStore.html"
)]
#![forbid(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]
#![cfg_attr(docsrs, feature(doc_cfg))]

// The folders are the architecture: the doors (`http`, `message` with the
// consumer loop, `client`) over one protocol (`protocol`: claim, hold,
// settle) and the stores (`store`: memory, cached, redis, the SQL family,
// dynamodb), with the leaves they share below them (`record`,
// `fingerprint`, `key`, `observe`); the outbox (`outbox`) over the SQL
// stores' tables; the store contracts (`testing`) and the guide (`guide`).
// Imports run one way, from the doors down. lib.rs only re-exports.
#[cfg(feature = "client")]
#[cfg_attr(docsrs, doc(cfg(feature = "client")))]
pub mod client;
mod fingerprint;
pub mod guide;
mod http;
mod key;
mod lock;
#[cfg(feature = "mcp")]
#[cfg_attr(docsrs, doc(cfg(feature = "mcp")))]
pub mod mcp;
pub mod message;
mod observe;
pub mod outbox;
mod protocol;
mod record;
pub mod store;
#[cfg(feature = "testing")]
#[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
pub mod testing;

#[cfg(feature = "dynamodb")]
#[cfg_attr(docsrs, doc(cfg(feature = "dynamodb")))]
pub use ::aws_sdk_dynamodb;
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use ::redis;
#[cfg(sql)]
#[cfg_attr(
    docsrs,
    doc(cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql")))
)]
pub use ::sqlx;
#[cfg(feature = "openapi")]
#[cfg_attr(docsrs, doc(cfg(feature = "openapi")))]
pub use ::utoipa;
pub use fingerprint::{
    DefaultFingerprint, Fingerprint, FingerprintHasher, FingerprintStrategy, PayloadFingerprint,
    RawBodyFingerprint,
};
pub use http::future::ResponseFuture;
pub use http::grpc::GrpcCode;
pub use http::layer::IdempotencyLayer;
#[cfg(feature = "openapi")]
#[cfg_attr(docsrs, doc(cfg(feature = "openapi")))]
pub use http::openapi;
pub use http::opt_out::NoReplay;
pub use http::outcome::{BypassReason, Completion, IdempotencyOutcome};
pub use http::problem::Problem;
pub use http::rejection::{Rejection, RejectionKind};
pub use http::replay::{IDEMPOTENCY_REPLAYABLE_FOR, IDEMPOTENT_REPLAYED};
pub use http::scope::{NoScope, ScopeExtractor, ScopeNotChosen};
pub use http::service::IdempotencyService;
pub use http::store_policy::{And, DefaultStorePolicy, StoreAllPolicy, StorePolicy};
pub use http::transaction::IdempotentTx;
pub use key::{IDEMPOTENCY_KEY, IdempotencyKey, InvalidKey};
pub use protocol::{Attempt, Earlier, MAX_LEASE, MAX_RETENTION};
pub use record::codec;
pub use record::{CompletedRecord, CorruptRecord, StoredResponse};
#[cfg(feature = "cache")]
#[cfg_attr(docsrs, doc(cfg(feature = "cache")))]
pub use store::CachedStore;
#[cfg(feature = "memory")]
#[cfg_attr(docsrs, doc(cfg(feature = "memory")))]
pub use store::MemoryStore;
pub use store::SensitiveKeys;
#[cfg(feature = "dynamodb")]
#[cfg_attr(docsrs, doc(cfg(feature = "dynamodb")))]
pub use store::dynamodb::{DynamoDbStore, DynamoDbTx, DynamoDbTxStore};
#[cfg(feature = "mysql")]
#[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
pub use store::mysql::{MySqlStore, MySqlTx, MySqlTxStore};
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use store::postgres::{PostgresStore, PostgresTx, PostgresTxStore};
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use store::redis::RedisStore;
#[cfg(feature = "sqlite")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
pub use store::sqlite::{SqliteStore, SqliteTx, SqliteTxStore};

/// The README's snippets, compiled as doctests (they are on SQLite).
#[cfg(all(doctest, feature = "sqlite"))]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
