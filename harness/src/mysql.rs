//! MySQL or MariaDB for the tests: `MYSQL_URL` when set, else the local
//! server at `mysql://root@127.0.0.1:3306`. Each test gets a throwaway
//! database, dropped when it ends.

use std::{
    sync::atomic::{AtomicUsize, Ordering},
    time::{Duration, Instant},
};

use sqlx::{Connection, Executor, MySqlConnection};

use crate::blocking;

const LOCAL: &str = "mysql://root@127.0.0.1:3306";

/// The server the tests use: `MYSQL_URL`, or the local one.
pub fn server_url() -> String {
    std::env::var("MYSQL_URL").unwrap_or_else(|_| LOCAL.to_owned())
}

/// `url` (a server, with or without a database) naming `database`.
pub fn with_database(url: &str, database: &str) -> String {
    let (base, query) = url
        .split_once('?')
        .map_or((url, None), |(b, q)| (b, Some(q)));
    let authority_end = base.find("://").map_or(0, |i| i + 3);
    let base = match base[authority_end..].find('/') {
        Some(slash) => &base[..authority_end + slash],
        None => base,
    };
    match query {
        Some(query) => format!("{base}/{database}?{query}"),
        None => format!("{base}/{database}"),
    }
}

/// A connection to `url`, or a panic that says what to install.
pub async fn connect(url: &str) -> MySqlConnection {
    MySqlConnection::connect(url).await.unwrap_or_else(|e| {
        panic!(
            "cannot reach MySQL/MariaDB at {url} ({e}). The tests need a real server: install and \
             start one (Debian/Ubuntu: `sudo apt-get install mariadb-server`, then \
             `sudo service mariadb start`; macOS: `brew install mariadb && brew services start mariadb`) \
             where `root` may connect over TCP without a password, or set MYSQL_URL to a server \
             where the tests may create databases."
        )
    })
}

/// A database that exists for one test, on `MYSQL_URL` or the local server
/// (or on any server, with [`on`](Self::on)).
pub struct TestDatabase {
    name: String,
    url: String,
    server: String,
}

impl TestDatabase {
    pub fn create() -> Self {
        Self::on(&server_url())
    }

    /// A database on the server at `server`.
    pub fn on(server: &str) -> Self {
        static SEQ: AtomicUsize = AtomicUsize::new(0);
        let name = format!(
            "tower_idempotency_test_{}_{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        );
        let create = format!("CREATE DATABASE {name}");
        let admin = server.to_owned();
        blocking(async move || {
            connect(&admin)
                .await
                .execute(sqlx::raw_sql(sqlx::AssertSqlSafe(create)))
                .await
                .expect("create the test database");
        });
        Self {
            url: with_database(server, &name),
            name,
            server: server.to_owned(),
        }
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The server's `host:port`, e.g. for a [`Relay`](super::relay::Relay).
    pub fn host_port(&self) -> String {
        let (_, rest) = self.url.split_once("://").unwrap_or(("", &self.url));
        let authority = rest.split('/').next().unwrap_or_default();
        let host_port = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
        if host_port.contains(':') {
            host_port.to_owned()
        } else {
            format!("{host_port}:3306")
        }
    }

    /// This database's URL with the server at `127.0.0.1:port` instead.
    pub fn url_via(&self, port: u16) -> String {
        let (scheme, rest) = self.url.split_once("://").unwrap_or(("mysql", &self.url));
        let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
        let credentials = authority.rsplit_once('@').map(|(c, _)| format!("{c}@"));
        format!(
            "{scheme}://{}127.0.0.1:{port}/{path}",
            credentials.unwrap_or_default()
        )
    }

    /// A fresh connection to this database.
    pub async fn connect(&self) -> MySqlConnection {
        connect(&self.url).await
    }

    /// One query on a fresh connection, for assertions: the first column of
    /// the first row, as a number.
    pub async fn count(&self, sql: &str) -> i64 {
        let mut connection = self.connect().await;
        sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
            .fetch_one(&mut connection)
            .await
            .unwrap()
    }

    /// Like [`count`](Self::count), but seeing rows other transactions
    /// have not committed yet (`READ UNCOMMITTED`).
    pub async fn count_uncommitted(&self, sql: &str) -> i64 {
        let mut connection = self.connect().await;
        connection
            .execute("SET SESSION TRANSACTION ISOLATION LEVEL READ UNCOMMITTED")
            .await
            .unwrap();
        sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
            .fetch_one(&mut connection)
            .await
            .unwrap()
    }

    /// Polls [`count`](Self::count) of `sql` until `done` holds; fails with
    /// `what` after 5 s.
    pub async fn wait_for_count(&self, sql: &str, done: impl Fn(i64) -> bool, what: &str) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while !done(self.count(sql).await) {
            assert!(Instant::now() < deadline, "{what}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        let drop = format!("DROP DATABASE IF EXISTS {}", self.name);
        let admin = self.server.clone();
        blocking(async move || {
            if let Ok(mut admin) = MySqlConnection::connect(&admin).await {
                let _ = admin
                    .execute(sqlx::raw_sql(sqlx::AssertSqlSafe(drop)))
                    .await;
            }
        });
    }
}
