//! The consumer chains: a producer sends orders to a broker — some twice,
//! some invalid, some reusing an order id with another amount — while M
//! consumer processes charge them into PostgreSQL behind a relay and the
//! nemesis kills (-9), pauses and cuts them. `sqs-chain`: `sqs_orders` on
//! moto's SQS, on a queue whose receive budget (`maxReceiveCount` 3) a
//! consumer that spent deliveries on faults would exhaust, consumers also
//! stopped by SIGTERM and started again. `kafka-chain`: `kafka_orders` on a
//! private tansu, three partitions, pauses longer than the session timeout
//! (a zombie whose partitions move on), consumers also stopped by SIGTERM and
//! started again beside the rest of their group. At the end: every valid order charged exactly
//! once, every message that can never succeed dead-lettered with a reason
//! that is true, nothing left undecided.

use std::{
    collections::HashMap,
    io::{BufRead, BufReader},
    path::PathBuf,
    process::{Child, Command, Stdio},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use tower_idempotency::sqlx;
use tower_idempotency_harness::{postgres::TestDatabase, relay::Relay};

use crate::{
    checker::{Report, Violation},
    history::{Event, FaultWindow, Recorder},
};

#[path = "../../examples/consumers/tests/support/sqs.rs"]
#[allow(dead_code)]
mod sqs;

// What the brokers' supports read dead letters back as.
#[path = "../../examples/consumers/tests/support/dead_letter.rs"]
#[allow(dead_code)]
mod dead_letter;
use dead_letter::DeadLetter;

#[path = "../../examples/consumers/tests/support/kafka.rs"]
#[allow(dead_code)]
mod kafka;

use kafka::{KafkaServer, TestTopic};
use sqs::{SqsServer, TestQueue};
use tower_idempotency_kafka::rdkafka::producer::{FutureProducer, FutureRecord};

/// A broker the chain runs on: its server and destination of the chain's
/// own, the consumer example that drains it, and what it holds at the end.
pub trait Line: Sized {
    /// The family's name (`sqs-chain`).
    const NAME: &'static str;
    /// The consumer example.
    const EXAMPLE: &'static str;
    /// How long a pause must last to outlive the consumer's hold on what
    /// it has in hand (a visibility timeout, a session timeout).
    const HOLD: Duration;
    /// Partitions a consumer group shares, whose rebalance the nemesis
    /// lets finish — every partition fetched again — after each change of
    /// the group's members (a start, a kill, a SIGTERM, a zombie's wake)
    /// before the next; `None` where nothing is shared.
    const SETTLES: Option<usize> = None;

    fn start() -> impl Future<Output = Self>;
    /// The consumer's environment, besides its database.
    fn env(&self) -> Vec<(String, String)>;
    /// A handle the producer sends with.
    fn sender(&self) -> Sender;
    /// Messages not settled yet.
    fn left(&self, db: &TestDatabase) -> impl Future<Output = u64>;
    /// The dead letters: each body with its kind.
    fn dead_letters(&self) -> impl Future<Output = Vec<(String, Option<String>)>>;
    /// Writes what the broker holds at the end into `out`, where the
    /// broker keeps it (a log), to trace a failing seed.
    fn dump(&self, _out: &std::path::Path) {}
    /// Whether the nemesis resets the broker's log ([`reset`](Self::reset)).
    const RESETS: bool = false;
    /// The broker restarted with its log lost, the destination created
    /// again (a topic deleted and created, a move to a new cluster).
    fn reset(&mut self) -> impl Future<Output = ()> {
        async {}
    }
}

/// Sends one message (`key`: its order id, Kafka's record key), as the
/// broker acknowledges it.
#[derive(Clone)]
pub enum Sender {
    Sqs(aws_sdk_sqs::Client, String),
    /// The producer is replaced when the broker restarts empty.
    Kafka(Arc<Mutex<FutureProducer>>, String),
}

impl Sender {
    async fn send(&self, key: &str, body: String) -> bool {
        match self {
            Self::Sqs(client, url) => client
                .send_message()
                .queue_url(url)
                .message_body(body)
                .send()
                .await
                .is_ok(),
            Self::Kafka(producer, topic) => {
                let producer = producer.lock().unwrap().clone();
                producer
                    .send(
                        FutureRecord::to(topic).key(key).payload(&body),
                        Duration::from_secs(10),
                    )
                    .await
                    .is_ok()
            }
        }
    }
}

/// SQS (moto): a standard queue, a 3 s visibility timeout, three receives.
pub struct Sqs {
    _server: SqsServer,
    env: Vec<(String, String)>,
    queue: TestQueue,
}

impl Line for Sqs {
    const NAME: &'static str = "sqs-chain";
    const EXAMPLE: &'static str = "sqs_orders";
    const HOLD: Duration = Duration::from_secs(3);

    async fn start() -> Self {
        let server = SqsServer::start();
        let queue = TestQueue::with_max_receives(&server, 3, 3).await;
        let mut env: Vec<(String, String)> = server
            .env()
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v))
            .collect();
        env.push(("SQS_QUEUE_URL".to_owned(), queue.url.clone()));
        Self {
            _server: server,
            env,
            queue,
        }
    }

    fn env(&self) -> Vec<(String, String)> {
        self.env.clone()
    }

    fn sender(&self) -> Sender {
        Sender::Sqs(self.queue.client.clone(), self.queue.url.clone())
    }

    async fn left(&self, _: &TestDatabase) -> u64 {
        self.queue.depth().await
    }

    async fn dead_letters(&self) -> Vec<(String, Option<String>)> {
        self.queue
            .dead_letters_with_reasons()
            .await
            .iter()
            .map(DeadLetter::body_and_kind)
            .collect()
    }
}

