//! A handler's own "do not replay this answer": the response is sent, not
//! stored, and the key is released.

use axum_core::response::{IntoResponseParts, ResponseParts};
use http::{HeaderMap, Response, header::CACHE_CONTROL};

/// A marker a handler puts on its response (in its extensions) to say the
/// answer must not be replayed: it is sent, not stored, and the key is
/// released, so a retry with the same key runs the handler again — say, a
/// validation failure it wants re-evaluated once the client has fixed what
/// it depended on. A response with `Cache-Control: no-store` is taken the
/// same way.
///
/// It is read before the store policy
/// ([`store_when`](crate::IdempotencyLayer::store_when)): a response that
/// opts out is never stored, whatever the policy says. On a transactional
/// store the handler's writes commit without a record
/// ([`NoReplay::new`], and `Cache-Control: no-store`) or roll back
/// ([`NoReplay::rolling_back`]); a server error rolls back whatever the
/// marker says, if the policy rolls server errors back (the default). A
/// retry after writes that committed runs the handler again: opt out only
/// where running it twice is what you want.
///
/// # Examples
///
/// ```
/// use axum::{Router, http::StatusCode, routing::post};
/// use tower_idempotency::{IdempotencyLayer, MemoryStore, NoReplay};
///
/// async fn charge() -> (StatusCode, NoReplay, &'static str) {
///     // The card's issuer is still deciding: ask again, do not replay this.
///     (StatusCode::UNPROCESSABLE_ENTITY, NoReplay::new(), "try again once the card is verified")
/// }
///
/// let app: Router = Router::new()
///     .route("/charges", post(charge))
///     .layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant());
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NoReplay {
    roll_back: bool,
}

impl NoReplay {
    /// Sent, not stored; on a transactional store the handler's writes
    /// commit, without a record.
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::NoReplay;
    ///
    /// assert!(!NoReplay::new().rolls_back());
    /// ```
    pub const fn new() -> Self {
        Self { roll_back: false }
    }

    /// Sent, not stored; on a transactional store the handler's writes roll
    /// back.
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::NoReplay;
    ///
    /// assert!(NoReplay::rolling_back().rolls_back());
    /// ```
    pub const fn rolling_back() -> Self {
        Self { roll_back: true }
    }

    /// Whether a transactional store rolls the handler's writes back.
    pub const fn rolls_back(self) -> bool {
        self.roll_back
    }
}

impl IntoResponseParts for NoReplay {
    type Error = std::convert::Infallible;

    fn into_response_parts(self, mut res: ResponseParts) -> Result<ResponseParts, Self::Error> {
        res.extensions_mut().insert(self);
        Ok(res)
    }
}

/// Whether `response` opts out of being stored, and how.
pub(crate) fn of<B>(response: &Response<B>) -> Option<NoReplay> {
    if let Some(marker) = response.extensions().get::<NoReplay>() {
        return Some(*marker);
    }
    no_store(response.headers()).then(NoReplay::new)
}

/// `Cache-Control` with the `no-store` directive (tokens are
/// case-insensitive; a header may repeat).
fn no_store(headers: &HeaderMap) -> bool {
    headers
        .get_all(CACHE_CONTROL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|directive| directive.trim().eq_ignore_ascii_case("no-store"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_store_is_read_among_other_directives_in_any_case() {
        let response = |value: &'static str| {
            Response::builder()
                .header(CACHE_CONTROL, value)
                .body(())
                .unwrap()
        };
        assert_eq!(of(&response("no-store")), Some(NoReplay::new()));
        assert_eq!(of(&response("private, No-Store")), Some(NoReplay::new()));
        assert_eq!(of(&response("no-cache, max-age=0")), None);
        assert_eq!(of(&Response::new(())), None);
        let mut marked = Response::new(());
        marked.extensions_mut().insert(NoReplay::rolling_back());
        assert_eq!(of(&marked), Some(NoReplay::rolling_back()));
    }
}
