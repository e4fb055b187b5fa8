//! Each configured route's runtime state, in one place: what it can take (attempts in flight,
//! executions waiting for one, its retry budget), its upstream's circuit breaker, the pace of its
//! attempts (for a 409's estimate) and its replays and 409s counted for `/admin/stats`; beside
//! them, the retry budgets of tenants and named upstreams ([`budgets`]). Built with each
//! configuration snapshot and swapped whole on reload; a route that went away is dropped with
//! it. Admission control is checked here before anything is recorded.

mod budgets;
pub use budgets::BudgetView;
pub(crate) use budgets::Charges;
use budgets::{SharedBudget, TenantBudgets};

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use tokio::sync::Semaphore;

use crate::clock::SharedClock;
use crate::config::{BudgetLimits, Config, Route};
use crate::domain::{BudgetScope, RouteName, Tenant, Timestamp};
use crate::policy::{Breaker, BreakerState, RoutePace};
use crate::store::stats::AnswerCount;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The runtimes of the routes configured now, shared by the ingress and the workers.
///
/// A reload builds a new set and swaps it in whole. What a route keeps across it: its guard while
/// its limits (`max_concurrency`, the retry budget) are unchanged, its breaker while its upstream
/// and circuit settings are, and always its pace and its counts; a tenant's or an upstream's
/// budget is kept while its limits are unchanged. An execution holds the guard it
/// started with to its end, so its attempts keep counting against the limits they started under.
pub struct Runtimes {
    current: RwLock<Arc<Snapshot>>,
    ticks: Ticks,
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

#[derive(Default)]
struct Snapshot {
    routes: HashMap<RouteName, Arc<RouteRuntime>>,
    /// By upstream ([`Route::upstream_key`]): routes that call the same upstream share its
    /// breaker, and a named upstream's retry budget.
    upstreams: HashMap<String, UpstreamRuntime>,
    tenants: TenantBudgets,
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
}

/// Executions may queue behind a full route up to a quarter of `max_concurrency` (at least 4).
fn queue_bound(max_concurrency: usize) -> usize {
    (max_concurrency / 4).max(4)
}

impl Runtimes {
    pub fn new(config: &Config, clock: SharedClock) -> Runtimes {
        let runtimes = Runtimes { current: RwLock::new(Arc::default()), ticks: Ticks::new(clock) };
        runtimes.reconfigure(config);
        runtimes
    }

