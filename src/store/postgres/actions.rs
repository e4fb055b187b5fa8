//! The operator's actions and the probes: settle, re-drive or cancel one record. Each reads the
//! record before it decides, so each locks the row for its one transaction.

use std::time::Duration;

use sqlx::{PgPool, Row};

use super::rows::{one_element, COLUMNS};
use crate::domain::{ClaimToken, Phase, RecordId, Timestamp};
use crate::record::{transition, Event, HistoryEntry, Record, Refused};
use crate::store::{
    decide, decode, retried, waits_for_attempts, Action, Cancel, Cancelled, LeaseClock, Probed, Resolution, Resolve,
    Retry, StoreError,
};

/// Reads a record and locks it until `tx` ends: the read-then-write actions decide on what they
/// read, so nothing may change it in between.
async fn lock(tx: &mut sqlx::Transaction<'_, sqlx::Postgres>, id: RecordId) -> Result<Option<Record>, StoreError> {
    Ok(lock_with_bound(tx, id, None).await?.map(|(record, _)| record))
}

/// [`lock`], with how long an attempt marked under the record may still reach the upstream, in
/// the store's clock: `at` is the node's time when the store keeps leases in it, else `None`.
async fn lock_with_bound(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    id: RecordId,
    at: Option<Timestamp>,
) -> Result<Option<(Record, Duration)>, StoreError> {
    let row = sqlx::query(&format!(
        "SELECT {COLUMNS}, GREATEST(COALESCE(in_flight_until, 0) - COALESCE($2::bigint, idem_now()), 0) AS in_flight_left
         FROM records WHERE id = $1::uuid FOR UPDATE"
    ))
    .bind(id.to_string())
    .bind(at)
    .fetch_optional(&mut **tx)
    .await?;
    let Some(row) = row else { return Ok(None) };
    let left: i64 = row.try_get("in_flight_left")?;
    Ok(Some((decode(&row)?, Duration::from_millis(left.max(0) as u64))))
}

/// A cancel as [`transition`] decides it from the locked record's phase, persisted guarded by
/// that phase.
pub(super) async fn cancel(pool: &PgPool, cancel: Cancel) -> Result<Cancelled, StoreError> {
    let Cancel { id, entry } = cancel;
    let mut tx = pool.begin().await?;
    let Some(record) = lock(&mut tx, id).await? else {
        return Ok(Cancelled::Missing);
    };
    let (set, guard) = match transition(record.phase(), Event::Cancel) {
        Ok(Phase::Free) => ("queued = FALSE, stop_reason = 'cancelled'", "state = 'not_started' AND queued"),
        Ok(Phase::InProgress) => ("cancel_requested = TRUE", "state = 'in_progress'"),
        _ => return Ok(Cancelled::Refused(record)),
    };
    let row = sqlx::query(&format!(
        "UPDATE records SET {set}, updated_at = $3, history = history || $2::jsonb
         WHERE id = $1::uuid AND {guard}
         RETURNING {COLUMNS}"
    ))
    .bind(id.to_string())
    .bind(one_element(&entry)?)
    .bind(entry.at)
    .fetch_optional(&mut *tx)
    .await?;
    tx.commit().await?;
    let Some(row) = row else {
        return Err(Refused { from: record.phase(), event: Event::Cancel }.into());
    };
    let updated = decode(&row)?;
    Ok(if record.phase() == Phase::InProgress { Cancelled::Flagged(updated) } else { Cancelled::Dequeued(updated) })
}

pub(super) async fn resolve(pool: &PgPool, clock: LeaseClock, resolve: Resolve) -> Result<Action, StoreError> {
    settle(pool, clock, resolve.id, resolve.resolution, None, resolve.entry).await
}

