#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]
#![cfg_attr(docsrs, feature(doc_cfg))]

// The folders are the architecture: two doors (`http`, `message`) over one
// protocol (`protocol`: claim, hold, settle) and the stores (`store`), with
// the leaves they share below them (`record`, `fingerprint`, `key`,
// `observe`). Imports run one way, from the doors down. lib.rs only
// re-exports.
mod fingerprint;
mod http;
mod key;
pub mod message;
mod observe;
mod protocol;
mod record;
pub mod store;

#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use ::redis;
#[cfg(any(feature = "postgres", feature = "sqlite"))]
#[cfg_attr(docsrs, doc(cfg(any(feature = "postgres", feature = "sqlite"))))]
pub use ::sqlx;
pub use fingerprint::{
    DefaultFingerprint, Fingerprint, FingerprintHasher, FingerprintStrategy, RawBodyFingerprint,
};
pub use http::future::ResponseFuture;
pub use http::layer::IdempotencyLayer;
pub use http::outcome::{BypassReason, Completion, IdempotencyOutcome};
pub use http::problem::Problem;
pub use http::rejection::{Rejection, RejectionKind};
pub use http::replay::IDEMPOTENT_REPLAYED;
pub use http::scope::{NoScope, ScopeExtractor};
pub use http::service::IdempotencyService;
pub use http::store_policy::{And, DefaultStorePolicy, StoreAll, StorePolicy};
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
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use store::postgres::{PostgresStore, PostgresTx, PostgresTxStore};
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use store::redis::RedisStore;
#[cfg(feature = "sqlite")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
pub use store::sqlite::{SqliteStore, SqliteTx, SqliteTxStore};
