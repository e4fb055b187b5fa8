//! The circuit breaker, one per upstream, fed by the *logical* outcome of each request (after
//! its retries), never by single attempts: retries that end in success are not failures, and
//! a storm of attempts from one request does not count many times.
//!
//! Closed → (`failures` logical failures in a row) → Open for `open_for`, doubling on each
//! failed trial up to `max_open_for` → HalfOpen: up to `trials` requests go through; a success
//! closes it, a failure opens it again.

use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BreakerSettings {
    pub failures: u32,
    pub open_for: Duration,
    pub max_open_for: Duration,
    pub trials: u32,
}

impl Default for BreakerSettings {
    fn default() -> Self {
        BreakerSettings {
            failures: 5,
            open_for: Duration::from_secs(5),
            max_open_for: Duration::from_secs(60),
            trials: 1,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerState {
    Closed,
    Open,
    HalfOpen,
}

impl BreakerState {
    pub fn as_str(self) -> &'static str {
        match self {
            BreakerState::Closed => "closed",
            BreakerState::Open => "open",
            BreakerState::HalfOpen => "half_open",
        }
    }
}

#[derive(Debug)]
pub(crate) struct Breaker {
    settings: BreakerSettings,
    state: BreakerState,
    consecutive_failures: u32,
    open_until: Option<Instant>,
    /// How long the next opening lasts (grows while trials keep failing).
    next_open_for: Duration,
    trials_in_flight: u32,
    /// When the last trial was let through: a trial whose outcome never comes back (a duplicate
    /// that found its record, a cancelled request) must not hold the circuit half-open forever.
    last_trial: Option<Instant>,
}

impl Breaker {
    /// What it was built with: a reload keeps a breaker, and its state, while these hold.
    pub(crate) fn settings(&self) -> BreakerSettings {
        self.settings
    }

    pub(crate) fn new(settings: BreakerSettings) -> Breaker {
        Breaker {
            settings,
            state: BreakerState::Closed,
            consecutive_failures: 0,
            open_until: None,
            next_open_for: settings.open_for,
            trials_in_flight: 0,
            last_trial: None,
        }
    }

    pub(crate) fn state(&mut self, now: Instant) -> BreakerState {
        if self.state == BreakerState::Open && self.open_until.is_some_and(|t| now >= t) {
            self.state = BreakerState::HalfOpen;
            self.trials_in_flight = 0;
        }
        self.state
    }

    /// May a new request go to the upstream? In half-open, only `trials` at a time.
    /// `Err` carries how long until it may be asked again.
    pub(crate) fn admit(&mut self, now: Instant) -> Result<(), Duration> {
        match self.state(now) {
            BreakerState::Closed => Ok(()),
            BreakerState::Open => Err(self.open_until.map(|t| t - now).unwrap_or(self.settings.open_for)),
            BreakerState::HalfOpen => {
                let stale = self.last_trial.is_some_and(|t| now.saturating_duration_since(t) >= self.settings.open_for);
                if stale {
                    self.trials_in_flight = 0;
                }
                if self.trials_in_flight < self.settings.trials {
                    self.trials_in_flight += 1;
                    self.last_trial = Some(now);
                    Ok(())
                } else {
                    Err(Duration::from_secs(1))
                }
            }
        }
    }

    /// Is the circuit open right now (for a retry between attempts)?
    pub(crate) fn is_open(&mut self, now: Instant) -> bool {
        self.state(now) == BreakerState::Open
    }

    /// The logical outcome of a request that was admitted.
    pub(crate) fn record(&mut self, success: bool, now: Instant) {
        let state = self.state(now);
        if state == BreakerState::HalfOpen {
            self.trials_in_flight = self.trials_in_flight.saturating_sub(1);
        }
        if success {
            self.consecutive_failures = 0;
            if state != BreakerState::Closed {
                self.state = BreakerState::Closed;
                self.open_until = None;
                self.next_open_for = self.settings.open_for;
            }
            return;
        }
        self.consecutive_failures += 1;
        let trip = match state {
            BreakerState::Closed => self.consecutive_failures >= self.settings.failures,
            BreakerState::HalfOpen => true,
            BreakerState::Open => false,
        };
        if trip {
            self.state = BreakerState::Open;
            self.open_until = Some(now + self.next_open_for);
            self.next_open_for = (self.next_open_for * 2).min(self.settings.max_open_for);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn breaker() -> Breaker {
        Breaker::new(BreakerSettings {
            failures: 3,
            open_for: Duration::from_secs(5),
            max_open_for: Duration::from_secs(15),
            trials: 1,
        })
    }

    #[test]
    fn consecutive_logical_failures_open_it_and_a_success_resets_the_count() {
        let t = Instant::now();
        let mut b = breaker();
        b.record(false, t);
        b.record(false, t);
        b.record(true, t);
        b.record(false, t);
        b.record(false, t);
        assert_eq!(b.state(t), BreakerState::Closed);
        b.record(false, t);
        assert_eq!(b.state(t), BreakerState::Open);
        assert_eq!(b.admit(t + Duration::from_secs(1)), Err(Duration::from_secs(4)));
    }

    #[test]
    fn after_the_open_period_one_trial_goes_through() {
        let t = Instant::now();
        let mut b = breaker();
        for _ in 0..3 {
            b.record(false, t);
        }
        let later = t + Duration::from_secs(5);
        assert_eq!(b.state(later), BreakerState::HalfOpen);
        assert!(b.admit(later).is_ok());
        assert!(b.admit(later).is_err(), "only one trial at a time");
        b.record(true, later);
        assert_eq!(b.state(later), BreakerState::Closed);
        assert!(b.admit(later).is_ok());
    }

    #[test]
    fn a_trial_that_never_reports_does_not_hold_the_circuit_half_open() {
        let t = Instant::now();
        let mut b = breaker();
        for _ in 0..3 {
            b.record(false, t);
        }
        let later = t + Duration::from_secs(5);
        assert!(b.admit(later).is_ok());
        assert!(b.admit(later + Duration::from_secs(1)).is_err());
        // No outcome ever came back for that trial: after another open period, a new one may go.
        assert!(b.admit(later + Duration::from_secs(5)).is_ok());
    }

    #[test]
    fn a_failed_trial_reopens_for_longer_up_to_the_maximum() {
        let t = Instant::now();
        let mut b = breaker();
        for _ in 0..3 {
            b.record(false, t);
        }
        let mut now = t + Duration::from_secs(5);
        for expected in [10, 15, 15] {
            assert!(b.admit(now).is_ok());
            b.record(false, now);
            assert_eq!(b.state(now), BreakerState::Open);
            assert_eq!(b.admit(now), Err(Duration::from_secs(expected)));
            now += Duration::from_secs(expected);
        }
    }
}
