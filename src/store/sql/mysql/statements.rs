//! MySQL's and MariaDB's statements: `INSERT … ON DUPLICATE KEY UPDATE`
//! and plain `DELETE`/`UPDATE` (no `RETURNING`, which MySQL lacks; no
//! `INSERT IGNORE`, which turns every error, truncations included, into a
//! warning). Times are the server's, in UTC (`UTC_TIMESTAMP(3)`).

use std::time::Duration;

use super::Flavor;
use crate::{
    fingerprint::push_hex,
    store::sql::{
        dialect::{
            Param::{self, *},
            Statements, Stmt,
        },
        tx_engine::{Expiry, savepoint},
    },
};

/// A row's milliseconds left.
const MS_LEFT: &str =
    "CAST(TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(3), expires_at) DIV 1000 AS SIGNED)";

/// Now plus a number of milliseconds (`{}`).
fn later(ms: &str) -> String {
    format!("UTC_TIMESTAMP(3) + INTERVAL ({ms} * 1000) MICROSECOND")
}

pub(super) fn statements(table: &str, flavor: Flavor) -> Statements {
    let s = |sql: &str, params: &'static [Param]| {
        let sql = sql
            .replace("{ms_left}", MS_LEFT)
            .replace("{later}", &later("?"));
        Stmt::new(table, &sql, params)
    };
    // A forget must not wait long on a row another transaction locked
    // (InnoDB's deletes lock what they meet): a replay's shared lock is
    // gone within moments, a claim's uncommitted row was probed for first.
    let short_wait = match flavor {
        Flavor::MariaDb => "SET STATEMENT innodb_lock_wait_timeout = 1 FOR ",
        Flavor::MySql => "",
    };
    // `ON DUPLICATE KEY UPDATE` assigns left to right, each assignment
    // seeing the ones before: `expires_at`, which the conditions read, is
    // assigned last.
    let take_over = |column: &str, value: &str| {
        format!("{column} = IF(expires_at <= UTC_TIMESTAMP(3), {value}, {column})")
    };
    let claim = format!(
        "INSERT INTO {{t}} (`key`, fingerprint, token, record, expires_at) VALUES (?, ?, ?, NULL, {{later}}) \
         ON DUPLICATE KEY UPDATE {}, {}, {}, {}",
        take_over("fingerprint", "VALUES(fingerprint)"),
        take_over("token", "VALUES(token)"),
        take_over("record", "NULL"),
        take_over("expires_at", "VALUES(expires_at)"),
    );
    Statements {
        table: table.to_owned(),
        schema: super::SCHEMA.replace("idempotency_records", table),
        exists: s(
            "SELECT CAST(0 AS SIGNED), x'', NULL, NULL, CAST(0 AS SIGNED) FROM {t} LIMIT 0",
            &[],
        ),
        find: s(
            "SELECT CAST(0 AS SIGNED), fingerprint, token, record, {ms_left} FROM {t} WHERE `key` = ?",
            &[Key],
        ),
        // Whether it claimed, only the row read back says (see
        // `LeaseClaim::ReadsBack`).
        claim: s(&claim, &[Key, Fingerprint, Token, Ms]),
        extend: s(
            "UPDATE {t} SET expires_at = {later} WHERE `key` = ? AND token = ? AND expires_at > UTC_TIMESTAMP(3)",
            &[Ms, Key, Token],
        ),
        // A repeat of this very completion also counts as stored.
        complete: s(
            "UPDATE {t} SET token = NULL, record = ?, expires_at = {later} \
             WHERE `key` = ? AND ((token = ? AND expires_at > UTC_TIMESTAMP(3)) OR record = ?)",
            &[Record, Ms, Key, Token, Record],
        ),
        release: s(
            "DELETE FROM {t} WHERE `key` = ? AND token = ?",
            &[Key, Token],
        ),
        forget_completed: s(
            &format!(
                "{short_wait}DELETE FROM {{t}} WHERE `key` = ? AND expires_at > UTC_TIMESTAMP(3) AND record IS NOT NULL"
            ),
            &[Key],
        ),
        delete_claim: s("DELETE FROM {t} WHERE `key` = ?", &[Key]),
        forget_in_flight: s(
            &format!(
                "{short_wait}DELETE FROM {{t}} WHERE `key` = ? AND expires_at > UTC_TIMESTAMP(3) AND record IS NULL"
            ),
            &[Key],
        ),
        delete_expired: s(
            "DELETE FROM {t} WHERE expires_at < UTC_TIMESTAMP(3) LIMIT ?",
            &[Batch],
        ),
        counts: s(
            "SELECT CAST(CASE WHEN expires_at <= UTC_TIMESTAMP(3) THEN 2 WHEN record IS NULL THEN 1 ELSE 0 END AS SIGNED), \
             CAST(COUNT(*) AS SIGNED) FROM {t} GROUP BY 1",
            &[],
        ),
    }
}

