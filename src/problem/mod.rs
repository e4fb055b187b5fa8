//! Every answer the broker writes itself: RFC 9457 problem details, `type`
//! `urn:idem:problem:<name>`, with a `detail` that tells the client what to do next.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::domain::State;
use crate::store::StoreError;

mod admin;

pub const STATUS_HEADER: http::HeaderName = http::HeaderName::from_static("idempotency-status");
/// Whether the client's own retry logic should send the request again (`true`/`false`).
pub const SHOULD_RETRY_HEADER: http::HeaderName = http::HeaderName::from_static("x-should-retry");
/// `Retry-After` in milliseconds, for clients that can wait less than a second.
pub(crate) const RETRY_AFTER_MS_HEADER: http::HeaderName = http::HeaderName::from_static("retry-after-ms");

/// The names of [`Problem::outcome_unknown`] and [`Problem::store`], which some answers tell
/// apart from every other.
const OUTCOME_UNKNOWN: &str = "outcome-unknown";
const STORE_UNAVAILABLE: &str = "store-unavailable";

#[derive(Debug, Clone)]
pub(crate) struct Problem {
    pub status: StatusCode,
    pub name: &'static str,
    pub title: &'static str,
    pub detail: String,
    /// How long the client should wait before asking again, in milliseconds; `Retry-After`
    /// says it in whole seconds, at least one.
    pub retry_after_ms: Option<u64>,
    /// Can the same request, sent again later, get a better answer? Said as `x-should-retry`,
    /// which SDKs read to decide for themselves; false where the broker already retried.
    pub retryable: bool,
    /// Members particular to one problem (RFC 9457 extensions).
    pub extensions: Vec<(&'static str, serde_json::Value)>,
    /// The key the answer is for: named in the document with the URL of its record.
    /// Boxed, not a `String`: this keeps a `Problem` under the size at which a `Result` carrying
    /// it gets costly to move on every request.
    pub idempotency_key: Option<Box<str>>,
    /// The record's state, for answers on keyed routes.
    pub idempotency_status: Option<State>,
}

impl Problem {
    pub(crate) fn new(
        status: StatusCode,
        name: &'static str,
        title: &'static str,
        detail: impl Into<String>,
    ) -> Problem {
        Problem {
            status,
            name,
            title,
            detail: detail.into(),
            retry_after_ms: None,
            retryable: false,
            extensions: Vec::new(),
            idempotency_key: None,
            idempotency_status: None,
        }
    }

    pub(crate) fn retry_after(self, seconds: u64) -> Problem {
        self.retry_after_ms(seconds.max(1) * 1000)
    }

    pub(crate) fn retry_after_ms(mut self, ms: u64) -> Problem {
        self.retry_after_ms = Some(ms);
        self
    }

    /// Names the key the answer is for, and so the record a client can poll.
    pub(crate) fn for_key(mut self, key: &str) -> Problem {
        self.idempotency_key = Some(key.into());
        self
    }

    /// Sending the same request again later may succeed.
    pub(crate) fn retryable(mut self) -> Problem {
        self.retryable = true;
        self
    }

    pub(crate) fn state(mut self, state: State) -> Problem {
        self.idempotency_status = Some(state);
        self
    }

    pub(crate) fn missing_key() -> Problem {
        Problem::new(
            StatusCode::BAD_REQUEST,
            "missing-idempotency-key",
            "Idempotency-Key required",
            "This route has side effects: send an Idempotency-Key header (a unique value per operation, \
             e.g. a UUID) and reuse it when you retry the same operation.",
        )
    }

    pub(crate) fn missing_key_source(missing: &crate::domain::key::MissingSource) -> Problem {
        Problem::new(
            StatusCode::BAD_REQUEST,
            "missing-idempotency-key",
            "Idempotency-Key required",
            format!(
                "Refused: {missing}. Send an Idempotency-Key header, or include what the route derives the key \
                 from (see GET /_idem/routes)."
            ),
        )
    }

