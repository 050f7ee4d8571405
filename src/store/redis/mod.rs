//! The Redis store (feature `redis`; Redis Cluster with feature `cluster`).
//!
//! # Protocol
//!
//! Claim, extend, complete and release are each one Lua script that touches
//! exactly one key, so every decision is atomic and the same scripts run on
//! Redis Cluster without CROSSSLOT errors. The claim script returns the
//! completed record itself, so a replay costs one round trip; a first execution
//! costs two (claim, complete), plus one extension per third of a lease for
//! slow handlers. Extend, complete and release act only while the stored lease
//! token is the caller's (fencing).
//!
//! # Layout
//!
//! One binary string per record at `{prefix}{scope length}:{scope}:{key}`:
//! a state byte (`i` in flight, `r` response, `u` unreplayable), the 32-byte
//! fingerprint, then the 16-byte lease token (in flight) or the status,
//! created-at, header block (see
//! [`StoredResponse::encode_headers`](crate::StoredResponse::encode_headers))
//! and the body bytes — no JSON or base64 anywhere. Each script reads and
//! writes it with one command; the claim is a single `SET NX GET`, so Redis
//! **7.0 or newer** is required. An in-flight record's TTL is the lease; a
//! completed record's TTL is the retention (`PX`), so nothing needs a sweeper.
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
mod connection;

use std::{
    sync::{Arc, LazyLock},
    time::Duration,
};

use redis::Value;

use self::connection::{Connection, Lua};
use super::{Claim, LeaseToken, StorageKey, Store, StoreError};
use crate::{CompletedRecord, CorruptRecord, Fingerprint};

static CLAIM: LazyLock<Lua> = LazyLock::new(|| Lua::new(include_str!("claim.lua")));
static EXTEND: LazyLock<Lua> = LazyLock::new(|| Lua::new(include_str!("extend.lua")));
static COMPLETE: LazyLock<Lua> = LazyLock::new(|| Lua::new(include_str!("complete.lua")));
static RELEASE: LazyLock<Lua> = LazyLock::new(|| Lua::new(include_str!("release.lua")));

/// How long a cluster connection keeps waiting for a reply that our own
/// timeout gave up on: the default lease.
#[cfg(feature = "cluster")]
const LATE_REPLY_WAIT: Duration = Duration::from_secs(30);

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
///     .layer(IdempotencyLayer::new(store));
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisStore {
    inner: Arc<Inner>,
}

struct Inner {
    connection: Connection,
    prefix: String,
    timeout: Duration,
    durable: Option<Durable>,
}

/// `WAIT` blocks the connection it is sent on until the replicas answer, so
/// completions that wait get a connection of their own: claims never queue
/// behind a `WAIT`.
struct Durable {
    connection: Connection,
    replicas: usize,
    timeout: Duration,
}

/// What to do when Redis may evict idempotency records: a `maxmemory-policy`
/// other than `noeviction` with a `maxmemory` limit, or a policy that cannot
/// be read (`CONFIG` disabled).
///
/// # Examples
///
/// ```no_run
/// # async fn demo() -> Result<(), tower_idempotency::store::StoreError> {
/// use tower_idempotency::{RedisStore, store::redis::EvictionPolicyCheck};
///
/// // A managed Redis whose CONFIG command is disabled, set to noeviction in
/// // its console: the store cannot check, so say that you did.
/// let store = RedisStore::builder()
///     .eviction_policy_check(EvictionPolicyCheck::Warn)
///     .connect("rediss://managed.example:6379")
///     .await?;
/// # let _ = store; Ok(()) }
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum EvictionPolicyCheck {
    /// Refuse to connect (the default).
    #[default]
    Refuse,
    /// Log an error and connect anyway: an explicit opt-out, for when you have
    /// made sure by other means that Redis will not evict records.
    Warn,
}

