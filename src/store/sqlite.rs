//! The SQLite store. SQLite allows one writer at a time, so instead of a pool of connections
//! fighting over the write lock, every write goes to one task that owns the only writing
//! connection and commits whatever has queued up in one transaction (group commit): under load,
//! one fsync covers many requests. Reads run on a separate pool of read-only connections, which
//! WAL lets proceed while the writer writes.

use std::str::FromStr;
use std::time::Duration;

use async_trait::async_trait;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteRow,
    SqliteSynchronous,
};
use sqlx::{Connection, Executor, Row};
use tokio::sync::{mpsc, oneshot};
use uuid::Uuid;

use super::{
    decode, page, Action, Admission, AfterAttempt, Cancelled, Lease, ListFilter, NewRecord, Page, Resolution, Store,
    StoreError,
};
use crate::policy::StopReason;
use crate::record::{Attempt, HistoryEntry, Millis, Phase, Record, State};

/// Most writes committed in one transaction. Bounds the latency a batch adds to its first write.
const MAX_BATCH: usize = 256;

pub struct SqliteStore {
    writes: mpsc::Sender<Write>,
    reads: SqlitePool,
}

impl SqliteStore {
    /// Opens (creating if needed) the database at `url` and applies migrations. The url may end
    /// in `?synchronous=normal` to trade the last commits on power loss for speed; the default,
    /// `full`, makes every record durable before its request is sent upstream.
    pub async fn open(url: &str) -> Result<SqliteStore, StoreError> {
        let (url, synchronous) = split_synchronous(url)?;
        let options = SqliteConnectOptions::from_str(&url)
            .map_err(|e| StoreError::Unavailable(format!("bad sqlite url `{url}`: {e}")))?
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(synchronous)
            .busy_timeout(Duration::from_secs(10))
            .foreign_keys(true);

        let mut writer = SqliteConnection::connect_with(&options).await?;
        sqlx::migrate!("migrations/sqlite")
            .run(&mut writer)
            .await
            .map_err(|e| StoreError::Unavailable(format!("migration failed: {e}")))?;

        let reads = SqlitePoolOptions::new()
            .max_connections(8)
            .min_connections(1)
            .connect_with(options.read_only(true))
            .await?;

        let (writes, queue) = mpsc::channel(4 * MAX_BATCH);
        tokio::spawn(write_loop(writer, queue));
        Ok(SqliteStore { writes, reads })
    }

    async fn write<T>(
        &self,
        op: impl FnOnce(oneshot::Sender<Result<T, StoreError>>) -> Write,
    ) -> Result<T, StoreError> {
        let (tx, rx) = oneshot::channel();
        self.writes.send(op(tx)).await.map_err(|_| StoreError::Unavailable("the sqlite writer has stopped".into()))?;
        rx.await.map_err(|_| StoreError::Unavailable("the sqlite writer has stopped".into()))?
    }
}

/// Migrations only, for `idem migrate`.
pub async fn migrate(url: &str) -> Result<(), StoreError> {
    SqliteStore::open(url).await.map(drop)
}

fn split_synchronous(url: &str) -> Result<(String, SqliteSynchronous), StoreError> {
    let Some((base, query)) = url.split_once('?') else {
        return Ok((url.to_string(), SqliteSynchronous::Full));
    };
    let mut synchronous = SqliteSynchronous::Full;
    let mut rest = Vec::new();
    for pair in query.split('&') {
        match pair.split_once('=') {
            Some(("synchronous", value)) => {
                synchronous = match value.to_ascii_lowercase().as_str() {
                    "full" => SqliteSynchronous::Full,
                    "normal" => SqliteSynchronous::Normal,
                    "extra" => SqliteSynchronous::Extra,
                    _ => {
                        return Err(StoreError::Unavailable(format!(
                            "synchronous={value}: use full, normal or extra (off would lose acknowledged records)"
                        )))
                    }
                }
            }
            _ => rest.push(pair),
        }
    }
    let url = if rest.is_empty() { base.to_string() } else { format!("{base}?{}", rest.join("&")) };
    Ok((url, synchronous))
}

