//! The operator's actions and the probes: settle, re-drive or cancel one record. Each reads the
//! record before it decides, so each locks the row for its one transaction.

use sqlx::{PgPool, Row};

use super::rows::{one_element, COLUMNS};
use crate::domain::{ClaimToken, Phase, RecordId, Timestamp};
use crate::record::rules::bound_left;
use crate::record::{transition, Event, HistoryEntry, Record, Refused};
use crate::store::{
    decide, decode, retried, Action, Cancel, Cancelled, LeaseClock, Probed, Resolution, Resolve, Retry, StoreError,
};

/// Reads a record and locks it until `tx` ends: the read-then-write actions decide on what they
/// read, so nothing may change it in between.
async fn lock(tx: &mut sqlx::Transaction<'_, sqlx::Postgres>, id: RecordId) -> Result<Option<Record>, StoreError> {
    Ok(lock_as_of(tx, id, None).await?.map(|(record, _)| record))
}

/// [`lock`], with the store's time to judge the record's attempts' bound by: `as_of` when the
/// evidence carries its own time (a probe's asking) or the store keeps leases in the node's
/// clock, else the database's time now.
async fn lock_as_of(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    id: RecordId,
    as_of: Option<Timestamp>,
) -> Result<Option<(Record, Timestamp)>, StoreError> {
    let row = sqlx::query(&format!(
        "SELECT {COLUMNS}, COALESCE($2::bigint, idem_now()) AS as_of FROM records WHERE id = $1::uuid FOR UPDATE"
    ))
    .bind(id)
    .bind(as_of)
    .fetch_optional(&mut **tx)
    .await?;
    let Some(row) = row else { return Ok(None) };
    Ok(Some((decode(&row)?, row.try_get("as_of")?)))
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
    .bind(id)
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
    let as_of = clock.bind_now(resolve.entry.at);
    settle(pool, clock, as_of, resolve.id, resolve.resolution, None, resolve.entry).await
}

/// Settles an `unknown` record as an operator or a probe decided. A probe names the claim it
/// read the record under (`probe`), and is counted; an operator's word holds whatever the claim.
/// Either frees the record only past its attempts' bound as of `as_of` (see [`lock_as_of`]): a
/// probe's asking, or the operator's word. A streamed answer's facts go, as in the SQLite store:
/// the record's answer is the resolution's.
async fn settle(
    pool: &PgPool,
    clock: LeaseClock,
    as_of: Option<Timestamp>,
    id: RecordId,
    resolution: Resolution,
    probe: Option<ClaimToken>,
    entry: HistoryEntry,
) -> Result<Action, StoreError> {
    let (state, response) = resolution.stored()?;
    let sql = unknown_update(
        "state = $2, queued = FALSE, response_status = $3, response_headers = $4::jsonb,
         response_body = $5, done_at = CASE WHEN $2 = 'done' THEN COALESCE($10::bigint, idem_now()) END,
         updated_at = $6,
         next_probe_at = NULL, probe_count = probe_count + $7, stream = NULL,
         history = history || $8::jsonb",
        "($9::bigint IS NULL OR claim_token = $9)",
    );
    let update = sqlx::query(&sql)
        .bind(id)
        .bind(state)
        .bind(response.map(|r| i32::from(r.status)))
        .bind(response.map(|r| serde_json::to_string(&r.headers)).transpose()?)
        .bind(response.map(|r| &r.body[..]))
        .bind(entry.at)
        .bind(i32::from(probe.is_some()))
        .bind(one_element(&entry)?)
        .bind(probe.map(|claim| claim.0))
        .bind(clock.bind_now(entry.at));
    on_unknown(pool, as_of, id, resolution.event(), update).await
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
/// or sends it again waits for its attempts' bound, judged in the store's clock as of `as_of`
/// (see [`lock_as_of`]).
async fn on_unknown(
    pool: &PgPool,
    as_of: Option<Timestamp>,
    id: RecordId,
    event: Event,
    update: sqlx::query::Query<'_, sqlx::Postgres, sqlx::postgres::PgArguments>,
) -> Result<Action, StoreError> {
    let mut tx = pool.begin().await?;
    let locked = lock_as_of(&mut tx, id, as_of).await?;
    let (record, as_of) = match locked {
        Some((record, as_of)) => (Some(record), Some(as_of)),
        None => (None, None),
    };
    let record = match decide(record, event) {
        Ok((record, _)) => record,
        Err(answer) => return Ok(answer),
    };
    if let Some(left) = as_of.and_then(|as_of| bound_left(record.in_flight_until, event, as_of)) {
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
    let as_of = clock.bind_now(entry.at);
    let to = retried()?;
    let sql = unknown_update(
        "state = $5, queued = $6, deadline_at = $2, stop_reason = NULL,
         cancel_requested = FALSE, next_probe_at = NULL, updated_at = $3, takeovers = 0,
         history = history || $4::jsonb",
        "TRUE",
    );
    let update = sqlx::query(&sql)
        .bind(id)
        .bind(deadline_at)
        .bind(entry.at)
        .bind(one_element(&entry)?)
        .bind(to.state())
        .bind(to == Phase::Queued);
    on_unknown(pool, as_of, id, Event::OperatorRetry, update).await
}

pub(super) async fn probed(pool: &PgPool, clock: LeaseClock, probed: Probed) -> Result<Action, StoreError> {
    let Probed { id, claim, resolution, asked_at, next_probe_at, entry } = probed;
    if let Some(resolution) = resolution {
        return settle(pool, clock, Some(asked_at), id, resolution, Some(claim), entry).await;
    }
    let as_of = clock.bind_now(entry.at);
    let sql = unknown_update(
        "probe_count = probe_count + 1, next_probe_at = $2, updated_at = $3, history = history || $4::jsonb",
        "claim_token = $5",
    );
    let update = sqlx::query(&sql).bind(id).bind(next_probe_at).bind(entry.at).bind(one_element(&entry)?).bind(claim.0);
    on_unknown(pool, as_of, id, Event::ProbeInconclusive, update).await
}
