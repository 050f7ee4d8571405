//! Stripe-style `Idempotency-Key` semantics for [tower] and [axum] services
//! and for queue consumers: a retry never runs the work twice, never runs
//! it alongside the original, never receives another tenant's answer, and a
//! key reused with other parameters is refused.
//!
//! Networks and processes fail between "the work was done" and "the caller
//! heard about it", so clients retry and brokers redeliver. The layer names
//! each operation by its `Idempotency-Key`, claims the key atomically, runs
//! the handler once, stores its response and replays it — byte for byte,
//! with `Idempotent-Replayed: true` — to every retry.
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
//! ```
//!
//! | Request | Answer | Handler runs? |
//! |---|---|---|
//! | unguarded method (guarded: `POST`, `PATCH`) or no key | passed through (or `400` with `require_key`) | yes |
//! | invalid key; body over the limit | `400`; `413` | no |
//! | new key | the handler runs under a claim; its response is stored, then sent | once |
//! | same key and request, completed | the stored response, `Idempotent-Replayed: true` | no |
//! | same key and request, still running | `409` + `Retry-After` (or wait, then replay) | no |
//! | same key, other method, path, query or body | `422` | no |
//! | store unreachable | `503` + `Retry-After` (fail closed) | no |
//!
//! Rejections are RFC 9457 `application/problem+json` ([`Rejection`]), never
//! stored; every response carries an [`IdempotencyOutcome`]. See
//! [`IdempotencyLayer`] for the configuration, [`StorePolicy`] for which
//! responses are stored, [`FingerprintStrategy`] for what counts as the same
//! request, and [`ScopeExtractor`] for scopes.
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
//! | [`CachedStore`] | `cache` | the inner store's | replays without a round trip |
//!
//! A store whose claims are **transactions** commits the record with the
//! handler's own writes: the handler takes the transaction with
//! [`IdempotentTx`], and a crash anywhere leaves both or neither — exactly
//! one effect. A store whose claims are **leases** keeps the record apart
//! from the effect: a crash between them means the retry executes again
//! once the lease expires. The SQL stores are one family, [`store::sql`].
//! Custom stores implement [`store::Store`].
//!
//! ```no_run
//! # #[cfg(feature = "sqlite")]
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use axum::{Router, http::StatusCode, routing::post};
//! use tower_idempotency::{IdempotencyLayer, IdempotentTx, SqliteStore, SqliteTx};
//!
//! async fn charge(mut tx: IdempotentTx<SqliteTx>) -> Result<StatusCode, StatusCode> {
//!     sqlx::query("INSERT INTO charges (amount) VALUES (1999)")
//!         .execute(&mut *tx)
//!         .await
//!         .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
//!     Ok(StatusCode::CREATED) // committed with the stored response, or not at all
//! }
//!
//! let store = SqliteStore::builder()
//!     .transactional()
//!     .create_table_if_missing()
//!     .connect("sqlite://payments.db")
//!     .await?;
//! let app: Router = Router::new()
//!     .route("/v1/charges", post(charge))
//!     .route_layer(IdempotencyLayer::new(store).single_tenant().require_key(true));
//! # let _ = app; Ok(()) }
//! ```
//!
//! # Queue consumers
//!
//! [`message::IdempotencyProcessor`] runs the same protocol for messages,
//! keyed by a business identifier, with the same stores; on a transactional
//! store the message's record commits in the work's transaction.
//!
//! # gRPC
//!
//! On a tonic server (`Server::builder().layer(…)`), the same layer guards
//! unary calls: the key is the `idempotency-key` metadata, the reply is
//! stored and replayed with its trailers (`grpc-status`, `grpc-message`,
//! trailing metadata), the layer's own answers are gRPC statuses
//! ([`Rejection::grpc_code`]), and the store policy reads the status
//! ([`StorePolicy::should_store_grpc`]: `UNAVAILABLE`,
//! `RESOURCE_EXHAUSTED`, `ABORTED` and `DEADLINE_EXCEEDED` release the key).
//! A method behind a transactional store takes its transaction with
//! [`IdempotentTx::from_extensions`]. Streaming methods are not guarded:
//! list them in [`IdempotencyLayer::unguarded_paths`].
//!
//! # Feature flags
//!
//! | Feature | Default | Adds |
//! |---|---|---|
//! | `memory` | yes | [`MemoryStore`] |
//! | `redis` | | [`RedisStore`] on one node (re-exports `redis`) |
//! | `cluster` | | Redis Cluster for [`RedisStore`] |
//! | `sqlite` | | [`SqliteStore`], [`SqliteTxStore`] (bundled SQLite; re-exports `sqlx`) |
//! | `postgres` | | [`PostgresStore`], [`PostgresTxStore`] (re-exports `sqlx`) |
//! | `mysql` | | [`MySqlStore`], [`MySqlTxStore`] for MySQL 8.0+ and MariaDB 10.6+ (re-exports `sqlx`) |
//! | `cache` | | [`CachedStore`] |
//! | `metrics` | | counters and histograms through the `metrics` facade |
//! | `compression` | | zstd for stored bodies ([`codec::Compression`], opt-in per store) |
//!
//! [tower]: https://docs.rs/tower
//! [axum]: https://docs.rs/axum
#![forbid(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]
#![cfg_attr(docsrs, feature(doc_cfg))]

// The folders are the architecture: two doors (`http`, `message`) over one
// protocol (`protocol`: claim, hold, settle) and the stores (`store`), with
// the leaves they share below them (`record`, `fingerprint`, `key`,
// `observe`). Imports run one way, from the doors down. lib.rs only
// re-exports.
#[cfg(feature = "client")]
#[cfg_attr(docsrs, doc(cfg(feature = "client")))]
pub mod client;
mod fingerprint;
mod http;
mod key;
mod lock;
pub mod message;
mod observe;
mod protocol;
mod record;
pub mod store;
#[cfg(feature = "testing")]
#[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
pub mod testing;

#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use ::redis;
#[cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql"))]
#[cfg_attr(
    docsrs,
    doc(cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql")))
)]
pub use ::sqlx;
pub use fingerprint::{
    DefaultFingerprint, Fingerprint, FingerprintHasher, FingerprintStrategy, PayloadFingerprint,
    RawBodyFingerprint,
};
pub use http::future::ResponseFuture;
pub use http::grpc::GrpcCode;
pub use http::layer::IdempotencyLayer;
pub use http::opt_out::NoReplay;
pub use http::outcome::{BypassReason, Completion, IdempotencyOutcome};
pub use http::problem::Problem;
pub use http::rejection::{Rejection, RejectionKind};
pub use http::replay::IDEMPOTENT_REPLAYED;
pub use http::scope::{NoScope, ScopeExtractor, ScopeNotChosen};
pub use http::service::IdempotencyService;
pub use http::store_policy::{And, DefaultStorePolicy, StoreAllPolicy, StorePolicy};
pub use http::transaction::IdempotentTx;
pub use key::{IDEMPOTENCY_KEY, IdempotencyKey, InvalidKey};
pub use protocol::{MAX_LEASE, MAX_RETENTION};
pub use record::codec;
pub use record::{CompletedRecord, CorruptRecord, StoredResponse};
#[cfg(feature = "cache")]
#[cfg_attr(docsrs, doc(cfg(feature = "cache")))]
pub use store::CachedStore;
#[cfg(feature = "memory")]
#[cfg_attr(docsrs, doc(cfg(feature = "memory")))]
pub use store::MemoryStore;
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

/// The README's snippets, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
