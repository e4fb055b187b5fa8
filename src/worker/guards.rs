//! Admission control: what a route and its upstream can take — attempts in flight, executions
//! waiting for one, the retry budget and the circuit breaker — checked before anything is recorded.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::Semaphore;

use crate::config::{Config, Route};
use crate::policy::{Breaker, BreakerState, RetryBudget};

use super::lock;

/// The protections shared by the ingress and the workers: per route, a retry budget, a cap on
/// attempts in flight and a bound on executions waiting for one; per upstream, a breaker.
pub struct Guards {
    pub(super) routes: HashMap<String, Arc<RouteGuard>>,
    breakers: HashMap<String, Mutex<Breaker>>,
}

pub(super) struct RouteGuard {
    pub(super) budget: Mutex<RetryBudget>,
    /// Attempts in flight on the route (`max_concurrency`).
    pub(super) attempts: Arc<Semaphore>,
    /// Executions admitted and not finished: those in flight plus those queued behind them.
    pub(super) pending: AtomicUsize,
    pub(super) max_pending: usize,
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
        let now = Instant::now();
        let routes = config
            .routes
            .iter()
            .map(|r| {
                let guard = RouteGuard {
                    budget: Mutex::new(RetryBudget::new(r.retry.budget_ratio, r.retry.budget_min_per_sec, now)),
                    attempts: Arc::new(Semaphore::new(r.max_concurrency)),
                    pending: AtomicUsize::new(0),
                    max_pending: r.max_concurrency + queue_bound(r.max_concurrency),
                };
                (r.name.clone(), Arc::new(guard))
            })
            .collect();
        let mut breakers = HashMap::new();
        for r in &config.routes {
            breakers.entry(r.upstream.clone()).or_insert_with(|| Mutex::new(Breaker::new(r.circuit)));
        }
        Guards { routes, breakers }
    }

    /// Takes a place for a new execution on `route`, unless the route or its upstream must shed it.
    pub fn enter(&self, route: &Route) -> Result<Slot, Refusal> {
        if let Some(breaker) = self.breakers.get(&route.upstream) {
            lock(breaker).admit(Instant::now()).map_err(Refusal::CircuitOpen)?;
        }
        let guard = self.routes.get(&route.name).ok_or(Refusal::Overloaded)?;
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
        let guard = self.routes.get(route)?;
        guard.pending.fetch_add(1, Ordering::SeqCst);
        Some(Slot(guard.clone()))
    }

    pub fn breaker_states(&self) -> Vec<(String, BreakerState)> {
        let now = Instant::now();
        self.breakers.iter().map(|(u, b)| (u.clone(), lock(b).state(now))).collect()
    }

    pub(super) fn circuit_open(&self, upstream: &str) -> bool {
        self.breakers.get(upstream).is_some_and(|b| lock(b).is_open(Instant::now()))
    }

    pub(super) fn record_outcome(&self, upstream: &str, success: bool) {
        if let Some(b) = self.breakers.get(upstream) {
            lock(b).record(success, Instant::now());
        }
    }

    pub(super) fn first_attempt(&self, route: &str) {
        if let Some(g) = self.routes.get(route) {
            lock(&g.budget).deposit(Instant::now());
        }
    }

    pub(super) fn take_retry(&self, route: &str) -> bool {
        self.routes.get(route).is_some_and(|g| lock(&g.budget).try_withdraw(Instant::now()))
    }
}