// ---- the writer ------------------------------------------------------------------------------

type Reply<T> = oneshot::Sender<Result<T, StoreError>>;

enum Write {
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
}

struct TakeOver {
    id: Uuid,
    owner: String,
    until: Millis,
    to: Phase,
    lost: Option<Attempt>,
    entry: HistoryEntry,
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

async fn write_loop(mut conn: SqliteConnection, mut queue: mpsc::Receiver<Write>) {
    let mut batch = Vec::with_capacity(MAX_BATCH);
    let mut done: Vec<Box<dyn Deliver>> = Vec::with_capacity(MAX_BATCH);
    while queue.recv_many(&mut batch, MAX_BATCH).await > 0 {
        // A lone write commits by itself: BEGIN and COMMIT would only add two round trips to
        // SQLite's thread. (One writer means no other write can interleave with its statements.)
        let lone = batch.len() == 1;
        let begun =
            if lone { Ok(()) } else { conn.execute("BEGIN IMMEDIATE").await.map(drop).map_err(StoreError::from) };
        let commit = match begun {
            Err(e) => Err(e),
            Ok(()) => {
                // Every admission of the batch goes in one statement; the rest one by one.
                let mut admits = Vec::new();
                for write in batch.drain(..) {
                    match write {
                        Write::Admit(new, cutoff, reply) => admits.push((new, cutoff, reply)),
                        other => done.push(apply(&mut conn, other).await),
                    }
                }
                if !admits.is_empty() {
                    done.extend(admit_all(&mut conn, admits).await);
                }
                if lone {
                    Ok(())
                } else {
                    match conn.execute("COMMIT").await {
                        Ok(_) => Ok(()),
                        Err(e) => {
                            let _ = conn.execute("ROLLBACK").await;
                            Err(StoreError::from(e))
                        }
                    }
                }
            }
        };
        if commit.is_err() {
            // BEGIN failed: nothing ran. Fail every write in the batch.
            for write in batch.drain(..) {
                done.push(fail(write));
            }
        }
        for d in done.drain(..) {
            d.deliver(&commit);
        }
    }
}

/// A write that never ran; its reply will carry the batch's error.
fn fail(write: Write) -> Box<dyn Deliver> {
    fn e<T>() -> Result<T, StoreError> {
        Err(StoreError::Unavailable("transaction could not start".into()))
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
    }
}

async fn apply(conn: &mut SqliteConnection, write: Write) -> Box<dyn Deliver> {
    match write {
        Write::Admit(new, cutoff, r) => admit_all(conn, vec![(new, cutoff, r)]).await.pop().expect("one admission"),
        Write::Claim(id, owner, until, now, r) => pending(r, claim(conn, id, &owner, until, now).await),
        Write::AttemptStarted(id, owner, n, at, until, r) => {
            pending(r, attempt_started(conn, id, &owner, n, at, until).await)
        }
        Write::AttemptEnded(id, owner, attempt, then, now, r) => {
            pending(r, attempt_ended(conn, id, &owner, attempt, then, now).await)
        }
        Write::Renew(id, owner, until, now, r) => pending(r, renew(conn, id, &owner, until, now).await),
        Write::Cancel(id, entry, r) => pending(r, cancel(conn, id, entry).await),
        Write::Resolve(id, resolution, entry, r) => pending(r, settle(conn, id, resolution, false, entry).await),
        Write::Retry(id, deadline_at, entry, r) => pending(r, retry(conn, id, deadline_at, entry).await),
        Write::TakeOver(t, r) => pending(r, take_over(conn, t).await),
        Write::Probed(id, resolution, next_at, entry, r) => {
            pending(r, probed(conn, id, resolution, next_at, entry).await)
        }
        Write::ClaimUnclaimed(owner, until, idle_since, now, limit, r) => {
            pending(r, claim_unclaimed(conn, &owner, until, idle_since, now, limit).await)
        }
        Write::SweepDone(cutoff, limit, r) => pending(r, sweep_done(conn, cutoff, limit).await),
    }
}

// ---- SQL -------------------------------------------------------------------------------------

/// The columns of one admitted row, in the order `admit_all` binds them.
const ADMIT_COLUMNS: usize = 14;

/// Insert, or take over a key whose record is expired (`done` past retention) or free with the
/// same fingerprint — for every request of a batch in one statement; one writer makes it atomic.
/// Rows are processed in order, so of duplicates within a batch the first wins and the others
/// find its record. `?1` is the retention cutoff; each row binds `ADMIT_COLUMNS` values after it.
fn admit_sql(rows: usize) -> String {
    let values: Vec<String> = (0..rows)
        .map(|r| {
            let p = |n: usize| format!("?{}", 1 + r * ADMIT_COLUMNS + n);
            let (owner, now) = (p(13), p(12));
            format!(
                "({}, {}, {}, {}, {}, {}, {}, {}, {}, {}, \
                 CASE WHEN {owner} IS NULL THEN 'not_started' ELSE 'in_progress' END, {owner} IS NULL, {}, {now}, {now}, \
                 {owner}, {}, CASE WHEN {owner} IS NULL THEN NULL ELSE 1 END, CASE WHEN {owner} IS NULL THEN NULL ELSE {now} END)",
                p(1), p(2), p(3), p(4), p(5), p(6), p(7), p(8), p(9), p(10), p(11), p(14)
            )
        })
        .collect();
    format!(
        "INSERT INTO records (id, tenant, key, route, method, path, query, fingerprint, request_headers,
                     request_body, state, queued, deadline_at, created_at, updated_at,
                     lease_owner, lease_expires_at, in_flight_number, in_flight_started_at)
VALUES {}
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
WHERE (records.state = 'done' AND records.done_at < ?1)
   OR (records.state = 'not_started' AND records.queued = 0 AND records.fingerprint = excluded.fingerprint)
RETURNING *",
        values.join(",\n       ")
    )
}

