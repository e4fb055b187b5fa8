//! `POST /admin/requests/bulk`: one operator action over every record a filter matches, planned
//! first (`dry_run`: how many, and a sample) and then applied record by record through the same
//! store calls as the single-record actions, so each record gets its own history entry.

use std::sync::Arc;
use std::time::UNIX_EPOCH;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::Bytes;
use serde::Deserialize;
use serde_json::{json, Value};
use uuid::Uuid;

use super::{apply_cancel, apply_resolve, apply_retry, json_body, store_problem, Admin, Attribution};
use crate::domain::{RouteName, State as RecordState, Tenant, Timestamp};
use crate::problem::Problem;
use crate::record::Record;
use crate::store::{Cursor, ListFilter, Resolution};

/// How many records one bulk call acts on unless it says otherwise; and at most.
const DEFAULT_LIMIT: u32 = 1000;
const MAX_LIMIT: u32 = 10_000;
/// Records shown by a dry run: enough to recognise what the filter caught.
const SAMPLE: usize = 10;
/// Records read per page while walking the matches.
const PAGE: u32 = 200;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct BulkBody {
    filter: Option<RawFilter>,
    action: Option<String>,
    #[serde(default)]
    dry_run: bool,
    limit: Option<i64>,
    actor: Option<String>,
    note: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFilter {
    state: Option<String>,
    route: Option<String>,
    tenant: Option<String>,
    created_after: Option<String>,
    created_before: Option<String>,
}

/// What a bulk call does to each record it matches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BulkAction {
    ResolveNotExecuted,
    Retry,
    Cancel,
}

impl BulkAction {
    pub const ALL: [BulkAction; 3] = [BulkAction::ResolveNotExecuted, BulkAction::Retry, BulkAction::Cancel];

    /// Its name in the API's `action`.
    pub fn as_str(self) -> &'static str {
        match self {
            BulkAction::ResolveNotExecuted => "resolve_not_executed",
            BulkAction::Retry => "retry",
            BulkAction::Cancel => "cancel",
        }
    }

    /// Its name as a command-line value: the API's, with dashes.
    pub fn flag(self) -> &'static str {
        match self {
            BulkAction::ResolveNotExecuted => "resolve-not-executed",
            BulkAction::Retry => "retry",
            BulkAction::Cancel => "cancel",
        }
    }

    pub fn parse(text: &str) -> Option<BulkAction> {
        BulkAction::ALL.into_iter().find(|a| a.as_str() == text)
    }
}

/// Which records a bulk call is about: the listing's filter, plus a window of creation times
/// (exclusive at both ends).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Filter {
    state: RecordState,
    route: Option<RouteName>,
    tenant: Option<Tenant>,
    created_after: Option<Timestamp>,
    created_before: Option<Timestamp>,
}

#[derive(Debug)]
struct Plan {
    filter: Filter,
    action: BulkAction,
    dry_run: bool,
    limit: u32,
}

fn bad_filter(field: &str, detail: impl std::fmt::Display) -> Problem {
    Problem::bad_request("invalid-filter", format!("filter.{field}: {detail}"))
}

fn time(field: &str, text: Option<String>) -> Result<Option<Timestamp>, Problem> {
    let Some(text) = text.filter(|t| !t.is_empty()) else {
        return Ok(None);
    };
    let at = humantime::parse_rfc3339_weak(&text)
        .map_err(|_| bad_filter(field, format!("`{text}` is not an RFC 3339 UTC time like 2024-05-01T12:00:00Z")))?;
    let ms = at.duration_since(UNIX_EPOCH).map_err(|_| bad_filter(field, format!("`{text}` is before 1970")))?;
    Ok(Some(Timestamp::EPOCH + ms))
}

