//! Amazon SQS for [tower-idempotency]: the consumer loop's adapter
//! ([`Sqs`]) and the outbox's publisher ([`SqsPublisher`]).
//!
//! A consumer writes only its work: the loop
//! ([`Consumer`](tower_idempotency::message::Consumer)) receives batches
//! with long polling, extends each message's visibility every third of the
//! queue's visibility timeout from the moment it is in hand
//! (`ChangeMessageVisibility`), settles it with the processor, and answers:
//! `DeleteMessage`, a visibility change for a message given back, or — for
//! what can never succeed — a send to the dead-letter queue the queue's
//! `RedrivePolicy` names, with its reason in the `DeadLetterReason`
//! attribute, then a delete. A queue without a `RedrivePolicy` keeps such a
//! message (invisible for 12 hours, logged each time it comes back), never
//! deletes it. On a FIFO queue a message group's messages are settled in
//! order. Nothing undecided is dropped: an outage, a busy database or a
//! duplicate in flight is retried in hand (no receive spent on it); on its
//! last receive before `maxReceiveCount`, an undecided message is
//! dead-lettered as undecided rather than moved by SQS without a reason. A
//! receive in flight at shutdown is awaited, and what it brings handed back.
//!
//! # Examples
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! use tower_idempotency::{
//!     SqliteStore, SqliteTx,
//!     message::{Consumer, DeadLetterReason, IdempotencyProcessor, Parsed},
//! };
//! use tower_idempotency_sqs::{Sqs, aws_sdk_sqs};
//!
//! #[derive(serde::Deserialize)]
//! struct Order { order_id: String, amount: i64 }
//!
//! let client = aws_sdk_sqs::Client::new(&aws_config::load_from_env().await);
//! let broker = Sqs::builder(client, "https://sqs.eu-west-1.amazonaws.com/123456789012/orders").build().await?;
//! let store = SqliteStore::builder().transactional().create_table_if_missing().connect("sqlite://ledger.db").await?;
//! let orders = IdempotencyProcessor::new(store).scope("ledger").budget(Sqs::budget());
//! Consumer::new(broker, orders)
//!     .run(
//!         |payload: &[u8]| {
//!             let order: Order = serde_json::from_slice(payload)
//!                 .map_err(|e| DeadLetterReason::invalid(e.to_string()))?;
//!             Ok(Parsed { key: order.order_id.clone(), message: order })
//!         },
//!         async |tx: &mut SqliteTx, order: &Order| {
//!             tower_idempotency::sqlx::query("INSERT INTO ledger (order_id, amount) VALUES (?1, ?2)")
//!                 .bind(&order.order_id)
//!                 .bind(order.amount)
//!                 .execute(&mut **tx)
//!                 .await
//!                 .map(drop)
//!         },
//!         async { tokio::signal::ctrl_c().await.ok(); },
//!     )
//!     .await?;
//! # Ok(()) }
//! ```
//!
//! [tower-idempotency]: https://docs.rs/tower-idempotency
#![forbid(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]

// The README's example compiles with the crate's doctests.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

use std::{borrow::Cow, fmt, time::Duration};

pub use aws_sdk_sqs;
use aws_sdk_sqs::{
    Client,
    error::{ProvideErrorMetadata, SdkError},
    types::{Message, MessageAttributeValue, MessageSystemAttributeName, QueueAttributeName},
};
use tower_idempotency::{
    message::{
        Acked, Broker, BrokerError, DeadLetterReason, DeadLettered, DeliveryBudget, ExtendError,
        HeaderStyle, Origin, Received,
    },
    outbox::{OutboxMessage, PublishError, Publisher},
};

/// The longest a message may stay invisible: SQS ends a message's
/// visibility 12 hours after it was received.
pub const MAX_VISIBILITY: Duration = Duration::from_secs(12 * 3600);

/// How long a message that can never succeed, with nowhere to go, is kept
/// out of sight: as long as SQS allows from a receive a moment ago.
const KEPT_FOR: Duration = Duration::from_secs(12 * 3600 - 600);

/// A queue, as the consumer loop drives it: see the [crate docs](crate).
/// Built by [`Sqs::builder`], which reads the queue's attributes.
pub struct Sqs {
    client: Client,
    url: String,
    name: String,
    visibility: Duration,
    fifo: bool,
    /// The dead-letter queue its `RedrivePolicy` names, and after how many
    /// receives SQS moves a message there.
    dead_letters: Option<(String, u32)>,
}

impl fmt::Debug for Sqs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sqs")
            .field("url", &self.url)
            .field("visibility", &self.visibility)
            .field("fifo", &self.fifo)
            .field("dead_letters", &self.dead_letters)
            .finish_non_exhaustive()
    }
}

