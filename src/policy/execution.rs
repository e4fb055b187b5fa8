//! One execution's walk through the policy, attempt by attempt: the order in which the checks of
//! [`RetryPolicy`] are asked, and what each answer leaves behind for the next one. The worker
//! follows it against a real upstream and `idem simulate` replays it on a logical clock; keeping
//! the sequence here means the two cannot drift apart.

use std::time::Duration;

use super::{AfterAttempt, Class, Decision, Observed, RetryPolicy, Settlement, StopReason, Switched};
use crate::domain::BudgetScope;

/// What an execution has learned so far that the policy's next decisions depend on.
#[derive(Debug, Clone, Default)]
pub(crate) struct Execution {
    /// Attempts of this execution, including any an earlier worker made before a take-over:
    /// they count against `max_attempts`, as the deadline they spent does.
    made: u32,
    /// The wait before the latest attempt: decorrelated jitter grows from it.
    previous_wait: Option<Duration>,
    /// Whether any attempt may have executed: it decides whether the key can be released.
    any_ambiguous: bool,
    /// The class of the latest attempt: a response that executed stays the answer.
    last: Option<Class>,
}

/// What is known when an attempt ends.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ended {
    pub observed: Observed,
    /// The upstream's `Retry-After`, parsed; only from a response that arrived within the limit.
    pub retry_after: Option<Duration>,
    /// Time spent since the request arrived, this attempt included.
    pub elapsed: Duration,
    pub cancelled: bool,
    pub circuit_open: bool,
    /// An operator's `retries_off` switch is on for the route as the attempt ends.
    pub retries_off: bool,
}

impl Execution {
    /// An execution that starts with `made` attempts already spent on the same deadline.
    pub(crate) fn resumed(made: u32) -> Execution {
        Execution { made, ..Execution::default() }
    }

    pub(crate) fn attempts(&self) -> u32 {
        self.made
    }

    pub(crate) fn last(&self) -> Option<Class> {
        self.last
    }

    pub(crate) fn previous_wait(&self) -> Option<Duration> {
        self.previous_wait
    }

    /// Whether another attempt may start after `elapsed`, and if so its time limit. A cancel
    /// raised before it is sent stops it, but only once the deadline has had its say, so that a
    /// spent deadline is reported as such. The operator's switches, set since the last decision,
    /// stop it too: an isolated route sends nothing more (stopping as an open circuit does), and
    /// with retries off only a first attempt starts.
    pub(crate) fn next_attempt(
        &self,
        policy: &RetryPolicy,
        elapsed: Duration,
        cancelled: bool,
        switched: Switched,
    ) -> Result<Duration, StopReason> {
        let limit = policy.attempt_limit(elapsed)?;
        if cancelled {
            return Err(StopReason::Cancelled);
        }
        if switched.isolated {
            return Err(StopReason::CircuitOpen);
        }
        if switched.retries_off && self.made > 0 {
            return Err(StopReason::RetriesOff);
        }
        Ok(limit)
    }

    /// The attempt is about to be sent: from here on it counts. Returns how many have been made.
    pub(crate) fn sending(&mut self) -> u32 {
        self.made += 1;
        self.made
    }

    /// The attempt ended: classifies what it produced and asks the policy what follows. `draw`
    /// is called only when a wait is computed, `take_budget` only when a retry would happen.
    pub(crate) fn ended(
        &mut self,
        policy: &RetryPolicy,
        replay_safe: bool,
        ended: Ended,
        draw: impl FnOnce() -> f64,
        take_budget: impl FnOnce() -> Result<(), BudgetScope>,
    ) -> (Class, Decision) {
        let class = policy.classify(ended.observed);
        self.any_ambiguous |= class == Class::Ambiguous;
        self.last = Some(class);
        let decision = policy.after_attempt(
            replay_safe,
            AfterAttempt {
                attempts: self.made,
                class,
                retry_after: ended.retry_after,
                elapsed: ended.elapsed,
                previous_wait: self.previous_wait,
                cancelled: ended.cancelled,
                circuit_open: ended.circuit_open,
                retries_off: ended.retries_off,
            },
            draw,
            take_budget,
        );
        (class, decision)
    }

