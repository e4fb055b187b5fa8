//! The PostgreSQL store, for several `idem serve` processes sharing one database. Every write is
//! one conditional statement (`INSERT … ON CONFLICT`, `UPDATE … WHERE <expected state>`), so row
//! locks and the unique index make it safe from any number of connections; the operator actions
//! that read before they write lock their row for that one transaction only. Work queues are
//! taken with `FOR UPDATE SKIP LOCKED`, so nodes sweeping at once never wait on each other. A
//! trigger announces settled and queued records on the `idem_records` channel, which one
//! listening connection per process relays as [`Notice`]s (`notices`). New keys that arrive
//! together are inserted by one statement (`admissions`), and the outcomes of attempts that end
//! together are stored by one call of a SQL function that updates each row as the one-row
//! statement would (`outcomes`). The operator's actions live in `actions`, take-over and the
//! sweeps in `upkeep`, the emergency switches in `switches`.
//!
//! The SQL mirrors `sqlite/writes.rs` statement for statement; that store's semantics are the
//! reference. UUIDs are bound as text and JSON as text cast to `jsonb`, and both are read back as
//! text (see `COLUMNS`), so the store needs no sqlx type features beyond the defaults.
//!
//! A statement about one record names it by id and checks its state with `state IS NOT DISTINCT
//! FROM '…'` rather than `state = '…'`. The equality would let the planner prove a partial
//! index's predicate (`records_leases` for `in_progress`, say) and scan that index whole,
//! filtering on the id — and it does, on a table too new to have statistics, and keeps that
//! plan cached on the connection: each write then reads every in-progress record's entry. The
//! other form cannot match an index, so the primary key is the only way in.

mod actions;
mod admissions;
mod lanes;
mod leases;
mod notices;
mod outcomes;
pub(super) mod recorded;
mod stats;
mod switches;
#[cfg(test)]
mod tests;
mod upkeep;

use std::sync::LazyLock;

use async_trait::async_trait;
use sqlx::postgres::{PgConnection, PgPool, PgPoolOptions};
use sqlx::{Connection, Row};
use tokio::sync::{broadcast, oneshot};
use uuid::Uuid;

use self::admissions::Admissions;
use self::leases::{attempt_started, claim, renew};
use self::outcomes::Outcomes;
use super::stats::{AnswerCount, Side, StatsRows, StatsSpan};
use super::{
    decode, page, Action, Admission, AfterAttempt, Cancelled, Lease, ListFilter, NewRecord, Notice, Page, Resolution,
    Store, StoreError, SweepPlan, SwitchCleared, TakeOverTo,
};
use crate::record::{Attempt, HistoryEntry, Millis, Phase, Record, State};
use crate::switch::{Clearing, Switch};

/// Connections per process: enough for a node's workers and requests, few enough that a dozen
/// nodes fit in PostgreSQL's default `max_connections`.
const MAX_CONNECTIONS: u32 = 16;
/// Notices held for a slow subscriber before it starts missing some (it then sees `Lagged` and
/// re-reads what it waits for).
const NOTICE_BACKLOG: usize = 1024;
/// How many times `admit` retries when the row it conflicted with changed before it could read
/// it. Each retry needs another request to change that very row in between; more than a few in a
/// row means something is wrong.
const ADMIT_TRIES: usize = 8;

/// Every column of `records`, in the shape [`decode`] reads: ids and JSON as text, integers
/// as 64 bits.
const COLUMNS: &str = "id::text AS id, tenant, key, route, method, path, query, fingerprint,
    request_headers::text AS request_headers, request_body, state, queued, deadline_at,
    lease_owner, lease_expires_at, in_flight_number, in_flight_started_at,
    attempts::text AS attempts, stop_reason, response_status::bigint AS response_status,
    response_headers::text AS response_headers, response_body, history::text AS history,
    cancel_requested, probe_count::bigint AS probe_count, next_probe_at, not_before, created_at, updated_at,
    takeovers::bigint AS takeovers, tombstone_until, policy_version";

