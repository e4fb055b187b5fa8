//! The pause before a retry, with the record's lease renewed through it, cut short by a cancel,
//! a newer claim of the record here, or the process stopping. (An attempt in flight keeps its
//! lease alive through `lease`.)

use std::sync::atomic::Ordering;
use std::time::Duration;

use super::attempts::{End, HandBack};
use super::job::Job;
use super::Inner;
use crate::domain::StopReason;
use crate::store::LeaseStatus;

/// How a wait ended, which decides how the execution goes on.
pub(super) enum WaitEnd {
    /// Waited in full: the next attempt may start.
    Elapsed,
    /// A cancel came (from the client or an operator): the execution stops, its record settled.
    Cancelled,
    /// The process is shutting down: hand the record back.
    Stopping,
    /// The lease was lost, or a newer claim of the record runs here: the record is no longer
    /// this execution's.
    Lost,
}

impl WaitEnd {
    /// Whether the execution goes on after the wait, or how it ends.
    pub(super) fn then(self) -> Result<(), End> {
        match self {
            WaitEnd::Elapsed => Ok(()),
            WaitEnd::Cancelled => Err(End::Stop(StopReason::Cancelled, None)),
            WaitEnd::Stopping => Err(End::HandBack(HandBack::Shutdown)),
            WaitEnd::Lost => Err(End::Lost),
        }
    }
}

impl Inner {
    /// Sleeps before a retry, renewing the lease, and stops at once on a cancel (or when a newer
    /// claim of the record runs here).
    pub(super) async fn wait(&self, job: &Job<'_>, total: Duration) -> WaitEnd {
        let (id, signal) = (job.record.id, job.signal);
        let until = tokio::time::Instant::now() + total;
        let slice = self.lease / 3;
        let mut stopping = self.drain.stopping();
        loop {
            if *stopping.borrow_and_update() {
                return WaitEnd::Stopping;
            }
            let notified = signal.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if signal.is_superseded() {
                return WaitEnd::Lost;
            }
            if signal.raised.load(Ordering::SeqCst) {
                return WaitEnd::Cancelled;
            }
            let now = tokio::time::Instant::now();
            if now >= until {
                return WaitEnd::Elapsed;
            }
            tokio::select! {
                _ = tokio::time::sleep((until - now).min(slice)) => {}
                _ = &mut notified => {
                    return if signal.is_superseded() { WaitEnd::Lost } else { WaitEnd::Cancelled };
                }
                _ = stopping.changed() => return WaitEnd::Stopping,
            }
            if tokio::time::Instant::now() < until {
                let (now, sent) = (self.clock.now(), crate::domain::clock::Moment::now());
                match self.store.renew(self.renewal(id, job.holder, now)).await {
                    Ok(LeaseStatus::Held { cancel_requested: true }) => return WaitEnd::Cancelled,
                    Ok(LeaseStatus::Held { cancel_requested: false }) => job.trust.renewed(sent, self.trust()),
                    Ok(LeaseStatus::Lost) => return WaitEnd::Lost,
                    // The next attempt's mark is a write under the claim too: it finds out.
                    Err(_) => {}
                }
            }
        }
    }
}
