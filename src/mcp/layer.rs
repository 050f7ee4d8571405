//! The MCP door's layer: the HTTP layer's store, scope and settings, and
//! the door's own choices — where the key is, which tools need one.

use std::{collections::HashSet, fmt, sync::Arc};

use tower_layer::Layer;

use super::{
    call::KeyPlace,
    door::{Door, Required, ToolCallFingerprint},
    service::McpIdempotencyService,
};
use crate::http::{layer::IdempotencyLayer, shared::Shared};

/// Runs each keyed MCP `tools/call` once: a tower layer in front of any
/// Streamable HTTP MCP endpoint (tested on rmcp's `StreamableHttpService`).
///
/// It is built from an [`IdempotencyLayer`], whose store, scope, store
/// policy, lease, retention, limits, in-flight wait, fail-open and
/// namespace it uses as the HTTP door does; where the key is, and which
/// tools need one, are the door's own (the layer's `header_name`,
/// `key_from_body`, `require_key` and `methods` do not apply). The HTTP
/// layer's fingerprint is not taken: a call's fingerprint is its tool and
/// arguments, so the layer given has the default fingerprint.
///
/// By default every tool is guarded, and a call is deduplicated when it
/// carries a key in `params._meta["idempotency-key"]`; name the tools that
/// must have one with [`require_key_for`](Self::require_key_for) (or
/// [`require_key`](Self::require_key) for all), and those whose calls are
/// never deduplicated (reads) with [`unguarded`](Self::unguarded).
///
/// What each call gets is in the [module docs](super).
///
/// # Examples
///
/// ```
/// use tower_idempotency::{IdempotencyLayer, MemoryStore, mcp::McpIdempotencyLayer};
///
/// let door = McpIdempotencyLayer::new(IdempotencyLayer::new(MemoryStore::new()).single_tenant())
///     .require_key_for(["create_charge", "refund"])
///     .unguarded(["list_charges"]);
/// # let _ = door;
/// ```
pub struct McpIdempotencyLayer<St, Sc, P> {
    shared: Arc<Shared<St, Sc, P, ToolCallFingerprint>>,
    door: Arc<Door>,
}

