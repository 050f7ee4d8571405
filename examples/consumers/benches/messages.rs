//! Messages per second through `message::Idempotent`, against the same work
//! without it, side by side in one run: 32 concurrent consumers, a new
//! business key per message, for `MSG_SECS` (default 3) per variant and
//! `MSG_ROUNDS` rounds (default 3); ratios are medians of per-round ratios.
//!
//! Then the brokers: messages per second through the SQS and JetStream
//! consumers' processing path (receive a batch, charge each message in a
//! PostgreSQL transaction, delete or acknowledge), with the crate
//! (`-tx`), without it (`-bare`), and with the crate's guarantee written by
//! hand and batched (`-floor`: a received batch's ids into
//! `processed_messages`, `ON CONFLICT DO NOTHING RETURNING`, and the
//! charges of the ids returned, in one transaction), side by side per
//! round, each variant on a fresh queue or stream filled beforehand. On
//! JetStream, the library's consumer loop too (`tower_idempotency_nats`
//! under `message::Consumer`, `in_hand(1000)`): `-loop`, each message on
//! its own side by side; `-loop-keys`, in order per `Ordering-Key` (eight
//! accounts), a key's messages in hand together settled in batches of up
//! to 100 — the messages are the same in every JetStream variant, each
//! with its account's key.
//!
//! Run with: `cargo bench --all-features --bench messages` (needs
//! `redis-server`, `moto_server` and `nats-server` on PATH and PostgreSQL,
//! as the tests do). `MSG_BROKERS=0` leaves the brokers out.
//!
//! Last, the outbox relay: messages per second from a PostgreSQL outbox
//! to JetStream (claim a batch, publish it, mark it sent) against
//! publishing the same messages directly, as many at a time, each
//! acknowledged by the stream. `MSG_OUTBOX=0` leaves it out;
//! `MSG_OUTBOX_N` messages per variant and round (default 10 000).

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
    sqlx::raw_sql(
        "CREATE TABLE order_charges (order_id text, amount bigint);
         CREATE TABLE processed_messages (id text PRIMARY KEY)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let plain = PostgresStore::builder()
        .create_table_if_missing()
        .with_pool(pool.clone())
        .await
        .unwrap();
    // One mode per table.
    let transactional = PostgresStore::builder()
        .table("transactional_records")
        .transactional()
        .create_table_if_missing()
        .with_pool(pool.clone())
        .await
        .unwrap();
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
    // The broker variants' keys are their own: the same store serves them.
    let broker_store = transactional.clone();
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

    if number("MSG_BROKERS", 1) == 1 {
        brokers::run(secs, rounds, &pool, broker_store.clone()).await;
    }
    if number("MSG_OUTBOX", 1) == 1 {
        brokers::relay(rounds, broker_store).await;
    }
}

// The brokers' fixtures, as the consumers' tests start them.
// The guarantee by hand, batched: the floor beside the crate.
#[path = "../tests/support/dead_letter.rs"]
#[allow(dead_code)]
mod dead_letter;
#[path = "../tests/support/nats.rs"]
#[allow(dead_code)]
mod nats;
mod recipe;
#[path = "../tests/support/sqs.rs"]
#[allow(dead_code)]
mod sqs;
use dead_letter::DeadLetter;

mod brokers {
    //! The broker variants: each round fills a fresh queue (stream) with
    //! more messages than a run can drain, then `CONSUMERS / 8` consumer
    //! tasks receive batches of 10 and process a batch's messages
    //! concurrently until the time is up.

    use std::{
        sync::{
            Arc,
            atomic::{AtomicU64, Ordering},
        },
        time::{Duration, Instant},
    };