pub struct PostgresStore {
    pool: PgPool,
    admissions: Admissions,
    outcomes: Outcomes,
    notices: broadcast::Sender<Notice>,
    /// Dropped with the store, which stops the task relaying notifications.
    _relay: oneshot::Sender<()>,
    url: String,
    /// The health checks' own connection: a pool busy with requests must not pass for a
    /// database that is down, nor a pool's idle connection for one that is up.
    health_check: tokio::sync::Mutex<Option<PgConnection>>,
}

impl PostgresStore {
    /// Connects to the database at `url` (`postgres://…`), applies migrations, and starts
    /// listening for changes made by other processes.
    pub async fn open(url: &str) -> Result<PostgresStore, StoreError> {
        let pool = PgPoolOptions::new().max_connections(MAX_CONNECTIONS).connect(url).await?;
        sqlx::migrate!("migrations/postgres")
            .run(&pool)
            .await
            .map_err(|e| StoreError::Unavailable(format!("migration failed: {e}")))?;
        // Listen before returning, so no change made after `open` goes unannounced.
        let listener = notices::listen(url).await?;
        let (notices, _) = broadcast::channel(NOTICE_BACKLOG);
        let (relay, stop) = oneshot::channel();
        tokio::spawn(notices::relay_notices(url.to_string(), listener, notices.clone(), stop));
        let (admissions, outcomes) = (Admissions::start(pool.clone()), Outcomes::start(pool.clone()));
        let health_check = tokio::sync::Mutex::new(None);
        Ok(PostgresStore { pool, admissions, outcomes, notices, _relay: relay, url: url.to_string(), health_check })
    }
}

// ---- SQL -------------------------------------------------------------------------------------

/// Insert, or take over a key whose record is expired (`done` past retention) or free with the
/// same fingerprint. `ON CONFLICT` locks the existing row before it evaluates the `WHERE`, so of
/// any number of concurrent admits one inserts or updates and the others see its result.
static ADMIT: LazyLock<String> = LazyLock::new(|| {
    format!(
        "INSERT INTO records (id, tenant, key, route, method, path, query, fingerprint,
                              request_headers, request_body, state, queued, deadline_at,
                              created_at, updated_at, lease_owner, lease_expires_at,
                              in_flight_number, in_flight_started_at, policy_version)
         VALUES ($1::uuid, $2, $3, $4, $5, $6, $7, $8, $9::jsonb, $10,
                 CASE WHEN $15::text IS NULL THEN 'not_started' ELSE 'in_progress' END,
                 $15::text IS NULL, $11, $12, $12, $15::text, $16::bigint,
                 CASE WHEN $15::text IS NULL THEN NULL ELSE 1 END,
                 CASE WHEN $15::text IS NULL THEN NULL ELSE $12 END, $18::text)
         ON CONFLICT (tenant, key) DO UPDATE SET
            id = CASE WHEN records.state = 'done' THEN excluded.id ELSE records.id END,
            attempts = CASE WHEN records.state = 'done' THEN '[]'::jsonb ELSE records.attempts END,
            history = CASE WHEN records.state = 'done' THEN '[]'::jsonb
                           ELSE records.history || $13::jsonb END,
            created_at = CASE WHEN records.state = 'done' THEN excluded.created_at
                              ELSE records.created_at END,
            takeovers = CASE WHEN records.state = 'done' THEN 0 ELSE records.takeovers END,
            policy_version = CASE WHEN records.state = 'done' THEN NULL ELSE records.policy_version END,
            route = excluded.route, method = excluded.method, path = excluded.path,
            query = excluded.query, fingerprint = excluded.fingerprint,
            request_headers = excluded.request_headers, request_body = excluded.request_body,
            state = 'not_started', queued = TRUE, deadline_at = excluded.deadline_at,
            lease_owner = NULL, lease_expires_at = NULL, in_flight_number = NULL,
            in_flight_started_at = NULL, stop_reason = NULL, response_status = NULL,
            response_headers = NULL, response_body = NULL, done_at = NULL,
            cancel_requested = FALSE, probe_count = 0, next_probe_at = NULL, not_before = NULL,
            tombstone_until = NULL, updated_at = excluded.updated_at
         WHERE (records.state = 'done' AND records.done_at < $14
                AND NOT ($17::bigint IS NOT NULL AND records.done_at >= $17::bigint
                         AND records.fingerprint = excluded.fingerprint))
            OR (records.state = 'not_started' AND NOT records.queued
                AND records.fingerprint = excluded.fingerprint)
         RETURNING {COLUMNS}"
    )
});