impl<St: Clone, Sc: Clone, P: Clone> McpIdempotencyLayer<St, Sc, P> {
    /// The door over `layer`'s store, scope and settings: every tool
    /// guarded, the key `params._meta["idempotency-key"]`, optional.
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore, mcp::McpIdempotencyLayer};
    ///
    /// let door = McpIdempotencyLayer::new(IdempotencyLayer::new(MemoryStore::new()).single_tenant());
    /// # let _ = door;
    /// ```
    pub fn new(layer: IdempotencyLayer<St, Sc, P>) -> Self {
        Self {
            shared: layer.into_shared(ToolCallFingerprint),
            door: Arc::new(Door {
                key: KeyPlace::Meta("idempotency-key".into()),
                require_key: Required::These(HashSet::new()),
                unguarded: HashSet::new(),
            }),
        }
    }

    fn door(&mut self) -> &mut Door {
        Arc::make_mut(&mut self.door)
    }

    /// Reads the key from another member of `params._meta` (default
    /// `"idempotency-key"`).
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore, mcp::McpIdempotencyLayer};
    ///
    /// let door = McpIdempotencyLayer::new(IdempotencyLayer::new(MemoryStore::new()).single_tenant())
    ///     .key_in_meta("com.example/idempotency-key");
    /// # let _ = door;
    /// ```
    pub fn key_in_meta(mut self, name: &str) -> Self {
        self.door().key = KeyPlace::Meta(name.into());
        self
    }

    /// Reads the key from the tool's arguments, at a JSON Pointer (RFC
    /// 6901) into `params.arguments` — a tool whose schema has an
    /// `order_id` argument, say. The key is then one of the arguments, and
    /// part of the fingerprint.
    ///
    /// # Panics
    ///
    /// If `pointer` is not a JSON Pointer (it starts with `/`).
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore, mcp::McpIdempotencyLayer};
    ///
    /// let door = McpIdempotencyLayer::new(IdempotencyLayer::new(MemoryStore::new()).single_tenant())
    ///     .key_from_arguments("/order_id");
    /// # let _ = door;
    /// ```
    pub fn key_from_arguments(mut self, pointer: &str) -> Self {
        assert!(
            pointer.starts_with('/'),
            "key_from_arguments: {pointer:?} is not a JSON Pointer; it starts with '/', as \"/order_id\""
        );
        self.door().key = KeyPlace::Argument(pointer.into());
        self
    }

    /// Whether every guarded tool refuses a call without a key (default
    /// `false`: only those named in
    /// [`require_key_for`](Self::require_key_for)).
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore, mcp::McpIdempotencyLayer};
    ///
    /// let door = McpIdempotencyLayer::new(IdempotencyLayer::new(MemoryStore::new()).single_tenant())
    ///     .require_key(true)
    ///     .unguarded(["search"]);
    /// # let _ = door;
    /// ```
    pub fn require_key(mut self, every_tool: bool) -> Self {
        self.door().require_key = if every_tool {
            Required::Every
        } else {
            Required::These(HashSet::new())
        };
        self
    }

    /// Tools whose calls must carry a key: one without is refused with
    /// `-32602`, naming where the key goes, and nothing runs.
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore, mcp::McpIdempotencyLayer};
    ///
    /// let door = McpIdempotencyLayer::new(IdempotencyLayer::new(MemoryStore::new()).single_tenant())
    ///     .require_key_for(["create_charge"]);
    /// # let _ = door;
    /// ```
    pub fn require_key_for<I>(mut self, tools: I) -> Self
    where
        I: IntoIterator,
        I::Item: Into<String>,
    {
        let door = self.door();
        match &mut door.require_key {
            Required::Every => {}
            Required::These(named) => named.extend(tools.into_iter().map(Into::into)),
        }
        self
    }

    /// Tools whose calls pass through unguarded, key or not: reads, whose
    /// retries may run again.
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore, mcp::McpIdempotencyLayer};
    ///
    /// let door = McpIdempotencyLayer::new(IdempotencyLayer::new(MemoryStore::new()).single_tenant())
    ///     .unguarded(["list_charges", "get_balance"]);
    /// # let _ = door;
    /// ```
    pub fn unguarded<I>(mut self, tools: I) -> Self
    where
        I: IntoIterator,
        I::Item: Into<String>,
    {
        self.door()
            .unguarded
            .extend(tools.into_iter().map(Into::into));
        self
    }
}

impl<St, Sc, P> McpIdempotencyLayer<St, Sc, P> {
    /// Wraps the MCP endpoint `inner`, as [`Layer::layer`] does.
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore, mcp::McpIdempotencyLayer};
    ///
    /// let endpoint = tower::service_fn(|_: http::Request<axum::body::Body>| async {
    ///     Ok::<_, std::convert::Infallible>(http::Response::new(axum::body::Body::empty()))
    /// });
    /// let door = McpIdempotencyLayer::new(IdempotencyLayer::new(MemoryStore::new()).single_tenant());
    /// let service = door.layer(endpoint);
    /// # let _ = service;
    /// ```
    pub fn layer<S>(&self, inner: S) -> McpIdempotencyService<S, St, Sc, P> {
        McpIdempotencyService::new(inner, self.shared.clone(), self.door.clone())
    }
}

impl<St, Sc, P> Clone for McpIdempotencyLayer<St, Sc, P> {
    fn clone(&self) -> Self {
        Self {
            shared: self.shared.clone(),
            door: self.door.clone(),
        }
    }
}

impl<S, St, Sc, P> Layer<S> for McpIdempotencyLayer<St, Sc, P> {
    type Service = McpIdempotencyService<S, St, Sc, P>;

    fn layer(&self, inner: S) -> Self::Service {
        McpIdempotencyLayer::layer(self, inner)
    }
}

impl<St, Sc, P> fmt::Debug for McpIdempotencyLayer<St, Sc, P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("McpIdempotencyLayer")
            .field("door", &self.door)
            .field("config", &self.shared.config)
            .finish_non_exhaustive()
    }
}
