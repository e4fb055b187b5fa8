//! What is read from a request before it is recorded: its body, within the memory budget and
//! the deadline; the deadline the client asks for; the headers kept with the record.

use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;

use crate::config::{Forwarding, Route};
use crate::domain::AnswerKind;
use crate::edge::body::{self, BodyBudget, Held, ReadError};
use crate::observe::metrics;
use crate::policy::RetryPolicy;
use crate::problem::Problem;
use crate::upstream;

/// The request's deadline: its policy's, or less if the client asks for less in the route's
/// deadline header. A client cannot lengthen it, and a value it sends that is not whole
/// milliseconds is ignored.
pub(super) fn deadline(policy: &RetryPolicy, route: &Route, headers: &http::HeaderMap) -> Duration {
    let asked = upstream::client_deadline(headers, route.deadline_header.as_ref());
    asked.map_or(policy.deadline, |asked| asked.min(policy.deadline))
}

/// The request headers kept with the record, and sent by every attempt: the client's address
/// among them ([`upstream::forward`]). The client's deadline header is not among them: each
/// attempt sends its own limit in it instead.
pub(super) fn stored_headers(
    route: &Route,
    parts: &http::request::Parts,
    forwarding: &Forwarding,
) -> Vec<(String, String)> {
    let mut kept = upstream::forwardable_request_headers(&parts.headers, route.forward_idempotency_key);
    if let Some(name) = &route.deadline_header {
        kept.retain(|(n, _)| n != name.as_str());
    }
    upstream::forward(&mut kept, parts.extensions.get(), forwarding);
    kept
}

/// The whole body, and its share of the memory budget: keep that until the request is answered.
///
/// A body that keeps trickling in never falls silent for `body_timeout`, so its reading is also
/// bounded by the route's deadline, which counts from the request's arrival: a body that takes
/// longer has left no time to execute the request anyway.
pub(super) async fn read_body<'a>(
    body: Body,
    route: &Route,
    budget: &'a BodyBudget,
) -> Result<(Bytes, Held<'a>), Problem> {
    let read = tokio::time::timeout(route.retry.deadline, body::read(body, route.max_body, budget)).await;
    read.unwrap_or(Err(ReadError::TimedOut)).map_err(|e| match e {
        ReadError::TooLarge(limit) => Problem::too_large(limit),
        ReadError::TimedOut => Problem::request_timeout(),
        ReadError::Overloaded => {
            metrics::answered(&route.name, AnswerKind::BuffersFull);
            Problem::buffers_full()
        }
        ReadError::Unreadable(_) => {
            Problem::bad_request("unreadable-body", "The request body could not be read completely.")
        }
    })
}
