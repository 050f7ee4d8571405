//! An in-process cache of completed records in front of any store.

use std::{sync::Arc, time::Duration};

use quick_cache::{Weighter, sync::Cache};
use tokio::time::Instant;

use super::{Claim, Forgotten, KeyState, LeaseToken, StorageKey, Store, StoreError};
use crate::{fingerprint::Fingerprint, observe, record::CompletedRecord};

/// Serves replays from memory: a bounded cache of completed records in front
/// of another store (typically the Redis store, feature `redis`).
///
/// A completed record never changes until it expires, so once this process
/// has completed a key, or a claim has returned its record, later replays of
/// that key in this process are answered without a round trip. The cache is safe because it keeps exactly what the
/// store decided:
///
/// - entries are addressed by the [`StorageKey`], which encodes the scope, so
///   one tenant never gets another's record;
/// - each entry keeps the record's fingerprint: a retry with different
///   parameters is still a mismatch (`422`), never a replay;
/// - each entry expires no later than the store's copy: its remaining TTL,
///   counted from before the claim was sent, or the retention counted from
///   before the completion was sent (every store counts a record's retention
///   from its completion or later);
/// - in-flight claims are never cached; every claim, extension, completion and
///   release still goes to the store.
///
/// **Clocks.** Where the store reports a record's remaining TTL from a
/// stored wall-clock expiry (the Redis store writes one, by the clock of the
/// instance that completed the record), the cache trusts the clocks of your
/// instances to agree within 5 s: it keeps each record 5 s less than that
/// expiry says. Keep application hosts NTP-synchronised; a clock that runs
/// more than 5 s behind the one that wrote a record can make this process
/// replay it from the cache after Redis has dropped it.
///
/// **In front of a SQL store.** On a transactional SQL store too, a
/// replay this process has seen before is answered from memory: no round
/// trip, no transaction — about the speed of the handler alone. The first
/// replay of a key on each instance still goes to the database (and fills
/// that instance's cache), and so does every retry that lands on another
/// instance: the cache pays where retries come back to the instance that
/// answered (one instance, sticky clients) or where one key is replayed
/// many times (a webhook sender that redelivers, a client in a retry loop).
/// A key forgotten in the store is still replayed by each instance that
/// cached it, until its entry expires: forget through each instance (the
/// cache's [`forget`](Store::forget) evicts its entry).
///
/// Memory is bounded by `max_bytes`, counting each record's body and headers;
/// the least valuable entries are evicted first (CLOCK-Pro, from
/// [`quick_cache`]).
///
/// # Examples
///
/// ```no_run
/// # async fn demo() -> Result<(), tower_idempotency::store::StoreError> {
/// use tower_idempotency::{CachedStore, IdempotencyLayer, RedisStore};
///
/// let redis = RedisStore::builder().connect("redis://127.0.0.1:6379").await?;
/// let layer = IdempotencyLayer::new(CachedStore::new(redis, 64 * 1024 * 1024));
/// # let _ = layer; Ok(()) }
/// ```
#[derive(Clone)]
pub struct CachedStore<St> {
    inner: St,
    cache: Arc<Cache<StorageKey, Entry, RecordWeight>>,
}

#[derive(Clone)]
struct Entry {
    fingerprint: Fingerprint,
    record: Arc<CompletedRecord>,
    expires_at: Instant,
}

#[derive(Clone)]
struct RecordWeight;

impl Weighter<StorageKey, Entry> for RecordWeight {
    fn weight(&self, key: &StorageKey, entry: &Entry) -> u64 {
        let record = match &*entry.record {
            CompletedRecord::Response(r) => {
                r.body().len()
                    + r.headers()
                        .iter()
                        .map(|(n, v)| n.as_str().len() + v.len() + 32)
                        .sum::<usize>()
            }
            CompletedRecord::Message { result, .. } => result.as_ref().map_or(0, |r| r.len()),
            CompletedRecord::Unreplayable { .. } => 0,
        };
        // Plus the key and the bookkeeping of an entry.
        (record + key.as_str().len() + 128) as u64
    }
}

impl<St> CachedStore<St> {
    /// Caches up to `max_bytes` of completed records in front of `inner`.
    /// In front of Redis, the instances' clocks must agree within 5 s (see
    /// the type's docs).
    pub fn new(inner: St, max_bytes: u64) -> Self {
        // quick_cache sizes its tables from an item estimate; assume ~1 KiB records.
        let estimated_items = (max_bytes / 1024).clamp(16, 1 << 20) as usize;
        Self {
            inner,
            cache: Arc::new(Cache::with_weighter(
                estimated_items,
                max_bytes,
                RecordWeight,
            )),
        }
    }

