//! A worker's lease on a record in PostgreSQL: taking a queued record, marking an attempt as
//! about to be sent, extending the lease. Each is one statement guarded by the claim's token, so
//! a worker that lost its record finds out instead of writing over its new claim's. Each sets the
//! lease's expiry (and a mark, its attempt's bound) in the store's clock: `$now` is the node's time
//! only when the store keeps leases in the node's clock, else NULL, and `idem_now()` reads the
//! server's.

use sqlx::postgres::{PgPool, PgRow};
use sqlx::Row;

use crate::domain::{ClaimToken, Phase};
use crate::record::{transition, Event};
use crate::store::{span_ms, AttemptStarted, ClaimQueued, LeaseClock, LeaseStatus, Renew, StoreError};

/// Takes a queued record.
pub(super) const CLAIM: &str = "
UPDATE records SET state = $5, queued = FALSE, lease_owner = $2,
                   lease_expires_at = COALESCE($6::bigint, idem_now()) + $3,
                   updated_at = $4, claim_token = claim_token + 1
WHERE id = $1::uuid AND state IS NOT DISTINCT FROM 'not_started' AND queued
RETURNING claim_token";

/// Marks an attempt as about to be sent, renewing the lease and raising the attempts' bound.
pub(super) const ATTEMPT_STARTED: &str = "
UPDATE records SET in_flight_number = $3, in_flight_started_at = $4,
                   lease_expires_at = COALESCE($8::bigint, idem_now()) + $5,
                   in_flight_until = GREATEST(COALESCE(in_flight_until, 0), COALESCE($8::bigint, idem_now()) + $7),
                   policy_version = $6, stream = NULL, updated_at = $4
WHERE id = $1::uuid AND state IS NOT DISTINCT FROM 'in_progress' AND claim_token = $2
RETURNING cancel_requested";

/// Extends a lease.
pub(super) const RENEW: &str = "
UPDATE records SET lease_expires_at = COALESCE($5::bigint, idem_now()) + $3, updated_at = $4
WHERE id = $1::uuid AND state IS NOT DISTINCT FROM 'in_progress' AND claim_token = $2
RETURNING cancel_requested";

pub(super) async fn claim(
    pool: &PgPool,
    clock: LeaseClock,
    claim: ClaimQueued,
) -> Result<Option<ClaimToken>, StoreError> {
    let ClaimQueued { id, owner, lease, now } = claim;
    let to = transition(Phase::Queued, Event::Claim)?;
    let token: Option<i64> = sqlx::query_scalar(CLAIM)
        .bind(id)
        .bind(&owner)
        .bind(span_ms(lease))
        .bind(now)
        .bind(to.state())
        .bind(clock.bind_now(now))
        .fetch_optional(pool)
        .await?;
    Ok(token.map(ClaimToken))
}

fn lease_of(row: Option<PgRow>) -> Result<LeaseStatus, StoreError> {
    Ok(match row {
        Some(row) => LeaseStatus::Held { cancel_requested: row.try_get("cancel_requested")? },
        None => LeaseStatus::Lost,
    })
}

pub(super) async fn attempt_started(
    pool: &PgPool,
    clock: LeaseClock,
    started: AttemptStarted,
) -> Result<LeaseStatus, StoreError> {
    let AttemptStarted { id, holder, number, started_at, lease, reach, policy_version } = started;
    let row = sqlx::query(ATTEMPT_STARTED)
        .bind(id)
        .bind(holder.token)
        .bind(i64::from(number))
        .bind(started_at)
        .bind(span_ms(lease))
        .bind(policy_version)
        .bind(span_ms(reach))
        .bind(clock.bind_now(started_at))
        .fetch_optional(pool)
        .await?;
    lease_of(row)
}

pub(super) async fn renew(pool: &PgPool, clock: LeaseClock, renew: Renew) -> Result<LeaseStatus, StoreError> {
    let Renew { id, holder, lease, now } = renew;
    let row = sqlx::query(RENEW)
        .bind(id)
        .bind(holder.token)
        .bind(span_ms(lease))
        .bind(now)
        .bind(clock.bind_now(now))
        .fetch_optional(pool)
        .await?;
    lease_of(row)
}
