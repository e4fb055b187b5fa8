//! The retry policy: pure decisions, no I/O and no clock reads. The worker tells it what an
//! attempt produced and how much of the end-to-end deadline has been spent; it answers whether to
//! stop (and why) or how long to wait before the next attempt. Randomness is passed in, so every
//! decision can be reproduced exactly in a test.

use std::time::{Duration, SystemTime};

mod breaker;
mod budget;
mod execution;
mod pace;
mod sides;
mod version;

pub(crate) use breaker::{Breaker, BreakerSettings, BreakerState};
pub(crate) use budget::{withdraw_from_all, Charge, RetryBudget};
pub(crate) use execution::{Ended, Execution};
pub(crate) use pace::{outcome_eta, Pending, RoutePace};
pub(crate) use sides::{in_canary, stop_reason as canary_stop_reason, CanarySide, CanaryStop, Cohort};
pub(crate) use version::Effective;

use crate::domain::{AttemptError, BudgetScope, Class, StopReason};

/// A route's retry settings (docs/configuration.md `[routes.retry]`), already validated.
#[derive(Debug, Clone, PartialEq)]
pub struct RetryPolicy {
    /// Total attempts, the first included.
    pub max_attempts: u32,
    /// End-to-end, from the request's arrival: queueing, attempts and waits all count.
    pub deadline: Duration,
    pub per_try_timeout: Duration,
    /// No attempt starts, and no wait begins, that would leave less than this.
    pub min_try: Duration,
    pub base: Duration,
    pub cap: Duration,
    pub jitter: Jitter,
    /// Statuses meaning "the upstream did not execute it".
    pub not_processed: Vec<u16>,
    /// Statuses meaning "it may have executed".
    pub ambiguous: Vec<u16>,
    pub budget_ratio: f64,
    pub budget_min_per_sec: f64,
    /// After a streamed answer's first byte reached the client: the longest silence between two
    /// parts before the stream counts as cut (docs/concepts.md).
    pub stream_idle_timeout: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Jitter {
    /// U[0, ceiling]
    Full,
    /// ceiling/2 + U[0, ceiling/2]
    Equal,
    /// min(cap, U[base, 3·previous wait])
    Decorrelated,
    /// exactly the ceiling
    None,
}

/// What the worker saw of one attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Observed {
    /// A complete response arrived within the attempt's time limit.
    Response(u16),
    /// The connection could not be made: nothing was sent.
    ConnectFailed,
    /// The attempt was given up before its first byte, too long after the write that marked it
    /// (`worker.send_window`): nothing was sent.
    NotSent,
    /// No complete response within the attempt's limit, after the request may have been written.
    /// A response arriving later is never used.
    TimedOut,
    /// An I/O error after the request may have been written, or a body cut after the status.
    Broken,
}

impl Observed {
    /// How the attempt ended when no status arrived, as stored with it.
    pub fn error(&self) -> Option<AttemptError> {
        match self {
            Observed::Response(_) => None,
            Observed::ConnectFailed => Some(AttemptError::ConnectFailed),
            Observed::NotSent => Some(AttemptError::NotSent),
            Observed::TimedOut => Some(AttemptError::TimedOut),
            Observed::Broken => Some(AttemptError::Broken),
        }
    }
}

/// What to do after an attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    Stop(StopReason),
    RetryAfter(Duration),
}

/// A wait before a retry, and the backoff it was raised from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlannedWait {
    pub backoff: Duration,
    pub wait: Duration,
}

/// Everything the policy needs to know about the attempt that just ended.
#[derive(Debug, Clone, Copy)]
pub struct AfterAttempt {
    /// Attempts made so far, this one included.
    pub attempts: u32,
    pub class: Class,
    /// The upstream's `Retry-After`, already parsed; only from a response that arrived in time.
    pub retry_after: Option<Duration>,
    /// Time spent since the request arrived, this attempt included.
    pub elapsed: Duration,
    /// The wait before this attempt (feeds decorrelated jitter); `None` after the first.
    pub previous_wait: Option<Duration>,
    pub cancelled: bool,
    pub circuit_open: bool,
    /// An operator's `retries_off` switch is on for the route.
    pub retries_off: bool,
}

