//! A worker's lease on a record in PostgreSQL: taking a queued record, marking an attempt as
//! about to be sent, extending the lease. Each is one statement guarded by the claim's token, so
//! a worker that lost its record finds out instead of writing over its new claim's.

use sqlx::postgres::{PgPool, PgRow};
use sqlx::Row;

use crate::domain::{ClaimToken, Phase};
use crate::record::{transition, Event};
use crate::store::{AttemptStarted, ClaimQueued, Lease, Renew, StoreError};

/// Takes a queued record.
pub(super) const CLAIM: &str = "
UPDATE records SET state = $5, queued = FALSE, lease_owner = $2, lease_expires_at = $3,
                   updated_at = $4, claim_token = claim_token + 1
WHERE id = $1::uuid AND state IS NOT DISTINCT FROM 'not_started' AND queued
RETURNING claim_token";

/// Marks an attempt as about to be sent, renewing the lease.
pub(super) const ATTEMPT_STARTED: &str = "
UPDATE records SET in_flight_number = $3, in_flight_started_at = $4, lease_expires_at = $5,
                   policy_version = $6, stream = NULL, updated_at = $4
WHERE id = $1::uuid AND state IS NOT DISTINCT FROM 'in_progress' AND claim_token = $2
RETURNING cancel_requested";

/// Extends a lease.
pub(super) const RENEW: &str = "
UPDATE records SET lease_expires_at = $3, updated_at = $4
WHERE id = $1::uuid AND state IS NOT DISTINCT FROM 'in_progress' AND claim_token = $2
RETURNING cancel_requested";

pub(super) async fn claim(pool: &PgPool, claim: ClaimQueued) -> Result<Option<ClaimToken>, StoreError> {
    let ClaimQueued { id, owner, lease_until, now } = claim;
    let to = transition(Phase::Queued, Event::Claim)?;
    let token: Option<i64> = sqlx::query_scalar(CLAIM)
        .bind(id.to_string())
        .bind(&*owner)
        .bind(lease_until)
        .bind(now)
        .bind(to.state().as_str())
        .fetch_optional(pool)
        .await?;
    Ok(token.map(ClaimToken))
}

fn lease_of(row: Option<PgRow>) -> Result<Lease, StoreError> {
    Ok(match row {
        Some(row) => Lease::Held { cancel_requested: row.try_get("cancel_requested")? },
        None => Lease::Lost,
    })
}

pub(super) async fn attempt_started(pool: &PgPool, started: AttemptStarted) -> Result<Lease, StoreError> {
    let AttemptStarted { id, holder, number, started_at, lease_until, policy_version } = started;
    let row = sqlx::query(ATTEMPT_STARTED)
        .bind(id.to_string())
        .bind(holder.token.0)
        .bind(i64::from(number))
        .bind(started_at)
        .bind(lease_until)
        .bind(policy_version.as_str())
        .fetch_optional(pool)
        .await?;
    lease_of(row)
}

pub(super) async fn renew(pool: &PgPool, renew: Renew) -> Result<Lease, StoreError> {
    let Renew { id, holder, lease_until, now } = renew;
    let row = sqlx::query(RENEW)
        .bind(id.to_string())
        .bind(holder.token.0)
        .bind(lease_until)
        .bind(now)
        .fetch_optional(pool)
        .await?;
    lease_of(row)
}