async fn get(pool: &PgPool, id: Uuid) -> Result<Option<Record>, StoreError> {
    sqlx::query(&format!("SELECT {COLUMNS} FROM records WHERE id = $1::uuid"))
        .bind(id.to_string())
        .fetch_optional(pool)
        .await?
        .map(|row| decode(&row))
        .transpose()
}

/// The record that refused an admit, and whether it has since become admissible (then the
/// admit is tried again rather than answered with a record that no longer refuses it).
static EXISTING: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT {COLUMNS},
                COALESCE((state = 'done' AND done_at < $3
                          AND NOT ($5::bigint IS NOT NULL AND done_at >= $5::bigint AND fingerprint = $4))
                         OR (state = 'not_started' AND NOT queued AND fingerprint = $4),
                         FALSE) AS admissible
         FROM records WHERE tenant = $1 AND key = $2"
    )
});

async fn admit(pool: &PgPool, new: NewRecord, cutoff: Millis) -> Result<Admission, StoreError> {
    let requeued = serde_json::to_string(&[HistoryEntry {
        at: new.now,
        actor: "client".into(),
        action: "requeued".into(),
        note: Some("the same request was sent again for a free key".into()),
    }])?;
    let request_headers = serde_json::to_string(&new.request.headers)?;
    for _ in 0..ADMIT_TRIES {
        let row = sqlx::query(&ADMIT)
            .bind(new.id.to_string())
            .bind(&new.tenant)
            .bind(&new.key)
            .bind(&new.route)
            .bind(&new.method)
            .bind(&new.path)
            .bind(&new.query)
            .bind(&new.fingerprint.as_bytes()[..])
            .bind(&request_headers)
            .bind(&new.request.body[..])
            .bind(new.deadline_at)
            .bind(new.now)
            .bind(&requeued)
            .bind(cutoff)
            .bind(new.claim.as_ref().map(|c| c.owner.as_str()))
            .bind(new.claim.as_ref().map(|c| c.lease_until))
            .bind(new.tombstone_cutoff)
            .bind(new.claim.as_ref().map(|c| c.policy_version.as_str()))
            .fetch_optional(pool)
            .await?;
        if let Some(row) = row {
            // The row as this statement left it. Read back later, another worker of any node
            // might already have claimed a requeued record, which would pass for our own claim.
            let record = decode(&row)?;
            return Ok(if record.id == new.id { Admission::Created(record) } else { Admission::Requeued(record) });
        }
        // The key's record refused this request. Read it; it may have changed (or been swept)
        // since, in which case the insert decides again.
        let row = sqlx::query(&EXISTING)
            .bind(&new.tenant)
            .bind(&new.key)
            .bind(cutoff)
            .bind(&new.fingerprint.as_bytes()[..])
            .bind(new.tombstone_cutoff)
            .fetch_optional(pool)
            .await?;
        if let Some(row) = row {
            if !row.try_get::<bool, _>("admissible")? {
                return Ok(Admission::Existing(decode(&row)?));
            }
        }
    }
    Err(StoreError::Unavailable(format!("the record for key `{}` kept changing while it was admitted", new.key)))
}

// The statements about one leased or queued record. Each names the record by id and checks
// its state in a form no index can serve (see the module's documentation).

