//! Answers built from what is stored: the upstream's response as recorded, the outcome of an
//! execution, and the problems that stand for an outcome that has no response.

use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::Response;

use super::REPLAYED_HEADER;
use crate::domain::AnswerKind;
use crate::domain::StopReason;
use crate::domain::{State, Timestamp};
use crate::observe::metrics;
use crate::problem::{Problem, SHOULD_RETRY_HEADER, STATUS_HEADER};
use crate::record::StoredResponse;
use crate::stream;
use crate::upstream;
use crate::worker::{Outcome, Streamed};

/// An answer on a keyed route: a response, or a problem that is told its key before it is sent.
pub(super) type Answer = Result<Response, Problem>;

/// A time as an HTTP-date header value.
pub(super) fn http_date(at: Timestamp) -> HeaderValue {
    HeaderValue::from_str(&httpdate::fmt_http_date(at.system_time())).expect("an HTTP-date is a valid header value")
}

/// On an answer whose outcome the store could not take yet (`false`): it is being written
/// again, and until it is, a duplicate is told the request is in progress, then unknown.
pub(super) const RECORDED_HEADER: http::HeaderName = http::HeaderName::from_static("idem-recorded");

/// The answer for the request that drove an execution.
pub(super) fn outcome_response(outcome: Outcome) -> Answer {
    match outcome {
        Outcome::Done(StopReason::Deadline, _) => Err(Problem::deadline_exceeded().state(State::Done)),
        Outcome::Done(_, response) => Ok(stored_response(&response, false)),
        Outcome::Unknown(_) => Err(Problem::outcome_unknown().state(State::Unknown)),
        Outcome::Free { stop, last: Some(last), .. } => {
            let mut response = response_of(&last);
            let headers = response.headers_mut();
            headers.insert(STATUS_HEADER, HeaderValue::from_static(State::NotStarted.as_str()));
            // The broker has retried already; only an upstream that asked for more time than the
            // deadline left is worth asking again, later.
            let again = stop == StopReason::RetryAfterBeyondDeadline;
            headers.insert(SHOULD_RETRY_HEADER, HeaderValue::from_static(if again { "true" } else { "false" }));
            Ok(response)
        }
        Outcome::Free { stop, last: None, unreachable } => Err(freed(Some(stop), unreachable.as_deref())),
        Outcome::Lost => Err(Problem::in_progress(Duration::from_secs(1)).state(State::InProgress)),
        Outcome::Streaming(streamed) => Ok(streamed_response(streamed)),
        // Told as it is, never as "nothing happened": the upstream's answer, or the problem its
        // outcome makes, marked as not in the record yet.
        Outcome::Unrecorded(outcome) => {
            let mut answer = outcome_response(*outcome);
            match &mut answer {
                Ok(response) => {
                    response.headers_mut().insert(RECORDED_HEADER, HeaderValue::from_static("false"));
                }
                Err(problem) => problem.extensions.push(("recorded", serde_json::Value::Bool(false))),
            }
            answer
        }
    }
}

/// Why an upstream was not reached, in the words of a problem's detail: `why` is the route and
/// the kind of failure (a refused connection, an untrusted certificate), when known.
pub(super) fn could_not_reach(why: Option<&str>) -> String {
    match why {
        Some(why) => format!("it could not be reached: {why}"),
        None => "it could not be reached".into(),
    }
}

