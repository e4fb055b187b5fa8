//! One execution, from its claim to its settlement: the route and policy it keeps, the
//! credential it forwards, and the record's end (done, unknown or free) stored with its outcome.
//! The attempts between are in `attempts`.

use std::time::Duration;

use tracing::warn;

use super::admission::{Reservation, Start};
use super::attempts::{since, HandBack, Progress, Reserved};
use super::job::Job;
use super::lease::LeaseTrust;
use super::{lock, Inner, Outcome, Reply};
use crate::config::{Policy, Route};
use crate::domain::switch::SwitchAction;
use crate::domain::RecordId;
use crate::domain::{ClaimToken, Holder, Timestamp};
use crate::domain::{Class, StopReason};
use crate::observe::metrics::{self, Laps, Stage};
use crate::policy::Settlement;
use crate::record::{Attempt, Record};
use crate::runtime::{ServedRoute, Slot};
use crate::store::{self, AttemptEnded, ClaimQueued, LeaseStatus, Renew};

/// What an admission that claimed its record hands the execution: its first attempt's place
/// and mark, where the ingress found that attempt goes, and the new key's stages so far.
struct FirstAttempt {
    reserved: Reserved,
    url: Option<url::Url>,
    laps: Option<Laps>,
}

impl Inner {
    /// The write that stores how an attempt of `record` (or the execution) ended, under `holder`'s
    /// claim.
    pub(super) fn ended(
        &self,
        record: &Record,
        holder: &Holder,
        attempt: Option<Attempt>,
        then: store::AttemptEnd,
        now: Timestamp,
    ) -> AttemptEnded {
        AttemptEnded { id: record.id, holder: holder.clone(), attempt, then, stream: None, now }
    }

    /// The write that extends `holder`'s lease on `id`, made at `now`.
    pub(super) fn renewal(&self, id: RecordId, holder: &Holder, now: Timestamp) -> Renew {
        Renew { id, holder: holder.clone(), lease: self.lease, now }
    }

    /// How long after the write that marks an attempt limited to `limit` that attempt may still
    /// reach the upstream: it starts within the send window and is cut at its limit, and clocks
    /// may disagree by the margin.
    pub(super) fn reach(&self, limit: Duration) -> Duration {
        self.send_window + limit + self.clock_margin
    }

    /// This process's claim with `token`.
    pub(super) fn holder(&self, token: ClaimToken) -> Holder {
        Holder { owner: self.owner.clone(), token }
    }

    /// Runs a spawned execution as `start` says; `None` when the process is past running any.
    /// A record is claimed only with a worker in hand: one held since admission, one taken
    /// before a bulk claim (see [`Worker::resume`](super::Worker::resume)), or one waited for
    /// before claiming a queued record. A lease never runs while its record waits for a worker.
    /// `route`: the record's route as the execution keeps it, with its place on the route held
    /// to the end; `None` when it is no longer configured.
    pub(super) async fn execute(
        &self,
        record: &Record,
        route: Option<(ServedRoute, Slot)>,
        start: Start,
        reply: &Reply,
    ) -> Option<Outcome> {
        let outcome = match start {
            Start::Reserved { reservation: Reservation { worker, attempt, url }, marked, laps } => {
                let _permit = worker;
                let first = FirstAttempt { reserved: Reserved { place: attempt, marked }, url, laps };
                let (route, _slot) = route.unzip();
                self.run(record, route.as_ref(), &self.holder(record.claim), marked, Some(first), reply).await
            }
            Start::Claim => {
                let _permit = self.permits.acquire().await.ok()?;
                // Queued behind other work, it runs under the route as served once a worker is
                // free: a reload meanwhile applies to it, as to any execution not yet begun. Its
                // place moves with it, so that the place and the attempts count on one route.
                drop(route);
                let (route, _slot) = self.route_of(record).unzip();
                self.claim_and_run(record, route.as_ref(), reply).await
            }
            Start::Claimed { worker, granted } => {
                let _permit = worker;
                let (route, _slot) = route.unzip();
                self.run(record, route.as_ref(), &self.holder(record.claim), granted, None, reply).await
            }
        };
        Some(outcome)
    }

