//! Outcomes of attempts, stored together: the attempts that ended at the same moment go to
//! PostgreSQL as one call of `idem_end_attempts` (`migrations/postgres`), one round trip and one
//! commit for all of them, where one statement each made PostgreSQL parse, execute, commit and
//! answer each alone. The function updates row by row, exactly as one attempt's update would.
//! An outcome it refuses (its claim is no longer the record's) may be a late one, tried alone
//! after the batch: the outcome of the attempt that was in flight when a take-over moved its
//! record to `unknown` (see [`AttemptEnded::late`]).

use std::collections::HashMap;

use sqlx::PgPool;

use super::lanes::{Lanes, Reply, LANES, MAX_BATCH};
use super::rows::{one_element, record_id};
use crate::domain::RecordId;
use crate::domain::StopReason;
use crate::store::{AttemptEnded, LeaseClock, LeaseStatus, StoreError, Stored};

/// One attempt's outcome, waiting for its batch.
struct Ending {
    ended: AttemptEnded,
    reply: Reply<LeaseStatus>,
}

pub(super) struct Outcomes {
    lanes: Lanes<Ending>,
}

impl Outcomes {
    pub(super) fn start(pool: PgPool, clock: LeaseClock) -> Outcomes {
        Outcomes { lanes: Lanes::start(LANES, MAX_BATCH, move |batch| store(pool.clone(), clock, batch)) }
    }

    /// Stores where the record goes after the attempt, if its owner still holds its lease.
    pub(super) async fn attempt_ended(&self, ended: AttemptEnded) -> Result<LeaseStatus, StoreError> {
        // Refused here, to its own caller, rather than failing a batch.
        ended.then.stored()?;
        self.lanes.ask(|reply| Ending { ended, reply }).await
    }
}

/// Stores a batch; should the call fail, each outcome is tried alone, so that one bad outcome
/// does not fail the others and each gets its own error.
async fn store(pool: PgPool, clock: LeaseClock, batch: Vec<Ending>) {
    let ended = match call(&pool, clock, &batch).await {
        Err(_) if batch.len() > 1 => {
            for ending in batch {
                let pool = pool.clone();
                tokio::spawn(store_alone(pool, clock, ending));
            }
            return;
        }
        ended => ended,
    };
    for ending in batch {
        answer(&pool, clock, ending, &ended).await;
    }
}

async fn store_alone(pool: PgPool, clock: LeaseClock, ending: Ending) {
    let ended = call(&pool, clock, std::slice::from_ref(&ending)).await;
    answer(&pool, clock, ending, &ended).await;
}

/// Answers an outcome as its batch stored it, after trying a refused one as a late outcome.
async fn answer(pool: &PgPool, clock: LeaseClock, ending: Ending, ended: &Result<HashMap<RecordId, bool>, StoreError>) {
    let lease = lease(ended, ending.ended.id);
    if let Ok(LeaseStatus::Lost) = lease {
        if let Err(e) = late_outcome(pool, clock, &ending.ended).await {
            let _ = ending.reply.send(Err(e));
            return;
        }
    }
    let _ = ending.reply.send(lease);
}

/// Settles an `unknown` record with a late outcome, if the record is still as its claim's
/// take-over left it: unknown, under the same claim, its last attempt the one lost.
pub(super) const LATE_OUTCOME: &str = "
UPDATE records SET attempts = jsonb_set(attempts, '{-1}', $4::jsonb), state = $5, queued = FALSE,
                   response_status = $6, response_headers = $7::jsonb, response_body = $8,
                   done_at = CASE WHEN $5 = 'done' THEN COALESCE($12::bigint, idem_now()) END,
                   next_probe_at = CASE WHEN $5 = 'unknown' THEN next_probe_at END,
                   stream = COALESCE($10::jsonb, stream), history = history || $11::jsonb, updated_at = $9
WHERE id = $1::uuid AND state IS NOT DISTINCT FROM 'unknown' AND claim_token = $2
  AND (attempts -> -1 ->> 'number')::bigint = $3 AND attempts -> -1 ->> 'outcome' = 'lost'";

