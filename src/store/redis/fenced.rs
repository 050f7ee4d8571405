//! The fenced writes — extend, complete, release, forget — each a
//! compare-and-set on the claim its holder wrote, sent one of two ways
//! with one protocol and the same stored bytes: a Lua script per write
//! (any Redis 7+), or one plain conditional command where every master
//! has them (Valkey 9.0+: `SET … IFEQ`, `DELIFEQ`; Redis 8.4+: `SET …
//! IFEQ`, `DELEX … IFEQ`), which needs no scripting permission.
//!
//! A conditional command compares whole values, where a script reads only
//! the state byte and the token: so the store remembers the claim each
//! holder last wrote ([`Held`]), and `SET … IFEQ … GET` answers with the
//! value it met, so that a claim its own holder extended meanwhile, or a
//! completion an earlier attempt applied, is recognised from the reply
//! without another round trip.

use std::{
    borrow::Cow,
    collections::HashMap,
    fmt,
    sync::{Mutex, PoisonError},
    time::Duration,
};

use redis::Value;

use super::{RedisStore, blob, connection::Connection, get, value_or_nil};
use crate::store::{Forgotten, LeaseToken, StoreError};

/// How a [`RedisStore`] sends its fenced writes (extend, complete, release,
/// forget). Either way the protocol and the stored bytes are the same, so
/// instances that chose differently share records (a rolling upgrade mixes
/// them).
///
/// # Examples
///
/// ```no_run
/// # async fn demo() -> Result<(), tower_idempotency::store::StoreError> {
/// use tower_idempotency::{RedisStore, store::redis::FencedWrites};
///
/// // A Valkey whose ACL forbids scripts: refuse to start anywhere else.
/// let store = RedisStore::builder()
///     .fenced_writes(FencedWrites::Commands)
///     .connect("redis://127.0.0.1:6379")
///     .await?;
/// assert_eq!(store.fenced_writes(), FencedWrites::Commands);
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum FencedWrites {
    /// Plain conditional commands where every master has them (Valkey 9.0
    /// or newer, Redis 8.4 or newer), scripts elsewhere (the default).
    #[default]
    Detect,
    /// One Lua script per write (`EVALSHA`), on any server.
    Scripts,
    /// Plain conditional commands only, no script: the store refuses to
    /// start on a server without them.
    Commands,
}

/// A server, as `INFO server` names it: its kind, major and minor version.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Server {
    Redis(u32, u32),
    Valkey(u32, u32),
}

impl Server {
    /// Valkey also reports the Redis version it is compatible with, so its
    /// own field is read first.
    pub(super) fn from_info(info: &str) -> Option<Self> {
        let field = |name: &str| {
            info.lines()
                .find_map(|line| line.strip_prefix(name))
                .map(str::trim)
        };
        let version = |v: &str| {
            let mut parts = v.split('.').map(|part| part.parse::<u32>().ok());
            Some((parts.next()??, parts.next().flatten().unwrap_or(0)))
        };
        if let Some(v) = field("valkey_version:") {
            let (major, minor) = version(v)?;
            return Some(Self::Valkey(major, minor));
        }
        let (major, minor) = version(field("redis_version:")?)?;
        Some(Self::Redis(major, minor))
    }

    /// Whether `SET … NX GET`, the claim, is there (Redis 7.0).
    pub(super) fn claims(self) -> bool {
        match self {
            Self::Redis(major, _) => major >= 7,
            Self::Valkey(..) => true,
        }
    }

    /// The conditional delete, where the server has it and `SET … IFEQ`.
    fn delete_if_equal(self) -> Option<DeleteIfEqual> {
        match self {
            Self::Valkey(major, _) if major >= 9 => Some(DeleteIfEqual::Delifeq),
            Self::Redis(major, minor) if (major, minor) >= (8, 4) => Some(DeleteIfEqual::Delex),
            _ => None,
        }
    }
}

impl fmt::Display for Server {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Redis(major, minor) => write!(f, "Redis {major}.{minor}"),
            Self::Valkey(major, minor) => write!(f, "Valkey {major}.{minor}"),
        }
    }
}

/// How the two servers spell a delete on an equal value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum DeleteIfEqual {
    /// Valkey 9.0: `DELIFEQ key value`.
    Delifeq,
    /// Redis 8.4: `DELEX key IFEQ value`.
    Delex,
}

/// The way chosen at start-up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Fencing {
    Scripts,
    Commands(DeleteIfEqual),
}

