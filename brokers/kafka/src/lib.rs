//! Apache Kafka for [tower-idempotency], on rdkafka (librdkafka built from
//! source): the consumer loop's adapter ([`Kafka`], run by
//! [`KafkaConsumer`]) and the outbox's publisher ([`KafkaPublisher`]).
//!
//! Kafka has no redelivery: a consumer that commits an offset past an
//! undecided record has lost it for good. So the consumed position is not
//! the broker's: each record's position (topic, partition, offset + 1)
//! commits **in the same transaction as its idempotency record and its
//! effect**, in a small table beside the records ([`Positions`], on
//! SQLite, PostgreSQL or MySQL). On assignment each partition seeks to its
//! stored position (the earliest offset where none is stored); the group's
//! committed offsets are written after, as a hint only. A new group id on
//! the same database starts where the last one stood: nothing re-executed,
//! nothing decided delivered again.
//!
//! The lose-nothing rule holds as on every broker: an unavailable or busy
//! database, a commit of unknown outcome or a record in flight elsewhere is
//! kept in hand and retried after a back-off, the records behind it on its
//! partition waiting (the partition is paused once enough are in hand) —
//! the position never moves past an undecided record, and nothing is
//! dead-lettered for it. What can never succeed goes to a dead-letter topic
//! (the key and value byte for byte, the record's headers and timestamp,
//! with `dead-letter-reason`, `original-topic`, `original-partition` and
//! `original-offset` headers added), and only then does
//! the position move past it. Partitions are settled side by side, each in
//! order — or, with [`KafkaBuilder::in_order_per_key`], each record key in
//! order and the keys side by side, the stored position then moving only
//! past the contiguous run of decided records, never past a record still
//! in work. On the transactional SQL stores a partition's (or a key's)
//! records in hand are settled in batches, many per transaction
//! ([`KafkaConsumer::batch`]):
//! the batch's first record writes the position, and what the batch
//! decided beyond it is stored once answered, never before its commit. A
//! partition revoked by a rebalance keeps no record unstarted (its new
//! owner seeks to the stored position), and the one in
//! hand commits or rolls back with no effect twice: the idempotency record
//! makes the new owner's attempt a duplicate.
//!
//! A stored position past its partition's end means the log is not the one
//! the position was taken on (the topic deleted and created again, the
//! broker's log lost, a move to a new cluster): the consumer consumes
//! nothing of that partition and stops with an error that says so and how
//! to proceed — never taking the new log's records for decided. A record
//! fetched from below its stored position (a fetch begun before the seek)
//! is dropped, logged and counted ([`Kafka::dropped_below_position`]).
//!
//! # Features
//!
//! One is required: the engine of the transactional store the positions
//! are kept with (without one the crate does not build, and says which to
//! enable).
//!
//! | feature | what it adds |
//! |---|---|
//! | `postgres` | [`Positions`] for `PostgresTxStore`: the table [`POSTGRES_SCHEMA`] |
//! | `sqlite` | [`Positions`] for `SqliteTxStore`: the table [`SQLITE_SCHEMA`] |
//! | `mysql` | [`Positions`] for `MySqlTxStore` (MySQL, MariaDB): the table [`MYSQL_SCHEMA`] |
//!
//! # Names that must not change
//!
//! A consumer's `name` (the third argument of [`Kafka::builder`]) keys
//! its stored positions: keep it for the consumer's life in production.
//! The group id is a hint only — a new one starts where the positions
//! stand. A consumer whose name changed finds no positions, so each
//! partition starts at its earliest offset: every record still in the log
//! is read again, and the idempotency records answer the decided ones as
//! duplicates — but a record decided longer ago than their retention runs
//! again. To rename, stop the consumer and move its rows first:
//! `UPDATE idempotency_kafka_positions SET consumer = 'new' WHERE consumer
//! = 'old'`. The processor's scope keys the idempotency records in the
//! same way: changing it makes every redelivered record new.
//!
//! # Examples
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! use tower_idempotency::{
//!     SqliteStore, SqliteTx, sqlx,
//!     message::{DeadLetterReason, IdempotencyProcessor, Parsed},
//! };
//! use tower_idempotency_kafka::{Kafka, KafkaConsumer, rdkafka::ClientConfig};
//!
//! #[derive(serde::Deserialize)]
//! struct Order { order_id: String, amount: i64 }
//!
//! let store = SqliteStore::builder().transactional().create_table_if_missing().connect("sqlite://ledger.db").await?;
//! let mut config = ClientConfig::new();
//! config.set("bootstrap.servers", "127.0.0.1:9092").set("group.id", "ledger");
//! let kafka = Kafka::builder(config, "orders", "ledger", store.clone()).build().await?;
//! let orders = IdempotencyProcessor::new(store).scope("ledger");
//! KafkaConsumer::new(kafka, orders)
//!     .run(
//!         |payload: &[u8]| {
//!             let order: Order = serde_json::from_slice(payload)
//!                 .map_err(|e| DeadLetterReason::invalid(e.to_string()))?;
//!             Ok(Parsed { key: order.order_id.clone(), message: order })
//!         },
//!         async |tx: &mut SqliteTx, order: &Order| {
//!             sqlx::query("INSERT INTO ledger (order_id, amount) VALUES (?1, ?2)")
//!                 .bind(&order.order_id)
//!                 .bind(order.amount)
//!                 .execute(&mut **tx)
//!                 .await
//!                 .map(drop)
//!         },
//!         async { tokio::signal::ctrl_c().await.ok(); },
//!     )
//!     .await?;
//! # Ok(()) }
//! ```
//!
//! [tower-idempotency]: https://docs.rs/tower-idempotency
#![forbid(unsafe_code)]
#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]

// The README's example compiles with the crate's doctests.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

// The positions live beside the records, in the transactional store's own
// engine: without one, nothing here can work.
#[cfg(not(any(feature = "postgres", feature = "sqlite", feature = "mysql")))]
compile_error!(
    "tower-idempotency-kafka keeps each consumer's positions in the database of its \
     transactional store: enable the feature of that store's engine — `postgres`, `sqlite` or \
     `mysql` — e.g. tower-idempotency-kafka = { version = \"0.1\", features = [\"postgres\"] }"
);

mod handover;
mod positions;
mod watermark;

use std::{
    borrow::Cow,
    collections::HashMap,
    fmt,
    sync::{
        Arc, Mutex,
        atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering as AtomicOrdering},
    },
    time::{Duration, Instant},
};

use handover::Handover;
pub use positions::{MYSQL_SCHEMA, POSTGRES_SCHEMA, Position, Positions, SQLITE_SCHEMA, TABLE};
pub use rdkafka;
use rdkafka::{
    ClientContext, Message, Offset, TopicPartitionList,
    admin::{AdminClient, AdminOptions, NewTopic, TopicReplication},
    client::DefaultClientContext,
    config::ClientConfig,
    consumer::{
        BaseConsumer, CommitMode, Consumer as _, ConsumerContext, Rebalance, StreamConsumer,
    },
    error::{KafkaError, RDKafkaErrorCode},
    message::{Header, Headers, OwnedHeaders, OwnedMessage},
    producer::{FutureProducer, FutureRecord, Producer as _},
};
use tokio::sync::mpsc;
use tower_idempotency::{
    PayloadFingerprint,
    message::{
        Acked, Broker, BrokerError, Consumer, DeadLetterField, DeadLetterReason, DeadLettered,
        HeaderStyle, IdempotencyProcessor, Origin, Parsed, Received, Report,
    },
    outbox::{OutboxMessage, PublishError, Publisher},
};
use watermark::Watermark;

