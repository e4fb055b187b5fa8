//! Probes: an `unknown` record of a route that says how to ask is settled by asking its
//! upstream (docs/operations.md#automatic-reconciliation-probes).

use std::sync::Arc;
use std::time::Duration;

use super::BATCH;
use crate::config::{Probe, Route};
use crate::domain::clock::{Clock, SharedClock, Turns};
use crate::domain::Actor;
use crate::domain::{HistoryAction, Phase};
use crate::record::rules::probe_event;
use crate::record::{Event, HistoryEntry, Record};
use crate::runtime::Live;
use crate::store::{Action, Probed, ProbesDue, Resolution, Store};
use crate::upstream::{Outbound, Upstream};
use crate::worker::Worker;

/// The wait before probe `n + 1` of a record: `settle` doubled per probe, at most 5 minutes.
pub(crate) fn probe_backoff(settle: Duration, probes: u32) -> Duration {
    let factor = 1u32.checked_shl(probes.min(16)).unwrap_or(u32::MAX);
    settle.saturating_mul(factor).min(Duration::from_secs(300))
}

/// Probes the upstream about `unknown` records of routes that declare how, as the configuration
/// in force at each pass declares it, until `turns` end.
pub(crate) async fn probes(
    store: Arc<dyn Store>,
    upstream: Upstream,
    config: Arc<Live>,
    worker: Worker,
    clock: SharedClock,
    mut turns: Turns,
) {
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // After the store's server changed (a failover), the attempts' bounds read were set in
    // another server's clock, which may have run behind this one's by more than the clock
    // margin. No probe is asked until every attempt marked before the change is past reaching
    // the upstream by this node's own clock (the longest reach any route gives one): a 404 then
    // frees nothing that could still execute, whatever the step between the two clocks.
    let (mut changes, mut held_until) = (store.serving().map(|s| s.changes), None);
    while turns.next(tick.tick()).await.is_some() {
        let config = config.current();
        let now = store.serving().map(|s| s.changes);
        if now != changes {
            changes = now;
            held_until = Some(tokio::time::Instant::now() + config.longest_reach());
        }
        if held_until.is_some_and(|until| tokio::time::Instant::now() < until) {
            continue;
        }
        for route in config.routes.iter().filter(|r| r.probe.is_some()) {
            if let Err(e) = probe_once(&*store, &upstream, route, &worker, &*clock).await {
                e.log(&format!("probing the records of route {} failed; will try again", route.name));
            }
        }
    }
}

/// Probes the `unknown` records of `route` that are due, once. A probe's "executed" settles a
/// record at once; its "not executed" only if no attempt marked under the record could still
/// reach the upstream when the probe was sent (its `in_flight_until`, against the store's time
/// read just before the probe went out): the upstream speaks of what had reached it when it was
/// asked, whenever its answer arrives or is written. Otherwise the record is asked about again
/// once the bound has passed.
pub async fn probe_once(
    store: &dyn Store,
    upstream: &Upstream,
    route: &Route,
    worker: &Worker,
    clock: &dyn Clock,
) -> Result<(), crate::store::StoreError> {
    let Some(probe) = &route.probe else { return Ok(()) };
    let now = clock.now();
    // A change of server (a failover) during the pass ends it before it writes: a 404 asked of
    // one server's clock is not judged in another's; the loop holds after the change.
    let changes = store.serving().map(|s| s.changes);
    for record in
        store.probes_due(ProbesDue { route: route.name.clone(), settle: probe.settle, now, limit: BATCH }).await?
    {
        let asked_at = store.store_time(clock.now()).await?;
        let (resolution, answered) = ask(upstream, route, probe, &record).await;
        let next = clock.now() + probe_backoff(probe.settle, record.probe_count + 1);
        let entry = |note| HistoryEntry { at: clock.now(), actor: Actor::Probe, action: HistoryAction::Probe, note };
        let (id, claim) = (record.id, record.claim);
        let note = Some(answered.clone());
        let probed = Probed { id, claim, resolution, asked_at, next_probe_at: next, entry: entry(note) };
        if store.serving().map(|s| s.changes) != changes {
            return Ok(());
        }
        let action = match store.probed(probed).await? {
            Action::InFlight(read, left) => {
                let attempt = read.attempts.last().map_or(0, |a| a.number);
                let later = format!(
                    "{answered}, but attempt {attempt} may still reach the upstream: when the probe was asked its \
                     bound was {} ms away; asked again after that",
                    left.as_millis()
                );
                // Asked again as soon as the bound has passed (`left` counts from the asking).
                let next_probe_at = clock.now() + left + Duration::from_millis(1);
                let again = Probed { id, claim, resolution: None, asked_at, next_probe_at, entry: entry(Some(later)) };
                store.probed(again).await?
            }
            action => action,
        };
        if let Action::Applied(settled) = action {
            if settled.phase() != Phase::Unknown {
                tracing::info!(record = %record.id, to = settled.phase().as_str(), "a probe settled a record");
                worker.settled(record.id);
            }
        }
    }
    Ok(())
}

/// One probe: 2xx → it executed (the answer is the resolution), 404 → it did not, anything
/// else → still unknown. No attempt header goes with it: a probe is no attempt, and an upstream
/// fencing by claim must answer it whatever claim it last saw.
async fn ask(upstream: &Upstream, route: &Route, probe: &Probe, record: &Record) -> (Option<Resolution>, String) {
    let path = probe.path.replace("{idempotency_key}", &crate::domain::key::path_segment(&record.key));
    let asked = format!("{} {}", probe.method, path);
    // A key such as `..` would climb out of the probe's path and ask about another resource.
    let (path_only, query) = path.split_once('?').unwrap_or((&path, ""));
    let url = match crate::domain::path::check(path_only).and_then(|()| route.upstream_url(path_only, query)) {
        Ok(url) => url,
        Err(why) => return (None, format!("{asked} not sent: {why}")),
    };
    let request = Outbound::for_route(route, &probe.method, url, &[], &route.upstream_headers, bytes::Bytes::new());
    match upstream.send(request, route.retry.per_try_timeout).await {
        Ok(answer) => {
            let status = answer.response.status;
            let note = format!("{asked} → {status}");
            match probe_event(Some(status)) {
                Event::ResolveExecuted => (Some(Resolution::Executed(answer.response)), note),
                Event::ResolveNotExecuted => (Some(Resolution::NotExecuted), note),
                _ => (None, note),
            }
        }
        Err(observed) => (None, format!("{asked} → no answer ({observed:?})")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probes_back_off_up_to_five_minutes() {
        let s = Duration::from_secs(5);
        assert_eq!(probe_backoff(s, 0), Duration::from_secs(5));
        assert_eq!(probe_backoff(s, 1), Duration::from_secs(10));
        assert_eq!(probe_backoff(s, 3), Duration::from_secs(40));
        assert_eq!(probe_backoff(s, 10), Duration::from_secs(300));
        assert_eq!(probe_backoff(s, 99), Duration::from_secs(300));
    }
}
