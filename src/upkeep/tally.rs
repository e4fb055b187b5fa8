//! Replays and 409s, counted for `/admin/stats`. Replays are answered from memory at rates no
//! database write could follow, so each answer is an atomic increment in its route's runtime
//! (`runtime`), and every second the counts are taken and added to the store's per-second
//! counters in one write. A node that dies loses at most the last second's counts; every node
//! adds its own, so the store holds the cluster's.

use std::sync::Arc;
use std::time::Duration;

use crate::domain::clock::{SharedClock, Turns};
use crate::domain::Timestamp;
use crate::runtime::{Live, Snapshot};
use crate::store::{AddAnswerCounts, Store, StoreError};

/// How often counts go to the store: the resolution of the replay and 409 series.
pub(crate) const FLUSH_EVERY: Duration = Duration::from_secs(1);
/// Counters older than this are deleted: the longest window `/admin/stats` shows.
pub(crate) const KEEP: Duration = Duration::from_secs(7 * 24 * 3600);

/// Adds what was counted to the store (and forgets counters older than [`KEEP`]). When the
/// store refuses, the counts are kept for the next flush. `now` is the second they count in.
pub(crate) async fn flush(snapshot: &Snapshot, store: &dyn Store, now: Timestamp) -> Result<(), StoreError> {
    let counts = snapshot.take_answer_counts(now);
    if counts.is_empty() {
        return Ok(());
    }
    let forget_before = now - KEEP;
    store
        .add_answer_counts(AddAnswerCounts { counts: counts.clone(), forget_before })
        .await
        .inspect_err(|_| snapshot.restore_answer_counts(&counts))
}

/// Flushes every [`FLUSH_EVERY`] until `turns` end (shutdown flushes a last time).
pub(crate) async fn flush_every_second(live: Arc<Live>, store: Arc<dyn Store>, clock: SharedClock, mut turns: Turns) {
    let mut ticks = tokio::time::interval(FLUSH_EVERY);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while turns.next(ticks.tick()).await.is_some() {
        if let Err(e) = flush(&live.served(), &*store, clock.now()).await {
            tracing::warn!(error = %e, "cannot store the replay and 409 counts; keeping them for the next try");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use crate::config::Config;
    use crate::domain::Timestamp;
    use crate::runtime::Live;
    use crate::store::stats::AnswerCount;

    #[test]
    fn counts_are_taken_once_per_route_in_the_second_they_are_taken() {
        let route = |name: &str| {
            format!("[[routes]]\nname = \"{name}\"\npath_prefix = \"/{name}\"\nupstream = \"http://127.0.0.1:9\"\n")
        };
        let config = Config::parse_with_env(&(route("payments") + &route("ledger")), |_| None).unwrap();
        let live = Live::new(config.clone(), crate::domain::clock::system());
        let (payments, ledger) =
            (live.served().route_named("payments").unwrap(), live.served().route_named("ledger").unwrap());
        payments.count_replay();
        payments.count_replay();
        payments.count_conflict();
        let at = Timestamp::from_millis;
        let counts = live.served().take_answer_counts(at(12_345));
        assert_eq!(counts, [AnswerCount { route: "payments".into(), second: at(12_000), replays: 2, conflicts: 1 }]);
        assert!(live.served().take_answer_counts(at(13_000)).is_empty(), "taken counts are not taken again");
        live.served().restore_answer_counts(&counts);
        assert_eq!(
            live.served().take_answer_counts(at(14_999))[0].replays,
            2,
            "counts the store refused go with the next flush"
        );
        // Kept across a reload that keeps the route; gone with a route that goes.
        ledger.count_conflict();
        live.reconfigure(Arc::new(config));
        assert_eq!(live.served().take_answer_counts(at(15_000))[0].conflicts, 1);
        live.served().route_named("ledger").unwrap().count_conflict();
        live.reconfigure(Arc::new(Config::parse_with_env(&route("payments"), |_| None).unwrap()));
        assert!(live.served().take_answer_counts(at(16_000)).is_empty());
    }
}
