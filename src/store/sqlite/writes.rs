//! The SQLite store's writes, one function per kind, each run by the writer thread inside the
//! transaction of its batch. One writer makes each statement and the reads after it atomic.

use rusqlite::{params, Connection, OptionalExtension};
use uuid::Uuid;

use super::writer::TakeOver;
use crate::policy::StopReason;
use crate::record::{Attempt, HistoryEntry, Millis, Record, State};
use crate::store::{
    refusal, Action, Admission, AfterAttempt, Cancelled, Lease, NewRecord, Resolution, StoreError, Stored, SweepPlan,
};

/// The one row `sql` returns, decoded, if any.
fn record_of(conn: &Connection, sql: &str, params: impl rusqlite::Params) -> Result<Option<Record>, StoreError> {
    let mut statement = conn.prepare_cached(sql)?;
    let mut rows = statement.query(params)?;
    rows.next()?.map(super::rows::record).transpose()
}

fn get(conn: &Connection, id: Uuid) -> Result<Option<Record>, StoreError> {
    record_of(conn, "SELECT * FROM records WHERE id = ?1", [id.to_string()])
}

/// Insert, or take over a key whose record is expired (`done` past retention) or free with the
/// same fingerprint. One writer makes the statement and the read after it atomic.
const ADMIT: &str = "
INSERT INTO records (id, tenant, key, route, method, path, query, fingerprint, request_headers,
                     request_body, state, queued, deadline_at, created_at, updated_at,
                     lease_owner, lease_expires_at, in_flight_number, in_flight_started_at, policy_version)
VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10,
        CASE WHEN ?13 IS NULL THEN 'not_started' ELSE 'in_progress' END, ?13 IS NULL, ?11, ?12, ?12,
        ?13, ?14, CASE WHEN ?13 IS NULL THEN NULL ELSE 1 END, CASE WHEN ?13 IS NULL THEN NULL ELSE ?12 END, ?17)
ON CONFLICT (tenant, key) DO UPDATE SET
    id = CASE WHEN records.state = 'done' THEN excluded.id ELSE records.id END,
    attempts = CASE WHEN records.state = 'done' THEN '[]' ELSE records.attempts END,
    history = CASE WHEN records.state = 'done' THEN '[]'
                   ELSE json_insert(records.history, '$[#]', json_object('at', excluded.updated_at,
                        'actor', 'client', 'action', 'requeued',
                        'note', 'the same request was sent again for a free key')) END,
    created_at = CASE WHEN records.state = 'done' THEN excluded.created_at ELSE records.created_at END,
    takeovers = CASE WHEN records.state = 'done' THEN 0 ELSE records.takeovers END,
    policy_version = CASE WHEN records.state = 'done' THEN NULL ELSE records.policy_version END,
    route = excluded.route, method = excluded.method, path = excluded.path, query = excluded.query,
    fingerprint = excluded.fingerprint, request_headers = excluded.request_headers,
    request_body = excluded.request_body, state = 'not_started', queued = 1,
    deadline_at = excluded.deadline_at, lease_owner = NULL, lease_expires_at = NULL,
    in_flight_number = NULL, in_flight_started_at = NULL, stop_reason = NULL,
    response_status = NULL, response_headers = NULL, response_body = NULL, done_at = NULL,
    cancel_requested = 0, probe_count = 0, next_probe_at = NULL, not_before = NULL,
    tombstone_until = NULL, updated_at = excluded.updated_at
WHERE (records.state = 'done' AND records.done_at < ?15
       AND NOT (?16 IS NOT NULL AND records.done_at >= ?16 AND records.fingerprint = excluded.fingerprint))
   OR (records.state = 'not_started' AND records.queued = 0 AND records.fingerprint = excluded.fingerprint)
RETURNING id, state";

