//! The payments service: its router, state and handlers, apart from
//! start-up so that tests can call [`app`] with `oneshot`.

use std::{env, sync::Arc, time::Duration};

use axum::{
    Json, Router,
    extract::{Request, State, rejection::JsonRejection},
    http::{StatusCode, header, request::Parts},
    middleware::{self, Next},
    response::{IntoResponse, Response},
    routing::{MethodRouter, get, post},
};
use serde::Deserialize;
use tower::ServiceBuilder;
use tower_http::{compression::CompressionLayer, timeout::TimeoutLayer, trace::TraceLayer};
use tower_idempotency::{
    Attempt, Earlier, IdempotencyLayer, IdempotencyOutcome, IdempotentTx, Problem,
    outbox::{Outbox, OutgoingMessage},
    sqlx,
    store::{
        LeaseToken, Store,
        sql::{Dialect, SqlTx, is_transient},
    },
};

use super::ledger::{Charge, Charges, Event, LedgerWrites};

/// The example's configuration, read from the environment.
pub struct Settings {
    pub bind_addr: String,
    /// `ADMIN_TOKEN`: serve the operators' routes behind it.
    pub admin_token: Option<Arc<str>>,
    /// `IDEMPOTENCY_DOCS_URL`: where the API publishes its idempotency
    /// policy, linked from every rejection.
    pub docs_url: Option<String>,
    /// How long a charge's transaction may sit idle before the database
    /// ends it (`PostgresStoreBuilder::transaction_timeout`; SQLite has
    /// no server to end it).
    #[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
    pub transaction_timeout: Duration,
    processor_latency: Duration,
    lease: Duration,
    retention: Duration,
    request_timeout: Duration,
    /// `DOWNSTREAM_KEY` (default `on`; `off` to measure the window it
    /// closes): on a lease store, each charge carries the attempt's
    /// downstream key under a unique constraint.
    downstream_key: bool,
    /// `OUTBOX_DESTINATION` (a queue URL, a subject, a queue name): each
    /// execution enqueues `charge.created` for it in the charge's
    /// transaction (a transactional SQL store only); the `outbox_relay`
    /// example publishes it.
    pub outbox_destination: Option<String>,
    /// `ANSWER_HOLD_FILE`, for fault tests: while that file exists, a
    /// charge's answer, once committed, is announced on stdout
    /// (`committed <Idempotency-Key>`) and held back 3 s — long enough to
    /// kill the instance that committed before its answer leaves.
    answer_hold: Option<std::path::PathBuf>,
}

/// How long an answer is held under [`Settings::answer_hold`].
const ANSWER_HOLD: Duration = Duration::from_secs(3);

impl Settings {
    /// The settings, or a message that names the variable to fix.
    pub fn from_env() -> Result<Self, String> {
        fn number(
            name: &str,
            default: u64,
            range: std::ops::RangeInclusive<u64>,
        ) -> Result<u64, String> {
            let Ok(v) = env::var(name) else {
                return Ok(default);
            };
            v.parse().ok().filter(|n| range.contains(n)).ok_or_else(|| {
                format!(
                    "{name} must be a whole number from {} to {}, got {v:?}",
                    range.start(),
                    range.end()
                )
            })
        }
        let max_lease_ms = tower_idempotency::MAX_LEASE.as_millis() as u64;
        let max_ttl_secs = tower_idempotency::MAX_RETENTION.as_secs();
        Ok(Self {
            bind_addr: env::var("BIND_ADDR").unwrap_or_else(|_| "127.0.0.1:3000".into()),
            admin_token: env::var("ADMIN_TOKEN")
                .ok()
                .filter(|t| !t.is_empty())
                .map(Into::into),
            docs_url: env::var("IDEMPOTENCY_DOCS_URL")
                .ok()
                .filter(|u| !u.is_empty()),
            transaction_timeout: Duration::from_millis(number(
                "IDEMPOTENCY_TX_TIMEOUT_MS",
                30_000,
                100..=86_400_000,
            )?),
            processor_latency: Duration::from_millis(number(
                "PROCESSOR_LATENCY_MS",
                0,
                0..=600_000,
            )?),
            lease: Duration::from_millis(number(
                "IDEMPOTENCY_LEASE_MS",
                30_000,
                30..=max_lease_ms,
            )?),
            retention: Duration::from_secs(number(
                "IDEMPOTENCY_TTL_SECS",
                86_400,
                1..=max_ttl_secs,
            )?),
            request_timeout: Duration::from_millis(number(
                "REQUEST_TIMEOUT_MS",
                10_000,
                1..=3_600_000,
            )?),
            downstream_key: match env::var("DOWNSTREAM_KEY").as_deref() {
                Err(_) | Ok("on") => true,
                Ok("off") => false,
                Ok(other) => {
                    return Err(format!("DOWNSTREAM_KEY must be on or off, got {other:?}"));
                }
            },
            outbox_destination: env::var("OUTBOX_DESTINATION")
                .ok()
                .filter(|d| !d.is_empty()),
            answer_hold: env::var_os("ANSWER_HOLD_FILE")
                .filter(|f| !f.is_empty())
                .map(Into::into),
        })
    }
}

