//! The deployment under test: N `payments` example processes on one store,
//! each behind a relay the nemesis can cut, stall or make lose answers, the
//! store itself behind one too; and the ledger the effects are read back
//! from.

use std::{
    io::{BufRead, BufReader},
    os::unix::process::CommandExt,
    path::PathBuf,
    process::{Child, Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use tower_idempotency::sqlx::{self, Connection};
use tower_idempotency_harness::{
    cluster::RedisCluster, dynamodb, mysql, postgres, redis_server::RedisServer, relay::Relay,
    sqlite::TestFile, tmpfs::Tmpfs,
};

use crate::history::Effect;

/// Which store the deployment runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreKind {
    /// One SQLite file, several processes on it.
    Sqlite,
    Postgres,
    MySql,
    /// Records in Redis, charges in a SQLite file, each under its
    /// downstream key.
    Redis,
    /// As `Redis`, on Valkey 9: every fenced write a plain command.
    Valkey,
    /// Redis, the charges without a downstream key: the documented window
    /// of a lease store, measured.
    RedisNoDownstreamKey,
    /// A Redis Cluster of three masters, each with a replica (its masters
    /// killed, their replicas promoted); charges as `Redis`.
    RedisCluster,
    /// DynamoDB (a dynoxide server behind its relay): each charge an item
    /// written in the request's own `TransactWriteItems` (the example built
    /// with its `dynamodb` feature).
    DynamoDb,
}

impl StoreKind {
    pub fn parse(name: &str) -> Option<Self> {
        Some(match name {
            "sqlite" => Self::Sqlite,
            "postgres" => Self::Postgres,
            "mysql" => Self::MySql,
            "redis" => Self::Redis,
            "valkey" => Self::Valkey,
            "redis-no-downstream-key" => Self::RedisNoDownstreamKey,
            "redis-cluster" => Self::RedisCluster,
            "dynamodb" => Self::DynamoDb,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Sqlite => "sqlite",
            Self::Postgres => "postgres",
            Self::MySql => "mysql",
            Self::Redis => "redis",
            Self::Valkey => "valkey",
            Self::RedisNoDownstreamKey => "redis-no-downstream-key",
            Self::RedisCluster => "redis-cluster",
            Self::DynamoDb => "dynamodb",
        }
    }

    /// Whether the store answers over one link (its relay can be cut): a
    /// cluster's clients follow its nodes' own addresses.
    pub fn networked(self) -> bool {
        !matches!(self, Self::Sqlite | Self::RedisCluster)
    }
}

/// The store the instances share, kept alive for the run.
enum Store {
    /// The file, on its own small disk where one can be mounted (root):
    /// it can then be filled up.
    Sqlite(TestFile, Option<Tmpfs>),
    Postgres(postgres::TestDatabase),
    MySql(mysql::TestDatabase),
    /// The server, held for the run; the charges' file.
    Redis(#[allow(dead_code)] RedisServer, TestFile),
    /// The cluster; the charges' file.
    Cluster(RedisCluster, TestFile),
    /// The server, and the records' table (the charges' is beside it).
    DynamoDb(dynamodb::DynamoServer, String),
}

/// One `payments` process, behind its relay.
pub struct Instance {
    pub port: u16,
    pub relay: Relay,
    child: Option<Child>,
    pub paused: bool,
    /// How many answers it held after their commit (`committed <key>` on
    /// its stdout, while [`Deployment::hold_answers`] is on).
    committed: Arc<AtomicUsize>,
}

pub struct Deployment {
    pub kind: StoreKind,
    pub instances: Vec<Instance>,
    store: Store,
    /// Between the instances and a networked store.
    pub store_relay: Option<Relay>,
    /// The SQLite file's own disk, to fill up.
    pub disk: Option<std::path::PathBuf>,
    env: Vec<(String, String)>,
    binary: PathBuf,
    /// The lease the instances run with.
    pub lease: Duration,
    /// What the last instance that would not start said last.
    last_start_error: String,
    /// While this file exists, the instances hold each first execution's
    /// answer after its commit (the example's `ANSWER_HOLD_FILE`).
    answer_hold: PathBuf,
}

impl Deployment {
    /// Starts `instances` processes of the example at `binary` on a fresh
    /// store of `kind`.
    pub async fn start(kind: StoreKind, instances: usize, binary: PathBuf) -> Self {
        let lease = Duration::from_millis(1500);
        let (store, upstream) = match kind {
            StoreKind::Sqlite => {
                let disk = running_as_root().then(|| Tmpfs::mount(64 << 20));
                (Store::Sqlite(TestFile::create(), disk), None)
            }
            StoreKind::Postgres => {
                let db = postgres::TestDatabase::create();
                let upstream = db.host_port();
                (Store::Postgres(db), Some(upstream))
            }
            StoreKind::MySql => {
                let db = mysql::TestDatabase::create();
                let upstream = db.host_port();
                (Store::MySql(db), Some(upstream))
            }
            StoreKind::Redis | StoreKind::RedisNoDownstreamKey | StoreKind::Valkey => {
                let redis = match kind {
                    StoreKind::Valkey => RedisServer::valkey(),
                    _ => RedisServer::start(),
                };
                let upstream = redis.url().trim_start_matches("redis://").to_owned();
                (Store::Redis(redis, TestFile::create()), Some(upstream))
            }
            StoreKind::RedisCluster => (
                Store::Cluster(RedisCluster::start(3, 1), TestFile::create()),
                None,
            ),
            StoreKind::DynamoDb => {
                let server = dynamodb::DynamoServer::start();
                let upstream = format!("127.0.0.1:{}", server.port());
                (
                    Store::DynamoDb(server, dynamodb::table_name()),
                    Some(upstream),
                )
            }
        };
        let store_relay = match &upstream {
            Some(upstream) => Some(Relay::start(upstream).await),
            None => None,
        };
        let via = store_relay.as_ref().map(Relay::port);
        let answer_hold = std::env::temp_dir().join(format!(
            "tower-idempotency-verify-answer-hold-{}-{}",
            std::process::id(),
            listen_port()
        ));
        let mut env = vec![
            (
                "ANSWER_HOLD_FILE".to_owned(),
                answer_hold.display().to_string(),
            ),
            ("RUST_LOG".to_owned(), "off".to_owned()),
            ("PROCESSOR_LATENCY_MS".to_owned(), "30".to_owned()),
            (
                "IDEMPOTENCY_LEASE_MS".to_owned(),
                lease.as_millis().to_string(),
            ),
            ("IDEMPOTENCY_TX_TIMEOUT_MS".to_owned(), "3000".to_owned()),
            ("REQUEST_TIMEOUT_MS".to_owned(), "5000".to_owned()),
        ];
        let mut disk = None;
        match &store {
            Store::Sqlite(file, None) => env.push(("DATABASE_URL".into(), file.url())),
            Store::Sqlite(_, Some(tmpfs)) => {
                let url = format!("sqlite://{}/payments.db", tmpfs.path().display());
                env.push(("DATABASE_URL".into(), url));
                disk = Some(tmpfs.path().to_owned());
            }
            Store::Postgres(db) => {
                env.push(("DATABASE_URL".into(), db.url_via(via.unwrap())));
            }
            Store::MySql(db) => env.push(("DATABASE_URL".into(), db.url_via(via.unwrap()))),
            Store::Redis(_, file) => {
                env.push((
                    "REDIS_URL".into(),
                    format!("redis://127.0.0.1:{}", via.unwrap()),
                ));
                env.push(("DATABASE_URL".into(), file.url()));
                if kind == StoreKind::RedisNoDownstreamKey {
                    env.push(("DOWNSTREAM_KEY".into(), "off".into()));
                }
            }
            Store::Cluster(cluster, file) => {
                env.push(("REDIS_CLUSTER_NODES".into(), cluster.urls().join(",")));
                env.push(("DATABASE_URL".into(), file.url()));
            }
            Store::DynamoDb(server, table) => {
                for (name, value) in server.env() {
                    env.push((name.into(), value));
                }
                // Through the relay: the store's link can be cut.
                env.retain(|(name, _)| name != "AWS_ENDPOINT_URL");
                env.push((
                    "AWS_ENDPOINT_URL".into(),
                    format!("http://127.0.0.1:{}", via.unwrap()),
                ));
                env.push(("DYNAMODB_TABLE".into(), table.clone()));
            }
        }
        let mut deployment = Self {
            kind,
            instances: Vec::new(),
            store,
            store_relay,
            disk,
            env,
            binary,
            lease,
            last_start_error: String::new(),
            answer_hold,
        };
        // The first creates the tables; the others start together.
        for _ in 0..instances {
            let port = listen_port();
            let relay = Relay::start(&format!("127.0.0.1:{port}")).await;
            deployment.instances.push(Instance {
                port,
                relay,
                child: None,
                paused: false,
                committed: Arc::new(AtomicUsize::new(0)),
            });
        }
        for i in 0..instances {
            deployment.spawn(i, None);
        }
        deployment
    }

    /// The addresses clients send to: each instance's relay.
    pub fn addrs(&self) -> Vec<String> {
        self.instances
            .iter()
            .map(|i| format!("127.0.0.1:{}", i.relay.port()))
            .collect()
    }

    /// Starts instance `i` (again), optionally under `faketime` with a
    /// clock offset; waits until it listens. An instance that exits at
    /// start-up (its store out of reach: it refuses to start without it)
    /// is started again, as a supervisor would, for up to a minute.
    pub fn spawn(&mut self, i: usize, clock_offset: Option<&str>) {
        for attempt in 1.. {
            if self.try_spawn(i, clock_offset) {
                return;
            }
            assert!(
                attempt < 120,
                "the payments example would not start for a minute; its last words: {}",
                self.last_start_error
            );
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    fn try_spawn(&mut self, i: usize, clock_offset: Option<&str>) -> bool {
        let port = self.instances[i].port;
        let mut command = match clock_offset {
            Some(offset) => {
                let mut c = Command::new("faketime");
                c.arg("-f").arg(offset).arg(&self.binary);
                c
            }
            None => Command::new(&self.binary),
        };
        // A group of its own: `faketime` runs the example as its child, so
        // signals go to the group, never to the wrapper alone.
        let mut child = command
            .process_group(0)
            .env("BIND_ADDR", format!("127.0.0.1:{port}"))
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", self.binary.display()));
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut stderr = child.stderr.take().unwrap();
        let mut line = String::new();
        loop {
            line.clear();
            if stdout.read_line(&mut line).unwrap_or(0) == 0 {
                let _ = child.wait();
                let mut said = String::new();
                let _ = std::io::Read::read_to_string(&mut stderr, &mut said);
                self.last_start_error = said.lines().last().unwrap_or_default().to_owned();
                return false;
            }
            if line.starts_with("listening on") {
                break;
            }
        }
        let committed = self.instances[i].committed.clone();
        std::thread::spawn(move || {
            for line in stdout.lines().map_while(Result::ok) {
                if line.starts_with("committed ") {
                    committed.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
        std::thread::spawn(move || std::io::copy(&mut stderr, &mut std::io::sink()));
        self.instances[i].child = Some(child);
        self.instances[i].paused = false;
        true
    }

    /// Whether the instances hold each first execution's answer after its
    /// commit (for 3 s, saying so on their stdout).
    pub fn hold_answers(&self, on: bool) {
        if on {
            std::fs::write(&self.answer_hold, b"").expect("the answer-hold file");
        } else {
            let _ = std::fs::remove_file(&self.answer_hold);
        }
    }

    /// How many answers each instance has held after their commit so far.
    pub fn committed(&self) -> Vec<usize> {
        self.instances
            .iter()
            .map(|i| i.committed.load(Ordering::Relaxed))
            .collect()
    }

    /// `kill -9` instance `i` (its process group: the example, and the
    /// `faketime` wrapper around it if any).
    pub fn kill(&mut self, i: usize) {
        if let Some(mut child) = self.instances[i].child.take() {
            signal_group(&child, "KILL");
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// `SIGSTOP` (or `SIGCONT`) instance `i`.
    pub fn pause(&mut self, i: usize, paused: bool) {
        if let Some(child) = &self.instances[i].child {
            signal_group(child, if paused { "STOP" } else { "CONT" });
            self.instances[i].paused = paused;
        }
    }

    pub fn is_running(&self, i: usize) -> bool {
        self.instances[i].child.is_some()
    }

    /// Ends every PostgreSQL or MySQL session of the database but the
    /// caller's: the instances' connections die mid-transaction.
    pub async fn terminate_sessions(&self) -> bool {
        match &self.store {
            Store::Postgres(db) => {
                let mut admin = db.connect().await;
                sqlx::raw_sql(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                     WHERE datname = current_database() AND pid <> pg_backend_pid()",
                )
                .execute(&mut admin)
                .await
                .is_ok()
            }
            Store::MySql(db) => {
                let mut admin = db.connect().await;
                let ids: Vec<u64> = sqlx::query_scalar(
                    "SELECT id FROM information_schema.PROCESSLIST WHERE db = DATABASE() AND id <> CONNECTION_ID()",
                )
                .fetch_all(&mut admin)
                .await
                .unwrap_or_default();
                for id in ids {
                    let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!("KILL {id}")))
                        .execute(&mut admin)
                        .await;
                }
                true
            }
            _ => false,
        }
    }

    /// Kills one of the cluster's masters (`kill -9`); its port.
    pub fn kill_master(&mut self, rng: &mut fastrand::Rng) -> Option<u16> {
        let Store::Cluster(cluster, _) = &mut self.store else {
            return None;
        };
        let masters = cluster.master_ports();
        let port = *masters.get(rng.usize(..masters.len().max(1)))?;
        cluster.node_mut(port).kill();
        Some(port)
    }

    /// Starts the cluster's killed nodes again (they rejoin as replicas)
    /// and waits until three masters serve every slot.
    pub fn heal_cluster(&mut self) {
        if let Store::Cluster(cluster, _) = &mut self.store {
            // The harness waits by sleeping: off the runtime's workers.
            tokio::task::block_in_place(|| {
                for node in cluster.nodes.iter_mut().filter(|n| !n.is_running()) {
                    node.restart();
                }
                cluster.wait_for_masters(3, Duration::from_secs(30));
            });
        }
    }

    /// Heals everything: relays open, paused instances resumed, killed ones
    /// started again.
    pub fn heal(&mut self) {
        if let Some(relay) = &self.store_relay {
            relay.restore();
        }
        self.heal_cluster();
        for i in 0..self.instances.len() {
            self.instances[i].relay.restore();
            if self.instances[i].paused {
                self.pause(i, false);
            }
            if !self.is_running(i) {
                self.spawn(i, None);
            }
        }
    }

    /// The SQLite file's URL.
    fn sqlite_url(&self) -> String {
        self.env
            .iter()
            .find(|(k, _)| k == "DATABASE_URL")
            .map(|(_, v)| v.clone())
            .unwrap_or_default()
    }

    /// Every charge the ledger holds.
    pub async fn effects(&self) -> Vec<Effect> {
        if let Store::DynamoDb(server, table) = &self.store {
            return dynamodb_effects(server, table).await;
        }
        let query = "SELECT id, account, amount, description FROM charges";
        let rows: Vec<(String, String, i64, Option<String>)> = match &self.store {
            Store::Sqlite(..) | Store::Redis(..) | Store::Cluster(..) => {
                let Ok(mut on) = sqlx::SqliteConnection::connect(&self.sqlite_url()).await else {
                    return Vec::new();
                };
                sqlx::query_as(query)
                    .fetch_all(&mut on)
                    .await
                    .unwrap_or_default()
            }
            Store::Postgres(db) => sqlx::query_as(query)
                .fetch_all(&mut db.connect().await)
                .await
                .unwrap(),
            Store::MySql(db) => sqlx::query_as(query)
                .fetch_all(&mut db.connect().await)
                .await
                .unwrap(),
            Store::DynamoDb(..) => unreachable!("read above"),
        };
        rows.into_iter()
            .map(|(id, account, amount, key)| Effect {
                id,
                account,
                amount,
                key: key.unwrap_or_default(),
            })
            .collect()
    }
}

/// Every charge item beside the records' `table` (a consistent scan).
async fn dynamodb_effects(server: &dynamodb::DynamoServer, table: &str) -> Vec<Effect> {
    use tower_idempotency::aws_sdk_dynamodb::types::AttributeValue;
    let client = server.client();
    let mut pages = client
        .scan()
        .table_name(format!("{table}_charges"))
        .consistent_read(true)
        .into_paginator()
        .send();
    let text = |item: &std::collections::HashMap<String, AttributeValue>, name: &str| {
        item.get(name)
            .and_then(|v| v.as_s().ok())
            .cloned()
            .unwrap_or_default()
    };
    let mut effects = Vec::new();
    while let Some(page) = pages.next().await {
        let Ok(page) = page else { return effects };
        for item in page.items() {
            effects.push(Effect {
                id: text(item, "id"),
                account: text(item, "account"),
                amount: item
                    .get("amount")
                    .and_then(|v| v.as_n().ok())
                    .and_then(|n| n.parse().ok())
                    .unwrap_or_default(),
                key: text(item, "description"),
            });
        }
    }
    effects
}

impl Drop for Deployment {
    fn drop(&mut self) {
        self.hold_answers(false);
        for i in 0..self.instances.len() {
            self.pause(i, false);
            self.kill(i);
        }
    }
}

fn running_as_root() -> bool {
    std::process::Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.starts_with(b"0"))
}

/// A free port below the kernel's ephemeral range: an instance restarted
/// after a kill finds its port still free, where one the kernel hands out
/// may meanwhile be the source port of some outgoing connection.
fn listen_port() -> u16 {
    loop {
        let port = fastrand::u16(20_000..32_000);
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

/// Sends `signal` to the process group `child` leads.
fn signal_group(child: &Child, signal: &str) {
    let _ = Command::new("kill")
        .args(["-s", signal, "--", &format!("-{}", child.id())])
        .status();
}
