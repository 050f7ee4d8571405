//! Records fetched, waiting to be taken by the consumer loop: one queue
//! per lane (the loop's ordering key — a partition, or a record key in
//! it), the loop handed first the lanes it holds least of.
//!
//! librdkafka fetches a partition in runs: taken in fetch order, the
//! deliveries the loop keeps in hand would be one partition's (one key's),
//! each waiting for the one before it, while every other lane waits behind
//! them.

use std::{
    collections::{HashMap, VecDeque},
    sync::Mutex,
    time::Duration,
};

use tokio::sync::Notify;

use crate::{KafkaRecord, lock};

#[derive(Debug, Default)]
pub(crate) struct Handover {
    queues: Mutex<Queues>,
    /// A record pushed, or the poller gone.
    ready: Notify,
}

#[derive(Debug, Default)]
struct Queues {
    waiting: HashMap<String, VecDeque<KafkaRecord>>,
    /// Per lane, the records the loop took and has not answered.
    in_loop: HashMap<String, usize>,
    queued: usize,
    /// The poller stopped: nothing more comes.
    closed: bool,
}

impl Handover {
    /// `record` fetched, for its lane.
    pub(crate) fn push(&self, record: KafkaRecord) {
        let mut queues = lock(&self.queues);
        queues
            .waiting
            .entry(record.lane.clone())
            .or_default()
            .push_back(record);
        queues.queued += 1;
        drop(queues);
        self.ready.notify_one();
    }

    /// Nothing more comes: the loop takes what is left, then is told.
    pub(crate) fn close(&self) {
        lock(&self.queues).closed = true;
        self.ready.notify_one();
    }

    /// Up to `room` records, each from the lane the loop holds least of
    /// (one lane's in their order), waiting `within` for a first; `None`
    /// once closed and empty. Cancel safe: records are taken only once
    /// they are returned.
    pub(crate) async fn take(&self, room: usize, within: Duration) -> Option<Vec<KafkaRecord>> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            {
                let mut queues = lock(&self.queues);
                if queues.queued > 0 {
                    return Some(queues.take(room));
                }
                if queues.closed {
                    return None;
                }
            }
            // A push between the look and the wait leaves its permit.
            if tokio::time::timeout_at(deadline, self.ready.notified())
                .await
                .is_err()
            {
                return Some(Vec::new());
            }
        }
    }

    /// A record of `lane` the loop took is answered.
    pub(crate) fn answered(&self, lane: &str) {
        let mut queues = lock(&self.queues);
        if let Some(held) = queues.in_loop.get_mut(lane) {
            *held -= 1;
            if *held == 0 {
                queues.in_loop.remove(lane);
            }
        }
    }
}

impl Queues {
    fn take(&mut self, room: usize) -> Vec<KafkaRecord> {
        let mut taken = Vec::new();
        while taken.len() < room && self.queued > 0 {
            let in_loop = &self.in_loop;
            let Some(lane) = self
                .waiting
                .keys()
                .min_by_key(|lane| in_loop.get(*lane).copied().unwrap_or(0))
                .cloned()
            else {
                break;
            };
            let queue = self.waiting.get_mut(&lane).expect("a lane just found");
            let record = queue.pop_front().expect("lanes kept are not empty");
            if queue.is_empty() {
                self.waiting.remove(&lane);
            }
            self.queued -= 1;
            *self.in_loop.entry(lane).or_default() += 1;
            taken.push(record);
        }
        taken
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicI64;

    use rdkafka::{Message, Timestamp, message::OwnedMessage};

    use super::*;
    use crate::{NOT_WRITTEN, Position};

    fn record(partition: i32, offset: i64) -> KafkaRecord {
        KafkaRecord {
            message: OwnedMessage::new(
                None,
                None,
                "t".into(),
                Timestamp::NotAvailable,
                partition,
                offset,
                None,
            ),
            lane: partition.to_string(),
            position: Position {
                consumer: "c".into(),
                topic: "t".into(),
                partition,
                next: offset + 1,
            },
            generation: 1,
            written: AtomicI64::new(NOT_WRITTEN),
        }
    }

    fn taken(records: &[KafkaRecord]) -> Vec<(i32, i64)> {
        records
            .iter()
            .map(|r| (r.message.partition(), r.message.offset()))
            .collect()
    }

    /// Fetched one partition's run after the other, the loop is handed
    /// each lane's first record before any lane's second.
    #[tokio::test]
    async fn the_lanes_held_least_come_first_each_in_its_order() {
        let handover = Handover::default();
        for partition in 0..3 {
            for offset in 0..3 {
                handover.push(record(partition, offset));
            }
        }
        let first = handover.take(3, Duration::ZERO).await.unwrap();
        let mut lanes: Vec<i32> = first.iter().map(|r| r.message.partition()).collect();
        lanes.sort_unstable();
        assert_eq!(lanes, [0, 1, 2], "{:?}", taken(&first));
        assert!(first.iter().all(|r| r.message.offset() == 0));
        // Partition 1's record answered: its next comes before the others'.
        handover.answered("1");
        let next = handover.take(1, Duration::ZERO).await.unwrap();
        assert_eq!(taken(&next), [(1, 1)]);
        let rest = handover.take(10, Duration::ZERO).await.unwrap();
        assert_eq!(rest.len(), 5);
        for partition in 0..3 {
            let offsets: Vec<i64> = rest
                .iter()
                .filter(|r| r.message.partition() == partition)
                .map(|r| r.message.offset())
                .collect();
            assert!(
                offsets.windows(2).all(|w| w[0] < w[1]),
                "in order: {offsets:?}"
            );
        }
    }

    #[tokio::test]
    async fn empty_it_waits_then_closed_it_says_so_once_drained() {
        let handover = Handover::default();
        assert_eq!(
            handover
                .take(1, Duration::from_millis(10))
                .await
                .unwrap()
                .len(),
            0
        );
        handover.push(record(0, 0));
        handover.close();
        assert_eq!(handover.take(5, Duration::ZERO).await.unwrap().len(), 1);
        assert!(handover.take(5, Duration::ZERO).await.is_none());
    }
}
