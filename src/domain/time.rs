//! Points in time as the store keeps them: milliseconds since the Unix epoch, the same number in
//! every process that reads a record, so that deadlines and leases mean one thing to all.

use std::fmt;
use std::ops::{Add, Sub};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

/// When a request arrived, on both clocks it is read against: the wall clock its record keeps
/// (the broker's clock, a test's manual one where set), and the process's monotonic clock, which
/// times its stages (`metrics::Stage`).
#[derive(Debug, Clone, Copy)]
pub struct Arrival {
    pub at: Timestamp,
    pub monotonic: Instant,
}

/// A wall-clock instant, in milliseconds since the Unix epoch. Stored and serialized as that
/// integer. Arithmetic saturates: a deadline far in the future or a span across a clock set
/// backwards stays a valid value rather than overflowing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Timestamp(i64);

impl Timestamp {
    /// The Unix epoch.
    pub const EPOCH: Timestamp = Timestamp(0);
    /// Before every instant: "since the beginning".
    pub const MIN: Timestamp = Timestamp(i64::MIN);
    /// After every instant: "never".
    pub const MAX: Timestamp = Timestamp(i64::MAX);

    pub const fn from_millis(ms: i64) -> Timestamp {
        Timestamp(ms)
    }

    pub const fn as_millis(self) -> i64 {
        self.0
    }

    /// The system clock's reading (the epoch if the clock is set before it).
    pub fn now() -> Timestamp {
        Timestamp::from(SystemTime::now())
    }

    /// The same instant as a [`SystemTime`], for what reads HTTP dates against it.
    pub fn system_time(self) -> SystemTime {
        UNIX_EPOCH + Duration::from_millis(self.0.max(0) as u64)
    }

    /// The instant as RFC 3339 with milliseconds, in UTC, as the API shows it.
    pub fn rfc3339(self) -> String {
        humantime::format_rfc3339_millis(self.system_time()).to_string()
    }
}

impl From<SystemTime> for Timestamp {
    fn from(t: SystemTime) -> Timestamp {
        Timestamp(t.duration_since(UNIX_EPOCH).map(millis).unwrap_or(0))
    }
}

/// A duration in whole milliseconds, capped at what a timestamp can hold.
fn millis(d: Duration) -> i64 {
    d.as_millis().min(i64::MAX as u128) as i64
}

impl Add<Duration> for Timestamp {
    type Output = Timestamp;
    fn add(self, d: Duration) -> Timestamp {
        Timestamp(self.0.saturating_add(millis(d)))
    }
}

impl Sub<Duration> for Timestamp {
    type Output = Timestamp;
    fn sub(self, d: Duration) -> Timestamp {
        Timestamp(self.0.saturating_sub(millis(d)))
    }
}

/// The span from `earlier` to `self`; zero when `earlier` is not earlier.
impl Sub<Timestamp> for Timestamp {
    type Output = Duration;
    fn sub(self, earlier: Timestamp) -> Duration {
        Duration::from_millis(self.0.saturating_sub(earlier.0).max(0) as u64)
    }
}

impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Timestamp = Timestamp::from_millis(1_700_000_000_000);

    #[test]
    fn adding_and_subtracting_durations_moves_by_milliseconds_and_saturates() {
        assert_eq!((T + Duration::from_millis(250)).as_millis(), 1_700_000_000_250);
        assert_eq!((T - Duration::from_secs(1)).as_millis(), 1_699_999_999_000);
        assert_eq!(T + Duration::MAX, Timestamp::MAX);
        assert_eq!(Timestamp::MIN - Duration::from_millis(1), Timestamp::MIN);
    }

    #[test]
    fn the_span_between_two_timestamps_is_never_negative() {
        let later = T + Duration::from_millis(1_500);
        assert_eq!(later - T, Duration::from_millis(1_500));
        assert_eq!(T - later, Duration::ZERO);
        assert_eq!(Timestamp::MAX - Timestamp::MIN, Duration::from_millis(i64::MAX as u64));
    }

    #[test]
    fn it_is_serialized_as_the_integer_it_was_before_it_had_a_name() {
        assert_eq!(serde_json::to_string(&T).unwrap(), "1700000000000");
        assert_eq!(serde_json::from_str::<Timestamp>("1700000000000").unwrap(), T);
    }

    #[test]
    fn it_reads_as_a_system_time_and_as_rfc3339() {
        assert_eq!(Timestamp::from(T.system_time()), T);
        assert_eq!(Timestamp::from_millis(-5).system_time(), UNIX_EPOCH);
        assert_eq!(Timestamp::from_millis(1_500).rfc3339(), "1970-01-01T00:00:01.500Z");
    }
}
