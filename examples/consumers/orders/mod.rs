//! What the orders consumers share, whatever their broker (`orders_consumer`
//! on RabbitMQ, `sqs_orders`, `nats_orders`, `kafka_orders`): the order
//! message, the ledger it is charged in (SQLite, PostgreSQL or MySQL, the
//! idempotency record in the charge's transaction), the work, and the line
//! each delivery gets on stdout. The loop is the library's
//! (`message::Consumer`); each broker's adapter is its crate's.
#![allow(dead_code)]

#[path = "../../support/startup.rs"]
mod startup;

use std::{borrow::Cow, env, io::Write, time::Duration};

use serde::{Deserialize, Serialize};
use tower_idempotency::{
    IdempotencyKey, MySqlStore, MySqlTxStore, PostgresStore, PostgresTxStore, SqliteStore,
    SqliteTxStore,
    message::{
        Acked, Broker, BrokerError, Consumer, DeadLetterReason, DeadLettered, DeliveryBudget,
        Disposition, ExtendError, IdempotencyProcessor, Parsed, ProcessOutcome, Report,
    },
    sqlx::{self, error::ErrorKind},
    store::{Store, StoreError},
};

/// A message: `{"order_id": string, "amount": integer > 0, "currency":
/// string}`; the order id is the business key.
#[derive(Deserialize, Serialize)]
pub struct Order {
    pub order_id: String,
    pub amount: i64,
    pub currency: String,
}

/// An order as the work needs it: JSON of the right shape, a positive
/// amount, text without NUL (PostgreSQL refuses it, SQLite would store it:
/// the order is invalid either way), and an order id that is a valid key.
pub fn order(data: &[u8]) -> Result<Order, String> {
    let order: Order = serde_json::from_slice(data).map_err(|e| e.to_string())?;
    if order.amount <= 0 {
        return Err("amount must be positive".into());
    }
    if order.order_id.contains('\0') || order.currency.contains('\0') {
        return Err("a text field holds U+0000".into());
    }
    IdempotencyKey::new(&order.order_id).map_err(|e| format!("order_id: {e}"))?;
    Ok(order)
}

/// The settings every consumer reads.
pub struct Settings {
    /// `DATABASE_URL`: `sqlite://PATH`, `postgres://…` or `mysql://…`
    /// (required).
    pub database_url: String,
    /// `WORK_DELAY_MS` (default 0): how long the work takes after
    /// inserting its row, before its commit — the payment processor;
    /// `WORK_DELAY_ORDERS` (comma-separated order ids; default every
    /// order): the orders it delays.
    pub work_delay: WorkDelay,
    /// `ACK_DELAY_MS` (default 0): a pause between the commit and the
    /// acknowledgement, to widen that crash window.
    pub ack_delay: Duration,
    /// `IDEMPOTENCY_LEASE_MS` (default 30000).
    pub lease: Duration,
    /// `IDEMPOTENCY_TX_TIMEOUT_MS` (default 30000): the bound on the work's
    /// transaction. Work that outlives it on three attempts is
    /// dead-lettered.
    pub tx_timeout: Duration,
}

/// The database a `DATABASE_URL` names, by its scheme.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Database {
    Sqlite,
    Postgres,
    MySql,
}

impl Database {
    /// The database `url` names, or why it names none: a typo must read as
    /// a typo, not as an outage.
    pub fn of(url: &str) -> Result<Self, String> {
        let scheme = url.split_once(':').map_or("", |(scheme, _)| scheme);
        match scheme {
            "sqlite" => Ok(Self::Sqlite),
            "postgres" | "postgresql" => Ok(Self::Postgres),
            "mysql" | "mariadb" => Ok(Self::MySql),
            _ => Err(format!(
                "DATABASE_URL: unknown scheme {scheme:?}: use sqlite://PATH, postgres://… or mysql://…"
            )),
        }
    }
}

impl Settings {
    pub fn from_env() -> Result<Self, String> {
        let lease = millis("IDEMPOTENCY_LEASE_MS", 30_000)?;
        if !(Duration::from_millis(30)..=tower_idempotency::MAX_LEASE).contains(&lease) {
            return Err("IDEMPOTENCY_LEASE_MS must be from 30 to 86400000".into());
        }
        let tx_timeout = millis("IDEMPOTENCY_TX_TIMEOUT_MS", 30_000)?;
        if tx_timeout < Duration::from_millis(100) {
            return Err("IDEMPOTENCY_TX_TIMEOUT_MS must be at least 100".into());
        }
        let database_url = env::var("DATABASE_URL").map_err(|_| {
            "DATABASE_URL is required, e.g. sqlite://orders.db, postgres://postgres@127.0.0.1:5432/orders or mysql://root@127.0.0.1:3306/orders"
                .to_owned()
        })?;
        Database::of(&database_url)?;
        Ok(Self {
            database_url,
            work_delay: WorkDelay {
                delay: millis("WORK_DELAY_MS", 0)?,
                only: env::var("WORK_DELAY_ORDERS")
                    .ok()
                    .map(|ids| ids.split(',').map(str::to_owned).collect()),
            },
            ack_delay: millis("ACK_DELAY_MS", 0)?,
            lease,
            tx_timeout,
        })
    }
}

