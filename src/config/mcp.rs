//! `kind = "mcp"` and `[routes.mcp]` (docs/mcp.md): a route in front of an MCP server, whose
//! `tools/call` requests are recorded tool by tool, and the operator's word on single tools.

use std::collections::BTreeMap;
use std::time::Duration;

use super::raw::{duration, RawMcp};
use super::{invalid, ConfigError, Policy, Route};
use crate::domain::PolicyVersion;

/// What a route speaks to its clients and its upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouteKind {
    /// Any HTTP API: every request on a keyed method is recorded.
    Http,
    /// MCP's Streamable HTTP transport: only `tools/call` is recorded.
    Mcp,
}

impl RouteKind {
    pub(super) fn parse(key: &str, text: Option<&str>) -> Result<RouteKind, ConfigError> {
        match text.unwrap_or("http") {
            "http" => Ok(RouteKind::Http),
            "mcp" => Ok(RouteKind::Mcp),
            other => Err(invalid(key, format!("`{other}` is not one of http, mcp"))),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            RouteKind::Http => "http",
            RouteKind::Mcp => "mcp",
        }
    }
}

/// An MCP route's own settings.
#[derive(Debug, Clone, PartialEq)]
pub struct McpSettings {
    /// How long a `tools/call` whose key is in flight waits for its outcome before it is told
    /// to come back: MCP clients send no `Prefer: wait`.
    pub in_flight_wait: Duration,
    /// The operator's word on single tools, by tool name, over what their annotations say.
    pub tools: BTreeMap<String, ToolRule>,
    /// The version of the route's retry table with replay safety on: the policy that calls to
    /// replay-safe tools run under, while the route's own is never replay-safe.
    pub replay_safe_version: PolicyVersion,
}

/// `[routes.mcp.tools."name"]`: each field unset leaves the tool's annotation to decide.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ToolRule {
    /// Record its calls (`true`) or pass them through (`false`), whatever `readOnlyHint` says.
    pub recorded: Option<bool>,
    /// May a call that possibly executed be sent again, whatever `idempotentHint` says.
    pub replay_safe: Option<bool>,
}

/// `[routes.retry] not_processed` on an MCP route when it is not set: the statuses of a
/// transport that refused the request (a bad request, a session the server does not know), then
/// the usual two.
pub(super) const MCP_NOT_PROCESSED: [i64; 4] = [400, 404, 429, 503];

/// How long a duplicate waits by default: long enough for most tools to finish, short enough
/// for an agent's own timeout.
const IN_FLIGHT_WAIT_DEFAULT: &str = "10s";

impl RawMcp {
    pub(super) fn validate(self, key: &str, replay_safe_version: PolicyVersion) -> Result<McpSettings, ConfigError> {
        let in_flight_wait =
            duration(&format!("{key}.in_flight_wait"), self.in_flight_wait.as_deref(), IN_FLIGHT_WAIT_DEFAULT)?;
        let mut tools = BTreeMap::new();
        for (name, raw) in self.tools {
            let tool_key = format!("{key}.tools.\"{name}\"");
            if name.is_empty() {
                return Err(invalid(tool_key, "a tool needs a name"));
            }
            if raw.recorded == Some(false) && raw.replay_safe.is_some() {
                return Err(invalid(
                    format!("{tool_key}.replay_safe"),
                    "says how a recorded call is retried, but this tool has recorded = false",
                ));
            }
            tools.insert(name, ToolRule { recorded: raw.recorded, replay_safe: raw.replay_safe });
        }
        Ok(McpSettings { in_flight_wait, tools, replay_safe_version })
    }
}

/// The checks only an MCP route needs: what would contradict recording tool by tool.
pub(super) fn check_mcp_route(key: &str, route: &super::raw::RawRoute) -> Result<(), ConfigError> {
    if route.replay_safe.is_some() {
        return Err(invalid(
            format!("{key}.replay_safe"),
            "an mcp route decides it per tool: by idempotentHint, or [routes.mcp.tools.\"name\"] replay_safe",
        ));
    }
    if route.methods.as_ref().is_some_and(|m| m.iter().any(|m| m != "POST")) {
        return Err(invalid(
            format!("{key}.methods"),
            "an mcp route records POSTed tools/call requests only: leave methods out, or say [\"POST\"]",
        ));
    }
    if route.canary.is_some() {
        return Err(invalid(format!("{key}.canary"), "is not supported on an mcp route"));
    }
    Ok(())
}

impl Route {
    /// The policy a recorded call runs under: the route's own, or, for a replay-safe tool on an
    /// MCP route, the same retry table with replay safety on.
    pub fn policy_with_replay_safety<'r>(&'r self, base: Policy<'r>, replay_safe: bool) -> Policy<'r> {
        match &self.mcp {
            Some(mcp) if replay_safe && !base.replay_safe => {
                Policy { retry: &self.retry, version: &mcp.replay_safe_version, replay_safe: true }
            }
            _ => base,
        }
    }
}
