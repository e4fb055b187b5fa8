//! What an agent is told about a recorded `tools/call` (docs/mcp.md), in JSON-RPC: a replay of
//! the stored result under its own request's `id`; an error for a key reused with other
//! arguments, for a call still in flight, for the broker's other problems; and, for an outcome
//! nobody knows, a tool result that says so to the model.

use serde_json::{json, Map, Value};

use super::{codes, sse, META_RECORD, META_REPLAYED};
use crate::domain::key::IdempotencyKey;
use crate::domain::{RecordId, State};
use crate::problem::Problem;

/// The stored answer to a call, replayed under `id`: the final JSON-RPC response in it (the
/// body's, or the last of a stored event stream), its `result` unchanged but for the replay
/// mark in `result._meta`. An operator's settlement may also be a bare `CallToolResult`.
/// `None` when the stored body holds no JSON-RPC response: the HTTP answer is replayed as it is.
pub(crate) fn replayed(body: &[u8], event_stream: bool, id: &Value) -> Option<Value> {
    let messages = match event_stream {
        true => sse::messages(body),
        false => vec![serde_json::from_slice::<Value>(body).ok()?],
    };
    let answers = |m: &Value| m.get("result").is_some() || m.get("error").is_some() || m.get("content").is_some();
    let last = messages.into_iter().rev().find(answers)?;
    let mut answer = match last {
        Value::Object(members) if members.contains_key("result") || members.contains_key("error") => members,
        // A settlement that is the tool's result itself.
        result @ Value::Object(_) if result.get("content").is_some() => {
            let mut members = Map::new();
            members.insert("result".into(), result);
            members
        }
        _ => return None,
    };
    answer.insert("jsonrpc".into(), json!("2.0"));
    answer.insert("id".into(), id.clone());
    if let Some(Value::Object(result)) = answer.get_mut("result") {
        let meta = result.entry("_meta").or_insert_with(|| json!({}));
        if let Value::Object(meta) = meta {
            meta.insert(META_REPLAYED.into(), json!(true));
        }
    }
    Some(Value::Object(answer))
}

/// The record a call's answer names, for an operator and for the agent's log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RecordRef {
    pub key: IdempotencyKey,
    /// The record's id, when it could be read.
    pub id: Option<RecordId>,
    pub state: Option<State>,
}

impl RecordRef {
    fn json(&self) -> Value {
        json!({
            "idempotencyKey": self.key.as_str(),
            "recordId": self.id.map(|id| id.to_string()),
            "state": self.state.map(State::as_str),
            "record": format!("/_idem/requests/{}", crate::domain::key::path_segment(self.key.as_str())),
        })
    }
}

/// The answer for a call whose outcome is `unknown`: a tool result with `isError`, whose text
/// tells the model the effect may have happened and not to repeat it blindly, and whose
/// structured content names the record an operator settles.
pub(crate) fn unknown(id: &Value, record: &RecordRef) -> Value {
    let text = format!(
        "The outcome of this tool call is unknown: it may have taken effect, or not. Do not call the tool \
         again to find out, and do not repeat it with a new idempotency key: an operator settles record {} \
         (idempotency key {}); calling again with the same key then returns its result.",
        record.id.map_or_else(|| "(id unavailable)".to_string(), |id| id.to_string()),
        record.key.as_str()
    );
    let mut structured = record.json();
    structured["problem"] = json!("urn:idem:problem:outcome-unknown");
    json!({
        "jsonrpc": "2.0",
        "id": id,
        "result": {
            "content": [{"type": "text", "text": text}],
            "isError": true,
            "structuredContent": structured,
            "_meta": {META_RECORD: record.json()},
        }
    })
}

