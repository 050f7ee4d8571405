//! JSON-RPC answers: the final response of a tool call, read from the MCP
//! server's answer (`application/json` or an SSE stream) and written for a
//! caller's own id; and the door's own refusals.

use std::time::Duration;

use axum_core::body::Body;
use bytes::Bytes;
use futures_util::StreamExt;
use http::{HeaderValue, Response, StatusCode, header};
use serde::{Deserialize, Serialize};
use serde_json::{Value, value::RawValue};

/// A JSON-RPC response, as read: only what the door looks at, the rest
/// kept as sent.
#[derive(Deserialize)]
struct Message<'a> {
    #[serde(borrow, default)]
    id: Option<&'a RawValue>,
    #[serde(borrow, default)]
    result: Option<&'a RawValue>,
    #[serde(borrow, default)]
    error: Option<&'a RawValue>,
}

/// A JSON-RPC response, as the door writes it.
#[derive(Serialize)]
struct Written<'a> {
    jsonrpc: &'static str,
    id: &'a RawValue,
    #[serde(skip_serializing_if = "Option::is_none")]
    result: Option<&'a RawValue>,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<&'a RawValue>,
}

/// The final response of a call: its result or its error, as the server
/// wrote it.
#[derive(Debug)]
pub(crate) enum Final {
    Result(Box<RawValue>),
    Error(Box<RawValue>),
}

impl Final {
    /// Whether the answer is the tool's, to keep and replay: a tool result
    /// (an `isError` one too — a declined card is an answer), never a
    /// JSON-RPC error nor an interim `input_required` result, which asks the
    /// client for more before the call can finish.
    pub(crate) fn is_outcome(&self) -> bool {
        #[derive(Deserialize)]
        struct Kind<'a> {
            #[serde(rename = "resultType", borrow, default)]
            result_type: Option<&'a str>,
        }
        match self {
            Self::Error(_) => false,
            Self::Result(result) => serde_json::from_str::<Kind<'_>>(result.get())
                .map_or(true, |kind| kind.result_type != Some("input_required")),
        }
    }

    /// The response to the request whose id is `id`.
    pub(crate) fn written(&self, id: &RawValue) -> Bytes {
        let (result, error) = match self {
            Self::Result(result) => (Some(&**result), None),
            Self::Error(error) => (None, Some(&**error)),
        };
        written(id, result, error)
    }
}

fn written(id: &RawValue, result: Option<&RawValue>, error: Option<&RawValue>) -> Bytes {
    let message = Written {
        jsonrpc: "2.0",
        id,
        result,
        error,
    };
    serde_json::to_vec(&message)
        .expect("a message of JSON values serialises")
        .into()
}

/// The final response to the request whose id is `id`, in an answer of
/// `content_type`: a JSON body, or the response with that id in an SSE
/// stream (progress notifications and the server's other messages are not
/// it). `None` when there is none.
pub(crate) async fn final_response<B>(
    content_type: Option<&HeaderValue>,
    body: B,
    id: &RawValue,
) -> Result<Option<Final>, ()>
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<axum_core::BoxError>,
{
    let content_type = content_type.and_then(|v| v.to_str().ok()).unwrap_or("");
    let essence = content_type.split(';').next().unwrap_or("").trim();
    if essence.eq_ignore_ascii_case("application/json") {
        let bytes = http_body_util::BodyExt::collect(body)
            .await
            .map_err(|_| ())?
            .to_bytes();
        return Ok(answering(&bytes, id));
    }
    if essence.eq_ignore_ascii_case("text/event-stream") {
        // The stream may stay open after the response (keep-alives): the
        // first response to the call is its last.
        let mut events = std::pin::pin!(sse_stream::SseStream::new(Body::new(body)));
        while let Some(event) = events.next().await {
            let event = event.map_err(|_| ())?;
            if let Some(data) = event.data
                && let Some(found) = answering(data.as_bytes(), id)
            {
                return Ok(Some(found));
            }
        }
        return Ok(None);
    }
    Ok(None)
}

/// The message in `bytes`, if it is the response to `id`.
fn answering(bytes: &[u8], id: &RawValue) -> Option<Final> {
    let message: Message<'_> = serde_json::from_slice(bytes).ok()?;
    if !same_id(message.id?, id) {
        return None;
    }
    match (message.result, message.error) {
        (Some(result), None) => Some(Final::Result(result.to_owned())),
        (None, Some(error)) => Some(Final::Error(error.to_owned())),
        _ => None,
    }
}

/// Two ids are the same JSON value, whatever their spelling.
fn same_id(a: &RawValue, b: &RawValue) -> bool {
    a.get() == b.get()
        || serde_json::from_str::<Value>(a.get()).ok()
            == serde_json::from_str::<Value>(b.get()).ok()
}

/// A stored response written again for a retry's `id`: byte for byte the
/// stored one but for the id. `None` if the stored bytes are not a response.
pub(crate) fn for_retry(stored: &[u8], id: &RawValue) -> Option<Bytes> {
    let message: Message<'_> = serde_json::from_slice(stored).ok()?;
    match (message.result, message.error) {
        (None, None) => None,
        (result, error) => Some(written(id, result, error)),
    }
}

