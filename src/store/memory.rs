//! The in-process store.

use std::{
    collections::HashMap,
    hash::{BuildHasher, RandomState},
    sync::{Arc, Mutex, MutexGuard},
    time::{Duration, SystemTime},
};

use tokio::time::Instant;

use super::{
    Claim, Forgotten, Found, FoundState, KeyState, Lapsed, LeaseToken, MAX_TTL, StorageKey, Store,
    StoreError,
};
use crate::{fingerprint::Fingerprint, lock::lock, record::CompletedRecord};

/// Enough shards that cores rarely wait for each other's lock, and that the
/// two whole-shard operations done under its lock — growing its table (a
/// copy) and dropping its expired entries (a scan) — stay short pauses: at
/// a million live records a shard holds about a thousand, a few
/// microseconds of work, where 64 shards made them tens of thousands and
/// the slowest requests waited on them.
const SHARDS: usize = 1024;

/// Deadlines further out than [`MAX_TTL`] are kept at that distance: the
/// store lives no longer than its process, and `Instant` cannot represent
/// every `Duration`.
fn deadline(now: Instant, after: Duration) -> Instant {
    now + after.min(MAX_TTL)
}

/// An in-process [`Store`]: the default, so examples and tests run with
/// nothing installed.
///
/// Claims are decided under a short-lived mutex (one of 1024 shards, picked by
/// key), so concurrent requests on one key are serialised exactly. Records
/// expire at their TTL without a sweeper thread: an expired record counts as
/// absent the moment its deadline passes, and a shard drops all its expired
/// records whenever it has doubled in size since its last clean-up, which keeps
/// the cost amortised O(1) per insert.
///
/// **Memory** is bounded by what is live: one entry per *(scope, key)* claimed
/// within the retention period, each holding at most the storable response
/// limit (1 MiB by default) plus headers. There is no cap on the number of
/// keys; if clients can mint unlimited keys, size the retention accordingly or
/// use the Redis store (whose `maxmemory` with `noeviction` turns a full store
/// into `503`s rather than lost records).
///
/// State lives in this process only: it is lost on restart and not shared
/// between replicas of a service. For a service with more than one
/// instance, or records that must survive a restart, use a transactional
/// SQL store (the record commits with the handler's writes) or Redis.
///
/// Cloning is cheap and clones share the same records.
///
/// # Examples
///
/// ```
/// use axum::{Router, routing::post};
/// use tower_idempotency::{IdempotencyLayer, MemoryStore};
///
/// let app: Router = Router::new()
///     .route("/v1/charges", post(|| async { "charged" }))
///     .layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant());
/// ```
#[derive(Clone, Default)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

struct Inner {
    hasher: RandomState,
    shards: [Mutex<Shard>; SHARDS],
}

impl Default for Inner {
    fn default() -> Self {
        Self {
            hasher: RandomState::new(),
            shards: std::array::from_fn(|_| Mutex::default()),
        }
    }
}

#[derive(Default)]
struct Shard {
    entries: HashMap<StorageKey, Entry>,
    /// Purge expired entries when `entries` reaches this length.
    purge_at: usize,
}

struct Entry {
    fingerprint: Fingerprint,
    expires_at: Instant,
    state: State,
}

enum State {
    InFlight {
        token: LeaseToken,
        /// The claims of this key that lapsed before this one, and when
        /// the first of them began (this one, if none did): what a
        /// takeover of it counts on from.
        lapsed: Lapsed,
    },
    Completed(Arc<CompletedRecord>),
}

/// How long a lapsed claim is kept past its lease, so that a later claim
/// of its key is told it takes over (as DynamoDB's items are kept past
/// their expiry).
const LAPSED_KEPT: Duration = Duration::from_secs(60 * 60);

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// The number of live (unexpired) records, in flight or completed.
    pub fn len(&self) -> usize {
        let now = Instant::now();
        self.inner
            .shards
            .iter()
            .map(|s| {
                lock(s)
                    .entries
                    .values()
                    .filter(|e| e.expires_at > now)
                    .count()
            })
            .sum()
    }

    /// `true` when no record is live.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn shard(&self, key: &StorageKey) -> MutexGuard<'_, Shard> {
        let index = self.inner.hasher.hash_one(key) as usize % SHARDS;
        lock(&self.inner.shards[index])
    }

    /// Runs `f` on the in-flight entry held by `token`, if any.
    fn with_own_claim(
        &self,
        key: &StorageKey,
        token: LeaseToken,
        f: impl FnOnce(&mut Shard),
    ) -> bool {
        let mut shard = self.shard(key);
        let now = Instant::now();
        let owned = matches!(
            shard.entries.get(key),
            Some(Entry { state: State::InFlight { token: t, .. }, expires_at, .. }) if *t == token && *expires_at > now
        );
        if owned {
            f(&mut shard);
        }
        owned
    }
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore").finish_non_exhaustive()
    }
}

