//! Request fingerprints: what makes a retry "the same request".
//!
//! The default strategy hashes, with SHA-256, the method, the path, the query
//! with its parameters sorted by name, and the body. A JSON body
//! (`application/json` or `application/*+json`) is canonicalised first, so a
//! retry that serialises the same parameters differently still matches, while
//! numbers are compared exactly. Every field is length-prefixed, so no two
//! different requests concatenate to the same hash input. Rules can narrow
//! the body to parts of it (JSON Pointers to ignore or to keep) and add
//! request headers.

pub(crate) mod canonical_json;
mod json_pointer;

use std::{fmt, sync::Arc};

use http::{HeaderName, header::CONTENT_TYPE, request::Parts};
use sha2::{Digest, Sha256};

use self::json_pointer::JsonPointer;
use crate::fingerprint::canonical_json::canonical_json;

/// The SHA-256 fingerprint of a request.
///
/// # Examples
///
/// ```
/// use tower_idempotency::Fingerprint;
///
/// let fp = Fingerprint::from_bytes([7; 32]);
/// assert_eq!(fp.as_bytes(), &[7; 32]);
/// assert!(fp.to_string().starts_with("0707"));
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// Wraps a 32-byte digest.
    pub const fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// The 32 bytes of the digest.
    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut hex = String::with_capacity(64);
        push_hex(&mut hex, &self.0);
        f.write_str(&hex)
    }
}

/// Appends `bytes` in lowercase hex. On the request path (every storage key
/// holds a hashed scope), where `{:02x}` per byte cost more than the hash.
pub(crate) fn push_hex(out: &mut String, bytes: &[u8]) {
    out.reserve(bytes.len() * 2);
    for &byte in bytes {
        let [high, low] = hex_pair(byte);
        out.push(char::from(high));
        out.push(char::from(low));
    }
}

/// Writes `bytes` in lowercase hex into `out`, two digits per byte.
pub(crate) fn write_hex(out: &mut [u8], bytes: &[u8]) {
    debug_assert_eq!(out.len(), bytes.len() * 2);
    for (pair, &byte) in out.chunks_exact_mut(2).zip(bytes) {
        pair.copy_from_slice(&hex_pair(byte));
    }
}

fn hex_pair(byte: u8) -> [u8; 2] {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    [
        DIGITS[usize::from(byte >> 4)],
        DIGITS[usize::from(byte & 15)],
    ]
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({self})")
    }
}

/// Decides which requests count as the same request.
///
/// Implemented for closures `Fn(&Parts, &[u8]) -> Fingerprint`; use
/// [`FingerprintHasher`] to build a length-prefixed digest.
///
/// # Examples
///
/// ```
/// use http::request::Parts;
/// use tower_idempotency::{Fingerprint, FingerprintHasher, IdempotencyLayer, MemoryStore};
///
/// // Ignore the query string: only method, path and body matter.
/// let layer = IdempotencyLayer::new(MemoryStore::new()).fingerprint_with(
///     |parts: &Parts, body: &[u8]| {
///         let mut h = FingerprintHasher::new("my-app/v1");
///         h.field(parts.method.as_str().as_bytes());
///         h.field(parts.uri.path().as_bytes());
///         h.field(body);
///         h.finish()
///     },
/// );
/// # let _ = layer;
/// ```
pub trait FingerprintStrategy: Clone + Send + Sync + 'static {
    /// Fingerprints a request from its head and its whole body.
    fn fingerprint(&self, parts: &Parts, body: &[u8]) -> Fingerprint;
}

impl<F> FingerprintStrategy for F
where
    F: Fn(&Parts, &[u8]) -> Fingerprint + Clone + Send + Sync + 'static,
{
    fn fingerprint(&self, parts: &Parts, body: &[u8]) -> Fingerprint {
        self(parts, body)
    }
}