/// A record id that PostgreSQL returned as text.
fn record_id(text: &str) -> Result<Uuid, StoreError> {
    Uuid::parse_str(text).map_err(|e| StoreError::Corrupt(format!("record id `{text}`: {e}")))
}

/// A JSON array holding `item`: what `jsonb || …` appends as one element.
fn one_element<T: serde::Serialize>(item: &T) -> Result<String, StoreError> {
    Ok(serde_json::to_string(&[item])?)
}

#[async_trait]
impl Store for PostgresStore {
    async fn admit(&self, new: NewRecord, retention_cutoff: Millis) -> Result<Admission, StoreError> {
        self.admissions.admit(new, retention_cutoff).await
    }

    async fn lookup(&self, tenant: &str, key: &str) -> Result<Option<Record>, StoreError> {
        sqlx::query(&format!("SELECT {COLUMNS} FROM records WHERE tenant = $1 AND key = $2"))
            .bind(tenant)
            .bind(key)
            .fetch_optional(&self.pool)
            .await?
            .map(|row| decode(&row))
            .transpose()
    }

    async fn get(&self, id: Uuid) -> Result<Option<Record>, StoreError> {
        get(&self.pool, id).await
    }

    async fn claim(&self, id: Uuid, owner: &str, lease_until: Millis, now: Millis) -> Result<bool, StoreError> {
        claim(&self.pool, id, owner, lease_until, now).await
    }

    async fn attempt_started(
        &self,
        id: Uuid,
        owner: &str,
        number: u32,
        started_at: Millis,
        lease_until: Millis,
        policy_version: &str,
    ) -> Result<Lease, StoreError> {
        attempt_started(&self.pool, id, owner, (number, started_at, lease_until, policy_version)).await
    }

    async fn attempt_ended(
        &self,
        id: Uuid,
        owner: &str,
        attempt: Option<Attempt>,
        then: AfterAttempt,
        now: Millis,
    ) -> Result<Lease, StoreError> {
        self.outcomes.attempt_ended(id, owner, attempt, then, now).await
    }

    async fn renew(&self, id: Uuid, owner: &str, lease_until: Millis, now: Millis) -> Result<Lease, StoreError> {
        renew(&self.pool, id, owner, lease_until, now).await
    }

    async fn cancel(&self, id: Uuid, entry: HistoryEntry) -> Result<Cancelled, StoreError> {
        actions::cancel(&self.pool, id, entry).await
    }

