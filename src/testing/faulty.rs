//! A store wrapper that fails on purpose, for the tests of what sits on a
//! store: errors, delays and lost acknowledgements per operation.

use std::{
    fmt,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use crate::{
    CompletedRecord, Fingerprint,
    store::{Claim, Forgotten, KeyState, LeaseToken, StorageKey, Store, StoreError},
};

/// An operation of the store protocol, as [`FaultyStore`] names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    /// [`Store::claim`] (and [`Store::claim_patiently`]).
    Claim,
    /// [`Store::extend`]: a heartbeat.
    Extend,
    /// [`Store::complete`].
    Complete,
    /// [`Store::release`] (and [`Store::release_keeping_writes`]).
    Release,
    /// [`Store::inspect`].
    Inspect,
    /// [`Store::forget`].
    Forget,
}

const OPS: usize = 6;

impl Op {
    fn index(self) -> usize {
        self as usize
    }
}

/// What may go wrong with one operation.
#[derive(Clone, Copy, Debug, Default)]
struct Plan {
    /// Fails without reaching the store.
    error: f64,
    /// Reaches the store, which does it, but the answer is lost: the
    /// caller sees an error (the network dropped the reply).
    lost: f64,
    /// Waits this long first.
    delay: Option<(f64, Duration)>,
}

/// How many faults a [`FaultyStore`] injected, by kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Injected {
    /// Operations failed before reaching the store.
    pub errors: u64,
    /// Operations done whose answer was lost.
    pub lost: u64,
    /// Operations delayed.
    pub delays: u64,
}

/// A [`Store`] that fails on purpose, at chosen rates per [`Op`]: errors
/// (the operation never reaches the store), lost acknowledgements (the
/// store does it, the caller hears an error) and delays. Seeded, so a
/// failing run can be repeated. For the tests of what you build on a
/// store — a layer, a consumer, your own retry logic: whatever the store
/// does, nothing may run twice, nothing may be lost.
///
/// # Examples
///
/// ```
/// # #[cfg(feature = "memory")]
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// use std::time::Duration;
/// use tower_idempotency::{MemoryStore, testing::{FaultyStore, Op}};
///
/// let store = FaultyStore::new(MemoryStore::new())
///     .seed(7)
///     .errors(Op::Claim, 0.2)
///     .lost_acknowledgements(Op::Complete, 0.5)
///     .delays(Op::Extend, 0.1, Duration::from_millis(50));
/// let layer = tower_idempotency::IdempotencyLayer::new(store.clone()).single_tenant();
/// # let _ = layer;
/// // … drive the service, then:
/// assert_eq!(store.injected().errors, 0);
/// # }
/// # #[cfg(not(feature = "memory"))] fn main() {}
/// ```
pub struct FaultyStore<S> {
    inner: S,
    plans: [Plan; OPS],
    rng: Arc<Mutex<fastrand::Rng>>,
    injected: Arc<[AtomicU64; 3]>,
}

impl<S: Clone> Clone for FaultyStore<S> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            plans: self.plans,
            rng: self.rng.clone(),
            injected: self.injected.clone(),
        }
    }
}

impl<S> fmt::Debug for FaultyStore<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FaultyStore")
            .field("injected", &self.injected())
            .finish_non_exhaustive()
    }
}

impl<S> FaultyStore<S> {
    /// `inner`, without faults until some are asked for.
    ///
    /// # Examples
    ///
    /// See the [type's docs](Self).
    pub fn new(inner: S) -> Self {
        Self {
            inner,
            plans: [Plan::default(); OPS],
            rng: Arc::new(Mutex::new(fastrand::Rng::new())),
            injected: Arc::default(),
        }
    }

    /// The seed of the random draws (default: a random one).
    ///
    /// # Examples
    ///
    /// See the [type's docs](Self).
    pub fn seed(self, seed: u64) -> Self {
        *self.rng.lock().expect("the draws") = fastrand::Rng::with_seed(seed);
        self
    }

    /// Fails `op` at `rate` (0.0 to 1.0) with
    /// [`StoreError::Unavailable`], before it reaches the store.
    ///
    /// # Examples
    ///
    /// See the [type's docs](Self).
    pub fn errors(mut self, op: Op, rate: f64) -> Self {
        self.plans[op.index()].error = rate;
        self
    }