/// Settles an `unknown` record as an operator or a probe decided. A probe names the claim it
/// read the record under (`probe`), and is counted; an operator's word holds whatever the claim.
/// A streamed answer's facts go, as in the SQLite store: the record's answer is the resolution's.
async fn settle(
    pool: &PgPool,
    clock: LeaseClock,
    id: RecordId,
    resolution: Resolution,
    probe: Option<ClaimToken>,
    entry: HistoryEntry,
) -> Result<Action, StoreError> {
    let (state, response) = resolution.stored()?;
    let at = clock.bind_now(entry.at);
    let sql = unknown_update(
        "state = $2, queued = FALSE, response_status = $3, response_headers = $4::jsonb,
         response_body = $5, done_at = CASE WHEN $2 = 'done' THEN $6 END, updated_at = $6,
         next_probe_at = NULL, probe_count = probe_count + $7, stream = NULL,
         history = history || $8::jsonb",
        "($9::bigint IS NULL OR claim_token = $9)",
    );
    let update = sqlx::query(&sql)
        .bind(id.to_string())
        .bind(state)
        .bind(response.map(|r| i32::from(r.status)))
        .bind(response.map(|r| serde_json::to_string(&r.headers)).transpose()?)
        .bind(response.map(|r| &r.body[..]))
        .bind(entry.at)
        .bind(i32::from(probe.is_some()))
        .bind(one_element(&entry)?)
        .bind(probe.map(|claim| claim.0));
    on_unknown(pool, at, id, resolution.event(), update).await
}

/// An update of one `unknown` record (`$1`) that sets `set`, if `guard` holds too, and returns
/// the record.
fn unknown_update(set: &str, guard: &str) -> String {
    format!(
        "UPDATE records SET {set}
         WHERE id = $1::uuid AND state IS NOT DISTINCT FROM 'unknown' AND {guard}
         RETURNING {COLUMNS}"
    )
}

/// Runs `update` (made by [`unknown_update`]) on record `id`, locked first, if the transition
/// table lets the record as it stands take `event`; otherwise, or when the update's own guard
/// (a probe's claim) does not hold, it is refused, as it stands. An event that frees the record
/// or sends it again waits for its attempts' bound, in the store's clock (`at`, as in
/// [`lock_with_bound`]).
async fn on_unknown(
    pool: &PgPool,
    at: Option<Timestamp>,
    id: RecordId,
    event: Event,
    update: sqlx::query::Query<'_, sqlx::Postgres, sqlx::postgres::PgArguments>,
) -> Result<Action, StoreError> {
    let mut tx = pool.begin().await?;
    let locked = lock_with_bound(&mut tx, id, at).await?;
    let (record, left) = match locked {
        Some((record, left)) => (Some(record), left),
        None => (None, Duration::ZERO),
    };
    let record = match decide(record, event) {
        Ok((record, _)) => record,
        Err(answer) => return Ok(answer),
    };
    if waits_for_attempts(event) && !left.is_zero() {
        return Ok(Action::InFlight(record, left));
    }
    let row = update.fetch_optional(&mut *tx).await?;
    tx.commit().await?;
    Ok(match row {
        Some(row) => Action::Applied(decode(&row)?),
        None => Action::Refused(record),
    })
}

pub(super) async fn retry(pool: &PgPool, clock: LeaseClock, retry: Retry) -> Result<Action, StoreError> {
    let Retry { id, deadline_at, entry } = retry;
    let at = clock.bind_now(entry.at);
    let to = retried()?;
    let sql = unknown_update(
        "state = $5, queued = $6, deadline_at = $2, stop_reason = NULL,
         cancel_requested = FALSE, next_probe_at = NULL, updated_at = $3, takeovers = 0,
         history = history || $4::jsonb",
        "TRUE",
    );
    let update = sqlx::query(&sql)
        .bind(id.to_string())
        .bind(deadline_at)
        .bind(entry.at)
        .bind(one_element(&entry)?)
        .bind(to.state())
        .bind(to == Phase::Queued);
    on_unknown(pool, at, id, Event::OperatorRetry, update).await
}

pub(super) async fn probed(pool: &PgPool, clock: LeaseClock, probed: Probed) -> Result<Action, StoreError> {
    let Probed { id, claim, resolution, next_probe_at, entry } = probed;
    if let Some(resolution) = resolution {
        return settle(pool, clock, id, resolution, Some(claim), entry).await;
    }
    let at = clock.bind_now(entry.at);
    let sql = unknown_update(
        "probe_count = probe_count + 1, next_probe_at = $2, updated_at = $3, history = history || $4::jsonb",
        "claim_token = $5",
    );
    let update = sqlx::query(&sql)
        .bind(id.to_string())
        .bind(next_probe_at)
        .bind(entry.at)
        .bind(one_element(&entry)?)
        .bind(claim.0);
    on_unknown(pool, at, id, Event::ProbeInconclusive, update).await
}
