//! Canary policies at run time (docs/configuration.md `[routes.canary]`): every node watches each running
//! canary's two sides in the store — the canary's policy version and the route's own — and ends
//! the canary when a stop condition holds, by setting a `canary_off` switch that every node then
//! obeys, kept and listed like any operator's switch. Which side a request is on is decided in
//! [`crate::config::Route::policy_for`]; whether the figures justify a stop, in
//! [`crate::policy::canary_stop_reason`].

use std::sync::Arc;
use std::time::Duration;

use uuid::Uuid;

use crate::config::Route;
use crate::domain::clock::{SharedClock, Turns};
use crate::domain::switch::{Scope, Switch, SwitchAction};
use crate::domain::PolicyVersion;
use crate::domain::RouteName;
use crate::domain::Timestamp;
use crate::policy::{canary_stop_reason, CanarySide, Cohort};
use crate::runtime::switches::Switches;
use crate::runtime::Live;
use crate::store::{Store, StoreError};

/// How often the sides are compared. Each look is one aggregate read per canary.
const LOOK_EVERY: Duration = Duration::from_secs(5);

/// The longest stretch of history a look reads: a long-running canary is judged on its last
/// hour, which keeps the read's cost bounded however long it runs.
const WINDOW: Duration = Duration::from_secs(3600);

/// Who a canary's own stop is recorded as, in the switch's audit trail.
pub(crate) const ACTOR: &str = "idem canary";

/// Watches the canaries of the configuration in force until `turns` end.
pub(crate) async fn watch(
    store: Arc<dyn Store>,
    live: Arc<Live>,
    switches: Arc<Switches>,
    clock: SharedClock,
    mut turns: Turns,
) {
    let mut tick = tokio::time::interval(LOOK_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The canaries watched at the last look: one a reload removed or replaced is shown as ended.
    let mut watched: Vec<(RouteName, PolicyVersion)> = Vec::new();
    while turns.next(tick.tick()).await.is_some() {
        let config = live.current();
        let now_watched: Vec<(RouteName, PolicyVersion)> = config
            .routes
            .iter()
            .filter_map(|r| r.canary.as_ref().map(|c| (r.name.clone(), c.policy_version.clone())))
            .collect();
        for (route, version) in watched.iter().filter(|w| !now_watched.contains(w)) {
            crate::observe::metrics::canary_running(route, version, false);
        }
        watched = now_watched;
        for route in config.routes.iter().filter(|r| r.canary.is_some()) {
            if let Err(e) = look(&*store, &switches, route, clock.now()).await {
                tracing::warn!(route = %route.name, error = %e, "could not compare the canary's sides");
            }
        }
    }
}

/// How many of the newest switches a look reads to find when the route's canary last resumed.
const HISTORY_READ: u32 = 200;

/// One look at a route's canary: its two sides' figures exported, and the canary ended if a stop
/// condition holds. What is on and when the canary last resumed are read from the store, not
/// from this node's view: of several nodes, the first to stop it does, and the others see it.
async fn look(store: &dyn Store, switches: &Switches, route: &Route, now: Timestamp) -> Result<(), StoreError> {
    let Some(canary) = &route.canary else { return Ok(()) };
    let off = |s: &Switch| s.action == SwitchAction::CanaryOff && s.scope.covers(&route.name);
    if store.active_switches(now).await?.iter().any(off) {
        crate::observe::metrics::canary_running(&route.name, &canary.policy_version, false);
        return Ok(());
    }
    crate::observe::metrics::canary_running(&route.name, &canary.policy_version, true);
    // A canary turned on again is judged only on what it does from then on.
    let resumed = store
        .switch_history(HISTORY_READ)
        .await?
        .iter()
        .filter(|s| off(s))
        .filter_map(|s| s.cleared.as_ref().map(|c| c.at).or(s.expires_at))
        .max();
    let since = resumed.unwrap_or(Timestamp::MIN).max(now - WINDOW);
    let sides = store.sides(&route.name, since).await?;
    let side =
        |version: &str| sides.iter().find(|s| s.policy_version == version).map_or(Cohort::default(), |s| s.requests);
    let control = side(route.policy_version.as_str());
    let trial = side(canary.policy_version.as_str());
    crate::observe::metrics::canary_side(&route.name, CanarySide::Control, &route.policy_version, control);
    crate::observe::metrics::canary_side(&route.name, CanarySide::Canary, &canary.policy_version, trial);
    let Some(reason) = canary_stop_reason(&canary.stop, control, trial) else { return Ok(()) };
    let switch = Switch {
        id: Uuid::now_v7(),
        scope: Scope::Route(route.name.clone()),
        action: SwitchAction::CanaryOff,
        reason: format!("canary {} stopped itself: {reason}", canary.policy_version),
        actor: ACTOR.to_string(),
        set_at: now,
        expires_at: None,
        cleared: None,
    };
    store.set_switch(switch.clone()).await?;
    let _ = switches.refresh(store).await;
    crate::observe::metrics::canary_running(&route.name, &canary.policy_version, false);
    tracing::warn!(
        route = %route.name,
        canary = %canary.policy_version,
        control = %route.policy_version,
        reason = %switch.reason,
        "canary stopped"
    );
    Ok(())
}
