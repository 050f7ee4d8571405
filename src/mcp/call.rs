//! A `tools/call` request, read as far as the door needs: what its head
//! says (the transport's `Mcp-Method` and `Mcp-Name`), then, from its body,
//! the tool, its arguments, its key and its JSON-RPC id.

use std::borrow::Cow;

use base64::{Engine, prelude::BASE64_STANDARD};
use http::{HeaderMap, HeaderName};
use serde::Deserialize;
use serde_json::{Map, Value, value::RawValue};

use crate::{
    fingerprint::{Fingerprint, FingerprintHasher, canonical_json::canonical_json},
    key::{IdempotencyKey, InvalidKey},
};

/// The header that names a request's JSON-RPC method (MCP 2026-07-28).
pub(crate) const MCP_METHOD: HeaderName = HeaderName::from_static("mcp-method");
/// The header that names the tool a `tools/call` calls.
pub(crate) const MCP_NAME: HeaderName = HeaderName::from_static("mcp-name");
/// The one method the door guards.
pub(crate) const TOOLS_CALL: &str = "tools/call";

/// What a request's head says it is.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Head<'a> {
    /// `Mcp-Method: tools/call`, with the tool `Mcp-Name` names, if it does.
    ToolCall(Option<Cow<'a, str>>),
    /// Another method: passed through unread.
    Other,
    /// No `Mcp-Method` (a client of an earlier protocol version): only the
    /// body can tell.
    Unlabelled,
    /// A header that cannot be read (not text, or `Mcp-Name`'s Base64 form
    /// broken).
    Unreadable(&'static str),
}

/// Reads the head.
pub(crate) fn head(headers: &HeaderMap) -> Head<'_> {
    let Some(method) = headers.get(MCP_METHOD) else {
        return Head::Unlabelled;
    };
    match method.to_str() {
        Ok(TOOLS_CALL) => {}
        Ok(_) => return Head::Other,
        Err(_) => return Head::Unreadable("Mcp-Method is not text"),
    }
    match headers.get(MCP_NAME).map(|name| name.to_str()) {
        None => Head::ToolCall(None),
        Some(Err(_)) => Head::Unreadable("Mcp-Name is not text"),
        Some(Ok(name)) => match decode_header(name) {
            Some(name) => Head::ToolCall(Some(name)),
            None => Head::Unreadable("Mcp-Name is not valid Base64"),
        },
    }
}

/// A header value as the transport writes it: as it is, or — a value a
/// header cannot carry — Base64 between `=?base64?` and `?=`.
fn decode_header(value: &str) -> Option<Cow<'_, str>> {
    match value
        .strip_prefix("=?base64?")
        .and_then(|inner| inner.strip_suffix("?="))
    {
        None => Some(Cow::Borrowed(value)),
        Some(inner) => {
            let bytes = BASE64_STANDARD.decode(inner).ok()?;
            String::from_utf8(bytes).ok().map(Cow::Owned)
        }
    }
}

/// What a body holds.
#[derive(Debug)]
pub(crate) enum Body<'a> {
    /// A `tools/call`.
    ToolCall(ToolCall<'a>),
    /// Another message: a request with another method, a notification, a
    /// response.
    Other { method: Option<String> },
    /// A JSON-RPC batch (protocol versions before 2025-06-18), and whether
    /// it holds a `tools/call`.
    Batch { calls_a_tool: bool },
}

/// Why a body cannot be read.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Unreadable {
    /// Not JSON.
    NotJson,
    /// JSON, but not a JSON-RPC message: the reason.
    NotJsonRpc(&'static str),
}

/// A `tools/call` request.
#[derive(Debug)]
pub(crate) struct ToolCall<'a> {
    /// Absent in a notification: a `tools/call` without one is not a request.
    pub(crate) id: Option<&'a RawValue>,
    pub(crate) params: Params<'a>,
}

#[derive(Debug, Deserialize)]
pub(crate) struct Params<'a> {
    pub(crate) name: String,
    /// Kept as sent: the fingerprint reads its numbers exactly.
    #[serde(borrow, default)]
    pub(crate) arguments: Option<&'a RawValue>,
    #[serde(rename = "_meta", default)]
    pub(crate) meta: Option<Map<String, Value>>,
}

/// Where a tool call's key is.
#[derive(Clone, Debug)]
pub(crate) enum KeyPlace {
    /// A member of `params._meta`.
    Meta(Box<str>),
    /// A JSON Pointer into `params.arguments`.
    Argument(Box<str>),
}