/// The operator's emergency switches over a route as they stand when a decision is made
/// (docs/operations.md). The policy is told, never looks: the worker reads them, `idem simulate` has none.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Switched {
    /// No retry starts: first attempts only.
    pub retries_off: bool,
    /// The route's upstream is cut off: no attempt starts at all.
    pub isolated: bool,
}

impl RetryPolicy {
    pub fn classify(&self, observed: Observed) -> Class {
        match observed {
            Observed::Response(status) if (200..300).contains(&status) => Class::Success,
            Observed::Response(status) if self.not_processed.contains(&status) => Class::NotExecuted,
            Observed::Response(status) if self.ambiguous.contains(&status) => Class::Ambiguous,
            Observed::Response(_) => Class::Final,
            Observed::ConnectFailed | Observed::NotSent => Class::NotExecuted,
            Observed::TimedOut | Observed::Broken => Class::Ambiguous,
        }
    }

    /// The time limit of an attempt starting after `elapsed`, or why it must not start.
    pub fn attempt_limit(&self, elapsed: Duration) -> Result<Duration, StopReason> {
        let remaining = self.deadline.saturating_sub(elapsed);
        if remaining < self.min_try {
            return Err(StopReason::Deadline);
        }
        Ok(self.per_try_timeout.min(remaining))
    }

    /// The backoff ceiling before retry `n` (1 for the first retry): min(cap, base·2^(n-1)).
    pub fn ceiling(&self, retry: u32) -> Duration {
        let factor = 1u32.checked_shl(retry.saturating_sub(1)).unwrap_or(u32::MAX);
        self.base.saturating_mul(factor).min(self.cap)
    }

    /// The jittered wait before retry `retry`; `draw` is a uniform sample in [0, 1].
    pub fn jittered(&self, retry: u32, previous_wait: Option<Duration>, draw: f64) -> Duration {
        let draw = if draw.is_finite() { draw.clamp(0.0, 1.0) } else { 0.0 };
        let ceiling = self.ceiling(retry);
        match self.jitter {
            Jitter::None => ceiling,
            Jitter::Full => floor_ms(ceiling.mul_f64(draw)),
            Jitter::Equal => floor_ms(ceiling / 2 + (ceiling / 2).mul_f64(draw)),
            Jitter::Decorrelated => {
                let low = self.base;
                let high = previous_wait.unwrap_or(self.base).saturating_mul(3).max(low);
                floor_ms(low + (high - low).mul_f64(draw)).min(self.cap)
            }
        }
    }

    /// The wait before retry `retry`: the jittered backoff, raised to the upstream's `Retry-After`
    /// when that is larger, since a `Retry-After` is a floor that is never shortened.
    pub fn planned_wait(
        &self,
        retry: u32,
        previous_wait: Option<Duration>,
        retry_after: Option<Duration>,
        draw: f64,
    ) -> PlannedWait {
        let backoff = self.jittered(retry, previous_wait, draw);
        PlannedWait { backoff, wait: backoff.max(retry_after.unwrap_or_default()) }
    }

    /// Decides what follows an attempt. The checks run in the order that keeps every promise:
    /// a cancel or a spent deadline beats a success that came too late; a possibly-executed
    /// attempt is never repeated on a route that is not replay-safe; a `Retry-After` is a floor
    /// that is never shortened, so when it does not fit in what remains, nothing more is sent.
    /// `draw` is called only when a wait is actually computed; `take_budget` only when a retry
    /// would otherwise happen, and names the budget that refused it, if one did.
    pub fn after_attempt(
        &self,
        replay_safe: bool,
        a: AfterAttempt,
        draw: impl FnOnce() -> f64,
        take_budget: impl FnOnce() -> Result<(), BudgetScope>,
    ) -> Decision {
        if a.cancelled {
            return Decision::Stop(StopReason::Cancelled);
        }
        if a.elapsed >= self.deadline {
            return Decision::Stop(StopReason::Deadline);
        }
        match a.class {
            Class::Success => return Decision::Stop(StopReason::Success),
            Class::Final => return Decision::Stop(StopReason::FinalResponse),
            Class::Ambiguous if !replay_safe => return Decision::Stop(StopReason::UnsafeReplay),
            Class::Ambiguous | Class::NotExecuted => {}
        }
        if a.attempts >= self.max_attempts {
            return Decision::Stop(StopReason::AttemptCap);
        }
        if a.circuit_open {
            return Decision::Stop(StopReason::CircuitOpen);
        }
        if a.retries_off {
            return Decision::Stop(StopReason::RetriesOff);
        }
        let PlannedWait { backoff: jittered, wait } =
            self.planned_wait(a.attempts, a.previous_wait, a.retry_after, draw());
        let remaining = self.deadline - a.elapsed;
        if remaining.saturating_sub(wait) < self.min_try {
            let floor_was_the_cause =
                a.retry_after.is_some_and(|ra| ra > jittered) && remaining.saturating_sub(jittered) >= self.min_try;
            return Decision::Stop(if floor_was_the_cause {
                StopReason::RetryAfterBeyondDeadline
            } else {
                StopReason::Deadline
            });
        }
        if let Err(scope) = take_budget() {
            return Decision::Stop(scope.stop_reason());
        }
        Decision::RetryAfter(wait)
    }
}

