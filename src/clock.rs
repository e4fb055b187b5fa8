//! The wall clock, passed in: everything that stamps a record, computes a deadline or a lease,
//! or compares one with the present reads it through a [`Clock`], so that a test can hold time
//! still and move it on by hand. Waiting still uses tokio time (which a test can pause): the
//! clock says what time it is, not how long to sleep.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use crate::record::{duration_ms, now_ms, Millis};

/// What time it is, in milliseconds since the Unix epoch.
pub trait Clock: Send + Sync {
    fn now(&self) -> Millis;

    /// The same instant as a [`SystemTime`], for what reads HTTP dates against it.
    fn system_time(&self) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_millis(self.now().max(0) as u64)
    }
}

/// The clock shared by a broker's parts.
pub type SharedClock = Arc<dyn Clock>;

/// The operating system's clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Millis {
        now_ms()
    }
}

/// The clock a broker runs on unless told otherwise.
pub fn system() -> SharedClock {
    Arc::new(SystemClock)
}

/// A clock that moves only when told to: set to an instant, or advanced by a duration.
#[derive(Debug)]
pub struct ManualClock {
    now: AtomicI64,
}

impl ManualClock {
    pub fn new(now: Millis) -> ManualClock {
        ManualClock { now: AtomicI64::new(now) }
    }

    /// Starts where the system clock is now, so that what it stamps reads as a plausible date.
    pub fn starting_now() -> ManualClock {
        ManualClock::new(now_ms())
    }

    pub fn set(&self, now: Millis) {
        self.now.store(now, Ordering::SeqCst);
    }

    pub fn advance(&self, by: Duration) {
        self.now.fetch_add(duration_ms(by), Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Millis {
        self.now.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_manual_clock_moves_only_when_told() {
        let clock = ManualClock::new(1_000);
        assert_eq!(clock.now(), 1_000);
        clock.advance(Duration::from_millis(250));
        assert_eq!(clock.now(), 1_250);
        clock.set(10);
        assert_eq!(clock.now(), 10);
        assert_eq!(clock.system_time(), SystemTime::UNIX_EPOCH + Duration::from_millis(10));
    }

    #[test]
    fn the_system_clock_reads_the_time_of_day() {
        let before = now_ms();
        let read = SystemClock.now();
        assert!(read >= before && read <= now_ms());
    }
}
