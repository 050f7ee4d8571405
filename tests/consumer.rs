//! Queue consumers: the message API on every store, and the
//! `orders_consumer` example on a real RabbitMQ and PostgreSQL, counting rows
//! of `order_charges` (no unique constraint: a double execution shows).

mod support;

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use tower_idempotency::{
    MemoryStore, PostgresStore,
    message::{Idempotent, ProcessError, Processed},
    sqlx,
    store::Store,
};

use support::{
    amqp::TestQueue,
    backend::{Backend, Postgres, SingleRedis},
    consumer::OrdersConsumer,
    postgres::TestDatabase,
    relay::Relay,
};

const ORDER: &[u8] = br#"{"order_id":"order-1","amount":500,"currency":"eur"}"#;

type Runs = Arc<AtomicUsize>;

/// Work that counts itself and returns a charge id.
fn charge(
    runs: &Runs,
) -> impl AsyncFnOnce(tower_idempotency::message::Claimed) -> Result<String, String> {
    let runs = runs.clone();
    async move |_| {
        let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
        Ok(format!("ch_{n}"))
    }
}

async fn the_protocol_on<St: Store>(store: St) {
    let orders = Idempotent::new(store).namespace("orders");
    let runs = Runs::default();

    let first = orders.run("order-1", ORDER, charge(&runs)).await.unwrap();
    assert_eq!(first, Processed::Executed("ch_1".to_owned()));
    // Redelivered, reformatted: the stored result, no second run.
    let reformatted = br#"{ "currency": "eur", "amount": 500, "order_id": "order-1" }"#;
    let again = orders
        .run("order-1", reformatted, charge(&runs))
        .await
        .unwrap();
    assert_eq!(again, Processed::Duplicate("ch_1".to_owned()));
    // The same business key with another payload.
    let other = br#"{"order_id":"order-1","amount":999,"currency":"eur"}"#;
    assert_eq!(
        orders.run("order-1", other, charge(&runs)).await.unwrap(),
        Processed::Mismatch
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    // Failures release the key: the redelivery runs.
    let failed = orders
        .run("order-2", ORDER, async |_| {
            Err::<String, _>("processor down")
        })
        .await;
    assert!(matches!(failed, Err(ProcessError::Work("processor down"))));
    let panicked = orders
        .run("order-2", ORDER, async |_| -> Result<String, String> {
            panic!("boom")
        })
        .await;
    assert!(matches!(panicked, Err(ProcessError::Panicked)));
    assert_eq!(
        orders.run("order-2", ORDER, charge(&runs)).await.unwrap(),
        Processed::Executed("ch_2".to_owned())
    );

    // While one delivery runs, another is told to come back later.
    let slow = orders.run("order-3", ORDER, async |_| {
        tokio::time::sleep(Duration::from_millis(400)).await;
        Ok::<_, String>("slow".to_owned())
    });
    let meanwhile = async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        orders.run("order-3", ORDER, charge(&runs)).await.unwrap()
    };
    let (slow, meanwhile) = tokio::join!(slow, meanwhile);
    assert_eq!(slow.unwrap(), Processed::Executed("slow".to_owned()));
    assert!(
        matches!(meanwhile, Processed::InFlight { .. }),
        "{meanwhile:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 2);

    assert!(matches!(
        orders.run("", ORDER, charge(&runs)).await,
        Err(ProcessError::InvalidKey(_))
    ));
}

#[tokio::test]
async fn the_protocol_on_the_memory_store() {
    the_protocol_on(MemoryStore::new()).await;
}

#[tokio::test]
async fn the_protocol_on_redis() {
    let redis = SingleRedis::start();
    the_protocol_on(redis.store().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_protocol_on_postgres() {
    let postgres = Postgres::start();
    the_protocol_on(postgres.store().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_protocol_on_transactional_postgres() {
    let db = TestDatabase::create();
    let store = PostgresStore::builder()
        .transactional()
        .connect(db.url())
        .await
        .unwrap();
    store.migrate().await.unwrap();
    the_protocol_on(store).await;
}

#[tokio::test]
async fn the_heartbeat_keeps_slow_work_claimed() {
    let orders = Idempotent::new(MemoryStore::new()).lease(Duration::from_millis(100));
    let runs = Runs::default();
    let slow = orders.run("order-1", ORDER, async |_| {
        tokio::time::sleep(Duration::from_millis(600)).await;
        Ok::<_, String>("slow".to_owned())
    });
    let probes = async {
        for _ in 0..3 {
            tokio::time::sleep(Duration::from_millis(150)).await;
            let probe = orders.run("order-1", ORDER, charge(&runs)).await.unwrap();
            assert!(matches!(probe, Processed::InFlight { .. }), "{probe:?}");
        }
    };
    let (slow, ()) = tokio::join!(slow, probes);
    assert_eq!(slow.unwrap(), Processed::Executed("slow".to_owned()));
    assert_eq!(runs.load(Ordering::SeqCst), 0, "never run alongside");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_transactional_postgres_the_record_commits_with_the_work() {
    let db = TestDatabase::create();
    let store = PostgresStore::builder()
        .transactional()
        .connect(db.url())
        .await
        .unwrap();
    store.migrate().await.unwrap();
    sqlx::raw_sql("CREATE TABLE order_charges (order_id text, amount bigint)")
        .execute(store.pool())
        .await
        .unwrap();
    let orders = Idempotent::new(store);
    let work = |fail: bool| {
        async move |claimed: tower_idempotency::message::Claimed| {
            let mut tx = claimed.transaction().expect("transactional");
            sqlx::query("INSERT INTO order_charges VALUES ('order-1', 500)")
                .execute(&mut *tx)
                .await
                .map_err(|e| e.to_string())?;
            if fail {
                return Err("the processor declined".to_owned());
            }
            Ok("charged".to_owned())
        }
    };
    let rows = || db.count("SELECT count(*) FROM order_charges");

    assert!(matches!(
        orders.run("order-1", ORDER, work(true)).await,
        Err(ProcessError::Work(_))
    ));
    assert_eq!(rows().await, 0, "a failed work's insert is rolled back");
    assert_eq!(
        orders.run("order-1", ORDER, work(false)).await.unwrap(),
        Processed::Executed("charged".to_owned())
    );
    assert_eq!(
        orders.run("order-1", ORDER, work(false)).await.unwrap(),
        Processed::Duplicate("charged".to_owned())
    );
    assert_eq!(rows().await, 1);
}

// The example on RabbitMQ and PostgreSQL.

fn order(id: &str, amount: i64) -> String {
    format!(r#"{{"order_id":"{id}","amount":{amount},"currency":"eur"}}"#)
}

const CHARGES: &str = "SELECT count(*) FROM order_charges";

async fn charges(db: &TestDatabase) -> i64 {
    db.count(CHARGES).await
}

/// Waits until the queue holds no ready message (up to 20 s).
async fn drained(queue: &TestQueue) {
    for _ in 0..200 {
        if queue.ready().await == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("{} still has {} messages", queue.name, queue.ready().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_order_published_twice_charges_once_and_both_are_acknowledged() {
    let db = TestDatabase::create();
    let queue = TestQueue::declare().await;
    let consumer =
        OrdersConsumer::start(&[("DATABASE_URL", db.url()), ("QUEUE", &queue.name)]).await;

    queue.publish(&order("order-1", 500)).await;
    queue.publish(&order("order-1", 500)).await;
    consumer.wait_for(|l| l == "executed order-1").await;
    consumer.wait_for(|l| l == "duplicate order-1").await;
    // Same order id, other amount: rejected, not charged.
    queue.publish(&order("order-1", 900)).await;
    consumer.wait_for(|l| l == "rejected order-1").await;
    // Not an order at all.
    queue.publish("{not json").await;
    consumer.wait_for(|l| l.starts_with("invalid ")).await;
    drained(&queue).await;
    assert_eq!(charges(&db).await, 1);
    queue.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_between_commit_and_ack_the_redelivery_is_a_duplicate() {
    let db = TestDatabase::create();
    let queue = TestQueue::declare().await;
    let env = [("DATABASE_URL", db.url()), ("QUEUE", queue.name.as_str())];
    let mut consumer = OrdersConsumer::start(&[env[0], env[1], ("ACK_DELAY_MS", "5000")]).await;
    queue.publish(&order("order-1", 500)).await;
    // Committed, not yet acknowledged.
    db.wait_for_count(CHARGES, |n| n == 1, "the order was never charged")
        .await;
    consumer.kill();

    // The broker redelivers the unacknowledged message to the new consumer.
    let consumer = OrdersConsumer::start(&env).await;
    consumer.wait_for(|l| l == "duplicate order-1").await;
    drained(&queue).await;
    assert_eq!(charges(&db).await, 1, "still one charge");
    assert!(!consumer.lines().iter().any(|l| l.starts_with("executed")));
    queue.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_mid_work_nothing_commits_and_the_redelivery_executes_once() {
    let db = TestDatabase::create();
    let queue = TestQueue::declare().await;
    let env = [("DATABASE_URL", db.url()), ("QUEUE", queue.name.as_str())];
    let mut consumer = OrdersConsumer::start(&[env[0], env[1], ("WORK_DELAY_MS", "5000")]).await;
    queue.publish(&order("order-1", 500)).await;
    // Killed once the row is inserted, uncommitted, while the "processor"
    // waits.
    let inserted = "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
                    AND state = 'idle in transaction' AND query LIKE 'INSERT INTO order_charges%'";
    db.wait_for_count(inserted, |n| n == 1, "the work never inserted its row")
        .await;
    consumer.kill();
    assert_eq!(charges(&db).await, 0, "nothing committed");

    let consumer = OrdersConsumer::start(&env).await;
    consumer.wait_for(|l| l == "executed order-1").await;
    drained(&queue).await;
    assert_eq!(charges(&db).await, 1);
    queue.delete().await;
}

/// The database unreachable while an order waits: the consumer puts the
/// message back (no ack, nothing charged, nothing lost) and charges the
/// order once the database is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_database_unreachable_an_order_waits_and_is_charged_once_it_returns() {
    let db = TestDatabase::create();
    let relay = Relay::start(&db.host_port()).await;
    let queue = TestQueue::declare().await;
    let url = db.url_via(relay.port());
    let consumer = OrdersConsumer::start(&[("DATABASE_URL", &url), ("QUEUE", &queue.name)]).await;

    relay.cut();
    queue.publish(&order("order-1", 500)).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        !consumer.lines().iter().any(|l| l.ends_with("order-1")),
        "no outcome while the database is away: {:?}",
        consumer.lines()
    );
    assert_eq!(charges(&db).await, 0);

    relay.restore();
    consumer.wait_for(|l| l == "executed order-1").await;
    drained(&queue).await;
    assert_eq!(charges(&db).await, 1);
    queue.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_consumers_and_concurrent_duplicates_one_charge_per_order() {
    let db = TestDatabase::create();
    let queue = TestQueue::declare().await;
    let env = [
        ("DATABASE_URL", db.url()),
        ("QUEUE", queue.name.as_str()),
        ("WORK_DELAY_MS", "20"),
    ];
    let first = OrdersConsumer::start(&env).await;
    let second = OrdersConsumer::start(&env).await;
    let orders = 20;
    let publishes = (0..orders * 3).map(|i| {
        let queue = &queue;
        async move {
            queue
                .publish(&order(&format!("order-{}", i % orders), 500))
                .await
        }
    });
    futures_util::future::join_all(publishes).await;
    drained(&queue).await;
    // Every delivery answered: executed or duplicate (in-flight ones requeued).
    for _ in 0..200 {
        let done = [&first, &second]
            .iter()
            .flat_map(|c| c.lines())
            .filter(|l| l.starts_with("executed") || l.starts_with("duplicate"))
            .count();
        if done == (orders * 3) as usize {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let per_order = db
        .count("SELECT count(*) FROM (SELECT order_id FROM order_charges GROUP BY order_id HAVING count(*) <> 1) AS twice")
        .await;
    assert_eq!(per_order, 0, "no order charged twice");
    assert_eq!(charges(&db).await, orders);
    let executed = [&first, &second]
        .iter()
        .flat_map(|c| c.lines())
        .filter(|l| l.starts_with("executed"))
        .count();
    assert_eq!(executed, orders as usize);
    queue.delete().await;
}
