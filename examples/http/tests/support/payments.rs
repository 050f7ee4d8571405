//! The `payments` example as a child process, built by `cargo test` beside
//! the tests: started, SIGKILLed and restarted like a real deployment.

use std::time::Duration;

use super::{
    http::{HttpClient, Reply},
    process::run_example_to_exit,
    redis_server::free_port,
};

/// The `payments` example as a process.
pub use super::process::Example as Payments;

impl Payments {
    /// Starts the example with `env` on `127.0.0.1:port` and waits for its
    /// "listening on" line.
    pub fn start(port: u16, env: &[(&str, &str)]) -> Self {
        Self::start_named("payments", port, env)
    }
}

/// Runs the example with `env` until it exits (it must refuse to start),
/// or kills it after 10 s: its exit status and everything it printed.
pub fn run_to_exit(env: &[(&str, &str)]) -> (std::process::ExitStatus, String) {
    run_example_to_exit("payments", env)
}

/// The example's crash-test charge: account `acct_crash`, key `crash-1`.
pub fn charge_request(addr: &str) -> http::Request<axum::body::Body> {
    http::Request::post(format!("http://{addr}/v1/charges"))
        .header("authorization", "Bearer acct_crash")
        .header("idempotency-key", "crash-1")
        .header("content-type", "application/json")
        .body(axum::body::Body::from(r#"{"amount":500,"currency":"usd"}"#))
        .unwrap()
}

/// Starts a charge on a fresh example process, kills it with SIGKILL once
/// `charged(address)` says the charge is under way (its handler waiting for
/// the processor), and restarts it on the same port.
pub async fn kill_mid_charge(
    client: &HttpClient,
    env: &[(&str, &str)],
    charged: impl AsyncFn(&str) -> bool,
) -> Payments {
    let port = free_port();
    let mut payments = Payments::start(port, env);
    let doomed = tokio::spawn({
        let client = client.clone();
        let addr = payments.addr.clone();
        async move {
            let _ =
                tokio::time::timeout(Duration::from_secs(5), client.send(charge_request(&addr)))
                    .await;
        }
    });
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !charged(&payments.addr).await {
        assert!(
            std::time::Instant::now() < deadline,
            "the charge was never written; the example printed: {}",
            payments.output()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    payments.child.kill().unwrap();
    payments.child.wait().unwrap();
    doomed.abort();
    Payments::start(port, env)
}

/// Retries the crash-test charge until it executes or replays (`409` while
/// a claim is held): the reply, and how many `409`s came first.
pub async fn retry_until_done(client: &HttpClient, addr: &str) -> (Reply, usize) {
    let mut conflicts = 0;
    for _ in 0..160 {
        let reply = client.send(charge_request(addr)).await;
        match reply.status {
            http::StatusCode::CONFLICT => conflicts += 1,
            // A store too slow to answer in time (a loaded machine): retried
            // with the same key, as a client should.
            http::StatusCode::SERVICE_UNAVAILABLE => {}
            _ => return (reply, conflicts),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("still 409 or 503 after 16 s");
}
