//! Request fingerprints: what makes a retry "the same request".
//!
//! The default strategy hashes, with SHA-256, the method, the path, the query
//! with its parameters sorted, and the body. A JSON body (`application/json`
//! or `application/*+json`) is canonicalised first — object keys sorted,
//! insignificant whitespace dropped — so a retry that serialises the same
//! parameters differently still matches. Every field is length-prefixed, so
//! no two different requests concatenate to the same hash input.

use std::fmt;

use http::{header::CONTENT_TYPE, request::Parts};
use sha2::{Digest, Sha256};

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
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
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

/// The default strategy (SPEC §2.3): method, path, sorted query and body, with
/// JSON bodies canonicalised.
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
///     DefaultFingerprint.fingerprint(&parts, body.as_bytes())
/// };
/// assert_eq!(fp(r#"{"amount":1,"currency":"eur"}"#), fp(r#"{ "currency": "eur", "amount": 1 }"#));
/// assert_ne!(fp(r#"{"amount":1}"#), fp(r#"{"amount":2}"#));
/// ```
#[derive(Clone, Copy, Debug, Default)]
pub struct DefaultFingerprint;

impl FingerprintStrategy for DefaultFingerprint {
    fn fingerprint(&self, parts: &Parts, body: &[u8]) -> Fingerprint {
        let mut h = hash_head(parts);
        if let Some(canonical) = is_json(parts).then(|| canonical_json(body)).flatten() {
            h.field(b"json");
            h.field(&canonical);
            return h.finish();
        }
        h.field(b"raw");
        h.field(body);
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
    params.sort_unstable();
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

/// The canonical form of a JSON document: object keys sorted by their UTF-8
/// bytes, no insignificant whitespace. `None` when the body is not JSON (it is
/// then hashed raw, and the handler will reject it).
pub(crate) fn canonical_json(body: &[u8]) -> Option<Vec<u8>> {
    let value: serde_json::Value = serde_json::from_slice(body).ok()?;
    let mut out = Vec::with_capacity(body.len());
    write_canonical(&value, &mut out);
    Some(out)
}

fn write_canonical(value: &serde_json::Value, out: &mut Vec<u8>) {
    use serde_json::Value;
    match value {
        Value::Object(map) => {
            // Sort explicitly: serde_json's map keeps insertion order when any
            // crate in the build enables its `preserve_order` feature.
            let mut entries: Vec<_> = map.iter().collect();
            entries.sort_unstable_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
            out.push(b'{');
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_string(k, out);
                out.push(b':');
                write_canonical(v, out);
            }
            out.push(b'}');
        }
        Value::Array(items) => {
            out.push(b'[');
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_canonical(v, out);
            }
            out.push(b']');
        }
        Value::String(s) => write_string(s, out),
        scalar => {
            // null, booleans and numbers have one compact form already.
            serde_json::to_writer(&mut *out, scalar).expect("writing to a Vec cannot fail")
        }
    }
}

fn write_string(s: &str, out: &mut Vec<u8>) {
    serde_json::to_writer(&mut *out, s).expect("writing to a Vec cannot fail");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canonical_form() {
        let c = canonical_json(br#" { "b" : [1, {"y":null,"x":true}], "a":"\u00e9" } "#).unwrap();
        assert_eq!(
            String::from_utf8(c).unwrap(),
            r#"{"a":"é","b":[1,{"x":true,"y":null}]}"#
        );
        assert!(canonical_json(b"{not json").is_none());
    }

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
