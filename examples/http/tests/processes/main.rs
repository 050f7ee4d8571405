//! The `payments` example deployed as processes on each store: killed with
//! `SIGKILL` mid-charge, paused with `SIGSTOP`, on a full disk, several on
//! one database, started with a mistake in its configuration — counting
//! charges, never trusting a reply alone.

#[path = "../support/mod.rs"]
mod support;

#[cfg(feature = "dynamodb")]
mod dynamodb;
mod mysql;
mod openapi;
mod postgres;
mod redis;
mod safety;
mod sqlite;