/// Builds an [`Sqs`]: see [`Sqs::builder`].
#[derive(Debug)]
pub struct SqsBuilder {
    client: Client,
    url: String,
}

/// Why an [`Sqs`] would not start: each says what to fix.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    /// The queue's attributes could not be read (it does not exist, the
    /// credentials may not, the endpoint is out of reach).
    #[error("reading queue {url}: {why}")]
    Unreadable {
        /// The queue.
        url: String,
        /// What SQS said.
        why: String,
    },
    /// Its `RedrivePolicy` cannot be read, or names a queue that cannot be
    /// found: a dead letter would have nowhere to go.
    #[error("queue {url}: {why}")]
    DeadLetters {
        /// The queue.
        url: String,
        /// What is wrong.
        why: String,
    },
}

impl Sqs {
    /// The queue at `url`, received with `client` (its credentials,
    /// region and endpoint from the SDK's configuration).
    ///
    /// # Examples
    ///
    /// See the [crate docs](crate).
    pub fn builder(client: Client, url: impl Into<String>) -> SqsBuilder {
        SqsBuilder {
            client,
            url: url.into(),
        }
    }

    /// The delivery budget for SQS: a message kept in hand at most until
    /// half an hour before SQS would end its visibility anyway (12 hours
    /// after its receive); give it to the processor
    /// ([`IdempotencyProcessor::budget`](tower_idempotency::message::IdempotencyProcessor::budget)).
    ///
    /// # Examples
    ///
    /// See the [crate docs](crate).
    pub fn budget() -> DeliveryBudget {
        DeliveryBudget::new().give_back_after(MAX_VISIBILITY - Duration::from_secs(1800))
    }

    /// The queue's URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The visibility timeout, in the whole seconds SQS takes.
    fn visibility_secs(&self) -> i32 {
        self.visibility.as_secs().clamp(1, 43_200) as i32
    }

    /// Left in the queue, visible again after `after` (whole seconds).
    async fn visible_after(&self, message: &Message, after: Duration) -> Result<(), BrokerError> {
        let seconds = (after.as_secs_f64().ceil() as i32).min(43_200);
        self.client
            .change_message_visibility()
            .queue_url(&self.url)
            .set_receipt_handle(message.receipt_handle().map(str::to_owned))
            .visibility_timeout(seconds)
            .send()
            .await
            .map_err(|e| describe(&e).into())
            .map(drop)
    }
}

