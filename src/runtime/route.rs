//! One route as a snapshot serves it: its configuration and its runtime, resolved once per
//! request (or per execution) and carried along, so that nothing downstream looks the route up
//! by name again, and a reload in the meantime changes neither.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use super::{lock, Charges, Refusal, RouteGuard, RouteRuntime, Slot, Snapshot};
use crate::config::{Config, Route};
use crate::domain::Tenant;
use crate::policy::RoutePace;

/// A route of a [`Snapshot`], with its runtime: reads as the [`Route`] it configures.
#[derive(Clone)]
pub struct ServedRoute {
    snapshot: Arc<Snapshot>,
    index: usize,
}

impl std::ops::Deref for ServedRoute {
    type Target = Route;

    fn deref(&self) -> &Route {
        &self.snapshot.config.routes[self.index]
    }
}

impl std::fmt::Debug for ServedRoute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("ServedRoute").field(&self.name).finish()
    }
}

impl ServedRoute {
    pub(super) fn new(snapshot: Arc<Snapshot>, index: usize) -> ServedRoute {
        ServedRoute { snapshot, index }
    }

    /// The configuration the route belongs to.
    pub fn config(&self) -> &Arc<Config> {
        &self.snapshot.config
    }

    /// The snapshot the route was resolved in: where a record of another route is looked up,
    /// in the same configuration.
    pub fn snapshot(&self) -> &Arc<Snapshot> {
        &self.snapshot
    }

    fn runtime(&self) -> &RouteRuntime {
        &self.snapshot.routes[self.index]
    }

    pub(crate) fn guard(&self) -> &Arc<RouteGuard> {
        &self.runtime().guard
    }

    /// The budgets a new execution of `tenant` on this route is charged to: the route's (the
    /// guard's), its named upstream's and its tenant's.
    pub(crate) fn charges(&self, tenant: &Tenant) -> Charges {
        let runtime = self.runtime();
        let ticks = &self.snapshot.ticks;
        Charges {
            route: runtime.guard.budget.clone(),
            upstream: runtime.upstream.budget.clone(),
            tenant: self.snapshot.tenants.of(tenant, ticks.now()),
            ticks: ticks.clone(),
        }
    }

    /// Takes a place for a new execution, unless the route or its upstream must shed it.
    pub fn enter(&self) -> Result<Slot, Refusal> {
        lock(&self.runtime().upstream.breaker).admit(self.snapshot.ticks.now()).map_err(Refusal::CircuitOpen)?;
        let guard = self.guard();
        let before = guard.pending.fetch_add(1, Ordering::SeqCst);
        let slot = Slot(guard.clone());
        if before >= guard.max_pending {
            return Err(Refusal::Overloaded);
        }
        Ok(slot)
    }

    /// A place for an execution that did not come through the ingress (take-over, operator
    /// retry): counted, never refused.
    pub fn slot(&self) -> Slot {
        let guard = self.guard().clone();
        guard.pending.fetch_add(1, Ordering::SeqCst);
        Slot(guard)
    }

    pub(crate) fn circuit_open(&self) -> bool {
        lock(&self.runtime().upstream.breaker).is_open(self.snapshot.ticks.now())
    }

    pub(crate) fn record_outcome(&self, success: bool) {
        lock(&self.runtime().upstream.breaker).record(success, self.snapshot.ticks.now());
    }

    /// An attempt (or a streamed answer's first byte) on the route took this long.
    pub(crate) fn observe(&self, took: Duration) {
        let mut pace = lock(&self.runtime().pace);
        match pace.as_mut() {
            Some(pace) => pace.observe(took),
            None => *pace = Some(RoutePace::first(took)),
        }
    }

    /// What the route's attempts have taken here; `None` until it has had one.
    pub fn pace(&self) -> Option<RoutePace> {
        *lock(&self.runtime().pace)
    }

    /// A done answer replayed.
    pub fn count_replay(&self) {
        self.runtime().answers.replays.fetch_add(1, Ordering::Relaxed);
    }

    /// Its counters in `/metrics`, registered with the route.
    pub(crate) fn counters(&self) -> &crate::observe::metrics::RouteCounters {
        &self.runtime().counters
    }

    /// A 409 `request-in-progress`: a duplicate arrived while its key was being executed.
    pub fn count_conflict(&self) {
        self.runtime().answers.conflicts.fetch_add(1, Ordering::Relaxed);
    }
}