impl Shard {
    fn insert(&mut self, key: StorageKey, entry: Entry, now: Instant) {
        if self.entries.len() >= self.purge_at {
            self.entries.retain(|_, e| match e.state {
                State::InFlight { .. } => e.expires_at + LAPSED_KEPT > now,
                State::Completed(_) => e.expires_at > now,
            });
            self.purge_at = (self.entries.len() * 2).max(64);
        }
        self.entries.insert(key, entry);
    }
}

impl Store for MemoryStore {
    type Granted = LeaseToken;
    const REPORTS_TAKEOVERS: bool = true;

    async fn claim(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<Claim, StoreError> {
        let now = Instant::now();
        let mut shard = self.shard(key);
        let found = shard.entries.get(key);
        if let Some(entry) = found.filter(|e| e.expires_at > now) {
            let left = entry.expires_at - now;
            return Found {
                fingerprint: Ok(entry.fingerprint),
                state: match &entry.state {
                    State::InFlight { .. } => FoundState::InFlight {
                        retry_after: left,
                        ours: None,
                    },
                    State::Completed(record) => FoundState::Completed {
                        record: Ok(record.clone()),
                        expires_in: left,
                    },
                },
            }
            .decide(fingerprint);
        }
        // A lapsed claim is taken over: what it carried is reported, and
        // carried on.
        let lapsed = match found.map(|e| &e.state) {
            Some(State::InFlight { lapsed, .. }) => Some(Lapsed {
                attempts: lapsed.attempts + 1,
                since: lapsed.since,
            }),
            _ => None,
        };
        let token = LeaseToken::generate();
        let entry = Entry {
            fingerprint: *fingerprint,
            expires_at: deadline(now, lease),
            state: State::InFlight {
                token,
                lapsed: lapsed.unwrap_or_else(|| Lapsed {
                    attempts: 0,
                    since: SystemTime::now(),
                }),
            },
        };
        shard.insert(key.clone(), entry, now);
        Ok(match lapsed {
            Some(lapsed) => Claim::TakenOver {
                granted: token,
                lapsed,
            },
            None => Claim::Acquired(token),
        })
    }

    async fn extend(
        &self,
        key: &StorageKey,
        token: LeaseToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        Ok(self.with_own_claim(key, token, |shard| {
            if let Some(e) = shard.entries.get_mut(key) {
                e.expires_at = deadline(Instant::now(), lease);
            }
        }))
    }

    async fn complete(
        &self,
        key: &StorageKey,
        token: &mut LeaseToken,
        _fingerprint: &Fingerprint,
        record: Arc<CompletedRecord>,
        retention: Duration,
    ) -> Result<bool, StoreError> {
        let stored = self.with_own_claim(key, *token, |shard| {
            if let Some(e) = shard.entries.get_mut(key) {
                e.expires_at = deadline(Instant::now(), retention);
                e.state = State::Completed(record.clone());
            }
        });
        // A completion repeated after it was applied is stored, not refused.
        Ok(stored
            || matches!(
                self.shard(key).entries.get(key),
                Some(Entry { state: State::Completed(done), .. }) if Arc::ptr_eq(done, &record)
            ))
    }

    async fn release(&self, key: &StorageKey, token: LeaseToken) -> Result<bool, StoreError> {
        Ok(self.with_own_claim(key, token, |shard| {
            shard.entries.remove(key);
        }))
    }

    async fn inspect(&self, key: &StorageKey) -> Result<KeyState, StoreError> {
        let now = Instant::now();
        let shard = self.shard(key);
        Ok(
            match shard.entries.get(key).filter(|e| e.expires_at > now) {
                None => KeyState::Absent,
                Some(entry) => match &entry.state {
                    State::InFlight { .. } => KeyState::InFlight {
                        retry_after: entry.expires_at - now,
                    },
                    State::Completed(record) => KeyState::Completed {
                        record: record.clone(),
                        expires_in: entry.expires_at - now,
                    },
                },
            },
        )
    }

    async fn forget(&self, key: &StorageKey, force: bool) -> Result<Forgotten, StoreError> {
        let now = Instant::now();
        let mut shard = self.shard(key);
        let forgotten = match shard.entries.get(key).filter(|e| e.expires_at > now) {
            None => return Ok(Forgotten::Nothing),
            Some(Entry {
                state: State::Completed(_),
                ..
            }) => Forgotten::Completed,
            Some(_) if force => Forgotten::ForcedInFlight,
            Some(_) => return Ok(Forgotten::InFlight),
        };
        // The holder's completion and release check its token: gone, they
        // are refused.
        shard.entries.remove(key);
        Ok(forgotten)
    }
}
