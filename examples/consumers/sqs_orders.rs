//! An orders consumer on Amazon SQS that charges each order exactly once,
//! however often the queue delivers it.
//!
//! Run with (against AWS, or any server speaking the SQS protocol through
//! `AWS_ENDPOINT_URL`, such as `moto_server`):
//!
//! ```not_rust
//! SQS_QUEUE_URL=https://sqs.eu-west-1.amazonaws.com/123456789012/orders \
//! DATABASE_URL=sqlite://orders.db \
//! cargo run --release --example sqs_orders
//! ```
//!
//! Environment: `SQS_QUEUE_URL` (required; a standard or a FIFO queue); the
//! SDK's own `AWS_ENDPOINT_URL`, `AWS_REGION`, `AWS_ACCESS_KEY_ID`,
//! `AWS_SECRET_ACCESS_KEY` (or any other source of credentials the SDK
//! reads); `DATABASE_URL` (required: `sqlite://PATH`, `postgres://…` or `mysql://…`; the
//! tables are created if missing); `WORK_DELAY_MS` (default 0: how long the
//! work takes inside its transaction); `ACK_DELAY_MS` (default 0: a pause
//! between the commit and the delete); `IDEMPOTENCY_LEASE_MS` (default
//! 30000); `IDEMPOTENCY_TX_TIMEOUT_MS` (default 30000: the bound on the
//! work's transaction).
//!
//! A message body is JSON `{"order_id", "amount", "currency"}`; the order id
//! is the business key — never the SQS message id, which is new on every
//! send. Each execution inserts one row into `order_charges`, in the same
//! transaction as the idempotency record.
//!
//! It receives batches of up to 10 with long polling and processes a
//! batch's messages concurrently (on a FIFO queue, each message group's in
//! order, one after the other). While a message's work runs, its
//! visibility timeout is extended every third of it
//! (`ChangeMessageVisibility`), so a job longer than the timeout is never
//! handed to a second consumer mid-work. Then:
//!
//! - executed or a duplicate: deleted (`DeleteMessageBatch`);
//! - in flight elsewhere, the database unavailable or busy: kept in hand
//!   and tried again after a back-off, its visibility extended all the
//!   while — never received again, so the queue's `maxReceiveCount` is not
//!   spent on an outage;
//! - never able to succeed (not a valid order: `invalid <message id>`; the
//!   same order id with another payload, or work that outlived its
//!   transaction on three attempts: `rejected <order_id>`; data the
//!   database refuses: `refused <order_id>`): sent at once to the
//!   dead-letter queue the queue's `RedrivePolicy` names, with the reason
//!   as the `DeadLetterReason` message attribute, and deleted. A queue
//!   without a `RedrivePolicy` keeps it: it is left invisible for 12 hours
//!   and logged as an error each time it comes back — never deleted;
//! - still undecided on its last receive (`maxReceiveCount`, reached only
//!   through crashes and shutdowns) when it must be given back:
//!   dead-lettered as `undecided <order_id>`, so that SQS never moves it
//!   without a reason.
//!
//! One line per message on stdout: `receiving from <queue url>` first, then
//! `executed|duplicate|rejected|refused|undecided <order_id>` or `invalid
//! <message id>`. It exits with status 2, naming the queue, when the queue
//! no longer exists; on SIGTERM it stops receiving (a receive in flight is
//! awaited, at most 20 s, and what it brings is handed back at once),
//! finishes the work in hand and deletes it, hands back at once whatever is
//! waiting between attempts, and exits 0.

use std::{collections::BTreeMap, time::Duration};

use aws_sdk_sqs::{
    Client,
    error::ProvideErrorMetadata,
    types::{
        DeleteMessageBatchRequestEntry, Message, MessageAttributeValue, MessageSystemAttributeName,
        QueueAttributeName,
    },
};
use futures_util::future::join_all;
use tokio::signal::unix::{SignalKind, signal};
use tower_idempotency::message::{
    DeadLetterReason, DeliveryBudget, Disposition, IdempotencyProcessor, extend_every,
};

#[path = "orders/mod.rs"]
mod orders;

use orders::{Handled, Ledger, Settings, exit_with, say};

#[tokio::main]
async fn main() {
    orders::init_tracing("sqs_orders");
    let settings = Settings::from_env().unwrap_or_else(|why| exit_with(&why));
    let url = std::env::var("SQS_QUEUE_URL").unwrap_or_else(|_| {
        exit_with("SQS_QUEUE_URL is required, e.g. https://sqs.eu-west-1.amazonaws.com/123456789012/orders")
    });
    let config = aws_config::load_from_env().await;
    let client = Client::new(&config);
    let queue = Queue::describe(&client, url).await;
    orders::run(Sqs { client, queue }, "sqs_orders", settings).await
}

