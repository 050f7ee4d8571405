//! The gRPC door, with a real tonic client over loopback: replays with their
//! trailers, one execution under concurrent duplicates, rejections as gRPC
//! statuses, the store policy reading `grpc-status`, and a transactional
//! store committing the charge with its reply.

use std::{
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use bytes::Bytes;
use grpc_payments::{
    ChargeReply, ChargeRequest, Ledger, ListChargesRequest, PaymentsClient, Settings,
    proto::payments_server::{Payments, PaymentsServer},
};
use http_body_util::{BodyExt, Full};
use tonic::{Code, Status, transport::Channel};
use tower::ServiceExt;
use tower_idempotency::{
    IdempotencyKey, IdempotencyLayer, IdempotentTx, MemoryStore, PostgresStore, PostgresTx,
    PostgresTxStore, RedisStore, SqliteStore, SqliteTx, sqlx,
    store::{KeyState, StorageKey, Store},
};
use tower_idempotency_harness::{
    postgres::TestDatabase, redis_server::RedisServer, sqlite::TestFile,
};

/// Serves the example's service over `store` on a free loopback port.
async fn serve<St: Store>(store: St, ledger: Ledger, settings: Settings) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { grpc_payments::serve(listener, store, ledger, &settings).await });
    addr
}

async fn client(addr: SocketAddr) -> PaymentsClient<Channel> {
    PaymentsClient::connect(format!("http://{addr}"))
        .await
        .expect("connect to the test server")
}

/// A `Charge` call as alice, with `key` if given.
fn charge(key: Option<&str>, amount: i64) -> tonic::Request<ChargeRequest> {
    let mut request = tonic::Request::new(ChargeRequest {
        amount,
        currency: "eur".into(),
        description: "order".into(),
    });
    let metadata = request.metadata_mut();
    metadata.insert("authorization", "Bearer tok_alice".parse().unwrap());
    if let Some(key) = key {
        metadata.insert("idempotency-key", key.parse().unwrap());
    }
    request
}

fn memory() -> Ledger {
    Ledger::Memory(Arc::default())
}

async fn charges(ledger: &Ledger) -> Vec<ChargeReply> {
    ledger.list("acct_alice").await.unwrap()
}

fn replayed<T>(response: &tonic::Response<T>) -> bool {
    response
        .metadata()
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true")
}

#[tokio::test]
async fn a_retry_replays_the_reply_and_a_refused_argument_does_not_burn_the_key() {
    let ledger = memory();
    let addr = serve(MemoryStore::new(), ledger.clone(), Settings::default()).await;
    let mut client = client(addr).await;

    let first = client.charge(charge(Some("order-1"), 1999)).await.unwrap();
    assert!(!replayed(&first));
    let retry = client.charge(charge(Some("order-1"), 1999)).await.unwrap();
    assert!(replayed(&retry), "{:?}", retry.metadata());
    assert_eq!(retry.into_inner(), first.into_inner());
    assert_eq!(charges(&ledger).await.len(), 1, "one execution");

    // A call refused for its arguments, before anything ran, is not
    // stored: its retry is refused afresh, and the corrected call executes
    // under the same key.
    let refused = client
        .charge(charge(Some("order-2"), -5))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument);
    let again = client
        .charge(charge(Some("order-2"), -5))
        .await
        .unwrap_err();
    assert_eq!(again.code(), Code::InvalidArgument);
    assert!(again.metadata().get("idempotent-replayed").is_none());
    let corrected = client.charge(charge(Some("order-2"), 500)).await.unwrap();
    assert!(!replayed(&corrected));
    assert_eq!(charges(&ledger).await.len(), 2);
}