/// Configures and connects a [`RedisStore`].
///
/// # Examples
///
/// ```no_run
/// # async fn demo() -> Result<(), tower_idempotency::store::StoreError> {
/// use std::time::Duration;
/// use tower_idempotency::{RedisStore, store::redis::EvictionPolicyCheck};
///
/// let store = RedisStore::builder()
///     .prefix("idem:")
///     .command_timeout(Duration::from_millis(500))
///     .eviction_policy_check(EvictionPolicyCheck::Refuse)
///     .connect("redis://127.0.0.1:6379")
///     .await?;
/// # let _ = store; Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct RedisStoreBuilder {
    prefix: String,
    timeout: Duration,
    eviction: EvictionPolicyCheck,
    replicas: Option<(usize, Duration)>,
}

impl RedisStore {
    /// Starts configuring a store.
    pub fn builder() -> RedisStoreBuilder {
        RedisStoreBuilder {
            prefix: "idempotency:".into(),
            timeout: Duration::from_secs(1),
            eviction: EvictionPolicyCheck::Refuse,
            replicas: None,
        }
    }

    /// The Redis key that holds a record.
    pub fn redis_key(&self, key: &StorageKey) -> String {
        let mut k = String::with_capacity(self.inner.prefix.len() + key.as_str().len());
        k.push_str(&self.inner.prefix);
        k.push_str(key.as_str());
        k
    }

    /// One script call on one connection, bounded by the command timeout.
    async fn run(
        &self,
        on: &Connection,
        script: &Lua,
        key: &str,
        args: &[&[u8]],
    ) -> Result<Value, StoreError> {
        let timeout = self.inner.timeout;
        match tokio::time::timeout(timeout, on.eval(script, key, args)).await {
            Ok(reply) => Ok(reply?),
            Err(_) => Err(StoreError::Timeout(timeout)),
        }
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
            .field("timeout", &self.inner.timeout)
            .finish_non_exhaustive()
    }
}

impl RedisStoreBuilder {
    /// The prefix of every Redis key the store writes (default `idempotency:`).
    ///
    /// # Examples
    ///
    /// ```
    /// let builder = tower_idempotency::RedisStore::builder().prefix("payments:idem:");
    /// # let _ = builder;
    /// ```
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// The longest any Redis call may take before the request gets `503`
    /// (default 1 s).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    ///
    /// let builder = tower_idempotency::RedisStore::builder().command_timeout(Duration::from_millis(250));
    /// # let _ = builder;
    /// ```
    pub fn command_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// What to do when Redis may evict records, or its eviction policy cannot
    /// be read (default: refuse to connect). See [`EvictionPolicyCheck`].
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::{RedisStore, store::redis::EvictionPolicyCheck};
    ///
    /// let builder = RedisStore::builder().eviction_policy_check(EvictionPolicyCheck::Warn);
    /// # let _ = builder;
    /// ```
    pub fn eviction_policy_check(mut self, check: EvictionPolicyCheck) -> Self {
        self.eviction = check;
        self
    }

    /// After each completion, wait up to `timeout` for `replicas` replicas to
    /// acknowledge it (`WAIT`). See the [module docs](self) for the trade-off.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    ///
    /// // Each completion waits up to 100 ms for one replica.
    /// let builder = tower_idempotency::RedisStore::builder().wait_for_replicas(1, Duration::from_millis(100));
    /// # let _ = builder;
    /// ```
    pub fn wait_for_replicas(mut self, replicas: usize, timeout: Duration) -> Self {
        self.replicas = Some((replicas, timeout));
        self
    }

