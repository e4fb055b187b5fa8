//! The operator's actions and the probes: settle, re-drive or cancel one record. Each reads the
//! record before it decides, so each locks the row for its one transaction.

use sqlx::PgPool;
use uuid::Uuid;

use super::rows::{one_element, COLUMNS};
use crate::record::{HistoryEntry, Millis, Record, State};
use crate::store::{decode, refusal, Action, Cancelled, Resolution, StoreError};

/// Reads a record and locks it until `tx` ends: the read-then-write actions decide on what they
/// read, so nothing may change it in between.
async fn lock(tx: &mut sqlx::Transaction<'_, sqlx::Postgres>, id: Uuid) -> Result<Option<Record>, StoreError> {
    sqlx::query(&format!("SELECT {COLUMNS} FROM records WHERE id = $1::uuid FOR UPDATE"))
        .bind(id.to_string())
        .fetch_optional(&mut **tx)
        .await?
        .map(|row| decode(&row))
        .transpose()
}

pub(super) async fn cancel(pool: &PgPool, id: Uuid, entry: HistoryEntry) -> Result<Cancelled, StoreError> {
    let mut tx = pool.begin().await?;
    let Some(record) = lock(&mut tx, id).await? else {
        return Ok(Cancelled::Missing);
    };
    let set = match (record.state, record.queued) {
        (State::NotStarted, true) => "queued = FALSE, stop_reason = 'cancelled'",
        (State::InProgress, _) => "cancel_requested = TRUE",
        _ => return Ok(Cancelled::Refused(record)),
    };
    let row = sqlx::query(&format!(
        "UPDATE records SET {set}, updated_at = $3, history = history || $2::jsonb
         WHERE id = $1::uuid
         RETURNING {COLUMNS}"
    ))
    .bind(id.to_string())
    .bind(one_element(&entry)?)
    .bind(entry.at)
    .fetch_one(&mut *tx)
    .await?;
    tx.commit().await?;
    let updated = decode(&row)?;
    Ok(if record.state == State::InProgress { Cancelled::Flagged(updated) } else { Cancelled::Dequeued(updated) })
}

/// Settles an `unknown` record as an operator or a probe decided. `probe` counts it as a probe.
pub(super) async fn settle(
    pool: &PgPool,
    id: Uuid,
    resolution: Resolution,
    probe: bool,
    entry: HistoryEntry,
) -> Result<Action, StoreError> {
    let (state, response) = resolution.stored();
    let sql = unknown_update(
        "state = $2, queued = FALSE, response_status = $3, response_headers = $4::jsonb,
         response_body = $5, done_at = CASE WHEN $2 = 'done' THEN $6 END, updated_at = $6,
         next_probe_at = NULL, probe_count = probe_count + $7, history = history || $8::jsonb",
    );
    let update = sqlx::query(&sql)
        .bind(id.to_string())
        .bind(state.as_str())
        .bind(response.map(|r| i32::from(r.status)))
        .bind(response.map(|r| serde_json::to_string(&r.headers)).transpose()?)
        .bind(response.map(|r| &r.body[..]))
        .bind(entry.at)
        .bind(i32::from(probe))
        .bind(one_element(&entry)?);
    on_unknown(pool, id, update).await
}

/// An update of one `unknown` record (`$1`) that sets `set` and returns the record.
fn unknown_update(set: &str) -> String {
    format!(
        "UPDATE records SET {set}
         WHERE id = $1::uuid AND state IS NOT DISTINCT FROM 'unknown'
         RETURNING {COLUMNS}"
    )
}

/// Runs `update` (made by [`unknown_update`]) on record `id`, locked first: a record that is not
/// `unknown` is refused, with the state it is in.
async fn on_unknown(
    pool: &PgPool,
    id: Uuid,
    update: sqlx::query::Query<'_, sqlx::Postgres, sqlx::postgres::PgArguments>,
) -> Result<Action, StoreError> {
    let mut tx = pool.begin().await?;
    if let Some(answer) = refusal(lock(&mut tx, id).await?) {
        return Ok(answer);
    }
    let row = update.fetch_one(&mut *tx).await?;
    tx.commit().await?;
    Ok(Action::Applied(decode(&row)?))
}

pub(super) async fn retry(
    pool: &PgPool,
    id: Uuid,
    deadline_at: Millis,
    entry: HistoryEntry,
) -> Result<Action, StoreError> {
    let sql = unknown_update(
        "state = 'not_started', queued = TRUE, deadline_at = $2, stop_reason = NULL,
         cancel_requested = FALSE, next_probe_at = NULL, updated_at = $3, takeovers = 0,
         history = history || $4::jsonb",
    );
    let update = sqlx::query(&sql).bind(id.to_string()).bind(deadline_at).bind(entry.at).bind(one_element(&entry)?);
    on_unknown(pool, id, update).await
}

pub(super) async fn probed(
    pool: &PgPool,
    id: Uuid,
    resolution: Option<Resolution>,
    next_at: Millis,
    entry: HistoryEntry,
) -> Result<Action, StoreError> {
    if let Some(resolution) = resolution {
        return settle(pool, id, resolution, true, entry).await;
    }
    let sql = unknown_update(
        "probe_count = probe_count + 1, next_probe_at = $2, updated_at = $3, history = history || $4::jsonb",
    );
    let update = sqlx::query(&sql).bind(id.to_string()).bind(next_at).bind(entry.at).bind(one_element(&entry)?);
    on_unknown(pool, id, update).await
}
