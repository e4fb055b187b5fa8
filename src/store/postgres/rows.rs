//! Rows of `records` as this store reads and writes them: every column in the shape
//! [`decode`] reads, ids returned as text, JSON appended as one-element arrays.

use sqlx::PgPool;
use uuid::Uuid;

use crate::domain::RecordId;
use crate::record::Record;
use crate::store::{decode, StoreError};

/// Every column of `records`, in the shape [`decode`] reads: ids and JSON as text, integers
/// as 64 bits.
pub(super) const COLUMNS: &str = "id::text AS id, tenant, key, route, method, path, query, fingerprint,
    request_headers::text AS request_headers, request_body, state, queued, deadline_at,
    lease_owner, lease_expires_at, in_flight_number, in_flight_started_at,
    attempts::text AS attempts, stop_reason, response_status::bigint AS response_status,
    response_headers::text AS response_headers, response_body, history::text AS history,
    cancel_requested, probe_count::bigint AS probe_count, next_probe_at, not_before, created_at, updated_at,
    takeovers::bigint AS takeovers, tombstone_until, policy_version, stream::text AS stream, claim_token,
    in_flight_until, done_at";

pub(super) async fn get(pool: &PgPool, id: RecordId) -> Result<Option<Record>, StoreError> {
    sqlx::query(&format!("SELECT {COLUMNS} FROM records WHERE id = $1::uuid"))
        .bind(id)
        .fetch_optional(pool)
        .await?
        .map(|row| decode(&row))
        .transpose()
}

/// A record id that PostgreSQL returned as text.
pub(super) fn record_id(text: &str) -> Result<Uuid, StoreError> {
    Uuid::parse_str(text).map_err(|e| StoreError::Corrupt(format!("record id `{text}`: {e}")))
}

/// A JSON array holding `item`: what `jsonb || …` appends as one element.
pub(super) fn one_element<T: serde::Serialize>(item: &T) -> Result<String, StoreError> {
    Ok(serde_json::to_string(&[item])?)
}
