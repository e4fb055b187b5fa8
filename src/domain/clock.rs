//! The wall clock, passed in: everything that stamps a record, computes a deadline or a lease,
//! or compares one with the present reads it through a [`Clock`], so that a test can hold time
//! still and move it on by hand. Waiting still uses tokio time (which a test can pause): the
//! clock says what time it is, not how long to sleep.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use crate::domain::Timestamp;

/// What time it is, in milliseconds since the Unix epoch.
pub trait Clock: Send + Sync {
    fn now(&self) -> Timestamp;

    /// The same instant as a [`SystemTime`], for what reads HTTP dates against it.
    fn system_time(&self) -> SystemTime {
        self.now().system_time()
    }
}

/// A moment on this process's own clocks, for the deadlines a node keeps to itself: how long it
/// trusts a lease, and until when it may send an attempt it marked (docs/guarantees.md). Read on
/// tokio's clock, the monotonic one its timers use (and tests pause), and on Linux on the boot
/// clock as well: the monotonic clock stops while the host is suspended (a laptop's lid, a
/// hypervisor's suspend), the boot clock does not, and a node thawing from a suspend must find
/// its deadlines past. A deadline has passed when either clock says so.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Moment {
    at: tokio::time::Instant,
    boot: Option<Duration>,
}

impl Moment {
    pub fn now() -> Moment {
        Moment { at: tokio::time::Instant::now(), boot: boot_clock() }
    }

    /// The moment on tokio's clock, for its timers.
    pub fn instant(self) -> tokio::time::Instant {
        self.at
    }

    /// Whether it has passed, by either clock.
    pub fn passed(self) -> bool {
        tokio::time::Instant::now() >= self.at || self.boot.zip(boot_clock()).is_some_and(|(by, now)| now >= by)
    }

    /// The earlier of two moments, clock by clock.
    pub fn min(self, other: Moment) -> Moment {
        let boot = match (self.boot, other.boot) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        Moment { at: self.at.min(other.at), boot }
    }
}

impl std::ops::Add<Duration> for Moment {
    type Output = Moment;
    fn add(self, d: Duration) -> Moment {
        Moment { at: self.at + d, boot: self.boot.map(|b| b + d) }
    }
}

/// A moment on tokio's clock alone: a test's, or a timer's.
impl From<tokio::time::Instant> for Moment {
    fn from(at: tokio::time::Instant) -> Moment {
        Moment { at, boot: None }
    }
}

/// The time since the host booted, suspends included (`CLOCK_BOOTTIME`), where there is one.
fn boot_clock() -> Option<Duration> {
    #[cfg(target_os = "linux")]
    {
        let mut now = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        // SAFETY: clock_gettime writes one timespec through a pointer to a local one.
        if unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut now) } == 0 {
            return Some(Duration::new(now.tv_sec as u64, now.tv_nsec as u32));
        }
    }
    None
}

/// The clock shared by a broker's parts.
pub type SharedClock = Arc<dyn Clock>;

/// The operating system's clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Timestamp {
        Timestamp::now()
    }
}

/// The clock a broker runs on unless told otherwise.
pub fn system() -> SharedClock {
    Arc::new(SystemClock)
}

/// A clock that moves only when told to: set to an instant, or advanced by a duration.
#[derive(Debug)]
pub struct ManualClock {
    /// Milliseconds since the epoch: an atomic integer, so that a test's thread and the broker's
    /// tasks share it without a lock.
    now: AtomicI64,
}

impl ManualClock {
    pub fn new(now: Timestamp) -> ManualClock {
        ManualClock { now: AtomicI64::new(now.as_millis()) }
    }

    /// Starts where the system clock is now, so that what it stamps reads as a plausible date.
    pub fn starting_now() -> ManualClock {
        ManualClock::new(Timestamp::now())
    }

    pub fn set(&self, now: Timestamp) {
        self.now.store(now.as_millis(), Ordering::SeqCst);
    }

    pub fn advance(&self, by: Duration) {
        let by = i64::try_from(by.as_millis()).unwrap_or(i64::MAX);
        let _ = self.now.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |now| Some(now.saturating_add(by)));
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Timestamp {
        Timestamp::from_millis(self.now.load(Ordering::SeqCst))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_manual_clock_moves_only_when_told() {
        let at = Timestamp::from_millis;
        let clock = ManualClock::new(at(1_000));
        assert_eq!(clock.now(), at(1_000));
        clock.advance(Duration::from_millis(250));
        assert_eq!(clock.now(), at(1_250));
        clock.set(at(10));
        assert_eq!(clock.now(), at(10));
        assert_eq!(clock.system_time(), SystemTime::UNIX_EPOCH + Duration::from_millis(10));
    }

    #[test]
    fn the_system_clock_reads_the_time_of_day() {
        let before = Timestamp::now();
        let read = SystemClock.now();
        assert!(read >= before && read <= Timestamp::now());
    }
}

/// A background loop's turns, ended by shutdown: the loop waits for its next turn (its tick, its
/// sleep, its next message) through [`Turns::next`], and stops there once shutdown has begun,
/// never in the middle of a turn (a sweep half written, a flush half done).
#[derive(Clone)]
pub struct Turns(tokio::sync::watch::Receiver<bool>);

impl Turns {
    /// Turns that end when `stopping` says `true`.
    pub fn until(stopping: tokio::sync::watch::Receiver<bool>) -> Turns {
        Turns(stopping)
    }

    /// Whether shutdown has begun: a loop that takes several steps per turn stops between them.
    pub fn over(&self) -> bool {
        *self.0.borrow()
    }

    /// Waits for `next`, unless shutdown begins first: `None` then, and the loop ends.
    pub async fn next<F: std::future::Future>(&mut self, next: F) -> Option<F::Output> {
        if *self.0.borrow() {
            return None;
        }
        tokio::select! {
            biased;
            _ = self.0.wait_for(|stopping| *stopping) => None,
            out = next => Some(out),
        }
    }
}

#[cfg(test)]
mod moment_tests {
    use super::*;

    /// A host suspended past a deadline: its monotonic clock, which tokio reads, stood still,
    /// while its boot clock went on. The deadline has passed.
    #[test]
    fn a_deadline_passed_on_the_boot_clock_has_passed_whatever_the_monotonic_clock_says() {
        let Some(booted) = boot_clock() else { return };
        let later = tokio::time::Instant::now() + Duration::from_secs(3_600);
        let slept_past = Moment { at: later, boot: Some(booted) };
        assert!(slept_past.passed(), "past on the boot clock");
        let ahead = Moment { at: later, boot: Some(booted + Duration::from_secs(3_600)) };
        assert!(!ahead.passed(), "ahead on both clocks");
        let monotonic_only = Moment::from(tokio::time::Instant::now() - Duration::from_millis(1));
        assert!(monotonic_only.passed(), "past on the monotonic clock");
        assert_eq!(slept_past.min(ahead).boot, Some(booted), "the earlier on each clock");
        assert!((Moment::now() + Duration::from_secs(1)).boot > boot_clock(), "both clocks move on");
    }
}