/// An `application/json` response of `body`.
pub(crate) fn json(status: StatusCode, body: Bytes) -> Response<Body> {
    let mut response = Response::new(Body::from(body));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

/// A JSON-RPC error the door answers itself.
#[derive(Debug)]
pub(crate) struct Refusal {
    /// The HTTP status: `200` for an answer to the call, `4xx` where the
    /// transport itself refuses (a body that is not JSON, headers that
    /// disagree with it).
    pub(crate) status: StatusCode,
    pub(crate) code: i32,
    pub(crate) message: String,
    pub(crate) retry_after: Option<Duration>,
}

impl Refusal {
    pub(crate) fn new(code: i32, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::OK,
            code,
            message: message.into(),
            retry_after: None,
        }
    }

    pub(crate) fn status(mut self, status: StatusCode) -> Self {
        self.status = status;
        self
    }

    pub(crate) fn retry_after(mut self, after: Duration) -> Self {
        self.retry_after = Some(after);
        self
    }

    /// The refusal as a JSON-RPC error response to `id` (`null` when the
    /// request's id could not be read). A retry hint travels as
    /// `data.retryAfterMs` and as `Retry-After`.
    pub(crate) fn into_response(self, id: Option<&RawValue>) -> Response<Body> {
        #[derive(Serialize)]
        struct Error<'a> {
            code: i32,
            message: &'a str,
            #[serde(skip_serializing_if = "Option::is_none")]
            data: Option<Data>,
        }
        #[derive(Serialize)]
        struct Data {
            #[serde(rename = "retryAfterMs")]
            retry_after_ms: u64,
        }
        let error = Error {
            code: self.code,
            message: &self.message,
            data: self.retry_after.map(|after| Data {
                retry_after_ms: u64::try_from(after.as_millis()).unwrap_or(u64::MAX),
            }),
        };
        let error = serde_json::value::to_raw_value(&error).expect("an error object serialises");
        let null = RawValue::NULL;
        let mut response = json(self.status, written(id.unwrap_or(null), None, Some(&error)));
        if let Some(after) = self.retry_after {
            // Whole seconds, rounded up: never sooner than the hint.
            let secs = after.as_millis().div_ceil(1000).max(1);
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs as u64));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use http_body_util::Full;

    use super::*;

    fn raw(json: &str) -> Box<RawValue> {
        RawValue::from_string(json.to_owned()).unwrap()
    }

    #[tokio::test]
    async fn the_final_response_is_read_from_json_or_sse() {
        let id = raw("7");
        let json = HeaderValue::from_static("application/json");
        let body = Full::new(Bytes::from_static(
            br#"{"jsonrpc":"2.0","id":7,"result":{"content":[],"structuredContent":{"n":1}}}"#,
        ));
        let found = final_response(Some(&json), body, &id)
            .await
            .unwrap()
            .unwrap();
        assert!(found.is_outcome());
        assert_eq!(
            &found.written(&raw("\"retry\""))[..],
            br#"{"jsonrpc":"2.0","id":"retry","result":{"content":[],"structuredContent":{"n":1}}}"#
        );

        let sse = HeaderValue::from_static("text/event-stream");
        let stream = "id: 0\nretry: 3000\ndata:\n\n\
            data: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\",\"params\":{\"progress\":1}}\n\n\
            : keep-alive\n\n\
            data: {\"jsonrpc\":\"2.0\",\"id\":7,\"error\":{\"code\":-32602,\"message\":\"bad\"}}\n\n";
        let found = final_response(Some(&sse), Full::new(Bytes::from(stream)), &id)
            .await
            .unwrap()
            .unwrap();
        assert!(matches!(found, Final::Error(_)));
        assert!(!found.is_outcome());

        // Another request's response is not this one's.
        let other = Full::new(Bytes::from_static(
            br#"{"jsonrpc":"2.0","id":8,"result":{}}"#,
        ));
        assert!(
            final_response(Some(&json), other, &id)
                .await
                .unwrap()
                .is_none()
        );
        let html = HeaderValue::from_static("text/html");
        let page = Full::new(Bytes::from_static(b"<html>"));
        assert!(
            final_response(Some(&html), page, &id)
                .await
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn interim_results_are_not_outcomes() {
        assert!(
            !Final::Result(raw(r#"{"resultType":"input_required","inputRequests":{}}"#))
                .is_outcome()
        );
        assert!(Final::Result(raw(r#"{"resultType":"complete","content":[]}"#)).is_outcome());
        assert!(Final::Result(raw(r#"{"isError":true,"content":[]}"#)).is_outcome());
    }

    #[test]
    fn a_replay_differs_only_in_its_id() {
        let stored =
            br#"{"jsonrpc":"2.0","id":1,"result":{"amount":12345678901234567890123,"x":1.10}}"#;
        assert_eq!(
            &for_retry(stored, &raw("2")).unwrap()[..],
            br#"{"jsonrpc":"2.0","id":2,"result":{"amount":12345678901234567890123,"x":1.10}}"#
        );
        assert!(for_retry(b"{}", &raw("2")).is_none());
    }

    #[tokio::test]
    async fn a_refusal_is_a_json_rpc_error_with_the_request_id() {
        let response = Refusal::new(-32010, "in flight")
            .retry_after(Duration::from_millis(1500))
            .into_response(Some(&raw("\"a\"")));
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(response.headers()[header::RETRY_AFTER], "2");
        let body = http_body_util::BodyExt::collect(response.into_body())
            .await
            .unwrap()
            .to_bytes();
        assert_eq!(
            &body[..],
            br#"{"jsonrpc":"2.0","id":"a","error":{"code":-32010,"message":"in flight","data":{"retryAfterMs":1500}}}"#
        );
    }
}