/// The service, without the `/metrics` route (its recorder is global, so
/// `main` adds it once). With a transactional store the charge is written
/// in the request's transaction; with any other, on its own.
pub fn app<St>(store: St, charges: Charges, settings: &Settings) -> Router
where
    St: Store<Granted: Recording>,
{
    let create = St::Granted::create_route();
    let admin = settings
        .admin_token
        .clone()
        .map(|token| super::admin::routes(store.clone(), token));
    // The processor's webhooks: keyed by the event's id in the body, in a
    // namespace of their own — no account's name can reach their records —
    // and no bearer token (the provider calls them).
    // Only the methods the routes take are guarded: any other is the
    // router's `405`, never a claim.
    let webhooks = IdempotencyLayer::new(store.clone())
        .methods([http::Method::POST])
        .namespace("webhooks:processor")
        .single_tenant()
        .key_from_body("/id")
        .require_key(true)
        .lease(settings.lease)
        .retention(settings.retention);
    let webhooks = Router::new()
        .route(
            "/v1/webhooks/processor",
            St::Granted::webhook_route().get(list_events),
        )
        .route_layer(webhooks);
    let mut idempotency = IdempotencyLayer::new(store)
        .methods([http::Method::POST])
        .require_key(true)
        .scope_with(|parts: &Parts| parts.extensions.get::<Account>().map(|a| a.0.clone()))
        .lease(settings.lease)
        .retention(settings.retention);
    if let Some(url) = &settings.docs_url {
        idempotency = idempotency.documentation(url);
    }
    let state = AppState {
        charges,
        processor_latency: settings.processor_latency,
        downstream_key: settings.downstream_key,
    };
    Router::new()
        .route("/v1/charges", create.get(list_charges))
        // Only on routes that matched; `GET` passes through it untouched.
        .route_layer(idempotency)
        // Outside the layer: what it holds, it holds after the commit.
        .route_layer(middleware::from_fn_with_state(
            settings.answer_hold.clone(),
            hold_answer,
        ))
        // Authenticate first, so the account is the idempotency scope.
        .layer(middleware::from_fn(authenticate))
        // The operators' routes, outside both: they check `ADMIN_TOKEN`.
        .merge(admin.unwrap_or_default())
        .merge(webhooks)
        // The API's description, with the idempotency contract in it.
        .route(
            "/openapi.json",
            get(|| async { axum::Json(super::openapi::spec()) }),
        )
        // Outermost first. Whatever rewrites the body (compression) must sit
        // outside the idempotency layer: inside, a gzip body would be stored
        // and replayed to clients that never asked for gzip.
        .layer(
            ServiceBuilder::new()
                .layer(
                    TraceLayer::new_for_http()
                        .make_span_with(request_span)
                        .on_response(log_response),
                )
                .layer(CompressionLayer::new())
                .layer(middleware::map_response(empty_refusal_as_problem))
                .layer(TimeoutLayer::with_status_code(
                    StatusCode::REQUEST_TIMEOUT,
                    settings.request_timeout,
                )),
        )
        .with_state(state)
}

/// [`Settings::answer_hold`]: a first execution's answer (not a replay's),
/// announced and held while the file exists.
async fn hold_answer(
    State(file): State<Option<std::path::PathBuf>>,
    request: Request,
    next: Next,
) -> Response {
    let key = request
        .headers()
        .get("idempotency-key")
        .and_then(|k| k.to_str().ok())
        .map(str::to_owned);
    let response = next.run(request).await;
    let executed =
        response.status().is_success() && !response.headers().contains_key("idempotent-replayed");
    if let (Some(file), Some(key), true) = (file, key, executed)
        && file.exists()
    {
        {
            use std::io::Write as _;
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out, "committed {key}");
            let _ = out.flush();
        }
        tokio::time::sleep(ANSWER_HOLD).await;
    }
    response
}

/// A refusal made below the handlers with an empty body — no such route
/// (`404`), a method the route does not take (`405`), the request timeout
/// (`408`) — as `problem+json`, like every other refusal.
async fn empty_refusal_as_problem(response: Response) -> Response {
    if response.headers().contains_key(header::CONTENT_TYPE) {
        return response;
    }
    let (title, detail) = match response.status() {
        StatusCode::NOT_FOUND => ("Not found", "There is no such route."),
        StatusCode::METHOD_NOT_ALLOWED => (
            "Method not allowed",
            "The route does not take this method: see the `Allow` header.",
        ),
        StatusCode::REQUEST_TIMEOUT => (
            "Request timeout",
            "The request outlived the server's timeout. A charge still completes, detached from \
             the connection: retry it with the same idempotency key to get its answer.",
        ),
        _ => return response,
    };
    let allow = response.headers().get(header::ALLOW).cloned();
    let mut problem = problem(response.status(), title, detail);
    if let Some(allow) = allow {
        problem.headers_mut().insert(header::ALLOW, allow);
    }
    problem
}

/// The span of a request: its method and path, an operators' route's
/// account hashed as the layer hashes scopes (it may be a tenant's name).
fn request_span<B>(request: &http::Request<B>) -> tracing::Span {
    let path = super::admin::logged_path(request.uri().path());
    tracing::info_span!("request", method = %request.method(), path = %path)
}

