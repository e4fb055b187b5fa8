//! The figures a history replay compares, computed the same way for what was recorded and for
//! each policy's replay, so the columns can be read against each other.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::domain::StopReason;
use crate::simulate::{End, Trace};

/// How one request ended, as the figures count it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ending {
    pub attempts: u32,
    pub stop: Option<StopReason>,
    /// From arrival to the end of the last attempt (or of the decision to stop).
    pub elapsed: Duration,
}

impl Ending {
    pub fn of(trace: &Trace) -> Ending {
        let stop = match trace.end {
            End::Stopped { reason, .. } => Some(reason),
            End::ScriptExhausted { .. } => None,
        };
        Ending { attempts: trace.attempts, stop, elapsed: trace.elapsed }
    }
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct Figures {
    pub requests: u64,
    pub attempts: u64,
    /// Succeeded on the first attempt.
    pub first_try: u64,
    /// Succeeded (a 2xx), on any attempt.
    pub succeeded: u64,
    /// Succeeded only thanks to a retry.
    pub salvaged: u64,
    pub budget_stopped: u64,
    pub deadline_stopped: u64,
    /// Every stop reason and how many requests it ended.
    pub stops: BTreeMap<&'static str, u64>,
    pub p50: Option<Duration>,
    pub p99: Option<Duration>,
}

impl Figures {
    pub fn of(endings: impl IntoIterator<Item = Ending>) -> Figures {
        let mut f = Figures::default();
        let mut elapsed = Vec::new();
        for e in endings {
            f.requests += 1;
            f.attempts += u64::from(e.attempts);
            let succeeded = e.stop == Some(StopReason::Success);
            f.succeeded += u64::from(succeeded);
            f.first_try += u64::from(succeeded && e.attempts == 1);
            f.salvaged += u64::from(succeeded && e.attempts > 1);
            f.budget_stopped += u64::from(e.stop.is_some_and(|s| s.budget().is_some()));
            f.deadline_stopped += u64::from(e.stop == Some(StopReason::Deadline));
            *f.stops.entry(e.stop.map_or("none", StopReason::as_str)).or_default() += 1;
            elapsed.push(e.elapsed);
        }
        elapsed.sort();
        f.p50 = percentile(&elapsed, 0.50);
        f.p99 = percentile(&elapsed, 0.99);
        f
    }

    /// Physical attempts per logical request.
    pub fn amplification(&self) -> Option<f64> {
        (self.requests > 0).then(|| self.attempts as f64 / self.requests as f64)
    }

    /// `count` as a share of the requests.
    pub fn share(&self, count: u64) -> Option<f64> {
        (self.requests > 0).then(|| count as f64 / self.requests as f64)
    }
}

/// The nearest-rank percentile of sorted values: the smallest value that at least `p` of them
/// do not exceed.
fn percentile(sorted: &[Duration], p: f64) -> Option<Duration> {
    let rank = (p * sorted.len() as f64).ceil() as usize;
    sorted.get(rank.max(1) - 1).copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ending(attempts: u32, stop: StopReason, ms: u64) -> Ending {
        Ending { attempts, stop: Some(stop), elapsed: Duration::from_millis(ms) }
    }

    #[test]
    fn each_figure_counts_what_it_says() {
        let f = Figures::of([
            ending(1, StopReason::Success, 10),
            ending(2, StopReason::Success, 30),
            ending(3, StopReason::AttemptCap, 50),
            ending(2, StopReason::RetryBudget, 20),
            ending(1, StopReason::Deadline, 40),
        ]);
        assert_eq!((f.requests, f.attempts, f.first_try, f.succeeded, f.salvaged), (5, 9, 1, 2, 1));
        assert_eq!((f.budget_stopped, f.deadline_stopped), (1, 1));
        assert_eq!(f.amplification(), Some(1.8));
        assert_eq!((f.p50, f.p99), (Some(Duration::from_millis(30)), Some(Duration::from_millis(50))));
        assert_eq!(f.stops["success"], 2);
    }

    #[test]
    fn no_requests_have_no_ratios() {
        let f = Figures::of([]);
        assert_eq!((f.amplification(), f.share(0), f.p50), (None, None, None));
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let values: Vec<_> = (1..=200).map(Duration::from_millis).collect();
        assert_eq!(percentile(&values, 0.5), Some(Duration::from_millis(100)));
        assert_eq!(percentile(&values, 0.99), Some(Duration::from_millis(198)));
        assert_eq!(percentile(&values[..1], 0.99), Some(Duration::from_millis(1)));
    }
}
