//! Request fingerprints: what makes a retry "the same request".
//!
//! The default strategy hashes, with SHA-256, the method, the path, the query
//! with its parameters sorted, and the body. A JSON body (`application/json`
//! or `application/*+json`) is canonicalised first — object keys sorted,
//! insignificant whitespace dropped — so a retry that serialises the same
//! parameters differently still matches. Every field is length-prefixed, so
//! no two different requests concatenate to the same hash input.

use std::fmt;

use serde::de::{DeserializeSeed, MapAccess, SeqAccess, Visitor};

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

/// The canonical form of a JSON document: no insignificant whitespace, one
/// spelling per string and number, object members sorted by their canonical
/// key. `None` when the body is not JSON (it is then hashed raw, and the
/// handler will reject it).
///
/// It is written while parsing, without building a tree: each object's
/// members go straight to the output, and are reordered only if they did not
/// arrive sorted.
pub(crate) fn canonical_json(body: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(body.len());
    let mut scratch = Scratch::default();
    let mut de = serde_json::Deserializer::from_slice(body);
    Canonical {
        out: &mut out,
        scratch: &mut scratch,
    }
    .deserialize(&mut de)
    .ok()?;
    de.end().ok()?;
    Some(out)
}

/// Where one object member was written: `out[start..end]` is `"key":value`,
/// and `out[start..key_end]` its canonical key, whose first 8 bytes, as a
/// big-endian number, are `prefix` (so most comparisons are one integer
/// comparison).
struct Member {
    prefix: u64,
    start: usize,
    key_end: usize,
    end: usize,
}

fn key_prefix(key: &[u8]) -> u64 {
    let mut bytes = [0; 8];
    let n = key.len().min(8);
    bytes[..n].copy_from_slice(&key[..n]);
    u64::from_be_bytes(bytes)
}

/// Buffers shared by all nesting levels, so objects allocate nothing of
/// their own: a stack of member positions, and room to reorder members.
#[derive(Default)]
struct Scratch {
    members: Vec<Member>,
    reorder: Vec<u8>,
}

/// Writes one JSON value in canonical form.
struct Canonical<'o> {
    out: &'o mut Vec<u8>,
    scratch: &'o mut Scratch,
}

impl Canonical<'_> {
    fn reborrow(&mut self) -> Canonical<'_> {
        Canonical {
            out: self.out,
            scratch: self.scratch,
        }
    }

    /// Rewrites the members written since `content_start` sorted by key
    /// (stable: repeated keys keep their order, so even such documents have
    /// one form).
    fn sort_members(&mut self, content_start: usize, first: usize) {
        let Scratch { members, reorder } = &mut *self.scratch;
        reorder.clear();
        reorder.extend_from_slice(&self.out[content_start..]);
        let written = &reorder[..];
        let at = |from: usize, to: usize| &written[from - content_start..to - content_start];
        let members = &mut members[first..];
        members.sort_by(|a, b| {
            (a.prefix.cmp(&b.prefix))
                .then_with(|| at(a.start, a.key_end).cmp(at(b.start, b.key_end)))
        });
        self.out.truncate(content_start);
        for (i, m) in members.iter().enumerate() {
            if i > 0 {
                self.out.push(b',');
            }
            self.out.extend_from_slice(at(m.start, m.end));
        }
    }
}

impl<'de> DeserializeSeed<'de> for Canonical<'_> {
    type Value = ();

    fn deserialize<D: serde::Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

/// An object key, written as a canonical JSON string. Keys are read as bytes:
/// serde_json then skips UTF-8 validation of keys without escapes, which are
/// copied verbatim anyway.
struct CanonicalKey<'o>(&'o mut Vec<u8>);

impl<'de> DeserializeSeed<'de> for CanonicalKey<'_> {
    type Value = ();

    fn deserialize<D: serde::Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_bytes(self)
    }
}

impl<'de> Visitor<'de> for CanonicalKey<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object key")
    }

    fn visit_borrowed_bytes<E>(self, raw: &'de [u8]) -> Result<(), E> {
        write_raw_string(self.0, raw);
        Ok(())
    }

    fn visit_bytes<E: serde::de::Error>(self, unescaped: &[u8]) -> Result<(), E> {
        let key = std::str::from_utf8(unescaped).map_err(E::custom)?;
        write_json(self.0, key);
        Ok(())
    }
}

/// A string that held no escapes in the input: valid JSON string content as
/// it stands (raw control characters are not valid JSON).
fn write_raw_string(out: &mut Vec<u8>, raw: &[u8]) {
    out.push(b'"');
    out.extend_from_slice(raw);
    out.push(b'"');
}