impl SqsBuilder {
    /// The adapter, once the queue's visibility timeout, FIFO-ness and
    /// dead-letter queue are read.
    ///
    /// # Errors
    ///
    /// See [`StartError`].
    ///
    /// # Examples
    ///
    /// See the [crate docs](crate).
    pub async fn build(self) -> Result<Sqs, StartError> {
        let Self { client, url } = self;
        let attributes = client
            .get_queue_attributes()
            .queue_url(&url)
            .attribute_names(QueueAttributeName::All)
            .send()
            .await
            .map_err(|e| StartError::Unreadable {
                url: url.clone(),
                why: describe(&e),
            })?
            .attributes
            .unwrap_or_default();
        let visibility = attributes
            .get(&QueueAttributeName::VisibilityTimeout)
            .and_then(|s| s.parse().ok())
            .map_or(Duration::from_secs(30), Duration::from_secs);
        let fifo = attributes
            .get(&QueueAttributeName::FifoQueue)
            .is_some_and(|s| s == "true");
        let dead_letters = match attributes.get(&QueueAttributeName::RedrivePolicy) {
            None => None,
            Some(policy) => Some(dead_letter_url(&client, policy).await.map_err(|why| {
                StartError::DeadLetters {
                    url: url.clone(),
                    why,
                }
            })?),
        };
        let name = url.rsplit('/').next().unwrap_or(&url).to_owned();
        Ok(Sqs {
            client,
            url,
            name,
            visibility,
            fifo,
            dead_letters,
        })
    }
}

/// The URL of the queue a `RedrivePolicy` names (by its ARN,
/// `arn:aws:sqs:REGION:ACCOUNT:NAME`), and its `maxReceiveCount`.
async fn dead_letter_url(client: &Client, policy: &str) -> Result<(String, u32), String> {
    let unreadable = || format!("unreadable RedrivePolicy {policy}");
    let policy_json =
        serde_json::from_str::<serde_json::Value>(policy).map_err(|_| unreadable())?;
    let arn = policy_json["deadLetterTargetArn"]
        .as_str()
        .ok_or_else(unreadable)?
        .to_owned();
    // A number, or a number in a string.
    let max_receives = match &policy_json["maxReceiveCount"] {
        serde_json::Value::Number(n) => n.as_u64(),
        serde_json::Value::String(s) => s.parse().ok(),
        _ => None,
    }
    .and_then(|n| u32::try_from(n).ok())
    .ok_or_else(unreadable)?;
    let parts: Vec<&str> = arn.split(':').collect();
    let [.., account, name] = parts[..] else {
        return Err(format!("unreadable dead-letter ARN {arn}"));
    };
    let dead = client
        .get_queue_url()
        .queue_name(name)
        .queue_owner_aws_account_id(account)
        .send()
        .await
        .map_err(|e| format!("its dead-letter queue {arn}: {}", describe(&e)))?
        .queue_url
        .ok_or_else(|| format!("no URL for {arn}"))?;
    Ok((dead, max_receives))
}

/// One SQS delivery.
pub struct SqsMessage {
    message: Message,
    /// Whether SQS moves it to the dead-letter queue on its next receive.
    last: bool,
}

impl fmt::Debug for SqsMessage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqsMessage")
            .field("message_id", &self.message.message_id())
            .field("last", &self.last)
            .finish_non_exhaustive()
    }
}

impl SqsMessage {
    /// The message, as the SDK gives it.
    pub fn message(&self) -> &Message {
        &self.message
    }

    fn attribute(&self, name: MessageSystemAttributeName) -> Option<&str> {
        self.message.attributes()?.get(&name).map(String::as_str)
    }
}

/// `Sqs`'s deliveries: see [`Received`].
impl Received for SqsMessage {
    fn payload(&self) -> &[u8] {
        self.message.body().unwrap_or_default().as_bytes()
    }

    /// A message attribute of type `String`.
    fn header(&self, name: &str) -> Option<&str> {
        self.message.message_attributes()?.get(name)?.string_value()
    }

    fn message_id(&self) -> Option<Cow<'_, str>> {
        self.message.message_id().map(Cow::Borrowed)
    }

    fn last(&self) -> bool {
        self.last
    }
}

impl Broker for Sqs {
    type Received = SqsMessage;

