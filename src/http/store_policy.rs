//! Store policies: which responses are final and get stored.
//!
//! A stored response is replayed to every retry for the retention period; a
//! response that is not stored *releases* the key, so the client may retry it.
//! A gRPC call's outcome is its `grpc-status`, read once the body is done.

use http::{HeaderMap, StatusCode};

use crate::http::grpc::{DECODE_FAILURE, GRPC_MESSAGE, GrpcCode};

/// Decides from a response whether it is final and should be stored.
///
/// Implemented for closures `Fn(StatusCode, &HeaderMap) -> bool`. A gRPC
/// response must pass both methods: [`should_store`](Self::should_store)
/// with its HTTP status (`200` for every call that reached the server) and
/// headers, then [`should_store_grpc`](Self::should_store_grpc) with its
/// `grpc-status`.
///
/// # Examples
///
/// ```
/// use http::{HeaderMap, StatusCode};
/// use tower_idempotency::{StorePolicy, DefaultStorePolicy, IdempotencyLayer, MemoryStore};
///
/// // The default, but 500s are released too, so the client may try again.
/// let policy = DefaultStorePolicy.and(|status: StatusCode, _: &HeaderMap| {
///     status != StatusCode::INTERNAL_SERVER_ERROR
/// });
/// let layer = IdempotencyLayer::new(MemoryStore::new()).store_when(policy);
/// # let _ = layer;
/// ```
pub trait StorePolicy: Clone + Send + Sync + 'static {
    /// `true` when the response is final and must be replayed to retries.
    fn should_store(&self, status: StatusCode, headers: &HeaderMap) -> bool;

    /// `true` when a gRPC call that ended with `code` is final. `metadata`
    /// holds its trailers (or, for a call answered without a body, its
    /// headers). By default, the codes that say "nothing was done, try
    /// again" are not final — `UNAVAILABLE`, `RESOURCE_EXHAUSTED`, `ABORTED`
    /// and `DEADLINE_EXCEEDED` (see [`GrpcCode::invites_retry`]) — nor what
    /// the framework answers before any method runs: `UNIMPLEMENTED` (an
    /// unknown method, a compression the server does not accept) and
    /// tonic's `INTERNAL` for a message it could not decode ("failed to
    /// decode Protobuf message"). Every other code is final.
    ///
    /// # Examples
    ///
    /// ```
    /// use http::{HeaderMap, StatusCode};
    /// use tower_idempotency::{DefaultStorePolicy, GrpcCode, StorePolicy};
    ///
    /// /// The default, but an `INTERNAL` error releases the key too.
    /// #[derive(Clone)]
    /// struct RetryInternal;
    ///
    /// impl StorePolicy for RetryInternal {
    ///     fn should_store(&self, status: StatusCode, headers: &HeaderMap) -> bool {
    ///         DefaultStorePolicy.should_store(status, headers)
    ///     }
    ///     fn should_store_grpc(&self, code: GrpcCode, metadata: &HeaderMap) -> bool {
    ///         code != GrpcCode::INTERNAL && DefaultStorePolicy.should_store_grpc(code, metadata)
    ///     }
    /// }
    ///
    /// let metadata = HeaderMap::new();
    /// assert!(RetryInternal.should_store_grpc(GrpcCode::OK, &metadata));
    /// assert!(!RetryInternal.should_store_grpc(GrpcCode::INTERNAL, &metadata));
    /// assert!(!RetryInternal.should_store_grpc(GrpcCode::UNAVAILABLE, &metadata));
    /// ```
    fn should_store_grpc(&self, code: GrpcCode, metadata: &HeaderMap) -> bool {
        !code.invites_retry() && !framework_answer(code, metadata)
    }

    /// Whether a server error (`5xx`; gRPC's `UNKNOWN`, `UNIMPLEMENTED`,
    /// `INTERNAL`, `DATA_LOSS`) rolls back on a transactional store
    /// (default: yes). There the handler's writes commit with the record or
    /// not at all, so rolling a server error back undoes everything it did:
    /// the key is released, and the retry executes once the fault (a broken
    /// table, a lost dependency) is gone — the same on every engine,
    /// whether or not the database aborted the handler's transaction. On a
    /// store whose claims are leases, the handler's effects live elsewhere
    /// and cannot be undone, so a server error is stored like any final
    /// answer. Answer `false` to store server errors everywhere.
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::{DefaultStorePolicy, StoreAllPolicy, StorePolicy};
    ///
    /// assert!(DefaultStorePolicy.rolls_back_server_errors());
    /// assert!(!StoreAllPolicy.rolls_back_server_errors());
    /// ```
    fn rolls_back_server_errors(&self) -> bool {
        true
    }

    /// Stores only what both policies store.
    fn and<Other: StorePolicy>(self, other: Other) -> And<Self, Other> {
        And(self, other)
    }
}