fn write_json<T: serde::Serialize + ?Sized>(out: &mut Vec<u8>, value: &T) {
    serde_json::to_writer(out, value).expect("writing to a Vec cannot fail");
}

impl<'de> Visitor<'de> for Canonical<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_unit<E>(self) -> Result<(), E> {
        self.out.extend_from_slice(b"null");
        Ok(())
    }

    fn visit_bool<E>(self, b: bool) -> Result<(), E> {
        self.out
            .extend_from_slice(if b { b"true" } else { b"false" });
        Ok(())
    }

    // serde_json writes numbers with itoa and ryu: one spelling per value.
    fn visit_i64<E>(self, n: i64) -> Result<(), E> {
        write_json(self.out, &n);
        Ok(())
    }

    fn visit_u64<E>(self, n: u64) -> Result<(), E> {
        write_json(self.out, &n);
        Ok(())
    }

    fn visit_f64<E>(self, n: f64) -> Result<(), E> {
        write_json(self.out, &n);
        Ok(())
    }

    fn visit_borrowed_str<E>(self, s: &'de str) -> Result<(), E> {
        write_raw_string(self.out, s.as_bytes());
        Ok(())
    }

    /// Unescaped by the parser: escape it again, the one way serde_json does.
    fn visit_str<E>(self, s: &str) -> Result<(), E> {
        write_json(self.out, s);
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(mut self, mut seq: A) -> Result<(), A::Error> {
        self.out.push(b'[');
        let mut first = true;
        loop {
            let before = self.out.len();
            if !first {
                self.out.push(b',');
            }
            if seq.next_element_seed(self.reborrow())?.is_none() {
                self.out.truncate(before);
                break;
            }
            first = false;
        }
        self.out.push(b']');
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(mut self, mut map: A) -> Result<(), A::Error> {
        self.out.push(b'{');
        let content_start = self.out.len();
        let first = self.scratch.members.len();
        let mut sorted = true;
        loop {
            let before = self.out.len();
            if before > content_start {
                self.out.push(b',');
            }
            let start = self.out.len();
            if map.next_key_seed(CanonicalKey(self.out))?.is_none() {
                self.out.truncate(before);
                break;
            }
            let key_end = self.out.len();
            let key = &self.out[start..key_end];
            let prefix = key_prefix(key);
            if let Some(previous) = self.scratch.members[first..].last() {
                sorted &=
                    (previous.prefix, &self.out[previous.start..previous.key_end]) <= (prefix, key);
            }
            self.out.push(b':');
            map.next_value_seed(self.reborrow())?;
            let end = self.out.len();
            self.scratch.members.push(Member {
                prefix,
                start,
                key_end,
                end,
            });
        }
        if !sorted {
            self.sort_members(content_start, first);
        }
        self.scratch.members.truncate(first);
        self.out.push(b'}');
        Ok(())
    }
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
    fn canonical_edge_cases() {
        let c = |s: &str| String::from_utf8(canonical_json(s.as_bytes()).unwrap()).unwrap();
        // Nested objects are sorted at every level, arrays keep their order.
        assert_eq!(
            c(r#"{"z":{"b":1,"a":[{"d":0,"c":0}]},"y":[3,1,2]}"#),
            r#"{"y":[3,1,2],"z":{"a":[{"c":0,"d":0}],"b":1}}"#
        );
        // Escapes are normalised: "\u0061" is "a", "\/" is "/".
        assert_eq!(
            c(r#"{"\u0062":"\/x","a":"\u00e9\n"}"#),
            "{\"a\":\"é\\n\",\"b\":\"/x\"}"
        );
        // Numbers have one spelling.
        assert_eq!(
            c("[1.0, 1e2, -0, 10, -5, 0.5]"),
            "[1.0,100.0,-0.0,10,-5,0.5]"
        );
        // Repeated keys keep their order (stable), so the form is deterministic.
        assert_eq!(c(r#"{"b":1,"a":2,"a":1}"#), r#"{"a":2,"a":1,"b":1}"#);
        // Canonical input is a fixed point.
        let once = c(r#"{ "k" : [ {"y":true,"x":null} ], "a" : "s" }"#);
        assert_eq!(c(&once), once);
        // Trailing garbage and invalid documents are not JSON.
        assert!(canonical_json(b"{} x").is_none());
        assert!(canonical_json(b"{\"a\":}").is_none());
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
