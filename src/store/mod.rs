//! Stores: where claims and completed records live.
//!
//! A store implements the claim protocol (claim, extend, complete, release) as four atomic
//! operations. [`Store::claim`] decides everything in one step and, for a
//! completed key, returns the record itself so that a replay costs one round
//! trip. [`Store::extend`], [`Store::complete`] and [`Store::release`] act only
//! while the caller's [`LeaseToken`] is still the one stored (fencing): a
//! request whose lease expired and was re-claimed by another can never
//! overwrite or delete the newer claim.
//!
//! # Writing a store
//!
//! ```
//! use std::{collections::HashMap, sync::{Arc, Mutex}, time::Duration};
//! use tower_idempotency::store::{Claim, LeaseToken, StorageKey, Store, StoreError};
//! use tower_idempotency::{CompletedRecord, Fingerprint};
//!
//! /// A toy store without expiry, to show the contract.
//! #[derive(Clone, Default)]
//! struct ToyStore(Arc<Mutex<HashMap<StorageKey, (Fingerprint, Result<Arc<CompletedRecord>, LeaseToken>)>>>);
//!
//! impl Store for ToyStore {
//!     async fn claim(&self, key: &StorageKey, fp: &Fingerprint, _lease: Duration) -> Result<Claim, StoreError> {
//!         let mut map = self.0.lock().unwrap();
//!         Ok(match map.get(key) {
//!             None => {
//!                 let token = LeaseToken::generate();
//!                 map.insert(key.clone(), (*fp, Err(token)));
//!                 Claim::Acquired(token)
//!             }
//!             Some((stored, _)) if stored != fp => Claim::Mismatch,
//!             Some((_, Err(_))) => Claim::InFlight { retry_after: Duration::from_secs(1) },
//!             Some((_, Ok(record))) => Claim::Completed { record: record.clone(), expires_in: Duration::MAX },
//!         })
//!     }
//!     async fn extend(&self, key: &StorageKey, token: LeaseToken, _lease: Duration) -> Result<bool, StoreError> {
//!         Ok(matches!(self.0.lock().unwrap().get(key), Some((_, Err(t))) if *t == token))
//!     }
//!     async fn complete(&self, key: &StorageKey, token: LeaseToken, _fp: &Fingerprint, record: Arc<CompletedRecord>, _retention: Duration) -> Result<bool, StoreError> {
//!         let mut map = self.0.lock().unwrap();
//!         match map.get_mut(key) {
//!             Some((_, state @ Err(_))) if *state == Err(token) => { *state = Ok(record); Ok(true) }
//!             _ => Ok(false),
//!         }
//!     }
//!     async fn release(&self, key: &StorageKey, token: LeaseToken) -> Result<bool, StoreError> {
//!         let mut map = self.0.lock().unwrap();
//!         let owned = matches!(map.get(key), Some((_, Err(t))) if *t == token);
//!         if owned { map.remove(key); }
//!         Ok(owned)
//!     }
//! }
//!
//! let layer = tower_idempotency::IdempotencyLayer::new(ToyStore::default());
//! # let _ = layer;
//! ```

use std::{fmt, future::Future, sync::Arc, time::Duration};

use crate::{
    fingerprint::{Fingerprint, FingerprintHasher, write_hex},
    key::IdempotencyKey,
    record::{CompletedRecord, CorruptRecord},
};

#[cfg(feature = "cache")]
mod cached;
#[cfg(any(feature = "redis", feature = "postgres"))]
mod late_claim;
#[cfg(feature = "memory")]
mod memory;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub mod postgres;
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub mod redis;

#[cfg(feature = "cache")]
#[cfg_attr(docsrs, doc(cfg(feature = "cache")))]
pub use cached::CachedStore;
#[cfg(feature = "memory")]
#[cfg_attr(docsrs, doc(cfg(feature = "memory")))]
pub use memory::MemoryStore;

