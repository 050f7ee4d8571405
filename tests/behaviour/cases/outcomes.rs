//! What is stored and what released: store policies, handler errors and
//! panics, oversized responses, retention, custom rejections.

use std::{sync::Arc, time::Duration};

use axum::body::Body;
use http::{HeaderMap, Request, StatusCode};
use tower::{ServiceExt, service_fn};
use tower_idempotency::{
    Completion, DefaultStorePolicy, IDEMPOTENCY_REPLAYABLE_FOR, IdempotencyLayer,
    IdempotencyOutcome, RejectionKind, StoreAllPolicy, StorePolicy,
};

use super::{CHARGE, app_with};
use crate::support::{
    backend::Backend,
    http::{Server, oneshot, post},
};

/// A handler's own "do not replay": `Cache-Control: no-store` on a 201, the
/// `NoReplay` marker on a 422, whatever the store policy says (it would
/// store both): sent, not stored, the key released — every retry runs the
/// handler.
pub async fn a_response_that_opts_out_is_sent_not_stored<B: Backend>(b: &B) {
    let (app, runs) = app_with(
        IdempotencyLayer::new(b.store().await)
            .single_tenant()
            .store_when(StoreAllPolicy),
    );
    for (path, status) in [("/no-store", 201), ("/no-replay", 422)] {
        let before = runs.get();
        for attempt in 1..=3 {
            let reply = oneshot(&app, post(path, "k", "")).await;
            assert_eq!(reply.status.as_u16(), status, "{path}");
            assert!(!reply.is_replay(), "{path}");
            assert_eq!(
                reply.outcome,
                Some(IdempotencyOutcome::Executed(Completion::Released)),
                "{path}"
            );
            assert_eq!(runs.get(), before + attempt, "{path}: run again");
        }
    }
}

pub async fn non_final_responses_release_the_key<B: Backend>(b: &B) {
    let (app, runs) = app_with(IdempotencyLayer::new(b.store().await).single_tenant());
    for (i, code) in [408u16, 425, 429, 502, 503, 504].into_iter().enumerate() {
        let path = format!("/status/{code}");
        let key = format!("k{code}");
        for attempt in 1..=2 {
            let reply = oneshot(&app, post(&path, &key, "")).await;
            assert_eq!(reply.status.as_u16(), code);
            assert!(!reply.is_replay());
            assert_eq!(
                reply.outcome,
                Some(IdempotencyOutcome::Executed(Completion::Released))
            );
            assert_eq!(runs.get(), i * 2 + attempt);
        }
    }
    // Refused for its parameters or credentials before anything ran: the
    // corrected request executes under the same key.
    let before = runs.get();
    for code in [400u16, 401, 403, 413, 415, 422, 431] {
        let path = format!("/status/{code}");
        let key = format!("k{code}");
        for _ in 0..2 {
            let reply = oneshot(&app, post(&path, &key, "")).await;
            assert_eq!(reply.status.as_u16(), code);
            assert_eq!(
                reply.outcome,
                Some(IdempotencyOutcome::Executed(Completion::Released)),
                "{code}"
            );
        }
    }
    assert_eq!(runs.get(), before + 14);
    // Answers produced by executing, errors included, are stored.
    for code in [200u16, 402, 404] {
        let path = format!("/status/{code}");
        let key = format!("k{code}");
        oneshot(&app, post(&path, &key, "")).await;
        let retry = oneshot(&app, post(&path, &key, "")).await;
        assert!(retry.is_replay(), "{code} should be stored");
        assert_eq!(retry.status.as_u16(), code);
    }
    assert_eq!(runs.get(), 12 + 14 + 3);
    // A server error is stored where the handler's effects live apart from
    // the record; where they commit with it, it rolls back and releases the
    // key, on every engine.
    oneshot(&app, post("/status/500", "k500", "")).await;
    let retry = oneshot(&app, post("/status/500", "k500", "")).await;
    assert_eq!(retry.status, StatusCode::INTERNAL_SERVER_ERROR);
    if B::TRANSACTIONS {
        assert!(
            !retry.is_replay(),
            "a 5xx rolls back on a transactional store"
        );
        assert_eq!(runs.get(), 12 + 14 + 3 + 2);
    } else {
        assert!(retry.is_replay(), "500 should be stored");
        assert_eq!(runs.get(), 12 + 14 + 3 + 1);
    }
}