    /// Builds the runtimes of `config`'s routes, keeping what each route may keep of its
    /// current one, and swaps them in.
    pub fn reconfigure(&self, config: &Config) {
        let now = self.ticks.now();
        let mut current = write(&self.current);
        let mut upstreams: HashMap<String, UpstreamRuntime> = HashMap::new();
        // Routes that share an upstream share its breaker, with the settings of the first.
        for r in &config.routes {
            let key = r.upstream_key();
            if upstreams.contains_key(key) {
                continue;
            }
            let before = current.upstreams.get(key);
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
        let routes = config
            .routes
            .iter()
            .map(|r| {
                let before = current.routes.get(&r.name);
                let guard = match before {
                    Some(b) if b.guard.limits == RouteGuard::limits_of(r) => b.guard.clone(),
                    _ => Arc::new(RouteGuard::new(r, now)),
                };
                let runtime = RouteRuntime {
                    guard,
                    upstream: upstreams[r.upstream_key()].clone(),
                    pace: before.map(|b| b.pace.clone()).unwrap_or_default(),
                    answers: before.map(|b| b.answers.clone()).unwrap_or_default(),
                };
                (r.name.clone(), Arc::new(runtime))
            })
            .collect();
        let tenants = current.tenants.reconfigured(config);
        *current = Arc::new(Snapshot { routes, upstreams, tenants });
    }

    fn snapshot(&self) -> Arc<Snapshot> {
        read(&self.current).clone()
    }

    fn runtime(&self, route: &str) -> Option<Arc<RouteRuntime>> {
        read(&self.current).routes.get(route).cloned()
    }

    /// The guard of `route` as configured now; for a route a reload removed since its request
    /// was read, one of its own, so that its execution is still bounded.
    pub(crate) fn guard_for(&self, route: &Route) -> Arc<RouteGuard> {
        match self.runtime(&route.name) {
            Some(r) => r.guard.clone(),
            None => Arc::new(RouteGuard::new(route, self.ticks.now())),
        }
    }

    pub(crate) fn guard_named(&self, route: &str) -> Option<Arc<RouteGuard>> {
        self.runtime(route).map(|r| r.guard.clone())
    }

    /// The breaker of `route`'s upstream: its runtime's, or for a route a reload removed, the
    /// one its upstream still has.
    fn breaker(&self, route: &Route) -> Option<Arc<Mutex<Breaker>>> {
        let current = read(&self.current);
        match current.routes.get(&route.name) {
            Some(r) => Some(r.upstream.breaker.clone()),
            None => current.upstreams.get(route.upstream_key()).map(|u| u.breaker.clone()),
        }
    }

    /// The budgets a new execution of `tenant` on `route` is charged to: its route's (the
    /// guard's), its named upstream's and its tenant's, as configured now.
    pub(crate) fn charges_for(&self, route: &Route, tenant: &Tenant) -> Charges {
        let guard = self.guard_for(route);
        let current = read(&self.current);
        let upstream = current.upstreams.get(route.upstream_key()).and_then(|u| u.budget.clone());
        let tenant = current.tenants.of(tenant, self.ticks.now());
        Charges { route: guard.budget.clone(), upstream, tenant, ticks: self.ticks.clone() }
    }

    /// Every retry budget on this node as it stands now: the routes', the named upstreams',
    /// and those of the tenants that have made a request since it started.
    pub fn budget_views(&self) -> Vec<BudgetView> {
        let now = self.ticks.now();
        let snapshot = self.snapshot();
        let mut views: Vec<BudgetView> =
            snapshot.routes.iter().map(|(name, r)| r.guard.budget.view(BudgetScope::Route, name, now)).collect();
        views.sort_by(|a, b| a.name.cmp(&b.name));
        let mut upstreams: Vec<BudgetView> = snapshot
            .upstreams
            .iter()
            .filter_map(|(name, u)| u.budget.as_ref().map(|b| b.view(BudgetScope::Upstream, name, now)))
            .collect();
        upstreams.sort_by(|a, b| a.name.cmp(&b.name));
        views.extend(upstreams);
        views.extend(snapshot.tenants.views(now));
        views
    }

    /// Takes a place for a new execution on `route`, unless the route or its upstream must shed it.
    pub fn enter(&self, route: &Route) -> Result<Slot, Refusal> {
        if let Some(breaker) = self.breaker(route) {
            lock(&breaker).admit(self.ticks.now()).map_err(Refusal::CircuitOpen)?;
        }
        let guard = self.guard_for(route);
        let before = guard.pending.fetch_add(1, Ordering::SeqCst);
        let slot = Slot(guard.clone());
        if before >= guard.max_pending {
            return Err(Refusal::Overloaded);
        }
        Ok(slot)
    }

    /// A place for an execution that did not come through the ingress (take-over, operator
    /// retry): counted, never refused.
    pub fn slot(&self, route: &str) -> Option<Slot> {
        let guard = self.guard_named(route)?;
        guard.pending.fetch_add(1, Ordering::SeqCst);
        Some(Slot(guard))
    }

    pub fn breaker_states(&self) -> Vec<(String, BreakerState)> {
        let now = self.ticks.now();
        self.snapshot().upstreams.iter().map(|(u, r)| (u.clone(), lock(&r.breaker).state(now))).collect()
    }

    pub(crate) fn circuit_open(&self, route: &Route) -> bool {
        self.breaker(route).is_some_and(|b| lock(&b).is_open(self.ticks.now()))
    }

    pub(crate) fn record_outcome(&self, route: &Route, success: bool) {
        if let Some(b) = self.breaker(route) {
            lock(&b).record(success, self.ticks.now());
        }
    }

    /// An attempt (or a streamed answer's first byte) on `route` took this long.
    pub(crate) fn observe(&self, route: &str, took: Duration) {
        if let Some(r) = self.runtime(route) {
            let mut pace = lock(&r.pace);
            match pace.as_mut() {
                Some(pace) => pace.observe(took),
                None => *pace = Some(RoutePace::first(took)),
            }
        }
    }

    /// What `route`'s attempts have taken here; `None` until it has had one.
    pub fn pace(&self, route: &str) -> Option<RoutePace> {
        self.runtime(route).and_then(|r| *lock(&r.pace))
    }

    /// A done answer replayed. A route no longer configured (a record's, from before a config
    /// change) is not counted.
    pub fn count_replay(&self, route: &str) {
        if let Some(r) = self.runtime(route) {
            r.answers.replays.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A 409 `request-in-progress`: a duplicate arrived while its key was being executed.
    pub fn count_conflict(&self, route: &str) {
        if let Some(r) = self.runtime(route) {
            r.answers.conflicts.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Takes the replays and 409s counted so far, as the counts of the second `now` falls in;
    /// nothing for routes with nothing counted.
    pub fn take_answer_counts(&self, now: Timestamp) -> Vec<AnswerCount> {
        let second = Timestamp::from_millis(now.as_millis() - now.as_millis().rem_euclid(1000));
        self.snapshot()
            .routes
            .iter()
            .filter_map(|(route, r)| {
                let replays = r.answers.replays.swap(0, Ordering::Relaxed);
                let conflicts = r.answers.conflicts.swap(0, Ordering::Relaxed);
                (replays + conflicts > 0).then(|| AnswerCount {
                    route: RouteName::from(route.as_str()),
                    second,
                    replays,
                    conflicts,
                })
            })
            .collect()
    }

    /// Hands back counts the store did not take, to go with the next flush.
    pub fn restore_answer_counts(&self, counts: &[AnswerCount]) {
        for c in counts {
            if let Some(r) = self.runtime(&c.route) {
                r.answers.replays.fetch_add(c.replays, Ordering::Relaxed);
                r.answers.conflicts.fetch_add(c.conflicts, Ordering::Relaxed);
            }
        }
    }
}

fn read<T>(l: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(|p| p.into_inner())
}

fn write<T>(l: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    l.write().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn a_reload_swaps_every_route_runtime_at_once_keeping_what_each_may_keep() {
        let before = config(&[("payments", "http://127.0.0.1:9", ""), ("ledger", "http://127.0.0.1:9", "")]);
        let runtimes = Runtimes::new(&before, crate::clock::system());
        runtimes.observe("payments", Duration::from_millis(40));
        runtimes.observe("ledger", Duration::from_millis(70));
        let guard = runtimes.guard_named("payments").unwrap();

        // payments changes its limits, ledger goes, tickets comes.
        runtimes.reconfigure(&config(&[
            ("payments", "http://127.0.0.1:9", "max_concurrency = 3"),
            ("tickets", "http://127.0.0.1:9", ""),
        ]));
        assert!(!Arc::ptr_eq(&guard, &runtimes.guard_named("payments").unwrap()), "new limits, a new guard");
        assert_eq!(runtimes.pace("payments").map(|p| p.typical), Some(Duration::from_millis(40)), "the pace stays");
        assert_eq!(runtimes.pace("ledger"), None, "a route that went is dropped whole");
        assert!(runtimes.guard_named("ledger").is_none());
        assert_eq!(runtimes.pace("tickets"), None, "a new route starts afresh");
    }

    #[test]
    fn a_retry_is_charged_to_its_route_its_named_upstream_and_its_tenant() {
        let text = "[auth]\ntenant_retry_budget_ratio = 0.0\ntenant_retry_budget_min_per_sec = 0.3\n\
                    [[upstreams]]\nname = \"provider\"\nurl = \"http://127.0.0.1:9\"\nbudget_ratio = 0.0\nbudget_min_per_sec = 0.5\n";
        let routes = routes_text(&[("payments", "provider", ""), ("refunds", "provider", "")]);
        let c = Config::parse_with_env(&format!("{text}{routes}"), |_| None).unwrap();
        let runtimes = Runtimes::new(&c, crate::clock::system());
        let (acme, globex) = (Tenant::from("acme"), Tenant::from("globex"));
        let take = |route: usize, tenant: &Tenant| runtimes.charges_for(&c.routes[route], tenant).take_retry();
        // acme's quota is 3 retries a window; globex's is its own.
        assert_eq!(
            (0..4).map(|_| take(0, &acme)).collect::<Vec<_>>(),
            [Ok(()), Ok(()), Ok(()), Err(BudgetScope::Tenant)]
        );
        // The upstream allows 5 over both routes: globex's retries on refunds find 2 of them left.
        assert_eq!((0..3).map(|_| take(1, &globex)).collect::<Vec<_>>(), [Ok(()), Ok(()), Err(BudgetScope::Upstream)]);
        let views = runtimes.budget_views();
        let view = |scope: &str, name: &str| views.iter().find(|v| v.scope == scope && v.name == name).unwrap();
        assert_eq!((view("upstream", "provider").retries, view("upstream", "provider").refused_total), (5, 1));
        assert_eq!((view("tenant", "acme").retries, view("tenant", "acme").refused_total), (3, 1));
        assert_eq!(view("route", "refunds").retries, 2, "a refused retry took nothing from the route");

        // A reload that changes acme's quota gives it a fresh one; the upstream's, unchanged, is kept.
        let reloaded = text.replace("0.3", "0.6");
        runtimes.reconfigure(&Config::parse_with_env(&format!("{reloaded}{routes}"), |_| None).unwrap());
        assert_eq!(take(0, &acme), Err(BudgetScope::Upstream), "the upstream's budget is still spent");
        let views = runtimes.budget_views();
        let acme_view = views.iter().find(|v| v.scope == "tenant" && v.name == "acme").unwrap();
        assert_eq!((acme_view.min_per_sec, acme_view.retries), (0.6, 0));
    }

    #[test]
    fn routes_that_call_one_upstream_share_its_breaker() {
        let circuit = "[routes.circuit]\nfailures = 2\nopen_for = \"30s\"";
        let c = config(&[("payments", "http://127.0.0.1:9", circuit), ("refunds", "http://127.0.0.1:9", circuit)]);
        let runtimes = Runtimes::new(&c, crate::clock::system());
        runtimes.record_outcome(&c.routes[0], false);
        runtimes.record_outcome(&c.routes[0], false);
        assert!(runtimes.circuit_open(&c.routes[1]), "the upstream is down for every route that calls it");
        assert_eq!(runtimes.breaker_states().len(), 1);
    }
}
