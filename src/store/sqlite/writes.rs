//! The SQLite store's writes, one function per kind, each run on the one writing connection
//! (by the writer thread, or by a caller committing in place) inside the transaction of its
//! batch. One writing connection makes each statement and the reads after it atomic.

use rusqlite::{params, Connection, OptionalExtension};

use crate::domain::StopReason;
use crate::domain::{ClaimToken, Phase, RecordId, Timestamp};
use crate::record::{transition, Event, Record};
use crate::store::{
    span_ms, Admission, Admit, AttemptEnded, AttemptStarted, Cancel, Cancelled, ClaimQueued, ClaimUnclaimed,
    LeaseStatus, Overwrite, Renew, StoreError, Stored, Sweep, TakeOver,
};

/// The one row `sql` returns, decoded, if any.
fn record_of(conn: &Connection, sql: &str, params: impl rusqlite::Params) -> Result<Option<Record>, StoreError> {
    let mut statement = conn.prepare_cached(sql)?;
    let mut rows = statement.query(params)?;
    rows.next()?.map(super::rows::record).transpose()
}

pub(super) fn get(conn: &Connection, id: RecordId) -> Result<Option<Record>, StoreError> {
    record_of(conn, "SELECT * FROM records WHERE id = ?1", [id])
}

/// A new key's record, as [`admit`] binds its parameters; what follows it decides a conflict.
macro_rules! insert_record {
    () => {
        "INSERT INTO records (id, tenant, key, route, method, path, query, fingerprint, request_headers,
                     request_body, state, queued, deadline_at, created_at, updated_at,
                     lease_owner, lease_expires_at, in_flight_number, in_flight_started_at, policy_version,
                     claim_token, in_flight_until)
VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?18, ?19, ?11, ?12, ?12, ?13, ?14, ?20, ?21, ?17, ?22, ?23)"
    };
}

/// A key seen for the first time: inserted, and nothing read back. Most admissions are this one,
/// and it has no `RETURNING`, which SQLite serves through a temporary table of its own that it
/// builds and drops per statement (about a tenth of the writer's CPU time under load).
const INSERT_NEW: &str = concat!(insert_record!(), " ON CONFLICT DO NOTHING");

/// Insert, or take over a key whose record is expired (`done` past retention) or free with the
/// same fingerprint, as [`Overwrite`] says (`?24`–`?28`). One writer makes the statement
/// and the read after it atomic.
const ADMIT: &str = concat!(
    insert_record!(),
    "
ON CONFLICT (tenant, key) DO UPDATE SET
    id = CASE WHEN records.state = 'done' THEN excluded.id ELSE records.id END,
    attempts = CASE WHEN records.state = 'done' THEN '[]' ELSE records.attempts END,
    history = CASE WHEN records.state = 'done' THEN '[]'
                   ELSE json_insert(records.history, '$[#]', json(?28)) END,
    created_at = CASE WHEN records.state = 'done' THEN excluded.created_at ELSE records.created_at END,
    takeovers = CASE WHEN records.state = 'done' THEN 0 ELSE records.takeovers END,
    policy_version = CASE WHEN records.state = 'done' THEN excluded.policy_version
                          ELSE COALESCE(records.policy_version, excluded.policy_version) END,
    in_flight_until = CASE WHEN records.state = 'done' THEN NULL ELSE records.in_flight_until END,
    stream = NULL,
    route = excluded.route, method = excluded.method, path = excluded.path, query = excluded.query,
    fingerprint = excluded.fingerprint, request_headers = excluded.request_headers,
    request_body = excluded.request_body,
    state = CASE WHEN records.state = 'done' THEN ?24 ELSE ?26 END,
    queued = CASE WHEN records.state = 'done' THEN ?25 ELSE ?27 END,
    deadline_at = excluded.deadline_at, lease_owner = NULL, lease_expires_at = NULL,
    in_flight_number = NULL, in_flight_started_at = NULL, stop_reason = NULL,
    response_status = NULL, response_headers = NULL, response_body = NULL, done_at = NULL,
    cancel_requested = 0, probe_count = 0, next_probe_at = NULL, not_before = NULL,
    tombstone_until = NULL, updated_at = excluded.updated_at
WHERE (records.state = 'done' AND records.done_at < ?15
       AND NOT (?16 IS NOT NULL AND records.done_at >= ?16 AND records.fingerprint = excluded.fingerprint))
   OR (records.state = 'not_started' AND records.queued = 0 AND records.fingerprint = excluded.fingerprint)
RETURNING id, state"
);

