//! One request's walk through a policy on the logical clock, a step at a time: an attempt
//! starts, then it ends and the policy decides. Split so that many requests can be interleaved
//! in time order, sharing one retry budget as the broker's requests on a route do; a lone
//! simulation simply steps until the end.

use std::time::{Duration, Instant};

use super::{AttemptStep, Encounter, End, Step, Trace, Verdict, WaitStep};
use crate::policy::{Charge, Decision, Ended, Execution, Observed, RetryPolicy, Switched};

/// Where the outcomes of attempts come from: a script, or recorded history.
pub trait AttemptSource {
    /// What attempt `number` meets when it starts `at` after the request's arrival with `limit`
    /// to run; `None` when nothing says.
    fn outcome(&mut self, number: u32, at: Duration, limit: Duration) -> Option<Encounter>;
}

/// A script's outcomes in order, whatever the attempt's time.
pub struct InOrder<'a>(pub std::slice::Iter<'a, Encounter>);

impl AttemptSource for InOrder<'_> {
    fn outcome(&mut self, _: u32, _: Duration, _: Duration) -> Option<Encounter> {
        self.0.next().cloned()
    }
}

/// An attempt that has started: what it will meet and when it must end.
struct InFlight {
    number: u32,
    limit: Duration,
    outcome: Encounter,
}

pub struct Replay<'p> {
    policy: &'p RetryPolicy,
    replay_safe: bool,
    /// The request's arrival on the budget's clock.
    arrival: Instant,
    run: Execution,
    now: Duration,
    steps: Vec<Step>,
    draws: Vec<f64>,
    in_flight: Option<InFlight>,
    end: Option<End>,
}

impl<'p> Replay<'p> {
    /// A request arriving at `arrival` whose first attempt can start `start` later (the time it
    /// spent queued).
    pub fn new(policy: &'p RetryPolicy, replay_safe: bool, arrival: Instant, start: Duration) -> Replay<'p> {
        Replay {
            policy,
            replay_safe,
            arrival,
            run: Execution::default(),
            now: start,
            steps: Vec::new(),
            draws: Vec::new(),
            in_flight: None,
            end: None,
        }
    }

    /// When, after arrival, the next step happens; `None` once the request has ended.
    pub fn next_at(&self) -> Option<Duration> {
        match (&self.end, &self.in_flight) {
            (Some(_), _) => None,
            (None, Some(attempt)) => Some(self.now + attempt.outcome.after.min(attempt.limit)),
            (None, None) => Some(self.now),
        }
    }

    /// Takes the next step: starts an attempt, or ends the one in flight and asks the policy
    /// what follows.
    pub fn step(
        &mut self,
        upstream: &mut impl AttemptSource,
        budget: &mut impl Charge,
        draw: &mut impl FnMut() -> f64,
    ) {
        if self.end.is_some() {
            return;
        }
        match self.in_flight.take() {
            None => self.start(upstream, budget),
            Some(attempt) => self.finish(attempt, budget, draw),
        }
    }

    pub fn trace(self, unused: Vec<Encounter>) -> Trace {
        let end = self.end.unwrap_or(End::ScriptExhausted { next: self.run.attempts() + 1 });
        Trace { steps: self.steps, end, elapsed: self.now, attempts: self.run.attempts(), draws: self.draws, unused }
    }

    fn stop(&mut self, reason: crate::domain::StopReason) {
        self.end = Some(End::Stopped { reason, state: self.run.settle(reason, self.replay_safe) });
    }

    fn start(&mut self, upstream: &mut impl AttemptSource, budget: &mut impl Charge) {
        let number = self.run.attempts() + 1;
        let limit = match self.run.next_attempt(self.policy, self.now, false, Switched::default()) {
            Ok(limit) => limit,
            Err(reason) => {
                self.steps.push(Step::NotStarted { number, elapsed: self.now, reason });
                return self.stop(reason);
            }
        };
        let Some(outcome) = upstream.outcome(number, self.now, limit) else {
            self.end = Some(End::ScriptExhausted { next: number });
            return;
        };
        if self.run.sending() == 1 {
            budget.first_attempt(self.arrival + self.now);
        }
        self.in_flight = Some(InFlight { number, limit, outcome });
    }

    fn finish(&mut self, attempt: InFlight, budget: &mut impl Charge, draw: &mut impl FnMut() -> f64) {
        let InFlight { number, limit, outcome } = attempt;
        let (policy, replay_safe) = (self.policy, self.replay_safe);
        let late = outcome.after > limit;
        let (observed, retry_after) =
            if late { (Observed::TimedOut, None) } else { (outcome.observed(), outcome.retry_after) };
        let cost = outcome.after.min(limit);
        self.now += cost;
        let now = self.now;
        let at = self.arrival + now;
        let previous_wait = self.run.previous_wait();
        let mut drawn = None;
        let (class, decision) = self.run.ended(
            policy,
            replay_safe,
            Ended {
                observed,
                retry_after,
                elapsed: now,
                cancelled: outcome.cancel,
                circuit_open: false,
                // A simulation has no operator switch on.
                retries_off: false,
            },
            || *drawn.insert(draw()),
            || budget.retry(at),
        );
        // The policy draws exactly when it computes a wait: without a draw it stopped first.
        let verdict = match (decision, drawn) {
            (Decision::Stop(reason), None) => Verdict::Stop(reason),
            _ => Verdict::Retryable,
        };
        self.steps.push(Step::Attempt(AttemptStep {
            number,
            limit,
            outcome,
            late,
            observed,
            class,
            retry_after,
            cost,
            elapsed: now,
            verdict,
        }));
        self.draws.extend(drawn);
        if let Verdict::Stop(reason) = verdict {
            return self.stop(reason);
        }
        let planned = drawn.map(|d| policy.planned_wait(number, previous_wait, retry_after, d));
        let wait = WaitStep {
            before: number + 1,
            draw: drawn,
            backoff: planned.map_or(Duration::ZERO, |p| p.backoff),
            retry_after,
            wait: planned.map_or(Duration::ZERO, |p| p.wait),
            cost: Duration::ZERO,
            elapsed: now,
            verdict: Verdict::Retry,
        };
        match decision {
            Decision::Stop(reason) => {
                self.steps.push(Step::Wait(WaitStep { verdict: Verdict::Stop(reason), ..wait }));
                self.stop(reason);
            }
            Decision::RetryAfter(taken) => {
                self.now += taken;
                self.run.waited(taken);
                self.steps.push(Step::Wait(WaitStep { wait: taken, cost: taken, elapsed: self.now, ..wait }));
            }
        }
    }
}
