//! The store contract kits (`testing::StoreContract`,
//! `testing::TxStoreContract`): every store of the crate keeps its
//! contract, on real servers; and each rule fails against a toy store with
//! that one bug planted.

// The suite runs against every store: `cargo test --all-features`.
#![cfg(every_store)]

mod support;

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant, SystemTime},
};

use tower_idempotency::{
    CompletedRecord, CorruptRecord, Fingerprint,
    store::{
        Claim, FailedCompletion, Forgotten, Granted, Held, KeyState, Lapsed, LeaseToken,
        StorageKey, Store, StoreError,
    },
    testing::{RULES, StoreContract, TX_RULES, TxEffects, TxStoreContract},
};

use support::backend::{
    Backend, CachedRedis, Cluster, Dynamo, DynamoTxBackend, Memory, MySql, MySqlTx, Postgres,
    PostgresTx, SingleRedis, Sqlite, SqliteTx, TxBackend,
};

async fn keeps_the_contract<B: Backend>(backend: B)
where
    B::Store: Store<Granted = LeaseToken>,
{
    let store = backend.store().await;
    let mut contract = StoreContract::new(|| async { store.clone() });
    if let Some(corrupt) = backend.corrupter(&store) {
        contract = contract.corrupting(move |key| corrupt(key));
    }
    contract.assert().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_memory_store_keeps_the_contract() {
    keeps_the_contract(Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_keeps_the_contract() {
    keeps_the_contract(SingleRedis::start()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_behind_the_replay_cache_keeps_the_contract() {
    keeps_the_contract(CachedRedis::start()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_keeps_the_contract() {
    keeps_the_contract(Cluster::start()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn valkey_keeps_the_contract() {
    keeps_the_contract(SingleRedis::valkey()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn valkey_behind_the_replay_cache_keeps_the_contract() {
    keeps_the_contract(CachedRedis::valkey()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn valkey_cluster_keeps_the_contract() {
    keeps_the_contract(Cluster::valkey()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_keeps_the_contract() {
    keeps_the_contract(Postgres::start()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_keeps_the_contract() {
    keeps_the_contract(Sqlite::start()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_keeps_the_contract() {
    keeps_the_contract(MySql::start()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dynamodb_keeps_the_contract() {
    keeps_the_contract(Dynamo::start()).await;
}

/// One bug a toy store can have.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Bug {
    None,
    /// Every claim is granted, held or not.
    NoExclusion,
    /// The payload is not compared: another payload replays.
    NoMismatch,
    /// A release leaves the claim in place.
    ReleaseKeeps,
    /// Leases never expire.
    LeasesForever,
    /// Tokens are not checked: a stale holder may complete.
    NoFencing,
    /// `extend` answers `true` and extends nothing.
    FakeHeartbeat,
    /// Retention counts from the claim, not the completion.
    RetentionFromClaim,
    /// `inspect` says absent whatever is there.
    BlindInspect,
    /// The check and the insert of a claim are two steps: concurrent claims
    /// both pass the check.
    RacyClaim,
    /// Records are addressed by the key alone: another tenant's replays.
    IgnoresScope,
    /// Keys are folded to lower case: `Order-42` replays `order-42`'s.
    FoldsCase,
    /// Records are kept 5 s at most, whatever the retention asked.
    CapsRetention,
    /// A release is not fenced: a stranger's token frees the key.
    ReleaseUnfenced,
    /// The fingerprint is compared before the record is read: an
    /// unreadable record under another fingerprint is a mismatch.
    ComparesBeforeReading,
    /// A claim over a lapsed one is reported as a first claim.
    TakeoverUntold,
}

type Entry = (
    Fingerprint,
    Result<Arc<CompletedRecord>, LeaseToken>,
    Instant,
    Instant,
);

/// A store in memory with expiry, correct unless `bug` says otherwise.
#[derive(Clone)]
struct Toy {
    bug: Bug,
    map: Arc<Mutex<HashMap<String, Entry>>>,
    /// The slots whose record was made unreadable.
    garbled: Arc<Mutex<std::collections::HashSet<String>>>,
    /// Each slot's last claim: the claims lapsed before it, and since when.
    traces: Arc<Mutex<HashMap<String, Lapsed>>>,
}

impl Toy {
    fn new(bug: Bug) -> Self {
        Self {
            bug,
            map: Arc::default(),
            garbled: Arc::default(),
            traces: Arc::default(),
        }
    }

    fn garble(&self, key: &StorageKey) {
        self.garbled.lock().unwrap().insert(self.slot(key));
    }

    /// Where a key's record lives: its storage key, unless a bug says
    /// otherwise.
    fn slot(&self, key: &StorageKey) -> String {
        let (scope, key) = key.as_str().split_once(':').expect("scope:key");
        match self.bug {
            Bug::IgnoresScope => key.to_owned(),
            Bug::FoldsCase => format!("{scope}:{}", key.to_ascii_lowercase()),
            _ => format!("{scope}:{key}"),
        }
    }

    fn live(&self, key: &StorageKey) -> Option<Entry> {
        let map = self.map.lock().unwrap();
        map.get(&self.slot(key))
            .filter(|e| e.3 > Instant::now())
            .cloned()
    }

    fn held_by(&self, key: &StorageKey, token: LeaseToken) -> bool {
        self.bug == Bug::NoFencing || matches!(self.live(key), Some((_, Err(t), ..)) if t == token)
    }
}

impl Store for Toy {
    type Granted = LeaseToken;
    const REPORTS_TAKEOVERS: bool = true;

    async fn claim(
        &self,
        key: &StorageKey,
        fp: &Fingerprint,
        lease: Duration,
    ) -> Result<Claim, StoreError> {
        let now = Instant::now();
        let expiry = if self.bug == Bug::LeasesForever {
            now + Duration::from_secs(3600)
        } else {
            now + lease
        };
        let found = self.live(key);
        if self.bug == Bug::RacyClaim {
            tokio::task::yield_now().await;
        }
        if let Some((stored, ..)) = &found
            && self.garbled.lock().unwrap().contains(&self.slot(key))
        {
            if self.bug == Bug::ComparesBeforeReading && stored != fp {
                return Ok(Claim::Mismatch);
            }
            return Err(CorruptRecord("garbled").into());
        }
        let slot = self.slot(key);
        let grant = |map: &mut HashMap<String, Entry>| {
            let token = LeaseToken::generate();
            let mut traces = self.traces.lock().unwrap();
            // A claim still there, not live: it lapsed, and is taken over.
            let lapsed = match map.get(&slot) {
                Some((_, Err(_), ..)) => traces.get(&slot).map(|trace| Lapsed {
                    attempts: trace.attempts + 1,
                    since: trace.since,
                }),
                _ => None,
            };
            let first = Lapsed {
                attempts: 0,
                since: SystemTime::now(),
            };
            traces.insert(slot.clone(), lapsed.unwrap_or(first));
            map.insert(slot, (*fp, Err(token), now, expiry));
            Ok(match lapsed {
                Some(lapsed) if self.bug != Bug::TakeoverUntold => Claim::TakenOver {
                    granted: token,
                    lapsed,
                },
                _ => Claim::Acquired(token),
            })
        };
        let mut map = self.map.lock().unwrap();
        match found {
            None => grant(&mut map),
            _ if self.bug == Bug::NoExclusion => grant(&mut map),
            Some((stored, ..)) if stored != *fp && self.bug != Bug::NoMismatch => {
                Ok(Claim::Mismatch)
            }
            Some((_, Err(_), _, until)) => Ok(Claim::InFlight {
                retry_after: until - now,
            }),
            Some((_, Ok(record), _, until)) => Ok(Claim::Completed {
                record,
                expires_in: until - now,
            }),
        }
    }

    async fn extend(
        &self,
        key: &StorageKey,
        token: LeaseToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        if !self.held_by(key, token) {
            return Ok(false);
        }
        if self.bug != Bug::FakeHeartbeat
            && let Some(entry) = self.map.lock().unwrap().get_mut(&self.slot(key))
        {
            entry.3 = Instant::now() + lease;
        }
        Ok(true)
    }

    async fn complete(
        &self,
        key: &StorageKey,
        token: &mut LeaseToken,
        _: &Fingerprint,
        record: Arc<CompletedRecord>,
        retention: Duration,
    ) -> Result<bool, StoreError> {
        if !self.held_by(key, *token) {
            return Ok(false);
        }
        let mut map = self.map.lock().unwrap();
        let Some(entry) = map.get_mut(&self.slot(key)) else {
            return Ok(false);
        };
        entry.1 = Ok(record);
        let from = if self.bug == Bug::RetentionFromClaim {
            entry.2
        } else {
            Instant::now()
        };
        let retention = if self.bug == Bug::CapsRetention {
            retention.min(Duration::from_secs(5))
        } else {
            retention
        };
        entry.3 = from + retention;
        Ok(true)
    }

    async fn release(&self, key: &StorageKey, token: LeaseToken) -> Result<bool, StoreError> {
        let unfenced =
            self.bug == Bug::ReleaseUnfenced && matches!(self.live(key), Some((_, Err(_), ..)));
        if !self.held_by(key, token) && !unfenced {
            return Ok(false);
        }
        if self.bug != Bug::ReleaseKeeps {
            self.map.lock().unwrap().remove(&self.slot(key));
        }
        Ok(true)
    }

    async fn inspect(&self, key: &StorageKey) -> Result<KeyState, StoreError> {
        let now = Instant::now();
        Ok(match self.live(key) {
            _ if self.bug == Bug::BlindInspect => KeyState::Absent,
            None => KeyState::Absent,
            Some((_, Err(_), _, until)) => KeyState::InFlight {
                retry_after: until - now,
            },
            Some((_, Ok(record), _, until)) => KeyState::Completed {
                record,
                expires_in: until - now,
            },
        })
    }

    async fn forget(&self, key: &StorageKey, force: bool) -> Result<Forgotten, StoreError> {
        let slot = self.slot(key);
        let mut map = self.map.lock().unwrap();
        let live = map.get(&slot).filter(|e| e.3 > Instant::now()).cloned();
        Ok(match live {
            None => Forgotten::Nothing,
            Some((_, Ok(_), ..)) => {
                map.remove(&slot);
                Forgotten::Completed
            }
            Some((_, Err(_), ..)) if force => {
                map.remove(&slot);
                Forgotten::ForcedInFlight
            }
            Some(_) => Forgotten::InFlight,
        })
    }
}

async fn broken_rules(bug: Bug) -> Vec<&'static str> {
    // One toy for every rule (each uses keys of its own), so that the
    // corrupter reaches the store the rule holds.
    let toy = Toy::new(bug);
    let garbling = toy.clone();
    StoreContract::new(move || {
        let toy = toy.clone();
        async move { toy }
    })
    .corrupting(move |key| {
        garbling.garble(&key);
        async {}
    })
    .time_unit(Duration::from_millis(100))
    .model_cases(24, 1)
    .check()
    .await
    .into_iter()
    .map(|v| v.rule)
    .collect()
}

/// The toy store without bugs keeps the contract; each planted bug breaks
/// the rule that names it, so every rule can fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_rule_fails_against_a_store_with_its_bug_planted() {
    assert_eq!(broken_rules(Bug::None).await, Vec::<&str>::new());
    let planted = [
        (Bug::NoExclusion, "claims_exclude_each_other"),
        (
            Bug::NoMismatch,
            "completion_replays_and_other_payloads_mismatch",
        ),
        (Bug::ReleaseKeeps, "release_frees_the_key"),
        (Bug::LeasesForever, "an_expired_lease_lets_another_claim"),
        (Bug::NoFencing, "a_lost_lease_fences_its_holder_off"),
        (Bug::FakeHeartbeat, "heartbeats_keep_a_claim"),
        (
            Bug::RetentionFromClaim,
            "retention_counts_from_the_completion",
        ),
        (Bug::BlindInspect, "inspect_and_forget_tell_the_truth"),
        (Bug::RacyClaim, "concurrent_claims_grant_the_key_once"),
        (Bug::IgnoresScope, "scopes_keep_keys_apart"),
        (Bug::FoldsCase, "keys_compare_byte_for_byte"),
        (Bug::CapsRetention, "retention_is_kept_as_long_as_asked"),
        (Bug::ReleaseUnfenced, "behaves_as_the_model"),
        (
            Bug::ComparesBeforeReading,
            "an_unreadable_record_is_an_error_under_any_fingerprint",
        ),
        (Bug::TakeoverUntold, "takeovers_count_the_lapsed_attempts"),
    ];
    each_rule_is_caught(&planted, broken_rules, RULES).await;
}

/// Checks each planted bug side by side (the rules mostly wait on the
/// clock): each must break the rule that names it, and together they must
/// cover every rule in `rules`.
async fn each_rule_is_caught<B, Fut>(
    planted: &[(B, &'static str)],
    broken: impl Fn(B) -> Fut,
    rules: &[&'static str],
) where
    B: Copy + std::fmt::Debug,
    Fut: std::future::Future<Output = Vec<&'static str>> + Send + 'static,
{
    let checks: Vec<_> = planted
        .iter()
        .map(|&(bug, _)| tokio::spawn(broken(bug)))
        .collect();
    let mut caught = Vec::new();
    for (&(bug, rule), check) in planted.iter().zip(checks) {
        let broken = check.await.expect("the check runs to its end");
        assert!(
            broken.contains(&rule),
            "{bug:?} should break {rule}, broke {broken:?}"
        );
        caught.push(rule);
    }
    caught.sort_unstable();
    let mut all = rules.to_vec();
    all.sort_unstable();
    assert_eq!(caught, all, "every rule is shown to fail");
}

/// Every transactional store of the crate keeps the transactional
/// contract on its real server, its effects rows of a table beside the
/// records.
async fn keeps_the_tx_contract<B: TxBackend>(backend: B) {
    let (store, charges) = backend.store_and_charges().await;
    TxStoreContract::new(store, charges).assert().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_tx_keeps_the_tx_contract() {
    keeps_the_tx_contract(PostgresTx::start()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_tx_keeps_the_tx_contract() {
    keeps_the_tx_contract(SqliteTx::start()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_tx_keeps_the_tx_contract() {
    keeps_the_tx_contract(MySqlTx::start()).await;
}

/// DynamoDB's transactional store, its effects items of a `charges` table
/// added to the request's `TransactWriteItems`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dynamodb_tx_keeps_the_tx_contract() {
    let backend = DynamoTxBackend::start();
    let (store, charges) = backend.store_and_charges().await;
    TxStoreContract::new(store, charges).assert().await;
}

/// One bug a toy transactional store can have.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TxBug {
    None,
    /// The record commits, the effects are dropped.
    RecordOnly,
    /// A release commits the effects.
    ReleaseCommits,
    /// A dropped transaction leaves its claim behind: the key is wedged.
    DropWedges,
    /// After a failed statement the record commits without the effects.
    PartsAfterAFailure,
    /// Rolling back to a savepoint undoes nothing.
    SavepointIgnored,
    /// A duplicate waits for the holder's transaction to end.
    DuplicateWaits,
    /// A claim lapses like a lease: a paused holder's key is claimed again.
    ClaimLapses,
    /// The check and the insert of a claim are two steps.
    RacyClaim,
    /// Writes kept without a record are rolled back.
    KeepingRollsBack,
    /// Records never expire.
    NeverExpires,
    /// Records are addressed by the key alone.
    IgnoresScope,
    /// A key undone in a batch keeps its work's writes.
    BatchUndoesNothing,
    /// A key found in a batch leaves the batch aborted (no savepoint).
    BatchAbortsOnAFind,
    /// A dropped batch commits.
    DroppedBatchCommits,
}

/// The toy's committed state: claims, records and effects.
#[derive(Default)]
struct Ledger {
    keys: HashMap<String, Slot>,
    effects: Vec<String>,
}

enum Slot {
    Held {
        tx: u64,
        until: Instant,
    },
    Done {
        fp: Fingerprint,
        record: Arc<CompletedRecord>,
        until: Instant,
    },
}

/// The toy's connection: the writes of a transaction not yet committed.
#[derive(Default)]
struct ToyConnection {
    pending: Vec<String>,
    savepoint: Option<usize>,
    aborted: bool,
    bug: Option<TxBug>,
}

struct ToyTx {
    id: u64,
    slot: String,
    connection: ToyConnection,
    ledger: Arc<Mutex<Ledger>>,
    open: bool,
    wedge: bool,
    /// A batch's keys: held, and the records completed in it.
    held: Vec<String>,
    records: Vec<(String, Fingerprint, Arc<CompletedRecord>, Duration)>,
}

impl std::ops::Deref for ToyTx {
    type Target = ToyConnection;
    fn deref(&self) -> &ToyConnection {
        &self.connection
    }
}

impl std::ops::DerefMut for ToyTx {
    fn deref_mut(&mut self) -> &mut ToyConnection {
        &mut self.connection
    }
}

impl Granted for ToyTx {
    fn held(&self) -> Held {
        Held::ForItsLife
    }

    fn lent_to_work(&self) -> bool {
        true
    }

    fn failed_completion(&self) -> FailedCompletion {
        FailedCompletion::NothingCommitted
    }
}

impl ToyTx {
    /// Ends the transaction: the claim goes, and so does everything else
    /// unless `commit` says what stays.
    fn end(&mut self, commit: Option<(Fingerprint, Arc<CompletedRecord>, Duration, bool)>) {
        self.open = false;
        let mut ledger = self.ledger.lock().unwrap();
        for slot in std::iter::once(&self.slot).chain(&self.held) {
            let ours =
                matches!(ledger.keys.get(slot), Some(Slot::Held { tx, .. }) if *tx == self.id);
            if ours {
                ledger.keys.remove(slot);
            }
        }
        if let Some((fp, record, retention, effects)) = commit {
            if effects {
                ledger.effects.append(&mut self.connection.pending);
            }
            if retention > Duration::ZERO {
                ledger.keys.insert(
                    self.slot.clone(),
                    Slot::Done {
                        fp,
                        record,
                        until: Instant::now() + retention,
                    },
                );
            }
        }
    }
}

impl ToyTx {
    /// Commits a batch: its records, and its effects.
    fn commit_batch(&mut self) {
        let records = std::mem::take(&mut self.records);
        self.end(None);
        let mut ledger = self.ledger.lock().unwrap();
        ledger.effects.append(&mut self.connection.pending);
        for (slot, fp, record, retention) in records {
            let until = Instant::now() + retention;
            ledger.keys.insert(slot, Slot::Done { fp, record, until });
        }
    }

    /// Undoes the key claimed in the batch last.
    fn undo(&mut self) {
        if let Some(slot) = self.held.pop() {
            self.ledger.lock().unwrap().keys.remove(&slot);
        }
        if let Some(at) = self.connection.savepoint.take()
            && self.connection.bug != Some(TxBug::BatchUndoesNothing)
        {
            self.connection.pending.truncate(at);
        }
        self.connection.aborted = false;
    }
}

impl Drop for ToyTx {
    fn drop(&mut self) {
        if self.open && self.connection.bug == Some(TxBug::DroppedBatchCommits) {
            self.commit_batch();
        } else if self.open && !self.wedge {
            self.end(None);
        }
    }
}

#[derive(Clone)]
struct ToyTxStore {
    bug: TxBug,
    ledger: Arc<Mutex<Ledger>>,
    next: Arc<std::sync::atomic::AtomicU64>,
}

impl ToyTxStore {
    fn new(bug: TxBug) -> Self {
        Self {
            bug,
            ledger: Arc::default(),
            next: Arc::default(),
        }
    }

    fn slot(&self, key: &StorageKey) -> String {
        let (scope, key) = key.as_str().split_once(':').expect("scope:key");
        if self.bug == TxBug::IgnoresScope {
            key.to_owned()
        } else {
            format!("{scope}:{key}")
        }
    }
}

impl ToyTxStore {
    fn grant(&self, ledger: &mut Ledger, slot: String, lease: Duration) -> Claim<ToyTx> {
        let id = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let until = Instant::now() + lease;
        ledger
            .keys
            .insert(slot.clone(), Slot::Held { tx: id, until });
        Claim::Acquired(ToyTx {
            id,
            slot,
            connection: ToyConnection {
                bug: Some(self.bug),
                ..ToyConnection::default()
            },
            ledger: self.ledger.clone(),
            open: true,
            wedge: self.bug == TxBug::DropWedges,
            held: Vec::new(),
            records: Vec::new(),
        })
    }
}

impl Store for ToyTxStore {
    type Granted = ToyTx;

    async fn claim(
        &self,
        key: &StorageKey,
        fp: &Fingerprint,
        lease: Duration,
    ) -> Result<Claim<ToyTx>, StoreError> {
        let slot = self.slot(key);
        if self.bug == TxBug::RacyClaim {
            let free = !self.ledger.lock().unwrap().keys.contains_key(&slot);
            if free {
                // Checked, then inserted: another claim may pass between.
                tokio::task::yield_now().await;
                return Ok(self.grant(&mut self.ledger.lock().unwrap(), slot, lease));
            }
        }
        if self.bug == TxBug::DuplicateWaits {
            while matches!(
                self.ledger.lock().unwrap().keys.get(&slot),
                Some(Slot::Held { .. })
            ) {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        {
            let now = Instant::now();
            let mut ledger = self.ledger.lock().unwrap();
            match ledger.keys.get(&slot) {
                Some(Slot::Held { until, .. })
                    if self.bug == TxBug::ClaimLapses && *until <= now => {}
                Some(Slot::Done { until, .. }) if *until <= now => {}
                Some(Slot::Held { .. }) => {
                    return Ok(Claim::InFlight {
                        retry_after: Duration::from_secs(1),
                    });
                }
                Some(Slot::Done { fp: stored, .. }) if stored != fp => return Ok(Claim::Mismatch),
                Some(Slot::Done { record, until, .. }) => {
                    return Ok(Claim::Completed {
                        record: record.clone(),
                        expires_in: *until - now,
                    });
                }
                None => {}
            }
            Ok(self.grant(&mut ledger, slot, lease))
        }
    }

    async fn extend(&self, _: &StorageKey, _: LeaseToken, _: Duration) -> Result<bool, StoreError> {
        Ok(false)
    }

    async fn complete(
        &self,
        _: &StorageKey,
        tx: &mut ToyTx,
        fp: &Fingerprint,
        record: Arc<CompletedRecord>,
        retention: Duration,
    ) -> Result<bool, StoreError> {
        let retention = if self.bug == TxBug::NeverExpires {
            Duration::from_secs(86_400)
        } else {
            retention
        };
        if tx.connection.aborted && self.bug != TxBug::PartsAfterAFailure {
            tx.end(None);
            return Ok(false);
        }
        let effects = self.bug != TxBug::RecordOnly && !tx.connection.aborted;
        tx.end(Some((*fp, record, retention, effects)));
        Ok(true)
    }

    async fn release(&self, _: &StorageKey, mut tx: ToyTx) -> Result<bool, StoreError> {
        if self.bug == TxBug::ReleaseCommits {
            tx.end(Some((
                Fingerprint::from_bytes([0; 32]),
                Arc::new(toy_record()),
                Duration::ZERO,
                true,
            )));
        } else {
            tx.end(None);
        }
        Ok(true)
    }

    const BATCHES: bool = true;

    async fn begin_batch(&self) -> Result<ToyTx, StoreError> {
        let id = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(ToyTx {
            id,
            slot: String::new(),
            connection: ToyConnection {
                bug: Some(self.bug),
                ..ToyConnection::default()
            },
            ledger: self.ledger.clone(),
            open: true,
            wedge: false,
            held: Vec::new(),
            records: Vec::new(),
        })
    }

    async fn claim_in_batch(
        &self,
        tx: &mut ToyTx,
        key: &StorageKey,
        fp: &Fingerprint,
    ) -> Result<Claim<()>, StoreError> {
        if tx.connection.aborted {
            return Err(StoreError::Unavailable("the batch is aborted".into()));
        }
        let slot = self.slot(key);
        let now = Instant::now();
        let mut ledger = self.ledger.lock().unwrap();
        let found = match ledger.keys.get(&slot) {
            Some(Slot::Held { .. }) => Some(Claim::InFlight {
                retry_after: Duration::from_secs(1),
            }),
            Some(Slot::Done { until, .. }) if *until <= now => None,
            Some(Slot::Done { fp: stored, .. }) if stored != fp => Some(Claim::Mismatch),
            Some(Slot::Done { record, until, .. }) => Some(Claim::Completed {
                record: record.clone(),
                expires_in: *until - now,
            }),
            None => None,
        };
        if let Some(found) = found {
            // Without a savepoint, what failed leaves the batch aborted.
            tx.connection.aborted = self.bug == TxBug::BatchAbortsOnAFind;
            return Ok(found);
        }
        ledger.keys.insert(
            slot.clone(),
            Slot::Held {
                tx: tx.id,
                until: now + Duration::from_secs(86_400),
            },
        );
        tx.held.push(slot);
        tx.connection.savepoint = Some(tx.connection.pending.len());
        Ok(Claim::Acquired(()))
    }

    async fn complete_in_batch(
        &self,
        tx: &mut ToyTx,
        key: &StorageKey,
        fp: &Fingerprint,
        record: Arc<CompletedRecord>,
        retention: Duration,
    ) -> Result<(), StoreError> {
        if tx.connection.aborted {
            tx.undo();
            return Err(StoreError::Unavailable("the batch is aborted".into()));
        }
        tx.records.push((self.slot(key), *fp, record, retention));
        tx.connection.savepoint = None;
        Ok(())
    }

    async fn release_in_batch(&self, tx: &mut ToyTx, _: &StorageKey) -> Result<(), StoreError> {
        tx.undo();
        Ok(())
    }

    async fn commit_batch(&self, mut tx: ToyTx) -> Result<(), StoreError> {
        if tx.connection.aborted {
            return Err(StoreError::Unavailable("the batch is aborted".into()));
        }
        tx.commit_batch();
        Ok(())
    }

    async fn release_keeping_writes(
        &self,
        _: &StorageKey,
        mut tx: ToyTx,
    ) -> Result<bool, StoreError> {
        let keep = self.bug != TxBug::KeepingRollsBack;
        tx.end(Some((
            Fingerprint::from_bytes([0; 32]),
            Arc::new(toy_record()),
            Duration::ZERO,
            keep,
        )));
        Ok(true)
    }
}

fn toy_record() -> CompletedRecord {
    CompletedRecord::Message {
        result: None,
        created_at: std::time::SystemTime::UNIX_EPOCH,
    }
}

/// The toy's effects: its connection's pending writes, its ledger's
/// committed ones.
struct ToyEffects(Arc<Mutex<Ledger>>);

impl TxEffects<ToyConnection> for ToyEffects {
    async fn write(&self, tx: &mut ToyConnection, id: &str) -> Result<(), String> {
        if tx.aborted {
            return Err("the transaction is aborted".into());
        }
        tx.pending.push(id.to_owned());
        Ok(())
    }

    async fn write_in_rolled_back_savepoint(
        &self,
        tx: &mut ToyConnection,
        id: &str,
    ) -> Result<(), String> {
        tx.savepoint = Some(tx.pending.len());
        self.write(tx, id).await?;
        if tx.bug != Some(TxBug::SavepointIgnored) {
            let at = tx.savepoint.take().expect("set above");
            tx.pending.truncate(at);
        }
        Ok(())
    }

    async fn fail_a_statement(&self, tx: &mut ToyConnection) {
        // As PostgreSQL does: the rest of the transaction is refused.
        tx.aborted = true;
    }

    async fn count(&self, id: &str) -> Result<u64, String> {
        Ok(self
            .0
            .lock()
            .unwrap()
            .effects
            .iter()
            .filter(|e| *e == id)
            .count() as u64)
    }
}

async fn broken_tx_rules(bug: TxBug) -> Vec<&'static str> {
    let store = ToyTxStore::new(bug);
    let effects = ToyEffects(store.ledger.clone());
    TxStoreContract::new(store, effects)
        .time_unit(Duration::from_millis(100))
        .check()
        .await
        .into_iter()
        .map(|v| v.rule)
        .collect()
}

/// The toy transactional store without bugs keeps the contract; each
/// planted bug breaks the rule that names it, so every rule can fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_tx_rule_fails_against_a_store_with_its_bug_planted() {
    assert_eq!(broken_tx_rules(TxBug::None).await, Vec::<&str>::new());
    let planted = [
        (TxBug::RecordOnly, "record_and_effects_commit_together"),
        (TxBug::ReleaseCommits, "a_release_rolls_the_effects_back"),
        (TxBug::DropWedges, "a_dropped_transaction_leaves_nothing"),
        (
            TxBug::PartsAfterAFailure,
            "a_failed_statement_commits_all_or_nothing",
        ),
        (
            TxBug::SavepointIgnored,
            "a_rolled_back_savepoint_keeps_the_rest",
        ),
        (
            TxBug::DuplicateWaits,
            "a_duplicate_is_answered_at_once_then_replays",
        ),
        (TxBug::ClaimLapses, "a_paused_holder_keeps_its_claim"),
        (TxBug::RacyClaim, "concurrent_claims_grant_the_key_once"),
        (
            TxBug::KeepingRollsBack,
            "kept_writes_commit_without_a_record",
        ),
        (
            TxBug::NeverExpires,
            "an_expired_record_lets_the_key_run_again",
        ),
        (TxBug::IgnoresScope, "scopes_keep_keys_apart"),
        (
            TxBug::BatchUndoesNothing,
            "a_batch_commits_its_keys_together_and_undoes_one_alone",
        ),
        (
            TxBug::BatchAbortsOnAFind,
            "a_batch_answers_what_it_finds_and_goes_on",
        ),
        (TxBug::DroppedBatchCommits, "a_dropped_batch_leaves_nothing"),
    ];
    each_rule_is_caught(&planted, broken_tx_rules, TX_RULES).await;
}

/// The layer over a store that fails on purpose — claims that error or
/// whose grant is lost, completions whose acknowledgement is lost,
/// heartbeats and releases that stall or fail — never executes a key
/// twice, and every key is answered once the client retries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_layer_over_a_faulty_store_executes_each_key_once() {
    use axum::{extract::State, http::HeaderMap, routing::post};
    use support::http::{oneshot, post as request};
    use tower_idempotency::{
        MemoryStore,
        testing::{FaultyStore, Op},
    };

    type Runs = Arc<Mutex<HashMap<String, usize>>>;
    async fn charge(
        State(runs): State<Runs>,
        headers: HeaderMap,
    ) -> (http::StatusCode, &'static str) {
        let key = headers["idempotency-key"].to_str().unwrap().to_owned();
        // Every third key outlasts two heartbeats (one each 100 ms), so the
        // delayed extensions are exercised on every run, not by chance.
        let slow = key.trim_start_matches("faulty-").parse::<u32>().unwrap() % 3 == 0;
        *runs.lock().unwrap().entry(key).or_default() += 1;
        let pause = if slow { 230 } else { fastrand::u64(0..60) };
        tokio::time::sleep(Duration::from_millis(pause)).await;
        (http::StatusCode::CREATED, "charged")
    }

    let store = FaultyStore::new(MemoryStore::new())
        .seed(38)
        .errors(Op::Claim, 0.15)
        .lost_acknowledgements(Op::Claim, 0.1)
        .lost_acknowledgements(Op::Complete, 0.3)
        .errors(Op::Complete, 0.1)
        .delays(Op::Extend, 0.3, Duration::from_millis(150))
        .errors(Op::Release, 0.2);
    let runs = Runs::default();
    let app = charges_over(store.clone(), post(charge)).with_state(runs.clone());

    let keys: Vec<String> = (0..60).map(|i| format!("faulty-{i}")).collect();
    // Each key by two clients at once, each retrying until answered.
    let clients = keys
        .iter()
        .flat_map(|key| [key.clone(), key.clone()])
        .map(|key| {
            let app = app.clone();
            async move {
                for _ in 0..100 {
                    let reply = oneshot(&app, request("/charges", &key, r#"{"amount":1}"#)).await;
                    match reply.status.as_u16() {
                        201 => return true,
                        409 | 500 | 503 => tokio::time::sleep(Duration::from_millis(50)).await,
                        other => panic!("{key}: unexpected {other} {:?}", reply.body),
                    }
                }
                false
            }
        });
    let answered = futures_util::future::join_all(clients).await;
    assert!(answered.iter().all(|a| *a), "every key is answered");
    let runs = runs.lock().unwrap();
    for key in &keys {
        assert_eq!(runs.get(key), Some(&1), "{key} executed once");
    }
    let injected = store.injected();
    assert!(
        injected.errors > 10 && injected.lost > 10 && injected.delays > 0,
        "the faults were injected: {injected:?}"
    );
}

/// An extension still on its way to a slow store when the work ends is cut
/// short; the completion's retries make it up at once, not a whole interval
/// later, so the key stays claimed while its completion is retried and a
/// duplicate is told to wait rather than executed.
#[tokio::test(start_paused = true)]
async fn an_extension_cut_short_by_the_end_of_the_work_is_made_up_at_once() {
    use axum::{extract::State, routing::post};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use support::http::{oneshot, post as request};
    use tower_idempotency::{
        MemoryStore,
        testing::{FaultyStore, Op},
    };

    async fn charge(State(runs): State<Arc<AtomicUsize>>) -> (http::StatusCode, &'static str) {
        runs.fetch_add(1, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(120)).await;
        (http::StatusCode::CREATED, "charged")
    }

    // Lease 300 ms, a heartbeat every 100 ms; each extension takes 150 ms
    // to reach the store, and the store refuses every completion, so the
    // completion is retried for a whole lease.
    let store = FaultyStore::new(MemoryStore::new())
        .delays(Op::Extend, 1.0, Duration::from_millis(150))
        .errors(Op::Complete, 1.0);
    let runs = Arc::new(AtomicUsize::new(0));
    let app = charges_over(store.clone(), post(charge)).with_state(runs.clone());

    // Claimed at 0; the extension sent at 100 is dropped when the work ends
    // at 120, before it reached the store.
    let first = oneshot(&app, request("/charges", "slow-store", "{}")).await;
    assert_eq!(first.status, 201);
    // At 400 the claim's own lease (to 300) is over: only an extension
    // sent at once (reaching the store at 270) still holds the key.
    tokio::time::sleep(Duration::from_millis(280)).await;
    let duplicate = oneshot(&app, request("/charges", "slow-store", "{}")).await;
    assert_eq!(duplicate.status, 409, "{:?}", duplicate.body);
    assert_eq!(runs.load(Ordering::SeqCst), 1, "executed once");
    assert!(store.injected().delays >= 2, "{:?}", store.injected());
}

/// `/charges` by `route`, behind the layer over `store` with 300 ms leases.
fn charges_over<S: Clone + Send + Sync + 'static>(
    store: tower_idempotency::testing::FaultyStore<tower_idempotency::MemoryStore>,
    route: axum::routing::MethodRouter<S>,
) -> axum::Router<S> {
    axum::Router::new().route("/charges", route).layer(
        tower_idempotency::IdempotencyLayer::new(store)
            .single_tenant()
            .lease(Duration::from_millis(300)),
    )
}
