//! Records per second drained from Kafka into a PostgreSQL ledger, side by
//! side in one run, on a private `tansu`: each variant drains its own
//! topic, filled beforehand with `KAFKA_BENCH_N` orders (default 4 000),
//! into its own database; the rate runs from the first record decided to
//! the last. Three shapes of topic: one partition; eight; eight with a hot
//! key (half the orders on one account). Orders are keyed by account (64
//! accounts).
//!
//! - `bare`: no idempotency — each batch's charges in one `INSERT`, then
//!   the group's offsets committed to Kafka (at least once: a crash
//!   between the two charges again);
//! - `floor`: the same guarantee as the crate, written by hand and batched
//!   — per batch one transaction that inserts the orders' ids into a
//!   processed-messages table (`ON CONFLICT DO NOTHING RETURNING`), charges
//!   the ids it returned, and stores the partitions' positions;
//! - `floor, 1 per tx`: the same recipe a record at a time, one
//!   transaction each, one record after another;
//! - `crate, 1 per tx`: `kafka_orders`'s consumer (`KafkaConsumer` over a
//!   `PostgresTxStore`, the example's parse and charge), one record per
//!   transaction (`batch(1)`), each partition in order, 10 in hand;
//! - `crate`: the same in batches — up to 500 records of a partition per
//!   transaction (`batch(500)`), 1 000 in hand;
//! - `crate per key`: batches, in order per key
//!   (`in_order_per_key(true)`): up to 500 records of a key per
//!   transaction, 1 000 in hand;
//! - `sqlite crate 1 per tx` and `sqlite crate`: `crate, 1 per tx` and
//!   `crate` over a `SqliteTxStore` (a file of its own, the positions in
//!   it), the charges counted there;
//! - `mysql crate 1 per tx` and `mysql crate`: the same over a
//!   `MySqlTxStore` (a database of its own on the local MariaDB, or
//!   `MYSQL_URL`'s server).
//!
//! Run with: `cargo bench -p tower-idempotency-consumer-examples --bench
//! kafka` (needs `tansu` on PATH and PostgreSQL, as the tests do).
//! `KAFKA_BENCH_ROUNDS` rounds (default 1); ratios are medians of
//! per-round ratios against the floor. `KAFKA_BENCH_SHAPES` and
//! `KAFKA_BENCH_VARIANTS` pick shapes and variants by name,
//! comma-separated (the floor always runs).

use std::{
    collections::HashMap,
    env,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use tower_idempotency::{
    MySqlStore, MySqlTxStore, PostgresStore, PostgresTxStore, SqliteStore, SqliteTxStore,
    sqlx::{self, PgPool, postgres::PgPoolOptions},
};
use tower_idempotency_harness::{mysql, postgres::TestDatabase, sqlite::TestFile};
use tower_idempotency_kafka::{
    Kafka, KafkaConsumer,
    rdkafka::{
        ClientConfig, Message, Offset, TopicPartitionList,
        consumer::{Consumer as _, StreamConsumer},
    },
};

#[path = "../orders/mod.rs"]
mod orders;
mod recipe;
// The broker and its topics, as the consumers' tests start them.
#[path = "../tests/support/dead_letter.rs"]
#[allow(dead_code)]
mod dead_letter;
#[path = "../tests/support/kafka.rs"]
#[allow(dead_code)]
mod kafka;
use dead_letter::DeadLetter;

use kafka::{KafkaServer, TestTopic};
use orders::{Ledger, WorkDelay};

/// Records a hand-written consumer takes in one batch, at most.
const BATCH: usize = 500;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Variant {
    Bare,
    Floor,
    FloorPerRecord,
    CratePerRecord,
    Crate,
    CratePerKey,
    SqliteCratePerRecord,
    SqliteCrate,
    MySqlCratePerRecord,
    MySqlCrate,
}

impl Variant {
    const ALL: [Self; 10] = [
        Self::Bare,
        Self::Floor,
        Self::FloorPerRecord,
        Self::CratePerRecord,
        Self::Crate,
        Self::CratePerKey,
        Self::SqliteCratePerRecord,
        Self::SqliteCrate,
        Self::MySqlCratePerRecord,
        Self::MySqlCrate,
    ];

    fn name(self) -> &'static str {
        match self {
            Self::Bare => "bare",
            Self::Floor => "floor",
            Self::FloorPerRecord => "floor, 1 per tx",
            Self::CratePerRecord => "crate, 1 per tx",
            Self::Crate => "crate",
            Self::CratePerKey => "crate per key",
            Self::SqliteCratePerRecord => "sqlite crate 1 per tx",
            Self::SqliteCrate => "sqlite crate",
            Self::MySqlCratePerRecord => "mysql crate 1 per tx",
            Self::MySqlCrate => "mysql crate",
        }
    }
}

