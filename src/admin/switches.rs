//! `/admin/switches` (docs/operations.md): the emergency switches an operator sets, lists and clears.
//!
//! - `POST /admin/switches` `{"scope","action","reason","expires_in"?,"actor"?}` → 201, the switch
//!   (and the one it replaced, if one of the same scope and action was on);
//! - `GET /admin/switches` → the active ones; `?history=true[&limit=N]` → every switch ever set,
//!   newest first, with who cleared it, when and why;
//! - `POST /admin/switches/{id}/clear` `{"reason","actor"?}` → the switch, cleared.
//!
//! The store is written first; then this node's view is read again at once, and every other
//! node's within its next refresh.

use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::Bytes;
use serde::Deserialize;
use serde_json::{json, Value};
use uuid::Uuid;

use super::{json_body, store_problem, Admin};
use crate::domain::switch::{ClearRequest, Invalid, SetRequest, Switch};
use crate::problem::Problem;
use crate::store::{SwitchCleared, MAX_HISTORY};

/// History rows shown unless the request asks for another number.
const DEFAULT_HISTORY: u32 = 100;

/// A switch request refused: 422, naming the field.
fn invalid(e: Invalid) -> Problem {
    Problem::invalid_switch(e.field, e.to_string())
}

fn switch_id(id: &str) -> Result<Uuid, Problem> {
    Uuid::parse_str(id).map_err(|_| Problem::bad_request("invalid-id", format!("`{id}` is not a switch id (a UUID).")))
}

/// Shows what was just written on this node at once, rather than at its next refresh. The write
/// stands whatever happens here; a failed read is logged and the upkeep reads again soon.
async fn show_now(admin: &Admin) {
    let _ = admin.switches.refresh(&*admin.store).await;
}

pub(super) async fn set(State(admin): State<Arc<Admin>>, body: Bytes) -> Result<Response, Problem> {
    let request: SetRequest = json_body(&body)?;
    let now = admin.clock.now();
    let switch = request
        .parse(Uuid::now_v7(), now, |name| admin.config.current().route_named(name).is_some())
        .map_err(invalid)?;
    let replaced = admin.store.set_switch(switch.clone()).await.map_err(store_problem)?;
    show_now(&admin).await;
    tracing::warn!(
        id = %switch.id,
        scope = switch.scope.as_str(),
        action = switch.action.as_str(),
        actor = %switch.actor,
        reason = %switch.reason,
        expires_at = switch.expires_at.map(crate::domain::Timestamp::as_millis),
        replaced = ?replaced.as_ref().map(|r| r.id),
        "emergency switch set"
    );
    let mut v = switch.to_json(now);
    v["replaced"] = replaced.map_or(Value::Null, |r| r.to_json(now));
    Ok((StatusCode::CREATED, Json(v)).into_response())
}

#[derive(Deserialize)]
pub(super) struct ListQuery {
    history: Option<String>,
    limit: Option<String>,
}

pub(super) async fn list(State(admin): State<Arc<Admin>>, Query(q): Query<ListQuery>) -> Result<Response, Problem> {
    let history = match q.history.as_deref().unwrap_or("false") {
        "true" | "1" => true,
        "false" | "0" | "" => false,
        other => {
            return Err(Problem::bad_request("invalid-filter", format!("history: `{other}` is not true or false.")))
        }
    };
    let limit = match q.limit.as_deref().filter(|l| !l.is_empty()) {
        None => DEFAULT_HISTORY,
        Some(text) => text.parse::<u32>().ok().filter(|n| (1..=MAX_HISTORY).contains(n)).ok_or_else(|| {
            Problem::bad_request("invalid-limit", format!("limit: `{text}` is not between 1 and {MAX_HISTORY}."))
        })?,
    };
    let now = admin.clock.now();
    let switches: Vec<Switch> =
        if history { admin.store.switch_history(limit).await } else { admin.store.active_switches(now).await }
            .map_err(store_problem)?;
    let items: Vec<Value> = switches.iter().map(|s| s.to_json(now)).collect();
    Ok(Json(json!({"items": items, "history": history})).into_response())
}

pub(super) async fn clear(
    State(admin): State<Arc<Admin>>,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<Response, Problem> {
    let id = switch_id(&id)?;
    let request: ClearRequest = json_body(&body)?;
    let now = admin.clock.now();
    let clearing = request.parse(now).map_err(invalid)?;
    match admin.store.clear_switch(crate::store::ClearSwitch { id, clearing }).await.map_err(store_problem)? {
        SwitchCleared::Cleared(switch) => {
            show_now(&admin).await;
            let cleared = switch.cleared.as_ref();
            tracing::warn!(
                id = %switch.id,
                scope = switch.scope.as_str(),
                action = switch.action.as_str(),
                actor = cleared.map(|c| c.actor.as_str()),
                reason = cleared.map(|c| c.reason.as_str()),
                "emergency switch cleared"
            );
            Ok(Json(switch.to_json(now)).into_response())
        }
        SwitchCleared::NotActive(switch) => Err(Problem::switch_not_active(switch.status(now).as_str())),
        SwitchCleared::Missing => Err(Problem::switch_not_found()),
    }
}