#[tokio::test]
async fn trailers_are_stored_and_replayed_byte_for_byte() {
    // A gRPC service's response, as tonic sends it: a message, then
    // `grpc-status` and trailing metadata in the trailers.
    let executions = Arc::new(AtomicUsize::new(0));
    let service = {
        let executions = executions.clone();
        tower::service_fn(move |_: http::Request<_>| {
            let n = executions.fetch_add(1, Ordering::SeqCst);
            async move {
                let mut trailers = http::HeaderMap::new();
                trailers.insert("grpc-status", "0".parse().unwrap());
                trailers.append("x-ledger-entry", format!("entry-{n}").parse().unwrap());
                trailers.append("x-ledger-entry", "second-value".parse().unwrap());
                let body = Full::new(Bytes::from_static(b"\0\0\0\0\x03\x08\x96\x01"))
                    .with_trailers(async move { Some(Ok(trailers)) });
                Ok::<_, std::convert::Infallible>(
                    http::Response::builder()
                        .header("content-type", "application/grpc")
                        .body(body)
                        .unwrap(),
                )
            }
        })
    };
    let service = IdempotencyLayer::new(MemoryStore::new())
        .single_tenant()
        .layer(service);
    let call = || {
        http::Request::post("/payments.v1.Payments/Charge")
            .header("content-type", "application/grpc")
            .header("idempotency-key", "k")
            .body(Full::new(Bytes::from_static(b"\0\0\0\0\x02\x08\x01")))
            .unwrap()
    };
    let (_, first_body, first_trailers) =
        read(service.clone().oneshot(call()).await.unwrap()).await;
    let (headers, body, trailers) = read(service.oneshot(call()).await.unwrap()).await;
    assert_eq!(executions.load(Ordering::SeqCst), 1);
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(body, first_body);
    let trailers = trailers.expect("the replay ends with trailers");
    assert_eq!(Some(&trailers), first_trailers.as_ref());
    assert_eq!(trailers["grpc-status"], "0");
    let entries: Vec<_> = trailers.get_all("x-ledger-entry").iter().collect();
    assert_eq!(entries, ["entry-0", "second-value"]);
}

/// A response's headers, body and trailers, read whole.
async fn read<B>(response: http::Response<B>) -> (http::HeaderMap, Bytes, Option<http::HeaderMap>)
where
    B: http_body::Body,
    B::Error: std::fmt::Debug,
{
    let (parts, body) = response.into_parts();
    let collected = body.collect().await.unwrap();
    let trailers = collected.trailers().cloned();
    (parts.headers, collected.to_bytes(), trailers)
}

/// The example on the memory store, with a card processor that takes
/// `latency`.
async fn serve_slow(latency: Duration) -> (Ledger, PaymentsClient<Channel>) {
    let ledger = memory();
    let settings = Settings {
        processor_latency: latency,
        ..Settings::default()
    };
    let addr = serve(MemoryStore::new(), ledger.clone(), settings).await;
    (ledger, client(addr).await)
}

#[tokio::test]
async fn the_charge_runs_once_under_concurrent_duplicates() {
    let (ledger, client) = serve_slow(Duration::from_millis(400)).await;
    let calls: Vec<_> = (0..16)
        .map(|_| {
            let mut client = client.clone();
            tokio::spawn(async move { client.charge(charge(Some("order-7"), 700)).await })
        })
        .collect();
    let mut ok = Vec::new();
    for call in calls {
        match call.await.unwrap() {
            Ok(reply) => ok.push(reply.into_inner()),
            Err(status) => {
                assert_eq!(status.code(), Code::Aborted, "{status:?}");
                let pushback = status.metadata().get("grpc-retry-pushback-ms");
                let pushback: u64 = pushback
                    .expect("ABORTED says when to retry")
                    .to_str()
                    .unwrap()
                    .parse()
                    .unwrap();
                assert!(
                    pushback <= 1000,
                    "a short hint, not the lease: {pushback} ms"
                );
            }
        }
    }
    assert!(!ok.is_empty(), "the first call succeeded");
    assert_eq!(charges(&ledger).await.len(), 1, "exactly one execution");
    // Every retry after it replays the one charge.
    let mut client = client;
    let retry = client.charge(charge(Some("order-7"), 700)).await.unwrap();
    assert!(replayed(&retry));
    assert_eq!(retry.into_inner(), ok[0]);
    assert_eq!(charges(&ledger).await.len(), 1);
}

