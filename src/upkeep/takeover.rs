//! Take-over: records whose lease expired, moved by the transition table on what was read of
//! them; and queued records nobody claimed, claimed by a node with workers free for them.

use std::sync::Arc;
use std::time::Duration;

use super::BATCH;
use crate::config::{Config, Route};
use crate::domain::clock::{SharedClock, Turns};
use crate::domain::{Actor, AttemptError, AttemptOutcome, HistoryAction, Owner, StopReason, Timestamp};
use crate::record::rules::{self, expiry_event, Expiry};
use crate::record::{Attempt, HistoryEntry, Record};
use crate::runtime::Live;
use crate::store::{ClaimUnclaimed, Store, TakeOver, TakeOverTo};
use crate::worker::Worker;

/// Where a record whose lease expired goes (docs/concepts.md), as [`expiry_event`] decides on
/// what was read of it: `unknown` if an attempt may have been sent and its policy is not
/// replay-safe; otherwise queued again, or freed if its deadline passed; stopped at the
/// take-over cap rather than queued once more. Its policy is the one it was admitted under
/// ([`Route::policy_of`]); a record whose route is gone is treated as unsafe: nothing is re-sent
/// blindly.
pub fn after_lease_expiry(record: &Record, route: Option<&Route>, now: Timestamp, max_takeovers: u32) -> TakeOverTo {
    let admitted_under = route.map(|r| r.policy_of(record.policy_version.as_ref(), r.own_policy()).replay_safe);
    let event = expiry_event(Expiry {
        attempt_unrecorded: record.in_flight.is_some(),
        replay_safe: rules::replay_safe(admitted_under),
        deadline_passed: now >= record.deadline_at,
        takeovers: record.takeovers,
        max_takeovers,
        attempt_may_have_run: record.in_flight.is_some()
            || record.attempts.iter().any(|a| a.outcome != AttemptOutcome::NotExecuted),
    });
    // Both events apply to every in-progress record; should the table ever refuse one, the
    // record waits for reconciliation rather than being sent again.
    TakeOverTo::after(event).unwrap_or(TakeOverTo::Unknown(StopReason::UnsafeReplay))
}

/// Takes over what dead workers left, and claims orphaned queued records, every `every`, until
/// `turns` end.
pub(crate) async fn take_overs(
    store: Arc<dyn Store>,
    worker: Worker,
    config: Arc<Live>,
    clock: SharedClock,
    mut turns: Turns,
) {
    // The lease cannot change without a restart: the pace is set once.
    let lease = config.current().worker.lease;
    let every = (lease / 3).clamp(Duration::from_millis(100), Duration::from_secs(5));
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut sweeper = Sweeper::starting(store, worker, lease);
    while turns.next(tick.tick()).await.is_some() {
        if let Err(e) = sweeper.pass(&config.current(), clock.now()).await {
            e.log("take-over sweep failed; will try again");
        }
    }
}

/// The take-over sweep of one node, pass by pass. It remembers whether a pass found the store
/// failing: a store that could not be reached may have left a node holding an answer it told its
/// client but could not record, whose lease ran out meanwhile. That node writes it again as soon
/// as the store answers (every third of a lease at the most), so once a pass finds the store
/// failing, this sweep takes nothing over until a pass succeeds and for a lease after that: a
/// take-over then could send again what a client was already answered. Meanwhile it still reads
/// the expired leases, which is how it finds out that the store answers again. A node that has
/// just started cannot know of an outage it did not see, so it holds back for its first lease
/// too ([`Sweeper::starting`]).
pub struct Sweeper {
    store: Arc<dyn Store>,
    worker: Worker,
    hold: Hold,
    /// How often the store's server had changed (a failover) when last seen: a change holds
    /// take-overs back for a lease and the clock margin, since the leases were set in the old
    /// server's clock and are now judged in the new one's.
    changes: Option<u64>,
    /// Until when the last change holds take-overs back, whatever the store's answers do.
    after_change: Option<tokio::time::Instant>,
}

/// Whether a sweep takes leases over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Hold {
    No,
    /// A pass failed: none until one succeeds.
    UntilAnswered,
    /// The store answers again: none before this instant.
    Until(tokio::time::Instant),
}

impl Sweeper {
    /// A sweep that takes over from its first pass: for tests that play a node already running.
    pub fn new(store: Arc<dyn Store>, worker: Worker) -> Sweeper {
        let changes = store.serving().map(|s| s.changes);
        Sweeper { store, worker, hold: Hold::No, changes, after_change: None }
    }

