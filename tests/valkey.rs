//! The Redis store on Valkey 9: `tests/redis.rs`'s whole list on a
//! `valkey-server`, and what only Valkey shows — fenced writes as plain
//! commands (`SET … IFEQ … GET`, `DELIFEQ`), no script run, a user without
//! scripting served, and records shared with instances that run scripts.

// The suite runs against every store: `cargo test --all-features`.
#![cfg(every_store)]

use std::{
    sync::Arc,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use http::StatusCode;
use tower_idempotency::{
    CompletedRecord, Fingerprint, IdempotencyKey, RedisStore,
    store::{Claim, Forgotten, LeaseToken, StorageKey, Store, redis::FencedWrites},
};

/// `tests/redis.rs`, on Valkey (it starts its servers with this flavour).
#[path = "redis.rs"]
mod list;

use list::support::{
    backend::rewrite_redis_value,
    redis_server::{Flavour, RedisServer, command_calls},
};

const FLAVOUR: Flavour = Flavour::Valkey;

const LEASE: Duration = Duration::from_secs(30);
const RETENTION: Duration = Duration::from_secs(3600);

async fn store_on(server: &RedisServer, fenced_writes: FencedWrites) -> RedisStore {
    RedisStore::builder()
        .fenced_writes(fenced_writes)
        .connect(&server.url())
        .await
        .expect("connect")
}

fn key(name: &str) -> StorageKey {
    StorageKey::new("", &IdempotencyKey::new(name).unwrap())
}

/// A record, its time in whole milliseconds as stored.
fn record() -> Arc<CompletedRecord> {
    let since = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
    Arc::new(CompletedRecord::Unreplayable {
        status: StatusCode::OK,
        created_at: UNIX_EPOCH + Duration::from_millis(since.as_millis() as u64),
    })
}

async fn claimed(store: &RedisStore, key: &StorageKey, fingerprint: &Fingerprint) -> LeaseToken {
    match store.claim(key, fingerprint, LEASE).await.unwrap() {
        Claim::Acquired(token) => token,
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn every_fenced_write_is_a_plain_command_and_no_script_runs() {
    let server = RedisServer::valkey();
    let store = store_on(&server, FencedWrites::Detect).await;
    assert_eq!(store.fenced_writes(), FencedWrites::Commands);
    let fingerprint = Fingerprint::from_bytes([1; 32]);
    let before = command_calls(server.port());

    let (done, released, forgotten) = (key("done"), key("released"), key("forgotten"));
    let mut token = claimed(&store, &done, &fingerprint).await;
    assert!(store.extend(&done, token, LEASE).await.unwrap());
    assert!(store.extend(&done, token, LEASE).await.unwrap());
    let stored = store
        .complete(&done, &mut token, &fingerprint, record(), RETENTION)
        .await
        .unwrap();
    assert!(stored);
    let token = claimed(&store, &released, &fingerprint).await;
    assert!(store.release(&released, token).await.unwrap());
    assert!(matches!(
        store.claim(&released, &fingerprint, LEASE).await.unwrap(),
        Claim::Acquired(_)
    ));
    let _ = claimed(&store, &forgotten, &fingerprint).await;
    assert_eq!(
        store.forget(&forgotten, false).await.unwrap(),
        Forgotten::InFlight
    );
    assert_eq!(
        store.forget(&forgotten, true).await.unwrap(),
        Forgotten::ForcedInFlight
    );
    assert_eq!(
        store.forget(&done, false).await.unwrap(),
        Forgotten::Completed
    );
    assert_eq!(
        store.forget(&done, false).await.unwrap(),
        Forgotten::Nothing
    );

    let ran: Vec<String> = command_calls(server.port())
        .into_iter()
        .filter(|(name, calls)| before.iter().all(|(n, c)| n != name || c != calls))
        .map(|(name, _)| name)
        .collect();
    assert!(
        !ran.iter()
            .any(|name| name.starts_with("eval") || name == "script" || name.starts_with("fcall")),
        "no script ran: {ran:?}"
    );
    assert!(
        ran.iter().any(|name| name == "delifeq"),
        "released and forgotten by DELIFEQ: {ran:?}"
    );
}

#[tokio::test]
async fn a_user_without_scripting_is_served_by_valkey_and_refused_by_redis_7() {
    let create_user = |server: &RedisServer| {
        let reply = server.command(&[
            "ACL",
            "SETUSER",
            "app",
            "on",
            ">s3cret",
            "~*",
            "+@all",
            "-@scripting",
        ]);
        assert_eq!(reply.trim(), "OK", "{reply}");
    };
    let url = |server: &RedisServer| format!("redis://app:s3cret@127.0.0.1:{}", server.port());

    let valkey = RedisServer::valkey();
    create_user(&valkey);
    let store = RedisStore::builder()
        .connect(&url(&valkey))
        .await
        .expect("Valkey 9 needs no script");
    assert_eq!(store.fenced_writes(), FencedWrites::Commands);
    let (k, fingerprint) = (key("k"), Fingerprint::from_bytes([2; 32]));
    let mut token = claimed(&store, &k, &fingerprint).await;
    assert!(
        store
            .complete(&k, &mut token, &fingerprint, record(), RETENTION)
            .await
            .unwrap()
    );
    assert!(matches!(
        store.claim(&k, &fingerprint, LEASE).await.unwrap(),
        Claim::Completed { .. }
    ));

    let redis = RedisServer::start();
    create_user(&redis);
    let refused = RedisStore::builder()
        .connect(&url(&redis))
        .await
        .expect_err("Redis 7 needs its scripts");
    let message = refused.to_string();
    assert!(
        message.contains("EVALSHA") && message.contains("FencedWrites::Commands"),
        "names what to allow, and the way without scripts: {message}"
    );
    // Asked for commands only, Redis 7 is refused by its version.
    let refused = RedisStore::builder()
        .fenced_writes(FencedWrites::Commands)
        .connect(&redis.url())
        .await
        .expect_err("Redis 7 has no SET IFEQ");
    let message = refused.to_string();
    assert!(
        message.contains("Redis 7.") && message.contains("Valkey 9.0 or newer"),
        "{message}"
    );
}

/// A rolling upgrade mixes instances that run scripts with instances that
/// send commands: each reads, waits for and fences the other's records.
#[tokio::test]
async fn scripts_and_commands_share_records_on_one_server() {
    let server = RedisServer::valkey();
    let scripts = store_on(&server, FencedWrites::Scripts).await;
    let commands = store_on(&server, FencedWrites::Commands).await;
    assert_eq!(scripts.fenced_writes(), FencedWrites::Scripts);
    let fingerprint = Fingerprint::from_bytes([3; 32]);

    for (writer, reader) in [(&scripts, &commands), (&commands, &scripts)] {
        let k = key(&format!("shared-{:?}", writer.fenced_writes()));
        let mut token = claimed(writer, &k, &fingerprint).await;
        assert!(matches!(
            reader.claim(&k, &fingerprint, LEASE).await.unwrap(),
            Claim::InFlight { .. }
        ));
        assert!(writer.extend(&k, token, LEASE).await.unwrap());
        let done = record();
        assert!(
            writer
                .complete(&k, &mut token, &fingerprint, done.clone(), RETENTION)
                .await
                .unwrap()
        );
        match reader.claim(&k, &fingerprint, LEASE).await.unwrap() {
            Claim::Completed { record, .. } => assert_eq!(record, done),
            other => panic!("{other:?}"),
        }
        // The other forgets what this one holds: the holder is fenced.
        let held = key(&format!("forced-{:?}", writer.fenced_writes()));
        let mut token = claimed(writer, &held, &fingerprint).await;
        assert_eq!(
            reader.forget(&held, true).await.unwrap(),
            Forgotten::ForcedInFlight
        );
        assert!(
            !writer
                .complete(&held, &mut token, &fingerprint, record(), RETENTION)
                .await
                .unwrap()
        );
        assert!(!writer.extend(&held, token, LEASE).await.unwrap());
    }
}

/// A conditional command compares the whole claim: a claim that changed
/// under its holder without it knowing (an extension Valkey applied whose
/// reply was lost) is still the holder's, and a completion applied whose
/// reply was lost is recognised — each from the reply, not by a failure.
#[tokio::test]
async fn a_claim_changed_by_a_lost_reply_is_still_its_holders() {
    let server = RedisServer::valkey();
    let store = store_on(&server, FencedWrites::Commands).await;
    let fingerprint = Fingerprint::from_bytes([4; 32]);
    let k = key("k");
    let mut token = claimed(&store, &k, &fingerprint).await;
    // Another deadline, the token kept: what an extension writes.
    let name = store.redis_key(&k);
    rewrite_redis_value(&server.url(), &name, |mut value| {
        let at = value.len() - 8;
        value[at..].copy_from_slice(&u64::MAX.to_be_bytes());
        value
    })
    .await;
    assert!(store.extend(&k, token, LEASE).await.unwrap());
    rewrite_redis_value(&server.url(), &name, |mut value| {
        let at = value.len() - 8;
        value[at..].copy_from_slice(&1u64.to_be_bytes());
        value
    })
    .await;
    let done = record();
    assert!(
        store
            .complete(&k, &mut token, &fingerprint, done.clone(), RETENTION)
            .await
            .unwrap()
    );
    // The same completion again (its reply lost the first time): stored.
    assert!(
        store
            .complete(&k, &mut token, &fingerprint, done, RETENTION)
            .await
            .unwrap()
    );
    // Another holder's claim is never written over.
    let other = key("other");
    let mut stale = claimed(&store, &other, &fingerprint).await;
    assert_eq!(
        server.command(&["DEL", &store.redis_key(&other)]).trim(),
        "1"
    );
    let _newer = claimed(&store, &other, &fingerprint).await;
    assert!(!store.extend(&other, stale, LEASE).await.unwrap());
    assert!(
        !store
            .complete(&other, &mut stale, &fingerprint, record(), RETENTION)
            .await
            .unwrap()
    );
    assert!(!store.release(&other, stale).await.unwrap());
    assert!(matches!(
        store.claim(&other, &fingerprint, LEASE).await.unwrap(),
        Claim::InFlight { .. }
    ));
}
