//! Configuring and connecting a [`RedisStore`], and the start-up checks
//! that refuse a Redis which would lose records.

use std::{sync::Arc, time::Duration};

use redis::Value;

use super::{
    COMPLETE, Durable, EXTEND, FORGET, FencedWrites, Inner, KeyNames, RELEASE, RedisStore,
    connection::Connection,
    fenced::{Fencing, Server},
    key_names,
};
use crate::{record::codec::Compression, store::StoreError};

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
    key_names: KeyNames,
    compression: Compression,
    fenced_writes: FencedWrites,
}

/// How long a cluster connection keeps waiting for a reply that our own
/// timeout gave up on: the default lease.
#[cfg(feature = "cluster")]
const LATE_REPLY_WAIT: Duration = Duration::from_secs(30);

impl RedisStoreBuilder {
    pub(super) fn new() -> Self {
        Self {
            prefix: "idempotency:".into(),
            timeout: Duration::from_secs(1),
            eviction: EvictionPolicyCheck::Refuse,
            replicas: None,
            key_names: KeyNames::default(),
            compression: Compression::none(),
            fenced_writes: FencedWrites::Detect,
        }
    }

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

    /// How Redis keys are named (default [`KeyNames::Compact`]). A
    /// deployment upgraded from 0.1 keeps [`KeyNames::Readable`]; the store
    /// refuses to start on a prefix whose records are named otherwise.
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::{RedisStore, store::redis::KeyNames};
    ///
    /// let builder = RedisStore::builder().key_names(KeyNames::Readable);
    /// # let _ = builder;
    /// ```
    pub fn key_names(mut self, names: KeyNames) -> Self {
        self.key_names = names;
        self
    }

    /// How stored bodies are written (default: as they are). With the
    /// `compression` feature, `Compression::zstd` compresses large ones;
    /// every store built with the feature reads them.
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::{RedisStore, codec::Compression};
    ///
    /// # #[cfg(feature = "compression")]
    /// let builder = RedisStore::builder().compression(Compression::zstd(1));
    /// # #[cfg(feature = "compression")]
    /// # let _ = builder;
    /// ```
    pub fn compression(mut self, compression: Compression) -> Self {
        self.compression = compression;
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

    /// How fenced writes are sent (default [`FencedWrites::Detect`]: plain
    /// conditional commands on Valkey 9.0+ and Redis 8.4+, Lua scripts
    /// elsewhere). [`FencedWrites::Commands`] makes a server without the
    /// commands a start-up error, for a deployment whose ACL forbids
    /// scripts.
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::{RedisStore, store::redis::FencedWrites};
    ///
    /// let builder = RedisStore::builder().fenced_writes(FencedWrites::Commands);
    /// # let _ = builder;
    /// ```
    pub fn fenced_writes(mut self, fenced_writes: FencedWrites) -> Self {
        self.fenced_writes = fenced_writes;
        self
    }

    /// After each completion, wait up to `timeout` for `replicas` replicas to
    /// acknowledge it (`WAIT`). See the [module docs](super) for the trade-off.
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
        let client = redis::Client::open(url).map_err(misconfigured)?;
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
                    .await
                    .map_err(refused)?;
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
            .build()
            .map_err(misconfigured)?;
        let connection = Connection::Cluster(client.get_async_connection().await.map_err(refused)?);
        let durable = match self.replicas {
            Some(_) => Some(Connection::Cluster(
                client.get_async_connection().await.map_err(refused)?,
            )),
            None => None,
        };
        self.finish(connection, durable).await
    }

    /// Uses a connection you configured yourself (TLS, authentication,
    /// Sentinel, your own retry policy), after the same start-up checks as
    /// [`connect`](Self::connect). Every call is still bounded by
    /// [`command_timeout`](Self::command_timeout); give the connection a
    /// response timeout longer than that, or none
    /// (`ConnectionManagerConfig::set_response_timeout(None)`), or it caps ours.
    ///
    /// With [`wait_for_replicas`](Self::wait_for_replicas), `WAIT` is sent on
    /// a clone of this connection, so it queues behind other commands.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use tower_idempotency::{RedisStore, redis};
    ///
    /// let client = redis::Client::open("rediss://user:secret@redis.internal:6380")?;
    /// let config = redis::aio::ConnectionManagerConfig::new().set_response_timeout(None);
    /// let connection = redis::aio::ConnectionManager::new_with_config(client, config).await?;
    /// let store = RedisStore::builder().from_connection(connection).await?;
    /// # let _ = store; Ok(()) }
    /// ```
    pub async fn from_connection(
        self,
        connection: redis::aio::ConnectionManager,
    ) -> Result<RedisStore, StoreError> {
        let durable = self
            .replicas
            .map(|_| Connection::Single(connection.clone()));
        self.finish(Connection::Single(connection), durable).await
    }

