//! Stores: where claims and completed records live.
//!
//! A store implements the claim protocol — claim, extend, complete, release
//! — as atomic operations. [`Store::claim`] decides everything in one step
//! and, for a completed key, returns the record itself, so that a replay
//! costs one round trip.
//!
//! A granted claim is a value the request holds until it settles it: the
//! store's [`Store::Granted`]. There are two kinds.
//!
//! - **A lease** ([`LeaseToken`]): the claim is a record in the store that
//!   expires unless extended. The request keeps it with heartbeats
//!   ([`Store::extend`]); [`Store::complete`] and [`Store::release`] act
//!   only while its token is still the one stored (fencing), so a request
//!   whose lease expired and was re-claimed by another can never overwrite
//!   or delete the newer claim. `MemoryStore`, the Redis store and the
//!   plain SQL stores work this way.
//! - **A transaction**: the claim is a row written inside a database
//!   transaction the store began, which the handler (or a message's work)
//!   writes its own effects in; [`Store::complete`] writes the record into
//!   the same transaction and commits. Record and effect are then one fact:
//!   a crash before the commit leaves neither, after it both. The
//!   transactional SQL stores work this way, and so can yours: a granted
//!   value that is [lent to the work](Granted::lent_to_work) is handed to
//!   the handler (through the `IdempotentTx` extractor) and to a message's
//!   work.
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
//!     type Granted = LeaseToken;
//!
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
//!     async fn complete(&self, key: &StorageKey, token: &mut LeaseToken, _fp: &Fingerprint, record: Arc<CompletedRecord>, _retention: Duration) -> Result<bool, StoreError> {
//!         let mut map = self.0.lock().unwrap();
//!         match map.get_mut(key) {
//!             Some((_, state @ Err(_))) if *state == Err(*token) => { *state = Ok(record); Ok(true) }
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
//!
//! A transactional store sets `type Granted` to its transaction type (which
//! implements [`Granted`] as held for its life, lent to the work, a failed
//! completion having committed nothing — and rolls back when dropped), begins the transaction and claims the key in it in
//! [`Store::claim`], commits the record with it in [`Store::complete`], and
//! rolls it back in [`Store::release`]; [`Store::extend`] is never called
//! for it. A store whose claims are answered over a network can hand its
//! claim to [`claim_within`], which bounds the wait and releases a claim
//! the server applied too late.

use std::{fmt, future::Future, sync::Arc, time::Duration};

use crate::{
    fingerprint::{Fingerprint, FingerprintHasher, write_hex},
    key::IdempotencyKey,
    record::{CompletedRecord, CorruptRecord},
};

#[cfg(feature = "cache")]
mod cached;
mod claim_within;
#[cfg(feature = "dynamodb")]
#[cfg_attr(docsrs, doc(cfg(feature = "dynamodb")))]
pub mod dynamodb;
mod found;
#[cfg(feature = "memory")]
mod memory;
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub mod redis;
mod sensitive;
#[cfg(sql)]
#[cfg_attr(
    docsrs,
    doc(cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql")))
)]
pub mod sql;
mod stats;

#[cfg(feature = "cache")]
#[cfg_attr(docsrs, doc(cfg(feature = "cache")))]
pub use cached::CachedStore;
pub use claim_within::claim_within;
pub use found::{Found, FoundState};
#[cfg(feature = "memory")]
#[cfg_attr(docsrs, doc(cfg(feature = "memory")))]
pub use memory::MemoryStore;
pub use sensitive::SensitiveKeys;
#[cfg(feature = "mysql")]
#[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
pub use sql::mysql;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use sql::postgres;
#[cfg(feature = "sqlite")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
pub use sql::sqlite;
pub use stats::TableStats;

