//! The PostgreSQL side of [`crate::store::recorded`]: a small pool whose sessions are read-only,
//! so nothing run through it can change what the brokers share.

use sqlx::postgres::{PgPool, PgPoolOptions};
use sqlx::Executor;

use crate::domain::Timestamp;
use crate::store::rows::{decode_recorded, Recorded};
use crate::store::StoreError;

/// Served by `records_listing` (created_at, id); the route is filtered on the way. Ids and JSON
/// come back as text, as [`decode_recorded`] reads them.
const RECORDED: &str = "
SELECT id::text AS id, tenant, created_at, deadline_at, state, stop_reason, attempts::text AS attempts,
       in_flight_number IS NOT NULL AS in_flight, tombstone_until IS NOT NULL AS tombstone,
       history::text AS history
FROM records
WHERE created_at >= $2 AND route = $1
ORDER BY created_at, id
LIMIT $3";

pub(in crate::store) async fn open(url: &str) -> Result<PgPool, StoreError> {
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .after_connect(|conn, _| {
            Box::pin(async move {
                conn.execute("SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY").await?;
                Ok(())
            })
        })
        .connect(url)
        .await
        .map_err(|e| StoreError::Unavailable(format!("cannot connect to read the store: {e}")))?;
    sqlx::query("SELECT 1 FROM records LIMIT 0").execute(&pool).await.map_err(|e| {
        StoreError::Unavailable(format!("the database holds no Idem records (is it a broker's store?): {e}"))
    })?;
    Ok(pool)
}

pub(in crate::store) async fn read(
    pool: &PgPool,
    route: &str,
    since: Timestamp,
    limit: u32,
) -> Result<Vec<Recorded>, StoreError> {
    let rows = sqlx::query(RECORDED).bind(route).bind(since).bind(i64::from(limit)).fetch_all(pool).await?;
    rows.iter().map(decode_recorded).collect()
}
