//! The transactional outbox on every transactional store, written once:
//! messages commit with the record and the charge or not at all, a replay
//! emits nothing, the relay publishes each committed message — in order
//! per ordering key, again with the same id after a relay died between
//! publishing and marking, later when the broker was down — and keeps what
//! the broker refuses. The publisher here is a recording one; the brokers'
//! own (SQS, JetStream, RabbitMQ) are the consumer examples'.

// The suite runs against every store: `cargo test --all-features`.
#![cfg(every_store)]

mod support;

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use axum::{Router, extract::State, http::StatusCode, routing::post};
use tower_idempotency::{
    IdempotencyLayer, IdempotentTx,
    outbox::{Outbox, OutboxMessage, OutboxRelay, OutgoingMessage, PublishError, Publisher},
    store::sql::SqlTx,
    testing::TxEffects,
};

use support::{
    backend::{MySqlTx, PostgresTx, SqliteTx, Total, TxBackend},
    http::{oneshot, post as request},
};

/// Publishes, then never returns: the relay dies before it marks.
struct Hangs(Broker);

impl Publisher for Hangs {
    async fn publish(&self, message: &OutboxMessage) -> Result<(), PublishError> {
        self.0.publish(message).await?;
        std::future::pending().await
    }
}

/// A broker that takes its time to confirm each message; `publishing`
/// once it has begun.
struct Slow(Broker, Duration, Arc<AtomicBool>);

impl Publisher for Slow {
    async fn publish(&self, message: &OutboxMessage) -> Result<(), PublishError> {
        self.2.store(true, Ordering::SeqCst);
        tokio::time::sleep(self.1).await;
        self.0.publish(message).await
    }
}

/// Fails the message `at` once (the broker unavailable), then passes on.
struct FailsOnce {
    broker: Broker,
    at: String,
    failed: Arc<AtomicBool>,
}

impl Publisher for FailsOnce {
    async fn publish(&self, message: &OutboxMessage) -> Result<(), PublishError> {
        if message.id == self.at && !self.failed.swap(true, Ordering::SeqCst) {
            return Err(PublishError::Unavailable("a blip".into()));
        }
        self.broker.publish(message).await
    }
}

/// What the broker got, in order; down while `down`, refusing
/// destinations named `refused`.
#[derive(Clone, Default)]
struct Broker {
    got: Arc<Mutex<Vec<OutboxMessage>>>,
    down: Arc<AtomicBool>,
}

impl Broker {
    fn ids(&self) -> Vec<String> {
        self.got
            .lock()
            .unwrap()
            .iter()
            .map(|m| m.id.clone())
            .collect()
    }

    fn count(&self) -> usize {
        self.got.lock().unwrap().len()
    }
}

impl Publisher for Broker {
    async fn publish(&self, message: &OutboxMessage) -> Result<(), PublishError> {
        if message.destination == "refused" {
            return Err(PublishError::Refused("no such queue".into()));
        }
        if self.down.load(Ordering::SeqCst) {
            return Err(PublishError::Unavailable("connection refused".into()));
        }
        // A broker takes a moment: concurrent relays overlap.
        tokio::time::sleep(Duration::from_millis(fastrand::u64(0..5))).await;
        self.got.lock().unwrap().push(message.clone());
        Ok(())
    }
}