/// Admits a batch's requests with one statement and answers each: `Created` (its own id came
/// back), `Requeued` (the first of the batch with that key got a free record back), or
/// `Existing` (nothing came back for it: its key's record decides).
async fn admit_all(
    conn: &mut SqliteConnection,
    admits: Vec<(NewRecord, Millis, Reply<Admission>)>,
) -> Vec<Box<dyn Deliver>> {
    let results = admit_rows(conn, &admits).await;
    admits.into_iter().zip(results).map(|((_, _, reply), result)| pending(reply, result)).collect()
}

async fn admit_rows(
    conn: &mut SqliteConnection,
    admits: &[(NewRecord, Millis, Reply<Admission>)],
) -> Vec<Result<Admission, StoreError>> {
    let failed = |e: StoreError| admits.iter().map(|_| Err(e.clone())).collect();
    // The most conservative cutoff of the batch: a record counts as expired only if it is for all.
    let cutoff = admits.iter().map(|(_, cutoff, _)| *cutoff).min().unwrap_or(0);
    let sql = admit_sql(admits.len());
    let mut query = sqlx::query(&sql).bind(cutoff);
    let mut headers = Vec::with_capacity(admits.len());
    for (new, _, _) in admits {
        match serde_json::to_string(&new.request.headers) {
            Ok(h) => headers.push(h),
            Err(e) => return failed(StoreError::from(e)),
        }
    }
    for ((new, _, _), headers) in admits.iter().zip(&headers) {
        query = query
            .bind(new.id.to_string())
            .bind(&new.tenant)
            .bind(&new.key)
            .bind(&new.route)
            .bind(&new.method)
            .bind(&new.path)
            .bind(&new.query)
            .bind(&new.fingerprint.as_bytes()[..])
            .bind(headers)
            .bind(&new.request.body[..])
            .bind(new.deadline_at)
            .bind(new.now)
            .bind(new.claim.as_ref().map(|c| c.owner.as_str()))
            .bind(new.claim.as_ref().map(|c| c.lease_until));
    }
    let rows = match query.fetch_all(&mut *conn).await {
        Ok(rows) => rows,
        Err(e) => return failed(StoreError::from(e)),
    };
    let mut returned = Vec::with_capacity(rows.len());
    for row in &rows {
        match decode(row) {
            Ok(record) => returned.push(Some(record)),
            Err(e) => return failed(e),
        }
    }
    let mut results = Vec::with_capacity(admits.len());
    for (new, _, _) in admits {
        let created = returned.iter().position(|r| r.as_ref().is_some_and(|r| r.id == new.id));
        let requeued =
            || returned.iter().position(|r| r.as_ref().is_some_and(|r| r.tenant == new.tenant && r.key == new.key));
        let result = if let Some(i) = created {
            Ok(Admission::Created(returned[i].take().expect("found just above")))
        } else if let Some(i) = requeued() {
            Ok(Admission::Requeued(returned[i].take().expect("found just above")))
        } else {
            existing(conn, &new.tenant, &new.key).await
        };
        results.push(result);
    }
    results
}

