//! The admin listener (docs/operations.md): the operator API over records — listing, inspection, and the
//! actions that settle the reconciliation queue, one record at a time or in bulk — the per-route series of a retry storm
//! (`/admin/stats`), the emergency switches (`/admin/switches`), the console page that draws and
//! drives them, metrics, and health and readiness probes.

use std::sync::Arc;

use axum::extract::{Path, Query, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use base64::Engine;
use bytes::Bytes;
use secrecy::ExposeSecret;
use serde::Deserialize;
use serde_json::{json, Value};
use uuid::Uuid;

use crate::domain::clock::SharedClock;
use crate::domain::Actor;
use crate::domain::HistoryAction;
use crate::domain::RecordId;
use crate::domain::{RouteName, State as RecordState, Tenant, Timestamp};
use crate::edge::body::BodyBudget;
use crate::problem::Problem;
use crate::record::{header_text, HistoryEntry, Record, StoredResponse, View};
use crate::runtime::switches::Switches;
use crate::runtime::Live;
use crate::store;
use crate::store::{Action, Cancelled, Cursor, ListFilter, Resolution, Store};
use crate::upkeep::reload::Reloader;
use crate::worker::Worker;

pub mod bulk;
pub mod cli;
mod config;
pub mod health;
mod series;
pub(crate) mod stats;
mod switches;
mod tables;

/// The operator console: one static page that calls this API with the operator's token and
/// draws its charts itself. It needs no build step, fetches nothing from elsewhere and holds no
/// data of its own.
const CONSOLE: &str = include_str!("console.html");

pub struct Admin {
    /// The configuration in force; each call reads it once.
    config: Arc<Live>,
    /// `POST /admin/config/reload`.
    reloader: Arc<Reloader>,
    store: Arc<dyn Store>,
    /// Runs an operator's retry, and wakes whoever waits for a record an operator settled.
    worker: Worker,
    /// The data plane's request bodies in memory, for `/metrics`.
    bodies: Arc<BodyBudget>,
    /// This node's view of the emergency switches: refreshed at once after a set or a clear
    /// here, and exported as `idem_switch_active`.
    switches: Arc<Switches>,
    /// What time it is: for the audit trail, a retry's fresh deadline, the series and switches.
    clock: SharedClock,
    /// Set when the node starts leaving: `/readyz` then fails, while requests are still served.
    leaving: Leaving,
}

/// When the node's listeners close, once it has started leaving (SIGTERM): until then it serves,
/// and `/readyz` says it is draining, so that load balancers stop sending it new requests first.
#[derive(Clone, Default)]
pub struct Leaving(Arc<std::sync::Mutex<Option<tokio::time::Instant>>>);

impl Leaving {
    /// The node leaves: its listeners close in `closes_in`.
    pub fn start(&self, closes_in: std::time::Duration) {
        *self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner) =
            Some(tokio::time::Instant::now() + closes_in);
    }

    /// How long until the listeners close, once leaving.
    fn closes_in(&self) -> Option<std::time::Duration> {
        let at = *self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        at.map(|at| at.saturating_duration_since(tokio::time::Instant::now()))
    }
}

/// What an [`Admin`] is built on: the parts of the broker it shares with the others.
pub struct Parts {
    pub config: Arc<Live>,
    pub reloader: Arc<Reloader>,
    pub store: Arc<dyn Store>,
    pub worker: Worker,
    pub bodies: Arc<BodyBudget>,
    pub switches: Arc<Switches>,
    pub clock: SharedClock,
    pub leaving: Leaving,
}

impl Admin {
    pub fn new(parts: Parts) -> Admin {
        let Parts { config, reloader, store, worker, bodies, switches, clock, leaving } = parts;
        Admin { config, reloader, store, worker, bodies, switches, clock, leaving }
    }
}

pub fn router(admin: Arc<Admin>) -> Router {
    let api = Router::new()
        .route("/admin/requests", get(list))
        .route("/admin/requests/{id}", get(show))
        .route("/admin/requests/{id}/resolve", post(resolve))
        .route("/admin/requests/{id}/retry", post(retry))
        .route("/admin/requests/{id}/cancel", post(cancel))
        .route("/admin/requests/bulk", post(bulk::bulk))
        .route("/admin/stats", get(stats::stats))
        .route("/admin/node", get(node))
        .route("/admin/config/reload", post(config::reload))
        .route("/admin/switches", get(switches::list).post(switches::set))
        .route("/admin/switches/{id}/clear", post(switches::clear))
        .route_layer(middleware::from_fn_with_state(admin.clone(), require_token));
    Router::new()
        .route("/", get(|| async { Html(CONSOLE) }))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready))
        .route("/metrics", get(metrics))
        .merge(api)
        .with_state(admin)
}

