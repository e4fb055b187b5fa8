//! `GET /admin/stats`: the curves of a retry storm, per route and step, computed from what the
//! store holds so that any node answers for the whole cluster. This module reads the query (a
//! window and a step that can be drawn) and answers; `series` does the arithmetic.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Query, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use super::series::assemble;
use super::Admin;
use crate::domain::{BudgetScope, RouteName, Timestamp};
use crate::problem::Problem;
use crate::runtime::BudgetView;
use crate::store::stats::StatsSpan;

/// The longest window: the answer counters are kept this long.
pub(crate) const MAX_WINDOW: Duration = crate::upkeep::tally::KEEP;
pub(crate) const MIN_STEP: Duration = Duration::from_secs(1);
/// Points per series at most: more than a chart can show, and each is a group in the query.
pub(crate) const MAX_POINTS: u64 = 1000;
const DEFAULT_WINDOW: Duration = Duration::from_secs(3600);
/// Without a step, the window is cut into about this many.
const DEFAULT_POINTS: u64 = 360;

/// A query parameter that cannot be honoured, and why; the answer names it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum BadStatsQuery {
    #[error("`window` {0}")]
    Window(String),
    #[error("`step` {0}")]
    Step(String),
}

impl BadStatsQuery {
    pub(crate) fn problem(&self) -> Problem {
        let name = match self {
            BadStatsQuery::Window(_) => "invalid-window",
            BadStatsQuery::Step(_) => "invalid-step",
        };
        Problem::bad_request(name, format!("{self}."))
    }
}

/// A window and a step that can be drawn: the step a whole number of seconds, at least
/// [`MIN_STEP`]; the window at most [`MAX_WINDOW`] and at most [`MAX_POINTS`] steps long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Resolution {
    window: Duration,
    step: Duration,
}

fn duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text.trim())
        .map_err(|_| format!("is `{text}`, not a duration: write it like 15m, 1h or 10s"))
}

impl Resolution {
    pub(crate) fn parse(window: Option<&str>, step: Option<&str>) -> Result<Resolution, BadStatsQuery> {
        let window = match window.filter(|w| !w.trim().is_empty()) {
            None => DEFAULT_WINDOW,
            Some(text) => duration(text).map_err(BadStatsQuery::Window)?,
        };
        if window.is_zero() || window > MAX_WINDOW {
            return Err(BadStatsQuery::Window(format!(
                "must be longer than 0 and at most {}",
                humantime::format_duration(MAX_WINDOW)
            )));
        }
        let step = match step.filter(|s| !s.trim().is_empty()) {
            None => Duration::from_secs(window.as_secs().div_ceil(DEFAULT_POINTS)).max(MIN_STEP),
            Some(text) => duration(text).map_err(BadStatsQuery::Step)?,
        };
        if step < MIN_STEP || step.subsec_nanos() != 0 {
            return Err(BadStatsQuery::Step("must be a whole number of seconds, at least 1s".into()));
        }
        if step > window {
            return Err(BadStatsQuery::Step("must not be longer than the window".into()));
        }
        let points = points(window, step);
        if points > MAX_POINTS {
            let least = window.as_secs().div_ceil(MAX_POINTS);
            return Err(BadStatsQuery::Step(format!(
                "cuts the window into {points} points, more than {MAX_POINTS}: use a step of at least {least}s"
            )));
        }
        Ok(Resolution { window, step })
    }

    /// The span to query at `now`: whole steps aligned on multiples of the step, the last one
    /// holding `now` (and still filling).
    pub(crate) fn span(&self, now: Timestamp, route: Option<RouteName>) -> StatsSpan {
        let step = self.step.as_secs() as i64 * 1000;
        let end = (now.as_millis().div_euclid(step) + 1) * step;
        let start = end - points(self.window, self.step) as i64 * step;
        StatsSpan {
            start: Timestamp::from_millis(start),
            end: Timestamp::from_millis(end),
            step: Duration::from_millis(step as u64),
            route,
        }
    }
}

fn points(window: Duration, step: Duration) -> u64 {
    window.as_millis().div_ceil(step.as_millis().max(1)) as u64
}

#[derive(Deserialize)]
pub(super) struct StatsQuery {
    window: Option<String>,
    step: Option<String>,
    route: Option<String>,
}

