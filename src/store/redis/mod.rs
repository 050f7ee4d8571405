//! The Redis store (feature `redis`; Redis Cluster with feature `cluster`).
//!
//! # What a lease store cannot promise
//!
//! The record lives in Redis and the handler's effect elsewhere, so they
//! are two facts, not one. **A second execution of a key is possible** in
//! two windows: a holder paused longer than its lease (`SIGSTOP`, a VM
//! stall, a long GC) loses the key mid-handler, the retry executes on
//! another instance, and the paused one finishes its effect too; a process
//! killed after its effect committed and before the record reached Redis
//! leaves the key free once its lease runs out. Where a second effect
//! costs money, either keep the effect and the record in one transaction
//! (the transactional SQL stores), or give the effect a **downstream key**:
//! the idempotency key (with its scope) stored with the effect under a
//! unique constraint, so that a second execution finds the first effect
//! instead of making another — as a payment processor's own idempotency
//! key does.
//!
//! ```no_run
//! # #[cfg(feature = "postgres")]
//! # async fn demo(pool: sqlx::PgPool, account: &str, key: &tower_idempotency::IdempotencyKey) -> Result<(), sqlx::Error> {
//! // CREATE TABLE charges (id text PRIMARY KEY, account text, amount bigint,
//! //     idempotency_key text, UNIQUE (account, idempotency_key));
//! sqlx::query(
//!     "INSERT INTO charges (id, account, amount, idempotency_key) VALUES ($1, $2, $3, $4)
//!      ON CONFLICT (account, idempotency_key) DO NOTHING",
//! )
//! .bind("ch_123").bind(account).bind(1999_i64).bind(key.as_str())
//! .execute(&pool)
//! .await?;
//! // Then answer with the charge that stands under (account, key).
//! # Ok(()) }
//! ```
//!
//! The handler finds the key in its request's extensions
//! (`Extension<IdempotencyKey>`); the `payments` example's Redis mode does
//! exactly this, tested with `kill -9` and `SIGSTOP`.
//!
//! # Protocol
//!
//! Every decision is one atomic command touching exactly one key, so it runs
//! unchanged on Redis Cluster without CROSSSLOT errors. The claim is one plain
//! command, `SET key <claim> NX PX <lease> GET`: it creates the claim or
//! returns what is stored, and the client decides 409, 422 or replay from
//! those bytes — so a replay costs one round trip and one `SET`. Extend,
//! complete, release and forget are compare-and-set on the lease token
//! (fencing). On **Valkey 9.0+** (or Redis 8.4+) each is one plain
//! conditional command — `SET … IFEQ … GET`, `DELIFEQ` (Redis: `DELEX …
//! IFEQ`) — so the store runs no script and needs no scripting permission;
//! on older servers each is one Lua script. [`FencedWrites`] says which
//! (detected at start-up, on every master, and logged); the stored bytes
//! are the same either way, so instances that chose differently share
//! records. A first execution costs two round trips (claim, complete),
//! plus one extension per third of a lease for slow handlers.
//!
//! # Layout
//!
//! One binary string per record. Its key is the prefix and 22 characters
//! (128 bits of a SHA-256 of scope and key, base64url; see [`KeyNames`],
//! which also keeps 0.1's longer readable names for deployments upgraded
//! from it). Its value: an in-flight claim is `i`, the 32-byte
//! fingerprint, the 16-byte lease token and the lease's deadline; a
//! completed record is `C`, its expiry, then the crate's record
//! [`codec`](crate::record::codec) (status, created-at, common headers as
//! one-byte codes, the body — compressed if the store was given a
//! [`Compression`]): binary, no JSON or base64 in the value. The deadline and the expiry (Unix milliseconds, by the writing
//! server's clock) give `Retry-After` and how long a
//! `CachedStore` (feature `cache`) may keep the record, less a 5 s
//! margin for clocks that disagree; they never decide anything. `SET NX
//! GET` needs Redis **7.0 or newer**, or any Valkey. An in-flight record's TTL is the
//! lease; a completed record's TTL is the retention (`PX`), so nothing
//! needs a sweeper. Records written by 0.1 still replay.
//!
//! # Eviction
//!
//! Every record has a TTL, so under **any** `maxmemory-policy` other than
//! `noeviction` Redis may delete records when memory runs short — `allkeys-*`
//! and `volatile-*` alike (`volatile-ttl` evicts in-flight claims first, since
//! their TTL is the shortest). A deleted record means the retry executes
//! again. On connect the store reads `maxmemory` and `maxmemory-policy` (on
//! every master of a cluster) and refuses to start unless the policy is
//! `noeviction` or there is no memory limit (`maxmemory 0`). Under
//! `noeviction` a full Redis rejects new claims, so requests get `503` (fail
//! closed) instead of executing twice. Where `CONFIG` is disabled (many
//! managed services) the policy cannot be read and the store refuses too.
//! [`EvictionPolicyCheck::Warn`] opts out of both refusals explicitly.
//!
//! # Outages
//!
//! Every call is bounded by the command timeout (default 1 s), and that
//! timeout is the one in force. When Redis cannot be reached the layer answers
//! `503` and does not run the handler (fail closed). A claim whose reply did
//! not arrive in time may still be applied by Redis later (a stalled server
//! runs the queued command when it wakes); the store keeps waiting for that
//! reply in the background, for up to one lease, and releases such a claim at
//! once, so it does not block the key for a whole lease. The connection
//! reconnects by itself when Redis comes back; no restart is needed.
//!
//! # Durability and failover
//!
//! Redis replicates asynchronously: a completed record acknowledged by a
//! master can be lost if that master fails before its replica received it,
//! and the promoted replica then does not know the key. **A retry of that key
//! executes again.** [`RedisStoreBuilder::wait_for_replicas`] narrows that
//! window: after each completion the store sends `WAIT n timeout` and the
//! response goes out only once `n` replicas acknowledged (or the timeout
//! passed, which is logged). It costs one more round trip plus the replication
//! delay on every first execution, and it is not a consensus guarantee: Redis
//! can still lose acknowledged writes in rare failover races. `WAIT` blocks
//! the connection it is sent on, so completions that wait use a connection of
//! their own (claims never queue behind them) and wait one after another: with
//! slow or missing replicas, completions queue for up to the timeout each.