/// Ready when the store can be trusted with a request: without it no request can be recorded
/// safely. Bounded in time, like the health check every node runs. Not ready once the node has
/// started leaving ([`Leaving`]).
async fn ready(State(admin): State<Arc<Admin>>) -> Response {
    if let Some(closes_in) = admin.leaving.closes_in() {
        return Problem::draining(closes_in).into_response();
    }
    match store::store_health(&*admin.store).await {
        Ok(()) => "ready\n".into_response(),
        Err(e) => Problem::not_ready(&e).into_response(),
    }
}

/// This node as it stands, whatever the store's state: what the console's banner shows. The
/// store's durability is what its database reported when it opened, not what was asked: an
/// operator checking `[store] sync` sees what holds. On PostgreSQL, the host serving the store,
/// its timeline and start, and how often the serving server changed (a failover) since the node started.
async fn node(State(admin): State<Arc<Admin>>) -> Response {
    let durability = admin.store.durability();
    let mut store = serde_json::json!({"sync": durability.sync.as_str(), "setting": durability.setting});
    if let Some(serving) = admin.store.serving() {
        store["host"] = serving.host.into();
        store["timeline"] = serving.timeline.into();
        store["started"] = serving.started.into();
        store["changes"] = serving.changes.into();
    }
    Json(serde_json::json!({
        "node": admin.worker.owner(),
        "unrecorded_outcomes": admin.worker.unrecorded_outcomes(),
        "store": store,
    }))
    .into_response()
}

/// Served whatever the store's state: during an outage the metrics are how it is seen.
async fn metrics(State(admin): State<Arc<Admin>>) -> Response {
    let counted = tokio::time::timeout(store::HEALTH_TIMEOUT, admin.store.count_by_phase()).await;
    let phases = match counted {
        Ok(Ok(phases)) => Some(phases),
        Ok(Err(e)) => {
            e.log("the records could not be counted for /metrics");
            None
        }
        Err(_) => None,
    };
    let served = admin.config.served();
    let routes: Vec<&str> = served.config().routes.iter().map(|r| r.name.as_str()).collect();
    let switches = admin.switches.render_metric(&routes, admin.clock.now());
    let circuits = served.breaker_states();
    let body = crate::observe::metrics::render(phases.as_deref(), &circuits, admin.bodies.held(), &switches);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], body).into_response()
}

/// With an admin token configured, every operator call must carry it as a bearer token.
async fn require_token(State(admin): State<Arc<Admin>>, request: Request, next: Next) -> Response {
    // The token of the configuration in force: a reload that changes it applies at once.
    if let Some(expected) = &admin.config.current().auth.admin_token {
        let given = crate::ingress::credentials::bearer(request.headers());
        let ok = given.is_some_and(|g| crate::ingress::credentials::same_secret(&g, expected.expose_secret()));
        if !ok {
            return Problem::admin_unauthorized().into_response();
        }
    }
    next.run(request).await
}

fn record_id(id: &str) -> Result<RecordId, Problem> {
    Uuid::parse_str(id)
        .map(RecordId)
        .map_err(|_| Problem::bad_request("invalid-id", format!("`{id}` is not a record id (a UUID).")))
}

/// No record has the id an operator named.
fn not_found() -> Problem {
    Problem::not_found().with_detail("No record has this id (it may have expired).")
}

fn refused(record: &Record, action: &str) -> Problem {
    Problem::invalid_transition(record.state, action)
}

fn record_json(record: &Record) -> Response {
    Json(record.to_json(View::Operator)).into_response()
}

fn store_problem(e: crate::store::StoreError) -> Problem {
    Problem::store(&e)
}

#[derive(Deserialize)]
struct ListQuery {
    state: Option<String>,
    route: Option<String>,
    tenant: Option<String>,
    limit: Option<u32>,
    cursor: Option<String>,
}

