//! The operator CLI against real servers: records written by the stores
//! as an application writes them, then looked up, forgotten, swept and
//! counted by the binary, its output and exit status checked. Each
//! scenario is written once and run on every store it applies to.

use std::{process::Output, sync::Arc, time::Duration};

use tower_idempotency::{
    DynamoDbStore, FingerprintHasher, IdempotencyKey, MySqlStore, PostgresStore, RedisStore,
    SqliteStore, StoredResponse,
    outbox::{Outbox, OutboxMessage, OutboxRelay, OutgoingMessage, PublishError, Publisher},
    store::{Claim, StorageKey, Store},
};
use tower_idempotency_harness::{
    dynamodb, mysql::TestDatabase as MySqlDatabase, postgres::TestDatabase,
    redis_server::RedisServer, sqlite::TestFile,
};

/// One store under test: its URL, and what keeps its server or file.
struct Backend {
    url: String,
    sql: bool,
    /// Counts its records by state (the SQL tables, DynamoDB).
    by_state: bool,
    /// The environment the CLI reaches the store with.
    env: Vec<(&'static str, String)>,
    _keep: Box<dyn std::any::Any + Send>,
}

impl Backend {
    fn redis() -> Self {
        let server = RedisServer::start();
        Self {
            url: server.url(),
            sql: false,
            by_state: false,
            env: Vec::new(),
            _keep: Box::new(server),
        }
    }

    fn postgres() -> Self {
        let db = TestDatabase::create();
        Self {
            url: db.url().to_owned(),
            sql: true,
            by_state: true,
            env: Vec::new(),
            _keep: Box::new(db),
        }
    }

    fn mysql() -> Self {
        let db = MySqlDatabase::create();
        Self {
            url: db.url().to_owned(),
            sql: true,
            by_state: true,
            env: Vec::new(),
            _keep: Box::new(db),
        }
    }

    fn sqlite() -> Self {
        let file = TestFile::create();
        Self {
            url: file.url(),
            sql: true,
            by_state: true,
            env: Vec::new(),
            _keep: Box::new(file),
        }
    }

    /// A dynoxide server and a table on it, reached through the AWS
    /// environment.
    fn dynamodb() -> Self {
        let server = dynamodb::DynamoServer::start();
        Self {
            url: format!("dynamodb://{}", dynamodb::table_name()),
            sql: false,
            by_state: true,
            env: server.env(),
            _keep: Box::new(server),
        }
    }

    /// The binary, on this store.
    async fn cli(&self, args: &[&str]) -> Run {
        cli_with(&[&["--store", &self.url], args].concat(), &self.env).await
    }
}

/// What one run of the binary said.
struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Run {
    fn json(&self) -> serde_json::Value {
        serde_json::from_str(self.stdout.trim()).unwrap_or_else(|e| panic!("{e}: {}", self.stdout))
    }
}

impl std::fmt::Debug for Run {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "exit {}\n{}{}", self.code, self.stdout, self.stderr)
    }
}

async fn cli(args: &[&str]) -> Run {
    cli_with(args, &[]).await
}

