//! The waiter registry: requests waiting for a record to settle (`Prefer: wait`) are woken when
//! it does, on this node or, through the store's notices, on another.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use tokio::sync::Notify;
use uuid::Uuid;

/// Wakes the requests that wait for a record to settle (`Prefer: wait`).
#[derive(Default)]
pub struct Settled {
    watchers: Mutex<HashMap<Uuid, Weak<Notify>>>,
}

impl Settled {
    pub fn watch(&self, id: Uuid) -> Arc<Notify> {
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

    pub fn settled(&self, id: Uuid) {
        let watcher = self.watchers.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
        if let Some(n) = watcher.and_then(|w| w.upgrade()) {
            n.notify_waiters();
        }
    }
}