    /// The store behind the cache.
    pub fn inner(&self) -> &St {
        &self.inner
    }

    /// The number of cached records (expired ones included until evicted).
    pub fn len(&self) -> usize {
        self.cache.len()
    }

    /// `true` when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.cache.is_empty()
    }
}

impl<St: std::fmt::Debug> std::fmt::Debug for CachedStore<St> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CachedStore")
            .field("inner", &self.inner)
            .field("cached", &self.cache.len())
            .field("weight", &self.cache.weight())
            .finish()
    }
}

impl<St> CachedStore<St> {
    /// Caches a completed record until `ttl` after `sent`, the moment the
    /// store was asked: never later than the store's own expiry.
    fn remember(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        record: Arc<CompletedRecord>,
        sent: Instant,
        ttl: Duration,
    ) {
        if let Some(expires_at) = sent.checked_add(ttl) {
            let entry = Entry {
                fingerprint: *fingerprint,
                record,
                expires_at,
            };
            self.cache.insert(key.clone(), entry);
        }
    }
}

impl<St: Store> CachedStore<St> {
    /// A completed record from the cache, or else what the inner store's
    /// `claim` answers (remembered when it is a completed record). The
    /// inner claim is made, and boxed, only on a miss: a store's claim
    /// future can be large (a SQL transaction's), and a hit should not
    /// carry it — every move of the request's future copies it.
    async fn cached_or<F>(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        claim: impl FnOnce() -> F,
    ) -> Result<Claim<St::Granted>, StoreError>
    where
        F: Future<Output = Result<Claim<St::Granted>, StoreError>>,
    {
        let now = Instant::now();
        if let Some(entry) = self.cache.get(key) {
            if entry.expires_at > now {
                observe::cache_lookup("hit");
                return Ok(if entry.fingerprint == *fingerprint {
                    Claim::Completed {
                        record: entry.record,
                        expires_in: entry.expires_at - now,
                    }
                } else {
                    Claim::Mismatch
                });
            }
            self.cache.remove(key);
        }
        observe::cache_lookup("miss");
        let claim = Box::pin(claim()).await?;
        if let Claim::Completed { record, expires_in } = &claim {
            self.remember(key, fingerprint, record.clone(), now, *expires_in);
        }
        Ok(claim)
    }
}

impl<St: Store> Store for CachedStore<St> {
    // A transactional store's transaction is handed on as it is.
    type Granted = St::Granted;
    const REPORTS_TAKEOVERS: bool = St::REPORTS_TAKEOVERS;

    async fn claim(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<Claim<St::Granted>, StoreError> {
        self.cached_or(key, fingerprint, || {
            self.inner.claim(key, fingerprint, lease)
        })
        .await
    }

    async fn claim_patiently(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<Claim<St::Granted>, StoreError> {
        self.cached_or(key, fingerprint, || {
            self.inner.claim_patiently(key, fingerprint, lease)
        })
        .await
    }

    async fn extend(
        &self,
        key: &StorageKey,
        token: LeaseToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        self.inner.extend(key, token, lease).await
    }

    async fn complete(
        &self,
        key: &StorageKey,
        granted: &mut St::Granted,
        fingerprint: &Fingerprint,
        record: Arc<CompletedRecord>,
        retention: Duration,
    ) -> Result<bool, StoreError> {
        let now = Instant::now();
        let stored = self
            .inner
            .complete(key, granted, fingerprint, record.clone(), retention)
            .await?;
        if stored {
            self.remember(key, fingerprint, record, now, retention);
        }
        Ok(stored)
    }

    async fn release(&self, key: &StorageKey, granted: St::Granted) -> Result<bool, StoreError> {
        self.inner.release(key, granted).await
    }

    async fn release_keeping_writes(
        &self,
        key: &StorageKey,
        granted: St::Granted,
    ) -> Result<bool, StoreError> {
        self.inner.release_keeping_writes(key, granted).await
    }

    /// Asks the store, not the cache.
    async fn inspect(&self, key: &StorageKey) -> Result<KeyState, StoreError> {
        self.inner.inspect(key).await
    }

    /// Forgets the key in the store and in this process's cache. Other
    /// processes' caches keep their copy until it expires: forget on every
    /// instance, or run them without a cache where records are forgotten.
    async fn forget(&self, key: &StorageKey, force: bool) -> Result<Forgotten, StoreError> {
        let forgotten = self.inner.forget(key, force).await?;
        self.cache.remove(key);
        Ok(forgotten)
    }
}