/// The claim protocol. See the [module docs](self) for the contract, the two
/// kinds of claims and a complete example.
///
/// Stores are cloned into every service the layer creates; clones must share
/// their state (put it behind an `Arc`).
pub trait Store: Clone + Send + Sync + 'static {
    /// A granted claim, held by the request that made it until it is
    /// completed or released: [`LeaseToken`] for a store whose claims are
    /// leases, the open transaction for a store that commits the record with
    /// the handler's writes. Dropped unsettled, it must give the key up (a
    /// transaction rolls back when dropped; the caller releases a lease).
    type Granted: Granted;

    /// Whether this store tells a claim granted over lapsed ones
    /// ([`Claim::TakenOver`]) from a first claim ([`Claim::Acquired`]) —
    /// or its granted claims commit nothing unless they complete (a
    /// transaction), so that no earlier claim can have taken effect. When
    /// it does not (the default: a lapsed claim that vanishes with its
    /// lease leaves nothing to tell by), the handler is told it
    /// [cannot know](crate::Earlier::Unknown).
    const REPORTS_TAKEOVERS: bool = false;

    /// Atomically claims `key` for a request with this fingerprint:
    /// - unknown key: claim it (an in-flight record that expires after
    ///   `lease`, or a row in a new transaction) and return
    ///   [`Claim::Acquired`];
    /// - a different fingerprint: [`Claim::Mismatch`];
    /// - in flight: [`Claim::InFlight`] with the remaining lease (or an
    ///   estimate);
    /// - completed: [`Claim::Completed`] with the record and its remaining TTL.
    fn claim(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> impl Future<Output = Result<Claim<Self::Granted>, StoreError>> + Send;

    /// Claims `key` as [`claim`](Self::claim) does, for a caller that
    /// keeps what it works on while it waits — a queue consumer holds its
    /// delivery — and would rather wait its turn than hear that the store is
    /// busy. A store whose writers take turns in this process (the SQLite
    /// transactional store: one writer at a time) waits in line as long as
    /// it takes instead of timing out; any other store claims as `claim`
    /// does (the default).
    fn claim_patiently(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> impl Future<Output = Result<Claim<Self::Granted>, StoreError>> + Send {
        self.claim(key, fingerprint, lease)
    }

    /// Pushes the expiry of the lease `token` holds to `lease` from now, if
    /// `token` still holds it. Returns whether it did. Called only for
    /// claims that are leases.
    fn extend(
        &self,
        key: &StorageKey,
        token: LeaseToken,
        lease: Duration,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Replaces the claim with the completed record (the answer to requests
    /// with this `fingerprint`), kept for `retention` counted from now, if
    /// `granted` still holds the claim. Returns whether it did.
    ///
    /// For a lease, the layer retries a completion that failed (e.g. timed
    /// out). A store where the failed attempt may still have been applied
    /// must answer `true` when the key already holds this very record, so
    /// that the retry does not report a lost lease. For a transaction, this
    /// writes the record in it and commits: an error means the handler's
    /// writes did not commit either (or their fate is unknown), and it is
    /// never retried.
    fn complete(
        &self,
        key: &StorageKey,
        granted: &mut Self::Granted,
        fingerprint: &Fingerprint,
        record: Arc<CompletedRecord>,
        retention: Duration,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Gives the claim up so the key may be retried: deletes a lease's
    /// in-flight record if its token still holds it, rolls a transaction
    /// back. Returns whether it did.
    fn release(
        &self,
        key: &StorageKey,
        granted: Self::Granted,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Gives the claim up without a record but keeping what the handler
    /// wrote: a transaction deletes its claim's row and commits; any other
    /// claim is [released](Self::release) (the default). For an answer the
    /// handler marked not to be replayed ([`NoReplay`](crate::NoReplay)).
    fn release_keeping_writes(
        &self,
        key: &StorageKey,
        granted: Self::Granted,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send {
        self.release(key, granted)
    }

    /// Whether claims can share one transaction, each in a savepoint of
    /// its own ([`begin_batch`](Self::begin_batch)): a consumer then
    /// settles several deliveries with one commit. The transactional SQL
    /// stores (PostgreSQL, SQLite, MySQL) do; the default is no.
    const BATCHES: bool = false;

    /// Begins a batch: a transaction that holds no claim yet, for
    /// [`claim_in_batch`](Self::claim_in_batch). Dropped, it rolls back.
    /// A store that has no batches answers [`StoreError::Unsupported`]
    /// (the default).
    fn begin_batch(&self) -> impl Future<Output = Result<Self::Granted, StoreError>> + Send {
        async { Err(StoreError::Unsupported("batches")) }
    }

    /// Claims `key` inside `batch` as [`claim`](Self::claim) does, in a
    /// savepoint of its own, so that this key's claim and what the work
    /// writes after it can be undone alone
    /// ([`release_in_batch`](Self::release_in_batch)) or kept
    /// ([`complete_in_batch`](Self::complete_in_batch)). Whatever the
    /// answer, the batch stays usable: a claim that found the key, or
    /// failed, is undone.
    fn claim_in_batch(
        &self,
        batch: &mut Self::Granted,
        key: &StorageKey,
        fingerprint: &Fingerprint,
    ) -> impl Future<Output = Result<Claim<()>, StoreError>> + Send {
        let _ = (batch, key, fingerprint);
        async { Err(StoreError::Unsupported("batches")) }
    }

    /// Writes the completed record of the key [claimed in the
    /// batch](Self::claim_in_batch) last, keeping what its work wrote;
    /// nothing commits before [`commit_batch`](Self::commit_batch). The
    /// write may travel with the batch's next statement: a failure is then
    /// that statement's, and the batch's — nothing in it commits.
    fn complete_in_batch(
        &self,
        batch: &mut Self::Granted,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        record: Arc<CompletedRecord>,
        retention: Duration,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        let _ = (batch, key, fingerprint, record, retention);
        async { Err(StoreError::Unsupported("batches")) }
    }

    /// Undoes the claim of the key claimed in the batch last, and what its
    /// work wrote; the batch's other keys are kept.
    fn release_in_batch(
        &self,
        batch: &mut Self::Granted,
        key: &StorageKey,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        let _ = (batch, key);
        async { Err(StoreError::Unsupported("batches")) }
    }

    /// Commits the batch: every record completed in it, with what its work
    /// wrote, or — on an error — none (or, if the commit's outcome is
    /// unknown, all or none).
    ///
    /// # Examples
    ///
    /// ```
    /// # async fn demo() {
    /// use tower_idempotency::{Fingerprint, IdempotencyKey, MemoryStore, store::{StorageKey, Store}};
    ///
    /// // The memory store has no batches: its claims are leases.
    /// assert!(!MemoryStore::BATCHES);
    /// assert!(MemoryStore::new().begin_batch().await.is_err());
    /// # }
    /// ```
    fn commit_batch(
        &self,
        batch: Self::Granted,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        let _ = batch;
        async { Err(StoreError::Unsupported("batches")) }
    }

    /// What the store holds for `key`, for an operator answering "what
    /// happened to this request?": nothing, a claim in flight, or a
    /// completed record (its status, when it expires, the stored body).
    /// Build the key with [`StorageKey::new`] from the raw scope (the
    /// account) and the idempotency key: it is hashed as the layer hashes
    /// it.
    ///
    /// A store that cannot look a key up answers
    /// [`StoreError::Unsupported`] (the default).
    ///
    /// # Examples
    ///
    /// ```
    /// # async fn demo() -> Result<(), tower_idempotency::store::StoreError> {
    /// use tower_idempotency::{IdempotencyKey, MemoryStore, store::{KeyState, StorageKey, Store}};
    ///
    /// let store = MemoryStore::new();
    /// let key = StorageKey::new("acct_alice", &IdempotencyKey::new("order-42").unwrap());
    /// assert!(matches!(store.inspect(&key).await?, KeyState::Absent));
    /// # Ok(()) }
    /// ```
    fn inspect(
        &self,
        key: &StorageKey,
    ) -> impl Future<Output = Result<KeyState, StoreError>> + Send {
        let _ = key;
        async { Err(StoreError::Unsupported("inspect")) }
    }

    /// Forgets `key`, so the next request with it executes again: a
    /// completed record is deleted. A claim in flight is left alone
    /// ([`Forgotten::InFlight`]) unless `force`: then it is deleted too, and
    /// the running handler's completion is fenced off — its response is sent
    /// but not stored, and its lease is lost — while a retry meanwhile
    /// executes again. That is what forcing means: the work may run twice.
    /// A transactional store's claim in flight is the handler's open
    /// transaction: it cannot be forced ([`StoreError::Unsupported`]), only
    /// waited for.
    ///
    /// A store that cannot forget answers [`StoreError::Unsupported`] (the
    /// default).
    ///
    /// # Examples
    ///
    /// ```
    /// # async fn demo() -> Result<(), tower_idempotency::store::StoreError> {
    /// use tower_idempotency::{IdempotencyKey, MemoryStore, store::{Forgotten, StorageKey, Store}};
    ///
    /// let store = MemoryStore::new();
    /// let key = StorageKey::new("acct_alice", &IdempotencyKey::new("order-42").unwrap());
    /// assert_eq!(store.forget(&key, false).await?, Forgotten::Nothing);
    /// # Ok(()) }
    /// ```
    fn forget(
        &self,
        key: &StorageKey,
        force: bool,
    ) -> impl Future<Output = Result<Forgotten, StoreError>> + Send {
        let _ = (key, force);
        async { Err(StoreError::Unsupported("forget")) }
    }
}

/// What a store holds for one key: see [`Store::inspect`].
#[derive(Clone, Debug)]
pub enum KeyState {
    /// Nothing: the next request with the key executes.
    Absent,
    /// A claim is in flight: a request with the key is running.
    InFlight {
        /// How long its lease has left, at most (an estimate, for a claim
        /// that lives as long as a transaction).
        retry_after: Duration,
    },
    /// A completed record, replayed to every retry until it expires.
    Completed {
        /// The record: the stored response (status, headers, body), or a
        /// processed message's result.
        record: Arc<CompletedRecord>,
        /// How long the store keeps it.
        expires_in: Duration,
    },
}

/// What [`Store::forget`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Forgotten {
    /// The store held nothing for the key.
    Nothing,
    /// A completed record was deleted: the next request executes.
    Completed,
    /// A claim is in flight and was left alone (forget it with `force`).
    InFlight,
    /// A claim in flight was deleted (`force`): its handler's completion is
    /// fenced off.
    ForcedInFlight,
}

/// A granted claim, as a store hands it out: see [`Store::Granted`].
///
/// It states three facts of the claim, each of which decides one thing the
/// layer does with it: how it is [held](Self::held) (whether a heartbeat
/// runs), whether the work is [lent](Self::lent_to_work) it (to write its
/// effects in), and what a [completion that fails](Self::failed_completion)
/// means.
///
/// # Examples
///
/// A lease: the heartbeat extends it, the work never sees it, and a failed
/// completion is retried while the lease holds.
///
/// ```
/// use tower_idempotency::store::{FailedCompletion, Granted, Held, LeaseToken};
///
/// let token = LeaseToken::generate();
/// assert_eq!(token.held(), Held::Lease(token));
/// assert!(!token.lent_to_work());
/// assert_eq!(token.failed_completion(), FailedCompletion::RetryWhileLeased);
/// ```
///
/// A transaction a store began: held for its life, lent to the work, and a
/// failed completion (a refused commit) committed nothing.
///
/// ```
/// use tower_idempotency::store::{FailedCompletion, Granted, Held};
///
/// struct MyTx;
///
/// impl Granted for MyTx {
///     fn held(&self) -> Held {
///         Held::ForItsLife
///     }
///     fn lent_to_work(&self) -> bool {
///         true
///     }
///     fn failed_completion(&self) -> FailedCompletion {
///         FailedCompletion::NothingCommitted
///     }
/// }
/// # assert!(MyTx.lent_to_work());
/// ```
pub trait Granted: Send + Sync + 'static {
    /// How the claim is held while the work runs: a lease the layer's
    /// heartbeat extends with its fencing token, or for the claim's own
    /// life (a transaction the store began, a claim with a fixed bound),
    /// which nothing extends.
    fn held(&self) -> Held;

    /// Whether the work receives the claim, to write its effects with it:
    /// the handler through the `IdempotentTx` extractor, a message's work
    /// as its argument. `true` for a transaction the record commits in.
    fn lent_to_work(&self) -> bool;

    /// What a completion that failed, or found the claim gone, means.
    fn failed_completion(&self) -> FailedCompletion;
}

/// How a granted claim is held: see [`Granted::held`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Held {
    /// A lease with this fencing token: the layer extends it every third
    /// of its duration while the work runs ([`Store::extend`]).
    Lease(LeaseToken),
    /// For the claim's own life: nothing extends it.
    ForItsLife,
}

/// What a completion that failed means: see [`Granted::failed_completion`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailedCompletion {
    /// The work's effects stand and its outcome went out, but the record
    /// may still be stored: the completion is retried in the background
    /// while the heartbeat holds the lease (for a claim held as a
    /// [`Held::Lease`]; for any other, the same as `NothingCommitted`
    /// but logged as a lost completion). A claim found gone is logged as a
    /// completion lost.
    RetryWhileLeased,
    /// Nothing committed — neither the work's effects nor the record — so
    /// the request answers that it did not take effect, and a retry
    /// executes anew.
    NothingCommitted,
}

impl Granted for LeaseToken {
    fn held(&self) -> Held {
        Held::Lease(*self)
    }

    fn lent_to_work(&self) -> bool {
        false
    }

    fn failed_completion(&self) -> FailedCompletion {
        FailedCompletion::RetryWhileLeased
    }
}

/// What [`Store::claim`] found.
#[derive(Clone, Debug)]
pub enum Claim<G = LeaseToken> {
    /// The key was free and is now claimed: the granted claim.
    Acquired(G),
    /// The key was held by claims that lapsed before they completed, and
    /// is now claimed over them: the granted claim, and what lapsed —
    /// which may have taken effect. A store that
    /// [reports takeovers](Store::REPORTS_TAKEOVERS) answers this, never
    /// [`Acquired`](Self::Acquired), for a claim taken over.
    TakenOver {
        /// The granted claim.
        granted: G,
        /// What lapsed.
        lapsed: Lapsed,
    },
    /// Another request with the same fingerprint holds the key.
    InFlight {
        /// How long until its lease runs out (an estimate, for a claim that
        /// lives as long as a transaction).
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

impl<G> Claim<G> {
    /// The same answer, its granted claim made into another: for a store
    /// built on another's claims (a transactional store over a lease's
    /// item), which wraps what it grants.
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::store::{Claim, LeaseToken};
    ///
    /// let claim: Claim<LeaseToken> = Claim::Acquired(LeaseToken::generate());
    /// let wrapped = claim.map(|token| (token, "the transaction"));
    /// assert!(matches!(wrapped, Claim::Acquired((_, "the transaction"))));
    /// ```
    pub fn map<H>(self, grant: impl FnOnce(G) -> H) -> Claim<H> {
        match self {
            Self::Acquired(granted) => Claim::Acquired(grant(granted)),
            Self::TakenOver { granted, lapsed } => Claim::TakenOver {
                granted: grant(granted),
                lapsed,
            },
            Self::InFlight { retry_after } => Claim::InFlight { retry_after },
            Self::Mismatch => Claim::Mismatch,
            Self::Completed { record, expires_in } => Claim::Completed { record, expires_in },
        }
    }
}

/// The earlier attempts a [`Claim::TakenOver`] was granted over: claims of
/// the key that lapsed, one after another, without completing.
///
/// # Examples
///
/// ```
/// use std::time::SystemTime;
/// use tower_idempotency::{Earlier, store::Lapsed};
///
/// let lapsed = Lapsed { attempts: 1, since: SystemTime::now() };
/// assert!(matches!(Earlier::from(lapsed), Earlier::TakenOver { attempts: 1, .. }));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lapsed {
    /// How many claims of the key began and lapsed, this one excluded.
    pub attempts: u32,
    /// When the first of them began.
    pub since: std::time::SystemTime,
}

/// The longest TTL a store keeps: far beyond any retention or lease the
/// doors accept ([`MAX_RETENTION`](crate::MAX_RETENTION),
/// [`MAX_LEASE`](crate::MAX_LEASE)), far below what every store can
/// represent. The one bound inside the stores, for callers that use a store
/// directly.
#[cfg(any(outside_store, feature = "memory"))]
pub(crate) const MAX_TTL: Duration = Duration::from_secs(100 * 365 * 24 * 60 * 60);

/// `ttl` in whole milliseconds, at least 1; a TTL over [`MAX_TTL`] is a
/// configuration error (naming `what`), not a command that fails each time.
#[cfg(outside_store)]
pub(crate) fn ttl_millis(ttl: Duration, what: &str) -> Result<u64, StoreError> {
    if ttl > MAX_TTL {
        return Err(StoreError::Misconfigured(format!(
            "a {what} of {ttl:?} is longer than a store keeps a record (100 years)"
        )));
    }
    Ok((ttl.as_millis() as u64).max(1))
}

/// The address of a record: an unambiguous encoding of *(scope, key)*.
///
/// The scope never appears raw: it is replaced by its SHA-256, so a scope
/// derived from a credential cannot leak into store key names or logs (which
/// show this key). The hash has a fixed length, so scope `a:b` with key `c`
/// and scope `a` with key `b:c` never collide.
///
/// A key made [`sensitive`](Self::sensitive) keeps the idempotency key out
/// of logs and spans too: it is shown there only as a digest
/// ([`SensitiveKeys`]).
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
#[derive(Clone)]
pub struct StorageKey {
    encoded: Arc<str>,
    /// Shown as this digest in logs and spans.
    sensitive: Option<SensitiveKeys>,
}

impl StorageKey {
    /// Encodes a scope and a key as `{hex SHA-256 of the scope}:{key}`.
    pub fn new(scope: &str, key: &IdempotencyKey) -> Self {
        let mut hasher = FingerprintHasher::new("tower-idempotency/scope/v1");
        hasher.field(scope.as_bytes());
        Self::encode(hasher, key)
    }

    /// Encodes a scope within a namespace, and a key: a layer's
    /// [`namespace`](crate::IdempotencyLayer::namespace), which keeps the
    /// records of one kind of scope (a webhook provider's, say) apart from
    /// another's (the accounts'), whatever the scopes are called. The
    /// namespace and the scope are hashed together, in a domain of their
    /// own: no scope in one namespace — nor any without one — shares an
    /// address with a scope in another.
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::{IdempotencyKey, store::StorageKey};
    ///
    /// let key = IdempotencyKey::new("evt_1").unwrap();
    /// // An account that calls itself after the webhooks' scope is another record.
    /// assert_ne!(
    ///     StorageKey::namespaced("webhooks", "processor", &key),
    ///     StorageKey::new("webhooks:processor", &key),
    /// );
    /// assert_ne!(
    ///     StorageKey::namespaced("webhooks", "", &key),
    ///     StorageKey::new("", &key),
    /// );
    /// ```
    pub fn namespaced(namespace: &str, scope: &str, key: &IdempotencyKey) -> Self {
        let mut hasher = FingerprintHasher::new("tower-idempotency/namespaced-scope/v1");
        hasher.field(namespace.as_bytes());
        hasher.field(scope.as_bytes());
        Self::encode(hasher, key)
    }

    /// `{hex of the scope's hash}:{key}`.
    fn encode(hasher: FingerprintHasher, key: &IdempotencyKey) -> Self {
        // Assembled on the stack, so the key costs one allocation: its `Arc`.
        let mut encoded = [0; 64 + 1 + IdempotencyKey::MAX_LEN];
        let (hex, rest) = encoded.split_at_mut(64);
        write_hex(hex, hasher.finish().as_bytes());
        rest[0] = b':';
        let key = key.as_str().as_bytes();
        rest[1..=key.len()].copy_from_slice(key);
        let encoded = &encoded[..64 + 1 + key.len()];
        Self {
            encoded: std::str::from_utf8(encoded)
                .expect("hex and an ASCII key")
                .into(),
            sensitive: None,
        }
    }

    /// The encoded key.
    pub fn as_str(&self) -> &str {
        &self.encoded
    }

    /// This key, shown in logs and spans (its `Display` and `Debug`) only
    /// as its digest by `how` — `hmac:` (keyed) or `sha256:` and 16 hex
    /// digits, the same on every line about it, and what
    /// [`logged_as`](Self::logged_as) says — for keys that may carry
    /// customer data. Stores address it as before.
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::{IdempotencyKey, SensitiveKeys, store::StorageKey};
    ///
    /// let keys = SensitiveKeys::keyed(b"a secret of at least 16 bytes");
    /// let key = StorageKey::new("acct_1", &IdempotencyKey::new("jane@example.com").unwrap()).sensitive(&keys);
    /// let shown = key.to_string();
    /// assert!(shown.starts_with("hmac:") && !shown.contains("jane"));
    /// assert!(key.as_str().ends_with(":jane@example.com"));
    /// ```
    pub fn sensitive(mut self, how: &SensitiveKeys) -> Self {
        self.sensitive = Some(how.clone());
        self
    }

    /// Whether logs and spans show this key only as a digest.
    pub fn is_sensitive(&self) -> bool {
        self.sensitive.is_some()
    }

    /// How this key is shown in logs and spans as a sensitive key: by its
    /// own [`SensitiveKeys`] if it is sensitive, else unkeyed (`sha256:`;
    /// [`SensitiveKeys::show`] gives the keyed form).
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::{IdempotencyKey, SensitiveKeys, store::StorageKey};
    ///
    /// let key = StorageKey::new("acct_1", &IdempotencyKey::new("order-42").unwrap());
    /// let keys = SensitiveKeys::unkeyed();
    /// assert_eq!(key.logged_as(), key.clone().sensitive(&keys).to_string());
    /// ```
    pub fn logged_as(&self) -> String {
        match &self.sensitive {
            Some(how) => how.show(self),
            None => SensitiveKeys::unkeyed().show(self),
        }
    }
}

// Two addresses are one record's whatever their display.
impl PartialEq for StorageKey {
    fn eq(&self, other: &Self) -> bool {
        self.encoded == other.encoded
    }
}

impl Eq for StorageKey {}

impl std::hash::Hash for StorageKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.encoded.hash(state);
    }
}

impl fmt::Debug for StorageKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(how) = &self.sensitive {
            return f.write_str(&how.show(self));
        }
        fmt::Debug::fmt(&*self.encoded, f)
    }
}