/// One line per response, with what the idempotency layer did.
fn log_response<B>(response: &Response<B>, latency: Duration, _: &tracing::Span) {
    let outcome = response.extensions().get::<IdempotencyOutcome>();
    tracing::info!(
        status = response.status().as_u16(),
        outcome = outcome.map_or("-", IdempotencyOutcome::name),
        ?latency,
        "response"
    );
}

#[derive(Clone)]
pub struct AppState {
    charges: Charges,
    processor_latency: Duration,
    downstream_key: bool,
}

/// How a store's claim decides where the charge is written: a lease, on its
/// own; a transaction, in it.
pub trait Recording: Send + Sync + 'static {
    fn create_route() -> MethodRouter<AppState>;
    fn webhook_route() -> MethodRouter<AppState>;
}

impl Recording for LeaseToken {
    fn create_route() -> MethodRouter<AppState> {
        post(create_charge)
    }

    fn webhook_route() -> MethodRouter<AppState> {
        post(record_event)
    }
}

impl<D: Dialect> Recording for SqlTx<D>
where
    <D::Db as sqlx::Database>::Connection: LedgerWrites,
{
    fn create_route() -> MethodRouter<AppState> {
        post(create_charge_in_transaction::<D>)
    }

    fn webhook_route() -> MethodRouter<AppState> {
        post(record_event_in_transaction::<SqlTx<D>>)
    }
}

/// The authenticated account: the bearer token names it.
#[derive(Clone)]
pub(crate) struct Account(pub(crate) String);

async fn authenticate(mut request: Request, next: Next) -> Response {
    let account = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
        .filter(|token| !token.is_empty());
    match account {
        Some(token) => {
            let account = Account(token.to_owned());
            request.extensions_mut().insert(account);
            next.run(request).await
        }
        None => problem(
            StatusCode::UNAUTHORIZED,
            "Unauthorized",
            "Send `Authorization: Bearer <token>`; the token names your account.",
        ),
    }
}

#[derive(Deserialize)]
pub(crate) struct NewCharge {
    /// Any spelling of a JSON integer (`1999`, `1999.0`, `1.999e3`), read
    /// exactly — never through a float.
    amount: Box<serde_json::value::RawValue>,
    currency: String,
    description: Option<String>,
}

/// The integer a JSON number spells, exactly, if it is one within `i64`:
/// its digits scaled by its exponent, a fraction only of zeros.
fn exact_integer(number: &str) -> Option<i64> {
    let (negative, rest) = match number.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, number),
    };
    let (mantissa, exponent) = match rest.split_once(['e', 'E']) {
        Some((mantissa, exponent)) => (mantissa, exponent.parse::<i32>().ok()?),
        None => (rest, 0),
    };
    let (whole, fraction) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let digits = format!("{whole}{fraction}");
    if whole.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let scale = exponent.checked_sub(i32::try_from(fraction.len()).ok()?)?;
    let digits = digits.trim_start_matches('0');
    let kept = if scale >= 0 {
        format!("{digits}{}", "0".repeat(usize::try_from(scale).ok()?))
    } else {
        let cut = usize::try_from(-scale).ok()?;
        let (kept, dropped) = digits.split_at(digits.len().saturating_sub(cut));
        if !dropped.bytes().all(|b| b == b'0') {
            return None;
        }
        kept.to_owned()
    };
    let magnitude: i128 = if kept.is_empty() {
        0
    } else {
        kept.parse().ok()?
    };
    i64::try_from(if negative { -magnitude } else { magnitude }).ok()
}

/// Charges on its own: the charge commits, then the processor is called,
/// then the idempotency record is stored. A lease store cannot close the
/// gaps between them — a crash after the charge's commit, or a pause longer
/// than the lease, lets the retry execute again, as a takeover — so the
/// charge carries the attempt's downstream key (the same on every attempt
/// of the key) under a unique constraint, as a card processor keeps its
/// own idempotency keys: a second execution finds the first charge and
/// answers with it.
async fn create_charge(
    State(state): State<AppState>,
    axum::Extension(Account(account)): axum::Extension<Account>,
    attempt: Option<axum::Extension<Attempt>>,
    body: Result<Json<NewCharge>, JsonRejection>,
) -> Response {
    let charge = match new_charge(account, body) {
        Ok(charge) => charge,
        Err(invalid) => return invalid.into_response(),
    };
    let recorded = match attempt {
        Some(axum::Extension(attempt)) if state.downstream_key => {
            if let Earlier::TakenOver { attempts, since } = attempt.earlier() {
                // The earlier attempt may have charged: the downstream key
                // finds its charge, if it committed, instead of a second.
                tracing::warn!(
                    attempts,
                    ?since,
                    "charge: taking over a lapsed attempt; reconciling by its downstream key"
                );
            }
            state
                .charges
                .insert_once(&charge, &attempt.downstream_key())
                .await
        }
        // No key, no protection: a charge per request (or the downstream
        // key turned off, to measure the window it closes).
        _ => state.charges.insert(&charge).await.map(|()| charge.clone()),
    };
    match recorded {
        Ok(charge) => after_recording(&state, charge, Ok(())).await,
        Err(e) => after_recording(&state, charge, Err(e)).await,
    }
}

