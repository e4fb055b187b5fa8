//! The SQLite side of [`crate::store::recorded`]: a read-only pool of its own, beside whatever
//! broker has the file open (WAL lets readers proceed while its writer writes).

use std::str::FromStr;
use std::time::Duration;

use sqlx::sqlite::{SqliteConnectOptions, SqlitePool, SqlitePoolOptions};

use super::split_synchronous;
use crate::domain::Timestamp;
use crate::store::rows::{decode_recorded, Recorded};
use crate::store::StoreError;

/// Served by `records_listing` (created_at, id); the route is filtered on the way.
const RECORDED: &str = "
SELECT id, tenant, created_at, deadline_at, state, stop_reason, attempts,
       in_flight_number IS NOT NULL AS in_flight, tombstone_until IS NOT NULL AS tombstone,
       history
FROM records
WHERE created_at >= ?2 AND route = ?1
ORDER BY created_at, id
LIMIT ?3";

pub(in crate::store) async fn open(url: &str) -> Result<SqlitePool, StoreError> {
    let (url, _) = split_synchronous(url)?;
    let options = SqliteConnectOptions::from_str(&url)
        .map_err(|e| StoreError::Unavailable(format!("bad sqlite url `{url}`: {e}")))?
        .create_if_missing(false)
        .read_only(true)
        .busy_timeout(Duration::from_secs(10));
    if !options.get_filename().exists() {
        return Err(StoreError::Unavailable(format!(
            "`{}` does not exist: no broker has recorded there",
            options.get_filename().display()
        )));
    }
    let pool = SqlitePoolOptions::new()
        .max_connections(1)
        .connect_with(options)
        .await
        .map_err(|e| StoreError::Unavailable(format!("cannot open `{url}` to read: {e}")))?;
    sqlx::query("SELECT 1 FROM records LIMIT 0").execute(&pool).await.map_err(|e| {
        StoreError::Unavailable(format!("`{url}` holds no Idem records (is it a broker's store?): {e}"))
    })?;
    Ok(pool)
}

pub(in crate::store) async fn read(
    pool: &SqlitePool,
    route: &str,
    since: Timestamp,
    limit: u32,
) -> Result<Vec<Recorded>, StoreError> {
    let rows = sqlx::query(RECORDED).bind(route).bind(since).bind(i64::from(limit)).fetch_all(pool).await?;
    rows.iter().map(decode_recorded).collect()
}