impl fmt::Display for StorageKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(how) = &self.sensitive {
            return f.write_str(&how.show(self));
        }
        f.write_str(&self.encoded)
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
    /// The handler's writes are more than the store takes in one
    /// transaction (DynamoDB: 400 KB an item, 100 items a transaction):
    /// nothing committed, and the same request meets the same refusal — an
    /// answer for the client (`413`), never a server error it would retry.
    #[error("the handler's writes are too large for the store: {0}")]
    TooLarge(String),
    /// The transaction that carries the handler's writes outlived the
    /// bound the database enforces on it (a transactional SQL store's
    /// `transaction_timeout`), and the database ended it: nothing
    /// committed. Work that always takes this long never commits: raise the
    /// bound above it, or move the slow part out of the transaction.
    #[error(
        "the transaction outlived its bound of {bound:?} (transaction_timeout) and the database ended it; nothing committed: {source}"
    )]
    TransactionTimedOut {
        /// The bound it outlived.
        bound: Duration,
        /// What the database answered.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The store is configured in a way that would lose records (e.g. Redis
    /// with a `maxmemory-policy` other than `noeviction`), or was asked for
    /// something it cannot represent.
    #[error("idempotency store misconfigured: {0}")]
    Misconfigured(String),
    /// The store does not support this operation: a custom store that did
    /// not implement [`Store::inspect`] or [`Store::forget`], or forcing a
    /// transactional store's claim in flight (it is the handler's open
    /// transaction: it ends when the handler does, or at the transaction
    /// timeout).
    #[error("the idempotency store does not support {0}")]
    Unsupported(&'static str),
}

impl StoreError {
    /// Whether the failure can pass with time: the store out of reach or
    /// failing ([`Unavailable`](Self::Unavailable): a restart, a failover, a
    /// busy database) or slow ([`Timeout`](Self::Timeout)). A process that
    /// meets one while it starts should connect again with back-off, for a
    /// bound; every other failure says what to fix — a
    /// [`Misconfigured`](Self::Misconfigured) store, a read-only database,
    /// a missing table or a refused user never come right by waiting.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::store::StoreError;
    ///
    /// assert!(StoreError::Timeout(Duration::from_secs(1)).is_transient());
    /// assert!(!StoreError::Misconfigured("maxmemory-policy is allkeys-lru".into()).is_transient());
    /// ```
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Timeout(_) => true,
            #[cfg(sql)]
            Self::Unavailable(why) => !why.is::<sql::UntilFixed>(),
            #[cfg(not(sql))]
            Self::Unavailable(_) => true,
            _ => false,
        }
    }
}

/// `work`, or [`StoreError::Timeout`] once `timeout` has passed: the bound
/// every networked store (and the outbox) puts on one call.
#[cfg(any(
    feature = "redis",
    feature = "postgres",
    feature = "mysql",
    feature = "sqlite",
    feature = "dynamodb"
))]
pub(crate) async fn bounded<T>(
    timeout: Duration,
    work: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    tokio::time::timeout(timeout, work)
        .await
        .unwrap_or(Err(StoreError::Timeout(timeout)))
}