    use super::{
        nats::{NatsServer, TestStream},
        sqs::{SqsServer, TestQueue},
    };
    use async_nats::jetstream::{self, consumer::pull};
    use aws_sdk_sqs::types::{DeleteMessageBatchRequestEntry, SendMessageBatchRequestEntry};
    use futures_util::{StreamExt, future::join_all};
    use tower_idempotency::{
        PostgresTx, PostgresTxStore,
        message::{
            Consumer, Disposition, IdempotencyProcessor, Parsed, ProcessOutcome, Report,
            extend_every,
        },
        outbox::{Outbox, OutboxMessage, OutboxRelay, OutgoingMessage, PublishError, Publisher},
        sqlx::{self, PgPool},
    };
    use tower_idempotency_nats::JetStream;

    const RECEIVERS: usize = 4;
    /// The accounts a JetStream message's `Ordering-Key` names.
    const ACCOUNTS: u64 = 8;

    /// The charge, as the examples write it.
    async fn charge(on: &mut sqlx::PgConnection, order_id: &str) {
        sqlx::query("INSERT INTO order_charges (order_id, amount) VALUES ($1, 1999)")
            .bind(order_id)
            .execute(on)
            .await
            .unwrap();
    }

    fn order_id(body: &[u8]) -> String {
        let order: serde_json::Value = serde_json::from_slice(body).unwrap();
        order["order_id"].as_str().unwrap().to_owned()
    }

    /// How a receiver settles what it received.
    #[derive(Clone, Copy)]
    enum Work<'a> {
        /// Each message charged by hand in a transaction of its own, no
        /// idempotency.
        Bare,
        /// The crate's guarantee by hand, batched: the batch's ids into
        /// `processed_messages` (`ON CONFLICT DO NOTHING RETURNING`) and
        /// the charges of the ids returned, in one transaction.
        Floor,
        /// Each message through the processor, the record in the charge's
        /// transaction.
        Tx(&'a IdempotencyProcessor<PostgresTxStore>),
    }

    impl<'a> Work<'a> {
        fn of(name: &str, orders: &'a IdempotencyProcessor<PostgresTxStore>) -> Self {
            match name.rsplit('-').next() {
                Some("tx") => Work::Tx(orders),
                Some("floor") => Work::Floor,
                _ => Work::Bare,
            }
        }
    }

    /// A received batch's work: see [`Work`].
    async fn settle(pool: &PgPool, how: Work<'_>, bodies: &[&[u8]]) {
        if let Work::Floor = how {
            let ids: Vec<String> = bodies.iter().map(|body| order_id(body)).collect();
            let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
            let mut tx = pool.begin().await.unwrap();
            let new = super::recipe::new_ids(&mut tx, &ids).await;
            sqlx::query(
                "INSERT INTO order_charges (order_id, amount) SELECT id, 1999 FROM unnest($1::text[]) AS id",
            )
            .bind(&new)
            .execute(&mut *tx)
            .await
            .unwrap();
            tx.commit().await.unwrap();
            return;
        }
        join_all(bodies.iter().map(|body| work(pool, how, body))).await;
    }

    /// One message's work, by hand or through the processor, the broker's
    /// hold extended while it runs.
    async fn work(pool: &PgPool, how: Work<'_>, body: &[u8]) {
        let id = order_id(body);
        match how {
            Work::Bare | Work::Floor => {
                let mut tx = pool.begin().await.unwrap();
                charge(&mut tx, &id).await;
                tx.commit().await.unwrap();
            }
            Work::Tx(orders) => {
                let hold = extend_every(Duration::from_secs(10), || async { Ok(()) });
                // moto may hand one message to two receivers at once: a
                // duplicate or an in-flight answer is the crate doing its job.
                let done = orders
                    .process_delivery(&id, body, &hold, async |tx: &mut PostgresTx| {
                        charge(tx, &id).await;
                        Ok::<_, String>(())
                    })
                    .await;
                assert!(matches!(
                    done,
                    Ok(ProcessOutcome::Executed(())
                        | ProcessOutcome::Duplicate(())
                        | ProcessOutcome::InFlight { .. })
                ));
            }
        }
    }