/// The JSON-RPC error for a problem the broker answered a recorded call with.
pub(crate) fn problem(id: &Value, problem: &Problem, record: Option<&RecordRef>) -> Value {
    let code = match problem.name {
        "idempotency-key-reused" => codes::KEY_REUSED,
        "request-in-progress" => codes::IN_PROGRESS,
        "missing-idempotency-key" | "invalid-idempotency-key" => codes::INVALID_PARAMS,
        _ => codes::BROKER_PROBLEM,
    };
    let message = match problem.name {
        "idempotency-key-reused" => {
            "This idempotency key was used for a call with other arguments (or another tool); nothing was \
             executed. Use a new key for a new operation."
                .to_string()
        }
        _ => format!("{}: {}", problem.title, problem.detail),
    };
    let mut data = json!({
        "type": format!("urn:idem:problem:{}", problem.name),
        "title": problem.title,
        "detail": problem.detail,
        "retryable": problem.retryable,
    });
    if let Some(ms) = problem.retry_after_ms {
        data["retryAfterMs"] = json!(ms);
    }
    if let Some(state) = problem.idempotency_status {
        data["state"] = json!(state.as_str());
    }
    if let Some(record) = record {
        let shown = record.json();
        for member in ["idempotencyKey", "record", "recordId"] {
            if !shown[member].is_null() {
                data[member] = shown[member].clone();
            }
        }
        if data.get("state").is_none() {
            data["state"] = shown["state"].clone();
        }
    }
    error(id, code, &message, Some(data))
}

/// The message that ends a call's event stream cut after its first byte, in place of the
/// broker's `idem-error` event (whose problem document is `problem`): the call's outcome is
/// `unknown` when its tool is not replay-safe; else its key is free again, a retryable error.
pub(crate) fn cut(id: &Value, problem: &Value, record: &RecordRef, replay_safe: bool) -> Value {
    if !replay_safe {
        return unknown(id, record);
    }
    let data = json!({
        "type": problem["type"],
        "title": problem["title"],
        "detail": problem["detail"],
        "retryable": true,
        "state": "not_started",
        "idempotencyKey": record.key.as_str(),
    });
    let message =
        format!("{}: {}", problem["title"].as_str().unwrap_or("Stream cut"), problem["detail"].as_str().unwrap_or(""));
    error(id, codes::BROKER_PROBLEM, &message, Some(data))
}

/// A JSON-RPC error response.
pub(crate) fn error(id: &Value, code: i64, message: &str, data: Option<Value>) -> Value {
    let mut error = json!({"code": code, "message": message});
    if let Some(data) = data {
        error["data"] = data;
    }
    json!({"jsonrpc": "2.0", "id": id, "error": error})
}