async fn existing(conn: &mut SqliteConnection, tenant: &str, key: &str) -> Result<Admission, StoreError> {
    let row = sqlx::query("SELECT * FROM records WHERE tenant = ?1 AND key = ?2")
        .bind(tenant)
        .bind(key)
        .fetch_one(&mut *conn)
        .await?;
    Ok(Admission::Existing(decode(&row)?))
}

async fn claim(
    conn: &mut SqliteConnection,
    id: Uuid,
    owner: &str,
    until: Millis,
    now: Millis,
) -> Result<bool, StoreError> {
    let done = sqlx::query(
        "UPDATE records SET state = 'in_progress', queued = 0, lease_owner = ?2, lease_expires_at = ?3,
                updated_at = ?4
         WHERE id = ?1 AND state = 'not_started' AND queued = 1",
    )
    .bind(id.to_string())
    .bind(owner)
    .bind(until)
    .bind(now)
    .execute(&mut *conn)
    .await?;
    Ok(done.rows_affected() == 1)
}

fn lease_of(row: Option<SqliteRow>) -> Result<Lease, StoreError> {
    Ok(match row {
        Some(row) => Lease::Held { cancel_requested: row.try_get::<i64, _>(0)? != 0 },
        None => Lease::Lost,
    })
}

async fn attempt_started(
    conn: &mut SqliteConnection,
    id: Uuid,
    owner: &str,
    number: u32,
    at: Millis,
    until: Millis,
) -> Result<Lease, StoreError> {
    let row = sqlx::query(
        "UPDATE records SET in_flight_number = ?3, in_flight_started_at = ?4, lease_expires_at = ?5,
                updated_at = ?4
         WHERE id = ?1 AND state = 'in_progress' AND lease_owner = ?2
         RETURNING cancel_requested",
    )
    .bind(id.to_string())
    .bind(owner)
    .bind(number as i64)
    .bind(at)
    .bind(until)
    .fetch_optional(&mut *conn)
    .await?;
    lease_of(row)
}

async fn attempt_ended(
    conn: &mut SqliteConnection,
    id: Uuid,
    owner: &str,
    attempt: Option<Attempt>,
    then: AfterAttempt,
    now: Millis,
) -> Result<Lease, StoreError> {
    let attempt = attempt.map(|a| serde_json::to_string(&a)).transpose()?;
    let (state, stop, response) = match &then {
        AfterAttempt::Wait { .. } => (State::InProgress, None, None),
        AfterAttempt::Release => (State::NotStarted, None, None),
        AfterAttempt::Done(stop, response) => (State::Done, Some(*stop), Some(response)),
        AfterAttempt::Unknown(stop) => (State::Unknown, Some(*stop), None),
        AfterAttempt::Free(stop) => (State::NotStarted, Some(*stop), None),
    };
    let row = sqlx::query(
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
    )
    .bind(id.to_string())
    .bind(owner)
    .bind(attempt)
    .bind(state.as_str())
    .bind(stop.map(StopReason::as_str))
    .bind(response.map(|r| r.status as i64))
    .bind(response.map(|r| serde_json::to_string(&r.headers)).transpose()?)
    .bind(response.map(|r| r.body.to_vec()))
    .bind(now)
    .bind(matches!(then, AfterAttempt::Release) as i64)
    .bind(match then {
        AfterAttempt::Wait { not_before } => Some(not_before),
        _ => None,
    })
    .fetch_optional(&mut *conn)
    .await?;
    lease_of(row)
}