/// The default strategy: method, path, query and body, with JSON bodies
/// canonicalised — and, when configured, only the parts of the body that
/// matter, and some request headers.
///
/// - **Query**: parameters are sorted by name only, so `?b=1&a=2` and
///   `?a=2&b=1` match, while the values of a repeated name keep their order
///   (`?x=1&x=2` and `?x=2&x=1` differ).
/// - **JSON bodies** (`application/json`, `application/*+json`) match when
///   they denote the same JSON value: whitespace is insignificant, object
///   members may come in any order, strings are compared after unescaping,
///   and numbers by their exact decimal value — `1`, `1.0` and `1e0` are one
///   number, but `0.1` and `0.10000000000000001` differ, and integers of any
///   size are compared digit by digit (never through `f64`). Arrays keep
///   their order. A body that is not valid JSON is hashed as raw bytes.
/// - **Other bodies** are hashed as raw bytes.
///
/// Whether the body was read as JSON is part of the fingerprint, so the same
/// bytes sent once without and once with `Content-Type: application/json` are
/// two different requests.
///
/// **Rules.** [`keep`](Self::keep) narrows a JSON body to the values its
/// JSON Pointers (RFC 6901) reach — what a retry must repeat — and
/// [`ignore`](Self::ignore) leaves values out, such as a client timestamp
/// that differs on every attempt; both apply to the canonical JSON, and a
/// body that is not JSON is still hashed whole. [`header`](Self::header)
/// adds a request header (an API version, `Accept`): its values compared
/// exactly, and absent not the same as empty. Without rules the
/// fingerprint is the one earlier versions computed, so stored records
/// keep matching.
///
/// # Examples
///
/// ```
/// use http::Request;
/// use tower_idempotency::{DefaultFingerprint, FingerprintStrategy};
///
/// let fp = |body: &str| {
///     let (parts, ()) = Request::post("/v1/charges?b=2&a=1")
///         .header("content-type", "application/json")
///         .body(())
///         .unwrap()
///         .into_parts();
///     DefaultFingerprint::new().fingerprint(&parts, body.as_bytes())
/// };
/// assert_eq!(fp(r#"{"amount":1,"currency":"eur"}"#), fp(r#"{ "currency": "eur", "amount": 1 }"#));
/// assert_ne!(fp(r#"{"amount":1}"#), fp(r#"{"amount":2}"#));
/// ```
///
/// With rules:
///
/// ```
/// use tower_idempotency::{DefaultFingerprint, IdempotencyLayer, MemoryStore};
///
/// let same_request = DefaultFingerprint::new()
///     .ignore("/metadata/client_time")
///     .header("api-version");
/// let layer = IdempotencyLayer::new(MemoryStore::new()).fingerprint_with(same_request);
/// # let _ = layer;
/// ```
#[derive(Clone, Debug, Default)]
pub struct DefaultFingerprint {
    rules: Option<Arc<Rules>>,
}

#[derive(Clone, Debug, Default)]
struct Rules {
    keep: Vec<JsonPointer>,
    ignore: Vec<JsonPointer>,
    headers: Vec<HeaderName>,
}

impl DefaultFingerprint {
    /// The default strategy, without rules.
    pub fn new() -> Self {
        Self::default()
    }

    fn rules(&mut self) -> &mut Rules {
        Arc::make_mut(self.rules.get_or_insert_with(Arc::default))
    }

    /// Leaves the JSON value at `pointer` (RFC 6901, e.g.
    /// `/metadata/client_time`) out of the fingerprint: two requests that
    /// differ only there are the same request.
    ///
    /// # Panics
    ///
    /// When configured, never at request time: if `pointer` is not a JSON
    /// Pointer (empty, or `/`-separated tokens with `~0` and `~1` escapes).
    ///
    /// # Examples
    ///
    /// ```
    /// let fp = tower_idempotency::DefaultFingerprint::new().ignore("/metadata/client_time");
    /// # let _ = fp;
    /// ```
    pub fn ignore(mut self, pointer: &str) -> Self {
        self.rules().ignore.push(parse(pointer, "ignore"));
        self
    }

    /// Keeps only the JSON values the kept pointers reach (e.g. `/amount`,
    /// `/currency`): any other part of the body may differ between retries.
    /// A value that is absent stays absent, apart from `null`.
    ///
    /// # Panics
    ///
    /// When configured: if `pointer` is not a JSON Pointer.
    ///
    /// # Examples
    ///
    /// ```
    /// let fp = tower_idempotency::DefaultFingerprint::new().keep("/amount").keep("/currency");
    /// # let _ = fp;
    /// ```
    pub fn keep(mut self, pointer: &str) -> Self {
        self.rules().keep.push(parse(pointer, "keep"));
        self
    }

