//! The clients: workers that charge through the crate's client layer (one
//! key per operation, kept across its retries), raw duplicates sent
//! alongside, a key reused with other parameters — and the final pass that
//! asks every key once more after the faults healed. Every attempt goes
//! into the history.

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::{
    client::legacy::{Client, connect::HttpConnector},
    rt::TokioExecutor,
};
use tower::{Service, ServiceBuilder, ServiceExt};
use tower_idempotency::client::{ClientError, IdempotentCall, IdempotentClientLayer};

use crate::history::{Event, Recorder, digest};

/// One business operation: a charge, under its key.
#[derive(Clone, Debug)]
pub struct Operation {
    pub op: u64,
    pub account: String,
    pub key: String,
    pub amount: i64,
}

/// How the clients behave.
#[derive(Clone, Debug)]
pub struct Workload {
    pub workers: usize,
    pub accounts: usize,
    /// The chance an operation also gets two raw duplicates alongside.
    pub duplicates: f64,
    /// The chance an operation's key is then reused with other parameters.
    pub mismatches: f64,
    /// The chance an operation takes a key another account used already:
    /// a new operation of its own, since keys are per tenant.
    pub shared_keys: f64,
    /// The client layer's deadline for one operation.
    pub deadline: Duration,
}

impl Default for Workload {
    fn default() -> Self {
        Self {
            workers: 10,
            accounts: 3,
            duplicates: 0.2,
            mismatches: 0.1,
            shared_keys: 0.1,
            deadline: Duration::from_secs(8),
        }
    }
}

type Hyper = Client<HttpConnector, Full<Bytes>>;

/// Sends charges to a deployment.
#[derive(Clone)]
pub struct Clients {
    hyper: Hyper,
    recorder: Recorder,
    workload: Workload,
    addrs: Vec<String>,
    next: Arc<AtomicU64>,
    seed: u64,
    /// Every operation started, for the final pass.
    pub operations: Arc<Mutex<Vec<Operation>>>,
}