/// Where `charge.created` goes, through the charge's transaction.
pub struct Emit<D: Dialect> {
    pub outbox: Outbox<D>,
    pub destination: Arc<str>,
}

impl<D: Dialect> Clone for Emit<D> {
    fn clone(&self) -> Self {
        Self {
            outbox: self.outbox.clone(),
            destination: self.destination.clone(),
        }
    }
}

/// Charges in the request's transaction: the charge, its `charge.created`
/// (when an outbox is configured) and the idempotency record commit
/// together once this returns, or none does — a replay emits nothing.
async fn create_charge_in_transaction<D: Dialect>(
    State(state): State<AppState>,
    axum::Extension(Account(account)): axum::Extension<Account>,
    emit: Option<axum::Extension<Emit<D>>>,
    mut tx: IdempotentTx<SqlTx<D>>,
    body: Result<Json<NewCharge>, JsonRejection>,
) -> Response
where
    <D::Db as sqlx::Database>::Connection: LedgerWrites,
{
    let charge = match new_charge(account, body) {
        Ok(charge) => charge,
        Err(invalid) => return invalid.into_response(),
    };
    let recorded = tx.insert(&charge).await;
    if recorded.is_ok()
        && let Some(axum::Extension(emit)) = emit
        && let Err(error) = emit
            .outbox
            .enqueue(&mut tx, charge_created(&charge, &emit.destination))
            .await
    {
        tracing::error!(%error, "cannot enqueue charge.created");
        return problem(
            StatusCode::SERVICE_UNAVAILABLE,
            "Charge failed",
            "The charge could not be recorded; nothing was charged. Retry with the same key.",
        );
    }
    after_recording(&state, charge, recorded).await
}

/// `charge.created`, shaped as the order consumers read it (`order_id`,
/// `amount`, `currency`): the downstream service charges its ledger once
/// per charge id. Ordered per account.
fn charge_created(charge: &Charge, destination: &str) -> OutgoingMessage {
    let event = serde_json::json!({
        "type": "charge.created",
        "order_id": charge.id,
        "account": charge.account,
        "amount": charge.amount,
        "currency": charge.currency,
    });
    OutgoingMessage::new(destination, event.to_string())
        .ordering_key(charge.account.clone())
        .header("type", "charge.created")
}

/// The card processor once the charge is recorded, then `201`; or why it
/// could not be recorded.
pub(crate) async fn after_recording(
    state: &AppState,
    charge: Charge,
    recorded: Result<(), sqlx::Error>,
) -> Response {
    if let Err(e) = recorded {
        tracing::error!(error = %e, "cannot record the charge");
        return not_recorded(&e);
    }
    // The card processor (none by default: even a zero sleep waits for the
    // timer's next millisecond tick).
    if !state.processor_latency.is_zero() {
        tokio::time::sleep(state.processor_latency).await;
    }
    created(charge)
}

/// A charge that could not be recorded: see [`write_failed`].
fn not_recorded(error: &sqlx::Error) -> Response {
    write_failed(
        error,
        "Charge failed",
        "The charge could not be recorded; nothing was charged.",
    )
}

/// A write of the handler's own that failed: `503` with `Retry-After` when
/// it can pass (`is_transient`: the database busy — SQLite's `database is
/// locked` —, in conflict, or out of reach; nothing was done, and a `503`
/// is never stored, so a retry with the key executes); else `500` with
/// `title` and `detail`, the request's own failure. A transient failure
/// answered `500` would be kept by a lease store and replayed to every
/// retry, for a charge that never happened.
fn write_failed(error: &sqlx::Error, title: &'static str, detail: &str) -> Response {
    if !is_transient(error) {
        return problem(StatusCode::INTERNAL_SERVER_ERROR, title, detail);
    }
    let mut response = problem(
        StatusCode::SERVICE_UNAVAILABLE,
        "Database unavailable",
        "The database is busy or could not be reached; nothing was done. Retry with the same key.",
    );
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, http::HeaderValue::from_static("1"));
    response
}

/// A valid charge for this account, or the `400` that says what is wrong.
pub(crate) fn new_charge(
    account: String,
    body: Result<Json<NewCharge>, JsonRejection>,
) -> Result<Charge, Problem> {
    let invalid = |detail: &str| {
        Problem::new(StatusCode::BAD_REQUEST, "Invalid charge").detail(detail.to_owned())
    };
    let new = match body {
        Ok(Json(new)) => new,
        Err(rejection) => return Err(invalid(&rejection.body_text())),
    };
    let amount = match exact_integer(new.amount.get().trim()) {
        Some(amount) if amount > 0 => amount,
        _ => return Err(invalid("`amount` must be a positive integer.")),
    };
    if new.currency.len() != 3 || !new.currency.bytes().all(|b| b.is_ascii_alphabetic()) {
        return Err(invalid("`currency` must be 3 letters."));
    }
    Ok(Charge {
        id: format!("ch_{}", fastrand_id()),
        account,
        amount,
        currency: new.currency.to_ascii_lowercase(),
        description: new.description,
    })
}