/// How long the payment processor takes, and for which orders (default:
/// no time).
#[derive(Clone, Default)]
pub struct WorkDelay {
    delay: Duration,
    only: Option<Vec<String>>,
}

impl WorkDelay {
    fn of(&self, order: &Order) -> Duration {
        match &self.only {
            Some(ids) if !ids.contains(&order.order_id) => Duration::ZERO,
            _ => self.delay,
        }
    }
}

/// A duration in milliseconds from the environment.
pub fn millis(name: &str, default: u64) -> Result<Duration, String> {
    match env::var(name) {
        Err(_) => Ok(Duration::from_millis(default)),
        Ok(v) => v
            .parse()
            .map(Duration::from_millis)
            .map_err(|_| format!("{name} must be a whole number of milliseconds, got {v:?}")),
    }
}

/// What a broker's example says of its consumer: how a delivery is spent
/// (its hold's hard end, if any), and how an invalid message is named on
/// its `invalid …` line.
pub struct Example<B: Broker> {
    pub broker: B,
    pub scope: &'static str,
    pub budget: DeliveryBudget,
    pub invalid: fn(&B::Received) -> String,
    /// The first line on stdout, once the ledger is open and the loop
    /// about to receive (`receiving from …`).
    pub ready: String,
}

/// What runs over the ledger, once it is open: a broker's consumer.
pub trait OnLedger {
    fn run<St: Ledger>(
        self,
        store: St,
        settings: Settings,
    ) -> impl Future<Output = Result<(), BrokerError>>;
}

/// Opens the ledger `DATABASE_URL` names (its tables created if missing)
/// and runs `consumer` over it. A broker that ends the subscription is
/// exit 2, saying why.
pub async fn with_ledger<C: OnLedger>(consumer: C, settings: Settings) {
    // The URLs may carry passwords: they are never logged.
    let url = settings.database_url.clone();
    let bound = settings.tx_timeout;
    // The ledger on `$store`'s engine: one transaction per order, bounded.
    macro_rules! on {
        ($store:ty) => {{
            let builder = <$store>::builder()
                .transactional()
                .create_table_if_missing()
                .transaction_timeout(bound);
            let store = open(async || builder.clone().connect(&url).await).await;
            consumer.run(store, settings).await
        }};
    }
    let ended = match Database::of(&url).unwrap_or_else(|why| exit_with(&why)) {
        Database::Sqlite => on!(SqliteStore),
        Database::MySql => on!(MySqlStore),
        Database::Postgres => on!(PostgresStore),
    };
    if let Err(error) = ended {
        exit_with(&error.to_string());
    }
}

/// The library's consumer loop over `example.broker` until SIGTERM, over
/// the ledger `DATABASE_URL` names: one line per delivery on stdout.
pub async fn consume<B: Broker>(example: Example<B>, settings: Settings) {
    with_ledger(example, settings).await
}

impl<B: Broker> OnLedger for Example<B> {
    async fn run<St: Ledger>(self, store: St, settings: Settings) -> Result<(), BrokerError> {
        let orders = processor(store, self.scope, &settings).budget(self.budget);
        say(&self.ready);
        let invalid = self.invalid;
        let broker = AckDelay {
            broker: self.broker,
            delay: settings.ack_delay,
        };
        Consumer::new(broker, orders)
            .passing_when(passing)
            .on_settled(move |report| {
                if let Some(line) = line(report, invalid) {
                    say(&line);
                }
            })
            .run(
                parse,
                charging::<St>(settings.work_delay.clone()),
                sigterm(),
            )
            .await
    }
}

/// The processor over the ledger, as every consumer configures it.
pub fn processor<St: Ledger>(
    store: St,
    scope: &'static str,
    settings: &Settings,
) -> IdempotencyProcessor<St> {
    IdempotencyProcessor::new(store)
        .scope(scope)
        .lease(settings.lease)
}

/// The work: the order's charge in the claim's transaction, then the
/// payment processor (`WORK_DELAY_MS`), before the commit.
pub fn charging<St: Ledger>(
    work_delay: WorkDelay,
) -> impl AsyncFn(&mut St::Granted, &Order) -> Result<String, sqlx::Error> {
    async move |tx: &mut St::Granted, order: &Order| {
        St::charge(tx, order).await?;
        let delay = work_delay.of(order);
        // Even a zero sleep waits for the timer's next millisecond tick.
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        Ok::<_, sqlx::Error>(format!("charged {} {}", order.amount, order.currency))
    }
}