async fn renew(
    conn: &mut SqliteConnection,
    id: Uuid,
    owner: &str,
    until: Millis,
    now: Millis,
) -> Result<Lease, StoreError> {
    let row = sqlx::query(
        "UPDATE records SET lease_expires_at = ?3, updated_at = ?4
         WHERE id = ?1 AND state = 'in_progress' AND lease_owner = ?2
         RETURNING cancel_requested",
    )
    .bind(id.to_string())
    .bind(owner)
    .bind(until)
    .bind(now)
    .fetch_optional(&mut *conn)
    .await?;
    lease_of(row)
}

async fn cancel(conn: &mut SqliteConnection, id: Uuid, entry: HistoryEntry) -> Result<Cancelled, StoreError> {
    let Some(record) = get(&mut *conn, id).await? else {
        return Ok(Cancelled::Missing);
    };
    let entry = serde_json::to_string(&entry)?;
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
    sqlx::query(sql).bind(id.to_string()).bind(entry).bind(crate::record::now_ms()).execute(&mut *conn).await?;
    let updated = get(&mut *conn, id).await?.ok_or_else(|| StoreError::Corrupt("record vanished".into()))?;
    Ok(if record.state == State::InProgress { Cancelled::Flagged(updated) } else { Cancelled::Dequeued(updated) })
}

/// Settles an `unknown` record as an operator or a probe decided. `probe` counts it as a probe.
async fn settle(
    conn: &mut SqliteConnection,
    id: Uuid,
    resolution: Resolution,
    probe: bool,
    entry: HistoryEntry,
) -> Result<Action, StoreError> {
    let Some(record) = get(&mut *conn, id).await? else {
        return Ok(Action::Missing);
    };
    if record.state != State::Unknown {
        return Ok(Action::Refused(record));
    }
    let now = entry.at;
    let entry = serde_json::to_string(&entry)?;
    let (state, response) = match &resolution {
        Resolution::Executed(response) => (State::Done, Some(response)),
        Resolution::NotExecuted => (State::NotStarted, None),
    };
    sqlx::query(
        "UPDATE records SET state = ?2, queued = 0, response_status = ?3, response_headers = ?4,
                response_body = ?5, done_at = CASE WHEN ?2 = 'done' THEN ?6 END, updated_at = ?6,
                next_probe_at = NULL, probe_count = probe_count + ?7,
                history = json_insert(history, '$[#]', json(?8))
         WHERE id = ?1 AND state = 'unknown'",
    )
    .bind(id.to_string())
    .bind(state.as_str())
    .bind(response.map(|r| r.status as i64))
    .bind(response.map(|r| serde_json::to_string(&r.headers)).transpose()?)
    .bind(response.map(|r| r.body.to_vec()))
    .bind(now)
    .bind(probe as i64)
    .bind(entry)
    .execute(&mut *conn)
    .await?;
    applied(conn, id).await
}

async fn applied(conn: &mut SqliteConnection, id: Uuid) -> Result<Action, StoreError> {
    get(&mut *conn, id).await?.map(Action::Applied).ok_or_else(|| StoreError::Corrupt("record vanished".into()))
}

