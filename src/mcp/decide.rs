//! What the door does with a request whose body it read: let it through,
//! refuse it, or guard it under its key — each answer decided here, once.

use http::StatusCode;
use serde_json::value::RawValue;

use super::{
    answer::Refusal,
    call::{self, Unreadable},
    codes,
    layer::Door,
};
use crate::{
    fingerprint::Fingerprint,
    http::{outcome::BypassReason, rejection::RejectionKind},
    key::IdempotencyKey,
};

/// What a request's head said, before its body was read.
pub(crate) enum Labelled {
    /// `Mcp-Method: tools/call`, and the tool `Mcp-Name` names.
    ToolCall(Option<String>),
    /// No `Mcp-Method`: a client of a protocol version before 2026-07-28.
    No,
}

/// The door's decision.
pub(crate) enum Decision<'a> {
    /// Through, untouched.
    Pass(BypassReason),
    /// Refused before anything runs, answering the request's id where it
    /// could be read.
    Refuse {
        refusal: Refusal,
        id: Option<&'a RawValue>,
        kind: RejectionKind,
    },
    /// Run through the protocol under `key`.
    Guard {
        key: IdempotencyKey,
        id: Box<RawValue>,
        fingerprint: Fingerprint,
    },
}

fn refuse(refusal: Refusal, kind: RejectionKind) -> Decision<'static> {
    Decision::Refuse {
        refusal,
        id: None,
        kind,
    }
}

/// Decides what becomes of the request whose head said `labelled` and
/// whose body is `bytes`.
pub(crate) fn decide<'a>(bytes: &'a [u8], labelled: &Labelled, door: &Door) -> Decision<'a> {
    let bad_request = |code, message: String| {
        refuse(
            Refusal::new(code, message).status(StatusCode::BAD_REQUEST),
            RejectionKind::BodyUnreadable,
        )
    };
    let call = match call::body(bytes) {
        Ok(call::Body::ToolCall(call)) => call,
        Ok(call::Body::Other { method }) => {
            return match labelled {
                Labelled::ToolCall(_) => bad_request(
                    codes::HEADER_MISMATCH,
                    format!(
                        "Mcp-Method says tools/call, but the body's method is {}",
                        method.as_deref().unwrap_or("none")
                    ),
                ),
                Labelled::No => Decision::Pass(BypassReason::UnguardedMethod),
            };
        }
        Ok(call::Body::Batch {
            calls_a_tool: false,
        }) => return Decision::Pass(BypassReason::UnguardedMethod),
        Ok(call::Body::Batch { calls_a_tool: true }) => {
            return bad_request(
                codes::INVALID_REQUEST,
                "a JSON-RPC batch that calls a tool cannot be deduplicated: send each tools/call on its own".into(),
            );
        }
        Err(Unreadable::NotJson) => {
            return bad_request(codes::PARSE_ERROR, "the request body is not JSON".into());
        }
        Err(Unreadable::NotJsonRpc(why)) => {
            return bad_request(codes::INVALID_REQUEST, why.into());
        }
    };
    let tool = call.params.name.as_str();
    if let Labelled::ToolCall(Some(named)) = labelled
        && named != tool
    {
        return Decision::Refuse {
            refusal: Refusal::new(
                codes::HEADER_MISMATCH,
                format!("Mcp-Name says {named}, but the body calls {tool}"),
            )
            .status(StatusCode::BAD_REQUEST),
            id: call.id,
            kind: RejectionKind::BodyUnreadable,
        };
    }
    // Without an id it is a notification, not a call: nothing answers it,
    // and the server refuses it as a call.
    let Some(id) = call.id else {
        return Decision::Pass(BypassReason::NoKey);
    };
    if door.unguarded.contains(tool) {
        return Decision::Pass(BypassReason::UnguardedTool);
    }
    let key = match call.key(&door.key) {
        Ok(Some(key)) => key,
        Ok(None) if door.requires_key(tool) => {
            return Decision::Refuse {
                refusal: Refusal::new(
                    codes::INVALID_PARAMS,
                    format!(
                        "the tool {tool} needs an idempotency key: a unique string in {}, the same on every retry of this call",
                        door.key.describe()
                    ),
                ),
                id: Some(id),
                kind: RejectionKind::MissingKey,
            };
        }
        Ok(None) => return Decision::Pass(BypassReason::NoKey),
        Err(why) => {
            return Decision::Refuse {
                refusal: Refusal::new(
                    codes::INVALID_PARAMS,
                    format!(
                        "the idempotency key in {} is not valid: {why}",
                        door.key.describe()
                    ),
                ),
                id: Some(id),
                kind: RejectionKind::InvalidKey(why),
            };
        }
    };
    Decision::Guard {
        key,
        id: id.to_owned(),
        fingerprint: call.fingerprint(),
    }
}