async fn list(State(admin): State<Arc<Admin>>, Query(q): Query<ListQuery>) -> Result<Response, Problem> {
    let state = match q.state.as_deref().filter(|s| !s.is_empty()) {
        None => None,
        Some(s) => Some(RecordState::parse(s).ok_or_else(|| {
            Problem::bad_request(
                "invalid-filter",
                format!("`{s}` is not a state: use not_started, in_progress, done or unknown."),
            )
        })?),
    };
    let cursor = match q.cursor.as_deref().filter(|c| !c.is_empty()) {
        None => None,
        Some(c) => Some(Cursor::decode(c).ok_or_else(|| {
            Problem::bad_request("invalid-cursor", "The cursor is not one this API returned as next_cursor.")
        })?),
    };
    let filter = ListFilter {
        state,
        route: q.route.filter(|s| !s.is_empty()).map(RouteName::from),
        tenant: q.tenant.filter(|s| !s.is_empty()).map(Tenant::from),
        limit: q.limit.unwrap_or(50).clamp(1, 1000),
        cursor,
    };
    let page = admin.store.list(&filter).await.map_err(store_problem)?;
    let items: Vec<Value> = page.items.iter().map(|r| r.to_json(View::Listed)).collect();
    Ok(Json(json!({"items": items, "next_cursor": page.next_cursor.map(|c| c.encode())})).into_response())
}

async fn show(State(admin): State<Arc<Admin>>, Path(id): Path<String>) -> Result<Response, Problem> {
    let id = record_id(&id)?;
    match admin.store.get(id).await.map_err(store_problem)? {
        Some(record) => Ok(record_json(&record)),
        None => Err(not_found()),
    }
}

/// Who did it and why, as the operator's request says; `actor` defaults to "admin".
#[derive(Deserialize, Default)]
struct Attribution {
    actor: Option<String>,
    note: Option<String>,
}

impl Attribution {
    /// The attribution of an action taken at `now`.
    fn at(&self, now: Timestamp) -> Stamped<'_> {
        Stamped { who: self, now }
    }
}

/// An [`Attribution`] and when the action it attributes is taken.
struct Stamped<'a> {
    who: &'a Attribution,
    now: Timestamp,
}

impl Stamped<'_> {
    /// The history entry the action leaves on the record.
    fn entry(&self, action: HistoryAction) -> HistoryEntry {
        HistoryEntry {
            at: self.now,
            actor: Actor::Operator(
                self.who.actor.clone().filter(|a| !a.trim().is_empty()).unwrap_or_else(|| "admin".into()),
            ),
            action,
            note: self.who.note.clone().filter(|n| !n.trim().is_empty()),
        }
    }
}

#[derive(Deserialize)]
struct ResolveBody {
    outcome: String,
    response: Option<ResponseBody>,
    #[serde(flatten)]
    who: Attribution,
}

#[derive(Deserialize)]
struct ResponseBody {
    status: u16,
    #[serde(default)]
    headers: serde_json::Map<String, Value>,
    body: Option<String>,
    body_base64: Option<String>,
}

impl ResponseBody {
    /// The operator's response, checked: a real status, header names and values HTTP accepts.
    fn into_stored(self) -> Result<StoredResponse, Problem> {
        let bad = |detail: String| Problem::bad_request("invalid-resolution", detail);
        if !(100..=599).contains(&self.status) {
            return Err(bad(format!("{} is not an HTTP status.", self.status)));
        }
        let mut headers = Vec::new();
        for (name, value) in self.headers {
            let values = match value {
                Value::String(s) => vec![s],
                Value::Array(list) => list
                    .into_iter()
                    .map(|v| v.as_str().map(str::to_string).ok_or(()))
                    .collect::<Result<_, _>>()
                    .map_err(|_| bad(format!("header `{name}` must be a string or a list of strings.")))?,
                _ => return Err(bad(format!("header `{name}` must be a string or a list of strings."))),
            };
            let lower = name.to_ascii_lowercase();
            if http::HeaderName::from_bytes(lower.as_bytes()).is_err() {
                return Err(bad(format!("`{name}` is not a header name.")));
            }
            for v in values {
                if http::HeaderValue::from_str(&v).is_err() {
                    return Err(bad(format!("the value of header `{name}` is not a valid header value.")));
                }
                headers.push((lower.clone(), header_text(v.as_bytes())));
            }
        }
        let body = match (self.body, self.body_base64) {
            (Some(_), Some(_)) => return Err(bad("give body or body_base64, not both.".into())),
            (Some(text), None) => Bytes::from(text),
            (None, Some(b64)) => Bytes::from(
                base64::engine::general_purpose::STANDARD
                    .decode(b64)
                    .map_err(|_| bad("body_base64 is not valid base64.".into()))?,
            ),
            (None, None) => Bytes::new(),
        };
        Ok(StoredResponse { status: self.status, headers, body })
    }
}

fn json_body<T: serde::de::DeserializeOwned>(body: &Bytes) -> Result<T, Problem> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return serde_json::from_str("{}").map_err(|e| Problem::bad_request("invalid-body", e.to_string()));
    }
    serde_json::from_slice(body)
        .map_err(|e| Problem::bad_request("invalid-body", format!("The body is not the expected JSON: {e}.")))
}

