//! A request's durable record and the state machine it moves through (docs/concepts.md).

use std::time::Duration;

use base64::Engine;
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::domain::fingerprint::Fingerprint;
use crate::domain::key::IdempotencyKey;
use crate::domain::{
    Actor, AttemptError, AttemptOutcome, HistoryAction, Owner, Phase, PolicyVersion, RecordId, RouteName,
};
use crate::domain::{ClaimToken, State, StopReason, Tenant, Timestamp, MCP_TOOLS_CALL};

mod machine;
pub mod rules;

pub use machine::{admitted, transition, Event, Refused};

/// One physical attempt, as stored with its record.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Attempt {
    pub number: u32,
    pub started_at: Timestamp,
    pub duration_ms: u64,
    pub outcome: AttemptOutcome,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    /// How the attempt ended when no status arrived.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<AttemptError>,
    /// The wait before this attempt.
    pub wait_ms: u64,
    /// The version of the policy the attempt was sent under; absent from attempts stored
    /// before versions were.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy_version: Option<PolicyVersion>,
    /// The upstream's `Retry-After` as the policy read it, when a response within the limit
    /// carried one: a replay of the history (`idem simulate --history`) needs it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after_ms: Option<u64>,
    /// Why the upstream could not be reached, naming the route, in words a client may read: the
    /// kind of failure (a refused connection, an untrusted certificate), nothing of the network.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unreachable: Option<String>,
    /// The same in the connection's own words (host names, addresses, the certificate's fault):
    /// what an operator needs to fix it, shown only in the operator's view.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

/// How much of a record is shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum View {
    /// One of many (a listing, a sample, an answer given at once): no history.
    Listed,
    /// The client's view of its own record: its history too.
    Client,
    /// The operator's view of one record: also why each attempt could not reach the upstream
    /// in the connection's own words, which may name hosts and addresses behind Idem.
    Operator,
}

/// An entry of the record's history: who did what, when.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HistoryEntry {
    pub at: Timestamp,
    pub actor: Actor,
    pub action: HistoryAction,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// A response as stored and replayed: status, end-to-end headers, body bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredResponse {
    pub status: u16,
    /// Header names and values; values are kept as Latin-1 text so that any byte survives.
    pub headers: Vec<(String, String)>,
    pub body: Bytes,
}

/// How a streamed answer went (docs/concepts.md), stored with its record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamFacts {
    /// Body bytes received from the upstream.
    pub bytes: u64,
    /// Whether the body is stored: within the route's `max_stored_body`. A `done` record whose
    /// body is not is never replayed; its duplicates are refused.
    pub stored: bool,
    /// Where a cut (or stalled) stream ended: the bytes received before it. `None` when whole.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cut_at: Option<u64>,
    /// From the attempt's send to the first body byte, and to the stream's end.
    pub first_byte_ms: u64,
    pub duration_ms: u64,
}

/// What the broker needs to send the request again, possibly from another process.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredRequest {
    pub headers: Vec<(String, String)>,
    pub body: Bytes,
}

/// How long a done record's answer lives (docs/agents.md, key lifetime): replayed for
/// `retention` after the record became done, then remembered by a tombstone for `tombstone` more
/// (none when it is zero). One value, which the admission, the retention sweep and every reader
/// judge a record's age by, always from its completion (`done_at`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lifetime {
    pub retention: Duration,
    pub tombstone: Duration,
}

impl Lifetime {
    /// Done records that finished before this are past their retention at `now`.
    pub fn cutoff(self, now: Timestamp) -> Timestamp {
        now - self.retention
    }

    /// Whether a record done at `done_at` is past its retention at `now`.
    pub fn expired(self, done_at: Timestamp, now: Timestamp) -> bool {
        done_at < self.cutoff(now)
    }

    /// When the answer of a record done at `done_at` stops being replayed.
    pub fn expires_at(self, done_at: Timestamp) -> Timestamp {
        done_at + self.retention
    }

    /// How long after its completion a record's tombstone goes, if it leaves one.
    pub fn tombstone_after(self) -> Option<Duration> {
        (!self.tombstone.is_zero()).then(|| self.retention + self.tombstone)
    }