mod blob;
mod builder;
mod connection;
mod fenced;
mod key_names;

pub use self::builder::{EvictionPolicyCheck, RedisStoreBuilder};
pub use self::fenced::FencedWrites;
pub use self::key_names::KeyNames;

use std::{
    sync::{Arc, LazyLock},
    time::{Duration, Instant},
};

use redis::Value;

use self::{
    connection::{Connection, Lua},
    fenced::{Fencing, Held, Next},
};
use super::{
    Claim, Forgotten, KeyState, LeaseToken, StorageKey, Store, StoreError, claim_within, ttl_millis,
};
use crate::{
    fingerprint::Fingerprint,
    record::{CompletedRecord, CorruptRecord, codec::Compression},
};

static EXTEND: LazyLock<Lua> = LazyLock::new(|| Lua::new(include_str!("extend.lua")));
static COMPLETE: LazyLock<Lua> = LazyLock::new(|| Lua::new(include_str!("complete.lua")));
static RELEASE: LazyLock<Lua> = LazyLock::new(|| Lua::new(include_str!("release.lua")));
static FORGET: LazyLock<Lua> = LazyLock::new(|| Lua::new(include_str!("forget.lua")));

/// A [`Store`] on Redis or Redis Cluster. See the [module docs](self) for the
/// protocol, the data layout and the failure behaviour.
///
/// One multiplexed connection (per node) serves all requests and reconnects by
/// itself. Cloning is cheap and clones share it.
///
/// # Examples
///
/// ```no_run
/// # async fn demo() -> Result<(), tower_idempotency::store::StoreError> {
/// use axum::{Router, routing::post};
/// use tower_idempotency::{IdempotencyLayer, RedisStore};
///
/// let store = RedisStore::builder()
///     .prefix("payments:idem:")
///     .connect("redis://127.0.0.1:6379")
///     .await?;
/// let app: Router = Router::new()
///     .route("/v1/charges", post(|| async { "charged" }))
///     .layer(IdempotencyLayer::new(store).single_tenant());
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisStore {
    inner: Arc<Inner>,
}

struct Inner {
    connection: Connection,
    prefix: String,
    key_names: KeyNames,
    compression: Compression,
    timeout: Duration,
    durable: Option<Durable>,
    fencing: Fencing,
    held: Held,
}

/// `WAIT` blocks the connection it is sent on until the replicas answer, so
/// completions that wait get a connection of their own: claims never queue
/// behind a `WAIT`.
struct Durable {
    connection: Connection,
    replicas: usize,
    timeout: Duration,
}

impl RedisStore {
    /// Starts configuring a store.
    pub fn builder() -> RedisStoreBuilder {
        RedisStoreBuilder::new()
    }

    /// The Redis key that holds a record.
    pub fn redis_key(&self, key: &StorageKey) -> String {
        self.inner.key_names.name(&self.inner.prefix, key)
    }