    /// Lets the store do `op` at `rate`, then loses its answer: the caller
    /// gets [`StoreError::Unavailable`] for a change that was made — a
    /// claim granted that no one holds, a record stored the caller thinks
    /// failed.
    ///
    /// # Examples
    ///
    /// See the [type's docs](Self).
    pub fn lost_acknowledgements(mut self, op: Op, rate: f64) -> Self {
        self.plans[op.index()].lost = rate;
        self
    }

    /// Delays `op` by `delay` at `rate`, before it reaches the store.
    ///
    /// # Examples
    ///
    /// See the [type's docs](Self).
    pub fn delays(mut self, op: Op, rate: f64, delay: Duration) -> Self {
        self.plans[op.index()].delay = Some((rate, delay));
        self
    }

    /// The faults injected so far (clones count together).
    ///
    /// # Examples
    ///
    /// See the [type's docs](Self).
    pub fn injected(&self) -> Injected {
        Injected {
            errors: self.injected[0].load(Ordering::Relaxed),
            lost: self.injected[1].load(Ordering::Relaxed),
            delays: self.injected[2].load(Ordering::Relaxed),
        }
    }

    /// The wrapped store.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[cfg(feature = "memory")] {
    /// use tower_idempotency::{MemoryStore, testing::FaultyStore};
    ///
    /// let store = FaultyStore::new(MemoryStore::new());
    /// let _inner: &MemoryStore = store.inner();
    /// # }
    /// ```
    pub fn inner(&self) -> &S {
        &self.inner
    }

    fn draw(&self, rate: f64) -> bool {
        rate > 0.0 && self.rng.lock().expect("the draws").f64() < rate
    }

    fn count(&self, kind: usize) {
        self.injected[kind].fetch_add(1, Ordering::Relaxed);
    }

    /// Runs `call` with the faults planned for `op`.
    async fn with_faults<T>(
        &self,
        op: Op,
        call: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let plan = self.plans[op.index()];
        if let Some((rate, delay)) = plan.delay
            && self.draw(rate)
        {
            self.count(2);
            tokio::time::sleep(delay).await;
        }
        if self.draw(plan.error) {
            self.count(0);
            return Err(injected(op, "failed before reaching the store"));
        }
        let done = call.await;
        if done.is_ok() && self.draw(plan.lost) {
            self.count(1);
            return Err(injected(op, "done by the store, its answer lost"));
        }
        done
    }
}

fn injected(op: Op, what: &str) -> StoreError {
    StoreError::Unavailable(format!("injected fault: {op:?} {what}").into())
}

impl<S: Store> Store for FaultyStore<S> {
    type Granted = S::Granted;
    const REPORTS_TAKEOVERS: bool = S::REPORTS_TAKEOVERS;

    async fn claim(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<Claim<S::Granted>, StoreError> {
        self.with_faults(Op::Claim, self.inner.claim(key, fingerprint, lease))
            .await
    }

    async fn claim_patiently(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<Claim<S::Granted>, StoreError> {
        self.with_faults(
            Op::Claim,
            self.inner.claim_patiently(key, fingerprint, lease),
        )
        .await
    }

    async fn extend(
        &self,
        key: &StorageKey,
        token: LeaseToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        self.with_faults(Op::Extend, self.inner.extend(key, token, lease))
            .await
    }

    async fn complete(
        &self,
        key: &StorageKey,
        granted: &mut S::Granted,
        fingerprint: &Fingerprint,
        record: Arc<CompletedRecord>,
        retention: Duration,
    ) -> Result<bool, StoreError> {
        self.with_faults(
            Op::Complete,
            self.inner
                .complete(key, granted, fingerprint, record, retention),
        )
        .await
    }

    async fn release(&self, key: &StorageKey, granted: S::Granted) -> Result<bool, StoreError> {
        self.with_faults(Op::Release, self.inner.release(key, granted))
            .await
    }

    async fn release_keeping_writes(
        &self,
        key: &StorageKey,
        granted: S::Granted,
    ) -> Result<bool, StoreError> {
        self.with_faults(Op::Release, self.inner.release_keeping_writes(key, granted))
            .await
    }

    async fn inspect(&self, key: &StorageKey) -> Result<KeyState, StoreError> {
        self.with_faults(Op::Inspect, self.inner.inspect(key)).await
    }

    async fn forget(&self, key: &StorageKey, force: bool) -> Result<Forgotten, StoreError> {
        self.with_faults(Op::Forget, self.inner.forget(key, force))
            .await
    }
}
