//! What the door does with a request whose body it read: let it through,
//! refuse it, or guard it under its key — each answer decided here, once.

use http::StatusCode;
use serde_json::value::RawValue;

use super::{
    answer::Refusal,
    call::{self, Unreadable},
    codes,
    door::Door,
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
    // Without an id it is a notification, which nothing answers: a call
    // the door could neither deduplicate nor answer a retry of.
    let Some(id) = call.id else {
        return bad_request(
            codes::INVALID_REQUEST,
            "a tools/call is a request: it needs an id".into(),
        );
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

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;
    use crate::mcp::{call::KeyPlace, door::Required};

    fn door() -> Door {
        Door {
            key: KeyPlace::Meta("idempotency-key".into()),
            require_key: Required::These(HashSet::from(["pay".to_owned()])),
            unguarded: HashSet::from(["list".to_owned()]),
        }
    }

    fn labelled(name: &str) -> Labelled {
        Labelled::ToolCall(Some(name.to_owned()))
    }

    fn refused_with(decision: Decision<'_>) -> i32 {
        match decision {
            Decision::Refuse { refusal, .. } => refusal.code,
            _ => panic!("refused"),
        }
    }

    #[test]
    fn each_request_is_passed_refused_or_guarded() {
        let door = door();
        let call = br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"pay","arguments":{"amount":1},"_meta":{"idempotency-key":"k"}}}"#;
        assert!(matches!(
            decide(call, &labelled("pay"), &door),
            Decision::Guard { key, .. } if key.as_str() == "k"
        ));
        // Unlabelled (an older client): read to tell.
        assert!(matches!(
            decide(call, &Labelled::No, &door),
            Decision::Guard { .. }
        ));
        assert!(matches!(
            decide(
                br#"{"jsonrpc":"2.0","id":1,"method":"ping"}"#,
                &Labelled::No,
                &door
            ),
            Decision::Pass(BypassReason::UnguardedMethod)
        ));
        // Labelled a call, the body something else; named one tool, calling another.
        assert_eq!(
            refused_with(decide(
                br#"{"jsonrpc":"2.0","id":1,"method":"ping"}"#,
                &labelled("pay"),
                &door
            )),
            codes::HEADER_MISMATCH
        );
        assert_eq!(
            refused_with(decide(call, &labelled("list"), &door)),
            codes::HEADER_MISMATCH
        );
        let list = br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"list","_meta":{"idempotency-key":"k"}}}"#;
        assert!(matches!(
            decide(list, &labelled("list"), &door),
            Decision::Pass(BypassReason::UnguardedTool)
        ));
        let keyless = br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"pay"}}"#;
        assert_eq!(
            refused_with(decide(keyless, &labelled("pay"), &door)),
            codes::INVALID_PARAMS
        );
        let optional =
            br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"other"}}"#;
        assert!(matches!(
            decide(optional, &labelled("other"), &door),
            Decision::Pass(BypassReason::NoKey)
        ));
        let notification = br#"{"jsonrpc":"2.0","method":"tools/call","params":{"name":"pay","_meta":{"idempotency-key":"k"}}}"#;
        assert_eq!(
            refused_with(decide(notification, &labelled("pay"), &door)),
            codes::INVALID_REQUEST
        );
        assert_eq!(
            refused_with(decide(b"{not json", &labelled("pay"), &door)),
            codes::PARSE_ERROR
        );
        let batch = br#"[{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"pay"}}]"#;
        assert_eq!(
            refused_with(decide(batch, &Labelled::No, &door)),
            codes::INVALID_REQUEST
        );
    }
}
