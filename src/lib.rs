#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod canonical_json;
mod claim;
mod execute;
mod fingerprint;
mod future;
mod key;
mod layer;
mod lease;
mod outcome;
mod policy;
mod record;
mod rejection;
mod scope;
mod service;
pub mod store;

#[cfg(feature = "redis")]
pub use ::redis;
pub use claim::IDEMPOTENT_REPLAYED;
pub use fingerprint::{
    DefaultFingerprint, Fingerprint, FingerprintHasher, FingerprintStrategy, RawBodyFingerprint,
};
pub use future::ResponseFuture;
pub use key::{IDEMPOTENCY_KEY, IdempotencyKey, InvalidKey};
pub use layer::{IdempotencyLayer, MAX_LEASE, MAX_RETENTION};
pub use outcome::{BypassReason, Completion, IdempotencyOutcome};
pub use policy::{And, CachePolicy, DefaultCachePolicy, StoreAll};
pub use record::{CompletedRecord, CorruptRecord, StoredResponse};
pub use rejection::{Rejection, RejectionKind};
pub use scope::{NoScope, ScopeExtractor};
pub use service::IdempotencyService;
#[cfg(feature = "memory")]
pub use store::MemoryStore;
#[cfg(feature = "redis")]
pub use store::redis::RedisStore;