/// The answer to a request whose record was freed with no upstream response to pass on, for why
/// it stopped (and, when its last attempt could not reach the upstream, why not): the same
/// whether its own execution tells it, or the record does (to a duplicate that waited, or to a
/// request whose execution's outcome did not reach it).
pub(super) fn freed(stop: Option<StopReason>, unreachable: Option<&str>) -> Problem {
    let could_not = could_not_reach(unreachable);
    let problem = match stop {
        Some(StopReason::Deadline) => Problem::deadline_exceeded(),
        Some(StopReason::Cancelled) => Problem::cancelled(),
        // The same answer as a refusal at admission: the circuit (or an isolation switch) may
        // open between a request's admission and its first attempt.
        Some(StopReason::CircuitOpen) => Problem::circuit_open(1),
        Some(StopReason::RetryBudget) => {
            Problem::upstream_unavailable("the route's retry budget is spent").retry_after(1)
        }
        Some(StopReason::TenantBudget) => {
            Problem::upstream_unavailable("your retry quota (the tenant's) is spent").retry_after(1)
        }
        Some(StopReason::UpstreamBudget) => {
            Problem::upstream_unavailable("the retry budget of its upstream, shared with other routes, is spent")
                .retry_after(1)
        }
        Some(StopReason::RetryAfterBeyondDeadline) => {
            Problem::upstream_unavailable("it asked to be called again later than the deadline allowed")
                .retry_after(1)
                .retryable()
        }
        // Not retryable: the operator holds retries back to spare the upstream, clients' own too.
        Some(StopReason::RetriesOff) => Problem::upstream_unavailable(&format!(
            "{could_not}, and an operator's retries_off switch holds back every retry"
        ))
        .retry_after(1),
        Some(StopReason::TakeoverCap) => Problem::upstream_unavailable(
            "the processes executing it stopped more often than worker.max_takeovers allows",
        )
        .retry_after(1),
        // Only the process that received the request held the credential; the client's next
        // request brings it again.
        Some(StopReason::CredentialUnavailable) => {
            Problem::upstream_unavailable("the credential it forwards was held only by the process that received it")
                .retryable()
        }
        Some(
            StopReason::Success
            | StopReason::FinalResponse
            | StopReason::UnsafeReplay
            | StopReason::AttemptCap
            | StopReason::StreamCut
            | StopReason::StreamIdleTimeout,
        )
        | None => Problem::upstream_unavailable(&could_not).retry_after(1),
    };
    problem.state(State::NotStarted)
}

/// A streamed answer as it arrives (docs/concepts.md): the upstream's status and headers, and its body
/// part by part. Its record is still `in_progress` while it flows; a cut ends the body visibly.
pub(super) fn streamed_response(streamed: Streamed) -> Response {
    let Streamed { status, headers, event_stream, reader } = streamed;
    let mut response = Response::new(stream::client_body(reader, event_stream));
    *response.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
    *response.headers_mut() = upstream::to_header_map(&headers);
    let headers = response.headers_mut();
    headers.insert(STATUS_HEADER, HeaderValue::from_static(State::InProgress.as_str()));
    headers.insert(SHOULD_RETRY_HEADER, HeaderValue::from_static("false"));
    response
}

/// A stored response, as the upstream gave it; replays are marked.
pub(super) fn stored_response(stored: &StoredResponse, replayed: bool) -> Response {
    let mut response = response_of(stored);
    mark_done(response.headers_mut(), replayed);
    response
}

/// Marks the answer of a done record: final, and a replay unless this request executed it.
pub(super) fn mark_done(headers: &mut HeaderMap, replayed: bool) {
    headers.insert(STATUS_HEADER, HeaderValue::from_static(State::Done.as_str()));
    headers.insert(SHOULD_RETRY_HEADER, HeaderValue::from_static("false"));
    if replayed {
        headers.insert(REPLAYED_HEADER, HeaderValue::from_static("true"));
    }
}

pub(super) fn response_of(stored: &StoredResponse) -> Response {
    let mut response = Response::new(Body::from(stored.body.clone()));
    *response.status_mut() = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::BAD_GATEWAY);
    *response.headers_mut() = upstream::to_header_map(&stored.headers);
    response
}

impl super::Ingress {
    /// A duplicate that waits, attached to its record's answer streaming through this process:
    /// it gets what was already sent, then follows live (docs/concepts.md).
    pub(super) fn attached(&self, record: &crate::record::Record) -> Option<Response> {
        let streamed = self.worker.attach(record.id)?;
        metrics::answered(&record.route, AnswerKind::Attached);
        let mut response = streamed_response(streamed);
        response.headers_mut().insert(REPLAYED_HEADER, HeaderValue::from_static("true"));
        Some(response)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_freed_request_is_told_what_stopped_it() {
        let retries_off = freed(Some(StopReason::RetriesOff), None);
        assert!(retries_off.detail.contains("retries_off"), "{}", retries_off.detail);
        assert!(!retries_off.retryable, "clients are held back with the broker's own retries");
        let takeovers = freed(Some(StopReason::TakeoverCap), None);
        assert!(takeovers.detail.contains("worker.max_takeovers"), "{}", takeovers.detail);
        let credential = freed(Some(StopReason::CredentialUnavailable), None);
        assert!(credential.detail.contains("credential"), "{}", credential.detail);
        assert!(credential.retryable, "the client's next request brings its credential and executes");
        for stop in StopReason::ALL {
            assert_eq!(freed(Some(stop), None).idempotency_status, Some(State::NotStarted), "{stop:?}");
        }
    }
}
