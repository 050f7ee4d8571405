//! The DynamoDB lease store through the layer, against a hand-written
//! floor that gives the same guarantee — a conditional `PutItem` claim
//! (free, or lapsed) that returns what it met, the handler, a completion
//! conditional on the claim's token — side by side in one run on a
//! dynoxide server: first executions and replays, requests per second and
//! their ratio per round; then the capacity units DynamoDB reports for
//! each step of a first execution and a replay, and the requests the store
//! sends for each (counted on its client).
//!
//! Run with: `cargo bench --features dynamodb --bench dynamodb` (needs
//! `dynoxide` on PATH: scripts/services installs it). `DDB_SECS` (per run,
//! default 3), `DDB_ROUNDS` (default 3), `DDB_WORKERS` (concurrent
//! requests, default 8). dynoxide serialises writers: the ratios are the
//! client side's cost over one emulator, not DynamoDB's latency.

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use axum::{
    Router,
    body::Body,
    extract::State,
    http::{HeaderMap, Request, StatusCode},
    response::{IntoResponse, Response},
    routing::post,
};
use tower::ServiceExt;
use tower_idempotency::{
    DynamoDbStore, IdempotencyLayer,
    aws_sdk_dynamodb::{
        Client,
        operation::put_item::PutItemError,
        primitives::Blob,
        types::{AttributeValue, ReturnConsumedCapacity, ReturnValuesOnConditionCheckFailure},
    },
};
use tower_idempotency_harness::dynamodb::{DynamoServer, table_name};

const BODY: &str = r#"{"amount":1999,"currency":"eur"}"#;

/// The requests a client sends, by operation (its `X-Amz-Target`, less the
/// API version): what a first execution or a replay costs DynamoDB,
/// whatever the emulator makes of the CPU.
#[derive(Clone, Debug, Default)]
struct Requests(Arc<std::sync::Mutex<std::collections::BTreeMap<String, u64>>>);

impl aws_smithy_runtime_api::client::interceptors::Intercept for Requests {
    fn name(&self) -> &'static str {
        "Requests"
    }

    fn read_before_transmit(
        &self,
        context: &aws_smithy_runtime_api::client::interceptors::context::BeforeTransmitInterceptorContextRef<'_>,
        _: &aws_smithy_runtime_api::client::runtime_components::RuntimeComponents,
        _: &mut aws_smithy_types::config_bag::ConfigBag,
    ) -> Result<(), aws_smithy_runtime_api::box_error::BoxError> {
        let target = context
            .request()
            .headers()
            .get("x-amz-target")
            .unwrap_or("?");
        let operation = target.rsplit('.').next().unwrap_or(target).to_owned();
        *self.0.lock().unwrap().entry(operation).or_default() += 1;
        Ok(())
    }
}

impl Requests {
    /// The requests sent while `n` requests went through `app`, per request.
    async fn per(&self, app: &Router, keys: impl Iterator<Item = String>) -> String {
        self.0.lock().unwrap().clear();
        let mut n = 0;
        for key in keys {
            let reply = app.clone().oneshot(request(&key)).await.unwrap();
            assert_eq!(reply.status(), StatusCode::CREATED, "{key}");
            n += 1;
        }
        let counted = self.0.lock().unwrap();
        let total: u64 = counted.values().sum();
        let each: Vec<String> = counted
            .iter()
            .map(|(operation, count)| format!("{operation} {:.2}", *count as f64 / n as f64))
            .collect();
        format!("{:.2} ({})", total as f64 / n as f64, each.join(", "))
    }
}
const ANSWER: &str = r#"{"id":"ch_1","amount":1999,"currency":"eur","status":"succeeded"}"#;

fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

async fn charge() -> Response {
    (StatusCode::CREATED, ANSWER).into_response()
}

/// The floor: the same claim, handler and fenced completion written by
/// hand, the answer stored as its bytes.
#[derive(Clone)]
struct Floor {
    client: Client,
    table: String,
}