/// `Created` (its own id came back), `Requeued` (a free record for the key was queued again),
/// or `Existing` (nothing came back: the key's record decides). A fresh insert is not read back:
/// it holds what `new` says. (An expired record taken over gets the new id too, but is queued
/// rather than claimed: that one is read back.)
pub(super) fn admit(conn: &Connection, new: NewRecord, cutoff: Millis) -> Result<Admission, StoreError> {
    let headers = serde_json::to_string(&new.request.headers)?;
    let written: Option<(String, String)> = conn
        .prepare_cached(ADMIT)?
        .query_row(
            params![
                new.id.to_string(),
                new.tenant,
                new.key,
                new.route,
                new.method,
                new.path,
                new.query,
                &new.fingerprint.as_bytes()[..],
                headers,
                &new.request.body[..],
                new.deadline_at,
                new.now,
                new.claim.as_ref().map(|c| c.owner.as_str()),
                new.claim.as_ref().map(|c| c.lease_until),
                cutoff,
                new.tombstone_cutoff,
                new.claim.as_ref().map(|c| c.policy_version.as_str()),
            ],
            |row| Ok((row.get(0)?, row.get(1)?)),
        )
        .optional()?;
    let inserted = if new.claim.is_some() { State::InProgress } else { State::NotStarted };
    if written.as_ref().is_some_and(|(id, state)| *id == new.id.to_string() && state == inserted.as_str()) {
        return Ok(Admission::Created(new.inserted()));
    }
    let record = record_of(conn, "SELECT * FROM records WHERE tenant = ?1 AND key = ?2", params![new.tenant, new.key])?
        .ok_or_else(|| StoreError::Corrupt("the key's record vanished".into()))?;
    Ok(match written {
        None => Admission::Existing(record),
        Some(_) if record.id == new.id => Admission::Created(record),
        Some(_) => Admission::Requeued(record),
    })
}

pub(super) fn claim(conn: &Connection, id: Uuid, owner: &str, until: Millis, now: Millis) -> Result<bool, StoreError> {
    let changed = conn
        .prepare_cached(
            "UPDATE records SET state = 'in_progress', queued = 0, lease_owner = ?2, lease_expires_at = ?3,
                updated_at = ?4
         WHERE id = ?1 AND state = 'not_started' AND queued = 1",
        )?
        .execute(params![id.to_string(), owner, until, now])?;
    Ok(changed == 1)
}

/// The lease as a `... RETURNING cancel_requested` statement found it: no row means it is lost.
fn lease(conn: &Connection, sql: &str, params: impl rusqlite::Params) -> Result<Lease, StoreError> {
    let cancel_requested: Option<bool> = conn.prepare_cached(sql)?.query_row(params, |row| row.get(0)).optional()?;
    Ok(match cancel_requested {
        Some(cancel_requested) => Lease::Held { cancel_requested },
        None => Lease::Lost,
    })
}

pub(super) fn attempt_started(
    conn: &Connection,
    id: Uuid,
    owner: &str,
    number: u32,
    at: Millis,
    until: Millis,
    policy_version: &str,
) -> Result<Lease, StoreError> {
    lease(
        conn,
        "UPDATE records SET in_flight_number = ?3, in_flight_started_at = ?4, lease_expires_at = ?5,
                policy_version = ?6, updated_at = ?4
         WHERE id = ?1 AND state = 'in_progress' AND lease_owner = ?2
         RETURNING cancel_requested",
        params![id.to_string(), owner, number, at, until, policy_version],
    )
}

pub(super) fn attempt_ended(
    conn: &Connection,
    id: Uuid,
    owner: &str,
    attempt: Option<Attempt>,
    then: AfterAttempt,
    now: Millis,
) -> Result<Lease, StoreError> {
    let attempt = attempt.map(|a| serde_json::to_string(&a)).transpose()?;
    let Stored { state, stop, response, queued, not_before } = then.stored();
    lease(
        conn,
        "UPDATE records SET
            attempts = CASE WHEN ?3 IS NULL THEN attempts ELSE json_insert(attempts, '$[#]', json(?3)) END,
            in_flight_number = NULL, in_flight_started_at = NULL,
            state = ?4, queued = ?10, not_before = CASE WHEN ?10 = 1 THEN not_before ELSE ?11 END,
            lease_owner = CASE WHEN ?4 = 'in_progress' THEN lease_owner END,
            lease_expires_at = CASE WHEN ?4 = 'in_progress' THEN lease_expires_at END,
            stop_reason = ?5, response_status = ?6, response_headers = ?7, response_body = ?8,
            done_at = CASE WHEN ?4 = 'done' THEN ?9 END,
            updated_at = ?9
         WHERE id = ?1 AND state = 'in_progress' AND lease_owner = ?2
         RETURNING cancel_requested",
        params![
            id.to_string(),
            owner,
            attempt,
            state.as_str(),
            stop.map(StopReason::as_str),
            response.map(|r| r.status),
            response.map(|r| serde_json::to_string(&r.headers)).transpose()?,
            response.map(|r| &r.body[..]),
            now,
            queued,
            not_before,
        ],
    )
}

