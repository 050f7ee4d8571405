//! The HTTP door: a tower layer that runs each keyed request through the
//! protocol.

pub(crate) mod buffer;
pub(crate) mod encoding;
pub(crate) mod future;
pub(crate) mod grpc;
pub(crate) mod handler;
pub(crate) mod key_source;
pub(crate) mod keyed;
pub(crate) mod layer;
pub(crate) mod observe;
#[cfg(feature = "openapi")]
pub mod openapi;
pub(crate) mod opt_out;
pub(crate) mod outcome;
pub(crate) mod problem;
pub(crate) mod rejection;
pub(crate) mod replay;
pub(crate) mod scope;
pub(crate) mod service;
pub(crate) mod shared;
pub(crate) mod store_policy;
pub(crate) mod transaction;

use axum_core::{BoxError, body::Body};
use bytes::Bytes;
use http::{Request, Response};
use tower_service::Service;

/// The inner service of a keyed request, as the door needs it: an HTTP
/// service whose work can finish on another task once the client has hung
/// up. Written once here, for the functions below the service.
pub(crate) trait Inner:
    Service<
        Request<Body>,
        Response = Response<Self::ResBody>,
        Future: Send + 'static,
        Error: Send + 'static,
    > + Send
    + 'static
{
    /// The handler's response body.
    type ResBody: http_body::Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static;
}

impl<S, B> Inner for S
where
    S: Service<Request<Body>, Response = Response<B>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type ResBody = B;
}