async fn retry(
    conn: &mut SqliteConnection,
    id: Uuid,
    deadline_at: Millis,
    entry: HistoryEntry,
) -> Result<Action, StoreError> {
    let Some(record) = get(&mut *conn, id).await? else {
        return Ok(Action::Missing);
    };
    if record.state != State::Unknown {
        return Ok(Action::Refused(record));
    }
    sqlx::query(
        "UPDATE records SET state = 'not_started', queued = 1, deadline_at = ?2, stop_reason = NULL,
                cancel_requested = 0, next_probe_at = NULL, updated_at = ?3,
                history = json_insert(history, '$[#]', json(?4))
         WHERE id = ?1 AND state = 'unknown'",
    )
    .bind(id.to_string())
    .bind(deadline_at)
    .bind(entry.at)
    .bind(serde_json::to_string(&entry)?)
    .execute(&mut *conn)
    .await?;
    applied(conn, id).await
}

async fn take_over(conn: &mut SqliteConnection, t: TakeOver) -> Result<bool, StoreError> {
    let (state, queued, stop) = match t.to {
        Phase::Queued => (State::NotStarted, true, None),
        Phase::Free => (State::NotStarted, false, Some(StopReason::Deadline)),
        Phase::Unknown => (State::Unknown, false, Some(StopReason::UnsafeReplay)),
        other => return Err(StoreError::Corrupt(format!("a take-over cannot lead to {other:?}"))),
    };
    let lost = t.lost.map(|a| serde_json::to_string(&a)).transpose()?;
    let done = sqlx::query(
        "UPDATE records SET state = ?4, queued = ?5, stop_reason = ?6, lease_owner = NULL,
                lease_expires_at = NULL, in_flight_number = NULL, in_flight_started_at = NULL,
                attempts = CASE WHEN ?7 IS NULL THEN attempts ELSE json_insert(attempts, '$[#]', json(?7)) END,
                history = json_insert(history, '$[#]', json(?8)), updated_at = ?9
         WHERE id = ?1 AND state = 'in_progress' AND lease_owner = ?2 AND lease_expires_at = ?3",
    )
    .bind(t.id.to_string())
    .bind(&t.owner)
    .bind(t.until)
    .bind(state.as_str())
    .bind(queued as i64)
    .bind(stop.map(StopReason::as_str))
    .bind(lost)
    .bind(serde_json::to_string(&t.entry)?)
    .bind(t.entry.at)
    .execute(&mut *conn)
    .await?;
    Ok(done.rows_affected() == 1)
}

async fn probed(
    conn: &mut SqliteConnection,
    id: Uuid,
    resolution: Option<Resolution>,
    next_at: Millis,
    entry: HistoryEntry,
) -> Result<Action, StoreError> {
    if let Some(resolution) = resolution {
        return settle(conn, id, resolution, true, entry).await;
    }
    let done = sqlx::query(
        "UPDATE records SET probe_count = probe_count + 1, next_probe_at = ?2, updated_at = ?3,
                history = json_insert(history, '$[#]', json(?4))
         WHERE id = ?1 AND state = 'unknown'",
    )
    .bind(id.to_string())
    .bind(next_at)
    .bind(entry.at)
    .bind(serde_json::to_string(&entry)?)
    .execute(&mut *conn)
    .await?;
    match get(&mut *conn, id).await? {
        Some(record) if done.rows_affected() == 1 => Ok(Action::Applied(record)),
        Some(record) => Ok(Action::Refused(record)),
        None => Ok(Action::Missing),
    }
}

async fn claim_unclaimed(
    conn: &mut SqliteConnection,
    owner: &str,
    until: Millis,
    idle_since: Millis,
    now: Millis,
    limit: u32,
) -> Result<Vec<Record>, StoreError> {
    let rows = sqlx::query(
        "UPDATE records SET state = 'in_progress', queued = 0, lease_owner = ?1, lease_expires_at = ?2,
                updated_at = ?4
         WHERE id IN (SELECT id FROM records WHERE state = 'not_started' AND queued = 1 AND updated_at < ?3
                      ORDER BY created_at LIMIT ?5)
         RETURNING *",
    )
    .bind(owner)
    .bind(until)
    .bind(idle_since)
    .bind(now)
    .bind(limit as i64)
    .fetch_all(&mut *conn)
    .await?;
    rows.iter().map(decode).collect()
}

