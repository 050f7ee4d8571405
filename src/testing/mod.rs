//! The store contract as a suite a custom store runs from its own tests
//! (feature `testing`): claims exclude each other, a lost lease fences its
//! holder off, heartbeats keep a claim, a completion replays and expires
//! after its retention counted from the completion — and not sooner than
//! asked — a release frees the key, the same key under two scopes is two
//! keys, keys compare byte for byte, inspect and forget tell the truth,
//! concurrent claims grant the key once, an unreadable record is an error
//! under any fingerprint (given [`StoreContract::corrupting`]), a claim
//! over lapsed ones is a takeover that counts them (for a store that
//! [reports takeovers](crate::store::Store::REPORTS_TAKEOVERS)); and,
//! model-based, random
//! sequences of claims, extensions, completions, releases, forgets,
//! inspects and waits keep to a reference model of each key's states
//! (absent; claimed, with its token and lease; completed, with its
//! fingerprint, record and expiry), a diverging sequence shrunk to the
//! fewest steps that still diverge.
//!
//! [`StoreContract`] is for stores whose claims are leases (`type Granted =
//! LeaseToken`), as a custom store's usually are; the crate's own lease
//! stores (memory, Redis, the SQL stores) run it in CI. A store whose
//! claims are database transactions runs [`TxStoreContract`] instead: the
//! record and the effects written with its transaction commit together or
//! not at all, across releases, dropped transactions, failed statements,
//! savepoints, duplicates, paused holders and expiry.
//!
//! [`FaultyStore`] wraps any store and fails on purpose — errors, lost
//! acknowledgements and delays per operation, at chosen rates — for the
//! tests of what you build on a store.
//!
//! # Examples
//!
//! A toy store that keeps the contract, checked the way a custom store's
//! tests would check theirs:
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! use tower_idempotency::{MemoryStore, testing::StoreContract};
//!
//! // Any `Store<Granted = LeaseToken>`: each rule gets a fresh one.
//! StoreContract::new(|| async { MemoryStore::new() }).assert().await;
//! # }
//! ```

use std::{
    fmt,
    future::Future,
    sync::Arc,
    time::{Duration, SystemTime},
};

use bytes::Bytes;

use crate::{
    CompletedRecord, Fingerprint, IdempotencyKey,
    store::{Claim, Forgotten, KeyState, Lapsed, LeaseToken, StorageKey, Store, StoreError},
};