/// The user variable a connection's session settings are marked with: set
/// (to the empty binary string, which leaves a fingerprint's bytes as they
/// are) once the session is ready for claims, `NULL` on a fresh
/// connection.
const SESSION_MARK: &str = "@tower_idempotency_session";

/// MySQL's error number for a `NULL` written into a `NOT NULL` column by a
/// single-row `INSERT` (whatever the `sql_mode`): the claim's fingerprint
/// carries the session's mark, so on a connection whose session is not
/// ready yet the claim fails with it, and inserts nothing.
pub(super) const SESSION_NOT_READY: u16 = 1048;

/// MySQL's error number for an arithmetic overflow: the completion's check
/// that the claim's row is still in the transaction.
pub(super) const ROW_GONE: u16 = 1690;

/// The transactional store's statements. The claim travels in the text
/// protocol with the session's settings, so its values are literals (hex,
/// whatever the `sql_mode`).
pub(super) struct TxStatements {
    table: String,
    flavor: Flavor,
    /// The session's lock wait and idle timeout, restored after a claim on
    /// MySQL (MariaDB scopes the claim's wait to its statement).
    restore: String,
}

impl TxStatements {
    pub(super) fn new(table: &str, flavor: Flavor, lock_wait: i64, wait_timeout: i64) -> Self {
        Self {
            table: table.to_owned(),
            flavor,
            restore: match flavor {
                Flavor::MariaDb => "autocommit = 1".to_owned(),
                Flavor::MySql => format!(
                    "autocommit = 1, innodb_lock_wait_timeout = {lock_wait}, wait_timeout = {wait_timeout}"
                ),
            },
        }
    }

    /// `statement`, waiting at most `wait` on a row another transaction
    /// holds: MariaDB scopes the wait to the statement (whole seconds, 0
    /// for none); MySQL's session minimum, 1 s, was set with the claim.
    fn waiting(&self, wait: Duration, statement: &str) -> String {
        match self.flavor {
            Flavor::MariaDb => format!(
                "SET STATEMENT innodb_lock_wait_timeout = {} FOR {statement}",
                wait.as_secs()
            ),
            Flavor::MySql => statement.to_owned(),
        }
    }

    /// What a connection's session is given once, before its first claim,
    /// in a round trip of its own (the failed claim's transaction rolled
    /// back first): it reads committed data — under REPEATABLE READ,
    /// InnoDB's gap locks made concurrent claims of *different* keys wait
    /// for each other, and a claim that may not wait reported a new key in
    /// flight —, on MariaDB the bounds of every request transaction it
    /// will run (`idle_transaction_timeout`, `max_statement_time`, whole
    /// seconds), and the mark that says it is ready. Like the bounds of
    /// the PostgreSQL store, these stay with the pooled connection.
    pub(super) fn session(&self, bound: Duration) -> String {
        let bounds = match self.flavor {
            Flavor::MariaDb => {
                let seconds = seconds(bound);
                format!("idle_transaction_timeout = {seconds}, max_statement_time = {seconds}, ")
            }
            Flavor::MySql => String::new(),
        };
        format!(
            "ROLLBACK; SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED; SET {bounds}{SESSION_MARK} = X''"
        )
    }