async fn sweep_done(conn: &mut SqliteConnection, cutoff: Millis, limit: u32) -> Result<u64, StoreError> {
    let done = sqlx::query(
        "DELETE FROM records WHERE id IN (
            SELECT id FROM records WHERE state = 'done' AND done_at < ?1 LIMIT ?2)",
    )
    .bind(cutoff)
    .bind(limit as i64)
    .execute(&mut *conn)
    .await?;
    Ok(done.rows_affected())
}

async fn get<'e, E: sqlx::SqliteExecutor<'e>>(executor: E, id: Uuid) -> Result<Option<Record>, StoreError> {
    sqlx::query("SELECT * FROM records WHERE id = ?1")
        .bind(id.to_string())
        .fetch_optional(executor)
        .await?
        .map(|row| decode(&row))
        .transpose()
}

fn corrupt(what: &str) -> StoreError {
    StoreError::Corrupt(what.to_string())
}

#[async_trait]
impl Store for SqliteStore {
    async fn admit(&self, new: NewRecord, retention_cutoff: Millis) -> Result<Admission, StoreError> {
        self.write(|r| Write::Admit(new, retention_cutoff, r)).await
    }

    async fn lookup(&self, tenant: &str, key: &str) -> Result<Option<Record>, StoreError> {
        sqlx::query("SELECT * FROM records WHERE tenant = ?1 AND key = ?2")
            .bind(tenant)
            .bind(key)
            .fetch_optional(&self.reads)
            .await?
            .map(|row| decode(&row))
            .transpose()
    }

    async fn get(&self, id: Uuid) -> Result<Option<Record>, StoreError> {
        get(&self.reads, id).await
    }

    async fn claim(&self, id: Uuid, owner: &str, lease_until: Millis, now: Millis) -> Result<bool, StoreError> {
        let owner = owner.to_string();
        self.write(|r| Write::Claim(id, owner, lease_until, now, r)).await
    }

    async fn attempt_started(
        &self,
        id: Uuid,
        owner: &str,
        number: u32,
        started_at: Millis,
        lease_until: Millis,
    ) -> Result<Lease, StoreError> {
        let owner = owner.to_string();
        self.write(|r| Write::AttemptStarted(id, owner, number, started_at, lease_until, r)).await
    }

    async fn attempt_ended(
        &self,
        id: Uuid,
        owner: &str,
        attempt: Option<Attempt>,
        then: AfterAttempt,
        now: Millis,
    ) -> Result<Lease, StoreError> {
        let owner = owner.to_string();
        self.write(|r| Write::AttemptEnded(id, owner, attempt, then, now, r)).await
    }

    async fn renew(&self, id: Uuid, owner: &str, lease_until: Millis, now: Millis) -> Result<Lease, StoreError> {
        let owner = owner.to_string();
        self.write(|r| Write::Renew(id, owner, lease_until, now, r)).await
    }

    async fn cancel(&self, id: Uuid, entry: HistoryEntry) -> Result<Cancelled, StoreError> {
        self.write(|r| Write::Cancel(id, entry, r)).await
    }

    async fn list(&self, filter: &ListFilter) -> Result<Page, StoreError> {
        let limit = filter.limit.clamp(1, 1000);
        let rows = sqlx::query(
            "SELECT * FROM records
             WHERE (?1 IS NULL OR state = ?1) AND (?2 IS NULL OR route = ?2) AND (?3 IS NULL OR tenant = ?3)
               AND (?4 IS NULL OR (created_at, id) > (?4, ?5))
             ORDER BY created_at, id LIMIT ?6",
        )
        .bind(filter.state.map(State::as_str))
        .bind(filter.route.as_deref())
        .bind(filter.tenant.as_deref())
        .bind(filter.cursor.map(|c| c.created_at))
        .bind(filter.cursor.map(|c| c.id.to_string()))
        .bind(limit as i64 + 1)
        .fetch_all(&self.reads)
        .await?;
        page(rows.iter().map(decode).collect::<Result<Vec<_>, _>>()?, limit)
    }

