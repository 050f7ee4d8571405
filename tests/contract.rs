//! The store contract kit (`testing::StoreContract`): every lease store of
//! the crate keeps it, on real servers; and each rule fails against a toy
//! store with that one bug planted.

mod support;

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use tower_idempotency::{
    CompletedRecord, Fingerprint,
    store::{Claim, Forgotten, KeyState, LeaseToken, StorageKey, Store, StoreError},
    testing::{RULES, StoreContract},
};

use support::backend::{
    Backend, CachedRedis, Cluster, Memory, MySql, Postgres, SingleRedis, Sqlite,
};

async fn keeps_the_contract<B: Backend>(backend: B)
where
    B::Store: Store<Granted = LeaseToken>,
{
    let store = backend.store().await;
    StoreContract::new(|| async { store.clone() })
        .assert()
        .await;
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
    map: Arc<Mutex<HashMap<StorageKey, Entry>>>,
}

impl Toy {
    fn new(bug: Bug) -> Self {
        Self {
            bug,
            map: Arc::default(),
        }
    }

    fn live(&self, key: &StorageKey) -> Option<Entry> {
        let map = self.map.lock().unwrap();
        map.get(key).filter(|e| e.3 > Instant::now()).cloned()
    }

    fn held_by(&self, key: &StorageKey, token: LeaseToken) -> bool {
        self.bug == Bug::NoFencing || matches!(self.live(key), Some((_, Err(t), ..)) if t == token)
    }
}

impl Store for Toy {
    type Granted = LeaseToken;

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
        let grant = |map: &mut HashMap<StorageKey, Entry>| {
            let token = LeaseToken::generate();
            map.insert(key.clone(), (*fp, Err(token), now, expiry));
            Ok(Claim::Acquired(token))
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
            && let Some(entry) = self.map.lock().unwrap().get_mut(key)
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
        let Some(entry) = map.get_mut(key) else {
            return Ok(false);
        };
        entry.1 = Ok(record);
        let from = if self.bug == Bug::RetentionFromClaim {
            entry.2
        } else {
            Instant::now()
        };
        entry.3 = from + retention;
        Ok(true)
    }

    async fn release(&self, key: &StorageKey, token: LeaseToken) -> Result<bool, StoreError> {
        if !self.held_by(key, token) {
            return Ok(false);
        }
        if self.bug != Bug::ReleaseKeeps {
            self.map.lock().unwrap().remove(key);
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
        let mut map = self.map.lock().unwrap();
        let live = map.get(key).filter(|e| e.3 > Instant::now()).cloned();
        Ok(match live {
            None => Forgotten::Nothing,
            Some((_, Ok(_), ..)) => {
                map.remove(key);
                Forgotten::Completed
            }
            Some((_, Err(_), ..)) if force => {
                map.remove(key);
                Forgotten::ForcedInFlight
            }
            Some(_) => Forgotten::InFlight,
        })
    }
}

async fn broken_rules(bug: Bug) -> Vec<&'static str> {
    StoreContract::new(|| async move { Toy::new(bug) })
        .time_unit(Duration::from_millis(100))
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
    ];
    let mut caught = Vec::new();
    for (bug, rule) in planted {
        let broken = broken_rules(bug).await;
        assert!(
            broken.contains(&rule),
            "{bug:?} should break {rule}, broke {broken:?}"
        );
        caught.push(rule);
    }
    caught.sort_unstable();
    let mut all = RULES.to_vec();
    all.sort_unstable();
    assert_eq!(caught, all, "every rule is shown to fail");
}