    fn body(variant: &str, round: u64, i: u64) -> String {
        format!(r#"{{"order_id":"{variant}-{round}-{i}","amount":1999,"currency":"eur"}}"#)
    }

    async fn sqs_fill(queue: &TestQueue, variant: &str, round: u64, n: u64) {
        let batches = (0..n.div_ceil(10)).map(|b| {
            let entries = (b * 10..(b * 10 + 10).min(n))
                .map(|i| {
                    SendMessageBatchRequestEntry::builder()
                        .id(i.to_string())
                        .message_body(body(variant, round, i))
                        .build()
                        .unwrap()
                })
                .collect();
            let (client, url) = (queue.client.clone(), queue.url.clone());
            async move {
                client
                    .send_message_batch()
                    .queue_url(url)
                    .set_entries(Some(entries))
                    .send()
                    .await
                    .unwrap();
            }
        });
        // 16 sends at a time.
        futures_util::stream::iter(batches)
            .buffer_unordered(16)
            .collect::<Vec<_>>()
            .await;
    }

    async fn sqs_rate(queue: &TestQueue, pool: &PgPool, how: Work<'_>, secs: u64) -> f64 {
        let done = AtomicU64::new(0);
        let started = Instant::now();
        let last = std::sync::Mutex::new(started);
        let deadline = started + Duration::from_secs(secs);
        let receiver = async || {
            while Instant::now() < deadline {
                let got = queue
                    .client
                    .receive_message()
                    .queue_url(&queue.url)
                    .max_number_of_messages(10)
                    .wait_time_seconds(1)
                    .send()
                    .await
                    .unwrap();
                let messages = got.messages.unwrap_or_default();
                let bodies: Vec<&[u8]> = messages
                    .iter()
                    .map(|m| m.body().unwrap().as_bytes())
                    .collect();
                settle(pool, how, &bodies).await;
                let entries: Vec<_> = messages
                    .iter()
                    .enumerate()
                    .map(|(i, m)| {
                        DeleteMessageBatchRequestEntry::builder()
                            .id(i.to_string())
                            .receipt_handle(m.receipt_handle().unwrap())
                            .build()
                            .unwrap()
                    })
                    .collect();
                if entries.is_empty() {
                    continue;
                }
                let n = entries.len() as u64;
                queue
                    .client
                    .delete_message_batch()
                    .queue_url(&queue.url)
                    .set_entries(Some(entries))
                    .send()
                    .await
                    .unwrap();
                done.fetch_add(n, Ordering::Relaxed);
                *last.lock().unwrap() = Instant::now();
            }
        };
        join_all((0..RECEIVERS).map(|_| receiver())).await;
        rate(&done, started, &last)
    }

    /// Messages per second up to the last one processed: a queue drained
    /// before the time is up does not count the idle end.
    fn rate(done: &AtomicU64, started: Instant, last: &std::sync::Mutex<Instant>) -> f64 {
        let elapsed = last.lock().unwrap().duration_since(started).as_secs_f64();
        done.load(Ordering::Relaxed) as f64 / elapsed.max(1e-3)
    }

    async fn nats_rate(
        stream: &TestStream,
        durable: &str,
        pool: &PgPool,
        how: Work<'_>,
        secs: u64,
    ) -> f64 {
        let js_stream = stream.js.get_stream(&stream.name).await.unwrap();
        let consumer: jetstream::consumer::PullConsumer = js_stream
            .get_or_create_consumer(
                durable,
                pull::Config {
                    durable_name: Some(durable.to_owned()),
                    filter_subject: stream.subject.clone(),
                    ack_policy: jetstream::consumer::AckPolicy::Explicit,
                    ..Default::default()
                },
            )
            .await
            .unwrap();
        let done = AtomicU64::new(0);
        let started = Instant::now();
        let last = std::sync::Mutex::new(started);
        let deadline = started + Duration::from_secs(secs);
        let receiver = async || {
            while Instant::now() < deadline {
                let mut batch = consumer.fetch().max_messages(10).messages().await.unwrap();
                let mut messages = Vec::new();
                while let Some(message) = batch.next().await {
                    messages.push(message.unwrap());
                }
                let bodies: Vec<&[u8]> = messages.iter().map(|m| &m.payload[..]).collect();
                settle(pool, how, &bodies).await;
                join_all(
                    messages
                        .iter()
                        .map(|m| async move { m.ack().await.unwrap() }),
                )
                .await;
                if !messages.is_empty() {
                    done.fetch_add(messages.len() as u64, Ordering::Relaxed);
                    *last.lock().unwrap() = Instant::now();
                }
            }
        };
        join_all((0..RECEIVERS).map(|_| receiver())).await;
        rate(&done, started, &last)
    }

    /// The library's consumer loop over the JetStream adapter, in
    /// process, for `secs`, then stopped (what is in hand answered): each
    /// message on its own side by side, or (`keyed`) in order per
    /// `Ordering-Key`, a key's messages in hand together in batches.
    async fn nats_loop_rate(
        stream: &TestStream,
        orders: IdempotencyProcessor<PostgresTxStore>,
        keyed: bool,
        secs: u64,
    ) -> f64 {
        let js_stream = stream.js.get_stream(&stream.name).await.unwrap();
        let consumer: jetstream::consumer::PullConsumer = js_stream
            .get_or_create_consumer(
                "bench-loop",
                pull::Config {
                    durable_name: Some("bench-loop".to_owned()),
                    filter_subject: stream.subject.clone(),
                    ack_policy: jetstream::consumer::AckPolicy::Explicit,
                    ..Default::default()
                },
            )
            .await
            .unwrap();
        let mut broker = JetStream::builder(stream.js.clone(), consumer);
        if keyed {
            broker = broker.ordered_by_header("Ordering-Key");
        }
        let broker = broker.build().await.unwrap();
        let done = Arc::new(AtomicU64::new(0));
        let started = Instant::now();
        let last = Arc::new(std::sync::Mutex::new(started));
        let on_settled = {
            let (done, last) = (done.clone(), last.clone());
            // Decided: acknowledged (at the stop, what waits is given back).
            move |report: &Report<'_, _, String, (), String>| {
                if matches!(report.disposition, Disposition::Ack) {
                    done.fetch_add(1, Ordering::Relaxed);
                    *last.lock().unwrap() = Instant::now();
                }
            }
        };
        Consumer::new(broker, orders)
            .in_hand(1000)
            .batch(100)
            .on_settled(on_settled)
            .run(
                |body: &[u8]| {
                    let id = order_id(body);
                    Ok(Parsed {
                        key: id.clone(),
                        message: id,
                    })
                },
                async |tx: &mut PostgresTx, id: &String| {
                    charge(tx, id).await;
                    Ok::<_, String>(())
                },
                tokio::time::sleep(Duration::from_secs(secs)),
            )
            .await
            .unwrap();
        rate(&done, started, &last)
    }