    /// Connects to a single Redis node, e.g. `redis://127.0.0.1:6379`.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), tower_idempotency::store::StoreError> {
    /// let store = tower_idempotency::RedisStore::builder().connect("redis://127.0.0.1:6379").await?;
    /// # let _ = store; Ok(()) }
    /// ```
    pub async fn connect(self, url: &str) -> Result<RedisStore, StoreError> {
        let client = redis::Client::open(url)?;
        let config = redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(Some(self.timeout))
            // No client-level response timeout (redis-rs defaults to 500 ms,
            // which silently capped ours): every call is bounded by
            // `command_timeout` here, and a late claim reply must still arrive
            // (see `claim`). The client's own timer also costs ~9 µs of CPU.
            .set_response_timeout(None)
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_millis(100));
        let open = || async {
            let manager =
                redis::aio::ConnectionManager::new_with_config(client.clone(), config.clone())
                    .await?;
            Ok::<_, StoreError>(Connection::Single(manager))
        };
        let connection = open().await?;
        let durable = match self.replicas {
            Some(_) => Some(open().await?),
            None => None,
        };
        self.finish(connection, durable).await
    }

    /// Connects to a Redis Cluster through one or more seed nodes, e.g.
    /// `["redis://127.0.0.1:7000"]`. The client follows `MOVED`/`ASK`
    /// redirects and topology changes.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), tower_idempotency::store::StoreError> {
    /// let store = tower_idempotency::RedisStore::builder()
    ///     .connect_cluster(["redis://127.0.0.1:7000", "redis://127.0.0.1:7001"])
    ///     .await?;
    /// # let _ = store; Ok(()) }
    /// ```
    #[cfg(feature = "cluster")]
    #[cfg_attr(docsrs, doc(cfg(feature = "cluster")))]
    pub async fn connect_cluster<I, T>(self, nodes: I) -> Result<RedisStore, StoreError>
    where
        I: IntoIterator<Item = T>,
        T: redis::IntoConnectionInfo,
    {
        let wait = self.replicas.map_or(Duration::ZERO, |(_, wait)| wait);
        let client = redis::cluster::ClusterClientBuilder::new(nodes)
            .connection_timeout(self.timeout)
            // The cluster client needs one. Ours (`command_timeout`) bounds
            // every call; this one must be longer, so that a `WAIT` runs its
            // course and a late claim reply still arrives (see `claim`).
            .response_timeout(self.timeout.max(LATE_REPLY_WAIT) + wait)
            .retries(2)
            .build()?;
        let connection = Connection::Cluster(client.get_async_connection().await?);
        let durable = match self.replicas {
            Some(_) => Some(Connection::Cluster(client.get_async_connection().await?)),
            None => None,
        };
        self.finish(connection, durable).await
    }

    async fn finish(
        self,
        connection: Connection,
        durable: Option<Connection>,
    ) -> Result<RedisStore, StoreError> {
        check_version(&connection).await?;
        check_eviction_policy(&connection, self.eviction).await?;
        // Load the scripts now so the first requests need no NOSCRIPT detour.
        for lua in [&*CLAIM, &*EXTEND, &*COMPLETE, &*RELEASE] {
            connection.on_every_master(lua.load()).await?;
        }
        Ok(RedisStore {
            inner: Arc::new(Inner {
                connection,
                prefix: self.prefix,
                timeout: self.timeout,
                durable: durable
                    .zip(self.replicas)
                    .map(|(connection, (replicas, timeout))| Durable {
                        connection,
                        replicas,
                        timeout,
                    }),
            }),
        })
    }
}

/// The claim script's `SET … NX GET` needs Redis 7.0; fail at start-up, not
/// on every request.
async fn check_version(connection: &Connection) -> Result<(), StoreError> {
    let mut info = redis::cmd("INFO");
    info.arg("server");
    let mut replies = Vec::new();
    connection
        .on_every_master(info)
        .await?
        .iter()
        .for_each(|r| collect_strings(r, &mut replies));
    for reply in &replies {
        let version = reply.lines().find_map(|l| l.strip_prefix("redis_version:"));
        let major = version.and_then(|v| v.split('.').next()?.trim().parse::<u32>().ok());
        if let (Some(version), Some(major)) = (version, major)
            && major < 7
        {
            return Err(StoreError::Misconfigured(format!(
                "Redis {} is too old: the idempotency store needs Redis 7.0 or newer (SET NX GET)",
                version.trim()
            )));
        }
    }
    Ok(())
}