async fn resolve(State(admin): State<Arc<Admin>>, Path(id): Path<String>, body: Bytes) -> Result<Response, Problem> {
    let id = record_id(&id)?;
    let body: ResolveBody = json_body(&body)?;
    let resolution =
        match (body.outcome.as_str(), body.response) {
            ("executed", Some(response)) => Resolution::Executed(response.into_stored()?),
            ("executed", None) => return Err(Problem::bad_request(
                "invalid-resolution",
                "outcome \"executed\" needs the response to replay: {\"status\":…, \"headers\":{…}, \"body\":\"…\"}.",
            )),
            ("not_executed", None) => Resolution::NotExecuted,
            ("not_executed", Some(_)) => {
                return Err(Problem::bad_request("invalid-resolution", "outcome \"not_executed\" takes no response."))
            }
            (other, _) => {
                return Err(Problem::bad_request(
                    "invalid-resolution",
                    format!("`{other}` is not an outcome: use \"executed\" or \"not_executed\"."),
                ))
            }
        };
    let record = apply_resolve(&admin, id, resolution, &body.who).await?;
    Ok(record_json(&record))
}

/// Settles one `unknown` record as the operator says, and wakes whoever waits for it. The bulk
/// action calls this too, so each record it settles is audited as a single resolve would be.
async fn apply_resolve(
    admin: &Admin,
    id: RecordId,
    resolution: Resolution,
    who: &Attribution,
) -> Result<Record, Problem> {
    let action = match &resolution {
        Resolution::Executed(_) => HistoryAction::ResolveExecuted,
        Resolution::NotExecuted => HistoryAction::ResolveNotExecuted,
    };
    let who = who.at(admin.clock.now());
    match admin.worker.resolve_record(id, resolution, who.entry(action)).await.map_err(store_problem)? {
        Action::Applied(record) => Ok(record),
        Action::Refused(record) => Err(refused(&record, "resolved")),
        Action::InFlight(_, left) => Err(Problem::attempt_in_flight("resolved as not executed", left)),
        Action::Missing => Err(not_found()),
    }
}

async fn retry(State(admin): State<Arc<Admin>>, Path(id): Path<String>, body: Bytes) -> Result<Response, Problem> {
    let id = record_id(&id)?;
    let who: Attribution = json_body(&body)?;
    let record = apply_retry(&admin, id, &who).await?;
    Ok((StatusCode::ACCEPTED, Json(record.to_json(View::Operator))).into_response())
}

/// Queues one `unknown` record again with a fresh deadline and hands it to a worker.
async fn apply_retry(admin: &Admin, id: RecordId, who: &Attribution) -> Result<Record, Problem> {
    let Some(record) = admin.store.get(id).await.map_err(store_problem)? else {
        return Err(not_found());
    };
    let config = admin.config.current();
    let Some(route) = config.route_named(&record.route) else {
        return Err(Problem::route_gone(&record.route));
    };
    let who = who.at(admin.clock.now());
    let deadline_at = who.now + route.retry.deadline;
    match admin.worker.retry_record(id, deadline_at, who.entry(HistoryAction::Retry)).await.map_err(store_problem)? {
        Action::Applied(record) => Ok(record),
        Action::Refused(record) => Err(refused(&record, "retried")),
        Action::InFlight(_, left) => Err(Problem::attempt_in_flight("retried", left)),
        Action::Missing => Err(not_found()),
    }
}

async fn cancel(State(admin): State<Arc<Admin>>, Path(id): Path<String>, body: Bytes) -> Result<Response, Problem> {
    let id = record_id(&id)?;
    let who: Attribution = json_body(&body)?;
    match apply_cancel(&admin, id, &who).await? {
        (record, false) => Ok(record_json(&record)),
        (record, true) => Ok((StatusCode::ACCEPTED, Json(record.to_json(View::Operator))).into_response()),
    }
}

/// Cancels one record: a queued one at once, a running one when its worker next looks (the
/// flag is `true` then).
async fn apply_cancel(admin: &Admin, id: RecordId, who: &Attribution) -> Result<(Record, bool), Problem> {
    let who = who.at(admin.clock.now());
    match admin.worker.cancel_record(id, who.entry(HistoryAction::Cancel)).await.map_err(store_problem)? {
        Cancelled::Dequeued(record) => Ok((record, false)),
        Cancelled::Flagged(record) => Ok((record, true)),
        Cancelled::Refused(record) => Err(Problem::not_cancellable(record.state)),
        Cancelled::Missing => Err(not_found()),
    }
}
