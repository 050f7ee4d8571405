//! The same protocol for queue consumers: run a message's work at most once
//! per business key, whatever the broker redelivers.
//!
//! Brokers deliver at least once. SQS makes a message visible again when its
//! visibility timeout (30 s by default) passes without a delete; RabbitMQ
//! requeues an unacknowledged delivery, flagged `redelivered`, when its
//! channel or connection closes. A consumer that did the work and crashed
//! before its acknowledgement gets the message again. [`IdempotencyProcessor::process`]
//! makes that harmless: it claims the message's **business key** (an order
//! id, a payment intent — never a delivery id or a fresh UUID, which differ
//! on every redelivery and defeat the check), runs the work under a lease
//! with heartbeats, stores its result, and answers every later delivery with
//! that stored result.
//!
//! What it does not give you: ordering (a redelivery may overtake newer
//! messages), and exactly-once *processing* — FIFO de-duplication windows
//! only drop duplicates within a few minutes, and no broker can promise that
//! the work ran once. What it does promise depends on the store:
//!
//! - On a transactional store (`SqliteTxStore`, `PostgresTxStore`), the
//!   work receives the store's transaction and the record commits with its
//!   writes: "processed" and the effect are one fact (the
//!   `processed_messages` pattern). A crash before the commit leaves
//!   neither, and the redelivery executes; a crash after it (before the
//!   acknowledgement) leaves both, and the redelivery is a
//!   [`ProcessOutcome::Duplicate`]. Exactly one effect.
//! - On Redis or memory stores the record and the work's effects are **not**
//!   atomic: a crash after the effect and before the record is stored means
//!   the redelivery runs the work again once the lease expires. Retries are
//!   harmless everywhere else.
//!
//! # Keeping the delivery, answering the broker
//!
//! A job longer than the broker's timeout (SQS's visibility timeout,
//! JetStream's `AckWait`) would be handed to a second consumer mid-work:
//! the broker's hold on the delivery is extended through a
//! [`DeliveryLease`] while the delivery is in hand.
//! [`IdempotencyProcessor::settle`] runs a [`Delivery`] to its end and says
//! what to tell the broker — a [`Disposition`]: acknowledge, give it back,
//! or dead-letter it with a [`DeadLetterReason`] — the same way for every
//! broker.
//!
//! # Nothing is lost
//!
//! Brokers deliver at least once; a consumer must never turn that into at
//! most once. The rule, for every broker:
//!
//! 1. **What can pass is retried in hand.** The store unavailable or busy,
//!    a commit whose outcome is unknown, the same message in flight on
//!    another consumer, a failure of the work you judge passing: the
//!    consumer keeps the delivery — its hold extended — and tries again
//!    after a back-off ([`DeliveryBudget`]). It is never handed back for
//!    that, so a running consumer spends none of the broker's delivery
//!    budget on a fault that heals: an outage of any length, with the
//!    consumer up throughout, dead-letters nothing.
//! 2. **Only what can never succeed is dead-lettered, with a true
//!    reason**: not a valid message, the key reused with another payload,
//!    a transaction the database refuses, a panic, a work error you judge
//!    permanent, work that outlived its transaction on the budget's
//!    attempts (3 by default) — counted by the consumer, not read off the
//!    broker's delivery counter.
//! 3. **Nothing is dropped.** A delivery goes back to the broker only when
//!    the consumer [drains](IdempotencyProcessor::drain) (SIGTERM) or the
//!    budget [says to](DeliveryBudget::give_back_after); on the broker's
//!    last delivery it is dead-lettered as [undecided](DeadLetterReason::Undecided)
//!    instead, loudly. A message that can never succeed with nowhere to go
//!    is kept, never deleted: the examples refuse a dead-letter target that
//!    cannot accept messages at start-up, and keep such a message out of
//!    sight in its queue when they have none.
//!
//! Sizing — which broker setting must outlast what:
//!
//! | setting | must be | why |
//! |---|---|---|
//! | SQS visibility timeout, JetStream `AckWait` | well above the hold's extension interval (a third of it) | a late extension hands the message to a second consumer, which then waits in hand as a duplicate |
//! | SQS `maxReceiveCount`, JetStream `MaxDeliver`, a quorum queue's `delivery-limit` | above the stops a message may meet undecided: a crash, a SIGTERM, a restart during an outage each spend one delivery of every message in hand (JetStream: unlimited is best) | only crashes and shutdowns spend it — SQS counts every receive, so a consumer killed holding a message has spent it; undecided on the last, a message is dead-lettered as undecided (SQS moves one received by a consumer that was killed, with no reason, since the consumer never saw its last receive end) |
//! | RabbitMQ `consumer_timeout` (30 min) | above [`give_back_after`](DeliveryBudget::give_back_after) | RabbitMQ cannot extend a delivery: give it back before the broker closes the channel |
//! | SQS's 12 hours of visibility | above `give_back_after` | a message's visibility cannot be extended past 12 hours from its receive |
//! | the transactional store's `transaction_timeout` | above the work's longest duration | work that always outlives it is dead-lettered as timed out |
//! | [`Consumer::batch_within`] (1 s) | well below the `transaction_timeout` | a batch whose commit the database refused for its age settles each delivery again on its own |
//! | the retention | above the broker's longest redelivery (SQS keeps messages up to 14 days) | a redelivery after the record expired runs the work again |
//!
//! On a SQLite store, a consumer's claims wait their turn on the file's one
//! writer ([`Store::claim_patiently`](crate::store::Store::claim_patiently))
//! instead of timing out: one consumer's deliveries never fight each other.
//!
//! # Examples
//!
//! ```
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use tower_idempotency::{MemoryStore, message::{IdempotencyProcessor, ProcessOutcome}};
//!
//! let orders = IdempotencyProcessor::new(MemoryStore::new()).scope("orders");
//! let payload = br#"{"order_id":"order-42","amount":1999}"#;
//!
//! let charge = async |_: &mut _| Ok::<_, std::io::Error>("ch_1".to_owned());
//! let first = orders.process("order-42", payload, charge).await?;
//! assert_eq!(first, ProcessOutcome::Executed("ch_1".to_owned()));
//!
//! // Redelivered: acknowledged with the stored result, the work does not run.
//! let again = orders
//!     .process("order-42", payload, async |_: &mut _| -> Result<String, std::io::Error> {
//!         unreachable!("a duplicate never runs the work")
//!     })
//!     .await?;
//! assert_eq!(again, ProcessOutcome::Duplicate("ch_1".to_owned()));
//! # Ok(()) }
//! ```

mod attempt;
mod batch;
mod budget;
mod consumer;
mod dead_letter;
mod delivery;
mod disposition;
mod outcome;
mod processor;

pub use attempt::attempt;
pub use budget::DeliveryBudget;
pub use consumer::{Acked, Broker, BrokerError, Consumer, DeadLettered, Parsed, Received, Report};
pub use dead_letter::{DeadLetterField, HeaderStyle, Origin};
pub use delivery::{Delivery, DeliveryLease, ExtendError, ExtendEvery, NoHold, extend_every};
pub use disposition::{DeadLetterReason, Disposition};
pub use outcome::{ProcessError, ProcessOutcome, Settled};
pub use processor::IdempotencyProcessor;
