//! The admin listener (SPEC §5): health and readiness probes for orchestrators.

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use axum::Router;

use crate::store::Store;

pub struct Admin {
    pub store: Arc<dyn Store>,
}

pub fn router(admin: Arc<Admin>) -> Router {
    Router::new().route("/healthz", get(|| async { "ok\n" })).route("/readyz", get(ready)).with_state(admin)
}

/// Ready when the store answers: without it no request can be recorded safely.
async fn ready(State(admin): State<Arc<Admin>>) -> (StatusCode, String) {
    match admin.store.ping().await {
        Ok(()) => (StatusCode::OK, "ready\n".into()),
        Err(e) => (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {e}\n")),
    }
}
