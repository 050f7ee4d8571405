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
//! [`IdempotencyProcessor::process_delivery`] extends the broker's hold
//! through a [`DeliveryLease`] while the work runs. [`Disposition::of`]
//! turns what processing came to into what to tell the broker —
//! acknowledge, retry after a back-off, or dead-letter — the same way for
//! every broker.
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

mod budget;
mod delivery;
mod disposition;
mod outcome;
mod processor;

pub use budget::DeliveryBudget;
pub use delivery::{Delivery, DeliveryLease, ExtendError, ExtendEvery, NoHold, extend_every};
pub use disposition::{DeadLetterReason, Disposition};
pub use outcome::{ProcessError, ProcessOutcome, Settled};
pub use processor::IdempotencyProcessor;
