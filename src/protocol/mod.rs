//! The protocol both doors run, whatever the store: claim a key
//! ([`claim`]), hold the claim while the work runs ([`Hold`]: heartbeats for
//! a lease, nothing to do for a transaction), then settle it — store the
//! outcome or release the key ([`Hold::finish`], [`Hold::release`]). Also
//! the one set of duration bounds and defaults both doors configure with.

mod attempt;
mod claim;
mod hold;
mod settle;

use std::time::Duration;

pub use attempt::{Attempt, Earlier};
pub(crate) use claim::{Claimed, Wait, claim, claim_in_batch};
pub(crate) use hold::Hold;
pub(crate) use settle::Finished;

/// The longest retention a layer or a message processor accepts: a year.
/// "Keep forever" is not something every store can honour, and no client
/// retries for longer.
pub const MAX_RETENTION: Duration = Duration::from_secs(365 * 24 * 60 * 60);

/// The longest lease a layer or a message processor accepts: a day. The
/// lease is how long a crashed process blocks its keys; the heartbeat keeps
/// slow work claimed whatever its length.
pub const MAX_LEASE: Duration = Duration::from_secs(24 * 60 * 60);

/// The shortest lease: heartbeats (every third of it) could not keep up
/// with less.
const MIN_LEASE: Duration = Duration::from_millis(30);

/// The shortest retention.
const MIN_RETENTION: Duration = Duration::from_secs(1);

/// The lease both doors start with: the analogue of a queue's visibility
/// timeout.
pub(crate) const DEFAULT_LEASE: Duration = Duration::from_secs(30);

/// The retention both doors start with.
pub(crate) const DEFAULT_RETENTION: Duration = Duration::from_secs(24 * 60 * 60);

/// When a duplicate of a key in flight is told to come back, at most.
pub(crate) const DEFAULT_IN_FLIGHT_HINT: Duration = Duration::from_secs(1);

/// `lease`, or a panic naming `setting` and the bound it breaks:
/// configuration mistakes fail when the layer or processor is configured,
/// never at run time.
pub(crate) fn checked_lease(lease: Duration, setting: &str) -> Duration {
    assert!(
        lease >= MIN_LEASE,
        "{setting} must be at least 30 ms (got {lease:?}): heartbeats could not keep up"
    );
    assert!(
        lease <= MAX_LEASE,
        "{setting} must be at most MAX_LEASE (24 hours), got {lease:?}: \
         a crashed process blocks its keys this long"
    );
    lease
}

/// `retention`, or a panic naming `setting` and the bound it breaks.
pub(crate) fn checked_retention(retention: Duration, setting: &str) -> Duration {
    assert!(
        retention >= MIN_RETENTION,
        "{setting} must be at least 1 s (got {retention:?})"
    );
    assert!(
        retention <= MAX_RETENTION,
        "{setting} must be at most MAX_RETENTION (365 days), got {retention:?}: \
         records cannot be kept forever; use the longest time a client may retry"
    );
    retention
}
