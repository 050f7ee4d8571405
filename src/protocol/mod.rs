//! The protocol both doors run: claim a key, hold the claim while the work
//! runs, settle it (store the outcome or release the key).

pub(crate) mod hold;

use std::time::Duration;

/// The longest [`IdempotencyLayer::retention`](crate::IdempotencyLayer::retention): a year. "Keep forever" is not
/// something every store can honour, and no client retries for longer.
pub const MAX_RETENTION: Duration = Duration::from_secs(365 * 24 * 60 * 60);

/// The longest [`IdempotencyLayer::lease`](crate::IdempotencyLayer::lease): a day. The lease is how long a
/// crashed process blocks its keys; the heartbeat keeps slow handlers claimed
/// whatever its length.
pub const MAX_LEASE: Duration = Duration::from_secs(24 * 60 * 60);