/// Kafka (a private tansu): three partitions, a 6 s session timeout.
pub struct Kafka {
    server: KafkaServer,
    topic: TestTopic,
    producer: Arc<Mutex<FutureProducer>>,
}

fn kafka_producer(server: &KafkaServer) -> FutureProducer {
    tower_idempotency_kafka::rdkafka::ClientConfig::new()
        .set("bootstrap.servers", server.brokers())
        .set("enable.idempotence", "true")
        .create()
        .expect("a producer")
}

impl Line for Kafka {
    const NAME: &'static str = "kafka-chain";
    const EXAMPLE: &'static str = "kafka_orders";
    const HOLD: Duration = Duration::from_secs(6);
    /// tansu 0.6's group coordinator can be wedged by members that leave,
    /// join or stop answering while it rebalances: from then on it
    /// assigns nothing, to plain librdkafka consumers as well (see
    /// RELIABILITY.md). The nemesis therefore changes the group only once
    /// it has settled.
    const SETTLES: Option<usize> = Some(3);

    async fn start() -> Self {
        let server = KafkaServer::start();
        let topic = TestTopic::create(&server, 3).await;
        let producer = Arc::new(Mutex::new(kafka_producer(&server)));
        Self {
            server,
            topic,
            producer,
        }
    }

    fn env(&self) -> Vec<(String, String)> {
        vec![
            ("KAFKA_BROKERS".to_owned(), self.server.brokers().to_owned()),
            ("KAFKA_TOPIC".to_owned(), self.topic.name.clone()),
            ("KAFKA_GROUP".to_owned(), "chain".to_owned()),
            ("KAFKA_SESSION_TIMEOUT_MS".to_owned(), "6000".to_owned()),
        ]
    }

    fn sender(&self) -> Sender {
        Sender::Kafka(self.producer.clone(), self.topic.name.clone())
    }

