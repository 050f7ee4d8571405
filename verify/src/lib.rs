//! A randomized fault-injection soak for tower-idempotency, with a history
//! checker — evidence in the manner of Jepsen: random faults at random
//! moments, every attempt recorded, and a checker that decides per key,
//! from the history and the effects alone, whether anything was executed
//! twice, lost, answered inconsistently, executed under a reused key,
//! answered with another tenant's charge, or left stuck.
//!
//! `cargo run --release -p tower-idempotency-verify -- --help` says how to
//! run it; `RELIABILITY.md` has the latest long runs.

pub mod chain;
pub mod checker;
pub mod deploy;
pub mod history;
pub mod nemesis;
pub mod plot;
pub mod run;
pub mod workload;