/// Records of one partition fetched and not answered before it is paused
/// (the rest waits in Kafka, not in memory), at least: four times what
/// the loop keeps in hand, where that is more, and resumed below half.
/// librdkafka's pause throws away what it had fetched ahead, so a resumed
/// partition fetches again and its records arrive a few hundred
/// milliseconds later; what is still fetched must cover that wait. Paused
/// at what the loop keeps in hand (1 000 for `in_hand(1000)`), a partition
/// stalled after every 1 000 records, most of its time.
const PER_PARTITION: usize = 1000;

/// A partition's pause, for a loop that keeps `in_hand` records: see
/// [`PER_PARTITION`].
fn paused_at(in_hand: usize) -> usize {
    in_hand.saturating_mul(4).max(PER_PARTITION)
}

/// How often, at most, a partition settled in order per key stores its
/// position on its own while records are in work (and once none is): a
/// crash re-reads what was decided since, answered as duplicates.
const POSITION_EVERY: Duration = Duration::from_millis(100);

/// How long the start-up waits for the brokers to answer.
const REACH: Duration = Duration::from_secs(5);

/// How often a partition's seek is asked, half a second apart, before it
/// is left paused until its next assignment.
const SEEK_TRIES: u32 = 6;

/// How long the record before a stored position may take to be fetched,
/// where the partition's watermark is below that position, before the log
/// is taken for another one.
const PROBE: Duration = Duration::from_secs(10);

/// A consumer group's topic, as the consumer loop drives it: see the
/// [crate docs](crate). Built by [`Kafka::builder`], which reaches the
/// brokers, creates the dead-letter topic if missing, and subscribes.
pub struct Kafka<St> {
    consumer: Arc<StreamConsumer<Rebalances>>,
    producer: FutureProducer,
    topic: String,
    dead_letters: String,
    name: String,
    store: St,
    /// Each partition's records in order per record key, keys side by
    /// side (else in the partition's order).
    by_key: bool,
    /// Records fetched, waiting for the loop.
    handover: Arc<Handover<KafkaRecord>>,
    partitions: Arc<Mutex<HashMap<i32, PartitionState>>>,
    /// Why the poller stopped, when it did (its handover then closes).
    stopped: Arc<Mutex<Option<String>>>,
    /// Records fetched from below their partition's stored position and
    /// dropped.
    dropped: Arc<AtomicU64>,
    /// Records of a partition in hand at which it is paused.
    paused_at: Arc<AtomicUsize>,
    poller: tokio::task::JoinHandle<()>,
}

impl<St> fmt::Debug for Kafka<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Kafka")
            .field("topic", &self.topic)
            .field("dead_letters", &self.dead_letters)
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl<St> Drop for Kafka<St> {
    fn drop(&mut self) {
        self.poller.abort();
    }
}

/// What this consumer holds of one assigned partition.
#[derive(Debug, Default)]
struct PartitionState {
    /// Bumped at each assignment: a record fetched under an earlier one is
    /// no longer this consumer's.
    generation: u64,
    /// Records fetched and not answered yet.
    in_hand: usize,
    /// Paused for want of room (not for its seek).
    full: bool,
    /// The stored position it was sought to: every record below it is
    /// decided. One fetched from below anyway (a fetch that began before
    /// the seek) is dropped, never handed over again.
    from: i64,
    /// Sought to its stored position since its assignment. Until then a
    /// record is one librdkafka fetched from where it stood before (its
    /// previous fetch position): handed over, it would be worked ahead of
    /// the records before it and its position stored past them.
    sought: bool,
    /// Its records handed over and not decided: how far the position may
    /// move.
    watermark: Watermark,
}

/// Builds a [`Kafka`]: see [`Kafka::builder`].
pub struct KafkaBuilder<St> {
    config: ClientConfig,
    topic: String,
    name: String,
    store: St,
    dead_letters: Option<String>,
    by_key: bool,
}

impl<St> fmt::Debug for KafkaBuilder<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KafkaBuilder")
            .field("topic", &self.topic)
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// Why a [`Kafka`] would not start: each says what to fix.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    /// The configuration is refused (a missing `group.id`, an unknown
    /// property).
    #[error("the Kafka client configuration is refused: {0}")]
    Config(KafkaError),
    /// No broker answered within 5 s.
    #[error("no Kafka broker answered at {brokers} within 5 s: {why}")]
    Unreachable {
        /// `bootstrap.servers`.
        brokers: String,
        /// What failed.
        why: String,
    },
    /// The dead-letter topic could not be created.
    #[error("the dead-letter topic {topic} could not be created: {why}")]
    DeadLetters {
        /// The topic.
        topic: String,
        /// What the broker said.
        why: String,
    },
    /// The positions table could not be created or read.
    #[error("the positions table: {0}")]
    Positions(tower_idempotency::sqlx::Error),
    /// A setting the consumer cannot run with.
    #[error("the Kafka setting {setting} cannot be used: {why}")]
    Setting {
        /// The setting.
        setting: String,
        /// Why, and what to do instead.
        why: String,
    },
}

impl<St: Positions> Kafka<St> {
    /// A consumer of `topic` configured by `config` (which must name its
    /// `bootstrap.servers` and `group.id`), keeping its positions under
    /// `name` in `store`'s database. The adapter sets what its rule needs:
    /// no auto-commit, no auto offset store, `auto.offset.reset=earliest`
    /// (with nothing stored, a partition starts at its earliest offset:
    /// starting at the end would skip what was produced before the first
    /// start); a `session.timeout.ms` you set is kept, 10 s otherwise. Under
    /// the consumer group protocol of KIP-848 (`group.protocol=consumer`)
    /// the broker times the session: `session.timeout.ms`,
    /// `heartbeat.interval.ms` and `partition.assignment.strategy` are
    /// refused at start-up ([`StartError::Setting`]).
    ///
    /// # Examples
    ///
    /// See the [crate docs](crate).
    pub fn builder(
        config: ClientConfig,
        topic: impl Into<String>,
        name: impl Into<String>,
        store: St,
    ) -> KafkaBuilder<St> {
        KafkaBuilder {
            config,
            topic: topic.into(),
            name: name.into(),
            store,
            dead_letters: None,
            by_key: false,
        }
    }

    /// The topic consumed.
    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// The dead-letter topic.
    pub fn dead_letter_topic(&self) -> &str {
        &self.dead_letters
    }

    /// How many records were fetched from below their partition's stored
    /// position and dropped, each logged: decided already (a fetch begun
    /// before the partition's seek, a seek that failed). Never a record of
    /// a log that restarted below the position — that stops the consumer.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # fn demo(kafka: &tower_idempotency_kafka::Kafka<tower_idempotency::SqliteTxStore>) {
    /// assert_eq!(kafka.dropped_below_position(), 0);
    /// # }
    /// ```
    pub fn dropped_below_position(&self) -> u64 {
        self.dropped.load(AtomicOrdering::Relaxed)
    }
}

