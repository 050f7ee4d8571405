//! The contract of a transactional store: the record and the effects the
//! work wrote with its claim's transaction are one fact.

use std::{
    fmt,
    future::Future,
    ops::DerefMut,
    sync::Arc,
    time::{Duration, Instant},
};

use super::{FP, OTHER, Outcome, Violation, day, key, record, show};
use crate::{
    IdempotencyKey,
    store::{Claim, Granted, StorageKey, Store, StoreError},
};

/// The effects a transactional store's work writes, as the
/// [`TxStoreContract`] writes and counts them: rows of a table of your
/// own, say, written with the claim's transaction (`C` is what the
/// store's granted claim dereferences to — the connection) and counted
/// outside every transaction.
///
/// # Examples
///
/// Effects as rows of a `charges (note)` table, on SQLite:
///
/// ```no_run
/// # #[cfg(feature = "sqlite")] mod demo {
/// use tower_idempotency::{sqlx::{self, SqliteConnection, SqlitePool}, testing::TxEffects};
///
/// struct Charges(SqlitePool);
///
/// impl TxEffects<SqliteConnection> for Charges {
///     async fn write(&self, tx: &mut SqliteConnection, id: &str) -> Result<(), String> {
///         sqlx::query("INSERT INTO charges (note) VALUES (?1)").bind(id)
///             .execute(&mut *tx).await.map(drop).map_err(|e| e.to_string())
///     }
///     async fn write_in_rolled_back_savepoint(&self, tx: &mut SqliteConnection, id: &str) -> Result<(), String> {
///         sqlx::query("SAVEPOINT contract").execute(&mut *tx).await.map_err(|e| e.to_string())?;
///         self.write(tx, id).await?;
///         sqlx::query("ROLLBACK TO SAVEPOINT contract").execute(&mut *tx).await.map(drop).map_err(|e| e.to_string())
///     }
///     async fn fail_a_statement(&self, tx: &mut SqliteConnection) {
///         let _ = sqlx::query("INSERT INTO no_such_table VALUES (1)").execute(&mut *tx).await;
///     }
///     async fn count(&self, id: &str) -> Result<u64, String> {
///         sqlx::query_scalar::<_, i64>("SELECT count(*) FROM charges WHERE note = ?1").bind(id)
///             .fetch_one(&self.0).await.map(|n| n as u64).map_err(|e| e.to_string())
///     }
/// }
/// # }
/// ```
pub trait TxEffects<C: ?Sized>: Send + Sync + 'static {
    /// Writes the effect `id` with the claim's transaction.
    fn write(&self, tx: &mut C, id: &str) -> impl Future<Output = Result<(), String>> + Send;

    /// Writes the effect `id` inside a savepoint of the transaction, then
    /// rolls the savepoint back: the work undoing a part of itself.
    fn write_in_rolled_back_savepoint(
        &self,
        tx: &mut C,
        id: &str,
    ) -> impl Future<Output = Result<(), String>> + Send;

    /// Runs a statement that fails (a table that does not exist, a
    /// duplicate of a unique value); its error is expected. Some databases
    /// then refuse the rest of the transaction, some go on.
    fn fail_a_statement(&self, tx: &mut C) -> impl Future<Output = ()> + Send;

    /// How many effects `id` are committed, read outside every
    /// transaction.
    fn count(&self, id: &str) -> impl Future<Output = Result<u64, String>> + Send;
}

rules! {
    /// Every rule of the [`TxStoreContract`], in order.
    TX_RULES for TxStoreContract<St, E>,
    impl [St, E, C] where [
        St: Store,
        St::Granted: DerefMut<Target = C>,
        C: ?Sized + Send,
        E: TxEffects<C>,
    ],
    key: StorageKey => {
        record_and_effects_commit_together,
        a_release_rolls_the_effects_back,
        a_dropped_transaction_leaves_nothing,
        a_failed_statement_commits_all_or_nothing,
        a_rolled_back_savepoint_keeps_the_rest,
        a_duplicate_is_answered_at_once_then_replays,
        a_paused_holder_keeps_its_claim,
        concurrent_claims_grant_the_key_once,
        kept_writes_commit_without_a_record,
        an_expired_record_lets_the_key_run_again,
        scopes_keep_keys_apart,
        a_batch_commits_its_keys_together_and_undoes_one_alone,
        a_batch_answers_what_it_finds_and_goes_on,
        a_dropped_batch_leaves_nothing,
    }
}

