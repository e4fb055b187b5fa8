//! A route of `kind = "mcp"` (docs/mcp.md): every message passes through but a `tools/call` to
//! a recorded tool, which is keyed, fingerprinted and executed like any keyed request, by the
//! same admission, and answered in JSON-RPC.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::Request;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures_util::StreamExt;
use http::{Method, StatusCode};
use serde_json::Value;

use super::answers::Answer;
use super::intake::read_body;
use super::{Ingress, Read, REPLAYED_HEADER};
use crate::config::{Config, Route};
use crate::domain::key::IdempotencyKey;
use crate::domain::{Arrival, State, Tenant};
use crate::ingress::credentials;
use crate::ingress::derived;
use crate::ingress::prefer::Prefer;
use crate::ingress::reader::Records;
use crate::mcp::answers::{self, RecordRef};
use crate::mcp::proxy::{self, json_answer, Watch};
use crate::mcp::sse::{self, Events, Piece};
use crate::mcp::{codes, message, Incoming, ToolCall, ToolClass};
use crate::observe::metrics;
use crate::problem::Problem;
use crate::runtime::ServedRoute;

/// A recorded call, as read: its body (stored as the record's request) and its message.
struct Recorded<'a> {
    route: &'a ServedRoute,
    tenant: Tenant,
    parts: http::request::Parts,
    body: Bytes,
    call: ToolCall,
    replay_safe: bool,
    arrival: Arrival,
    /// What its answer is read for, should it pass through after all (a keyless call on a route
    /// that does not require keys).
    watch: Watch,
}

impl Ingress {
    /// A request on an MCP route.
    pub(super) async fn mcp(&self, route: &ServedRoute, request: Request, arrival: Arrival) -> Response {
        let config = route.config();
        let tenant = match credentials::tenant(config, request.headers()) {
            Ok(tenant) => tenant,
            Err(problem) => return problem.into_response(),
        };
        let (parts, body) = request.into_parts();
        // Held until this request is answered: its body lives at least that long.
        let (body, _held) = match read_body(body, route, &self.bodies).await {
            Ok(read) => read,
            Err(problem) => return problem.into_response(),
        };
        let session = crate::mcp::session_of(&parts.headers).to_string();
        let watch = Watch { route: route.name.to_string(), session, catalog: self.mcp_tools.clone(), answering: None };
        if parts.method != Method::POST {
            if parts.method == Method::DELETE {
                self.mcp_tools.forget(&watch.route, &watch.session);
            }
            return self.mcp_pass(config, route, &parts, body, watch).await;
        }
        match message::read(&body) {
            Err(refused) => {
                // A body that is no request at all is the client's error; a bad `tools/call` is a
                // JSON-RPC error answered like the server's own.
                let status = match refused.code {
                    codes::INVALID_PARAMS => StatusCode::OK,
                    _ => StatusCode::BAD_REQUEST,
                };
                let id = refused.id.unwrap_or(Value::Null);
                json_answer(status, &answers::error(&id, refused.code, &refused.message, None))
            }
            Ok(Incoming::Other { method }) => {
                let answering = method.filter(|m| m == "initialize" || m == "tools/list");
                self.mcp_pass(config, route, &parts, body, Watch { answering, ..watch }).await
            }
            Ok(Incoming::ToolCall(call)) => {
                let class = match self.mcp_tools.class(route, &watch.session, &call.tool) {
                    ToolClass::PassThrough => self.decided_before(route, &tenant, &call).await,
                    recorded => recorded,
                };
                match class {
                    ToolClass::PassThrough => self.mcp_pass(config, route, &parts, body, watch).await,
                    ToolClass::Recorded { replay_safe } => {
                        let recorded = Recorded { route, tenant, parts, body, call, replay_safe, arrival, watch };
                        self.mcp_recorded(recorded).await
                    }
                }
            }
        }
    }

    /// What becomes of a keyed call that this node would pass through (its tool is read-only in
    /// this node's catalog, or the operator's): the first decision made for the key wins, on
    /// whichever node made it (docs/mcp.md). A key that has a record was recorded by a node that
    /// judged otherwise, and its record decides, with the policy stored with it; a key without
    /// one passes through. A store that cannot be asked cannot tell: the call takes the recorded
    /// way, whose answer says the store is unavailable, rather than risk a second execution.
    async fn decided_before(&self, route: &ServedRoute, tenant: &Tenant, call: &ToolCall) -> ToolClass {
        let Some(key) = &call.key else { return ToolClass::PassThrough };
        match self.records.live(route.config(), tenant, key).await {
            Ok(None) => ToolClass::PassThrough,
            Ok(Some(record)) => {
                let policy = route.policy_of(record.policy_version.as_ref(), route.own_policy());
                ToolClass::Recorded { replay_safe: policy.replay_safe }
            }
            Err(_) => ToolClass::Recorded { replay_safe: false },
        }
    }