impl<St: Positions> KafkaBuilder<St> {
    /// The dead-letter topic (default `<topic>.dead`), created at start-up
    /// when missing.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # fn demo(builder: tower_idempotency_kafka::KafkaBuilder<tower_idempotency::SqliteTxStore>) {
    /// let builder = builder.dead_letter_topic("orders.refused");
    /// # let _ = builder; }
    /// ```
    pub fn dead_letter_topic(mut self, topic: impl Into<String>) -> Self {
        self.dead_letters = Some(topic.into());
        self
    }

    /// With `true`, settles each partition's records in order per record
    /// key, and the keys side by side (default `false`: each partition's
    /// records one after another, in the partition's order, each record's
    /// position committed in its own transaction). One key's records — an
    /// account's, when the producer keys by account — stay in order;
    /// records of different keys may be settled out of the partition's
    /// order, and records without a key are in order among themselves.
    ///
    /// The stored position moves only past the contiguous run of decided
    /// records, never past one in work. The transactions then write none
    /// (each would wait on the partition's position row for the one
    /// before it to commit): the position is stored on its own, at most
    /// every 100 ms per partition, once none of its records is undecided,
    /// and when the loop stops. A crash re-reads from the position stored,
    /// and the records decided beyond it are answered as duplicates —
    /// never executed again, as long as the idempotency records are kept.
    /// How many records are in work at once, in all, is the consumer's
    /// [`in_hand`](Consumer::in_hand); a partition is paused at four times
    /// that many records in hand (1 000 at least).
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # fn demo(builder: tower_idempotency_kafka::KafkaBuilder<tower_idempotency::SqliteTxStore>) {
    /// // An account's orders in order; accounts side by side.
    /// let builder = builder.in_order_per_key(true);
    /// # let _ = builder; }
    /// ```
    pub fn in_order_per_key(mut self, per_key: bool) -> Self {
        self.by_key = per_key;
        self
    }

    /// The adapter: the brokers reached, the dead-letter topic there, the
    /// positions table there, the topic subscribed.
    ///
    /// # Errors
    ///
    /// See [`StartError`].
    ///
    /// # Examples
    ///
    /// See the [crate docs](crate).
    pub async fn build(self) -> Result<Kafka<St>, StartError> {
        let Self {
            mut config,
            topic,
            name,
            store,
            dead_letters,
            by_key,
        } = self;
        let dead_letters = dead_letters.unwrap_or_else(|| format!("{topic}.dead"));
        let brokers = config.get("bootstrap.servers").unwrap_or("").to_owned();
        let producer: FutureProducer = producer_config(&config)
            .create()
            .map_err(StartError::Config)?;
        // The brokers, within a bound.
        let probe = producer.clone();
        blocking(move || probe.client().fetch_metadata(None, REACH).map(drop))
            .await
            .map_err(|why| StartError::Unreachable { brokers, why })?;
        let admin: AdminClient<DefaultClientContext> =
            admin_config(&config).create().map_err(StartError::Config)?;
        let created = admin
            .create_topics(
                &[NewTopic::new(&dead_letters, 1, TopicReplication::Fixed(1))],
                &AdminOptions::new().operation_timeout(Some(REACH)),
            )
            .await
            .map_err(|e| StartError::DeadLetters {
                topic: dead_letters.clone(),
                why: e.to_string(),
            })?;
        for result in created {
            match result {
                Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
                Err((_, code)) => {
                    return Err(StartError::DeadLetters {
                        topic: dead_letters,
                        why: code.to_string(),
                    });
                }
            }
        }
        store
            .create_positions_table()
            .await
            .map_err(StartError::Positions)?;
        let probe = probe_config(&config);
        consumer_config(&mut config)?;
        let (notices, notified) = mpsc::unbounded_channel();
        let consumer: StreamConsumer<Rebalances> = config
            .create_with_context(Rebalances {
                topic: topic.clone(),
                notices,
            })
            .map_err(StartError::Config)?;
        consumer.subscribe(&[&topic]).map_err(StartError::Config)?;
        let consumer = Arc::new(consumer);
        let partitions = Arc::new(Mutex::new(HashMap::new()));
        let handover = Arc::new(Handover::default());
        let stopped = Arc::new(Mutex::new(None));
        let dropped = Arc::new(AtomicU64::new(0));
        let paused_at = Arc::new(AtomicUsize::new(PER_PARTITION));
        let poller = tokio::spawn(
            Poller {
                consumer: consumer.clone(),
                store: store.clone(),
                topic: topic.clone(),
                name: name.clone(),
                partitions: partitions.clone(),
                handover: handover.clone(),
                by_key,
                stopped: stopped.clone(),
                dropped: dropped.clone(),
                paused_at: paused_at.clone(),
                probe,
            }
            .run(notified),
        );
        Ok(Kafka {
            consumer,
            producer,
            topic,
            dead_letters,
            name,
            store,
            by_key,
            handover,
            partitions,
            stopped,
            dropped,
            paused_at,
            poller,
        })
    }
}

/// What the broker assigns and times under the consumer group protocol of
/// KIP-848 (`group.protocol=consumer`): librdkafka refuses them there.
const CLASSIC_ONLY: [&str; 3] = [
    "session.timeout.ms",
    "heartbeat.interval.ms",
    "partition.assignment.strategy",
];

/// What the adapter's rule needs of the consumer's configuration: no
/// auto-commit, no auto offset store, `auto.offset.reset=earliest`; under
/// the classic group protocol a 10 s `session.timeout.ms` unless one is
/// set, under KIP-848's none of the settings that protocol leaves to the
/// broker (a configuration naming one is refused, by name).
fn consumer_config(config: &mut ClientConfig) -> Result<(), StartError> {
    config
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("auto.offset.reset", "earliest");
    let kip_848 = config
        .get("group.protocol")
        .is_some_and(|protocol| protocol.eq_ignore_ascii_case("consumer"));
    if !kip_848 {
        if config.get("session.timeout.ms").is_none() {
            config.set("session.timeout.ms", "10000");
        }
        return Ok(());
    }
    match CLASSIC_ONLY.iter().find(|name| config.get(name).is_some()) {
        Some(name) => Err(StartError::Setting {
            setting: (*name).to_owned(),
            why: "group.protocol=consumer (KIP-848) leaves it to the broker: remove it, and set \
                  the group's session and heartbeat intervals on the broker \
                  (group.consumer.session.timeout.ms, group.consumer.heartbeat.interval.ms)"
                .to_owned(),
        }),
        None => Ok(()),
    }
}

/// How long a producer waits for a record's delivery, unless
/// `message.timeout.ms` says otherwise (librdkafka's own default, 300 s,
/// would hide an outage for five minutes).
const DELIVERY: Duration = Duration::from_secs(10);

/// The producer's configuration, from the consumer's: the same brokers
/// (and security), idempotent, each delivery bounded.
fn producer_config(config: &ClientConfig) -> ClientConfig {
    let mut producer = admin_config(config);
    producer.set("enable.idempotence", "true");
    if producer.get("message.timeout.ms").is_none() && producer.get("delivery.timeout.ms").is_none()
    {
        producer.set("message.timeout.ms", DELIVERY.as_millis().to_string());
    }
    producer
}

/// The brokers and security settings of `config`, without what only a
/// consumer takes.
fn admin_config(config: &ClientConfig) -> ClientConfig {
    let mut admin = ClientConfig::new();
    for (key, value) in config.config_map() {
        let consumer_only = key.starts_with("group.")
            || key.starts_with("session.")
            || key.starts_with("enable.auto")
            || key.starts_with("auto.")
            || key.starts_with("max.poll")
            || key.starts_with("heartbeat.")
            || key.starts_with("partition.assignment");
        if !consumer_only {
            admin.set(key, value);
        }
    }
    admin
}