impl Fencing {
    /// The way `wanted` takes on `servers` (every master): commands only
    /// where all of them spell them alike.
    pub(super) fn choose(servers: &[Server], wanted: FencedWrites) -> Result<Self, StoreError> {
        let common = servers
            .iter()
            .map(|server| server.delete_if_equal())
            .reduce(|a, b| if a == b { a } else { None })
            .flatten();
        match (wanted, common) {
            (FencedWrites::Scripts, _) | (FencedWrites::Detect, None) => Ok(Self::Scripts),
            (_, Some(delete)) => Ok(Self::Commands(delete)),
            (FencedWrites::Commands, None) => {
                let found: Vec<String> = servers.iter().map(ToString::to_string).collect();
                Err(StoreError::Misconfigured(format!(
                    "FencedWrites::Commands needs `SET … IFEQ` and a conditional delete on every \
                     master — Valkey 9.0 or newer, or Redis 8.4 or newer — and found {}: upgrade, \
                     or use FencedWrites::Detect, which runs scripts there",
                    if found.is_empty() {
                        "no version".to_owned()
                    } else {
                        found.join(", ")
                    }
                )))
            }
        }
    }

    pub(super) fn as_public(self) -> FencedWrites {
        match self {
            Self::Scripts => FencedWrites::Scripts,
            Self::Commands(_) => FencedWrites::Commands,
        }
    }
}

impl fmt::Display for Fencing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Scripts => "Lua scripts (EVALSHA)",
            Self::Commands(DeleteIfEqual::Delifeq) => "plain commands (SET IFEQ, DELIFEQ)",
            Self::Commands(DeleteIfEqual::Delex) => "plain commands (SET IFEQ, DELEX IFEQ)",
        })
    }
}

/// The claim each holder last wrote, by its token: what a conditional
/// command compares with. A hint only — a write that finds none reads the
/// value first, and one that finds an older one learns the current value
/// from its reply — so a full map is simply emptied.
#[derive(Default)]
pub(super) struct Held(Mutex<HashMap<LeaseToken, Vec<u8>>>);

/// Claims remembered at most (a holder gives its entry back when it
/// completes or releases; this bounds what abandoned ones leave).
const HELD_AT_MOST: usize = 1 << 16;

impl Held {
    pub(super) fn keep(&self, token: LeaseToken, claim: Vec<u8>) {
        let mut held = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if held.len() >= HELD_AT_MOST && !held.contains_key(&token) {
            held.clear();
        }
        held.insert(token, claim);
    }

    fn get(&self, token: LeaseToken) -> Option<Vec<u8>> {
        let held = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        held.get(&token).cloned()
    }

    fn give_back(&self, token: LeaseToken) {
        let mut held = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        held.remove(&token);
    }
}

/// What a conditional `SET` writes over the claim it met.
pub(super) enum Next<'a> {
    /// The claim, its lease starting now (extend).
    Extended(Duration),
    /// These bytes (complete).
    Value(&'a [u8]),
}

impl Next<'_> {
    fn over<'v>(&'v self, claim: &[u8]) -> Cow<'v, [u8]> {
        match self {
            Self::Extended(lease) => Cow::Owned(blob::extended(claim, *lease)),
            Self::Value(value) => Cow::Borrowed(value),
        }
    }
}

impl RedisStore {
    /// `SET key <next> IFEQ <claim> GET PX ttl` while the value is
    /// `token`'s claim: whether it was written — or, for a completion,
    /// already stands (an earlier attempt applied whose reply was lost).
    pub(super) async fn set_if_held(
        &self,
        on: &Connection,
        key: &str,
        token: LeaseToken,
        next: Next<'_>,
        ttl_ms: &str,
    ) -> Result<bool, StoreError> {
        let Some(mut claim) = self.claim_of(on, key, token).await? else {
            return Ok(false);
        };
        let done = match &next {
            Next::Value(value) => Some(*value),
            Next::Extended(_) => None,
        };
        loop {
            if done == Some(&claim[..]) {
                return Ok(true);
            }
            if !blob::held_by(&claim, token) {
                return Ok(false);
            }
            let value = next.over(&claim);
            let mut set = redis::cmd("SET");
            set.arg(key)
                .arg(&*value)
                .arg("IFEQ")
                .arg(&claim)
                .arg("GET")
                .arg("PX")
                .arg(ttl_ms);
            match value_or_nil(on.query(&set).await?, "SET IFEQ reply is not a string")? {
                None => return Ok(false),
                Some(met) if met == claim => {
                    if let Next::Extended(_) = next {
                        self.inner.held.keep(token, value.into_owned());
                    }
                    return Ok(true);
                }
                // Not written: what stands instead, decided again.
                Some(met) => claim = met,
            }
        }
    }

    /// Deletes `token`'s claim: whether it held it.
    pub(super) async fn delete_if_held(
        &self,
        delete: DeleteIfEqual,
        key: &str,
        token: LeaseToken,
    ) -> Result<bool, StoreError> {
        let on = &self.inner.connection;
        let Some(mut claim) = self.claim_of(on, key, token).await? else {
            return Ok(false);
        };
        loop {
            if !blob::held_by(&claim, token) {
                return Ok(false);
            }
            if self.delete_if_equal(delete, key, &claim).await? {
                return Ok(true);
            }
            match get(on, key).await? {
                Some(now) => claim = now,
                None => return Ok(false),
            }
        }
    }