    /// Uses a Redis Cluster connection you configured yourself, after the
    /// same start-up checks as [`connect_cluster`](Self::connect_cluster).
    /// Give its client a response timeout longer than
    /// [`command_timeout`](Self::command_timeout), so that ours is the one in
    /// force and late replies still arrive.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use std::time::Duration;
    /// use tower_idempotency::{RedisStore, redis};
    ///
    /// let client = redis::cluster::ClusterClientBuilder::new(["rediss://redis.internal:7000"])
    ///     .response_timeout(Duration::from_secs(30))
    ///     .build()?;
    /// let store = RedisStore::builder()
    ///     .from_cluster_connection(client.get_async_connection().await?)
    ///     .await?;
    /// # let _ = store; Ok(()) }
    /// ```
    #[cfg(feature = "cluster")]
    #[cfg_attr(docsrs, doc(cfg(feature = "cluster")))]
    pub async fn from_cluster_connection(
        self,
        connection: redis::cluster_async::ClusterConnection,
    ) -> Result<RedisStore, StoreError> {
        let durable = self
            .replicas
            .map(|_| Connection::Cluster(connection.clone()));
        self.finish(Connection::Cluster(connection), durable).await
    }

    async fn finish(
        self,
        connection: Connection,
        durable: Option<Connection>,
    ) -> Result<RedisStore, StoreError> {
        let servers = servers(&connection).await?;
        let fencing = Fencing::choose(&servers, self.fenced_writes)?;
        check_eviction_policy(&connection, self.eviction).await?;
        key_names::check(&connection, &self.prefix, self.key_names).await?;
        if fencing == Fencing::Scripts {
            // Loaded now, so the first requests need no NOSCRIPT detour.
            for lua in [&*EXTEND, &*COMPLETE, &*RELEASE, &*FORGET] {
                connection
                    .on_every_master(lua.load())
                    .await
                    .map_err(refused)?;
            }
        }
        let names: Vec<String> = servers.iter().map(ToString::to_string).collect();
        tracing::info!(
            servers = names.join(", "),
            "idempotency: Redis store ready, fenced writes by {fencing}"
        );
        Ok(RedisStore {
            inner: Arc::new(Inner {
                connection,
                prefix: self.prefix,
                key_names: self.key_names,
                compression: self.compression,
                timeout: self.timeout,
                fencing,
                held: Default::default(),
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

/// Every master's server and version. The claim's `SET … NX GET` needs
/// Redis 7.0: fail at start-up, not on every request.
async fn servers(connection: &Connection) -> Result<Vec<Server>, StoreError> {
    let mut info = redis::cmd("INFO");
    info.arg("server");
    let mut replies = Vec::new();
    connection
        .on_every_master(info)
        .await?
        .iter()
        .for_each(|r| collect_strings(r, &mut replies));
    let servers: Vec<Server> = replies
        .iter()
        .filter_map(|r| Server::from_info(r))
        .collect();
    if let Some(old) = servers.iter().find(|server| !server.claims()) {
        return Err(StoreError::Misconfigured(format!(
            "{old} is too old: the idempotency store needs Redis 7.0 or newer, or Valkey (SET NX GET)"
        )));
    }
    Ok(servers)
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

/// A server that refuses the credentials in the URL (a wrong password, no
/// such user, none given where one is required) or lets the user run too
/// little is a configuration mistake, told with its fix — not an outage.
fn refused(error: redis::RedisError) -> StoreError {
    if error.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoPerm) {
        return StoreError::Misconfigured(format!(
            "the Redis user may not run a command the store needs ({error}): allow it SET, GET, \
             INFO, CONFIG GET (or opt out of the eviction-policy check) and EVALSHA/EVAL — or, \
             on Valkey 9.0+ or Redis 8.4+, DELIFEQ or DELEX instead of scripts \
             (FencedWrites::Commands)"
        ));
    }
    StoreError::from(error)
}

/// A client that cannot even be built (a URL that does not parse, an
/// unknown scheme) is a configuration mistake, not an outage.
fn misconfigured(error: redis::RedisError) -> StoreError {
    match error.kind() {
        redis::ErrorKind::InvalidClientConfig => {
            StoreError::Misconfigured(format!("the Redis URL is not valid: {error}"))
        }
        _ => StoreError::from(error),
    }
}
