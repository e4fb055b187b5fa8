//! A request's durable record and the state machine it moves through (SPEC §4).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine;
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use uuid::Uuid;

use crate::fingerprint::Fingerprint;
use crate::policy::StopReason;

/// Wall-clock time in milliseconds since the Unix epoch: what the store keeps, because
/// deadlines and leases must mean the same thing to every process that reads the record.
pub type Millis = i64;

pub fn now_ms() -> Millis {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as Millis).unwrap_or(0)
}

pub fn rfc3339(ms: Millis) -> String {
    let t = UNIX_EPOCH + Duration::from_millis(ms.max(0) as u64);
    humantime::format_rfc3339_millis(t).to_string()
}

pub fn duration_ms(d: Duration) -> Millis {
    d.as_millis().min(i64::MAX as u128) as Millis
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum State {
    /// Recorded; nothing can have reached the upstream yet. Either queued for a worker or free.
    NotStarted,
    /// A worker holds a lease on it and an attempt may be in flight.
    InProgress,
    /// Final: a response is stored and replayed until retention ends.
    Done,
    /// An attempt may have executed and the route is not replay-safe: waits for reconciliation.
    Unknown,
}

impl State {
    pub const ALL: [State; 4] = [State::NotStarted, State::InProgress, State::Done, State::Unknown];

    pub fn as_str(self) -> &'static str {
        match self {
            State::NotStarted => "not_started",
            State::InProgress => "in_progress",
            State::Done => "done",
            State::Unknown => "unknown",
        }
    }

    pub fn parse(text: &str) -> Option<State> {
        State::ALL.into_iter().find(|s| s.as_str() == text)
    }
}

/// Where a record stands: its state, and for `not_started` whether work is queued for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Queued,
    Free,
    InProgress,
    Done,
    Unknown,
}

impl Phase {
    pub fn of(state: State, queued: bool) -> Phase {
        match state {
            State::NotStarted if queued => Phase::Queued,
            State::NotStarted => Phase::Free,
            State::InProgress => Phase::InProgress,
            State::Done => Phase::Done,
            State::Unknown => Phase::Unknown,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Queued => "queued",
            Phase::Free => "free",
            Phase::InProgress => "in_progress",
            Phase::Done => "done",
            Phase::Unknown => "unknown",
        }
    }

    pub fn state(self) -> State {
        match self {
            Phase::Queued | Phase::Free => State::NotStarted,
            Phase::InProgress => State::InProgress,
            Phase::Done => State::Done,
            Phase::Unknown => State::Unknown,
        }
    }
}

/// The events of SPEC §4's transition table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// A request with the same key and fingerprint arrives for a free record.
    Requeue,
    Claim,
    AttemptSent,
    FinalResponse,
    WaitForRetry,
    AmbiguousNotReplaySafe,
    /// Retries stopped and nothing may have executed (or the route is replay-safe).
    StopFree,
    LeaseExpired {
        attempt_unrecorded: bool,
        replay_safe: bool,
        deadline_passed: bool,
    },
    /// A lease expired that would be continued, but the record was taken over too often already.
    TakeoverCapReached {
        attempt_may_have_run: bool,
    },
    ResolveExecuted,
    ResolveNotExecuted,
    OperatorRetry,
    /// A cancel while queued: nothing was sent, the key is freed.
    CancelQueued,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("a record that is {from:?} cannot take {event:?}")]
pub struct Refused {
    pub from: Phase,
    pub event: Event,
}

/// SPEC §4's transition table as a function: anything not listed is refused.
pub fn transition(from: Phase, event: Event) -> Result<Phase, Refused> {
    use Event::*;
    use Phase::*;
    let to = match (from, event) {
        (Free, Requeue) => Queued,
        (Queued, Claim) => InProgress,
        (Queued, CancelQueued) => Free,
        (InProgress, AttemptSent | WaitForRetry) => InProgress,
        (InProgress, FinalResponse) => Done,
        (InProgress, AmbiguousNotReplaySafe) => Unknown,
        (InProgress, StopFree) => Free,
        (InProgress, LeaseExpired { attempt_unrecorded, replay_safe, deadline_passed }) => {
            if attempt_unrecorded && !replay_safe {
                Unknown
            } else if deadline_passed {
                Free
            } else {
                Queued
            }
        }
        (InProgress, TakeoverCapReached { attempt_may_have_run: true }) => Unknown,
        (InProgress, TakeoverCapReached { attempt_may_have_run: false }) => Free,
        (Unknown, ResolveExecuted) => Done,
        (Unknown, ResolveNotExecuted) => Free,
        (Unknown, OperatorRetry) => Queued,
        _ => return Err(Refused { from, event }),
    };
    Ok(to)
}

