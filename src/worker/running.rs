//! The executions running in this process, one per record at most: the newest claim's. Each
//! has a signal that lets a cancel reach it at once, even mid-wait, and tells it when a newer
//! claim of its record runs here now.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tokio::sync::Notify;
use tracing::warn;

use std::collections::HashMap;
use std::sync::Mutex;

use super::lock;
use crate::domain::{ClaimToken, RecordId};

/// Lets a cancel reach an execution running in this process at once, even mid-wait; and tells
/// an execution that a newer claim of its record runs here now, so it stops before its next
/// write rather than be refused at it.
#[derive(Default)]
pub(super) struct CancelSignal {
    pub(super) raised: AtomicBool,
    pub(super) superseded: AtomicBool,
    pub(super) notify: Notify,
}

impl CancelSignal {
    pub(super) fn is_superseded(&self) -> bool {
        self.superseded.load(Ordering::SeqCst)
    }
}

/// The execution of one claim of a record, as this process knows it: at most one per record,
/// the newest claim's.
struct Claimed {
    token: ClaimToken,
    signal: Arc<CancelSignal>,
}

/// The executions running here, by record: the claim each runs under, and its signal.
#[derive(Default)]
pub(super) struct Running(Mutex<HashMap<RecordId, Claimed>>);

impl Running {
    /// Registers the execution of `id` under claim `token` as the one running here, and tells
    /// an older claim's execution, if one still runs, that it is superseded.
    pub(super) fn start(&self, id: RecordId, token: ClaimToken) -> Arc<CancelSignal> {
        let signal = Arc::new(CancelSignal::default());
        let older = lock(&self.0).insert(id, Claimed { token, signal: signal.clone() });
        if let Some(older) = older {
            warn!(record = %id, older = %older.token, newer = %token, "a newer claim of the record supersedes one still running here");
            older.signal.superseded.store(true, Ordering::SeqCst);
            older.signal.notify.notify_waiters();
        }
        signal
    }

    /// Forgets the execution of `id` under claim `token`, unless a newer claim's took its place.
    pub(super) fn stopped(&self, id: RecordId, token: ClaimToken) {
        let mut running = lock(&self.0);
        if running.get(&id).is_some_and(|r| r.token == token) {
            running.remove(&id);
        }
    }

    /// The cancel signal of the execution of `id` running here, if one is.
    pub(super) fn signal(&self, id: RecordId) -> Option<Arc<CancelSignal>> {
        lock(&self.0).get(&id).map(|r| r.signal.clone())
    }
}