impl Plan {
    fn parse(body: BulkBody) -> Result<(Plan, Attribution), Problem> {
        let raw = body.filter.ok_or_else(|| {
            Problem::bad_request("invalid-filter", "filter: give at least {\"state\": \"unknown\"} (or another state).")
        })?;
        // A bulk action over every record of every state is never what an operator means.
        let state = match raw.state.as_deref().filter(|s| !s.is_empty()) {
            None => return Err(bad_filter("state", "is required")),
            Some(s) => RecordState::parse(s).ok_or_else(|| {
                bad_filter("state", format!("`{s}` is not a state: use not_started, in_progress, done or unknown"))
            })?,
        };
        let filter = Filter {
            state,
            route: raw.route.filter(|s| !s.is_empty()).map(RouteName::from),
            tenant: raw.tenant.filter(|s| !s.is_empty()).map(Tenant::from),
            created_after: time("created_after", raw.created_after)?,
            created_before: time("created_before", raw.created_before)?,
        };
        if let (Some(after), Some(before)) = (filter.created_after, filter.created_before) {
            if after >= before {
                return Err(bad_filter("created_before", "must be later than created_after"));
            }
        }
        let action = match body.action.as_deref().and_then(BulkAction::parse) {
            Some(action) => action,
            None => {
                let names: Vec<String> = BulkAction::ALL.iter().map(|a| format!("\"{}\"", a.as_str())).collect();
                return Err(Problem::bad_request(
                    "invalid-action",
                    format!(
                        "action: {} is not one of {}.",
                        body.action.as_deref().map_or("a missing action".to_string(), |a| format!("`{a}`")),
                        names.join(", ")
                    ),
                ));
            }
        };
        let limit = match body.limit {
            None => DEFAULT_LIMIT,
            Some(n) if (1..=MAX_LIMIT as i64).contains(&n) => n as u32,
            Some(n) => {
                return Err(Problem::bad_request(
                    "invalid-limit",
                    format!("limit: {n} is not between 1 and {MAX_LIMIT}."),
                ))
            }
        };
        let who = Attribution { actor: body.actor, note: body.note };
        Ok((Plan { filter, action, dry_run: body.dry_run, limit }, who))
    }
}

/// The records the filter matches, oldest first, at most `limit`; and whether more match.
async fn matches(admin: &Admin, filter: &Filter, limit: u32) -> Result<(Vec<Record>, bool), Problem> {
    // Listings run by creation time, then id: the greatest id at `created_after` starts the walk
    // just after it.
    let mut cursor = filter.created_after.map(|at| Cursor { created_at: at, id: Uuid::max() });
    let mut found = Vec::new();
    loop {
        let query = ListFilter {
            state: Some(filter.state),
            route: filter.route.clone(),
            tenant: filter.tenant.clone(),
            limit: PAGE,
            cursor,
        };
        let page = admin.store.list(&query).await.map_err(store_problem)?;
        for record in page.items {
            if filter.created_before.is_some_and(|before| record.created_at >= before) {
                return Ok((found, false));
            }
            if found.len() as u32 == limit {
                return Ok((found, true));
            }
            found.push(record);
        }
        match page.next_cursor {
            Some(next) => cursor = Some(next),
            None => return Ok((found, false)),
        }
    }
}