/// One physical attempt, as stored with its record.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Attempt {
    pub number: u32,
    pub started_at: Millis,
    pub duration_ms: u64,
    /// `success`, `final`, `not_executed`, `ambiguous`, or `lost` (the worker died mid-attempt).
    pub outcome: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    /// How the attempt ended when no status arrived: `connect_failed`, `timed_out`, `broken`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The wait before this attempt.
    pub wait_ms: u64,
    /// The version of the policy the attempt was sent under (see [`crate::policy::PolicyVersion`]);
    /// absent from attempts stored before versions were.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy_version: Option<String>,
    /// The upstream's `Retry-After` as the policy read it, when a response within the limit
    /// carried one: a replay of the history (`idem simulate --history`) needs it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after_ms: Option<u64>,
}

/// An entry of the record's history: who did what, when.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HistoryEntry {
    pub at: Millis,
    pub actor: String,
    pub action: String,
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

/// What the broker needs to send the request again, possibly from another process.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredRequest {
    pub headers: Vec<(String, String)>,
    pub body: Bytes,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Lease {
    pub owner: String,
    pub expires_at: Millis,
}

#[derive(Debug, Clone)]
pub struct Record {
    pub id: Uuid,
    pub tenant: String,
    pub key: String,
    pub route: String,
    pub method: String,
    pub path: String,
    pub query: String,
    pub fingerprint: Fingerprint,
    pub request: StoredRequest,
    pub state: State,
    pub queued: bool,
    /// End of the end-to-end deadline, counted from the request's arrival.
    pub deadline_at: Millis,
    pub lease: Option<Lease>,
    /// The attempt that may be in flight: its number and start. Set before the attempt is sent
    /// and cleared when its outcome is stored, so a take-over knows whether one may have run.
    pub in_flight: Option<(u32, Millis)>,
    pub attempts: Vec<Attempt>,
    pub stop_reason: Option<StopReason>,
    pub response: Option<StoredResponse>,
    pub history: Vec<HistoryEntry>,
    pub cancel_requested: bool,
    /// Probes sent so far for an `unknown` record, and when the next is due.
    pub probe_count: u32,
    pub next_probe_at: Option<Millis>,
    /// How many times its expired lease was taken over (kept when a client sends a freed record
    /// again, so a record that crashes its workers cannot do so without end).
    pub takeovers: u32,
    /// While waiting between attempts: the earliest start of the next one.
    pub not_before: Option<Millis>,
    /// A tombstone: a done record past its retention, its bodies dropped, kept until then so a
    /// late retry of the same request is answered 410 rather than executed again.
    pub tombstone_until: Option<Millis>,
    /// The policy version of the latest attempt, written with its "may have been sent" mark:
    /// an attempt whose worker died before storing its outcome is still known by its policy.
    pub policy_version: Option<String>,
    pub created_at: Millis,
    pub updated_at: Millis,
}

impl Record {
    pub fn phase(&self) -> Phase {
        Phase::of(self.state, self.queued)
    }

    pub fn path_and_query(&self) -> String {
        if self.query.is_empty() {
            self.path.clone()
        } else {
            format!("{}?{}", self.path, self.query)
        }
    }

