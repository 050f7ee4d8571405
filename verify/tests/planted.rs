//! The checker, validated: each invariant fails against a server with the
//! bug it guards against planted — one that re-executes retries, one that
//! loses its records on restart, one that replays another key's answer, one
//! that ignores the scope, one that wedges its keys in flight — and passes
//! against the crate as it is. Each server is the crate's layer in this
//! process, over a store with the bug, in front of an in-memory ledger.

use std::{
    net::SocketAddr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};

use axum::{
    Json, Router,
    extract::State,
    http::{StatusCode, request::Parts},
    routing::post,
};
use tower_idempotency::{
    CompletedRecord, Fingerprint, IdempotencyLayer, MemoryStore,
    store::{Claim, LeaseToken, StorageKey, Store, StoreError},
};
use tower_idempotency_verify::{
    checker::{self, Report},
    history::{Effect, Recorder},
    workload::{Clients, Workload},
};

/// The bug a store has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Bug {
    None,
    /// A completed key is claimed again: every retry executes.
    ReExecutes,
    /// Every so often the store starts empty, as after a restart without
    /// persistence.
    LosesRecords,
    /// A completed key replays the last answer stored, whatever its key.
    ReplaysAnother,
    /// A key once claimed stays in flight for good: wedged.
    Wedges,
}

#[derive(Clone)]
struct Planted {
    bug: Bug,
    inner: Arc<Mutex<MemoryStore>>,
    last: Arc<Mutex<Option<Arc<CompletedRecord>>>>,
    wedged: Arc<Mutex<std::collections::HashSet<StorageKey>>>,
}

impl Planted {
    fn new(bug: Bug) -> Self {
        let store = Self {
            bug,
            inner: Arc::new(Mutex::new(MemoryStore::new())),
            last: Arc::default(),
            wedged: Arc::default(),
        };
        if bug == Bug::LosesRecords {
            let inner = store.inner.clone();
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(Duration::from_millis(700)).await;
                    *inner.lock().unwrap() = MemoryStore::new();
                }
            });
        }
        store
    }

    fn inner(&self) -> MemoryStore {
        self.inner.lock().unwrap().clone()
    }
}

impl Store for Planted {
    type Granted = LeaseToken;

