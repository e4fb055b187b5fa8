//! Writes whose answer was lost (the connection died under their commit, the primary failed
//! over): the write may or may not be committed, and it is never taken as "not written". Each
//! is settled by reading the record back before anything else is done
//! (docs/high-availability.md#a-commit-whose-answer-never-came).

use std::time::Duration;

use tracing::warn;

use super::attempts::{End, HandBack};
use super::job::Job;
use super::Inner;
use crate::record::Record;
use crate::store::{self, Admission, LeaseStatus, StoreError};

impl Inner {
    /// Settles a mark whose answer was lost by reading the record back under its claim, before
    /// anything is sent: found marked, the attempt goes (within its send window, counted from
    /// before the write, which has likely passed); found without the mark, nothing was written
    /// and the record is handed back for a claim of its own. When it cannot be read either
    /// ([`read_back`]), nothing is sent, and the claim's lease runs out.
    pub(super) async fn mark_in_doubt(
        &self,
        job: &Job<'_>,
        number: u32,
        error: &store::StoreError,
    ) -> Result<LeaseStatus, End> {
        let held = |r: &Record| r.claim == job.holder.token && r.state == crate::domain::State::InProgress;
        let read = read_back(self.lease, || self.store.get(job.record.id)).await;
        match read {
            Ok(Some(r)) if held(&r) && r.in_flight.map(|(n, _)| n) == Some(number) => {
                warn!(error = %error, "the answer to an attempt's mark was lost; read back, the mark is there: sending it");
                Ok(LeaseStatus::Held { cancel_requested: r.cancel_requested })
            }
            Ok(Some(r)) if held(&r) => {
                warn!(error = %error, "the answer to an attempt's mark was lost; read back, it is not there: not sending it");
                Err(End::HandBack(HandBack::ClaimInDoubt))
            }
            Ok(_) => Ok(LeaseStatus::Lost),
            Err(again) => {
                // Without a durable "may have been sent" mark known, the attempt must not go out.
                warn!(error = %error, read = %again, "could not record an attempt, nor read it back; not sending it");
                Err(End::Lost)
            }
        }
    }
}

/// Settles an admission whose answer was lost (`error`) by reading the key's record back: this
/// request's own record (`id`) was inserted, claimed or queued as the insert said; anything
/// else, and the error stands (a retry of the request reads the key anew).
pub(super) async fn admission(
    store: &dyn store::Store,
    lease: std::time::Duration,
    tenant: &crate::domain::Tenant,
    key: &crate::domain::IdempotencyKey,
    id: crate::domain::RecordId,
    error: store::StoreError,
) -> Result<Admission, store::StoreError> {
    match read_back(lease, || store.lookup(tenant, key)).await {
        Ok(Some(record)) if record.id == id => {
            tracing::warn!(error = %error, "the answer to an admission was lost; read back, it is recorded");
            Ok(Admission::Created(record))
        }
        // Another record (one that was there, or a requeue of it): what this request's insert did
        // cannot be told apart; its client is told the error, and its retry reads the key anew.
        _ => Err(error),
    }
}

/// Reads back, with `read`, what a write whose answer was lost left in the store: the store that
/// just failed to answer is asked again while it is out (a failover takes seconds), for up to a
/// third of `lease`, so that the claim it was made under is still held when the answer comes.
/// Its last error, if it never answers.
async fn read_back<T, F>(lease: Duration, read: impl Fn() -> F) -> Result<T, StoreError>
where
    F: std::future::Future<Output = Result<T, StoreError>>,
{
    let give_up = tokio::time::Instant::now() + lease / 3;
    let mut wait = Duration::from_millis(50);
    loop {
        // Each read within what is left: a read that hangs on a dead connection must not hold
        // the claim past its lease.
        let read = match tokio::time::timeout_at(give_up, read()).await {
            Ok(read) => read,
            Err(_) => Err(StoreError::Unavailable("the store did not answer the read-back in time".into())),
        };
        match read {
            Err(e) if e.is_outage() && tokio::time::Instant::now() + wait < give_up => {
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_secs(1));
            }
            read => return read,
        }
    }
}