/// The claim protocol. See the [module docs](self) for the contract and a
/// complete example.
///
/// Stores are cloned into every service the layer creates; clones must share
/// their state (put it behind an `Arc`).
pub trait Store: Clone + Send + Sync + 'static {
    /// Atomically claims `key` for a request with this fingerprint:
    /// - unknown key: record an in-flight claim that expires after `lease` and
    ///   return [`Claim::Acquired`] with a fresh token;
    /// - a different fingerprint: [`Claim::Mismatch`];
    /// - in flight: [`Claim::InFlight`] with the remaining lease;
    /// - completed: [`Claim::Completed`] with the record and its remaining TTL.
    fn claim(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> impl Future<Output = Result<Claim, StoreError>> + Send;

    /// Pushes the in-flight claim's expiry to `lease` from now, if `token`
    /// still holds it. Returns whether it did.
    fn extend(
        &self,
        key: &StorageKey,
        token: LeaseToken,
        lease: Duration,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Replaces the in-flight claim with the completed record (the answer to
    /// requests with this `fingerprint`), kept for `retention`, if `token`
    /// still holds the claim. Returns whether it did.
    ///
    /// The layer retries a completion that failed (e.g. timed out). A store
    /// where the failed attempt may still have been applied must answer
    /// `true` when the key already holds this very record, so that the retry
    /// does not report a lost lease.
    fn complete(
        &self,
        key: &StorageKey,
        token: LeaseToken,
        fingerprint: &Fingerprint,
        record: Arc<CompletedRecord>,
        retention: Duration,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Deletes the in-flight claim, if `token` still holds it, so the key may
    /// be retried. Returns whether it did.
    fn release(
        &self,
        key: &StorageKey,
        token: LeaseToken,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Called once the claim is acquired, before the handler runs: a store
    /// may put what the handler needs into the request's extensions (the
    /// transactional Postgres store puts the transaction there). Does nothing
    /// by default.
    fn attach(&self, token: LeaseToken, extensions: &mut http::Extensions) {
        let _ = (token, extensions);
    }

    /// Whether [`complete`](Store::complete) commits the handler's own writes
    /// together with the record (default `false`). Then a completion that
    /// did not succeed means the handler's writes did not commit either (or
    /// their fate is unknown): the layer withholds the handler's response and
    /// answers `503`, instead of sending it and retrying the completion.
    fn commits_effects(&self) -> bool {
        false
    }
}

/// What [`Store::claim`] found.
#[derive(Clone, Debug)]
pub enum Claim {
    /// The key was free and is now claimed by this token.
    Acquired(LeaseToken),
    /// Another request with the same fingerprint holds the key.
    InFlight {
        /// How long until its lease runs out.
        retry_after: Duration,
    },
    /// The key was used with a different fingerprint.
    Mismatch,
    /// The key is completed with the same fingerprint: replay this.
    Completed {
        /// The stored outcome.
        record: Arc<CompletedRecord>,
        /// How long the store keeps it (its remaining TTL); a cache of
        /// completed records must not keep it longer.
        expires_in: Duration,
    },
}

/// The address of a record: an unambiguous encoding of *(scope, key)*.
///
/// The scope never appears raw: it is replaced by its SHA-256, so a scope
/// derived from a credential cannot leak into store key names or logs (which
/// show this key). The hash has a fixed length, so scope `a:b` with key `c`
/// and scope `a` with key `b:c` never collide.
///
/// # Examples
///
/// ```
/// use tower_idempotency::{IdempotencyKey, store::StorageKey};
///
/// let k = |scope: &str, key: &str| StorageKey::new(scope, &IdempotencyKey::new(key).unwrap());
/// assert_ne!(k("a:b", "c"), k("a", "b:c"));
/// let key = k("acct_1", "order-42");
/// assert!(key.as_str().ends_with(":order-42"));
/// assert!(!key.as_str().contains("acct_1"));
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct StorageKey(Arc<str>);

impl StorageKey {
    /// Encodes a scope and a key as `{hex SHA-256 of the scope}:{key}`.
    pub fn new(scope: &str, key: &IdempotencyKey) -> Self {
        let mut hasher = FingerprintHasher::new("tower-idempotency/scope/v1");
        hasher.field(scope.as_bytes());
        // Assembled on the stack, so the key costs one allocation: its `Arc`.
        let mut encoded = [0; 64 + 1 + IdempotencyKey::MAX_LEN];
        let (hex, rest) = encoded.split_at_mut(64);
        write_hex(hex, hasher.finish().as_bytes());
        rest[0] = b':';
        let key = key.as_str().as_bytes();
        rest[1..=key.len()].copy_from_slice(key);
        let encoded = &encoded[..64 + 1 + key.len()];
        Self(
            std::str::from_utf8(encoded)
                .expect("hex and an ASCII key")
                .into(),
        )
    }

    /// The encoded key.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for StorageKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for StorageKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A fencing token: proof that a request still holds its claim.
///
/// 128 random bits, so that two claims of the same key — in this process or
/// any other — never share a token.
///
/// # Examples
///
/// ```
/// use tower_idempotency::store::LeaseToken;
///
/// let a = LeaseToken::generate();
/// assert_ne!(a, LeaseToken::generate());
/// assert_eq!(LeaseToken::from_bytes(a.to_bytes()), a);
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct LeaseToken(u128);

impl LeaseToken {
    /// A fresh random token.
    pub fn generate() -> Self {
        Self(fastrand::u128(..))
    }

    /// The token's 16 bytes, for storing it.
    pub fn to_bytes(self) -> [u8; 16] {
        self.0.to_be_bytes()
    }

    /// A token read back from a store.
    pub fn from_bytes(bytes: [u8; 16]) -> Self {
        Self(u128::from_be_bytes(bytes))
    }
}

impl fmt::Debug for LeaseToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LeaseToken({:032x})", self.0)
    }
}

/// A store could not do what was asked. Every backend maps its errors into
/// this type.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The store could not be reached, or failed the operation.
    #[error("idempotency store unavailable: {0}")]
    Unavailable(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The store did not answer in time.
    #[error("idempotency store timed out after {0:?}")]
    Timeout(Duration),
    /// A stored record could not be decoded.
    #[error(transparent)]
    Corrupt(#[from] CorruptRecord),
    /// The handler still holds the transaction the store gave it (an
    /// extractor kept past the handler, e.g. moved into a spawned task), so
    /// it can be neither committed nor rolled back now. It rolls back when
    /// that holder drops it.
    #[error("the handler's transaction is still held: it was not committed")]
    TransactionHeld,
    /// The database refused the transaction that carries the handler's
    /// writes: one of the handler's statements failed (which aborts a
    /// PostgreSQL transaction), or the commit broke a constraint. Nothing
    /// committed, and the same request would meet the same refusal.
    #[error("the database refused the transaction: {0}")]
    Refused(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The store is configured in a way that would lose records (e.g. Redis
    /// with a `maxmemory-policy` other than `noeviction`), or was asked for
    /// something it cannot represent.
    #[error("idempotency store misconfigured: {0}")]
    Misconfigured(String),
}