    /// The records past the consumers' stored positions.
    async fn left(&self, db: &TestDatabase) -> u64 {
        let end: i64 = self.topic.ends().values().sum();
        let stored = db
            .count("SELECT coalesce(sum(next_offset), 0)::bigint FROM idempotency_kafka_positions")
            .await;
        end.saturating_sub(stored).max(0) as u64
    }

    async fn dead_letters(&self) -> Vec<(String, Option<String>)> {
        self.topic
            .dead_letters_with_kinds()
            .await
            .iter()
            .map(DeadLetter::body_and_kind)
            .collect()
    }

    const RESETS: bool = true;

    /// tansu restarted on memory storage: every topic, record, group and
    /// producer id gone; the topic created again, a new producer.
    async fn reset(&mut self) {
        self.server.restart_empty();
        self.topic = TestTopic::create_named(&self.server, self.topic.name.clone(), 3).await;
        *self.producer.lock().unwrap() = kafka_producer(&self.server);
    }

    /// `records.txt`: each record's partition, offset and key.
    fn dump(&self, out: &std::path::Path) {
        let records = tokio::task::block_in_place(|| self.topic.read(&self.topic.name));
        let lines: String = records
            .iter()
            .map(|r| {
                format!(
                    "{} {} {}\n",
                    r.partition,
                    r.offset,
                    r.key.as_deref().unwrap_or("-")
                )
            })
            .collect();
        let _ = std::fs::write(out.join("records.txt"), lines);
    }
}

/// What the chain is asked to do.
#[derive(Clone, Debug)]
pub struct Plan {
    pub seed: u64,
    pub duration: Duration,
    pub consumers: usize,
    pub out: PathBuf,
    /// The consumer example's binary ([`Line::EXAMPLE`]).
    pub binary: PathBuf,
}

/// One consumer process.
struct Consumer {
    child: Option<Child>,
    paused: bool,
    /// Its log file.
    log: Option<PathBuf>,
}

struct Chain {
    consumers: Vec<Consumer>,
    env: Vec<(String, String)>,
    binary: PathBuf,
    /// Where each consumer process's log goes (`consumer-<i>-<start>.log`).
    logs: PathBuf,
    started: usize,
}

impl Chain {
    fn spawn(&mut self, i: usize) {
        self.started += 1;
        let log_path = self.logs.join(format!(
            "consumer-{i}-{started}.log",
            started = self.started
        ));
        let log = std::fs::File::create(&log_path).expect("a consumer's log file");
        let mut child = Command::new(&self.binary)
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", self.binary.display()));
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        loop {
            line.clear();
            assert!(
                stdout.read_line(&mut line).unwrap_or(0) > 0,
                "the consumer exited before receiving"
            );
            if line.starts_with("receiving from") {
                break;
            }
        }
        // Its lines (one per delivery), stamped, beside its log.
        let mut out = std::fs::File::create(self.logs.join(format!(
            "consumer-{i}-{started}.out",
            started = self.started
        )))
        .expect("a consumer's output file");
        std::thread::spawn(move || {
            use std::io::Write as _;
            for line in stdout.lines().map_while(Result::ok) {
                let at = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap_or_default()
                    .as_secs_f64();
                let _ = writeln!(out, "{at:.3} {line}");
            }
        });
        self.consumers[i] = Consumer {
            child: Some(child),
            paused: false,
            log: Some(log_path),
        };
    }

