#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]
#![cfg_attr(docsrs, feature(doc_cfg))]

// Imports run one way, along a request's path: layer → service → guard →
// execute → lease → store → record → outcome → rejection → key, with config
// (built by the layer, read below it) and the leaves policy, scope, body
// (buffering, for guard and execute) and fingerprint → canonical_json beside
// the path. lib.rs only re-exports.
mod body;
mod canonical_json;
pub mod codec;
mod config;
mod execute;
mod fingerprint;
mod future;
mod guard;
mod key;
mod layer;
mod lease;
pub mod message;
mod observe;
mod outcome;
mod policy;
mod problem;
mod record;
mod rejection;
mod scope;
mod service;
pub mod store;

#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use ::redis;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use ::sqlx;
pub use config::{MAX_LEASE, MAX_RETENTION};
pub use fingerprint::{
    DefaultFingerprint, Fingerprint, FingerprintHasher, FingerprintStrategy, RawBodyFingerprint,
};
pub use future::ResponseFuture;
pub use key::{IDEMPOTENCY_KEY, IdempotencyKey, InvalidKey};
pub use layer::IdempotencyLayer;
pub use outcome::{BypassReason, Completion, IdempotencyOutcome};
pub use policy::{And, DefaultStorePolicy, StoreAll, StorePolicy};
pub use problem::Problem;
pub use record::{CompletedRecord, CorruptRecord, IDEMPOTENT_REPLAYED, StoredResponse};
pub use rejection::{Rejection, RejectionKind};
pub use scope::{NoScope, ScopeExtractor};
pub use service::IdempotencyService;
#[cfg(feature = "cache")]
#[cfg_attr(docsrs, doc(cfg(feature = "cache")))]
pub use store::CachedStore;
#[cfg(feature = "memory")]
#[cfg_attr(docsrs, doc(cfg(feature = "memory")))]
pub use store::MemoryStore;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use store::postgres::{IdempotentTx, PostgresStore};
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use store::redis::RedisStore;
