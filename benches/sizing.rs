//! Bytes per record: what one completed record costs each store, for three
//! responses — the example's small charge, a ~300 B one, and a realistic
//! 2.6 KiB charge object (ids, nested objects, metadata, timestamps) — and
//! what that means for a day of traffic.
//!
//! Run with: `cargo bench --all-features --bench sizing` (needs
//! `redis-server` on PATH and PostgreSQL at `DATABASE_URL` or locally, as
//! the tests do; SQLite is built in). `SIZING_RECORDS` (default 2000) sets
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
//! `location`).

use std::{env, sync::Arc, time::Duration};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode, header};
use tower_idempotency::{
    CompletedRecord, Fingerprint, IdempotencyKey, PostgresStore, RedisStore, SqliteStore,
    StoredResponse,
    store::{Claim, StorageKey, Store},
};
use tower_idempotency_harness::{postgres::TestDatabase, redis_server::RedisServer, sqlite::TestFile};

const BODIES: [(&str, &str); 3] = [
    ("small", include_str!("fixtures/charge_small.json")),
    ("~300 B", include_str!("fixtures/charge_medium.json")),
    ("2.6 KiB", include_str!("fixtures/charge_large.json")),
];

/// A day of traffic at 1 000 requests per second.
const RECORDS_PER_DAY: f64 = 1000.0 * 86_400.0;

fn record(body: &str, n: usize) -> CompletedRecord {
    let mut headers = HeaderMap::new();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
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
    StorageKey::new(&format!("{size}/{scope}"), &IdempotencyKey::new(&key).unwrap())
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
        let done = store
            .complete(&key, &mut granted, &fingerprint, Arc::new(record(body, n)), Duration::from_secs(86_400))
            .await
            .expect("complete");
        assert!(done);
        keys.push(key);
    }
    keys
}

struct Row {
    store: &'static str,
    size: &'static str,
    body: usize,
    bytes: f64,
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let records: usize = env::var("SIZING_RECORDS").map_or(2000, |v| v.parse().expect("SIZING_RECORDS"));
    let mut rows = Vec::new();

    let redis = RedisServer::start();
    let store = RedisStore::builder().connect(&redis.url()).await.unwrap();
    for (size, body) in BODIES {
        let keys = fill(&store, size, body, records).await;
        let total: u64 = keys
            .iter()
            .map(|k| {
                redis
                    .command(&["MEMORY", "USAGE", &store.redis_key(k), "SAMPLES", "0"])
                    .trim()
                    .parse::<u64>()
                    .expect("MEMORY USAGE")
            })
            .sum();
        rows.push(Row { store: "Redis", size, body: body.len(), bytes: total as f64 / records as f64 });
    }

    let database = TestDatabase::create();
    let mut admin = database.connect().await;
    for transactional in [false, true] {
        for (size, body) in BODIES {
            let table = format!("sizing_{}_{}", u8::from(transactional), body.len());
            let before;
            if transactional {
                let store = PostgresStore::builder().table(&table).transactional().connect(database.url()).await.unwrap();
                store.migrate().await.unwrap();
                before = relation_size(&mut admin, &table).await;
                fill(&store, size, body, records).await;
            } else {
                let store = PostgresStore::builder().table(&table).connect(database.url()).await.unwrap();
                store.migrate().await.unwrap();
                before = relation_size(&mut admin, &table).await;
                fill(&store, size, body, records).await;
            }
            sqlx::raw_sql(&format!("VACUUM {table}")).execute(&mut admin).await.unwrap();
            let after = relation_size(&mut admin, &table).await;
            let store = if transactional { "PostgreSQL (transactional)" } else { "PostgreSQL" };
            rows.push(Row { store, size, body: body.len(), bytes: (after - before) as f64 / records as f64 });
        }
    }

    for transactional in [false, true] {
        for (size, body) in BODIES {
            let file = TestFile::create();
            let url = file.url();
            let pool = if transactional {
                let store = SqliteStore::builder().transactional().connect(&url).await.unwrap();
                store.migrate().await.unwrap();
                fill(&store, size, body, records / 10).await;
                store.pool().clone()
            } else {
                let store = SqliteStore::builder().connect(&url).await.unwrap();
                store.migrate().await.unwrap();
                fill(&store, size, body, records / 10).await;
                store.pool().clone()
            };
            // The table exists and holds a few records: now measure growth.
            checkpoint(&pool).await;
            let before = std::fs::metadata(file.path()).unwrap().len();
            if transactional {
                let store = SqliteStore::builder().transactional().with_pool(pool.clone()).await.unwrap();
                fill(&store, &format!("{size}+"), body, records).await;
            } else {
                let store = SqliteStore::builder().with_pool(pool.clone()).await.unwrap();
                fill(&store, &format!("{size}+"), body, records).await;
            }
            checkpoint(&pool).await;
            let after = std::fs::metadata(file.path()).unwrap().len();
            let store = if transactional { "SQLite (transactional)" } else { "SQLite" };
            rows.push(Row { store, size, body: body.len(), bytes: (after - before) as f64 / records as f64 });
        }
    }

    println!("bytes per record, {records} records per measurement");
    println!("| store | response body | bytes per record | overhead | GB per 1 000 req/s over 24 h |");
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
}

async fn relation_size(admin: &mut sqlx::PgConnection, table: &str) -> i64 {
    sqlx::query_scalar("SELECT pg_total_relation_size($1::regclass)")
        .bind(table)
        .fetch_one(admin)
        .await
        .unwrap()
}

async fn checkpoint(pool: &sqlx::SqlitePool) {
    sqlx::raw_sql("PRAGMA wal_checkpoint(TRUNCATE)").execute(pool).await.unwrap();
}
