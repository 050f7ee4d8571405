//! Requests in process (`oneshot`) and over real HTTP on loopback.

use std::{net::SocketAddr, time::Duration};

use axum::{Router, body::Body};
use bytes::Bytes;
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use tower::ServiceExt;
use tower_idempotency::IdempotencyOutcome;

/// A response, read whole.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
    /// Only for in-process requests.
    pub outcome: Option<IdempotencyOutcome>,
}

impl Reply {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", self.body))
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.to_str().unwrap())
    }

    pub fn header_all(&self, name: &str) -> Vec<&str> {
        self.headers
            .get_all(name)
            .iter()
            .map(|v| v.to_str().unwrap())
            .collect()
    }

    pub fn is_replay(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }

    /// Asserts an RFC 9457 problem with this status.
    pub fn assert_problem(&self, status: u16) {
        assert_eq!(self.status.as_u16(), status, "body: {:?}", self.body);
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json")
        );
        let p = self.json();
        assert_eq!(p["status"], status);
        for member in ["type", "title", "detail"] {
            assert!(
                p[member].as_str().is_some_and(|s| !s.is_empty()),
                "problem lacks {member}: {p}"
            );
        }
    }
}

/// Builds a request: method, path, optional key, JSON body.
pub fn request(method: Method, path: &str, key: Option<&str>, body: &str) -> Request<Body> {
    let mut builder = Request::builder()
        .method(method)
        .uri(path)
        .header("content-type", "application/json");
    if let Some(key) = key {
        builder = builder.header("idempotency-key", key);
    }
    builder.body(Body::from(body.to_owned())).unwrap()
}

pub fn post(path: &str, key: &str, body: &str) -> Request<Body> {
    request(Method::POST, path, Some(key), body)
}

/// Sends through the router in process.
pub async fn oneshot(app: &Router, req: Request<Body>) -> Reply {
    let response = app.clone().oneshot(req).await.unwrap();
    let outcome = response.extensions().get::<IdempotencyOutcome>().cloned();
    let (parts, body) = response.into_parts();
    Reply {
        status: parts.status,
        headers: parts.headers,
        body: body.collect().await.unwrap().to_bytes(),
        outcome,
    }
}

/// A real server on 127.0.0.1:0, stopped on drop, with a real client.
pub struct Server {
    pub addr: SocketAddr,
    pub client: HttpClient,
    task: tokio::task::JoinHandle<()>,
}

impl Server {
    pub async fn start(app: Router) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        Self {
            addr,
            client: HttpClient::default(),
            task,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// `post(path, key, body)` over HTTP.
    pub async fn post(&self, path: &str, key: &str, body: &str) -> Reply {
        let mut req = post(path, key, body);
        *req.uri_mut() = self.url(path).parse().unwrap();
        self.client.send(req).await
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A real HTTP/1.1 client.
#[derive(Clone)]
pub struct HttpClient(Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>);

impl Default for HttpClient {
    fn default() -> Self {
        Self(Client::builder(TokioExecutor::new()).build_http())
    }
}

impl HttpClient {
    pub async fn send(&self, req: Request<Body>) -> Reply {
        let (parts, body) = req.into_parts();
        let body = body.collect().await.unwrap().to_bytes();
        let req = Request::from_parts(parts, Full::new(body));
        let response = tokio::time::timeout(Duration::from_secs(30), self.0.request(req))
            .await
            .expect("HTTP request timed out")
            .expect("HTTP request failed");
        let (parts, body) = response.into_parts();
        Reply {
            status: parts.status,
            headers: parts.headers,
            body: body.collect().await.unwrap().to_bytes(),
            outcome: None,
        }
    }
}