/// The configuration of a consumer that reads one partition from a given
/// offset, assigned (librdkafka wants a group id, which it never joins or
/// commits to), told of an offset out of range rather than reset.
fn probe_config(config: &ClientConfig) -> ClientConfig {
    let mut probe = admin_config(config);
    probe
        .set("group.id", "tower-idempotency-kafka-probe")
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("auto.offset.reset", "error");
    probe
}

/// A rebalance, told by librdkafka's callback to the poller.
enum Notice {
    Assigned(Vec<i32>),
    Revoked(Vec<i32>),
}

/// The consumer's context: each assignment is paused at once (its
/// partitions seek to their stored positions before anything is fetched)
/// and told to the poller, as each revocation is.
struct Rebalances {
    topic: String,
    notices: mpsc::UnboundedSender<Notice>,
}

impl ClientContext for Rebalances {}

impl ConsumerContext for Rebalances {
    fn post_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        let ours = |tpl: &TopicPartitionList| -> Vec<i32> {
            tpl.elements_for_topic(&self.topic)
                .iter()
                .map(|e| e.partition())
                .collect()
        };
        match rebalance {
            Rebalance::Assign(tpl) => {
                if let Err(error) = consumer.pause(tpl) {
                    tracing::error!(%error, "kafka: an assignment could not be paused for its seek");
                }
                let _ = self.notices.send(Notice::Assigned(ours(tpl)));
            }
            Rebalance::Revoke(tpl) => {
                let _ = self.notices.send(Notice::Revoked(ours(tpl)));
            }
            Rebalance::Error(error) => tracing::warn!(%error, "kafka: a rebalance failed"),
        }
    }
}

/// Polls all the time — librdkafka needs a poll within
/// `max.poll.interval.ms`, however long the loop keeps a record in hand —
/// and hands records to the loop; seeks each assigned partition to its
/// stored position; pauses a partition with enough in hand.
struct Poller<St> {
    consumer: Arc<StreamConsumer<Rebalances>>,
    store: St,
    topic: String,
    name: String,
    partitions: Arc<Mutex<HashMap<i32, PartitionState>>>,
    handover: Arc<Handover<KafkaRecord>>,
    /// Lanes are record keys in a partition, not partitions.
    by_key: bool,
    stopped: Arc<Mutex<Option<String>>>,
    dropped: Arc<AtomicU64>,
    paused_at: Arc<AtomicUsize>,
    /// The configuration of [`served`]'s consumer.
    probe: ClientConfig,
}

/// The poller gone — stopped, aborted, or panicked — the loop is told
/// once it has taken what was handed over.
impl<St> Drop for Poller<St> {
    fn drop(&mut self) {
        self.handover.close();
    }
}

