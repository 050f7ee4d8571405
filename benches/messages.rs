//! Messages per second through `message::Idempotent`, against the same work
//! without it, side by side in one run: 32 concurrent consumers, a new
//! business key per message, for `MSG_SECS` (default 3) per variant and
//! `MSG_ROUNDS` rounds (default 3); ratios are medians of per-round ratios.
//!
//! Run with: `cargo bench --all-features --bench messages` (needs
//! `redis-server` on PATH and PostgreSQL, as the tests do).

use std::{
    env,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use tower_idempotency::{
    MemoryStore, PostgresStore, RedisStore,
    message::{IdempotencyProcessor, ProcessOutcome},
    sqlx::{self, PgConnection, PgPool, postgres::PgPoolOptions},
    store::Store,
};
use tower_idempotency_harness::postgres::TestDatabase;
use tower_idempotency_harness::redis_server::RedisServer;

const CONSUMERS: usize = 32;
const PAYLOAD: &[u8] = br#"{"order_id":"order","amount":1999,"currency":"eur"}"#;

/// The work when it writes nothing: build the result a consumer would store.
fn result(n: u64) -> String {
    format!("charged order-{n}")
}

async fn insert(on: &mut PgConnection, n: u64) {
    sqlx::query("INSERT INTO order_charges (order_id, amount) VALUES ($1, 1999)")
        .bind(format!("order-{n}"))
        .execute(on)
        .await
        .unwrap();
}

/// Processes message number `n`.
type Process = Arc<dyn Fn(u64) -> futures_util::future::BoxFuture<'static, ()> + Send + Sync>;

#[derive(Clone)]
enum Variant {
    Bare,
    Api(Process),
}

fn through<St: Store>(orders: IdempotencyProcessor<St>, round: u64) -> Variant {
    let orders = Arc::new(orders);
    Variant::Api(Arc::new(move |n| {
        let orders = orders.clone();
        Box::pin(async move {
            let key = format!("r{round}-{n}");
            let done = orders
                .process(&key, PAYLOAD, async |_: &mut _| Ok::<_, String>(result(n)))
                .await
                .unwrap();
            assert!(matches!(done, ProcessOutcome::Executed(_)));
        })
    }))
}

/// Messages per second for `secs`, `CONSUMERS` at a time. Each consumer
/// checks the deadline itself: bare work never yields, so a timer elsewhere
/// could not stop it.
async fn throughput(secs: u64, process: Process) -> f64 {
    let next = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let deadline = started + Duration::from_secs(secs);
    let workers: Vec<_> = (0..CONSUMERS)
        .map(|_| {
            let (next, process) = (next.clone(), process.clone());
            tokio::spawn(async move {
                while Instant::now() < deadline {
                    process(next.fetch_add(1, Ordering::Relaxed)).await;
                }
            })
        })
        .collect();
    for worker in workers {
        worker.await.unwrap();
    }
    next.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64()
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let number =
        |name: &str, default: u64| env::var(name).map_or(default, |v| v.parse().expect(name));
    let secs = number("MSG_SECS", 3);
    let rounds = number("MSG_ROUNDS", 3);

    let redis = RedisServer::start();
    let database = TestDatabase::create();
    let pool: PgPool = PgPoolOptions::new()
        .max_connections(CONSUMERS as u32 + 8)
        .test_before_acquire(false)
        .connect(database.url())
        .await
        .unwrap();
    sqlx::raw_sql("CREATE TABLE order_charges (order_id text, amount bigint)")
        .execute(&pool)
        .await
        .unwrap();
    let plain = PostgresStore::builder()
        .with_pool(pool.clone())
        .await
        .unwrap();
    plain.migrate().await.unwrap();
    // One mode per table.
    let transactional = PostgresStore::builder()
        .table("transactional_records")
        .transactional()
        .with_pool(pool.clone())
        .await
        .unwrap();
    transactional.migrate().await.unwrap();
    let redis_store = RedisStore::builder().connect(&redis.url()).await.unwrap();
    let memory = MemoryStore::new();

    // (name, reference, variant per round)
    type Make = Box<dyn Fn(u64) -> Variant>;
    let pg_bare: Make = {
        let pool = pool.clone();
        Box::new(move |_| {
            let pool = pool.clone();
            Variant::Api(Arc::new(move |n| {
                let pool = pool.clone();
                Box::pin(async move {
                    let mut tx = pool.begin().await.unwrap();
                    insert(&mut tx, n).await;
                    tx.commit().await.unwrap();
                    let _ = result(n);
                })
            }))
        })
    };
    let pg_tx: Make = Box::new(move |round| {
        let orders = Arc::new(IdempotencyProcessor::new(transactional.clone()));
        Variant::Api(Arc::new(move |n| {
            let orders = orders.clone();
            Box::pin(async move {
                let done = orders
                    .process(
                        &format!("r{round}-{n}"),
                        PAYLOAD,
                        async |tx: &mut tower_idempotency::PostgresTx| {
                            insert(tx, n).await;
                            Ok::<_, String>(result(n))
                        },
                    )
                    .await
                    .unwrap();
                assert!(matches!(done, ProcessOutcome::Executed(_)));
            })
        }))
    });
    let variants: Vec<(&str, &str, Make)> = vec![
        ("bare", "bare", Box::new(|_| Variant::Bare)),
        (
            "memory",
            "bare",
            Box::new(move |r| through(IdempotencyProcessor::new(memory.clone()), r)),
        ),
        (
            "redis",
            "bare",
            Box::new(move |r| through(IdempotencyProcessor::new(redis_store.clone()), r)),
        ),
        (
            "postgres",
            "bare",
            Box::new(move |r| through(IdempotencyProcessor::new(plain.clone()), r)),
        ),
        ("pg-insert-bare", "pg-insert-bare", pg_bare),
        ("pg-insert-tx", "pg-insert-bare", pg_tx),
    ];

    println!(
        "messages: {} variants x {rounds} rounds x {secs}s, {CONSUMERS} concurrent consumers, 2 tokio workers",
        variants.len()
    );
    let mut rates = vec![Vec::new(); variants.len()];
    for round in 1..=rounds {
        println!("\nround {round}");
        for (i, (name, reference, make)) in variants.iter().enumerate() {
            let process = match make(round) {
                Variant::Bare => {
                    Arc::new(|n: u64| -> futures_util::future::BoxFuture<'static, ()> {
                        Box::pin(async move {
                            std::hint::black_box(result(n));
                        })
                    })
                        as Arc<
                            dyn Fn(u64) -> futures_util::future::BoxFuture<'static, ()>
                                + Send
                                + Sync,
                        >
                }
                Variant::Api(process) => process,
            };
            let rate = throughput(secs, process).await;
            rates[i].push(rate);
            let reference_rate = variants
                .iter()
                .position(|v| v.0 == *reference)
                .map(|j| rates[j][round as usize - 1])
                .unwrap();
            println!(
                "{name:<16} {rate:>12.0} msg/s {:>8.4} x {reference}",
                rate / reference_rate
            );
        }
    }
    println!("\nmedian over {rounds} rounds");
    for (i, (name, reference, _)) in variants.iter().enumerate() {
        let j = variants.iter().position(|v| v.0 == *reference).unwrap();
        let ratio = median(rates[i].iter().zip(&rates[j]).map(|(a, b)| a / b).collect());
        println!(
            "{name:<16} {:>12.0} msg/s {ratio:>8.4} x {reference}",
            median(rates[i].clone())
        );
    }
    drop(redis);
}
