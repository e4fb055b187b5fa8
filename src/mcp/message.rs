//! A POSTed JSON-RPC body, read just far enough to route it (docs/mcp.md): a `tools/call` with
//! its tool, arguments and key, or anything else, which passes through as it came.

use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

use super::{codes, META_KEY};
use crate::domain::fingerprint::{canonical_json, Fingerprint};
use crate::domain::key::IdempotencyKey;
use crate::domain::MCP_TOOLS_CALL;

/// What a POSTed body is, for the broker.
#[derive(Debug, Clone, PartialEq)]
pub enum Incoming {
    /// A `tools/call` request: recorded unless its tool is not.
    ToolCall(ToolCall),
    /// Any other message (`initialize`, `tools/list`, a notification, a response to the server,
    /// a batch without a `tools/call`): passed through. `method` is a single request's.
    Other { method: Option<String> },
}

/// A `tools/call` request, as the broker keys and fingerprints it.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    /// The request's JSON-RPC `id`: its answer, replayed or not, carries it.
    pub id: Value,
    pub tool: String,
    /// `params.arguments`, an empty object when absent.
    pub arguments: Value,
    /// The key the client sent: `params.idempotencyKey`, else `params._meta["io.idem/idempotencyKey"]`.
    pub key: Option<IdempotencyKey>,
}

/// A body the broker answers itself, with a JSON-RPC error: never sent upstream, never recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused {
    pub code: i64,
    pub message: String,
    /// The request's `id`, when it could be read.
    pub id: Option<Value>,
}

impl Refused {
    fn new(code: i64, message: impl Into<String>, id: Option<Value>) -> Refused {
        Refused { code, message: message.into(), id }
    }
}

/// Reads a POSTed body. Not JSON: a parse error (-32700). A `tools/call` whose params the broker
/// cannot key (no tool name, a key that is not a visible-ASCII string of at most 255
/// characters): invalid params (-32602). A batch that holds a `tools/call`: invalid request
/// (-32600), since one answer cannot be recorded for several calls. Everything else, JSON the
/// broker has no business judging, passes through for the server to answer.
pub fn read(body: &[u8]) -> Result<Incoming, Refused> {
    let message: Value = serde_json::from_slice(body)
        .map_err(|e| Refused::new(codes::PARSE_ERROR, format!("Parse error: {e}"), None))?;
    match message {
        Value::Object(members) => single(members),
        Value::Array(batch) => {
            let holds_call = batch.iter().any(|m| m.get("method").and_then(Value::as_str) == Some(MCP_TOOLS_CALL));
            if holds_call {
                return Err(Refused::new(
                    codes::INVALID_REQUEST,
                    "Invalid Request: send tools/call on its own, not in a batch, so that it can be recorded",
                    None,
                ));
            }
            Ok(Incoming::Other { method: None })
        }
        _ => Ok(Incoming::Other { method: None }),
    }
}

fn single(mut members: Map<String, Value>) -> Result<Incoming, Refused> {
    let method = members.get("method").and_then(Value::as_str).map(str::to_string);
    // A notification (no id) is not a call whose answer could be replayed.
    let id = members.get("id").cloned();
    let (Some(MCP_TOOLS_CALL), Some(id)) = (method.as_deref(), id) else {
        return Ok(Incoming::Other { method });
    };
    let invalid = |why: &str| Refused::new(codes::INVALID_PARAMS, format!("Invalid params: {why}"), Some(id.clone()));
    let Some(Value::Object(mut params)) = members.remove("params") else {
        return Err(invalid("tools/call needs params with the tool's name"));
    };
    let tool = match params.get("name") {
        Some(Value::String(name)) if !name.is_empty() => name.clone(),
        _ => return Err(invalid("params.name must name the tool")),
    };
    let arguments = match params.remove("arguments") {
        None | Some(Value::Null) => Value::Object(Map::new()),
        Some(arguments) => arguments,
    };
    let sent = params.get("idempotencyKey").or_else(|| params.get("_meta").and_then(|meta| meta.get(META_KEY)));
    let key = match sent {
        None | Some(Value::Null) => None,
        Some(Value::String(text)) => Some(IdempotencyKey::parse(text).map_err(|e| invalid(&key_error(&e)))?),
        Some(_) => return Err(invalid("the idempotency key must be a string")),
    };
    Ok(Incoming::ToolCall(ToolCall { id, tool, arguments, key }))
}

fn key_error(error: &crate::domain::key::KeyError) -> String {
    match error {
        crate::domain::key::KeyError::Missing => "the idempotency key is missing".into(),
        crate::domain::key::KeyError::Invalid(why) => why.replace("Idempotency-Key", "idempotency key"),
    }
}

impl ToolCall {
    /// The arguments in canonical JSON: members sorted, no insignificant whitespace.
    pub fn canonical_arguments(&self) -> Vec<u8> {
        let text = serde_json::to_vec(&self.arguments).unwrap_or_default();
        canonical_json(&text).unwrap_or(text)
    }

    /// Tool name and canonical arguments, on `route`: the same call re-serialised, or sent with
    /// another JSON-RPC id, key or `_meta`, is the same request.
    pub fn fingerprint(&self, route: &str) -> Fingerprint {
        Fingerprint::of(route, MCP_TOOLS_CALL, &self.tool, "", Some(b"application/json"), &self.canonical_arguments())
    }