pub(super) fn renew(conn: &Connection, id: Uuid, owner: &str, until: Millis, now: Millis) -> Result<Lease, StoreError> {
    lease(
        conn,
        "UPDATE records SET lease_expires_at = ?3, updated_at = ?4
         WHERE id = ?1 AND state = 'in_progress' AND lease_owner = ?2
         RETURNING cancel_requested",
        params![id.to_string(), owner, until, now],
    )
}

pub(super) fn cancel(conn: &Connection, id: Uuid, entry: HistoryEntry) -> Result<Cancelled, StoreError> {
    let Some(record) = get(conn, id)? else {
        return Ok(Cancelled::Missing);
    };
    let sql = match (record.state, record.queued) {
        (State::NotStarted, true) => {
            "UPDATE records SET queued = 0, stop_reason = 'cancelled', updated_at = ?3,
                    history = json_insert(history, '$[#]', json(?2))
             WHERE id = ?1"
        }
        (State::InProgress, _) => {
            "UPDATE records SET cancel_requested = 1, updated_at = ?3,
                    history = json_insert(history, '$[#]', json(?2))
             WHERE id = ?1"
        }
        _ => return Ok(Cancelled::Refused(record)),
    };
    conn.prepare_cached(sql)?.execute(params![id.to_string(), serde_json::to_string(&entry)?, entry.at])?;
    let updated = get(conn, id)?.ok_or_else(|| StoreError::Corrupt("record vanished".into()))?;
    Ok(if record.state == State::InProgress { Cancelled::Flagged(updated) } else { Cancelled::Dequeued(updated) })
}

fn applied(conn: &Connection, id: Uuid) -> Result<Action, StoreError> {
    get(conn, id)?.map(Action::Applied).ok_or_else(|| StoreError::Corrupt("record vanished".into()))
}

/// Settles an `unknown` record as an operator or a probe decided. `probe` counts it as a probe.
pub(super) fn settle(
    conn: &Connection,
    id: Uuid,
    resolution: Resolution,
    probe: bool,
    entry: HistoryEntry,
) -> Result<Action, StoreError> {
    if let Some(answer) = refusal(get(conn, id)?) {
        return Ok(answer);
    }
    let (state, response) = resolution.stored();
    conn.prepare_cached(
        "UPDATE records SET state = ?2, queued = 0, response_status = ?3, response_headers = ?4,
                response_body = ?5, done_at = CASE WHEN ?2 = 'done' THEN ?6 END, updated_at = ?6,
                next_probe_at = NULL, probe_count = probe_count + ?7,
                history = json_insert(history, '$[#]', json(?8))
         WHERE id = ?1 AND state = 'unknown'",
    )?
    .execute(params![
        id.to_string(),
        state.as_str(),
        response.map(|r| r.status),
        response.map(|r| serde_json::to_string(&r.headers)).transpose()?,
        response.map(|r| &r.body[..]),
        entry.at,
        probe,
        serde_json::to_string(&entry)?,
    ])?;
    applied(conn, id)
}

pub(super) fn retry(
    conn: &Connection,
    id: Uuid,
    deadline_at: Millis,
    entry: HistoryEntry,
) -> Result<Action, StoreError> {
    if let Some(answer) = refusal(get(conn, id)?) {
        return Ok(answer);
    }
    conn.prepare_cached(
        "UPDATE records SET state = 'not_started', queued = 1, deadline_at = ?2, stop_reason = NULL,
                cancel_requested = 0, next_probe_at = NULL, updated_at = ?3, takeovers = 0,
                history = json_insert(history, '$[#]', json(?4))
         WHERE id = ?1 AND state = 'unknown'",
    )?
    .execute(params![id.to_string(), deadline_at, entry.at, serde_json::to_string(&entry)?])?;
    applied(conn, id)
}

pub(super) fn take_over(conn: &Connection, t: TakeOver) -> Result<bool, StoreError> {
    let (state, queued, stop) = t.to.stored();
    let lost = t.lost.map(|a| serde_json::to_string(&a)).transpose()?;
    let changed = conn
        .prepare_cached(
            "UPDATE records SET state = ?4, queued = ?5, stop_reason = ?6, lease_owner = NULL,
                lease_expires_at = NULL, in_flight_number = NULL, in_flight_started_at = NULL,
                attempts = CASE WHEN ?7 IS NULL THEN attempts ELSE json_insert(attempts, '$[#]', json(?7)) END,
                history = json_insert(history, '$[#]', json(?8)), updated_at = ?9,
                takeovers = takeovers + 1
         WHERE id = ?1 AND state = 'in_progress' AND lease_owner = ?2 AND lease_expires_at = ?3",
        )?
        .execute(params![
            t.id.to_string(),
            t.owner,
            t.until,
            state.as_str(),
            queued,
            stop.map(StopReason::as_str),
            lost,
            serde_json::to_string(&t.entry)?,
            t.entry.at,
        ])?;
    Ok(changed == 1)
}

