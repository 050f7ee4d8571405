//! The configuration a service reads on every request, shared by the clones
//! of one service. Built by the layer; read by everything below it.

use std::{sync::Arc, time::Duration};

use http::Method;

use crate::{
    http::grpc::Wire,
    http::key_source::KeySource,
    http::observe::Throttle,
    http::outcome::{Answered, IdempotencyOutcome},
    http::rejection::{Rejection, RejectionKind, RenderRejection},
    store::SensitiveKeys,
};

/// Plain settings, read on every request.
#[derive(Clone, Debug)]
pub(crate) struct Config {
    pub(crate) methods: Vec<Method>,
    /// Paths that pass through whatever their method, e.g. gRPC streams.
    pub(crate) unguarded_paths: Vec<String>,
    /// Where keys are read: a header, or the body (a webhook's event id).
    pub(crate) key_source: KeySource,
    pub(crate) require_key: bool,
    /// Whether a keyed request without a scope passes through unprotected
    /// (else it is refused).
    pub(crate) pass_through_without_scope: bool,
    pub(crate) retention: Duration,
    /// Whether stored and replayed answers say how long they are replayed.
    pub(crate) retention_header: bool,
    /// Whether keys appear in spans and logs only hashed.
    pub(crate) sensitive_keys: Option<SensitiveKeys>,
    /// The namespace the layer's scopes live in, if it has one of its own.
    pub(crate) namespace: Option<Arc<str>>,
    pub(crate) lease: Duration,
    pub(crate) max_request_body: usize,
    pub(crate) max_stored_body: usize,
    pub(crate) in_flight_wait: Option<Duration>,
    pub(crate) fail_open: bool,
    pub(crate) unavailable_retry_after: Duration,
    /// When a duplicate of a key in flight is told to come back, at most.
    pub(crate) in_flight_retry_after: Duration,
    /// Where the API publishes its idempotency policy, for rejections.
    pub(crate) documentation: Option<Arc<str>>,
}

/// Everything a service needs, shared by the clones of one service.
#[derive(Clone)]
pub(crate) struct Shared<St, Sc, P, F> {
    pub(crate) store: St,
    pub(crate) scope: Sc,
    pub(crate) policy: P,
    pub(crate) fingerprint: F,
    pub(crate) config: Config,
    pub(crate) render: RenderRejection,
    /// Store outages are logged at most once a second, across the services
    /// the layer builds.
    pub(crate) outage_log: Arc<Throttle>,
}

impl<St, Sc, P, F> Shared<St, Sc, P, F> {
    /// The rendered rejection, with its outcome: problem+json (or what the
    /// application renders) for an HTTP caller, a status for a gRPC one.
    pub(crate) fn rejection(&self, kind: RejectionKind, wire: Wire) -> Answered {
        let mut rejection = Rejection::new(kind.clone());
        if let Some(url) = &self.config.documentation {
            rejection = rejection.documented_at(url.clone());
        }
        let response = match wire {
            Wire::Http => (self.render)(rejection),
            Wire::Grpc => rejection.into_grpc_response(),
        };
        Answered::new(response, IdempotencyOutcome::Rejected(kind))
    }
}