/// The longest a message may stay invisible: SQS ends a message's
/// visibility 12 hours after it was received.
const MAX_VISIBILITY: Duration = Duration::from_secs(12 * 3600);

/// The queue as its attributes describe it.
struct Queue {
    url: String,
    visibility: Duration,
    fifo: bool,
    /// The dead-letter queue its `RedrivePolicy` names, and after how many
    /// receives SQS moves a message there.
    dead_letters: Option<(String, u32)>,
}

impl Queue {
    /// The queue's name: the last part of its URL.
    fn name(&self) -> &str {
        self.url.rsplit('/').next().unwrap_or(&self.url)
    }

    async fn describe(client: &Client, url: String) -> Self {
        let attributes = client
            .get_queue_attributes()
            .queue_url(&url)
            .attribute_names(QueueAttributeName::All)
            .send()
            .await
            .unwrap_or_else(|e| exit_with(&format!("reading queue {url}: {}", describe(&e))))
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
            Some(policy) => Some(dead_letter_url(client, &url, policy).await),
        };
        Self {
            url,
            visibility,
            fifo,
            dead_letters,
        }
    }

    /// The visibility timeout, in the whole seconds SQS takes.
    fn visibility_secs(&self) -> i32 {
        self.visibility.as_secs().clamp(1, 43_200) as i32
    }
}

/// The URL of the queue a `RedrivePolicy` names (by its ARN,
/// `arn:aws:sqs:REGION:ACCOUNT:NAME`), and its `maxReceiveCount`.
async fn dead_letter_url(client: &Client, url: &str, policy: &str) -> (String, u32) {
    let unreadable = format!("queue {url}: unreadable RedrivePolicy {policy}");
    let policy_json = serde_json::from_str::<serde_json::Value>(policy)
        .unwrap_or_else(|_| exit_with(&unreadable));
    let arn = policy_json["deadLetterTargetArn"]
        .as_str()
        .map(str::to_owned)
        .unwrap_or_else(|| exit_with(&unreadable));
    // A number, or a number in a string.
    let max_receives = match &policy_json["maxReceiveCount"] {
        serde_json::Value::Number(n) => n.as_u64(),
        serde_json::Value::String(s) => s.parse().ok(),
        _ => None,
    }
    .and_then(|n| u32::try_from(n).ok())
    .unwrap_or_else(|| exit_with(&unreadable));
    let parts: Vec<&str> = arn.split(':').collect();
    let [.., account, name] = parts[..] else {
        exit_with(&format!("queue {url}: unreadable dead-letter ARN {arn}"))
    };
    let dead = client
        .get_queue_url()
        .queue_name(name)
        .queue_owner_aws_account_id(account)
        .send()
        .await
        .unwrap_or_else(|e| {
            exit_with(&format!(
                "queue {url}: its dead-letter queue {arn}: {}",
                describe(&e)
            ))
        })
        .queue_url
        .unwrap_or_else(|| exit_with(&format!("queue {url}: no URL for {arn}")));
    (dead, max_receives)
}

struct Sqs {
    client: Client,
    queue: Queue,
}

impl orders::Consumer for Sqs {
    /// Kept in hand at most until half an hour before SQS would end the
    /// message's visibility anyway.
    fn budget(&self) -> DeliveryBudget {
        DeliveryBudget::new().give_back_after(MAX_VISIBILITY - Duration::from_secs(1800))
    }

    /// Receives until SIGTERM, or until the queue is gone.
    async fn run<St: Ledger>(self, orders: IdempotencyProcessor<St>, settings: Settings) {
        let mut term = signal(SignalKind::terminate())
            .unwrap_or_else(|e| exit_with(&format!("listening for SIGTERM: {e}")));
        // SIGTERM drains: what waits between attempts goes back at once.
        tokio::spawn({
            let orders = orders.clone();
            async move {
                term.recv().await;
                orders.drain();
            }
        });
        let mut announced = false;
        let mut outage = 0u32;
        while !orders.is_draining() {
            let receive = self
                .client
                .receive_message()
                .queue_url(&self.queue.url)
                .max_number_of_messages(10)
                .wait_time_seconds(20)
                .message_system_attribute_names(MessageSystemAttributeName::ApproximateReceiveCount)
                .message_system_attribute_names(MessageSystemAttributeName::MessageGroupId)
                .send();
            if !announced {
                say(&format!("receiving from {}", self.queue.url));
                announced = true;
            }
            // Never dropped halfway: SQS may have handed its messages out.
            let received = receive.await;
            let messages = match received {
                Ok(out) => {
                    outage = 0;
                    out.messages.unwrap_or_default()
                }
                Err(error) if gone(&error) => exit_with(&format!(
                    "queue {} no longer exists: {}",
                    self.queue.url,
                    describe(&error)
                )),
                Err(error) => {
                    outage += 1;
                    tracing::warn!(error = describe(&error), "receiving failed; retrying");
                    tokio::time::sleep(Duration::from_millis(200 << outage.min(5))).await;
                    continue;
                }
            };
            if orders.is_draining() {
                // Received after SIGTERM: handed back at once, not started.
                for message in &messages {
                    self.retry_later(message, Duration::ZERO).await;
                }
                break;
            }
            self.batch(&orders, &settings, messages).await;
        }
        eprintln!("sqs_orders: SIGTERM: stopped receiving, the messages in hand done");
    }
}

