//! `POST /admin/config/reload`: the configuration file read again, applied or refused (docs/configuration.md).

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use super::Admin;
use crate::problem::Problem;
use crate::upkeep::reload::{Applied, ReloadError};

/// Applied: what changed (routes added, changed with their old and new `policy_version`,
/// removed; other settings), when the configuration in force was loaded, and its routes. Refused:
/// a 422 problem whose detail, and `key` member, name the key at fault; nothing was applied.
pub(super) async fn reload(State(admin): State<Arc<Admin>>) -> Response {
    match admin.reloader.reload("POST /admin/config/reload").await {
        Ok(applied) => Json(applied_json(&applied)).into_response(),
        Err(e) => refusal(&e).into_response(),
    }
}

fn applied_json(applied: &Applied) -> serde_json::Value {
    let routes: Vec<_> = applied
        .config
        .routes
        .iter()
        .map(|r| json!({"name": r.name, "policy_version": r.policy_version.as_str()}))
        .collect();
    json!({
        "result": "applied",
        "loaded_at": humantime::format_rfc3339_millis(applied.loaded_at).to_string(),
        "changes": applied.changes.to_json(),
        "routes": routes,
    })
}

fn refusal(e: &ReloadError) -> Problem {
    let detail = format!("{}. The running configuration is kept; nothing of the file was applied.", e.detail());
    match e {
        ReloadError::NoFile => Problem::reload_unavailable(detail),
        ReloadError::Config(_) => Problem::config_refused(detail, e.key()),
    }
}
