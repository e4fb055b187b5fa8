//! The admin API's own answers (docs/operations.md): the operator is told what to do, like a
//! client.

use axum::http::StatusCode;
use serde_json::json;

use super::Problem;
use crate::domain::State;

impl Problem {
    pub(crate) fn admin_unauthorized() -> Problem {
        Problem::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "Unauthorized",
            "The admin API needs the admin bearer token (the value of the variable named by auth.admin_token_env).",
        )
    }

    /// `/readyz` while the store cannot be trusted with a request.
    pub(crate) fn not_ready(why: &dyn std::fmt::Display) -> Problem {
        Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "not-ready",
            "Not ready",
            format!("The store cannot record a request safely: {why}. New requests are refused until it can."),
        )
        .retry_after(1)
        .retryable()
    }

    /// The node is leaving (SIGTERM): it still answers, but a load balancer should send new
    /// requests elsewhere before its listeners close.
    pub(crate) fn draining(closes_in: std::time::Duration) -> Problem {
        Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "draining",
            "Draining",
            format!(
                "This node is shutting down: it still serves, but its listeners close in {closes_in:?}. Send new requests to another node."
            ),
        )
        .retryable()
    }

    /// An operator's action that the record's state does not allow: only `unknown` records are
    /// resolved or retried. `action` is the participle ("resolved", "retried").
    pub(crate) fn invalid_transition(state: State, action: &str) -> Problem {
        let why = match state {
            State::Done => "it is done: its response is final and replayed to every duplicate",
            State::InProgress => "it is in progress: wait for its outcome (or cancel it)",
            State::NotStarted => "it is not_started: nothing is uncertain about it",
            State::Unknown => "it is unknown",
        };
        Problem::new(
            StatusCode::CONFLICT,
            "invalid-transition",
            "Action not allowed in this state",
            format!("Only an unknown record can be {action}; this one cannot, because {why}."),
        )
        .state(state)
    }

    /// An operator's `not_executed` or retry of an `unknown` record while an attempt marked under
    /// it may still reach the upstream (docs/guarantees.md). `action` is the participle.
    pub(crate) fn attempt_in_flight(action: &str, left: std::time::Duration) -> Problem {
        Problem::new(
            StatusCode::CONFLICT,
            "attempt-in-flight",
            "An attempt may still reach the upstream",
            format!(
                "The record cannot be {action} yet: an attempt marked under it may still reach the upstream for \
                 another {} ms (its send window, its time limit and the clock margin). Saying now that it did not \
                 execute could let it execute twice; ask again after that.",
                left.as_millis()
            ),
        )
        .state(State::Unknown)
        .retry_after_ms(left.as_millis().min(u128::from(u64::MAX)) as u64)
        .retryable()
    }

    /// A retry of a record whose route the configuration in force no longer has.
    pub(crate) fn route_gone(route: &str) -> Problem {
        Problem::new(
            StatusCode::CONFLICT,
            "route-gone",
            "Route no longer configured",
            format!("The record's route `{route}` is not in the current config, so it cannot be sent."),
        )
    }

    pub(crate) fn route_not_found(route: &str) -> Problem {
        Problem::new(
            StatusCode::NOT_FOUND,
            "route-not-found",
            "No such route",
            format!("No route named `{route}` is configured."),
        )
    }

    pub(crate) fn switch_not_found() -> Problem {
        Problem::new(StatusCode::NOT_FOUND, "switch-not-found", "No such switch", "No switch has this id.")
    }

    /// A clear of a switch that is no longer on; `status` is what it is instead.
    pub(crate) fn switch_not_active(status: &str) -> Problem {
        Problem::new(
            StatusCode::CONFLICT,
            "switch-not-active",
            "Switch not active",
            format!("This switch is {status} already: there is nothing to clear."),
        )
    }

    /// A switch request refused: 422, naming the field (also as the document's `field` member).
    pub(crate) fn invalid_switch(field: &str, detail: impl Into<String>) -> Problem {
        let mut problem = Problem::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid-switch", "Invalid switch", detail);
        problem.extensions.push(("field", json!(field)));
        problem
    }

    /// A reload asked of a broker started without a file to read again.
    pub(crate) fn reload_unavailable(detail: impl Into<String>) -> Problem {
        Problem::new(StatusCode::CONFLICT, "reload-unavailable", "Nothing to reload", detail)
    }

    /// A configuration a reload refused whole: 422, naming the key at fault (also as the
    /// document's `key` member) when there is one.
    pub(crate) fn config_refused(detail: impl Into<String>, key: Option<&str>) -> Problem {
        let mut problem =
            Problem::new(StatusCode::UNPROCESSABLE_ENTITY, "config-refused", "Configuration refused", detail);
        if let Some(key) = key {
            problem.extensions.push(("key", json!(key)));
        }
        problem
    }
}
