//! Every answer the broker writes itself: RFC 9457 problem details, `type`
//! `urn:idem:problem:<name>`, with a `detail` that tells the client what to do next.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::record::State;
use crate::store::StoreError;

pub const STATUS_HEADER: &str = "idempotency-status";

#[derive(Debug, Clone)]
pub struct Problem {
    pub status: StatusCode,
    pub name: &'static str,
    pub title: &'static str,
    pub detail: String,
    /// Seconds the client should wait before asking again.
    pub retry_after: Option<u64>,
    /// The record's state, for answers on keyed routes.
    pub idempotency_status: Option<State>,
}

impl Problem {
    pub fn new(status: StatusCode, name: &'static str, title: &'static str, detail: impl Into<String>) -> Problem {
        Problem { status, name, title, detail: detail.into(), retry_after: None, idempotency_status: None }
    }

    pub fn retry_after(mut self, seconds: u64) -> Problem {
        self.retry_after = Some(seconds.max(1));
        self
    }

    pub fn state(mut self, state: State) -> Problem {
        self.idempotency_status = Some(state);
        self
    }

    pub fn missing_key() -> Problem {
        Problem::new(
            StatusCode::BAD_REQUEST,
            "missing-idempotency-key",
            "Idempotency-Key required",
            "This route has side effects: send an Idempotency-Key header (a unique value per operation, \
             e.g. a UUID) and reuse it when you retry the same operation.",
        )
    }

    pub fn invalid_key(why: &str) -> Problem {
        Problem::new(
            StatusCode::BAD_REQUEST,
            "invalid-idempotency-key",
            "Invalid Idempotency-Key",
            format!("{why}. Use 1 to 255 visible ASCII characters, bare or as a quoted string."),
        )
    }

    pub fn too_large(limit: usize) -> Problem {
        Problem::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload-too-large",
            "Request body too large",
            format!("This route accepts bodies up to {limit} bytes. Nothing was recorded."),
        )
    }

    pub fn unauthorized() -> Problem {
        Problem::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "Unauthorized",
            "Send your tenant's bearer token in the Authorization header.",
        )
    }

    pub fn no_route(path: &str) -> Problem {
        Problem::new(
            StatusCode::NOT_FOUND,
            "no-route",
            "No route",
            format!("No configured route matches the path `{path}`."),
        )
    }

    pub fn in_progress(retry_after: u64) -> Problem {
        Problem::new(
            StatusCode::CONFLICT,
            "request-in-progress",
            "Request in progress",
            "A request with this Idempotency-Key is being executed. Retry after the indicated time with \
             the same key to get its outcome, or send `Prefer: wait=N` to wait for it.",
        )
        .retry_after(retry_after)
    }

    pub fn key_reused() -> Problem {
        Problem::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "idempotency-key-reused",
            "Idempotency-Key reused",
            "This Idempotency-Key was already used for a different request (route, method, path, query \
             or body differ). Use a new key for a new operation.",
        )
    }

    pub fn outcome_unknown() -> Problem {
        Problem::new(
            StatusCode::BAD_GATEWAY,
            "outcome-unknown",
            "Outcome unknown",
            "The upstream may or may not have executed this request, and sending it again could execute it \
             twice. It is queued for reconciliation and will not be re-sent until it is settled; ask again \
             with the same key later.",
        )
    }

    pub fn upstream_unavailable(reason: &str) -> Problem {
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

    pub fn deadline_exceeded() -> Problem {
        Problem::new(
            StatusCode::GATEWAY_TIMEOUT,
            "deadline-exceeded",
            "Deadline exceeded",
            "The request's deadline passed before the upstream gave a usable answer. Ask again with the same \
             key: you will get the stored outcome if there is one, or a fresh execution if the key is free.",
        )
    }

    pub fn cancelled() -> Problem {
        Problem::new(
            StatusCode::CONFLICT,
            "request-cancelled",
            "Request cancelled",
            "The request was cancelled before the upstream executed it. The key is free: send the request \
             again with the same key to execute it.",
        )
    }

    pub fn not_cancellable(state: State) -> Problem {
        Problem::new(
            StatusCode::CONFLICT,
            "request-not-cancellable",
            "Request cannot be cancelled",
            format!("The request is {}: there is nothing left to cancel.", state.as_str()),
        )
        .state(state)
    }

    pub fn overloaded() -> Problem {
        Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "overloaded",
            "Route overloaded",
            "This route has as many requests in flight and queued as it accepts. Nothing was recorded or \
             sent: retry after the indicated time with the same key.",
        )
        .retry_after(1)
    }

    pub fn circuit_open(retry_after: u64) -> Problem {
        Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "circuit-open",
            "Upstream circuit open",
            "The upstream has been failing, so requests to it are refused for a while to let it recover. \
             Nothing was recorded or sent: retry after the indicated time with the same key.",
        )
        .retry_after(retry_after)
    }

    pub fn not_found() -> Problem {
        Problem::new(
            StatusCode::NOT_FOUND,
            "request-not-found",
            "No such request",
            "No request with this key exists for your tenant (it may have expired).",
        )
    }

    pub fn store(e: &StoreError) -> Problem {
        e.log("a request was refused: the store failed");
        Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "store-unavailable",
            "Store unavailable",
            "The broker cannot reach its database, so it cannot record the request safely; nothing was sent \
             upstream. Retry later with the same key.",
        )
        .retry_after(1)
    }

    pub fn bad_request(name: &'static str, detail: impl Into<String>) -> Problem {
        Problem::new(StatusCode::BAD_REQUEST, name, "Bad request", detail)
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let body = json!({
            "type": format!("urn:idem:problem:{}", self.name),
            "title": self.title,
            "status": self.status.as_u16(),
            "detail": self.detail,
        });
        let mut response = (self.status, body.to_string()).into_response();
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/problem+json"));
        if let Some(seconds) = self.retry_after {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        if let Some(state) = self.idempotency_status {
            headers.insert(STATUS_HEADER, HeaderValue::from_static(state.as_str()));
        }
        response
    }
}
