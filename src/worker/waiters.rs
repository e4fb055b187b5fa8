//! The waiter registry: requests waiting for a record to settle (`Prefer: wait`) are woken when
//! it does, on this node or, through the store's notices, on another.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use crate::domain::RecordId;
use tokio::sync::Notify;

/// Wakes the requests that wait for a record to settle (`Prefer: wait`).
#[derive(Default)]
pub struct Settled {
    watchers: Mutex<HashMap<RecordId, Weak<Notify>>>,
}

impl Settled {
    pub fn watch(&self, id: RecordId) -> Arc<Notify> {
        let mut map = self.watchers.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(existing) = map.get(&id).and_then(Weak::upgrade) {
            return existing;
        }
        if map.len() > 1024 {
            map.retain(|_, w| w.strong_count() > 0);
        }
        let notify = Arc::new(Notify::new());
        map.insert(id, Arc::downgrade(&notify));
        notify
    }

    pub fn settled(&self, id: RecordId) {
        let watcher = self.watchers.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
        if let Some(n) = watcher.and_then(|w| w.upgrade()) {
            n.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_settlement_wakes_every_request_waiting_for_that_record_and_no_other() {
        let waiters = Settled::default();
        let (id, other) = (RecordId(uuid::Uuid::new_v4()), RecordId(uuid::Uuid::new_v4()));
        let first = waiters.watch(id);
        let second = waiters.watch(id);
        assert!(Arc::ptr_eq(&first, &second), "requests waiting for one record share its wake-up");
        let elsewhere = waiters.watch(other);
        let (a, b, c) = (first.notified(), second.notified(), elsewhere.notified());
        tokio::pin!(a, b, c);
        for n in [a.as_mut(), b.as_mut(), c.as_mut()] {
            n.enable();
        }
        waiters.settled(id);
        a.await;
        b.await;
        assert!(futures_util::FutureExt::now_or_never(c).is_none(), "another record's waiter slept on");
    }

    #[test]
    fn a_record_settled_with_nobody_waiting_leaves_nothing_behind() {
        let waiters = Settled::default();
        let id = RecordId(uuid::Uuid::new_v4());
        waiters.settled(id);
        let watch = waiters.watch(id);
        waiters.settled(id);
        // Settled, its entry is gone: a later wait gets a fresh wake-up.
        assert!(!Arc::ptr_eq(&watch, &waiters.watch(id)));
    }

    #[test]
    fn entries_of_requests_that_stopped_waiting_are_swept_as_the_registry_grows() {
        let waiters = Settled::default();
        for _ in 0..2_000 {
            drop(waiters.watch(RecordId(uuid::Uuid::new_v4())));
        }
        let held = waiters.watchers.lock().unwrap().len();
        assert!(held <= 1_025, "{held} entries kept for requests no longer waiting");
    }
}