impl Sqs {
    /// Processes a batch — concurrently, save that a FIFO group's messages
    /// run in order — then deletes what is done in one request.
    async fn batch<St: Ledger>(
        &self,
        orders: &IdempotencyProcessor<St>,
        settings: &Settings,
        messages: Vec<Message>,
    ) {
        // On a FIFO queue, a group's messages in the order received; on a
        // standard queue, each message on its own.
        let mut groups: BTreeMap<String, Vec<Message>> = BTreeMap::new();
        for (i, message) in messages.into_iter().enumerate() {
            let group = match (
                self.queue.fifo,
                attribute(&message, MessageSystemAttributeName::MessageGroupId),
            ) {
                (true, Some(group)) => group.to_owned(),
                _ => format!("#{i}"),
            };
            groups.entry(group).or_default().push(message);
        }
        let group_runs = groups
            .into_values()
            .map(|group| self.group(orders, settings, group));
        let settled: Vec<(Message, Option<String>)> =
            join_all(group_runs).await.into_iter().flatten().collect();
        self.delete(&settled).await;
        for (_, line) in settled {
            if let Some(line) = line {
                say(&line);
            }
        }
    }

    /// One group's messages in order: once one must wait, the ones after it
    /// wait too (a FIFO group is never overtaken). Returns the messages to
    /// delete, each with its line.
    async fn group<St: Ledger>(
        &self,
        orders: &IdempotencyProcessor<St>,
        settings: &Settings,
        group: Vec<Message>,
    ) -> Vec<(Message, Option<String>)> {
        let mut settled = Vec::new();
        let mut held_back: Option<Duration> = None;
        for message in group {
            if let Some(after) = held_back {
                self.retry_later(&message, after).await;
                continue;
            }
            let handled = self.one(orders, settings, &message).await;
            let line = if handled.invalid {
                Some(format!("invalid {}", message.message_id().unwrap_or("?")))
            } else {
                handled.line
            };
            match handled.disposition {
                Disposition::Ack => settled.push((message, line)),
                Disposition::Retry { after } => {
                    self.retry_later(&message, after).await;
                    if let Some(line) = line {
                        say(&line);
                    }
                    held_back = Some(after);
                }
                Disposition::DeadLetter(reason) => {
                    match self.dead_letter(&message, &reason).await {
                        Ok(true) => settled.push((message, line)),
                        Ok(false) => {
                            // Kept: out of sight for as long as SQS allows.
                            if let Some(line) = line {
                                say(&line);
                            }
                            self.retry_later(&message, MAX_VISIBILITY).await;
                        }
                        Err(error) => {
                            // Not deleted: it comes back and is moved then.
                            tracing::error!(%error, "the dead-letter queue refused the message; retried later");
                            held_back = Some(Duration::from_secs(1));
                            self.retry_later(&message, Duration::from_secs(1)).await;
                        }
                    }
                }
            }
        }
        settled
    }

    /// One message's work, its visibility extended while the work runs.
    async fn one<St: Ledger>(
        &self,
        orders: &IdempotencyProcessor<St>,
        settings: &Settings,
        message: &Message,
    ) -> Handled {
        let receives: u32 = attribute(message, MessageSystemAttributeName::ApproximateReceiveCount)
            .and_then(|n| n.parse().ok())
            .unwrap_or(1);
        // SQS moves it to the dead-letter queue on the receive after this.
        let last = self
            .queue
            .dead_letters
            .as_ref()
            .is_some_and(|(_, max_receives)| receives >= *max_receives);
        let receipt = message.receipt_handle().unwrap_or_default();
        let visibility = self.queue.visibility_secs();
        let hold = extend_every(
            (self.queue.visibility / 3).max(Duration::from_millis(300)),
            || async move {
                self.client
                    .change_message_visibility()
                    .queue_url(&self.queue.url)
                    .receipt_handle(receipt)
                    .visibility_timeout(visibility)
                    .send()
                    .await?;
                Ok(())
            },
        );
        let origin = orders::Origin {
            system: "aws_sqs",
            destination: self.queue.name(),
            message_id: message.message_id(),
        };
        let body = message.body().unwrap_or_default();
        orders::handle(orders, settings, &origin, body.as_bytes(), &hold, last).await
    }

