//! How the broker hears that its store failed: the verdict of the health checks that every node
//! runs a few times a second, and log lines about failures that an outage repeats for every
//! request and every background sweep.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use super::{Store, StoreError};
use crate::domain::clock::Turns;

/// The least time between two log lines about an unavailable store, process-wide.
const OUTAGE_LOG_EVERY: Duration = Duration::from_secs(1);

impl StoreError {
    /// Logs this error as seen by `context`. An outage fails everything the same way: one line a
    /// second says it, instead of one per failure. A corrupt record is a bug of its own, always
    /// logged.
    pub fn log(&self, context: &str) {
        if matches!(self, StoreError::Corrupt(_)) || outage_log_due() {
            tracing::error!(error = %self, "{context}");
        }
    }
}

fn outage_log_due() -> bool {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    /// Milliseconds after `EPOCH` before which no further line is due.
    static NEXT_DUE: AtomicU64 = AtomicU64::new(0);
    let now = EPOCH.get_or_init(Instant::now).elapsed().as_millis() as u64;
    let due = NEXT_DUE.load(Ordering::Relaxed);
    let next = now + OUTAGE_LOG_EVERY.as_millis() as u64;
    now >= due && NEXT_DUE.compare_exchange(due, next, Ordering::Relaxed, Ordering::Relaxed).is_ok()
}

/// The last verdict of the store's health checks. While they find it down, new requests are
/// refused at once: they could not be recorded, and each waiting for the store to fail it (a
/// database that does not answer can take its connection timeout) would hold its client for
/// nothing.
#[derive(Debug, Default)]
pub struct Health {
    down: AtomicBool,
    /// Why, while `down`.
    failure: Mutex<Option<StoreError>>,
}

impl Health {
    pub fn check(&self) -> Result<(), StoreError> {
        if !self.down.load(Ordering::Acquire) {
            return Ok(());
        }
        let failure = self.failure.lock().unwrap_or_else(|p| p.into_inner()).clone();
        Err(failure.unwrap_or_else(|| StoreError::Unavailable("the store's health check failed".into())))
    }

    /// Records a health check's answer; true if it changed the verdict.
    pub fn record(&self, answer: &Result<(), StoreError>) -> bool {
        let mut failure = self.failure.lock().unwrap_or_else(|p| p.into_inner());
        *failure = answer.as_ref().err().cloned();
        let down = failure.is_some();
        self.down.swap(down, Ordering::AcqRel) != down
    }
}

/// How often every node checks its store.
const HEALTH_EVERY: Duration = Duration::from_millis(250);
/// A health check that takes longer fails: a store that cannot answer within it cannot record a
/// request in time either.
pub const HEALTH_TIMEOUT: Duration = Duration::from_secs(1);

/// Asks the store whether it can be trusted with a request ([`Store::ping`]), within
/// [`HEALTH_TIMEOUT`].
pub async fn store_health(store: &dyn Store) -> Result<(), StoreError> {
    match tokio::time::timeout(HEALTH_TIMEOUT, store.ping()).await {
        Ok(answer) => answer,
        Err(_) => Err(StoreError::Unavailable(format!("the store did not answer within {HEALTH_TIMEOUT:?}"))),
    }
}

/// Checks the store every [`HEALTH_EVERY`] and records the verdict in `health`: a lost store is
/// noticed within about a second even when no request comes (and a SQLite store that may resume
/// finds out here), the log says so at most once a second, and `idem_store_available` follows;
/// until `turns` end.
pub async fn watch_store(store: Arc<dyn Store>, health: Arc<Health>, mut turns: Turns) {
    let mut tick = tokio::time::interval(HEALTH_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while turns.next(tick.tick()).await.is_some() {
        let answer = store_health(&*store).await;
        let changed = health.record(&answer);
        match &answer {
            Ok(()) if changed => tracing::info!("the store is available again: new requests are taken"),
            Ok(()) => {}
            Err(e) => e.log("the store is unavailable: new requests are refused with 503 store-unavailable"),
        }
        crate::observe::metrics::store_available(answer.is_ok());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_verdict_follows_the_last_check_and_says_why() {
        let health = Health::default();
        assert!(health.check().is_ok(), "up until a check says otherwise");
        assert!(health.record(&Err(StoreError::Unavailable("the file was deleted".into()))));
        assert!(health.check().unwrap_err().to_string().contains("the file was deleted"));
        assert!(!health.record(&Err(StoreError::Unavailable("still".into()))), "no change");
        assert!(health.record(&Ok(())));
        assert!(health.check().is_ok());
    }
}
