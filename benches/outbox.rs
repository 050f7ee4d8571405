//! The outbox relay on PostgreSQL, what the relay's design promises,
//! measured side by side in one run:
//!
//! - **a hot key**: 4 000 pending messages on one ordering key drained by
//!   one relay, against the same 4 000 spread over 64 keys (the ratio of
//!   their rates; target ≥ 0.5×);
//! - **the sweep**: sent rows past the retention deleted per second,
//!   against the relay's publish rate (it must keep up);
//! - **commit → publish**: the latency from a request's commit to its
//!   message's publication by a relay in another process's place (its
//!   own pool, woken by `LISTEN/NOTIFY`), p50 and p99;
//! - **idle cost**: the statements an idle relay runs per second;
//! - **takeover**: a relay killed between publishing and marking (it stops
//!   renewing its claim), and the seconds until a relay on the defaults
//!   beside it publishes the message again.
//!
//! The publisher keeps messages in memory (the broker's own cost is not the
//! relay's; `examples/consumers/benches/messages.rs` compares the relay with
//! publishing to JetStream directly).
//!
//! Run with: `cargo bench --features postgres --bench outbox` (PostgreSQL at
//! `DATABASE_URL` or locally as in the tests). `OUTBOX_ROUNDS` (default 3).
//! Each round and each step is bounded; traffic stays on 127.0.0.1.

