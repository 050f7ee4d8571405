//! The `payments` example's own tests, which live beside its `app()` in
//! `payments/app.rs`.

// Start-up code the example's `main` uses is dead here.
#[allow(dead_code)]
#[path = "../payments/admin.rs"]
mod admin;
#[allow(dead_code)]
#[path = "../payments/app.rs"]
mod app;
#[allow(dead_code)]
#[cfg(feature = "dynamodb")]
#[path = "../payments/dynamo.rs"]
mod dynamo;
#[allow(dead_code)]
#[path = "../payments/ledger.rs"]
mod ledger;
#[path = "../payments/openapi.rs"]
mod openapi;