    /// A message passed through unrecorded, unless an operator isolated the route.
    async fn mcp_pass(
        &self,
        config: &Config,
        route: &Route,
        parts: &http::request::Parts,
        body: Bytes,
        watch: Watch,
    ) -> Response {
        if let Some(refusal) = self.isolation(&route.name) {
            return self.refused(route, refusal).into_response();
        }
        let mut headers = crate::upstream::forwardable_request_headers(&parts.headers, true);
        crate::upstream::forward(&mut headers, parts.extensions.get(), &config.server.forwarded);
        proxy::pass(&self.upstream, route, parts, &headers, body, watch).await
    }

    /// A `tools/call` to a recorded tool: keyed (sent, or derived from the route's `key_from`),
    /// fingerprinted by tool and arguments, executed or answered from its record.
    async fn mcp_recorded(&self, recorded: Recorded<'_>) -> Response {
        let Recorded { route, tenant, parts, body, call, replay_safe, arrival, watch } = recorded;
        let config = route.config();
        // Fields that change on every retry (a timestamp, a nonce) count neither in the
        // fingerprint nor in a derived key.
        let kept = derived::without_ignored(&body, &route.fingerprint_ignore);
        let judged = match kept.as_deref().map(message::read) {
            Some(Ok(Incoming::ToolCall(kept))) => kept,
            _ => call.clone(),
        };
        let key = match &call.key {
            Some(key) => key.clone(),
            None if !route.key_from.is_empty() => {
                match derived::key(route, &tenant, &parts.headers, kept.as_deref().unwrap_or(&body)) {
                    Ok(run) => judged.derived_key(&run),
                    Err(missing) => {
                        let problem = Problem::missing_key_source(&missing);
                        return json_answer(StatusCode::OK, &answers::problem(&call.id, &problem, None));
                    }
                }
            }
            None if !route.require_key => {
                metrics::unkeyed(&route.name);
                return self.mcp_pass(config, route, &parts, body, watch).await;
            }
            None => {
                let problem = Problem::new(
                    StatusCode::BAD_REQUEST,
                    "missing-idempotency-key",
                    "Missing idempotency key",
                    format!(
                        "this tool is recorded: send a key in params.idempotencyKey or params._meta[\"{}\"]",
                        crate::mcp::META_KEY
                    ),
                );
                return json_answer(StatusCode::OK, &answers::problem(&call.id, &problem, None));
            }
        };
        super::access::key(&key);
        let fingerprint = judged.fingerprint(&route.name);
        let wait = route.mcp.as_ref().map(|mcp| mcp.in_flight_wait);
        let prefer = Prefer { respond_async: false, wait };
        let read = Read {
            tenant: tenant.clone(),
            key: &key,
            fingerprint,
            body,
            route,
            parts: &parts,
            // An MCP route's path is not checked here: the execution builds the URL from the record.
            url: None,
            arrival,
            prefer,
            replay_safe,
        };
        // As on any keyed route, naming the tool.
        let span = |tenant: &Tenant| {
            let span = tracing::info_span!("request", %tenant, route = %route.name, tool = %call.tool);
            crate::observe::telemetry::continue_trace(&span, &parts.headers);
            super::access::trace(&span);
            span
        };
        let answer = self.answer_keyed(read, span).await;
        let answer = self.mcp_answer(route, &tenant, &key, &call.id, answer).await;
        let config = route.config().clone();
        let cut = Cut { id: call.id, tenant, key, replay_safe, records: self.records.clone(), config };
        cut.told_in_json_rpc(answer)
    }