fn created(charge: Charge) -> Response {
    let location = format!("/v1/charges/{}", charge.id);
    (
        StatusCode::CREATED,
        [(header::LOCATION, location)],
        Json(charge),
    )
        .into_response()
}

/// A webhook event: `{"id": string, "type": string, …}` (the layer has
/// checked the id).
#[derive(Deserialize)]
pub(crate) struct NewEvent {
    id: String,
    #[serde(rename = "type")]
    kind: Option<String>,
}

/// Records an event on its own, then answers `200 {"received": id}`.
async fn record_event(
    State(state): State<AppState>,
    body: Result<Json<NewEvent>, JsonRejection>,
) -> Response {
    let event = match new_event(body) {
        Ok(event) => event,
        Err(invalid) => return invalid.into_response(),
    };
    let recorded = state.charges.insert_event(&event).await;
    received(event, recorded)
}

/// Records an event in the request's transaction: the event and the
/// idempotency record commit together, or neither does.
pub(crate) async fn record_event_in_transaction<T>(
    mut tx: IdempotentTx<T>,
    body: Result<Json<NewEvent>, JsonRejection>,
) -> Response
where
    T: std::ops::DerefMut<Target: LedgerWrites> + Send + Sync + 'static,
{
    let event = match new_event(body) {
        Ok(event) => event,
        Err(invalid) => return invalid.into_response(),
    };
    let recorded = tx.insert_event(&event).await;
    received(event, recorded)
}

fn new_event(body: Result<Json<NewEvent>, JsonRejection>) -> Result<Event, Problem> {
    match body {
        Ok(Json(new)) => Ok(Event {
            id: new.id,
            kind: new.kind,
        }),
        Err(rejection) => {
            Err(Problem::new(StatusCode::BAD_REQUEST, "Invalid event")
                .detail(rejection.body_text()))
        }
    }
}

fn received(event: Event, recorded: Result<(), sqlx::Error>) -> Response {
    match recorded {
        Ok(()) => Json(serde_json::json!({ "received": event.id })).into_response(),
        Err(e) => {
            tracing::error!(error = %e, "cannot record the event");
            write_failed(
                &e,
                "Event not recorded",
                "The event could not be recorded; deliver it again.",
            )
        }
    }
}

async fn list_events(State(state): State<AppState>) -> Response {
    match state.charges.list_events().await {
        Ok(events) => Json(events).into_response(),
        Err(e) => {
            tracing::error!(error = %e, "cannot list events");
            problem(
                StatusCode::INTERNAL_SERVER_ERROR,
                "Listing failed",
                "The events could not be read.",
            )
        }
    }
}

async fn list_charges(
    State(state): State<AppState>,
    axum::Extension(Account(account)): axum::Extension<Account>,
) -> Response {
    match state.charges.list(&account).await {
        Ok(charges) => Json(charges).into_response(),
        Err(e) => {
            tracing::error!(error = %e, "cannot list charges");
            problem(
                StatusCode::SERVICE_UNAVAILABLE,
                "Charges unavailable",
                "Try again later.",
            )
        }
    }
}

fn fastrand_id() -> String {
    std::iter::repeat_with(fastrand::alphanumeric)
        .take(24)
        .collect()
}

fn problem(status: StatusCode, title: &'static str, detail: &str) -> Response {
    Problem::new(status, title)
        .detail(detail.to_owned())
        .into_response()
}

#[cfg(test)]
mod tests {
    use axum::body::{Body, to_bytes};
    use tower::ServiceExt;
    use tower_idempotency::MemoryStore;

    use super::*;

    fn settings() -> Settings {
        Settings {
            bind_addr: String::new(),
            admin_token: None,
            docs_url: None,
            transaction_timeout: Duration::from_secs(30),
            processor_latency: Duration::ZERO,
            lease: Duration::from_secs(30),
            retention: Duration::from_secs(86_400),
            request_timeout: Duration::from_secs(10),
            downstream_key: true,
            outbox_destination: None,
            answer_hold: None,
        }
    }

    fn memory() -> Charges {
        Charges::Memory(Arc::default())
    }

    fn charge(key: &str, body: &str) -> Request {
        Request::post("/v1/charges")
            .header("authorization", "Bearer acct_test")
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(Body::from(body.to_owned()))
            .unwrap()
    }

    async fn body(response: Response) -> axum::body::Bytes {
        to_bytes(response.into_body(), usize::MAX).await.unwrap()
    }