    /// Done records that finished at or after this are still remembered at `now`, by their
    /// tombstone; `None` when none is kept.
    pub fn tombstone_cutoff(self, now: Timestamp) -> Option<Timestamp> {
        self.tombstone_after().map(|after| now - after)
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Lease {
    pub owner: Owner,
    pub expires_at: Timestamp,
}

#[derive(Debug, Clone)]
pub struct Record {
    pub id: RecordId,
    pub tenant: Tenant,
    pub key: IdempotencyKey,
    pub route: RouteName,
    pub method: http::Method,
    pub path: String,
    pub query: String,
    pub fingerprint: Fingerprint,
    pub request: StoredRequest,
    pub state: State,
    pub queued: bool,
    /// End of the end-to-end deadline, counted from the request's arrival.
    pub deadline_at: Timestamp,
    pub lease: Option<Lease>,
    /// The token of its latest claim, kept after the lease ends: a write under an older claim is
    /// refused (see [`ClaimToken`]).
    pub claim: ClaimToken,
    /// The attempt that may be in flight: its number and start. Set before the attempt is sent
    /// and cleared when its outcome is stored, so a take-over knows whether one may have run.
    pub in_flight: Option<(u32, Timestamp)>,
    /// The time, in the store's clock, after which no attempt marked so far can still reach
    /// the upstream: raised by every mark, and brought down to the outcome's time when an
    /// attempt's outcome is stored on a record never taken over (nothing else can be on its
    /// way then). Nothing frees the record before it.
    pub in_flight_until: Option<Timestamp>,
    pub attempts: Vec<Attempt>,
    pub stop_reason: Option<StopReason>,
    pub response: Option<StoredResponse>,
    pub history: Vec<HistoryEntry>,
    pub cancel_requested: bool,
    /// Probes sent so far for an `unknown` record, and when the next is due.
    pub probe_count: u32,
    pub next_probe_at: Option<Timestamp>,
    /// How many times its expired lease was taken over (kept when a client sends a freed record
    /// again, so a record that crashes its workers cannot do so without end).
    pub takeovers: u32,
    /// While waiting between attempts: the earliest start of the next one.
    pub not_before: Option<Timestamp>,
    /// A tombstone: a done record past its retention, its bodies dropped, kept until then so a
    /// late retry of the same request is answered 410 rather than executed again.
    pub tombstone_until: Option<Timestamp>,
    /// When it became done, in the store's clock: its lifetime counts from then.
    pub done_at: Option<Timestamp>,
    /// The policy version of the latest attempt, written with its "may have been sent" mark:
    /// an attempt whose worker died before storing its outcome is still known by its policy.
    pub policy_version: Option<PolicyVersion>,
    /// Set when its answer streamed: how that went, written by the same write as the outcome,
    /// and cleared when a later attempt starts.
    pub stream: Option<StreamFacts>,
    pub created_at: Timestamp,
    pub updated_at: Timestamp,
}

impl Record {
    pub fn phase(&self) -> Phase {
        Phase::of(self.state, self.queued)
    }

    /// A done record whose answer is past its retention at `now`: read as gone by every reader,
    /// whether or not the sweep has removed it yet (docs/agents.md, key lifetime).
    pub fn past_retention(&self, lifetime: Lifetime, now: Timestamp) -> bool {
        self.state == State::Done && lifetime.expired(self.completed(), now)
    }

    /// When a done record became done: its `done_at` (its last update, for a record stored
    /// without one).
    pub fn completed(&self) -> Timestamp {
        self.done_at.unwrap_or(self.updated_at)
    }

    pub fn path_and_query(&self) -> String {
        if self.query.is_empty() {
            self.path.clone()
        } else {
            format!("{}?{}", self.path, self.query)
        }
    }

    /// The record as docs/http-api.md shows it to clients and operators, in `view`. The request
    /// body and headers are never shown: they may carry secrets meant only for the upstream.
    pub fn to_json(&self, view: View) -> Value {
        let with_history = view != View::Listed;
        let attempts: Vec<Value> = self
            .attempts
            .iter()
            .map(|a| {
                let mut v = json!({
                    "number": a.number,
                    "started_at": a.started_at.rfc3339(),
                    "duration_ms": a.duration_ms,
                    "outcome": a.outcome.as_str(),
                    "wait_ms": a.wait_ms,
                });
                if let Some(s) = a.status {
                    v["status"] = json!(s);
                }
                if let Some(e) = &a.error {
                    v["error"] = json!(e);
                }
                if let Some(version) = &a.policy_version {
                    v["policy_version"] = json!(version);
                }
                if let Some(ra) = a.retry_after_ms {
                    v["retry_after_ms"] = json!(ra);
                }
                if let Some(unreachable) = &a.unreachable {
                    v["unreachable"] = json!(unreachable);
                }
                if let Some(detail) = a.detail.as_ref().filter(|_| view == View::Operator) {
                    v["detail"] = json!(detail);
                }
                v
            })
            .collect();
        let mut v = json!({
            "id": self.id,
            "tenant": self.tenant,
            "key": self.key,
            "route": self.route,
            "method": self.method.as_str(),
            "path": self.path_and_query(),
            "state": self.state.as_str(),
            "queued": self.queued,
            "fingerprint": self.fingerprint.to_hex(),
            "attempts": attempts,
            "stop_reason": self.stop_reason.map(StopReason::as_str),
            "takeovers": self.takeovers,
            "deadline_at": self.deadline_at.rfc3339(),
            "created_at": self.created_at.rfc3339(),
            "updated_at": self.updated_at.rfc3339(),
        });
        if let Some(version) = &self.policy_version {
            v["policy_version"] = json!(version);
        }
        // An MCP tool call's tool is named, its arguments kept back like any request body.
        if let Some(tool) = tool_called(&self.request.body) {
            v["tool"] = json!(tool);
        }
        if let Some(stream) = &self.stream {
            v["stream"] = json!(stream);
        }
        match (self.tombstone_until, &self.response) {
            (Some(until), Some(r)) => {
                v["tombstone_until"] = until.rfc3339().into();
                v["response"] = json!({ "status": r.status });
            }
            (_, Some(r)) => v["response"] = response_json(r),
            _ => {}
        }
        if with_history {
            v["history"] = self
                .history
                .iter()
                .map(|h| {
                    let mut e = json!({"at": h.at.rfc3339(), "actor": h.actor, "action": h.action});
                    if let Some(n) = &h.note {
                        e["note"] = json!(n);
                    }
                    e
                })
                .collect();
        }
        v
    }
}

pub fn response_json(r: &StoredResponse) -> Value {
    let mut headers = serde_json::Map::new();
    for (name, value) in &r.headers {
        match headers.get_mut(name) {
            None => {
                headers.insert(name.clone(), json!(value));
            }
            Some(Value::Array(list)) => list.push(json!(value)),
            Some(first) => *first = json!([first.take(), value]),
        }
    }
    let mut v = json!({"status": r.status, "headers": headers});
    match std::str::from_utf8(&r.body) {
        Ok(text) => v["body"] = json!(text),
        Err(_) => v["body_base64"] = json!(base64::engine::general_purpose::STANDARD.encode(&r.body)),
    }
    v
}

/// Header values as Latin-1 text: lossless for every byte a header value may hold.
pub fn header_text(bytes: &[u8]) -> String {
    bytes.iter().map(|&b| b as char).collect()
}

pub fn header_bytes(text: &str) -> Vec<u8> {
    text.chars().map(|c| c as u32 as u8).collect()
}

/// The tool an MCP `tools/call` body calls (docs/mcp.md), shown with its record; `None` for any
/// other body. Most bodies are not tool calls: they are not parsed at all.
pub fn tool_called(body: &[u8]) -> Option<String> {
    #[derive(Deserialize)]
    struct Call {
        method: String,
        params: Params,
    }
    #[derive(Deserialize)]
    struct Params {
        name: String,
    }
    let mentioned = body.windows(MCP_TOOLS_CALL.len()).any(|w| w == MCP_TOOLS_CALL.as_bytes());
    if !body.starts_with(b"{") || !mentioned {
        return None;
    }
    let call: Call = serde_json::from_slice(body).ok()?;
    (call.method == MCP_TOOLS_CALL).then_some(call.params.name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_attempt_outcome_is_stored_as_its_name_and_read_back() {
        for outcome in AttemptOutcome::ALL {
            let text = serde_json::to_string(&outcome).unwrap();
            assert_eq!(text, format!("\"{}\"", outcome.as_str()));
            assert_eq!(serde_json::from_str::<AttemptOutcome>(&text).unwrap(), outcome);
            assert_eq!(AttemptOutcome::parse(outcome.as_str()), Some(outcome));
        }
        assert!(serde_json::from_str::<AttemptOutcome>("\"maybe\"").is_err());
    }

    #[test]
    fn header_text_keeps_every_byte() {
        let raw: Vec<u8> = (0u8..=255).collect();
        assert_eq!(header_bytes(&header_text(&raw)), raw);
    }

    #[test]
    fn a_binary_response_body_is_shown_as_base64_and_repeated_headers_as_a_list() {
        let r = StoredResponse {
            status: 201,
            headers: vec![
                ("set-cookie".into(), "a=1".into()),
                ("set-cookie".into(), "b=2".into()),
                ("content-type".into(), "application/octet-stream".into()),
            ],
            body: Bytes::from_static(&[0xff, 0x00]),
        };
        let v = response_json(&r);
        assert_eq!(v["headers"]["set-cookie"], json!(["a=1", "b=2"]));
        assert_eq!(v["body_base64"], json!("/wA="));
        assert!(v.get("body").is_none());
    }
}