impl<St: Positions> Poller<St> {
    /// Polls until a partition's log turns out not to be the one its
    /// stored position was taken on: then it says why and ends, closing
    /// the loop's channel (what was handed over is still worked).
    async fn run(self, mut notices: mpsc::UnboundedReceiver<Notice>) {
        loop {
            tokio::select! {
                biased;
                Some(notice) = notices.recv() => {
                    if let Err(why) = self.rebalanced(notice).await {
                        tracing::error!(topic = %self.topic, "kafka: {why}");
                        *lock(&self.stopped) = Some(why);
                        return;
                    }
                }
                received = self.consumer.recv() => match received {
                    Ok(message) => self.hand_over(message.detach()),
                    Err(error) => {
                        tracing::warn!(%error, topic = %self.topic, "kafka: receiving failed; retrying");
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                },
            }
        }
    }

    async fn rebalanced(&self, notice: Notice) -> Result<(), String> {
        match notice {
            Notice::Revoked(revoked) => {
                let mut partitions = lock(&self.partitions);
                for partition in revoked {
                    partitions.remove(&partition);
                }
                Ok(())
            }
            Notice::Assigned(assigned) => {
                {
                    let mut partitions = lock(&self.partitions);
                    for partition in &assigned {
                        let state = partitions.entry(*partition).or_default();
                        state.generation += 1;
                        state.in_hand = 0;
                        state.full = false;
                        state.sought = false;
                        state.watermark = Watermark::default();
                    }
                }
                self.seek(&assigned).await
            }
        }
    }

    /// Seeks each partition to its stored position (its earliest offset
    /// where none is stored), then lets it fetch; a database that cannot be
    /// read keeps it paused and is asked again. A partition whose log ends
    /// below its stored position stays paused, and the poller stops: see
    /// [`ends_below`](Self::ends_below).
    async fn seek(&self, assigned: &[i32]) -> Result<(), String> {
        let stored = loop {
            match self.store.read_positions(&self.name, &self.topic).await {
                Ok(stored) => break stored.into_iter().collect::<HashMap<i32, i64>>(),
                Err(error) => {
                    tracing::warn!(%error, "kafka: the stored positions cannot be read; the assignment waits");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        };
        for partition in assigned {
            let next = stored.get(partition).copied();
            if let Some(next) = next {
                self.ends_below(*partition, next).await?;
            }
            let offset = next.map_or(Offset::Beginning, Offset::Offset);
            if let Some(state) = lock(&self.partitions).get_mut(partition) {
                state.from = next.unwrap_or(0);
                state.watermark = Watermark::from(state.from);
            }
            let mut one = TopicPartitionList::new();
            if one
                .add_partition_offset(&self.topic, *partition, offset)
                .is_err()
            {
                continue;
            }
            if let Err(why) = self.seek_to(&one).await {
                // Where it would fetch from is unknown: it stays paused,
                // nothing of it taken, until it is assigned again (a
                // revocation while it was sought, or a restart).
                tracing::error!(
                    topic = %self.topic,
                    "kafka: partition {partition} could not be sought to its stored position ({why}); \
                     it stays paused, nothing of it consumed, until it is assigned again"
                );
                continue;
            }
            if let Some(state) = lock(&self.partitions).get_mut(partition) {
                state.sought = true;
            }
            let mut resume = TopicPartitionList::new();
            resume.add_partition(&self.topic, *partition);
            match self.consumer.resume(&resume) {
                Ok(()) => match next {
                    Some(next) => tracing::info!(
                        topic = %self.topic,
                        "kafka: partition {partition} assigned, fetching from its stored position {next}"
                    ),
                    None => tracing::info!(
                        topic = %self.topic,
                        "kafka: partition {partition} assigned, fetching from its start (no stored position)"
                    ),
                },
                Err(error) => {
                    tracing::error!(%error, partition, "kafka: a partition could not resume")
                }
            }
        }
        Ok(())
    }

    /// Seeks `one` partition, asked again a few times (a seek can fail
    /// while librdkafka is still taking the assignment in).
    async fn seek_to(&self, one: &TopicPartitionList) -> Result<(), String> {
        let mut why = String::new();
        for attempt in 0..SEEK_TRIES {
            if attempt > 0 {
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            let (consumer, one) = (self.consumer.clone(), one.clone());
            let sought =
                blocking(move || consumer.seek_partitions(one, Duration::from_secs(10))).await;
            why = match sought {
                Ok(sought) => match sought.elements().iter().find_map(|e| e.error().err()) {
                    None => return Ok(()),
                    Some(error) => error.to_string(),
                },
                Err(error) => error,
            };
            tracing::warn!(
                why,
                attempt,
                "kafka: a partition could not seek to its stored position"
            );
        }
        Err(why)
    }

    /// `Err` when `partition`'s log ends below `next`, the position stored
    /// for it: the log is not the one the position was taken on — the
    /// topic deleted and created again, the broker's log lost or moved to
    /// a new cluster — and every record of the new log below `next` would
    /// be taken for decided and dropped. Its high watermark is read first;
    /// only one below `next` is looked at again, by fetching the record
    /// just before `next` (the last one decided): a broker whose watermark
    /// lags the records it serves (tansu 0.6 reports its last batch's
    /// first offset + 1) still serves it, a new log does not. What cannot
    /// be read leaves the seek to go on.
    async fn ends_below(&self, partition: i32, next: i64) -> Result<(), String> {
        let (consumer, topic) = (self.consumer.clone(), self.topic.clone());
        let watermarks =
            blocking(move || consumer.fetch_watermarks(&topic, partition, REACH)).await;
        let end = match watermarks {
            Ok((_, high)) if high >= next => return Ok(()),
            Ok((_, high)) => high,
            Err(error) => {
                tracing::warn!(%error, partition, "kafka: the partition's end could not be read; seeking to its stored position");
                return Ok(());
            }
        };
        let (probe, topic) = (self.probe.clone(), self.topic.clone());
        let served = blocking(move || served(&probe, &topic, partition, next - 1)).await;
        match served {
            Ok(true) => return Ok(()),
            Ok(false) => {}
            Err(error) => {
                tracing::warn!(%error, partition, "kafka: the record before the stored position could not be fetched; seeking to it");
                return Ok(());
            }
        }
        Err(format!(
            "partition {partition} of topic {topic} ends at offset {end}, below the position stored for \
             consumer {name} ({next}), and no record {last} is served: the topic's log is not the one \
             that position was taken on (the topic deleted and created again, or the broker's log \
             lost). Nothing was consumed from it. If this log is the one to consume from its start, \
             delete the consumer's stored positions — DELETE FROM {TABLE} WHERE consumer = '{name}' \
             AND topic = '{topic}' — and start again: records already decided under their keys are \
             duplicates, never executed twice",
            last = next - 1,
            topic = self.topic,
            name = self.name,
        ))
    }

    fn hand_over(&self, message: OwnedMessage) {
        let partition = message.partition();
        let generation = {
            let mut partitions = lock(&self.partitions);
            let Some(state) = partitions.get_mut(&partition) else {
                // Fetched before its revocation was told: its new owner
                // takes it from the stored position.
                return;
            };
            if !state.sought {
                // Fetched from where the partition stood before its seek:
                // fetched again, in order, from the stored position.
                tracing::debug!(
                    partition,
                    offset = message.offset(),
                    "kafka: a record fetched before its partition's seek is left to the seek"
                );
                return;
            }
            if message.offset() < state.from {
                // Decided already: the stored position is past it (a fetch
                // begun before the seek). Counted and said, never silent.
                let dropped = self.dropped.fetch_add(1, AtomicOrdering::Relaxed) + 1;
                tracing::warn!(
                    partition,
                    offset = message.offset(),
                    position = state.from,
                    dropped,
                    "kafka: a record fetched from below its partition's stored position is dropped (decided already)"
                );
                return;
            }
            state.in_hand += 1;
            state.watermark.handed(message.offset());
            if state.in_hand >= self.paused_at.load(AtomicOrdering::Relaxed) && !state.full {
                state.full = true;
                let mut tpl = TopicPartitionList::new();
                tpl.add_partition(&self.topic, partition);
                let _ = self.consumer.pause(&tpl);
            }
            state.generation
        };
        let position = Position {
            consumer: self.name.clone(),
            topic: self.topic.clone(),
            partition,
            next: message.offset() + 1,
        };
        let lane = lane(&message, self.by_key);
        self.handover.push(
            &lane,
            KafkaRecord {
                lane: lane.clone(),
                message,
                position,
                generation,
                written: AtomicI64::new(NOT_WRITTEN),
            },
        );
    }
}

/// `f` (a librdkafka call that blocks) on a thread for blocking work; its
/// error, or the thread's, said.
async fn blocking<T: Send + 'static, E: fmt::Display>(
    f: impl FnOnce() -> Result<T, E> + Send + 'static,
) -> Result<T, String> {
    tokio::task::spawn_blocking(move || f().map_err(|e| e.to_string()))
        .await
        .unwrap_or_else(|e| Err(e.to_string()))
}

/// Whether the broker serves the record at `offset` of `partition`, asked
/// by a consumer assigned there alone (never in a group): `false` when the broker
/// answers that the offset is out of range, or no record comes within
/// [`PROBE`].
fn served(config: &ClientConfig, topic: &str, partition: i32, offset: i64) -> Result<bool, String> {
    let consumer: BaseConsumer = config.create().map_err(|e| e.to_string())?;
    let mut at = TopicPartitionList::new();
    at.add_partition_offset(topic, partition, Offset::Offset(offset))
        .map_err(|e| e.to_string())?;
    consumer.assign(&at).map_err(|e| e.to_string())?;
    let deadline = std::time::Instant::now() + PROBE;
    while let Some(left) = deadline.checked_duration_since(std::time::Instant::now()) {
        match consumer.poll(left.min(Duration::from_millis(500))) {
            Some(Ok(message)) if message.offset() >= offset => return Ok(true),
            Some(Err(KafkaError::MessageConsumption(
                RDKafkaErrorCode::OffsetOutOfRange | RDKafkaErrorCode::AutoOffsetReset,
            ))) => return Ok(false),
            _ => {}
        }
    }
    Ok(false)
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The lane of `message`, its ordering key in the loop: its partition,
/// and its record key where records are in order per key (a key that is
/// not UTF-8 read lossily, which can only put two keys in one lane).
fn lane(message: &OwnedMessage, by_key: bool) -> String {
    let partition = message.partition();
    match message.key() {
        Some(key) if by_key => format!("{partition}/{}", String::from_utf8_lossy(key)),
        _ => partition.to_string(),
    }
}

/// One Kafka record.
pub struct KafkaRecord {
    message: OwnedMessage,
    /// Its ordering key in the loop.
    lane: String,
    /// Its consumer, topic and partition, and the offset after it.
    position: Position,
    /// Its partition's assignment when it was fetched.
    generation: u64,
    /// The position its work's transaction wrote, last attempt's
    /// ([`NOT_WRITTEN`] if none): once it commits, the partition's stored
    /// position is at least that.
    written: AtomicI64,
}

/// No position written by a record's work.
const NOT_WRITTEN: i64 = -1;

impl fmt::Debug for KafkaRecord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "KafkaRecord({}/{}@{})",
            self.message.topic(),
            self.message.partition(),
            self.message.offset()
        )
    }
}

impl KafkaRecord {
    /// The record, as rdkafka gives it.
    pub fn message(&self) -> &OwnedMessage {
        &self.message
    }

    /// `topic/partition@offset`: how the record is named.
    pub fn coordinates(&self) -> String {
        format!(
            "{}/{}@{}",
            self.message.topic(),
            self.message.partition(),
            self.message.offset()
        )
    }
}

/// `Kafka`'s deliveries: see [`Received`].
impl Received for KafkaRecord {
    fn payload(&self) -> &[u8] {
        self.message.payload().unwrap_or_default()
    }

