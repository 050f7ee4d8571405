//! PostgreSQL for the tests: `DATABASE_URL` when set, else the local server
//! at `postgres://postgres@127.0.0.1:5432/postgres`. Each test gets a
//! throwaway database, dropped when it ends.

use std::{
    sync::atomic::{AtomicUsize, Ordering},
    time::{Duration, Instant},
};

use sqlx::{Connection, Executor, PgConnection};

use crate::blocking;

const LOCAL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

/// The server the tests use: `DATABASE_URL`, or the local one.
pub fn server_url() -> String {
    std::env::var("DATABASE_URL").unwrap_or_else(|_| LOCAL.to_owned())
}

/// `url` with its database name replaced.
fn with_database(url: &str, database: &str) -> String {
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

/// `scheme://`, the authority (credentials and `host:port`), the rest.
fn split_authority(url: &str) -> (&str, &str, &str) {
    let start = url.find("://").map_or(0, |i| i + 3);
    let end = url[start..].find('/').map_or(url.len(), |i| start + i);
    (&url[..start], &url[start..end], &url[end..])
}

async fn admin() -> PgConnection {
    let url = server_url();
    PgConnection::connect(&url).await.unwrap_or_else(|e| {
        panic!(
            "cannot reach PostgreSQL at {url} ({e}). The tests need a real PostgreSQL server: \
             install and start one (Debian/Ubuntu: `sudo apt-get install postgresql`, then \
             `sudo service postgresql start`; macOS: `brew install postgresql && brew services start postgresql`) \
             with a `postgres` user that may connect over TCP without a password, \
             or set DATABASE_URL to a server where the tests may create databases."
        )
    })
}

/// A database that exists for one test.
pub struct TestDatabase {
    name: String,
    url: String,
}

impl TestDatabase {
    pub fn create() -> Self {
        static SEQ: AtomicUsize = AtomicUsize::new(0);
        let name = format!(
            "tower_idempotency_test_{}_{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        );
        let create = format!("CREATE DATABASE {name}");
        blocking(async move || {
            let mut admin = admin().await;
            admin
                .execute(sqlx::raw_sql(sqlx::AssertSqlSafe(create)))
                .await
                .expect("create the test database");
        });
        let url = with_database(&server_url(), &name);
        Self { name, url }
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    /// The server's `host:port`, e.g. for a [`Relay`](super::relay::Relay).
    pub fn host_port(&self) -> String {
        let (_, host_port, _) = split_authority(&self.url);
        let host_port = host_port.rsplit_once('@').map_or(host_port, |(_, h)| h);
        if host_port.contains(':') {
            host_port.to_owned()
        } else {
            format!("{host_port}:5432")
        }
    }

    /// This database's URL with the server at `127.0.0.1:port` instead.
    pub fn url_via(&self, port: u16) -> String {
        let (scheme, authority, rest) = split_authority(&self.url);
        let credentials = authority.rsplit_once('@').map_or("", |(c, _)| c);
        let at = if credentials.is_empty() { "" } else { "@" };
        format!("{scheme}{credentials}{at}127.0.0.1:{port}{rest}")
    }

    /// A fresh connection to this database.
    pub async fn connect(&self) -> PgConnection {
        PgConnection::connect(&self.url).await.unwrap()
    }

    /// One query on a fresh connection, for assertions: the first column of
    /// the first row, as a number.
    pub async fn count(&self, sql: &str) -> i64 {
        let mut connection = PgConnection::connect(&self.url).await.unwrap();
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
        let drop = format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name);
        blocking(async move || {
            let _ = admin()
                .await
                .execute(sqlx::raw_sql(sqlx::AssertSqlSafe(drop)))
                .await;
        });
    }
}
