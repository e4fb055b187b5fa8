//! Background upkeep of the store: done records past retention are deleted, in batches, so
//! that a key can be used afresh and the table does not grow without bound.

use std::sync::Arc;
use std::time::Duration;

use crate::record::{duration_ms, now_ms};
use crate::store::Store;

const SWEEP_BATCH: u32 = 1000;

/// How often the retention sweep runs: a tenth of the retention, between 1 s and 1 min.
pub fn sweep_interval(retention: Duration) -> Duration {
    (retention / 10).clamp(Duration::from_secs(1), Duration::from_secs(60))
}

pub async fn retention_sweep(store: Arc<dyn Store>, retention: Duration) {
    let mut tick = tokio::time::interval(sweep_interval(retention));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let cutoff = now_ms() - duration_ms(retention);
        loop {
            match store.sweep_done(cutoff, SWEEP_BATCH).await {
                Ok(n) if n == SWEEP_BATCH as u64 => continue,
                Ok(n) => {
                    if n > 0 {
                        tracing::info!(deleted = n, "retention sweep");
                    }
                    break;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "retention sweep failed; will try again");
                    break;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sweep_runs_often_enough_for_short_and_long_retentions() {
        assert_eq!(sweep_interval(Duration::from_secs(2)), Duration::from_secs(1));
        assert_eq!(sweep_interval(Duration::from_secs(100)), Duration::from_secs(10));
        assert_eq!(sweep_interval(Duration::from_secs(86400)), Duration::from_secs(60));
    }
}
