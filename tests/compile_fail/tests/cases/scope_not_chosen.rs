// A layer whose scope was never chosen cannot guard a route: the compiler
// asks for `scope_with` or `single_tenant`.
use axum::{Router, routing::post};
use tower_idempotency::{IdempotencyLayer, MemoryStore};

fn main() {
    let app: Router = Router::new()
        .route("/v1/charges", post(|| async { "charged" }))
        .route_layer(IdempotencyLayer::new(MemoryStore::new()));
    let _ = app;
}
