//! The behaviour of the layer, case by case, generic over the store: what a
//! request gets (a replay, a rejection, an execution), what is stored and
//! what released, how concurrent duplicates and hang-ups are handled, and
//! how leases behave. `main.rs` runs every case against every store.

mod concurrency;
mod leases;
mod operations;
mod outcomes;
mod requests;
mod transactions;

use axum::Router;
use http::request::Parts;
use tower_idempotency::{DefaultFingerprint, FingerprintStrategy, IdempotencyLayer, store::Store};

pub use self::{
    concurrency::*, leases::*, operations::*, outcomes::*, requests::*, transactions::*,
};
use crate::support::{
    app::{Counter, routes},
    http::{Reply, Server, post},
};

/// Every case, in one list: `behaviour_cases!(m, args…)` expands to
/// `m!(args…; case, case, …)`.
macro_rules! behaviour_cases {
    ($run:ident $(, $($arg:tt)+)?) => {
        $run!($($($arg)+)?;
            replay_is_byte_identical,
            mismatch_on_body_path_query_and_method,
            canonical_json_variants_replay,
            query_parameter_order_is_irrelevant,
            missing_key_passes_through_unless_required,
            key_validation,
            quoted_key_is_the_bare_key,
            a_webhook_is_keyed_by_its_event_id_in_the_body,
            unguarded_methods_are_untouched,
            oversized_request_is_413_and_stores_nothing,
            scopes_are_isolated,
            scope_encoding_cannot_collide,
            non_final_responses_release_the_key,
            a_response_that_opts_out_is_sent_not_stored,
            store_all_keeps_every_status,
            a_corrected_request_executes_under_its_key_unless_client_errors_are_stored,
            handler_error_releases_the_key,
            handler_panic_releases_the_key,
            oversized_response_is_sent_and_unreplayable,
            concurrent_duplicates_execute_once,
            concurrent_duplicates_wait_and_replay,
            client_disconnect_does_not_cancel,
            dropped_response_future_still_completes,
            record_expires_after_retention,
            the_retention_is_told_when_asked,
            rejections_are_customisable,
            a_completed_key_is_inspected_and_forgotten,
            a_key_in_flight_is_not_forgotten_without_force,
            declared_fingerprint_rules_decide_what_is_the_same_request,
            rejections_link_to_the_published_policy,
        );
    };
}

/// The cases about leases, for the stores whose claims are leases (the
/// transactional stores' claims live as long as their transaction).
macro_rules! lease_cases {
    ($run:ident $(, $($arg:tt)+)?) => {
        $run!($($($arg)+)?;
            expired_lease_lets_a_retry_execute,
            heartbeat_keeps_a_slow_handler_claimed,
            fencing_refuses_a_stale_holder,
            a_key_in_flight_is_forgotten_with_force,
        );
    };
}

/// The cases about the transactional stores' claims: the handler's writes
/// and the record commit together or not at all.
macro_rules! transaction_cases {
    ($run:ident $(, $($arg:tt)+)?) => {
        $run!($($($arg)+)?;
            a_transaction_in_flight_cannot_be_forced,
            the_charge_and_the_record_commit_together_and_replay,
            concurrent_duplicates_charge_once_and_none_waits_for_the_first,
            an_answer_that_opts_out_commits_or_rolls_back_as_the_handler_chose,
            a_server_error_after_a_failed_statement_is_not_stored_and_the_retry_charges_once,
            expired_records_are_absent_at_once_and_deleted_in_batches,
        );
    };
}

pub(crate) use behaviour_cases;
pub(crate) use lease_cases;
pub(crate) use transaction_cases;

pub(crate) fn scoped<St: Store>(
    store: St,
) -> IdempotencyLayer<St, impl tower_idempotency::ScopeExtractor> {
    IdempotencyLayer::new(store).scope_with(|parts: &Parts| {
        parts
            .headers
            .get("x-account")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    })
}

pub(crate) fn app_with<St, Sc, P, F>(layer: IdempotencyLayer<St, Sc, P, F>) -> (Router, Counter)
where
    St: Store,
    Sc: tower_idempotency::ScopeExtractor,
    P: tower_idempotency::StorePolicy,
    F: FingerprintStrategy,
{
    let counter = Counter::default();
    (routes(counter.clone()).layer(layer), counter)
}

pub(crate) const CHARGE: &str = r#"{"amount":1999,"currency":"eur"}"#;

/// The fingerprint the layer computes for `post(path, key, CHARGE)`.
pub(crate) fn fingerprint_of(path: &str) -> tower_idempotency::Fingerprint {
    let (parts, _) = post(path, "k", CHARGE).into_parts();
    DefaultFingerprint::new().fingerprint(&parts, CHARGE.as_bytes())
}

/// `n` identical requests at once over HTTP.
pub(crate) async fn fire(server: &Server, n: usize, path: &str, key: &str) -> Vec<Reply> {
    let requests = (0..n).map(|_| server.post(path, key, CHARGE));
    futures_util::future::join_all(requests).await
}