    /// Begins the request's transaction with the claim in it, in one round
    /// trip of two statements: the session stops committing each statement
    /// on its own (so that even after a deadlock rolled everything back,
    /// nothing a handler writes later commits without its record), on
    /// MySQL with the transaction's bound (`wait_timeout`) and the claim's
    /// lock wait in the same `SET`; then the claim's row is inserted,
    /// expiring after `lifetime_ms`, its fingerprint carrying the session's
    /// mark ([`SESSION_NOT_READY`]). Every way the transaction ends
    /// restores the session ([`Self::end`]), a claim that found the key
    /// taken too: that costs a replay one statement, which a first
    /// execution would otherwise pay (a `BEGIN`). A row another transaction
    /// has not committed makes the insert fail at once (1205): in flight;
    /// a committed one fails it with 1062: read next.
    pub(super) fn claim(
        &self,
        key: &str,
        fingerprint: &[u8],
        wait: Duration,
        bound: Duration,
        lifetime_ms: i64,
    ) -> String {
        self.in_transaction(
            bound,
            &self.waiting(wait, &self.insert(key, fingerprint, lifetime_ms)),
        )
    }

    /// A batch's transaction begun on a connection, in one round trip: the
    /// session's settings ([`Self::session`]) and the transaction's, as a
    /// claim's ([`Self::claim`]). Its claims need not find out whether the
    /// session is ready.
    pub(super) fn begin_batch(&self, bound: Duration) -> String {
        format!("{}; {}", self.session(bound), self.transaction(bound))
    }

    /// The claim's row inserted in a batch's transaction, in the key's
    /// savepoint: [`Self::claim`] without the transaction's settings.
    pub(super) fn claim_in_batch(
        &self,
        key: &str,
        fingerprint: &[u8],
        wait: Duration,
        lifetime_ms: i64,
    ) -> String {
        self.in_savepoint(wait, &self.insert(key, fingerprint, lifetime_ms))
    }

    /// `statement` in the key's savepoint of a batch's transaction, opened
    /// with it, waiting at most `wait` as a claim does.
    fn in_savepoint(&self, wait: Duration, statement: &str) -> String {
        format!("{}{}", savepoint::OPEN, self.waiting(wait, statement))
    }

    /// The claim's row, expiring after `lifetime_ms`, its fingerprint
    /// carrying the session's mark.
    fn insert(&self, key: &str, fingerprint: &[u8], lifetime_ms: i64) -> String {
        format!(
            "INSERT INTO {} (`key`, fingerprint, token, record, expires_at) VALUES ({}, CONCAT({}, {SESSION_MARK}), NULL, NULL, {})",
            self.table,
            hex(key.as_bytes()),
            hex(fingerprint),
            later(&lifetime_ms.to_string()),
        )
    }

    /// `statement` as the first of a claim's transaction: see
    /// [`Self::claim`].
    fn in_transaction(&self, bound: Duration, statement: &str) -> String {
        format!("{}; {statement}", self.transaction(bound))
    }

    /// A claim's transaction's settings: see [`Self::claim`].
    fn transaction(&self, bound: Duration) -> String {
        match self.flavor {
            Flavor::MariaDb => "SET autocommit = 0".to_owned(),
            Flavor::MySql => format!(
                "SET autocommit = 0, wait_timeout = {}, innodb_lock_wait_timeout = 1",
                seconds(bound)
            ),
        }
    }

    /// The committed row that holds the key, read once the claim's
    /// transaction has ended (`ROLLBACK`, in the same round trip): at READ
    /// COMMITTED a plain read sees the latest commit, and holds no lock a
    /// concurrent replay would wait for.
    pub(super) fn read_after_rollback(&self, key: &str) -> String {
        format!("{}; {}", self.end("ROLLBACK"), self.read(key))
    }

    /// The committed row that holds the key, read in a batch's transaction
    /// once the key's savepoint is undone (in the same round trip).
    pub(super) fn read_in_batch(&self, key: &str) -> String {
        format!("{}{}", savepoint::UNDO, self.read(key))
    }

    /// The row that holds the key.
    fn read(&self, key: &str) -> String {
        format!(
            "SELECT CAST(0 AS SIGNED), fingerprint, token, record, {MS_LEFT} FROM {} WHERE `key` = {}",
            self.table,
            hex(key.as_bytes())
        )
    }

    /// The record written into the claim's row and committed, in one round
    /// trip; its expiry kept as the claim wrote it — the update then
    /// changes no indexed column, and InnoDB touches no secondary index —
    /// or written as the retention from now. If the claim's row is gone
    /// (the handler deleted it, or a deadlock rolled the transaction back
    /// and the handler went on writing), committing would keep writes
    /// without their record: the check after the update then overflows
    /// ([`ROW_GONE`]: its row count is 0; a `SET`, which answers with no
    /// rows to read), and the `COMMIT` after it never runs.
    pub(super) fn complete(&self, key: &str, record: &[u8], expiry: Expiry) -> String {
        self.record(key, record, expiry, &self.end("COMMIT"))
    }