    /// The sweep of a node starting now, which takes nothing over for its first `lease`: a
    /// node elsewhere may hold an answer it told during an outage this one never saw, and it
    /// writes it within that lease once the store answers.
    pub fn starting(store: Arc<dyn Store>, worker: Worker, lease: Duration) -> Sweeper {
        Sweeper { hold: Hold::Until(tokio::time::Instant::now() + lease), ..Sweeper::new(store, worker) }
    }

    /// One pass, as of `now` (just read): expired leases taken over (unless held since the store
    /// failed), then queued records nobody claimed.
    pub async fn pass(&mut self, config: &Config, now: Timestamp) -> Result<(), crate::store::StoreError> {
        let read = crate::domain::clock::Moment::now();
        let changes = self.store.serving().map(|s| s.changes);
        if changes != self.changes {
            // A failover: the leases read now were set in another server's clock.
            self.after_change = Some(read.instant() + config.worker.lease + config.worker.clock_margin);
            self.changes = changes;
            tracing::warn!("the store's server changed: no take-over for a lease and the clock margin");
        }
        let holding = match self.hold {
            Hold::No => false,
            Hold::UntilAnswered => true,
            Hold::Until(until) => read.instant() < until,
        } || self.after_change.is_some_and(|until| read.instant() < until);
        let passed = async {
            let expired = self.store.expired_leases(now, BATCH).await?;
            // A change of server under the read (a pass that waited out a failover and was
            // answered by the new primary): nothing taken over; the next pass holds.
            let moved = self.store.serving().map(|s| s.changes) != changes;
            if !holding && !moved {
                take_over_expired(&*self.store, &self.worker, config, now, expired).await?;
            }
            claim_orphans(&*self.store, &self.worker, config, now, read).await
        }
        .await;
        self.hold = match (&passed, self.hold) {
            (Err(_), _) => Hold::UntilAnswered,
            (Ok(()), Hold::UntilAnswered) => Hold::Until(tokio::time::Instant::now() + config.worker.lease),
            (Ok(()), Hold::Until(_)) if !holding => Hold::No,
            (Ok(()), hold) => hold,
        };
        passed
    }
}

/// Takes over the records whose lease `expired`, each as [`after_lease_expiry`] decides.
async fn take_over_expired(
    store: &dyn Store,
    worker: &Worker,
    config: &Config,
    now: Timestamp,
    expired: Vec<Record>,
) -> Result<(), crate::store::StoreError> {
    for record in expired {
        let Some(lease) = &record.lease else { continue };
        let route = config.route_named(&record.route);
        let to = after_lease_expiry(&record, route, now, config.worker.max_takeovers);
        let lost = record.in_flight.map(|(number, started_at)| Attempt {
            number,
            started_at,
            // As long as the lease let it run, as far as this node's clock can tell.
            duration_ms: (lease.expires_at - started_at).as_millis() as u64,
            outcome: AttemptOutcome::Lost,
            status: None,
            error: Some(AttemptError::WorkerLost),
            wait_ms: 0,
            // Marked with the attempt before it was sent, so the lost attempt keeps its policy.
            policy_version: record.policy_version.clone(),
            retry_after_ms: None,
            unreachable: None,
            detail: None,
        });
        let capped = if to.stop_reason() == Some(StopReason::TakeoverCap) {
            format!(
                "; taken over {} times before, it is stopped instead of continued (worker.max_takeovers = {})",
                record.takeovers, config.worker.max_takeovers
            )
        } else {
            String::new()
        };
        let entry = HistoryEntry {
            at: now,
            actor: Actor::Node(Owner::from(worker.owner())),
            action: HistoryAction::TakeOver(to.phase()),
            note: Some(format!(
                "the lease of {} expired{}{capped}",
                lease.owner,
                if lost.is_some() { " while an attempt may have been in flight" } else { "" }
            )),
        };
        let in_flight = record.in_flight.map(|(number, _)| number);
        let take_over =
            TakeOver { id: record.id, expired: lease.clone(), claim: record.claim, in_flight, to, lost, entry };
        if store.take_over(take_over).await? {
            let phase = to.phase().as_str();
            tracing::warn!(record = %record.id, from = %lease.owner, to = phase, takeovers = record.takeovers + 1, "took over a record");
            if let Some(stop) = to.stop_reason() {
                crate::observe::metrics::stopped_by_take_over(&record.route, stop);
            }
            if to == TakeOverTo::Queued {
                if let Some(record) = store.get(record.id).await? {
                    worker.submit(record);
                }
            } else {
                worker.settled(record.id);
            }
        }
    }
    Ok(())
}

