//! `idem simulate`: a route's real retry policy run against a scripted upstream on a logical
//! clock — no network, no sleeping. Each attempt goes through [`Execution`], the same
//! sequence of decisions the worker follows, so what the simulation shows is what the broker
//! would do. The route is taken to be quiet: its retry budget is fresh and its circuit closed.

use std::time::{Duration, Instant};

use crate::config::Config;
use crate::domain::{Class, State, StopReason};
use crate::policy::{Observed, RetryBudget, RetryPolicy, Settlement};

pub mod history;
mod report;
mod run;
mod script;

pub use report::{human, json};
pub use run::{AttemptSource, InOrder, Replay};
pub use script::{DrawError, Draws, Encounter, Script, ScriptError, Scripted};

/// Everything that happened, step by step, and how it ended.
#[derive(Debug, Clone)]
pub struct Trace {
    pub steps: Vec<Step>,
    pub end: End,
    /// Time from the request's arrival to the end.
    pub elapsed: Duration,
    pub attempts: u32,
    /// Every jitter draw the policy used, in order: given to `--draw`, they reproduce the run.
    pub draws: Vec<f64>,
    /// Scripted outcomes no attempt reached.
    pub unused: Vec<Encounter>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    Stopped {
        reason: StopReason,
        state: Settlement,
    },
    /// The policy would send attempt `next` now, but the script has no outcome for it. Not a
    /// stop reason: the record would still be in progress.
    ScriptExhausted {
        next: u32,
    },
}

#[derive(Debug, Clone)]
pub enum Step {
    Attempt(AttemptStep),
    Wait(WaitStep),
    /// An attempt the policy did not let start.
    NotStarted {
        number: u32,
        elapsed: Duration,
        reason: StopReason,
    },
}

#[derive(Debug, Clone)]
pub struct AttemptStep {
    pub number: u32,
    pub limit: Duration,
    pub outcome: Encounter,
    /// The scripted answer came after the limit: the broker saw a timeout and nothing of it,
    /// its `Retry-After` included.
    pub late: bool,
    pub observed: Observed,
    pub class: Class,
    /// The `Retry-After` the policy was given.
    pub retry_after: Option<Duration>,
    pub cost: Duration,
    pub elapsed: Duration,
    pub verdict: Verdict,
}

#[derive(Debug, Clone)]
pub struct WaitStep {
    /// The attempt the wait would precede.
    pub before: u32,
    /// `None` only if the policy ever waited without drawing, which it does not.
    pub draw: Option<f64>,
    pub backoff: Duration,
    pub retry_after: Option<Duration>,
    pub wait: Duration,
    /// Zero when the wait was only planned: a stop does not sleep.
    pub cost: Duration,
    pub elapsed: Duration,
    pub verdict: Verdict,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The attempt may be retried: the policy plans a wait (the next step).
    Retryable,
    /// The wait fits: the next attempt follows it.
    Retry,
    Stop(StopReason),
}

/// Runs `outcomes` through `policy` on a route whose replay safety is `replay_safe`, taking
/// jitter draws from `draw`.
pub fn simulate(
    policy: &RetryPolicy,
    replay_safe: bool,
    outcomes: &[Encounter],
    mut draw: impl FnMut() -> f64,
) -> Trace {
    // The budget counts in instants; only offsets from this one are ever used.
    let origin = Instant::now();
    let mut budget = RetryBudget::new(policy.budget_ratio, policy.budget_min_per_sec, origin);
    let mut script = InOrder(outcomes.iter());
    let mut replay = Replay::new(policy, replay_safe, origin, Duration::ZERO);
    while replay.next_at().is_some() {
        replay.step(&mut script, &mut budget, &mut draw);
    }
    replay.trace(script.0.cloned().collect())
}

#[derive(Debug, thiserror::Error)]
pub enum SimulateError {
    #[error("no route named `{route}` in the config (routes: {known})")]
    UnknownRoute { route: String, known: String },
}

