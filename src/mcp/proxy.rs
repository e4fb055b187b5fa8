//! Messages that pass through unrecorded (docs/mcp.md): `initialize`, notifications,
//! `tools/list`, resources, prompts, calls to read-only tools, the GET stream, DELETE. Answers
//! flow back as they arrive, event by event; on the way the broker reads the few messages that
//! concern it: it learns the tools of a `tools/list` result, forgets them at
//! `notifications/tools/list_changed`, and adds its capability to the `initialize` result.

use std::sync::Arc;

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::{header, HeaderValue, StatusCode};
use serde_json::Value;

use super::answers::with_idempotency;
use super::sse::{self, Events, Piece};
use super::Catalog;
use crate::config::Route;
use crate::problem::Problem;
use crate::stream::StreamCut;
use crate::upstream::{self, Head, Outbound, Upstream};

/// What the broker looks at in an answer passing through.
#[derive(Clone)]
pub(crate) struct Watch {
    pub route: String,
    /// The request's session: its tools are learned or forgotten.
    pub session: String,
    pub catalog: Arc<Catalog>,
    /// The method of the request answered, when the broker reads its result (`initialize`,
    /// `tools/list`).
    pub answering: Option<String>,
}

impl Watch {
    /// Reads one message; a changed message when the broker changes it.
    fn look(&self, message: &Value) -> Option<Value> {
        if message.get("method").and_then(Value::as_str) == Some("notifications/tools/list_changed") {
            self.catalog.forget(&self.route, &self.session);
            return None;
        }
        let result = message.get("result")?;
        match self.answering.as_deref() {
            Some("initialize") => {
                let mut changed = message.clone();
                with_idempotency(&mut changed).then_some(changed)
            }
            Some("tools/list") => {
                self.catalog.learn(&self.route, &self.session, result);
                None
            }
            _ => None,
        }
    }

    /// Whether a whole answer (not a stream) must be read before it is passed on.
    fn reads_answers(&self) -> bool {
        self.answering.is_some()
    }
}

/// Sends a request upstream as it came and passes its answer back as it arrives.
/// `headers` are the request's as they go upstream (the client's address among them).
pub(crate) async fn pass(
    upstream: &Upstream,
    route: &Route,
    parts: &http::request::Parts,
    headers: &[(String, String)],
    body: Bytes,
    watch: Watch,
) -> Response {
    let url = match route.upstream_url(parts.uri.path(), parts.uri.query().unwrap_or("")) {
        Ok(url) => url,
        Err(why) => return Problem::invalid_path(&why).into_response(),
    };
    let credentials = upstream::route_credentials(route, parts.headers.get(header::AUTHORIZATION));
    // The head within the route's deadline; a stream's body as long as both ends keep it open.
    let until = tokio::time::Instant::now() + route.retry.deadline;
    let request = Outbound::for_route(route, &parts.method, url, headers, &credentials, body);
    let head = match upstream.send_head(request, until, None).await {
        Ok(head) => head,
        Err(failure) if failure.observed == crate::policy::Observed::TimedOut => {
            return unreachable("did not answer within the route's deadline")
        }
        Err(failure) => match failure.cause {
            Some(cause) => return unreachable(&format!("could not be reached (route {}: {})", route.name, cause.why)),
            None => return unreachable("could not be reached"),
        },
    };
    let status = StatusCode::from_u16(head.status).unwrap_or(StatusCode::BAD_GATEWAY);
    let response_headers = upstream::to_header_map(&head.headers);
    let body = if head.event_stream {
        events_body(head, watch)
    } else if watch.reads_answers() {
        match head.whole(until).await {
            Ok(answer) => Body::from(looked_at(answer.response.body, &watch)),
            Err(_) => return unreachable("cut its answer short"),
        }
    } else {
        raw_body(head)
    };
    let mut response = Response::new(body);
    *response.status_mut() = status;
    *response.headers_mut() = response_headers;
    response
}

/// The answer when a message that passes through got no answer: nothing of it was recorded, so
/// unlike a recorded call's problem this names no key.
fn unreachable(what: &str) -> Response {
    let detail = format!("The MCP server {what}. Nothing was recorded; send the message again.");
    Problem::new(StatusCode::BAD_GATEWAY, "upstream-unavailable", "Upstream unavailable", detail)
        .retry_after(1)
        .retryable()
        .into_response()
}

/// A whole JSON answer, changed if the broker changes its message.
fn looked_at(body: Bytes, watch: &Watch) -> Bytes {
    let changed = serde_json::from_slice::<Value>(&body).ok().and_then(|message| watch.look(&message));
    match changed {
        Some(message) => Bytes::from(message.to_string()),
        None => body,
    }
}

