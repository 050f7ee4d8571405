//! Concurrent duplicates, and clients that hang up or drop the response
//! future.

use std::time::Duration;

use http::StatusCode;
use tower_idempotency::IdempotencyLayer;

use super::{CHARGE, app_with, fire};
use crate::support::{
    backend::Backend,
    http::{Reply, Server, oneshot, post},
};

pub async fn concurrent_duplicates_execute_once<B: Backend>(b: &B) {
    let (app, runs) = app_with(IdempotencyLayer::new(b.store().await).single_tenant());
    let server = Server::start(app).await;
    let replies = fire(&server, 64, "/slow?ms=200", "same").await;
    assert_eq!(runs.get(), 1, "64 concurrent duplicates, one execution");
    let executed = replies
        .iter()
        .filter(|r| r.status == StatusCode::CREATED && !r.is_replay())
        .count();
    assert_eq!(executed, 1);
    // A duplicate that reached the store after the first completed (a
    // transactional store's duplicates queue for pooled connections)
    // replays it; every other is told to come back.
    for r in replies.iter().filter(|r| r.status != StatusCode::CREATED) {
        r.assert_problem(409);
        let after: u64 = r
            .header("retry-after")
            .expect("409 carries Retry-After")
            .parse()
            .unwrap();
        assert_eq!(after, 1, "a short hint, never the rest of the lease");
    }
}

pub async fn concurrent_duplicates_wait_and_replay<B: Backend>(b: &B) {
    let layer = IdempotencyLayer::new(b.store().await)
        .single_tenant()
        .wait_for_in_flight(Duration::from_secs(10));
    let (app, runs) = app_with(layer);
    let server = Server::start(app).await;
    let replies = fire(&server, 64, "/slow?ms=200", "same").await;
    assert_eq!(runs.get(), 1);
    assert!(replies.iter().all(|r| r.status == StatusCode::CREATED));
    assert_eq!(replies.iter().filter(|r| r.is_replay()).count(), 63);
    assert!(replies.iter().all(|r| r.body == replies[0].body));
}

pub async fn client_disconnect_does_not_cancel<B: Backend>(b: &B) {
    use tokio::io::AsyncWriteExt;
    let (app, runs) = app_with(IdempotencyLayer::new(b.store().await).single_tenant());
    let server = Server::start(app).await;
    let mut socket = tokio::net::TcpStream::connect(server.addr).await.unwrap();
    let raw = format!(
        "POST /slow?ms=300 HTTP/1.1\r\nhost: x\r\nidempotency-key: k\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{CHARGE}",
        CHARGE.len()
    );
    socket.write_all(raw.as_bytes()).await.unwrap();
    // Hung up only once the handler runs (an event, not a delay).
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while runs.get() == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the handler never started"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(runs.get(), 1, "the handler started");
    drop(socket); // the client hangs up mid-handler
    let retry = until_settled(async || server.post("/slow?ms=300", "k", CHARGE).await).await;
    assert!(
        retry.is_replay(),
        "the detached handler finished and stored its response"
    );
    assert_eq!(runs.get(), 1);
}

/// Retries while told the key is in flight (`409`), up to 5 s: the first
/// answer that is not, which must be the first execution's replay.
async fn until_settled(send: impl AsyncFn() -> Reply) -> Reply {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let reply = send().await;
        if reply.status != StatusCode::CONFLICT || std::time::Instant::now() > deadline {
            return reply;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The same, without a network: the caller drops the response future.
pub async fn dropped_response_future_still_completes<B: Backend>(b: &B) {
    let (app, runs) = app_with(IdempotencyLayer::new(b.store().await).single_tenant());
    let mut request = Box::pin(oneshot(&app, post("/slow?ms=300", "k", CHARGE)));
    let started = async {
        while runs.get() == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    tokio::select! {
        _ = &mut request => panic!("the request finished before its caller gave up"),
        waited = tokio::time::timeout(Duration::from_secs(5), started) => {
            waited.expect("the handler started");
        }
    }
    // The caller gives up while the handler runs.
    drop(request);
    assert_eq!(runs.get(), 1);
    let retry =
        until_settled(async || oneshot(&app, post("/slow?ms=300", "k", CHARGE)).await).await;
    assert!(
        retry.is_replay(),
        "the handler finished on its own and stored its response"
    );
    assert_eq!(runs.get(), 1);
}