/// The contract of a store whose claims are transactions (`type Granted`
/// a transaction that dereferences to its connection, lent to the
/// work): the effects written with a claim's transaction commit with its
/// record or not at all — committed together; rolled back together by a
/// release, a dropped transaction (the process died, the request was
/// cancelled) or a statement the database refused; a savepoint the work
/// rolled back stays undone; a duplicate is answered at once while the
/// holder runs, however long (a transaction's claim does not lapse like a
/// lease), and replays once it committed; concurrent claims grant the key
/// once; writes kept without a record (`release_keeping_writes`) commit
/// and free the key; an expired record lets the key run again; two scopes
/// are two keys. On a store that [batches](Store::BATCHES): the keys of a
/// batch commit together, and one undone in it (its work's writes too,
/// even after a statement the database refused) is undone alone; a key
/// found in a batch (completed, reused with another payload, in flight) is
/// answered and the batch goes on; a dropped batch leaves nothing.
///
/// The crate's transactional SQL stores run it on their real servers;
/// run it against your own with the effects your work writes.
///
/// # Examples
///
/// ```no_run
/// # #[cfg(feature = "sqlite")]
/// # async fn demo(charges: impl tower_idempotency::testing::TxEffects<tower_idempotency::sqlx::SqliteConnection>) {
/// use tower_idempotency::{SqliteStore, testing::TxStoreContract};
///
/// let store = SqliteStore::builder()
///     .transactional()
///     .create_table_if_missing()
///     .connect("sqlite://contract.db")
///     .await
///     .unwrap();
/// // `charges`: your `TxEffects` (see its example).
/// TxStoreContract::new(store, charges).assert().await;
/// # }
/// ```
pub struct TxStoreContract<St, E> {
    store: St,
    effects: Arc<E>,
    unit: Duration,
}

impl<St, E> fmt::Debug for TxStoreContract<St, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TxStoreContract")
            .field("unit", &self.unit)
            .finish_non_exhaustive()
    }
}

