//! `tower-idempotency`: the operator's command line over the crate's
//! stores — look up one key, forget it (with the same safety rules as the
//! payments example's admin routes), sweep expired records, count what a
//! store holds, and look after the transactional outbox beside it.
//!
//! Run with: `cargo run -p tower-idempotency-cli -- --help`, e.g.
//!
//! ```text
//! tower-idempotency --store sqlite://payments.db inspect --scope acct_alice order-42
//! tower-idempotency --store postgres://postgres@127.0.0.1/app forget --scope acct_alice order-42
//! tower-idempotency --store redis://127.0.0.1:6379 stats --json
//! tower-idempotency --store dynamodb://idempotency_records inspect --scope acct_alice order-42
//! tower-idempotency --store mysql://root@127.0.0.1/app sweep --batch 5000
//! tower-idempotency --store postgres://postgres@127.0.0.1/app outbox refused
//! tower-idempotency --store postgres://postgres@127.0.0.1/app outbox requeue 3f2a…
//! ```

mod opened;
mod report;

use std::process::ExitCode;

use clap::{ArgGroup, Args, Parser, Subcommand};
use tower_idempotency::{
    IdempotencyKey, SensitiveKeys,
    store::{Forgotten, StorageKey, StoreError},
};

use crate::{opened::Opened, report::Report};

/// What the exit status says, for scripts.
const EXIT_STATUS: &str = "Exit status: 0 done; 1 nothing there, or refused (`inspect` of a key \
the store does not hold, `forget` of nothing, of a request in flight without --force, or of a \
transaction's claim, which only its transaction can end; `outbox requeue` of a message that is \
not refused); 2 a usage or configuration mistake \
(the URL, the key, the table, the credentials); 3 the store could not be reached or answered \
with an error.";

/// Look up, forget and sweep idempotency records in a tower-idempotency
/// store.
#[derive(Parser)]
#[command(name = "tower-idempotency", version, after_help = EXIT_STATUS)]
struct Cli {
    /// The store: redis://HOST:PORT (rediss:// for TLS), postgres://…,
    /// mysql://… (MySQL and MariaDB), sqlite://FILE, dynamodb://TABLE (the
    /// AWS environment: credentials, region, AWS_ENDPOINT_URL).
    #[arg(long, env = "IDEMPOTENCY_STORE", global = true, value_name = "URL")]
    store: Option<String>,
    /// The SQL stores' table.
    #[arg(long, default_value = "idempotency_records", global = true)]
    table: String,
    /// The outbox's table (the `outbox` commands).
    #[arg(long, default_value = "idempotency_outbox", global = true)]
    outbox_table: String,
    /// The Redis store's key prefix.
    #[arg(long, default_value = "idempotency:", global = true)]
    prefix: String,
    /// Answer in JSON, one object.
    #[arg(long, global = true)]
    json: bool,
    /// The secret the application keys its sensitive keys' digests with
    /// (`SensitiveKeys::keyed`): `logged_as` then shows the key as its logs
    /// do (`hmac:…`). Without it, the unkeyed form (`sha256:…`).
    #[arg(
        long,
        env = "IDEMPOTENCY_LOG_SECRET",
        global = true,
        hide_env_values = true
    )]
    log_secret: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Show what the store holds for one key: nothing, a request in
    /// flight, or a completed record (its status and how long it is kept).
    Inspect(KeyArgs),
    /// Forget a completed record, so that the key executes again. A request
    /// in flight is refused: --force forgets a lease's claim anyway (its
    /// handler's completion is then fenced off, and a retry runs it a
    /// second time); a transactional store's claim is its open
    /// transaction, which only the transaction (or its timeout) ends.
    /// Instances that serve replays from a `CachedStore` keep replaying
    /// what they cached until it expires: forget through each of them.
    Forget {
        #[command(flatten)]
        key: KeyArgs,
        /// Forget a request in flight too: a retry then executes again.
        #[arg(long)]
        force: bool,
    },
    /// Delete the expired records of a SQL store, in batches (they count
    /// as absent already; this takes back their space). Redis records
    /// expire by themselves.
    Sweep {
        /// Records per statement.
        #[arg(long, default_value_t = 1000)]
        batch: u32,
    },
    /// Count what the store holds: live records, claims in flight (a lease
    /// store's: a transactional store's claim is an uncommitted row, which
    /// no count sees; `inspect` probes one key), expired rows not deleted
    /// yet (SQL: a scan of the table); keys under the prefix and the
    /// server's memory (Redis).
    Stats,
    /// The transactional outbox beside the records (SQL stores): what it
    /// holds, what the broker refused, and putting a refused message back
    /// in line once its cause is fixed.
    #[command(subcommand)]
    Outbox(OutboxCommand),
}

