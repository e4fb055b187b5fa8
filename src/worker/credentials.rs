//! Client credentials held in memory for the executions that will forward them.

use std::collections::HashMap;
use std::sync::Mutex;

use super::lock;

use crate::domain::RecordId;
use crate::domain::Timestamp;

/// Client credentials waiting for their execution to start. One whose record another node ran
/// is never taken: it is dropped once its deadline has passed.
#[derive(Default)]
pub(super) struct HeldCredentials(Mutex<Held>);

#[derive(Default)]
struct Held {
    by_record: HashMap<RecordId, (Option<http::HeaderValue>, Timestamp)>,
    /// Expired entries are swept when the map grows past this, which then doubles: amortised,
    /// a hold costs O(1).
    sweep_at: usize,
}

impl HeldCredentials {
    pub(super) fn hold(
        &self,
        id: RecordId,
        credential: Option<http::HeaderValue>,
        deadline_at: Timestamp,
        now: Timestamp,
    ) {
        let mut held = lock(&self.0);
        if held.by_record.len() >= held.sweep_at {
            held.by_record.retain(|_, (_, until)| *until > now);
            held.sweep_at = (2 * held.by_record.len()).max(256);
        }
        held.by_record.insert(id, (credential, deadline_at));
    }

    /// `None` when nothing is held: the request was received by another process.
    pub(super) fn take(&self, id: RecordId) -> Option<Option<http::HeaderValue>> {
        lock(&self.0).by_record.remove(&id).map(|(credential, _)| credential)
    }
}
