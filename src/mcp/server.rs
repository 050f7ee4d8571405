//! The MCP server as the protocol's handler: its answer to a guarded call
//! read down to the call's final response, which is what the protocol
//! stores — or, where it must not be stored, sent marked so.

use std::{
    future::Future,
    pin::Pin,
    task::{Context, Poll},
};

use axum_core::{BoxError, body::Body};
use bytes::Bytes;
use http::{Request, Response, StatusCode, header::CONTENT_TYPE};
use serde_json::value::RawValue;
use tower_service::Service;

use super::{
    answer::{self, Refusal},
    codes,
};
use crate::http::opt_out::NoReplay;

/// The JSON-RPC id of the call a request carries, for the server's answer
/// to be matched with.
#[derive(Clone, Debug)]
pub(crate) struct CallId(pub(crate) Box<RawValue>);

/// The MCP server, answering each guarded call with its final response as
/// `application/json`.
#[derive(Clone, Debug)]
pub(crate) struct FinalResponse<S>(pub(crate) S);

impl<S, B> Service<Request<Body>> for FinalResponse<S>
where
    S: Service<Request<Body>, Response = Response<B>>,
    S::Future: Send + 'static,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Response = Response<Body>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        let id = request.extensions().get::<CallId>().cloned();
        let answered = self.0.call(request);
        Box::pin(async move {
            let response = answered.await?;
            Ok(match id {
                Some(CallId(id)) => final_response(response, &id).await,
                // Not a call the door read: nothing to match, nothing kept.
                None => not_kept(response.map(Body::new)),
            })
        })
    }
}

/// The server's answer to the call `id`, read down to its final response.
async fn final_response<B>(response: Response<B>, id: &RawValue) -> Response<Body>
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    // Anything but 200 is the transport refusing the request (a protocol
    // version, a header, the size), never the tool's answer.
    if response.status() != StatusCode::OK {
        return not_kept(response.map(Body::new));
    }
    let (parts, body) = response.into_parts();
    let read = answer::final_response(parts.headers.get(CONTENT_TYPE), body, id).await;
    let found = match read {
        Ok(Some(found)) => found,
        Ok(None) => {
            return not_kept(
                Refusal::new(
                    codes::INTERNAL_ERROR,
                    "the MCP server's answer ended without a response to this call",
                )
                .into_response(Some(id)),
            );
        }
        Err(()) => {
            return not_kept(
                Refusal::new(
                    codes::INTERNAL_ERROR,
                    "the MCP server's answer failed while it was read",
                )
                .into_response(Some(id)),
            );
        }
    };
    let response = answer::json(StatusCode::OK, found.written(id));
    if found.is_outcome() {
        response
    } else {
        not_kept(response)
    }
}

/// Sent, never stored: the key is released and a transactional store rolls
/// the tool's writes back.
fn not_kept(mut response: Response<Body>) -> Response<Body> {
    response.extensions_mut().insert(NoReplay::rolling_back());
    response
}