/// `Created` (a fresh insert, or an expired record taken over with the new id), `Requeued` (a
/// free record for the key was queued again), or `Existing` (nothing changed: the key's record
/// decides). A fresh insert is not read back: it holds what `new` says. Every other case reads
/// the key's record after the write.
pub(super) fn admit(conn: &Connection, admit: Admit) -> Result<Admission, StoreError> {
    let Admit { new, retention_cutoff: cutoff } = admit;
    let headers = serde_json::to_string(&new.request.headers)?;
    let fresh = new.fresh();
    let id = new.id;
    let params = params![
        id,
        new.tenant,
        new.key,
        new.route,
        new.method.as_str(),
        new.path,
        new.query,
        &new.fingerprint.as_bytes()[..],
        headers,
        &new.request.body[..],
        new.deadline_at,
        new.now,
        new.claim.as_ref().map(|c| &c.owner),
        new.claim.as_ref().map(|c| c.marked_at + c.lease),
        cutoff,
        new.tombstone_cutoff,
        new.policy_version.as_ref(),
        fresh.state,
        fresh.queued,
        fresh.in_flight.map(|(number, _)| number),
        fresh.in_flight.map(|(_, at)| at),
        fresh.claim.0,
        new.claim.as_ref().map(|c| c.marked_at + c.reach),
    ];
    if conn.prepare_cached(INSERT_NEW)?.execute(params)? == 1 {
        return Ok(Admission::Created(new.inserted()));
    }
    let Overwrite { replaced, requeued, entry } = Overwrite::at(new.now)?;
    let entry = serde_json::to_string(&entry)?;
    let overwrite =
        params![replaced.state(), replaced == Phase::Queued, requeued.state(), requeued == Phase::Queued, entry];
    let all: Vec<&dyn rusqlite::ToSql> = params.iter().chain(overwrite.iter()).copied().collect();
    let written: Option<(String, String)> =
        conn.prepare_cached(ADMIT)?.query_row(&all[..], |row| Ok((row.get(0)?, row.get(1)?))).optional()?;
    let record = record_of(conn, "SELECT * FROM records WHERE tenant = ?1 AND key = ?2", params![new.tenant, new.key])?
        .ok_or_else(|| StoreError::Corrupt("the key's record vanished".into()))?;
    Ok(match written {
        None => Admission::Existing(record),
        Some(_) if record.id == new.id => Admission::Created(record),
        Some(_) => Admission::Requeued(record),
    })
}

pub(super) fn claim(conn: &Connection, claim: ClaimQueued) -> Result<Option<ClaimToken>, StoreError> {
    let ClaimQueued { id, owner, lease, now } = claim;
    let lease_until = now + lease;
    let to = transition(Phase::Queued, Event::Claim)?;
    let token = conn
        .prepare_cached(
            "UPDATE records SET state = ?5, queued = 0, lease_owner = ?2, lease_expires_at = ?3, updated_at = ?4,
                    claim_token = claim_token + 1
             WHERE id = ?1 AND state = 'not_started' AND queued = 1
             RETURNING claim_token",
        )?
        .query_row(params![id, owner, lease_until, now, to.state()], |row| row.get(0))
        .optional()?;
    Ok(token.map(ClaimToken))
}

/// The lease as an update guarded by it (`?1` the record's id, `?2` its claim's token, `?3` …
/// the write's own values) found it: lost if no row changed, else held, with the record's cancel
/// flag read back. The flag is read by a statement of its own rather than by `RETURNING`, which
/// SQLite serves through a temporary table it builds and drops per statement.
fn lease_update(
    conn: &Connection,
    update: &str,
    params: impl rusqlite::Params,
    id: RecordId,
) -> Result<LeaseStatus, StoreError> {
    if conn.prepare_cached(update)?.execute(params)? == 0 {
        return Ok(LeaseStatus::Lost);
    }
    let cancel_requested =
        conn.prepare_cached("SELECT cancel_requested FROM records WHERE id = ?1")?.query_row([id], |row| row.get(0))?;
    Ok(LeaseStatus::Held { cancel_requested })
}

pub(super) fn attempt_started(conn: &Connection, started: AttemptStarted) -> Result<LeaseStatus, StoreError> {
    let AttemptStarted { id, holder, number, started_at, lease, reach, policy_version } = started;
    lease_update(
        conn,
        "UPDATE records SET in_flight_number = ?3, in_flight_started_at = ?4, lease_expires_at = ?5,
                in_flight_until = MAX(COALESCE(in_flight_until, 0), ?7),
                policy_version = ?6, stream = NULL, updated_at = ?4
         WHERE id = ?1 AND state = 'in_progress' AND claim_token = ?2",
        params![id, holder.token, number, started_at, started_at + lease, policy_version, started_at + reach],
        id,
    )
}

