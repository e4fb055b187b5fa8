//! When an outcome is likely: what a 409 tells a concurrent duplicate, so that a client that
//! honours `Retry-After` comes back when the answer is there rather than at a fixed guess.

use std::time::Duration;

use crate::domain::Timestamp;

/// What one route's attempts have taken, learnt from the attempts this process made: the
/// typical one (an exponentially weighted mean, so that it follows an upstream that slows down or
/// recovers within a few dozen attempts) and the slowest of late (a high-water mark that fades
/// by a twentieth with each attempt, so one slow call is remembered for a few dozen).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RoutePace {
    pub typical: Duration,
    pub slowest: Duration,
}

/// The weight of the newest attempt in the mean.
const WEIGHT: f64 = 0.2;
/// What the slowest attempt of late keeps of itself with each newer attempt.
const FADE: f64 = 0.95;

impl RoutePace {
    /// The pace after the first attempt seen.
    pub fn first(took: Duration) -> RoutePace {
        RoutePace { typical: took, slowest: took }
    }

    pub fn observe(&mut self, took: Duration) {
        self.typical = self.typical.mul_f64(1.0 - WEIGHT) + took.mul_f64(WEIGHT);
        self.slowest = self.slowest.mul_f64(FADE).max(took);
    }
}

/// Where a record that is not settled yet stands, as far as its timing goes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Pending {
    pub now: Timestamp,
    /// The attempt in flight started then.
    pub in_flight_since: Option<Timestamp>,
    /// The longest an attempt may run (the route's `per_try_timeout`); `None` for a route no
    /// longer configured, bounded by the deadline alone.
    pub attempt_limit: Option<Duration>,
    /// Waiting between attempts: the next starts no earlier than this.
    pub next_attempt_at: Option<Timestamp>,
    pub deadline_at: Timestamp,
}

/// Assumed for a route with no attempt seen yet.
const UNSEEN: Duration = Duration::from_secs(1);
/// Never ask a client to come back sooner than this: the answer would rarely be there.
const SOONEST: Duration = Duration::from_millis(50);