    async fn claim(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<Claim, StoreError> {
        if self.bug == Bug::Wedges && !self.wedged.lock().unwrap().insert(key.clone()) {
            return Ok(Claim::InFlight {
                retry_after: Duration::from_millis(100),
            });
        }
        let claim = self.inner().claim(key, fingerprint, lease).await?;
        Ok(match (self.bug, claim) {
            (Bug::ReExecutes, Claim::Completed { .. }) => Claim::Acquired(LeaseToken::generate()),
            (Bug::ReplaysAnother, Claim::Completed { record, expires_in }) => Claim::Completed {
                record: self.last.lock().unwrap().clone().unwrap_or(record),
                expires_in,
            },
            (_, claim) => claim,
        })
    }

    async fn extend(
        &self,
        key: &StorageKey,
        token: LeaseToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        self.inner().extend(key, token, lease).await
    }

    async fn complete(
        &self,
        key: &StorageKey,
        token: &mut LeaseToken,
        fingerprint: &Fingerprint,
        record: Arc<CompletedRecord>,
        retention: Duration,
    ) -> Result<bool, StoreError> {
        *self.last.lock().unwrap() = Some(record.clone());
        self.inner()
            .complete(key, token, fingerprint, record, retention)
            .await
    }

    async fn release(&self, key: &StorageKey, token: LeaseToken) -> Result<bool, StoreError> {
        self.inner().release(key, token).await
    }
}

#[derive(serde::Deserialize)]
struct NewCharge {
    amount: i64,
    description: String,
}

#[derive(Clone, Default)]
struct Ledger {
    effects: Arc<Mutex<Vec<Effect>>>,
    next: Arc<AtomicU64>,
}

fn account(parts: &Parts) -> Option<String> {
    parts
        .headers
        .get("authorization")?
        .to_str()
        .ok()?
        .strip_prefix("Bearer ")
        .map(str::to_owned)
}

/// Serves the charges route over `store` (scoped unless `ignore_scope`)
/// on a free port.
async fn serve(store: Planted, ignore_scope: bool, ledger: Ledger) -> SocketAddr {
    let charge = async |State(ledger): State<Ledger>, parts: Parts, Json(new): Json<NewCharge>| {
        let account = account(&parts).unwrap_or_default();
        let id = format!("ch_{}", ledger.next.fetch_add(1, Ordering::SeqCst));
        ledger.effects.lock().unwrap().push(Effect {
            id: id.clone(),
            account: account.clone(),
            amount: new.amount,
            key: new.description.clone(),
        });
        let body = serde_json::json!({"id": id, "account": account, "amount": new.amount, "description": new.description});
        (StatusCode::CREATED, Json(body))
    };
    let layer = IdempotencyLayer::new(store).lease(Duration::from_millis(500));
    let routes = Router::new()
        .route("/v1/charges", post(charge))
        .with_state(ledger);
    let app = if ignore_scope {
        routes.layer(layer.single_tenant())
    } else {
        routes.layer(layer.scope_with(account))
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

/// Three seconds of the workload against a server with `bug`, then the
/// final pass, checked.
async fn soak(bug: Bug, ignore_scope: bool) -> Report {
    let dir = std::env::temp_dir().join(format!(
        "verify-planted-{bug:?}-{ignore_scope}-{}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let recorder = Recorder::create(&dir.join("history.jsonl")).unwrap();
    let ledger = Ledger::default();
    let addr = serve(Planted::new(bug), ignore_scope, ledger.clone()).await;
    let workload = Workload {
        workers: 4,
        shared_keys: 0.3,
        deadline: Duration::from_secs(2),
        ..Workload::default()
    };
    let clients = Clients::new(recorder.clone(), workload, vec![addr.to_string()], 7);
    let stop = Arc::new(AtomicBool::new(false));
    let running = tokio::spawn({
        let (clients, stop) = (clients.clone(), stop.clone());
        async move { clients.run(stop).await }
    });
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.store(true, Ordering::Relaxed);
    running.await.unwrap();
    clients.final_pass().await;
    let effects = ledger.effects.lock().unwrap().clone();
    let report = checker::check(&recorder.events(), &effects, &[]);
    let _ = std::fs::remove_dir_all(&dir);
    report
}

fn kinds(report: &Report) -> Vec<&'static str> {
    let mut kinds: Vec<_> = report.violations.iter().map(|v| v.name()).collect();
    kinds.dedup();
    kinds
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_crate_as_it_is_passes() {
    let report = soak(Bug::None, false).await;
    assert!(report.ops > 50, "{report}");
    assert!(report.passed(), "{report}\n{:?}", report.violations);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_re_executes_retries_is_caught_as_duplicated() {
    let report = soak(Bug::ReExecutes, false).await;
    assert!(kinds(&report).contains(&"duplicated"), "{report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_loses_records_on_restart_is_caught_as_duplicated() {
    let report = soak(Bug::LosesRecords, false).await;
    assert!(kinds(&report).contains(&"duplicated"), "{report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_replays_another_body_is_caught_as_inconsistent() {
    let report = soak(Bug::ReplaysAnother, false).await;
    assert!(kinds(&report).contains(&"inconsistent"), "{report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_ignores_the_scope_is_caught_crossing_tenants() {
    let report = soak(Bug::None, true).await;
    assert!(kinds(&report).contains(&"cross-tenant"), "{report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_whose_keys_stay_in_flight_is_caught_as_stuck() {
    let report = soak(Bug::Wedges, false).await;
    assert!(kinds(&report).contains(&"stuck"), "{report}");
}