/// Data the database refuses is refused on every attempt; anything else
/// may pass.
pub fn passing(error: &sqlx::Error) -> bool {
    !refuses_the_data(error)
}

/// Resolves at SIGTERM.
pub fn sigterm() -> impl Future<Output = ()> + Send {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .unwrap_or_else(|e| exit_with(&format!("listening for SIGTERM: {e}")));
    async move {
        term.recv().await;
    }
}

/// A delivery's line: `executed|duplicate|rejected|refused|undecided
/// <order_id>`, or `invalid <the broker's name for it>`; none for a
/// delivery given back undecided (delivered again).
pub fn line<R, M, E>(
    report: &Report<'_, R, M, String, E>,
    invalid: fn(&R) -> String,
) -> Option<String> {
    let Some(parsed) = report.parsed else {
        // Unread: invalid, or given back at a stop.
        return match report.disposition {
            Disposition::Retry { .. } => None,
            _ => Some(format!("invalid {}", invalid(report.received))),
        };
    };
    let word = match (report.disposition, report.outcome) {
        (Disposition::Ack, Some(Ok(ProcessOutcome::Executed(_)))) => "executed",
        (Disposition::Ack, _) => "duplicate",
        (Disposition::DeadLetter(reason), _) => {
            tracing::error!(order = %parsed.key, %reason, "the order can never be processed: dead-lettered");
            match reason {
                DeadLetterReason::Mismatch | DeadLetterReason::TimedOut { .. } => "rejected",
                DeadLetterReason::Undecided(_) => "undecided",
                _ => "refused",
            }
        }
        (Disposition::Retry { .. }, _) => return None,
    };
    Some(format!("{word} {}", parsed.key))
}

/// An order as the loop reads it: its key is its order id.
pub fn parse(data: &[u8]) -> Result<Parsed<Order>, DeadLetterReason> {
    match order(data) {
        Ok(order) => Ok(Parsed {
            key: order.order_id.clone(),
            message: order,
        }),
        Err(why) => {
            tracing::warn!(%why, "invalid order message");
            Err(DeadLetterReason::invalid(why))
        }
    }
}

/// The broker, with `ACK_DELAY_MS` between a delivery's settling (its
/// commit) and its acknowledgement: the crash window a redelivery finds
/// the record in, widened for the tests.
struct AckDelay<B> {
    broker: B,
    delay: Duration,
}

impl<B: Broker> Broker for AckDelay<B> {
    type Received = B::Received;

    fn system(&self) -> &'static str {
        self.broker.system()
    }

    fn destination(&self) -> &str {
        self.broker.destination()
    }

    fn receive(
        &self,
        room: usize,
        within: Duration,
    ) -> impl Future<Output = Result<Vec<B::Received>, BrokerError>> + Send {
        self.broker.receive(room, within)
    }

    fn receive_is_cancel_safe(&self) -> bool {
        self.broker.receive_is_cancel_safe()
    }

    fn stop_receiving(&self) -> impl Future<Output = ()> + Send {
        self.broker.stop_receiving()
    }

    fn hold_interval(&self) -> Option<Duration> {
        self.broker.hold_interval()
    }

    fn extend(
        &self,
        received: &B::Received,
    ) -> impl Future<Output = Result<(), ExtendError>> + Send {
        self.broker.extend(received)
    }

    fn ordering_key<'a>(&self, received: &'a B::Received) -> Option<Cow<'a, str>> {
        self.broker.ordering_key(received)
    }

    async fn ack(&self, received: &B::Received, acked: Acked) -> Result<(), BrokerError> {
        // Even a zero sleep waits for the timer's next millisecond tick.
        if !self.delay.is_zero() {
            tokio::time::sleep(self.delay).await;
        }
        self.broker.ack(received, acked).await
    }

    fn owns(&self, received: &B::Received) -> bool {
        self.broker.owns(received)
    }

    fn give_back(
        &self,
        received: &B::Received,
        after: Duration,
    ) -> impl Future<Output = Result<(), BrokerError>> + Send {
        self.broker.give_back(received, after)
    }

    fn dead_letter(
        &self,
        received: &B::Received,
        reason: &DeadLetterReason,
    ) -> impl Future<Output = Result<DeadLettered, BrokerError>> + Send {
        self.broker.dead_letter(received, reason)
    }

    fn close(&self) -> impl Future<Output = ()> + Send {
        self.broker.close()
    }
}

