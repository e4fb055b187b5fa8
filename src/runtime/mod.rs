//! Each configured route's runtime state, in one place: what it can take (attempts in flight,
//! executions waiting for one, its retry budget), its upstream's circuit breaker, the pace of its
//! attempts (for a 409's estimate) and its replays and 409s counted for `/admin/stats`; beside
//! them, the retry budgets of tenants and named upstreams (`budgets`). Held with the
//! configuration it was built for in one [`Snapshot`], served by [`Live`] and swapped whole on
//! reload; a route that went away is dropped with it. A request resolves its [`ServedRoute`]
//! once and carries it to its end; admission control is checked there before anything is
//! recorded.

mod budgets;
mod live;
mod route;
pub(crate) mod switches;
pub(crate) use budgets::BudgetView;
pub(crate) use budgets::Charges;
use budgets::{SharedBudget, TenantBudgets};
pub use live::Live;
pub(crate) use route::ServedRoute;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::Semaphore;

use crate::config::{BudgetLimits, Config, Route};
use crate::domain::clock::SharedClock;
use crate::domain::{BudgetScope, Timestamp};
use crate::policy::{Breaker, BreakerState, RoutePace};
use crate::store::stats::AnswerCount;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The runtime's time: the broker's clock, read as an [`Instant`] for the budgets and breakers
/// that count in them, so that they move with a test's manual clock as with the system's.
#[derive(Clone)]
pub(crate) struct Ticks {
    clock: SharedClock,
    origin: (Instant, Timestamp),
}

impl Ticks {
    fn new(clock: SharedClock) -> Ticks {
        let origin = (Instant::now(), clock.now());
        Ticks { clock, origin }
    }

    pub(crate) fn now(&self) -> Instant {
        self.origin.0 + (self.clock.now() - self.origin.1)
    }
}

/// One configuration and the runtimes of its routes, built together and served together.
///
/// A reload builds the next snapshot from this one. What a route keeps across it: its guard
/// while its limits (`max_concurrency`, the retry budget) are unchanged, its breaker while its
/// upstream and circuit settings are, and always its pace and its counts; a tenant's or an
/// upstream's budget is kept while its limits are unchanged. An execution holds the snapshot it
/// started with to its end, so its attempts keep counting against the limits they started under.
pub struct Snapshot {
    config: Arc<Config>,
    /// Each route's, in the order of `config.routes`.
    routes: Vec<RouteRuntime>,
    /// By upstream ([`Route::upstream_key`]): routes that call the same upstream share its
    /// breaker, and a named upstream's retry budget.
    upstreams: HashMap<String, UpstreamRuntime>,
    tenants: TenantBudgets,
    ticks: Ticks,
}

#[derive(Clone)]
struct UpstreamRuntime {
    breaker: Arc<Mutex<Breaker>>,
    /// A named upstream's (`[[upstreams]]`); a route's URL has none of its own.
    budget: Option<Arc<SharedBudget>>,
}

/// One route's runtime state.
struct RouteRuntime {
    guard: Arc<RouteGuard>,
    upstream: UpstreamRuntime,
    /// What its attempts took here; `None` until it has had one.
    pace: Arc<Mutex<Option<RoutePace>>>,
    answers: Arc<AnswerCounts>,
    counters: crate::observe::metrics::RouteCounters,
}

/// Replays and 409s answered on a route since the counts were last taken.
#[derive(Default)]
struct AnswerCounts {
    replays: AtomicU64,
    conflicts: AtomicU64,
}

/// What a route can take: its attempts in flight, its executions waiting for one, its retry
/// budget.
pub(crate) struct RouteGuard {
    budget: Arc<SharedBudget>,
    /// Attempts in flight on the route (`max_concurrency`).
    pub(crate) attempts: Arc<Semaphore>,
    /// Executions admitted and not finished: those in flight plus those queued behind them.
    pub(crate) pending: AtomicUsize,
    pub(crate) max_pending: usize,
    /// What the guard was built from: a reload keeps the guard (its counts, its budget's
    /// window) while these stay the same.
    limits: (usize, f64, f64),
}