    fn system(&self) -> &'static str {
        "aws_sqs"
    }

    fn destination(&self) -> &str {
        &self.name
    }

    /// Long polling (up to SQS's 20 s); a receive that fails for a moment
    /// is tried again, with back-off; the queue gone ends the loop, naming
    /// it.
    async fn receive(&self, room: usize, within: Duration) -> Result<Vec<SqsMessage>, BrokerError> {
        let mut outage = 0u32;
        loop {
            let received = self
                .client
                .receive_message()
                .queue_url(&self.url)
                .max_number_of_messages(room.clamp(1, 10) as i32)
                .wait_time_seconds(within.as_secs().clamp(1, 20) as i32)
                .message_system_attribute_names(MessageSystemAttributeName::ApproximateReceiveCount)
                .message_system_attribute_names(MessageSystemAttributeName::MessageGroupId)
                .message_attribute_names("All")
                .send()
                .await;
            match received {
                Ok(out) => {
                    return Ok(out
                        .messages
                        .unwrap_or_default()
                        .into_iter()
                        .map(|message| {
                            let mut received = SqsMessage {
                                message,
                                last: false,
                            };
                            let receives: u32 = received
                                .attribute(MessageSystemAttributeName::ApproximateReceiveCount)
                                .and_then(|n| n.parse().ok())
                                .unwrap_or(1);
                            // SQS moves it to the dead-letter queue on the
                            // receive after this.
                            received.last = self
                                .dead_letters
                                .as_ref()
                                .is_some_and(|(_, max)| receives >= *max);
                            received
                        })
                        .collect());
                }
                Err(error) if gone(&error) => {
                    return Err(format!(
                        "queue {} no longer exists: {}",
                        self.url,
                        describe(&error)
                    )
                    .into());
                }
                Err(error) => {
                    outage += 1;
                    tracing::warn!(error = describe(&error), "receiving failed; retrying");
                    tokio::time::sleep(Duration::from_millis(200 << outage.min(5))).await;
                }
            }
        }
    }

    fn hold_interval(&self) -> Option<Duration> {
        Some((self.visibility / 3).max(Duration::from_millis(300)))
    }

    async fn extend(&self, received: &SqsMessage) -> Result<(), ExtendError> {
        self.client
            .change_message_visibility()
            .queue_url(&self.url)
            .set_receipt_handle(received.message.receipt_handle().map(str::to_owned))
            .visibility_timeout(self.visibility_secs())
            .send()
            .await?;
        Ok(())
    }

    /// A FIFO queue's message group.
    fn ordering_key<'a>(&self, received: &'a SqsMessage) -> Option<Cow<'a, str>> {
        if !self.fifo {
            return None;
        }
        received
            .attribute(MessageSystemAttributeName::MessageGroupId)
            .map(Cow::Borrowed)
    }

    async fn ack(&self, received: &SqsMessage, _: Acked) -> Result<(), BrokerError> {
        self.client
            .delete_message()
            .queue_url(&self.url)
            .set_receipt_handle(received.message.receipt_handle().map(str::to_owned))
            .send()
            .await
            .map_err(|e| describe(&e).into())
            .map(drop)
    }

    async fn give_back(&self, received: &SqsMessage, after: Duration) -> Result<(), BrokerError> {
        self.visible_after(&received.message, after).await
    }

    async fn dead_letter(
        &self,
        received: &SqsMessage,
        reason: &DeadLetterReason,
    ) -> Result<DeadLettered, BrokerError> {
        let message = &received.message;
        let id = message.message_id().unwrap_or("?");
        let Some((dead, _)) = &self.dead_letters else {
            tracing::error!(message = id, queue = %self.url, %reason, "a message that can never succeed has no dead-letter queue (no RedrivePolicy): kept in the queue, out of sight for nearly 12 hours; give the queue a RedrivePolicy");
            if let Err(error) = self.visible_after(message, KEPT_FOR).await {
                // Back after its visibility timeout instead, and kept then.
                tracing::warn!(%error, "could not keep the message out of sight");
            }
            return Ok(DeadLettered::Kept);
        };
        let origin = Origin {
            // The queue's name: its URL's last segment.
            source: self.url.rsplit('/').next().unwrap_or(&self.url),
            partition: None,
            position: message.message_id(),
        };
        let mut send = self
            .client
            .send_message()
            .queue_url(dead)
            .set_message_body(message.body().map(str::to_owned));
        for (name, value) in reason.headers(&origin, HeaderStyle::Sqs) {
            send = send.message_attributes(name, text(&value));
        }
        if self.fifo {
            let group = received
                .attribute(MessageSystemAttributeName::MessageGroupId)
                .unwrap_or("dead");
            send = send.message_group_id(group).message_deduplication_id(id);
        }
        send.send().await.map_err(|e| describe(&e))?;
        Ok(DeadLettered::Moved)
    }
}

