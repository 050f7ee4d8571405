//! What a request gets: replays byte for byte, mismatches, what counts as
//! the same request, keys, methods, limits and scopes.

use axum::body::Body;
use http::{Method, Request, StatusCode};
use tower_idempotency::{
    Completion, IdempotencyKey, IdempotencyLayer, IdempotencyOutcome, RejectionKind,
};

use super::{CHARGE, app_with, scoped};
use crate::support::{
    backend::Backend,
    http::{oneshot, post, request},
};

pub async fn replay_is_byte_identical<B: Backend>(b: &B) {
    let (app, runs) = app_with(IdempotencyLayer::new(b.store().await).single_tenant());
    let first = oneshot(&app, post("/charges", "k1", CHARGE)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(
        first.outcome,
        Some(IdempotencyOutcome::Executed(Completion::Stored))
    );
    assert!(!first.is_replay());
    assert_eq!(
        first.header("set-cookie"),
        Some("session=secret"),
        "the first response is untouched"
    );

    let retry = oneshot(&app, post("/charges", "k1", CHARGE)).await;
    assert_eq!(runs.get(), 1);
    assert_eq!(retry.outcome, Some(IdempotencyOutcome::Replayed));
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(retry.body, first.body, "same body bytes");
    assert!(retry.is_replay());
    assert_eq!(retry.header("location"), first.header("location"));
    assert_eq!(
        retry.header_all("x-multi"),
        ["first", "second", "third"],
        "multi-valued, in order"
    );
    assert_eq!(retry.header("content-type"), Some("application/json"));
    assert_eq!(
        retry.header("set-cookie"),
        None,
        "Set-Cookie is never replayed"
    );
    // Replayed again: still identical.
    let again = oneshot(&app, post("/charges", "k1", CHARGE)).await;
    assert_eq!(again.body, first.body);
    assert_eq!(runs.get(), 1);
}

pub async fn mismatch_on_body_path_query_and_method<B: Backend>(b: &B) {
    let (app, runs) = app_with(IdempotencyLayer::new(b.store().await).single_tenant());
    let first = oneshot(&app, post("/charges?mode=live", "k", CHARGE)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let changed = [
        post(
            "/charges?mode=live",
            "k",
            r#"{"amount":2000,"currency":"eur"}"#,
        ),
        post("/slow?mode=live", "k", CHARGE),
        post("/charges?mode=test", "k", CHARGE),
        post("/charges", "k", CHARGE),
        request(Method::PATCH, "/charges?mode=live", Some("k"), CHARGE),
    ];
    for req in changed {
        let reply = oneshot(&app, req).await;
        reply.assert_problem(422);
        assert_eq!(
            reply.outcome,
            Some(IdempotencyOutcome::Rejected(RejectionKind::Mismatch))
        );
    }
    assert_eq!(runs.get(), 1);
    // The original still replays.
    assert!(
        oneshot(&app, post("/charges?mode=live", "k", CHARGE))
            .await
            .is_replay()
    );
}

pub async fn canonical_json_variants_replay<B: Backend>(b: &B) {
    let (app, runs) = app_with(IdempotencyLayer::new(b.store().await).single_tenant());
    let variants = [
        r#"{"amount":1999,"currency":"eur","meta":{"a":1,"b":[1,2]}}"#,
        r#"{ "currency" : "eur", "amount" : 1999, "meta" : { "b" : [ 1, 2 ], "a" : 1 } }"#,
        "{\n\t\"meta\": {\"b\": [1,2], \"a\": 1},\n\t\"amount\": 1999,\n\t\"currency\": \"eur\"\n}",
    ];
    let first = oneshot(&app, post("/charges", "k", variants[0])).await;
    for v in &variants[1..] {
        let retry = oneshot(&app, post("/charges", "k", v)).await;
        assert!(retry.is_replay(), "{v} should replay");
        assert_eq!(retry.body, first.body);
    }
    // Array order is significant.
    let reordered = r#"{"amount":1999,"currency":"eur","meta":{"a":1,"b":[2,1]}}"#;
    oneshot(&app, post("/charges", "k", reordered))
        .await
        .assert_problem(422);
    assert_eq!(runs.get(), 1);
}

pub async fn query_parameter_order_is_irrelevant<B: Backend>(b: &B) {
    let (app, runs) = app_with(IdempotencyLayer::new(b.store().await).single_tenant());
    oneshot(&app, post("/charges?a=1&b=2", "k", CHARGE)).await;
    assert!(
        oneshot(&app, post("/charges?b=2&a=1", "k", CHARGE))
            .await
            .is_replay()
    );
    assert_eq!(runs.get(), 1);
}

pub async fn missing_key_passes_through_unless_required<B: Backend>(b: &B) {
    let (app, runs) = app_with(IdempotencyLayer::new(b.store().await).single_tenant());
    for _ in 0..2 {
        let reply = oneshot(&app, request(Method::POST, "/charges", None, CHARGE)).await;
        assert_eq!(reply.status, StatusCode::CREATED);
        assert_eq!(
            reply.outcome,
            Some(IdempotencyOutcome::Bypassed(
                tower_idempotency::BypassReason::NoKey
            ))
        );
    }
    assert_eq!(runs.get(), 2, "without a key every request executes");

    let (app, runs) = app_with(
        IdempotencyLayer::new(b.store().await)
            .single_tenant()
            .require_key(true),
    );
    let reply = oneshot(&app, request(Method::POST, "/charges", None, CHARGE)).await;
    reply.assert_problem(400);
    assert_eq!(
        reply.outcome,
        Some(IdempotencyOutcome::Rejected(RejectionKind::MissingKey))
    );
    assert_eq!(runs.get(), 0);
}

pub async fn key_validation<B: Backend>(b: &B) {
    let (app, runs) = app_with(IdempotencyLayer::new(b.store().await).single_tenant());
    let longest = "k".repeat(255);
    let reply = oneshot(&app, post("/charges", &longest, CHARGE)).await;
    assert_eq!(reply.status, StatusCode::CREATED);
    assert!(
        oneshot(&app, post("/charges", &longest, CHARGE))
            .await
            .is_replay()
    );
    assert_eq!(runs.get(), 1);

    let bad: [&[u8]; 6] = [
        "k".repeat(256).as_bytes().to_vec().leak(),
        b"has space",
        "cl\u{e9}".as_bytes(),
        b"\"unterminated",
        b"\"\"",
        b"\"tab\tinside\"",
    ];
    for key in bad {
        let req = Request::post("/charges")
            .header(
                "idempotency-key",
                http::HeaderValue::from_bytes(key).unwrap(),
            )
            .body(Body::from(CHARGE))
            .unwrap();
        let reply = oneshot(&app, req).await;
        reply.assert_problem(400);
        assert!(matches!(
            reply.outcome,
            Some(IdempotencyOutcome::Rejected(RejectionKind::InvalidKey(_)))
        ));
    }
    // Two keys on one request are ambiguous.
    let req = Request::post("/charges")
        .header("idempotency-key", "a")
        .header("idempotency-key", "b")
        .body(Body::from(CHARGE))
        .unwrap();
    oneshot(&app, req).await.assert_problem(400);
    assert_eq!(runs.get(), 1, "invalid keys never execute");
}

pub async fn quoted_key_is_the_bare_key<B: Backend>(b: &B) {
    let (app, runs) = app_with(IdempotencyLayer::new(b.store().await).single_tenant());
    oneshot(&app, post("/charges", "\"order-7\"", CHARGE)).await;
    assert!(
        oneshot(&app, post("/charges", "order-7", CHARGE))
            .await
            .is_replay()
    );
    assert_eq!(runs.get(), 1);
    assert_eq!(IdempotencyKey::new("order-7").unwrap().as_str(), "order-7");
}

pub async fn unguarded_methods_are_untouched<B: Backend>(b: &B) {
    let (app, runs) = app_with(IdempotencyLayer::new(b.store().await).single_tenant());
    for _ in 0..2 {
        let reply = oneshot(&app, request(Method::GET, "/charges", Some("k"), "")).await;
        assert!(!reply.is_replay());
        assert_eq!(reply.header("set-cookie"), Some("session=secret"));
    }
    assert_eq!(runs.get(), 2);
    // A POST with the same key afterwards is a fresh key: GETs stored nothing.
    assert_eq!(
        oneshot(&app, post("/charges", "k", CHARGE)).await.status,
        StatusCode::CREATED
    );
    assert_eq!(runs.get(), 3);
}

pub async fn oversized_request_is_413_and_stores_nothing<B: Backend>(b: &B) {
    let (app, runs) = app_with(
        IdempotencyLayer::new(b.store().await)
            .single_tenant()
            .max_request_body(1024),
    );
    let big = format!(r#"{{"pad":"{}"}}"#, "x".repeat(2048));
    let reply = oneshot(&app, post("/charges", "k", &big)).await;
    reply.assert_problem(413);
    // Also when the size is not announced up front (streamed body).
    let stream =
        futures_util::stream::iter((0..4).map(|_| Ok::<_, std::io::Error>(vec![b' '; 512])));
    let req = Request::post("/charges")
        .header("idempotency-key", "k")
        .body(Body::from_stream(stream))
        .unwrap();
    oneshot(&app, req).await.assert_problem(413);
    assert_eq!(runs.get(), 0);
    // Nothing was stored: the key is still free.
    assert_eq!(
        oneshot(&app, post("/charges", "k", CHARGE)).await.status,
        StatusCode::CREATED
    );
    assert_eq!(runs.get(), 1);
}

pub async fn scopes_are_isolated<B: Backend>(b: &B) {
    let (app, runs) = app_with(scoped(b.store().await));
    let as_account = |account: &str| {
        let mut req = post("/charges", "shared-key", CHARGE);
        req.headers_mut()
            .insert("x-account", account.parse().unwrap());
        req
    };
    let alice = oneshot(&app, as_account("alice")).await;
    let bob = oneshot(&app, as_account("bob")).await;
    assert!(!bob.is_replay(), "bob must never see alice's response");
    assert_ne!(alice.body, bob.body);
    assert_eq!(runs.get(), 2);
    let alice_again = oneshot(&app, as_account("alice")).await;
    assert!(alice_again.is_replay());
    assert_eq!(alice_again.body, alice.body);
    // No scope — the authentication placed inside the layer, say: refused,
    // never run unprotected.
    let unscoped = oneshot(&app, post("/charges", "shared-key", CHARGE)).await;
    unscoped.assert_problem(500);
    assert_eq!(
        unscoped.outcome,
        Some(IdempotencyOutcome::Rejected(
            tower_idempotency::RejectionKind::NoScope
        ))
    );
    assert_eq!(runs.get(), 2, "not run");
    // Unless the application lets such requests through, on purpose.
    let (app, runs) = app_with(scoped(b.store().await).pass_through_without_scope());
    let unscoped = oneshot(&app, post("/charges", "shared-key", CHARGE)).await;
    assert_eq!(
        unscoped.outcome,
        Some(IdempotencyOutcome::Bypassed(
            tower_idempotency::BypassReason::NoScope
        ))
    );
    assert_eq!(runs.get(), 1);
}

pub async fn scope_encoding_cannot_collide<B: Backend>(b: &B) {
    let (app, runs) = app_with(scoped(b.store().await));
    let req = |account: &str, key: &str| {
        let mut req = post("/charges", key, CHARGE);
        req.headers_mut()
            .insert("x-account", account.parse().unwrap());
        req
    };
    oneshot(&app, req("a:b", "c")).await;
    let other = oneshot(&app, req("a", "b:c")).await;
    assert!(!other.is_replay());
    assert_eq!(runs.get(), 2);
}

/// Webhook receivers: the key is the event's id, in the body. Redeliveries
/// (with new signatures in their headers) replay; the same id with another
/// body is refused; a body without an id string is `400`, or passes
/// through when the key is optional.
pub async fn a_webhook_is_keyed_by_its_event_id_in_the_body<B: Backend>(b: &B) {
    use http::Method;
    use tower_idempotency::{BypassReason, IdempotencyLayer, IdempotencyOutcome};

    let event = r#"{"id":"evt_1","type":"charge.succeeded","data":{"amount":1999}}"#;
    let delivery = |body: &str, signature: &str| {
        let mut request = request(Method::POST, "/charges", None, body);
        request
            .headers_mut()
            .insert("webhook-signature", signature.parse().unwrap());
        request
    };
    let layer = IdempotencyLayer::new(b.store().await)
        .single_tenant()
        .key_from_body("/id")
        .require_key(true);
    let (app, runs) = app_with(layer);
    let first = oneshot(&app, delivery(event, "v1,sig-a")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    for n in 0..3 {
        let again = oneshot(&app, delivery(event, &format!("v1,sig-{n}"))).await;
        assert!(again.is_replay(), "a redelivery replays");
        assert_eq!(again.body, first.body);
    }
    assert_eq!(runs.get(), 1);
    let other = r#"{"id":"evt_1","type":"charge.refunded"}"#;
    oneshot(&app, delivery(other, "v1,sig"))
        .await
        .assert_problem(422);
    for no_id in [r#"{"type":"x"}"#, r#"{"id":7}"#, "not json"] {
        oneshot(&app, delivery(no_id, "v1,sig"))
            .await
            .assert_problem(400);
    }
    oneshot(&app, delivery(r#"{"id":"evt 2"}"#, "v1,sig"))
        .await
        .assert_problem(400);
    assert_eq!(runs.get(), 1);

    // The key optional: a body without one runs unprotected.
    let (app, runs) = app_with(
        IdempotencyLayer::new(b.store().await)
            .single_tenant()
            .key_from_body("/id"),
    );
    for _ in 0..2 {
        let through = oneshot(&app, delivery(r#"{"type":"x"}"#, "s")).await;
        assert_eq!(through.status, StatusCode::CREATED);
        assert_eq!(
            through.outcome,
            Some(IdempotencyOutcome::Bypassed(BypassReason::NoKey))
        );
    }
    assert_eq!(runs.get(), 2);
}