    pub(crate) fn invalid_key(why: &str) -> Problem {
        Problem::new(
            StatusCode::BAD_REQUEST,
            "invalid-idempotency-key",
            "Invalid Idempotency-Key",
            format!("{why}. Use 1 to 255 visible ASCII characters, bare or as a quoted string."),
        )
    }

    pub(crate) fn invalid_path(why: &crate::domain::path::InvalidPath) -> Problem {
        Problem::new(
            StatusCode::BAD_REQUEST,
            "invalid-path",
            "Invalid path",
            format!("Refused: {why}. Send the path as the resource's own, without `.` or `..` segments. Nothing was recorded or sent."),
        )
    }

    pub(crate) fn too_large(limit: usize) -> Problem {
        Problem::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload-too-large",
            "Request body too large",
            format!("This route accepts bodies up to {limit} bytes. Nothing was recorded."),
        )
    }

    pub(crate) fn unauthorized() -> Problem {
        Problem::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "Unauthorized",
            "Send your tenant's bearer token in the Authorization header.",
        )
    }

    pub(crate) fn no_route(path: &str) -> Problem {
        Problem::new(
            StatusCode::NOT_FOUND,
            "no-route",
            "No route",
            format!("No configured route matches the path `{path}`."),
        )
    }

    pub(crate) fn in_progress(retry_after: std::time::Duration) -> Problem {
        Problem::new(
            StatusCode::CONFLICT,
            "request-in-progress",
            "Request in progress",
            "A request with this Idempotency-Key is being executed. Retry after the indicated time with \
             the same key to get its outcome, or send `Prefer: wait=N` to wait for it.",
        )
        .retry_after_ms(retry_after.as_millis() as u64)
        .retryable()
    }

    pub(crate) fn key_reused() -> Problem {
        Problem::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "idempotency-key-reused",
            "Idempotency-Key reused",
            "This Idempotency-Key was already used for a different request (route, method, path, query \
             or body differ). Use a new key for a new operation.",
        )
    }

    pub(crate) fn result_expired(status: Option<u16>, completed_at: &str) -> Problem {
        let said = status.map_or("an answer".to_string(), |s| format!("status {s}"));
        let mut problem = Problem::new(
            StatusCode::GONE,
            "result-expired",
            "Result expired",
            format!(
                "This request already executed (it completed at {completed_at} with {status}), and its stored \
                 answer is past its retention. It will not be executed again: look the result up in your own \
                 records, or send a new key if you mean a new operation.",
                status = said
            ),
        );
        problem.extensions = vec![("original_status", status.into()), ("completed_at", completed_at.into())];
        problem
    }

    pub(crate) fn outcome_unknown() -> Problem {
        Problem::new(
            StatusCode::BAD_GATEWAY,
            OUTCOME_UNKNOWN,
            "Outcome unknown",
            "The upstream may or may not have executed this request, and sending it again could execute it \
             twice. It is queued for reconciliation and will not be re-sent until it is settled; ask again \
             with the same key later.",
        )
    }

    /// Whether this says the store could not be asked.
    pub(crate) fn is_store_unavailable(&self) -> bool {
        self.name == STORE_UNAVAILABLE
    }

    /// Whether this says the upstream may or may not have executed the request.
    pub(crate) fn is_outcome_unknown(&self) -> bool {
        self.name == OUTCOME_UNKNOWN
    }

    pub(crate) fn upstream_unavailable(reason: &str) -> Problem {
        Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "upstream-unavailable",
            "Upstream unavailable",
            format!(
                "The upstream did not execute the request ({reason}). The key is free: retry with the same \
                 key and it will be executed afresh."
            ),
        )
    }

    /// A streamed answer that ended short after its first byte reached the client (docs/concepts.md):
    /// `why` says what ended it; `replay_safe` decides what became of the key.
    pub(crate) fn stream_cut(why: &str, replay_safe: bool) -> Problem {
        let then = if replay_safe {
            "The route is replay-safe, so the key is free: send it again with the same key and it will be \
             executed afresh."
        } else {
            "The upstream may have executed it, so it will not be sent again: it waits for reconciliation, and \
             asking again with the same key tells you its outcome once settled."
        };
        Problem::new(
            StatusCode::BAD_GATEWAY,
            "stream-cut",
            "Stream cut",
            format!("The upstream's streamed answer ended before it was complete ({why}). {then}"),
        )
    }

    /// A duplicate of a done request whose streamed answer was longer than the route stores.
    pub(crate) fn response_not_stored() -> Problem {
        Problem::new(
            StatusCode::CONFLICT,
            "response-not-stored",
            "Response not stored",
            "This request was executed and its answer was streamed to the client that sent it, but the answer \
             was longer than the route's max_stored_body, so it was not stored and cannot be replayed. It will \
             not be executed again under this key.",
        )
        .state(State::Done)
    }

    pub(crate) fn deadline_exceeded() -> Problem {
        Problem::new(
            StatusCode::GATEWAY_TIMEOUT,
            "deadline-exceeded",
            "Deadline exceeded",
            "The request's deadline passed before the upstream gave a usable answer. Ask again with the same \
             key: you will get the stored outcome if there is one, or a fresh execution if the key is free.",
        )
    }

    pub(crate) fn cancelled() -> Problem {
        Problem::new(
            StatusCode::CONFLICT,
            "request-cancelled",
            "Request cancelled",
            "The request was cancelled before the upstream executed it. The key is free: send the request \
             again with the same key to execute it.",
        )
    }

    pub(crate) fn not_cancellable(state: State) -> Problem {
        Problem::new(
            StatusCode::CONFLICT,
            "request-not-cancellable",
            "Request cannot be cancelled",
            format!("The request is {}: there is nothing left to cancel.", state.as_str()),
        )
        .state(state)
    }

    pub(crate) fn overloaded() -> Problem {
        Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "overloaded",
            "Route overloaded",
            "This route has as many requests in flight and queued as it accepts. Nothing was recorded or \
             sent: retry after the indicated time with the same key.",
        )
        .retry_after(1)
        .retryable()
    }

    pub(crate) fn buffers_full() -> Problem {
        Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "overloaded",
            "Broker overloaded",
            "The broker holds as many request bodies in memory as it may. Nothing was recorded or sent: \
             retry after the indicated time with the same key.",
        )
        .retry_after(1)
        .retryable()
    }

    pub(crate) fn request_timeout() -> Problem {
        Problem::new(
            StatusCode::REQUEST_TIMEOUT,
            "request-timeout",
            "Request timeout",
            "The request body did not arrive in time: it stalled, or came too slowly to finish within the \
             route's deadline. The connection is closed; nothing was recorded or sent. Send the whole request \
             again with the same key.",
        )
    }

    pub(crate) fn circuit_open(retry_after: u64) -> Problem {
        Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "circuit-open",
            "Upstream circuit open",
            "The upstream has been failing, so requests to it are refused for a while to let it recover. \
             Nothing was sent and the key is free: retry after the indicated time with the same key.",
        )
        .retry_after(retry_after)
        .retryable()
    }

    pub(crate) fn not_found() -> Problem {
        Problem::new(
            StatusCode::NOT_FOUND,
            "request-not-found",
            "No such request",
            "No request with this key exists for your tenant (it may have expired).",
        )
    }

    /// What a store error means to the client, told as what it is: an outage is worth waiting
    /// out; a record another request or an operator changed first is answered by sending the
    /// request again; a record that cannot be read back is an operator's to look at, and no
    /// retry will help. In each, nothing was sent upstream by this request.
    pub(crate) fn store(e: &StoreError) -> Problem {
        e.log("a request was refused: the store failed");
        match e {
            StoreError::Unavailable(_) | StoreError::Failed { .. } => Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                STORE_UNAVAILABLE,
                "Store unavailable",
                "The broker cannot reach its database, so it cannot record the request safely; nothing was sent \
                 upstream. Retry later with the same key.",
            )
            .retry_after(1)
            .retryable(),
            StoreError::Refused(_) => Problem::new(
                StatusCode::CONFLICT,
                "record-changed",
                "Record changed",
                "The key's record changed while this request was being written (another request with the same \
                 key, or an operator, got there first); this request sent nothing upstream. Send it again with \
                 the same key: you get the record as it stands now.",
            )
            .retryable(),
            StoreError::Corrupt(_) | StoreError::Unreadable { .. } => Problem::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "record-unreadable",
                "Record unreadable",
                "The key's stored record cannot be read back, so the broker cannot tell what it holds; nothing \
                 was sent upstream. This needs an operator (the broker logged it); sending the request again \
                 will not help.",
            ),
        }
    }

    pub(crate) fn bad_request(name: &'static str, detail: impl Into<String>) -> Problem {
        Problem::new(StatusCode::BAD_REQUEST, name, "Bad request", detail)
    }

    /// The same problem, told with a detail that fits where it arose.
    pub(crate) fn with_detail(mut self, detail: impl Into<String>) -> Problem {
        self.detail = detail.into();
        self
    }
}