    /// The key of a call that sent none, from the route's `key_from` key (`from_sources`: an
    /// agent run's id, say): that key, the tool name and the canonical arguments, digested. The
    /// same run calling the same tool with the same arguments is one operation; another tool or
    /// other arguments in that run are others.
    pub fn derived_key(&self, from_sources: &IdempotencyKey) -> IdempotencyKey {
        let mut digest = Sha256::new();
        for part in [from_sources.as_str().as_bytes(), self.tool.as_bytes(), &self.canonical_arguments()] {
            digest.update((part.len() as u64).to_be_bytes());
            digest.update(part);
        }
        let key = format!("{}{}", crate::domain::key::DERIVED_PREFIX, hex::encode(digest.finalize()));
        IdempotencyKey::parse(&key).expect("a prefix and 64 hex digits make a valid key")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn call(body: Value) -> ToolCall {
        match read(body.to_string().as_bytes()) {
            Ok(Incoming::ToolCall(call)) => call,
            other => panic!("not a tool call: {other:?}"),
        }
    }

    #[test]
    fn the_key_is_params_idempotency_key_then_the_documented_meta_member() {
        let both = json!({"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {
            "name": "create_payment", "arguments": {"amount": 5},
            "idempotencyKey": "sep-3182", "_meta": {"io.idem/idempotencyKey": "meta"}}});
        assert_eq!(call(both).key.unwrap().as_str(), "sep-3182");
        let meta = json!({"jsonrpc": "2.0", "id": "a", "method": "tools/call", "params": {
            "name": "create_payment", "_meta": {"io.idem/idempotencyKey": "meta-1"}}});
        let meta = call(meta);
        assert_eq!(meta.key.unwrap().as_str(), "meta-1");
        assert_eq!(meta.id, json!("a"));
        assert_eq!(meta.arguments, json!({}));
        let none = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "t"}});
        assert!(call(none).key.is_none());
    }

    #[test]
    fn a_bad_key_or_a_call_without_a_tool_is_invalid_params_naming_the_id() {
        for params in [
            json!({"name": "t", "idempotencyKey": 5}),
            json!({"name": "t", "idempotencyKey": ""}),
            json!({"name": "t", "idempotencyKey": "has space"}),
            json!({"name": "t", "idempotencyKey": "x".repeat(256)}),
            json!({"arguments": {}}),
            json!({"name": ""}),
        ] {
            let body = json!({"jsonrpc": "2.0", "id": 9, "method": "tools/call", "params": params});
            let refused = read(body.to_string().as_bytes()).unwrap_err();
            assert_eq!(refused.code, codes::INVALID_PARAMS, "{params}");
            assert_eq!(refused.id, Some(json!(9)));
        }
        let no_params = json!({"jsonrpc": "2.0", "id": 9, "method": "tools/call"});
        assert_eq!(read(no_params.to_string().as_bytes()).unwrap_err().code, codes::INVALID_PARAMS);
    }

    #[test]
    fn what_is_not_a_keyed_call_passes_through_and_what_is_not_json_is_a_parse_error() {
        assert_eq!(read(b"{not json").unwrap_err().code, codes::PARSE_ERROR);
        assert_eq!(read(b"").unwrap_err().code, codes::PARSE_ERROR);
        let init = json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {}});
        assert_eq!(read(init.to_string().as_bytes()).unwrap(), Incoming::Other { method: Some("initialize".into()) });
        let note = json!({"jsonrpc": "2.0", "method": "tools/call", "params": {"name": "t"}});
        assert!(matches!(read(note.to_string().as_bytes()).unwrap(), Incoming::Other { .. }), "no id: a notification");
        assert_eq!(read(b"[]").unwrap(), Incoming::Other { method: None });
        assert_eq!(read(b"42").unwrap(), Incoming::Other { method: None });
        let batch = json!([{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "t"}}]);
        assert_eq!(read(batch.to_string().as_bytes()).unwrap_err().code, codes::INVALID_REQUEST);
    }

    #[test]
    fn the_fingerprint_is_the_tool_and_its_canonical_arguments_only() {
        let a = call(json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {
            "name": "pay", "arguments": {"b": 1, "a": [1, 2]}, "idempotencyKey": "k"}}));
        let b = call(json!({"jsonrpc": "2.0", "id": "other", "method": "tools/call", "params": {
            "name": "pay", "arguments": {"a": [1, 2], "b": 1}, "_meta": {"progressToken": 3}}}));
        assert_eq!(a.fingerprint("r"), b.fingerprint("r"));
        let other_args = call(json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {
            "name": "pay", "arguments": {"b": 2, "a": [1, 2]}}}));
        assert_ne!(a.fingerprint("r"), other_args.fingerprint("r"));
        let other_tool = call(json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {
            "name": "refund", "arguments": {"b": 1, "a": [1, 2]}}}));
        assert_ne!(a.fingerprint("r"), other_tool.fingerprint("r"));
        assert_ne!(a.fingerprint("r"), a.fingerprint("other-route"));
    }

    #[test]
    fn a_derived_key_covers_the_run_the_tool_and_the_arguments() {
        let run = IdempotencyKey::parse("derived:run-1").unwrap();
        let other_run = IdempotencyKey::parse("derived:run-2").unwrap();
        let a = call(json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {
            "name": "pay", "arguments": {"b": 1, "a": 2}}}));
        let same = call(json!({"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {
            "name": "pay", "arguments": {"a": 2, "b": 1}}}));
        let other = call(json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {
            "name": "pay", "arguments": {"a": 3, "b": 1}}}));
        assert_eq!(a.derived_key(&run), same.derived_key(&run));
        assert!(a.derived_key(&run).as_str().starts_with("derived:"));
        assert_ne!(a.derived_key(&run), other.derived_key(&run));
        assert_ne!(a.derived_key(&run), a.derived_key(&other_run));
    }
}
