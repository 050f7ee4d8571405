//! The start-up check: the store proves on the table itself what its claims
//! rely on, and refuses to start where that does not hold.
//!
//! On two connections of its own (so a small pool is not exhausted by it),
//! in transactions that never commit:
//! 1. the first claims a fresh key: the row is inserted;
//! 2. the key compares as bytes: the same key with its case flipped or its
//!    punctuation changed is not found, and is claimed as a key of its own
//!    (a case-insensitive collation or `citext` would replay one key's
//!    answer to another);
//! 3. the key is unique: a second claim of it in the same transaction finds
//!    it taken;
//! 4. a second session's claim of it waits and fails, or finds it taken:
//!    never succeeds (an engine that detects the conflict only at commit
//!    would run the handler twice);
//! 5. rolled back, the claim is gone: the table's storage engine has
//!    transactions (MySQL's MyISAM or MEMORY commit each statement on its
//!    own, so a record could outlive a rolled-back effect).
//!
//! What is not the engine's fault is told apart, each with its own fix: a
//! database that is merely busy (another process holds its write lock, or
//! a migration its table lock) is waited for, with a log line saying so,
//! for at most [`BUSY_WAIT`]; one that is read-only, a table that does not
//! exist, or a user without the grants the claims need says so. None of
//! them is a failed check.

use std::time::{Duration, Instant};

use sqlx::ConnectOptions;

use super::{
    base::{Base, EngineCheck, now_ms},
    decide::{UntilFixed, store_error},
    dialect::{Args, Connection, Engine, ErrorClass},
};
use crate::store::StoreError;

/// How long the check waits for a busy database before it gives up.
const BUSY_WAIT: Duration = Duration::from_secs(60);

/// How often it says that it is still waiting.
const SAY_EVERY: Duration = Duration::from_secs(5);

/// Applies the check's verdict under `check`: `why` is `Some` when the
/// engine failed it.
fn verdict(check: EngineCheck, engine: &str, why: Option<String>) -> Result<(), StoreError> {
    let Some(why) = why else { return Ok(()) };
    let message = format!(
        "the database ({engine}) failed the start-up check: {why}. Claims would not keep \
         duplicates apart: a concurrent duplicate could run the handler twice, or one key's \
         answer be replayed for another. Use an engine (and a table) where a claim held by \
         an uncommitted transaction makes a second claim of the key wait or fail, keys \
         compare as bytes and transactions roll back; or opt out with \
         .engine_check(EngineCheck::Warn) if you have made sure by other means"
    );
    match check {
        EngineCheck::Refuse => Err(StoreError::Misconfigured(message)),
        EngineCheck::Warn => {
            tracing::error!("idempotency: {message}");
            Ok(())
        }
    }
}

/// What one attempt at the check came to.
enum Attempt {
    /// The engine and why it failed, if it did.
    Verdict(String, Option<String>),
    /// The database could not be written now: waited for, then retried.
    Busy(String),
    /// The database cannot be written at all.
    ReadOnly(String),
    /// The table does not exist.
    NoTable,
    /// The user may not read or write the table.
    Denied(String),
}

/// Creates the table and its index if they are missing, then runs the
/// check on it.
pub(crate) async fn migrate<D: Engine>(base: &Base<D>) -> Result<(), StoreError> {
    base.create_table().await?;
    run(base).await
}

