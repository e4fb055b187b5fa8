//! The SQLite store's only writer: an OS thread that owns the one writing connection and commits
//! whatever has queued up in one transaction (group commit), so under load one fsync covers many
//! requests.
//!
//! It drives SQLite through rusqlite, synchronously, rather than through sqlx: sqlx runs every
//! statement on a worker thread of its own and hands it over through a channel, which costs a
//! thread wake-up per statement. A single writer runs its batch back to back, so here the only
//! hand-offs are the batch coming in and each reply going out.

use std::path::Path;
use std::sync::mpsc::{self as std_mpsc, RecvTimeoutError};
use std::time::{Duration, Instant};

use rusqlite::{params, Connection, OptionalExtension};
use tokio::sync::{mpsc, oneshot};
use uuid::Uuid;

use crate::policy::StopReason;
use crate::record::{Attempt, HistoryEntry, Millis, Phase, Record, State};
use crate::store::stats::AnswerCount;
use crate::store::{
    decode, refusal, taken_over, Action, Admission, AfterAttempt, Cancelled, Columns, Lease, NewRecord, Resolution,
    StoreError, Stored,
};

/// Most writes committed in one transaction. Bounds the latency a batch adds to its first write.
const MAX_BATCH: usize = 256;

pub(super) type Reply<T> = oneshot::Sender<Result<T, StoreError>>;

pub(super) enum Write {
    Admit(NewRecord, Millis, Reply<Admission>),
    Claim(Uuid, String, Millis, Millis, Reply<bool>),
    AttemptStarted(Uuid, String, u32, Millis, Millis, Reply<Lease>),
    AttemptEnded(Uuid, String, Option<Attempt>, AfterAttempt, Millis, Reply<Lease>),
    Renew(Uuid, String, Millis, Millis, Reply<Lease>),
    Cancel(Uuid, HistoryEntry, Reply<Cancelled>),
    Resolve(Uuid, Resolution, HistoryEntry, Reply<Action>),
    Retry(Uuid, Millis, HistoryEntry, Reply<Action>),
    TakeOver(TakeOver, Reply<bool>),
    Probed(Uuid, Option<Resolution>, Millis, HistoryEntry, Reply<Action>),
    ClaimUnclaimed(String, Millis, Millis, Millis, u32, Reply<Vec<Record>>),
    SweepDone(Millis, u32, Reply<u64>),
    AddAnswerCounts(Vec<AnswerCount>, Millis, Reply<()>),
}

pub(super) struct TakeOver {
    pub id: Uuid,
    pub owner: String,
    pub until: Millis,
    pub to: Phase,
    pub lost: Option<Attempt>,
    pub entry: HistoryEntry,
}

/// Commits between two nudges to the checkpointer.
const CHECKPOINT_EVERY: u32 = 32;
/// How long the writer keeps looking for the next write, after a batch of one, before it sleeps.
/// Waking a sleeping thread costs tens of microseconds (more on a virtual machine), and at low
/// load a request's next write usually comes sooner: the upstream answers, or the client sends
/// its next request. It yields between looks, so a thread with work to do gets the CPU; but
/// under load each look is a system call and often a context switch, and the next bunch of
/// writes pays for its wake-up many times over: after a batch of several, the writer sleeps at
/// once (measured: 8–10 % less CPU per new key at c=64, the same latency at c=1).
const LINGER: Duration = Duration::from_micros(100);
/// WAL pages past which the writer checkpoints by itself, should the checkpointer fall behind.
const WAL_BACKSTOP_PAGES: u32 = 20_000;
/// The longest the checkpointer sleeps without a nudge.
const CHECKPOINT_IDLE: Duration = Duration::from_secs(1);

/// Starts the writer thread, and the checkpointer beside it, on the database at `path` (which
/// the migrations have prepared); both stop when every sender is dropped.
pub(super) fn start(path: &Path, synchronous: &str) -> Result<mpsc::Sender<Write>, StoreError> {
    let conn = Connection::open(path)?;
    conn.busy_timeout(Duration::from_secs(10))?;
    conn.execute_batch(&format!(
        "PRAGMA journal_mode = WAL; PRAGMA synchronous = {synchronous}; PRAGMA foreign_keys = ON;
         PRAGMA wal_autocheckpoint = {WAL_BACKSTOP_PAGES};"
    ))?;
    let checkpoints = Connection::open(path)?;
    let cannot = |e: std::io::Error| StoreError::Unavailable(format!("cannot start the sqlite writer: {e}"));
    let (nudge, nudges) = std_mpsc::sync_channel(1);
    std::thread::Builder::new()
        .name("idem-sqlite-checkpoints".into())
        .spawn(move || checkpoint_loop(checkpoints, nudges))
        .map_err(cannot)?;
    let (writes, queue) = mpsc::channel(4 * MAX_BATCH);
    std::thread::Builder::new()
        .name("idem-sqlite-writer".into())
        .spawn(move || write_loop(conn, queue, nudge))
        .map_err(cannot)?;
    Ok(writes)
}