    /// A connection lost under the handler's own statement is an outage
    /// (`503`, retry with the key), not the charge's failure (`500`).
    #[tokio::test]
    async fn a_database_lost_mid_statement_is_a_503_and_a_refused_statement_a_500() {
        let lost = sqlx::Error::Io(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        let lost = not_recorded(&lost);
        assert_eq!(lost.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(lost.headers().contains_key(header::RETRY_AFTER));
        assert_eq!(
            lost.headers()[header::CONTENT_TYPE],
            "application/problem+json"
        );
        let exhausted = not_recorded(&sqlx::Error::PoolTimedOut);
        assert_eq!(exhausted.status(), StatusCode::SERVICE_UNAVAILABLE);
        let refused = not_recorded(&sqlx::Error::RowNotFound);
        assert_eq!(refused.status(), StatusCode::INTERNAL_SERVER_ERROR);
        // SQLite's write lock held by another connection: `database is
        // locked` is busy, never the charge's failure (a lease store would
        // keep a 500 and replay it to every retry).
        let file = std::env::temp_dir().join(format!("payments-busy-{}.db", std::process::id()));
        let url = format!("sqlite://{}?mode=rwc", file.display());
        let mut holder = <sqlx::SqliteConnection as sqlx::Connection>::connect(&url)
            .await
            .unwrap();
        sqlx::raw_sql(
            "CREATE TABLE IF NOT EXISTS t (x INTEGER); BEGIN IMMEDIATE; INSERT INTO t VALUES (1)",
        )
        .execute(&mut holder)
        .await
        .unwrap();
        let mut writer = <sqlx::SqliteConnection as sqlx::Connection>::connect(&url)
            .await
            .unwrap();
        let locked = sqlx::raw_sql("PRAGMA busy_timeout = 0; INSERT INTO t VALUES (2)")
            .execute(&mut writer)
            .await
            .unwrap_err();
        assert!(
            locked.to_string().contains("database is locked"),
            "{locked}"
        );
        assert_eq!(
            not_recorded(&locked).status(),
            StatusCode::SERVICE_UNAVAILABLE
        );
        drop((holder, writer));
        let _ = std::fs::remove_file(&file);
        // Through a store whose database is gone: the charge's own
        // statement fails on a closed pool.
        let file = std::env::temp_dir().join(format!("payments-lost-{}.db", std::process::id()));
        let url = format!("sqlite://{}", file.display());
        let store = tower_idempotency::SqliteStore::builder()
            .transactional()
            .create_table_if_missing()
            .connect(&url)
            .await
            .unwrap();
        crate::ledger::create_tables(store.pool()).await.unwrap();
        let pool = store.pool().clone();
        let charges = Charges::Sqlite(pool.clone());
        let charges_closed = Charges::Sqlite(pool.clone());
        let app = app(MemoryStore::new(), charges_closed, &settings());
        pool.close().await;
        let reply = app
            .oneshot(charge("order-lost", r#"{"amount":100,"currency":"eur"}"#))
            .await
            .unwrap();
        assert_eq!(reply.status(), StatusCode::SERVICE_UNAVAILABLE);
        drop((charges, store));
        let _ = std::fs::remove_file(&file);
    }

    #[test]
    fn amounts_are_read_exactly_in_any_spelling_of_an_integer() {
        for (text, amount) in [
            ("1999", Some(1999)),
            ("1999.0", Some(1999)),
            ("1.999e3", Some(1999)),
            ("19990E-1", Some(1999)),
            ("0.0", Some(0)),
            ("-5", Some(-5)),
            ("9223372036854775807", Some(i64::MAX)),
            ("9223372036854775808", None),
            ("9007199254740993.0", Some(9_007_199_254_740_993)),
            ("19.99", None),
            ("1e-3", None),
            ("\"1999\"", None),
        ] {
            assert_eq!(exact_integer(text), amount, "{text}");
        }
    }

    #[tokio::test]
    async fn a_retry_replays_the_charge_and_changed_parameters_are_refused() {
        let app = app(MemoryStore::new(), memory(), &settings());
        let first = app
            .clone()
            .oneshot(charge("order-1", r#"{"amount":100,"currency":"eur"}"#))
            .await
            .unwrap();
        assert_eq!(first.status(), StatusCode::CREATED);
        let first = body(first).await;

        let retry = app
            .clone()
            .oneshot(charge("order-1", r#"{ "currency": "eur", "amount": 100 }"#))
            .await
            .unwrap();
        assert_eq!(retry.headers()["idempotent-replayed"], "true");
        assert_eq!(body(retry).await, first);

        let changed = app
            .clone()
            .oneshot(charge("order-1", r#"{"amount":200,"currency":"eur"}"#))
            .await
            .unwrap();
        assert_eq!(changed.status(), StatusCode::UNPROCESSABLE_ENTITY);

        let list = Request::get("/v1/charges")
            .header("authorization", "Bearer acct_test")
            .body(Body::empty())
            .unwrap();
        let charges: serde_json::Value =
            serde_json::from_slice(&body(app.oneshot(list).await.unwrap()).await).unwrap();
        assert_eq!(charges.as_array().unwrap().len(), 1, "one execution");
    }

    #[tokio::test]
    async fn the_api_serves_its_description_without_a_token() {
        let app = app(MemoryStore::new(), memory(), &settings());
        let request = Request::get("/openapi.json").body(Body::empty()).unwrap();
        let response = app.oneshot(request).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        let spec: serde_json::Value = serde_json::from_slice(&body(response).await).unwrap();
        let post = &spec["paths"]["/v1/charges"]["post"];
        assert!(post["responses"]["409"]["headers"]["Retry-After"].is_object());
    }

    #[tokio::test]
    async fn compression_outside_the_layer_never_replays_gzip_to_a_client_that_did_not_ask() {
        let app = app(MemoryStore::new(), memory(), &settings());
        // A long description, so the response is worth compressing.
        let new = format!(
            r#"{{"amount":100,"currency":"eur","description":"{}"}}"#,
            "x".repeat(2048)
        );
        let mut gzip = charge("order-2", &new);
        gzip.headers_mut()
            .insert(header::ACCEPT_ENCODING, "gzip".parse().unwrap());
        let first = app.clone().oneshot(gzip).await.unwrap();
        assert_eq!(first.headers()[header::CONTENT_ENCODING], "gzip");

        let retry = app.oneshot(charge("order-2", &new)).await.unwrap();
        assert_eq!(retry.headers()["idempotent-replayed"], "true");
        assert!(retry.headers().get(header::CONTENT_ENCODING).is_none());
        let charge: serde_json::Value = serde_json::from_slice(&body(retry).await).unwrap();
        assert_eq!(charge["amount"], 100);
    }

    fn admin(method: &str, path: &str, token: &str) -> Request {
        Request::builder()
            .method(method)
            .uri(path)
            .header("authorization", format!("Bearer {token}"))
            .body(Body::empty())
            .unwrap()
    }

    #[tokio::test]
    async fn operators_inspect_and_forget_a_key_behind_the_admin_token() {
        let store = MemoryStore::new();
        let without = app(store.clone(), memory(), &settings());
        let path = "/admin/idempotency/acct_test/order%2D7";
        let unset = without.oneshot(admin("GET", path, "s3cret")).await.unwrap();
        assert_eq!(
            unset.status(),
            StatusCode::NOT_FOUND,
            "no ADMIN_TOKEN: no routes"
        );

        let settings = Settings {
            admin_token: Some("s3cret".into()),
            ..settings()
        };
        let app = app(store, memory(), &settings);
        let wrong = app
            .clone()
            .oneshot(admin("GET", path, "guess"))
            .await
            .unwrap();
        assert_eq!(wrong.status(), StatusCode::UNAUTHORIZED);
        let nothing = app
            .clone()
            .oneshot(admin("GET", path, "s3cret"))
            .await
            .unwrap();
        assert_eq!(nothing.status(), StatusCode::NOT_FOUND);

        let charged = app
            .clone()
            .oneshot(charge("order-7", r#"{"amount":100,"currency":"eur"}"#))
            .await
            .unwrap();
        assert_eq!(charged.status(), StatusCode::CREATED);
        let found = app
            .clone()
            .oneshot(admin("GET", path, "s3cret"))
            .await
            .unwrap();
        assert_eq!(found.status(), StatusCode::OK);
        let found: serde_json::Value = serde_json::from_slice(&body(found).await).unwrap();
        assert_eq!(found["state"], "completed");
        assert_eq!(found["status"], 201);
        assert!(found["expires_in_secs"].as_u64().unwrap() > 86_000);

        let forgot = app
            .clone()
            .oneshot(admin("DELETE", path, "s3cret"))
            .await
            .unwrap();
        assert_eq!(forgot.status(), StatusCode::NO_CONTENT);
        let gone = app
            .clone()
            .oneshot(admin("DELETE", path, "s3cret"))
            .await
            .unwrap();
        assert_eq!(gone.status(), StatusCode::NOT_FOUND);
        let again = app
            .oneshot(charge("order-7", r#"{"amount":100,"currency":"eur"}"#))
            .await
            .unwrap();
        assert!(
            again.headers().get("idempotent-replayed").is_none(),
            "executes again"
        );
    }

    #[tokio::test]
    async fn rejections_link_to_idempotency_docs_url() {
        let settings = Settings {
            docs_url: Some("https://docs.example.com/idempotency".into()),
            ..settings()
        };
        let app = app(MemoryStore::new(), memory(), &settings);
        let mut missing = charge("k", r#"{"amount":100,"currency":"eur"}"#);
        missing.headers_mut().remove("idempotency-key");
        let refused = app.oneshot(missing).await.unwrap();
        assert_eq!(refused.status(), StatusCode::BAD_REQUEST);
        assert_eq!(
            refused.headers()["link"],
            r#"<https://docs.example.com/idempotency>; rel="describedby""#
        );
    }

    /// No route, a method a route does not take, the request timeout: each
    /// a `problem+json` like every other refusal, not an empty body.
    #[tokio::test]
    async fn refusals_below_the_handlers_are_problems_too() {
        let settings = Settings {
            processor_latency: Duration::from_millis(300),
            request_timeout: Duration::from_millis(50),
            ..settings()
        };
        let app = app(MemoryStore::new(), memory(), &settings);
        let nowhere = Request::get("/v1/nowhere").body(Body::empty()).unwrap();
        let put = Request::put("/v1/charges")
            .header("authorization", "Bearer acct_test")
            .body(Body::empty())
            .unwrap();
        let slow = charge("order-slow", r#"{"amount":100,"currency":"eur"}"#);
        for (request, status) in [
            (nowhere, StatusCode::NOT_FOUND),
            (put, StatusCode::METHOD_NOT_ALLOWED),
            (slow, StatusCode::REQUEST_TIMEOUT),
        ] {
            let response = app.clone().oneshot(request).await.unwrap();
            assert_eq!(response.status(), status);
            assert_eq!(
                response.headers()[header::CONTENT_TYPE],
                "application/problem+json",
                "{status}"
            );
            if status == StatusCode::METHOD_NOT_ALLOWED {
                assert!(response.headers().contains_key(header::ALLOW));
            }
            let problem: serde_json::Value = serde_json::from_slice(&body(response).await).unwrap();
            assert_eq!(problem["status"], status.as_u16());
        }
    }

    #[tokio::test]
    async fn requests_without_credentials_are_refused_before_the_layer() {
        let mut request = charge("order-3", r#"{"amount":100,"currency":"eur"}"#);
        request.headers_mut().remove(header::AUTHORIZATION);
        let response = app(MemoryStore::new(), memory(), &settings())
            .oneshot(request)
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
        assert_eq!(
            response.headers()[header::CONTENT_TYPE],
            "application/problem+json"
        );
    }

    fn event(body: &str, signature: &str) -> Request {
        Request::post("/v1/webhooks/processor")
            .header("content-type", "application/json")
            .header("webhook-signature", signature)
            .body(Body::from(body.to_owned()))
            .unwrap()
    }

    async fn events(app: &Router) -> serde_json::Value {
        let list = Request::get("/v1/webhooks/processor")
            .body(Body::empty())
            .unwrap();
        let response = app.clone().oneshot(list).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        serde_json::from_slice(&body(response).await).unwrap()
    }

    /// An account that names itself after the webhooks' scope cannot reach
    /// their records: its charge under the event's id, then the provider's
    /// genuine event, each execute once.
    #[tokio::test]
    async fn no_account_can_take_the_webhooks_records() {
        let app = app(MemoryStore::new(), memory(), &settings());
        for token in ["webhooks:processor", ""] {
            let mut squat = charge("evt_1", r#"{"amount":100,"currency":"eur"}"#);
            squat.headers_mut().insert(
                header::AUTHORIZATION,
                format!("Bearer {token}").parse().unwrap(),
            );
            let _ = app.clone().oneshot(squat).await.unwrap();
        }
        let genuine = app
            .clone()
            .oneshot(event(r#"{"id":"evt_1","type":"charge.succeeded"}"#, "s"))
            .await
            .unwrap();
        assert_eq!(genuine.status(), StatusCode::OK);
        assert!(!genuine.headers().contains_key("idempotent-replayed"));
        assert_eq!(events(&app).await.as_array().unwrap().len(), 1);
    }

    /// A processor redelivers one event many times, concurrently and after a
    /// restart: one row, every redelivery answered with the stored answer.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_webhook_redelivered_many_times_records_its_event_once() {
        use tower_idempotency::SqliteStore;

        let dir = std::env::temp_dir().join(format!("payments-webhooks-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let url = format!("sqlite://{}", dir.join("ledger.db").display());
        let open = async || {
            let store = SqliteStore::builder()
                .transactional()
                .create_table_if_missing()
                .connect(&url)
                .await
                .unwrap();
            crate::ledger::create_tables(store.pool()).await.unwrap();
            let charges = Charges::Sqlite(store.pool().clone());
            app(store, charges, &settings())
        };
        let payload = r#"{"id":"evt_1","type":"charge.succeeded","data":{"amount":1999}}"#;
        let app1 = open().await;
        let deliveries = (0..16).map(|n| {
            let app = app1.clone();
            tokio::spawn(async move {
                loop {
                    let response = app
                        .clone()
                        .oneshot(event(payload, &format!("v1,{n}")))
                        .await
                        .unwrap();
                    if response.status() != StatusCode::CONFLICT {
                        break response;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            })
        });
        let mut replays = 0;
        for delivery in deliveries {
            let response = delivery.await.unwrap();
            assert_eq!(response.status(), StatusCode::OK);
            replays += usize::from(response.headers().contains_key("idempotent-replayed"));
            let answer: serde_json::Value = serde_json::from_slice(&body(response).await).unwrap();
            assert_eq!(answer, serde_json::json!({"received": "evt_1"}));
        }
        assert_eq!(replays, 15, "one execution, fifteen replays");
        assert_eq!(
            events(&app1).await,
            serde_json::json!([{"id": "evt_1", "type": "charge.succeeded"}])
        );
        drop(app1);

        // After a restart, a redelivery is still the stored answer.
        let app2 = open().await;
        let again = app2
            .clone()
            .oneshot(event(payload, "v1,late"))
            .await
            .unwrap();
        assert_eq!(again.status(), StatusCode::OK);
        assert!(again.headers().contains_key("idempotent-replayed"));
        let other = app2
            .clone()
            .oneshot(event(r#"{"id":"evt_1","type":"charge.refunded"}"#, "s"))
            .await
            .unwrap();
        assert_eq!(other.status(), StatusCode::UNPROCESSABLE_ENTITY);
        let no_id = app2
            .clone()
            .oneshot(event(r#"{"type":"charge.succeeded"}"#, "s"))
            .await
            .unwrap();
        assert_eq!(no_id.status(), StatusCode::BAD_REQUEST);
        assert_eq!(events(&app2).await.as_array().unwrap().len(), 1, "one row");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
