//! An SQS-compatible server (moto's `moto_server`) on a free loopback
//! port, stopped on drop, and queues made on it for one test each.

use std::{
    collections::HashMap,
    net::TcpStream,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use aws_sdk_sqs::{
    Client,
    config::{BehaviorVersion, Credentials, Region},
    types::{MessageSystemAttributeName, QueueAttributeName},
};

use tower_idempotency_harness::redis_server::free_port;

const INSTALL_HINT: &str = "moto_server was not found on PATH. The SQS tests need an SQS-compatible server: \
install moto's server mode (`pip install 'moto[server]'`), or point SQS_TEST_ENDPOINT at any server speaking the SQS protocol, and run the tests again.";

/// The region and credentials the tests and the example use against it.
pub const REGION: &str = "us-east-1";

/// A running `moto_server`, or the server `SQS_TEST_ENDPOINT` names.
pub struct SqsServer {
    endpoint: String,
    child: Option<Child>,
}

impl SqsServer {
    /// Starts `moto_server` on a free port (or uses `SQS_TEST_ENDPOINT`) and
    /// waits until it accepts connections.
    pub fn start() -> Self {
        if let Ok(endpoint) = std::env::var("SQS_TEST_ENDPOINT") {
            return Self {
                endpoint,
                child: None,
            };
        }
        let port = free_port();
        let child = Command::new("moto_server")
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("{INSTALL_HINT} ({e})"));
        let server = Self {
            endpoint: format!("http://127.0.0.1:{port}"),
            child: Some(child),
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "moto_server did not listen on {port} within 30 s"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        server
    }

    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The environment an SQS process needs to reach this server.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("AWS_ENDPOINT_URL", self.endpoint.clone()),
            ("AWS_REGION", REGION.into()),
            ("AWS_ACCESS_KEY_ID", "test".into()),
            ("AWS_SECRET_ACCESS_KEY", "test".into()),
        ]
    }

    pub fn client(&self) -> Client {
        let config = aws_sdk_sqs::Config::builder()
            .behavior_version(BehaviorVersion::latest())
            .region(Region::new(REGION))
            .endpoint_url(&self.endpoint)
            .credentials_provider(Credentials::new("test", "test", None, None, "tests"))
            .build();
        Client::from_conf(config)
    }

    /// Kills the server (SIGKILL): every queue on it is gone.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for SqsServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A queue of its own for one test, with a dead-letter queue its
/// `RedrivePolicy` names (unless made `without_dead_letters`).
pub struct TestQueue {
    pub client: Client,
    pub url: String,
    pub dead_letters: Option<String>,
    pub fifo: bool,
}

static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

impl TestQueue {
    /// A standard queue with the given visibility timeout and a
    /// dead-letter queue.
    pub async fn create(server: &SqsServer, visibility_s: u32) -> Self {
        Self::make(server, visibility_s, false, Some(1000)).await
    }

    /// A standard queue whose `RedrivePolicy` moves a message to the
    /// dead-letter queue after `max_receives` receives: a small delivery
    /// budget.
    pub async fn with_max_receives(
        server: &SqsServer,
        visibility_s: u32,
        max_receives: u32,
    ) -> Self {
        Self::make(server, visibility_s, false, Some(max_receives)).await
    }

    /// A FIFO queue (`.fifo`), content-based deduplication off.
    pub async fn create_fifo(server: &SqsServer, visibility_s: u32) -> Self {
        Self::make(server, visibility_s, true, Some(1000)).await
    }

    /// A standard queue without a dead-letter queue.
    pub async fn without_dead_letters(server: &SqsServer, visibility_s: u32) -> Self {
        Self::make(server, visibility_s, false, None).await
    }