impl Problem {
    /// The problem document (RFC 9457), as sent.
    pub(crate) fn document(&self) -> String {
        let mut body = json!({
            "type": format!("urn:idem:problem:{}", self.name),
            "title": self.title,
            "status": self.status.as_u16(),
            "detail": self.detail,
            "retryable": self.retryable,
            // The shape SDKs of payment APIs read an error from, so they raise their own
            // idempotency error with this message rather than "invalid response".
            "error": { "type": "idempotency_error", "code": self.name, "message": self.detail },
        });
        if let Some(ms) = self.retry_after_ms {
            body["retry_after_ms"] = ms.into();
        }
        for (name, value) in &self.extensions {
            body[*name] = value.clone();
        }
        if let Some(key) = &self.idempotency_key {
            body["idempotency_key"] = key.as_ref().into();
            body["record"] = format!("/_idem/requests/{}", crate::domain::key::path_segment(key)).into();
        }
        body.to_string()
    }
}

/// Marks an answer the broker made itself, in the response's extensions: the access log tells
/// it from the upstream's, which may be a problem document too.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Made;

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let mut response = (self.status, self.document()).into_response();
        response.extensions_mut().insert(Made);
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/problem+json"));
        headers.insert(SHOULD_RETRY_HEADER, HeaderValue::from_static(if self.retryable { "true" } else { "false" }));
        // A client that fell silent mid-request gets its answer, and then the connection goes.
        if self.status == StatusCode::REQUEST_TIMEOUT {
            headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        if let Some(ms) = self.retry_after_ms {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(ms.div_ceil(1000).max(1)));
            headers.insert(RETRY_AFTER_MS_HEADER, HeaderValue::from(ms));
        }
        if let Some(state) = self.idempotency_status {
            headers.insert(STATUS_HEADER, HeaderValue::from_static(state.as_str()));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::Phase;
    use crate::record::{Event, Refused};

    /// A store error is told as what it is: an outage to wait out, a record changed first to
    /// send again for, a record that cannot be read to call an operator for.
    #[test]
    fn a_store_error_is_told_as_an_outage_a_changed_record_or_an_unreadable_one() {
        let outage = Problem::store(&StoreError::Unavailable("connection refused".into()));
        assert_eq!(
            (outage.status, outage.name, outage.retryable),
            (StatusCode::SERVICE_UNAVAILABLE, "store-unavailable", true)
        );
        assert_eq!(outage.retry_after_ms, Some(1000));
        assert!(outage.is_store_unavailable());

        let changed = Problem::store(&StoreError::Refused(Refused { from: Phase::Done, event: Event::Claim }));
        assert_eq!((changed.status, changed.name, changed.retryable), (StatusCode::CONFLICT, "record-changed", true));
        assert!(!changed.is_store_unavailable() && changed.detail.contains("Send it again with the same key"));

        let corrupt = Problem::store(&StoreError::Corrupt("state `sideways`".into()));
        assert_eq!(
            (corrupt.status, corrupt.name, corrupt.retryable),
            (StatusCode::INTERNAL_SERVER_ERROR, "record-unreadable", false)
        );
        assert!(corrupt.retry_after_ms.is_none() && corrupt.detail.contains("will not help"));
    }
}
