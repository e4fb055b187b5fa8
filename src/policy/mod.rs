//! The retry policy: pure decisions, no I/O and no clock reads. The worker tells it what an
//! attempt produced and how much of the end-to-end deadline has been spent; it answers whether to
//! stop (and why) or how long to wait before the next attempt. Randomness is passed in, so every
//! decision can be reproduced exactly in a test.

use std::time::{Duration, SystemTime};

mod breaker;
mod budget;
mod execution;
mod pace;

pub use breaker::{Breaker, BreakerSettings, BreakerState};
pub use budget::RetryBudget;
pub use execution::{Ended, Execution};
pub use pace::{outcome_eta, Pace, Pending};

/// A route's retry settings (SPEC §2 `[routes.retry]`), already validated.
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
    /// No complete response within the attempt's limit, after the request may have been written.
    /// A response arriving later is never used.
    TimedOut,
    /// An I/O error after the request may have been written, or a body cut after the status.
    Broken,
}

/// What an attempt means for the operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    /// 2xx: executed, and it worked.
    Success,
    /// Any other status not listed as retryable: executed, final, stored and replayed.
    Final,
    /// Connect failure or a `not_processed` status: the upstream did not execute it.
    NotExecuted,
    /// Timeout, broken connection or an `ambiguous` status: it may have executed.
    Ambiguous,
}

impl Class {
    pub fn as_str(self) -> &'static str {
        match self {
            Class::Success => "success",
            Class::Final => "final",
            Class::NotExecuted => "not_executed",
            Class::Ambiguous => "ambiguous",
        }
    }
}

/// Why a record's execution stopped. Recorded with the record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StopReason {
    Success,
    FinalResponse,
    /// The attempt may have executed and the route is not replay-safe: the outcome is unknown.
    UnsafeReplay,
    AttemptCap,
    Deadline,
    RetryBudget,
    RetryAfterBeyondDeadline,
    CircuitOpen,
    Cancelled,
    /// The route forwards the client's own credential, which only the process that received the
    /// request holds; this one does not (a take-over, a restart), so nothing is sent.
    CredentialUnavailable,
    /// Its lease expired more often than `worker.max_takeovers`: a record whose worker keeps
    /// dying on it is stopped rather than continued again.
    TakeoverCap,
}

impl StopReason {
    pub const ALL: [StopReason; 11] = [
        StopReason::Success,
        StopReason::FinalResponse,
        StopReason::UnsafeReplay,
        StopReason::AttemptCap,
        StopReason::Deadline,
        StopReason::RetryBudget,
        StopReason::RetryAfterBeyondDeadline,
        StopReason::CircuitOpen,
        StopReason::Cancelled,
        StopReason::CredentialUnavailable,
        StopReason::TakeoverCap,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            StopReason::Success => "success",
            StopReason::FinalResponse => "final_response",
            StopReason::UnsafeReplay => "unsafe_replay",
            StopReason::AttemptCap => "attempt_cap",
            StopReason::Deadline => "deadline",
            StopReason::RetryBudget => "retry_budget",
            StopReason::RetryAfterBeyondDeadline => "retry_after_beyond_deadline",
            StopReason::CircuitOpen => "circuit_open",
            StopReason::Cancelled => "cancelled",
            StopReason::CredentialUnavailable => "credential_unavailable",
            StopReason::TakeoverCap => "takeover_cap",
        }
    }

    pub fn parse(text: &str) -> Option<StopReason> {
        StopReason::ALL.into_iter().find(|r| r.as_str() == text)
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
}

