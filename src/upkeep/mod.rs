//! Background upkeep, on every node, each loop started by the server under its name:
//! - take-over (`takeover`): records whose worker died (lease expired) are continued, freed or
//!   moved to `unknown` by the take-over rule (docs/operations.md#surviving-crashes); queued
//!   records nobody claimed are claimed here;
//! - probes (`probes`): `unknown` records of routes with a `probe` are settled by asking the
//!   upstream, "not executed" only once no attempt marked under them can still reach it;
//! - retention (here): `done` records past retention become tombstones or go, in batches;
//! - reload (`reload`): the configuration file read again on `SIGHUP` or at the admin API's
//!   asking, applied whole or refused whole;
//! - canaries (`canaries`): every route's canary judged from the store's figures, and ended by a
//!   `canary_off` switch when it does harm;
//! - answer counts (`tally`): the replays and 409s counted in memory, added to the store once a
//!   second.
//!
//! The store's own health check lives with the store (`store::watch_store`).

use std::sync::Arc;
use std::time::Duration;

use crate::config::Config;
use crate::domain::clock::{SharedClock, Turns};
use crate::domain::Timestamp;
use crate::runtime::Live;
use crate::store::{RouteSweep, Store, Sweep, SweepPlan};

pub(crate) mod canaries;
mod probes;
pub(crate) mod reload;
mod takeover;
pub(crate) mod tally;

#[cfg(feature = "test-support")]
pub use probes::probe_once;
pub(crate) use probes::probes;
pub(crate) use takeover::take_overs;
#[cfg(feature = "test-support")]
pub use takeover::{after_lease_expiry, Sweeper};

const SWEEP_BATCH: u32 = 1000;
/// Records read (and acted on) at once by a take-over or probe pass.
const BATCH: u32 = 64;

/// How often the retention sweep runs: a tenth of the retention, between 1 s and 1 min.
pub(crate) fn sweep_interval(retention: Duration) -> Duration {
    (retention / 10).clamp(Duration::from_secs(1), Duration::from_secs(60))
}

/// What the sweep does at `now`: each route's done records past its retention become tombstones
/// (or go, when the route keeps none); those of routes no longer configured go after the store's
/// retention.
pub(crate) fn sweep_plan(config: &Config, now: Timestamp) -> SweepPlan {
    let routes = config
        .routes
        .iter()
        .map(|r| RouteSweep {
            route: r.name.clone(),
            cutoff: r.lifetime().cutoff(now),
            tombstone_after: r.lifetime().tombstone_after(),
        })
        .collect();
    SweepPlan { now, routes, others_cutoff: now - config.store.retention }
}

/// Sweeps by the configuration in force at each pass, and paces itself by it, until `turns` end.
pub(crate) async fn retention_sweep(store: Arc<dyn Store>, config: Arc<Live>, clock: SharedClock, mut turns: Turns) {
    loop {
        let config = config.current();
        let plan = sweep_plan(&config, clock.now());
        loop {
            match store.sweep_done(Sweep { plan: plan.clone(), limit: SWEEP_BATCH }).await {
                Ok(n) if n >= SWEEP_BATCH as u64 && !turns.over() => continue,
                Ok(n) => {
                    if n > 0 {
                        tracing::info!(changed = n, "retention sweep");
                    }
                    break;
                }
                Err(e) => {
                    e.log("retention sweep failed; will try again");
                    break;
                }
            }
        }
        let shortest = config.routes.iter().map(|r| r.retention).chain([config.store.retention]).min();
        if turns.next(tokio::time::sleep(sweep_interval(shortest.unwrap_or(config.store.retention)))).await.is_none() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sweep_runs_often_enough_for_short_and_long_retentions() {
        assert_eq!(sweep_interval(Duration::from_secs(2)), Duration::from_secs(1));
        assert_eq!(sweep_interval(Duration::from_secs(100)), Duration::from_secs(10));
        assert_eq!(sweep_interval(Duration::from_secs(86400)), Duration::from_secs(60));
    }
}
