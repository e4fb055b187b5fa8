//! Client credentials held in memory for the executions that will forward them.

use std::collections::HashMap;

use crate::domain::RecordId;
use crate::domain::Timestamp;

/// Client credentials waiting for their execution to start. One whose record another node ran
/// is never taken: it is dropped once its deadline has passed.
#[derive(Default)]
pub(super) struct HeldCredentials {
    by_record: HashMap<RecordId, (Option<http::HeaderValue>, Timestamp)>,
    /// Expired entries are swept when the map grows past this, which then doubles: amortised,
    /// a hold costs O(1).
    sweep_at: usize,
}

impl HeldCredentials {
    pub(super) fn hold(
        &mut self,
        id: RecordId,
        credential: Option<http::HeaderValue>,
        deadline_at: Timestamp,
        now: Timestamp,
    ) {
        if self.by_record.len() >= self.sweep_at {
            self.by_record.retain(|_, (_, until)| *until > now);
            self.sweep_at = (2 * self.by_record.len()).max(256);
        }
        self.by_record.insert(id, (credential, deadline_at));
    }

    /// `None` when nothing is held: the request was received by another process.
    pub(super) fn take(&mut self, id: RecordId) -> Option<Option<http::HeaderValue>> {
        self.by_record.remove(&id).map(|(credential, _)| credential)
    }
}
