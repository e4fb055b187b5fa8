//! Outcomes the store could not take when they came (its file gone or read-only, its database
//! down). The upstream has answered by then, so the outcome is the best evidence there is of
//! what executed: the client is told it, as executed, and the write is made again, with growing
//! waits, until the store takes it — under the claim if it still holds, or as the late outcome
//! of a claim whose lease ran out meanwhile and was taken over to `unknown` (see
//! `docs/guarantees.md`). Between tries the claim's lease is renewed, so a store that takes
//! small writes but not this one does not let the claim lapse; and the waits never exceed a
//! third of a lease, so that once the store answers again the outcome is written well within
//! the lease during which no node takes anything over (`upkeep::Sweeper`). An outcome still
//! waiting when the process stops is lost with it, and its record stays in reconciliation, with
//! the error line logged for it.

use std::sync::atomic::Ordering;
use std::time::Duration;

use tracing::{error, info, warn};

use super::Inner;
use crate::domain::RouteName;
use crate::observe::metrics;
use crate::store::{AttemptEnded, LeaseStatus, Renew, StoreError};

/// The first wait before an outcome is written again, doubled after each refusal up to
/// [`LONGEST_WAIT`] (or a third of the lease, if shorter).
const FIRST_WAIT: Duration = Duration::from_millis(100);
const LONGEST_WAIT: Duration = Duration::from_secs(5);

impl Inner {
    /// Writes `ended` again in the background until the store takes it; `error` is why it did
    /// not the first time.
    pub(super) fn write_later(&self, ended: AttemptEnded, route: &RouteName, status: Option<u16>, error: &StoreError) {
        let id = ended.id;
        error!(
            record = %id, %route, upstream_status = status, error = %error,
            "the upstream answered but the store could not take the outcome: the client was told it; \
             writing it again until the store takes it (until then the record shows in_progress, then unknown)"
        );
        metrics::outcome_unrecorded(route);
        let waiting = self.unrecorded.clone();
        waiting.fetch_add(1, Ordering::SeqCst);
        metrics::unrecorded_outcome_waits(true);
        let (store, settled, clock) = (self.store.clone(), self.settled.clone(), self.clock.clone());
        let lease = self.lease;
        let longest = LONGEST_WAIT.min(lease / 3);
        tokio::spawn(async move {
            let mut wait = FIRST_WAIT.min(longest);
            loop {
                tokio::time::sleep(wait).await;
                match store.attempt_ended(ended.clone()).await {
                    Ok(LeaseStatus::Held { .. }) => {
                        info!(record = %id, "the outcome the store could not take is stored now");
                        break;
                    }
                    // Taken over meanwhile: the store wrote it as that claim's late outcome, unless
                    // the record was settled or claimed again since, which stands.
                    Ok(LeaseStatus::Lost) => {
                        info!(record = %id, "the outcome the store could not take was offered as a late outcome: the record takes it if it still awaits it");
                        break;
                    }
                    // Not the store's absence: writing it again would fail the same way.
                    Err(e) if !e.is_outage() => {
                        error!(record = %id, error = %e, "the outcome the store could not take is refused by it; the record is left for reconciliation");
                        break;
                    }
                    Err(e) => {
                        warn!(record = %id, error = %e, "the store still cannot take the outcome; trying again");
                        // The claim kept alive meanwhile, where the store takes that much.
                        let renew = Renew { id, holder: ended.holder.clone(), lease, now: clock.now() };
                        if let Ok(LeaseStatus::Lost) = store.renew(renew).await {
                            info!(record = %id, "the claim of the outcome being written again was taken: it is offered as a late outcome");
                        }
                        wait = (wait * 2).min(longest);
                    }
                }
            }
            settled.settled(id);
            waiting.fetch_sub(1, Ordering::SeqCst);
            metrics::unrecorded_outcome_waits(false);
        });
    }
}