    /// The policy a record executes under: the one it was admitted with (so a canary switched
    /// off or on meanwhile moves no record across), or where a reload removed that one, the
    /// choice made now, unsafe to repeat ([`Route::policy_of`]).
    pub(super) fn policy_of<'r>(&self, route: &'r Route, record: &Record) -> Policy<'r> {
        route.policy_of(record.policy_version.as_ref(), self.switches.policy(route, &record.tenant, &record.key))
    }

    pub(super) async fn claim_and_run(&self, record: &Record, route: Option<&ServedRoute>, reply: &Reply) -> Outcome {
        let (now, sent) = (self.clock.now(), crate::domain::clock::Moment::now());
        let claimed =
            self.store.claim(ClaimQueued { id: record.id, owner: self.owner.clone(), lease: self.lease, now }).await;
        lock(&self.mine).remove(&record.id);
        match claimed {
            Ok(Some(token)) => self.run(record, route, &self.holder(token), sent, None, reply).await,
            Ok(None) => Outcome::Lost,
            Err(e) => {
                warn!(error = %e, "could not claim a record; it stays queued");
                Outcome::Lost
            }
        }
    }

    /// Runs attempts until the policy stops, storing each attempt before and after it is sent.
    /// The route and its policy are the ones the execution was started with: those the request
    /// was admitted under, or those in force when it was taken up. A reload during the execution
    /// changes neither, and a route removed since still lets it finish. `granted`: when the write
    /// that claimed it was sent, from which its lease is trusted.
    async fn run(
        &self,
        record: &Record,
        route: Option<&ServedRoute>,
        holder: &Holder,
        granted: crate::domain::clock::Moment,
        first: Option<FirstAttempt>,
        reply: &Reply,
    ) -> Outcome {
        let (url, reserved) = match first {
            Some(FirstAttempt { reserved, url, laps }) => (url, Some((reserved, laps))),
            None => (None, None),
        };
        let Some(route) = route else {
            warn!(route = %record.route, "the record's route is no longer configured");
            return self.settle_unsent(record, holder, false, StopReason::Cancelled).await;
        };
        // Checked at ingress; only a route changed since then can make it fail here.
        let Ok(url) = url.map_or_else(|| route.upstream_url(&record.path, &record.query), Ok) else {
            warn!(route = %record.route, "the record's path would not reach the upstream as recorded; not sending it");
            return self.settle_unsent(record, holder, false, StopReason::Cancelled).await;
        };
        // Chosen once: its attempts are marked, and its end settled, under this one.
        let chosen = self.policy_of(route, record);
        let credential = self.credentials.take(record.id);
        if route.forward_authorization && credential.is_none() {
            // Reached here, a record that is not replay-safe has had no attempt that may have
            // executed (a take-over makes those unknown), so settling frees it.
            warn!("the client's credential is not held by this process; not sending");
            return self.settle_unsent(record, holder, chosen.replay_safe, StopReason::CredentialUnavailable).await;
        }
        let credentials = crate::upstream::route_credentials(route, credential.flatten().as_ref());
        let signal = self.running.start(record.id, holder.token);
        let trust = LeaseTrust::granted(granted, self.trust());
        let job = Job {
            record,
            holder,
            route,
            chosen,
            url,
            credentials: &credentials,
            signal: &signal,
            trust: &trust,
            charges: route.charges(&record.tenant),
            reply,
        };
        let outcome = self.attempts(&job, reserved).await;
        self.running.stopped(record.id, holder.token);
        outcome
    }

    /// Settles a record that this execution sends nothing for.
    async fn settle_unsent(&self, record: &Record, holder: &Holder, replay_safe: bool, stop: StopReason) -> Outcome {
        let progress = Progress::new(record, Duration::ZERO);
        self.finish(record, holder, replay_safe, None, stop, progress).await.0
    }

    /// Hands a record back to the queue between attempts — at shutdown, or when its claim is in
    /// doubt — for another claim (another worker's, or this node's after its restart) to
    /// continue within the same deadline.
    pub(super) async fn release(&self, record: &Record, holder: &Holder, why: HandBack) -> Outcome {
        let release = self.ended(record, holder, None, store::AttemptEnd::Release, self.clock.now());
        let why = match why {
            HandBack::Shutdown => "at shutdown",
            HandBack::ClaimInDoubt => "as its claim is in doubt",
        };
        match self.store.attempt_ended(release).await {
            Ok(_) => tracing::info!(record = %record.id, "handed back {why}"),
            Err(e) => warn!(error = %e, "could not hand a record back {why}; its lease will expire"),
        }
        Outcome::Lost
    }

    /// Settles an execution that made attempts (or meant to): the breaker and the metrics hear
    /// how it ended, then the record is settled.
    pub(super) async fn finish_after(
        &self,
        job: &Job<'_>,
        attempt: Option<Attempt>,
        stop: StopReason,
        p: Progress,
    ) -> Outcome {
        let Job { record, holder, route, .. } = *job;
        // The breaker hears the request's logical outcome, once: did the upstream serve it?
        if let (true, Some(class)) = (stop != StopReason::Cancelled, p.run.last()) {
            let status = p.last_response.as_ref().map(|r| r.status);
            let served = (matches!(class, Class::Success | Class::Final) && status.is_some_and(|s| s < 500))
                || status.is_some_and(|s| route.refuses_the_tenant(s));
            route.record_outcome(served);
        }
        metrics::stopped(&route.name, &record.tenant, stop, p.run.attempts(), since(p.arrival, self.clock.now()));
        match stop {
            StopReason::RetriesOff => metrics::held_by_switch(&route.name, SwitchAction::RetriesOff),
            StopReason::CircuitOpen if self.switches.isolated(&route.name) => {
                metrics::held_by_switch(&route.name, SwitchAction::Isolate)
            }
            _ => {}
        }
        let (outcome, laps) = self.finish(record, holder, job.chosen.replay_safe, attempt, stop, p).await;
        if let Some(laps) = laps {
            job.reply.keep_stages(laps);
        }
        outcome
    }

    /// Stores the record's end, as the policy settles it, and wakes whoever waits for it. With
    /// the outcome come the new key's stages up to its commit, if it was timed and did not stream.
    async fn finish(
        &self,
        record: &Record,
        holder: &Holder,
        replay_safe: bool,
        attempt: Option<Attempt>,
        stop: StopReason,
        p: Progress,
    ) -> (Outcome, Option<Laps>) {
        // One attempt answered and that answer ended it: the attempt's own line says so.
        let told_by_its_attempt =
            p.run.attempts() == 1 && matches!(stop, StopReason::Success | StopReason::FinalResponse);
        let (then, outcome) = match (p.run.settle(stop, replay_safe), p.last_response, p.partial) {
            (Settlement::Done, Some(response), _) => {
                (store::AttemptEnd::Done(stop, response.clone()), Outcome::Done(stop, response))
            }
            (Settlement::Free, last, _) => {
                (store::AttemptEnd::Free(stop), Outcome::Free { stop, last, unreachable: p.unreachable })
            }
            (Settlement::Unknown, _, Some(partial)) => (store::AttemptEnd::Cut(stop, partial), Outcome::Unknown(stop)),
            // `Done` always comes with the response that made it so; should it ever not, the
            // safe reading of an execution we cannot show is "unknown".
            (Settlement::Unknown, _, None) | (Settlement::Done, None, _) => {
                (store::AttemptEnd::Unknown(stop), Outcome::Unknown(stop))
            }
        };
        // A streamed answer's facts go with its outcome, in the same write.
        let ended = AttemptEnded { stream: p.stream, ..self.ended(record, holder, attempt, then, self.clock.now()) };
        // A streamed answer reached its client before its outcome was stored: its stages would
        // not add up to its way.
        let mut laps = p.laps.filter(|_| ended.stream.is_none());
        if let Some(laps) = &mut laps {
            if let Some(answered) = p.upstream_answered {
                laps.lap_at(Stage::Upstream, answered);
            }
            laps.lap(Stage::ToOutcome);
        }
        let result = self.store.attempt_ended(ended.clone()).await;
        if let Some(laps) = &mut laps {
            laps.lap(Stage::OutcomeCommit);
        }
        self.settled.settled(record.id);
        let outcome = match result {
            Ok(LeaseStatus::Held { .. }) if told_by_its_attempt => {
                tracing::debug!(stop = stop.as_str(), "settled");
                outcome
            }
            Ok(LeaseStatus::Held { .. }) => {
                tracing::info!(stop = stop.as_str(), "settled");
                outcome
            }
            Ok(LeaseStatus::Lost) => Outcome::Lost,
            Err(e) => {
                let status = ended.attempt.as_ref().and_then(|a| a.status);
                self.write_later(ended, &record.route, status, &e);
                Outcome::Unrecorded(Box::new(outcome))
            }
        };
        (outcome, laps)
    }
}