/// Stores an outcome under its claim; refused under another, unless it is the late outcome of
/// the attempt its claim's take-over left `lost` (see [`AttemptEnded::late`]).
pub(super) fn attempt_ended(conn: &Connection, ended: AttemptEnded) -> Result<LeaseStatus, StoreError> {
    let lease = outcome(conn, &ended)?;
    if lease == LeaseStatus::Lost {
        late_outcome(conn, &ended)?;
    }
    Ok(lease)
}

/// Stores an outcome under its claim. An outcome that proves its request finished upstream
/// ([`AttemptEnded::ends_its_attempt`]: an answer of the upstream's own, or a request never sent)
/// ends that attempt's life, so the record's bound need not run on past now — unless the record
/// was ever taken over, when an attempt of an earlier claim may still be on its way: the bound
/// covers that one too, and stays. An ambiguous outcome (a gateway's 504, a timeout, a cut
/// connection) keeps the whole bound: the request may still take effect within it. (Any time not
/// later than the bound will do for an attempt that has ended, so the node's clock serves.)
fn outcome(conn: &Connection, ended: &AttemptEnded) -> Result<LeaseStatus, StoreError> {
    let ends = ended.ends_its_attempt();
    let AttemptEnded { id, holder, attempt, then, stream, now } = ended;
    let attempt = attempt.as_ref().map(serde_json::to_string).transpose()?;
    let stream = stream.as_ref().map(serde_json::to_string).transpose()?;
    let Stored { state, stop, response, queued, not_before } = then.stored()?;
    lease_update(
        conn,
        "UPDATE records SET
            attempts = CASE WHEN ?3 IS NULL THEN attempts ELSE json_insert(attempts, '$[#]', json(?3)) END,
            in_flight_number = NULL, in_flight_started_at = NULL,
            in_flight_until = CASE WHEN ?13 AND takeovers = 0 AND in_flight_until > ?9 THEN ?9
                                   ELSE in_flight_until END,
            state = ?4, queued = ?10, not_before = CASE WHEN ?10 = 1 THEN not_before ELSE ?11 END,
            lease_owner = CASE WHEN ?4 = 'in_progress' THEN lease_owner END,
            lease_expires_at = CASE WHEN ?4 = 'in_progress' THEN lease_expires_at END,
            stop_reason = ?5, response_status = ?6, response_headers = ?7, response_body = ?8,
            done_at = CASE WHEN ?4 = 'done' THEN ?9 END,
            stream = COALESCE(?12, stream),
            updated_at = ?9
         WHERE id = ?1 AND state = 'in_progress' AND claim_token = ?2",
        params![
            id,
            holder.token,
            attempt,
            state,
            stop.map(StopReason::as_str),
            response.map(|r| r.status),
            response.map(|r| serde_json::to_string(&r.headers)).transpose()?,
            response.map(|r| &r.body[..]),
            now,
            queued,
            not_before,
            stream,
            ends,
        ],
        *id,
    )
}

/// Settles an `unknown` record with the late outcome `ended` is, if the record is still as its
/// claim's take-over left it: unknown, under the same claim, its last attempt the one lost.
fn late_outcome(conn: &Connection, ended: &AttemptEnded) -> Result<bool, StoreError> {
    let Some(late) = ended.late() else { return Ok(false) };
    let response = late.response;
    let changed = conn
        .prepare_cached(
            "UPDATE records SET attempts = json_replace(attempts, '$[#-1]', json(?4)), state = ?5, queued = 0,
                response_status = ?6, response_headers = ?7, response_body = ?8,
                done_at = CASE WHEN ?5 = 'done' THEN ?9 END,
                next_probe_at = CASE WHEN ?5 = 'unknown' THEN next_probe_at END,
                stream = COALESCE(?10, stream), history = json_insert(history, '$[#]', json(?11)), updated_at = ?9
             WHERE id = ?1 AND state = 'unknown' AND claim_token = ?2
               AND json_extract(attempts, '$[#-1].number') = ?3
               AND json_extract(attempts, '$[#-1].outcome') = 'lost'",
        )?
        .execute(params![
            ended.id,
            ended.holder.token,
            late.attempt.number,
            serde_json::to_string(late.attempt)?,
            late.state,
            response.map(|r| r.status),
            response.map(|r| serde_json::to_string(&r.headers)).transpose()?,
            response.map(|r| &r.body[..]),
            ended.now,
            ended.stream.as_ref().map(serde_json::to_string).transpose()?,
            serde_json::to_string(&late.entry)?,
        ])?;
    Ok(changed == 1)
}

pub(super) fn renew(conn: &Connection, renew: Renew) -> Result<LeaseStatus, StoreError> {
    let Renew { id, holder, lease, now } = renew;
    lease_update(
        conn,
        "UPDATE records SET lease_expires_at = ?3, updated_at = ?4
         WHERE id = ?1 AND state = 'in_progress' AND claim_token = ?2",
        params![id, holder.token, now + lease, now],
        id,
    )
}