pub(super) async fn stats(State(admin): State<Arc<Admin>>, Query(q): Query<StatsQuery>) -> Result<Response, Problem> {
    let resolution = Resolution::parse(q.window.as_deref(), q.step.as_deref()).map_err(|e| e.problem())?;
    let route = q.route.filter(|r| !r.is_empty()).map(RouteName::from);
    let served = admin.config.served();
    let config = served.config();
    let routes: Vec<&str> = match &route {
        Some(name) if config.route_named(name).is_none() => return Err(Problem::route_not_found(name)),
        Some(name) => vec![name.as_str()],
        None => config.routes.iter().map(|r| r.name.as_str()).collect(),
    };
    let now = admin.clock.now();
    let span = resolution.span(now, route.clone());
    let rows = admin.store.stats(&span).await.map_err(|e| Problem::store(&e))?;
    let routes: Vec<Value> = assemble(&span, now, &routes, &rows)
        .into_iter()
        .map(|(name, series)| {
            let mut v = series.to_json();
            v["route"] = json!(name);
            v
        })
        .collect();
    Ok(Json(json!({
        "start": span.start.rfc3339(),
        "end": span.end.rfc3339(),
        "step_ms": span.step_ms(),
        "points": span.points(),
        "now": now.rfc3339(),
        "routes": routes,
        // Each retry budget's last 10 s on this node: whose retries a storm is spending.
        "budgets": budgets_spent_by(served.budget_views(), route.and_then(|r| config.route_named(&r))),
    }))
    .into_response())
}

/// The budgets a route's retries spend (its own, its named upstream's, the tenants' quotas), or
/// every budget without a route.
fn budgets_spent_by(views: Vec<BudgetView>, route: Option<&crate::config::Route>) -> Vec<BudgetView> {
    let Some(route) = route else { return views };
    views
        .into_iter()
        .filter(|v| {
            if v.scope == BudgetScope::Route.as_str() {
                v.name == route.name.as_str()
            } else if v.scope == BudgetScope::Upstream.as_str() {
                route.upstream_name.as_deref() == Some(v.name.as_str())
            } else {
                true
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::StatusCode;

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn window_and_step_default_to_an_hour_in_ten_second_steps() {
        assert_eq!(Resolution::parse(None, None), Ok(Resolution { window: secs(3600), step: secs(10) }));
        assert_eq!(Resolution::parse(Some("1h"), Some("10s")), Resolution::parse(Some(""), Some(" ")));
        // Without a step, a window gets about 360 points of whole seconds.
        assert_eq!(Resolution::parse(Some("15m"), None).unwrap().step, secs(3));
        assert_eq!(Resolution::parse(Some("7d"), None).unwrap().step, secs(1680));
        assert_eq!(Resolution::parse(Some("30s"), None).unwrap().step, secs(1));
        assert_eq!(Resolution::parse(Some("1h 30m"), Some("1m")).unwrap().window, secs(5400));
    }

    #[test]
    fn a_window_or_step_that_cannot_be_drawn_is_refused_naming_the_parameter() {
        let window = |w: &str| Resolution::parse(Some(w), Some("10s")).unwrap_err();
        let step = |s: &str| Resolution::parse(Some("1h"), Some(s)).unwrap_err();
        assert!(matches!(window("soon"), BadStatsQuery::Window(why) if why.contains("`soon`")));
        assert!(matches!(window("8d"), BadStatsQuery::Window(why) if why.contains("at most 7days")));
        assert!(matches!(window("0s"), BadStatsQuery::Window(_)));
        assert!(matches!(step("10"), BadStatsQuery::Step(why) if why.contains("not a duration")));
        assert!(matches!(step("500ms"), BadStatsQuery::Step(why) if why.contains("at least 1s")));
        assert!(matches!(step("1500ms"), BadStatsQuery::Step(why) if why.contains("whole number")));
        assert!(matches!(step("2h"), BadStatsQuery::Step(why) if why.contains("longer than the window")));
        assert!(
            matches!(step("1s"), BadStatsQuery::Step(why) if why.contains("3600 points") && why.contains("at least 4s"))
        );
        assert!(Resolution::parse(Some("1h"), Some("4s")).is_ok(), "900 points are fine");
        let problem = step("1s").problem();
        assert_eq!((problem.status, problem.name), (StatusCode::BAD_REQUEST, "invalid-step"));
        assert!(problem.detail.starts_with("`step` cuts the window"), "{}", problem.detail);
        assert_eq!(window("8d").problem().name, "invalid-window");
    }

    #[test]
    fn the_span_is_whole_aligned_steps_ending_with_the_one_now_falls_in() {
        let r = Resolution::parse(Some("1m"), Some("10s")).unwrap();
        let span = r.span(Timestamp::from_millis(1_000_123_456), Some("payments".into()));
        assert_eq!(span.step, Duration::from_secs(10));
        assert_eq!(span.end, Timestamp::from_millis(1_000_130_000));
        assert_eq!(span.start, Timestamp::from_millis(1_000_070_000));
        assert_eq!(span.route.as_deref(), Some("payments"));
        // A window that is not a whole number of steps is rounded up to one.
        let span = Resolution::parse(Some("25s"), Some("10s")).unwrap().span(Timestamp::EPOCH, None);
        assert_eq!((span.start.as_millis(), span.end.as_millis()), (-20_000, 10_000));
    }
}
