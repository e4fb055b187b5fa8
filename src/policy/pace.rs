//! When an outcome is likely: what a 409 tells a concurrent duplicate, so that a client that
//! honours `Retry-After` comes back when the answer is there rather than at a fixed guess.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use crate::record::Timestamp;

/// Each route's typical attempt duration, learnt from the attempts this process made: an
/// exponentially weighted mean, so that it follows an upstream that slows down or recovers
/// within a few dozen attempts.
#[derive(Default)]
pub struct Pace {
    typical_ms: Mutex<HashMap<String, f64>>,
}

/// The weight of the newest attempt in the mean.
const WEIGHT: f64 = 0.2;

impl Pace {
    pub fn observe(&self, route: &str, took: Duration) {
        let ms = took.as_secs_f64() * 1000.0;
        let mut typical = self.typical_ms.lock().unwrap_or_else(|e| e.into_inner());
        match typical.get_mut(route) {
            Some(mean) => *mean += WEIGHT * (ms - *mean),
            None => {
                typical.insert(route.to_string(), ms);
            }
        }
    }

    /// `None` until the route has had an attempt here.
    pub fn typical(&self, route: &str) -> Option<Duration> {
        let typical = self.typical_ms.lock().unwrap_or_else(|e| e.into_inner());
        typical.get(route).map(|&ms| Duration::from_micros((ms * 1000.0) as u64))
    }
}

/// Where a record that is not settled yet stands, as far as its timing goes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Pending {
    pub now: Timestamp,
    /// The attempt in flight started then.
    pub in_flight_since: Option<Timestamp>,
    /// Waiting between attempts: the next starts no earlier than this.
    pub next_attempt_at: Option<Timestamp>,
    pub deadline_at: Timestamp,
}

/// Assumed for a route with no attempt seen yet.
const UNSEEN: Duration = Duration::from_secs(1);
/// Never ask a client to come back sooner than this: the answer would rarely be there.
const SOONEST: Duration = Duration::from_millis(50);

/// How long until the outcome is likely: what is left of the attempt in flight at the typical
/// pace, or the wait to the next attempt plus one at that pace; never past the deadline, by
/// which time there is an outcome whatever happens.
pub fn outcome_eta(pending: Pending, typical: Option<Duration>) -> Duration {
    let typical = typical.unwrap_or(UNSEEN);
    let at = match (pending.in_flight_since, pending.next_attempt_at) {
        (Some(started), _) => (started + typical).max(pending.now),
        (None, Some(next)) => next.max(pending.now) + typical,
        (None, None) => pending.now + typical,
    };
    let at = at.min(pending.deadline_at.max(pending.now));
    (at - pending.now).max(SOONEST)
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
            next_attempt_at: next_attempt_at.map(at),
            deadline_at: at(40_000),
        }
    }

    #[test]
    fn the_pace_follows_recent_attempts() {
        let pace = Pace::default();
        assert_eq!(pace.typical("payments"), None);
        pace.observe("payments", Duration::from_millis(500));
        assert_eq!(pace.typical("payments"), Some(Duration::from_millis(500)));
        for _ in 0..30 {
            pace.observe("payments", Duration::from_millis(100));
        }
        let typical = pace.typical("payments").unwrap();
        assert!(typical < Duration::from_millis(105), "{typical:?}");
        assert_eq!(pace.typical("orders"), None);
    }

    #[test]
    fn an_attempt_in_flight_is_expected_at_the_typical_pace() {
        let typical = Some(Duration::from_millis(500));
        assert_eq!(outcome_eta(pending(Some(9_800), None), typical), Duration::from_millis(300));
        // Slower than usual: expected any moment now.
        assert_eq!(outcome_eta(pending(Some(5_000), None), typical), SOONEST);
    }

    #[test]
    fn a_record_waiting_to_retry_is_expected_after_its_next_attempt() {
        let typical = Some(Duration::from_millis(500));
        assert_eq!(outcome_eta(pending(None, Some(12_000)), typical), Duration::from_millis(2_500));
        assert_eq!(outcome_eta(pending(None, None), typical), Duration::from_millis(500));
        assert_eq!(outcome_eta(pending(None, None), None), UNSEEN);
    }

    #[test]
    fn nothing_is_expected_after_the_deadline() {
        let late = Pending { deadline_at: at(11_000), ..pending(None, Some(50_000)) };
        assert_eq!(outcome_eta(late, Some(Duration::from_millis(500))), Duration::from_millis(1_000));
        let past = Pending { deadline_at: at(9_000), ..late };
        assert_eq!(outcome_eta(past, None), SOONEST);
    }
}
