//! The MCP front (docs/mcp.md): a route of `kind = "mcp"` speaks MCP's Streamable HTTP transport
//! to its clients and to one upstream MCP server. Every message passes through, and only
//! `tools/call` is recorded, like any keyed request; the ingress does that part, with what
//! this module reads and shapes:
//!
//! - `message` — a POSTed JSON-RPC body: a `tools/call` with its tool, arguments and key, or
//!   anything else;
//! - `tools` — which tools are recorded and which are replay-safe: their annotations, observed
//!   in the upstream's `tools/list` answers per session, under the operator's rules;
//! - `answers` — a recorded call's answers in JSON-RPC: replay, in flight, key reused, unknown;
//!   and the `initialize` result with `capabilities.tools.idempotency`;
//! - `sse` — the server-sent events that carry messages, read where the broker looks at them;
//! - `proxy` — the messages that pass through unrecorded, streams included, looked at on the way.

pub(crate) mod answers;
pub(crate) mod message;
pub(crate) mod proxy;
pub(crate) mod sse;
pub(crate) mod tools;

pub use message::Incoming;
pub(crate) use message::ToolCall;
pub(crate) use tools::{Catalog, ToolClass};

/// The session header of the Streamable HTTP transport: the upstream assigns it, and it
/// travels both ways unchanged.
pub(crate) const SESSION_HEADER: &str = "mcp-session-id";

/// The `params._meta` member a client may send its key in, when it cannot set
/// `params.idempotencyKey` (SEP-3182).
pub(crate) const META_KEY: &str = "io.idem/idempotencyKey";
/// Set to `true` in `result._meta` of a replayed result.
pub(crate) const META_REPLAYED: &str = "io.idem/replayed";
/// The record an `unknown` answer is about, in `result._meta`.
pub(crate) const META_RECORD: &str = "io.idem/record";

/// The JSON-RPC error codes the broker answers with (docs/mcp.md).
pub(crate) mod codes {
    /// The body is not JSON.
    pub(crate) const PARSE_ERROR: i64 = -32700;
    /// A batch holding a `tools/call`.
    pub(crate) const INVALID_REQUEST: i64 = -32600;
    /// A `tools/call` without a tool name, or with a key that is not one; or without a key
    /// on a route that requires one and cannot derive one.
    pub(crate) const INVALID_PARAMS: i64 = -32602;
    /// The key was used before for another tool or other arguments: nothing was executed.
    pub(crate) const KEY_REUSED: i64 = -32009;
    /// The key's call is still in flight: come back after `data.retryAfterMs`.
    pub(crate) const IN_PROGRESS: i64 = -32010;
    /// Any other answer of the broker's own (overloaded, circuit open, store unavailable,
    /// deadline exceeded, result expired…): `data.type` names the problem.
    pub(crate) const BROKER_PROBLEM: i64 = -32011;
}

/// The session a request belongs to: its `Mcp-Session-Id`, or empty for a server that assigns none.
pub(crate) fn session_of(headers: &http::HeaderMap) -> &str {
    headers.get(SESSION_HEADER).and_then(|v| v.to_str().ok()).unwrap_or("")
}