    /// SIGTERM, as a supervisor stops it: it finishes what it has in hand
    /// and exits (killed after 60 s, a bound for a loaded machine).
    fn terminate(&mut self, i: usize) {
        if let Some(mut child) = self.consumers[i].child.take() {
            let _ = Command::new("kill")
                .args(["-TERM", &child.id().to_string()])
                .status();
            let deadline = Instant::now() + Duration::from_secs(60);
            while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Waits, at most `within`, for every consumer to exit; the number
    /// that exited with status 2 having said, in their log, that a
    /// partition ends below its stored position.
    async fn stopped_naming_a_reset(&mut self, within: Duration) -> usize {
        let deadline = Instant::now() + within;
        let mut named = 0;
        while Instant::now() < deadline {
            for consumer in &mut self.consumers {
                let exited = consumer
                    .child
                    .as_mut()
                    .and_then(|child| child.try_wait().ok().flatten());
                if let Some(status) = exited {
                    consumer.child = None;
                    let said = consumer.log.as_ref().is_some_and(|log| {
                        std::fs::read_to_string(log)
                            .is_ok_and(|log| log.contains("below the position stored"))
                    });
                    named += usize::from(status.code() == Some(2) && said);
                }
            }
            if self.consumers.iter().all(|c| c.child.is_none()) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        named
    }

    /// How far each consumer log has been written so far.
    fn logged(&self) -> HashMap<PathBuf, u64> {
        std::fs::read_dir(&self.logs)
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("consumer-"))
            .map(|e| (e.path(), e.metadata().map(|m| m.len()).unwrap_or(0)))
            .collect()
    }

    /// Waits, at most a minute, until the consumers' logs since `mark` say
    /// every one of [`Line::SETTLES`] partitions was assigned and fetched.
    async fn settled<L: Line>(&self, mark: &HashMap<PathBuf, u64>) {
        let Some(partitions) = L::SETTLES else {
            return;
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            let mut fetched = std::collections::HashSet::new();
            for path in self.logged().into_keys() {
                let Ok(text) = std::fs::read(&path) else {
                    continue;
                };
                let from = mark.get(&path).copied().unwrap_or(0) as usize;
                let text = String::from_utf8_lossy(text.get(from..).unwrap_or_default());
                fetched.extend(text.lines().filter_map(kafka::fetching).map(str::to_owned));
            }
            if fetched.len() >= partitions {
                return;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    fn kill(&mut self, i: usize) {
        if let Some(mut child) = self.consumers[i].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    fn pause(&mut self, i: usize, paused: bool) {
        if let Some(child) = &self.consumers[i].child {
            let signal = if paused { "-STOP" } else { "-CONT" };
            let _ = Command::new("kill")
                .args([signal, &child.id().to_string()])
                .status();
            self.consumers[i].paused = paused;
        }
    }

    fn heal(&mut self) {
        for i in 0..self.consumers.len() {
            if self.consumers[i].paused {
                self.pause(i, false);
            }
            if self.consumers[i].child.is_none() {
                self.spawn(i);
            }
        }
    }
}

impl Drop for Chain {
    fn drop(&mut self) {
        for i in 0..self.consumers.len() {
            self.pause(i, false);
            self.kill(i);
        }
    }
}

/// What each published message should come to.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Expect {
    /// A valid order: charged once with this amount.
    Charge(i64),
    /// Dead-lettered with this reason.
    DeadLetter(&'static str),
}

/// Runs the chain on `L`; its report, as the HTTP runs'.
pub async fn run<L: Line>(plan: &Plan) -> (Report, Vec<Event>) {
    std::fs::create_dir_all(&plan.out).expect("create the output folder");
    let recorder = Recorder::create(&plan.out.join("history.jsonl")).expect("create the history");
    let mut line = L::start().await;
    let db = TestDatabase::create();
    let relay = Relay::start(&db.host_port()).await;
    let mut env = line.env();
    env.extend([
        ("DATABASE_URL".to_owned(), db.url_via(relay.port())),
        ("WORK_DELAY_MS".to_owned(), "50".to_owned()),
        ("IDEMPOTENCY_TX_TIMEOUT_MS".to_owned(), "5000".to_owned()),
        ("RUST_LOG".to_owned(), "info".to_owned()),
        ("NO_COLOR".to_owned(), "1".to_owned()),
    ]);
    let mut chain = Chain {
        consumers: (0..plan.consumers)
            .map(|_| Consumer {
                child: None,
                paused: false,
                log: None,
            })
            .collect(),
        env,
        binary: plan.binary.clone(),
        logs: plan.out.clone(),
        started: 0,
    };
    for i in 0..plan.consumers {
        chain.spawn(i);
    }
    chain.settled::<L>(&HashMap::new()).await;

    let stop = Arc::new(AtomicBool::new(false));
    let expected: Arc<Mutex<HashMap<String, Vec<Expect>>>> = Arc::default();
    // Held for writing while the broker is reset: no order in flight.
    let gate = Arc::new(tokio::sync::RwLock::new(()));
    let producer = tokio::spawn(produce(
        line.sender(),
        recorder.clone(),
        plan.seed,
        (stop.clone(), gate.clone()),
        expected.clone(),
    ));
    // Dead letters the broker lost in a reset, read before it; restarted
    // consumers that did not stop on it.
    let mut dead_before_reset = Vec::new();
    let mut reset_missed = Vec::new();
    let started = Instant::now();
    let mut rng = fastrand::Rng::with_seed(plan.seed ^ 0x5eed);
    let mut faults = Vec::new();
    tokio::time::sleep(Duration::from_millis(500)).await;
    while started.elapsed() < plan.duration {
        let i = rng.usize(..plan.consumers);
        let hold = Duration::from_millis(rng.u64(500..3000));
        let start = recorder.now();
        let menu = if L::RESETS { 6 } else { 5 };
        let (kind, target) = match rng.u32(..menu) {
            0 => {
                let mark = chain.logged();
                chain.kill(i);
                tokio::time::sleep(hold / 2).await;
                chain.spawn(i);
                chain.settled::<L>(&mark).await;
                ("kill", format!("consumer {i}"))
            }
            1 => {
                // Longer than the broker's hold (a visibility or session
                // timeout): what it has in hand moves on while it is
                // stopped, and it wakes a zombie.
                chain.pause(i, true);
                tokio::time::sleep(L::HOLD + hold).await;
                let mark = chain.logged();
                chain.pause(i, false);
                chain.settled::<L>(&mark).await;
                ("pause", format!("consumer {i}"))
            }
            2 => {
                relay.cut();
                tokio::time::sleep(hold * 2).await;
                relay.restore();
                ("cut-database", "database".into())
            }
            3 => {
                relay.stall();
                tokio::time::sleep(hold).await;
                relay.restore();
                ("stall-database", "database".into())
            }
            5 => {
                let quiet = gate.write().await;
                // What was produced settled first: the broker is about to
                // lose its log (and what it dead-lettered).
                settled_all(&line, &db).await;
                dead_before_reset.extend(line.dead_letters().await);
                line.reset().await;
                // The consumers running across it end: they stop naming it,
                // or librdkafka 2.12.1 crashes on the restarted broker's
                // metadata (see RELIABILITY.md). Restarted, as a supervisor
                // would, each must stop naming the reset, consuming nothing.
                chain.stopped_naming_a_reset(Duration::from_secs(60)).await;
                chain.heal();
                let named = chain.stopped_naming_a_reset(Duration::from_secs(60)).await;
                if named < plan.consumers {
                    reset_missed.push(format!(
                        "after the broker lost its log, {named} of {} restarted consumers stopped naming it",
                        plan.consumers
                    ));
                }
                // The operator's step the error names.
                sqlx::query("DELETE FROM idempotency_kafka_positions WHERE consumer = $1")
                    .bind(L::EXAMPLE)
                    .execute(&mut db.connect().await)
                    .await
                    .expect("delete the stored positions");
                let mark = chain.logged();
                chain.heal();
                chain.settled::<L>(&mark).await;
                drop(quiet);
                ("reset-log", "broker".to_owned())
            }
            _ => {
                let mark = chain.logged();
                tokio::task::block_in_place(|| chain.terminate(i));
                chain.settled::<L>(&mark).await;
                tokio::time::sleep(hold / 2).await;
                let mark = chain.logged();
                chain.spawn(i);
                chain.settled::<L>(&mark).await;
                ("sigterm", format!("consumer {i}"))
            }
        };
        faults.push(FaultWindow {
            kind: kind.into(),
            target,
            start,
            end: recorder.now(),
        });
        tokio::time::sleep(Duration::from_millis(rng.u64(200..1500))).await;
    }
    stop.store(true, Ordering::Relaxed);
    producer.await.expect("the producer");
    relay.restore();
    chain.heal();
    // The quiet phase.
    settled_all(&line, &db).await;
    let left = line.left(&db).await;
    let charged: Vec<(String, i64)> = sqlx::query_as("SELECT order_id, amount FROM order_charges")
        .fetch_all(&mut db.connect().await)
        .await
        .unwrap_or_default();
    let mut dead = line.dead_letters().await;
    dead.extend(dead_before_reset);
    line.dump(&plan.out);
    let expected = expected.lock().unwrap().clone();
    let mut report = check(&expected, &charged, &dead, left, &faults);
    for detail in reset_missed {
        report.violations.push(Violation::Inconsistent {
            key: "reset-log".to_owned(),
            detail,
        });
    }
    let events = recorder.events();
    crate::run::write(&plan.out, L::NAME, plan.seed, &report, &events, &faults);
    (report, events)
}

/// Waits until nothing `line` holds is left unsettled, at most a minute.
async fn settled_all<L: Line>(line: &L, db: &TestDatabase) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while line.left(db).await > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Sends orders until `stop`: each valid, sometimes sent twice, sometimes
/// followed by its id with another amount; some not orders at all.
async fn produce(
    sender: Sender,
    recorder: Recorder,
    seed: u64,
    (stop, gate): (Arc<AtomicBool>, Arc<tokio::sync::RwLock<()>>),
    expected: Arc<Mutex<HashMap<String, Vec<Expect>>>>,
) {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let _open = gate.read().await;
        n += 1;
        let id = format!("order-{seed}-{n}");
        let amount = rng.i64(100..100_000);
        let mut sends: Vec<(String, Expect, &str)> = Vec::new();
        let order =
            |amount: i64| format!(r#"{{"order_id":"{id}","amount":{amount},"currency":"eur"}}"#);
        match rng.u32(..20) {
            0 => sends.push(("{not json".into(), Expect::DeadLetter("invalid"), "invalid")),
            1 | 2 => {
                sends.push((order(amount), Expect::Charge(amount), "publish"));
                sends.push((order(amount), Expect::Charge(amount), "resend"));
            }
            3 => {
                sends.push((order(amount), Expect::Charge(amount), "publish"));
                sends.push((
                    order(amount + 1),
                    Expect::DeadLetter("mismatch"),
                    "mismatch",
                ));
            }
            _ => sends.push((order(amount), Expect::Charge(amount), "publish")),
        }
        for (body, expect, via) in sends {
            let key = if via == "invalid" {
                format!("invalid-{seed}-{n}")
            } else {
                id.clone()
            };
            recorder.record(Event {
                op: n,
                key: key.clone(),
                amount,
                kind: "invoke".into(),
                via: via.into(),
                ..Event::default()
            });
            if sender.send(&key, body).await {
                expected
                    .lock()
                    .unwrap()
                    .entry(key)
                    .or_default()
                    .push(expect);
            }
            // The mismatch after the original has been taken in hand.
            if via == "publish" {
                tokio::time::sleep(Duration::from_millis(rng.u64(0..30))).await;
            }
        }
        tokio::time::sleep(Duration::from_millis(rng.u64(20..120))).await;
    }
}

/// Every order published comes to what it should: a valid one charged
/// exactly once; a mismatch or an invalid message in the dead-letter queue
/// with that very reason; nothing left in the queue.
fn check(
    expected: &HashMap<String, Vec<Expect>>,
    charged: &[(String, i64)],
    dead: &[(String, Option<String>)],
    left: u64,
    faults: &[FaultWindow],
) -> Report {
    let mut report = Report::default();
    for fault in faults {
        *report.faults.entry(fault.kind.clone()).or_default() += 1;
    }
    let mut charges: HashMap<&str, Vec<i64>> = HashMap::new();
    for (id, amount) in charged {
        charges.entry(id).or_default().push(*amount);
    }
    let mut dead_reasons: HashMap<String, Vec<String>> = HashMap::new();
    for (body, kind) in dead {
        let id = serde_json::from_str::<serde_json::Value>(body)
            .ok()
            .and_then(|v| v["order_id"].as_str().map(str::to_owned))
            .unwrap_or_else(|| "not-an-order".into());
        dead_reasons
            .entry(id)
            .or_default()
            .push(kind.clone().unwrap_or_else(|| "none".into()));
    }
    for (key, expects) in expected {
        report.ops += 1;
        report.attempts += expects.len();
        let before = report.violations.len();
        // An order and its id reused with another amount race: SQS does
        // not keep their order, so whichever is taken first is charged and
        // the other is the mismatch.
        let reused = expects.contains(&Expect::DeadLetter("mismatch"));
        if let Some(Expect::Charge(amount)) =
            expects.iter().find(|e| matches!(e, Expect::Charge(_)))
        {
            let got = charges.get(key.as_str()).cloned().unwrap_or_default();
            match got.len() {
                0 => {
                    report.lost += 1;
                    report.violations.push(Violation::Lost { key: key.clone() });
                }
                1 if got[0] == *amount || (reused && got[0] == amount + 1) => {}
                1 => report
                    .violations
                    .push(Violation::MismatchExecuted { key: key.clone() }),
                n => {
                    report.duplicated += 1;
                    report.violations.push(Violation::Duplicated {
                        key: key.clone(),
                        effects: n,
                    });
                }
            }
        }
        let wanted: Vec<&str> = expects
            .iter()
            .filter_map(|e| match e {
                Expect::DeadLetter(reason) => Some(*reason),
                Expect::Charge(_) => None,
            })
            .collect();
        let got = dead_reasons
            .get(if key.starts_with("invalid-") {
                "not-an-order"
            } else {
                key
            })
            .cloned()
            .unwrap_or_default();
        for reason in &wanted {
            if !got.iter().any(|g| g == reason) {
                report.violations.push(Violation::Inconsistent {
                    key: key.clone(),
                    detail: format!("should be dead-lettered as {reason}, found {got:?}"),
                });
            }
        }
        if !key.starts_with("invalid-") && got.iter().any(|g| !wanted.contains(&g.as_str())) {
            report.violations.push(Violation::Inconsistent {
                key: key.clone(),
                detail: format!("dead-lettered without a true reason: {got:?}"),
            });
        }
        if report.violations.len() == before {
            report.ok += 1;
        }
    }
    let invalid_sent = expected
        .keys()
        .filter(|k| k.starts_with("invalid-"))
        .count();
    let invalid_dead = dead_reasons.get("not-an-order").map_or(0, |reasons| {
        reasons.iter().filter(|r| *r == "invalid").count()
    });
    // At least once: a consumer killed between the dead-letter send and
    // the delete sends it again (a standard queue cannot drop the repeat).
    if invalid_dead < invalid_sent {
        report.violations.push(Violation::Inconsistent {
            key: "invalid messages".into(),
            detail: format!("{invalid_sent} sent, {invalid_dead} dead-lettered as invalid"),
        });
    }
    if left > 0 {
        report.stuck += left as usize;
        report.violations.push(Violation::Stuck {
            key: "broker".into(),
            last: format!("{left} messages still undecided after the heal"),
        });
    }
    report.violations.sort();
    report.violations.dedup();
    report
}