    /// How this store sends its fenced writes, as chosen at start-up:
    /// [`FencedWrites::Commands`] or [`FencedWrites::Scripts`].
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), tower_idempotency::store::StoreError> {
    /// use tower_idempotency::{RedisStore, store::redis::FencedWrites};
    ///
    /// let store = RedisStore::builder().connect("redis://127.0.0.1:6379").await?;
    /// if store.fenced_writes() == FencedWrites::Scripts {
    ///     println!("this server runs a Lua script per fenced write");
    /// }
    /// # Ok(()) }
    /// ```
    pub fn fenced_writes(&self) -> FencedWrites {
        self.inner.fencing.as_public()
    }

    /// One script call on one connection, bounded by the command timeout.
    async fn run(
        &self,
        on: &Connection,
        script: &Lua,
        key: &str,
        args: &[&[u8]],
    ) -> Result<Value, StoreError> {
        super::bounded(self.inner.timeout, async {
            Ok(on.eval(script, key, args).await?)
        })
        .await
    }

    /// A fenced script: `1` when the token held the claim.
    async fn run_fenced(
        &self,
        on: &Connection,
        script: &Lua,
        key: &str,
        args: &[&[u8]],
    ) -> Result<bool, StoreError> {
        Ok(matches!(
            self.run(on, script, key, args).await?,
            Value::Int(1)
        ))
    }
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.inner.prefix)
            .field("key_names", &self.inner.key_names)
            .field("compression", &self.inner.compression)
            .field("timeout", &self.inner.timeout)
            .field("fencing", &self.inner.fencing)
            .finish_non_exhaustive()
    }
}

impl Store for RedisStore {
    type Granted = LeaseToken;