pub(super) async fn bulk(State(admin): State<Arc<Admin>>, body: Bytes) -> Result<Response, Problem> {
    let (plan, who) = Plan::parse(json_body(&body)?)?;
    let (records, more) = matches(&admin, &plan.filter, plan.limit).await?;
    if plan.dry_run {
        let sample: Vec<Value> = records.iter().take(SAMPLE).map(|r| r.to_json(crate::record::View::Listed)).collect();
        return Ok(
            Json(json!({"dry_run": true, "count": records.len(), "more": more, "sample": sample})).into_response()
        );
    }
    let mut applied = 0u64;
    let mut refused = Vec::new();
    // One at a time, each through its own store call: a record that changed since it was
    // listed is refused on its own and the rest go on.
    for record in &records {
        let done = match plan.action {
            BulkAction::ResolveNotExecuted => apply_resolve(&admin, record.id, Resolution::NotExecuted, &who).await,
            BulkAction::Retry => apply_retry(&admin, record.id, &who).await,
            BulkAction::Cancel => apply_cancel(&admin, record.id, &who).await.map(|(record, _)| record),
        };
        match done {
            Ok(_) => applied += 1,
            // The store is in trouble: stop, and say how far it got.
            Err(problem) if problem.status.is_server_error() => {
                refused.push(json!({"id": record.id, "reason": problem.detail}));
                return Ok(Json(json!({
                    "dry_run": false, "matched": records.len(), "applied": applied, "refused": refused,
                    "more": more, "stopped": true,
                }))
                .into_response());
            }
            Err(problem) => refused.push(json!({"id": record.id, "reason": problem.detail})),
        }
    }
    Ok(Json(json!({
        "dry_run": false, "matched": records.len(), "applied": applied, "refused": refused, "more": more,
    }))
    .into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bulk_action_is_named_one_way_in_the_api_and_with_dashes_on_the_command_line() {
        for action in BulkAction::ALL {
            assert_eq!(BulkAction::parse(action.as_str()), Some(action));
            assert_eq!(action.flag().replace('-', "_"), action.as_str());
        }
        assert_eq!(BulkAction::parse("resolve-not-executed"), None, "the API takes its own spelling only");
    }

    fn plan(body: Value) -> Result<Plan, Problem> {
        let body: BulkBody =
            serde_json::from_value(body).map_err(|e| Problem::bad_request("invalid-body", e.to_string()))?;
        Plan::parse(body).map(|(plan, _)| plan)
    }

    fn refusal(body: Value) -> (String, String) {
        let p = plan(body).unwrap_err();
        (p.name.to_string(), p.detail)
    }

    #[test]
    fn a_plan_reads_its_filter_action_and_limit() {
        let p = plan(json!({
            "filter": {"state": "unknown", "route": "payments", "created_after": "2024-05-01T00:00:00Z",
                       "created_before": "2024-05-02T00:00:00.500Z"},
            "action": "resolve_not_executed", "dry_run": true,
        }))
        .unwrap();
        assert_eq!(p.filter.state, RecordState::Unknown);
        assert_eq!(p.filter.route.as_deref(), Some("payments"));
        assert_eq!(p.filter.created_after, Some(Timestamp::from_millis(1_714_521_600_000)));
        assert_eq!(p.filter.created_before, Some(Timestamp::from_millis(1_714_608_000_500)));
        assert_eq!((p.action, p.dry_run, p.limit), (BulkAction::ResolveNotExecuted, true, DEFAULT_LIMIT));
        let p = plan(json!({"filter": {"state": "in_progress"}, "action": "cancel", "limit": 5})).unwrap();
        assert_eq!((p.action, p.dry_run, p.limit), (BulkAction::Cancel, false, 5));
    }

    #[test]
    fn bad_plans_are_refused_naming_the_field() {
        for (body, name, field) in [
            (json!({"action": "retry"}), "invalid-filter", "filter"),
            (json!({"filter": {}, "action": "retry"}), "invalid-filter", "filter.state"),
            (json!({"filter": {"state": "lost"}, "action": "retry"}), "invalid-filter", "filter.state"),
            (
                json!({"filter": {"state": "unknown", "created_after": "yesterday"}, "action": "retry"}),
                "invalid-filter",
                "filter.created_after",
            ),
            (
                json!({"filter": {"state": "unknown", "created_after": "2024-05-02T00:00:00Z",
                                  "created_before": "2024-05-01T00:00:00Z"}, "action": "retry"}),
                "invalid-filter",
                "filter.created_before",
            ),
            (json!({"filter": {"state": "unknown"}}), "invalid-action", "action"),
            (json!({"filter": {"state": "unknown"}, "action": "delete"}), "invalid-action", "action"),
            (json!({"filter": {"state": "unknown"}, "action": "retry", "limit": 0}), "invalid-limit", "limit"),
            (json!({"filter": {"state": "unknown"}, "action": "retry", "limit": 99999}), "invalid-limit", "limit"),
            (json!({"filter": {"state": "unknown", "stat": "x"}, "action": "retry"}), "invalid-body", "stat"),
        ] {
            let (got, detail) = refusal(body.clone());
            assert_eq!(got, name, "{body}: {detail}");
            assert!(detail.contains(field), "{body}: {detail}");
        }
    }
}