/// Claims queued records nobody claimed: as many as this node has workers free for right now,
/// each set aside before the claim. A busy node leaves the rest to nodes that can run them, or
/// to a later pass. About half of them (rounded up, so a node with one free worker still takes
/// over), so that new requests arriving meanwhile still find a worker free and are claimed as
/// they are recorded: the claim below may wait on the store. `read` is `now` on the monotonic
/// clock: the claims' leases are trusted from then, never from later than the time they are
/// written with.
async fn claim_orphans(
    store: &dyn Store,
    worker: &Worker,
    config: &Config,
    now: Timestamp,
    read: crate::domain::clock::Moment,
) -> Result<(), crate::store::StoreError> {
    let free = worker.free_workers((BATCH as usize).min(worker.idle_workers().div_ceil(2)));
    if free.is_empty() {
        return Ok(());
    }
    let idle_since = now - config.worker.lease;
    let lease = config.worker.lease;
    let limit = free.len() as u32;
    let owner = worker.owner().into();
    let claimed = store.claim_unclaimed(ClaimUnclaimed { owner, lease, idle_since, now, limit }).await?;
    // At most `limit` records: one worker each. Workers not needed go back as they drop.
    for (record, free) in claimed.into_iter().zip(free) {
        tracing::info!(record = %record.id, "claimed a queued record nobody was executing");
        worker.resume(record, free, read);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::domain::clock::Clock;
    use crate::domain::RecordId;
    use crate::store::NewRecord;

    const NOW: Timestamp = Timestamp::from_millis(1_700_000_000_000);

    const ROUTE_P: &str =
        "[[routes]]\nname = \"p\"\npath_prefix = \"/p\"\nupstream = \"http://127.0.0.1:9\"\nreplay_safe = {safe}\n";

    fn route(replay_safe: bool) -> Route {
        let text = ROUTE_P.replace("{safe}", &replay_safe.to_string());
        Config::parse_with_env(&text, |_| None).unwrap().routes.remove(0)
    }

    /// An in-progress record, taken over `takeovers` times before, with attempts that ended as
    /// `outcomes`, and one more in flight if `in_flight`.
    fn leased(takeovers: u32, outcomes: &[&str], in_flight: bool) -> Record {
        let mut record = new_record().inserted();
        record.takeovers = takeovers;
        record.attempts = outcomes
            .iter()
            .enumerate()
            .map(|(i, outcome)| Attempt {
                number: i as u32 + 1,
                started_at: NOW,
                duration_ms: 1,
                outcome: AttemptOutcome::parse(outcome).unwrap(),
                status: None,
                error: None,
                wait_ms: 0,
                policy_version: None,
                retry_after_ms: None,
                unreachable: None,
                detail: None,
            })
            .collect();
        record.in_flight = in_flight.then_some((outcomes.len() as u32 + 1, NOW));
        record
    }

    /// `record` as admitted under `route`'s policy.
    fn under(route: &Route, mut record: Record) -> Record {
        record.policy_version = Some(route.policy_version.clone());
        record
    }

    /// A request to route `p`, arriving at `NOW`.
    fn new_record() -> NewRecord {
        NewRecord {
            id: RecordId::new(),
            tenant: "default".into(),
            key: crate::domain::key::IdempotencyKey::parse("k").unwrap(),
            route: "p".into(),
            method: http::Method::POST,
            path: "/p".into(),
            query: String::new(),
            fingerprint: crate::domain::fingerprint::Fingerprint::of("p", "POST", "/p", "", None, b"{}"),
            request: crate::record::StoredRequest { headers: vec![], body: bytes::Bytes::new() },
            deadline_at: NOW + Duration::from_millis(30_000),
            now: NOW,
            policy_version: None,
            claim: None,
            tombstone_cutoff: None,
        }
    }

    #[tokio::test]
    async fn a_lease_is_taken_over_once_the_clock_passes_its_expiry_and_not_before() {
        use crate::domain::clock::ManualClock;
        use crate::store::Claim;
        use crate::worker::Worker;
        let dir = tempfile::TempDir::new().unwrap();
        let url = format!("sqlite://{}", dir.path().join("idem.db").display());
        let text =
            format!("[store]\nurl = \"{url}\"\n[worker]\nlease = \"10s\"\n{}", ROUTE_P.replace("{safe}", "false"));
        let config = Config::parse_with_env(&text, |_| None).unwrap();
        let store = crate::store::open(&url).await.unwrap();
        let clock = Arc::new(ManualClock::new(NOW));
        let worker = Worker::on(store.clone(), config.clone(), "alive", clock.clone());
        // Another node admitted it claimed, its first attempt marked as sent, and then died.
        let version = config.routes[0].policy_version.clone();
        let claim = Claim {
            owner: "dead".into(),
            marked_at: NOW,
            lease: Duration::from_millis(10_000),
            reach: Duration::from_secs(12),
        };
        let new = NewRecord { claim: Some(claim), policy_version: Some(version), ..new_record() };
        let id = new.id;
        store.admit(crate::store::Admit { new, retention_cutoff: Timestamp::EPOCH }).await.unwrap();

        clock.set(NOW + Duration::from_millis(10_000));
        let mut sweeper = Sweeper::new(store.clone(), worker.clone());
        sweeper.pass(&config, clock.now()).await.unwrap();
        let record = store.get(id).await.unwrap().unwrap();
        assert_eq!(record.lease.as_ref().map(|l| l.owner.as_str()), Some("dead"), "taken over at its expiry");

        clock.advance(Duration::from_millis(1));
        sweeper.pass(&config, clock.now()).await.unwrap();
        let record = store.get(id).await.unwrap().unwrap();
        // Not replay-safe, with an attempt that may have gone out: unknown, the attempt lost.
        assert_eq!(record.phase(), crate::domain::Phase::Unknown);
        assert_eq!(record.attempts.last().map(|a| a.outcome.as_str()), Some("lost"));
        let entry = record.history.last().unwrap();
        assert_eq!((entry.at, entry.actor.to_string()), (NOW + Duration::from_millis(10_001), "node:alive".into()));
    }

    /// A node that has just started takes nothing over for its first lease, whatever the store
    /// says: elsewhere a node may hold an answer it told during an outage this one never saw.
    #[tokio::test]
    async fn a_node_that_has_just_started_takes_nothing_over_for_its_first_lease() {
        use crate::domain::clock::ManualClock;
        use crate::store::Claim;
        use crate::worker::Worker;
        let dir = tempfile::TempDir::new().unwrap();
        let url = format!("sqlite://{}", dir.path().join("idem.db").display());
        let text =
            format!("[store]\nurl = \"{url}\"\n[worker]\nlease = \"10s\"\n{}", ROUTE_P.replace("{safe}", "false"));
        let config = Config::parse_with_env(&text, |_| None).unwrap();
        let store = crate::store::open(&url).await.unwrap();
        let clock = Arc::new(ManualClock::new(NOW));
        let worker = Worker::on(store.clone(), config.clone(), "started", clock.clone());
        let lease = Duration::from_secs(10);
        let claim = Claim { owner: "teller".into(), marked_at: NOW, lease, reach: Duration::from_secs(12) };
        let new = NewRecord { claim: Some(claim), ..new_record() };
        let id = new.id;
        store.admit(crate::store::Admit { new, retention_cutoff: Timestamp::EPOCH }).await.unwrap();
        clock.set(NOW + 2 * lease);

        // The hold runs on the monotonic clock: a short one, for the test to wait out.
        let hold = Duration::from_millis(200);
        let mut sweeper = Sweeper::starting(store.clone(), worker.clone(), hold);
        sweeper.pass(&config, clock.now()).await.unwrap();
        let held = store.get(id).await.unwrap().unwrap();
        assert_eq!(held.phase(), crate::domain::Phase::InProgress, "held back in its first lease");
        tokio::time::sleep(hold).await;
        sweeper.pass(&config, clock.now()).await.unwrap();
        assert_eq!(store.get(id).await.unwrap().unwrap().phase(), crate::domain::Phase::Unknown, "taken over after it");
    }

    #[test]
    fn a_record_is_continued_until_it_was_taken_over_max_takeovers_times() {
        let safe = route(true);
        for takeovers in 0..3 {
            assert_eq!(
                after_lease_expiry(&under(&safe, leased(takeovers, &["lost"], true)), Some(&safe), NOW, 3),
                TakeOverTo::Queued
            );
        }
        let capped = after_lease_expiry(&under(&safe, leased(3, &["lost"], true)), Some(&safe), NOW, 3);
        assert_eq!(capped, TakeOverTo::Unknown(StopReason::TakeoverCap), "an attempt may have run");
        let never = after_lease_expiry(&under(&safe, leased(0, &[], false)), Some(&safe), NOW, 0);
        assert_eq!(never, TakeOverTo::Free(StopReason::TakeoverCap), "0: never continued");
    }

    /// A record keeps the policy it was admitted under. Admitted as not replay-safe, a reload
    /// that makes its route replay-safe (and so its policy another) does not make its attempt in
    /// flight safe to send again: unknown. Admitted as replay-safe, it is continued as such while
    /// the route still has its policy; once a reload has removed that policy, it is judged on
    /// the safe side.
    #[test]
    fn a_record_keeps_the_replay_safety_it_was_admitted_under_whatever_a_reload_does() {
        let (unsafe_route, safe) = (route(false), route(true));
        let admitted_unsafe = under(&unsafe_route, leased(0, &[], true));
        let unknown = TakeOverTo::Unknown(StopReason::UnsafeReplay);
        assert_eq!(after_lease_expiry(&admitted_unsafe, Some(&unsafe_route), NOW, 3), unknown);
        assert_eq!(after_lease_expiry(&admitted_unsafe, Some(&safe), NOW, 3), unknown, "reloaded as replay-safe");
        let admitted_safe = under(&safe, leased(0, &[], true));
        assert_eq!(after_lease_expiry(&admitted_safe, Some(&safe), NOW, 3), TakeOverTo::Queued);
        assert_eq!(after_lease_expiry(&admitted_safe, Some(&unsafe_route), NOW, 3), unknown, "its policy removed");
    }

    #[test]
    fn a_capped_record_is_freed_only_if_no_attempt_may_have_run() {
        let unsafe_route = route(false);
        let safe = route(true);
        let stop =
            |record: &Record, route: &Route| after_lease_expiry(&under(route, record.clone()), Some(route), NOW, 1);
        assert_eq!(stop(&leased(1, &[], false), &unsafe_route), TakeOverTo::Free(StopReason::TakeoverCap));
        assert_eq!(
            stop(&leased(1, &["not_executed", "not_executed"], false), &unsafe_route),
            TakeOverTo::Free(StopReason::TakeoverCap)
        );
        // On a replay-safe route a lost or ambiguous attempt was continued; at the cap it counts.
        assert_eq!(stop(&leased(1, &["lost"], false), &safe), TakeOverTo::Unknown(StopReason::TakeoverCap));
        assert_eq!(stop(&leased(1, &["ambiguous"], false), &safe), TakeOverTo::Unknown(StopReason::TakeoverCap));
        assert_eq!(stop(&leased(1, &[], true), &safe), TakeOverTo::Unknown(StopReason::TakeoverCap));
    }

    #[test]
    fn the_cap_changes_nothing_for_a_record_that_stops_anyway() {
        let unsafe_route = route(false);
        let in_flight = leased(5, &[], true);
        assert_eq!(
            after_lease_expiry(&in_flight, Some(&unsafe_route), NOW, 1),
            TakeOverTo::Unknown(StopReason::UnsafeReplay)
        );
        let late = leased(5, &[], false);
        assert_eq!(
            after_lease_expiry(&late, Some(&unsafe_route), NOW + Duration::from_millis(60_000), 1),
            TakeOverTo::Free(StopReason::Deadline)
        );
        assert_eq!(after_lease_expiry(&late, None, NOW, 9), TakeOverTo::Queued, "a gone route has nothing in flight");
    }

    #[test]
    fn a_call_to_a_replay_safe_mcp_tool_is_continued_after_a_take_over_and_others_are_not() {
        let text =
            "[[routes]]\nname = \"p\"\nkind = \"mcp\"\npath_prefix = \"/p\"\nupstream = \"http://127.0.0.1:9\"\n";
        let mcp = Config::parse_with_env(text, |_| None).unwrap().routes.remove(0);
        let mut safe_call = leased(0, &[], true);
        safe_call.policy_version = Some(mcp.mcp.as_ref().unwrap().replay_safe_version.clone());
        assert_eq!(after_lease_expiry(&safe_call, Some(&mcp), NOW, 3), TakeOverTo::Queued);
        let mut other_call = leased(0, &[], true);
        other_call.policy_version = Some(mcp.policy_version.clone());
        let unknown = TakeOverTo::Unknown(StopReason::UnsafeReplay);
        assert_eq!(after_lease_expiry(&other_call, Some(&mcp), NOW, 3), unknown);
        assert_eq!(after_lease_expiry(&leased(0, &[], true), Some(&mcp), NOW, 3), unknown, "no policy: the safe side");
    }
}
