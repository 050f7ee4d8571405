//! Where an outbox keeps its messages: what the relay asks of it, whatever
//! the store.

use std::{future::Future, time::Duration};

use super::{OutboxBacklog, OutboxMessage, OutboxStats};
use crate::store::{LeaseToken, StoreError};

/// An outbox's table, as an [`OutboxRelay`](super::OutboxRelay) uses it:
/// the SQL stores' `Outbox` is one; a store of your own
/// can carry an outbox by implementing it, and relay it with the same
/// relay.
///
/// A message is pending until a relay marks it sent or refused. A relay
/// claims pending messages for a while (its claim, a [`LeaseToken`]): a
/// claimed message is left to that claim until it lapses (the relay died)
/// or is settled. What a table must keep:
///
/// - **Order.** Messages of one ordering key are claimed in the order they
///   were enqueued, and a key is held by one claim at a time: a claim
///   takes a key's *head* (its oldest pending message) only when it is due
///   and no other claim holds it, and takes the messages behind a head only
///   together with it. A message without an ordering key is a key of its
///   own.
/// - **One clock.** Claims lapse, and back-offs end, by one clock every
///   relay reads (the database's), never each relay's own.
/// - **Nothing dropped.** Only [`settle`](Self::settle) ends a pending
///   message (sent, or refused and kept), and only for the claim that holds
///   it.
///
/// # Examples
///
/// A table in memory, for a test:
///
/// ```
/// use std::{sync::{Arc, Mutex}, time::Duration};
/// use tower_idempotency::{
///     outbox::{OutboxBacklog, OutboxMessage, OutboxStats, OutboxTable, Settlement},
///     store::{LeaseToken, StoreError},
/// };
///
/// #[derive(Clone, Default)]
/// struct InMemory(Arc<Mutex<Vec<(OutboxMessage, Option<LeaseToken>, bool)>>>);
///
/// impl OutboxTable for InMemory {
///     async fn claim(&self, claim: LeaseToken, batch: u32, _: Duration) -> Result<Vec<OutboxMessage>, StoreError> {
///         let mut rows = self.0.lock().unwrap();
///         // No ordering keys here: every pending, unclaimed message.
///         Ok(rows.iter_mut()
///             .filter(|(_, held, sent)| held.is_none() && !sent)
///             .take(batch as usize)
///             .map(|(message, held, _)| { *held = Some(claim); message.clone() })
///             .collect())
///     }
///     async fn extend(&self, claim: LeaseToken, _: Duration) -> Result<u64, StoreError> {
///         // Claims never lapse here: a claim keeps what it holds.
///         let rows = self.0.lock().unwrap();
///         Ok(rows.iter().filter(|(_, held, _)| *held == Some(claim)).count() as u64)
///     }
///     async fn settle(&self, claim: LeaseToken, settled: &Settlement<'_>) -> Result<(), StoreError> {
///         for (message, held, sent) in self.0.lock().unwrap().iter_mut() {
///             if *held == Some(claim) {
///                 *held = None;
///                 *sent = settled.sent.contains(&message.id.as_str());
///             }
///         }
///         Ok(())
///     }
///     async fn sweep(&self, _: Duration, _: u32) -> Result<u64, StoreError> { Ok(0) }
///     async fn stats(&self) -> Result<OutboxStats, StoreError> { Ok(OutboxStats::default()) }
///     async fn backlog(&self, _: Duration) -> Result<OutboxBacklog, StoreError> { Ok(OutboxBacklog::default()) }
///     async fn refused(&self, _: u32) -> Result<Vec<OutboxMessage>, StoreError> { Ok(Vec::new()) }
///     async fn requeue(&self, _: &str) -> Result<bool, StoreError> { Ok(false) }
/// }
/// ```
pub trait OutboxTable: Send + Sync + 'static {
    /// Claims up to `batch` due messages for `claim`, for `claim_for` from
    /// now: due heads of their ordering keys, and behind each head as much
    /// of its key's run as the batch has room for — oldest first, each
    /// key's in the order enqueued. Each message's `attempts` counts this
    /// claim.
    fn claim(
        &self,
        claim: LeaseToken,
        batch: u32,
        claim_for: Duration,
    ) -> impl Future<Output = Result<Vec<OutboxMessage>, StoreError>> + Send;

    /// Keeps the messages `claim` holds claimed for `claim_for` more, from
    /// now — the relay's keep-alive while it publishes them: how many it
    /// still holds (a claim that lapsed and was taken by another relay
    /// holds fewer).
    fn extend(
        &self,
        claim: LeaseToken,
        claim_for: Duration,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Settles what `claim` holds: marks the messages `sent`, makes the
    /// `retried` ones due again after their back-off (keeping their error),
    /// keeps the `refused` ones for good, and gives the `released` ones
    /// back, due at once (they stood behind a message that failed). A
    /// message `claim` no longer holds (its claim lapsed and another took
    /// it) is left as it is.
    fn settle(
        &self,
        claim: LeaseToken,
        settled: &Settlement<'_>,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Deletes up to `batch` messages sent longer ago than `sent_before`;
    /// how many.
    fn sweep(
        &self,
        sent_before: Duration,
        batch: u32,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// How many messages the table holds, by state (it may read them all).
    fn stats(&self) -> impl Future<Output = Result<OutboxStats, StoreError>> + Send;

    /// What waits — pending messages and the oldest one's age, refused
    /// ones, sent ones older than `retention` — read cheaply enough to ask
    /// every few seconds.
    fn backlog(
        &self,
        retention: Duration,
    ) -> impl Future<Output = Result<OutboxBacklog, StoreError>> + Send;

    /// Up to `limit` messages refused for good, oldest first.
    fn refused(
        &self,
        limit: u32,
    ) -> impl Future<Output = Result<Vec<OutboxMessage>, StoreError>> + Send;

    /// Makes the refused message `id` pending again; whether there was one.
    fn requeue(&self, id: &str) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Resolves once a commit may have enqueued a message since it was
    /// last awaited — a commit in this process, or one the table hears of
    /// from others (PostgreSQL's `NOTIFY`) — so an idle relay wakes at once
    /// rather than at its next poll. Never resolves where nothing tells
    /// (the default): the relay polls.
    fn committed(&self) -> impl Future<Output = ()> + Send {
        std::future::pending()
    }
}

/// What a relay's round came to, for [`OutboxTable::settle`]: each claimed
/// message's id in one list.
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct Settlement<'a> {
    /// Published: mark them sent.
    pub sent: Vec<&'a str>,
    /// The broker was unavailable: due again after the back-off, with the
    /// error.
    pub retried: Vec<(&'a str, Duration, String)>,
    /// Refused for good: kept, never published, with why.
    pub refused: Vec<(&'a str, String)>,
    /// Not published, standing behind one that failed: due again at once.
    pub released: Vec<&'a str>,
}