async fn check_eviction_policy(
    connection: &Connection,
    check: EvictionPolicyCheck,
) -> Result<(), StoreError> {
    let opt_out = "or, if you have made sure by other means, opt out with \
        `RedisStore::builder().eviction_policy_check(EvictionPolicyCheck::Warn)`";
    let (policies, limits) = match (
        config_get(connection, "maxmemory-policy").await,
        config_get(connection, "maxmemory").await,
    ) {
        (Ok(policies), Ok(limits)) => (policies, limits),
        (Err(error), _) | (_, Err(error)) => {
            let message = format!(
                "cannot read the Redis maxmemory-policy ({error}); CONFIG may be disabled, as on many \
                 managed services. Idempotency records are safe from eviction only under \
                 `maxmemory-policy noeviction` (or without a maxmemory limit): set it, {opt_out}"
            );
            return refuse_or_warn(check, message);
        }
    };
    let evicting = policies.iter().find(|policy| *policy != "noeviction");
    let limited = limits.iter().any(|limit| limit != "0");
    if let (Some(policy), true) = (evicting, limited) {
        let message = format!(
            "Redis maxmemory-policy is {policy}: every idempotency record has a TTL, so Redis may \
             evict records when memory runs short (volatile-ttl evicts in-flight claims first), \
             and their retries would execute again. Set `maxmemory-policy noeviction` (or remove \
             the maxmemory limit), {opt_out}"
        );
        return refuse_or_warn(check, message);
    }
    Ok(())
}

fn refuse_or_warn(check: EvictionPolicyCheck, message: String) -> Result<(), StoreError> {
    match check {
        EvictionPolicyCheck::Refuse => Err(StoreError::Misconfigured(message)),
        EvictionPolicyCheck::Warn => {
            tracing::error!("idempotency: {message}");
            Ok(())
        }
    }
}

/// `CONFIG GET name` on every master: the values.
async fn config_get(connection: &Connection, name: &str) -> Result<Vec<String>, StoreError> {
    let mut get = redis::cmd("CONFIG");
    get.arg("GET").arg(name);
    let mut values = Vec::new();
    for reply in connection.on_every_master(get).await? {
        collect_strings(&reply, &mut values);
    }
    values.retain(|value| value != name);
    if values.is_empty() {
        return Err(StoreError::Misconfigured(format!(
            "CONFIG GET {name} returned nothing"
        )));
    }
    Ok(values)
}