impl RouteGuard {
    fn new(route: &Route, now: Instant) -> RouteGuard {
        let r = route;
        RouteGuard {
            budget: Arc::new(SharedBudget::new(
                BudgetLimits { ratio: r.retry.budget_ratio, min_per_sec: r.retry.budget_min_per_sec },
                now,
            )),
            attempts: Arc::new(Semaphore::new(r.max_concurrency)),
            pending: AtomicUsize::new(0),
            max_pending: r.max_concurrency + queue_bound(r.max_concurrency),
            limits: RouteGuard::limits_of(r),
        }
    }

    fn limits_of(route: &Route) -> (usize, f64, f64) {
        (route.max_concurrency, route.retry.budget_ratio, route.retry.budget_min_per_sec)
    }
}

/// An execution's place on its route; the route counts it until this is dropped.
pub struct Slot(Arc<RouteGuard>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.pending.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Why the ingress refuses to start an execution.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The route's attempts and its queue are full.
    Overloaded,
    /// The upstream's circuit is open; ask again after this long.
    CircuitOpen(Duration),
    /// An operator's `isolate` switch holds the route, as an open circuit would; ask again
    /// after this long.
    Isolated(Duration),
}

/// Executions may queue behind a full route up to a quarter of `max_concurrency` (at least 4).
fn queue_bound(max_concurrency: usize) -> usize {
    (max_concurrency / 4).max(4)
}

impl Snapshot {
    /// The runtimes of `config`'s routes, all fresh.
    fn first(config: Arc<Config>, ticks: Ticks) -> Snapshot {
        Snapshot::build(config, ticks, None)
    }

    /// The runtimes of `config`'s routes, each keeping what it may keep of its runtime here.
    fn next(&self, config: Arc<Config>) -> Snapshot {
        Snapshot::build(config, self.ticks.clone(), Some(self))
    }

    fn build(config: Arc<Config>, ticks: Ticks, before: Option<&Snapshot>) -> Snapshot {
        let now = ticks.now();
        let mut upstreams: HashMap<String, UpstreamRuntime> = HashMap::new();
        // Routes that share an upstream share its breaker, with the settings of the first.
        for r in &config.routes {
            let key = r.upstream_key();
            if upstreams.contains_key(key) {
                continue;
            }
            let before = before.and_then(|s| s.upstreams.get(key));
            let breaker = match before {
                Some(u) if lock(&u.breaker).settings() == r.circuit => u.breaker.clone(),
                _ => Arc::new(Mutex::new(Breaker::new(r.circuit))),
            };
            let limits = r.upstream_name.as_deref().and_then(|name| config.upstream_named(name)).map(|u| u.budget);
            let budget = limits.map(|limits| match before.and_then(|u| u.budget.clone()) {
                Some(kept) if kept.limits() == limits => kept,
                _ => Arc::new(SharedBudget::new(limits, now)),
            });
            upstreams.insert(key.to_string(), UpstreamRuntime { breaker, budget });
        }
        let routes = (config.routes.iter())
            .map(|r| {
                let before = before.and_then(|s| s.runtime_named(&r.name));
                let guard = match before {
                    Some(b) if b.guard.limits == RouteGuard::limits_of(r) => b.guard.clone(),
                    _ => Arc::new(RouteGuard::new(r, now)),
                };
                RouteRuntime {
                    guard,
                    upstream: upstreams[r.upstream_key()].clone(),
                    pace: before.map(|b| b.pace.clone()).unwrap_or_default(),
                    answers: before.map(|b| b.answers.clone()).unwrap_or_default(),
                    counters: crate::observe::metrics::RouteCounters::new(&r.name),
                }
            })
            .collect();
        let fresh = TenantBudgets::default();
        let tenants = before.map_or(&fresh, |s| &s.tenants).reconfigured(&config);
        Snapshot { config, routes, upstreams, tenants, ticks }
    }

    /// The configuration this snapshot serves.
    pub fn config(&self) -> &Arc<Config> {
        &self.config
    }