    /// Forgets what `key` holds (see `Store::forget`), deleting only the
    /// value it read.
    pub(super) async fn forget_by_commands(
        &self,
        delete: DeleteIfEqual,
        key: &str,
        force: bool,
    ) -> Result<Forgotten, StoreError> {
        loop {
            let Some(value) = get(&self.inner.connection, key).await? else {
                return Ok(Forgotten::Nothing);
            };
            let in_flight = blob::is_in_flight(&value);
            if in_flight && !force {
                return Ok(Forgotten::InFlight);
            }
            if self.delete_if_equal(delete, key, &value).await? {
                return Ok(if in_flight {
                    Forgotten::ForcedInFlight
                } else {
                    Forgotten::Completed
                });
            }
        }
    }

    /// The claim `token`'s holder last wrote, or what `key` holds now.
    async fn claim_of(
        &self,
        on: &Connection,
        key: &str,
        token: LeaseToken,
    ) -> Result<Option<Vec<u8>>, StoreError> {
        match self.inner.held.get(token) {
            Some(claim) => Ok(Some(claim)),
            None => get(on, key).await,
        }
    }

    async fn delete_if_equal(
        &self,
        delete: DeleteIfEqual,
        key: &str,
        value: &[u8],
    ) -> Result<bool, StoreError> {
        let mut command = match delete {
            DeleteIfEqual::Delifeq => redis::cmd("DELIFEQ"),
            DeleteIfEqual::Delex => redis::cmd("DELEX"),
        };
        command.arg(key);
        if delete == DeleteIfEqual::Delex {
            command.arg("IFEQ");
        }
        command.arg(value);
        Ok(matches!(
            self.inner.connection.query(&command).await?,
            Value::Int(1)
        ))
    }

    /// The holder is done with its claim, whatever came of it.
    pub(super) fn gave_up(&self, token: LeaseToken) {
        self.inner.held.give_back(token);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VALKEY_9: &str =
        "# Server\r\nredis_version:7.2.4\r\nserver_name:valkey\r\nvalkey_version:9.1.2\r\n";
    const VALKEY_8: &str = "redis_version:7.2.4\r\nvalkey_version:8.1.1\r\n";
    const REDIS_7: &str = "# Server\r\nredis_version:7.0.15\r\nredis_git_sha1:0\r\n";
    const REDIS_8_4: &str = "redis_version:8.4.0\r\n";

    fn servers(infos: &[&str]) -> Vec<Server> {
        infos.iter().filter_map(|i| Server::from_info(i)).collect()
    }

    #[test]
    fn the_server_is_read_from_its_own_version_field() {
        assert_eq!(Server::from_info(VALKEY_9), Some(Server::Valkey(9, 1)));
        assert_eq!(Server::from_info(REDIS_7), Some(Server::Redis(7, 0)));
        assert_eq!(Server::from_info(REDIS_8_4), Some(Server::Redis(8, 4)));
        assert_eq!(
            Server::from_info("redis_version:6.2.1"),
            Some(Server::Redis(6, 2))
        );
        assert!(!Server::Redis(6, 2).claims() && Server::Redis(7, 0).claims());
        assert_eq!(Server::from_info("nothing here"), None);
    }

    #[test]
    fn commands_only_where_every_master_spells_them_alike() {
        use Fencing::{Commands, Scripts};
        let detect =
            |infos: &[&str]| Fencing::choose(&servers(infos), FencedWrites::Detect).unwrap();
        assert_eq!(detect(&[VALKEY_9]), Commands(DeleteIfEqual::Delifeq));
        assert_eq!(detect(&[REDIS_8_4]), Commands(DeleteIfEqual::Delex));
        assert_eq!(detect(&[REDIS_7]), Scripts);
        // SET IFEQ without DELIFEQ.
        assert_eq!(detect(&[VALKEY_8]), Scripts);
        // A rolling upgrade of a cluster: one master behind.
        assert_eq!(detect(&[VALKEY_9, VALKEY_8]), Scripts);
        assert_eq!(detect(&[VALKEY_9, REDIS_8_4]), Scripts);
        assert_eq!(detect(&[]), Scripts);
        assert_eq!(
            Fencing::choose(&servers(&[VALKEY_9]), FencedWrites::Scripts).unwrap(),
            Scripts
        );
        let refused = Fencing::choose(&servers(&[VALKEY_9, REDIS_7]), FencedWrites::Commands)
            .unwrap_err()
            .to_string();
        assert!(
            refused.contains("Valkey 9.0 or newer") && refused.contains("Redis 7.0"),
            "{refused}"
        );
    }
}