    fn header(&self, name: &str) -> Option<&str> {
        let headers = self.message.headers()?;
        headers
            .iter()
            .find(|header| header.key == name)
            .and_then(|header| std::str::from_utf8(header.value?).ok())
    }

    /// `topic/partition@offset`.
    fn message_id(&self) -> Option<Cow<'_, str>> {
        Some(Cow::Owned(self.coordinates()))
    }
}

impl<St: Positions> Kafka<St> {
    /// `record` answered: one fewer in hand on its partition, which
    /// fetches again once it has room.
    fn answered(&self, record: &KafkaRecord) {
        self.handover.answered(&record.lane);
        let mut partitions = lock(&self.partitions);
        let Some(state) = fetched_under(&mut partitions, record) else {
            return;
        };
        state.in_hand = state.in_hand.saturating_sub(1);
        if state.full && state.in_hand < self.paused_at.load(AtomicOrdering::Relaxed) / 2 {
            state.full = false;
            let mut tpl = TopicPartitionList::new();
            tpl.add_partition(&self.topic, record.message.partition());
            let _ = self.consumer.resume(&tpl);
        }
    }

    /// `record` decided: the position to store on its own now, if any.
    /// In the partition's order, an execution's transaction wrote one
    /// (counted committed first), and a decision without work stores one
    /// where it passes what is committed. An execution in a batch wrote
    /// one short of it (the batch's records before it were undecided when
    /// it ran): what it leaves behind is stored on its own, as in order per
    /// key. In order per key, transactions write none and the position is
    /// stored on its own, every [`POSITION_EVERY`] at most, and once
    /// nothing is undecided. `None`
    /// as well for a record of an earlier assignment: the partition's
    /// owner reads it again from the stored position, and its idempotency
    /// record answers it.
    fn to_store(&self, record: &KafkaRecord, acked: Acked) -> Option<Position> {
        let mut partitions = lock(&self.partitions);
        let watermark = &mut fetched_under(&mut partitions, record)?.watermark;
        if acked == Acked::Executed {
            watermark.stored(record.written.load(AtomicOrdering::SeqCst));
        }
        watermark.decided(record.message.offset());
        let next = match (self.by_key, acked) {
            (true, _) => watermark.due(Instant::now(), POSITION_EVERY),
            (false, Acked::Decided) => watermark.passing(),
            (false, Acked::Executed) => watermark.due(Instant::now(), POSITION_EVERY),
        }?;
        Some(Position {
            next,
            ..record.position.clone()
        })
    }

    /// `position`, stored on its own, committed.
    fn stored(&self, record: &KafkaRecord, position: &Position) {
        if let Some(state) = fetched_under(&mut lock(&self.partitions), record) {
            state.watermark.stored(position.next);
        }
    }
}

/// The state of `record`'s partition, while it is still under the
/// assignment `record` was fetched under.
fn fetched_under<'a>(
    partitions: &'a mut HashMap<i32, PartitionState>,
    record: &KafkaRecord,
) -> Option<&'a mut PartitionState> {
    partitions
        .get_mut(&record.message.partition())
        .filter(|state| state.generation == record.generation)
}

/// The position `record`'s work writes in its transaction, last, where
/// each partition is settled in order: where its partition stands once it
/// commits (see [`Watermark::with`]). `None` where that passes nothing
/// committed, and for a record of an earlier assignment: it writes none.
fn in_work(
    partitions: &Mutex<HashMap<i32, PartitionState>>,
    record: &KafkaRecord,
) -> Option<Position> {
    let next = fetched_under(&mut lock(partitions), record)?
        .watermark
        .with(record.message.offset());
    record
        .written
        .store(next.unwrap_or(NOT_WRITTEN), AtomicOrdering::SeqCst);
    let next = next?;
    Some(Position {
        next,
        ..record.position.clone()
    })
}

impl<St: Positions> Broker for Kafka<St> {
    type Received = KafkaRecord;

    fn system(&self) -> &'static str {
        "kafka"
    }

    fn destination(&self) -> &str {
        &self.topic
    }

    async fn receive(
        &self,
        room: usize,
        within: Duration,
    ) -> Result<Vec<KafkaRecord>, BrokerError> {
        self.handover.take(room, within).await.ok_or_else(|| {
            lock(&self.stopped)
                .clone()
                .unwrap_or_else(|| format!("the consumer of {} stopped", self.topic))
                .into()
        })
    }

    /// Records come from what the poller handed over: a receive dropped at
    /// shutdown leaves them there.
    fn receive_is_cancel_safe(&self) -> bool {
        true
    }

    /// Kafka holds nothing per record: the consumer polls all the time.
    fn hold_interval(&self) -> Option<Duration> {
        None
    }

    /// The partition, and the record's key where records are in order
    /// per key ([`KafkaBuilder::in_order_per_key`]).
    fn ordering_key<'a>(&self, record: &'a KafkaRecord) -> Option<Cow<'a, str>> {
        Some(Cow::Borrowed(&record.lane))
    }

    /// Its partition still assigned since it was fetched. Called once, when
    /// its turn comes: a record no longer ours is let go here.
    fn owns(&self, record: &KafkaRecord) -> bool {
        let ours = fetched_under(&mut lock(&self.partitions), record).is_some();
        if !ours {
            self.answered(record);
        }
        ours
    }

    /// An execution stored a position in its own transaction; anything
    /// else decided stores it now. Then the group's offset, as a hint.
    async fn ack(&self, record: &KafkaRecord, acked: Acked) -> Result<(), BrokerError> {
        let to_store = self.to_store(record, acked);
        self.answered(record);
        let committed = match &to_store {
            Some(position) => {
                self.store.store_position(position).await?;
                self.stored(record, position);
                position.next
            }
            None if acked == Acked::Executed => record.written.load(AtomicOrdering::SeqCst),
            None => NOT_WRITTEN,
        };
        let mut hint = TopicPartitionList::new();
        if committed != NOT_WRITTEN
            && hint
                .add_partition_offset(
                    &self.topic,
                    record.message.partition(),
                    Offset::Offset(committed),
                )
                .is_ok()
        {
            let _ = self.consumer.commit(&hint, CommitMode::Async);
        }
        Ok(())
    }

    /// Nothing to tell Kafka: the position stays before the record, which
    /// is read again from there (after a restart, or by the partition's
    /// next owner).
    async fn give_back(&self, record: &KafkaRecord, _: Duration) -> Result<(), BrokerError> {
        self.answered(record);
        Ok(())
    }

    async fn dead_letter(
        &self,
        record: &KafkaRecord,
        reason: &DeadLetterReason,
    ) -> Result<DeadLettered, BrokerError> {
        let message = &record.message;
        let offset = message.offset().to_string();
        let origin = Origin {
            source: message.topic(),
            partition: Some(message.partition()),
            position: Some(&offset),
        };
        // The record's own headers first, as they came (a header of the
        // contract's name is the contract's: it is written below).
        let mut headers = OwnedHeaders::new();
        if let Some(original) = message.headers() {
            for header in original.iter() {
                if !DeadLetterField::is_named(HeaderStyle::Kafka, header.key) {
                    headers = headers.insert(header);
                }
            }
        }
        for (key, value) in reason.headers(&origin, HeaderStyle::Kafka) {
            headers = headers.insert(Header {
                key,
                value: Some(value.as_str()),
            });
        }
        let mut dead = FutureRecord::to(&self.dead_letters)
            .payload(message.payload().unwrap_or_default())
            .headers(headers);
        if let Some(key) = message.key() {
            dead = dead.key(key);
        }
        if let Some(at) = message.timestamp().to_millis() {
            dead = dead.timestamp(at);
        }
        self.producer
            .send(dead, Duration::from_secs(30))
            .await
            .map_err(|(error, _)| {
                format!(
                    "the dead-letter topic {} refused it: {error}",
                    self.dead_letters
                )
            })?;
        Ok(DeadLettered::Moved)
    }

    /// Stores each partition's position where what was decided passed the
    /// last one stored (in order per key, what the last 100 ms decided),
    /// then lets go.
    async fn close(&self) {
        self.poller.abort();
        let due: Vec<Position> = lock(&self.partitions)
            .iter()
            .filter_map(|(partition, state)| {
                Some(Position {
                    consumer: self.name.clone(),
                    topic: self.topic.clone(),
                    partition: *partition,
                    next: state.watermark.passing()?,
                })
            })
            .collect();
        for position in due {
            if let Err(error) = self.store.store_position(&position).await {
                // Read again from the last one stored: duplicates, answered.
                tracing::warn!(%error, partition = position.partition, "kafka: the last position could not be stored");
            }
        }
        self.consumer.unsubscribe();
    }
}

