//! Admission control: what a route and its upstream can take — attempts in flight, executions
//! waiting for one, the retry budget and the circuit breaker — checked before anything is recorded.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use tokio::sync::Semaphore;

use crate::config::{Config, Route};
use crate::domain::RouteName;
use crate::policy::{Breaker, BreakerState, RetryBudget};

use super::lock;

/// The protections shared by the ingress and the workers: per route, a retry budget, a cap on
/// attempts in flight and a bound on executions waiting for one; per upstream, a breaker.
///
/// A reload replaces the guards of routes whose limits changed and drops those of routes that
/// went; an execution holds the guard it started with to its end, so its attempts keep counting
/// against the limits they started under (see [`Guards::reconfigure`]).
pub struct Guards {
    routes: RwLock<HashMap<RouteName, Arc<RouteGuard>>>,
    breakers: RwLock<HashMap<String, Arc<Mutex<Breaker>>>>,
}

pub(super) struct RouteGuard {
    pub(super) budget: Mutex<RetryBudget>,
    /// Attempts in flight on the route (`max_concurrency`).
    pub(super) attempts: Arc<Semaphore>,
    /// Executions admitted and not finished: those in flight plus those queued behind them.
    pub(super) pending: AtomicUsize,
    pub(super) max_pending: usize,
    /// What the guard was built from: a reload keeps the guard (its counts, its budget's
    /// window) while these stay the same.
    limits: (usize, f64, f64),
}

impl RouteGuard {
    fn new(route: &Route, now: Instant) -> RouteGuard {
        let r = route;
        RouteGuard {
            budget: Mutex::new(RetryBudget::new(r.retry.budget_ratio, r.retry.budget_min_per_sec, now)),
            attempts: Arc::new(Semaphore::new(r.max_concurrency)),
            pending: AtomicUsize::new(0),
            max_pending: r.max_concurrency + queue_bound(r.max_concurrency),
            limits: RouteGuard::limits_of(r),
        }
    }

    fn limits_of(route: &Route) -> (usize, f64, f64) {
        (route.max_concurrency, route.retry.budget_ratio, route.retry.budget_min_per_sec)
    }

    pub(super) fn first_attempt(&self) {
        lock(&self.budget).deposit(Instant::now());
    }

    pub(super) fn take_retry(&self) -> bool {
        lock(&self.budget).try_withdraw(Instant::now())
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

impl Guards {
    pub fn new(config: &Config) -> Guards {
        let guards = Guards { routes: RwLock::new(HashMap::new()), breakers: RwLock::new(HashMap::new()) };
        guards.reconfigure(config);
        guards
    }

    /// Brings the guards in line with `config`: a route whose limits (`max_concurrency`, the
    /// retry budget) are unchanged keeps its guard and its counts; a new or changed one gets a
    /// fresh guard; a removed one's guard lives on only in the executions that hold it. Each
    /// upstream keeps its breaker, and its state, unless its circuit settings changed.
    pub fn reconfigure(&self, config: &Config) {
        let now = Instant::now();
        let mut routes = write(&self.routes);
        let kept: HashMap<RouteName, Arc<RouteGuard>> = config
            .routes
            .iter()
            .map(|r| {
                let guard = match routes.get(&r.name) {
                    Some(g) if g.limits == RouteGuard::limits_of(r) => g.clone(),
                    _ => Arc::new(RouteGuard::new(r, now)),
                };
                (r.name.clone(), guard)
            })
            .collect();
        *routes = kept;
        drop(routes);
        let mut breakers = write(&self.breakers);
        let mut kept: HashMap<String, Arc<Mutex<Breaker>>> = HashMap::new();
        // Routes that share an upstream share its breaker, with the settings of the first.
        for r in &config.routes {
            if kept.contains_key(&r.upstream) {
                continue;
            }
            let breaker = match breakers.get(&r.upstream) {
                Some(b) if lock(b).settings() == r.circuit => b.clone(),
                _ => Arc::new(Mutex::new(Breaker::new(r.circuit))),
            };
            kept.insert(r.upstream.clone(), breaker);
        }
        *breakers = kept;
    }

    /// The guard of `route` as configured now; for a route a reload removed since its request
    /// was read, one of its own, so that its execution is still bounded.
    pub(super) fn route(&self, route: &Route) -> Arc<RouteGuard> {
        match read(&self.routes).get(&route.name) {
            Some(g) => g.clone(),
            None => Arc::new(RouteGuard::new(route, Instant::now())),
        }
    }

    pub(super) fn named(&self, route: &str) -> Option<Arc<RouteGuard>> {
        read(&self.routes).get(route).cloned()
    }

    fn breaker(&self, upstream: &str) -> Option<Arc<Mutex<Breaker>>> {
        read(&self.breakers).get(upstream).cloned()
    }

    /// Takes a place for a new execution on `route`, unless the route or its upstream must shed it.
    pub fn enter(&self, route: &Route) -> Result<Slot, Refusal> {
        if let Some(breaker) = self.breaker(&route.upstream) {
            lock(&breaker).admit(Instant::now()).map_err(Refusal::CircuitOpen)?;
        }
        let guard = self.route(route);
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
        let guard = self.named(route)?;
        guard.pending.fetch_add(1, Ordering::SeqCst);
        Some(Slot(guard))
    }

    pub fn breaker_states(&self) -> Vec<(String, BreakerState)> {
        let now = Instant::now();
        read(&self.breakers).iter().map(|(u, b)| (u.clone(), lock(b).state(now))).collect()
    }

    pub(super) fn circuit_open(&self, upstream: &str) -> bool {
        self.breaker(upstream).is_some_and(|b| lock(&b).is_open(Instant::now()))
    }

    pub(super) fn record_outcome(&self, upstream: &str, success: bool) {
        if let Some(b) = self.breaker(upstream) {
            lock(&b).record(success, Instant::now());
        }
    }
}

fn read<T>(l: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(|p| p.into_inner())
}

fn write<T>(l: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    l.write().unwrap_or_else(|p| p.into_inner())
}
