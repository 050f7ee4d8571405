//! RFC 9457 problem details: the shape of every answer the layer gives
//! itself, exported so an application can answer the same way.

use std::borrow::Cow;

use axum_core::{
    body::Body,
    response::{IntoResponse, Response},
};
use http::{HeaderValue, StatusCode, header};

/// An RFC 9457 `application/problem+json` response: `type`, `title`,
/// `status` and `detail`, in that order.
///
/// # Examples
///
/// ```
/// use axum::response::IntoResponse;
/// use http::StatusCode;
/// use tower_idempotency::Problem;
///
/// let response = Problem::new(StatusCode::BAD_REQUEST, "Invalid charge")
///     .detail("`amount` must be a positive integer.")
///     .into_response();
/// assert_eq!(response.status(), StatusCode::BAD_REQUEST);
/// assert_eq!(response.headers()["content-type"], "application/problem+json");
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    status: StatusCode,
    problem_type: Cow<'static, str>,
    title: Cow<'static, str>,
    detail: Cow<'static, str>,
}

impl Problem {
    /// A problem with this status and title, of type `about:blank` and with
    /// an empty detail.
    pub fn new(status: StatusCode, title: impl Into<Cow<'static, str>>) -> Self {
        Self {
            status,
            problem_type: "about:blank".into(),
            title: title.into(),
            detail: "".into(),
        }
    }

    /// A URI naming the problem type (default `about:blank`).
    pub fn problem_type(mut self, uri: impl Into<Cow<'static, str>>) -> Self {
        self.problem_type = uri.into();
        self
    }

    /// An explanation of this occurrence.
    pub fn detail(mut self, detail: impl Into<Cow<'static, str>>) -> Self {
        self.detail = detail.into();
        self
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let string = |s: &str| serde_json::Value::from(s).to_string();
        let body = format!(
            r#"{{"type":{},"title":{},"status":{},"detail":{}}}"#,
            string(&self.problem_type),
            string(&self.title),
            self.status.as_u16(),
            string(&self.detail),
        );
        let mut response = Response::new(Body::from(body));
        *response.status_mut() = self.status;
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        response
    }
}