#[tokio::test]
async fn a_client_whose_deadline_passes_gets_the_charge_on_its_retry() {
    let (ledger, mut client) = serve_slow(Duration::from_millis(600)).await;
    let mut hurried = charge(Some("order-9"), 900);
    hurried.set_timeout(Duration::from_millis(100));
    let gone = client.charge(hurried).await.unwrap_err();
    assert!(
        matches!(gone.code(), Code::DeadlineExceeded | Code::Cancelled),
        "{gone:?}"
    );
    // The handler was detached from the call: it finishes and its reply is
    // stored, so the retry receives it instead of a second charge.
    let retry = loop {
        match client.charge(charge(Some("order-9"), 900)).await {
            Err(status) if status.code() == Code::Aborted => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            other => break other.unwrap(),
        }
    };
    assert!(replayed(&retry));
    assert_eq!(charges(&ledger).await.len(), 1, "charged once");
    assert_eq!(charges(&ledger).await[0], retry.into_inner());
}

#[tokio::test]
async fn rejections_are_grpc_statuses_and_streams_pass_through() {
    let ledger = memory();
    let addr = serve(MemoryStore::new(), ledger.clone(), Settings::default()).await;
    let mut client = client(addr).await;
    client.charge(charge(Some("order-3"), 300)).await.unwrap();

    let mismatch = client
        .charge(charge(Some("order-3"), 301))
        .await
        .unwrap_err();
    assert_eq!(mismatch.code(), Code::FailedPrecondition, "{mismatch:?}");
    assert!(mismatch.message().contains("different parameters"));

    let missing = client.charge(charge(None, 300)).await.unwrap_err();
    assert_eq!(missing.code(), Code::InvalidArgument, "{missing:?}");
    let malformed = client.charge(charge(Some("ke y"), 300)).await.unwrap_err();
    assert_eq!(malformed.code(), Code::InvalidArgument, "{malformed:?}");
    assert_eq!(charges(&ledger).await.len(), 1, "no rejected call ran");

    // The streaming method is not guarded: it needs no key.
    let mut list = tonic::Request::new(ListChargesRequest {});
    list.metadata_mut()
        .insert("authorization", "Bearer tok_alice".parse().unwrap());
    let mut stream = client.list_charges(list).await.unwrap().into_inner();
    let mut listed = 0;
    while stream.message().await.unwrap().is_some() {
        listed += 1;
    }
    assert_eq!(listed, 1);
}

/// A `Charge` that answers `UNAVAILABLE` until `failures` calls have
/// failed, writing its charge first when it runs in a transaction.
#[derive(Clone)]
struct Flaky {
    executions: Arc<AtomicUsize>,
    failures: usize,
    in_transaction: bool,
}

#[tonic::async_trait]
impl Payments for Flaky {
    async fn charge(
        &self,
        request: tonic::Request<ChargeRequest>,
    ) -> Result<tonic::Response<ChargeReply>, Status> {
        let n = self.executions.fetch_add(1, Ordering::SeqCst);
        let id = format!("ch_{n}");
        if self.in_transaction {
            let mut tx = IdempotentTx::<SqliteTx>::from_extensions(request.extensions())
                .ok_or_else(|| Status::internal("no transaction"))?;
            sqlx::query("INSERT INTO charges (id, account, amount, currency, description) VALUES ($1, 'acct_test', 1, 'eur', '')")
                .bind(&id)
                .execute(&mut *tx)
                .await
                .map_err(|e| Status::internal(e.to_string()))?;
        }
        if n < self.failures {
            return Err(Status::unavailable("the card processor is down"));
        }
        Ok(tonic::Response::new(ChargeReply {
            id,
            ..ChargeReply::default()
        }))
    }

    type ListChargesStream = futures_util::stream::Empty<Result<ChargeReply, Status>>;

    async fn list_charges(
        &self,
        _: tonic::Request<ListChargesRequest>,
    ) -> Result<tonic::Response<Self::ListChargesStream>, Status> {
        Err(Status::unimplemented("not here"))
    }
}

/// Serves `service` behind the layer over `store` (one scope for all
/// callers), on a free loopback port.
async fn serve_with<St: Store, P: Payments>(store: St, service: P) -> PaymentsClient<Channel> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .layer(IdempotencyLayer::new(store).single_tenant())
            .add_service(PaymentsServer::new(service))
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
    );
    client(addr).await
}

/// A transactional store and the example's ledger in a throwaway
/// PostgreSQL database.
async fn postgres(database: &TestDatabase) -> (PostgresTxStore, Ledger) {
    let store = PostgresStore::builder()
        .transactional()
        .create_table_if_missing()
        .connect(database.url())
        .await
        .unwrap();
    let ledger = Ledger::postgres(store.pool()).await.unwrap();
    (store, ledger)
}