/// The store `connect` opens, with the idempotency table and
/// `order_charges` created if missing — connected again with back-off
/// while the database is out of reach (a restart, a connection dropped
/// while starting), for a bound; exit 2 on a configuration mistake or once
/// the bound has passed.
async fn open<St: Ledger>(connect: impl AsyncFn() -> Result<St, StoreError>) -> St {
    startup::retrying("DATABASE_URL", async || {
        let store = connect().await?;
        St::create_tables(&store).await?;
        Ok(store)
    })
    .await
    .unwrap_or_else(|e| exit_with(&format!("DATABASE_URL: {e}")))
}

/// A transactional store the orders are charged in (and, for Kafka, its
/// positions kept).
pub trait Ledger: Store + Clone + tower_idempotency_kafka::Positions {
    fn create_tables(&self) -> impl Future<Output = Result<(), Box<dyn std::error::Error>>>;
    /// Inserts the order's charge in the claim's transaction.
    fn charge(
        tx: &mut Self::Granted,
        order: &Order,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;
}

impl Ledger for PostgresTxStore {
    async fn create_tables(&self) -> Result<(), Box<dyn std::error::Error>> {
        // `CREATE TABLE IF NOT EXISTS` races itself: consumers started
        // together on a new database take turns on an advisory lock.
        sqlx::raw_sql(
            "BEGIN;
            SELECT pg_advisory_xact_lock(hashtext('orders example schema'));
            CREATE TABLE IF NOT EXISTS order_charges (
                order_id text NOT NULL, amount bigint NOT NULL, currency text NOT NULL,
                charged_at timestamptz NOT NULL DEFAULT now());
            COMMIT",
        )
        .execute(self.pool())
        .await?;
        Ok(())
    }

    async fn charge(tx: &mut Self::Granted, order: &Order) -> Result<(), sqlx::Error> {
        sqlx::query("INSERT INTO order_charges (order_id, amount, currency) VALUES ($1, $2, $3)")
            .bind(&order.order_id)
            .bind(order.amount)
            .bind(&order.currency)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }
}

impl Ledger for SqliteTxStore {
    async fn create_tables(&self) -> Result<(), Box<dyn std::error::Error>> {
        sqlx::raw_sql(
            "CREATE TABLE IF NOT EXISTS order_charges (
                order_id TEXT NOT NULL, amount INTEGER NOT NULL, currency TEXT NOT NULL,
                charged_at TEXT NOT NULL DEFAULT CURRENT_TIMESTAMP)",
        )
        .execute(self.pool())
        .await?;
        Ok(())
    }

    async fn charge(tx: &mut Self::Granted, order: &Order) -> Result<(), sqlx::Error> {
        sqlx::query("INSERT INTO order_charges (order_id, amount, currency) VALUES (?1, ?2, ?3)")
            .bind(&order.order_id)
            .bind(order.amount)
            .bind(&order.currency)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }
}

impl Ledger for MySqlTxStore {
    async fn create_tables(&self) -> Result<(), Box<dyn std::error::Error>> {
        sqlx::raw_sql(
            "CREATE TABLE IF NOT EXISTS order_charges (
                order_id VARCHAR(255) NOT NULL, amount BIGINT NOT NULL, currency VARCHAR(16) NOT NULL,
                charged_at TIMESTAMP(3) NOT NULL DEFAULT CURRENT_TIMESTAMP(3)) ENGINE = InnoDB",
        )
        .execute(self.pool())
        .await?;
        Ok(())
    }

    async fn charge(tx: &mut Self::Granted, order: &Order) -> Result<(), sqlx::Error> {
        sqlx::query("INSERT INTO order_charges (order_id, amount, currency) VALUES (?, ?, ?)")
            .bind(&order.order_id)
            .bind(order.amount)
            .bind(&order.currency)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }
}

/// Whether the database refused the order's data itself, which no
/// redelivery changes: a constraint it breaks, or (PostgreSQL's SQLSTATE
/// class 22) data it cannot store. Anything else — a lost connection, a
/// deadlock, a serialization failure — may pass next time.
fn refuses_the_data(error: &sqlx::Error) -> bool {
    let Some(error) = error.as_database_error() else {
        return false;
    };
    let data_exception = error
        .code()
        .is_some_and(|code| code.len() == 5 && code.starts_with("22"));
    data_exception || !matches!(error.kind(), ErrorKind::Other)
}

/// One line per delivery on stdout, flushed at once (tests read it).
pub fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// Logging to stderr, `RUST_LOG` or `info` for the example and the crate.
pub fn init_tracing(example: &str) {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| format!("{example}=info,tower_idempotency=info").into()),
        )
        .init();
}

/// Exits with status 2 and `message` on stderr, so a supervisor restarts
/// the consumer.
pub fn exit_with(message: &str) -> ! {
    let name = env::args()
        .next()
        .and_then(|p| p.rsplit('/').next().map(str::to_owned))
        .unwrap_or_default();
    eprintln!("{name}: {message}");
    std::process::exit(2)
}