/// Adds `capabilities.tools.idempotency` to an `initialize` result, when the server offers
/// tools at all; true if it did.
pub(crate) fn with_idempotency(message: &mut Value) -> bool {
    let tools = message.get_mut("result").and_then(|r| r.get_mut("capabilities")).and_then(|c| c.get_mut("tools"));
    match tools {
        Some(Value::Object(tools)) => {
            tools.insert("idempotency".into(), json!({"supported": true}));
            true
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(text: &str) -> IdempotencyKey {
        IdempotencyKey::parse(text).unwrap()
    }

    #[test]
    fn a_replay_is_the_stored_result_under_the_new_id_marked_as_replayed() {
        let stored = json!({"jsonrpc": "2.0", "id": 1, "result": {"content": [{"type": "text", "text": "paid"}],
            "structuredContent": {"payment": "p_1"}, "isError": false}});
        let replay = replayed(stored.to_string().as_bytes(), false, &json!("retry-2")).unwrap();
        assert_eq!(replay["id"], json!("retry-2"));
        assert_eq!(replay["result"]["_meta"][META_REPLAYED], json!(true));
        let mut without_mark = replay["result"].clone();
        without_mark.as_object_mut().unwrap().remove("_meta");
        assert_eq!(without_mark, stored["result"], "the result itself is the stored one");
    }

    #[test]
    fn a_stored_stream_replays_its_final_response_and_a_settlement_may_be_a_bare_result() {
        let stream = "data: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\",\"params\":{}}\n\n\
                      data: {\"jsonrpc\":\"2.0\",\"id\":3,\"result\":{\"content\":[],\"_meta\":{\"k\":1}}}\n\n";
        let replay = replayed(stream.as_bytes(), true, &json!(8)).unwrap();
        assert_eq!(replay["id"], json!(8));
        assert_eq!(replay["result"]["_meta"], json!({"k": 1, META_REPLAYED: true}));
        let bare = json!({"content": [{"type": "text", "text": "settled"}]});
        let replay = replayed(bare.to_string().as_bytes(), false, &json!(2)).unwrap();
        assert_eq!(replay["result"]["content"], bare["content"]);
        let error = json!({"jsonrpc": "2.0", "id": 1, "error": {"code": -32602, "message": "no such tool"}});
        assert_eq!(replayed(error.to_string().as_bytes(), false, &json!(5)).unwrap()["error"], error["error"]);
        assert_eq!(replayed(b"<html>bad gateway</html>", false, &json!(1)), None);
        assert_eq!(replayed(b"{\"unrelated\":true}", false, &json!(1)), None);
    }

    #[test]
    fn an_unknown_outcome_is_a_tool_error_naming_its_record() {
        let id = RecordId::from(uuid::Uuid::now_v7());
        let record = RecordRef { key: key("k-1"), id: Some(id), state: Some(State::Unknown) };
        let answer = unknown(&json!(4), &record);
        assert_eq!(answer["id"], json!(4));
        assert_eq!(answer["result"]["isError"], json!(true));
        let text = answer["result"]["content"][0]["text"].as_str().unwrap();
        assert!(text.contains("may have taken effect") && text.contains(&id.to_string()), "{text}");
        let structured = &answer["result"]["structuredContent"];
        assert_eq!(structured["idempotencyKey"], json!("k-1"));
        assert_eq!(structured["recordId"], json!(id.to_string()));
        assert_eq!(structured["state"], json!("unknown"));
    }

    #[test]
    fn problems_become_errors_with_documented_codes() {
        let record = RecordRef { key: key("k"), id: None, state: None };
        let reused = problem(&json!(1), &Problem::key_reused().state(State::Done), Some(&record));
        assert_eq!(reused["error"]["code"], json!(codes::KEY_REUSED));
        assert_eq!(reused["error"]["data"]["state"], json!("done"));
        assert_eq!(reused["error"]["data"]["idempotencyKey"], json!("k"));
        assert_eq!(reused["error"]["data"]["type"], json!("urn:idem:problem:idempotency-key-reused"));
        let busy = Problem::in_progress(std::time::Duration::from_millis(1500)).state(State::InProgress);
        let busy = problem(&json!(2), &busy, Some(&record));
        assert_eq!(busy["error"]["code"], json!(codes::IN_PROGRESS));
        assert_eq!(busy["error"]["data"]["retryable"], json!(true));
        assert!(busy["error"]["data"]["retryAfterMs"].as_u64().is_some_and(|ms| ms >= 1000), "{busy}");
        let other = problem(&json!(3), &Problem::overloaded(), None);
        assert_eq!(other["error"]["code"], json!(codes::BROKER_PROBLEM));
    }

    #[test]
    fn a_cut_stream_ends_with_the_outcome_the_tool_leaves() {
        let record =
            RecordRef { key: key("k"), id: Some(RecordId::from(uuid::Uuid::now_v7())), state: Some(State::Unknown) };
        let problem = json!({"type": "urn:idem:problem:stream-cut", "title": "Stream cut", "detail": "cut"});
        assert_eq!(cut(&json!(1), &problem, &record, false)["result"]["isError"], json!(true));
        let freed = cut(&json!(1), &problem, &record, true);
        assert_eq!(freed["error"]["code"], json!(codes::BROKER_PROBLEM));
        assert_eq!(freed["error"]["data"]["retryable"], json!(true));
    }

    #[test]
    fn initialize_gains_the_idempotency_capability_only_where_tools_are_offered() {
        let mut with_tools = json!({"id": 0, "result": {"capabilities": {"tools": {"listChanged": true}}}});
        assert!(with_idempotency(&mut with_tools));
        assert_eq!(
            with_tools["result"]["capabilities"]["tools"],
            json!({"listChanged": true, "idempotency": {"supported": true}})
        );
        let mut without = json!({"id": 0, "result": {"capabilities": {"prompts": {}}}});
        assert!(!with_idempotency(&mut without));
        assert!(!with_idempotency(&mut json!({"id": 0, "error": {"code": 1}})));
    }
}