/// What to do with the outbox.
#[derive(Subcommand)]
enum OutboxCommand {
    /// Count its messages by state, and how long the oldest pending one
    /// has waited (a relay that is down shows here first).
    Stats,
    /// List the messages the broker refused for good (oldest first): each
    /// id, destination, ordering key, attempts and the payload's size.
    Refused {
        /// At most this many.
        #[arg(long, default_value_t = 100)]
        limit: u32,
    },
    /// Make refused messages pending again, by id (the relay publishes
    /// them at its next round, in order behind their ordering key).
    Requeue {
        /// The messages' ids, as `refused` lists them.
        #[arg(required = true)]
        ids: Vec<String>,
    },
}

/// Which record: the scope the application gave the key, and the key.
#[derive(Args)]
#[command(group(ArgGroup::new("tenant").required(true).args(["scope", "single_tenant"])))]
struct KeyArgs {
    /// The key's scope: what the layer's `scope_with` returned for the
    /// request (typically the account), or a consumer's `scope`.
    #[arg(long)]
    scope: Option<String>,
    /// The layer is `single_tenant()`: one scope for every request.
    #[arg(long)]
    single_tenant: bool,
    /// The layer's `namespace`, if it has one (a webhook route's, say).
    #[arg(long)]
    namespace: Option<String>,
    /// The idempotency key as the client sent it (a message's business
    /// key); `"k"` and `k` are one key, as in the header.
    key: String,
}

impl KeyArgs {
    /// The record's address; shown as the application's logs show it when
    /// `log_secret` is the secret they are keyed with.
    fn storage_key(&self, log_secret: Option<&str>) -> Result<StorageKey, Failure> {
        let key = IdempotencyKey::parse(&self.key)
            .map_err(|why| Failure::Usage(format!("the key {:?} is not valid: {why}", self.key)))?;
        let scope = self.scope.as_deref().unwrap_or("");
        let address = match &self.namespace {
            None => StorageKey::new(scope, &key),
            Some(namespace) => StorageKey::namespaced(namespace, scope, &key),
        };
        match log_secret {
            None => Ok(address),
            Some(secret) if secret.len() < 16 => Err(Failure::Usage(format!(
                "--log-secret has {} bytes: the application's secret has at least 16",
                secret.len()
            ))),
            Some(secret) => Ok(address.sensitive(&SensitiveKeys::keyed(secret))),
        }
    }
}

/// Why a command did not do what it was asked.
enum Failure {
    /// Nothing there, or refused: exit 1.
    Refused(String),
    /// A usage or configuration mistake: exit 2.
    Usage(String),
    /// The store: exit 3.
    Store(StoreError),
}

impl From<StoreError> for Failure {
    fn from(error: StoreError) -> Self {
        match error {
            StoreError::Misconfigured(why) => Self::Usage(why),
            StoreError::Unsupported(what) => {
                Self::Refused(format!("the store does not support {what}"))
            }
            error => Self::Store(error),
        }
    }
}