/// A body passed on part by part, untouched; a cut aborts the client's response.
fn raw_body(head: Head) -> Body {
    let parts = futures_util::stream::unfold(Some(head), |head| async move {
        let mut head = head?;
        match head.part().await {
            Ok(Some(part)) => Some((Ok(part), Some(head))),
            Ok(None) => None,
            Err(_) => Some((Err(StreamCut), None)),
        }
    });
    Body::from_stream(parts)
}

/// An event stream passed on event by event, each read by the broker on the way.
fn events_body(head: Head, watch: Watch) -> Body {
    struct Flow {
        head: Head,
        events: Events,
        watch: Watch,
    }
    let parts =
        futures_util::stream::unfold(Some(Flow { head, events: Events::default(), watch }), |flow| async move {
            let mut flow = flow?;
            loop {
                match flow.head.part().await {
                    Ok(Some(part)) => {
                        let out = pass_events(&mut flow.events, &flow.watch, &part);
                        if !out.is_empty() {
                            return Some((Ok(Bytes::from(out)), Some(flow)));
                        }
                    }
                    Ok(None) => return flow.events.rest().map(|rest| (Ok(Bytes::from(rest)), None)),
                    Err(_) => return Some((Err(StreamCut), None)),
                }
            }
        });
    Body::from_stream(parts)
}

/// The bytes to pass on for a part of an event stream: every whole event, read and maybe changed.
fn pass_events(events: &mut Events, watch: &Watch, part: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(part.len());
    for piece in events.push(part) {
        match piece {
            Piece::Raw(bytes) => out.extend_from_slice(&bytes),
            Piece::Event(event) => match sse::message(&event).and_then(|m| watch.look(&m)) {
                Some(changed) => out.extend_from_slice(&sse::with_message(&event, &changed)),
                None => out.extend_from_slice(&event),
            },
        }
    }
    out
}

/// A JSON-RPC message the broker answers with itself, as `application/json`.
pub(crate) fn json_answer(status: StatusCode, message: &Value) -> Response {
    let mut response = Response::new(Body::from(message.to_string()));
    *response.status_mut() = status;
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn watch(answering: Option<&str>) -> (Watch, Arc<Catalog>) {
        let catalog = Arc::new(Catalog::default());
        let watch = Watch {
            route: "r".into(),
            session: "s".into(),
            catalog: catalog.clone(),
            answering: answering.map(Into::into),
        };
        (watch, catalog)
    }

    #[test]
    fn an_initialize_answer_streamed_gains_the_capability_and_the_rest_passes_untouched() {
        let (watch, _) = watch(Some("initialize"));
        let init = json!({"jsonrpc": "2.0", "id": 0, "result": {"capabilities": {"tools": {}}}});
        let stream = format!(": ping\n\nevent: message\ndata: {init}\n\n");
        let mut events = Events::default();
        let (a, b) = stream.as_bytes().split_at(20);
        let mut out = pass_events(&mut events, &watch, a);
        out.extend(pass_events(&mut events, &watch, b));
        let text = String::from_utf8(out).unwrap();
        assert!(text.starts_with(": ping\n\nevent: message\n"), "{text}");
        let messages = sse::messages(text.as_bytes());
        assert_eq!(messages[0]["result"]["capabilities"]["tools"]["idempotency"], json!({"supported": true}));
    }

    #[test]
    fn tools_are_learned_from_a_list_and_forgotten_when_the_list_changes() {
        let (listing, catalog) = watch(Some("tools/list"));
        let list = json!({"jsonrpc": "2.0", "id": 1, "result": {"tools": [
            {"name": "get_balance", "annotations": {"readOnlyHint": true}}]}});
        assert_eq!(looked_at(Bytes::from(list.to_string()), &listing), Bytes::from(list.to_string()));
        let config = crate::config::Config::parse_with_env(
            "[[routes]]\nname = \"r\"\nkind = \"mcp\"\npath_prefix = \"/mcp\"\nupstream = \"http://127.0.0.1:9\"\n",
            |_| None,
        )
        .unwrap();
        assert_eq!(catalog.class(&config.routes[0], "s", "get_balance"), super::super::ToolClass::PassThrough);
        let stream_watch = Watch { answering: None, ..listing };
        let changed = "data: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/tools/list_changed\"}\n\n";
        let out = pass_events(&mut Events::default(), &stream_watch, changed.as_bytes());
        assert_eq!(out, changed.as_bytes());
        assert_ne!(catalog.class(&config.routes[0], "s", "get_balance"), super::super::ToolClass::PassThrough);
    }
}