    /// Adds the request header `name` to the fingerprint: its values,
    /// compared exactly and in order; absent is not the same as empty.
    /// (Ignored for message payloads, which have no headers.)
    ///
    /// # Panics
    ///
    /// When configured: if `name` is not a valid header name.
    ///
    /// # Examples
    ///
    /// ```
    /// let fp = tower_idempotency::DefaultFingerprint::new().header("api-version");
    /// # let _ = fp;
    /// ```
    pub fn header(mut self, name: &str) -> Self {
        let name = HeaderName::try_from(name).unwrap_or_else(|_| {
            panic!("DefaultFingerprint::header: {name:?} is not a valid header name")
        });
        self.rules().headers.push(name);
        self
    }

    /// The canonical JSON of `body` narrowed by the rules, or `None` when
    /// it is not JSON.
    fn json(&self, body: &[u8]) -> Option<Vec<u8>> {
        let canonical = canonical_json(body)?;
        match self.rules.as_deref() {
            Some(rules) if !rules.keep.is_empty() || !rules.ignore.is_empty() => {
                json_pointer::select(&canonical, &rules.keep, &rules.ignore)
            }
            _ => Some(canonical),
        }
    }
}

fn parse(pointer: &str, rule: &str) -> JsonPointer {
    JsonPointer::parse(pointer).unwrap_or_else(|why| panic!("DefaultFingerprint::{rule}: {why}"))
}

impl FingerprintStrategy for DefaultFingerprint {
    fn fingerprint(&self, parts: &Parts, body: &[u8]) -> Fingerprint {
        let mut h = hash_head(parts);
        if let Some(rules) = self.rules.as_deref().filter(|r| !r.headers.is_empty()) {
            h.field(b"headers");
            for name in &rules.headers {
                let values: Vec<_> = parts.headers.get_all(name).iter().collect();
                h.field(name.as_str().as_bytes());
                h.field(&(values.len() as u64).to_be_bytes());
                values.iter().for_each(|v| h.field(v.as_bytes()));
            }
        }
        if let Some(json) = is_json(parts).then(|| self.json(body)).flatten() {
            h.field(b"json");
            h.field(&json);
            return h.finish();
        }
        h.field(b"raw");
        h.field(body);
        h.finish()
    }
}

/// Decides which message payloads count as the same: the sibling of
/// [`FingerprintStrategy`] for [`IdempotencyProcessor`](crate::message::IdempotencyProcessor).
///
/// Implemented by [`DefaultFingerprint`] (a JSON payload compared by its
/// canonical form, narrowed by the rules; any other byte for byte), by
/// [`RawBodyFingerprint`], and for closures `Fn(&[u8]) -> Fingerprint`.
///
/// # Examples
///
/// ```
/// use tower_idempotency::{DefaultFingerprint, PayloadFingerprint};
///
/// let fp = DefaultFingerprint::new();
/// assert_eq!(fp.fingerprint_payload(br#"{"a":1,"b":2}"#), fp.fingerprint_payload(br#"{ "b": 2, "a": 1.0 }"#));
/// assert_ne!(fp.fingerprint_payload(br#"{"a":1}"#), fp.fingerprint_payload(br#"{"a":2}"#));
/// ```
pub trait PayloadFingerprint: Clone + Send + Sync + 'static {
    /// Fingerprints a message payload.
    fn fingerprint_payload(&self, payload: &[u8]) -> Fingerprint;
}

impl<F> PayloadFingerprint for F
where
    F: Fn(&[u8]) -> Fingerprint + Clone + Send + Sync + 'static,
{
    fn fingerprint_payload(&self, payload: &[u8]) -> Fingerprint {
        self(payload)
    }
}

/// The domain of a message payload's hash.
const MESSAGE: &str = "tower-idempotency/message/v1";

impl PayloadFingerprint for DefaultFingerprint {
    fn fingerprint_payload(&self, payload: &[u8]) -> Fingerprint {
        let mut h = FingerprintHasher::new(MESSAGE);
        match self.json(payload) {
            Some(json) => {
                h.field(b"json");
                h.field(&json);
            }
            None => {
                h.field(b"raw");
                h.field(payload);
            }
        }
        h.finish()
    }
}

