//! The drain: executions in flight in this process, counted so that a graceful shutdown can
//! wait for them, and the flag that tells them the process is stopping.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::{watch, Notify};
use tracing::warn;

pub(super) struct Drain {
    /// Set at shutdown: executions hand their records back instead of waiting or starting.
    stopping: watch::Sender<bool>,
    /// Executions running in this process, and a wake-up for when there are none.
    active: AtomicUsize,
    idle: Notify,
}

impl Default for Drain {
    fn default() -> Drain {
        Drain { stopping: watch::channel(false).0, active: AtomicUsize::new(0), idle: Notify::new() }
    }
}

/// Counts a running execution until it is dropped.
pub(super) struct Running<'a>(&'a Drain);

impl Drop for Running<'_> {
    fn drop(&mut self) {
        if self.0.active.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

impl Drain {
    pub(super) fn running(&self) -> Running<'_> {
        self.active.fetch_add(1, Ordering::SeqCst);
        Running(self)
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
        let drained = async {
            loop {
                let idle = self.idle.notified();
                tokio::pin!(idle);
                idle.as_mut().enable();
                if self.active.load(Ordering::SeqCst) == 0 {
                    return;
                }
                idle.await;
            }
        };
        if tokio::time::timeout(bound, drained).await.is_err() {
            warn!(running = self.active.load(Ordering::SeqCst), "shutdown bound reached with attempts in flight");
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
