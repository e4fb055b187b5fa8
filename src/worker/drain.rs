//! The drain: executions in flight in this process, counted so that a graceful shutdown can
//! wait for them, and the flag that tells them the process is stopping.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{watch, Notify};
use tracing::warn;

pub(super) struct Drain {
    /// Set at shutdown: executions hand their records back instead of waiting or starting.
    stopping: watch::Sender<bool>,
    /// Executions running in this process, counted from their spawn (one waiting for a worker
    /// counts), and a wake-up for when there are none.
    active: Arc<Active>,
}

#[derive(Default)]
struct Active {
    count: AtomicUsize,
    idle: Notify,
}

impl Default for Drain {
    fn default() -> Drain {
        Drain { stopping: watch::channel(false).0, active: Arc::default() }
    }
}

/// Counts a running execution until it is dropped.
pub(super) struct Counted(Arc<Active>);

impl Drop for Counted {
    fn drop(&mut self) {
        if self.0.count.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

impl Drain {
    /// Returns once no execution runs.
    pub(super) async fn until_idle(&self) {
        loop {
            let idle = self.active.idle.notified();
            tokio::pin!(idle);
            idle.as_mut().enable();
            if self.active.count.load(Ordering::SeqCst) == 0 {
                return;
            }
            idle.await;
        }
    }

    pub(super) fn running(&self) -> Counted {
        self.active.count.fetch_add(1, Ordering::SeqCst);
        Counted(self.active.clone())
    }

    pub(super) fn is_stopping(&self) -> bool {
        *self.stopping.borrow()
    }

    pub(super) fn stopping(&self) -> watch::Receiver<bool> {
        self.stopping.subscribe()
    }

    /// Raises the stopping flag, then waits up to `bound` for the running executions to end.
    pub(super) async fn shutdown(&self, bound: Duration) {
        self.stopping.send_replace(true);
        if tokio::time::timeout(bound, self.until_idle()).await.is_err() {
            warn!(running = self.active.count.load(Ordering::SeqCst), "shutdown bound reached with attempts in flight");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_shutdown_waits_for_the_running_executions_and_no_longer_than_its_bound() {
        let drain = std::sync::Arc::new(Drain::default());
        let mut told = drain.stopping();
        let running = drain.running();
        let shutdown = tokio::spawn({
            let drain = drain.clone();
            async move { drain.shutdown(Duration::from_secs(3_600)).await }
        });
        told.changed().await.unwrap();
        assert!(drain.is_stopping());
        assert!(!shutdown.is_finished());
        // The last execution ending ends the wait, long before the bound.
        drop(running);
        shutdown.await.unwrap();

        // One that never ends is waited for up to the bound, then left behind.
        let stuck = Drain::default();
        let _running = stuck.running();
        stuck.shutdown(Duration::from_millis(1)).await;
        assert!(stuck.is_stopping());
    }
}