async fn late_outcome(pool: &PgPool, clock: LeaseClock, ended: &AttemptEnded) -> Result<bool, StoreError> {
    let Some(late) = ended.late() else { return Ok(false) };
    let response = late.response;
    let done = sqlx::query(LATE_OUTCOME)
        .bind(ended.id)
        .bind(ended.holder.token)
        .bind(i64::from(late.attempt.number))
        .bind(serde_json::to_string(late.attempt)?)
        .bind(late.state)
        .bind(response.map(|r| i32::from(r.status)))
        .bind(response.map(|r| serde_json::to_string(&r.headers)).transpose()?)
        .bind(response.map(|r| &r.body[..]))
        .bind(ended.now)
        .bind(ended.stream.as_ref().map(serde_json::to_string).transpose()?)
        .bind(one_element(&late.entry)?)
        .bind(clock.bind_now(ended.now))
        .execute(pool)
        .await?;
    Ok(done.rows_affected() == 1)
}

fn lease(ended: &Result<HashMap<RecordId, bool>, StoreError>, id: RecordId) -> Result<LeaseStatus, StoreError> {
    match ended {
        Ok(ended) => Ok(match ended.get(&id) {
            Some(&cancel_requested) => LeaseStatus::Held { cancel_requested },
            None => LeaseStatus::Lost,
        }),
        Err(e) => Err(e.clone()),
    }
}

/// Calls `idem_end_attempts`: the records whose lease was still held, and whether each was asked
/// to cancel. The function takes one array per column, each outcome at the same index in all.
async fn call(pool: &PgPool, clock: LeaseClock, batch: &[Ending]) -> Result<HashMap<RecordId, bool>, StoreError> {
    let ended: Vec<&AttemptEnded> = batch.iter().map(|e| &e.ended).collect();
    let stored = ended.iter().map(|e| e.then.stored()).collect::<Result<Vec<Stored>, _>>()?;
    let attempts =
        ended.iter().map(|e| e.attempt.as_ref().map(one_element).transpose()).collect::<Result<Vec<_>, _>>()?;
    let headers = stored
        .iter()
        .map(|s| s.response.map(|r| serde_json::to_string(&r.headers)).transpose())
        .collect::<Result<Vec<_>, _>>()?;
    let streams = ended
        .iter()
        .map(|e| e.stream.as_ref().map(serde_json::to_string).transpose())
        .collect::<Result<Vec<_>, _>>()?;
    let rows: Vec<(String, bool)> = sqlx::query_as(
        "SELECT ended::text, cancel_requested FROM idem_end_attempts(
             $1::text[]::uuid[], $2::int8[], $3::text[]::jsonb[], $4::bool[], $5::text[], $6::text[],
             $7::int4[], $8::text[]::jsonb[], $9::bytea[], $10::int8[], $11::int8[], $12::bool[],
             $13::int8[], $14::text[]::jsonb[])",
    )
    .bind(ended.iter().map(|e| e.id).collect::<Vec<_>>())
    .bind(ended.iter().map(|e| e.holder.token).collect::<Vec<_>>())
    .bind(attempts)
    .bind(ended.iter().map(|e| e.ends_its_attempt()).collect::<Vec<_>>())
    .bind(stored.iter().map(|s| s.state).collect::<Vec<_>>())
    .bind(stored.iter().map(|s| s.stop.map(StopReason::as_str)).collect::<Vec<_>>())
    .bind(stored.iter().map(|s| s.response.map(|r| i32::from(r.status))).collect::<Vec<_>>())
    .bind(headers)
    .bind(stored.iter().map(|s| s.response.map(|r| &r.body[..])).collect::<Vec<_>>())
    .bind(ended.iter().map(|e| e.now).collect::<Vec<_>>())
    .bind(ended.iter().map(|e| clock.bind_now(e.now)).collect::<Vec<_>>())
    .bind(stored.iter().map(|s| s.queued).collect::<Vec<_>>())
    .bind(stored.iter().map(|s| s.not_before).collect::<Vec<_>>())
    .bind(streams)
    .fetch_all(pool)
    .await?;
    rows.into_iter().map(|(id, cancel)| Ok((RecordId(record_id(&id)?), cancel))).collect()
}