fn text(value: &str) -> MessageAttributeValue {
    MessageAttributeValue::builder()
        .data_type("String")
        .string_value(value)
        .build()
        .expect("a data type")
}

/// Whether an SQS error says the queue does not exist.
fn gone<E: ProvideErrorMetadata>(error: &SdkError<E>) -> bool {
    error
        .code()
        .is_some_and(|code| code.contains("NonExistentQueue") || code.contains("QueueDoesNotExist"))
}

/// An SDK error with its service's code and message, not just "service
/// error".
fn describe<E: ProvideErrorMetadata + std::error::Error + 'static>(error: &SdkError<E>) -> String {
    match (error.code(), error.message()) {
        (Some(code), Some(message)) => format!("{code}: {message}"),
        (Some(code), None) => code.to_owned(),
        _ => aws_sdk_sqs::error::DisplayErrorContext(error).to_string(),
    }
}

/// The outbox's publisher to SQS: each message to the queue its
/// destination names (a queue URL), its id in the `message-id` attribute
/// and its headers as attributes; on a FIFO queue (`….fifo`) the id is the
/// `MessageDeduplicationId` (SQS drops a repeat within 5 minutes) and the
/// ordering key the `MessageGroupId`. A queue that does not exist or a
/// message SQS will not take is refused (kept by the relay); anything else
/// is retried.
///
/// # Examples
///
/// ```no_run
/// # async fn demo() {
/// use tower_idempotency_sqs::{SqsPublisher, aws_sdk_sqs};
///
/// let publisher = SqsPublisher::new(aws_sdk_sqs::Client::new(&aws_config::load_from_env().await));
/// # let _ = publisher; }
/// ```
#[derive(Clone, Debug)]
pub struct SqsPublisher {
    client: Client,
}

impl SqsPublisher {
    /// Publishes with `client`.
    ///
    /// # Examples
    ///
    /// See [`SqsPublisher`].
    pub fn new(client: Client) -> Self {
        Self { client }
    }
}

impl Publisher for SqsPublisher {
    async fn publish(&self, message: &OutboxMessage) -> Result<(), PublishError> {
        let mut send = self
            .client
            .send_message()
            .queue_url(&message.destination)
            .message_body(String::from_utf8_lossy(&message.payload))
            .message_attributes("message-id", text(&message.id));
        for (name, value) in &message.headers {
            send = send.message_attributes(name, text(value));
        }
        if message.destination.ends_with(".fifo") {
            let group = message.ordering_key.as_deref().unwrap_or(&message.id);
            send = send
                .message_deduplication_id(&message.id)
                .message_group_id(group);
        }
        match send.send().await {
            Ok(_) => Ok(()),
            Err(error) => {
                let code = error.code().unwrap_or_default().to_owned();
                let refused = [
                    "NonExistentQueue",
                    "QueueDoesNotExist",
                    "InvalidMessageContents",
                    "InvalidParameterValue",
                ]
                .iter()
                .any(|refused| code.contains(refused));
                if refused {
                    Err(PublishError::Refused(describe(&error)))
                } else {
                    Err(PublishError::Unavailable(describe(&error).into()))
                }
            }
        }
    }
}