    /// A wait before the next attempt is over (or, after a take-over, known to have been owed).
    pub(crate) fn waited(&mut self, wait: Duration) {
        self.previous_wait = Some(wait);
    }

    /// Where the record lands when execution stops for `stop`.
    pub(crate) fn settle(&self, stop: StopReason, replay_safe: bool) -> Settlement {
        super::settle(stop, self.last, self.any_ambiguous, replay_safe)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn seed() -> RetryPolicy {
        RetryPolicy::seed_example()
    }

    fn ended(observed: Observed, elapsed: u64) -> Ended {
        Ended {
            observed,
            retry_after: None,
            elapsed: ms(elapsed),
            cancelled: false,
            circuit_open: false,
            retries_off: false,
        }
    }

    #[test]
    fn attempts_made_before_a_take_over_count_against_the_cap() {
        let p = seed();
        let mut run = Execution::resumed(2);
        assert_eq!(run.next_attempt(&p, ms(100), false, Switched::default()), Ok(ms(600)));
        assert_eq!(run.sending(), 3);
        let (_, d) = run.ended(&p, true, ended(Observed::Response(503), 200), || 0.5, || Ok(()));
        assert_eq!(d, Decision::Stop(StopReason::AttemptCap));
    }

    #[test]
    fn a_cancel_before_sending_yields_to_a_spent_deadline() {
        let run = Execution::default();
        let none = Switched::default();
        assert_eq!(run.next_attempt(&seed(), ms(10), true, none), Err(StopReason::Cancelled));
        assert_eq!(run.next_attempt(&seed(), ms(1450), true, none), Err(StopReason::Deadline));
    }

    #[test]
    fn with_retries_off_only_a_first_attempt_starts_and_an_isolated_route_gets_none() {
        let p = seed();
        let off = Switched { retries_off: true, isolated: false };
        let isolated = Switched { retries_off: false, isolated: true };
        let mut run = Execution::default();
        assert_eq!(run.next_attempt(&p, ms(0), false, off), Ok(ms(600)));
        assert_eq!(run.next_attempt(&p, ms(0), false, isolated), Err(StopReason::CircuitOpen));
        run.sending();
        assert_eq!(run.next_attempt(&p, ms(300), false, off), Err(StopReason::RetriesOff));
        // Taken over after an attempt elsewhere: that one was the first.
        assert_eq!(Execution::resumed(1).next_attempt(&p, ms(300), false, off), Err(StopReason::RetriesOff));

        let mut switched = ended(Observed::Response(503), 200);
        switched.retries_off = true;
        let (class, d) = run.ended(&p, true, switched, || 0.5, || panic!("no retry, so no budget taken"));
        assert_eq!(class, Class::NotExecuted);
        assert_eq!(d, Decision::Stop(StopReason::RetriesOff));
        assert_eq!(run.settle(StopReason::RetriesOff, false), Settlement::Free);
        // A final answer is still final: the switch only takes away retries.
        let mut success = ended(Observed::Response(200), 200);
        success.retries_off = true;
        assert_eq!(run.ended(&p, true, success, || 0.5, || Ok(())).1, Decision::Stop(StopReason::Success));
    }

    #[test]
    fn an_ambiguous_attempt_is_remembered_when_a_later_one_is_not() {
        let p = seed();
        let mut run = Execution::default();
        run.sending();
        let (class, d) = run.ended(&p, true, ended(Observed::TimedOut, 600), || 0.0, || Ok(()));
        assert_eq!(class, Class::Ambiguous);
        let Decision::RetryAfter(wait) = d else { panic!("expected a retry, got {d:?}") };
        run.waited(wait);
        assert_eq!(run.previous_wait(), Some(ms(0)));
        run.sending();
        let (_, d) = run.ended(&p, false, ended(Observed::ConnectFailed, 700), || 0.0, || Err(BudgetScope::Route));
        assert_eq!(d, Decision::Stop(StopReason::RetryBudget));
        assert_eq!(run.last(), Some(Class::NotExecuted));
        assert_eq!(run.settle(StopReason::RetryBudget, false), Settlement::Unknown);
        assert_eq!(run.settle(StopReason::RetryBudget, true), Settlement::Free);
    }
}
