//! Which attempt of its key a granted claim is — the first, or a takeover
//! of one that lapsed and may have taken effect — and the key to hand to
//! the next system down, the same on every attempt.

use std::{fmt, time::SystemTime};

use crate::store::{Lapsed, SensitiveKeys, StorageKey};

/// Which attempt of its key a request or a message's work is, told to the
/// handler (a request's extensions; [`message::attempt`](crate::message::attempt)
/// for a message's work), with the [downstream key](Self::downstream_key)
/// to pass on.
///
/// On a store whose claims are leases, a claim is granted over an earlier
/// one whose lease lapsed — the process holding it crashed or stalled — and
/// that earlier attempt may have charged the card before it stopped. The
/// store does not know; the card processor does. Pass the downstream key as
/// the processor's own idempotency key on every attempt, and a takeover's
/// charge is the first attempt's, not a second one; on a
/// [takeover](Earlier::TakenOver), reconcile (ask the processor what the
/// key did) before acting on anything the first attempt may have done.
///
/// # Examples
///
/// ```
/// use axum::{Extension, Router, routing::post};
/// use tower_idempotency::{Attempt, Earlier, IdempotencyLayer, MemoryStore};
///
/// async fn charge(Extension(attempt): Extension<Attempt>) -> String {
///     if let Earlier::TakenOver { attempts, .. } = attempt.earlier() {
///         tracing::warn!(attempts, "an earlier attempt lapsed: reconciling with the processor");
///     }
///     // The processor deduplicates on it: every attempt charges at most once.
///     format!("charged under {}", attempt.downstream_key())
/// }
///
/// let app: Router = Router::new()
///     .route("/v1/charges", post(charge))
///     .layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant());
/// # let _ = app;
/// ```
#[derive(Clone)]
pub struct Attempt {
    earlier: Earlier,
    /// The downstream key is derived from it when asked for, so that a
    /// handler that never asks pays nothing.
    key: StorageKey,
}

/// What came before an [`Attempt`] of the same key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Earlier {
    /// No earlier attempt can have taken effect: this is the key's first,
    /// or its earlier attempts released it (their work failed) or rolled
    /// back (a transactional store's claim commits only with the work's
    /// effects).
    None,
    /// Granted over earlier attempts that began and never completed (their
    /// leases lapsed): they may have taken effect.
    TakenOver {
        /// How many began before this one.
        attempts: u32,
        /// When the first of them began.
        since: SystemTime,
    },
    /// The store cannot tell: its lapsed claims vanish with their lease (the
    /// Redis store, the SQL lease stores, a custom store that does not
    /// report takeovers). Treat it as a possible takeover — the downstream
    /// key is what covers it.
    Unknown,
}

impl Attempt {
    pub(crate) fn new(earlier: Earlier, key: StorageKey) -> Self {
        Self { earlier, key }
    }

    /// What came before it.
    ///
    /// # Examples
    ///
    /// See [`Attempt`].
    pub fn earlier(&self) -> Earlier {
        self.earlier
    }

    /// Whether it was granted over earlier attempts that lapsed.
    ///
    /// # Examples
    ///
    /// See [`Attempt`].
    pub fn is_takeover(&self) -> bool {
        matches!(self.earlier, Earlier::TakenOver { .. })
    }

    /// The key to hand the next system down as its idempotency key: the
    /// same on every attempt of this key in its scope, in every process,
    /// and another for any other key or scope — 64 hex digits, which every
    /// card processor's idempotency key accepts. It is derived from the
    /// key by HMAC-SHA-256 under the secret of the layer's (or processor's)
    /// [`sensitive_keys`](crate::IdempotencyLayer::sensitive_keys) when it
    /// has one, so that the processor learns nothing about the client's
    /// key; without a secret, by a plain SHA-256, which a guessed key can
    /// be tested against.
    ///
    /// # Examples
    ///
    /// See [`Attempt`].
    pub fn downstream_key(&self) -> String {
        SensitiveKeys::downstream_key(&self.key)
    }
}

impl From<Lapsed> for Earlier {
    fn from(lapsed: Lapsed) -> Self {
        Self::TakenOver {
            attempts: lapsed.attempts,
            since: lapsed.since,
        }
    }
}

// The key only as its logged form: it may carry customer data.
impl fmt::Debug for Attempt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Attempt")
            .field("earlier", &self.earlier)
            .field("key", &self.key.logged_as())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::IdempotencyKey;

    fn key(scope: &str, key: &str) -> StorageKey {
        StorageKey::new(scope, &IdempotencyKey::new(key).unwrap())
    }

    fn downstream(key: StorageKey) -> String {
        Attempt::new(Earlier::None, key).downstream_key()
    }

    #[test]
    fn a_downstream_key_is_the_keys_own_and_hides_it() {
        let secret = SensitiveKeys::keyed(b"a secret of at least 16 bytes");
        let mine = downstream(key("acct_1", "order-42"));
        // The same on every attempt, whatever the attempt was told.
        assert_eq!(
            mine,
            Attempt::new(
                Earlier::TakenOver {
                    attempts: 2,
                    since: SystemTime::UNIX_EPOCH
                },
                key("acct_1", "order-42")
            )
            .downstream_key()
        );
        assert_eq!(mine.len(), 64);
        assert!(mine.bytes().all(|b| b.is_ascii_hexdigit()));
        // Another key, another scope, another secret: another key downstream.
        assert_ne!(mine, downstream(key("acct_1", "order-43")));
        assert_ne!(mine, downstream(key("acct_2", "order-42")));
        let keyed = downstream(key("acct_1", "order-42").sensitive(&secret));
        assert_ne!(mine, keyed);
        let other = SensitiveKeys::keyed(b"another secret, also 16+ bytes");
        assert_ne!(
            keyed,
            downstream(key("acct_1", "order-42").sensitive(&other))
        );
        // Neither the key nor its logged digest.
        let stored = key("acct_1", "order-42").sensitive(&secret);
        assert!(!keyed.contains("order-42"));
        assert!(!stored.logged_as().contains(&keyed[..16]));
    }
}
