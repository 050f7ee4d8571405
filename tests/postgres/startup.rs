//! What stops a store at start-up is told apart, each with its own fix: a
//! table that does not exist, a user without grants, a read-only database,
//! a server that cannot be reached, a URL that does not parse — none of
//! them reported as an unsafe engine.

use std::sync::atomic::{AtomicUsize, Ordering};

use tower_idempotency::{PostgresStore, sqlx, store::StoreError};

use crate::support::postgres::TestDatabase;

/// A login role of its own, with a password (in case the server does not
/// trust every local user), dropped with its grants at the end.
struct Role {
    name: String,
    db_url: String,
}

impl Role {
    async fn create(db: &TestDatabase) -> Self {
        static SEQ: AtomicUsize = AtomicUsize::new(0);
        let name = format!(
            "tiu_role_{}_{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        );
        let mut admin = db.connect().await;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DROP ROLE IF EXISTS {name}; CREATE ROLE {name} LOGIN PASSWORD 'secret'"
        )))
        .execute(&mut admin)
        .await
        .unwrap();
        let url = db
            .url()
            .replacen("postgres@", &format!("{name}:secret@"), 1);
        assert_ne!(url, db.url(), "the test database's URL names user postgres");
        Self { name, db_url: url }
    }

    /// Runs `sql` as the test database's owner.
    async fn admin(db: &TestDatabase, sql: &str) {
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
            .execute(&mut db.connect().await)
            .await
            .unwrap();
    }

    async fn drop_in(self, db: &TestDatabase) {
        Self::admin(db, &format!("DROP OWNED BY {0}; DROP ROLE {0}", self.name)).await;
    }
}

async fn connect(url: &str) -> Result<(), StoreError> {
    PostgresStore::builder()
        .transactional()
        .connect(url)
        .await
        .map(drop)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_table_is_refused_at_start_up_naming_the_fix() {
    let db = TestDatabase::create();
    let error = connect(db.url()).await.unwrap_err();
    assert!(matches!(error, StoreError::Misconfigured(_)), "{error}");
    let said = error.to_string();
    assert!(said.contains("does not exist"), "{said}");
    assert!(said.contains("create_table_if_missing"), "{said}");
    assert!(!said.contains("start-up check"), "not an engine: {said}");
    // Created at start-up when asked.
    PostgresStore::builder()
        .transactional()
        .create_table_if_missing()
        .connect(db.url())
        .await
        .unwrap();
    connect(db.url()).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_without_grants_is_told_to_grant_not_to_disable_the_check() {
    let db = TestDatabase::create();
    connect_created(&db).await;
    let role = Role::create(&db).await;
    for grant in ["", "GRANT SELECT ON idempotency_records TO {role}"] {
        if !grant.is_empty() {
            Role::admin(&db, &grant.replace("{role}", &role.name)).await;
        }
        let error = connect(&role.db_url).await.unwrap_err();
        let said = error.to_string();
        assert!(matches!(error, StoreError::Misconfigured(_)), "{said}");
        assert!(
            said.contains("GRANT SELECT, INSERT, UPDATE, DELETE"),
            "{said}"
        );
        assert!(
            !said.contains("EngineCheck::Warn"),
            "not an unsafe engine: {said}"
        );
    }
    Role::admin(
        &db,
        &format!(
            "GRANT SELECT, INSERT, UPDATE, DELETE ON idempotency_records TO {}",
            role.name
        ),
    )
    .await;
    connect(&role.db_url).await.unwrap();
    role.drop_in(&db).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_database_says_so() {
    let db = TestDatabase::create();
    connect_created(&db).await;
    let role = Role::create(&db).await;
    Role::admin(
        &db,
        &format!(
            "GRANT SELECT, INSERT, UPDATE, DELETE ON idempotency_records TO {0}; \
             ALTER ROLE {0} SET default_transaction_read_only = on",
            role.name
        ),
    )
    .await;
    let said = connect(&role.db_url).await.unwrap_err().to_string();
    assert!(said.contains("read-only"), "{said}");
    assert!(!said.contains("EngineCheck::Warn"), "{said}");
    role.drop_in(&db).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_server_and_a_bad_url_say_what_they_are() {
    let port = crate::support::redis_server::free_port();
    let closed = format!("postgres://postgres@127.0.0.1:{port}/postgres");
    let said = connect(&closed).await.unwrap_err().to_string();
    assert!(said.contains("cannot connect"), "{said}");
    assert!(said.to_lowercase().contains("refused"), "why: {said}");
    let error = connect("postgres://postgres@127.0.0.1:notaport/db")
        .await
        .unwrap_err();
    assert!(matches!(error, StoreError::Misconfigured(_)), "{error}");
}

/// A database or a role that does not exist is a mistake in the URL, not
/// an outage; a user who may not create tables, asked to create the table,
/// is told to grant CREATE or migrate — not to grant on a table that is not
/// there yet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_database_or_role_and_a_missing_create_right_say_what_they_are() {
    let db = TestDatabase::create();
    let (server, _) = db.url().rsplit_once('/').unwrap();
    let error = connect(&format!("{server}/tiu_no_such_database"))
        .await
        .unwrap_err();
    assert!(matches!(error, StoreError::Misconfigured(_)), "{error}");
    let said = error.to_string();
    assert!(said.contains("does not exist"), "{said}");
    assert!(said.contains("CREATE DATABASE"), "{said}");
    let error = connect(&db.url().replacen("postgres@", "tiu_no_such_role:x@", 1))
        .await
        .unwrap_err();
    assert!(matches!(error, StoreError::Misconfigured(_)), "{error}");
    assert!(error.to_string().contains("credentials"), "{error}");

    let role = Role::create(&db).await;
    Role::admin(
        &db,
        &format!("REVOKE CREATE ON SCHEMA public FROM PUBLIC, {}", role.name),
    )
    .await;
    let error = PostgresStore::builder()
        .transactional()
        .create_table_if_missing()
        .connect(&role.db_url)
        .await
        .unwrap_err();
    let said = error.to_string();
    assert!(matches!(error, StoreError::Misconfigured(_)), "{said}");
    assert!(said.contains("may not create the table"), "{said}");
    assert!(said.contains("GRANT CREATE ON SCHEMA"), "{said}");
    role.drop_in(&db).await;
}

/// The table, created by its owner.
async fn connect_created(db: &TestDatabase) {
    PostgresStore::builder()
        .transactional()
        .create_table_if_missing()
        .connect(db.url())
        .await
        .unwrap();
}
