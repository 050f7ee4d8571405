//! Where a partition's stored position may stand while its records are
//! settled side by side: past the contiguous prefix of decided records,
//! never past one still undecided.

use std::{
    collections::BTreeSet,
    time::{Duration, Instant},
};

/// The records of one partition's assignment that were handed over and
/// are not decided yet, and how far the handing over went. Records come
/// from librdkafka in offset order, so every record below the first
/// undecided one is decided: that offset is the position.
#[derive(Debug, Default)]
pub(crate) struct Watermark {
    /// Handed over, not decided: in work, waiting for their lane, or
    /// given back (which keeps the position before them until the
    /// partition is sought again).
    undecided: BTreeSet<i64>,
    /// The offset after the last record handed over: the position once
    /// everything handed over is decided.
    handed_to: i64,
    /// The furthest position known committed: a write that would not
    /// pass it is left out.
    stored: i64,
    /// When a position was last taken to be stored on its own.
    taken: Option<Instant>,
}

impl Watermark {
    /// A partition sought to `from`: nothing handed over yet.
    pub(crate) fn from(from: i64) -> Self {
        Self {
            undecided: BTreeSet::new(),
            handed_to: from,
            stored: from,
            taken: None,
        }
    }

    /// The record at `offset` handed over to the loop.
    pub(crate) fn handed(&mut self, offset: i64) {
        self.undecided.insert(offset);
        self.handed_to = self.handed_to.max(offset + 1);
    }

    /// The position the work's transaction of the record at `offset`
    /// writes, where records are settled in the partition's order: where
    /// the partition stands once that record commits, the others as they
    /// are now — it commits with the record, and every record below it is
    /// decided, by that commit or before. `None` where that would not pass
    /// the position known committed, or not the record itself: a record
    /// before it is undecided — in work in the same batch, whose first
    /// record writes the position — so what is decided is stored on its
    /// own once answered (a row written by every record of a batch, each
    /// in a savepoint, costs PostgreSQL a multixact per write).
    pub(crate) fn with(&self, offset: i64) -> Option<i64> {
        let next = self
            .undecided
            .iter()
            .find(|&&other| other != offset)
            .copied()
            .unwrap_or(self.handed_to);
        (next > self.stored && next > offset).then_some(next)
    }

    /// The record at `offset` decided: its work committed, or a duplicate
    /// or a dead letter answered.
    pub(crate) fn decided(&mut self, offset: i64) {
        self.undecided.remove(&offset);
    }

    /// The position now, if it passes the one known committed.
    pub(crate) fn passing(&self) -> Option<i64> {
        let next = self.position();
        (next > self.stored).then_some(next)
    }

    /// The position to store on its own where records are settled side by
    /// side — their transactions write none, for each would wait on the
    /// position's row in turn: the position now, if it passes the one
    /// known committed, once nothing is undecided or `every` after the
    /// last one taken. Taken, it is the one `every` waits from.
    pub(crate) fn due(&mut self, now: Instant, every: Duration) -> Option<i64> {
        let next = self.passing()?;
        let waiting = self.taken.is_some_and(|taken| now < taken + every);
        if waiting && !self.idle() {
            return None;
        }
        self.taken = Some(now);
        Some(next)
    }

    /// `next` committed.
    pub(crate) fn stored(&mut self, next: i64) {
        self.stored = self.stored.max(next);
    }

    /// Where the partition stands: the first record not decided, or past
    /// everything handed over.
    pub(crate) fn position(&self) -> i64 {
        self.undecided.first().copied().unwrap_or(self.handed_to)
    }

    /// Whether a record is handed over and not decided.
    pub(crate) fn idle(&self) -> bool {
        self.undecided.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_position_never_passes_a_record_undecided() {
        let mut partition = Watermark::from(10);
        for offset in [10, 11, 12, 14] {
            partition.handed(offset);
        }
        // 12 and 14 decided while 10 is in work: the position stays at 10,
        // where it is stored already.
        assert_eq!(partition.with(12), None);
        partition.decided(12);
        assert_eq!(partition.passing(), None);
        partition.decided(14);
        assert_eq!(partition.passing(), None);
        // 10 decided: 11 is next, undecided.
        assert_eq!(partition.with(10), Some(11));
        partition.decided(10);
        assert_eq!(partition.passing(), Some(11));
        partition.stored(11);
        assert_eq!(partition.passing(), None);
        // 11 last: past everything handed over (13 was never a record).
        assert_eq!(partition.with(11), Some(15));
        partition.decided(11);
        assert_eq!(partition.passing(), Some(15));
        assert!(partition.idle());
    }

    #[test]
    fn in_order_each_record_stores_the_offset_after_it() {
        let mut partition = Watermark::from(0);
        partition.handed(0);
        assert_eq!(partition.with(0), Some(1));
        partition.handed(1);
        assert_eq!(partition.with(0), Some(1));
        partition.stored(1);
        partition.decided(0);
        assert_eq!(partition.passing(), None);
        assert_eq!(partition.with(1), Some(2));
    }

    /// A batch's records in work together: the first writes the position
    /// past itself; those behind it, whose writes could pass nothing more
    /// (the first is undecided until the batch commits), write none.
    #[test]
    fn in_a_batch_only_the_first_record_writes_the_position() {
        let mut partition = Watermark::from(0);
        for offset in 0..4 {
            partition.handed(offset);
        }
        assert_eq!(partition.with(0), Some(1));
        assert_eq!(partition.with(1), None);
        assert_eq!(partition.with(3), None);
        for offset in 0..4 {
            partition.decided(offset);
        }
        partition.stored(1);
        assert_eq!(partition.passing(), Some(4), "stored on its own");
    }

    #[test]
    fn a_record_given_back_holds_the_position_before_it() {
        let mut partition = Watermark::from(0);
        for offset in 0..3 {
            partition.handed(offset);
        }
        // 1 given back (never decided); 2 and 0 decided.
        partition.decided(2);
        assert_eq!(partition.passing(), None);
        partition.decided(0);
        assert_eq!(partition.passing(), Some(1));
        partition.stored(1);
        assert!(!partition.idle());
        assert_eq!(partition.position(), 1);
        assert_eq!(partition.with(2), None);
    }

    #[test]
    fn side_by_side_a_position_is_due_each_interval_or_once_idle() {
        let every = Duration::from_millis(100);
        let at = Instant::now();
        let mut partition = Watermark::from(0);
        for offset in 0..4 {
            partition.handed(offset);
        }
        partition.decided(0);
        assert_eq!(partition.due(at, every), Some(1));
        partition.stored(1);
        partition.decided(1);
        assert_eq!(partition.due(at, every), None, "not yet due");
        assert_eq!(partition.due(at + every, every), Some(2));
        partition.decided(3);
        assert_eq!(partition.due(at + every, every), None, "2 undecided");
        partition.decided(2);
        assert_eq!(
            partition.due(at + every, every),
            Some(4),
            "idle: due at once"
        );
    }
}