impl RetryPolicy {
    pub fn classify(&self, observed: Observed) -> Class {
        match observed {
            Observed::Response(status) if (200..300).contains(&status) => Class::Success,
            Observed::Response(status) if self.not_processed.contains(&status) => Class::NotExecuted,
            Observed::Response(status) if self.ambiguous.contains(&status) => Class::Ambiguous,
            Observed::Response(_) => Class::Final,
            Observed::ConnectFailed => Class::NotExecuted,
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
    /// would otherwise happen.
    pub fn after_attempt(
        &self,
        replay_safe: bool,
        a: AfterAttempt,
        draw: impl FnOnce() -> f64,
        take_budget: impl FnOnce() -> bool,
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
        if !take_budget() {
            return Decision::Stop(StopReason::RetryBudget);
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
pub fn settle(stop: StopReason, last: Option<Class>, any_ambiguous: bool, replay_safe: bool) -> Settlement {
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
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// The seed article's policy: 1500 ms budget, 600 ms per try, 100 ms minimum window,
    /// base 200 ms, cap 800 ms, full jitter.
    fn seed() -> RetryPolicy {
        RetryPolicy::seed_example()
    }

    fn after(attempts: u32, class: Class, elapsed: u64) -> AfterAttempt {
        AfterAttempt {
            attempts,
            class,
            retry_after: None,
            elapsed: ms(elapsed),
            previous_wait: None,
            cancelled: false,
            circuit_open: false,
        }
    }

    fn no_draw() -> f64 {
        panic!("the policy drew a random number where it must not")
    }

    fn half() -> f64 {
        0.5
    }

    fn budget() -> bool {
        true
    }

    #[test]
    fn classification_follows_the_route_lists() {
        let p = seed();
        assert_eq!(p.classify(Observed::Response(201)), Class::Success);
        assert_eq!(p.classify(Observed::Response(400)), Class::Final);
        assert_eq!(p.classify(Observed::Response(401)), Class::Final);
        assert_eq!(p.classify(Observed::Response(500)), Class::Final);
        assert_eq!(p.classify(Observed::Response(503)), Class::NotExecuted);
        assert_eq!(p.classify(Observed::Response(429)), Class::NotExecuted);
        assert_eq!(p.classify(Observed::Response(502)), Class::Ambiguous);
        assert_eq!(p.classify(Observed::Response(504)), Class::Ambiguous);
        assert_eq!(p.classify(Observed::ConnectFailed), Class::NotExecuted);
        assert_eq!(p.classify(Observed::TimedOut), Class::Ambiguous);
        assert_eq!(p.classify(Observed::Broken), Class::Ambiguous);
        let custom = RetryPolicy { not_processed: vec![], ambiguous: vec![503], ..seed() };
        assert_eq!(custom.classify(Observed::Response(503)), Class::Ambiguous);
        assert_eq!(custom.classify(Observed::Response(429)), Class::Final);
    }

    #[test]
    fn a_401_stops_after_one_attempt_without_waiting() {
        let p = seed();
        let d = p.after_attempt(false, after(1, p.classify(Observed::Response(401)), 30), no_draw, || {
            panic!("budget consulted")
        });
        assert_eq!(d, Decision::Stop(StopReason::FinalResponse));
    }

    #[test]
    fn an_ambiguous_503_on_an_unsafe_route_stops_as_unknown() {
        let p = RetryPolicy { not_processed: vec![429], ambiguous: vec![502, 503, 504], ..seed() };
        let class = p.classify(Observed::Response(503));
        assert_eq!(
            p.after_attempt(false, after(1, class, 100), no_draw, budget),
            Decision::Stop(StopReason::UnsafeReplay)
        );
        // The same answer on a replay-safe route is retried.
        assert!(matches!(p.after_attempt(true, after(1, class, 100), half, budget), Decision::RetryAfter(_)));
    }

    #[test]
    fn a_retry_after_is_a_floor_that_is_never_shortened() {
        let p = seed();
        let a = AfterAttempt { retry_after: Some(ms(300)), ..after(1, Class::NotExecuted, 400) };
        // Full jitter at 0.5 of a 200 ms ceiling is 100 ms; the server asked for 300 ms.
        assert_eq!(p.after_attempt(false, a, half, budget), Decision::RetryAfter(ms(300)));
        let a = AfterAttempt { retry_after: Some(ms(50)), ..a };
        assert_eq!(p.after_attempt(false, a, half, budget), Decision::RetryAfter(ms(100)));
    }

    #[test]
    fn a_retry_after_beyond_the_remaining_budget_stops_without_sleeping_or_sending() {
        let p = seed();
        let a = AfterAttempt { retry_after: Some(ms(3000)), ..after(1, Class::NotExecuted, 1000) };
        let d = p.after_attempt(false, a, half, || panic!("budget taken for a retry that will not happen"));
        assert_eq!(d, Decision::Stop(StopReason::RetryAfterBeyondDeadline));
    }

    #[test]
    fn success_arriving_exactly_at_the_deadline_is_a_deadline_stop() {
        let p = seed();
        let d = p.after_attempt(false, after(2, Class::Success, 1500), no_draw, budget);
        assert_eq!(d, Decision::Stop(StopReason::Deadline));
    }

    #[test]
    fn a_cancel_stops_retrying() {
        let p = seed();
        let a = AfterAttempt { cancelled: true, ..after(1, Class::NotExecuted, 100) };
        assert_eq!(p.after_attempt(true, a, no_draw, budget), Decision::Stop(StopReason::Cancelled));
    }

    #[test]
    fn a_single_attempt_policy_never_draws_or_waits() {
        let p = RetryPolicy { max_attempts: 1, ..seed() };
        let d = p.after_attempt(true, after(1, Class::NotExecuted, 10), no_draw, || panic!("budget"));
        assert_eq!(d, Decision::Stop(StopReason::AttemptCap));
    }

    #[test]
    fn an_exhausted_budget_or_an_open_circuit_stops_retries() {
        let p = seed();
        let d = p.after_attempt(false, after(1, Class::NotExecuted, 10), half, || false);
        assert_eq!(d, Decision::Stop(StopReason::RetryBudget));
        let a = AfterAttempt { circuit_open: true, ..after(1, Class::NotExecuted, 10) };
        assert_eq!(p.after_attempt(false, a, no_draw, budget), Decision::Stop(StopReason::CircuitOpen));
    }

    #[test]
    fn no_attempt_starts_with_less_than_min_try_left() {
        let p = seed();
        assert_eq!(p.attempt_limit(ms(0)), Ok(ms(600)));
        assert_eq!(p.attempt_limit(ms(1100)), Ok(ms(400)));
        assert_eq!(p.attempt_limit(ms(1400)), Ok(ms(100)));
        assert_eq!(p.attempt_limit(ms(1401)), Err(StopReason::Deadline));
        assert_eq!(p.attempt_limit(ms(9000)), Err(StopReason::Deadline));
    }

    #[test]
    fn backoff_ceilings_double_up_to_the_cap() {
        let p = seed();
        assert_eq!(p.ceiling(1), ms(200));
        assert_eq!(p.ceiling(2), ms(400));
        assert_eq!(p.ceiling(3), ms(800));
        assert_eq!(p.ceiling(4), ms(800));
        assert_eq!(p.ceiling(80), ms(800));
    }

    #[test]
    fn each_jitter_mode_stays_in_its_range() {
        let with = |jitter| RetryPolicy { jitter, ..seed() };
        let full = with(Jitter::Full);
        assert_eq!(full.jittered(2, None, 0.0), ms(0));
        assert_eq!(full.jittered(2, None, 1.0), ms(400));
        assert_eq!(full.jittered(2, None, 0.25), ms(100));
        let equal = with(Jitter::Equal);
        assert_eq!(equal.jittered(2, None, 0.0), ms(200));
        assert_eq!(equal.jittered(2, None, 1.0), ms(400));
        let none = with(Jitter::None);
        assert_eq!(none.jittered(3, None, 0.7), ms(800));
        let dec = with(Jitter::Decorrelated);
        assert_eq!(dec.jittered(1, None, 0.0), ms(200));
        assert_eq!(dec.jittered(1, None, 1.0), ms(600));
        assert_eq!(dec.jittered(2, Some(ms(600)), 1.0), ms(800), "capped");
        assert_eq!(dec.jittered(2, Some(ms(250)), 0.5), ms(475));
        // A broken random source cannot produce a wait outside the range.
        assert_eq!(full.jittered(1, None, f64::NAN), ms(0));
        assert_eq!(full.jittered(1, None, 7.0), ms(200));
    }

    /// The seed article's worked example: a 400 ms 503 with Retry-After 300 ms, a 300 ms wait,
    /// then a 700 ms hang cut at the 600 ms per-try limit; at 1300 ms the next wait (200 ms)
    /// would leave 0 ms < 100 ms, so it stops there, having sent two attempts.
    #[test]
    fn the_seed_worked_example_ends_at_1300_ms() {
        let p = seed();
        let mut elapsed = ms(0);

        let limit = p.attempt_limit(elapsed).unwrap();
        assert_eq!(limit, ms(600));
        elapsed += ms(400);
        let first =
            AfterAttempt { retry_after: Some(ms(300)), elapsed, ..after(1, p.classify(Observed::Response(503)), 0) };
        let Decision::RetryAfter(wait) = p.after_attempt(true, first, half, budget) else { panic!("expected a retry") };
        assert_eq!(wait, ms(300));
        elapsed += wait;

        let limit = p.attempt_limit(elapsed).unwrap();
        assert_eq!(limit, ms(600));
        elapsed += limit; // the 700 ms hang is cut at the limit; its late answer is never used
        let second = AfterAttempt { previous_wait: Some(wait), elapsed, ..after(2, p.classify(Observed::TimedOut), 0) };
        let d = p.after_attempt(true, second, half, budget);
        assert_eq!(d, Decision::Stop(StopReason::Deadline));
        assert_eq!(elapsed, ms(1300));
    }

    #[test]
    fn retry_after_accepts_seconds_and_http_dates_and_ignores_garbage() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        assert_eq!(parse_retry_after("3", now), Some(Duration::from_secs(3)));
        assert_eq!(parse_retry_after(" 0 ", now), Some(Duration::ZERO));
        assert_eq!(parse_retry_after("\t3 ", now), Some(Duration::from_secs(3)));
        let later = httpdate::fmt_http_date(now + Duration::from_secs(120));
        assert_eq!(parse_retry_after(&later, now), Some(Duration::from_secs(120)));
        let past = httpdate::fmt_http_date(now - Duration::from_secs(120));
        assert_eq!(parse_retry_after(&past, now), Some(Duration::ZERO));
        assert_eq!(parse_retry_after("Sunday, 06-Nov-94 08:49:37 GMT", now), Some(Duration::ZERO));
        assert_eq!(parse_retry_after("99999999999999999999999", now), Some(MAX_RETRY_AFTER));
        let epoch = SystemTime::UNIX_EPOCH;
        assert_eq!(parse_retry_after("Fri, 31 Dec 9999 23:59:59 GMT", epoch), Some(MAX_RETRY_AFTER));
        for garbage in ["", "-1", "+1", "1.5", "soon", "3s", "Mon, 99 Foo 2024 00:00:00 GMT", "\u{a0}3", "3\u{c}"] {
            assert_eq!(parse_retry_after(garbage, now), None, "{garbage:?}");
        }
    }

    #[test]
    fn settlement_never_forgets_a_possible_execution() {
        use Settlement::*;
        assert_eq!(settle(StopReason::Success, Some(Class::Success), false, false), Done);
        assert_eq!(settle(StopReason::FinalResponse, Some(Class::Final), false, false), Done);
        assert_eq!(settle(StopReason::UnsafeReplay, Some(Class::Ambiguous), true, false), Unknown);
        // A success at the deadline executed: it is stored, not released.
        assert_eq!(settle(StopReason::Deadline, Some(Class::Success), false, false), Done);
        // A deadline or cancel after an ambiguous attempt on an unsafe route is unknown...
        assert_eq!(settle(StopReason::Deadline, Some(Class::Ambiguous), true, false), Unknown);
        assert_eq!(settle(StopReason::Cancelled, Some(Class::NotExecuted), true, false), Unknown);
        // ...and on a replay-safe route the key is released.
        assert_eq!(settle(StopReason::Deadline, Some(Class::Ambiguous), true, true), Free);
        for stop in [
            StopReason::AttemptCap,
            StopReason::RetryBudget,
            StopReason::RetryAfterBeyondDeadline,
            StopReason::CircuitOpen,
        ] {
            assert_eq!(settle(stop, Some(Class::NotExecuted), false, false), Free, "{stop:?}");
        }
        assert_eq!(settle(StopReason::Deadline, None, false, false), Free);
    }

    #[test]
    fn stop_reasons_round_trip_through_their_names() {
        for r in StopReason::ALL {
            assert_eq!(StopReason::parse(r.as_str()), Some(r));
        }
        assert_eq!(StopReason::parse("bogus"), None);
    }
}
