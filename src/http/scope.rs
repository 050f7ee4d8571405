//! Scopes: whose key is it?
//!
//! Records are addressed by *(scope, key)*, so two tenants using the same key
//! never see each other's responses. The scope is usually the authenticated
//! account, set in the request's extensions by the authentication middleware
//! in front of the layer.
//!
//! The scope never leaves the process raw: store key names and logs carry its
//! SHA-256 (see [`StorageKey`](crate::store::StorageKey)). Still, prefer a
//! stable account id to anything derived from a credential: a rotated API key
//! would otherwise start a new scope, and its retries would execute again.

use http::request::Parts;

/// Extracts the scope of a request from its head.
///
/// Implemented for closures `Fn(&Parts) -> Option<String>`. Returning `None`
/// means the request cannot be attributed to anyone; the layer then passes it
/// through unprotected (outcome [`Bypassed`](crate::IdempotencyOutcome::Bypassed)),
/// so put authentication in front of the layer or make sure the handler
/// rejects such requests.
///
/// # Examples
///
/// ```
/// use http::request::Parts;
/// use tower_idempotency::{IdempotencyLayer, MemoryStore};
///
/// let layer = IdempotencyLayer::new(MemoryStore::new()).scope_with(|parts: &Parts| {
///     parts
///         .headers
///         .get("x-account-id")
///         .and_then(|v| v.to_str().ok())
///         .map(str::to_owned)
/// });
/// # let _ = layer;
/// ```
pub trait ScopeExtractor: Clone + Send + Sync + 'static {
    /// The scope of this request, or `None` if it has none.
    fn scope(&self, parts: &Parts) -> Option<String>;
}

impl<F> ScopeExtractor for F
where
    F: Fn(&Parts) -> Option<String> + Clone + Send + Sync + 'static,
{
    fn scope(&self, parts: &Parts) -> Option<String> {
        self(parts)
    }
}

/// The default: every request shares one global scope.
///
/// **Unsafe for multi-tenant APIs**: two clients that pick the same key would
/// receive each other's responses. Use
/// [`IdempotencyLayer::scope_with`](crate::IdempotencyLayer::scope_with)
/// whenever more than one party can call the API.
///
/// # Examples
///
/// ```
/// use tower_idempotency::{NoScope, ScopeExtractor};
///
/// let (parts, ()) = http::Request::new(()).into_parts();
/// assert_eq!(NoScope.scope(&parts).as_deref(), Some(""));
/// ```
#[derive(Clone, Copy, Debug, Default)]
pub struct NoScope;

impl ScopeExtractor for NoScope {
    fn scope(&self, _parts: &Parts) -> Option<String> {
        Some(String::new())
    }
}