impl Clients {
    pub fn new(recorder: Recorder, workload: Workload, addrs: Vec<String>, seed: u64) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(Duration::from_secs(1)));
        Self {
            hyper: Client::builder(TokioExecutor::new()).build(connector),
            recorder,
            workload,
            addrs,
            next: Arc::default(),
            seed,
            operations: Arc::default(),
        }
    }

    /// Runs the workers until `stop` is set.
    pub async fn run(&self, stop: Arc<AtomicBool>) {
        let workers = (0..self.workload.workers).map(|w| {
            let (this, stop) = (self.clone(), stop.clone());
            tokio::spawn(async move {
                let mut rng = fastrand::Rng::with_seed(this.seed.wrapping_mul(1000) + w as u64);
                while !stop.load(Ordering::Relaxed) {
                    this.one(&mut rng).await;
                }
            })
        });
        for worker in futures_util::future::join_all(workers).await {
            worker.expect("a worker panicked");
        }
    }

    /// One operation: the client call, perhaps raw duplicates alongside,
    /// perhaps a reuse of its key after.
    async fn one(&self, rng: &mut fastrand::Rng) {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let account = format!("acct_{}", rng.usize(..self.workload.accounts));
        let share = rng.f64() < self.workload.shared_keys;
        let operation = {
            // Chosen and recorded under one lock: a key is taken once per
            // account.
            let mut operations = self.operations.lock().unwrap();
            // With the same parameters: only the scope tells them apart.
            let shared = share
                .then(|| {
                    operations
                        .iter()
                        .rev()
                        .take(50)
                        .find(|o| {
                            o.account != account
                                && !operations
                                    .iter()
                                    .any(|p| p.key == o.key && p.account == account)
                        })
                        .map(|o| (o.key.clone(), o.amount))
                })
                .flatten();
            let (key, amount) =
                shared.unwrap_or_else(|| (format!("op-{}-{n}", self.seed), rng.i64(100..100_000)));
            let operation = Operation {
                op: n,
                account,
                key,
                amount,
            };
            operations.push(operation.clone());
            operation
        };
        let instance = rng.usize(..self.addrs.len());
        let raw = rng.f64() < self.workload.duplicates;
        let call = self.call(&operation, instance, "client");
        if raw {
            let others: Vec<usize> = (0..2).map(|_| rng.usize(..self.addrs.len())).collect();
            let duplicates = others
                .iter()
                .map(|&i| self.raw(&operation, i, operation.amount, "raw"));
            tokio::join!(call, futures_util::future::join_all(duplicates));
        } else {
            call.await;
        }
        if rng.f64() < self.workload.mismatches {
            let other = operation.amount + 1;
            let instance = rng.usize(..self.addrs.len());
            self.raw(&operation, instance, other, "mismatch").await;
        }
    }

    fn request(
        &self,
        operation: &Operation,
        instance: usize,
        amount: i64,
    ) -> http::Request<Full<Bytes>> {
        let body = serde_json::json!({
            "amount": amount,
            "currency": "eur",
            "description": operation.key,
        })
        .to_string();
        http::Request::post(format!("http://{}/v1/charges", self.addrs[instance]))
            .header("authorization", format!("Bearer {}", operation.account))
            .header("idempotency-key", &operation.key)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body)))
            .unwrap()
    }

    fn event(&self, operation: &Operation, kind: &str, via: &str, instance: usize) -> Event {
        Event {
            op: operation.op,
            account: operation.account.clone(),
            key: operation.key.clone(),
            amount: operation.amount,
            kind: kind.into(),
            via: via.into(),
            instance,
            ..Event::default()
        }
    }

    /// Through the client layer: retried under the operation's key until
    /// an answer or the deadline.
    pub async fn call(&self, operation: &Operation, instance: usize, via: &str) {
        self.recorder
            .record(self.event(operation, "invoke", via, instance));
        let layer = IdempotentClientLayer::new()
            .max_attempts(12)
            .attempt_timeout(Duration::from_secs(1))
            .deadline(self.workload.deadline)
            .backoff(Duration::from_millis(100), Duration::from_secs(1));
        // Behind a balancer, as clients of a deployment are: each attempt
        // may go to another instance, under the same key.
        let spread = Spread {
            hyper: self.hyper.clone(),
            addrs: self.addrs.clone(),
        };
        let mut client = ServiceBuilder::new().layer(layer).service(spread);
        let started = Instant::now();
        let request = self.request(operation, instance, operation.amount);
        let called = match ServiceExt::<http::Request<Full<Bytes>>>::ready(&mut client).await {
            Ok(client) => client.call(request).await,
            Err(error) => Err(error),
        };
        let mut event = self.event(operation, "info", via, instance);
        event.latency_ms = started.elapsed().as_millis() as u64;
        match called {
            Ok(response) => {
                let call = response.extensions().get::<IdempotentCall>().cloned();
                event.attempts = call.as_ref().map_or(1, |c| c.attempts);
                event.replayed = call.is_some_and(|c| c.replayed);
                let status = response.status();
                let body = response.body().bytes();
                answered(&mut event, status, &body);
            }
            Err(error) => {
                event.attempts = ClientError::call(&error).map_or(1, |c| c.attempts);
            }
        }
        self.recorder.record(event);
    }

    /// Sent once, as it is: a duplicate alongside, or a key reused.
    async fn raw(&self, operation: &Operation, instance: usize, amount: i64, via: &str) {
        let mut event = self.event(operation, "invoke", via, instance);
        event.amount = amount;
        self.recorder.record(event.clone());
        let started = Instant::now();
        let request = self.request(operation, instance, amount);
        let sent = tokio::time::timeout(Duration::from_secs(1), self.hyper.request(request)).await;
        event.kind = "info".into();
        event.attempts = 1;
        if let Ok(Ok(response)) = sent {
            let status = response.status();
            let replayed = response.headers().contains_key("idempotent-replayed");
            if let Ok(Ok(body)) =
                tokio::time::timeout(Duration::from_secs(1), response.into_body().collect()).await
            {
                event.replayed = replayed;
                answered(&mut event, status, &body.to_bytes());
            }
        }
        event.latency_ms = started.elapsed().as_millis() as u64;
        self.recorder.record(event);
    }

    /// Asks every operation once more, through the client layer, on the
    /// healed deployment.
    pub async fn final_pass(&self) {
        let operations = self.operations.lock().unwrap().clone();
        let addrs = self.addrs.len();
        for chunk in operations.chunks(16) {
            let calls = chunk
                .iter()
                .map(|operation| self.call(operation, operation.op as usize % addrs, "final"));
            futures_util::future::join_all(calls).await;
        }
    }
}

/// Fills an event in from an answer: `ok` for a 2xx, naming its charge;
/// `fail` for any other answer.
fn answered(event: &mut Event, status: http::StatusCode, body: &[u8]) {
    event.status = Some(status.as_u16());
    event.body = Some(digest(body));
    if status.is_success() {
        event.kind = "ok".into();
        if let Ok(charge) = serde_json::from_slice::<serde_json::Value>(body) {
            event.charge = charge["id"].as_str().map(str::to_owned);
            event.charge_account = charge["account"].as_str().map(str::to_owned);
        }
    } else {
        event.kind = "fail".into();
    }
}

/// A load balancer in front of the instances: each request goes to one of
/// them at random, whatever its URL named.
#[derive(Clone)]
struct Spread {
    hyper: Hyper,
    addrs: Vec<String>,
}

impl tower::Service<http::Request<Full<Bytes>>> for Spread {
    type Response = <Hyper as tower::Service<http::Request<Full<Bytes>>>>::Response;
    type Error = <Hyper as tower::Service<http::Request<Full<Bytes>>>>::Error;
    type Future = <Hyper as tower::Service<http::Request<Full<Bytes>>>>::Future;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        tower::Service::poll_ready(&mut self.hyper, cx)
    }

    fn call(&mut self, mut request: http::Request<Full<Bytes>>) -> Self::Future {
        let addr = &self.addrs[fastrand::usize(..self.addrs.len())];
        let path = request
            .uri()
            .path_and_query()
            .map_or("/", |p| p.as_str())
            .to_owned();
        *request.uri_mut() = format!("http://{addr}{path}").parse().expect("a URI");
        tower::Service::call(&mut self.hyper, request)
    }
}