/// Whether a gRPC answer is the framework's own, given before any method
/// ran: storing it would burn the key of a call that did nothing.
fn framework_answer(code: GrpcCode, metadata: &HeaderMap) -> bool {
    code == GrpcCode::UNIMPLEMENTED
        || (code == GrpcCode::INTERNAL
            && metadata
                .get(GRPC_MESSAGE)
                // grpc-message travels percent-encoded.
                .map(|m| percent_encoding::percent_decode(m.as_bytes()))
                .is_some_and(|m| m.take(DECODE_FAILURE.len()).eq(DECODE_FAILURE.bytes())))
}

impl<F> StorePolicy for F
where
    F: Fn(StatusCode, &HeaderMap) -> bool + Clone + Send + Sync + 'static,
{
    fn should_store(&self, status: StatusCode, headers: &HeaderMap) -> bool {
        self(status, headers)
    }
}

/// The default policy, Stripe's rule in outcome: an answer is stored once
/// the operation **executed**; a request refused before anything executed
/// is not, so the corrected request with the same key executes.
///
/// | status | stored? | why |
/// |---|---|---|
/// | `2xx`, `3xx` | yes | the operation's result |
/// | `402`, `404`, `409`, `410`, other `4xx` | yes | an answer produced by executing: a card declined, no such customer |
/// | `400`, `401`, `403`, `413`, `415`, `422`, `431` | **no** | refused for its parameters or credentials before anything ran: a malformed or mistyped body, a failing extractor, a webhook body the handler refuses |
/// | `408`, `425`, `429`, `502`, `503`, `504` | **no** | "nothing was done, try again" |
/// | `500` and other `5xx` | yes on a lease store; rolled back on a transactional store | see [`StorePolicy::rolls_back_server_errors`] |
///
/// gRPC calls likewise: `INVALID_ARGUMENT`, `UNAUTHENTICATED` and
/// `PERMISSION_DENIED` are not stored, nor `UNAVAILABLE`,
/// `RESOURCE_EXHAUSTED`, `ABORTED`, `DEADLINE_EXCEEDED` and the
/// framework's own answers (see [`StorePolicy::should_store_grpc`]).
///
/// Why not store `400` and `422`, as Stripe's replays suggest? Stripe saves
/// no result when parameters fail validation before the endpoint starts
/// executing. Storing them would burn the key: a typo'd JSON body rejected
/// by axum's `Json` extractor would answer the corrected retry with `422`
/// (another request under a used key), and anyone who can reach a webhook
/// route could squat an event id with a body the handler refuses, so that
/// the provider's genuine event is refused for the whole retention.
///
/// The rule assumes what HTTP says: a handler that answers `400`, `401`,
/// `403`, `413`, `415`, `422` or `431` did nothing. On a transactional
/// store that holds by construction — the answer is not final, so its
/// writes roll back. On a store whose claims are leases, a handler that
/// changes something and then answers one of these must mark the answer
/// final with a policy of its own (or answer another status).
///
/// # Examples
///
/// ```
/// use http::{HeaderMap, StatusCode};
/// use tower_idempotency::{StorePolicy, DefaultStorePolicy, IdempotencyLayer, MemoryStore};
///
/// let h = HeaderMap::new();
/// assert!(DefaultStorePolicy.should_store(StatusCode::CREATED, &h));
/// assert!(DefaultStorePolicy.should_store(StatusCode::PAYMENT_REQUIRED, &h));
/// assert!(DefaultStorePolicy.should_store(StatusCode::NOT_FOUND, &h));
/// assert!(!DefaultStorePolicy.should_store(StatusCode::BAD_REQUEST, &h));
/// assert!(!DefaultStorePolicy.should_store(StatusCode::UNPROCESSABLE_ENTITY, &h));
/// assert!(!DefaultStorePolicy.should_store(StatusCode::TOO_MANY_REQUESTS, &h));
///
/// // Store every 4xx, as a strict reading of Stripe's replays would: a
/// // client that fixes its request must then use a new key.
/// let policy = |status: StatusCode, h: &HeaderMap| {
///     status.is_client_error() || DefaultStorePolicy.should_store(status, h)
/// };
/// assert!(policy.should_store(StatusCode::BAD_REQUEST, &h));
/// let layer = IdempotencyLayer::new(MemoryStore::new()).store_when(policy);
/// # let _ = layer;
/// ```
#[derive(Clone, Copy, Debug, Default)]
pub struct DefaultStorePolicy;

