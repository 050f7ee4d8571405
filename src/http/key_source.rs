//! Where a request's key comes from — a header (or gRPC metadata entry),
//! or a JSON body at a pointer (a webhook's event id) — decided here, in
//! the two steps the door takes: what the request's head says before its
//! body is read, and the body's key once it is buffered.

use std::sync::Arc;

use http::{HeaderMap, HeaderName};

use crate::{
    http::rejection::RejectionKind,
    key::{IdempotencyKey, InvalidKey},
};

/// Where the layer reads keys.
#[derive(Clone, Debug)]
pub(crate) enum KeySource {
    /// A request header, one value.
    Header(HeaderName),
    /// A string at this JSON Pointer into the body.
    Body(Arc<str>),
}

/// What a request's head says about its key.
#[derive(Debug)]
pub(crate) enum InHead {
    Key(IdempotencyKey),
    /// To be read from the body, once it is buffered.
    InBody,
    /// The request carries none.
    Absent,
    Invalid(InvalidKey),
}

impl KeySource {
    pub(crate) fn in_head(&self, headers: &HeaderMap) -> InHead {
        let Self::Header(name) = self else {
            return InHead::InBody;
        };
        let mut values = headers.get_all(name).iter();
        match (values.next(), values.next()) {
            (None, _) => InHead::Absent,
            (Some(_), Some(_)) => InHead::Invalid(InvalidKey::Repeated),
            (Some(value), None) => match IdempotencyKey::from_header(value) {
                Ok(key) => InHead::Key(key),
                Err(why) => InHead::Invalid(why),
            },
        }
    }

    /// The key in a JSON body: `Err(None)` when there is none (not JSON,
    /// no such member, not a string), `Err(Some(why))` when it is no valid
    /// key.
    pub(crate) fn in_body(&self, body: &[u8]) -> Result<IdempotencyKey, Option<InvalidKey>> {
        let Self::Body(pointer) = self else {
            return Err(None);
        };
        let value: serde_json::Value = serde_json::from_slice(body).map_err(|_| None)?;
        let key = value
            .pointer(pointer)
            .and_then(|v| v.as_str())
            .ok_or(None)?;
        IdempotencyKey::new(key).map_err(Some)
    }

    /// The rejection of a request without a key where one is required.
    pub(crate) fn missing(&self) -> RejectionKind {
        match self {
            Self::Header(_) => RejectionKind::MissingKey,
            Self::Body(pointer) => RejectionKind::MissingBodyKey {
                pointer: pointer.clone(),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header() -> KeySource {
        KeySource::Header(HeaderName::from_static("idempotency-key"))
    }

    #[test]
    fn a_header_key_is_one_valid_value() {
        let mut headers = HeaderMap::new();
        assert!(matches!(header().in_head(&headers), InHead::Absent));
        headers.append("idempotency-key", "k1".parse().unwrap());
        assert!(matches!(header().in_head(&headers), InHead::Key(k) if k.as_str() == "k1"));
        headers.append("idempotency-key", "k2".parse().unwrap());
        assert!(matches!(
            header().in_head(&headers),
            InHead::Invalid(InvalidKey::Repeated)
        ));
        assert!(matches!(header().missing(), RejectionKind::MissingKey));
    }

    #[test]
    fn a_body_key_is_a_string_at_the_pointer() {
        let body = KeySource::Body("/id".into());
        let mut headers = HeaderMap::new();
        headers.append("idempotency-key", "ignored".parse().unwrap());
        assert!(matches!(body.in_head(&headers), InHead::InBody));
        assert_eq!(
            body.in_body(br#"{"id":"evt_1"}"#).unwrap().as_str(),
            "evt_1"
        );
        assert!(matches!(body.in_body(br#"{"id":7}"#), Err(None)));
        assert!(matches!(body.in_body(b"not json"), Err(None)));
        assert!(matches!(body.in_body(br#"{"id":""}"#), Err(Some(_))));
        assert!(matches!(
            body.missing(),
            RejectionKind::MissingBodyKey { pointer } if &*pointer == "/id"
        ));
    }
}
