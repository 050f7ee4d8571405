//! What a dead letter says of itself, stated once for every broker: why it
//! was dead-lettered (one line), the kind of reason, and where it came
//! from — each field spelled as its broker's headers are, and written by
//! every broker that can carry it.

use super::DeadLetterReason;

/// How a broker spells its headers: the dead-letter contract's field names
/// are chosen here, once, for each broker.
///
/// | field | [`Kafka`](Self::Kafka) | [`Nats`](Self::Nats) | [`Amqp`](Self::Amqp) | [`Sqs`](Self::Sqs) |
/// |---|---|---|---|---|
/// | reason | `dead-letter-reason` | `Dead-Letter-Reason` | `x-dead-letter-reason` | `DeadLetterReason` |
/// | kind | `dead-letter-kind` | `Dead-Letter-Kind` | `x-dead-letter-kind` | `DeadLetterKind` |
/// | source | `original-topic` | `Original-Subject` | `x-original-queue` | `OriginalQueue` |
/// | partition | `original-partition` | — | — | — |
/// | position | `original-offset` | `Original-Sequence` | — | `OriginalMessageId` |
///
/// # Examples
///
/// ```
/// use tower_idempotency::message::{DeadLetterField, HeaderStyle};
///
/// assert_eq!(DeadLetterField::Reason.name(HeaderStyle::Nats), Some("Dead-Letter-Reason"));
/// assert_eq!(DeadLetterField::Partition.name(HeaderStyle::Sqs), None);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum HeaderStyle {
    /// Kafka's record headers: lowercase, hyphenated.
    Kafka,
    /// NATS message headers: MIME-style, each word capitalised.
    Nats,
    /// AMQP 0-9-1 (RabbitMQ) message headers: an application's own begin
    /// with `x-`.
    Amqp,
    /// SQS message attributes: words run together, each capitalised.
    Sqs,
}

/// A field of the dead-letter contract.
///
/// # Examples
///
/// See [`HeaderStyle`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum DeadLetterField {
    /// Why, for a person: [`DeadLetterReason`]'s text, on one line.
    Reason,
    /// The reason's [`kind`](DeadLetterReason::kind): for a program.
    Kind,
    /// Where the message was consumed from: its topic, subject or queue.
    Source,
    /// Its partition, where the broker has partitions.
    Partition,
    /// Its place there, as the broker numbers its messages: Kafka's offset,
    /// a stream's sequence, SQS's message id.
    Position,
}

impl DeadLetterField {
    /// Every field, in the order a dead letter carries them.
    pub const ALL: [Self; 5] = [
        Self::Reason,
        Self::Kind,
        Self::Source,
        Self::Partition,
        Self::Position,
    ];

    /// The field's name in `style`, or `None` where that broker has no such
    /// thing to name.
    ///
    /// # Examples
    ///
    /// See [`HeaderStyle`].
    pub fn name(self, style: HeaderStyle) -> Option<&'static str> {
        use HeaderStyle::{Amqp, Kafka, Nats, Sqs};
        Some(match (self, style) {
            (Self::Reason, Kafka) => "dead-letter-reason",
            (Self::Reason, Nats) => "Dead-Letter-Reason",
            (Self::Reason, Amqp) => "x-dead-letter-reason",
            (Self::Reason, Sqs) => "DeadLetterReason",
            (Self::Kind, Kafka) => "dead-letter-kind",
            (Self::Kind, Nats) => "Dead-Letter-Kind",
            (Self::Kind, Amqp) => "x-dead-letter-kind",
            (Self::Kind, Sqs) => "DeadLetterKind",
            (Self::Source, Kafka) => "original-topic",
            (Self::Source, Nats) => "Original-Subject",
            (Self::Source, Amqp) => "x-original-queue",
            (Self::Source, Sqs) => "OriginalQueue",
            (Self::Partition, Kafka) => "original-partition",
            (Self::Position, Kafka) => "original-offset",
            (Self::Position, Nats) => "Original-Sequence",
            (Self::Position, Sqs) => "OriginalMessageId",
            (Self::Partition | Self::Position, _) => return None,
        })
    }

    /// Whether `header` is one of the contract's names in `style`: a
    /// message's own header of that name is not copied to its dead letter,
    /// which carries the contract's value instead.
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::message::{DeadLetterField, HeaderStyle};
    ///
    /// assert!(DeadLetterField::is_named(HeaderStyle::Kafka, "original-offset"));
    /// assert!(!DeadLetterField::is_named(HeaderStyle::Kafka, "traceparent"));
    /// ```
    pub fn is_named(style: HeaderStyle, header: &str) -> bool {
        Self::ALL
            .iter()
            .any(|field| field.name(style) == Some(header))
    }
}

/// Where a dead letter came from, as its consumer saw it.
///
/// # Examples
///
/// See [`DeadLetterReason::headers`].
#[derive(Clone, Copy, Debug)]
pub struct Origin<'a> {
    /// The topic, subject or queue it was consumed from.
    pub source: &'a str,
    /// Its partition, where the broker has partitions.
    pub partition: Option<i32>,
    /// Its place there: an offset, a stream's sequence, a message id.
    pub position: Option<&'a str>,
}

impl DeadLetterReason {
    /// The dead letter's headers, as `(name, value)` in `style`: the reason
    /// on one line (a header value holds one), its kind, and the fields of
    /// `origin` the broker can carry.
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::message::{DeadLetterReason, HeaderStyle, Origin};
    ///
    /// let reason = DeadLetterReason::invalid("line one\nline two");
    /// let origin = Origin { source: "orders", partition: Some(3), position: Some("42") };
    /// let headers = reason.headers(&origin, HeaderStyle::Kafka);
    /// assert_eq!(headers[0], ("dead-letter-reason", "not a valid message: line one line two".to_owned()));
    /// assert!(headers.contains(&("original-partition", "3".to_owned())));
    ///
    /// // RabbitMQ has no partitions, nor a position in a queue.
    /// assert_eq!(reason.headers(&origin, HeaderStyle::Amqp).len(), 3);
    /// ```
    pub fn headers(&self, origin: &Origin<'_>, style: HeaderStyle) -> Vec<(&'static str, String)> {
        DeadLetterField::ALL
            .iter()
            .filter_map(|field| {
                let value = match field {
                    DeadLetterField::Reason => Some(self.to_string().replace(['\r', '\n'], " ")),
                    DeadLetterField::Kind => Some(self.kind().to_owned()),
                    DeadLetterField::Source => Some(origin.source.to_owned()),
                    DeadLetterField::Partition => origin.partition.map(|p| p.to_string()),
                    DeadLetterField::Position => origin.position.map(str::to_owned),
                }?;
                Some((field.name(style)?, value))
            })
            .collect()
    }
}
