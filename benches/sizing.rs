//! Bytes per record: what one completed record costs each store, for three
//! responses — the example's small charge, a ~300 B one, and a realistic
//! 2.6 KiB charge object (ids, nested objects, metadata, timestamps) — as
//! they are and compressed, and what that means for a day of traffic; then
//! the CPU the codec spends per record, and why zstd.
//!
//! Run with: `cargo bench --all-features --bench sizing` (needs
//! `redis-server` on PATH, PostgreSQL at `DATABASE_URL` and MySQL/MariaDB at
//! `MYSQL_URL` or locally, as the tests do; SQLite is built in). `SIZING_RECORDS` (default 2000) sets
//! how many records each measurement writes.
//!
//! - Redis: `MEMORY USAGE` of each record's key (key, value, TTL and
//!   Redis's own bookkeeping), averaged.
//! - PostgreSQL: growth of `pg_total_relation_size` (heap, TOAST and
//!   indexes) after writing the records and a `VACUUM`, per record.
//! - SQLite: growth of the database file after writing the records and a
//!   checkpoint, per record.
//!
//! Records are written through each store's own `claim` and `complete`,
//! with keys shaped like the layer's (an account scope, a 36-character
//! key) and the headers the payments example stores (`content-type`,
//! `location`). The dictionary is trained on 500 charges of the fixtures'
//! shapes whose every value is random: it knows the field names, not the
//! values.

use std::{env, hint::black_box, sync::Arc, time::Duration, time::Instant};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode, header};
use serde_json::Value;
use tower_idempotency::{
    CompletedRecord, Fingerprint, IdempotencyKey, MySqlStore, PostgresStore, RedisStore,
    SqliteStore, StoredResponse,
    codec::{self, Compression},
    store::{Claim, StorageKey, Store, redis::KeyNames},
};
use tower_idempotency_harness::{
    postgres::TestDatabase, redis_server::RedisServer, sqlite::TestFile,
};

const BODIES: [(&str, &str); 3] = [
    ("small", include_str!("fixtures/charge_small.json")),
    ("~300 B", include_str!("fixtures/charge_medium.json")),
    ("2.6 KiB", include_str!("fixtures/charge_large.json")),
];

/// A day of traffic at 1 000 requests per second.
const RECORDS_PER_DAY: f64 = 1000.0 * 86_400.0;

fn record(body: &str, n: usize) -> CompletedRecord {
    let mut headers = HeaderMap::new();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    headers.insert(
        header::LOCATION,
        HeaderValue::from_str(&format!("/v1/charges/ch_3PqT7x2eZvKYlo2C{n:010}")).unwrap(),
    );
    CompletedRecord::Response(StoredResponse::capture(
        StatusCode::CREATED,
        &headers,
        Bytes::copy_from_slice(body.as_bytes()),
    ))
}

fn key(size: &str, n: usize) -> StorageKey {
    let scope = format!("acct_1Mh8sQ2eZv{:06}", n % 1000);
    let key = format!("{:08x}-4b7c-4e0d-9a3f-{:012x}", n, n * 7919);
    StorageKey::new(
        &format!("{size}/{scope}"),
        &IdempotencyKey::new(&key).unwrap(),
    )
}

/// Writes `records` completed records of `body` into `store`.
async fn fill<St: Store>(store: &St, size: &str, body: &str, records: usize) -> Vec<StorageKey> {
    let fingerprint = Fingerprint::from_bytes([0x5a; 32]);
    let mut keys = Vec::with_capacity(records);
    for n in 0..records {
        let key = key(size, n);
        let Claim::Acquired(mut granted) = store
            .claim(&key, &fingerprint, Duration::from_secs(30))
            .await
            .expect("claim")
        else {
            panic!("{key} was not free")
        };
        let record = Arc::new(record(body, n));
        let day = Duration::from_secs(86_400);
        let done = store
            .complete(&key, &mut granted, &fingerprint, record, day)
            .await;
        assert!(done.expect("complete"));
        keys.push(key);
    }
    keys
}

/// Every string, number and boolean of `value` replaced by a random one of
/// the same shape.
fn scramble(value: &mut Value, rng: &mut fastrand::Rng) {
    match value {
        Value::String(s) => {
            *s = s
                .chars()
                .map(|c| match c {
                    'a'..='z' => rng.lowercase(),
                    'A'..='Z' => rng.uppercase(),
                    '0'..='9' => rng.digit(10),
                    other => other,
                })
                .collect()
        }
        Value::Number(n) if n.is_u64() => *value = rng.u64(0..10_000_000).into(),
        Value::Bool(b) => *b = rng.bool(),
        Value::Array(items) => items.iter_mut().for_each(|v| scramble(v, rng)),
        Value::Object(fields) => fields.values_mut().for_each(|v| scramble(v, rng)),
        _ => {}
    }
}