    /// A recorded call's answer in JSON-RPC. The request that executed it gets the upstream's
    /// answer as it came (streamed or whole); a replay, the stored result under this request's
    /// `id`; an unknown outcome, a tool error naming its record; any other problem, an error.
    async fn mcp_answer(
        &self,
        route: &ServedRoute,
        tenant: &Tenant,
        key: &IdempotencyKey,
        id: &Value,
        answer: Answer,
    ) -> Response {
        let response = match answer {
            Ok(response) => response,
            Err(problem) => {
                super::access::kind(super::access::Kind::Problem);
                let record = self.record_ref(route.config(), tenant, key, &problem).await;
                let message = match problem.is_outcome_unknown() {
                    true => answers::unknown(id, &record),
                    false => answers::problem(id, &problem, Some(&record)),
                };
                return json_answer(StatusCode::OK, &message);
            }
        };
        if !response.headers().contains_key(REPLAYED_HEADER) {
            return response;
        }
        let event_stream = crate::stream::is_event_stream(response.headers());
        let (head, body) = response.into_parts();
        // A replay attached to an answer still streaming here ends with that answer.
        let read = axum::body::to_bytes(body, route.max_stored_body.saturating_add(1));
        let bytes = match tokio::time::timeout(route.retry.deadline, read).await {
            Ok(Ok(bytes)) => bytes,
            _ => {
                let problem = Problem::response_not_stored();
                return json_answer(StatusCode::OK, &answers::problem(id, &problem, None));
            }
        };
        match answers::replayed(&bytes, event_stream, id) {
            Some(message) => {
                let mut answer = json_answer(StatusCode::OK, &message);
                answer.headers_mut().insert(REPLAYED_HEADER, http::HeaderValue::from_static("true"));
                answer
            }
            // Not a JSON-RPC answer (an HTTP error the server gave): replayed as it was.
            None => Response::from_parts(head, Body::from(bytes)),
        }
    }

    /// The record a problem is about, as far as the store tells (not at all when it is down).
    async fn record_ref(&self, config: &Config, tenant: &Tenant, key: &IdempotencyKey, problem: &Problem) -> RecordRef {
        let mut reference = RecordRef { key: key.clone(), id: None, state: problem.idempotency_status };
        if !problem.is_store_unavailable() {
            if let Ok(Some(record)) = self.records.live(config, tenant, key).await {
                reference.id = Some(record.id);
                reference.state = Some(record.state);
            }
        }
        reference
    }
}

/// What a call's event stream, cut after its first byte, ends with for an MCP client: not the
/// broker's `idem-error` event, which no MCP client reads, but a message under the call's `id`
/// (see [`answers::cut`]), after which the stream ends as a whole one would.
struct Cut {
    id: Value,
    tenant: Tenant,
    key: IdempotencyKey,
    replay_safe: bool,
    records: Records,
    /// The configuration the call was served under.
    config: Arc<Config>,
}

impl Cut {
    fn told_in_json_rpc(self, response: Response) -> Response {
        if !crate::stream::is_event_stream(response.headers()) {
            return response;
        }
        let (head, body) = response.into_parts();
        let flow = (body.into_data_stream(), Events::default(), self);
        let parts = futures_util::stream::unfold(Some(flow), |flow| async move {
            let (mut body, mut events, cut) = flow?;
            loop {
                let part = match body.next().await {
                    Some(Ok(part)) => part,
                    Some(Err(e)) => return Some((Err(e), None)),
                    None => return events.rest().map(|rest| (Ok(Bytes::from(rest)), None)),
                };
                let mut out = Vec::with_capacity(part.len());
                for piece in events.push(&part) {
                    match piece {
                        Piece::Event(event) if sse::is_broker_error(&event) => {
                            out.extend(sse::event(&cut.message(&event).await));
                            return Some((Ok(Bytes::from(out)), None));
                        }
                        Piece::Event(bytes) | Piece::Raw(bytes) => out.extend(bytes),
                    }
                }
                if !out.is_empty() {
                    return Some((Ok(Bytes::from(out)), Some((body, events, cut))));
                }
            }
        });
        Response::from_parts(head, Body::from_stream(parts))
    }

    /// The message in place of the `idem-error` event `event`.
    async fn message(&self, event: &[u8]) -> Value {
        let problem = sse::message(event).unwrap_or(Value::Null);
        let mut record = RecordRef { key: self.key.clone(), id: None, state: None };
        if let Ok(Some(found)) = self.records.live(&self.config, &self.tenant, &self.key).await {
            record.id = Some(found.id);
            record.state = Some(found.state);
        }
        if !self.replay_safe {
            // What the record becomes as this event is sent, whatever the store said a moment before.
            record.state = Some(State::Unknown);
        }
        answers::cut(&self.id, &problem, &record, self.replay_safe)
    }
}