async fn floor(
    State(floor): State<Floor>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    let key = headers["idempotency-key"].to_str().unwrap().to_owned();
    let fingerprint = sha2_like(&body);
    let token = fastrand::u128(..).to_le_bytes().to_vec();
    let now = now_ms();
    let claimed = floor
        .client
        .put_item()
        .table_name(&floor.table)
        .item("pk", AttributeValue::S(key.clone()))
        .item("st", AttributeValue::S("i".into()))
        .item("fp", AttributeValue::B(Blob::new(fingerprint.clone())))
        .item("tok", AttributeValue::B(Blob::new(token.clone())))
        .item("exp", AttributeValue::N((now + 30_000).to_string()))
        .condition_expression("attribute_not_exists(#pk) OR #exp < :now")
        .expression_attribute_names("#pk", "pk")
        .expression_attribute_names("#exp", "exp")
        .expression_attribute_values(":now", AttributeValue::N(now.to_string()))
        .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
        .send()
        .await;
    if let Err(error) = claimed {
        let old = match error.into_service_error() {
            PutItemError::ConditionalCheckFailedException(failed) => failed.item,
            _ => return StatusCode::SERVICE_UNAVAILABLE.into_response(),
        };
        let old = old.unwrap_or_default();
        if old.get("fp") != Some(&AttributeValue::B(Blob::new(fingerprint))) {
            return StatusCode::UNPROCESSABLE_ENTITY.into_response();
        }
        return match old.get("rec") {
            Some(AttributeValue::B(record)) => {
                (StatusCode::CREATED, record.as_ref().to_vec()).into_response()
            }
            _ => StatusCode::CONFLICT.into_response(),
        };
    }
    let answer = charge().await;
    let completed = floor
        .client
        .put_item()
        .table_name(&floor.table)
        .item("pk", AttributeValue::S(key))
        .item("st", AttributeValue::S("c".into()))
        .item("fp", AttributeValue::B(Blob::new(sha2_like(&body))))
        .item("exp", AttributeValue::N((now + 86_400_000).to_string()))
        .item(
            "rec",
            AttributeValue::B(Blob::new(ANSWER.as_bytes().to_vec())),
        )
        .condition_expression("#tok = :tok AND #st = :i")
        .expression_attribute_names("#tok", "tok")
        .expression_attribute_names("#st", "st")
        .expression_attribute_values(":tok", AttributeValue::B(Blob::new(token)))
        .expression_attribute_values(":i", AttributeValue::S("i".into()))
        .send()
        .await;
    match completed {
        Ok(_) => answer,
        Err(_) => StatusCode::SERVICE_UNAVAILABLE.into_response(),
    }
}

/// The body's SHA-256, as a fingerprint stands for it (the floor hashes
/// it raw: less than the layer's canonical JSON, in the floor's favour).
fn sha2_like(body: &[u8]) -> Vec<u8> {
    use sha2::Digest;
    sha2::Sha256::digest(body).to_vec()
}

fn request(key: &str) -> Request<Body> {
    Request::post("/charges")
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Body::from(BODY))
        .unwrap()
}