/// How long a command runs before the CLI says it is waiting.
const SAY_WAITING_AFTER: std::time::Duration = std::time::Duration::from_millis(500);

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    // The store's warnings (a probe that cannot run, a busy database) on
    // stderr, where the operator sees them.
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_target(false)
        .without_time()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .init();
    let mut run = std::pin::pin!(run(&cli));
    let done = match tokio::time::timeout(SAY_WAITING_AFTER, run.as_mut()).await {
        Ok(done) => done,
        Err(_) => {
            eprintln!("tower-idempotency: waiting for the store to answer…");
            run.await
        }
    };
    match done {
        Ok(report) => {
            report.print(cli.json);
            ExitCode::SUCCESS
        }
        Err(failure) => {
            let (code, message) = match failure {
                Failure::Refused(why) => (1, why),
                Failure::Usage(why) => (2, why),
                Failure::Store(error) => (3, format!("the store failed: {error}")),
            };
            if cli.json {
                println!("{}", serde_json::json!({ "error": message }));
            }
            eprintln!("tower-idempotency: {message}");
            ExitCode::from(code)
        }
    }
}

async fn run(cli: &Cli) -> Result<Report, Failure> {
    let Some(url) = cli.store.as_deref() else {
        return Err(Failure::Usage(
            "which store? Pass --store URL (or set IDEMPOTENCY_STORE)".into(),
        ));
    };
    // Invalid input fails before anything connects.
    let key = match &cli.command {
        Command::Inspect(key) | Command::Forget { key, .. } => {
            Some(key.storage_key(cli.log_secret.as_deref())?)
        }
        Command::Sweep { .. } | Command::Stats | Command::Outbox(_) => None,
    };
    let store = Opened::connect(url, &cli.table, &cli.prefix).await?;
    match (&cli.command, key) {
        (Command::Inspect(_), Some(key)) => {
            let state = store.inspect(&key).await?;
            let report = Report::state(store.redis_key(&key), &key, &state);
            match state {
                tower_idempotency::store::KeyState::Absent => Err(Failure::Refused(format!(
                    "the store holds nothing for this key ({}): its next request executes",
                    key.logged_as()
                ))),
                _ => Ok(report),
            }
        }
        (Command::Forget { force, .. }, Some(key)) => match store.forget(&key, *force).await? {
            forgotten @ (Forgotten::Completed | Forgotten::ForcedInFlight) => {
                Ok(Report::forgotten(&key, forgotten))
            }
            Forgotten::Nothing => Err(Failure::Refused(format!(
                "nothing to forget: the store holds nothing for this key ({})",
                key.logged_as()
            ))),
            Forgotten::InFlight => Err(Failure::Refused(format!(
                "a request with this key is in flight ({}; on SQLite: another process holds the \
                 database's write lock, perhaps for this key): not forgotten. Try again once it \
                 has ended; --force forgets a lease's claim anyway, and a retry then runs it a \
                 second time",
                key.logged_as()
            ))),
        },
        (Command::Sweep { batch }, _) => {
            let deleted = store.sweep((*batch).max(1)).await?;
            Ok(Report::swept(deleted))
        }
        (Command::Stats, _) => Ok(store.stats().await?),
        (Command::Outbox(command), _) => {
            let outbox = store.outbox(&cli.outbox_table).await?;
            match command {
                OutboxCommand::Stats => outbox.stats().await,
                OutboxCommand::Refused { limit } => outbox.refused((*limit).max(1)).await,
                OutboxCommand::Requeue { ids } => {
                    let mut requeued = Vec::new();
                    let mut missing = Vec::new();
                    for id in ids {
                        match outbox.requeue(id).await? {
                            true => requeued.push(id.as_str()),
                            false => missing.push(id.as_str()),
                        }
                    }
                    match missing.is_empty() {
                        true => Ok(Report::requeued(&requeued)),
                        false => Err(Failure::Refused(format!(
                            "not refused, so not requeued (unknown, pending or sent): {}{}",
                            missing.join(", "),
                            match requeued.is_empty() {
                                true => String::new(),
                                false => format!("; requeued: {}", requeued.join(", ")),
                            }
                        ))),
                    }
                }
            }
        }
        (Command::Inspect(_) | Command::Forget { .. }, None) => {
            unreachable!("a key was read for these")
        }
    }
}
