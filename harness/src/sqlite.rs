//! SQLite for the tests: a database file in a directory of its own under
//! the system's temporary directory, removed when the test ends.

use std::{
    path::PathBuf,
    sync::atomic::{AtomicUsize, Ordering},
};

use sqlx::{Connection, SqliteConnection};

/// A database file that exists for one test.
pub struct TestFile {
    dir: PathBuf,
}

impl TestFile {
    pub fn create() -> Self {
        static SEQ: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "tower-idempotency-sqlite-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).expect("create the test's directory");
        Self { dir }
    }

    pub fn path(&self) -> PathBuf {
        self.dir.join("test.db")
    }

    /// `sqlite://…`, the file created if missing.
    pub fn url(&self) -> String {
        format!("sqlite://{}?mode=rwc", self.path().display())
    }

    /// One query on a fresh connection, for assertions: the first column of
    /// the first row, as a number.
    pub async fn count(&self, sql: &str) -> i64 {
        let mut connection = SqliteConnection::connect(&self.url()).await.unwrap();
        sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
            .fetch_one(&mut connection)
            .await
            .unwrap()
    }
}

impl Drop for TestFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