/// Copies the WAL back into the database file on a thread of its own. Left to SQLite, that
/// would run inside whichever commit crosses the threshold, and its fsyncs would be that
/// request's latency. A passive checkpoint never blocks the writer.
fn checkpoint_loop(conn: Connection, nudges: std_mpsc::Receiver<()>) {
    loop {
        let stopping = matches!(nudges.recv_timeout(CHECKPOINT_IDLE), Err(RecvTimeoutError::Disconnected));
        let mode = if stopping { "TRUNCATE" } else { "PASSIVE" };
        let done = conn.query_row(&format!("PRAGMA wal_checkpoint({mode})"), [], |_| Ok(()));
        if let Err(e) = done {
            tracing::warn!(error = %e, "sqlite checkpoint failed; the WAL keeps growing until one succeeds");
        }
        if stopping {
            return;
        }
    }
}

/// A write's result, held back until its transaction commits.
trait Deliver: Send {
    fn deliver(self: Box<Self>, commit: &Result<(), StoreError>);
}

struct Pending<T> {
    reply: Reply<T>,
    result: Result<T, StoreError>,
}

impl<T: Send> Deliver for Pending<T> {
    fn deliver(self: Box<Self>, commit: &Result<(), StoreError>) {
        let result = match commit {
            Ok(()) => self.result,
            Err(e) => Err(e.clone()),
        };
        let _ = self.reply.send(result);
    }
}

fn pending<T: Send + 'static>(reply: Reply<T>, result: Result<T, StoreError>) -> Box<dyn Deliver> {
    Box::new(Pending { reply, result })
}

fn write_loop(mut conn: Connection, mut queue: mpsc::Receiver<Write>, checkpoint: std_mpsc::SyncSender<()>) {
    let mut batch = Vec::with_capacity(MAX_BATCH);
    let mut done: Vec<Box<dyn Deliver>> = Vec::with_capacity(MAX_BATCH);
    let mut commits = 0u32;
    let mut linger = LINGER;
    while next_batch(&mut queue, &mut batch, linger) {
        linger = if batch.len() == 1 { LINGER } else { Duration::ZERO };
        commits = commits.wrapping_add(1);
        if commits.is_multiple_of(CHECKPOINT_EVERY) {
            let _ = checkpoint.try_send(());
        }
        let commit = commit_batch(&mut conn, &mut batch, &mut done);
        for d in done.drain(..) {
            d.deliver(&commit);
        }
    }
}

/// Fills `batch` with what has queued up, waiting (lingering for up to `linger` first) if
/// nothing has. False once every sender is gone.
fn next_batch(queue: &mut mpsc::Receiver<Write>, batch: &mut Vec<Write>, linger: Duration) -> bool {
    let since = Instant::now();
    loop {
        while batch.len() < MAX_BATCH {
            match queue.try_recv() {
                Ok(write) => batch.push(write),
                Err(_) => break,
            }
        }
        if !batch.is_empty() {
            return true;
        }
        if since.elapsed() >= linger {
            return queue.blocking_recv_many(batch, MAX_BATCH) > 0;
        }
        std::thread::yield_now();
    }
}

/// Applies every write of `batch` in one transaction, leaving each one's result in `done`.
fn commit_batch(
    conn: &mut Connection,
    batch: &mut Vec<Write>,
    done: &mut Vec<Box<dyn Deliver>>,
) -> Result<(), StoreError> {
    if let Err(e) = conn.execute_batch("BEGIN IMMEDIATE") {
        done.extend(batch.drain(..).map(fail));
        return Err(e.into());
    }
    let mut writes = batch.drain(..);
    while let Some(write) = writes.next() {
        done.push(apply(conn, write));
        if conn.is_autocommit() {
            // SQLite rolls the whole transaction back on some errors (I/O, a full disk): the
            // writes before this one are undone, and the rest must not run outside it.
            done.extend(writes.map(fail));
            return Err(StoreError::Unavailable("the transaction was rolled back".into()));
        }
    }
    conn.execute_batch("COMMIT").map_err(|e| {
        let _ = conn.execute_batch("ROLLBACK");
        StoreError::from(e)
    })
}