/// A dictionary trained on random charges of the fixtures' shapes.
fn dictionary() -> Vec<u8> {
    let mut rng = fastrand::Rng::with_seed(7);
    let samples: Vec<Vec<u8>> = (0..500)
        .map(|i| {
            let mut charge: Value = serde_json::from_str(BODIES[i % 3].1).unwrap();
            scramble(&mut charge, &mut rng);
            serde_json::to_vec(&charge).unwrap()
        })
        .collect();
    zstd::dict::from_samples(&samples, 8 * 1024).expect("train a dictionary")
}

struct Row {
    store: String,
    size: &'static str,
    body: usize,
    bytes: f64,
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let records: usize =
        env::var("SIZING_RECORDS").map_or(2000, |v| v.parse().expect("SIZING_RECORDS"));
    let dictionary = dictionary();
    let variants = [
        ("", Compression::none()),
        (", zstd 1", Compression::zstd(1)),
        (
            ", zstd 1 + dictionary",
            Compression::zstd(1).min_size(64).dictionary(&dictionary),
        ),
    ];
    let mut rows = Vec::new();

    // One server per naming: a prefix holds one naming.
    let namings = [
        (" (0.1 key names)", KeyNames::Readable),
        ("", KeyNames::Compact),
    ];
    for (naming, names) in namings {
        let redis = RedisServer::start();
        for (variant, compression) in &variants {
            if names == KeyNames::Readable && !variant.is_empty() {
                continue;
            }
            let store = RedisStore::builder()
                .key_names(names)
                .compression(compression.clone())
                .connect(&redis.url())
                .await
                .unwrap();
            for (size, body) in BODIES {
                let keys = fill(&store, &format!("{variant}{size}"), body, records).await;
                let total: u64 = keys
                    .iter()
                    .map(|k| {
                        let usage = ["MEMORY", "USAGE", &store.redis_key(k), "SAMPLES", "0"];
                        redis
                            .command(&usage)
                            .trim()
                            .parse::<u64>()
                            .expect("MEMORY USAGE")
                    })
                    .sum();
                let store = format!("Redis{naming}{variant}");
                rows.push(Row {
                    store,
                    size,
                    body: body.len(),
                    bytes: total as f64 / records as f64,
                });
            }
        }
    }

    let database = TestDatabase::create();
    let mut admin = database.connect().await;
    for (variant, compression) in &variants {
        for transactional in [false, true] {
            if transactional && !variant.is_empty() {
                continue;
            }
            for (size, body) in BODIES {
                let table = format!(
                    "sizing_{}_{}_{}",
                    u8::from(transactional),
                    variant.len(),
                    body.len()
                );
                let builder = PostgresStore::builder()
                    .table(&table)
                    .compression(compression.clone());
                let before;
                if transactional {
                    let store = builder
                        .transactional()
                        .create_table_if_missing()
                        .connect(database.url())
                        .await
                        .unwrap();
                    before = relation_size(&mut admin, &table).await;
                    fill(&store, size, body, records).await;
                } else {
                    let store = builder
                        .create_table_if_missing()
                        .connect(database.url())
                        .await
                        .unwrap();
                    before = relation_size(&mut admin, &table).await;
                    fill(&store, size, body, records).await;
                }
                sqlx::raw_sql(sqlx::AssertSqlSafe(format!("VACUUM {table}")))
                    .execute(&mut admin)
                    .await
                    .unwrap();
                let after = relation_size(&mut admin, &table).await;
                let store = format!("PostgreSQL{}{variant}", mode(transactional));
                rows.push(Row {
                    store,
                    size,
                    body: body.len(),
                    bytes: (after - before) as f64 / records as f64,
                });
            }
        }
    }

    for (variant, compression) in &variants {
        for transactional in [false, true] {
            if transactional && !variant.is_empty() {
                continue;
            }
            for (size, body) in BODIES {
                let file = TestFile::create();
                let builder = SqliteStore::builder().compression(compression.clone());
                let bytes = if transactional {
                    let store = builder
                        .transactional()
                        .create_table_if_missing()
                        .connect(&file.url())
                        .await
                        .unwrap();
                    sqlite_growth(&store, store.pool(), &file, size, body, records).await
                } else {
                    let store = builder
                        .create_table_if_missing()
                        .connect(&file.url())
                        .await
                        .unwrap();
                    sqlite_growth(&store, store.pool(), &file, size, body, records).await
                };
                let store = format!("SQLite{}{variant}", mode(transactional));
                rows.push(Row {
                    store,
                    size,
                    body: body.len(),
                    bytes,
                });
            }
        }
    }

    let database = tower_idempotency_harness::mysql::TestDatabase::create();
    let mut admin = database.connect().await;
    for (variant, compression) in &variants {
        for transactional in [false, true] {
            if transactional && !variant.is_empty() {
                continue;
            }
            for (size, body) in BODIES {
                let table = format!(
                    "sizing_{}_{}_{}",
                    u8::from(transactional),
                    variant.len(),
                    body.len()
                );
                let builder = MySqlStore::builder()
                    .table(&table)
                    .compression(compression.clone());
                let before;
                if transactional {
                    let store = builder
                        .transactional()
                        .create_table_if_missing()
                        .connect(database.url())
                        .await
                        .unwrap();
                    before = innodb_size(&mut admin, &table).await;
                    fill(&store, size, body, records).await;
                } else {
                    let store = builder
                        .create_table_if_missing()
                        .connect(database.url())
                        .await
                        .unwrap();
                    before = innodb_size(&mut admin, &table).await;
                    fill(&store, size, body, records).await;
                }
                let after = innodb_size(&mut admin, &table).await;
                let store = format!("MariaDB (InnoDB){}{variant}", mode(transactional));
                rows.push(Row {
                    store,
                    size,
                    body: body.len(),
                    bytes: (after - before) as f64 / records as f64,
                });
            }
        }
    }

