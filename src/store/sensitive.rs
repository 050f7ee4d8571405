//! How a key that may carry customer data is shown in logs and spans.

use std::{fmt, sync::Arc};

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::fingerprint::{FingerprintHasher, push_hex};

/// How keys are shown in logs and spans when they may carry customer data
/// (an order reference, an email, an account id): each as a short digest
/// of its scope and key, the same on every line about it.
///
/// An idempotency key is often guessable (`order-42`), so a plain hash of
/// it can be reversed by hashing candidates. [`keyed`](Self::keyed) makes
/// the digest an HMAC-SHA-256 under a secret the application holds (from
/// its secret store, like any other): without the secret, a logged digest
/// tells nothing about the key. [`unkeyed`](Self::unkeyed) is a plain
/// SHA-256 — an explicit choice, for logs that only people who could read
/// the store anyway can see.
///
/// # Examples
///
/// ```
/// use tower_idempotency::{IdempotencyKey, SensitiveKeys, store::StorageKey};
///
/// let keys = SensitiveKeys::keyed(b"a secret of at least 16 bytes");
/// let key = StorageKey::new("acct_1", &IdempotencyKey::new("order-42").unwrap());
/// let shown = keys.show(&key);
/// assert!(shown.starts_with("hmac:") && !shown.contains("order-42"));
/// // Another secret, another digest: the logged form cannot be recomputed without it.
/// assert_ne!(shown, SensitiveKeys::keyed(b"another secret, also 16+ bytes").show(&key));
/// assert!(SensitiveKeys::unkeyed().show(&key).starts_with("sha256:"));
/// ```
#[derive(Clone)]
pub struct SensitiveKeys {
    /// `None`: unkeyed.
    secret: Option<Arc<[u8]>>,
}

/// The shortest secret [`SensitiveKeys::keyed`] takes.
const MIN_SECRET: usize = 16;

impl SensitiveKeys {
    /// Digests keyed with `secret` (HMAC-SHA-256), shown as `hmac:` and 16
    /// hex digits.
    ///
    /// # Panics
    ///
    /// At start-up, when `secret` is shorter than 16 bytes: a short secret
    /// can be guessed as easily as the keys it hides.
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::SensitiveKeys;
    ///
    /// let keys = SensitiveKeys::keyed(std::env::var("LOG_KEY_SECRET").unwrap_or_else(|_| "dev-only secret, 16+".into()));
    /// # let _ = keys;
    /// ```
    pub fn keyed(secret: impl AsRef<[u8]>) -> Self {
        let secret = secret.as_ref();
        assert!(
            secret.len() >= MIN_SECRET,
            "SensitiveKeys::keyed: the secret has {} bytes; give it at least {MIN_SECRET} \
             (e.g. 32 random bytes from your secret store)",
            secret.len()
        );
        Self {
            secret: Some(secret.into()),
        }
    }

    /// Plain SHA-256 digests, shown as `sha256:` and 16 hex digits: anyone
    /// with the logs can test a guessed key against them. Choose it only
    /// where that is acceptable.
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::SensitiveKeys;
    ///
    /// let keys = SensitiveKeys::unkeyed();
    /// # let _ = keys;
    /// ```
    pub fn unkeyed() -> Self {
        Self { secret: None }
    }

    /// How `key` is shown: its digest, whether or not the key is marked
    /// [`sensitive`](super::StorageKey::sensitive) — to find an operator's
    /// key in logs written with sensitive keys.
    ///
    /// # Examples
    ///
    /// See the [type's](Self).
    pub fn show(&self, key: &super::StorageKey) -> String {
        let (prefix, digest) = match &self.secret {
            Some(secret) => (
                "hmac:",
                keyed(secret, "tower-idempotency/logged-key/v2", key),
            ),
            None => ("sha256:", unkeyed("tower-idempotency/logged-key/v1", key)),
        };
        let mut shown = String::from(prefix);
        push_hex(&mut shown, &digest[..8]);
        shown
    }

    /// `key`'s downstream key (see
    /// [`Attempt::downstream_key`](crate::Attempt::downstream_key)): keyed
    /// by its own secret when it has one, in a domain of its own, so it is
    /// neither a logged digest nor the key.
    pub(crate) fn downstream_key(key: &super::StorageKey) -> String {
        const DOMAIN: &str = "tower-idempotency/downstream-key/v1";
        let digest = match key.sensitive.as_ref().and_then(|how| how.secret.as_deref()) {
            Some(secret) => keyed(secret, DOMAIN, key),
            None => unkeyed(DOMAIN, key),
        };
        let mut shown = String::with_capacity(64);
        push_hex(&mut shown, &digest);
        shown
    }
}

/// `key`'s HMAC-SHA-256 under `secret`, in `domain`.
fn keyed(secret: &[u8], domain: &str, key: &super::StorageKey) -> [u8; 32] {
    let mut mac = Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes any key");
    mac.update(domain.as_bytes());
    mac.update(key.as_str().as_bytes());
    mac.finalize().into_bytes().into()
}

/// `key`'s SHA-256, in `domain`.
fn unkeyed(domain: &str, key: &super::StorageKey) -> [u8; 32] {
    let mut hasher = FingerprintHasher::new(domain);
    hasher.field(key.as_str().as_bytes());
    *hasher.finish().as_bytes()
}

// The secret never appears in a log.
impl fmt::Debug for SensitiveKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self.secret {
            Some(_) => "SensitiveKeys::keyed(…)",
            None => "SensitiveKeys::unkeyed()",
        })
    }
}