#[tokio::test]
async fn unavailable_releases_the_key_and_the_retry_executes() {
    let executions = Arc::new(AtomicUsize::new(0));
    let flaky = Flaky {
        executions: executions.clone(),
        failures: 1,
        in_transaction: false,
    };
    let mut client = serve_with(MemoryStore::new(), flaky).await;

    let down = client.charge(charge(Some("k"), 1)).await.unwrap_err();
    assert_eq!(down.code(), Code::Unavailable);
    assert!(down.metadata().get("idempotent-replayed").is_none());
    let retry = client.charge(charge(Some("k"), 1)).await.unwrap();
    assert!(!replayed(&retry), "the retry executed");
    assert_eq!(retry.get_ref().id, "ch_1");
    let again = client.charge(charge(Some("k"), 1)).await.unwrap();
    assert!(replayed(&again));
    assert_eq!(again.get_ref().id, "ch_1");
    assert_eq!(executions.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn an_unreachable_store_is_unavailable_and_the_handler_does_not_run() {
    let mut redis = RedisServer::start();
    let store = RedisStore::builder().connect(&redis.url()).await.unwrap();
    let executions = Arc::new(AtomicUsize::new(0));
    let flaky = Flaky {
        executions: executions.clone(),
        failures: 0,
        in_transaction: false,
    };
    let mut client = serve_with(store, flaky).await;
    let first = client.charge(charge(Some("before"), 1)).await.unwrap();
    let retry = client.charge(charge(Some("before"), 1)).await.unwrap();
    assert!(replayed(&retry), "replayed from Redis, trailers and all");
    assert_eq!(retry.into_inner(), first.into_inner());
    redis.kill();
    let refused = client.charge(charge(Some("during"), 1)).await.unwrap_err();
    assert_eq!(refused.code(), Code::Unavailable, "{refused:?}");
    assert!(refused.metadata().get("grpc-retry-pushback-ms").is_some());
    assert_eq!(executions.load(Ordering::SeqCst), 1, "not run unprotected");
}

#[tokio::test]
async fn a_sqlite_transaction_commits_the_charge_with_its_reply_or_nothing() {
    let file = TestFile::create();
    let store = SqliteStore::builder()
        .transactional()
        .create_table_if_missing()
        .connect(&file.url())
        .await
        .unwrap();
    Ledger::sqlite(store.pool()).await.unwrap();
    let executions = Arc::new(AtomicUsize::new(0));
    let flaky = Flaky {
        executions: executions.clone(),
        failures: 1,
        in_transaction: true,
    };
    let mut client = serve_with(store.clone(), flaky).await;

    // UNAVAILABLE: the key is released and the charge rolled back.
    let down = client.charge(charge(Some("tx-1"), 1)).await.unwrap_err();
    assert_eq!(down.code(), Code::Unavailable);
    assert_eq!(file.count("SELECT count(*) FROM charges").await, 0);
    // The retry executes; its charge commits with the stored reply.
    let ok = client.charge(charge(Some("tx-1"), 1)).await.unwrap();
    assert_eq!(file.count("SELECT count(*) FROM charges").await, 1);
    let key = StorageKey::new("", &IdempotencyKey::new("tx-1").unwrap());
    let KeyState::Completed { record, .. } = store.inspect(&key).await.unwrap() else {
        panic!("the reply is stored");
    };
    let tower_idempotency::CompletedRecord::Response(stored) = &*record else {
        panic!("a response");
    };
    assert!(
        stored
            .trailers()
            .iter()
            .any(|(name, value)| name == "grpc-status" && value == "0"),
        "its trailers are stored: {:?}",
        stored.trailers()
    );
    let again = client.charge(charge(Some("tx-1"), 1)).await.unwrap();
    assert!(replayed(&again));
    assert_eq!(again.into_inner(), ok.into_inner());
    assert_eq!(file.count("SELECT count(*) FROM charges").await, 1);
    assert_eq!(executions.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn the_example_on_postgres_commits_one_charge_per_key() {
    let database = TestDatabase::create();
    let (store, ledger) = postgres(&database).await;
    let addr = serve(store, ledger.clone(), Settings::default()).await;
    let mut client = client(addr).await;
    let first = client.charge(charge(Some("pg-1"), 1200)).await.unwrap();
    let retry = client.charge(charge(Some("pg-1"), 1200)).await.unwrap();
    assert!(replayed(&retry));
    assert_eq!(retry.into_inner(), first.into_inner());
    assert_eq!(database.count("SELECT count(*) FROM charges").await, 1);
    assert_eq!(charges(&ledger).await.len(), 1);
}

/// A `Charge` whose insert breaks the table's primary key, which aborts a
/// PostgreSQL transaction: it answers `ALREADY_EXISTS`, or — wrongly —
/// `OK` as if nothing had happened.
#[derive(Clone)]
struct Conflicting {
    executions: Arc<AtomicUsize>,
    claims_success: bool,
}

#[tonic::async_trait]
impl Payments for Conflicting {
    async fn charge(
        &self,
        request: tonic::Request<ChargeRequest>,
    ) -> Result<tonic::Response<ChargeReply>, Status> {
        self.executions.fetch_add(1, Ordering::SeqCst);
        let mut tx = IdempotentTx::<PostgresTx>::from_extensions(request.extensions())
            .ok_or_else(|| Status::internal("no transaction"))?;
        let inserted = sqlx::query("INSERT INTO charges (id, account, amount, currency, description) VALUES ('ch_taken', 'acct_test', 1, 'eur', '')")
            .execute(&mut *tx)
            .await;
        match inserted {
            Err(_) if !self.claims_success => Err(Status::already_exists("ch_taken exists")),
            _ => Ok(tonic::Response::new(ChargeReply::default())),
        }
    }

    type ListChargesStream = futures_util::stream::Empty<Result<ChargeReply, Status>>;

    async fn list_charges(
        &self,
        _: tonic::Request<ListChargesRequest>,
    ) -> Result<tonic::Response<Self::ListChargesStream>, Status> {
        Err(Status::unimplemented("not here"))
    }
}

#[tokio::test]
async fn a_refused_transaction_sends_the_handlers_error_and_withholds_its_ok() {
    let database = TestDatabase::create();
    let (store, _) = postgres(&database).await;
    sqlx::query("INSERT INTO charges VALUES ('ch_taken', 'acct_other', 5, 'eur', '')")
        .execute(store.pool())
        .await
        .unwrap();
    for claims_success in [false, true] {
        let executions = Arc::new(AtomicUsize::new(0));
        let conflicting = Conflicting {
            executions: executions.clone(),
            claims_success,
        };
        let mut client = serve_with(store.clone(), conflicting).await;
        let key = format!("dup-{claims_success}");
        for _ in 0..2 {
            let status = client.charge(charge(Some(&key), 1)).await.unwrap_err();
            // The handler's own error is the truth about its call; an `OK`
            // built on a refused transaction would describe a charge that
            // was rolled back, so the layer answers `INTERNAL` instead.
            let expected = if claims_success {
                Code::Internal
            } else {
                Code::AlreadyExists
            };
            assert_eq!(status.code(), expected, "{status:?}");
        }
        assert_eq!(
            executions.load(Ordering::SeqCst),
            2,
            "not stored: the key was released"
        );
    }
    assert_eq!(database.count("SELECT count(*) FROM charges").await, 1);
}

/// The example's binary, killed (SIGKILL) when dropped.
struct Example(std::process::Child);

impl Example {
    fn kill(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for Example {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The example's binary on `file`, serving on `port`, its card processor
/// taking `latency_ms`; returned once it says it listens.
fn start_example(file: &TestFile, port: u16, latency_ms: u64) -> Example {
    use std::io::{BufRead, BufReader};
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_grpc-payments"))
        .env("DATABASE_URL", file.url())
        .env("BIND_ADDR", format!("127.0.0.1:{port}"))
        .env("PROCESSOR_LATENCY_MS", latency_ms.to_string())
        .env("RUST_LOG", "off")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("start the grpc-payments binary");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(line.starts_with("listening on"), "{line:?}");
    Example(child)
}

#[tokio::test]
async fn killed_mid_charge_the_example_leaves_nothing_and_the_retry_charges_once() {
    let file = TestFile::create();
    let port = tower_idempotency_harness::redis_server::free_port();
    let mut server = start_example(&file, port, 3_000);
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let mut hurt = client(addr).await;
    let call = tokio::spawn(async move { hurt.charge(charge(Some("crash-1"), 4200)).await });
    // The charge is in its transaction, waiting on the card processor.
    tokio::time::sleep(Duration::from_millis(800)).await;
    server.kill();
    assert!(
        call.await.unwrap().is_err(),
        "the call died with the server"
    );

    // Nothing committed: neither the charge nor its key.
    let _server = start_example(&file, port, 0);
    assert_eq!(file.count("SELECT count(*) FROM charges").await, 0);
    let mut client = client(addr).await;
    let retry = client.charge(charge(Some("crash-1"), 4200)).await.unwrap();
    assert!(!replayed(&retry), "the retry executes");
    let again = client.charge(charge(Some("crash-1"), 4200)).await.unwrap();
    assert!(replayed(&again));
    assert_eq!(again.into_inner(), retry.into_inner());
    assert_eq!(
        file.count("SELECT count(*) FROM charges").await,
        1,
        "charged once"
    );
}

/// A server that does not accept gzip: tonic refuses a compressed call with
/// `UNIMPLEMENTED` before the method runs. That refusal did nothing and is
/// not stored (it was, for 24 h: the plain retry then got
/// `FAILED_PRECONDITION`, and nothing was ever charged).
#[tokio::test]
async fn a_compressed_call_the_server_refuses_does_not_burn_its_key() {
    let ledger = memory();
    let addr = serve(MemoryStore::new(), ledger.clone(), Settings::default()).await;
    let mut gzip = client(addr)
        .await
        .send_compressed(tonic::codec::CompressionEncoding::Gzip);
    let refused = gzip.charge(charge(Some("order-9"), 900)).await.unwrap_err();
    assert_eq!(refused.code(), Code::Unimplemented, "{refused:?}");
    let plain = client(addr)
        .await
        .charge(charge(Some("order-9"), 900))
        .await
        .unwrap();
    assert!(!replayed(&plain), "the retry executes");
    assert_eq!(charges(&ledger).await.len(), 1);
}

/// A server that accepts gzip: the layer compares calls by their messages
/// decompressed, so the retry of a gzip call replays whether it is
/// compressed or not (the fingerprint covered the compressed bytes: the
/// same message sent plain was refused as another request).
#[tokio::test]
async fn compressed_and_plain_calls_of_one_message_are_one_request() {
    let ledger = memory();
    let settings = Settings {
        accept_gzip: true,
        ..Settings::default()
    };
    let addr = serve(MemoryStore::new(), ledger.clone(), settings).await;
    let mut gzip = client(addr)
        .await
        .send_compressed(tonic::codec::CompressionEncoding::Gzip);
    let first = gzip.charge(charge(Some("order-10"), 1000)).await.unwrap();
    assert!(!replayed(&first));
    let plain = client(addr)
        .await
        .charge(charge(Some("order-10"), 1000))
        .await
        .unwrap();
    assert!(replayed(&plain), "the plain retry is the same request");
    assert_eq!(plain.into_inner(), first.get_ref().clone());
    let again = gzip.charge(charge(Some("order-10"), 1000)).await.unwrap();
    assert!(replayed(&again));
    assert_eq!(charges(&ledger).await.len(), 1);
}

/// A message tonic cannot decode is answered `INTERNAL` ("failed to decode
/// Protobuf message") before the method runs: not stored, so the client's
/// corrected call under the same key executes.
#[tokio::test]
async fn a_message_the_framework_cannot_decode_does_not_burn_its_key() {
    let ledger = memory();
    let addr = serve(MemoryStore::new(), ledger.clone(), Settings::default()).await;
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    // One frame whose message is not a ChargeRequest: field 1 as a varint
    // where the schema has an int64 is fine, so use a truncated field.
    let garbage = Bytes::from_static(b"\x00\x00\x00\x00\x02\x0a\xff");
    let request = http::Request::post(format!("http://{addr}/payments.v1.Payments/Charge"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("authorization", "Bearer tok_alice")
        .header("idempotency-key", "order-11")
        .body(tonic::body::Body::new(Full::new(garbage)))
        .unwrap();
    let response = channel.clone().oneshot(request).await.unwrap();
    let (parts, body) = response.into_parts();
    let trailers = body.collect().await.unwrap().trailers().cloned();
    let status = trailers
        .as_ref()
        .and_then(|t| t.get("grpc-status"))
        .or_else(|| parts.headers.get("grpc-status"))
        .map(|v| v.to_str().unwrap().to_owned());
    assert_eq!(
        status.as_deref(),
        Some("13"),
        "INTERNAL: {parts:?} {trailers:?}"
    );
    let fixed = client(addr)
        .await
        .charge(charge(Some("order-11"), 1100))
        .await
        .unwrap();
    assert!(!replayed(&fixed), "the corrected call executes");
    assert_eq!(charges(&ledger).await.len(), 1);
}

// The client layer below a tonic client: the key set once per call, the
// retryable statuses retried after their pushback, the others not.

/// A tonic client whose calls go through `IdempotentClientLayer`.
async fn idempotent_client(
    addr: SocketAddr,
) -> PaymentsClient<
    impl tonic::client::GrpcService<
        tonic::body::Body,
        ResponseBody = impl http_body::Body<Data = Bytes, Error = impl Into<tonic::codegen::StdError>>
                       + Send
                       + 'static,
        Error = impl Into<tonic::codegen::StdError>,
    > + Clone,
> {
    use tower_idempotency::client::IdempotentClientLayer;
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let service = tower::ServiceBuilder::new()
        .layer(
            IdempotentClientLayer::new()
                .backoff(Duration::from_millis(50), Duration::from_millis(200)),
        )
        .map_request(|r: http::Request<Full<Bytes>>| r.map(tonic::body::Body::new))
        .service(channel);
    PaymentsClient::new(service)
}

/// Serves `service` behind the layer, counting the requests that reach it.
async fn serve_counted<P: Payments>(service: P) -> (SocketAddr, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let requests = Arc::new(AtomicUsize::new(0));
    let counting = requests.clone();
    tokio::spawn(
        tonic::transport::Server::builder()
            .layer(tower::util::MapRequestLayer::new(
                move |r: http::Request<_>| {
                    counting.fetch_add(1, Ordering::SeqCst);
                    r
                },
            ))
            .layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant())
            .add_service(PaymentsServer::new(service))
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
    );
    (addr, requests)
}

#[tokio::test]
async fn the_client_layer_retries_unavailable_under_one_key_and_not_failed_precondition() {
    let executions = Arc::new(AtomicUsize::new(0));
    let flaky = Flaky {
        executions: executions.clone(),
        failures: 2,
        in_transaction: false,
    };
    let (addr, requests) = serve_counted(flaky).await;
    let mut client = idempotent_client(addr).await;
    // No key given: the layer sets one, the same on the three attempts.
    let reply = client.charge(charge(None, 1)).await.unwrap();
    assert_eq!(
        reply.get_ref().id,
        "ch_2",
        "UNAVAILABLE twice, then the charge"
    );
    assert_eq!(requests.load(Ordering::SeqCst), 3);
    // The key reused with another amount: FAILED_PRECONDITION, not retried.
    let reused = client.charge(charge(Some("k-1"), 1)).await.unwrap();
    assert_eq!(reused.get_ref().id, "ch_3");
    let before = requests.load(Ordering::SeqCst);
    let refused = client.charge(charge(Some("k-1"), 2)).await.unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition, "{refused:?}");
    assert_eq!(requests.load(Ordering::SeqCst), before + 1, "sent once");
}

#[tokio::test]
async fn the_client_layer_retries_aborted_in_flight_into_the_replay() {
    let ledger = memory();
    let settings = Settings {
        processor_latency: Duration::from_millis(600),
        ..Settings::default()
    };
    let addr = serve(MemoryStore::new(), ledger.clone(), settings).await;
    let client = idempotent_client(addr).await;
    let (mut a, mut b) = (client.clone(), client);
    let (first, second) = tokio::join!(a.charge(charge(Some("order-race"), 700)), async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        b.charge(charge(Some("order-race"), 700)).await
    });
    let (first, second) = (first.unwrap(), second.unwrap());
    assert!(!replayed(&first));
    assert!(
        replayed(&second),
        "ABORTED while in flight, retried after its pushback: the replay"
    );
    assert_eq!(first.into_inner(), second.into_inner());
    assert_eq!(charges(&ledger).await.len(), 1);
}