    /// Left in the queue, visible again after `after` (whole seconds).
    async fn retry_later(&self, message: &Message, after: Duration) {
        let seconds = (after.as_secs_f64().ceil() as i32).min(43_200);
        let changed = self
            .client
            .change_message_visibility()
            .queue_url(&self.queue.url)
            .set_receipt_handle(message.receipt_handle().map(str::to_owned))
            .visibility_timeout(seconds)
            .send()
            .await;
        if let Err(error) = changed {
            // It comes back after the visibility timeout instead.
            tracing::warn!(
                error = describe(&error),
                "could not shorten a message's visibility"
            );
        }
    }

    /// Sent to the dead-letter queue with its reason (`true`: the caller
    /// deletes it from this one); without one, kept (`false`) and logged.
    async fn dead_letter(
        &self,
        message: &Message,
        reason: &DeadLetterReason,
    ) -> Result<bool, String> {
        let id = message.message_id().unwrap_or("?");
        let Some((dead, _)) = &self.queue.dead_letters else {
            tracing::error!(message = id, queue = %self.queue.url, %reason, "a message that can never succeed has no dead-letter queue (no RedrivePolicy): kept in the queue, invisible for 12 hours; give the queue a RedrivePolicy");
            return Ok(false);
        };
        let text = |value: String| {
            MessageAttributeValue::builder()
                .data_type("String")
                .string_value(value)
                .build()
                .expect("a data type")
        };
        let mut send = self
            .client
            .send_message()
            .queue_url(dead)
            .set_message_body(message.body().map(str::to_owned))
            .message_attributes("DeadLetterReason", text(reason.to_string()))
            .message_attributes("DeadLetterKind", text(reason.kind().to_owned()));
        if self.queue.fifo {
            let group =
                attribute(message, MessageSystemAttributeName::MessageGroupId).unwrap_or("dead");
            send = send.message_group_id(group).message_deduplication_id(id);
        }
        send.send().await.map_err(|e| describe(&e))?;
        Ok(true)
    }

    /// Deletes what is settled, up to 10 per request.
    async fn delete(&self, settled: &[(Message, Option<String>)]) {
        for chunk in settled.chunks(10) {
            let entries = chunk
                .iter()
                .enumerate()
                .map(|(i, (message, _))| {
                    DeleteMessageBatchRequestEntry::builder()
                        .id(i.to_string())
                        .set_receipt_handle(message.receipt_handle().map(str::to_owned))
                        .build()
                        .expect("an id and a receipt handle")
                })
                .collect();
            let deleted = self
                .client
                .delete_message_batch()
                .queue_url(&self.queue.url)
                .set_entries(Some(entries))
                .send()
                .await;
            match deleted {
                Ok(out) => {
                    for failed in out.failed {
                        // Delivered again, then a duplicate: acknowledged then.
                        tracing::warn!(code = failed.code, why = failed.message, "a delete failed");
                    }
                }
                Err(error) => tracing::warn!(error = describe(&error), "deleting a batch failed"),
            }
        }
    }
}

fn attribute(message: &Message, name: MessageSystemAttributeName) -> Option<&str> {
    message.attributes()?.get(&name).map(String::as_str)
}

/// Whether an SQS error says the queue does not exist.
fn gone<E: ProvideErrorMetadata>(error: &aws_sdk_sqs::error::SdkError<E>) -> bool {
    error
        .code()
        .is_some_and(|code| code.contains("NonExistentQueue") || code.contains("QueueDoesNotExist"))
}

/// An SDK error with its service's code and message, not just "service
/// error".
fn describe<E: ProvideErrorMetadata + std::error::Error + 'static>(
    error: &aws_sdk_sqs::error::SdkError<E>,
) -> String {
    match (error.code(), error.message()) {
        (Some(code), Some(message)) => format!("{code}: {message}"),
        (Some(code), None) => code.to_owned(),
        _ => aws_sdk_sqs::error::DisplayErrorContext(error).to_string(),
    }
}