/// A contract's rules, listed once: each a name and its check, a method of
/// the same name. Makes the public list of names (`$names`) and the
/// contract's `run_rules`, which runs each check in that order.
macro_rules! rules {
    (
        $(#[$doc:meta])*
        $names:ident for $contract:ty,
        impl [$($generics:tt)*] where [$($bounds:tt)*],
        $arg:ident: $ty:ty => { $($rule:ident),* $(,)? }
    ) => {
        $(#[$doc])*
        pub const $names: &[&str] = &[$(stringify!($rule)),*];

        impl<$($generics)*> $contract where $($bounds)* {
            /// Runs each rule in order — but those `skip` names — on what
            /// `given` makes for it; the ones the store broke.
            async fn run_rules<G: Future<Output = $ty>>(
                &self,
                skip: impl Fn(&str) -> bool,
                given: impl Fn(&'static str) -> G,
            ) -> Vec<$crate::testing::Violation> {
                let mut broken = Vec::new();
                $(
                    let rule = stringify!($rule);
                    if !skip(rule) {
                        let $arg = given(rule).await;
                        if let Err(detail) = self.$rule($arg).await {
                            broken.push($crate::testing::Violation { rule, detail });
                        }
                    }
                )*
                broken
            }
        }
    };
}

mod faulty;
mod model;
mod transactional;

pub use faulty::{FaultyStore, Injected, Op};
pub use transactional::{TX_RULES, TxEffects, TxStoreContract};

/// The store contract, run against the stores `make` builds: see the
/// [module docs](self).
pub struct StoreContract<M> {
    make: M,
    /// Overwrites a key's stored record with bytes its store cannot read.
    corrupt: Option<Corrupter>,
    inspect: bool,
    unit: Duration,
    cases: usize,
    seed: u64,
}

/// What [`StoreContract::corrupting`] is given.
type Corrupter =
    Arc<dyn Fn(StorageKey) -> std::pin::Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync>;

/// Panics, listing each broken rule, unless `broken` is empty.
fn assert_kept(store: &str, broken: &[Violation]) {
    assert!(
        broken.is_empty(),
        "{store} breaks the contract:\n{}",
        broken
            .iter()
            .map(|v| format!("- {v}"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// A rule the store broke.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    /// The rule, as the suite names it (`claims_exclude_each_other`).
    pub rule: &'static str,
    /// What happened instead.
    pub detail: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.rule, self.detail)
    }
}

rules! {
    /// Every rule, in order.
    RULES for StoreContract<M>,
    impl [M, Fut, St] where [
        M: Fn() -> Fut,
        Fut: Future<Output = St>,
        St: Store<Granted = LeaseToken>,
    ],
    on: (St, StorageKey) => {
        claims_exclude_each_other,
        completion_replays_and_other_payloads_mismatch,
        release_frees_the_key,
        an_expired_lease_lets_another_claim,
        a_lost_lease_fences_its_holder_off,
        heartbeats_keep_a_claim,
        retention_counts_from_the_completion,
        inspect_and_forget_tell_the_truth,
        concurrent_claims_grant_the_key_once,
        scopes_keep_keys_apart,
        keys_compare_byte_for_byte,
        retention_is_kept_as_long_as_asked,
        an_unreadable_record_is_an_error_under_any_fingerprint,
        takeovers_count_the_lapsed_attempts,
        behaves_as_the_model,
    }
}

impl<M> fmt::Debug for StoreContract<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StoreContract")
            .field("inspect", &self.inspect)
            .field("unit", &self.unit)
            .finish_non_exhaustive()
    }
}

type Outcome = Result<(), String>;

impl<M, Fut, St> StoreContract<M>
where
    M: Fn() -> Fut,
    Fut: Future<Output = St>,
    St: Store<Granted = LeaseToken>,
{
    /// The suite over the stores `make` builds (a fresh one per rule;
    /// rules use keys of their own, so one shared store works too).
    ///
    /// # Examples
    ///
    /// See the [module docs](self).
    pub fn new(make: M) -> Self {
        Self {
            make,
            corrupt: None,
            inspect: true,
            unit: Duration::from_millis(200),
            cases: 8,
            seed: fastrand::u64(..),
        }
    }

    /// How many random sequences the model-based rule runs (default 8,
    /// of 16 steps each), and from which seed (default: a random one; a
    /// failure names it, to run the same sequences again).
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::{MemoryStore, testing::StoreContract};
    ///
    /// let contract = StoreContract::new(|| async { MemoryStore::new() }).model_cases(32, 7);
    /// # let _ = contract;
    /// ```
    pub fn model_cases(mut self, cases: usize, seed: u64) -> Self {
        self.cases = cases;
        self.seed = seed;
        self
    }

    /// How to overwrite the record a store holds under a key with bytes
    /// it cannot read (a truncated or garbled value, written to its table,
    /// key or item directly), for the rule that an unreadable record is an
    /// error under any fingerprint — never a mismatch, never a claim
    /// granted over it to run the work again. Without it that rule is
    /// skipped: only the store's own tests know where its bytes live.
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::{MemoryStore, testing::StoreContract};
    ///
    /// // A real store's tests write garbage where the key's record is.
    /// let contract = StoreContract::new(|| async { MemoryStore::new() })
    ///     .corrupting(|key| async move { let _ = key; /* UPDATE … SET record = x'00' … */ });
    /// # let _ = contract;
    /// ```
    pub fn corrupting<C, CFut>(mut self, corrupt: C) -> Self
    where
        C: Fn(StorageKey) -> CFut + Send + Sync + 'static,
        CFut: Future<Output = ()> + Send + 'static,
    {
        self.corrupt = Some(Arc::new(move |key| Box::pin(corrupt(key))));
        self
    }

    /// Skips the inspect/forget rule, for a store that leaves
    /// [`Store::inspect`] and [`Store::forget`] unsupported (as the trait's
    /// defaults do).
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::{MemoryStore, testing::StoreContract};
    ///
    /// let contract = StoreContract::new(|| async { MemoryStore::new() }).without_inspect();
    /// # let _ = contract;
    /// ```
    pub fn without_inspect(mut self) -> Self {
        self.inspect = false;
        self
    }

    /// The time unit of the rules about leases and retention (default
    /// 200 ms): leases of 2 units, waits of 3. Raise it for a store whose
    /// clock is coarse or far away; the suite takes about 20 units.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::{MemoryStore, testing::StoreContract};
    ///
    /// let contract = StoreContract::new(|| async { MemoryStore::new() }).time_unit(Duration::from_millis(500));
    /// # let _ = contract;
    /// ```
    pub fn time_unit(mut self, unit: Duration) -> Self {
        self.unit = unit;
        self
    }

    /// Runs every rule; the ones the store broke.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// use tower_idempotency::{MemoryStore, testing::StoreContract};
    ///
    /// let broken = StoreContract::new(|| async { MemoryStore::new() }).check().await;
    /// assert!(broken.is_empty(), "{broken:?}");
    /// # }
    /// ```
    pub async fn check(&self) -> Vec<Violation> {
        self.run_rules(
            |rule| {
                (rule == "inspect_and_forget_tell_the_truth" && !self.inspect)
                    || (rule == "an_unreadable_record_is_an_error_under_any_fingerprint"
                        && self.corrupt.is_none())
                    || (rule == "takeovers_count_the_lapsed_attempts" && !St::REPORTS_TAKEOVERS)
            },
            |rule| {
                let store = (self.make)();
                async move { (store.await, key(rule)) }
            },
        )
        .await
    }

    /// Runs every rule and panics, listing the broken ones, if any is.
    ///
    /// # Panics
    ///
    /// When the store breaks a rule.
    ///
    /// # Examples
    ///
    /// See the [module docs](self).
    pub async fn assert(&self) {
        assert_kept("the store", &self.check().await);
    }

    async fn claims_exclude_each_other(&self, (store, key): (St, StorageKey)) -> Outcome {
        let store = &store;
        let lease = self.unit * 2;
        let _first = acquire(store, &key, &FP, lease).await?;
        expect_in_flight(store.claim(&key, &FP, lease).await, "a second claim")
    }

    async fn completion_replays_and_other_payloads_mismatch(
        &self,
        (store, key): (St, StorageKey),
    ) -> Outcome {
        let store = &store;
        let lease = self.unit * 2;
        let mut token = acquire(store, &key, &FP, lease).await?;
        complete(store, &key, &mut token, day()).await?;
        match store.claim(&key, &FP, lease).await {
            Ok(Claim::Completed { record, .. }) if *record == self::record() => {}
            other => {
                return Err(format!(
                    "the same payload got {}, not its record",
                    show(&other)
                ));
            }
        }
        match store.claim(&key, &OTHER, lease).await {
            Ok(Claim::Mismatch) => Ok(()),
            other => Err(format!(
                "another payload got {}, not Mismatch",
                show(&other)
            )),
        }
    }

    /// A completed record made unreadable: a claim under its fingerprint
    /// and under another are errors, never a replay, a mismatch or a
    /// grant; and so they stay (nothing was taken over to run again).
    async fn an_unreadable_record_is_an_error_under_any_fingerprint(
        &self,
        (store, key): (St, StorageKey),
    ) -> Outcome {
        let Some(corrupt) = &self.corrupt else {
            return Ok(());
        };
        let store = &store;
        let lease = self.unit * 2;
        let mut token = acquire(store, &key, &FP, lease).await?;
        complete(store, &key, &mut token, day()).await?;
        corrupt(key.clone()).await;
        for (asked, fingerprint) in [("its own", &FP), ("another", &OTHER), ("its own", &FP)] {
            match store.claim(&key, fingerprint, lease).await {
                Err(_) => {}
                other => {
                    return Err(format!(
                        "a claim with {asked} fingerprint met an unreadable record and got {}, not an error",
                        show(&other)
                    ));
                }
            }
        }
        Ok(())
    }

    async fn release_frees_the_key(&self, (store, key): (St, StorageKey)) -> Outcome {
        let store = &store;
        let lease = self.unit * 2;
        let token = acquire(store, &key, &FP, lease).await?;
        truthy(store.release(&key, token).await, "release by the holder")?;
        acquire(store, &key, &FP, lease).await.map(drop)
    }

    async fn an_expired_lease_lets_another_claim(&self, (store, key): (St, StorageKey)) -> Outcome {
        let store = &store;
        let u = self.unit;
        let lease = self.unit * 2;
        let _crashed = acquire(store, &key, &FP, lease).await?;
        tokio::time::sleep(u * 3).await;
        take_over(store, &key, lease, 1)
            .await
            .map(drop)
            .map_err(|e| format!("after the lease ran out: {e}"))
    }

    async fn takeovers_count_the_lapsed_attempts(&self, (store, key): (St, StorageKey)) -> Outcome {
        let store = &store;
        let u = self.unit;
        let lease = self.unit * 2;
        let began = SystemTime::now();
        let _first = acquire(store, &key, &FP, lease).await?;
        tokio::time::sleep(u * 3).await;
        let (_, lapsed) = take_over(store, &key, lease, 1).await?;
        // Whose clock: the store's, to within a unit.
        let since = |lapsed: Lapsed| {
            let off = lapsed
                .since
                .duration_since(began)
                .unwrap_or_else(|e| e.duration());
            if off > u {
                return Err(format!(
                    "a takeover said the first attempt began {:?}, {off:?} from when it did",
                    lapsed.since
                ));
            }
            Ok(())
        };
        since(lapsed)?;
        tokio::time::sleep(u * 3).await;
        let (mut third, lapsed) = take_over(store, &key, lease, 2).await?;
        since(lapsed)?;
        // Completed, then expired: a claim over it is a first one again.
        complete(store, &key, &mut third, u).await?;
        tokio::time::sleep(u * 2).await;
        let token = acquire(store, &key, &FP, lease)
            .await
            .map_err(|e| format!("over an expired record: {e}"))?;
        // Released (its work failed, nothing took effect): a first again.
        truthy(store.release(&key, token).await, "release by the holder")?;
        acquire(store, &key, &FP, lease)
            .await
            .map(drop)
            .map_err(|e| format!("after a release: {e}"))
    }

    async fn a_lost_lease_fences_its_holder_off(&self, (store, key): (St, StorageKey)) -> Outcome {
        let store = &store;
        let u = self.unit;
        let lease = self.unit * 2;
        let mut stale = acquire(store, &key, &FP, lease).await?;
        tokio::time::sleep(u * 3).await;
        let (mut fresh, _) = take_over(store, &key, lease * 5, 1).await?;
        falsy(
            store.extend(&key, stale, lease).await,
            "extend by the stale holder",
        )?;
        falsy(
            store
                .complete(&key, &mut stale, &FP, Arc::new(record()), day())
                .await,
            "complete by the stale holder",
        )?;
        falsy(
            store.release(&key, stale).await,
            "release by the stale holder",
        )?;
        complete(store, &key, &mut fresh, day()).await
    }

    async fn heartbeats_keep_a_claim(&self, (store, key): (St, StorageKey)) -> Outcome {
        let store = &store;
        let u = self.unit;
        let lease = self.unit * 2;
        let token = acquire(store, &key, &FP, lease).await?;
        for _ in 0..3 {
            tokio::time::sleep(u).await;
            truthy(
                store.extend(&key, token, lease).await,
                "extend by the holder",
            )?;
        }
        expect_in_flight(
            store.claim(&key, &FP, lease).await,
            "a claim after three heartbeats, past the first lease",
        )
    }

    async fn retention_counts_from_the_completion(
        &self,
        (store, key): (St, StorageKey),
    ) -> Outcome {
        let store = &store;
        let u = self.unit;
        let lease = self.unit * 2;
        let mut token = acquire(store, &key, &FP, lease * 5).await?;
        // Completed late in its lease: the retention starts now.
        tokio::time::sleep(u * 3).await;
        complete(store, &key, &mut token, u * 3).await?;
        tokio::time::sleep(u * 2).await;
        match store.claim(&key, &FP, lease).await {
            Ok(Claim::Completed { .. }) => {}
            other => {
                return Err(format!(
                    "within its retention the record was {}",
                    show(&other)
                ));
            }
        }
        tokio::time::sleep(u * 2).await;
        acquire(store, &key, &FP, lease)
            .await
            .map(drop)
            .map_err(|e| format!("past its retention: {e}"))
    }

    async fn inspect_and_forget_tell_the_truth(&self, (store, key): (St, StorageKey)) -> Outcome {
        let store = &store;
        let lease = self.unit * 2;
        match store.inspect(&key).await {
            Ok(KeyState::Absent) => {}
            other => return Err(format!("inspect of a new key: {other:?}")),
        }
        let mut token = acquire(store, &key, &FP, lease).await?;
        match store.inspect(&key).await {
            Ok(KeyState::InFlight { .. }) => {}
            other => return Err(format!("inspect of a claim: {other:?}")),
        }
        match store.forget(&key, false).await {
            Ok(Forgotten::InFlight) => {}
            other => return Err(format!("forget of a claim without force: {other:?}")),
        }
        complete(store, &key, &mut token, day()).await?;
        match store.inspect(&key).await {
            Ok(KeyState::Completed { .. }) => {}
            other => return Err(format!("inspect of a record: {other:?}")),
        }
        match store.forget(&key, false).await {
            Ok(Forgotten::Completed) => {}
            other => return Err(format!("forget of a record: {other:?}")),
        }
        acquire(store, &key, &FP, lease)
            .await
            .map(drop)
            .map_err(|e| format!("after forget: {e}"))
    }

    async fn concurrent_claims_grant_the_key_once(
        &self,
        (store, key): (St, StorageKey),
    ) -> Outcome {
        let store = &store;
        let lease = self.unit * 2;
        let claims = (0..32).map(|_| store.claim(&key, &FP, lease));
        let claims = futures_util::future::join_all(claims).await;
        let granted = claims
            .iter()
            .filter(|c| matches!(c, Ok(Claim::Acquired(_) | Claim::TakenOver { .. })))
            .count();
        if let Some(Err(error)) = claims.iter().find(|c| c.is_err()) {
            return Err(format!("a concurrent claim failed: {error}"));
        }
        if granted == 1 {
            Ok(())
        } else {
            Err(format!(
                "32 concurrent claims granted the key {granted} times"
            ))
        }
    }

    async fn scopes_keep_keys_apart(&self, (store, _key): (St, StorageKey)) -> Outcome {
        let store = &store;
        let lease = self.unit * 2;
        let idempotency_key =
            IdempotencyKey::new(format!("scoped-{}", fastrand::u64(..))).expect("a valid key");
        let alice = StorageKey::new("acct_alice", &idempotency_key);
        let bob = StorageKey::new("acct_bob", &idempotency_key);
        let mut token = acquire(store, &alice, &FP, lease).await?;
        complete(store, &alice, &mut token, day()).await?;
        acquire(store, &bob, &FP, lease)
            .await
            .map(drop)
            .map_err(|e| format!("the same key under another scope: {e}"))
    }

    async fn keys_compare_byte_for_byte(&self, (store, _key): (St, StorageKey)) -> Outcome {
        let store = &store;
        let lease = self.unit * 2;
        let tag = fastrand::u32(..);
        let held = StorageKey::new(
            "tower-idempotency:contract",
            &IdempotencyKey::new(format!("Order-Ab-{tag}")).expect("a valid key"),
        );
        let mut token = acquire(store, &held, &FP, lease).await?;
        complete(store, &held, &mut token, day()).await?;
        for look_alike in [
            format!("order-ab-{tag}"),
            format!("ORDER-AB-{tag}"),
            format!("Order_Ab-{tag}"),
            format!("0rder-Ab-{tag}"),
            format!("Order-Ab-{tag}."),
        ] {
            let other = StorageKey::new(
                "tower-idempotency:contract",
                &IdempotencyKey::new(&look_alike).expect("a valid key"),
            );
            acquire(store, &other, &FP, lease)
                .await
                .map_err(|e| format!("{look_alike:?}, beside Order-Ab-{tag}: {e}"))?;
        }
        Ok(())
    }

    async fn retention_is_kept_as_long_as_asked(&self, (store, key): (St, StorageKey)) -> Outcome {
        let store = &store;
        let u = self.unit;
        let lease = self.unit * 2;
        let mut token = acquire(store, &key, &FP, lease).await?;
        // Created as it completes, as the doors' records are (a
        // store may count the retention from the record's birth).
        let record = CompletedRecord::Message {
            result: None,
            created_at: SystemTime::now(),
        };
        let done = store
            .complete(&key, &mut token, &FP, Arc::new(record), day())
            .await;
        truthy(done, "complete by the holder")?;
        let said = |claim: Result<Claim, StoreError>| match claim {
            Ok(Claim::Completed { expires_in, .. }) => Ok(expires_in),
            other => Err(format!("a record kept a day was {}", show(&other))),
        };
        let expires_in = said(store.claim(&key, &FP, lease).await)?;
        if expires_in < day() - Duration::from_secs(60) {
            return Err(format!(
                "a record asked to be kept a day says it expires in {expires_in:?}"
            ));
        }
        // Kept, not only said: still there after a while.
        tokio::time::sleep(u * 30).await;
        said(store.claim(&key, &FP, lease).await)
            .map(drop)
            .map_err(|e| format!("after {:?}: {e}", u * 30))
    }

    async fn behaves_as_the_model(&self, (_store, _key): (St, StorageKey)) -> Outcome {
        let u = self.unit;
        model::check(&self.make, self.seed, self.cases, 16, u, self.inspect).await
    }
}

const FP: Fingerprint = Fingerprint::from_bytes([7; 32]);
const OTHER: Fingerprint = Fingerprint::from_bytes([8; 32]);

fn day() -> Duration {
    Duration::from_secs(86_400)
}

/// A key of the rule's own, new on every run.
fn key(rule: &str) -> StorageKey {
    let key = format!("contract-{rule}-{}", fastrand::u64(..));
    let key = key.chars().take(255).collect::<String>();
    StorageKey::new(
        "tower-idempotency:contract",
        &IdempotencyKey::new(&key).expect("a valid key"),
    )
}

fn record() -> CompletedRecord {
    CompletedRecord::Message {
        result: Some(Bytes::from_static(b"{\"charged\":1999}")),
        created_at: SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000),
    }
}

async fn acquire<St: Store<Granted = LeaseToken>>(
    store: &St,
    key: &StorageKey,
    fp: &Fingerprint,
    lease: Duration,
) -> Result<LeaseToken, String> {
    match store.claim(key, fp, lease).await {
        Ok(Claim::Acquired(token)) => Ok(token),
        other => Err(format!(
            "a claim of a free key got {}, not Acquired",
            show(&other)
        )),
    }
}

/// A claim over one that lapsed after `attempts` attempts began: a
/// takeover saying so on a store that
/// [reports them](Store::REPORTS_TAKEOVERS), a plain grant on any other.
async fn take_over<St: Store<Granted = LeaseToken>>(
    store: &St,
    key: &StorageKey,
    lease: Duration,
    attempts: u32,
) -> Result<(LeaseToken, Lapsed), String> {
    let claim = store.claim(key, &FP, lease).await;
    match claim {
        Ok(Claim::TakenOver { granted, lapsed }) if St::REPORTS_TAKEOVERS => {
            if lapsed.attempts == attempts {
                Ok((granted, lapsed))
            } else {
                Err(format!(
                    "a takeover after {attempts} lapsed attempts said {}",
                    lapsed.attempts
                ))
            }
        }
        Ok(Claim::Acquired(granted)) if !St::REPORTS_TAKEOVERS => Ok((
            granted,
            Lapsed {
                attempts,
                since: SystemTime::UNIX_EPOCH,
            },
        )),
        other => Err(format!(
            "a claim over a lapsed one got {}, not {}",
            show(&other),
            if St::REPORTS_TAKEOVERS {
                "TakenOver (the store reports takeovers)"
            } else {
                "Acquired (the store does not report takeovers)"
            }
        )),
    }
}

async fn complete<St: Store<Granted = LeaseToken>>(
    store: &St,
    key: &StorageKey,
    token: &mut LeaseToken,
    retention: Duration,
) -> Outcome {
    let done = store
        .complete(key, token, &FP, Arc::new(record()), retention)
        .await;
    truthy(done, "complete by the holder")
}

fn expect_in_flight(claim: Result<Claim, StoreError>, what: &str) -> Outcome {
    match claim {
        Ok(Claim::InFlight { .. }) => Ok(()),
        other => Err(format!("{what} got {}, not InFlight", show(&other))),
    }
}

fn truthy(done: Result<bool, StoreError>, what: &str) -> Outcome {
    match done {
        Ok(true) => Ok(()),
        Ok(false) => Err(format!("{what} was refused")),
        Err(error) => Err(format!("{what} failed: {error}")),
    }
}

fn falsy(done: Result<bool, StoreError>, what: &str) -> Outcome {
    match done {
        Ok(false) => Ok(()),
        Ok(true) => Err(format!("{what} was accepted")),
        Err(error) => Err(format!("{what} failed: {error}")),
    }
}

fn show<G>(claim: &Result<Claim<G>, StoreError>) -> String {
    match claim {
        Ok(claim) => model::claim_name(claim).into(),
        Err(error) => format!("an error ({error})"),
    }
}
