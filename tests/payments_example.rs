//! The `payments` example's own tests, which live beside its `app()` in
//! `examples/payments/app.rs`.

// Start-up code the example's `main` uses is dead here.
#[allow(dead_code)]
#[path = "../examples/payments/admin.rs"]
mod admin;
#[allow(dead_code)]
#[path = "../examples/payments/app.rs"]
mod app;
#[allow(dead_code)]
#[path = "../examples/payments/ledger.rs"]
mod ledger;