    async fn make(server: &SqsServer, visibility_s: u32, fifo: bool, dlq: Option<u32>) -> Self {
        let client = server.client();
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let suffix = if fifo { ".fifo" } else { "" };
        let name = format!("orders-{}-{n}", std::process::id());
        let fifo_attrs = |mut attrs: HashMap<QueueAttributeName, String>| {
            if fifo {
                attrs.insert(QueueAttributeName::FifoQueue, "true".into());
            }
            attrs
        };
        let dead_letters = if dlq.is_some() {
            let url = client
                .create_queue()
                .queue_name(format!("{name}-dead{suffix}"))
                .set_attributes(Some(fifo_attrs(HashMap::new())))
                .send()
                .await
                .expect("create the dead-letter queue")
                .queue_url
                .unwrap();
            Some(url)
        } else {
            None
        };
        let mut attrs = fifo_attrs(HashMap::from([(
            QueueAttributeName::VisibilityTimeout,
            visibility_s.to_string(),
        )]));
        if let (Some(dead), Some(max_receives)) = (&dead_letters, dlq) {
            let arn = client
                .get_queue_attributes()
                .queue_url(dead)
                .attribute_names(QueueAttributeName::QueueArn)
                .send()
                .await
                .expect("the dead-letter queue's ARN")
                .attributes
                .unwrap()
                .remove(&QueueAttributeName::QueueArn)
                .unwrap();
            let policy = serde_json::json!({"deadLetterTargetArn": arn, "maxReceiveCount": max_receives.to_string()});
            attrs.insert(QueueAttributeName::RedrivePolicy, policy.to_string());
        }
        let url = client
            .create_queue()
            .queue_name(format!("{name}{suffix}"))
            .set_attributes(Some(attrs))
            .send()
            .await
            .expect("create the test queue")
            .queue_url
            .unwrap();
        Self {
            client,
            url,
            dead_letters,
            fifo,
        }
    }

    /// Sends one message (on a FIFO queue, in `group`, deduplicated by
    /// `dedup`: a new id per send unless given).
    pub async fn send(&self, body: &str) {
        self.send_in(body, "orders", None).await
    }

    pub async fn send_in(&self, body: &str, group: &str, dedup: Option<&str>) {
        let mut send = self
            .client
            .send_message()
            .queue_url(&self.url)
            .message_body(body);
        if self.fifo {
            let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            send = send
                .message_group_id(group)
                .message_deduplication_id(dedup.map_or_else(|| format!("send-{n}"), str::to_owned));
        }
        send.send().await.expect("send a message");
    }

    /// Messages in the queue: visible plus in flight (received, not
    /// deleted) plus delayed.
    pub async fn depth(&self) -> u64 {
        depth(&self.client, &self.url).await
    }

    /// Messages in the dead-letter queue (visible, in flight or delayed).
    pub async fn dead_depth(&self) -> u64 {
        match &self.dead_letters {
            Some(dead) => depth(&self.client, dead).await,
            None => 0,
        }
    }

    /// The dead-letter queue's bodies, received (and left there).
    pub async fn dead_lettered(&self) -> Vec<String> {
        self.dead_letters_with_reasons()
            .await
            .into_iter()
            .map(|dead| dead.body)
            .collect()
    }

    /// The dead-letter queue's messages, each with its attributes (none of
    /// the contract's when SQS moved it itself), received (and left there).
    pub async fn dead_letters_with_reasons(&self) -> Vec<super::DeadLetter> {
        let Some(dead) = &self.dead_letters else {
            return Vec::new();
        };
        let mut bodies = Vec::new();
        loop {
            let got = self
                .client
                .receive_message()
                .queue_url(dead)
                .max_number_of_messages(10)
                .visibility_timeout(60)
                .message_system_attribute_names(MessageSystemAttributeName::All)
                .message_attribute_names("All")
                .send()
                .await
                .expect("receive from the dead-letter queue");
            let messages = got.messages.unwrap_or_default();
            if messages.is_empty() {
                return bodies;
            }
            bodies.extend(messages.into_iter().map(|m| {
                super::DeadLetter {
                    headers: m
                        .message_attributes
                        .unwrap_or_default()
                        .into_iter()
                        .filter_map(|(name, value)| Some((name, value.string_value?)))
                        .collect(),
                    body: m.body.unwrap_or_default(),
                    style: tower_idempotency::message::HeaderStyle::Sqs,
                }
            }));
        }
    }

    /// Waits (up to 30 s) until the queue holds no message at all.
    pub async fn drained(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let n = self.depth().await;
            if n == 0 {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{} still holds {n} messages",
                self.url
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    pub async fn delete(&self) {
        let _ = self.client.delete_queue().queue_url(&self.url).send().await;
    }
}

async fn depth(client: &Client, url: &str) -> u64 {
    let attrs = client
        .get_queue_attributes()
        .queue_url(url)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessages)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesNotVisible)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesDelayed)
        .send()
        .await
        .expect("the queue's attributes")
        .attributes
        .unwrap_or_default();
    attrs.values().map(|v| v.parse::<u64>().unwrap_or(0)).sum()
}
