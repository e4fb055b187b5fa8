//! A claim's lease as this process holds it (docs/guarantees.md). The store keeps the lease's
//! expiry in its own clock; this process trusts it only for `lease - clock_margin`, counted on
//! its own clocks ([`Moment`]: the monotonic one, and the boot clock, which counts a suspended
//! host's sleep) from just before it sent the write that granted or renewed it, and sends
//! nothing outside that trust. The lease is renewed beside the attempt it keeps alive, so a slow
//! store never holds an attempt back; a renewal that fails, or finds the claim lost, is acted on:
//! no further attempt is made under that claim.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use tracing::{error, warn};

use super::{lock, Inner};
use crate::domain::clock::Moment;
use crate::domain::{Holder, RecordId, RouteName};
use crate::observe::metrics;
use crate::store::{LeaseStatus, StoreError};

/// How far this process trusts a claim's lease, and whether a renewal cast doubt on it.
pub(super) struct LeaseTrust {
    /// The lease is trusted before this instant, and only before it.
    trusted_until: Mutex<Moment>,
    /// A renewal made beside the execution (during an attempt, or while it waited for a place to
    /// send one) failed, or found the claim taken: the attempt in flight finishes, and no other
    /// starts under this claim.
    in_doubt: AtomicBool,
}

impl LeaseTrust {
    /// A claim granted by a write sent at `sent`, trusted for `trust` from then.
    pub(super) fn granted(sent: Moment, trust: Duration) -> LeaseTrust {
        LeaseTrust { trusted_until: Mutex::new(sent + trust), in_doubt: AtomicBool::new(false) }
    }

    /// A write sent at `sent` renewed the lease (a renewal, or an attempt's mark).
    pub(super) fn renewed(&self, sent: Moment, trust: Duration) {
        let mut until = lock(&self.trusted_until);
        let renewed = sent + trust;
        // The later of the two, on each clock: a renewal sent later reaches further on both.
        if renewed.instant() > until.instant() {
            *until = renewed;
        }
    }

    pub(super) fn trusted_until(&self) -> Moment {
        *lock(&self.trusted_until)
    }

    pub(super) fn in_doubt(&self) -> bool {
        self.in_doubt.load(Ordering::SeqCst)
    }

    fn doubt(&self) {
        self.in_doubt.store(true, Ordering::SeqCst);
    }
}

/// The lease an execution renews beside its attempts: its record, its claim, its route (to
/// count a failed renewal on) and how far it is trusted.
pub(super) struct LeaseOf<'a> {
    pub(super) id: RecordId,
    pub(super) holder: &'a Holder,
    pub(super) route: &'a RouteName,
    pub(super) trust: &'a LeaseTrust,
}

/// How a renewal made beside an attempt ended.
enum Renewed {
    Held(Moment),
    Lost,
    Failed(StoreError),
}

impl Inner {
    /// How long a write sent now may be trusted to hold the lease it sets.
    pub(super) fn trust(&self) -> Duration {
        self.lease.saturating_sub(self.clock_margin)
    }

    /// Awaits `attempt` while its claim's lease is renewed beside it, every third of the lease.
    /// The attempt is polled all along, whatever the store does: a renewal runs as a task of its
    /// own, and one still under way when the attempt ends is left to finish alone.
    pub(super) async fn renewing<F: Future>(&self, job: LeaseOf<'_>, attempt: F) -> F::Output {
        tokio::pin!(attempt);
        let every = self.lease / 3;
        let mut next = tokio::time::Instant::now() + every;
        let mut renewal: Option<tokio::task::JoinHandle<Renewed>> = None;
        loop {
            tokio::select! {
                out = &mut attempt => return out,
                _ = tokio::time::sleep_until(next), if renewal.is_none() => {
                    renewal = Some(self.renew_beside(&job));
                }
                renewed = async { renewal.as_mut().expect("guarded by the branch").await }, if renewal.is_some() => {
                    renewal = None;
                    next = tokio::time::Instant::now() + every;
                    match renewed {
                        Ok(Renewed::Held(sent)) => job.trust.renewed(sent, self.trust()),
                        Ok(Renewed::Lost) => {
                            job.trust.doubt();
                            metrics::renewal_failed(job.route, "lost");
                            warn!("the claim was taken while an attempt was in flight: that attempt finishes, no other starts under it");
                        }
                        Ok(Renewed::Failed(e)) => {
                            job.trust.doubt();
                            metrics::renewal_failed(job.route, "error");
                            error!(error = %e, "could not renew the lease while an attempt was in flight: that attempt finishes, no other starts under this claim");
                        }
                        // The task panicked or was cancelled: as good as a failed renewal.
                        Err(e) => {
                            job.trust.doubt();
                            metrics::renewal_failed(job.route, "error");
                            error!(error = %e, "a lease renewal did not finish");
                        }
                    }
                }
            }
        }
    }

    /// One renewal of `job`'s lease, as a task of its own. Its time in the node's clock and on
    /// the monotonic one are read together, before the task is spawned: the lease the store sets
    /// from the first is never shorter than the trust counted from the second.
    fn renew_beside(&self, job: &LeaseOf<'_>) -> tokio::task::JoinHandle<Renewed> {
        let store = self.store.clone();
        let (renew, sent) = (self.renewal(job.id, job.holder, self.clock.now()), Moment::now());
        tokio::spawn(async move {
            match store.renew(renew).await {
                Ok(LeaseStatus::Held { .. }) => Renewed::Held(sent),
                Ok(LeaseStatus::Lost) => Renewed::Lost,
                Err(e) => Renewed::Failed(e),
            }
        })
    }
}