fn collect_strings(value: &Value, out: &mut Vec<String>) {
    match value {
        Value::BulkString(b) => out.push(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => out.push(s.clone()),
        Value::Array(items) | Value::Set(items) => {
            items.iter().for_each(|v| collect_strings(v, out))
        }
        Value::Map(pairs) => pairs.iter().for_each(|(_, v)| collect_strings(v, out)),
        _ => {}
    }
}

impl Store for RedisStore {
    async fn claim(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<Claim, StoreError> {
        let token = LeaseToken::generate();
        let lease_ms = millis(lease, "lease")?;
        let claim = blob::in_flight(fingerprint, token);
        let args: [&[u8]; 3] = [&claim, fingerprint.as_bytes(), lease_ms.as_bytes()];
        let evalsha = CLAIM.evalsha(&self.redis_key(key), &args);
        let connection = self.inner.connection.clone();
        // Owned and boxed, so that it can outlive this call (below).
        let mut reply = Box::pin(async move { connection.eval_cmd(&CLAIM, &evalsha).await });
        let timeout = self.inner.timeout;
        match tokio::time::timeout(timeout, &mut reply).await {
            Ok(reply) => decode_claim(reply?, token),
            Err(_) => {
                // Redis may still run the claim (a stalled server runs queued
                // commands when it wakes): wait for its reply in the
                // background, and release the claim if it was taken, so that
                // it does not block the key for a whole lease.
                let store = self.clone();
                let key = key.clone();
                tokio::spawn(async move {
                    let Ok(Ok(late)) = tokio::time::timeout(lease, reply).await else {
                        return;
                    };
                    if let Ok(Claim::Acquired(token)) = decode_claim(late, token) {
                        let released = store.release(&key, token).await;
                        tracing::warn!(%key, ?released, "idempotency: a claim that timed out was applied late; released");
                    }
                });
                Err(StoreError::Timeout(timeout))
            }
        }
    }

    async fn extend(
        &self,
        key: &StorageKey,
        token: LeaseToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let lease_ms = millis(lease, "lease")?;
        let args: [&[u8]; 2] = [&token.to_bytes(), lease_ms.as_bytes()];
        self.run_fenced(&self.inner.connection, &EXTEND, &self.redis_key(key), &args)
            .await
    }

    async fn complete(
        &self,
        key: &StorageKey,
        token: LeaseToken,
        fingerprint: &Fingerprint,
        record: Arc<CompletedRecord>,
        retention: Duration,
    ) -> Result<bool, StoreError> {
        let redis_key = self.redis_key(key);
        let durable = self.inner.durable.as_ref();
        let on = durable.map_or(&self.inner.connection, |d| &d.connection);
        let retention_ms = millis(retention, "retention")?;
        let completed = blob::completed(fingerprint, &record);
        let args: [&[u8]; 3] = [&token.to_bytes(), &completed, retention_ms.as_bytes()];
        let stored = self.run_fenced(on, &COMPLETE, &redis_key, &args).await?;
        if let (true, Some(durable)) = (stored, durable) {
            durable.wait(&redis_key).await;
        }
        Ok(stored)
    }

    async fn release(&self, key: &StorageKey, token: LeaseToken) -> Result<bool, StoreError> {
        let args: [&[u8]; 1] = [&token.to_bytes()];
        self.run_fenced(
            &self.inner.connection,
            &RELEASE,
            &self.redis_key(key),
            &args,
        )
        .await
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

/// The longest TTL the store sets: far beyond any retention the layer
/// accepts, far below what Redis can represent.
const MAX_TTL: Duration = Duration::from_secs(100 * 365 * 24 * 60 * 60);

/// Milliseconds as the decimal string Redis expects, at least 1; a TTL Redis
/// cannot keep is a configuration error, not a command that fails each time.
fn millis(d: Duration, what: &str) -> Result<String, StoreError> {
    if d > MAX_TTL {
        return Err(StoreError::Misconfigured(format!(
            "a {what} of {d:?} is longer than the Redis store keeps a key (100 years)"
        )));
    }
    Ok(d.as_millis().max(1).to_string())
}

fn decode_claim(reply: Value, token: LeaseToken) -> Result<Claim, StoreError> {
    let corrupt = |what| StoreError::Corrupt(CorruptRecord(what));
    let Value::Array(items) = reply else {
        return Err(corrupt("claim reply is not an array"));
    };
    let mut items = items.into_iter();
    let mut next_int = |what| match items.next() {
        Some(Value::Int(n)) => Ok(n),
        _ => Err(corrupt(what)),
    };
    let tag = next_int("claim reply has no tag")?;
    if tag == 1 {
        return Ok(Claim::Acquired(token));
    }
    if tag == 3 {
        return Ok(Claim::Mismatch);
    }
    let ttl = Duration::from_millis(next_int("record without TTL")?.max(0) as u64);
    match (tag, items.next()) {
        // Our own claim, sent twice (a client-side retry): it is ours.
        (2, Some(Value::BulkString(held))) if *held == token.to_bytes() => {
            Ok(Claim::Acquired(token))
        }
        (2, _) => Ok(Claim::InFlight { retry_after: ttl }),
        (4, Some(Value::BulkString(record))) => Ok(Claim::Completed {
            record: Arc::new(blob::decode_completed(record)?),
            expires_in: ttl,
        }),
        _ => Err(corrupt("unknown claim reply")),
    }
}

impl From<redis::RedisError> for StoreError {
    fn from(error: redis::RedisError) -> Self {
        StoreError::Unavailable(Box::new(error))
    }
}