/// The consumer loop over [`Kafka`]: the library's
/// [`Consumer`], whose work also
/// writes each record's position in its transaction.
pub struct KafkaConsumer<St: Positions, F, M, T, E> {
    inner: Consumer<Kafka<St>, St, F, M, T, E>,
    /// The adapter's partitions, where each record's work finds the
    /// position it writes — none where records are in order per key.
    partitions: Option<Arc<Mutex<HashMap<i32, PartitionState>>>>,
    /// The adapter's pause, which follows the records in hand.
    paused_at: Arc<AtomicUsize>,
}

impl<St: Positions, F, M, T, E> fmt::Debug for KafkaConsumer<St, F, M, T, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.inner.fmt(f)
    }
}

impl<St, F, M, T, E> KafkaConsumer<St, F, M, T, E>
where
    St: Positions,
    F: PayloadFingerprint,
    M: Send + Sync,
    T: serde::Serialize + serde::de::DeserializeOwned,
    E: fmt::Display + From<tower_idempotency::sqlx::Error>,
{
    /// The loop over `kafka`, settling each record with `processor`: see
    /// [`Consumer::new`].
    ///
    /// # Examples
    ///
    /// See the [crate docs](crate).
    pub fn new(kafka: Kafka<St>, processor: IdempotencyProcessor<St, F>) -> Self {
        Self {
            partitions: (!kafka.by_key).then(|| kafka.partitions.clone()),
            paused_at: kafka.paused_at.clone(),
            inner: Consumer::new(kafka, processor),
        }
    }

    /// See [`Consumer::in_hand`]. A partition is paused once it has four
    /// times that many records fetched and not answered (1 000 at least),
    /// and resumed below half: what waits beyond that stays in Kafka.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # fn demo(consumer: tower_idempotency_kafka::KafkaConsumer<tower_idempotency::SqliteTxStore, tower_idempotency::DefaultFingerprint, (), (), tower_idempotency::sqlx::Error>) {
    /// let consumer = consumer.in_hand(64);
    /// # let _ = consumer; }
    /// ```
    pub fn in_hand(self, deliveries: usize) -> Self {
        self.paused_at
            .store(paused_at(deliveries), AtomicOrdering::Relaxed);
        Self {
            inner: self.inner.in_hand(deliveries),
            ..self
        }
    }

    /// See [`Consumer::batch`]: a batch is one partition's records (or,
    /// in order per key, one key's) in one transaction, the position
    /// stored when it passes them.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # fn demo(consumer: tower_idempotency_kafka::KafkaConsumer<tower_idempotency::SqliteTxStore, tower_idempotency::DefaultFingerprint, (), (), tower_idempotency::sqlx::Error>) {
    /// let consumer = consumer.in_hand(1000).batch(200);
    /// # let _ = consumer; }
    /// ```
    pub fn batch(self, records: usize) -> Self {
        Self {
            inner: self.inner.batch(records),
            ..self
        }
    }

    /// See [`Consumer::batch_within`].
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # fn demo(consumer: tower_idempotency_kafka::KafkaConsumer<tower_idempotency::SqliteTxStore, tower_idempotency::DefaultFingerprint, (), (), tower_idempotency::sqlx::Error>) {
    /// let consumer = consumer.batch_within(std::time::Duration::from_millis(200));
    /// # let _ = consumer; }
    /// ```
    pub fn batch_within(self, within: std::time::Duration) -> Self {
        Self {
            inner: self.inner.batch_within(within),
            ..self
        }
    }

    /// See [`Consumer::passing_when`].
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # fn demo(consumer: tower_idempotency_kafka::KafkaConsumer<tower_idempotency::SqliteTxStore, tower_idempotency::DefaultFingerprint, (), (), tower_idempotency::sqlx::Error>) {
    /// let consumer = consumer.passing_when(|error| error.as_database_error().is_none());
    /// # let _ = consumer; }
    /// ```
    pub fn passing_when(self, passing: impl Fn(&E) -> bool + Send + Sync + 'static) -> Self {
        Self {
            inner: self.inner.passing_when(passing),
            ..self
        }
    }

    /// See [`Consumer::on_settled`].
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # fn demo(consumer: tower_idempotency_kafka::KafkaConsumer<tower_idempotency::SqliteTxStore, tower_idempotency::DefaultFingerprint, (), (), tower_idempotency::sqlx::Error>) {
    /// let consumer = consumer.on_settled(|report| println!("{}", report.disposition));
    /// # let _ = consumer; }
    /// ```
    pub fn on_settled(
        self,
        report: impl Fn(&Report<'_, KafkaRecord, M, T, E>) + Send + Sync + 'static,
    ) -> Self {
        Self {
            inner: self.inner.on_settled(report),
            ..self
        }
    }

    /// Runs the loop (see [`Consumer::run`]) until `shutdown` completes:
    /// `parse` reads each record's business key and message, `work` does
    /// the effect in the store's transaction, and then the partition's
    /// position — where it stands once the record is decided — is written
    /// in that transaction, to commit with them (in order per key, it is
    /// stored on its own instead: see [`KafkaBuilder::in_order_per_key`]).
    ///
    /// # Errors
    ///
    /// See [`Consumer::run`].
    ///
    /// # Examples
    ///
    /// See the [crate docs](crate).
    pub async fn run<P, W>(
        self,
        parse: P,
        work: W,
        shutdown: impl std::future::Future<Output = ()> + Send,
    ) -> Result<(), BrokerError>
    where
        P: Fn(&[u8]) -> Result<Parsed<M>, DeadLetterReason>,
        W: AsyncFn(&mut St::Granted, &M) -> Result<T, E>,
    {
        let partitions = self.partitions;
        self.inner
            .run_received(
                |record: &KafkaRecord| parse(record.payload()),
                async |tx: &mut St::Granted, record: &KafkaRecord, message: &M| {
                    let done = work(tx, message).await?;
                    // Last: the position's row is held until the commit.
                    if let Some(position) = partitions
                        .as_deref()
                        .and_then(|partitions| in_work(partitions, record))
                    {
                        St::store_position_in(tx, &position).await?;
                    }
                    Ok(done)
                },
                shutdown,
            )
            .await
    }
}

/// The outbox's publisher to Kafka: the idempotent producer
/// (`enable.idempotence`), each message to the topic its destination
/// names, its ordering key as the record key (so one account's events stay
/// in order on one partition; without one, its id), its id as the
/// `message-id` header, its headers as Kafka headers. Each delivery is
/// bounded (`message.timeout.ms`, 10 s unless set): a broker that is down
/// answers unavailable within it, and the relay says so and retries. A
/// producer that failed for good — a fatal error, its producer state lost
/// by a broker that restarted (`UnknownProducerId`), a delivery timed out —
/// is replaced by a new one for the next message. An unknown topic is
/// refused (kept). Kafka does not deduplicate a resend after a relay crash
/// — the idempotent producer only drops its own retries within a session —
/// so the consumer's record absorbs it.
///
/// # Examples
///
/// ```no_run
/// # fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use tower_idempotency_kafka::{KafkaPublisher, rdkafka::ClientConfig};
///
/// let publisher = KafkaPublisher::new(ClientConfig::new().set("bootstrap.servers", "127.0.0.1:9092"))?;
/// # let _ = publisher; Ok(()) }
/// ```
#[derive(Clone)]
pub struct KafkaPublisher {
    config: ClientConfig,
    /// The producer in use; replaced after a failure it cannot recover
    /// from.
    producer: Arc<Mutex<FutureProducer>>,
}

impl fmt::Debug for KafkaPublisher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KafkaPublisher").finish_non_exhaustive()
    }
}

