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
    sync::{Mutex, MutexGuard, PoisonError},
    time::Duration,
};

use tokio::sync::Notify;

#[derive(Debug)]
pub(crate) struct Handover<R> {
    queues: Mutex<Queues<R>>,
    /// A record pushed, or the poller gone.
    ready: Notify,
}

#[derive(Debug)]
struct Queues<R> {
    waiting: HashMap<String, VecDeque<R>>,
    /// Per lane, the records the loop took and has not answered (none:
    /// no entry).
    in_loop: HashMap<String, usize>,
    /// Lanes with records waiting and none in the loop, in the order they
    /// became so: taken first, without looking through every lane (a key
    /// per record makes as many lanes as records). An entry no longer true
    /// when it comes up is passed over.
    unheld: VecDeque<String>,
    queued: usize,
    /// The poller stopped: nothing more comes.
    closed: bool,
}

impl<R> Default for Handover<R> {
    fn default() -> Self {
        Self {
            queues: Mutex::new(Queues {
                waiting: HashMap::new(),
                in_loop: HashMap::new(),
                unheld: VecDeque::new(),
                queued: 0,
                closed: false,
            }),
            ready: Notify::new(),
        }
    }
}

impl<R> Handover<R> {
    fn queues(&self) -> MutexGuard<'_, Queues<R>> {
        self.queues.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// `record` fetched, for `lane`.
    pub(crate) fn push(&self, lane: &str, record: R) {
        let mut queues = self.queues();
        match queues.waiting.get_mut(lane) {
            Some(queue) => queue.push_back(record),
            None => {
                queues
                    .waiting
                    .insert(lane.to_owned(), VecDeque::from([record]));
                if !queues.in_loop.contains_key(lane) {
                    queues.unheld.push_back(lane.to_owned());
                }
            }
        }
        queues.queued += 1;
        drop(queues);
        self.ready.notify_one();
    }

    /// Nothing more comes: the loop takes what is left, then is told.
    pub(crate) fn close(&self) {
        self.queues().closed = true;
        self.ready.notify_one();
    }

    /// Up to `room` records, each from the lane the loop holds least of
    /// (one lane's in their order), waiting `within` for a first; `None`
    /// once closed and empty. Cancel safe: records are taken only once
    /// they are returned.
    pub(crate) async fn take(&self, room: usize, within: Duration) -> Option<Vec<R>> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            {
                let mut queues = self.queues();
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
        let mut queues = self.queues();
        if let Some(held) = queues.in_loop.get_mut(lane) {
            *held -= 1;
            if *held == 0 {
                queues.in_loop.remove(lane);
                if queues.waiting.contains_key(lane) {
                    queues.unheld.push_back(lane.to_owned());
                }
            }
        }
    }
}

impl<R> Queues<R> {
    fn take(&mut self, room: usize) -> Vec<R> {
        let mut taken = Vec::new();
        while taken.len() < room && self.queued > 0 {
            let Some(lane) = self.held_least() else {
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

    /// A lane with records waiting, of those the loop holds fewest of: one
    /// it holds none of, first come; else the least held.
    fn held_least(&mut self) -> Option<String> {
        while let Some(lane) = self.unheld.pop_front() {
            if self.waiting.contains_key(&lane) && !self.in_loop.contains_key(&lane) {
                return Some(lane);
            }
        }
        let in_loop = &self.in_loop;
        self.waiting
            .keys()
            .min_by_key(|lane| in_loop.get(*lane).copied().unwrap_or(0))
            .cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Fetched one partition's run after the other, the loop is handed
    /// each lane's first record before any lane's second.
    #[tokio::test]
    async fn the_lanes_held_least_come_first_each_in_its_order() {
        let handover = Handover::default();
        for partition in 0..3 {
            for offset in 0..3 {
                handover.push(&partition.to_string(), (partition, offset));
            }
        }
        let mut first = handover.take(3, Duration::ZERO).await.unwrap();
        first.sort_unstable();
        assert_eq!(first, [(0, 0), (1, 0), (2, 0)]);
        // Partition 1's record answered: its next comes before the others'.
        handover.answered("1");
        assert_eq!(handover.take(1, Duration::ZERO).await.unwrap(), [(1, 1)]);
        let rest = handover.take(10, Duration::ZERO).await.unwrap();
        assert_eq!(rest.len(), 5);
        for partition in 0..3 {
            let offsets: Vec<i32> = rest
                .iter()
                .filter(|(p, _)| *p == partition)
                .map(|(_, offset)| *offset)
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
        assert!(
            handover
                .take(1, Duration::from_millis(10))
                .await
                .unwrap()
                .is_empty()
        );
        handover.push("0", ());
        handover.close();
        assert_eq!(handover.take(5, Duration::ZERO).await.unwrap().len(), 1);
        assert!(handover.take(5, Duration::ZERO).await.is_none());
    }
}
