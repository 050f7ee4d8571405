//! Leases, for the stores whose claims are leases: a crashed claim expires
//! (and its retry is told it takes over), the heartbeat keeps a slow
//! handler's, and fencing refuses a stale holder.

use std::{sync::Arc, time::Duration};

use http::StatusCode;
use tower_idempotency::{
    IdempotencyKey, IdempotencyLayer,
    store::{Claim, LeaseToken, StorageKey, Store},
};

use super::{CHARGE, app_with, fingerprint_of};
use crate::support::{backend::Backend, http::Server};

pub async fn expired_lease_lets_a_retry_execute<B: Backend>(b: &B)
where
    B::Store: Store<Granted = LeaseToken>,
{
    let store = b.store().await;
    let (app, runs) = app_with(IdempotencyLayer::new(store.clone()).single_tenant());
    let server = Server::start(app).await;
    // A process claimed the key with a short lease, then crashed.
    let key = StorageKey::new("", &IdempotencyKey::new("k").unwrap());
    // Long enough that the probe below lands inside it on a loaded machine;
    // the retry then waits past it, however late it is woken.
    let lease = Duration::from_secs(2);
    let claimed_at = tokio::time::Instant::now();
    let claim = store
        .claim(&key, &fingerprint_of("/charges"), lease)
        .await
        .unwrap();
    assert!(matches!(claim, Claim::Acquired(_)));
    let blocked = server.post("/charges", "k", CHARGE).await;
    blocked.assert_problem(409);
    assert!(
        matches!(blocked.header("retry-after"), Some("1" | "2")),
        "{:?}",
        blocked.header("retry-after")
    );
    assert_eq!(runs.get(), 0);
    tokio::time::sleep_until(claimed_at + lease + Duration::from_millis(200)).await;
    let retry = server.post("/charges", "k", CHARGE).await;
    assert_eq!(
        retry.status,
        StatusCode::CREATED,
        "the crashed claim expired with its lease"
    );
    assert_eq!(runs.get(), 1);
    // The handler was told it took over, where the store can tell.
    let told = retry.header("x-attempt").unwrap_or_default();
    if B::Store::REPORTS_TAKEOVERS {
        assert!(told.starts_with("TakenOver { attempts: 1,"), "{told}");
    } else {
        assert_eq!(told, "Unknown");
    }
    // Its downstream key is the key's in every attempt, and no other key's.
    let downstream = retry.header("x-downstream-key").unwrap_or_default();
    assert_eq!(downstream.len(), 64, "{downstream}");
    let other = server.post("/charges", "other", CHARGE).await;
    let first = if B::Store::REPORTS_TAKEOVERS {
        "None"
    } else {
        "Unknown"
    };
    assert_eq!(other.header("x-attempt"), Some(first));
    assert_ne!(other.header("x-downstream-key"), Some(downstream));
}

pub async fn heartbeat_keeps_a_slow_handler_claimed<B: Backend>(b: &B)
where
    B::Store: Store<Granted = LeaseToken>,
{
    // A 6 s handler under a 1.5 s lease: four lease periods. The claim is
    // lost only if a heartbeat (every 0.5 s) is a whole second late, and the
    // probes end 1.2 s before the handler does: both margins hold on a
    // saturated machine. (With 300 ms leases, a heartbeat delayed past
    // 200 ms by a loaded CI machine lost the claim.)
    let layer = IdempotencyLayer::new(b.store().await)
        .single_tenant()
        .lease(Duration::from_millis(1500));
    let (app, runs) = app_with(layer);
    let server = Server::start(app).await;
    let first = server.post("/slow?ms=6000", "k", CHARGE);
    let probes = async {
        // Probe well past several lease periods: the heartbeat must keep the claim.
        for wait_ms in [1800, 1500, 1500] {
            tokio::time::sleep(Duration::from_millis(wait_ms)).await;
            server
                .post("/slow?ms=6000", "k", CHARGE)
                .await
                .assert_problem(409);
        }
    };
    let (first, ()) = tokio::join!(first, probes);
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(server.post("/slow?ms=6000", "k", CHARGE).await.is_replay());
    assert_eq!(runs.get(), 1, "the claim was never lost");
}

pub async fn fencing_refuses_a_stale_holder<B: Backend>(b: &B)
where
    B::Store: Store<Granted = LeaseToken>,
{
    let store = b.store().await;
    let key = StorageKey::new("acct", &IdempotencyKey::new("k").unwrap());
    let fp = fingerprint_of("/charges");
    let lease = Duration::from_millis(100);
    let Claim::Acquired(mut stale) = store.claim(&key, &fp, lease).await.unwrap() else {
        panic!("first claim must be acquired")
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (Claim::Acquired(mut fresh)
    | Claim::TakenOver {
        granted: mut fresh, ..
    }) = store
        .claim(&key, &fp, Duration::from_secs(30))
        .await
        .unwrap()
    else {
        panic!("the expired claim must be re-claimable")
    };
    assert_ne!(stale, fresh);
    let record = Arc::new(tower_idempotency::CompletedRecord::Unreplayable {
        status: StatusCode::OK,
        created_at: std::time::SystemTime::now(),
    });
    let day = Duration::from_secs(86_400);
    assert!(
        !store.extend(&key, stale, lease).await.unwrap(),
        "stale extend refused"
    );
    assert!(
        !store
            .complete(&key, &mut stale, &fp, record.clone(), day)
            .await
            .unwrap(),
        "stale complete refused"
    );
    assert!(
        !store.release(&key, stale).await.unwrap(),
        "stale release refused"
    );
    assert!(
        matches!(
            store.claim(&key, &fp, lease).await.unwrap(),
            Claim::InFlight { .. }
        ),
        "the newer claim is intact"
    );
    assert!(
        store
            .extend(&key, fresh, Duration::from_secs(30))
            .await
            .unwrap()
    );
    assert!(
        store
            .complete(&key, &mut fresh, &fp, record.clone(), day)
            .await
            .unwrap()
    );
    assert!(
        store
            .complete(&key, &mut fresh, &fp, record.clone(), day)
            .await
            .unwrap(),
        "a completion repeated after it was applied (its reply lost) is stored, not refused"
    );
    let other = Arc::new(tower_idempotency::CompletedRecord::Unreplayable {
        status: StatusCode::CREATED,
        created_at: std::time::SystemTime::now(),
    });
    assert!(
        !store
            .complete(&key, &mut fresh, &fp, other, day)
            .await
            .unwrap(),
        "a record completes once: another record never replaces it"
    );
    assert!(
        !store.release(&key, fresh).await.unwrap(),
        "a completed record cannot be released"
    );
    assert!(matches!(
        store.claim(&key, &fp, lease).await.unwrap(),
        Claim::Completed { .. }
    ));
}
