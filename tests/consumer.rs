//! Queue consumers: the message API on every store, counting the work's
//! runs and rows (the example consumers, on real brokers, are tested in the
//! examples package).

// The suite runs against every store: `cargo test --all-features`.
#![cfg(every_store)]

mod support;

use std::{
    borrow::Cow,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use tower_idempotency::{
    MemoryStore, MySqlTx, MySqlTxStore, PostgresStore, PostgresTx, PostgresTxStore, SqliteStore,
    SqliteTx, SqliteTxStore,
    message::{
        Acked, Broker, BrokerError, Consumer, DeadLetterReason, DeadLettered, Delivery,
        DeliveryBudget, Disposition, IdempotencyProcessor, Parsed, ProcessError, ProcessOutcome,
        Received, extend_every,
    },
    sqlx,
    store::Store,
};

use support::{
    backend::{self, Backend, Postgres, SingleRedis},
    postgres::TestDatabase,
    relay::Relay,
    sqlite::TestFile,
};

const ORDER: &[u8] = br#"{"order_id":"order-1","amount":500,"currency":"eur"}"#;

type Runs = Arc<AtomicUsize>;

/// Work that counts itself and returns a charge id.
fn charge<G>(runs: &Runs) -> impl AsyncFnOnce(&mut G) -> Result<String, String> {
    let runs = runs.clone();
    async move |_| {
        let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
        Ok(format!("ch_{n}"))
    }
}

async fn the_protocol_on<St: Store>(store: St) {
    let orders = IdempotencyProcessor::new(store).scope("orders");
    let runs = Runs::default();

    let first = orders
        .process("order-1", ORDER, charge(&runs))
        .await
        .unwrap();
    assert_eq!(first, ProcessOutcome::Executed("ch_1".to_owned()));
    // Redelivered, reformatted: the stored result, no second run.
    let reformatted = br#"{ "currency": "eur", "amount": 500, "order_id": "order-1" }"#;
    let again = orders
        .process("order-1", reformatted, charge(&runs))
        .await
        .unwrap();
    assert_eq!(again, ProcessOutcome::Duplicate("ch_1".to_owned()));
    // The same business key with another payload.
    let other = br#"{"order_id":"order-1","amount":999,"currency":"eur"}"#;
    assert_eq!(
        orders
            .process("order-1", other, charge(&runs))
            .await
            .unwrap(),
        ProcessOutcome::Mismatch
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    // Failures release the key: the redelivery runs.
    let failed = orders
        .process("order-2", ORDER, async |_| {
            Err::<String, _>("processor down")
        })
        .await;
    assert!(matches!(failed, Err(ProcessError::Work("processor down"))));
    let panicked = orders
        .process("order-2", ORDER, async |_| -> Result<String, String> {
            panic!("boom")
        })
        .await;
    assert!(matches!(panicked, Err(ProcessError::Panicked)));
    assert_eq!(
        orders
            .process("order-2", ORDER, charge(&runs))
            .await
            .unwrap(),
        ProcessOutcome::Executed("ch_2".to_owned())
    );

    // While one delivery runs, another is told to come back later.
    let slow = orders.process("order-3", ORDER, async |_| {
        tokio::time::sleep(Duration::from_millis(400)).await;
        Ok::<_, String>("slow".to_owned())
    });
    let meanwhile = async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        orders
            .process("order-3", ORDER, charge(&runs))
            .await
            .unwrap()
    };
    let (slow, meanwhile) = tokio::join!(slow, meanwhile);
    assert_eq!(slow.unwrap(), ProcessOutcome::Executed("slow".to_owned()));
    assert!(
        matches!(meanwhile, ProcessOutcome::InFlight { .. }),
        "{meanwhile:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 2);

    assert!(matches!(
        orders.process("", ORDER, charge(&runs)).await,
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
        .create_table_if_missing()
        .connect(db.url())
        .await
        .unwrap();
    the_protocol_on(store).await;
}

#[tokio::test]
async fn the_heartbeat_keeps_slow_work_claimed() {
    let orders = IdempotencyProcessor::new(MemoryStore::new()).lease(Duration::from_millis(100));
    let runs = Runs::default();
    let slow = orders.process("order-1", ORDER, async |_| {
        tokio::time::sleep(Duration::from_millis(600)).await;
        Ok::<_, String>("slow".to_owned())
    });
    let probes = async {
        for _ in 0..3 {
            tokio::time::sleep(Duration::from_millis(150)).await;
            let probe = orders
                .process("order-1", ORDER, charge(&runs))
                .await
                .unwrap();
            assert!(
                matches!(probe, ProcessOutcome::InFlight { .. }),
                "{probe:?}"
            );
        }
    };
    let (slow, ()) = tokio::join!(slow, probes);
    assert_eq!(slow.unwrap(), ProcessOutcome::Executed("slow".to_owned()));
    assert_eq!(runs.load(Ordering::SeqCst), 0, "never run alongside");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_transactional_postgres_the_record_commits_with_the_work() {
    let db = TestDatabase::create();
    let store = PostgresStore::builder()
        .transactional()
        .create_table_if_missing()
        .connect(db.url())
        .await
        .unwrap();
    sqlx::raw_sql("CREATE TABLE order_charges (order_id text, amount bigint)")
        .execute(store.pool())
        .await
        .unwrap();
    let orders = IdempotencyProcessor::new(store);
    let work = |fail: bool| {
        async move |tx: &mut PostgresTx| {
            sqlx::query("INSERT INTO order_charges VALUES ('order-1', 500)")
                .execute(&mut **tx)
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
        orders.process("order-1", ORDER, work(true)).await,
        Err(ProcessError::Work(_))
    ));
    assert_eq!(rows().await, 0, "a failed work's insert is rolled back");
    assert_eq!(
        orders.process("order-1", ORDER, work(false)).await.unwrap(),
        ProcessOutcome::Executed("charged".to_owned())
    );
    assert_eq!(
        orders.process("order-1", ORDER, work(false)).await.unwrap(),
        ProcessOutcome::Duplicate("charged".to_owned())
    );
    assert_eq!(rows().await, 1);
}

// Settling a delivery: what can pass is retried in hand, only what can
// never succeed is dead-lettered, and nothing is dropped.

/// A budget that backs off quickly, for tests.
fn quick() -> DeliveryBudget {
    DeliveryBudget::new().backoff_between(Duration::from_millis(50), Duration::from_millis(200))
}

/// A transactional PostgreSQL store with `order_charges`, reached through
/// `relay` (if any), its transactions bounded by `bound`.
async fn ledger(db: &TestDatabase, relay: Option<&Relay>, bound: Duration) -> PostgresTxStore {
    let direct = PostgresStore::builder()
        .transactional()
        .create_table_if_missing()
        .connect(db.url())
        .await
        .unwrap();
    sqlx::raw_sql("CREATE TABLE order_charges (order_id text, amount bigint)")
        .execute(direct.pool())
        .await
        .unwrap();
    let url = relay.map_or_else(|| db.url().to_owned(), |r| db.url_via(r.port()));
    PostgresStore::builder()
        .transactional()
        .transaction_timeout(bound)
        .connect(&url)
        .await
        .unwrap()
}

/// Inserts the order's charge, sleeping `delays[n]` (then the last) on the
/// n-th call before its commit; counts its calls.
fn charging(
    calls: &Runs,
    delays: &'static [u64],
) -> impl AsyncFnMut(&mut PostgresTx) -> Result<String, sqlx::Error> {
    let calls = calls.clone();
    async move |tx: &mut PostgresTx| {
        let n = calls.fetch_add(1, Ordering::SeqCst);
        sqlx::query("INSERT INTO order_charges VALUES ('order-1', 500)")
            .execute(&mut **tx)
            .await?;
        let delay = delays.get(n).or(delays.last()).copied().unwrap_or(0);
        tokio::time::sleep(Duration::from_millis(delay)).await;
        Ok("charged".to_owned())
    }
}

/// The database away for a while, then one attempt that outlives its
/// transaction: neither spends the delivery. The delivery is kept in hand —
/// its hold extended all the while — and the order is charged once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_then_one_timed_out_attempt_is_retried_in_hand_and_charged_once() {
    let db = TestDatabase::create();
    let relay = Relay::start(&db.host_port()).await;
    let store = ledger(&db, Some(&relay), Duration::from_millis(400)).await;
    let orders = IdempotencyProcessor::new(store).budget(quick());
    let extended = Runs::default();
    let hold = extend_every(Duration::from_millis(100), || async {
        extended.fetch_add(1, Ordering::SeqCst);
        Ok(())
    });
    let calls = Runs::default();
    relay.cut();
    let restore = async {
        tokio::time::sleep(Duration::from_secs(2)).await;
        relay.restore();
    };
    let delivery = Delivery::new("order-1", ORDER).held_by(&hold);
    // The first attempt that reaches the database outlives its bound.
    let settling = orders.settle(delivery, charging(&calls, &[1500, 0]), |_| true);
    let (settled, ()) = tokio::join!(settling, restore);
    assert_eq!(settled.disposition, Disposition::Ack, "{settled:?}");
    assert!(matches!(settled.outcome, Ok(ProcessOutcome::Executed(_))));
    assert!(
        settled.attempts >= 4,
        "the outage took attempts: {settled:?}"
    );
    assert_eq!(
        calls.load(Ordering::SeqCst),
        2,
        "one timed out, one committed"
    );
    assert!(
        extended.load(Ordering::SeqCst) >= 15,
        "the hold was kept through the waits"
    );
    assert_eq!(db.count("SELECT count(*) FROM order_charges").await, 1);
}

/// Work that always outlives its transaction can never commit: after the
/// budget's attempts it is dead-lettered, saying so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_that_outlives_its_bound_on_every_attempt_is_dead_lettered_as_timed_out() {
    let db = TestDatabase::create();
    let store = ledger(&db, None, Duration::from_millis(300)).await;
    let orders = IdempotencyProcessor::new(store).budget(quick().timed_out_attempts(2));
    let calls = Runs::default();
    let settled = orders
        .settle(
            Delivery::new("order-1", ORDER),
            charging(&calls, &[800]),
            |_| true,
        )
        .await;
    assert!(
        matches!(
            &settled.disposition,
            Disposition::DeadLetter(DeadLetterReason::TimedOut { attempts: 2, bound })
                if *bound == Duration::from_millis(300)
        ),
        "{settled:?}"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    assert_eq!(db.count("SELECT count(*) FROM order_charges").await, 0);
}

/// A producer's resend while the first delivery's long work runs waits in
/// hand, then acknowledges as a duplicate: never run, never dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_in_flight_waits_in_hand_and_is_acknowledged_as_a_duplicate() {
    let db = TestDatabase::create();
    let store = ledger(&db, None, Duration::from_secs(10)).await;
    let orders = IdempotencyProcessor::new(store).budget(quick());
    let (first_calls, second_calls) = (Runs::default(), Runs::default());
    let first = orders.settle(
        Delivery::new("order-1", ORDER),
        charging(&first_calls, &[1500]),
        |_| true,
    );
    let second = async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        orders
            .settle(
                Delivery::new("order-1", ORDER).last(true),
                charging(&second_calls, &[0]),
                |_| true,
            )
            .await
    };
    let (first, second) = tokio::join!(first, second);
    assert_eq!(first.disposition, Disposition::Ack);
    assert_eq!(second.disposition, Disposition::Ack, "{second:?}");
    assert!(matches!(second.outcome, Ok(ProcessOutcome::Duplicate(_))));
    assert!(second.attempts > 1, "it waited: {second:?}");
    assert_eq!(second_calls.load(Ordering::SeqCst), 0);
    assert_eq!(db.count("SELECT count(*) FROM order_charges").await, 1);
}

/// Draining gives a delivery waiting between attempts back at once; on the
/// broker's last delivery it is dead-lettered as undecided instead, never
/// left for the broker to drop. A budget that gives back after a while
/// does so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_undecided_delivery_goes_back_on_drain_or_budget_and_is_never_dropped_on_its_last() {
    let db = TestDatabase::create();
    let relay = Relay::start(&db.host_port()).await;
    let store = ledger(&db, Some(&relay), Duration::from_secs(10)).await;
    relay.cut();
    let calls = Runs::default();

    let kept = IdempotencyProcessor::new(store.clone())
        .budget(quick().give_back_after(Duration::from_millis(700)));
    let started = std::time::Instant::now();
    let settled = kept
        .settle(
            Delivery::new("order-1", ORDER),
            charging(&calls, &[0]),
            |_| true,
        )
        .await;
    assert!(
        matches!(settled.disposition, Disposition::Retry { after } if after > Duration::ZERO),
        "{settled:?}"
    );
    assert!(started.elapsed() >= Duration::from_millis(700));
    assert!(matches!(settled.outcome, Err(ProcessError::Unavailable(_))));

    let orders = IdempotencyProcessor::new(store).budget(quick());
    for last in [false, true] {
        let settling = orders.settle(
            Delivery::new("order-1", ORDER).last(last),
            charging(&calls, &[0]),
            |_| true,
        );
        let drain = async {
            tokio::time::sleep(Duration::from_millis(500)).await;
            orders.drain();
            std::time::Instant::now()
        };
        let (settled, drained_at) = tokio::join!(settling, drain);
        assert!(drained_at.elapsed() < Duration::from_millis(400), "at once");
        if last {
            assert!(
                matches!(
                    &settled.disposition,
                    Disposition::DeadLetter(DeadLetterReason::Undecided(_))
                ),
                "{settled:?}"
            );
        } else {
            assert_eq!(
                settled.disposition,
                Disposition::Retry {
                    after: Duration::ZERO
                }
            );
        }
    }
    assert_eq!(calls.load(Ordering::SeqCst), 0, "never ran");
    relay.restore();
    assert_eq!(db.count("SELECT count(*) FROM order_charges").await, 0);
}

/// What can never succeed is dead-lettered at once, with a reason that is
/// true: the key reused with another payload, a work error judged
/// permanent.
#[tokio::test]
async fn only_what_can_never_succeed_is_dead_lettered_with_its_reason() {
    let orders = IdempotencyProcessor::new(MemoryStore::new());
    let runs = Runs::default();
    let declined = orders
        .settle(
            Delivery::new("order-1", ORDER),
            async |_: &mut _| Err::<String, _>("card declined".to_owned()),
            |_| false,
        )
        .await;
    assert_eq!(
        declined.disposition,
        Disposition::DeadLetter(DeadLetterReason::Work("card declined".into()))
    );
    assert_eq!(declined.attempts, 1);
    let settled = orders
        .settle(
            Delivery::new("order-1", ORDER),
            async |_: &mut _| Ok::<_, String>(runs.fetch_add(1, Ordering::SeqCst)),
            |_| true,
        )
        .await;
    assert_eq!(settled.disposition, Disposition::Ack);
    let other = br#"{"order_id":"order-1","amount":900,"currency":"eur"}"#;
    let reused = orders
        .settle(
            Delivery::new("order-1", other),
            async |_: &mut _| Ok::<_, String>(runs.fetch_add(1, Ordering::SeqCst)),
            |_| true,
        )
        .await;
    assert_eq!(
        reused.disposition,
        Disposition::DeadLetter(DeadLetterReason::Mismatch)
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// One SQLite file takes one writer at a time: deliveries of one consumer
/// wait their turn in line instead of timing out into retries — each is
/// settled on its first attempt, however long the others' work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_sqlite_a_consumers_deliveries_wait_their_turn_instead_of_timing_out() {
    let file = TestFile::create();
    let store = SqliteStore::builder()
        .transactional()
        .command_timeout(Duration::from_millis(200))
        .create_table_if_missing()
        .connect(&file.url())
        .await
        .unwrap();
    sqlx::raw_sql("CREATE TABLE order_charges (order_id TEXT)")
        .execute(store.pool())
        .await
        .unwrap();
    let orders = IdempotencyProcessor::new(store).budget(quick());
    let ids: Vec<String> = (1..=4).map(|i| format!("order-{i}")).collect();
    let settles = ids.iter().map(|id| {
        let orders = &orders;
        async move {
            orders
                .settle(
                    Delivery::new(id, id.as_bytes()),
                    async |tx: &mut SqliteTx| {
                        sqlx::query("INSERT INTO order_charges VALUES (?1)")
                            .bind(id)
                            .execute(&mut **tx)
                            .await?;
                        // Longer than the store's command timeout.
                        tokio::time::sleep(Duration::from_millis(500)).await;
                        Ok::<_, sqlx::Error>(())
                    },
                    |_| true,
                )
                .await
        }
    });
    let settled = futures_util::future::join_all(settles).await;
    for settled in &settled {
        assert_eq!(settled.disposition, Disposition::Ack, "{settled:?}");
        assert_eq!(settled.attempts, 1, "waited in line: {settled:?}");
    }
    assert_eq!(file.count("SELECT count(*) FROM order_charges").await, 4);
}

// Safety, round 2: a cancelled future, a result type that changed.

/// The result type changed between deploys: the redelivery of a processed
/// message is still a duplicate (acknowledged), not an error that requeues
/// it forever, and the work does not run again.
#[tokio::test]
async fn a_stored_result_that_no_longer_reads_is_a_duplicate() {
    let orders = IdempotencyProcessor::new(MemoryStore::new());
    let runs = Runs::default();
    let first = orders
        .process("order-1", ORDER, charge(&runs))
        .await
        .unwrap();
    assert_eq!(first, ProcessOutcome::Executed("ch_1".to_owned()));

    let redeployed = orders
        .process("order-1", ORDER, async |_| -> Result<u64, String> {
            panic!("the work ran again")
        })
        .await
        .unwrap();
    assert!(
        matches!(redeployed, ProcessOutcome::DuplicateUnreadable { .. }),
        "{redeployed:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A result that cannot be stored as JSON is still recorded as processed:
/// the work ran, and a redelivery must not run it again.
#[tokio::test]
async fn a_result_that_cannot_be_stored_still_records_the_work() {
    let orders = IdempotencyProcessor::new(MemoryStore::new());
    let runs = Runs::default();
    let unstorable = || {
        let runs = runs.clone();
        async move |_: &mut _| {
            runs.fetch_add(1, Ordering::SeqCst);
            // JSON object keys must be strings.
            Ok::<_, String>(std::collections::HashMap::from([((1, 2), "x".to_owned())]))
        }
    };
    let first = orders
        .process("order-1", ORDER, unstorable())
        .await
        .unwrap();
    assert!(matches!(first, ProcessOutcome::Executed(_)), "{first:?}");
    let again = orders
        .process("order-1", ORDER, unstorable())
        .await
        .unwrap();
    assert!(
        matches!(again, ProcessOutcome::DuplicateUnreadable { .. }),
        "{again:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// Drops `run`'s future after 0 to 80 ms (a timeout, a shutdown) — in the
/// claim, in the work, in the completion — then asks for the key again until
/// it is not in flight: it must be free well within the lease (30 s), and
/// `effects()` (which counts and resets) must show the work took effect once
/// where the store commits the record with the work, at most twice elsewhere
/// (dropped after its effect and before its record).
async fn dropping_run_never_wedges_the_key<St, Mk, W>(
    store: St,
    work: Mk,
    effects: impl AsyncFn() -> i64,
    exactly_once: bool,
) where
    St: Store,
    Mk: Fn() -> W,
    W: AsyncFnOnce(&mut St::Granted) -> Result<String, String>,
{
    let orders = IdempotencyProcessor::new(store).scope("cancelled");
    for ms in (0..80).step_by(2) {
        let key = format!("order-{ms}");
        let dropped = tokio::time::timeout(
            Duration::from_millis(ms),
            orders.process(&key, ORDER, work()),
        )
        .await;
        let deadline = std::time::Instant::now() + Duration::from_secs(3);
        loop {
            match orders.process(&key, ORDER, work()).await.unwrap() {
                ProcessOutcome::Executed(_) | ProcessOutcome::Duplicate(_) => break,
                ProcessOutcome::InFlight { .. } => {
                    assert!(
                        std::time::Instant::now() < deadline,
                        "{key}: still in flight 3 s after its run was dropped at {ms} ms ({dropped:?})"
                    );
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                other => panic!("{key}: {other:?}"),
            }
        }
        let done = effects().await;
        if exactly_once {
            assert_eq!(done, 1, "{key}: dropped at {ms} ms");
        } else {
            assert!((1..=2).contains(&done), "{key}: {done} effects");
        }
    }
}

/// Work that counts its effect after 10 ms, then takes 30 ms more.
fn counted<G>(effects: &Runs) -> impl AsyncFnOnce(&mut G) -> Result<String, String> {
    let effects = effects.clone();
    async move |_| {
        tokio::time::sleep(Duration::from_millis(10)).await;
        let n = effects.fetch_add(1, Ordering::SeqCst) + 1;
        tokio::time::sleep(Duration::from_millis(30)).await;
        Ok(format!("ch_{n}"))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_run_never_wedges_the_key_on_memory_redis_and_plain_postgres() {
    let redis = SingleRedis::start();
    let postgres = Postgres::start();
    let effects = Runs::default();
    let count = async || effects.swap(0, Ordering::SeqCst) as i64;
    let work = || counted(&effects);
    dropping_run_never_wedges_the_key(MemoryStore::new(), work, count, false).await;
    dropping_run_never_wedges_the_key(redis.store().await, work, count, false).await;
    dropping_run_never_wedges_the_key(postgres.store().await, work, count, false).await;
}

/// On the transactional store the work's insert is rolled back with its
/// dropped claim, and committed with its record once it finished: exactly
/// one row per order, whenever the future was dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_run_on_transactional_postgres_rolls_back_or_commits_whole() {
    let db = TestDatabase::create();
    let store = PostgresStore::builder()
        .transactional()
        .create_table_if_missing()
        .connect(db.url())
        .await
        .unwrap();
    sqlx::raw_sql("CREATE TABLE order_charges (order_id text, amount bigint)")
        .execute(store.pool())
        .await
        .unwrap();
    let pool = store.pool().clone();
    let work = || {
        async move |tx: &mut PostgresTx| {
            sqlx::query("INSERT INTO order_charges VALUES ('x', 500)")
                .execute(&mut **tx)
                .await
                .map_err(|e| e.to_string())?;
            tokio::time::sleep(Duration::from_millis(30)).await;
            Ok("charged".to_owned())
        }
    };
    let effects = async || {
        let deleted = sqlx::query("DELETE FROM order_charges")
            .execute(&pool)
            .await
            .unwrap();
        deleted.rows_affected() as i64
    };
    dropping_run_never_wedges_the_key(store, work, effects, true).await;
    let open = "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
                AND state = 'idle in transaction'";
    db.wait_for_count(open, |n| n == 0, "a dropped run left its transaction open")
        .await;
}

/// Work that swallows its failed statement and returns `Ok`: PostgreSQL
/// aborted the transaction, nothing commits, and the error says no
/// redelivery can succeed (reject), rather than "store unavailable".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_whose_statement_failed_is_refused_not_an_outage() {
    let db = TestDatabase::create();
    let store = PostgresStore::builder()
        .transactional()
        .create_table_if_missing()
        .connect(db.url())
        .await
        .unwrap();
    sqlx::raw_sql("CREATE TABLE order_charges (order_id text, amount bigint CHECK (amount > 0))")
        .execute(store.pool())
        .await
        .unwrap();
    let orders = IdempotencyProcessor::new(store);
    let swallowed = orders
        .process("order-1", ORDER, async |tx: &mut PostgresTx| {
            let _ = sqlx::query("INSERT INTO order_charges VALUES ('order-1', -5)")
                .execute(&mut **tx)
                .await;
            Ok::<_, String>("charged".to_owned())
        })
        .await;
    assert!(
        matches!(swallowed, Err(ProcessError::Refused(_))),
        "{swallowed:?}"
    );
    assert_eq!(db.count("SELECT count(*) FROM order_charges").await, 0);
}

/// The consumer's fingerprint takes the same rules: a resent order with a
/// new `sent_at` is still the same order; another amount is not.
#[tokio::test]
async fn declared_rules_decide_what_is_the_same_message() {
    let orders = IdempotencyProcessor::new(MemoryStore::new())
        .fingerprint_with(tower_idempotency::DefaultFingerprint::new().ignore("/sent_at"));
    let runs = Runs::default();
    let order = |amount: u32, sent_at: &str| {
        format!(r#"{{"order_id":"order-1","amount":{amount},"sent_at":"{sent_at}"}}"#)
    };
    let first = orders
        .process("order-1", order(500, "10:00").as_bytes(), charge(&runs))
        .await
        .unwrap();
    assert_eq!(first, ProcessOutcome::Executed("ch_1".to_owned()));
    let resent = orders
        .process("order-1", order(500, "10:05").as_bytes(), charge(&runs))
        .await
        .unwrap();
    assert_eq!(resent, ProcessOutcome::Duplicate("ch_1".to_owned()));
    let other = orders
        .process("order-1", order(900, "10:05").as_bytes(), charge(&runs))
        .await
        .unwrap();
    assert_eq!(other, ProcessOutcome::Mismatch);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A broker that hands a fixed list of orders over in one receive, all on
/// one ordering key, and writes down how each was answered — and, for an
/// acknowledgement, whether the order's charge was committed by then.
struct Scripted {
    orders: Mutex<Option<Vec<Order>>>,
    answers: Arc<Mutex<Vec<String>>>,
    db: Ledger,
    left: AtomicUsize,
    all_answered: Arc<tokio::sync::Notify>,
}

struct Order(String, Vec<u8>);

impl Received for Order {
    fn payload(&self) -> &[u8] {
        &self.1
    }
    fn header(&self, _: &str) -> Option<&str> {
        None
    }
    fn message_id(&self) -> Option<Cow<'_, str>> {
        Some(Cow::Borrowed(&self.0))
    }
}

impl Scripted {
    async fn answered(&self, order: &Order, how: &str) {
        let id = String::from_utf8_lossy(&order.1).to_string();
        let id = serde_json::from_str::<serde_json::Value>(&id).unwrap()["order_id"]
            .as_str()
            .unwrap()
            .to_owned();
        let committed = self.db.committed(&id).await;
        self.answers
            .lock()
            .unwrap()
            .push(format!("{how} {id} ({committed} committed)"));
        if self.left.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.all_answered.notify_one();
        }
    }
}

impl Broker for Scripted {
    type Received = Order;

    fn system(&self) -> &'static str {
        "scripted"
    }
    fn destination(&self) -> &str {
        "orders"
    }
    async fn receive(&self, room: usize, within: Duration) -> Result<Vec<Order>, BrokerError> {
        let orders = self.orders.lock().unwrap().take();
        match orders {
            Some(orders) => {
                assert!(room >= orders.len(), "room for every order in one receive");
                Ok(orders)
            }
            None => {
                tokio::time::sleep(within).await;
                Ok(Vec::new())
            }
        }
    }
    fn receive_is_cancel_safe(&self) -> bool {
        true
    }
    fn hold_interval(&self) -> Option<Duration> {
        None
    }
    fn ordering_key<'a>(&self, _: &'a Order) -> Option<Cow<'a, str>> {
        Some(Cow::Borrowed("acct-1"))
    }
    async fn ack(&self, order: &Order, _: Acked) -> Result<(), BrokerError> {
        self.answered(order, "acked").await;
        Ok(())
    }
    async fn give_back(&self, order: &Order, _: Duration) -> Result<(), BrokerError> {
        self.answered(order, "given back").await;
        Ok(())
    }
    async fn dead_letter(
        &self,
        order: &Order,
        _: &DeadLetterReason,
    ) -> Result<DeadLettered, BrokerError> {
        self.answered(order, "dead-lettered").await;
        Ok(DeadLettered::Kept)
    }
}

/// Where the scripted orders are charged: `order_charges`, which refuses
/// an amount of 666, as a constraint a payload always breaks.
#[derive(Clone)]
enum Ledger {
    Postgres(sqlx::PgPool),
    Sqlite(sqlx::SqlitePool),
    MySql(sqlx::MySqlPool),
}

impl Ledger {
    /// The charges of `id` committed.
    async fn committed(&self, id: &str) -> i64 {
        self.count(&format!(
            "SELECT count(*) FROM order_charges WHERE order_id = '{id}'"
        ))
        .await
    }

    /// Every charge committed.
    async fn charges(&self) -> i64 {
        self.count("SELECT count(*) FROM order_charges").await
    }

    async fn count(&self, sql: &str) -> i64 {
        let sql = sqlx::AssertSqlSafe(sql.to_owned());
        match self {
            Self::Postgres(db) => sqlx::query_scalar(sql).fetch_one(db).await,
            Self::Sqlite(db) => sqlx::query_scalar(sql).fetch_one(db).await,
            Self::MySql(db) => sqlx::query_scalar(sql).fetch_one(db).await,
        }
        .unwrap()
    }
}

/// The scripted orders through the consumer loop over transactional
/// PostgreSQL, `batch` at most per transaction: how each was answered, and
/// in how many transactions the charges committed.
async fn through_batches(batch: usize) -> (Vec<String>, i64) {
    let db = TestDatabase::create();
    let store = ledger(&db, None, Duration::from_secs(30)).await;
    sqlx::raw_sql(
        "ALTER TABLE order_charges ADD COLUMN tx bigint NOT NULL DEFAULT txid_current(), \
         ADD CHECK (amount <> 666)",
    )
    .execute(store.pool())
    .await
    .unwrap();
    let answers = scripted(
        store.clone(),
        Ledger::Postgres(store.pool().clone()),
        batch,
        async |tx: &mut PostgresTx, (id, amount): &(String, i64)| {
            sqlx::query("INSERT INTO order_charges (order_id, amount) VALUES ($1, $2)")
                .bind(id)
                .bind(amount)
                .execute(&mut **tx)
                .await
                .map(drop)
        },
    )
    .await;
    let transactions: i64 = sqlx::query_scalar("SELECT count(DISTINCT tx) FROM order_charges")
        .fetch_one(store.pool())
        .await
        .unwrap();
    (answers, transactions)
}

/// The scripted orders through the consumer loop over `store`, charged in
/// `db` by `charge`, `batch` at most per transaction: how each was
/// answered.
async fn scripted<St: Store>(
    store: St,
    db: Ledger,
    batch: usize,
    charge: impl AsyncFn(&mut St::Granted, &(String, i64)) -> Result<(), sqlx::Error>,
) -> Vec<String> {
    let order = |id: &str, amount: i64| {
        let body = format!(r#"{{"order_id":"{id}","amount":{amount}}}"#);
        Order(format!("m-{id}-{amount}"), body.into_bytes())
    };
    let orders = vec![
        order("order-1", 500),
        order("order-2", 500),
        // Refused by the database: undone alone, dead-lettered.
        order("order-3", 666),
        // Delivered twice: the second finds the record the batch wrote.
        order("order-1", 500),
        order("order-4", 500),
        order("order-5", 500),
    ];
    let (answers, all_answered) = (Arc::default(), Arc::default());
    let broker = Scripted {
        left: AtomicUsize::new(orders.len()),
        orders: Mutex::new(Some(orders)),
        answers: Arc::clone(&answers),
        db,
        all_answered: Arc::clone(&all_answered),
    };
    let processor = IdempotencyProcessor::new(store).scope("orders");
    Consumer::new(broker, processor)
        .in_hand(10)
        .batch(batch)
        .passing_when(|error: &sqlx::Error| error.as_database_error().is_none())
        .run(
            |payload| {
                let order: serde_json::Value = serde_json::from_slice(payload)
                    .map_err(|e| DeadLetterReason::invalid(e.to_string()))?;
                Ok(Parsed {
                    key: order["order_id"].as_str().unwrap().to_owned(),
                    message: (
                        order["order_id"].as_str().unwrap().to_owned(),
                        order["amount"].as_i64().unwrap(),
                    ),
                })
            },
            charge,
            async move { all_answered.notified().await },
        )
        .await
        .unwrap();
    answers.lock().unwrap().clone()
}

/// Six deliveries of one key in hand together: settled in one transaction
/// — each order's charge in a savepoint of its own — and answered only
/// once it committed. The order the database refuses is undone alone
/// (dead-lettered, nothing of it committed, the others kept); the order
/// delivered twice finds the record the batch itself wrote, a duplicate.
/// One per transaction (`batch(1)`), the same answers in four.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_commits_together_undoes_a_refused_order_alone_and_answers_after_its_commit() {
    let answered = [
        "acked order-1 (1 committed)",
        "acked order-2 (1 committed)",
        "dead-lettered order-3 (0 committed)",
        "acked order-1 (1 committed)",
        "acked order-4 (1 committed)",
        "acked order-5 (1 committed)",
    ];
    let (answers, transactions) = through_batches(100).await;
    assert_eq!(answers, answered);
    assert_eq!(transactions, 1, "one transaction for the batch");
    let (answers, transactions) = through_batches(1).await;
    assert_eq!(answers, answered);
    assert_eq!(transactions, 4, "a transaction per charge");
}

/// A transactional store the scripted orders are charged through, on a
/// database of its own with `order_charges` in it.
trait Charging: Store + Sized {
    /// The store, where it charges, and what keeps its database.
    async fn open() -> (Self, Ledger, Box<dyn std::any::Any>);

    /// Inserts the order's charge in the claim's transaction.
    async fn charge(tx: &mut Self::Granted, id: &str, amount: i64) -> Result<(), sqlx::Error>;
}

impl Charging for SqliteTxStore {
    async fn open() -> (Self, Ledger, Box<dyn std::any::Any>) {
        let backend = backend::SqliteTx::start();
        let store = backend.store().await;
        sqlx::raw_sql(
            "CREATE TABLE order_charges (order_id TEXT, amount INTEGER CHECK (amount <> 666))",
        )
        .execute(store.pool())
        .await
        .unwrap();
        let db = Ledger::Sqlite(store.pool().clone());
        (store, db, Box::new(backend))
    }

    async fn charge(tx: &mut SqliteTx, id: &str, amount: i64) -> Result<(), sqlx::Error> {
        sqlx::query("INSERT INTO order_charges (order_id, amount) VALUES (?1, ?2)")
            .bind(id)
            .bind(amount)
            .execute(&mut **tx)
            .await
            .map(drop)
    }
}

impl Charging for MySqlTxStore {
    async fn open() -> (Self, Ledger, Box<dyn std::any::Any>) {
        let backend = backend::MySqlTx::start();
        let store = backend.store().await;
        sqlx::raw_sql(
            "CREATE TABLE order_charges (order_id VARCHAR(64), amount BIGINT, \
             CHECK (amount <> 666)) ENGINE = InnoDB",
        )
        .execute(store.pool())
        .await
        .unwrap();
        let db = Ledger::MySql(store.pool().clone());
        (store, db, Box::new(backend))
    }

    async fn charge(tx: &mut MySqlTx, id: &str, amount: i64) -> Result<(), sqlx::Error> {
        sqlx::query("INSERT INTO order_charges (order_id, amount) VALUES (?, ?)")
            .bind(id)
            .bind(amount)
            .execute(&mut **tx)
            .await
            .map(drop)
    }
}

/// The scripted orders through the loop over a fresh `St`, `batch` at most
/// per transaction, each charge first writing down how many charges had
/// committed before it: how each order was answered, and what each charge
/// saw.
async fn seen_through<St: Charging>(batch: usize) -> (Vec<String>, Vec<i64>) {
    let (store, db, _database) = St::open().await;
    let seen = Mutex::new(Vec::new());
    let answers = scripted(
        store,
        db.clone(),
        batch,
        async |tx: &mut St::Granted, (id, amount): &(String, i64)| {
            let committed = db.charges().await;
            seen.lock().unwrap().push(committed);
            St::charge(tx, id, *amount).await
        },
    )
    .await;
    let seen = seen.lock().unwrap().clone();
    (answers, seen)
}

/// The answers through batches of 100 and of 1, and what each charge saw
/// committed: in batches, `batched`; one by one, every charge before it.
async fn seen_in_batches<St: Charging>(batched: [i64; 5]) {
    let answered = [
        "acked order-1 (1 committed)",
        "acked order-2 (1 committed)",
        "dead-lettered order-3 (0 committed)",
        "acked order-1 (1 committed)",
        "acked order-4 (1 committed)",
        "acked order-5 (1 committed)",
    ];
    let (answers, seen) = seen_through::<St>(100).await;
    assert_eq!(answers, answered);
    assert_eq!(seen, batched, "what each charge saw committed, in batches");
    let (answers, seen) = seen_through::<St>(1).await;
    assert_eq!(answers, answered);
    assert_eq!(
        seen,
        [0, 1, 2, 2, 3],
        "what each charge saw committed, one by one"
    );
}

/// The same orders on SQLite, whose batch takes the file's write lock with
/// its first claim: answered alike, and each charge sees none of its batch
/// committed. A key the batch itself holds is in flight: the batch before
/// it commits, and the order is then settled on its own (a duplicate) —
/// orders 1, 2 and 3 in one batch, 4 and 5 in the next.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_sqlite_a_batch_commits_together_and_answers_after_its_commit() {
    seen_in_batches::<SqliteTxStore>([0, 0, 0, 2, 2]).await;
}

/// The same orders on MySQL/MariaDB: each order's claim, charge and record
/// in a savepoint of the batch's transaction. A key the batch itself wrote
/// is found there, as on PostgreSQL: every order in one batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_mysql_a_batch_commits_together_and_answers_after_its_commit() {
    seen_in_batches::<MySqlTxStore>([0; 5]).await;
}