    /// The record as SPEC §3 shows it to clients and operators. The request body and headers
    /// are not shown: they may carry secrets meant only for the upstream.
    pub fn to_json(&self, with_history: bool) -> Value {
        let attempts: Vec<Value> = self
            .attempts
            .iter()
            .map(|a| {
                let mut v = json!({
                    "number": a.number,
                    "started_at": rfc3339(a.started_at),
                    "duration_ms": a.duration_ms,
                    "outcome": a.outcome,
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
                v
            })
            .collect();
        let mut v = json!({
            "id": self.id,
            "tenant": self.tenant,
            "key": self.key,
            "route": self.route,
            "method": self.method,
            "path": self.path_and_query(),
            "state": self.state.as_str(),
            "queued": self.queued,
            "fingerprint": self.fingerprint.to_hex(),
            "attempts": attempts,
            "stop_reason": self.stop_reason.map(StopReason::as_str),
            "takeovers": self.takeovers,
            "deadline_at": rfc3339(self.deadline_at),
            "created_at": rfc3339(self.created_at),
            "updated_at": rfc3339(self.updated_at),
        });
        if let Some(version) = &self.policy_version {
            v["policy_version"] = json!(version);
        }
        match (self.tombstone_until, &self.response) {
            (Some(until), Some(r)) => {
                v["tombstone_until"] = rfc3339(until).into();
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
                    let mut e = json!({"at": rfc3339(h.at), "actor": h.actor, "action": h.action});
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

#[cfg(test)]
mod tests {
    use super::*;
    use Event::*;
    use Phase::*;

    const ALL_PHASES: [Phase; 5] = [Queued, Free, InProgress, Done, Unknown];

    fn expired(attempt_unrecorded: bool, replay_safe: bool, deadline_passed: bool) -> Event {
        LeaseExpired { attempt_unrecorded, replay_safe, deadline_passed }
    }

    #[test]
    fn the_happy_path_goes_queued_in_progress_done() {
        let p = transition(Queued, Claim).unwrap();
        let p = transition(p, AttemptSent).unwrap();
        assert_eq!(transition(p, FinalResponse), Ok(Done));
    }

    #[test]
    fn an_ambiguous_attempt_on_an_unsafe_route_becomes_unknown_and_only_an_operator_settles_it() {
        assert_eq!(transition(InProgress, AmbiguousNotReplaySafe), Ok(Unknown));
        assert_eq!(transition(Unknown, ResolveExecuted), Ok(Done));
        assert_eq!(transition(Unknown, ResolveNotExecuted), Ok(Free));
        assert_eq!(transition(Unknown, OperatorRetry), Ok(Queued));
        for event in [Claim, Requeue, FinalResponse, StopFree, CancelQueued] {
            assert!(transition(Unknown, event).is_err(), "{event:?}");
        }
    }

    #[test]
    fn lease_expiry_follows_what_may_have_been_sent() {
        assert_eq!(transition(InProgress, expired(true, false, false)), Ok(Unknown));
        assert_eq!(transition(InProgress, expired(true, false, true)), Ok(Unknown));
        assert_eq!(transition(InProgress, expired(true, true, false)), Ok(Queued));
        assert_eq!(transition(InProgress, expired(false, false, false)), Ok(Queued));
        assert_eq!(transition(InProgress, expired(false, false, true)), Ok(Free));
    }

    #[test]
    fn a_record_taken_over_too_often_stops_unknown_if_an_attempt_may_have_run_and_free_otherwise() {
        let capped = |attempt_may_have_run| TakeoverCapReached { attempt_may_have_run };
        assert_eq!(transition(InProgress, capped(true)), Ok(Unknown));
        assert_eq!(transition(InProgress, capped(false)), Ok(Free));
        for from in [Queued, Free, Done, Unknown] {
            assert!(transition(from, capped(true)).is_err(), "{from:?}");
        }
    }

    #[test]
    fn done_is_final_and_only_settled_records_are_resolved() {
        for event in [Requeue, Claim, AttemptSent, FinalResponse, ResolveExecuted, ResolveNotExecuted, OperatorRetry] {
            assert!(transition(Done, event).is_err(), "{event:?}");
        }
        for from in [Queued, Free, InProgress, Done] {
            assert!(transition(from, ResolveExecuted).is_err(), "{from:?}");
            assert!(transition(from, OperatorRetry).is_err(), "{from:?}");
        }
    }

    #[test]
    fn only_a_free_record_is_requeued_and_only_a_queued_one_is_claimed() {
        for from in ALL_PHASES {
            assert_eq!(transition(from, Requeue).is_ok(), from == Free, "{from:?}");
            assert_eq!(transition(from, Claim).is_ok(), from == Queued, "{from:?}");
        }
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
