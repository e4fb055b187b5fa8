//! The emergency switches as this node obeys them: the active ones, read from the store at least
//! once a second by every node (and at once by the node that sets or clears one), held in memory
//! so that the worker and the ingress ask them without a store round trip. Expiry is checked
//! on each question, so a switch ends on time whenever the last read was.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use crate::config::{Policy, Route};
use crate::domain::clock::{self, SharedClock, Turns};
use crate::domain::key::IdempotencyKey;
use crate::domain::switch::{Scope, Switch, SwitchAction};
use crate::domain::{RouteName, Tenant, Timestamp};
use crate::policy::Switched;
use crate::store::{Store, StoreError};

/// How often every node reads the switches: twice within the two seconds docs/operations.md promises.
pub(crate) const REFRESH_EVERY: Duration = Duration::from_millis(500);

/// The switches in force, shared by the ingress, the worker and the admin API.
pub struct Switches {
    active: RwLock<Arc<Vec<Switch>>>,
    /// What "now" is when a switch's expiry is checked.
    clock: SharedClock,
    /// Numbers each read as it starts, and the number of the read now shown, so that a slow
    /// read that began before a set cannot overwrite the fresher view the set left.
    reads: AtomicU64,
    shown: Mutex<u64>,
    /// Whether the last read failed: said once in the log, not every half second.
    failing: AtomicBool,
}

/// The longest `Retry-After` of a refusal by an `isolate` switch.
const ISOLATED_RETRY_AFTER: Duration = Duration::from_secs(5);

impl Default for Switches {
    fn default() -> Switches {
        Switches::new(clock::system())
    }
}

impl Switches {
    /// An empty view, whose expiries are checked against `clock`.
    pub fn new(clock: SharedClock) -> Switches {
        Switches {
            active: RwLock::default(),
            clock,
            reads: AtomicU64::new(0),
            shown: Mutex::new(0),
            failing: AtomicBool::new(false),
        }
    }

    /// A view that starts with `active` (for tests and tools; a node reads its view from the store).
    pub fn with(active: Vec<Switch>) -> Switches {
        let switches = Switches::default();
        *switches.active.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(active);
        switches
    }

    fn snapshot(&self) -> Arc<Vec<Switch>> {
        self.active.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The switch doing `action` on `route` at `now`, if one is on.
    pub fn on(&self, route: &RouteName, action: SwitchAction, now: Timestamp) -> Option<Switch> {
        self.snapshot().iter().find(|s| s.holds(route, action, now)).cloned()
    }

    fn is_on(&self, route: &RouteName, action: SwitchAction) -> bool {
        let now = self.clock.now();
        self.snapshot().iter().any(|s| s.holds(route, action, now))
    }

    pub fn retries_off(&self, route: &RouteName) -> bool {
        self.is_on(route, SwitchAction::RetriesOff)
    }

    pub fn isolated(&self, route: &RouteName) -> bool {
        self.is_on(route, SwitchAction::Isolate)
    }

    /// Whether `route`'s canary is ended by an operator: all its traffic uses the main policy.
    pub fn canary_off(&self, route: &RouteName) -> bool {
        self.is_on(route, SwitchAction::CanaryOff)
    }

    /// What the retry policy is told about `route` right now.
    pub fn switched(&self, route: &RouteName) -> Switched {
        let now = self.clock.now();
        let active = self.snapshot();
        Switched {
            retries_off: active.iter().any(|s| s.holds(route, SwitchAction::RetriesOff, now)),
            isolated: active.iter().any(|s| s.holds(route, SwitchAction::Isolate, now)),
        }
    }

    /// How long an `isolate` switch on `route` asks a refused client to wait, if one is on: until
    /// the switch expires, or a few seconds, since it may be cleared sooner (one second at least).
    pub fn isolation(&self, route: &RouteName) -> Option<Duration> {
        let now = self.clock.now();
        let switch = self.on(route, SwitchAction::Isolate, now)?;
        let left = switch.expires_at.map_or(ISOLATED_RETRY_AFTER, |at| at - now);
        Some(left.clamp(Duration::from_secs(1), ISOLATED_RETRY_AFTER))
    }

    /// The policy a request of `tenant` with `key` runs under on `route`: the route's own, or the
    /// canary's for a request in the slice of a canary that no `canary_off` switch has ended.
    pub fn policy<'r>(&self, route: &'r Route, tenant: &Tenant, key: &IdempotencyKey) -> Policy<'r> {
        route.policy_for(tenant, key, !self.canary_off(&route.name))
    }

    /// The switches active at `now`, oldest first.
    pub fn active(&self, now: Timestamp) -> Vec<Switch> {
        self.snapshot().iter().filter(|s| s.is_active(now)).cloned().collect()
    }

    /// Reads the active switches from the store and shows them, unless a read that started later
    /// has already been shown. On failure the last view stays: a store outage must not quietly
    /// switch everything back on.
    pub async fn refresh(&self, store: &dyn Store) -> Result<(), StoreError> {
        let number = self.reads.fetch_add(1, Ordering::SeqCst) + 1;
        let read = store.active_switches(self.clock.now()).await;
        let was_failing = self.failing.swap(read.is_err(), Ordering::SeqCst);
        let active = match read {
            Ok(active) => active,
            Err(e) => {
                if !was_failing {
                    tracing::warn!(error = %e, "the emergency switches could not be read; the last ones read stay in force");
                }
                return Err(e);
            }
        };
        if was_failing {
            tracing::info!("the emergency switches are read again");
        }
        let mut shown = self.shown.lock().unwrap_or_else(|p| p.into_inner());
        if number > *shown {
            *shown = number;
            *self.active.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(active);
        }
        Ok(())
    }

    /// The `idem_switch_active` gauge: for every scope (all, each of `routes`, and any other a
    /// stored switch names) and action, 1 while a switch is on, else 0. Written per broker, like
    /// the other figures read at scrape time.
    pub fn render_metric(&self, routes: &[&str], now: Timestamp) -> String {
        let active = self.active(now);
        let mut scopes: Vec<Scope> = std::iter::once(Scope::All).chain(routes.iter().map(|r| Scope::of(r))).collect();
        for s in &active {
            if !scopes.contains(&s.scope) {
                scopes.push(s.scope.clone());
            }
        }
        let mut text = String::from(
            "# HELP idem_switch_active 1 while an operator's emergency switch is on for the scope (a route, or all) \
             and action, else 0.\n# TYPE idem_switch_active gauge\n",
        );
        for scope in &scopes {
            for action in SwitchAction::ALL {
                let on = active.iter().any(|s| &s.scope == scope && s.action == action);
                text.push_str(&format!(
                    "idem_switch_active{{scope=\"{}\",action=\"{}\"}} {}\n",
                    scope.as_str(),
                    action.as_str(),
                    u8::from(on)
                ));
            }
        }
        text
    }
}