impl KeyPlace {
    /// Where it is, as the door's refusals name it.
    pub(crate) fn describe(&self) -> String {
        match self {
            Self::Meta(name) => format!("params._meta[\"{name}\"]"),
            Self::Argument(pointer) => {
                format!("params.arguments at the JSON Pointer \"{pointer}\"")
            }
        }
    }
}

/// Reads a body: the message once, and a call's params from their own
/// text.
pub(crate) fn body(bytes: &[u8]) -> Result<Body<'_>, Unreadable> {
    /// A message, as far as telling a call from the rest goes.
    #[derive(Deserialize)]
    struct Message<'a> {
        #[serde(default)]
        method: Option<String>,
        #[serde(borrow, default)]
        id: Option<&'a RawValue>,
        #[serde(borrow, default)]
        params: Option<&'a RawValue>,
    }
    /// A batch's message: its method alone.
    #[derive(Deserialize)]
    struct Method {
        #[serde(default)]
        method: Option<String>,
    }
    let trimmed = bytes.trim_ascii_start();
    if trimmed.starts_with(b"[") {
        let batch: Vec<Method> = serde_json::from_slice(bytes).map_err(|_| Unreadable::NotJson)?;
        let calls_a_tool = batch
            .iter()
            .any(|m| m.method.as_deref() == Some(TOOLS_CALL));
        return Ok(Body::Batch { calls_a_tool });
    }
    let message: Message<'_> = serde_json::from_slice(bytes).map_err(|e| {
        if e.is_data() {
            Unreadable::NotJsonRpc("a JSON-RPC message is an object")
        } else {
            Unreadable::NotJson
        }
    })?;
    if message.method.as_deref() != Some(TOOLS_CALL) {
        return Ok(Body::Other {
            method: message.method,
        });
    }
    let params = message
        .params
        .and_then(|params| serde_json::from_str(params.get()).ok())
        .ok_or(Unreadable::NotJsonRpc(
            "tools/call needs params with a string name",
        ))?;
    Ok(Body::ToolCall(ToolCall {
        id: message.id,
        params,
    }))
}

