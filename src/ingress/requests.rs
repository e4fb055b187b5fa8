//! The data plane's own endpoints: `GET`/`DELETE /_idem/requests/{key}` (a client's record,
//! waited on with `Prefer: wait=N`, or cancelled) and `GET /_idem/routes` (each route's key rules).

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, State as AxumState};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;

use super::Ingress;
use crate::credentials;
use crate::key::{IdempotencyKey, KeyError};
use crate::prefer::Prefer;
use crate::problem::{Problem, STATUS_HEADER};
use crate::record::{now_ms, HistoryEntry, Phase, Record};
use crate::store::Cancelled;

async fn find(app: &Ingress, headers: &HeaderMap, key: &str) -> Result<Record, Problem> {
    let tenant = credentials::tenant(&app.config, headers)?;
    let key = IdempotencyKey::parse(key).map_err(|e| match e {
        KeyError::Missing => Problem::missing_key(),
        KeyError::Invalid(why) => Problem::invalid_key(why),
    })?;
    match app.store.lookup(&tenant, key.as_str()).await {
        Ok(Some(record)) if !app.expired(&record) => Ok(record),
        Ok(_) => Err(Problem::not_found()),
        Err(e) => Err(Problem::store(&e)),
    }
}

fn record_response(status: StatusCode, record: &Record) -> Response {
    let mut response = (status, Json(record.to_json(true))).into_response();
    response.headers_mut().insert(STATUS_HEADER, HeaderValue::from_static(record.state.as_str()));
    response
}

pub(super) async fn show_request(
    AxumState(app): AxumState<Arc<Ingress>>,
    Path(key): Path<String>,
    headers: HeaderMap,
) -> Response {
    let record = match find(&app, &headers, &key).await {
        Ok(record) => record,
        Err(problem) => return problem.into_response(),
    };
    // An agent can wait for the outcome instead of polling: `Prefer: wait=N`.
    let wait = Prefer::from_headers(&headers).wait;
    let record = match (wait, record.phase()) {
        (Some(wait), Phase::Queued | Phase::InProgress) => match app.wait_for(record.id, wait).await {
            Ok(Some(settled)) => settled,
            Ok(None) => return Problem::not_found().into_response(),
            Err(problem) => return problem.into_response(),
        },
        _ => record,
    };
    record_response(StatusCode::OK, &record)
}

/// `GET /_idem/routes`: each route's key rules, so a client (an agent) can tell which calls need
/// a key, how one is derived, and how long a result is replayed.
pub(super) async fn list_routes(AxumState(app): AxumState<Arc<Ingress>>, headers: HeaderMap) -> Response {
    if let Err(problem) = credentials::tenant(&app.config, &headers) {
        return problem.into_response();
    }
    let h = |d: Duration| humantime::format_duration(d).to_string();
    let routes: Vec<serde_json::Value> = app
        .config
        .routes
        .iter()
        .map(|r| {
            serde_json::json!({
                "name": r.name,
                "path_prefix": r.path_prefix,
                "keyed_methods": r.methods.iter().map(|m| m.as_str()).collect::<Vec<_>>(),
                "require_key": r.require_key,
                "replay_safe": r.replay_safe,
                "retention": h(r.retention),
                "retention_seconds": r.retention.as_secs(),
                "tombstone": h(r.tombstone),
                "tombstone_seconds": r.tombstone.as_secs(),
                "max_body": r.max_body,
                "key_from": r.key_from.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
                "fingerprint_ignore": r.fingerprint_ignore,
            })
        })
        .collect();
    Json(serde_json::json!({ "routes": routes })).into_response()
}

pub(super) async fn cancel_request(
    AxumState(app): AxumState<Arc<Ingress>>,
    Path(key): Path<String>,
    headers: HeaderMap,
) -> Response {
    let record = match find(&app, &headers, &key).await {
        Ok(record) => record,
        Err(problem) => return problem.into_response(),
    };
    let entry =
        HistoryEntry { at: now_ms(), actor: format!("client:{}", record.tenant), action: "cancel".into(), note: None };
    match app.store.cancel(record.id, entry).await {
        Ok(Cancelled::Dequeued(record)) => {
            app.settled.settled(record.id);
            record_response(StatusCode::OK, &record)
        }
        Ok(Cancelled::Flagged(record)) => {
            app.worker.cancel(record.id);
            record_response(StatusCode::ACCEPTED, &record)
        }
        Ok(Cancelled::Refused(record)) => Problem::not_cancellable(record.state).into_response(),
        Ok(Cancelled::Missing) => Problem::not_found().into_response(),
        Err(e) => Problem::store(&e).into_response(),
    }
}