/// A cancel as [`transition`] decides it, from the record's phase as read: dequeued (freed),
/// flagged for its worker, or refused. The update is guarded by that phase.
pub(super) fn cancel(conn: &Connection, cancel: Cancel) -> Result<Cancelled, StoreError> {
    let Cancel { id, entry } = cancel;
    let Some(record) = get(conn, id)? else {
        return Ok(Cancelled::Missing);
    };
    let sql = match transition(record.phase(), Event::Cancel) {
        Ok(Phase::Free) => {
            "UPDATE records SET queued = 0, stop_reason = 'cancelled', updated_at = ?3,
                    history = json_insert(history, '$[#]', json(?2))
             WHERE id = ?1 AND state = 'not_started' AND queued = 1"
        }
        Ok(Phase::InProgress) => {
            "UPDATE records SET cancel_requested = 1, updated_at = ?3,
                    history = json_insert(history, '$[#]', json(?2))
             WHERE id = ?1 AND state = 'in_progress'"
        }
        _ => return Ok(Cancelled::Refused(record)),
    };
    let changed = conn.prepare_cached(sql)?.execute(params![id, serde_json::to_string(&entry)?, entry.at])?;
    let updated = get(conn, id)?.ok_or_else(|| StoreError::Corrupt("record vanished".into()))?;
    Ok(match (changed, record.phase()) {
        (0, _) => Cancelled::Refused(updated),
        (_, Phase::InProgress) => Cancelled::Flagged(updated),
        _ => Cancelled::Dequeued(updated),
    })
}

pub(super) fn take_over(conn: &Connection, take_over: TakeOver) -> Result<bool, StoreError> {
    let TakeOver { id, expired, claim, in_flight, to, lost, entry } = take_over;
    let phase = to.phase();
    let lost = lost.map(|a| serde_json::to_string(&a)).transpose()?;
    let changed = conn
        .prepare_cached(
            "UPDATE records SET state = ?4, queued = ?5, stop_reason = ?6, lease_owner = NULL,
                lease_expires_at = NULL, in_flight_number = NULL, in_flight_started_at = NULL,
                attempts = CASE WHEN ?7 IS NULL THEN attempts ELSE json_insert(attempts, '$[#]', json(?7)) END,
                history = json_insert(history, '$[#]', json(?8)), updated_at = ?9,
                takeovers = takeovers + 1
         WHERE id = ?1 AND state = 'in_progress' AND claim_token = ?2 AND lease_expires_at = ?3
           AND in_flight_number IS ?10",
        )?
        .execute(params![
            id,
            claim.0,
            expired.expires_at,
            phase.state(),
            phase == Phase::Queued,
            to.stop_reason().map(StopReason::as_str),
            lost,
            serde_json::to_string(&entry)?,
            entry.at,
            in_flight,
        ])?;
    Ok(changed == 1)
}

pub(super) fn claim_unclaimed(conn: &Connection, claim: ClaimUnclaimed) -> Result<Vec<Record>, StoreError> {
    let ClaimUnclaimed { owner, lease, idle_since, now, limit } = claim;
    let lease_until = now + lease;
    let to = transition(Phase::Queued, Event::Claim)?;
    let mut statement = conn.prepare_cached(
        "UPDATE records SET state = ?6, queued = 0, lease_owner = ?1, lease_expires_at = ?2,
                updated_at = ?4, claim_token = claim_token + 1
         WHERE id IN (SELECT id FROM records WHERE state = 'not_started' AND queued = 1 AND updated_at < ?3
                      ORDER BY created_at LIMIT ?5)
         RETURNING *",
    )?;
    let mut rows = statement.query(params![owner, lease_until, idle_since, now, limit, to.state()])?;
    let mut records = Vec::new();
    while let Some(row) = rows.next()? {
        records.push(super::rows::record(row)?);
    }
    Ok(records)
}

pub(super) fn sweep_done(conn: &Connection, sweep: Sweep) -> Result<u64, StoreError> {
    let Sweep { plan, limit } = sweep;
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
                .execute(params![route.cutoff, &route.route, span_ms(after), limit])?,
            None => conn
                .prepare_cached(
                    "DELETE FROM records WHERE id IN (SELECT id FROM records WHERE state = 'done'
                        AND tombstone_until IS NULL AND done_at < ?1 AND route = ?2 LIMIT ?3)",
                )?
                .execute(params![route.cutoff, &route.route, limit])?,
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
pub(super) fn probe(conn: &Connection, now: Timestamp) -> Result<(), StoreError> {
    conn.prepare_cached(
        "INSERT INTO liveness (id, written_at) VALUES (1, ?1)
         ON CONFLICT (id) DO UPDATE SET written_at = excluded.written_at",
    )?
    .execute([now])?;
    Ok(())
}
