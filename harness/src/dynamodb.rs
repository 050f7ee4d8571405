//! A DynamoDB-compatible server for the tests: `dynoxide serve` (an
//! emulator on SQLite, whose conformance suite runs against real DynamoDB)
//! on a free loopback port, in memory, stopped on drop; a table of the
//! test's own per test. The store is reached through the AWS SDK over HTTP,
//! as it reaches DynamoDB.
//!
//! dynoxide runs one writer at a time: it proves the protocol's semantics
//! (conditions, transactions, their cancellation reasons), not behaviour
//! under DynamoDB's own contention.

use std::{
    net::TcpStream,
    process::{Child, Command, Stdio},
    sync::atomic::{AtomicUsize, Ordering},
    time::{Duration, Instant},
};

use aws_sdk_dynamodb::{Client, config::Credentials};

use crate::redis_server::free_port;

const INSTALL_HINT: &str = "dynoxide was not found on PATH. The DynamoDB tests need a \
DynamoDB-compatible server: `cargo install dynoxide-rs --locked --no-default-features \
--features native-sqlite,http-server,cli` (scripts/services does), then run the tests again.";

/// One `dynoxide serve` process, in memory.
pub struct DynamoServer {
    port: u16,
    child: Child,
}

impl DynamoServer {
    pub fn start() -> Self {
        for _ in 0..5 {
            let port = free_port();
            let child = Command::new("dynoxide")
                .args(["serve", "--port", &port.to_string(), "--log", "quiet"])
                .stdout(Stdio::null())
                .stderr(Stdio::inherit())
                .spawn()
                .unwrap_or_else(|e| panic!("{INSTALL_HINT} ({e})"));
            let mut server = Self { port, child };
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline {
                if TcpStream::connect(("127.0.0.1", port)).is_ok() {
                    return server;
                }
                if server.child.try_wait().ok().flatten().is_some() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = server.child.kill();
        }
        panic!("could not start dynoxide on a free port in 5 attempts");
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// A client of this server (static test credentials, one region).
    pub fn client(&self) -> Client {
        client_of(&self.endpoint())
    }

    /// The AWS environment a process uses to reach this server.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("AWS_ENDPOINT_URL", self.endpoint()),
            ("AWS_ACCESS_KEY_ID", "test".into()),
            ("AWS_SECRET_ACCESS_KEY", "test".into()),
            ("AWS_REGION", "us-east-1".into()),
        ]
    }

    /// Stops the server at once (`kill -9`): a store that loses it mid-call.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for DynamoServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A client of the DynamoDB-compatible server at `endpoint`.
pub fn client_of(endpoint: &str) -> Client {
    let config = aws_sdk_dynamodb::Config::builder()
        .behavior_version_latest()
        .endpoint_url(endpoint)
        .region(aws_sdk_dynamodb::config::Region::new("us-east-1"))
        .credentials_provider(Credentials::new("test", "test", None, None, "tests"))
        .build();
    Client::from_conf(config)
}

/// A table name of the test's own.
pub fn table_name() -> String {
    static SEQ: AtomicUsize = AtomicUsize::new(0);
    format!(
        "idempotency_{}_{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    )
}