#[derive(Clone, Copy)]
struct Shape {
    name: &'static str,
    partitions: i32,
    hot: bool,
}

const SHAPES: [Shape; 3] = [
    Shape {
        name: "1 partition",
        partitions: 1,
        hot: false,
    },
    Shape {
        name: "8 partitions",
        partitions: 8,
        hot: false,
    },
    Shape {
        name: "8 partitions, hot key",
        partitions: 8,
        hot: true,
    },
];

fn orders_for(shape: Shape, n: usize) -> Vec<(String, String)> {
    (0..n)
        .map(|i| {
            let account = if shape.hot && i % 2 == 0 {
                "acct-hot".to_owned()
            } else {
                format!("acct-{}", i % 64)
            };
            let order = format!(r#"{{"order_id":"order-{i}","amount":1999,"currency":"eur"}}"#);
            (account, order)
        })
        .collect()
}

/// The ledger's tables, and the hand-written consumers' processed ids.
async fn ledger(db: &TestDatabase) -> PgPool {
    let pool = PgPoolOptions::new()
        .max_connections(16)
        .connect(db.url())
        .await
        .unwrap();
    sqlx::raw_sql(
        "CREATE TABLE order_charges (order_id text NOT NULL, amount bigint NOT NULL, \
             currency text NOT NULL, charged_at timestamptz NOT NULL DEFAULT now());
         CREATE TABLE processed_messages (id text PRIMARY KEY);",
    )
    .execute(&pool)
    .await
    .unwrap();
    pool
}

/// Records decided from a start to the last: a hand-written consumer
/// starts at its first batch in hand, the crate's at its first record
/// decided (which is then not counted).
#[derive(Default)]
struct Clock {
    first: Option<Instant>,
    last: Option<Instant>,
    decided: usize,
    counted: usize,
}

impl Clock {
    fn start(&mut self) {
        self.first.get_or_insert_with(Instant::now);
    }

    fn decided(&mut self, n: usize) {
        if self.first.is_none() {
            self.start();
        } else {
            self.counted += n;
        }
        self.decided += n;
        self.last = Some(Instant::now());
    }

    fn rate(&self) -> f64 {
        let (Some(first), Some(last)) = (self.first, self.last) else {
            return 0.0;
        };
        self.counted as f64 / last.duration_since(first).as_secs_f64().max(1e-6)
    }
}

fn consumer_config(server: &KafkaServer, group: &str) -> ClientConfig {
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", server.brokers())
        .set("group.id", group)
        .set("session.timeout.ms", "6000");
    config
}

/// A hand-written consumer: every partition from its start, batches of up
/// to [`BATCH`] handed to `settle` until `n` records are decided.
async fn by_hand(
    server: &KafkaServer,
    topic: &TestTopic,
    partitions: i32,
    n: usize,
    settle: impl AsyncFn(&[(i32, i64, String)]),
) -> f64 {
    let consumer: StreamConsumer = consumer_config(server, &format!("{}-hand", topic.name))
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    let mut all = TopicPartitionList::new();
    for partition in 0..partitions {
        all.add_partition_offset(&topic.name, partition, Offset::Beginning)
            .unwrap();
    }
    consumer.assign(&all).unwrap();
    let mut clock = Clock::default();
    while clock.decided < n {
        let mut batch = Vec::new();
        let first = consumer.recv().await.unwrap();
        clock.start();
        batch.push(record(&first));
        drop(first);
        while batch.len() < BATCH {
            match tokio::time::timeout(Duration::from_millis(1), consumer.recv()).await {
                Ok(Ok(message)) => batch.push(record(&message)),
                _ => break,
            }
        }
        settle(&batch).await;
        let mut offsets = TopicPartitionList::new();
        for (partition, offset) in last_offsets(&batch) {
            offsets
                .add_partition_offset(&topic.name, partition, Offset::Offset(offset + 1))
                .unwrap();
        }
        consumer
            .commit(
                &offsets,
                tower_idempotency_kafka::rdkafka::consumer::CommitMode::Async,
            )
            .unwrap();
        clock.decided(batch.len());
    }
    clock.rate()
}

fn record(message: &impl Message) -> (i32, i64, String) {
    let order = orders::order(message.payload().unwrap()).unwrap();
    (message.partition(), message.offset(), order.order_id)
}

fn last_offsets(batch: &[(i32, i64, String)]) -> HashMap<i32, i64> {
    let mut last = HashMap::new();
    for (partition, offset, _) in batch {
        let at = last.entry(*partition).or_insert(*offset);
        *at = (*at).max(*offset);
    }
    last
}

/// Charges `ids`, in one statement.
async fn charge_all(on: impl sqlx::PgExecutor<'_>, ids: &[&str]) {
    sqlx::query(
        "INSERT INTO order_charges (order_id, amount, currency) \
         SELECT id, 1999, 'eur' FROM unnest($1::text[]) AS id",
    )
    .bind(ids)
    .execute(on)
    .await
    .unwrap();
}

/// No idempotency: the batch's charges, in one statement.
async fn bare(pool: &PgPool, batch: &[(i32, i64, String)]) {
    let ids: Vec<&str> = batch.iter().map(|(_, _, id)| id.as_str()).collect();
    charge_all(pool, &ids).await;
}

/// The seed's recipe, batched: the processed ids, the charges of the ids
/// new, and the positions, in one transaction.
async fn floor(pool: &PgPool, topic: &str, batch: &[(i32, i64, String)]) {
    let ids: Vec<&str> = batch.iter().map(|(_, _, id)| id.as_str()).collect();
    let mut tx = pool.begin().await.unwrap();
    let new = recipe::new_ids(&mut tx, &ids).await;
    charge_all(
        &mut *tx,
        &new.iter().map(String::as_str).collect::<Vec<_>>(),
    )
    .await;
    let (partitions, nexts): (Vec<i32>, Vec<i64>) = last_offsets(batch)
        .into_iter()
        .map(|(partition, offset)| (partition, offset + 1))
        .unzip();
    sqlx::query(
        "INSERT INTO idempotency_kafka_positions AS p (consumer, topic, partition, next_offset) \
         SELECT 'floor', $1, partition, next FROM unnest($2::int[], $3::bigint[]) AS t(partition, next) \
         ON CONFLICT (consumer, topic, partition) \
         DO UPDATE SET next_offset = GREATEST(p.next_offset, excluded.next_offset)",
    )
    .bind(topic)
    .bind(&partitions)
    .bind(&nexts)
    .execute(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
}

/// A `PostgresTxStore` on `db`, its tables created.
async fn on_postgres(db: &TestDatabase) -> PostgresTxStore {
    let store: PostgresTxStore = PostgresStore::builder()
        .transactional()
        .create_table_if_missing()
        .connect(db.url())
        .await
        .unwrap();
    store.create_tables().await.unwrap();
    store
}

/// A `SqliteTxStore` on `file`, its tables created.
async fn on_sqlite(file: &TestFile) -> SqliteTxStore {
    let store: SqliteTxStore = SqliteStore::builder()
        .transactional()
        .create_table_if_missing()
        .connect(&file.url())
        .await
        .unwrap();
    store.create_tables().await.unwrap();
    store
}

/// A `MySqlTxStore` on `db`, its tables created.
async fn on_mysql(db: &mysql::TestDatabase) -> MySqlTxStore {
    let store: MySqlTxStore = MySqlStore::builder()
        .transactional()
        .create_table_if_missing()
        .connect(db.url())
        .await
        .unwrap();
    store.create_tables().await.unwrap();
    store
}

/// `kafka_orders`'s consumer over `store`, in process, until `n` records
/// are decided, `batch` at most per transaction.
async fn through_the_crate<St: orders::Ledger>(
    server: &KafkaServer,
    topic: &TestTopic,
    store: St,
    n: usize,
    per_key: bool,
    batch: usize,
) -> f64 {
    let kafka = Kafka::builder(
        consumer_config(server, &format!("{}-crate", topic.name)),
        topic.name.clone(),
        "kafka_orders",
        store.clone(),
    )
    .in_order_per_key(per_key)
    .build()
    .await
    .unwrap();
    let clock = Arc::new(Mutex::new(Clock::default()));
    let done = Arc::new(tokio::sync::Notify::new());
    let executed = Arc::new(AtomicU64::new(0));
    let settings = orders::Settings {
        database_url: String::new(),
        work_delay: WorkDelay::default(),
        ack_delay: Duration::ZERO,
        lease: Duration::from_secs(30),
        tx_timeout: Duration::from_secs(30),
    };
    let on_settled = {
        let (clock, done, executed) = (clock.clone(), done.clone(), executed.clone());
        move |report: &tower_idempotency::message::Report<'_, _, _, _, _>| {
            if orders::line(report, |_| String::new()).is_some_and(|l| l.starts_with("executed")) {
                executed.fetch_add(1, Ordering::Relaxed);
            }
            let mut clock = clock.lock().unwrap();
            clock.decided(1);
            if clock.decided >= n {
                done.notify_one();
            }
        }
    };
    KafkaConsumer::new(kafka, orders::processor(store, "kafka_orders", &settings))
        .in_hand(match (batch, per_key) {
            (1, false) => 10,
            (1, true) => 32,
            _ => 1000,
        })
        .batch(batch)
        .on_settled(on_settled)
        .run(
            orders::parse,
            orders::charging::<St>(WorkDelay::default()),
            done.notified(),
        )
        .await
        .unwrap();
    assert_eq!(
        executed.load(Ordering::Relaxed),
        n as u64,
        "each order once"
    );
    clock.lock().unwrap().rate()
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

#[tokio::main]
async fn main() {
    let n: usize = env::var("KAFKA_BENCH_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4_000);
    let rounds: usize = env::var("KAFKA_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let server = KafkaServer::start();
    // The crate's batch, where it batches.
    let crate_batch: usize = env::var("KAFKA_BENCH_BATCH").map_or(BATCH, |b| b.parse().unwrap());
    println!("{n} orders per variant, {rounds} round(s); records/s, first decided to last");
    // A comma-separated list picks shapes or variants by name.
    let picked = |var: &str, name: &str| {
        env::var(var).map_or(true, |names| names.split(',').any(|n| n == name))
    };
    for shape in SHAPES
        .into_iter()
        .filter(|s| picked("KAFKA_BENCH_SHAPES", s.name))
    {
        let mut rates: HashMap<Variant, Vec<f64>> = HashMap::new();
        let mut ratios: HashMap<Variant, Vec<f64>> = HashMap::new();
        for round in 0..rounds {
            let mut this: HashMap<Variant, f64> = HashMap::new();
            for variant in Variant::ALL {
                if !picked("KAFKA_BENCH_VARIANTS", variant.name()) && variant != Variant::Floor {
                    continue;
                }
                let topic = TestTopic::create(&server, shape.partitions).await;
                topic.produce_together(&orders_for(shape, n)).await;
                let db = TestDatabase::create();
                let pool = ledger(&db).await;
                let file = TestFile::create();
                let mut mysql_db = None;
                let rate = match variant {
                    Variant::Bare => {
                        by_hand(&server, &topic, shape.partitions, n, async |batch| {
                            bare(&pool, batch).await
                        })
                        .await
                    }
                    Variant::Floor | Variant::FloorPerRecord => {
                        sqlx::raw_sql(tower_idempotency_kafka::POSTGRES_SCHEMA)
                            .execute(&pool)
                            .await
                            .unwrap();
                        let per_record = variant == Variant::FloorPerRecord;
                        by_hand(&server, &topic, shape.partitions, n, async |batch| {
                            if per_record {
                                for record in batch {
                                    floor(&pool, &topic.name, std::slice::from_ref(record)).await;
                                }
                            } else {
                                floor(&pool, &topic.name, batch).await;
                            }
                        })
                        .await
                    }
                    Variant::CratePerRecord => {
                        let store = on_postgres(&db).await;
                        through_the_crate(&server, &topic, store, n, false, 1).await
                    }
                    Variant::Crate => {
                        let store = on_postgres(&db).await;
                        through_the_crate(&server, &topic, store, n, false, crate_batch).await
                    }
                    Variant::CratePerKey => {
                        let store = on_postgres(&db).await;
                        through_the_crate(&server, &topic, store, n, true, crate_batch).await
                    }
                    Variant::SqliteCratePerRecord => {
                        let store = on_sqlite(&file).await;
                        through_the_crate(&server, &topic, store, n, false, 1).await
                    }
                    Variant::SqliteCrate => {
                        let store = on_sqlite(&file).await;
                        through_the_crate(&server, &topic, store, n, false, crate_batch).await
                    }
                    Variant::MySqlCratePerRecord | Variant::MySqlCrate => {
                        let db = mysql_db.insert(mysql::TestDatabase::create());
                        let store = on_mysql(db).await;
                        let batch = if variant == Variant::MySqlCrate {
                            crate_batch
                        } else {
                            1
                        };
                        through_the_crate(&server, &topic, store, n, false, batch).await
                    }
                };
                let charges = "SELECT count(*) FROM order_charges";
                let charged: i64 = match variant {
                    Variant::SqliteCratePerRecord | Variant::SqliteCrate => {
                        file.count(charges).await
                    }
                    Variant::MySqlCratePerRecord | Variant::MySqlCrate => {
                        mysql_db.as_ref().unwrap().count(charges).await
                    }
                    _ => sqlx::query_scalar(charges).fetch_one(&pool).await.unwrap(),
                };
                assert_eq!(
                    charged,
                    n as i64,
                    "{}: every order charged once",
                    variant.name()
                );
                println!(
                    "  {} / round {round} / {}: {rate:.0} records/s",
                    shape.name,
                    variant.name()
                );
                this.insert(variant, rate);
                rates.entry(variant).or_default().push(rate);
            }
            for (variant, rate) in &this {
                ratios
                    .entry(*variant)
                    .or_default()
                    .push(rate / this[&Variant::Floor]);
            }
        }
        println!("{}:", shape.name);
        for variant in Variant::ALL.into_iter().filter(|v| rates.contains_key(v)) {
            println!(
                "  {:<14} {:>8.0} records/s  {:.3}x the floor",
                variant.name(),
                median(rates[&variant].clone()),
                median(ratios[&variant].clone())
            );
        }
    }
}
