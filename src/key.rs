//! The `Idempotency-Key` header value.

use std::fmt;

use http::HeaderValue;

/// The name of the request header that carries the key.
pub const IDEMPOTENCY_KEY: http::HeaderName = http::HeaderName::from_static("idempotency-key");

/// A validated `Idempotency-Key`: 1 to [`MAX_LEN`](Self::MAX_LEN) visible ASCII
/// characters (0x21–0x7E).
///
/// The header may carry the key as a bare token (`abc`) or as an RFC 8941
/// sf-string (`"abc"`); both name the same key.
///
/// # Examples
///
/// ```
/// use http::HeaderValue;
/// use tower_idempotency::IdempotencyKey;
///
/// let bare = IdempotencyKey::from_header(&HeaderValue::from_static("order-42")).unwrap();
/// let quoted = IdempotencyKey::from_header(&HeaderValue::from_static("\"order-42\"")).unwrap();
/// assert_eq!(bare, quoted);
/// assert_eq!(bare.as_str(), "order-42");
///
/// assert!(IdempotencyKey::new("has space").is_err());
/// assert!(IdempotencyKey::new("x".repeat(IdempotencyKey::MAX_LEN + 1)).is_err());
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(Box<str>);

impl IdempotencyKey {
    /// The longest accepted key, in characters.
    pub const MAX_LEN: usize = 255;

    /// Validates an already unquoted key.
    pub fn new(key: impl Into<String>) -> Result<Self, InvalidKey> {
        let key = key.into();
        validate(key.as_bytes())?;
        Ok(Self(key.into_boxed_str()))
    }

    /// Parses the value of an `Idempotency-Key` header: a bare token or an
    /// RFC 8941 sf-string.
    pub fn from_header(value: &HeaderValue) -> Result<Self, InvalidKey> {
        Self::parse_bytes(value.as_bytes())
    }

    /// Parses a key as a client sends it in the header — a bare token or an
    /// RFC 8941 sf-string (`"order-42"` is `order-42`) — e.g. one an
    /// operator copied from a request log.
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::IdempotencyKey;
    ///
    /// assert_eq!(IdempotencyKey::parse("\"order-42\"").unwrap(), IdempotencyKey::new("order-42").unwrap());
    /// ```
    pub fn parse(value: &str) -> Result<Self, InvalidKey> {
        Self::parse_bytes(value.as_bytes())
    }

    fn parse_bytes(raw: &[u8]) -> Result<Self, InvalidKey> {
        let raw = raw.trim_ascii();
        let unquoted = match raw {
            [b'"', inner @ .., b'"'] => unescape_sf_string(inner)?,
            [b'"', ..] => return Err(InvalidKey::MalformedString),
            bare => bare.to_vec(),
        };
        validate(&unquoted)?;
        // `validate` admitted only ASCII, so this cannot fail.
        let key = String::from_utf8(unquoted).map_err(|_| InvalidKey::InvalidCharacter)?;
        Ok(Self(key.into_boxed_str()))
    }

    /// The key as a string slice.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Converts the key into an owned string.
    pub fn into_string(self) -> String {
        self.0.into_string()
    }
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

fn validate(key: &[u8]) -> Result<(), InvalidKey> {
    if key.is_empty() {
        return Err(InvalidKey::Empty);
    }
    if key.len() > IdempotencyKey::MAX_LEN {
        return Err(InvalidKey::TooLong);
    }
    if !key.iter().all(|b| (0x21..=0x7e).contains(b)) {
        return Err(InvalidKey::InvalidCharacter);
    }
    Ok(())
}

/// RFC 8941 §4.2.5: inside the quotes only `\"` and `\\` are escapes.
fn unescape_sf_string(inner: &[u8]) -> Result<Vec<u8>, InvalidKey> {
    let mut out = Vec::with_capacity(inner.len());
    let mut bytes = inner.iter();
    while let Some(&b) = bytes.next() {
        match b {
            b'\\' => match bytes.next() {
                Some(&escaped @ (b'"' | b'\\')) => out.push(escaped),
                _ => return Err(InvalidKey::MalformedString),
            },
            b'"' => return Err(InvalidKey::MalformedString),
            other => out.push(other),
        }
    }
    Ok(out)
}

/// Why an `Idempotency-Key` was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidKey {
    /// The key is empty.
    #[error("the Idempotency-Key is empty")]
    Empty,
    /// The key is longer than [`IdempotencyKey::MAX_LEN`] characters.
    #[error("the Idempotency-Key is longer than 255 characters")]
    TooLong,
    /// The key holds a character outside visible ASCII (0x21–0x7E).
    #[error("the Idempotency-Key may hold only visible ASCII characters (0x21-0x7E)")]
    InvalidCharacter,
    /// The key starts with `"` but is not a well-formed RFC 8941 sf-string.
    #[error("the Idempotency-Key is not a well-formed quoted string")]
    MalformedString,
    /// The request carries more than one `Idempotency-Key` header.
    #[error("the request carries more than one Idempotency-Key header")]
    Repeated,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(v: &str) -> Result<IdempotencyKey, InvalidKey> {
        IdempotencyKey::from_header(&HeaderValue::from_str(v).unwrap())
    }

    #[test]
    fn quoted_and_bare_are_the_same_key() {
        assert_eq!(parse("\"k-1\"").unwrap(), parse("k-1").unwrap());
        assert_eq!(parse(r#""a\"b\\c""#).unwrap().as_str(), r#"a"b\c"#);
    }

    #[test]
    fn lengths() {
        assert!(parse(&"k".repeat(255)).is_ok());
        assert_eq!(parse(&"k".repeat(256)), Err(InvalidKey::TooLong));
        assert_eq!(parse("\"\""), Err(InvalidKey::Empty));
    }

    #[test]
    fn characters() {
        assert_eq!(parse("a b"), Err(InvalidKey::InvalidCharacter));
        assert_eq!(parse("\"a b\""), Err(InvalidKey::InvalidCharacter));
        assert_eq!(parse("\"abc"), Err(InvalidKey::MalformedString));
        assert_eq!(parse(r#""a\nb""#), Err(InvalidKey::MalformedString));
        let non_ascii = HeaderValue::from_bytes("clé".as_bytes()).unwrap();
        assert_eq!(
            IdempotencyKey::from_header(&non_ascii),
            Err(InvalidKey::InvalidCharacter)
        );
    }
}