impl<St, E, C> TxStoreContract<St, E>
where
    St: Store,
    St::Granted: DerefMut<Target = C>,
    C: ?Sized + Send,
    E: TxEffects<C>,
{
    /// The suite over `store` (each rule uses keys of its own), writing
    /// and counting `effects`.
    ///
    /// # Examples
    ///
    /// See the [type's docs](Self).
    pub fn new(store: St, effects: E) -> Self {
        Self {
            store,
            effects: Arc::new(effects),
            unit: Duration::from_millis(200),
        }
    }

    /// The time unit of the rules that wait (default 200 ms): a paused
    /// holder sits 4 units, a record kept 1 unit is looked for after 3,
    /// and a duplicate must be answered within 5. Keep it well under the
    /// store's bound on a transaction.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # #[cfg(feature = "sqlite")]
    /// # fn demo(store: tower_idempotency::SqliteTxStore, charges: impl tower_idempotency::testing::TxEffects<tower_idempotency::sqlx::SqliteConnection>) {
    /// use std::time::Duration;
    /// use tower_idempotency::testing::TxStoreContract;
    ///
    /// let contract = TxStoreContract::new(store, charges).time_unit(Duration::from_millis(500));
    /// # let _ = contract;
    /// # }
    /// ```
    pub fn time_unit(mut self, unit: Duration) -> Self {
        self.unit = unit;
        self
    }

    /// Runs every rule; the ones the store broke.
    ///
    /// # Examples
    ///
    /// See the [type's docs](Self) (`assert` panics where this lists).
    pub async fn check(&self) -> Vec<Violation> {
        self.run_rules(|_| false, |rule| std::future::ready(key(rule)))
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
    /// See the [type's docs](Self).
    pub async fn assert(&self) {
        super::assert_kept("the transactional store", &self.check().await);
    }

    async fn record_and_effects_commit_together(&self, key: StorageKey) -> Outcome {
        let store = &self.store;
        let fx = &*self.effects;
        let lease = self.unit * 2;
        // Each rule's effects are named after its key: counted apart.
        let id = |what: &str| format!("{}-{what}", &key.as_str()[key.as_str().len() - 16..]);
        let mut tx = self.acquire(&key).await?;
        write(fx, &mut tx, &id("charge")).await?;
        commit(store, &key, &mut tx, day()).await?;
        drop(tx);
        expect_count(fx, &id("charge"), 1, "after the commit").await?;
        match store.claim(&key, &FP, lease).await {
            Ok(Claim::Completed { record, .. }) if *record == super::record() => {}
            other => {
                return Err(format!(
                    "the same payload got {}, not its record",
                    show(&other)
                ));
            }
        }
        match store.claim(&key, &OTHER, lease).await {
            Ok(Claim::Mismatch) => {}
            other => {
                return Err(format!(
                    "another payload got {}, not Mismatch",
                    show(&other)
                ));
            }
        }
        expect_count(fx, &id("charge"), 1, "after the replay").await
    }

    async fn a_release_rolls_the_effects_back(&self, key: StorageKey) -> Outcome {
        let store = &self.store;
        let fx = &*self.effects;
        let u = self.unit;
        // Each rule's effects are named after its key: counted apart.
        let id = |what: &str| format!("{}-{what}", &key.as_str()[key.as_str().len() - 16..]);
        let mut tx = self.acquire(&key).await?;
        write(fx, &mut tx, &id("charge")).await?;
        ok(store.release(&key, tx).await, "release by the holder")?;
        expect_count(fx, &id("charge"), 0, "after the release").await?;
        self.acquire_within(&key, u * 3, "after the release").await
    }

    async fn a_dropped_transaction_leaves_nothing(&self, key: StorageKey) -> Outcome {
        let fx = &*self.effects;
        let u = self.unit;
        // Each rule's effects are named after its key: counted apart.
        let id = |what: &str| format!("{}-{what}", &key.as_str()[key.as_str().len() - 16..]);
        let mut tx = self.acquire(&key).await?;
        write(fx, &mut tx, &id("charge")).await?;
        // The process died, the request was cancelled: no one
        // completes or releases it.
        drop(tx);
        self.acquire_within(&key, u * 5, "after the holder was dropped")
            .await?;
        expect_count(fx, &id("charge"), 0, "after the holder was dropped").await
    }

    async fn a_failed_statement_commits_all_or_nothing(&self, key: StorageKey) -> Outcome {
        let store = &self.store;
        let fx = &*self.effects;
        let u = self.unit;
        let lease = self.unit * 2;
        // Each rule's effects are named after its key: counted apart.
        let id = |what: &str| format!("{}-{what}", &key.as_str()[key.as_str().len() - 16..]);
        let mut tx = self.acquire(&key).await?;
        write(fx, &mut tx, &id("charge")).await?;
        fx.fail_a_statement(&mut *tx).await;
        let committed = store
            .complete(&key, &mut tx, &FP, Arc::new(record()), day())
            .await;
        drop(tx);
        let effects = fx.count(&id("charge")).await?;
        match (committed, effects) {
            // The database went on after the failed statement.
            (Ok(true), 1) => match store.claim(&key, &FP, lease).await {
                Ok(Claim::Completed { .. }) => Ok(()),
                other => Err(format!(
                    "committed, yet the retry got {}, not the record",
                    show(&other)
                )),
            },
            // It refused the rest: neither, and the key is free.
            (Ok(false) | Err(_), 0) => {
                self.acquire_within(&key, u * 3, "after a commit the database refused")
                    .await
            }
            (committed, effects) => Err(format!(
                "the completion said {committed:?} and {effects} effects committed: \
                 the record and the effects parted"
            )),
        }
    }

    async fn a_rolled_back_savepoint_keeps_the_rest(&self, key: StorageKey) -> Outcome {
        let store = &self.store;
        let fx = &*self.effects;
        // Each rule's effects are named after its key: counted apart.
        let id = |what: &str| format!("{}-{what}", &key.as_str()[key.as_str().len() - 16..]);
        let mut tx = self.acquire(&key).await?;
        write(fx, &mut tx, &id("kept")).await?;
        fx.write_in_rolled_back_savepoint(&mut *tx, &id("undone"))
            .await
            .map_err(|e| format!("the savepoint: {e}"))?;
        commit(store, &key, &mut tx, day()).await?;
        drop(tx);
        expect_count(fx, &id("kept"), 1, "written beside the savepoint").await?;
        expect_count(fx, &id("undone"), 0, "rolled back to the savepoint").await
    }

    async fn a_duplicate_is_answered_at_once_then_replays(&self, key: StorageKey) -> Outcome {
        let store = &self.store;
        let fx = &*self.effects;
        let lease = self.unit * 2;
        // Each rule's effects are named after its key: counted apart.
        let id = |what: &str| format!("{}-{what}", &key.as_str()[key.as_str().len() - 16..]);
        let mut tx = self.acquire(&key).await?;
        write(fx, &mut tx, &id("charge")).await?;
        let duplicate = self.claim_at_once(&key).await?;
        if !matches!(duplicate, Ok(Claim::InFlight { .. })) {
            return Err(format!(
                "a duplicate of a running claim got {}, not InFlight",
                show(&duplicate)
            ));
        }
        commit(store, &key, &mut tx, day()).await?;
        drop(tx);
        match store.claim(&key, &FP, lease).await {
            Ok(Claim::Completed { .. }) => {}
            other => {
                return Err(format!(
                    "the duplicate's retry got {}, not the record",
                    show(&other)
                ));
            }
        }
        expect_count(fx, &id("charge"), 1, "after the duplicate").await
    }

    async fn a_paused_holder_keeps_its_claim(&self, key: StorageKey) -> Outcome {
        let store = &self.store;
        let fx = &*self.effects;
        let u = self.unit;
        // Each rule's effects are named after its key: counted apart.
        let id = |what: &str| format!("{}-{what}", &key.as_str()[key.as_str().len() - 16..]);
        // A lease this short would have lapsed: a transaction's
        // claim lasts as long as the transaction.
        let mut tx = match store.claim(&key, &FP, u / 2).await {
            Ok(Claim::Acquired(tx)) => tx,
            other => return Err(format!("a claim of a free key got {}", show(&other))),
        };
        tokio::time::sleep(u * 4).await;
        let duplicate = self.claim_at_once(&key).await?;
        if !matches!(duplicate, Ok(Claim::InFlight { .. })) {
            return Err(format!(
                "a duplicate of a paused holder got {}, not InFlight",
                show(&duplicate)
            ));
        }
        write(fx, &mut tx, &id("charge")).await?;
        commit(store, &key, &mut tx, day()).await?;
        drop(tx);
        expect_count(fx, &id("charge"), 1, "after the paused holder went on").await
    }

    async fn concurrent_claims_grant_the_key_once(&self, key: StorageKey) -> Outcome {
        let store = &self.store;
        let fx = &*self.effects;
        // Each rule's effects are named after its key: counted apart.
        let id = |what: &str| format!("{}-{what}", &key.as_str()[key.as_str().len() - 16..]);
        let claims = (0..16).map(|_| self.claim_at_once(&key));
        let claims = futures_util::future::join_all(claims).await;
        let mut granted = Vec::new();
        for claim in claims {
            let claim = claim?;
            match claim {
                Ok(Claim::Acquired(tx)) => granted.push(tx),
                Ok(Claim::InFlight { .. }) => {}
                other => return Err(format!("a concurrent claim got {}", show(&other))),
            }
        }
        if granted.len() != 1 {
            return Err(format!(
                "16 concurrent claims granted the key {} times",
                granted.len()
            ));
        }
        let mut tx = granted.pop().expect("one");
        write(fx, &mut tx, &id("charge")).await?;
        commit(store, &key, &mut tx, day()).await?;
        drop(tx);
        expect_count(fx, &id("charge"), 1, "after concurrent claims").await
    }

    async fn kept_writes_commit_without_a_record(&self, key: StorageKey) -> Outcome {
        let store = &self.store;
        let fx = &*self.effects;
        let u = self.unit;
        // Each rule's effects are named after its key: counted apart.
        let id = |what: &str| format!("{}-{what}", &key.as_str()[key.as_str().len() - 16..]);
        let mut tx = self.acquire(&key).await?;
        write(fx, &mut tx, &id("charge")).await?;
        ok(
            store.release_keeping_writes(&key, tx).await,
            "release keeping the writes",
        )?;
        expect_count(fx, &id("charge"), 1, "kept by the release").await?;
        self.acquire_within(&key, u * 3, "after a release that kept the writes")
            .await
    }

    async fn an_expired_record_lets_the_key_run_again(&self, key: StorageKey) -> Outcome {
        let store = &self.store;
        let fx = &*self.effects;
        let u = self.unit;
        // Each rule's effects are named after its key: counted apart.
        let id = |what: &str| format!("{}-{what}", &key.as_str()[key.as_str().len() - 16..]);
        let mut tx = self.acquire(&key).await?;
        write(fx, &mut tx, &id("charge")).await?;
        commit(store, &key, &mut tx, u).await?;
        drop(tx);
        tokio::time::sleep(u * 3).await;
        self.acquire_within(&key, u * 3, "past the record's retention")
            .await?;
        expect_count(
            fx,
            &id("charge"),
            1,
            "the record's expiry leaves its effects",
        )
        .await
    }

    async fn scopes_keep_keys_apart(&self, _key: StorageKey) -> Outcome {
        let store = &self.store;
        let shared =
            IdempotencyKey::new(format!("scoped-{}", fastrand::u64(..))).expect("a valid key");
        let alice = StorageKey::new("acct_alice", &shared);
        let bob = StorageKey::new("acct_bob", &shared);
        let mut tx = self.acquire(&alice).await?;
        commit(store, &alice, &mut tx, day()).await?;
        drop(tx);
        self.acquire_within(&bob, Duration::ZERO, "the same key under another scope")
            .await
    }

    async fn a_batch_commits_its_keys_together_and_undoes_one_alone(
        &self,
        key: StorageKey,
    ) -> Outcome {
        if !St::BATCHES {
            return Ok(());
        }
        let store = &self.store;
        let fx = &*self.effects;
        let lease = self.unit * 2;
        let [kept, undone, refused] = others(&key);
        // Named after the rule's key and each key's part: counted apart.
        let id = |part: &StorageKey| {
            let which = if *part == kept {
                "kept"
            } else if *part == undone {
                "undone"
            } else {
                "refused"
            };
            format!("{}-{which}", &key.as_str()[key.as_str().len() - 16..])
        };
        let mut batch = begin(store).await?;
        claim_in_batch(store, &mut batch, &kept).await?;
        write(fx, &mut batch, &id(&kept)).await?;
        complete_in_batch(store, &mut batch, &kept).await?;
        claim_in_batch(store, &mut batch, &undone).await?;
        write(fx, &mut batch, &id(&undone)).await?;
        in_batch(
            store.release_in_batch(&mut batch, &undone).await,
            "the release",
        )?;
        claim_in_batch(store, &mut batch, &refused).await?;
        write(fx, &mut batch, &id(&refused)).await?;
        fx.fail_a_statement(&mut *batch).await;
        in_batch(
            store.release_in_batch(&mut batch, &refused).await,
            "the release after a refused statement",
        )?;
        // Uncommitted, the batch's key is in flight to any other claim.
        match self.claim_at_once(&kept).await? {
            Ok(Claim::InFlight { .. }) => {}
            other => {
                return Err(format!(
                    "a key of an uncommitted batch got {}, not InFlight",
                    show(&other)
                ));
            }
        }
        expect_count(fx, &id(&kept), 0, "before the batch's commit").await?;
        in_batch(store.commit_batch(batch).await, "the batch's commit")?;
        expect_count(fx, &id(&kept), 1, "after the batch's commit").await?;
        expect_count(fx, &id(&undone), 0, "undone in the batch").await?;
        expect_count(fx, &id(&refused), 0, "undone after a refused statement").await?;
        match store.claim(&kept, &FP, lease).await {
            Ok(Claim::Completed { record, .. }) if *record == super::record() => {}
            other => {
                return Err(format!(
                    "a key the batch committed got {}, not its record",
                    show(&other)
                ));
            }
        }
        self.acquire_within(&undone, Duration::ZERO, "a key undone in a batch")
            .await?;
        self.acquire_within(
            &refused,
            Duration::ZERO,
            "a key undone after a refused statement",
        )
        .await
    }

    async fn a_batch_answers_what_it_finds_and_goes_on(&self, key: StorageKey) -> Outcome {
        if !St::BATCHES {
            return Ok(());
        }
        let store = &self.store;
        let fx = &*self.effects;
        let [done, held, new] = others(&key);
        let id = |_: &StorageKey| format!("{}-found", &key.as_str()[key.as_str().len() - 16..]);
        let mut tx = self.acquire(&done).await?;
        commit(store, &done, &mut tx, day()).await?;
        drop(tx);
        let holder = self.acquire(&held).await?;
        let mut batch = begin(store).await?;
        match store.claim_in_batch(&mut batch, &done, &FP).await {
            Ok(Claim::Completed { record, .. }) if *record == super::record() => {}
            other => {
                return Err(format!(
                    "a completed key in a batch got {}, not its record",
                    show(&other)
                ));
            }
        }
        match store.claim_in_batch(&mut batch, &done, &OTHER).await {
            Ok(Claim::Mismatch) => {}
            other => {
                return Err(format!(
                    "another payload in a batch got {}, not Mismatch",
                    show(&other)
                ));
            }
        }
        let within = self.unit * 5;
        match tokio::time::timeout(within, store.claim_in_batch(&mut batch, &held, &FP)).await {
            Ok(Ok(Claim::InFlight { .. })) => {}
            Ok(other) => {
                return Err(format!(
                    "a key held elsewhere got {}, not InFlight, in a batch",
                    show(&other)
                ));
            }
            Err(_) => {
                return Err(format!(
                    "a batch's claim waited over {within:?} for the holder"
                ));
            }
        }
        // Ended before the batch writes: SQLite writes one transaction at a
        // time.
        drop(holder);
        claim_in_batch(store, &mut batch, &new).await?;
        write(fx, &mut batch, &id(&new)).await?;
        complete_in_batch(store, &mut batch, &new).await?;
        in_batch(store.commit_batch(batch).await, "the batch's commit")?;
        expect_count(fx, &id(&new), 1, "a batch that answered found keys").await
    }

    async fn a_dropped_batch_leaves_nothing(&self, key: StorageKey) -> Outcome {
        if !St::BATCHES {
            return Ok(());
        }
        let store = &self.store;
        let fx = &*self.effects;
        let u = self.unit;
        let id = |what: &str| format!("{}-{what}", &key.as_str()[key.as_str().len() - 16..]);
        let mut batch = begin(store).await?;
        claim_in_batch(store, &mut batch, &key).await?;
        write(fx, &mut batch, &id("dropped")).await?;
        complete_in_batch(store, &mut batch, &key).await?;
        // The process died mid-batch: no one commits it.
        drop(batch);
        self.acquire_within(&key, u * 5, "after a batch was dropped")
            .await?;
        expect_count(fx, &id("dropped"), 0, "after a batch was dropped").await
    }

    async fn acquire(&self, key: &StorageKey) -> Result<St::Granted, String> {
        match self.store.claim(key, &FP, self.unit * 2).await {
            Ok(Claim::Acquired(tx)) if tx.lent_to_work() => Ok(tx),
            Ok(Claim::Acquired(_)) => Err(
                "the claim is not lent to the work (a lease, not a transaction): run StoreContract"
                    .into(),
            ),
            other => Err(format!(
                "a claim of a free key got {}, not Acquired",
                show(&other)
            )),
        }
    }

    /// A claim that must be answered within 5 units: a duplicate is told
    /// at once, it never waits for the holder.
    async fn claim_at_once(
        &self,
        key: &StorageKey,
    ) -> Result<Result<Claim<St::Granted>, StoreError>, String> {
        let within = self.unit * 5;
        tokio::time::timeout(within, self.store.claim(key, &FP, self.unit * 2))
            .await
            .map_err(|_| format!("a duplicate waited over {within:?} for the holder"))
    }

    /// The key is free again — at once or, where a dropped transaction
    /// ends in the background, within `within` — and claiming it works
    /// (the claim is released again).
    async fn acquire_within(&self, key: &StorageKey, within: Duration, when: &str) -> Outcome {
        let deadline = Instant::now() + within;
        loop {
            match self.store.claim(key, &FP, self.unit * 2).await {
                Ok(Claim::Acquired(tx)) => {
                    return ok(self.store.release(key, tx).await, "release");
                }
                Ok(Claim::InFlight { .. }) if Instant::now() < deadline => {
                    tokio::time::sleep(self.unit / 4).await;
                }
                other => {
                    return Err(format!(
                        "{when}, a claim got {}, not Acquired",
                        show(&other)
                    ));
                }
            }
        }
    }
}

/// Three keys of their own, beside a rule's `key`.
fn others(key: &StorageKey) -> [StorageKey; 3] {
    ["a", "b", "c"].map(|which| {
        let key = IdempotencyKey::new(format!("{which}-{key}")).expect("a valid key");
        StorageKey::new("batches", &key)
    })
}

async fn begin<St: Store>(store: &St) -> Result<St::Granted, String> {
    store
        .begin_batch()
        .await
        .map_err(|e| format!("beginning a batch failed: {e}"))
}

async fn claim_in_batch<St: Store>(
    store: &St,
    batch: &mut St::Granted,
    key: &StorageKey,
) -> Outcome {
    match store.claim_in_batch(batch, key, &FP).await {
        Ok(Claim::Acquired(())) => Ok(()),
        other => Err(format!(
            "a claim of a free key in a batch got {}, not Acquired",
            show(&other)
        )),
    }
}

async fn complete_in_batch<St: Store>(
    store: &St,
    batch: &mut St::Granted,
    key: &StorageKey,
) -> Outcome {
    let completed = store
        .complete_in_batch(batch, key, &FP, Arc::new(record()), day())
        .await;
    in_batch(completed, "the completion in a batch")
}

fn in_batch(done: Result<(), StoreError>, what: &str) -> Outcome {
    done.map_err(|error| format!("{what} failed: {error}"))
}

async fn write<C: ?Sized, G: DerefMut<Target = C>>(
    fx: &impl TxEffects<C>,
    tx: &mut G,
    id: &str,
) -> Outcome {
    fx.write(&mut **tx, id)
        .await
        .map_err(|e| format!("writing the effect {id}: {e}"))
}

async fn commit<St: Store>(
    store: &St,
    key: &StorageKey,
    tx: &mut St::Granted,
    retention: Duration,
) -> Outcome {
    let committed = store
        .complete(key, tx, &FP, Arc::new(record()), retention)
        .await;
    ok(committed, "the completion (the commit)")
}

fn ok(done: Result<bool, StoreError>, what: &str) -> Outcome {
    match done {
        Ok(true) => Ok(()),
        Ok(false) => Err(format!("{what} was refused")),
        Err(error) => Err(format!("{what} failed: {error}")),
    }
}

async fn expect_count<C: ?Sized>(
    fx: &impl TxEffects<C>,
    id: &str,
    want: u64,
    when: &str,
) -> Outcome {
    match fx.count(id).await {
        Ok(n) if n == want => Ok(()),
        Ok(n) => Err(format!("{when}: {n} effects committed, not {want}")),
        Err(e) => Err(format!("{when}: counting the effects failed: {e}")),
    }
}