/// The suite, written once; `outbox_suite!(module, backend, engine)`
/// runs it on one transactional store.
macro_rules! outbox_suite {
    ($module:ident, $backend:ident, $engine:ty, $store:ty, $charges:ty) => {
        mod $module {
            use super::*;

            type B = $backend;
            type D = $engine;
            type Store = $store;
            type Charges = $charges;

            fn backend() -> B {
                B::start()
            }

            /// A store of `B`, its charges, and its outbox.
            async fn outbox_of(b: &B) -> (Store, Charges, Outbox<D>) {
                let (store, charges) = b.store_and_charges().await;
                let table = format!("outbox_{}", fastrand::u32(..));
                let outbox = Outbox::on(&store)
                    .table(table)
                    .create_table_if_missing()
                    .build()
                    .await
                    .expect("the outbox");
                (store, charges, outbox)
            }

            #[derive(Clone)]
            struct App {
                charges: Charges,
                outbox: Outbox<D>,
            }

            /// A charge and its `charge.created`, in the request's transaction;
            /// `?status=503` rolls both back.
            async fn charge(
                State(app): State<App>,
                headers: http::HeaderMap,
                uri: http::Uri,
                mut tx: IdempotentTx<SqlTx<D>>,
            ) -> StatusCode {
                let key = headers["idempotency-key"].to_str().unwrap().to_owned();
                app.charges.write(&mut *tx, &key).await.unwrap();
                let event = OutgoingMessage::new("charges", format!(r#"{{"charge":"{key}"}}"#))
                    .ordering_key("acct_alice")
                    .header("type", "charge.created");
                app.outbox.enqueue(&mut tx, event).await.unwrap();
                if uri.query() == Some("status=503") {
                    StatusCode::SERVICE_UNAVAILABLE
                } else {
                    StatusCode::CREATED
                }
            }

            fn router(store: Store, app: App) -> Router {
                Router::new()
                    .route("/charges", post(charge))
                    .layer(IdempotencyLayer::new(store).single_tenant())
                    .with_state(app)
            }

            /// The message commits with the charge, once: a replay and a rolled-back
            /// request enqueue nothing; the relay publishes each once, with the id
            /// derived from the key, then marks it sent.
            async fn messages_commit_with_the_charge_and_replays_emit_nothing(b: B) {
                let (store, charges, outbox) = outbox_of(&b).await;
                let app = router(
                    store,
                    App {
                        charges: charges.clone(),
                        outbox: outbox.clone(),
                    },
                );
                for _ in 0..3 {
                    let reply = oneshot(&app, request("/charges", "order-1", "{}")).await;
                    assert!(reply.status == StatusCode::CREATED, "{:?}", reply.body);
                }
                let rolled_back =
                    oneshot(&app, request("/charges?status=503", "order-2", "{}")).await;
                assert_eq!(rolled_back.status, StatusCode::SERVICE_UNAVAILABLE);
                assert_eq!(charges.total().await, 1);
                assert_eq!(
                    outbox.stats().await.unwrap().pending,
                    1,
                    "one message, committed once"
                );

                let broker = Broker::default();
                let relay = OutboxRelay::new(outbox.clone(), broker.clone());
                let round = relay.run_once().await.unwrap();
                assert_eq!((round.claimed, round.published), (1, 1));
                assert_eq!(relay.run_once().await.unwrap().claimed, 0, "marked sent");
                let got = broker.got.lock().unwrap().clone();
                assert_eq!(got.len(), 1);
                assert_eq!(got[0].payload, br#"{"charge":"order-1"}"#);
                assert_eq!(
                    got[0].headers,
                    vec![("type".to_owned(), "charge.created".to_owned())]
                );
                assert_eq!(got[0].ordering_key.as_deref(), Some("acct_alice"));
                assert_eq!(
                    got[0].id.len(),
                    32,
                    "derived from the scope, the key and the position"
                );
                let stats = outbox.stats().await.unwrap();
                assert_eq!((stats.pending, stats.sent), (0, 1));
            }

            /// Three relays at once over many messages of a few ordering keys: each
            /// message published once, each key's in the order enqueued.
            async fn relays_side_by_side_publish_once_and_in_order(b: B) {
                let (store, _charges, outbox) = outbox_of(&b).await;
                let enqueued = enqueue_many(&store, &outbox, 60, 4).await;
                let broker = Broker::default();
                let relays: Vec<_> = (0..3)
                    .map(|_| {
                        let relay = OutboxRelay::new(outbox.clone(), broker.clone()).batch(8);
                        tokio::spawn(
                            async move { while relay.run_once().await.unwrap().claimed > 0 {} },
                        )
                    })
                    .collect();
                for relay in relays {
                    relay.await.unwrap();
                }
                // Whatever one relay left behind while another held its key's head.
                let last = OutboxRelay::new(outbox.clone(), broker.clone());
                while last.run_once().await.unwrap().claimed > 0 {}
                assert_published_once_in_order(&broker, &enqueued);
                assert_eq!(outbox.stats().await.unwrap().pending, 0);
            }

            /// The broker down for a while: nothing is lost, each key's messages are
            /// published in order once it is back.
            async fn a_broker_down_loses_nothing_and_keeps_the_order(b: B) {
                let (store, _charges, outbox) = outbox_of(&b).await;
                let enqueued = enqueue_many(&store, &outbox, 12, 3).await;
                let broker = Broker::default();
                broker.down.store(true, Ordering::SeqCst);
                let relay = OutboxRelay::new(outbox.clone(), broker.clone())
                    .backoff(Duration::from_millis(20), Duration::from_millis(50));
                for _ in 0..5 {
                    let round = relay.run_once().await.unwrap();
                    assert_eq!(round.published, 0);
                    tokio::time::sleep(Duration::from_millis(30)).await;
                }
                assert_eq!(
                    outbox.stats().await.unwrap().pending,
                    12,
                    "kept while the broker is down"
                );
                broker.down.store(false, Ordering::SeqCst);
                let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
                while outbox.stats().await.unwrap().pending > 0 {
                    assert!(
                        tokio::time::Instant::now() < deadline,
                        "published once the broker is back"
                    );
                    relay.run_once().await.unwrap();
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                assert_published_once_in_order(&broker, &enqueued);
            }

            /// A relay that dies between publishing and marking: once its claim
            /// lapses, another publishes again — with the same id, for the broker's
            /// deduplication and the consumer's idempotency to absorb.
            async fn a_relay_dead_before_marking_is_followed_by_a_republish_with_the_same_id(b: B) {
                let (store, _charges, outbox) = outbox_of(&b).await;
                enqueue_many(&store, &outbox, 1, 1).await;
                let broker = Broker::default();
                // A claim long enough for a loaded machine's first round (it
                // may refresh the table's statistics) to come and go in it.
                let dying = OutboxRelay::new(outbox.clone(), Hangs(broker.clone()))
                    .claim_for(Duration::from_millis(1500));
                // Published, then the relay is gone before it marks.
                {
                    let round = dying.run_once();
                    tokio::pin!(round);
                    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
                    while broker.count() == 0 {
                        assert!(tokio::time::Instant::now() < deadline, "published");
                        tokio::select! {
                            _ = &mut round => panic!("a hung publish never ends its round"),
                            () = tokio::time::sleep(Duration::from_millis(5)) => {}
                        }
                    }
                }
                assert_eq!(broker.count(), 1);
                let next = OutboxRelay::new(outbox.clone(), broker.clone());
                assert_eq!(
                    next.run_once().await.unwrap().claimed,
                    0,
                    "left to its claimer"
                );
                tokio::time::sleep(Duration::from_millis(1600)).await;
                assert_eq!(next.run_once().await.unwrap().published, 1);
                let ids = broker.ids();
                assert_eq!(ids.len(), 2);
                assert_eq!(ids[0], ids[1], "republished with the same id");
            }

            /// A relay whose broker takes longer than its claim to confirm
            /// keeps the claim alive: another relay looking meanwhile takes
            /// nothing, and the message is published once.
            async fn a_slow_broker_keeps_the_claim_alive_and_nothing_goes_out_twice(b: B) {
                let (store, _charges, outbox) = outbox_of(&b).await;
                enqueue_many(&store, &outbox, 1, 1).await;
                let broker = Broker::default();
                let claim = Duration::from_millis(1500);
                let publishing = Arc::new(AtomicBool::new(false));
                let slow = OutboxRelay::new(
                    outbox.clone(),
                    Slow(broker.clone(), claim * 3, publishing.clone()),
                )
                .claim_for(claim);
                let slow = tokio::spawn(async move { slow.run_once().await });
                while !publishing.load(Ordering::SeqCst) {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                let other = OutboxRelay::new(outbox.clone(), broker.clone()).claim_for(claim);
                let mut looked = 0;
                while !slow.is_finished() {
                    let round = other.run_once().await.unwrap();
                    assert_eq!(round.claimed, 0, "left to the live relay");
                    looked += 1;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                let round = slow.await.unwrap().unwrap();
                assert_eq!((round.claimed, round.published), (1, 1));
                assert!(looked > 10, "the other relay looked while it published");
                assert_eq!(other.run_once().await.unwrap().claimed, 0, "marked sent");
                assert_eq!(broker.count(), 1, "published once");
            }

            /// A message the broker refuses is kept, reported, and published once
            /// requeued; it does not hold up the messages after it.
            async fn a_refused_message_is_kept_and_reported_never_dropped(b: B) {
                let (store, _charges, outbox) = outbox_of(&b).await;
                let key = storage_key("refused");
                let tx = claim(&store, &key).await;
                let mut tx = tx;
                outbox
                    .enqueue(
                        &mut tx,
                        OutgoingMessage::new("refused", b"{}".to_vec()).ordering_key("k"),
                    )
                    .await
                    .unwrap();
                outbox
                    .enqueue(
                        &mut tx,
                        OutgoingMessage::new("charges", b"{}".to_vec()).ordering_key("k"),
                    )
                    .await
                    .unwrap();
                commit(&store, &key, tx).await;
                let broker = Broker::default();
                let relay = OutboxRelay::new(outbox.clone(), broker.clone());
                while relay.run_once().await.unwrap().claimed > 0 {}
                assert_eq!(broker.count(), 1, "the next message went");
                let stats = outbox.stats().await.unwrap();
                assert_eq!((stats.pending, stats.sent, stats.refused), (0, 1, 1));
                let refused = outbox.refused(10).await.unwrap();
                assert_eq!(refused.len(), 1);
                assert_eq!(refused[0].destination, "refused");
                assert!(outbox.requeue(&refused[0].id).await.unwrap());
                assert_eq!(outbox.stats().await.unwrap().pending, 1);
            }

            /// Sent messages are deleted once the retention has passed.
            async fn sent_messages_are_swept_after_the_retention(b: B) {
                let (store, _charges, outbox) = outbox_of(&b).await;
                enqueue_many(&store, &outbox, 5, 5).await;
                let relay = OutboxRelay::new(outbox.clone(), Broker::default())
                    .retention(Duration::from_millis(200));
                while relay.run_once().await.unwrap().claimed > 0 {}
                assert_eq!(relay.sweep().await.unwrap(), 0, "kept within the retention");
                tokio::time::sleep(Duration::from_millis(300)).await;
                assert_eq!(relay.sweep().await.unwrap(), 5);
                assert_eq!(outbox.stats().await.unwrap(), Default::default());
            }

            /// What a handler enqueues is what the relay publishes, byte for byte:
            /// every byte value in the payload, quotes, backslashes and
            /// non-ASCII text in the destination, the ordering key and the
            /// headers (the row travels as SQL text with the commit).
            async fn a_message_is_published_byte_for_byte(b: B) {
                let (store, _charges, outbox) = outbox_of(&b).await;
                let payload: Vec<u8> = (0..=255u8).chain(*b"'\\\"\0").collect();
                let destination = r#"charges.'quoted'\back\slash"é"#;
                let ordering = "acct_'o\\'brien_ü";
                let key = storage_key("bytes");
                let mut tx = claim(&store, &key).await;
                outbox
                    .enqueue(
                        &mut tx,
                        OutgoingMessage::new(destination, payload.clone())
                            .ordering_key(ordering)
                            .header("type", "it's \\ \"quoted\" — ✓")
                            .id("given-'id'\\"),
                    )
                    .await
                    .unwrap();
                commit(&store, &key, tx).await;
                let broker = Broker::default();
                let relay = OutboxRelay::new(outbox.clone(), broker.clone());
                assert_eq!(relay.run_once().await.unwrap().published, 1);
                let got = broker.got.lock().unwrap().clone();
                assert_eq!(got[0].payload, payload);
                assert_eq!(got[0].destination, destination);
                assert_eq!(got[0].ordering_key.as_deref(), Some(ordering));
                assert_eq!(got[0].id, "given-'id'\\");
                assert_eq!(
                    got[0].headers,
                    vec![("type".to_owned(), "it's \\ \"quoted\" — ✓".to_owned())]
                );
            }

            /// A handler that gives one id to two messages: the second row fails
            /// the commit, so nothing of the request commits — no charge, no
            /// message, no record — and its success is withheld.
            async fn an_id_given_twice_fails_the_commit_and_nothing_commits(b: B) {
                #[derive(Clone)]
                struct Twice {
                    charges: Charges,
                    outbox: Outbox<D>,
                }
                async fn twice(
                    State(app): State<Twice>,
                    mut tx: IdempotentTx<SqlTx<D>>,
                ) -> StatusCode {
                    app.charges.write(&mut *tx, "twice").await.unwrap();
                    for _ in 0..2 {
                        let event = OutgoingMessage::new("charges", "{}").id("the-same-id");
                        app.outbox.enqueue(&mut tx, event).await.unwrap();
                    }
                    StatusCode::CREATED
                }
                let (store, charges, outbox) = outbox_of(&b).await;
                let app = Router::new()
                    .route("/twice", post(twice))
                    .layer(IdempotencyLayer::new(store).single_tenant())
                    .with_state(Twice {
                        charges: charges.clone(),
                        outbox: outbox.clone(),
                    });
                let reply = oneshot(&app, request("/twice", "twice-1", "{}")).await;
                assert!(reply.status.is_server_error(), "{:?}", reply.body);
                assert_eq!(charges.total().await, 0, "nothing committed");
                assert_eq!(outbox.stats().await.unwrap(), Default::default());
                let again = oneshot(&app, request("/twice", "twice-1", "{}")).await;
                assert!(
                    again.status.is_server_error(),
                    "executed again, not replayed"
                );
            }

            /// A key that executes again — its record forgotten, or expired —
            /// is a new execution: its `charge.created` is a new message with
            /// an id of its own, never the id of the row the first execution
            /// left (sent, kept for the retention; or still pending), which
            /// would refuse every retry's commit. A retry of one execution
            /// (a replay) emits nothing.
            async fn a_key_executed_again_sends_new_messages_and_is_never_wedged(b: B) {
                let (store, charges, outbox) = outbox_of(&b).await;
                let app = App {
                    charges: charges.clone(),
                    outbox: outbox.clone(),
                };
                let short = Router::new()
                    .route("/charges", post(charge))
                    .layer(
                        IdempotencyLayer::new(store.clone())
                            .single_tenant()
                            .retention(Duration::from_secs(1)),
                    )
                    .with_state(app.clone());
                let app = router(store.clone(), app);
                let broker = Broker::default();
                let relay = OutboxRelay::new(outbox.clone(), broker.clone());
                let key = |k: &str| {
                    tower_idempotency::store::StorageKey::new(
                        "",
                        &tower_idempotency::IdempotencyKey::new(k).unwrap(),
                    )
                };
                use tower_idempotency::store::{Forgotten, Store as _};

                // Forgotten after its message was sent (the row kept as sent).
                let first = oneshot(&app, request("/charges", "again-1", "{}")).await;
                assert_eq!(first.status, StatusCode::CREATED, "{:?}", first.body);
                while relay.run_once().await.unwrap().claimed > 0 {}
                assert_eq!(
                    store.forget(&key("again-1"), false).await.unwrap(),
                    Forgotten::Completed
                );
                let again = oneshot(&app, request("/charges", "again-1", "{}")).await;
                assert_eq!(again.status, StatusCode::CREATED, "{:?}", again.body);
                assert!(again.headers.get("idempotent-replayed").is_none());
                let replay = oneshot(&app, request("/charges", "again-1", "{}")).await;
                assert!(replay.headers.contains_key("idempotent-replayed"));

                // Forgotten while its message is still pending.
                let pending = oneshot(&app, request("/charges", "again-2", "{}")).await;
                assert_eq!(pending.status, StatusCode::CREATED);
                store.forget(&key("again-2"), false).await.unwrap();
                let again = oneshot(&app, request("/charges", "again-2", "{}")).await;
                assert_eq!(again.status, StatusCode::CREATED, "{:?}", again.body);

                // Expired (a retention of 1 s), its message sent.
                let expiring = oneshot(&short, request("/charges", "again-3", "{}")).await;
                assert_eq!(expiring.status, StatusCode::CREATED);
                while relay.run_once().await.unwrap().claimed > 0 {}
                tokio::time::sleep(Duration::from_millis(1100)).await;
                let again = oneshot(&short, request("/charges", "again-3", "{}")).await;
                assert_eq!(again.status, StatusCode::CREATED, "{:?}", again.body);
                assert!(again.headers.get("idempotent-replayed").is_none());

                while relay.run_once().await.unwrap().claimed > 0 {}
                assert_eq!(charges.total().await, 6, "six executions");
                let mut ids = broker.ids();
                assert_eq!(ids.len(), 6, "one message per execution");
                ids.sort();
                ids.dedup();
                assert_eq!(ids.len(), 6, "each execution's message is its own");
            }

            /// One account's burst drains at the relay's full batch, in order: a
            /// round takes the key's head and its run behind it, not one message.
            async fn a_hot_keys_backlog_drains_a_batch_a_round_in_order(b: B) {
                let (store, _charges, outbox) = outbox_of(&b).await;
                let enqueued = enqueue_many(&store, &outbox, 600, 1).await;
                let broker = Broker::default();
                let relay = OutboxRelay::new(outbox.clone(), broker.clone()).batch(256);
                let first = relay.run_once().await.unwrap();
                assert_eq!((first.claimed, first.published), (256, 256), "{first:?}");
                let mut rounds = 1;
                while relay.run_once().await.unwrap().claimed > 0 {
                    rounds += 1;
                }
                assert_eq!(rounds, 3, "600 messages of one key in three rounds");
                assert_published_once_in_order(&broker, &enqueued);
            }

            /// A claim reads a window of the oldest due messages, never a hot
            /// key's whole backlog: with 200 messages of one account ahead of
            /// another account's one, a round of 16 (a window of 64) does not
            /// reach the other — its cost is bounded by the batch — and the
            /// rounds after it drain everything, each key in order.
            async fn a_claim_reads_a_window_not_a_hot_keys_whole_backlog(b: B) {
                let (store, _charges, outbox) = outbox_of(&b).await;
                let mut enqueued = enqueue_many(&store, &outbox, 200, 1).await;
                let key = storage_key("other");
                let mut tx = claim(&store, &key).await;
                let other = outbox
                    .enqueue(
                        &mut tx,
                        OutgoingMessage::new("charges", "other").ordering_key("acct_other"),
                    )
                    .await
                    .unwrap();
                commit(&store, &key, tx).await;
                enqueued.insert("acct_other".into(), vec![other.clone()]);
                let broker = Broker::default();
                let relay = OutboxRelay::new(outbox.clone(), broker.clone()).batch(16);
                let first = relay.run_once().await.unwrap();
                assert!(first.published > 0, "{first:?}");
                assert!(
                    !broker.got.lock().unwrap().iter().any(|m| m.id == other),
                    "the first claim walked past its window to the other account"
                );
                let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
                while outbox.stats().await.unwrap().pending > 0 {
                    assert!(tokio::time::Instant::now() < deadline, "drained");
                    relay.run_once().await.unwrap();
                }
                assert_published_once_in_order(&broker, &enqueued);
            }

            /// A message of a run the broker cannot take stops the run there:
            /// the rest is given back behind it, and goes out after it, in order.
            async fn a_failure_mid_run_stops_the_run_and_keeps_the_order(b: B) {
                let (store, _charges, outbox) = outbox_of(&b).await;
                let enqueued = enqueue_many(&store, &outbox, 20, 2).await;
                let broker = Broker::default();
                let fifth = FailsOnce {
                    broker: broker.clone(),
                    at: enqueued["acct_0"][4].clone(),
                    failed: Arc::default(),
                };
                let relay = OutboxRelay::new(outbox.clone(), fifth)
                    .backoff(Duration::from_millis(50), Duration::from_millis(50));
                let round = relay.run_once().await.unwrap();
                assert_eq!(round.claimed, 20, "{round:?}");
                assert_eq!(
                    (round.published, round.retried, round.released),
                    (14, 1, 5),
                    "acct_1's ten and acct_0's first four; its fifth backs off, the five behind it wait"
                );
                let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
                while outbox.stats().await.unwrap().pending > 0 {
                    assert!(tokio::time::Instant::now() < deadline, "published after the back-off");
                    relay.run_once().await.unwrap();
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                assert_published_once_in_order(&broker, &enqueued);
            }

            /// Three relays on one hot key never hold it together: each message
            /// once, in order.
            async fn relays_side_by_side_on_one_hot_key_publish_once_in_order(b: B) {
                let (store, _charges, outbox) = outbox_of(&b).await;
                let enqueued = enqueue_many(&store, &outbox, 300, 1).await;
                let broker = Broker::default();
                let relays: Vec<_> = (0..3)
                    .map(|_| {
                        let relay = OutboxRelay::new(outbox.clone(), broker.clone()).batch(16);
                        tokio::spawn(async move {
                            let mut idle = 0;
                            while idle < 20 {
                                if relay.run_once().await.unwrap().claimed == 0 {
                                    idle += 1;
                                    tokio::time::sleep(Duration::from_millis(5)).await;
                                }
                            }
                        })
                    })
                    .collect();
                for relay in relays {
                    relay.await.unwrap();
                }
                let last = OutboxRelay::new(outbox.clone(), broker.clone());
                while last.run_once().await.unwrap().claimed > 0 {}
                assert_published_once_in_order(&broker, &enqueued);
            }

            /// An idle relay polls rarely but wakes at once at a commit: one of
            /// its own process, and on PostgreSQL one of another (a store on
            /// a pool of its own, as another instance's would be).
            pub(super) async fn an_idle_relay_wakes_at_a_commit(b: B, other_process: bool) {
                let (store, _charges, outbox) = outbox_of(&b).await;
                let broker = Broker::default();
                let relay = OutboxRelay::new(outbox.clone(), broker.clone())
                    .poll_interval(Duration::from_secs(3600))
                    .spawn();
                // The relay's first round has run and found nothing.
                tokio::time::sleep(Duration::from_millis(300)).await;
                let (store, outbox) = if other_process {
                    let (other, _) = b.store_and_charges().await;
                    let table = format!("{outbox:?}");
                    let table = table.split('"').nth(1).unwrap().to_owned();
                    let other_outbox = Outbox::on(&other).table(table).build().await.unwrap();
                    (other, other_outbox)
                } else {
                    (store, outbox)
                };
                enqueue_many(&store, &outbox, 1, 1).await;
                let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
                while broker.count() == 0 {
                    assert!(
                        tokio::time::Instant::now() < deadline,
                        "woken by the commit, not by its hourly poll"
                    );
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                relay.abort();
            }

            /// The sweep keeps up with the relay: whatever is past the retention
            /// goes in one sweep, in batches; the backlog says how many wait.
            async fn the_sweep_deletes_everything_past_the_retention_at_once(b: B) {
                let (store, _charges, outbox) = outbox_of(&b).await;
                // Twelve requests of 1 000 messages: each commit well inside the
                // store's timeout on a saturated machine.
                for request in 0..12 {
                    let key = storage_key(&format!("sweep-{request}"));
                    let mut tx = claim(&store, &key).await;
                    for i in 0..1_000 {
                        outbox
                            .enqueue(&mut tx, OutgoingMessage::new("charges", format!("{i}")))
                            .await
                            .unwrap();
                    }
                    commit(&store, &key, tx).await;
                }
                // Batches small enough that each statement stays well inside the
                // outbox's timeout on a saturated machine: the sweep still takes
                // all 12 000 in one call.
                let relay = OutboxRelay::new(outbox.clone(), Broker::default())
                    .batch(1024)
                    .retention(Duration::from_millis(1));
                while relay.run_once().await.unwrap().claimed > 0 {}
                tokio::time::sleep(Duration::from_millis(20)).await;
                let backlog = relay.backlog().await.unwrap();
                assert_eq!((backlog.pending, backlog.awaiting_sweep), (0, 12_000), "{backlog:?}");
                assert_eq!(relay.sweep().await.unwrap(), 12_000);
                assert_eq!(outbox.stats().await.unwrap(), Default::default());
            }

            /// `n` messages over `keys` ordering keys, one transaction per message (a
            /// claim and its completion, as a request's); their ids by key, in order.
            async fn enqueue_many(
                store: &Store,
                outbox: &Outbox<D>,
                n: usize,
                keys: usize,
            ) -> HashMap<String, Vec<String>> {
                let mut enqueued: HashMap<String, Vec<String>> = HashMap::new();
                for i in 0..n {
                    let key = storage_key(&format!("m{i}"));
                    let mut tx = claim(store, &key).await;
                    let ordering = format!("acct_{}", i % keys);
                    let id = outbox
                        .enqueue(
                            &mut tx,
                            OutgoingMessage::new("charges", format!("{i}"))
                                .ordering_key(ordering.clone()),
                        )
                        .await
                        .unwrap();
                    commit(store, &key, tx).await;
                    enqueued.entry(ordering).or_default().push(id);
                }
                enqueued
            }

            fn assert_published_once_in_order(
                broker: &Broker,
                enqueued: &HashMap<String, Vec<String>>,
            ) {
                let got = broker.got.lock().unwrap().clone();
                let total: usize = enqueued.values().map(Vec::len).sum();
                assert_eq!(got.len(), total, "each message published once");
                for (ordering, ids) in enqueued {
                    let published: Vec<&String> = got
                        .iter()
                        .filter(|m| m.ordering_key.as_deref() == Some(ordering))
                        .map(|m| &m.id)
                        .collect();
                    assert_eq!(
                        published,
                        ids.iter().collect::<Vec<_>>(),
                        "{ordering} in order"
                    );
                }
            }

            fn storage_key(key: &str) -> tower_idempotency::store::StorageKey {
                let key = format!("{key}-{}", fastrand::u32(..));
                tower_idempotency::store::StorageKey::new(
                    "outbox",
                    &tower_idempotency::IdempotencyKey::new(&key).unwrap(),
                )
            }

            async fn claim<St, G>(store: &St, key: &tower_idempotency::store::StorageKey) -> G
            where
                St: tower_idempotency::store::Store<Granted = G>,
            {
                let fp = tower_idempotency::Fingerprint::from_bytes([1; 32]);
                match store.claim(key, &fp, Duration::from_secs(5)).await.unwrap() {
                    tower_idempotency::store::Claim::Acquired(tx) => tx,
                    _ => panic!("a fresh key is claimed"),
                }
            }

            async fn commit<St: tower_idempotency::store::Store>(
                store: &St,
                key: &tower_idempotency::store::StorageKey,
                mut tx: St::Granted,
            ) {
                let fp = tower_idempotency::Fingerprint::from_bytes([1; 32]);
                let record = tower_idempotency::CompletedRecord::Message {
                    result: None,
                    created_at: std::time::SystemTime::now(),
                };
                assert!(
                    store
                        .complete(key, &mut tx, &fp, Arc::new(record), Duration::from_secs(60))
                        .await
                        .unwrap()
                );
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn commit_with_the_charge_replays_emit_nothing() {
                messages_commit_with_the_charge_and_replays_emit_nothing(backend()).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn relays_side_by_side() {
                relays_side_by_side_publish_once_and_in_order(backend()).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn broker_down() {
                a_broker_down_loses_nothing_and_keeps_the_order(backend()).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn relay_dead_before_marking() {
                a_relay_dead_before_marking_is_followed_by_a_republish_with_the_same_id(backend())
                    .await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn slow_broker() {
                a_slow_broker_keeps_the_claim_alive_and_nothing_goes_out_twice(backend()).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn refused_message() {
                a_refused_message_is_kept_and_reported_never_dropped(backend()).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn byte_for_byte() {
                a_message_is_published_byte_for_byte(backend()).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn an_id_given_twice() {
                an_id_given_twice_fails_the_commit_and_nothing_commits(backend()).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn hot_key() {
                a_hot_keys_backlog_drains_a_batch_a_round_in_order(backend()).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn claim_window() {
                a_claim_reads_a_window_not_a_hot_keys_whole_backlog(backend()).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn failure_mid_run() {
                a_failure_mid_run_stops_the_run_and_keeps_the_order(backend()).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn relays_on_one_hot_key() {
                relays_side_by_side_on_one_hot_key_publish_once_in_order(backend()).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn woken_by_its_own_commit() {
                an_idle_relay_wakes_at_a_commit(backend(), false).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn swept_at_once() {
                the_sweep_deletes_everything_past_the_retention_at_once(backend()).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn executed_again() {
                a_key_executed_again_sends_new_messages_and_is_never_wedged(backend()).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn swept() {
                sent_messages_are_swept_after_the_retention(backend()).await;
            }
        }
    };
}

outbox_suite!(
    postgres,
    PostgresTx,
    tower_idempotency::store::sql::postgres::Postgres,
    tower_idempotency::PostgresTxStore,
    support::backend::Charges<tower_idempotency::sqlx::Postgres>
);
/// On PostgreSQL a commit anywhere wakes a relay (`LISTEN`/`NOTIFY`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_postgres_relay_wakes_at_another_processes_commit() {
    postgres::an_idle_relay_wakes_at_a_commit(PostgresTx::start(), true).await;
}

outbox_suite!(
    sqlite,
    SqliteTx,
    tower_idempotency::store::sql::sqlite::Sqlite,
    tower_idempotency::SqliteTxStore,
    support::backend::Charges<tower_idempotency::sqlx::Sqlite>
);
outbox_suite!(
    mysql,
    MySqlTx,
    tower_idempotency::store::sql::mysql::MySql,
    tower_idempotency::MySqlTxStore,
    support::backend::Charges<tower_idempotency::sqlx::MySql>
);