    async fn claim(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<Claim, StoreError> {
        let token = LeaseToken::generate();
        let claimed = blob::in_flight(fingerprint, token, lease);
        // One plain command: it creates the claim, or returns what is there
        // (the client then decides 409, 422 or replay from those bytes).
        let mut set = redis::cmd("SET");
        set.arg(self.redis_key(key))
            .arg(&claimed)
            .arg("NX")
            .arg("PX")
            .arg(millis(lease, "lease")?)
            .arg("GET");
        let inner = self.inner.clone();
        let fingerprint = *fingerprint;
        // Owned, so that it can outlive this call (see `claim_within`).
        let claim = async move {
            let found = value_or_nil(
                inner.connection.query(&set).await?,
                "claim reply is not a string",
            )?;
            let claim = blob::decode_claim(found, &fingerprint, token, lease, &inner.compression)?;
            // A conditional command compares with the claim it holds.
            if let (Claim::Acquired(_), Fencing::Commands(_)) = (&claim, inner.fencing) {
                inner.held.keep(token, claimed);
            }
            Ok(claim)
        };
        claim_within(self, key, Instant::now(), self.inner.timeout, lease, claim).await
    }

    async fn extend(
        &self,
        key: &StorageKey,
        token: LeaseToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let lease_ms = millis(lease, "lease")?;
        let (on, key) = (&self.inner.connection, &self.redis_key(key));
        match self.inner.fencing {
            Fencing::Scripts => {
                let deadline = blob::deadline(lease);
                let args: [&[u8]; 3] = [&token.to_bytes(), lease_ms.as_bytes(), &deadline];
                self.run_fenced(on, &EXTEND, key, &args).await
            }
            Fencing::Commands(_) => {
                let extend = self.set_if_held(on, key, token, Next::Extended(lease), &lease_ms);
                super::bounded(self.inner.timeout, extend).await
            }
        }
    }

    async fn complete(
        &self,
        key: &StorageKey,
        token: &mut LeaseToken,
        fingerprint: &Fingerprint,
        record: Arc<CompletedRecord>,
        retention: Duration,
    ) -> Result<bool, StoreError> {
        let redis_key = self.redis_key(key);
        let durable = self.inner.durable.as_ref();
        let on = durable.map_or(&self.inner.connection, |d| &d.connection);
        let retention_ms = millis(retention, "retention")?;
        let completed = blob::completed(fingerprint, &record, retention, &self.inner.compression);
        let stored = match self.inner.fencing {
            Fencing::Scripts => {
                let args: [&[u8]; 3] = [&token.to_bytes(), &completed, retention_ms.as_bytes()];
                self.run_fenced(on, &COMPLETE, &redis_key, &args).await?
            }
            Fencing::Commands(_) => {
                let next = Next::Value(&completed);
                let complete = self.set_if_held(on, &redis_key, *token, next, &retention_ms);
                let stored = super::bounded(self.inner.timeout, complete).await?;
                self.gave_up(*token);
                stored
            }
        };
        if let (true, Some(durable)) = (stored, durable) {
            durable.wait(&redis_key).await;
        }
        Ok(stored)
    }

    async fn release(&self, key: &StorageKey, token: LeaseToken) -> Result<bool, StoreError> {
        let key = &self.redis_key(key);
        match self.inner.fencing {
            Fencing::Scripts => {
                let args: [&[u8]; 1] = [&token.to_bytes()];
                self.run_fenced(&self.inner.connection, &RELEASE, key, &args)
                    .await
            }
            Fencing::Commands(delete) => {
                let release = self.delete_if_held(delete, key, token);
                let released = super::bounded(self.inner.timeout, release).await?;
                self.gave_up(token);
                Ok(released)
            }
        }
    }

    async fn inspect(&self, key: &StorageKey) -> Result<KeyState, StoreError> {
        let key = self.redis_key(key);
        let found = super::bounded(self.inner.timeout, get(&self.inner.connection, &key)).await?;
        Ok(blob::inspect(found, &self.inner.compression)?)
    }

    async fn forget(&self, key: &StorageKey, force: bool) -> Result<Forgotten, StoreError> {
        if let Fencing::Commands(delete) = self.inner.fencing {
            let key = self.redis_key(key);
            let forget = self.forget_by_commands(delete, &key, force);
            return super::bounded(self.inner.timeout, forget).await;
        }
        let args: [&[u8]; 1] = [if force { b"1" } else { b"0" }];
        let reply = self
            .run(&self.inner.connection, &FORGET, &self.redis_key(key), &args)
            .await?;
        Ok(match reply {
            Value::Int(0) => Forgotten::Nothing,
            Value::Int(1) => Forgotten::Completed,
            Value::Int(2) => Forgotten::InFlight,
            Value::Int(3) => Forgotten::ForcedInFlight,
            _ => return Err(CorruptRecord("forget reply").into()),
        })
    }
}

impl Durable {
    async fn wait(&self, key: &str) {
        let wait =
            self.connection
                .wait_for_replicas(key, self.replicas, self.timeout.as_millis() as u64);
        let replicas = self.replicas;
        // WAIT answers within its own timeout; ours guards against a hung Redis.
        let bound = self.timeout * 2 + Duration::from_secs(1);
        let Ok(acked) = tokio::time::timeout(bound, wait).await else {
            tracing::warn!(key, "idempotency: WAIT did not answer in {bound:?}");
            return;
        };
        match acked {
            Ok(acked) if acked >= replicas => {}
            Ok(acked) => tracing::warn!(
                key,
                acked,
                replicas,
                "idempotency: completion acknowledged by fewer replicas than asked; a failover now could lose it"
            ),
            Err(error) => tracing::warn!(key, %error, "idempotency: WAIT failed"),
        }
    }
}

/// What `key` holds: `GET`.
async fn get(on: &Connection, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
    let mut get = redis::cmd("GET");
    get.arg(key);
    Ok(value_or_nil(
        on.query(&get).await?,
        "GET reply is not a string",
    )?)
}

/// A reply that is a value or none (`GET`, `SET … GET`); anything else is
/// `otherwise`.
fn value_or_nil(reply: Value, otherwise: &'static str) -> Result<Option<Vec<u8>>, CorruptRecord> {
    match reply {
        Value::Nil => Ok(None),
        Value::BulkString(value) => Ok(Some(value)),
        _ => Err(CorruptRecord(otherwise)),
    }
}

/// Milliseconds as the decimal string Redis expects.
fn millis(d: Duration, what: &str) -> Result<String, StoreError> {
    Ok(ttl_millis(d, what)?.to_string())
}

impl From<redis::RedisError> for StoreError {
    /// A server that wants credentials it was not given (`NOAUTH`) or
    /// refuses the ones it was (`WRONGPASS`) is a configuration mistake,
    /// whichever command meets it first; anything else is unavailable.
    fn from(error: redis::RedisError) -> Self {
        if error.kind() == redis::ErrorKind::AuthenticationFailed
            || matches!(error.code(), Some("WRONGPASS" | "NOAUTH"))
        {
            return StoreError::Misconfigured(format!(
                "Redis refuses the connection's credentials ({error}): give the user and password \
                 in the URL (redis://USER:PASSWORD@HOST:PORT, or redis://:PASSWORD@HOST:PORT for \
                 the default user)"
            ));
        }
        StoreError::Unavailable(Box::new(error))
    }
}