impl PayloadFingerprint for RawBodyFingerprint {
    fn fingerprint_payload(&self, payload: &[u8]) -> Fingerprint {
        let mut h = FingerprintHasher::new(MESSAGE);
        h.field(b"raw");
        h.field(payload);
        h.finish()
    }
}

/// Like [`DefaultFingerprint`], but hashes every body as raw bytes, even JSON.
///
/// # Examples
///
/// ```
/// use tower_idempotency::{IdempotencyLayer, MemoryStore, RawBodyFingerprint};
///
/// let layer = IdempotencyLayer::new(MemoryStore::new()).fingerprint_with(RawBodyFingerprint);
/// # let _ = layer;
/// ```
#[derive(Clone, Copy, Debug, Default)]
pub struct RawBodyFingerprint;

impl FingerprintStrategy for RawBodyFingerprint {
    fn fingerprint(&self, parts: &Parts, body: &[u8]) -> Fingerprint {
        let mut h = hash_head(parts);
        h.field(b"raw");
        h.field(body);
        h.finish()
    }
}

/// A SHA-256 hasher that length-prefixes every field, so that `("ab", "c")`
/// and `("a", "bc")` hash differently.
///
/// # Examples
///
/// ```
/// use tower_idempotency::FingerprintHasher;
///
/// let hash = |fields: &[&str]| {
///     let mut h = FingerprintHasher::new("example");
///     fields.iter().for_each(|f| h.field(f.as_bytes()));
///     h.finish()
/// };
/// assert_ne!(hash(&["ab", "c"]), hash(&["a", "bc"]));
/// ```
#[derive(Clone, Debug)]
pub struct FingerprintHasher(Sha256);

impl FingerprintHasher {
    /// Starts a hash in a named domain (e.g. `"my-app/v1"`), so that digests of
    /// different strategies never coincide.
    pub fn new(domain: &str) -> Self {
        let mut h = Self(Sha256::new());
        h.field(domain.as_bytes());
        h
    }

    /// Adds one field, prefixed with its length.
    pub fn field(&mut self, bytes: &[u8]) {
        self.0.update((bytes.len() as u64).to_be_bytes());
        self.0.update(bytes);
    }

    /// The digest.
    pub fn finish(self) -> Fingerprint {
        Fingerprint(self.0.finalize().into())
    }
}

fn hash_head(parts: &Parts) -> FingerprintHasher {
    let mut h = FingerprintHasher::new("tower-idempotency/v1");
    h.field(parts.method.as_str().as_bytes());
    h.field(parts.uri.path().as_bytes());
    let query = parts.uri.query().unwrap_or("");
    let mut params: Vec<&str> = query.split('&').filter(|p| !p.is_empty()).collect();
    // By name only, and stable: the values of a repeated name keep their
    // order, since `x=1&x=2` and `x=2&x=1` differ under last-wins and list
    // semantics alike.
    params.sort_by_key(|p| p.split_once('=').map_or(*p, |(name, _)| name));
    // The count is a field too, so parameters cannot slide into the body.
    h.field(&(params.len() as u64).to_be_bytes());
    params.iter().for_each(|p| h.field(p.as_bytes()));
    h
}

fn is_json(parts: &Parts) -> bool {
    let Some(ct) = parts
        .headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let essence = ct.split(';').next().unwrap_or("").trim();
    let Some((ty, sub)) = essence.split_once('/') else {
        return false;
    };
    ty.eq_ignore_ascii_case("application")
        && (sub.eq_ignore_ascii_case("json")
            || sub.len() > 5 && sub[sub.len() - 5..].eq_ignore_ascii_case("+json"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_content_types() {
        let parts = |ct: &str| {
            http::Request::post("/")
                .header(CONTENT_TYPE, ct)
                .body(())
                .unwrap()
                .into_parts()
                .0
        };
        assert!(is_json(&parts("application/json")));
        assert!(is_json(&parts("Application/JSON; charset=utf-8")));
        assert!(is_json(&parts("application/merge-patch+json")));
        assert!(!is_json(&parts("text/plain")));
        assert!(!is_json(&parts("application/x-www-form-urlencoded")));
    }
}
