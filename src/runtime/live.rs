//! What the broker serves now, replaceable while it serves (docs/configuration.md reload): the
//! configuration and its routes' runtimes, one snapshot swapped in one step. Every request and
//! every background pass reads the snapshot current when it starts and keeps it to its end; an
//! execution keeps the one it was claimed with, so a reload never changes the policy of an
//! attempt sequence half-way, nor the limits it counts against.
//!
//! A `tokio::sync::watch` channel holds it rather than a lock-free swap cell: reads are a short
//! read lock and an `Arc` clone, never held across an `.await`, writes come a few times a day,
//! and it needs no dependency beyond tokio.

use std::sync::Arc;
use std::time::SystemTime;

use tokio::sync::watch;

use super::{Snapshot, Ticks};
use crate::config::Config;
use crate::domain::clock::SharedClock;

#[derive(Clone)]
struct Loaded {
    snapshot: Arc<Snapshot>,
    at: SystemTime,
}

pub struct Live {
    loaded: watch::Sender<Loaded>,
}

impl Live {
    /// Serves `config`, its runtimes counting in `clock`.
    pub fn new(config: Config, clock: SharedClock) -> Live {
        let snapshot = Snapshot::first(Arc::new(config), Ticks::new(clock));
        Live { loaded: watch::Sender::new(Loaded { snapshot: Arc::new(snapshot), at: SystemTime::now() }) }
    }

    /// What is served now: a snapshot that a later reload does not change.
    pub fn served(&self) -> Arc<Snapshot> {
        self.loaded.borrow().snapshot.clone()
    }

    /// The configuration in force now, for a reader that needs no route's runtime.
    pub fn current(&self) -> Arc<Config> {
        self.loaded.borrow().snapshot.config().clone()
    }

    /// When the configuration in force was loaded (at start, or by the last applied reload).
    pub fn loaded_at(&self) -> SystemTime {
        self.loaded.borrow().at
    }

    /// Serves `config` to everything that starts from now on, its routes' runtimes keeping what
    /// each may keep of the ones they replace (see [`Snapshot`]).
    pub fn reconfigure(&self, config: Arc<Config>) -> Arc<Snapshot> {
        let mut next = None;
        // Built under the channel's lock, so that two reloads could not each build from the
        // snapshot the other replaces.
        self.loaded.send_modify(|loaded| {
            let snapshot = Arc::new(loaded.snapshot.next(config));
            next = Some(snapshot.clone());
            *loaded = Loaded { snapshot, at: SystemTime::now() };
        });
        next.expect("send_modify runs its closure")
    }
}

impl std::fmt::Debug for Live {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Live").field("loaded_at", &self.loaded_at()).finish_non_exhaustive()
    }
}
