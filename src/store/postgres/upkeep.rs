//! Upkeep shared by every node: take-over of expired leases, queued records nobody claimed, and
//! the retention sweep. Nodes sweeping at once never wait on each other: a take-over is a
//! compare-and-set on the lease it saw, and the batch statements skip rows another has locked.

use sqlx::PgPool;

use super::rows::{one_element, COLUMNS};
use crate::domain::Phase;
use crate::domain::StopReason;
use crate::record::{transition, Event, Record};
use crate::store::{decode, span_ms, ClaimUnclaimed, LeaseClock, StoreError, Sweep, TakeOver};

/// Takes over a record whose lease expired, if it stands as it was read: its claim, its lease and
/// its attempt in flight decided where it goes.
pub(super) const TAKE_OVER: &str = "
UPDATE records SET state = $4, queued = $5, stop_reason = $6, lease_owner = NULL,
                   lease_expires_at = NULL, in_flight_number = NULL, in_flight_started_at = NULL,
                   attempts = attempts || COALESCE($7::jsonb, '[]'::jsonb),
                   history = history || $8::jsonb, updated_at = $9, takeovers = takeovers + 1
WHERE id = $1::uuid AND state IS NOT DISTINCT FROM 'in_progress' AND claim_token = $2
  AND lease_expires_at = $3 AND in_flight_number IS NOT DISTINCT FROM $10::bigint";

pub(super) async fn take_over(pool: &PgPool, take_over: TakeOver) -> Result<bool, StoreError> {
    let TakeOver { id, expired, claim, in_flight, to, lost, entry } = take_over;
    let phase = to.phase();
    let done = sqlx::query(TAKE_OVER)
        .bind(id)
        .bind(claim.0)
        .bind(expired.expires_at)
        .bind(phase.state())
        .bind(phase == Phase::Queued)
        .bind(to.stop_reason().map(StopReason::as_str))
        .bind(lost.as_ref().map(one_element).transpose()?)
        .bind(one_element(&entry)?)
        .bind(entry.at)
        .bind(in_flight.map(i64::from))
        .execute(pool)
        .await?;
    Ok(done.rows_affected() == 1)
}

/// Of several nodes claiming at once, each skips the rows another has locked: every record goes
/// to exactly one, and none waits.
pub(super) async fn claim_unclaimed(
    pool: &PgPool,
    clock: LeaseClock,
    claim: ClaimUnclaimed,
) -> Result<Vec<Record>, StoreError> {
    let ClaimUnclaimed { owner, lease, idle_since, now, limit } = claim;
    let to = transition(Phase::Queued, Event::Claim)?;
    let rows = sqlx::query(&format!(
        "UPDATE records SET state = $6, queued = FALSE, lease_owner = $1,
                lease_expires_at = COALESCE($7::bigint, idem_now()) + $2, updated_at = $4,
                claim_token = claim_token + 1
         WHERE id IN (SELECT id FROM records
                      WHERE state = 'not_started' AND queued AND updated_at < $3
                      ORDER BY created_at LIMIT $5
                      FOR UPDATE SKIP LOCKED)
         RETURNING {COLUMNS}"
    ))
    .bind(&owner)
    .bind(span_ms(lease))
    .bind(idle_since)
    .bind(now)
    .bind(i64::from(limit))
    .bind(to.state())
    .bind(clock.bind_now(now))
    .fetch_all(pool)
    .await?;
    rows.iter().map(decode).collect()
}

/// Ends retention by the plan, judged in the store's clock, where done records were stamped
/// as done: the plan is moved to the server's time unless the store keeps the node's.
pub(super) async fn sweep_done(pool: &PgPool, clock: LeaseClock, sweep: Sweep) -> Result<u64, StoreError> {
    let Sweep { plan, limit } = sweep;
    let plan = match clock {
        LeaseClock::Node => plan,
        LeaseClock::Database => plan.as_of(sqlx::query_scalar("SELECT idem_now()").fetch_one(pool).await?),
    };
    let limit = i64::from(limit);
    let mut changed = 0;
    for route in &plan.routes {
        let swept = match route.tombstone_after {
            Some(after) => {
                sqlx::query(
                    "UPDATE records SET tombstone_until = done_at + $3, path = '', query = '',
                        request_headers = '[]'::jsonb, request_body = ''::bytea, attempts = '[]'::jsonb,
                        history = '[]'::jsonb, response_headers = NULL, response_body = NULL
                     WHERE id IN (SELECT id FROM records WHERE state = 'done' AND tombstone_until IS NULL
                                  AND done_at < $1 AND route = $2 LIMIT $4 FOR UPDATE SKIP LOCKED)",
                )
                .bind(route.cutoff)
                .bind(&route.route)
                .bind(span_ms(after))
                .bind(limit)
                .execute(pool)
                .await?
            }
            None => {
                sqlx::query(
                    "DELETE FROM records WHERE id IN (SELECT id FROM records WHERE state = 'done'
                        AND tombstone_until IS NULL AND done_at < $1 AND route = $2
                        LIMIT $3 FOR UPDATE SKIP LOCKED)",
                )
                .bind(route.cutoff)
                .bind(&route.route)
                .bind(limit)
                .execute(pool)
                .await?
            }
        };
        changed += swept.rows_affected();
    }
    let configured: Vec<&crate::domain::RouteName> = plan.routes.iter().map(|r| &r.route).collect();
    let others = sqlx::query(
        "DELETE FROM records WHERE id IN (SELECT id FROM records WHERE state = 'done'
            AND tombstone_until IS NULL AND done_at < $1 AND route <> ALL($2::text[])
            LIMIT $3 FOR UPDATE SKIP LOCKED)",
    )
    .bind(plan.others_cutoff)
    .bind(&configured)
    .bind(limit)
    .execute(pool)
    .await?;
    let tombstones = sqlx::query(
        "DELETE FROM records WHERE id IN (SELECT id FROM records WHERE tombstone_until < $1
            LIMIT $2 FOR UPDATE SKIP LOCKED)",
    )
    .bind(plan.now)
    .bind(limit)
    .execute(pool)
    .await?;
    Ok(changed + others.rows_affected() + tombstones.rows_affected())
}