    fn number(name: &str, default: u64) -> u64 {
        std::env::var(name).map_or(default, |v| v.parse().expect(name))
    }

    pub async fn run(secs: u64, rounds: u64, pool: &PgPool, store: PostgresTxStore) {
        let sqs = SqsServer::start();
        let nats = NatsServer::start();
        let orders = Arc::new(IdempotencyProcessor::new(store.clone()).scope("brokers"));
        // Enough for a run: well over what one drains in `secs`.
        let (sqs_fill_n, nats_fill_n) = (
            number("MSG_SQS_FILL", 300),
            number("MSG_NATS_FILL", 5_000 * secs),
        );
        println!(
            "\nbrokers: SQS (moto_server) and JetStream (nats-server), {RECEIVERS} receivers x batches of 10, {rounds} rounds x {secs}s, charge in PostgreSQL"
        );
        // Each broker's bare variant first: the reference of the two after.
        let names = [
            "sqs-bare",
            "sqs-floor",
            "sqs-tx",
            "nats-bare",
            "nats-floor",
            "nats-tx",
            "nats-loop",
            "nats-loop-keys",
        ];
        // Each variant against its broker's bare variant (its first) and
        // floor (its second).
        let reference = |i: usize| {
            let broker = names[i].split('-').next();
            names
                .iter()
                .position(|n| n.split('-').next() == broker)
                .unwrap()
        };
        let mut rates = vec![Vec::new(); names.len()];
        for round in 1..=rounds {
            println!("\nround {round}");
            for (i, name) in names.iter().enumerate() {
                let with = Work::of(name, &orders);
                let rate = if name.starts_with("sqs") {
                    let queue = TestQueue::without_dead_letters(&sqs, 30).await;
                    sqs_fill(&queue, name, round, sqs_fill_n).await;
                    let rate = sqs_rate(&queue, pool, with, secs).await;
                    queue.delete().await;
                    rate
                } else {
                    let stream = TestStream::create(&nats).await;
                    // Each publish acknowledged by the stream, 64 at a time.
                    let publishes = (0..nats_fill_n).map(|j| {
                        let (js, subject) = (stream.js.clone(), stream.subject.clone());
                        let body = body(name, round, j);
                        let mut headers = async_nats::HeaderMap::new();
                        headers.insert("Ordering-Key", format!("acct-{}", j % ACCOUNTS));
                        async move {
                            js.publish_with_headers(subject, headers, body.into())
                                .await
                                .unwrap()
                                .await
                                .unwrap()
                        }
                    });
                    futures_util::stream::iter(publishes)
                        .buffer_unordered(64)
                        .collect::<Vec<_>>()
                        .await;
                    match name.strip_prefix("nats-loop") {
                        Some(keys) => {
                            // A processor of its own: the loop drains it
                            // when it stops.
                            let orders = IdempotencyProcessor::new(store.clone()).scope("brokers");
                            nats_loop_rate(&stream, orders, !keys.is_empty(), secs).await
                        }
                        None => nats_rate(&stream, "bench", pool, with, secs).await,
                    }
                };
                rates[i].push(rate);
                let bare = rates[reference(i)][round as usize - 1];
                println!(
                    "{name:<16} {rate:>12.0} msg/s {:>8.4} x {}",
                    rate / bare,
                    names[reference(i)]
                );
            }
        }
        println!("\nmedian over {rounds} rounds");
        let ratio = |i: usize, of: usize| {
            super::median(
                rates[i]
                    .iter()
                    .zip(&rates[of])
                    .map(|(a, b)| a / b)
                    .collect(),
            )
        };
        for (i, name) in names.iter().enumerate() {
            let floor = reference(i) + 1;
            println!(
                "{name:<16} {:>12.0} msg/s {:>8.4} x {} {:>8.4} x {}",
                super::median(rates[i].clone()),
                ratio(i, reference(i)),
                names[reference(i)],
                ratio(i, floor),
                names[floor]
            );
        }
    }

