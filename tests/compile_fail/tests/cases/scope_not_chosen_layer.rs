// The layer applied by hand (`Layer::layer`, as a `Service` is built for
// tests or for a framework without `route_layer`) is told the same fix:
// the compiler asks for `scope_with` or `single_tenant`, never only that
// some trait bounds were not satisfied.
use tower_idempotency::{IdempotencyLayer, MemoryStore};

fn main() {
    let inner = tower::service_fn(|_: http::Request<axum::body::Body>| async {
        Ok::<_, std::convert::Infallible>(http::Response::new(axum::body::Body::empty()))
    });
    let service = IdempotencyLayer::new(MemoryStore::new()).layer(inner);
    let _ = service;
}
