//! The JSON-RPC error codes the door answers with. They are stable: a
//! client may act on them.
//!
//! The door's own codes are in the range JSON-RPC leaves to servers
//! (`-32000` to `-32099`), clear of those MCP defines (`-32002`, `-32020`,
//! `-32042`); the others are JSON-RPC's and MCP's own, used as they define
//! them.
//!
//! # Examples
//!
//! ```
//! use tower_idempotency::mcp::codes;
//!
//! // A client waits and re-sends the same call, with the same key.
//! fn should_retry(code: i64) -> bool {
//!     code == codes::IN_FLIGHT as i64 || code == codes::STORE_UNAVAILABLE as i64
//! }
//! assert!(should_retry(-32010));
//! assert!(!should_retry(codes::KEY_REUSED as i64));
//! ```

/// A call with this key is still running: nothing was run. Re-send the
/// same call with the same key after `error.data.retryAfterMs`
/// milliseconds (also sent as `Retry-After`).
pub const IN_FLIGHT: i32 = -32010;
/// This key was first used with another tool or other arguments: nothing
/// was run. A new call needs a new key.
pub const KEY_REUSED: i32 = -32011;
/// The idempotency store cannot be reached: nothing was run. Re-send
/// the same call after `error.data.retryAfterMs` milliseconds.
pub const STORE_UNAVAILABLE: i32 = -32012;
/// The call under this key completed, but its answer was too large to
/// keep: it will not run again, and cannot be replayed.
pub const UNREPLAYABLE: i32 = -32013;
/// JSON-RPC's invalid params: a guarded tool's key is missing or not a
/// valid key (the message says where it goes).
pub const INVALID_PARAMS: i32 = -32602;
/// JSON-RPC's invalid request: not a JSON-RPC message, a `tools/call`
/// without an id, a batch that calls a tool, or a body over the size
/// limit.
pub const INVALID_REQUEST: i32 = -32600;
/// JSON-RPC's parse error: the body is not JSON.
pub const PARSE_ERROR: i32 = -32700;
/// JSON-RPC's internal error: the server failed (no scope for the
/// caller, an unreadable answer); the key was released.
pub const INTERNAL_ERROR: i32 = -32603;
/// MCP's header mismatch: `Mcp-Method` or `Mcp-Name` disagrees with the
/// body (HTTP `400`).
pub const HEADER_MISMATCH: i32 = -32020;