    /// Publishes to JetStream with the message's id as `Nats-Msg-Id`, once
    /// the stream acknowledged it, as the `outbox_relay` example does.
    struct JetStreamPublisher(jetstream::Context);

    impl Publisher for JetStreamPublisher {
        async fn publish(&self, message: &OutboxMessage) -> Result<(), PublishError> {
            let mut headers = async_nats::HeaderMap::new();
            headers.insert("Nats-Msg-Id", message.id.as_str());
            let acked = async {
                self.0
                    .publish_with_headers(
                        message.destination.clone(),
                        headers,
                        message.payload.clone().into(),
                    )
                    .await?
                    .await
            };
            acked
                .await
                .map(drop)
                .map_err(|e| PublishError::Unavailable(e.into()))
        }
    }

    /// The relay against publishing directly: per round, `nats-direct`
    /// publishes N messages 64 at a time; `nats-relay` enqueues N messages
    /// in the outbox beforehand (one consumer transaction each, not timed),
    /// then relays until the outbox is empty (the relay's defaults). The
    /// messages have 256 ordering keys, as accounts would. Beside each
    /// rate, the CPU time per message of `nats-server`, PostgreSQL and this
    /// process: on a machine whose cores the three share, what the
    /// database adds per message bounds the relay's rate.
    pub async fn relay(rounds: u64, store: PostgresTxStore) {
        use tower_idempotency_harness::cpu;
        /// CPU µs per message of nats-server, postgres and this process
        /// over `run`, and its rate.
        async fn costed(n: u64, run: impl std::future::Future<Output = ()>) -> (f64, [f64; 3]) {
            let read = || {
                [
                    cpu::processes_us("nats-server"),
                    cpu::processes_us("postgres"),
                    cpu::own_us(),
                ]
            };
            let before = read();
            let started = Instant::now();
            run.await;
            let rate = n as f64 / started.elapsed().as_secs_f64();
            let after = read();
            let per = |i: usize| (after[i] - before[i]) / n as f64;
            (rate, [per(0), per(1), per(2)])
        }
        let n = number("MSG_OUTBOX_N", 10_000);
        let nats = NatsServer::start();
        let outbox = Outbox::on(&store)
            .table("bench_outbox")
            .create_table_if_missing()
            .build()
            .await
            .unwrap();
        let events = IdempotencyProcessor::new(store).scope("outbox-bench");
        println!(
            "\noutbox relay: {n} messages per variant and round to JetStream (nats-server), PostgreSQL outbox, {rounds} rounds; cpu us per message: nats-server / postgres / this process"
        );
        let (mut direct, mut relayed) = (Vec::new(), Vec::new());
        for round in 1..=rounds {
            let body = |i: u64| format!(r#"{{"type":"charge.created","order_id":"r{round}-{i}"}}"#);
            // Directly: the same messages, ids and acknowledgements.
            let stream = TestStream::create(&nats).await;
            let publishes = (0..n).map(|i| {
                let (js, subject) = (stream.js.clone(), stream.subject.clone());
                let body = body(i);
                async move {
                    let mut headers = async_nats::HeaderMap::new();
                    headers.insert("Nats-Msg-Id", format!("direct-{round}-{i}").as_str());
                    js.publish_with_headers(subject, headers, body.into())
                        .await
                        .unwrap()
                        .await
                        .unwrap();
                }
            });
            let (d, d_cpu) = costed(n, async {
                futures_util::stream::iter(publishes)
                    .buffer_unordered(64)
                    .collect::<Vec<_>>()
                    .await;
            })
            .await;
            direct.push(d);

            // Through the outbox.
            let stream = TestStream::create(&nats).await;
            let enqueues = (0..n).map(|i| {
                let (events, outbox) = (&events, &outbox);
                let message = OutgoingMessage::new(stream.subject.clone(), body(i))
                    .ordering_key(format!("acct-{}", i % 256));
                async move {
                    events
                        .process(
                            &format!("r{round}-{i}"),
                            b"{}",
                            async |tx: &mut PostgresTx| outbox.enqueue(tx, message).await.map(drop),
                        )
                        .await
                        .unwrap();
                }
            });
            futures_util::stream::iter(enqueues)
                .buffer_unordered(32)
                .collect::<Vec<_>>()
                .await;
            let relay = OutboxRelay::new(outbox.clone(), JetStreamPublisher(stream.js.clone()));
            let (r, r_cpu) = costed(n, async {
                let mut published = 0;
                while published < n as usize {
                    published += relay.run_once().await.unwrap().published;
                }
            })
            .await;
            relayed.push(r);
            println!(
                "round {round}: nats-direct {d:>9.0} msg/s ({:.1} / {:.1} / {:.1})  nats-relay {r:>9.0} msg/s ({:.1} / {:.1} / {:.1}) {:>8.4} x nats-direct",
                d_cpu[0],
                d_cpu[1],
                d_cpu[2],
                r_cpu[0],
                r_cpu[1],
                r_cpu[2],
                r / d
            );
        }
        let ratio = super::median(relayed.iter().zip(&direct).map(|(r, d)| r / d).collect());
        println!(
            "median: nats-direct {:.0} msg/s, nats-relay {:.0} msg/s, {ratio:.4} x nats-direct (median of per-round ratios)",
            super::median(direct),
            super::median(relayed)
        );
    }
}
