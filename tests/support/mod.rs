//! Test support shared by the integration tests. Not every test file uses
//! every helper.
#![allow(dead_code)]

pub mod amqp;
pub mod app;
pub mod backend;
pub mod cluster;
pub mod consumer;
pub mod http;
pub mod logs;
pub mod payments;
pub mod postgres;
pub mod redis_server;
pub mod relay;
pub mod sqlite;
pub mod suite;