/// A write that never ran; its reply carries the batch's error.
fn fail(write: Write) -> Box<dyn Deliver> {
    fn e<T>() -> Result<T, StoreError> {
        Err(StoreError::Unavailable("the transaction did not commit".into()))
    }
    match write {
        Write::Admit(.., r) => pending(r, e()),
        Write::Claim(.., r) => pending(r, e()),
        Write::AttemptStarted(.., r) => pending(r, e()),
        Write::AttemptEnded(.., r) => pending(r, e()),
        Write::Renew(.., r) => pending(r, e()),
        Write::Cancel(.., r) => pending(r, e()),
        Write::Resolve(.., r) => pending(r, e()),
        Write::Retry(.., r) => pending(r, e()),
        Write::TakeOver(_, r) => pending(r, e()),
        Write::Probed(.., r) => pending(r, e()),
        Write::ClaimUnclaimed(.., r) => pending(r, e()),
        Write::SweepDone(.., r) => pending(r, e()),
        Write::AddAnswerCounts(.., r) => pending(r, e()),
    }
}

fn apply(conn: &Connection, write: Write) -> Box<dyn Deliver> {
    match write {
        Write::Admit(new, cutoff, r) => pending(r, admit(conn, new, cutoff)),
        Write::Claim(id, owner, until, now, r) => pending(r, claim(conn, id, &owner, until, now)),
        Write::AttemptStarted(id, owner, n, at, until, r) => {
            pending(r, attempt_started(conn, id, &owner, n, at, until))
        }
        Write::AttemptEnded(id, owner, attempt, then, now, r) => {
            pending(r, attempt_ended(conn, id, &owner, attempt, then, now))
        }
        Write::Renew(id, owner, until, now, r) => pending(r, renew(conn, id, &owner, until, now)),
        Write::Cancel(id, entry, r) => pending(r, cancel(conn, id, entry)),
        Write::Resolve(id, resolution, entry, r) => pending(r, settle(conn, id, resolution, false, entry)),
        Write::Retry(id, deadline_at, entry, r) => pending(r, retry(conn, id, deadline_at, entry)),
        Write::TakeOver(t, r) => pending(r, take_over(conn, t)),
        Write::Probed(id, resolution, next_at, entry, r) => pending(r, probed(conn, id, resolution, next_at, entry)),
        Write::ClaimUnclaimed(owner, until, idle_since, now, limit, r) => {
            pending(r, claim_unclaimed(conn, &owner, until, idle_since, now, limit))
        }
        Write::SweepDone(cutoff, limit, r) => pending(r, sweep_done(conn, cutoff, limit)),
        Write::AddAnswerCounts(counts, forget_before, r) => {
            pending(r, super::stats::add_answer_counts(conn, &counts, forget_before))
        }
    }
}

impl Columns for rusqlite::Row<'_> {
    fn text(&self, name: &str) -> Result<Option<String>, StoreError> {
        Ok(self.get(name)?)
    }
    fn integer(&self, name: &str) -> Result<Option<i64>, StoreError> {
        Ok(self.get(name)?)
    }
    fn blob(&self, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
        Ok(self.get(name)?)
    }
    fn flag(&self, name: &str) -> Result<bool, StoreError> {
        Ok(self.get(name)?)
    }
}

/// The one row `sql` returns, decoded, if any.
fn record_of(conn: &Connection, sql: &str, params: impl rusqlite::Params) -> Result<Option<Record>, StoreError> {
    let mut statement = conn.prepare_cached(sql)?;
    let mut rows = statement.query(params)?;
    rows.next()?.map(decode).transpose()
}

fn get(conn: &Connection, id: Uuid) -> Result<Option<Record>, StoreError> {
    record_of(conn, "SELECT * FROM records WHERE id = ?1", [id.to_string()])
}

// ---- SQL -------------------------------------------------------------------------------------

/// Insert, or take over a key whose record is expired (`done` past retention) or free with the
/// same fingerprint. One writer makes the statement and the read after it atomic.
const ADMIT: &str = "
INSERT INTO records (id, tenant, key, route, method, path, query, fingerprint, request_headers,
                     request_body, state, queued, deadline_at, created_at, updated_at,
                     lease_owner, lease_expires_at, in_flight_number, in_flight_started_at)
VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10,
        CASE WHEN ?13 IS NULL THEN 'not_started' ELSE 'in_progress' END, ?13 IS NULL, ?11, ?12, ?12,
        ?13, ?14, CASE WHEN ?13 IS NULL THEN NULL ELSE 1 END, CASE WHEN ?13 IS NULL THEN NULL ELSE ?12 END)
