//! The operators' routes: look up one account's key, and forget it. Served
//! only when `ADMIN_TOKEN` is set, outside the idempotency layer, behind
//! `Authorization: Bearer <ADMIN_TOKEN>`.

use std::sync::Arc;

use axum::{
    Json, Router,
    extract::{Path, Query},
    http::{HeaderMap, StatusCode, header},
    response::{IntoResponse, Response},
    routing::get,
};
use tower_idempotency::{
    CompletedRecord, IdempotencyKey, Problem,
    store::{Forgotten, KeyState, StorageKey, Store, StoreError},
};

/// `GET` and `DELETE /admin/idempotency/{account}/{key}`.
pub fn routes<St: Store, S: Clone + Send + Sync + 'static>(
    store: St,
    token: Arc<str>,
) -> Router<S> {
    let (inspect_store, inspect_token) = (store.clone(), token.clone());
    let route = get(
        move |headers: HeaderMap, Path(path): Path<(String, String)>| {
            let (store, token) = (inspect_store.clone(), inspect_token.clone());
            async move { inspect(&store, &token, &headers, path).await }
        },
    )
    .delete(
        move |headers: HeaderMap,
              Path(path): Path<(String, String)>,
              Query(force): Query<Force>| {
            let (store, token) = (store.clone(), token.clone());
            async move { forget(&store, &token, &headers, path, force.force).await }
        },
    );
    Router::new().route("/admin/idempotency/{account}/{key}", route)
}

#[derive(serde::Deserialize)]
pub struct Force {
    #[serde(default)]
    force: bool,
}

async fn inspect<St: Store>(
    store: &St,
    token: &str,
    headers: &HeaderMap,
    (account, key): (String, String),
) -> Response {
    let key = match address(token, headers, &account, &key) {
        Ok(key) => key,
        Err(refused) => return refused.into_response(),
    };
    // The key as the layer logs it: the account only hashed.
    tracing::info!(%key, "admin: inspecting");
    match store.inspect(&key).await {
        Ok(KeyState::Absent) => nothing(),
        Ok(KeyState::InFlight { retry_after }) => Json(serde_json::json!({
            "state": "in_flight",
            "retry_after_ms": retry_after.as_millis() as u64,
        }))
        .into_response(),
        Ok(KeyState::Completed { record, expires_in }) => {
            let status = match &*record {
                CompletedRecord::Response(response) => response.status(),
                CompletedRecord::Unreplayable { status, .. } => *status,
                _ => StatusCode::OK,
            };
            Json(serde_json::json!({
                "state": "completed",
                "status": status.as_u16(),
                "expires_in_secs": expires_in.as_secs(),
            }))
            .into_response()
        }
        Err(error) => store_failed(&error),
    }
}

async fn forget<St: Store>(
    store: &St,
    token: &str,
    headers: &HeaderMap,
    (account, key): (String, String),
    force: bool,
) -> Response {
    let key = match address(token, headers, &account, &key) {
        Ok(key) => key,
        Err(refused) => return refused.into_response(),
    };
    tracing::info!(%key, force, "admin: forgetting");
    match store.forget(&key, force).await {
        Ok(Forgotten::Completed | Forgotten::ForcedInFlight) => {
            StatusCode::NO_CONTENT.into_response()
        }
        Ok(Forgotten::Nothing) => nothing(),
        Ok(Forgotten::InFlight) => problem(
            StatusCode::CONFLICT,
            "Request in flight",
            "A request with this key is running. Forgetting it anyway (?force=true) lets a retry run it a second time.",
        ),
        Err(StoreError::Unsupported(what)) => problem(
            StatusCode::CONFLICT,
            "Cannot forget this key now",
            &format!("The store does not support {what}."),
        ),
        Err(error) => store_failed(&error),
    }
}

/// The record's address, as the layer builds it (the account is the
/// scope), once the request shows `Authorization: Bearer <ADMIN_TOKEN>`.
fn address(
    token: &str,
    headers: &HeaderMap,
    account: &str,
    key: &str,
) -> Result<StorageKey, Problem> {
    let presented = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    if presented != Some(token) {
        return Err(Problem::new(StatusCode::UNAUTHORIZED, "Unauthorized")
            .detail("Send `Authorization: Bearer <ADMIN_TOKEN>`."));
    }
    // As the layer reads the header: `"k"` and `k` are one key.
    let key = IdempotencyKey::parse(key).map_err(|why| {
        Problem::new(StatusCode::BAD_REQUEST, "Invalid idempotency key").detail(why.to_string())
    })?;
    Ok(StorageKey::new(account, &key))
}

/// `path` as logs may show it: an operators' route names the account (the
/// scope), which, as the layer does, only ever appears hashed.
pub fn logged_path(path: &str) -> std::borrow::Cow<'_, str> {
    const ROUTE: &str = "/admin/idempotency/";
    let Some((account, key)) = path
        .strip_prefix(ROUTE)
        .and_then(|rest| rest.split_once('/'))
    else {
        return path.into();
    };
    // Decoded as axum's `Path` decodes them.
    let account = percent_encoding::percent_decode_str(account).decode_utf8_lossy();
    let key = percent_encoding::percent_decode_str(key).decode_utf8_lossy();
    match IdempotencyKey::parse(&key) {
        Ok(key) => format!(
            "{ROUTE}{}",
            StorageKey::new(&account, &key).as_str().replace(':', "/")
        )
        .into(),
        Err(_) => format!("{ROUTE}<account>/<invalid key>").into(),
    }
}

fn nothing() -> Response {
    problem(
        StatusCode::NOT_FOUND,
        "No such key",
        "The store holds nothing for this account and key: the next request with it executes.",
    )
}

fn store_failed(error: &StoreError) -> Response {
    tracing::error!(%error, "admin: the store failed");
    problem(
        StatusCode::SERVICE_UNAVAILABLE,
        "Store unavailable",
        "The idempotency store could not answer; try again.",
    )
}

fn problem(status: StatusCode, title: &'static str, detail: &str) -> Response {
    Problem::new(status, title)
        .detail(detail.to_owned())
        .into_response()
}