    async fn list(&self, filter: &ListFilter) -> Result<Page, StoreError> {
        let limit = filter.limit.clamp(1, 1000);
        let rows = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM records
             WHERE ($1::text IS NULL OR state = $1) AND ($2::text IS NULL OR route = $2)
               AND ($3::text IS NULL OR tenant = $3)
               AND ($4::bigint IS NULL OR (created_at, id) > ($4, $5::uuid))
             ORDER BY created_at, id LIMIT $6"
        ))
        .bind(filter.state.map(State::as_str))
        .bind(filter.route.as_deref())
        .bind(filter.tenant.as_deref())
        .bind(filter.cursor.map(|c| c.created_at))
        .bind(filter.cursor.map(|c| c.id.to_string()))
        .bind(i64::from(limit) + 1)
        .fetch_all(&self.pool)
        .await?;
        page(rows.iter().map(decode).collect::<Result<Vec<_>, _>>()?, limit)
    }

    async fn resolve(&self, id: Uuid, resolution: Resolution, entry: HistoryEntry) -> Result<Action, StoreError> {
        actions::settle(&self.pool, id, resolution, false, entry).await
    }

    async fn retry(&self, id: Uuid, deadline_at: Millis, entry: HistoryEntry) -> Result<Action, StoreError> {
        actions::retry(&self.pool, id, deadline_at, entry).await
    }

    async fn expired_leases(&self, now: Millis, limit: u32) -> Result<Vec<Record>, StoreError> {
        let rows = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM records WHERE state = 'in_progress' AND lease_expires_at < $1
             ORDER BY lease_expires_at LIMIT $2"
        ))
        .bind(now)
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(decode).collect()
    }

    async fn take_over(
        &self,
        id: Uuid,
        owner: &str,
        until: Millis,
        to: TakeOverTo,
        lost: Option<Attempt>,
        entry: HistoryEntry,
    ) -> Result<bool, StoreError> {
        upkeep::take_over(&self.pool, id, owner, until, to, lost, entry).await
    }

    async fn claim_unclaimed(
        &self,
        owner: &str,
        lease_until: Millis,
        idle_since: Millis,
        now: Millis,
        limit: u32,
    ) -> Result<Vec<Record>, StoreError> {
        upkeep::claim_unclaimed(&self.pool, owner, lease_until, idle_since, now, limit).await
    }

    async fn probes_due(
        &self,
        route: &str,
        settle: Millis,
        now: Millis,
        limit: u32,
    ) -> Result<Vec<Record>, StoreError> {
        let rows = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM records WHERE state = 'unknown' AND route = $1
               AND COALESCE(next_probe_at, updated_at + $2) <= $3
             ORDER BY created_at LIMIT $4"
        ))
        .bind(route)
        .bind(settle)
        .bind(now)
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(decode).collect()
    }

    async fn probed(
        &self,
        id: Uuid,
        resolution: Option<Resolution>,
        next_probe_at: Millis,
        entry: HistoryEntry,
    ) -> Result<Action, StoreError> {
        actions::probed(&self.pool, id, resolution, next_probe_at, entry).await
    }

    async fn count_by_phase(&self) -> Result<Vec<(Phase, u64)>, StoreError> {
        upkeep::count_by_phase(&self.pool).await
    }

    async fn sweep_done(&self, plan: &SweepPlan, limit: u32) -> Result<u64, StoreError> {
        upkeep::sweep_done(&self.pool, plan, limit).await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        let mut held = self.health_check.lock().await;
        // Taken out while in use: a check that fails, or is abandoned halfway, leaves no
        // connection in an unknown state behind; the next one connects afresh.
        let mut conn = match held.take() {
            Some(conn) => conn,
            None => PgConnection::connect(&self.url).await?,
        };
        sqlx::query("SELECT 1").execute(&mut conn).await?;
        *held = Some(conn);
        Ok(())
    }

    async fn add_answer_counts(&self, counts: Vec<AnswerCount>, forget_before: Millis) -> Result<(), StoreError> {
        stats::add_answer_counts(&self.pool, counts, forget_before).await
    }

    async fn stats(&self, span: &StatsSpan) -> Result<StatsRows, StoreError> {
        stats::read(&self.pool, span).await
    }

    async fn sides(&self, route: &str, since: Millis) -> Result<Vec<Side>, StoreError> {
        stats::sides(&self.pool, route, since).await
    }

    async fn watch(&self, id: Uuid) -> Result<(), StoreError> {
        sqlx::query("UPDATE records SET watched = TRUE WHERE id = $1::uuid AND NOT watched")
            .bind(id.to_string())
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn set_switch(&self, switch: Switch) -> Result<Option<Switch>, StoreError> {
        switches::set(&self.pool, &switch).await
    }

    async fn clear_switch(&self, id: Uuid, clearing: Clearing) -> Result<SwitchCleared, StoreError> {
        switches::clear(&self.pool, id, &clearing).await
    }

    async fn active_switches(&self, now: Millis) -> Result<Vec<Switch>, StoreError> {
        switches::active(&self.pool, now).await
    }

    async fn switch_history(&self, limit: u32) -> Result<Vec<Switch>, StoreError> {
        switches::history(&self.pool, limit).await
    }

    fn notices(&self) -> Option<broadcast::Receiver<Notice>> {
        Some(self.notices.subscribe())
    }
}