    /// The route for `path` ([`Config::position_for`]), with its runtime.
    pub fn route_for(self: &Arc<Self>, path: &str) -> Option<ServedRoute> {
        self.config.position_for(path).map(|index| ServedRoute::new(self.clone(), index))
    }

    /// The route called `name`, with its runtime; `None` when this configuration has none (a
    /// record's route, removed since it was recorded).
    pub fn route_named(self: &Arc<Self>, name: &str) -> Option<ServedRoute> {
        self.config.position_named(name).map(|index| ServedRoute::new(self.clone(), index))
    }

    fn runtime_named(&self, name: &str) -> Option<&RouteRuntime> {
        self.config.position_named(name).map(|i| &self.routes[i])
    }

    /// Every retry budget on this node as it stands now: the routes', the named upstreams',
    /// and those of the tenants that have made a request since it started.
    pub fn budget_views(&self) -> Vec<BudgetView> {
        let now = self.ticks.now();
        let mut views: Vec<BudgetView> = (self.config.routes.iter().zip(&self.routes))
            .map(|(route, r)| r.guard.budget.view(BudgetScope::Route, &route.name, now))
            .collect();
        views.sort_by(|a, b| a.name.cmp(&b.name));
        let mut upstreams: Vec<BudgetView> = (self.upstreams.iter())
            .filter_map(|(name, u)| u.budget.as_ref().map(|b| b.view(BudgetScope::Upstream, name, now)))
            .collect();
        upstreams.sort_by(|a, b| a.name.cmp(&b.name));
        views.extend(upstreams);
        views.extend(self.tenants.views(now));
        views
    }

    pub fn breaker_states(&self) -> Vec<(String, BreakerState)> {
        let now = self.ticks.now();
        self.upstreams.iter().map(|(u, r)| (u.clone(), lock(&r.breaker).state(now))).collect()
    }

    /// Takes the replays and 409s counted so far, as the counts of the second `now` falls in;
    /// nothing for routes with nothing counted.
    pub fn take_answer_counts(&self, now: Timestamp) -> Vec<AnswerCount> {
        let second = Timestamp::from_millis(now.as_millis() - now.as_millis().rem_euclid(1000));
        (self.config.routes.iter().zip(&self.routes))
            .filter_map(|(route, r)| {
                let replays = r.answers.replays.swap(0, Ordering::Relaxed);
                let conflicts = r.answers.conflicts.swap(0, Ordering::Relaxed);
                (replays + conflicts > 0).then(|| AnswerCount { route: route.name.clone(), second, replays, conflicts })
            })
            .collect()
    }