/// Requests per second through `app` for `secs`, `workers` at once: each a
/// fresh key (`first`) or one completed key (a replay).
async fn rate(app: &Router, first: bool, secs: u64, workers: u64, tag: &str) -> f64 {
    let done = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + Duration::from_secs(secs);
    let replayed = format!("{tag}-replayed");
    if !first {
        let reply = app.clone().oneshot(request(&replayed)).await.unwrap();
        assert_eq!(reply.status(), StatusCode::CREATED);
    }
    let tasks = (0..workers).map(|w| {
        let (app, done, replayed) = (app.clone(), done.clone(), replayed.clone());
        let tag = tag.to_owned();
        tokio::spawn(async move {
            let mut n = 0;
            while Instant::now() < deadline {
                let key = match first {
                    true => format!("{tag}-{w}-{n}"),
                    false => replayed.clone(),
                };
                let reply = app.clone().oneshot(request(&key)).await.unwrap();
                assert_eq!(reply.status(), StatusCode::CREATED, "{key}");
                n += 1;
            }
            done.fetch_add(n, Ordering::Relaxed);
        })
    });
    let started = Instant::now();
    futures_util::future::join_all(tasks).await;
    done.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64()
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// The capacity DynamoDB reports for a first execution's two writes and a
/// replay's refused claim (a refused conditional write is billed, its
/// units not reported back: DynamoDB bills 1 WCU per KB of the item).
async fn capacity(client: &Client, table: &str) {
    let total = |c: Option<&tower_idempotency::aws_sdk_dynamodb::types::ConsumedCapacity>| {
        c.and_then(|c| c.capacity_units()).unwrap_or_default()
    };
    let claim = client
        .put_item()
        .table_name(table)
        .item("pk", AttributeValue::S("capacity".into()))
        .item("st", AttributeValue::S("i".into()))
        .item("fp", AttributeValue::B(Blob::new(vec![0; 32])))
        .item("tok", AttributeValue::B(Blob::new(vec![0; 16])))
        .item("exp", AttributeValue::N(u64::MAX.to_string()))
        .condition_expression("attribute_not_exists(pk)")
        .return_consumed_capacity(ReturnConsumedCapacity::Total)
        .send()
        .await
        .unwrap();
    let completion = client
        .put_item()
        .table_name(table)
        .item("pk", AttributeValue::S("capacity".into()))
        .item("st", AttributeValue::S("c".into()))
        .item("fp", AttributeValue::B(Blob::new(vec![0; 32])))
        .item("exp", AttributeValue::N(u64::MAX.to_string()))
        .item("rec", AttributeValue::B(Blob::new(vec![b'x'; 300])))
        .return_consumed_capacity(ReturnConsumedCapacity::Total)
        .send()
        .await
        .unwrap();
    println!(
        "\ncapacity (as dynoxide reports it): claim {} WCU, completion {} WCU: a first execution {} WCU \
         (Powertools: 2 WCU); a replay and a 409 are one refused conditional write, billed 1 WCU",
        total(claim.consumed_capacity()),
        total(completion.consumed_capacity()),
        total(claim.consumed_capacity()) + total(completion.consumed_capacity()),
    );
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let (secs, rounds, workers) = (
        env_number("DDB_SECS", 3),
        env_number("DDB_ROUNDS", 3),
        env_number("DDB_WORKERS", 8),
    );
    let server = DynamoServer::start();
    let client = server.client();
    let (layered_table, floor_table) = (table_name(), table_name());
    // The store's own client counts what it sends.
    let requests = Requests::default();
    let counted = Client::from_conf(
        client
            .config()
            .to_builder()
            .interceptor(requests.clone())
            .build(),
    );
    let store = DynamoDbStore::builder(counted)
        .table(&layered_table)
        .create_table_if_missing()
        .build()
        .await
        .unwrap();
    DynamoDbStore::builder(client.clone())
        .table(&floor_table)
        .create_table_if_missing()
        .build()
        .await
        .unwrap();
    let layered = Router::new()
        .route("/charges", post(charge))
        .layer(IdempotencyLayer::new(store).single_tenant());
    let floored = Router::new()
        .route("/charges", post(floor))
        .with_state(Floor {
            client: client.clone(),
            table: floor_table.clone(),
        });
    println!(
        "DynamoDB (dynoxide) lease store vs the hand-written conditional-put floor: {rounds} rounds x {secs}s, {workers} at once"
    );
    println!(
        "| round | layer first req/s | floor first req/s | ratio | layer replay req/s | floor replay req/s | ratio |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|");
    let (mut firsts, mut replays) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        let tag = |what: &str| format!("r{round}-{what}");
        // Alternating which goes first: the emulator's tables grow with
        // every first execution.
        let (layer_first, floor_first) = if round % 2 == 0 {
            let floor = rate(&floored, true, secs, workers, &tag("floor")).await;
            (
                rate(&layered, true, secs, workers, &tag("layer")).await,
                floor,
            )
        } else {
            let layer = rate(&layered, true, secs, workers, &tag("layer")).await;
            (
                layer,
                rate(&floored, true, secs, workers, &tag("floor")).await,
            )
        };
        let layer_replay = rate(&layered, false, secs, workers, &tag("layer")).await;
        let floor_replay = rate(&floored, false, secs, workers, &tag("floor")).await;
        firsts.push(layer_first / floor_first);
        replays.push(layer_replay / floor_replay);
        println!(
            "| {} | {layer_first:.0} | {floor_first:.0} | {:.3} | {layer_replay:.0} | {floor_replay:.0} | {:.3} |",
            round + 1,
            layer_first / floor_first,
            layer_replay / floor_replay
        );
    }
    println!(
        "medians: first {:.3}, replay {:.3}",
        median(firsts),
        median(replays)
    );
    capacity(&client, &floor_table).await;
    let first = requests
        .per(&layered, (0..200).map(|i| format!("counted-{i}")))
        .await;
    let replay = requests
        .per(&layered, (0..200).map(|_| "counted-0".to_owned()))
        .await;
    println!(
        "the store's requests (counted on its client, 200 each): a first execution {first}; a replay {replay}"
    );
}
