//! Claiming a key: the store's six possible answers, matched once for both
//! doors.

use std::{sync::Arc, time::Duration};

use super::{Earlier, Hold};
use crate::{
    fingerprint::Fingerprint,
    observe,
    record::CompletedRecord,
    store::{Claim, StorageKey, Store, StoreError},
};

/// What a claim came to; `H`, what holds a granted one: a [`Hold`], or
/// for a claim inside a batch's transaction, what came before it.
pub(crate) enum Claimed<H> {
    /// The key is this request's: run the work under `H`.
    Granted(H),
    /// An earlier request completed the key with the same fingerprint; the
    /// store keeps its record for `expires_in` (zero: unknown).
    Completed {
        record: Arc<CompletedRecord>,
        expires_in: Duration,
    },
    /// Another request with the same fingerprint holds the key.
    InFlight { retry_after: Duration },
    /// The key was used with a different fingerprint.
    Mismatch,
    /// The store could not answer: nothing was claimed.
    Unavailable(StoreError),
}

impl<H> Claimed<H> {
    /// The same answer, a granted claim held by `hold`'s.
    fn map<I>(self, hold: impl FnOnce(H) -> I) -> Claimed<I> {
        match self {
            Self::Granted(granted) => Claimed::Granted(hold(granted)),
            Self::Completed { record, expires_in } => Claimed::Completed { record, expires_in },
            Self::InFlight { retry_after } => Claimed::InFlight { retry_after },
            Self::Mismatch => Claimed::Mismatch,
            Self::Unavailable(error) => Claimed::Unavailable(error),
        }
    }
}

/// How long a claim may wait for its turn on a store whose writers take
/// turns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Wait {
    /// The store's own bound: a client is waiting for an answer.
    Bounded,
    /// As long as it takes: a consumer keeps its delivery meanwhile.
    InLine,
}

/// Claims `key` for a request with `fingerprint`, under a lease of `lease`
/// where the store's claims are leases. A duplicate of a key in flight is
/// told to come back after `hint` at most: what a store knows is when the
/// holder's lease runs out (up to a whole lease), not when its work ends,
/// and most work ends far sooner.
pub(crate) async fn claim<St: Store>(
    store: &St,
    key: StorageKey,
    fingerprint: Fingerprint,
    lease: Duration,
    hint: Duration,
    wait: Wait,
) -> Claimed<Hold<St>> {
    let claimed = async {
        match wait {
            Wait::Bounded => store.claim(&key, &fingerprint, lease).await,
            Wait::InLine => store.claim_patiently(&key, &fingerprint, lease).await,
        }
    };
    let answer = observe::store_call("claim", claimed).await;
    read::<St, _>(answer, &key, hint).map(|(granted, earlier)| {
        Hold::new(store.clone(), key, granted, fingerprint, lease, earlier)
    })
}

/// Claims `key` inside `batch`, the open transaction of a batch of
/// claims ([`Store::claim_in_batch`]): what came before a granted claim.
pub(crate) async fn claim_in_batch<St: Store>(
    store: &St,
    batch: &mut St::Granted,
    key: &StorageKey,
    fingerprint: &Fingerprint,
    hint: Duration,
) -> Claimed<Earlier> {
    let claimed = store.claim_in_batch(batch, key, fingerprint);
    let answer = observe::store_call("claim", claimed).await;
    read::<St, ()>(answer, key, hint).map(|((), earlier)| earlier)
}

/// The store's answer to a claim, read — the one rule for every claim:
/// a granted claim with what came before it, or what was found.
fn read<St: Store, G>(
    answer: Result<Claim<G>, StoreError>,
    key: &StorageKey,
    hint: Duration,
) -> Claimed<(G, Earlier)> {
    let granted = match answer {
        // A store that reports takeovers would have said if it was one.
        Ok(Claim::Acquired(granted)) if St::REPORTS_TAKEOVERS => (granted, Earlier::None),
        Ok(Claim::Acquired(granted)) => (granted, Earlier::Unknown),
        Ok(Claim::TakenOver { granted, lapsed }) => {
            // An earlier attempt began and never completed: it may have
            // taken effect. The work is told; operators are too.
            observe::takeover();
            tracing::warn!(
                key = %key.logged_as(),
                attempts = lapsed.attempts,
                since = ?lapsed.since,
                "idempotency: claim taken over from an attempt whose lease lapsed; it may have taken effect"
            );
            (granted, Earlier::from(lapsed))
        }
        Ok(Claim::Completed { record, expires_in }) => {
            tracing::debug!(%key, "idempotency: completed before, replayed");
            return Claimed::Completed { record, expires_in };
        }
        Ok(Claim::InFlight { retry_after }) => {
            tracing::debug!(%key, "idempotency: in flight elsewhere");
            return Claimed::InFlight {
                retry_after: retry_after.min(hint),
            };
        }
        Ok(Claim::Mismatch) => {
            tracing::info!(%key, "idempotency: key reused with different parameters");
            return Claimed::Mismatch;
        }
        Err(error) => return Claimed::Unavailable(error),
    };
    Claimed::Granted(granted)
}