    println!("bytes per record, {records} records per measurement");
    println!(
        "| store | response body | bytes per record | overhead | GB per 1 000 req/s over 24 h |"
    );
    println!("|---|---:|---:|---:|---:|");
    for row in &rows {
        println!(
            "| {} | {} ({} B) | {:.0} | {:+.0} | {:.1} |",
            row.store,
            row.size,
            row.body,
            row.bytes,
            row.bytes - row.body as f64,
            row.bytes * RECORDS_PER_DAY / 1e9
        );
    }
    println!();
    cpu(&variants);
}

/// The table's pages, data and index, as InnoDB counts them once its
/// statistics are refreshed (16 KiB pages: measure many records).
async fn innodb_size(admin: &mut sqlx::MySqlConnection, table: &str) -> i64 {
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("ANALYZE TABLE {table}")))
        .execute(&mut *admin)
        .await
        .unwrap();
    sqlx::query_scalar(
        "SELECT CAST(data_length + index_length AS SIGNED) FROM information_schema.TABLES \
         WHERE table_schema = DATABASE() AND table_name = ?",
    )
    .bind(table)
    .fetch_one(admin)
    .await
    .unwrap()
}

async fn relation_size(admin: &mut sqlx::PgConnection, table: &str) -> i64 {
    sqlx::query_scalar("SELECT pg_total_relation_size($1::regclass)")
        .bind(table)
        .fetch_one(admin)
        .await
        .unwrap()
}

fn mode(transactional: bool) -> &'static str {
    if transactional {
        " (transactional)"
    } else {
        ""
    }
}

/// The file's growth per record once the table holds a few records.
async fn sqlite_growth<St: Store>(
    store: &St,
    pool: &sqlx::SqlitePool,
    file: &TestFile,
    size: &str,
    body: &str,
    records: usize,
) -> f64 {
    fill(store, &format!("warm {size}"), body, records / 10).await;
    checkpoint(pool).await;
    let before = std::fs::metadata(file.path()).unwrap().len();
    fill(store, size, body, records).await;
    checkpoint(pool).await;
    let after = std::fs::metadata(file.path()).unwrap().len();
    (after - before) as f64 / records as f64
}

async fn checkpoint(pool: &sqlx::SqlitePool) {
    sqlx::raw_sql("PRAGMA wal_checkpoint(TRUNCATE)")
        .execute(pool)
        .await
        .unwrap();
}

/// Microseconds per call of `f`, over enough calls to be steady.
fn micros(f: &mut dyn FnMut() -> usize) -> f64 {
    let rounds = 5000;
    for _ in 0..rounds / 10 {
        black_box(f());
    }
    let started = Instant::now();
    for _ in 0..rounds {
        black_box(f());
    }
    started.elapsed().as_secs_f64() * 1e6 / rounds as f64
}

/// What the codec costs per record (encode before the store's write,
/// decode on every replay), as it is and compressed; and lz4, the faster
/// codec zstd was chosen over: it saves far less.
fn cpu(variants: &[(&str, Compression)]) {
    let fingerprint = Fingerprint::from_bytes([0x5a; 32]);
    println!("CPU per record: the codec's encode and decode (one core)");
    println!("| body | compression | encoded | encode us | decode us |");
    println!("|---|---|---:|---:|---:|");
    for (size, body) in BODIES {
        let record = record(body, 1);
        for (variant, compression) in variants {
            let bytes = Bytes::from(codec::encode_with(&fingerprint, &record, compression));
            let encode =
                micros(&mut || codec::encode_with(&fingerprint, &record, compression).len());
            let decode =
                micros(&mut || codec::decode_with(bytes.clone(), compression).is_ok() as usize);
            let name = variant.trim_start_matches(", ");
            let name = if name.is_empty() { "none" } else { name };
            println!(
                "| {size} ({} B) | {name} | {} B | {encode:.1} | {decode:.1} |",
                body.len(),
                bytes.len()
            );
        }
        let packed = lz4_flex::compress_prepend_size(body.as_bytes());
        let encode = micros(&mut || lz4_flex::compress_prepend_size(body.as_bytes()).len());
        let decode = micros(&mut || lz4_flex::decompress_size_prepended(&packed).unwrap().len());
        println!(
            "| {size} ({} B) | lz4 (body only, for comparison) | {} B | {encode:.1} | {decode:.1} |",
            body.len(),
            packed.len()
        );
    }
}
