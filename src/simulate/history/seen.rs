//! What the upstream was seen to do for one recorded request, as a script the simulator can
//! replay (attempt n answered X after d ms), and what is assumed where a policy sends an
//! attempt that was never observed.

use std::fmt::Write;
use std::str::FromStr;
use std::time::Duration;

use crate::domain::AttemptError;
use crate::domain::Timestamp;
use crate::record::Attempt;
use crate::simulate::{AttemptSource, Encounter, Scripted};

/// One recorded attempt: when it started after the request's arrival, and what it met.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Seen {
    pub start: Duration,
    pub outcome: Encounter,
    /// No answer came within its limit: what would have come later is unknown.
    pub timed_out: bool,
}

/// What an attempt the history does not show is taken to meet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Assume {
    /// The outcome of the latest recorded attempt that started no later than it.
    Last,
    /// A 200, as long after its start as that latest recorded attempt took: the optimistic bound.
    Success,
}

impl Assume {
    pub fn name(self) -> &'static str {
        match self {
            Assume::Last => "last",
            Assume::Success => "success",
        }
    }

    pub fn describe(self) -> &'static str {
        match self {
            Assume::Last => {
                "an unobserved attempt gets the outcome of the latest recorded attempt of its request that started \
                 no later than it (a recorded timeout stays a timeout, at the attempt's own limit)"
            }
            Assume::Success => {
                "an unobserved attempt succeeds: a 200 as long after its start as the latest recorded attempt of its \
                 request that started no later than it took"
            }
        }
    }
}

impl FromStr for Assume {
    type Err = String;

    fn from_str(text: &str) -> Result<Assume, String> {
        match text {
            "last" => Ok(Assume::Last),
            "success" => Ok(Assume::Success),
            other => Err(format!("`{other}` is not an assumption: give last or success")),
        }
    }
}

/// Attempts a replay sent that the history does not show, by why.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Unobserved {
    /// More attempts than the request had.
    pub beyond: u64,
    /// Started later than the recorded attempt of the same number (a longer wait, or a slower
    /// start): the upstream was not watched at that time.
    pub later: u64,
    /// The recorded attempt timed out and this one would have waited longer for an answer.
    pub longer_limit: u64,
}

impl Unobserved {
    pub fn total(&self) -> u64 {
        self.beyond + self.later + self.longer_limit
    }
}

/// The request's recorded attempts as a script. A request cancelled by its caller carries the
/// cancel on its last attempt, where the worker heard it.
pub(super) fn script(created_at: Timestamp, attempts: &[Attempt], cancelled: bool) -> Vec<Seen> {
    let last = attempts.len().saturating_sub(1);
    attempts
        .iter()
        .enumerate()
        .map(|(i, a)| {
            let result = match (a.status, a.error) {
                (Some(status), _) => Scripted::Status(status),
                // Nothing was sent either way.
                (None, Some(AttemptError::ConnectFailed | AttemptError::NotSent)) => Scripted::ConnectFailed,
                (None, Some(AttemptError::TimedOut)) => Scripted::Timeout,
                // Broken, or lost with its worker: it may have executed.
                _ => Scripted::Broken,
            };
            // Only a status can carry a Retry-After; the worker records none otherwise.
            let retry_after = a.retry_after_ms.filter(|_| a.status.is_some()).map(Duration::from_millis);
            let outcome = outcome(Duration::from_millis(a.duration_ms), result, retry_after, cancelled && i == last);
            Seen { start: a.started_at - created_at, outcome, timed_out: result == Scripted::Timeout }
        })
        .collect()
}

/// An outcome, with its text in the script syntax of `--outcomes`.
fn outcome(after: Duration, result: Scripted, retry_after: Option<Duration>, cancel: bool) -> Encounter {
    let mut text = format!("{}ms:", after.as_millis());
    match result {
        Scripted::Status(status) => text.push_str(&status.to_string()),
        Scripted::Timeout => text.push_str(AttemptError::TimedOut.script_word()),
        Scripted::ConnectFailed => text.push_str(AttemptError::ConnectFailed.script_word()),
        Scripted::Broken => text.push_str(AttemptError::Broken.script_word()),
    }
    if let Some(ra) = retry_after {
        let _ = write!(text, " retry-after={}ms", ra.as_millis());
    }
    if cancel {
        text.push_str(" cancel");
    }
    Encounter { text, after, result, retry_after, cancel }
}

/// A recorded request's attempts as the simulator's upstream, counting what it had to assume.
pub(super) struct History<'a> {
    pub seen: &'a [Seen],
    pub assume: Assume,
    pub unobserved: &'a mut Unobserved,
}

