//! How records are named in Redis, and the start-up check that every
//! instance sharing a prefix names them alike.

use std::fmt;

use base64::{Engine, engine::general_purpose::URL_SAFE_NO_PAD};
use redis::Value;

use super::connection::Connection;
use crate::{
    fingerprint::FingerprintHasher,
    store::{StorageKey, StoreError},
};

/// How a [`RedisStore`](super::RedisStore) names the Redis key of a record.
///
/// Every instance that shares a prefix must name keys alike, or a retry
/// that reaches an instance naming them differently would not find its
/// record and would execute again. The store therefore keeps its naming in
/// one small key, `{prefix}key-names`, and refuses to start when that key
/// names another; a store that would start [`Compact`](Self::Compact) on a
/// prefix that holds [`Readable`](Self::Readable) records (written by
/// tower-idempotency 0.1, which knew only that naming) refuses too, when a
/// sample of the keys under the prefix finds one.
///
/// # Examples
///
/// ```
/// use tower_idempotency::store::redis::KeyNames;
///
/// // A deployment upgraded from 0.1 keeps its records readable:
/// let builder = tower_idempotency::RedisStore::builder().key_names(KeyNames::Readable);
/// # let _ = builder;
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyNames {
    /// `{prefix}` and 22 characters: 128 bits of a SHA-256 of scope and
    /// key, base64url — a collision is as unlikely as guessing a random
    /// 128-bit token, and every name has the same short length whatever the
    /// key's. Operators find a key's record through the store's `inspect`,
    /// not by its name. The default.
    #[default]
    Compact,
    /// `{prefix}{hex SHA-256 of the scope}:{key}`, 66 characters longer:
    /// the naming of tower-idempotency 0.1.
    Readable,
}

impl KeyNames {
    /// The Redis key of `key` under `prefix`.
    pub(super) fn name(self, prefix: &str, key: &StorageKey) -> String {
        let mut name = String::with_capacity(prefix.len() + key.as_str().len().max(22));
        name.push_str(prefix);
        match self {
            Self::Compact => {
                let mut hasher = FingerprintHasher::new("tower-idempotency/redis-key/v2");
                hasher.field(key.as_str().as_bytes());
                URL_SAFE_NO_PAD.encode_string(&hasher.finish().as_bytes()[..16], &mut name);
            }
            Self::Readable => name.push_str(key.as_str()),
        }
        name
    }

    fn as_str(self) -> &'static str {
        match self {
            Self::Compact => "compact",
            Self::Readable => "readable",
        }
    }
}

impl fmt::Display for KeyNames {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How many keys under the prefix each master is asked for when looking
/// for records named as 0.1 named them: all of them on a small database,
/// a sample on a large one (where they are plenty if there are any).
const SAMPLE: usize = 10_000;

/// Refuses to start when instances on this prefix would name keys unlike
/// `mine`; records `mine` for the instances that come after.
pub(super) async fn check(
    connection: &Connection,
    prefix: &str,
    mine: KeyNames,
) -> Result<(), StoreError> {
    let marker = format!("{prefix}key-names");
    let mut get = redis::cmd("GET");
    get.arg(&marker);
    let recorded = connection.query(&get).await?;
    if recorded == Value::Nil
        && mine == KeyNames::Compact
        && holds_readable(connection, prefix).await?
    {
        return Err(StoreError::Misconfigured(format!(
            "Redis holds records under the prefix `{prefix}` named as tower-idempotency 0.1 named \
             them (readable key names); with compact names their retries would execute again. \
             Keep them with `RedisStore::builder().key_names(KeyNames::Readable)`, or use a new \
             prefix once they have expired"
        )));
    }
    let mut set = redis::cmd("SET");
    set.arg(&marker).arg(mine.as_str()).arg("NX").arg("GET");
    let recorded = match connection.query(&set).await? {
        Value::BulkString(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
        _ => return Ok(()),
    };
    if recorded != mine.as_str() {
        let theirs = if recorded == "readable" {
            "Readable"
        } else {
            "Compact"
        };
        return Err(StoreError::Misconfigured(format!(
            "the records under the Redis prefix `{prefix}` have {recorded} key names \
             (`{marker}`), this store was configured for {mine} ones: a retry reaching the \
             other naming would execute again. Configure \
             `RedisStore::builder().key_names(KeyNames::{theirs})`, or use another prefix"
        )));
    }
    Ok(())
}

/// Whether a sample of the keys under `prefix` holds one named as 0.1 named
/// them: the prefix, 64 hexadecimal digits and a colon.
async fn holds_readable(connection: &Connection, prefix: &str) -> Result<bool, StoreError> {
    let mut pattern = String::with_capacity(2 * prefix.len() + 64 * "[0-9a-f]".len() + 2);
    for c in prefix.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            pattern.push('\\');
        }
        pattern.push(c);
    }
    for _ in 0..64 {
        pattern.push_str("[0-9a-f]");
    }
    pattern.push_str(":*");
    let mut scan = redis::cmd("SCAN");
    scan.arg(0)
        .arg("MATCH")
        .arg(&pattern)
        .arg("COUNT")
        .arg(SAMPLE);
    let replies = connection.on_every_master(scan).await?;
    Ok(replies.iter().any(found_keys))
}

/// Whether a `SCAN` reply (`[cursor, keys]`), or a cluster's replies from
/// its masters, hold a key.
fn found_keys(reply: &Value) -> bool {
    match reply {
        Value::Array(parts) if matches!(parts.first(), Some(Value::BulkString(_))) => {
            matches!(parts.get(1), Some(Value::Array(keys)) if !keys.is_empty())
        }
        Value::Array(replies) => replies.iter().any(found_keys),
        Value::Map(replies) => replies.iter().any(|(_, reply)| found_keys(reply)),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::IdempotencyKey;

    #[test]
    fn compact_names_are_short_and_distinct() {
        let key =
            |scope: &str, key: &str| StorageKey::new(scope, &IdempotencyKey::new(key).unwrap());
        let a = KeyNames::Compact.name("idempotency:", &key("acct_1", "order-42"));
        assert_eq!(a.len(), "idempotency:".len() + 22);
        assert_ne!(
            a,
            KeyNames::Compact.name("idempotency:", &key("acct_2", "order-42"))
        );
        assert_ne!(
            a,
            KeyNames::Compact.name("idempotency:", &key("acct_1", "order-43"))
        );
        let readable = KeyNames::Readable.name("idempotency:", &key("acct_1", "order-42"));
        assert!(readable.ends_with(":order-42"), "{readable}");
    }
}