/// `idem simulate`: the route's policy from `config`, the script, and either fixed draws or
/// random ones; the report as a table or as one JSON document.
pub fn command(
    config: &Config,
    route: &str,
    script: &Script,
    draws: Option<&Draws>,
    as_json: bool,
) -> Result<String, SimulateError> {
    let Some(r) = config.route_named(route) else {
        let known = config.routes.iter().map(|r| r.name.as_str()).collect::<Vec<_>>().join(", ");
        return Err(SimulateError::UnknownRoute { route: route.to_string(), known });
    };
    let trace = match draws {
        Some(draws) => simulate(&r.retry, r.replay_safe, script.outcomes(), draws.source()),
        None => simulate(&r.retry, r.replay_safe, script.outcomes(), rand::random::<f64>),
    };
    let random = draws.is_none();
    Ok(if as_json {
        let mut text =
            serde_json::to_string_pretty(&json(&trace, &r.name, &r.retry, r.replay_safe, random)).unwrap_or_default();
        text.push('\n');
        text
    } else {
        human(&trace, &r.name, &r.retry, r.replay_safe, random)
    })
}

/// The state a record would end in.
pub fn final_state(end: End) -> State {
    match end {
        End::Stopped { state: Settlement::Done, .. } => State::Done,
        End::Stopped { state: Settlement::Unknown, .. } => State::Unknown,
        End::Stopped { state: Settlement::Free, .. } => State::NotStarted,
        End::ScriptExhausted { .. } => State::InProgress,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::Jitter;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn seed() -> RetryPolicy {
        RetryPolicy::seed_example()
    }

    fn run(policy: &RetryPolicy, replay_safe: bool, script: &str) -> Trace {
        let script: Script = script.parse().unwrap();
        simulate(policy, replay_safe, script.outcomes(), || 0.5)
    }

    #[test]
    fn the_worked_example_stops_at_1300_ms_with_a_planned_wait_it_never_takes() {
        let t = run(&seed(), true, "400ms:503 retry-after=300ms, 700ms:200, 100ms:200");
        assert_eq!(t.end, End::Stopped { reason: StopReason::Deadline, state: Settlement::Free });
        assert_eq!((t.elapsed, t.attempts, t.draws.clone()), (ms(1300), 2, vec![0.5, 0.5]));
        let Step::Wait(last) = &t.steps[3] else { panic!("{:?}", t.steps[3]) };
        assert_eq!((last.backoff, last.wait, last.cost, last.elapsed), (ms(200), ms(200), ms(0), ms(1300)));
        assert_eq!(t.unused.len(), 1);
    }

    #[test]
    fn a_quiet_route_with_no_retry_floor_has_no_budget_for_a_retry() {
        let policy = RetryPolicy { budget_min_per_sec: 0.0, ..seed() };
        let t = run(&policy, false, "100ms:503, 100ms:200");
        assert_eq!(t.end, End::Stopped { reason: StopReason::RetryBudget, state: Settlement::Free });
        assert_eq!(t.elapsed, ms(100));
    }

    #[test]
    fn a_cancel_lets_the_attempt_finish_and_its_outcome_decides_the_state() {
        let t = run(&seed(), false, "100ms:200 cancel, 100ms:200");
        assert_eq!(t.end, End::Stopped { reason: StopReason::Cancelled, state: Settlement::Done });
        let t = run(&seed(), false, "100ms:cancel");
        assert_eq!(t.end, End::Stopped { reason: StopReason::Cancelled, state: Settlement::Unknown });
    }

    #[test]
    fn decorrelated_jitter_grows_from_the_wait_actually_taken() {
        let policy = RetryPolicy { jitter: Jitter::Decorrelated, max_attempts: 4, deadline: ms(10_000), ..seed() };
        let t = run(&policy, true, "10ms:503, 10ms:503, 10ms:503, 10ms:200");
        let waits: Vec<_> =
            t.steps.iter().filter_map(|s| if let Step::Wait(w) = s { Some(w.wait) } else { None }).collect();
        // U[200, 3·200] at 0.5 is 400; then U[200, 3·400] at 0.5 is 700, capped at 800.
        assert_eq!(waits, vec![ms(400), ms(700), ms(800)]);
        assert_eq!(t.end, End::Stopped { reason: StopReason::Success, state: Settlement::Done });
    }

    #[test]
    fn a_script_that_runs_out_leaves_the_record_in_progress() {
        let t = run(&seed(), false, "400ms:503");
        assert_eq!(t.end, End::ScriptExhausted { next: 2 });
        assert_eq!(t.elapsed, ms(500), "the 100 ms wait was taken before attempt 2 found no outcome");
        assert_eq!(final_state(t.end), State::InProgress);
    }
}
