//! The data plane's own endpoints: `GET`/`DELETE /_idem/requests/{key}` (a client's record,
//! waited on with `Prefer: wait=N`, or cancelled) and `GET /_idem/routes` (each route's key rules).

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, State as AxumState};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};

use super::Ingress;
use crate::domain::key::{IdempotencyKey, KeyError};
use crate::domain::Actor;
use crate::domain::HistoryAction;
use crate::domain::Phase;
use crate::ingress::credentials;
use crate::ingress::prefer::Prefer;
use crate::problem::{Problem, STATUS_HEADER};
use crate::record::{HistoryEntry, Record, View};
use crate::runtime::Snapshot;
use crate::store::Cancelled;

/// `served`: the configuration in force when the request arrived, as the access log read it.
async fn find(app: &Ingress, served: &Snapshot, headers: &HeaderMap, key: &str) -> Result<Record, Problem> {
    let config = served.config();
    let tenant = credentials::tenant(config, headers)?;
    let key = IdempotencyKey::parse(key).map_err(|e| match e {
        KeyError::Missing => Problem::missing_key(),
        KeyError::Invalid(why) => Problem::invalid_key(why),
    })?;
    app.records.live(config, &tenant, &key).await.map_err(|e| Problem::store(&e))?.ok_or_else(Problem::not_found)
}

fn record_response(status: StatusCode, record: &Record) -> Response {
    let mut response = (status, Json(record.to_json(View::Client))).into_response();
    response.headers_mut().insert(STATUS_HEADER, HeaderValue::from_static(record.state.as_str()));
    response
}

/// A handler's answer, a problem rendered like any other.
fn answered(answer: Result<Response, Problem>) -> Response {
    if answer.is_ok() {
        super::access::kind(super::access::Kind::Own);
    }
    answer.unwrap_or_else(IntoResponse::into_response)
}

pub(super) async fn show_request(
    AxumState(app): AxumState<Arc<Ingress>>,
    Extension(served): Extension<Arc<Snapshot>>,
    Path(key): Path<String>,
    headers: HeaderMap,
) -> Response {
    answered(show(&app, &served, &key, &headers).await)
}

async fn show(app: &Ingress, served: &Snapshot, key: &str, headers: &HeaderMap) -> Result<Response, Problem> {
    let mut record = find(app, served, headers, key).await?;
    // An agent can wait for the outcome instead of polling: `Prefer: wait=N`.
    if let (Some(wait), Phase::Queued | Phase::InProgress) = (Prefer::from_headers(headers).wait, record.phase()) {
        record = app.wait_for(&record, wait, false).await?.ok_or_else(Problem::not_found)?;
    }
    Ok(record_response(StatusCode::OK, &record))
}

/// `GET /_idem/routes`: each route's key rules, so a client (an agent) can tell which calls need
/// a key, how one is derived, and how long a result is replayed.
pub(super) async fn list_routes(Extension(served): Extension<Arc<Snapshot>>, headers: HeaderMap) -> Response {
    let config = served.config();
    if let Err(problem) = credentials::tenant(config, &headers) {
        return problem.into_response();
    }
    let h = |d: Duration| humantime::format_duration(d).to_string();
    let routes: Vec<serde_json::Value> = config
        .routes
        .iter()
        .map(|r| {
            serde_json::json!({
                "name": r.name,
                "kind": r.kind().as_str(),
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
                "policy_version": r.policy_version.as_str(),
            })
        })
        .collect();
    super::access::kind(super::access::Kind::Own);
    Json(serde_json::json!({ "routes": routes })).into_response()
}

pub(super) async fn cancel_request(
    AxumState(app): AxumState<Arc<Ingress>>,
    Extension(served): Extension<Arc<Snapshot>>,
    Path(key): Path<String>,
    headers: HeaderMap,
) -> Response {
    answered(cancel(&app, &served, &key, &headers).await)
}

async fn cancel(app: &Ingress, served: &Snapshot, key: &str, headers: &HeaderMap) -> Result<Response, Problem> {
    let record = find(app, served, headers, key).await?;
    let entry = HistoryEntry {
        at: app.clock.now(),
        actor: Actor::Client(Some(record.tenant.clone())),
        action: HistoryAction::Cancel,
        note: None,
    };
    match app.worker.cancel_record(record.id, entry).await.map_err(|e| Problem::store(&e))? {
        Cancelled::Dequeued(record) => Ok(record_response(StatusCode::OK, &record)),
        Cancelled::Flagged(record) => Ok(record_response(StatusCode::ACCEPTED, &record)),
        Cancelled::Refused(record) => Err(Problem::not_cancellable(record.state)),
        Cancelled::Missing => Err(Problem::not_found()),
    }
}
