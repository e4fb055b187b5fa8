//! Replays and 409s, counted for `/admin/stats`. Replays are answered from memory at rates no
//! database write could follow, so each answer is an atomic increment here, and every second the
//! counts are taken and added to the store's per-second counters in one write. A node that dies
//! loses at most the last second's counts; every node adds its own, so the store holds the
//! cluster's.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use crate::clock::SharedClock;
use crate::domain::Timestamp;
use crate::store::stats::AnswerCount;
use crate::store::{AddAnswerCounts, Store, StoreError};

/// How often counts go to the store: the resolution of the replay and 409 series.
pub const FLUSH_EVERY: Duration = Duration::from_secs(1);
/// Counters older than this are deleted: the longest window `/admin/stats` shows.
pub const KEEP: Duration = Duration::from_secs(7 * 24 * 3600);

#[derive(Default)]
struct Counters {
    replays: AtomicU64,
    conflicts: AtomicU64,
}

/// One pair of counters per configured route: counting takes a read lock that only a reload
/// ever contends, and allocates nothing.
pub struct Tally {
    routes: RwLock<HashMap<String, Arc<Counters>>>,
}

impl Tally {
    pub fn new<'a>(routes: impl IntoIterator<Item = &'a str>) -> Tally {
        let tally = Tally { routes: RwLock::new(HashMap::new()) };
        tally.reconfigure(routes);
        tally
    }

    /// Counts the routes configured now: a route kept keeps its counters, a new one starts at
    /// zero, and a removed one's counts not yet flushed (at most a second's) are dropped.
    pub fn reconfigure<'a>(&self, routes: impl IntoIterator<Item = &'a str>) {
        let mut map = self.routes.write().unwrap_or_else(|p| p.into_inner());
        let kept = routes.into_iter().map(|r| (r.to_string(), map.get(r).cloned().unwrap_or_default())).collect();
        *map = kept;
    }

    fn counters(&self, route: &str) -> Option<Arc<Counters>> {
        self.routes.read().unwrap_or_else(|p| p.into_inner()).get(route).cloned()
    }

    /// A done answer replayed. A route no longer configured (a record's, from before a config
    /// change) is not counted.
    pub fn replay(&self, route: &str) {
        if let Some(c) = self.counters(route) {
            c.replays.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A 409 `request-in-progress`: a duplicate arrived while its key was being executed.
    pub fn conflict(&self, route: &str) {
        if let Some(c) = self.counters(route) {
            c.conflicts.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Takes the counts so far, as the counts of the second `now` falls in; nothing for routes
    /// with nothing counted.
    pub fn take(&self, now: Timestamp) -> Vec<AnswerCount> {
        let second = Timestamp::from_millis(now.as_millis() - now.as_millis().rem_euclid(1000));
        self.routes
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter_map(|(route, c)| {
                let replays = c.replays.swap(0, Ordering::Relaxed);
                let conflicts = c.conflicts.swap(0, Ordering::Relaxed);
                (replays + conflicts > 0).then(|| AnswerCount { route: route.clone(), second, replays, conflicts })
            })
            .collect()
    }

    /// Hands back counts the store did not take, to go with the next flush.
    fn restore(&self, counts: &[AnswerCount]) {
        for c in counts {
            if let Some(counters) = self.counters(&c.route) {
                counters.replays.fetch_add(c.replays, Ordering::Relaxed);
                counters.conflicts.fetch_add(c.conflicts, Ordering::Relaxed);
            }
        }
    }

    /// Adds what was counted to the store (and forgets counters older than [`KEEP`]). When the
    /// store refuses, the counts are kept for the next flush. `now` is the second they count in.
    pub async fn flush(&self, store: &dyn Store, now: Timestamp) -> Result<(), StoreError> {
        let counts = self.take(now);
        if counts.is_empty() {
            return Ok(());
        }
        let forget_before = now - KEEP;
        store
            .add_answer_counts(AddAnswerCounts { counts: counts.clone(), forget_before })
            .await
            .inspect_err(|_| self.restore(&counts))
    }
}

/// Flushes every [`FLUSH_EVERY`] until aborted.
pub async fn flush_every_second(tally: Arc<Tally>, store: Arc<dyn Store>, clock: SharedClock) {
    let mut ticks = tokio::time::interval(FLUSH_EVERY);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        if let Err(e) = tally.flush(&*store, clock.now()).await {
            tracing::warn!(error = %e, "cannot store the replay and 409 counts; keeping them for the next try");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_are_taken_once_per_route_in_the_second_they_are_taken() {
        let tally = Tally::new(["payments", "ledger"]);
        tally.replay("payments");
        tally.replay("payments");
        tally.conflict("payments");
        tally.replay("gone");
        let at = Timestamp::from_millis;
        let counts = tally.take(at(12_345));
        assert_eq!(counts, [AnswerCount { route: "payments".into(), second: at(12_000), replays: 2, conflicts: 1 }]);
        assert!(tally.take(at(13_000)).is_empty(), "taken counts are not taken again");
        tally.restore(&counts);
        assert_eq!(tally.take(at(14_999))[0].replays, 2, "counts the store refused go with the next flush");
    }
}