impl ToolCall<'_> {
    /// The call's key, where the door reads it: `Ok(None)` when there is none.
    pub(crate) fn key(&self, at: &KeyPlace) -> Result<Option<IdempotencyKey>, InvalidKey> {
        let value = match at {
            KeyPlace::Meta(name) => self
                .params
                .meta
                .as_ref()
                .and_then(|meta| meta.get(&**name))
                .and_then(Value::as_str)
                .map(Cow::Borrowed),
            KeyPlace::Argument(pointer) => self
                .params
                .arguments
                .and_then(|raw| serde_json::from_str::<Value>(raw.get()).ok())
                .and_then(|arguments| {
                    arguments
                        .pointer(pointer)
                        .and_then(Value::as_str)
                        .map(|key| Cow::Owned(key.to_owned()))
                }),
        };
        value.map(IdempotencyKey::new).transpose()
    }

    /// The call's fingerprint: the tool's name and its arguments, canonical
    /// JSON — never the JSON-RPC id nor `_meta`, which change on every retry.
    /// No arguments and `{}` are one call.
    pub(crate) fn fingerprint(&self) -> Fingerprint {
        let mut h = FingerprintHasher::new("tower-idempotency/mcp/tools-call/v1");
        h.field(self.params.name.as_bytes());
        let arguments = self.params.arguments.map_or("{}", RawValue::get);
        match canonical_json(arguments.as_bytes()) {
            Some(canonical) => h.field(&canonical),
            None => h.field(arguments.as_bytes()),
        }
        h.finish()
    }
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        pairs
            .iter()
            .map(|(name, value)| {
                (
                    HeaderName::from_static(name),
                    HeaderValue::from_static(value),
                )
            })
            .collect()
    }

    #[test]
    fn the_head_routes_without_the_body() {
        assert_eq!(head(&HeaderMap::new()), Head::Unlabelled);
        assert_eq!(head(&headers(&[("mcp-method", "tools/list")])), Head::Other);
        assert_eq!(
            head(&headers(&[("mcp-method", "tools/call")])),
            Head::ToolCall(None)
        );
        assert_eq!(
            head(&headers(&[
                ("mcp-method", "tools/call"),
                ("mcp-name", "pay")
            ])),
            Head::ToolCall(Some("pay".into()))
        );
        // "créer" does not fit a header as it is.
        assert_eq!(
            head(&headers(&[
                ("mcp-method", "tools/call"),
                ("mcp-name", "=?base64?Y3LDqWVy?=")
            ])),
            Head::ToolCall(Some("créer".into()))
        );
        assert!(matches!(
            head(&headers(&[
                ("mcp-method", "tools/call"),
                ("mcp-name", "=?base64?***?=")
            ])),
            Head::Unreadable(_)
        ));
    }

    #[test]
    fn a_body_is_a_call_another_message_or_a_batch() {
        let call = br#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"pay","arguments":{"amount":1},"_meta":{"idempotency-key":"k1"}}}"#;
        let Ok(Body::ToolCall(call)) = body(call) else {
            panic!("a call")
        };
        assert_eq!(call.id.unwrap().get(), "7");
        assert_eq!(call.params.name, "pay");
        let meta = KeyPlace::Meta("idempotency-key".into());
        assert_eq!(call.key(&meta).unwrap().unwrap().as_str(), "k1");
        assert!(matches!(
            body(br#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#),
            Ok(Body::Other { method: Some(m) }) if m == "tools/list"
        ));
        assert!(matches!(
            body(br#"[{"method":"ping"},{"method":"tools/call","params":{"name":"x"}}]"#),
            Ok(Body::Batch { calls_a_tool: true })
        ));
        assert_eq!(body(b"{not json").unwrap_err(), Unreadable::NotJson);
        assert!(matches!(body(b"7"), Err(Unreadable::NotJsonRpc(_))));
        assert!(matches!(
            body(br#"{"method":"tools/call","params":{}}"#),
            Err(Unreadable::NotJsonRpc(_))
        ));
    }

    #[test]
    fn a_key_is_in_meta_or_in_the_arguments() {
        let Ok(Body::ToolCall(call)) = body(
            br#"{"id":1,"method":"tools/call","params":{"name":"pay","arguments":{"order":{"id":"o-1"}},"_meta":{"other":"x"}}}"#,
        ) else {
            panic!("a call")
        };
        assert!(
            call.key(&KeyPlace::Meta("idempotency-key".into()))
                .unwrap()
                .is_none()
        );
        assert_eq!(
            call.key(&KeyPlace::Argument("/order/id".into()))
                .unwrap()
                .unwrap()
                .as_str(),
            "o-1"
        );
        let Ok(Body::ToolCall(call)) = body(
            br#"{"id":1,"method":"tools/call","params":{"name":"pay","_meta":{"idempotency-key":""}}}"#,
        ) else {
            panic!("a call")
        };
        assert!(call.key(&KeyPlace::Meta("idempotency-key".into())).is_err());
    }

    #[test]
    fn the_fingerprint_is_the_tool_and_its_arguments() {
        let fingerprint = |bytes: &[u8]| match body(bytes) {
            Ok(Body::ToolCall(call)) => call.fingerprint(),
            _ => panic!("a call"),
        };
        let first = fingerprint(
            br#"{"id":1,"method":"tools/call","params":{"name":"pay","arguments":{"amount":1999,"currency":"eur"},"_meta":{"idempotency-key":"k","progressToken":1}}}"#,
        );
        // Another id, other _meta, the members in another order: the same call.
        let retry = fingerprint(
            br#"{"id":"r-2","method":"tools/call","params":{"_meta":{"idempotency-key":"k","progressToken":9},"arguments":{"currency":"eur","amount":1999.0},"name":"pay"}}"#,
        );
        assert_eq!(first, retry);
        let other_amount = fingerprint(
            br#"{"id":1,"method":"tools/call","params":{"name":"pay","arguments":{"amount":2000,"currency":"eur"}}}"#,
        );
        assert_ne!(first, other_amount);
        let other_tool = fingerprint(
            br#"{"id":1,"method":"tools/call","params":{"name":"refund","arguments":{"amount":1999,"currency":"eur"}}}"#,
        );
        assert_ne!(first, other_tool);
        assert_eq!(
            fingerprint(br#"{"id":1,"method":"tools/call","params":{"name":"list"}}"#),
            fingerprint(
                br#"{"id":1,"method":"tools/call","params":{"name":"list","arguments":{}}}"#
            )
        );
    }
}