/// Runs the check on the table, which must exist.
pub(crate) async fn run<D: Engine>(base: &Base<D>) -> Result<(), StoreError> {
    let started = Instant::now();
    let mut said = started;
    let table = &base.sql.table;
    loop {
        match attempt(base).await? {
            Attempt::NoTable => {
                return Err(StoreError::Misconfigured(format!(
                    "the idempotency table {table} does not exist in this database: create it at start-up \
                     with .create_table_if_missing() on the store's builder, or apply the engine's SCHEMA with \
                     your migrations"
                )));
            }
            Attempt::Denied(why) => {
                return Err(StoreError::Misconfigured(format!(
                    "the database user may not use the idempotency table {table} ({why}): grant it SELECT, \
                     INSERT, UPDATE and DELETE on the table (GRANT SELECT, INSERT, UPDATE, DELETE ON {table} \
                     TO <user>), or connect as a user who has them. This is a permission, not an unsafe engine"
                )));
            }
            Attempt::Verdict(engine, why) => return verdict(base.engine_check, &engine, why),
            Attempt::ReadOnly(why) => {
                return Err(StoreError::Unavailable(Box::new(UntilFixed(format!(
                    "the database is read-only, so no claim can be written ({why}); \
                     make it writable, or point the store at a writable one"
                )))));
            }
            Attempt::Busy(why) if started.elapsed() < BUSY_WAIT => {
                if said.elapsed() >= SAY_EVERY || said == started {
                    tracing::warn!(
                        waited = ?started.elapsed(),
                        "idempotency: {} is waiting for the database before its start-up check: {why}",
                        D::STORE
                    );
                    said = Instant::now();
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Attempt::Busy(why) => {
                return Err(StoreError::Unavailable(
                    format!(
                        "the database stayed busy for {BUSY_WAIT:?}, so the start-up check could \
                         not run: {why}. Start this instance once the other one's transaction \
                         ends (a long transaction, or a paused process, holds it)"
                    )
                    .into(),
                ));
            }
        }
    }
}

async fn attempt<D: Engine>(base: &Base<D>) -> Result<Attempt, StoreError> {
    let error = |e: sqlx::Error| store_error(&base.engine, &base.sql.table, e);
    let options = base.pool.connect_options();
    let mut first = options.connect().await.map_err(error)?;
    let exists = D::fetch(&mut first, &base.sql.exists, &Args::default()).await;
    if let Err(e) = exists {
        return Ok(match D::classify(&e) {
            ErrorClass::MissingTable => Attempt::NoTable,
            ErrorClass::PermissionDenied => Attempt::Denied(e.to_string()),
            ErrorClass::Busy | ErrorClass::LockTimeout => Attempt::Busy(e.to_string()),
            _ => Attempt::Verdict(
                D::STORE.into(),
                Some(format!("the table cannot be read ({e})")),
            ),
        });
    }
    let engine = D::describe(&mut first, &base.sql.table)
        .await
        .map_err(error)?;
    let mut second = options.connect().await.map_err(error)?;
    let key = self_test_key();
    let verdict = holds(base, &key, &mut first, &mut second).await;
    // Whatever happened, neither transaction commits.
    let _ = D::raw(&mut first, "ROLLBACK").await;
    let _ = D::raw(&mut second, "ROLLBACK").await;
    Ok(match verdict {
        Ok(()) => match gone_after_rollback(base, &key, &mut first).await {
            Ok(()) => Attempt::Verdict(engine, None),
            Err(why) => Attempt::Verdict(engine, Some(why)),
        },
        Err(Failed::Busy(why)) => Attempt::Busy(why),
        Err(Failed::ReadOnly(why)) => Attempt::ReadOnly(why),
        Err(Failed::Denied(why)) => Attempt::Denied(why),
        Err(Failed::Check(why)) => Attempt::Verdict(engine, Some(why)),
    })
}

/// Why the claims' rules did not hold, or could not be tried.
enum Failed {
    Busy(String),
    ReadOnly(String),
    Denied(String),
    Check(String),
}

/// Rules 1 to 4 (see the module docs), on the key the check claims.
async fn holds<D: Engine>(
    base: &Base<D>,
    key: &str,
    first: &mut Connection<D>,
    second: &mut Connection<D>,
) -> Result<(), Failed> {
    let failed = |what: &str, e: sqlx::Error| match D::classify(&e) {
        ErrorClass::Busy | ErrorClass::LockTimeout => Failed::Busy(e.to_string()),
        ErrorClass::ReadOnly => Failed::ReadOnly(e.to_string()),
        ErrorClass::PermissionDenied => Failed::Denied(e.to_string()),
        _ => Failed::Check(format!("{what} fails ({e})")),
    };
    let sql = &base.sql;
    // 1. A fresh key is claimed.
    match D::check_claim(first, sql, key, Duration::from_secs(1), false).await {
        Ok(true) => {}
        Ok(false) => {
            return Err(Failed::Check(
                "a claim of a fresh key did not insert its row".into(),
            ));
        }
        Err(e) => return Err(failed("the claim statement", e)),
    }
    // 2. Only the key itself finds its row, and its look-alikes are keys
    // of their own.
    let look_alikes = look_alikes(key);
    for variant in &look_alikes {
        let args = Args {
            key: variant,
            now: now_ms(),
            ..Args::default()
        };
        match D::fetch(first, &sql.find, &args).await {
            Ok(None) => {}
            Ok(Some(_)) => {
                return Err(Failed::Check(format!(
                    "the key column does not compare bytes: a lookup of {variant:?} found the row of {key:?} \
                     (a case-insensitive or accent-insensitive collation, or a type such as citext): \
                     one key's stored answer would be replayed for another"
                )));
            }
            Err(e) => return Err(failed("reading a row", e)),
        }
    }
    for variant in &look_alikes {
        let lenient = || {
            Failed::Check(format!(
                "the key column does not compare bytes: {variant:?} could not be claimed while {key:?} \
                 was held (a case-insensitive or accent-insensitive collation, or a type such as citext): \
                 one key's stored answer would be replayed for another"
            ))
        };
        match D::check_claim(first, sql, variant, Duration::from_secs(1), true).await {
            Ok(true) => {}
            Ok(false) => return Err(lenient()),
            Err(e) if D::classify(&e) == ErrorClass::Duplicate => return Err(lenient()),
            Err(e) => return Err(failed("a claim of another key", e)),
        }
    }
    // 3. The key is unique.
    match D::check_claim(first, sql, key, Duration::from_secs(1), true).await {
        Ok(false) => {}
        Ok(true) => {
            return Err(Failed::Check(
                "a second claim of a held key inserted a row: the key is not unique (no primary key on the key column)".into(),
            ));
        }
        Err(e) if D::classify(&e) == ErrorClass::Duplicate => {}
        Err(e) => return Err(failed("a second claim of the key", e)),
    }
    // 4. Another session's claim does not succeed.
    match D::check_claim(second, sql, key, Duration::from_millis(200), false).await {
        Ok(false) => Ok(()),
        Ok(true) => Err(Failed::Check(
            "a second session claimed a key that an uncommitted transaction holds (conflicts detected only at commit)".into(),
        )),
        // It waited and failed, or met the held lock: it did not claim the
        // key.
        Err(e)
            if matches!(
                D::classify(&e),
                ErrorClass::LockTimeout | ErrorClass::Busy | ErrorClass::Duplicate
            ) =>
        {
            Ok(())
        }
        Err(e) => Err(Failed::Check(format!("the second claim failed unexpectedly ({e})"))),
    }
}

/// Rule 5: the rolled-back claim left nothing behind.
async fn gone_after_rollback<D: Engine>(
    base: &Base<D>,
    key: &str,
    on: &mut Connection<D>,
) -> Result<(), String> {
    let args = Args {
        key,
        now: now_ms(),
        ..Args::default()
    };
    match D::fetch(on, &base.sql.find, &args).await {
        Ok(None) => Ok(()),
        Ok(Some(_)) => {
            // Not to be left behind by the check itself.
            let _ = D::execute(on, &base.sql.forget_in_flight, &args).await;
            Err(
                "a claim rolled back was still there: the table's storage engine has no \
                 transactions (MyISAM, MEMORY, …), so a record would outlive its rolled-back \
                 effect; use a transactional engine (InnoDB)"
                    .into(),
            )
        }
        Err(e) => Err(format!("reading the rolled-back claim fails ({e})")),
    }
}

/// Spellings of `key` that a byte comparison tells apart from it and a
/// lenient collation might not.
fn look_alikes(key: &str) -> Vec<String> {
    let flipped: String = key
        .chars()
        .map(|c| {
            if c.is_ascii_uppercase() {
                c.to_ascii_lowercase()
            } else {
                c.to_ascii_uppercase()
            }
        })
        .collect();
    vec![flipped, key.replace('-', ""), key.replace('-', "_")]
}

/// The key the check claims: never a layer's (scope hashes are hex, message
/// keys are visible ASCII after a hash too), unique per check, with letters
/// of both cases and punctuation for the look-alikes.
fn self_test_key() -> String {
    format!("Tower-Idempotency:self-test:{:032x}", fastrand::u128(..))
}
