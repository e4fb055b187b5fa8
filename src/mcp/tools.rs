//! Which tool calls are recorded (docs/mcp.md): each tool's annotations as the upstream's own
//! `tools/list` answers gave them to the client's session, with the operator's word
//! (`[routes.mcp.tools."name"]`) over them.

use std::collections::HashMap;
use std::sync::Mutex;

use serde_json::Value;

use crate::config::{Route, ToolRule};

/// What a tool's annotations say, as far as recording goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Annotations {
    /// `readOnlyHint: true`: the tool changes nothing, and its calls need no record.
    pub read_only: bool,
    /// `idempotentHint: true`: calling it again with the same arguments changes nothing more.
    pub idempotent: bool,
}

impl Annotations {
    /// A tool of a `tools/list` result: its name and annotations (absent hints are false, as
    /// MCP defines them for recording's purpose: side-effecting, not idempotent).
    fn of(tool: &Value) -> Option<(String, Annotations)> {
        let name = tool.get("name")?.as_str()?.to_string();
        let hint = |name: &str| tool.get("annotations").and_then(|a| a.get(name)).and_then(Value::as_bool);
        Some((
            name,
            Annotations {
                read_only: hint("readOnlyHint") == Some(true),
                idempotent: hint("idempotentHint") == Some(true),
            },
        ))
    }
}

/// What becomes of a call to a tool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ToolClass {
    /// Passed through unrecorded: a read-only tool, or one the operator says is not recorded.
    PassThrough,
    /// Recorded; `replay_safe` says whether an attempt that may have executed is sent again.
    Recorded { replay_safe: bool },
}

/// The operator's rule first, then the annotations. A tool the broker has no annotations for
/// (its session never listed tools through the broker, or listed them before a
/// `notifications/tools/list_changed`) is recorded and not replay-safe: the side that can never
/// execute a call twice.
pub(crate) fn classify(rule: Option<ToolRule>, annotations: Option<Annotations>) -> ToolClass {
    let rule = rule.unwrap_or_default();
    let annotations = annotations.unwrap_or_default();
    match rule.recorded.unwrap_or(!annotations.read_only) {
        false => ToolClass::PassThrough,
        true => ToolClass::Recorded { replay_safe: rule.replay_safe.unwrap_or(annotations.idempotent) },
    }
}

/// Sessions remembered at once: past it, one is forgotten, whose tools are then recorded by
/// default until it lists them again — never a call missed, only one recorded needlessly.
const MAX_SESSIONS: usize = 10_000;

/// Tools per session, as their `tools/list` answers passed through the broker.
#[derive(Default)]
pub(crate) struct Catalog {
    /// By route and `Mcp-Session-Id` (empty for a server that assigns none).
    sessions: Mutex<HashMap<(String, String), HashMap<String, Annotations>>>,
}

impl Catalog {
    /// Learns the tools of a `tools/list` result (one page of it: pages add up).
    pub(crate) fn learn(&self, route: &str, session: &str, result: &Value) {
        let Some(tools) = result.get("tools").and_then(Value::as_array) else { return };
        let mut sessions = lock(&self.sessions);
        let id = (route.to_string(), session.to_string());
        if !sessions.contains_key(&id) && sessions.len() >= MAX_SESSIONS {
            if let Some(evicted) = sessions.keys().next().cloned() {
                sessions.remove(&evicted);
            }
        }
        sessions.entry(id).or_default().extend(tools.iter().filter_map(Annotations::of));
    }

    /// Forgets a session's tools: they changed (`notifications/tools/list_changed`), or the
    /// session ended.
    pub(crate) fn forget(&self, route: &str, session: &str) {
        lock(&self.sessions).remove(&(route.to_string(), session.to_string()));
    }

    /// What becomes of a call to `tool` in `session` on `route`.
    pub(crate) fn class(&self, route: &Route, session: &str, tool: &str) -> ToolClass {
        let rule = route.mcp.as_ref().and_then(|mcp| mcp.tools.get(tool)).copied();
        let annotations = {
            let sessions = lock(&self.sessions);
            sessions.get(&(route.name.to_string(), session.to_string())).and_then(|tools| tools.get(tool)).copied()
        };
        classify(rule, annotations)
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const RECORDED: ToolClass = ToolClass::Recorded { replay_safe: false };
    const REPLAY_SAFE: ToolClass = ToolClass::Recorded { replay_safe: true };

    #[test]
    fn annotations_decide_unless_the_operator_says_otherwise() {
        let read_only = Annotations { read_only: true, idempotent: false };
        let idempotent = Annotations { read_only: false, idempotent: true };
        let plain = Annotations::default();
        assert_eq!(classify(None, Some(read_only)), ToolClass::PassThrough);
        assert_eq!(classify(None, Some(idempotent)), REPLAY_SAFE);
        assert_eq!(classify(None, Some(plain)), RECORDED);
        assert_eq!(classify(None, None), RECORDED, "unknown tools are recorded, never re-sent");
        let record = ToolRule { recorded: Some(true), replay_safe: None };
        assert_eq!(classify(Some(record), Some(read_only)), RECORDED);
        let skip = ToolRule { recorded: Some(false), replay_safe: None };
        assert_eq!(classify(Some(skip), Some(plain)), ToolClass::PassThrough);
        let unsafe_rule = ToolRule { recorded: None, replay_safe: Some(false) };
        assert_eq!(classify(Some(unsafe_rule), Some(idempotent)), RECORDED);
        let safe_rule = ToolRule { recorded: None, replay_safe: Some(true) };
        assert_eq!(classify(Some(safe_rule), None), REPLAY_SAFE);
    }

    #[test]
    fn a_session_learns_its_tools_page_by_page_and_forgets_them_when_they_change() {
        let config = crate::config::Config::parse_with_env(
            "[[routes]]\nname = \"tools\"\nkind = \"mcp\"\npath_prefix = \"/mcp\"\nupstream = \"http://127.0.0.1:9\"\n",
            |_| None,
        )
        .unwrap();
        let route = &config.routes[0];
        let catalog = Catalog::default();
        catalog.learn("tools", "s1", &json!({"tools": [{"name": "get", "annotations": {"readOnlyHint": true}}]}));
        catalog.learn("tools", "s1", &json!({"tools": [{"name": "set", "annotations": {"idempotentHint": true}}]}));
        assert_eq!(catalog.class(route, "s1", "get"), ToolClass::PassThrough);
        assert_eq!(catalog.class(route, "s1", "set"), REPLAY_SAFE);
        assert_eq!(catalog.class(route, "s2", "get"), RECORDED, "another session has not listed them");
        catalog.forget("tools", "s1");
        assert_eq!(catalog.class(route, "s1", "get"), RECORDED);
    }
}