    async fn resolve(&self, id: Uuid, resolution: Resolution, entry: HistoryEntry) -> Result<Action, StoreError> {
        self.write(|r| Write::Resolve(id, resolution, entry, r)).await
    }

    async fn retry(&self, id: Uuid, deadline_at: Millis, entry: HistoryEntry) -> Result<Action, StoreError> {
        self.write(|r| Write::Retry(id, deadline_at, entry, r)).await
    }

    async fn expired_leases(&self, now: Millis, limit: u32) -> Result<Vec<Record>, StoreError> {
        let rows = sqlx::query(
            "SELECT * FROM records WHERE state = 'in_progress' AND lease_expires_at < ?1
             ORDER BY lease_expires_at LIMIT ?2",
        )
        .bind(now)
        .bind(limit as i64)
        .fetch_all(&self.reads)
        .await?;
        rows.iter().map(decode).collect()
    }

    async fn take_over(
        &self,
        id: Uuid,
        owner: &str,
        until: Millis,
        to: Phase,
        lost: Option<Attempt>,
        entry: HistoryEntry,
    ) -> Result<bool, StoreError> {
        let t = TakeOver { id, owner: owner.to_string(), until, to, lost, entry };
        self.write(|r| Write::TakeOver(t, r)).await
    }

    async fn claim_unclaimed(
        &self,
        owner: &str,
        lease_until: Millis,
        idle_since: Millis,
        now: Millis,
        limit: u32,
    ) -> Result<Vec<Record>, StoreError> {
        let owner = owner.to_string();
        self.write(|r| Write::ClaimUnclaimed(owner, lease_until, idle_since, now, limit, r)).await
    }

    async fn probes_due(
        &self,
        route: &str,
        settle: Millis,
        now: Millis,
        limit: u32,
    ) -> Result<Vec<Record>, StoreError> {
        let rows = sqlx::query(
            "SELECT * FROM records WHERE state = 'unknown' AND route = ?1
               AND COALESCE(next_probe_at, updated_at + ?2) <= ?3
             ORDER BY created_at LIMIT ?4",
        )
        .bind(route)
        .bind(settle)
        .bind(now)
        .bind(limit as i64)
        .fetch_all(&self.reads)
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
        self.write(|r| Write::Probed(id, resolution, next_probe_at, entry, r)).await
    }

    async fn count_by_phase(&self) -> Result<Vec<(Phase, u64)>, StoreError> {
        let rows = sqlx::query("SELECT state, queued, COUNT(*) FROM records GROUP BY state, queued")
            .fetch_all(&self.reads)
            .await?;
        rows.iter()
            .map(|row| {
                let state: String = row.try_get(0)?;
                let state = State::parse(&state).ok_or_else(|| corrupt("state"))?;
                let queued = row.try_get::<i64, _>(1)? != 0;
                Ok((Phase::of(state, queued), row.try_get::<i64, _>(2)? as u64))
            })
            .collect()
    }

    async fn sweep_done(&self, cutoff: Millis, limit: u32) -> Result<u64, StoreError> {
        self.write(|r| Write::SweepDone(cutoff, limit, r)).await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        sqlx::query("SELECT 1").execute(&self.reads).await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_synchronous_setting_is_taken_out_of_the_url() {
        let (url, s) = split_synchronous("sqlite://idem.db").unwrap();
        assert_eq!(url, "sqlite://idem.db");
        assert!(matches!(s, SqliteSynchronous::Full));
        let (url, s) = split_synchronous("sqlite://idem.db?synchronous=normal&mode=rwc").unwrap();
        assert_eq!(url, "sqlite://idem.db?mode=rwc");
        assert!(matches!(s, SqliteSynchronous::Normal));
        assert!(split_synchronous("sqlite://idem.db?synchronous=off").is_err());
    }
}
