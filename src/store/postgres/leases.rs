//! A worker's lease on a record in PostgreSQL: taking a queued record, marking an attempt as
//! about to be sent, extending the lease. Each is one statement guarded by the lease's owner, so
//! a worker that lost its record finds out instead of writing over its new owner.

use sqlx::postgres::{PgPool, PgRow};
use sqlx::Row;
use uuid::Uuid;

use crate::record::Millis;
use crate::store::{Lease, StoreError};

/// Takes a queued record.
pub(super) const CLAIM: &str = "
UPDATE records SET state = 'in_progress', queued = FALSE, lease_owner = $2, lease_expires_at = $3,
                   updated_at = $4
WHERE id = $1::uuid AND state IS NOT DISTINCT FROM 'not_started' AND queued";

/// Marks an attempt as about to be sent, renewing the lease.
pub(super) const ATTEMPT_STARTED: &str = "
UPDATE records SET in_flight_number = $3, in_flight_started_at = $4, lease_expires_at = $5,
                   policy_version = $6, updated_at = $4
WHERE id = $1::uuid AND state IS NOT DISTINCT FROM 'in_progress' AND lease_owner = $2
RETURNING cancel_requested";

/// Extends a lease.
pub(super) const RENEW: &str = "
UPDATE records SET lease_expires_at = $3, updated_at = $4
WHERE id = $1::uuid AND state IS NOT DISTINCT FROM 'in_progress' AND lease_owner = $2
RETURNING cancel_requested";

pub(super) async fn claim(
    pool: &PgPool,
    id: Uuid,
    owner: &str,
    until: Millis,
    now: Millis,
) -> Result<bool, StoreError> {
    let done = sqlx::query(CLAIM).bind(id.to_string()).bind(owner).bind(until).bind(now).execute(pool).await?;
    Ok(done.rows_affected() == 1)
}

fn lease_of(row: Option<PgRow>) -> Result<Lease, StoreError> {
    Ok(match row {
        Some(row) => Lease::Held { cancel_requested: row.try_get("cancel_requested")? },
        None => Lease::Lost,
    })
}

/// The attempt's number, start, lease end and policy version.
pub(super) type Started<'a> = (u32, Millis, Millis, &'a str);

pub(super) async fn attempt_started(
    pool: &PgPool,
    id: Uuid,
    owner: &str,
    started: Started<'_>,
) -> Result<Lease, StoreError> {
    let (number, at, until, version) = started;
    let row = sqlx::query(ATTEMPT_STARTED)
        .bind(id.to_string())
        .bind(owner)
        .bind(i64::from(number))
        .bind(at)
        .bind(until)
        .bind(version)
        .fetch_optional(pool)
        .await?;
    lease_of(row)
}

pub(super) async fn renew(
    pool: &PgPool,
    id: Uuid,
    owner: &str,
    until: Millis,
    now: Millis,
) -> Result<Lease, StoreError> {
    let row = sqlx::query(RENEW).bind(id.to_string()).bind(owner).bind(until).bind(now).fetch_optional(pool).await?;
    lease_of(row)
}