    /// Hands back counts the store did not take, to go with the next flush.
    pub fn restore_answer_counts(&self, counts: &[AnswerCount]) {
        for c in counts {
            if let Some(r) = self.runtime_named(&c.route) {
                r.answers.replays.fetch_add(c.replays, Ordering::Relaxed);
                r.answers.conflicts.fetch_add(c.conflicts, Ordering::Relaxed);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::Tenant;

    fn config(routes: &[(&str, &str, &str)]) -> Config {
        Config::parse_with_env(&routes_text(routes), |_| None).unwrap()
    }

    fn routes_text(routes: &[(&str, &str, &str)]) -> String {
        routes
            .iter()
            .map(|(name, upstream, extra)| {
                format!(
                    "[[routes]]\nname = \"{name}\"\npath_prefix = \"/{name}\"\nupstream = \"{upstream}\"\n{extra}\n"
                )
            })
            .collect()
    }

    fn served(live: &Live, name: &str) -> Option<ServedRoute> {
        live.served().route_named(name)
    }

    #[test]
    fn a_reload_swaps_every_route_runtime_at_once_keeping_what_each_may_keep() {
        let before = config(&[("payments", "http://127.0.0.1:9", ""), ("ledger", "http://127.0.0.1:9", "")]);
        let live = Live::new(before, crate::domain::clock::system());
        let payments = served(&live, "payments").unwrap();
        payments.observe(Duration::from_millis(40));
        served(&live, "ledger").unwrap().observe(Duration::from_millis(70));

        // payments changes its limits, ledger goes, tickets comes.
        live.reconfigure(Arc::new(config(&[
            ("payments", "http://127.0.0.1:9", "max_concurrency = 3"),
            ("tickets", "http://127.0.0.1:9", ""),
        ])));
        let now = served(&live, "payments").unwrap();
        assert!(!Arc::ptr_eq(payments.guard(), now.guard()), "new limits, a new guard");
        assert_eq!(now.pace().map(|p| p.typical), Some(Duration::from_millis(40)), "the pace stays");
        assert!(served(&live, "ledger").is_none(), "a route that went is dropped whole");
        assert_eq!(served(&live, "tickets").unwrap().pace(), None, "a new route starts afresh");
        // What resolved the route before the reload keeps the snapshot it was resolved in.
        assert_eq!(payments.max_concurrency, 256);
        assert_eq!(payments.guard().max_pending, 256 + 64);
    }

    #[test]
    fn a_retry_is_charged_to_its_route_its_named_upstream_and_its_tenant() {
        let text = "[auth]\ntenant_retry_budget_ratio = 0.0\ntenant_retry_budget_min_per_sec = 0.3\n\
                    [[upstreams]]\nname = \"provider\"\nurl = \"http://127.0.0.1:9\"\nbudget_ratio = 0.0\nbudget_min_per_sec = 0.5\n";
        let routes = routes_text(&[("payments", "provider", ""), ("refunds", "provider", "")]);
        let c = Config::parse_with_env(&format!("{text}{routes}"), |_| None).unwrap();
        let live = Live::new(c, crate::domain::clock::system());
        let (acme, globex) = (Tenant::from("acme"), Tenant::from("globex"));
        let take = |route: &str, tenant: &Tenant| served(&live, route).unwrap().charges(tenant).take_retry();
        // acme's quota is 3 retries a window; globex's is its own.
        assert_eq!(
            (0..4).map(|_| take("payments", &acme)).collect::<Vec<_>>(),
            [Ok(()), Ok(()), Ok(()), Err(BudgetScope::Tenant)]
        );
        // The upstream allows 5 over both routes: globex's retries on refunds find 2 of them left.
        assert_eq!(
            (0..3).map(|_| take("refunds", &globex)).collect::<Vec<_>>(),
            [Ok(()), Ok(()), Err(BudgetScope::Upstream)]
        );
        let views = live.served().budget_views();
        let view = |scope: &str, name: &str| views.iter().find(|v| v.scope == scope && v.name == name).unwrap();
        assert_eq!((view("upstream", "provider").retries, view("upstream", "provider").refused_total), (5, 1));
        assert_eq!((view("tenant", "acme").retries, view("tenant", "acme").refused_total), (3, 1));
        assert_eq!(view("route", "refunds").retries, 2, "a refused retry took nothing from the route");

        // A reload that changes acme's quota gives it a fresh one; the upstream's, unchanged, is kept.
        let reloaded = text.replace("0.3", "0.6");
        live.reconfigure(Arc::new(Config::parse_with_env(&format!("{reloaded}{routes}"), |_| None).unwrap()));
        assert_eq!(take("payments", &acme), Err(BudgetScope::Upstream), "the upstream's budget is still spent");
        let views = live.served().budget_views();
        let acme_view = views.iter().find(|v| v.scope == "tenant" && v.name == "acme").unwrap();
        assert_eq!((acme_view.min_per_sec, acme_view.retries), (0.6, 0));
    }

    #[test]
    fn routes_that_call_one_upstream_share_its_breaker() {
        let circuit = "[routes.circuit]\nfailures = 2\nopen_for = \"30s\"";
        let c = config(&[("payments", "http://127.0.0.1:9", circuit), ("refunds", "http://127.0.0.1:9", circuit)]);
        let live = Live::new(c, crate::domain::clock::system());
        let payments = served(&live, "payments").unwrap();
        payments.record_outcome(false);
        payments.record_outcome(false);
        assert!(served(&live, "refunds").unwrap().circuit_open(), "the upstream is down for every route that calls it");
        assert_eq!(live.served().breaker_states().len(), 1);
    }
}