/// Where a record lands once its execution stops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settlement {
    /// The last attempt's response is stored and replayed.
    Done,
    /// It may have executed; it must not be sent again automatically.
    Unknown,
    /// Nothing executed (or the route is replay-safe): the key is released.
    Free,
}

/// Decides the record's fate from why execution stopped and what the attempts showed.
/// `last` is the class of the last attempt, if one ran; `any_ambiguous` says whether any attempt
/// of this execution may have executed.
pub(crate) fn settle(stop: StopReason, last: Option<Class>, any_ambiguous: bool, replay_safe: bool) -> Settlement {
    match stop {
        StopReason::Success | StopReason::FinalResponse => Settlement::Done,
        StopReason::UnsafeReplay => Settlement::Unknown,
        // A response that executed stays the answer even when it came too late for the client:
        // forgetting it would let a retry execute the operation a second time.
        _ if matches!(last, Some(Class::Success | Class::Final)) => Settlement::Done,
        _ if any_ambiguous && !replay_safe => Settlement::Unknown,
        _ => Settlement::Free,
    }
}

fn floor_ms(d: Duration) -> Duration {
    Duration::from_millis(d.as_millis() as u64)
}

/// The longest `Retry-After` taken as it is: about 136 years, later than any deadline, and small
/// enough for any arithmetic on it. A longer one, as a number or as a date, is cut to this.
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(u32::MAX as u64);

/// Parses a `Retry-After` value: delta-seconds or an HTTP-date (IMF-fixdate, RFC 850, asctime).
/// A date in the past means "now" (zero). Anything else is `None`: ignored, never guessed at.
/// Only HTTP's own whitespace (spaces and tabs) around the value is ignored.
pub fn parse_retry_after(value: &str, now: SystemTime) -> Option<Duration> {
    let value = value.trim_matches([' ', '\t']);
    if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) {
        // An absurdly long number still means "later than any deadline", not garbage.
        let secs = value.parse::<u64>().unwrap_or(u64::MAX);
        return Some(Duration::from_secs(secs).min(MAX_RETRY_AFTER));
    }
    let when = httpdate::parse_http_date(value).ok()?;
    Some(when.duration_since(now).unwrap_or_default().min(MAX_RETRY_AFTER))
}

#[cfg(test)]
impl RetryPolicy {
    /// The seed article's policy: 1500 ms budget, 600 ms per try, 100 ms minimum window,
    /// base 200 ms, cap 800 ms, full jitter; the fixture of every test that follows the article.
    pub(crate) fn seed_example() -> RetryPolicy {
        let ms = Duration::from_millis;
        RetryPolicy {
            max_attempts: 3,
            deadline: ms(1500),
            per_try_timeout: ms(600),
            min_try: ms(100),
            base: ms(200),
            cap: ms(800),
            jitter: Jitter::Full,
            not_processed: vec![429, 503],
            ambiguous: vec![502, 504],
            budget_ratio: 0.1,
            budget_min_per_sec: 10.0,
            stream_idle_timeout: Duration::from_secs(30),
        }
    }
}

#[cfg(test)]
mod tests;
