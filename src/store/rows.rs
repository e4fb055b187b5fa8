//! Rows into records: one decoder for every driver's rows, so both backends read a record the
//! same way.

use bytes::Bytes;
use uuid::Uuid;

use super::StoreError;
use crate::domain::fingerprint::Fingerprint;
use crate::domain::key::IdempotencyKey;
use crate::domain::PolicyVersion;
use crate::domain::StopReason;
use crate::domain::{ClaimToken, HistoryAction, RecordId, State, Tenant, Timestamp};
use crate::record::{Attempt, HistoryEntry, Record, StoredRequest, StoredResponse};

/// A row read by column name, whichever driver produced it: any sqlx row (both backends), and
/// the SQLite writer's rusqlite rows (`sqlite::rows`). Integers arrive as 64 bits (PostgreSQL's
/// queries cast theirs).
pub(crate) trait Columns {
    fn text(&self, name: &str) -> Result<Option<String>, StoreError>;
    fn integer(&self, name: &str) -> Result<Option<i64>, StoreError>;
    fn blob(&self, name: &str) -> Result<Option<Vec<u8>>, StoreError>;
    fn flag(&self, name: &str) -> Result<bool, StoreError>;

    /// A time, stored as milliseconds since the epoch.
    fn time(&self, name: &str) -> Result<Option<Timestamp>, StoreError> {
        Ok(self.integer(name)?.map(Timestamp::from_millis))
    }
}

/// Every sqlx row whose database decodes the four kinds of value: the trait names no driver.
impl<R> Columns for R
where
    R: sqlx::Row,
    for<'n> &'n str: sqlx::ColumnIndex<R>,
    for<'r> Option<String>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Option<i64>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Option<Vec<u8>>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> bool: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    fn text(&self, name: &str) -> Result<Option<String>, StoreError> {
        Ok(self.try_get(name)?)
    }
    fn integer(&self, name: &str) -> Result<Option<i64>, StoreError> {
        Ok(self.try_get(name)?)
    }
    fn blob(&self, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
        Ok(self.try_get(name)?)
    }
    fn flag(&self, name: &str) -> Result<bool, StoreError> {
        Ok(self.try_get(name)?)
    }
}

/// Reads a record from a row of either backend, checking every value: ids and JSON arrive as
/// text, booleans as booleans (or SQLite's 0 and 1).
pub(crate) fn decode(row: &impl Columns) -> Result<Record, StoreError> {
    let corrupt = |what: &str| StoreError::Corrupt(format!("column {what}"));
    let text = |name: &'static str| row.text(name)?.ok_or_else(|| corrupt(name));
    let number = |name: &'static str| row.integer(name);
    let required = |name: &'static str| row.integer(name)?.ok_or_else(|| corrupt(name));
    let time = |name: &'static str| row.time(name);
    let required_time = |name: &'static str| row.time(name)?.ok_or_else(|| corrupt(name));
    let response = match number("response_status")? {
        None => None,
        Some(status) => Some(StoredResponse {
            status: u16::try_from(status).map_err(|_| corrupt("response_status"))?,
            headers: serde_json::from_str(row.text("response_headers")?.as_deref().unwrap_or("[]"))?,
            body: Bytes::from(row.blob("response_body")?.unwrap_or_default()),
        }),
    };
    let in_flight = match number("in_flight_number")?.zip(number("in_flight_started_at")?) {
        None => None,
        Some((n, at)) => Some((u32::try_from(n).map_err(|_| corrupt("in_flight_number"))?, Timestamp::from_millis(at))),
    };
    let lease = row
        .text("lease_owner")?
        .zip(time("lease_expires_at")?)
        .map(|(owner, expires_at)| crate::record::Lease { owner: owner.into(), expires_at });
    Ok(Record {
        id: RecordId(Uuid::parse_str(&text("id")?).map_err(|_| corrupt("id"))?),
        tenant: Tenant::from(text("tenant")?),
        key: IdempotencyKey::from_stored(text("key")?),
        route: text("route")?.into(),
        method: http::Method::from_bytes(text("method")?.as_bytes()).map_err(|_| corrupt("method"))?,
        path: text("path")?,
        query: text("query")?,
        fingerprint: Fingerprint::from_bytes(&row.blob("fingerprint")?.unwrap_or_default())
            .ok_or_else(|| corrupt("fingerprint"))?,
        request: StoredRequest {
            headers: serde_json::from_str(&text("request_headers")?)?,
            body: Bytes::from(row.blob("request_body")?.ok_or_else(|| corrupt("request_body"))?),
        },
        state: State::parse(&text("state")?).ok_or_else(|| corrupt("state"))?,
        queued: row.flag("queued")?,
        deadline_at: required_time("deadline_at")?,
        lease,
        claim: ClaimToken(required("claim_token")?),
        in_flight,
        in_flight_until: time("in_flight_until")?,
        attempts: serde_json::from_str(&text("attempts")?)?,
        stop_reason: row
            .text("stop_reason")?
            .map(|s| StopReason::parse(&s).ok_or_else(|| corrupt("stop_reason")))
            .transpose()?,
        response,
        history: serde_json::from_str(&text("history")?)?,
        cancel_requested: row.flag("cancel_requested")?,
        probe_count: u32::try_from(required("probe_count")?).map_err(|_| corrupt("probe_count"))?,
        next_probe_at: time("next_probe_at")?,
        takeovers: u32::try_from(required("takeovers")?).map_err(|_| corrupt("takeovers"))?,
        not_before: time("not_before")?,
        tombstone_until: time("tombstone_until")?,
        policy_version: row.text("policy_version")?.map(PolicyVersion::from),
        stream: row.text("stream")?.map(|s| serde_json::from_str(&s)).transpose()?,
        created_at: required_time("created_at")?,
        updated_at: required_time("updated_at")?,
        done_at: time("done_at")?,
    })
}

