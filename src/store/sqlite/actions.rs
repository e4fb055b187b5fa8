//! The SQLite writer's operator actions and probes: settle or re-drive an `unknown` record. Each
//! reads the record, lets [`decide`] apply the transition table to it, and persists the decision
//! guarded by the phase it was decided from.

use rusqlite::{params, Connection};

use super::writes::get;
use crate::domain::{ClaimToken, Phase, RecordId, Timestamp};
use crate::record::rules::bound_left;
use crate::record::{Event, HistoryEntry};
use crate::store::{decide, Action, Probed, Resolution, Resolve, Retry, StoreError};

/// The record as `changed` rows (0 or 1) of a guarded update left it: applied, or refused when
/// the guard no longer matched.
fn answer(conn: &Connection, id: RecordId, changed: usize) -> Result<Action, StoreError> {
    let record = get(conn, id)?.ok_or_else(|| StoreError::Corrupt("record vanished".into()))?;
    Ok(if changed == 1 { Action::Applied(record) } else { Action::Refused(record) })
}

pub(super) fn resolve(conn: &Connection, resolve: Resolve) -> Result<Action, StoreError> {
    settle(conn, resolve.id, resolve.resolution, None, resolve.entry)
}

/// What a probe asked, of which claim, and when (in the store's clock, as its bound is).
struct Asked {
    claim: ClaimToken,
    at: Timestamp,
}

/// Settles an `unknown` record as an operator or a probe decided. A probe names the claim it
/// read the record under and when it asked (`probe`), and is counted; an operator's word holds
/// whatever the claim. Either frees the record only past its attempts' bound: as of the probe's
/// asking, or of the operator's word.
/// A streamed answer's facts go: the record's answer, if any, is now the resolution's (a stream
/// too long to keep must not make the operator's answer unreplayable); its attempts keep the cut.
fn settle(
    conn: &Connection,
    id: RecordId,
    resolution: Resolution,
    probe: Option<Asked>,
    entry: HistoryEntry,
) -> Result<Action, StoreError> {
    let record = match decide(get(conn, id)?, resolution.event()) {
        Ok((record, _)) => record,
        Err(answer) => return Ok(answer),
    };
    let as_of = probe.as_ref().map_or(entry.at, |asked| asked.at);
    if let Some(left) = bound_left(record.in_flight_until, resolution.event(), as_of) {
        return Ok(Action::InFlight(record, left));
    }
    let (state, response) = resolution.stored()?;
    let changed = conn
        .prepare_cached(
            "UPDATE records SET state = ?2, queued = 0, response_status = ?3, response_headers = ?4,
                response_body = ?5, done_at = CASE WHEN ?2 = 'done' THEN ?6 END, updated_at = ?6,
                next_probe_at = NULL, probe_count = probe_count + ?7, stream = NULL,
                history = json_insert(history, '$[#]', json(?8))
             WHERE id = ?1 AND state = 'unknown' AND (?9 IS NULL OR claim_token = ?9)",
        )?
        .execute(params![
            id,
            state,
            response.map(|r| r.status),
            response.map(|r| serde_json::to_string(&r.headers)).transpose()?,
            response.map(|r| &r.body[..]),
            entry.at,
            probe.is_some(),
            serde_json::to_string(&entry)?,
            probe.map(|asked| asked.claim.0),
        ])?;
    answer(conn, id, changed)
}

pub(super) fn retry(conn: &Connection, retry: Retry) -> Result<Action, StoreError> {
    let Retry { id, deadline_at, entry } = retry;
    let (record, to) = match decide(get(conn, id)?, Event::OperatorRetry) {
        Ok(decided) => decided,
        Err(answer) => return Ok(answer),
    };
    if let Some(left) = bound_left(record.in_flight_until, Event::OperatorRetry, entry.at) {
        return Ok(Action::InFlight(record, left));
    }
    let changed = conn
        .prepare_cached(
            "UPDATE records SET state = ?5, queued = ?6, deadline_at = ?2, stop_reason = NULL,
                cancel_requested = 0, next_probe_at = NULL, updated_at = ?3, takeovers = 0,
                history = json_insert(history, '$[#]', json(?4))
             WHERE id = ?1 AND state = 'unknown'",
        )?
        .execute(params![id, deadline_at, entry.at, serde_json::to_string(&entry)?, to.state(), to == Phase::Queued])?;
    answer(conn, id, changed)
}

pub(super) fn probed(conn: &Connection, probed: Probed) -> Result<Action, StoreError> {
    let Probed { id, claim, resolution, asked_at, next_probe_at, entry } = probed;
    if let Some(resolution) = resolution {
        return settle(conn, id, resolution, Some(Asked { claim, at: asked_at }), entry);
    }
    if let Err(answer) = decide(get(conn, id)?, Event::ProbeInconclusive) {
        return Ok(answer);
    }
    let changed = conn
        .prepare_cached(
            "UPDATE records SET probe_count = probe_count + 1, next_probe_at = ?2, updated_at = ?3,
                history = json_insert(history, '$[#]', json(?4))
             WHERE id = ?1 AND state = 'unknown' AND claim_token = ?5",
        )?
        .execute(params![id, next_probe_at, entry.at, serde_json::to_string(&entry)?, claim.0])?;
    answer(conn, id, changed)
}
