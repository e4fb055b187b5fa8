//! How the serving primary replicates, as far as a failover's losses go, and what `idem check
//! --connect` says of a store (docs/high-availability.md#what-a-failover-can-lose).

use sqlx::postgres::{PgPool, PgPoolOptions};

use super::primary::{self, Found};
use super::{options, status_on};
use crate::store::{Serving, StoreError};

/// Warns when the primary at `host` replicates to no synchronous standby: a failover may then
/// lose commits it acknowledged, answers told and claims acted on included
/// (docs/high-availability.md).
pub(super) async fn warn_without_synchronous_standby(pool: &PgPool, host: &str) {
    if let Ok(Some(replication)) = replication(pool).await {
        if let Some(warning) = replication.warning() {
            tracing::warn!(host, "{warning}");
        }
    }
}

/// How the primary replicates, as far as a failover's losses go: its `synchronous_standby_names`
/// and how many standbys stream from it. `None` when the server is a standby itself.
pub(super) async fn replication(pool: &PgPool) -> Result<Option<Replication>, StoreError> {
    let (standby, names): (bool, String) =
        sqlx::query_as("SELECT pg_is_in_recovery(), current_setting('synchronous_standby_names')")
            .fetch_one(pool)
            .await?;
    if standby {
        return Ok(None);
    }
    // Only a superuser, or a role of `pg_read_all_stats`, sees the standbys streaming.
    let streaming: Option<i64> =
        sqlx::query_scalar("SELECT count(*) FROM pg_stat_replication").fetch_one(pool).await.ok();
    Ok(Some(Replication { synchronous_standby_names: names, streaming }))
}

/// See [`replication`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Replication {
    pub(crate) synchronous_standby_names: String,
    pub(crate) streaming: Option<i64>,
}

impl Replication {
    /// What a failover may lose, when it may lose anything acknowledged.
    pub(crate) fn warning(&self) -> Option<String> {
        self.synchronous_standby_names.trim().is_empty().then(|| {
            "the store's primary has no synchronous standby (synchronous_standby_names is empty): a failover to an \
             asynchronous standby may lose commits it acknowledged, and a key whose claim or answer is lost then \
             executes again (docs/high-availability.md)"
                .to_string()
        })
    }
}

/// What `idem check --connect` finds at `url`, changing nothing: the host that serves it and
/// that server's timeline and start, the store's protocol and migrations, and what a failover
/// may lose there (docs/high-availability.md).
pub(crate) async fn inspect(url: &str) -> Result<crate::store::Inspection, StoreError> {
    let (host, primary) = options(url)?.pick().await?;
    let pool = PgPoolOptions::new().max_connections(1).connect_with(primary).await?;
    let (timeline, started) = match primary::ask(&mut *pool.acquire().await?).await? {
        Found::Primary(identity) => (Some(identity.timeline), Some(identity.started)),
        Found::Standby => (None, None),
    };
    let status = status_on(&pool).await?;
    let replication = replication(&pool).await?;
    pool.close().await;
    let mut warnings = Vec::new();
    if timeline.is_none() {
        warnings.push(format!("{host} is a standby: the store cannot write there"));
    }
    warnings.extend(replication.as_ref().and_then(Replication::warning));
    let replication = replication.map(|r| {
        let names =
            if r.synchronous_standby_names.trim().is_empty() { "(empty)" } else { &r.synchronous_standby_names };
        match r.streaming {
            Some(n) => format!("synchronous_standby_names {names}; standbys streaming: {n}"),
            None => format!("synchronous_standby_names {names}"),
        }
    });
    Ok(crate::store::Inspection {
        serving: Some(Serving { host, timeline, started, changes: 0 }),
        replication,
        status,
        warnings,
    })
}