impl DefaultStorePolicy {
    /// Statuses that refuse a request for its parameters or credentials,
    /// before anything ran.
    const REFUSED: [u16; 7] = [400, 401, 403, 413, 415, 422, 431];
    /// Statuses that say "nothing was done, try again".
    const TRY_AGAIN: [u16; 6] = [408, 425, 429, 502, 503, 504];
}

impl StorePolicy for DefaultStorePolicy {
    fn should_store(&self, status: StatusCode, _headers: &HeaderMap) -> bool {
        let status = status.as_u16();
        !Self::REFUSED.contains(&status) && !Self::TRY_AGAIN.contains(&status)
    }

    fn should_store_grpc(&self, code: GrpcCode, metadata: &HeaderMap) -> bool {
        let refused = [
            GrpcCode::INVALID_ARGUMENT,
            GrpcCode::UNAUTHENTICATED,
            GrpcCode::PERMISSION_DENIED,
        ];
        !refused.contains(&code) && !code.invites_retry() && !framework_answer(code, metadata)
    }
}

/// Stripe's behaviour: store every response, whatever its status (gRPC's
/// included), server errors on a transactional store too.
///
/// # Examples
///
/// ```
/// use tower_idempotency::{IdempotencyLayer, MemoryStore, StoreAllPolicy};
///
/// let layer = IdempotencyLayer::new(MemoryStore::new()).store_when(StoreAllPolicy);
/// # let _ = layer;
/// ```
#[derive(Clone, Copy, Debug, Default)]
pub struct StoreAllPolicy;

impl StorePolicy for StoreAllPolicy {
    fn should_store(&self, _status: StatusCode, _headers: &HeaderMap) -> bool {
        true
    }

    fn should_store_grpc(&self, _code: GrpcCode, _metadata: &HeaderMap) -> bool {
        true
    }

    fn rolls_back_server_errors(&self) -> bool {
        false
    }
}

/// Two policies that must both agree; see [`StorePolicy::and`].
#[derive(Clone, Copy, Debug, Default)]
pub struct And<A, B>(A, B);

impl<A: StorePolicy, B: StorePolicy> StorePolicy for And<A, B> {
    fn should_store(&self, status: StatusCode, headers: &HeaderMap) -> bool {
        self.0.should_store(status, headers) && self.1.should_store(status, headers)
    }

    fn should_store_grpc(&self, code: GrpcCode, metadata: &HeaderMap) -> bool {
        self.0.should_store_grpc(code, metadata) && self.1.should_store_grpc(code, metadata)
    }

    fn rolls_back_server_errors(&self) -> bool {
        self.0.rolls_back_server_errors() || self.1.rolls_back_server_errors()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(raw: &'static str) -> HeaderMap {
        HeaderMap::from_iter([(GRPC_MESSAGE, http::HeaderValue::from_static(raw))])
    }

    #[test]
    fn the_frameworks_decode_failure_is_not_stored_however_it_is_encoded() {
        let policy = DefaultStorePolicy;
        for raw in [
            "failed to decode Protobuf message: buffer underflow",
            "failed%20to%20decode%20Protobuf%20message%3A%20buffer%20underflow",
        ] {
            assert!(
                !policy.should_store_grpc(GrpcCode::INTERNAL, &message(raw)),
                "{raw}"
            );
        }
        // A method's own INTERNAL is its outcome.
        assert!(policy.should_store_grpc(GrpcCode::INTERNAL, &message("ledger%20corrupt")));
        assert!(policy.should_store_grpc(GrpcCode::INTERNAL, &HeaderMap::new()));
        assert!(!policy.should_store_grpc(GrpcCode::UNIMPLEMENTED, &HeaderMap::new()));
    }
}