async fn cli_with(args: &[&str], env: &[(&'static str, String)]) -> Run {
    let Output {
        status,
        stdout,
        stderr,
    } = tokio::process::Command::new(env!("CARGO_BIN_EXE_tower-idempotency"))
        .args(args)
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .env_remove("IDEMPOTENCY_STORE")
        .output()
        .await
        .expect("run the CLI");
    Run {
        code: status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&stdout).into_owned(),
        stderr: String::from_utf8_lossy(&stderr).into_owned(),
    }
}

fn key(scope: &str, key: &str) -> StorageKey {
    StorageKey::new(scope, &IdempotencyKey::new(key).unwrap())
}

fn key_in(namespace: &str, scope: &str, key: &str) -> StorageKey {
    StorageKey::namespaced(namespace, scope, &IdempotencyKey::new(key).unwrap())
}

fn fingerprint() -> tower_idempotency::Fingerprint {
    let mut hasher = FingerprintHasher::new("cli-test");
    hasher.field(b"POST /v1/charges");
    hasher.finish()
}

/// A `201` stored under `key` for `retention`, as the layer stores one.
async fn seed<St: Store>(store: &St, key: &StorageKey, retention: Duration) {
    let Ok(Claim::Acquired(mut granted)) = store
        .claim(key, &fingerprint(), Duration::from_secs(30))
        .await
    else {
        panic!("claim {key}");
    };
    let response = StoredResponse::capture(
        http::StatusCode::CREATED,
        &http::HeaderMap::new(),
        bytes::Bytes::from_static(br#"{"id":"ch_1"}"#),
    );
    let stored = store
        .complete(
            key,
            &mut granted,
            &fingerprint(),
            Arc::new(tower_idempotency::CompletedRecord::Response(response)),
            retention,
        )
        .await
        .unwrap();
    assert!(stored);
}

/// A claim of `key` held: a request in flight.
async fn hold<St: Store>(store: &St, key: &StorageKey) -> St::Granted {
    match store
        .claim(key, &fingerprint(), Duration::from_secs(30))
        .await
    {
        Ok(Claim::Acquired(granted)) => granted,
        _ => panic!("claim {key}"),
    }
}

const DAY: Duration = Duration::from_secs(86_400);

/// Inspect, forget (and its refusals), stats and sweep on a lease store
/// (Redis, or a SQL table's lease store).
async fn lease_store_scenario<St: Store>(backend: &Backend, store: St) {
    let order = key("acct_alice", "order-42");
    seed(&store, &order, DAY).await;

    let found = backend
        .cli(&["inspect", "--scope", "acct_alice", "order-42"])
        .await;
    assert_eq!(found.code, 0, "{found:?}");
    assert!(found.stdout.contains("state: completed"), "{found:?}");
    assert!(found.stdout.contains("status: 201"), "{found:?}");
    assert!(found.stdout.contains(&order.logged_as()), "{found:?}");
    // With the application's log secret: the key as its logs show it.
    let secret = "the application's log secret";
    let keyed = backend
        .cli(&[
            "--log-secret",
            secret,
            "inspect",
            "--scope",
            "acct_alice",
            "order-42",
        ])
        .await;
    let shown = tower_idempotency::SensitiveKeys::keyed(secret).show(&order);
    assert!(shown.starts_with("hmac:"));
    assert!(
        keyed.stdout.contains(&format!("logged_as: {shown}")),
        "{keyed:?}"
    );
    let json = backend
        .cli(&["--json", "inspect", "--scope", "acct_alice", "\"order-42\""])
        .await
        .json();
    assert_eq!(json["state"], "completed");
    assert_eq!(json["status"], 201);
    assert_eq!(json["key"], order.as_str());
    assert!(json["expires_in_secs"].as_u64().unwrap() > 86_000);

    // Another tenant's key of the same name is another record.
    let other = backend
        .cli(&["inspect", "--scope", "acct_bob", "order-42"])
        .await;
    assert_eq!(other.code, 1, "{other:?}");
    assert!(other.stderr.contains("holds nothing"), "{other:?}");
    let single = backend
        .cli(&["inspect", "--single-tenant", "order-42"])
        .await;
    assert_eq!(single.code, 1, "{single:?}");
    // A layer's namespace is part of the address.
    let webhook = key_in("webhooks:processor", "", "evt_1");
    seed(&store, &webhook, DAY).await;
    let namespaced = backend
        .cli(&[
            "inspect",
            "--namespace",
            "webhooks:processor",
            "--single-tenant",
            "evt_1",
        ])
        .await;
    assert_eq!(namespaced.code, 0, "{namespaced:?}");
    let outside = backend
        .cli(&["inspect", "--scope", "webhooks:processor", "evt_1"])
        .await;
    assert_eq!(outside.code, 1, "{outside:?}");
    assert!(
        backend
            .cli(&[
                "forget",
                "--namespace",
                "webhooks:processor",
                "--single-tenant",
                "evt_1"
            ])
            .await
            .code
            == 0
    );

    // A request in flight: shown, refused, forced.
    let running = key("acct_alice", "order-43");
    let mut granted = hold(&store, &running).await;
    let shown = backend
        .cli(&["--json", "inspect", "--scope", "acct_alice", "order-43"])
        .await;
    assert_eq!(shown.code, 0, "{shown:?}");
    assert_eq!(shown.json()["state"], "in_flight");
    let refused = backend
        .cli(&["forget", "--scope", "acct_alice", "order-43"])
        .await;
    assert_eq!(refused.code, 1, "{refused:?}");
    assert!(refused.stderr.contains("in flight"), "{refused:?}");
    let forced = backend
        .cli(&["forget", "--force", "--scope", "acct_alice", "order-43"])
        .await;
    assert_eq!(forced.code, 0, "{forced:?}");
    assert!(
        forced.stdout.contains("forgot: in_flight_claim"),
        "{forced:?}"
    );
    // The running handler's completion is fenced off.
    let late = store
        .complete(
            &running,
            &mut granted,
            &fingerprint(),
            Arc::new(tower_idempotency::CompletedRecord::Message {
                result: None,
                created_at: std::time::SystemTime::now(),
            }),
            DAY,
        )
        .await
        .unwrap();
    assert!(!late, "a forced claim's completion must be fenced off");

    // Counted.
    let stats = backend.cli(&["--json", "stats"]).await;
    assert_eq!(stats.code, 0, "{stats:?}");
    let stats = stats.json();
    if backend.by_state {
        assert_eq!(stats["completed"], 1, "{stats}");
        assert_eq!(stats["in_flight"], 0, "{stats}");
    } else {
        // The record, and the store's own naming key.
        assert!(stats["keys"].as_u64().unwrap() >= 1, "{stats}");
    }

    // Forgotten: the next request executes.
    let forgot = backend
        .cli(&["forget", "--scope", "acct_alice", "order-42"])
        .await;
    assert_eq!(forgot.code, 0, "{forgot:?}");
    assert!(
        forgot.stdout.contains("forgot: completed_record"),
        "{forgot:?}"
    );
    let gone = backend
        .cli(&["inspect", "--scope", "acct_alice", "order-42"])
        .await;
    assert_eq!(gone.code, 1, "{gone:?}");
    let Ok(Claim::Acquired(granted)) = store.claim(&order, &fingerprint(), DAY).await else {
        panic!("a forgotten key executes again");
    };
    assert!(store.release(&order, granted).await.unwrap());
    let again = backend
        .cli(&["forget", "--scope", "acct_alice", "order-42"])
        .await;
    assert_eq!(again.code, 1, "{again:?}");
    assert!(again.stderr.contains("nothing to forget"), "{again:?}");

    // Swept: what expired is deleted, what lives is kept.
    if backend.sql {
        for n in 0..3 {
            seed(
                &store,
                &key("acct_alice", &format!("old-{n}")),
                Duration::from_secs(1),
            )
            .await;
        }
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        let expired = backend.cli(&["--json", "stats"]).await.json();
        assert_eq!(expired["expired"], 3, "{expired}");
        let swept = backend.cli(&["--json", "sweep", "--batch", "2"]).await;
        assert_eq!(swept.code, 0, "{swept:?}");
        assert_eq!(swept.json()["deleted"], 3);
        let after = backend.cli(&["--json", "stats"]).await.json();
        assert_eq!(after["expired"], 0, "{after}");
    } else {
        let refused = backend.cli(&["sweep"]).await;
        assert_eq!(refused.code, 2, "{refused:?}");
        assert!(
            refused.stderr.contains("expire by themselves"),
            "{refused:?}"
        );
    }
}

#[tokio::test]
async fn on_dynamodb() {
    let backend = Backend::dynamodb();
    let table = backend.url.trim_start_matches("dynamodb://").to_owned();
    let server: &dynamodb::DynamoServer = backend._keep.downcast_ref().unwrap();
    let store = DynamoDbStore::builder(server.client())
        .table(table)
        .create_table_if_missing()
        .build()
        .await
        .unwrap();
    lease_store_scenario(&backend, store).await;
}

#[tokio::test]
async fn on_redis() {
    let backend = Backend::redis();
    let store = RedisStore::builder().connect(&backend.url).await.unwrap();
    lease_store_scenario(&backend, store).await;
}

#[tokio::test]
async fn on_a_postgres_lease_table() {
    let backend = Backend::postgres();
    let store = PostgresStore::builder()
        .create_table_if_missing()
        .connect(&backend.url)
        .await
        .unwrap();
    lease_store_scenario(&backend, store).await;
}

#[tokio::test]
async fn on_a_mysql_lease_table() {
    let backend = Backend::mysql();
    let store = MySqlStore::builder()
        .create_table_if_missing()
        .connect(&backend.url)
        .await
        .unwrap();
    lease_store_scenario(&backend, store).await;
}

#[tokio::test]
async fn on_a_sqlite_lease_table() {
    let backend = Backend::sqlite();
    let store = SqliteStore::builder()
        .create_table_if_missing()
        .connect(&backend.url)
        .await
        .unwrap();
    lease_store_scenario(&backend, store).await;
}

/// A transactional store's claim is its open transaction: seen in flight,
/// never forgotten, gone with the transaction.
async fn transactional_scenario<St: Store>(backend: &Backend, store: St) {
    let order = key("acct_alice", "order-44");
    let open = hold(&store, &order).await;
    let shown = backend
        .cli(&["--json", "inspect", "--scope", "acct_alice", "order-44"])
        .await;
    assert_eq!(shown.code, 0, "{shown:?}");
    assert_eq!(shown.json()["state"], "in_flight");
    // A count cannot see the claim inspect found, and says so.
    let counted = backend.cli(&["stats"]).await;
    assert_eq!(counted.code, 0, "{counted:?}");
    assert!(counted.stdout.contains("in_flight: 0"), "{counted:?}");
    assert!(counted.stdout.contains("uncommitted"), "{counted:?}");
    let refused = backend
        .cli(&["forget", "--scope", "acct_alice", "order-44"])
        .await;
    assert_eq!(refused.code, 1, "{refused:?}");
    assert!(refused.stderr.contains("in flight"), "{refused:?}");
    // Not even by force: only the transaction, or its timeout, ends it.
    let forced = backend
        .cli(&["forget", "--force", "--scope", "acct_alice", "order-44"])
        .await;
    assert_eq!(forced.code, 1, "{forced:?}");
    assert!(forced.stderr.contains("open transaction"), "{forced:?}");
    drop(open);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let gone = backend
        .cli(&["inspect", "--scope", "acct_alice", "order-44"])
        .await;
    assert_eq!(gone.code, 1, "{gone:?}");
    // Committed with its record, it is an ordinary record.
    seed(&store, &order, DAY).await;
    let found = backend
        .cli(&["inspect", "--scope", "acct_alice", "order-44"])
        .await;
    assert_eq!(found.code, 0, "{found:?}");
    let forgot = backend
        .cli(&["forget", "--scope", "acct_alice", "order-44"])
        .await;
    assert_eq!(forgot.code, 0, "{forgot:?}");

    // A request in flight when the forget is asked, which commits once the
    // CLI has answered: refused at once — never waited for, then its fresh
    // record forgotten (a retry of it would charge again).
    let charging = key("acct_alice", "order-45");
    let mut open = hold(&store, &charging).await;
    let refused = backend
        .cli(&["forget", "--scope", "acct_alice", "order-45"])
        .await;
    assert_eq!(refused.code, 1, "{refused:?}");
    assert!(refused.stderr.contains("in flight"), "{refused:?}");
    assert!(
        !refused.stderr.contains("waiting"),
        "answered at once: {refused:?}"
    );
    let committed = store
        .complete(
            &charging,
            &mut open,
            &fingerprint(),
            Arc::new(tower_idempotency::CompletedRecord::Message {
                result: None,
                created_at: std::time::SystemTime::now(),
            }),
            DAY,
        )
        .await
        .unwrap();
    assert!(committed);
    let kept = backend
        .cli(&["--json", "inspect", "--scope", "acct_alice", "order-45"])
        .await;
    assert_eq!(kept.code, 0, "{kept:?}");
    assert_eq!(
        kept.json()["state"],
        "completed",
        "the charge's record is kept"
    );
}

#[tokio::test]
async fn on_a_postgres_transactional_table() {
    let backend = Backend::postgres();
    let store = PostgresStore::builder()
        .transactional()
        .create_table_if_missing()
        .connect(&backend.url)
        .await
        .unwrap();
    transactional_scenario(&backend, store).await;
}

#[tokio::test]
async fn on_a_mysql_transactional_table() {
    let backend = Backend::mysql();
    let store = MySqlStore::builder()
        .transactional()
        .create_table_if_missing()
        .connect(&backend.url)
        .await
        .unwrap();
    transactional_scenario(&backend, store).await;
}

#[tokio::test]
async fn on_a_sqlite_transactional_table() {
    // The CLI is another process: the claim this test holds is another
    // process's write lock on the file, as an application's would be.
    let backend = Backend::sqlite();
    let store = SqliteStore::builder()
        .transactional()
        .create_table_if_missing()
        .connect(&backend.url)
        .await
        .unwrap();
    transactional_scenario(&backend, store).await;
}

/// `inspect` and `stats` only read: they run with a user that may only
/// read the table (and say that a transaction in flight cannot be seen
/// then), and `forget` is refused there as a permission, not an outage.
async fn read_only_scenario(backend: &Backend, reader_url: &str) {
    let order = key("acct_alice", "order-46");
    let reader = async |args: &[&str]| cli(&[&["--store", reader_url], args].concat()).await;
    let found = reader(&["--json", "inspect", "--scope", "acct_alice", "order-46"]).await;
    assert_eq!(found.code, 0, "{found:?}");
    assert_eq!(found.json()["state"], "completed");
    let stats = reader(&["--json", "stats"]).await;
    assert_eq!(stats.code, 0, "{stats:?}");
    assert_eq!(stats.json()["completed"], 1);
    let absent = reader(&["inspect", "--scope", "acct_alice", "order-47"]).await;
    assert_eq!(absent.code, 1, "{absent:?}");
    assert!(absent.stderr.contains("cannot be seen"), "{absent:?}");
    let forget = reader(&["forget", "--scope", "acct_alice", "order-46"]).await;
    assert_ne!(forget.code, 0, "{forget:?}");
    let still = backend
        .cli(&["inspect", "--scope", "acct_alice", "order-46"])
        .await;
    assert_eq!(still.code, 0, "{still:?}");
    let _ = order;
}

#[tokio::test]
async fn a_postgres_user_who_may_only_read_inspects_and_counts() {
    use tower_idempotency::sqlx::{Connection, Executor};
    let backend = Backend::postgres();
    let store = PostgresStore::builder()
        .transactional()
        .create_table_if_missing()
        .connect(&backend.url)
        .await
        .unwrap();
    seed(&store, &key("acct_alice", "order-46"), DAY).await;
    let role = format!("reader_{}", fastrand::u32(..));
    let mut admin = tower_idempotency::sqlx::PgConnection::connect(&backend.url)
        .await
        .unwrap();
    admin
        .execute(tower_idempotency::sqlx::AssertSqlSafe(format!(
            "CREATE ROLE {role} LOGIN PASSWORD 'reader'; GRANT SELECT ON idempotency_records TO {role}"
        )))
        .await
        .unwrap();
    let reader_url = backend
        .url
        .replacen("postgres@", &format!("{role}:reader@"), 1);
    read_only_scenario(&backend, &reader_url).await;
    admin
        .execute(tower_idempotency::sqlx::AssertSqlSafe(format!(
            "REVOKE ALL ON idempotency_records FROM {role}; DROP ROLE {role}"
        )))
        .await
        .unwrap();
}

#[tokio::test]
async fn a_mysql_user_who_may_only_read_inspects_and_counts() {
    use tower_idempotency::sqlx::{Connection, Executor};
    let db = MySqlDatabase::create();
    let backend = Backend {
        url: db.url().to_owned(),
        sql: true,
        by_state: true,
        env: Vec::new(),
        _keep: Box::new(()),
    };
    let store = MySqlStore::builder()
        .transactional()
        .create_table_if_missing()
        .connect(&backend.url)
        .await
        .unwrap();
    seed(&store, &key("acct_alice", "order-46"), DAY).await;
    let user = format!("reader_{}", fastrand::u32(..));
    let mut admin = tower_idempotency::sqlx::MySqlConnection::connect(&backend.url)
        .await
        .unwrap();
    admin
        .execute(tower_idempotency::sqlx::AssertSqlSafe(format!(
            "CREATE USER '{user}'@'%' IDENTIFIED BY 'reader'; \
             GRANT SELECT ON {}.* TO '{user}'@'%'",
            db.name()
        )))
        .await
        .unwrap();
    let reader_url = backend.url.replacen("root@", &format!("{user}:reader@"), 1);
    read_only_scenario(&backend, &reader_url).await;
    admin
        .execute(tower_idempotency::sqlx::AssertSqlSafe(format!(
            "DROP USER '{user}'@'%'"
        )))
        .await
        .unwrap();
    drop(db);
}

/// Wrong credentials and a database that does not exist are configuration
/// mistakes (exit 2) that say what to fix, not outages (exit 3).
#[tokio::test]
async fn wrong_credentials_and_unknown_databases_are_mistakes() {
    let pg = tower_idempotency_harness::postgres::server_url();
    let cases = [
        (pg.replacen("postgres@", "no_such_role@", 1), "credentials"),
        (
            format!("{}/no_such_database", pg.rsplit_once('/').unwrap().0),
            "does not exist",
        ),
        (
            format!(
                "{}/no_such_database",
                tower_idempotency_harness::mysql::server_url().trim_end_matches('/')
            ),
            "does not exist",
        ),
        (
            tower_idempotency_harness::mysql::server_url().replacen("root@", "root:wrong@", 1)
                + "/mysql",
            "credentials",
        ),
    ];
    for (url, says) in cases {
        let run = cli(&["--store", &url, "stats"]).await;
        assert_eq!(run.code, 2, "{url}: {run:?}");
        assert!(run.stderr.contains(says), "{url}: {run:?}");
    }
    let redis = RedisServer::start();
    let wrong = redis.url().replacen("redis://", "redis://:wrong@", 1);
    let run = cli(&["--store", &wrong, "stats"]).await;
    assert_eq!(run.code, 2, "{run:?}");
    assert!(run.stderr.contains("credentials"), "{run:?}");
}

/// Mistakes are told apart from outages, each with its own status.
#[tokio::test]
async fn mistakes_and_outages_say_so() {
    let no_store = cli(&["inspect", "--scope", "a", "k"]).await;
    assert_eq!(no_store.code, 2, "{no_store:?}");
    assert!(no_store.stderr.contains("--store"), "{no_store:?}");
    let scheme = cli(&["--store", "memcached://127.0.0.1", "stats"]).await;
    assert_eq!(scheme.code, 2, "{scheme:?}");
    let no_scope = cli(&["--store", "sqlite://x.db", "inspect", "k"]).await;
    assert_eq!(no_scope.code, 2, "{no_scope:?}");
    assert!(no_scope.stderr.contains("--single-tenant"), "{no_scope:?}");
    let bad_key = cli(&[
        "--store",
        "sqlite://x.db",
        "inspect",
        "--scope",
        "a",
        "two words",
    ])
    .await;
    assert_eq!(bad_key.code, 2, "{bad_key:?}");
    assert!(bad_key.stderr.contains("not valid"), "{bad_key:?}");

    let backend = Backend::postgres();
    let missing = backend.cli(&["--table", "nope", "stats"]).await;
    assert_eq!(missing.code, 2, "{missing:?}");
    assert!(missing.stderr.contains("nope"), "{missing:?}");
    let file = cli(&[
        "--store",
        "sqlite:///tmp/tower-idempotency-cli-no-such.db",
        "stats",
    ])
    .await;
    assert_eq!(file.code, 2, "{file:?}");
    assert!(!std::path::Path::new("/tmp/tower-idempotency-cli-no-such.db").exists());

    let port = tower_idempotency_harness::redis_server::free_port();
    let down = cli(&["--store", &format!("redis://127.0.0.1:{port}"), "stats"]).await;
    assert_eq!(down.code, 3, "{down:?}");

    // A Redis that wants a password, given none (NOAUTH) or a wrong one
    // (WRONGPASS): the URL's mistake, not an outage.
    let locked = RedisServer::start();
    locked.command(&["CONFIG", "SET", "requirepass", "s3cret"]);
    let port = locked.port();
    for url in [
        format!("redis://127.0.0.1:{port}"),
        format!("redis://:wrong@127.0.0.1:{port}"),
    ] {
        for command in [&["stats"][..], &["inspect", "--scope", "a", "k"]] {
            let mut args = vec!["--store", url.as_str()];
            args.extend_from_slice(command);
            let run = cli(&args).await;
            assert_eq!(run.code, 2, "{url} {command:?}: {run:?}");
            assert!(run.stderr.contains("password"), "{run:?}");
        }
    }
}

/// A relay's publisher whose broker has no queue `missing`.
struct Broker;

impl Publisher for Broker {
    async fn publish(&self, message: &OutboxMessage) -> Result<(), PublishError> {
        match message.destination.as_str() {
            "missing" => Err(PublishError::Refused("no such queue".into())),
            _ => Ok(()),
        }
    }
}

/// `outbox stats`, `outbox refused` and `outbox requeue` on the outbox of
/// a transactional table: a message the broker refused is listed, put
/// back in line by id, and counted pending again; an id that is not
/// refused is refused (exit 1), the rest requeued.
macro_rules! outbox_scenario {
    ($name:ident, $backend:ident, $store:ty) => {
        #[tokio::test]
        async fn $name() {
            let backend = Backend::$backend();
            let store = <$store>::builder()
                .transactional()
                .create_table_if_missing()
                .connect(&backend.url)
                .await
                .unwrap();
            let outbox = Outbox::on(&store)
                .create_table_if_missing()
                .build()
                .await
                .unwrap();
            let order = key("acct_alice", "order-47");
            let mut tx = hold(&store, &order).await;
            for destination in ["missing", "charges", "missing"] {
                outbox
                    .enqueue(&mut tx, OutgoingMessage::new(destination, b"{}".to_vec()))
                    .await
                    .unwrap();
            }
            let result = Arc::new(tower_idempotency::CompletedRecord::Message {
                result: None,
                created_at: std::time::SystemTime::now(),
            });
            assert!(
                store
                    .complete(&order, &mut tx, &fingerprint(), result, DAY)
                    .await
                    .unwrap()
            );
            // The claim's connection goes back to the pool.
            drop(tx);
            let pending = backend.cli(&["--json", "outbox", "stats"]).await;
            assert_eq!(pending.code, 0, "{pending:?}");
            assert_eq!(pending.json()["pending"], 3, "{pending:?}");
            assert!(
                pending.json()["oldest_pending_secs"].is_u64(),
                "{pending:?}"
            );

            let relay = OutboxRelay::new(outbox.clone(), Broker);
            while relay.run_once().await.expect("a relay round").claimed > 0 {}
            let stats = backend.cli(&["--json", "outbox", "stats"]).await;
            assert_eq!(stats.code, 0, "{stats:?}");
            let counts = stats.json();
            assert_eq!(
                (&counts["pending"], &counts["sent"], &counts["refused"]),
                (&0.into(), &1.into(), &2.into())
            );
            let refused = backend.cli(&["--json", "outbox", "refused"]).await;
            assert_eq!(refused.code, 0, "{refused:?}");
            let listed = refused.json()["refused"].as_array().unwrap().clone();
            assert_eq!(listed.len(), 2, "{refused:?}");
            assert!(listed.iter().all(|m| m["destination"] == "missing"));
            let id = listed[0]["id"].as_str().unwrap().to_owned();
            let shown = backend.cli(&["outbox", "refused", "--limit", "1"]).await;
            assert!(shown.stdout.contains(&id), "{shown:?}");

            let requeued = backend.cli(&["outbox", "requeue", &id, "no-such-id"]).await;
            assert_eq!(requeued.code, 1, "{requeued:?}");
            assert!(requeued.stderr.contains("no-such-id"), "{requeued:?}");
            assert!(
                requeued.stderr.contains(&format!("requeued: {id}")),
                "{requeued:?}"
            );
            let after = backend.cli(&["--json", "outbox", "stats"]).await.json();
            assert_eq!(
                (&after["pending"], &after["refused"]),
                (&1.into(), &1.into())
            );
            let missing = backend
                .cli(&["--outbox-table", "nope", "outbox", "stats"])
                .await;
            assert_eq!(missing.code, 2, "{missing:?}");
            assert!(missing.stderr.contains("nope"), "{missing:?}");
        }
    };
}

outbox_scenario!(the_outbox_of_a_sqlite_table, sqlite, SqliteStore);
outbox_scenario!(the_outbox_of_a_postgres_table, postgres, PostgresStore);
outbox_scenario!(the_outbox_of_a_mysql_table, mysql, MySqlStore);

#[tokio::test]
async fn redis_has_no_outbox() {
    let backend = Backend::redis();
    let run = backend.cli(&["outbox", "stats"]).await;
    assert_eq!(run.code, 2, "{run:?}");
    assert!(run.stderr.contains("SQL database"), "{run:?}");
}