/// One request of the route as recorded, with what a replay needs of it.
#[derive(Debug, Clone, PartialEq)]
pub struct Recorded {
    pub id: Uuid,
    /// Whose request it was: a replay charges its retries to its tenant's quota too.
    pub tenant: Tenant,
    pub created_at: Timestamp,
    /// The end of its deadline: the route's, or earlier if the client shortened it.
    pub deadline_at: Timestamp,
    pub state: State,
    /// `None` while its execution has not ended.
    pub stop_reason: Option<StopReason>,
    pub attempts: Vec<Attempt>,
    /// An attempt was marked as sent and its outcome is not recorded (yet).
    pub in_flight: bool,
    /// Past its retention and kept as a tombstone: its attempts were dropped.
    pub tombstone: bool,
    /// When its key, freed, was sent again, oldest first: each time a new execution of the same
    /// record began, with attempts of its own.
    pub requeued_at: Vec<Timestamp>,
}

/// The times of a stored history's `requeued` entries, oldest first.
fn requeued_at(history: &str) -> Result<Vec<Timestamp>, StoreError> {
    let entries: Vec<HistoryEntry> = serde_json::from_str(history)?;
    let mut at: Vec<Timestamp> = entries.iter().filter(|e| e.action == HistoryAction::Requeued).map(|e| e.at).collect();
    at.sort_unstable();
    Ok(at)
}

/// Reads one row of either backend's history query (`store::recorded`): `id`, `created_at`,
/// `deadline_at`, `state`, `stop_reason`, `attempts` (JSON text), `history`, `in_flight` and
/// `tombstone` (flags).
pub(crate) fn decode_recorded(row: &impl Columns) -> Result<Recorded, StoreError> {
    let corrupt = |what: &str| StoreError::Corrupt(format!("column {what}"));
    let text = |name: &'static str| row.text(name)?.ok_or_else(|| corrupt(name));
    let mut attempts: Vec<Attempt> = serde_json::from_str(&text("attempts")?)?;
    attempts.sort_by_key(|a| a.number);
    Ok(Recorded {
        id: Uuid::parse_str(&text("id")?).map_err(|_| corrupt("id"))?,
        tenant: text("tenant")?.into(),
        created_at: row.time("created_at")?.ok_or_else(|| corrupt("created_at"))?,
        deadline_at: row.time("deadline_at")?.ok_or_else(|| corrupt("deadline_at"))?,
        state: State::parse(&text("state")?).ok_or_else(|| corrupt("state"))?,
        stop_reason: row
            .text("stop_reason")?
            .map(|s| StopReason::parse(&s).ok_or_else(|| corrupt("stop_reason")))
            .transpose()?,
        attempts,
        in_flight: row.flag("in_flight")?,
        tombstone: row.flag("tombstone")?,
        requeued_at: requeued_at(&text("history")?)?,
    })
}