impl AttemptSource for History<'_> {
    fn outcome(&mut self, number: u32, at: Duration, limit: Duration) -> Option<Encounter> {
        // The latest recorded attempt that started no later than this one, and never one
        // numbered after it: what the upstream was last seen doing.
        let index = (number as usize).checked_sub(1)?;
        let latest = self.seen.iter().take(index + 1).rposition(|s| s.start <= at).unwrap_or(0);
        let basis = self.seen.get(latest)?;
        match self.seen.get(index) {
            None => self.unobserved.beyond += 1,
            Some(same) if at > same.start => self.unobserved.later += 1,
            Some(same) if same.timed_out && limit > same.outcome.after => self.unobserved.longer_limit += 1,
            Some(same) => return Some(same.outcome.clone()),
        }
        Some(self.assumed(basis, limit))
    }
}

impl History<'_> {
    fn assumed(&self, basis: &Seen, limit: Duration) -> Encounter {
        let o = &basis.outcome;
        match self.assume {
            Assume::Last if basis.timed_out => outcome(limit.max(o.after), o.result, None, false),
            Assume::Last => outcome(o.after, o.result, o.retry_after, false),
            Assume::Success => outcome(o.after, Scripted::Status(200), None, false),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn at(ms: i64) -> Timestamp {
        Timestamp::from_millis(ms)
    }

    fn attempt(number: u32, started_at: i64, took: u64, status: Option<u16>, error: Option<&str>) -> Attempt {
        Attempt {
            number,
            started_at: at(started_at),
            duration_ms: took,
            outcome: crate::domain::AttemptOutcome::Success,
            status,
            error: error.map(|e| AttemptError::parse(e).expect("an attempt error")),
            wait_ms: 0,
            retry_after_ms: None,
            policy_version: None,
            unreachable: None,
            detail: None,
        }
    }

    #[test]
    fn a_recorded_retry_after_is_replayed() {
        let mut a = attempt(1, 0, 40, Some(503), None);
        a.retry_after_ms = Some(2000);
        assert_eq!(script(at(0), &[a], false)[0].outcome.text, "40ms:503 retry-after=2000ms");
    }

    fn recorded() -> Vec<Seen> {
        script(
            at(1000),
            &[attempt(1, 1010, 40, Some(503), None), attempt(2, 1200, 600, None, Some("timed_out"))],
            false,
        )
    }

    #[test]
    fn attempts_become_a_script_with_their_start_after_arrival() {
        let seen = recorded();
        let texts: Vec<_> = seen.iter().map(|s| s.outcome.text.as_str()).collect();
        assert_eq!(texts, ["40ms:503", "600ms:timeout"]);
        assert_eq!((seen[0].start, seen[1].start, seen[1].timed_out), (ms(10), ms(200), true));
        let cancelled = script(at(0), &[attempt(1, 0, 5, None, Some("broken"))], true);
        assert_eq!(cancelled[0].outcome.text, "5ms:broken cancel");
    }

    #[test]
    fn a_replay_that_keeps_to_the_record_assumes_nothing() {
        let seen = recorded();
        let mut unobserved = Unobserved::default();
        let mut h = History { seen: &seen, assume: Assume::Last, unobserved: &mut unobserved };
        assert_eq!(h.outcome(1, ms(10), ms(600)).unwrap().text, "40ms:503");
        assert_eq!(h.outcome(2, ms(150), ms(600)).unwrap().text, "600ms:timeout");
        assert_eq!(unobserved, Unobserved::default());
    }

    #[test]
    fn what_was_never_observed_is_assumed_and_counted() {
        let seen = recorded();
        let mut unobserved = Unobserved::default();
        let mut h = History { seen: &seen, assume: Assume::Last, unobserved: &mut unobserved };
        // A third attempt: the last one seen was a timeout, so it times out at its own limit.
        assert_eq!(h.outcome(3, ms(900), ms(800)).unwrap().text, "800ms:timeout");
        // A longer wait before attempt 2: the latest attempt seen by then is attempt 2 itself.
        assert_eq!(h.outcome(2, ms(300), ms(700)).unwrap().text, "700ms:timeout");
        // The same start with a longer limit: what came after 600 ms was never seen.
        assert_eq!(h.outcome(2, ms(200), ms(900)).unwrap().text, "900ms:timeout");
        let mut h = History { seen: &seen, assume: Assume::Success, unobserved: h.unobserved };
        assert_eq!(h.outcome(3, ms(900), ms(800)).unwrap().text, "600ms:200");
        assert_eq!(unobserved, Unobserved { beyond: 2, later: 1, longer_limit: 1 });
        assert_eq!(unobserved.total(), 4);
    }
}
