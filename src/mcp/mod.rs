//! The MCP door: an AI agent's `tools/call` runs once, however often it is
//! re-sent.
//!
//! MCP clients retry by protocol: a client whose response stream breaks
//! re-issues the request with a new JSON-RPC id, and closing the stream is
//! itself the cancellation — although the tool may already have charged
//! the card. [`McpIdempotencyLayer`] goes in front of any Streamable HTTP
//! MCP endpoint (rmcp's `StreamableHttpService`, say) and runs each keyed
//! tool call through the same protocol as the HTTP layer: the first call
//! under a key runs, its final JSON-RPC response is stored, and every retry
//! gets that response with its own id.
//!
//! - **Only `tools/call` is guarded.** It is chosen from the transport's
//!   `Mcp-Method` and `Mcp-Name` headers, so every other method
//!   (`server/discover`, `tools/list`, notifications, …) passes through
//!   unread. A request without `Mcp-Method` (a client of a protocol version
//!   before 2026-07-28) is read to find out.
//! - **The key** is `params._meta["idempotency-key"]` by default
//!   ([`key_in_meta`](McpIdempotencyLayer::key_in_meta),
//!   [`key_from_arguments`](McpIdempotencyLayer::key_from_arguments)). A tool
//!   that requires one and has none is refused with `-32602`, naming where
//!   the key goes; nothing runs.
//! - **The fingerprint** is the tool's name and its arguments (canonical
//!   JSON): never the JSON-RPC id, never `_meta`, which carry progress
//!   tokens and trace context that change on every retry.
//! - **What is stored** is the call's final response, whether the server
//!   answered `application/json` or an SSE stream (progress notifications
//!   are not part of it; a guarded call is answered `application/json`). A
//!   tool result is stored — an `isError: true` one too: a declined card is
//!   an answer. A JSON-RPC error (invalid params, an internal error) and an
//!   interim `resultType: "input_required"` result are never stored: the
//!   key is released and, on a transactional store, the tool's writes roll
//!   back.
//! - **A replay** is that response with the retry's own `id`, byte for byte
//!   the same otherwise, and the header `Idempotent-Replayed: true`.
//! - **Refusals** are JSON-RPC errors with the request's id, their codes in
//!   [`codes`].
//! - **Scopes** are the HTTP layer's: the same key under two tenants is two
//!   calls.
//! - **A client that hangs up** does not stop the call: it runs to a
//!   decision (the record commits or the key is released), and the retry
//!   with a new id gets its outcome.
//!
//! # Examples
//!
//! ```
//! use http::request::Parts;
//! use tower_idempotency::{IdempotencyLayer, MemoryStore, mcp::McpIdempotencyLayer};
//!
//! /// Put in the request's extensions by your authentication middleware.
//! #[derive(Clone)]
//! struct Account(String);
//!
//! let door = McpIdempotencyLayer::new(
//!     IdempotencyLayer::new(MemoryStore::new())
//!         .scope_with(|parts: &Parts| parts.extensions.get::<Account>().map(|a| a.0.clone())),
//! )
//! .require_key_for(["create_charge"])
//! .unguarded(["list_charges"]);
//! // axum::Router::new().nest_service("/mcp", door.layer(rmcp_streamable_http_service))
//! # let _ = door;
//! ```
//!
//! The guide: [`crate::guide::mcp`].

mod answer;
mod call;
pub mod codes;
mod decide;
mod door;
mod layer;
mod server;
mod service;

pub use layer::McpIdempotencyLayer;
pub use service::McpIdempotencyService;
