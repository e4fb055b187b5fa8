//! The running configuration, replaceable while the broker serves (docs/configuration.md reload). Every
//! request and every background pass reads the configuration current when it starts and keeps
//! that snapshot to its end; an execution keeps the one it was claimed with, so a reload never
//! changes the policy of an attempt sequence half-way.
//!
//! A `tokio::sync::watch` channel holds it rather than a lock-free swap cell: reads are a short
//! read lock and an `Arc` clone, never held across an `.await`, writes come a few times a day,
//! and it needs no dependency beyond tokio.

use std::sync::Arc;
use std::time::SystemTime;

use tokio::sync::watch;

use super::Config;

#[derive(Clone)]
struct Loaded {
    config: Arc<Config>,
    at: SystemTime,
}

pub struct Live {
    loaded: watch::Sender<Loaded>,
}

impl Live {
    pub fn new(config: Config) -> Live {
        Live { loaded: watch::Sender::new(Loaded { config: Arc::new(config), at: SystemTime::now() }) }
    }

    /// The configuration in force now: a snapshot that a later reload does not change.
    pub fn current(&self) -> Arc<Config> {
        self.loaded.borrow().config.clone()
    }

    /// When the configuration in force was loaded (at start, or by the last applied reload).
    pub fn loaded_at(&self) -> SystemTime {
        self.loaded.borrow().at
    }

    /// Puts `config` in force for everything that starts from now on; returns the one it replaces.
    pub fn replace(&self, config: Arc<Config>) -> Arc<Config> {
        self.loaded.send_replace(Loaded { config, at: SystemTime::now() }).config
    }
}

impl std::fmt::Debug for Live {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Live").field("loaded_at", &self.loaded_at()).finish_non_exhaustive()
    }
}