use std::{
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use tower_idempotency::{
    CompletedRecord, Fingerprint, IdempotencyKey, PostgresStore, PostgresTxStore,
    outbox::{Outbox, OutboxMessage, OutboxRelay, OutgoingMessage, PublishError, Publisher},
    sqlx,
    store::{Claim, StorageKey, Store, sql::postgres::Postgres},
};
use tower_idempotency_harness::postgres::TestDatabase;

/// When each message was published, by id.
#[derive(Clone, Default)]
struct Kept(Arc<Mutex<Vec<(String, Instant)>>>);

impl Publisher for Kept {
    async fn publish(&self, message: &OutboxMessage) -> Result<(), PublishError> {
        self.0
            .lock()
            .unwrap()
            .push((message.id.clone(), Instant::now()));
        Ok(())
    }
}

/// Publishes, then never returns: a relay that dies before it marks.
struct PublishesThenHangs(Kept);

impl Publisher for PublishesThenHangs {
    async fn publish(&self, message: &OutboxMessage) -> Result<(), PublishError> {
        self.0.publish(message).await?;
        std::future::pending().await
    }
}

/// One message, a relay that publishes it and dies before marking it (its
/// round dropped: no renewal, no mark), and a relay on the defaults
/// running beside it: seconds from the death to the message's next
/// publication.
async fn takeover(pool: &sqlx::PgPool, outbox: &Outbox<Postgres>, round: u32) -> f64 {
    pending(pool, 1, 1, &format!("takeover{round}-")).await;
    let first = Kept::default();
    let dying = OutboxRelay::new(outbox.clone(), PublishesThenHangs(first.clone()));
    {
        let work = dying.run_once();
        tokio::pin!(work);
        let bound = Instant::now() + Duration::from_secs(30);
        while first.0.lock().unwrap().is_empty() {
            assert!(Instant::now() < bound, "never published");
            tokio::select! {
                _ = &mut work => panic!("a hung publish never ends its round"),
                () = tokio::time::sleep(Duration::from_millis(1)) => {}
            }
        }
    }
    let died = Instant::now();
    let next = Kept::default();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let relay = OutboxRelay::new(outbox.clone(), next.clone());
    let running = tokio::spawn(relay.run(async move {
        let _ = stopped.await;
    }));
    while next.0.lock().unwrap().is_empty() {
        assert!(
            died.elapsed() < Duration::from_secs(120),
            "never taken over"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let took = died.elapsed();
    let _ = stop.send(());
    running.await.unwrap();
    took.as_secs_f64()
}

async fn store(url: &str) -> PostgresTxStore {
    PostgresStore::builder()
        .transactional()
        .create_table_if_missing()
        .connect(url)
        .await
        .expect("the store")
}

async fn outbox(store: &PostgresTxStore) -> Outbox<Postgres> {
    Outbox::on(store)
        .create_table_if_missing()
        .build()
        .await
        .expect("the outbox")
}

/// `n` pending messages over `keys` ordering keys, written in one
/// statement (the relay's side is measured, not the enqueue's).
async fn pending(pool: &sqlx::PgPool, n: u32, keys: u32, tag: &str) {
    sqlx::query(
        "INSERT INTO idempotency_outbox (id, destination, ordering_key, payload, headers, created_at) \
         SELECT $1 || i, 'charges', 'acct-' || (i % $2), '\\x7b7d'::bytea, '[]', \
                (extract(epoch from now()) * 1000)::bigint \
         FROM generate_series(1, $3) AS i",
    )
    .bind(tag)
    .bind(i64::from(keys))
    .bind(i64::from(n))
    .execute(pool)
    .await
    .expect("the backlog");
    sqlx::query("ANALYZE idempotency_outbox")
        .execute(pool)
        .await
        .unwrap();
}

/// Drains the outbox with one relay; messages per second.
async fn drain(outbox: &Outbox<Postgres>, n: u32) -> f64 {
    let kept = Kept::default();
    let relay = OutboxRelay::new(outbox.clone(), kept.clone());
    let started = Instant::now();
    while kept.0.lock().unwrap().len() < n as usize {
        relay.run_once().await.expect("a relay round");
        assert!(started.elapsed() < Duration::from_secs(300), "drained");
    }
    f64::from(n) / started.elapsed().as_secs_f64()
}

/// `n` sent rows past any retention; the sweep's rows per second.
async fn sweep(pool: &sqlx::PgPool, outbox: &Outbox<Postgres>, n: u32, tag: &str) -> f64 {
    sqlx::query(
        "INSERT INTO idempotency_outbox (id, destination, payload, headers, created_at, state, sent_at) \
         SELECT $1 || i, 'charges', '\\x7b7d'::bytea, '[]', 0, 1, 0 FROM generate_series(1, $2) AS i",
    )
    .bind(tag)
    .bind(i64::from(n))
    .execute(pool)
    .await
    .expect("sent rows");
    let relay = OutboxRelay::new(outbox.clone(), Kept::default()).retention(Duration::from_secs(1));
    let started = Instant::now();
    let mut deleted = 0;
    while deleted < u64::from(n) {
        deleted += relay.sweep().await.expect("a sweep");
        assert!(started.elapsed() < Duration::from_secs(300), "swept");
    }
    deleted as f64 / started.elapsed().as_secs_f64()
}

/// Commits `n` requests, one message each, 5 ms apart, with a relay
/// running on a pool of its own; each commit's latency to publication.
async fn latency(url: &str, n: u32, round: u32) -> Vec<Duration> {
    let (writer, relaying) = (store(url).await, store(url).await);
    let (events, relayed) = (outbox(&writer).await, outbox(&relaying).await);
    let kept = Kept::default();
    let relay = OutboxRelay::new(relayed, kept.clone()).spawn();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let fingerprint = Fingerprint::from_bytes([7; 32]);
    let mut committed = Vec::new();
    for i in 0..n {
        let key = StorageKey::new(
            "bench",
            &IdempotencyKey::new(format!("r{round}-{i}")).unwrap(),
        );
        let Ok(Claim::Acquired(mut tx)) = writer
            .claim(&key, &fingerprint, Duration::from_secs(5))
            .await
        else {
            panic!("a fresh key is claimed");
        };
        let id = events
            .enqueue(
                &mut tx,
                OutgoingMessage::new("charges", b"{}".to_vec()).ordering_key("acct"),
            )
            .await
            .unwrap();
        let record = Arc::new(CompletedRecord::Message {
            result: None,
            created_at: std::time::SystemTime::now(),
        });
        assert!(
            writer
                .complete(
                    &key,
                    &mut tx,
                    &fingerprint,
                    record,
                    Duration::from_secs(600)
                )
                .await
                .unwrap()
        );
        committed.push((id, Instant::now()));
        drop(tx);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while kept.0.lock().unwrap().len() < n as usize {
        assert!(Instant::now() < deadline, "every message published");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    relay.abort();
    let published = kept.0.lock().unwrap().clone();
    let mut latencies: Vec<Duration> = committed
        .iter()
        .map(|(id, at)| {
            let (_, when) = published.iter().find(|(p, _)| p == id).unwrap();
            when.saturating_duration_since(*at)
        })
        .collect();
    latencies.sort();
    latencies
}

/// The statements an idle relay (its default poll) runs per second, from
/// the database's own count of transactions: a window with the relay
/// running less one without it (the pools and the counting itself).
async fn idle() -> f64 {
    // A database of its own: the other steps' stores stay out of its count.
    let database = TestDatabase::create();
    let url = database.url();
    let pool = &sqlx::PgPool::connect(url).await.unwrap();
    let count = || async {
        let (n,): (i64,) = sqlx::query_as(
            "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = current_database()",
        )
        .fetch_one(pool)
        .await
        .unwrap();
        // The statistics are the server's snapshot of this transaction.
        sqlx::query("SELECT pg_stat_clear_snapshot()")
            .execute(pool)
            .await
            .unwrap();
        n
    };
    let window = Duration::from_secs(10);
    let per_second = async || {
        let before = count().await;
        tokio::time::sleep(window).await;
        (count().await - before) as f64 / window.as_secs_f64()
    };
    let relaying = store(url).await;
    let idle_outbox = outbox(&relaying).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let without = per_second().await;
    let relay = OutboxRelay::new(idle_outbox, Kept::default()).spawn();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let with = per_second().await;
    relay.abort();
    with - without
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let rounds: u32 = std::env::var("OUTBOX_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    let database = TestDatabase::create();
    let url = database.url().to_owned();
    let main = store(&url).await;
    let outbox = outbox(&main).await;
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    println!("outbox relay on PostgreSQL, one relay, {rounds} rounds");
    println!(
        "| round | 4 000 on 64 keys msg/s | 4 000 on 1 key msg/s | ratio | sweep rows/s | commit→publish p50 / p99 ms | idle statements/s | killed relay → next publication s |"
    );
    println!("|---|---:|---:|---:|---:|---|---:|---:|");
    for round in 0..rounds {
        pending(&pool, 4000, 64, &format!("spread{round}-")).await;
        let spread = drain(&outbox, 4000).await;
        pending(&pool, 4000, 1, &format!("hot{round}-")).await;
        let hot = drain(&outbox, 4000).await;
        let swept = sweep(&pool, &outbox, 50_000, &format!("sent{round}-")).await;
        // What autovacuum does between bursts: the next round starts on a
        // table without this one's dead row versions.
        sqlx::query("DELETE FROM idempotency_outbox")
            .execute(&pool)
            .await
            .unwrap();
        sqlx::query("VACUUM ANALYZE idempotency_outbox")
            .execute(&pool)
            .await
            .unwrap();
        let latencies = latency(&url, 200, round).await;
        let idle = idle().await;
        let takeover = takeover(&pool, &outbox, round).await;
        println!(
            "| {} | {spread:.0} | {hot:.0} | {:.2} | {swept:.0} | {:.1} / {:.1} | {idle:.2} | {takeover:.2} |",
            round + 1,
            hot / spread,
            percentile(&latencies, 0.5).as_secs_f64() * 1000.0,
            percentile(&latencies, 0.99).as_secs_f64() * 1000.0,
        );
    }
}