    /// The record written into the claim's row and checked there, as
    /// [`Self::complete`] does, then `then` (the commit, a batch's
    /// savepoint released): never run if the row is gone.
    pub(super) fn record(&self, key: &str, record: &[u8], expiry: Expiry, then: &str) -> String {
        let mut sql = String::with_capacity(2 * record.len() + 256);
        sql.push_str("UPDATE ");
        sql.push_str(&self.table);
        sql.push_str(" SET record = ");
        push_hex_literal(&mut sql, record);
        if let Expiry::Retention(ms) = expiry {
            sql.push_str(", expires_at = ");
            sql.push_str(&later(&ms.to_string()));
        }
        sql.push_str(&format!(
            " WHERE `key` = {}; SET @tower_idempotency_row = 9223372036854775807 + (1 - ROW_COUNT()); {then}",
            hex(key.as_bytes()),
        ));
        sql
    }

    /// An expired record replaced by this claim's row, expiring after
    /// `lifetime_ms`, in a transaction begun as [`Self::claim`]'s.
    pub(super) fn take_over(
        &self,
        key: &str,
        fingerprint: &[u8],
        wait: Duration,
        bound: Duration,
        lifetime_ms: i64,
    ) -> String {
        let update = self.replace_expired(key, fingerprint, lifetime_ms);
        self.in_transaction(bound, &self.waiting(wait, &update))
    }

    /// An expired record replaced by this claim's row in a batch's
    /// transaction, in the key's savepoint.
    pub(super) fn take_over_in_batch(
        &self,
        key: &str,
        fingerprint: &[u8],
        wait: Duration,
        lifetime_ms: i64,
    ) -> String {
        self.in_savepoint(wait, &self.replace_expired(key, fingerprint, lifetime_ms))
    }

    /// The key's expired record replaced by a claim's row.
    fn replace_expired(&self, key: &str, fingerprint: &[u8], lifetime_ms: i64) -> String {
        format!(
            "UPDATE {} SET fingerprint = {}, token = NULL, record = NULL, expires_at = {} \
             WHERE `key` = {} AND expires_at <= UTC_TIMESTAMP(3)",
            self.table,
            hex(fingerprint),
            later(&lifetime_ms.to_string()),
            hex(key.as_bytes()),
        )
    }

    /// Ends the transaction with `end` (`COMMIT`, `ROLLBACK`), the session
    /// as it was.
    pub(super) fn end(&self, end: &str) -> String {
        format!("{end}; SET {}", self.restore)
    }

    /// The in-flight probe: see [`probe`].
    pub(super) fn probe(&self, key: &str) -> String {
        probe(&self.table, self.flavor, key)
    }
}

/// A bound in whole seconds, at least one, as MySQL's settings take it.
fn seconds(bound: Duration) -> u64 {
    bound.as_secs_f64().ceil().max(1.0) as u64
}

/// For the start-up check and the in-flight probe: a claim as a
/// transaction makes it, the row held a minute, that fails at once on a
/// row another transaction holds (on MySQL, after its 1 s minimum).
pub(super) fn probe(table: &str, flavor: Flavor, key: &str) -> String {
    let (session, wait) = match flavor {
        Flavor::MariaDb => (
            "SET autocommit = 0",
            "SET STATEMENT innodb_lock_wait_timeout = 0 FOR ",
        ),
        Flavor::MySql => ("SET autocommit = 0, innodb_lock_wait_timeout = 1", ""),
    };
    format!(
        "{session}; {wait}INSERT INTO {table} (`key`, fingerprint, token, record, expires_at) \
         VALUES ({}, x'00', NULL, NULL, {})",
        hex(key.as_bytes()),
        later("60000"),
    )
}

/// `bytes` as a hex literal, `X'…'`: data, whatever the `sql_mode` says of
/// backslashes.
fn hex(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(3 + 2 * bytes.len());
    push_hex_literal(&mut out, bytes);
    out
}

/// Appends `bytes` as a hex literal (see [`hex`]): a record's can run to
/// megabytes.
pub(super) fn push_hex_literal(out: &mut String, bytes: &[u8]) {
    out.push_str("X'");
    push_hex(out, bytes);
    out.push('\'');
}
