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
/// means the request cannot be attributed to anyone — most often because
/// the authentication middleware that sets the account runs *after* the
/// layer instead of before it. A keyed request is then refused with `500`
/// ([`RejectionKind::NoScope`](crate::RejectionKind::NoScope)), not run,
/// and the first such request is logged as an error: running it
/// unprotected is how double charges happen. An application whose
/// anonymous callers really should pass through unprotected says so with
/// [`IdempotencyLayer::pass_through_without_scope`](crate::IdempotencyLayer::pass_through_without_scope).
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
#[diagnostic::on_unimplemented(
    message = "the IdempotencyLayer's scope is not chosen: call `.scope_with(…)` or `.single_tenant()` on it",
    label = "this layer does not say whose idempotency keys these are",
    note = "`.scope_with(|parts: &Parts| parts.extensions.get::<AccountId>().map(|a| a.0.clone()))` for an API with more than one tenant (the authenticated account, set by authentication placed outside the layer), or `.single_tenant()` when every caller is the same party"
)]
pub trait ScopeExtractor: Clone + Send + Sync + 'static {
    /// The scope of this request, or `None` if it has none.
    fn scope(&self, parts: &Parts) -> Option<String>;
}

// Not named in a diagnostic: a layer whose scope is not chosen is told to
// choose one, rather than that `ScopeNotChosen` is no closure.
#[diagnostic::do_not_recommend]
impl<F> ScopeExtractor for F
where
    F: Fn(&Parts) -> Option<String> + Clone + Send + Sync + 'static,
{
    fn scope(&self, parts: &Parts) -> Option<String> {
        self(parts)
    }
}

/// One global scope, chosen with
/// [`IdempotencyLayer::single_tenant`](crate::IdempotencyLayer::single_tenant):
/// every request shares it.
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

/// A layer whose scope is not chosen yet: what
/// [`IdempotencyLayer::new`](crate::IdempotencyLayer::new) starts with. It
/// is no [`ScopeExtractor`], so such a layer cannot guard a service — the
/// compiler asks for
/// [`scope_with`](crate::IdempotencyLayer::scope_with) or
/// [`single_tenant`](crate::IdempotencyLayer::single_tenant): a forgotten
/// scope would replay one tenant's response to another.
#[derive(Clone, Copy, Debug, Default)]
pub struct ScopeNotChosen;