/// How long until the outcome is likely, and never "any moment now" when it is not near:
/// - an attempt in flight is expected at the route's typical pace;
/// - past the typical time it is slow, and a slow attempt is expected to run as long again as it
///   already has, and at least as long as the slowest attempt of late (a client that is told
///   to come back is told later each time, and is not spent on a few short waits while an
///   upstream is slow); never past the attempt's limit, when it ends whatever the upstream does;
/// - a record waiting to retry is expected after its next attempt, at the typical pace;
/// - never past the deadline, by which time there is an outcome whatever happens.
pub(crate) fn outcome_eta(pending: Pending, pace: Option<RoutePace>) -> Duration {
    let RoutePace { typical, slowest } = pace.unwrap_or(RoutePace { typical: UNSEEN, slowest: UNSEEN });
    let now = pending.now;
    let at = match (pending.in_flight_since, pending.next_attempt_at) {
        (Some(started), _) => {
            let spent = now - started;
            let expected = match spent.checked_sub(typical) {
                None => started + typical,
                Some(_) => (now + spent).max(started + slowest),
            };
            pending.attempt_limit.map_or(expected, |limit| expected.min(started + limit))
        }
        (None, Some(next)) => next.max(now) + typical,
        (None, None) => now + typical,
    };
    let at = at.min(pending.deadline_at.max(now));
    (at - now).max(SOONEST)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: i64) -> Timestamp {
        Timestamp::from_millis(ms)
    }

    fn pending(in_flight_since: Option<i64>, next_attempt_at: Option<i64>) -> Pending {
        Pending {
            now: at(10_000),
            in_flight_since: in_flight_since.map(at),
            attempt_limit: Some(Duration::from_secs(10)),
            next_attempt_at: next_attempt_at.map(at),
            deadline_at: at(40_000),
        }
    }

    fn pace(typical_ms: u64, slowest_ms: u64) -> Option<RoutePace> {
        Some(RoutePace { typical: Duration::from_millis(typical_ms), slowest: Duration::from_millis(slowest_ms) })
    }

    #[test]
    fn the_pace_follows_recent_attempts_and_remembers_a_slow_one_for_a_while() {
        let mut p = RoutePace::first(Duration::from_millis(2_000));
        assert_eq!(Some(p), pace(2_000, 2_000));
        for _ in 0..20 {
            p.observe(Duration::from_millis(10));
        }
        let RoutePace { typical, slowest } = p;
        assert!(typical < Duration::from_millis(35), "the mean follows: {typical:?}");
        // 2 s × 0.95^20: the slow call fades, and is still remembered.
        assert!((700..=720).contains(&slowest.as_millis()), "{slowest:?}");
    }

    #[test]
    fn an_attempt_in_flight_is_expected_at_the_typical_pace() {
        let typical = pace(500, 500);
        assert_eq!(outcome_eta(pending(Some(9_800), None), typical), Duration::from_millis(300));
        assert_eq!(outcome_eta(pending(Some(9_520), None), typical), SOONEST, "due any moment");
        assert_eq!(outcome_eta(pending(None, None), None), UNSEEN, "1 s for a route not seen yet");
        // A slow attempt of late does not delay what is on time.
        assert_eq!(outcome_eta(pending(Some(9_800), None), pace(500, 5_000)), Duration::from_millis(300));
    }

    #[test]
    fn an_attempt_slower_than_usual_is_expected_later_the_longer_it_runs() {
        let eta = |since: i64| outcome_eta(pending(Some(since), None), pace(100, 100));
        assert_eq!(eta(9_900), Duration::from_millis(100));
        assert_eq!(eta(9_000), Duration::from_millis(1_000));
        assert_eq!(eta(7_000), Duration::from_millis(3_000));
        // A client that comes back when told is told later each time.
        let (mut spent, mut told) = (Duration::from_millis(120), vec![]);
        for _ in 0..4 {
            let wait = eta(10_000 - spent.as_millis() as i64);
            told.push(wait.as_millis());
            spent += wait;
        }
        assert_eq!(told, [120, 240, 480, 960]);
    }

    #[test]
    fn a_slow_attempt_is_expected_no_sooner_than_the_slowest_of_late() {
        // Typical 20 ms, but one took 700 ms lately: 60 ms in, it is slow, and may be that slow.
        let p = pace(20, 700);
        assert_eq!(outcome_eta(pending(Some(9_940), None), p), Duration::from_millis(640));
        assert_eq!(outcome_eta(pending(Some(9_000), None), p), Duration::from_millis(1_000));
    }

    #[test]
    fn an_attempt_is_expected_no_later_than_its_limit_and_the_deadline() {
        let p = pace(100, 100);
        // 10 s limit: started 8 s ago, it ends within 2 s whatever the upstream does.
        assert_eq!(outcome_eta(pending(Some(2_000), None), p), Duration::from_secs(2));
        let unlimited = Pending { attempt_limit: None, ..pending(Some(2_000), None) };
        assert_eq!(outcome_eta(unlimited, p), Duration::from_secs(8));
        let near_deadline = Pending { deadline_at: at(13_000), ..unlimited };
        assert_eq!(outcome_eta(near_deadline, p), Duration::from_secs(3));
        // At its limit: the floor, the outcome is there or about to be.
        assert_eq!(outcome_eta(pending(Some(0), None), p), SOONEST);
    }

    #[test]
    fn a_record_waiting_to_retry_is_expected_after_its_next_attempt() {
        let typical = pace(500, 500);
        assert_eq!(outcome_eta(pending(None, Some(12_000)), typical), Duration::from_millis(2_500));
        assert_eq!(outcome_eta(pending(None, None), typical), Duration::from_millis(500));
    }

    #[test]
    fn nothing_is_expected_after_the_deadline() {
        let late = Pending { deadline_at: at(11_000), ..pending(None, Some(50_000)) };
        assert_eq!(outcome_eta(late, pace(500, 500)), Duration::from_millis(1_000));
        let past = Pending { deadline_at: at(9_000), ..late };
        assert_eq!(outcome_eta(past, None), SOONEST);
    }
}