impl KafkaPublisher {
    /// An idempotent producer configured by `config` (its brokers and
    /// security).
    ///
    /// # Errors
    ///
    /// The configuration's.
    ///
    /// # Examples
    ///
    /// See [`KafkaPublisher`].
    pub fn new(config: &ClientConfig) -> Result<Self, KafkaError> {
        let config = producer_config(config);
        Ok(Self {
            producer: Arc::new(Mutex::new(config.create()?)),
            config,
        })
    }

    /// Replaces `failed` (unless another message replaced it already) by a
    /// new producer: its successor starts a new idempotent session.
    fn replace(&self, failed: &FutureProducer, why: &KafkaError) {
        let mut producer = lock(&self.producer);
        if !std::ptr::eq(producer.client(), failed.client()) {
            return;
        }
        match self.config.create() {
            Ok(fresh) => {
                tracing::warn!(error = %why, "kafka: the producer failed for good; publishing through a new one");
                *producer = fresh;
            }
            Err(error) => {
                tracing::error!(%error, "kafka: a new producer could not be created; the failed one is kept");
            }
        }
    }
}

/// Whether a producer that failed with `error` must be replaced: a fatal
/// error, its idempotent session's state lost or fenced by the broker, or a
/// delivery that timed out (librdkafka keeps retrying the same sequence).
fn broken(producer: &FutureProducer, error: &KafkaError) -> bool {
    producer.client().fatal_error().is_some()
        || matches!(
            error.rdkafka_error_code(),
            Some(
                RDKafkaErrorCode::UnknownProducerId
                    | RDKafkaErrorCode::InvalidProducerEpoch
                    | RDKafkaErrorCode::OutOfOrderSequenceNumber
                    | RDKafkaErrorCode::InvalidProducerIdMapping
                    | RDKafkaErrorCode::ProducerFenced
                    | RDKafkaErrorCode::MessageTimedOut
                    | RDKafkaErrorCode::Fatal
            )
        )
}

impl Publisher for KafkaPublisher {
    async fn publish(&self, message: &OutboxMessage) -> Result<(), PublishError> {
        let mut headers = OwnedHeaders::new().insert(Header {
            key: "message-id",
            value: Some(message.id.as_str()),
        });
        for (name, value) in &message.headers {
            headers = headers.insert(Header {
                key: name.as_str(),
                value: Some(value.as_str()),
            });
        }
        let key = message.ordering_key.as_deref().unwrap_or(&message.id);
        let record = FutureRecord::to(&message.destination)
            .key(key)
            .payload(&message.payload)
            .headers(headers);
        let producer = lock(&self.producer).clone();
        match producer.send(record, Duration::from_secs(30)).await {
            Ok(_) => Ok(()),
            Err((KafkaError::MessageProduction(code), _))
                if matches!(
                    code,
                    RDKafkaErrorCode::UnknownTopicOrPartition
                        | RDKafkaErrorCode::UnknownTopic
                        | RDKafkaErrorCode::TopicAuthorizationFailed
                        | RDKafkaErrorCode::MessageSizeTooLarge
                        | RDKafkaErrorCode::InvalidTopic
                ) =>
            {
                Err(PublishError::Refused(format!(
                    "{}: {code}",
                    message.destination
                )))
            }
            Err((error, _)) => {
                if broken(&producer, &error) {
                    self.replace(&producer, &error);
                }
                Err(PublishError::Unavailable(error.into()))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn configured(settings: &[(&str, &str)]) -> Result<ClientConfig, StartError> {
        let mut config = ClientConfig::new();
        for (key, value) in settings {
            config.set(*key, *value);
        }
        consumer_config(&mut config).map(|()| config)
    }

    /// A partition keeps fetching while the loop works what it holds: its
    /// pause stays well above the loop's records in hand.
    #[test]
    fn a_partition_is_paused_at_four_times_the_records_in_hand() {
        assert_eq!(paused_at(10), 1000, "the default's");
        assert_eq!(paused_at(1000), 4000);
        assert_eq!(paused_at(usize::MAX), usize::MAX);
    }

    #[test]
    fn the_classic_protocol_gets_a_session_timeout_unless_one_is_set() {
        let config = configured(&[]).unwrap();
        assert_eq!(config.get("session.timeout.ms"), Some("10000"));
        assert_eq!(config.get("enable.auto.commit"), Some("false"));
        let config = configured(&[("session.timeout.ms", "6000")]).unwrap();
        assert_eq!(config.get("session.timeout.ms"), Some("6000"));
    }

    #[test]
    fn kip_848_gets_no_session_timeout_and_refuses_what_it_leaves_to_the_broker() {
        let config = configured(&[("group.protocol", "consumer")]).unwrap();
        assert_eq!(config.get("session.timeout.ms"), None);
        assert_eq!(config.get("enable.auto.offset.store"), Some("false"));
        for setting in CLASSIC_ONLY {
            let refused = configured(&[("group.protocol", "consumer"), (setting, "1")]);
            match refused {
                Err(StartError::Setting { setting: named, .. }) => assert_eq!(named, setting),
                other => panic!("{setting}: {:?}", other.map(|_| ())),
            }
        }
    }

    /// librdkafka itself refuses the session timeout under KIP-848: what
    /// the adapter used to set made the protocol unusable.
    #[test]
    fn librdkafka_accepts_the_kip_848_configuration() {
        let mut config = configured(&[
            ("group.protocol", "consumer"),
            ("group.id", "ledger"),
            ("bootstrap.servers", "127.0.0.1:1"),
        ])
        .unwrap();
        let created: Result<BaseConsumer, _> = config.create();
        assert!(created.is_ok(), "{:?}", created.err());
        config.set("session.timeout.ms", "10000");
        let refused: Result<BaseConsumer, _> = config.create();
        assert!(
            refused.is_err(),
            "librdkafka refuses it, as the adapter must not set it"
        );
    }
}