/// Reads the switches every [`REFRESH_EVERY`] until `turns` end.
pub(crate) async fn keep_fresh(switches: Arc<Switches>, store: Arc<dyn Store>, mut turns: Turns) {
    let mut tick = tokio::time::interval(REFRESH_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while turns.next(tick.tick()).await.is_some() {
        // Failures are logged once by `refresh`, and the view it had stays.
        let _ = switches.refresh(&*store).await;
    }
}

#[cfg(test)]
mod tests {
    use uuid::Uuid;

    use super::*;

    fn switch(scope: Scope, action: SwitchAction, expires_at: Option<Timestamp>) -> Switch {
        Switch {
            id: Uuid::new_v4(),
            scope,
            action,
            reason: "storm".into(),
            actor: "alice".into(),
            set_at: Timestamp::EPOCH,
            expires_at,
            cleared: None,
        }
    }

    #[test]
    fn the_view_answers_per_route_and_drops_expired_switches_by_itself() {
        let far = Timestamp::now() + Duration::from_secs(3_600);
        let switches = Switches::with(vec![
            switch(Scope::Route("payments".into()), SwitchAction::RetriesOff, Some(far)),
            switch(Scope::All, SwitchAction::CanaryOff, None),
            switch(Scope::Route("orders".into()), SwitchAction::Isolate, Some(Timestamp::from_millis(1))),
        ]);
        assert_eq!(switches.switched(&"payments".into()), Switched { retries_off: true, isolated: false });
        assert_eq!(switches.switched(&"orders".into()), Switched::default(), "its isolation expired");
        assert!(switches.canary_off(&"orders".into()) && switches.canary_off(&"payments".into()));
        assert_eq!(switches.active(Timestamp::now()).len(), 2);
    }

    #[test]
    fn the_metric_has_every_scope_and_action_with_help_and_type() {
        let switches = Switches::with(vec![switch(Scope::Route("gone".into()), SwitchAction::Isolate, None)]);
        let text = switches.render_metric(&["payments"], Timestamp::now());
        assert!(text.starts_with("# HELP idem_switch_active "));
        assert!(text.contains("idem_switch_active{scope=\"all\",action=\"retries_off\"} 0\n"));
        assert!(text.contains("idem_switch_active{scope=\"payments\",action=\"canary_off\"} 0\n"));
        assert!(text.contains("idem_switch_active{scope=\"gone\",action=\"isolate\"} 1\n"));
        assert_eq!(text.lines().filter(|l| !l.starts_with('#')).count(), 9);
    }
}