pub async fn store_all_keeps_every_status<B: Backend>(b: &B) {
    let (app, runs) = app_with(
        IdempotencyLayer::new(b.store().await)
            .single_tenant()
            .store_when(StoreAllPolicy),
    );
    for code in ["503", "500"] {
        let path = format!("/status/{code}");
        oneshot(&app, post(&path, code, "")).await;
        let retry = oneshot(&app, post(&path, code, "")).await;
        assert!(
            retry.is_replay(),
            "{code}: stored, even on a transactional store"
        );
        assert_eq!(retry.status.as_str(), code);
    }
    assert_eq!(runs.get(), 2);
}

/// A client fixes a rejected request — it had no JSON content type, then
/// a typo in its JSON — and sends it again under the same key: by default
/// the rejections released the key, so the corrected request executes. A
/// policy that stores every client error burns the key instead: the fixed
/// request is another request under a used key, `422`.
pub async fn a_corrected_request_executes_under_its_key_unless_client_errors_are_stored<
    B: Backend,
>(
    b: &B,
) {
    let unlabelled = |key: &str| {
        let mut req = post("/orders", key, CHARGE);
        req.headers_mut().remove(http::header::CONTENT_TYPE);
        req
    };

    let every_client_error = |status: StatusCode, h: &HeaderMap| {
        status.is_client_error() || DefaultStorePolicy.should_store(status, h)
    };
    let (app, runs) = app_with(
        IdempotencyLayer::new(b.store().await)
            .single_tenant()
            .store_when(every_client_error),
    );
    let rejected = oneshot(&app, unlabelled("stored")).await;
    assert_eq!(rejected.status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    let fixed = oneshot(&app, post("/orders", "stored", CHARGE)).await;
    fixed.assert_problem(422);
    assert_eq!(runs.get(), 0);

    let (app, runs) = app_with(IdempotencyLayer::new(b.store().await).single_tenant());
    let typo = oneshot(&app, post("/orders", "released", r#"{"amount": 500,"#)).await;
    assert_eq!(typo.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        typo.outcome,
        Some(IdempotencyOutcome::Executed(Completion::Released))
    );
    let rejected = oneshot(&app, unlabelled("released")).await;
    assert_eq!(rejected.status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    assert_eq!(
        rejected.outcome,
        Some(IdempotencyOutcome::Executed(Completion::Released))
    );
    let fixed = oneshot(&app, post("/orders", "released", CHARGE)).await;
    assert_eq!(fixed.status, StatusCode::CREATED, "{:?}", fixed.body);
    assert!(
        oneshot(&app, post("/orders", "released", CHARGE))
            .await
            .is_replay()
    );
    assert_eq!(runs.get(), 1);
}

pub async fn handler_error_releases_the_key<B: Backend>(b: &B) {
    let attempts = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let seen = attempts.clone();
    let service = service_fn(move |_req: Request<Body>| {
        let n = seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
        async move {
            if n == 1 {
                Err(std::io::Error::other("database down"))
            } else {
                Ok(http::Response::new(Body::from(format!("ok {n}"))))
            }
        }
    });
    let service = tower::Layer::layer(
        &IdempotencyLayer::new(b.store().await).single_tenant(),
        service,
    );
    let req = || post("/x", "k", CHARGE);
    let error = service.clone().oneshot(req()).await.unwrap_err();
    assert_eq!(error.to_string(), "database down");
    let ok = service.clone().oneshot(req()).await.unwrap();
    assert_eq!(
        ok.status(),
        StatusCode::OK,
        "the retry executes: the error released the key"
    );
    let replay = service.oneshot(req()).await.unwrap();
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(attempts.load(std::sync::atomic::Ordering::SeqCst), 2);
}

pub async fn handler_panic_releases_the_key<B: Backend>(b: &B) {
    let (app, runs) = app_with(IdempotencyLayer::new(b.store().await).single_tenant());
    let server = Server::start(app).await;
    server
        .post("/panic-once", "k", CHARGE)
        .await
        .assert_problem(500);
    let retry = server.post("/panic-once", "k", CHARGE).await;
    assert_eq!(
        retry.status,
        StatusCode::CREATED,
        "the panic released the claim"
    );
    assert!(!retry.is_replay());
    assert!(
        server.post("/panic-once", "k", CHARGE).await.is_replay(),
        "the successful retry is stored"
    );
    assert_eq!(runs.get(), 2);
}

pub async fn oversized_response_is_sent_and_unreplayable<B: Backend>(b: &B) {
    let (app, runs) = app_with(
        IdempotencyLayer::new(b.store().await)
            .single_tenant()
            .max_stored_body(1024),
    );
    let first = oneshot(&app, post("/big/4096", "k", "")).await;
    assert_eq!(first.status, StatusCode::OK);
    assert_eq!(
        first.body.len(),
        4096,
        "the client still gets the whole body"
    );
    assert_eq!(
        first.outcome,
        Some(IdempotencyOutcome::Executed(Completion::StoredUnreplayable))
    );
    let retry = oneshot(&app, post("/big/4096", "k", "")).await;
    retry.assert_problem(409);
    assert!(retry.json()["detail"].as_str().unwrap().contains("200"));
    assert_eq!(runs.get(), 1, "never a second execution");
    // A response at the limit is stored.
    oneshot(&app, post("/big/1024", "k2", "")).await;
    let replay = oneshot(&app, post("/big/1024", "k2", "")).await;
    assert!(replay.is_replay());
    assert_eq!(replay.body.len(), 1024);
}

pub async fn record_expires_after_retention<B: Backend>(b: &B) {
    let (app, runs) = app_with(
        IdempotencyLayer::new(b.store().await)
            .single_tenant()
            .retention(Duration::from_secs(3)),
    );
    // The replay lands well inside the retention on a loaded machine; the
    // retry after it waits past it, however late it is woken.
    oneshot(&app, post("/charges", "k", CHARGE)).await;
    let stored_at = tokio::time::Instant::now();
    assert!(
        oneshot(&app, post("/charges", "k", CHARGE))
            .await
            .is_replay()
    );
    tokio::time::sleep_until(stored_at + Duration::from_millis(3200)).await;
    let after = oneshot(&app, post("/charges", "k", CHARGE)).await;
    assert!(!after.is_replay(), "the record expired with its retention");
    assert_eq!(runs.get(), 2);
}

/// Asked to, the layer tells how long an answer is replayed: the retention
/// on the stored first answer, what the store has left on each replay;
/// nothing on an answer that will not be replayed, nor when not asked.
pub async fn the_retention_is_told_when_asked<B: Backend>(b: &B) {
    let told = |reply: &crate::support::http::Reply| {
        reply
            .headers
            .get(IDEMPOTENCY_REPLAYABLE_FOR)
            .map(|v| v.to_str().unwrap().parse::<u64>().expect("seconds"))
    };
    let layer = IdempotencyLayer::new(b.store().await)
        .single_tenant()
        .retention(Duration::from_secs(3600));
    let (app, _) = app_with(layer.clone().retention_header(true));
    let first = oneshot(&app, post("/charges", "told", CHARGE)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(told(&first), Some(3600), "the first answer");
    let replay = oneshot(&app, post("/charges", "told", CHARGE)).await;
    assert!(replay.is_replay());
    let left = told(&replay).expect("a replay says what is left");
    assert!((3000..=3600).contains(&left), "{left}");
    // Released (a 503), refused before running (a 422): not replayed.
    let released = oneshot(&app, post("/status/503", "released", "")).await;
    assert_eq!(told(&released), None, "a released key");
    let mismatch = oneshot(&app, post("/charges", "told", "{}")).await;
    assert_eq!(mismatch.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(told(&mismatch), None, "a rejection");
    // Not asked: never.
    let (quiet, _) = app_with(layer);
    oneshot(&quiet, post("/charges", "quiet", CHARGE)).await;
    let replay = oneshot(&quiet, post("/charges", "quiet", CHARGE)).await;
    assert!(replay.is_replay());
    assert_eq!(told(&replay), None);
}

pub async fn rejections_are_customisable<B: Backend>(b: &B) {
    let layer = IdempotencyLayer::new(b.store().await)
        .single_tenant()
        .on_rejection(|r: tower_idempotency::Rejection| {
            let mut response = http::Response::new(Body::from(format!("custom: {}", r.title())));
            *response.status_mut() = r.status();
            response
        });
    let (app, _) = app_with(layer);
    oneshot(&app, post("/charges", "k", CHARGE)).await;
    let reply = oneshot(&app, post("/charges", "k", "{}")).await;
    assert_eq!(reply.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(
        std::str::from_utf8(&reply.body)
            .unwrap()
            .starts_with("custom: ")
    );
    assert_eq!(
        reply.outcome,
        Some(IdempotencyOutcome::Rejected(RejectionKind::Mismatch))
    );
}