ON CONFLICT (tenant, key) DO UPDATE SET
    id = CASE WHEN records.state = 'done' THEN excluded.id ELSE records.id END,
    attempts = CASE WHEN records.state = 'done' THEN '[]' ELSE records.attempts END,
    history = CASE WHEN records.state = 'done' THEN '[]'
                   ELSE json_insert(records.history, '$[#]', json_object('at', excluded.updated_at,
                        'actor', 'client', 'action', 'requeued',
                        'note', 'the same request was sent again for a free key')) END,
    created_at = CASE WHEN records.state = 'done' THEN excluded.created_at ELSE records.created_at END,
    route = excluded.route, method = excluded.method, path = excluded.path, query = excluded.query,
    fingerprint = excluded.fingerprint, request_headers = excluded.request_headers,
    request_body = excluded.request_body, state = 'not_started', queued = 1,
    deadline_at = excluded.deadline_at, lease_owner = NULL, lease_expires_at = NULL,
    in_flight_number = NULL, in_flight_started_at = NULL, stop_reason = NULL,
    response_status = NULL, response_headers = NULL, response_body = NULL, done_at = NULL,
    cancel_requested = 0, probe_count = 0, next_probe_at = NULL, not_before = NULL,
    updated_at = excluded.updated_at
WHERE (records.state = 'done' AND records.done_at < ?15)
   OR (records.state = 'not_started' AND records.queued = 0 AND records.fingerprint = excluded.fingerprint)
RETURNING id, state";

/// `Created` (its own id came back), `Requeued` (a free record for the key was queued again),
/// or `Existing` (nothing came back: the key's record decides). A fresh insert is not read back:
/// it holds what `new` says. (An expired record taken over gets the new id too, but is queued
/// rather than claimed: that one is read back.)
fn admit(conn: &Connection, new: NewRecord, cutoff: Millis) -> Result<Admission, StoreError> {
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

fn claim(conn: &Connection, id: Uuid, owner: &str, until: Millis, now: Millis) -> Result<bool, StoreError> {
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

fn attempt_started(
    conn: &Connection,
    id: Uuid,
    owner: &str,
    number: u32,
    at: Millis,
    until: Millis,
) -> Result<Lease, StoreError> {
    lease(
        conn,
        "UPDATE records SET in_flight_number = ?3, in_flight_started_at = ?4, lease_expires_at = ?5,
                updated_at = ?4
         WHERE id = ?1 AND state = 'in_progress' AND lease_owner = ?2
         RETURNING cancel_requested",
        params![id.to_string(), owner, number, at, until],
    )
}

fn attempt_ended(
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

fn renew(conn: &Connection, id: Uuid, owner: &str, until: Millis, now: Millis) -> Result<Lease, StoreError> {
    lease(
        conn,
        "UPDATE records SET lease_expires_at = ?3, updated_at = ?4
         WHERE id = ?1 AND state = 'in_progress' AND lease_owner = ?2
         RETURNING cancel_requested",
        params![id.to_string(), owner, until, now],
    )
}

fn cancel(conn: &Connection, id: Uuid, entry: HistoryEntry) -> Result<Cancelled, StoreError> {
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
fn settle(
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

fn retry(conn: &Connection, id: Uuid, deadline_at: Millis, entry: HistoryEntry) -> Result<Action, StoreError> {
    if let Some(answer) = refusal(get(conn, id)?) {
        return Ok(answer);
    }
    conn.prepare_cached(
        "UPDATE records SET state = 'not_started', queued = 1, deadline_at = ?2, stop_reason = NULL,
                cancel_requested = 0, next_probe_at = NULL, updated_at = ?3,
                history = json_insert(history, '$[#]', json(?4))
         WHERE id = ?1 AND state = 'unknown'",
    )?
    .execute(params![id.to_string(), deadline_at, entry.at, serde_json::to_string(&entry)?])?;
    applied(conn, id)
}

fn take_over(conn: &Connection, t: TakeOver) -> Result<bool, StoreError> {
    let (state, queued, stop) = taken_over(t.to)?;
    let lost = t.lost.map(|a| serde_json::to_string(&a)).transpose()?;
    let changed = conn
        .prepare_cached(
            "UPDATE records SET state = ?4, queued = ?5, stop_reason = ?6, lease_owner = NULL,
                lease_expires_at = NULL, in_flight_number = NULL, in_flight_started_at = NULL,
                attempts = CASE WHEN ?7 IS NULL THEN attempts ELSE json_insert(attempts, '$[#]', json(?7)) END,
                history = json_insert(history, '$[#]', json(?8)), updated_at = ?9
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

fn probed(
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

fn claim_unclaimed(
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
        records.push(decode(row)?);
    }
    Ok(records)
}

fn sweep_done(conn: &Connection, cutoff: Millis, limit: u32) -> Result<u64, StoreError> {
    let deleted = conn
        .prepare_cached(
            "DELETE FROM records WHERE id IN (
                SELECT id FROM records WHERE state = 'done' AND done_at < ?1 LIMIT ?2)",
        )?
        .execute(params![cutoff, limit])?;
    Ok(deleted as u64)
}