pub(super) fn probed(
    conn: &Connection,
    id: Uuid,
    resolution: Option<Resolution>,
    next_at: Millis,
    entry: HistoryEntry,
) -> Result<Action, StoreError> {
    if let Some(resolution) = resolution {
        return settle(conn, id, resolution, true, entry);
    }
    if let Some(answer) = refusal(get(conn, id)?) {
        return Ok(answer);
    }
    conn.prepare_cached(
        "UPDATE records SET probe_count = probe_count + 1, next_probe_at = ?2, updated_at = ?3,
                history = json_insert(history, '$[#]', json(?4))
         WHERE id = ?1 AND state = 'unknown'",
    )?
    .execute(params![id.to_string(), next_at, entry.at, serde_json::to_string(&entry)?])?;
    applied(conn, id)
}

pub(super) fn claim_unclaimed(
    conn: &Connection,
    owner: &str,
    until: Millis,
    idle_since: Millis,
    now: Millis,
    limit: u32,
) -> Result<Vec<Record>, StoreError> {
    let mut statement = conn.prepare_cached(
        "UPDATE records SET state = 'in_progress', queued = 0, lease_owner = ?1, lease_expires_at = ?2,
                updated_at = ?4
         WHERE id IN (SELECT id FROM records WHERE state = 'not_started' AND queued = 1 AND updated_at < ?3
                      ORDER BY created_at LIMIT ?5)
         RETURNING *",
    )?;
    let mut rows = statement.query(params![owner, until, idle_since, now, limit])?;
    let mut records = Vec::new();
    while let Some(row) = rows.next()? {
        records.push(super::rows::record(row)?);
    }
    Ok(records)
}

pub(super) fn sweep_done(conn: &Connection, plan: &SweepPlan, limit: u32) -> Result<u64, StoreError> {
    let mut changed = 0;
    for route in &plan.routes {
        changed += match route.tombstone_after {
            Some(after) => conn
                .prepare_cached(
                    "UPDATE records SET tombstone_until = done_at + ?3, path = '', query = '',
                        request_headers = '[]', request_body = X'', attempts = '[]', history = '[]',
                        response_headers = NULL, response_body = NULL
                     WHERE id IN (SELECT id FROM records WHERE state = 'done' AND tombstone_until IS NULL
                                  AND done_at < ?1 AND route = ?2 LIMIT ?4)",
                )?
                .execute(params![route.cutoff, route.route, after, limit])?,
            None => conn
                .prepare_cached(
                    "DELETE FROM records WHERE id IN (SELECT id FROM records WHERE state = 'done'
                        AND tombstone_until IS NULL AND done_at < ?1 AND route = ?2 LIMIT ?3)",
                )?
                .execute(params![route.cutoff, route.route, limit])?,
        };
    }
    let configured = serde_json::to_string(&plan.routes.iter().map(|r| &r.route).collect::<Vec<_>>())?;
    changed += conn
        .prepare_cached(
            "DELETE FROM records WHERE id IN (SELECT id FROM records WHERE state = 'done'
                AND tombstone_until IS NULL AND done_at < ?1
                AND route NOT IN (SELECT value FROM json_each(?2)) LIMIT ?3)",
        )?
        .execute(params![plan.others_cutoff, configured, limit])?;
    changed += conn
        .prepare_cached("DELETE FROM records WHERE id IN (SELECT id FROM records WHERE tombstone_until < ?1 LIMIT ?2)")?
        .execute(params![plan.now, limit])?;
    Ok(changed as u64)
}

/// Rewrites the one row of `liveness`: a commit that touches no record.
pub(super) fn probe(conn: &Connection, now: Millis) -> Result<(), StoreError> {
    conn.prepare_cached(
        "INSERT INTO liveness (id, written_at) VALUES (1, ?1)
         ON CONFLICT (id) DO UPDATE SET written_at = excluded.written_at",
    )?
    .execute([now])?;
    Ok(())
}
