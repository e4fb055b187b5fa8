//! Recorded history, read for `idem simulate --history`: a route's requests since a time, with
//! their attempts, straight from the store a broker writes to. The reader is read-only and
//! applies no migration, so it can run beside live brokers (and beside a broker of another
//! version) without touching what they share; each backend's SQL lives with that backend.

use uuid::Uuid;

use super::{postgres, sqlite, Columns, StoreError};
use crate::domain::HistoryAction;
use crate::domain::StopReason;
use crate::domain::{State, Timestamp};
use crate::record::{Attempt, HistoryEntry};

/// Most requests one read returns: enough for a day of a busy route, few enough to hold and
/// replay in memory. More are reported as cut, never silently dropped.
pub const MAX_RECORDED: u32 = 500_000;

/// One request of the route as recorded, with what a replay needs of it.
#[derive(Debug, Clone, PartialEq)]
pub struct Recorded {
    pub id: Uuid,
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

/// What [`Reader::recorded`] found: the requests in order of arrival, and whether more matched.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RecordedPage {
    pub requests: Vec<Recorded>,
    /// More requests matched than the limit: the latest were left out.
    pub cut: bool,
}

/// A read-only connection to the store named by a `store.url`.
pub enum Reader {
    Sqlite(sqlx::SqlitePool),
    Postgres(sqlx::PgPool),
}

impl Reader {
    /// Opens the store read-only. A SQLite file that does not exist is an error, not a new
    /// database; so is a database without Idem's tables.
    pub async fn open(url: &str) -> Result<Reader, StoreError> {
        if url.starts_with("sqlite:") {
            Ok(Reader::Sqlite(sqlite::recorded::open(url).await?))
        } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            Ok(Reader::Postgres(postgres::recorded::open(url).await?))
        } else {
            Err(StoreError::Unavailable(format!("unsupported store url `{url}`")))
        }
    }

    /// The requests of `route` that arrived at or after `since`, oldest first, at most `limit`.
    pub async fn recorded(&self, route: &str, since: Timestamp, limit: u32) -> Result<RecordedPage, StoreError> {
        let limit = limit.clamp(1, MAX_RECORDED);
        let mut requests = match self {
            Reader::Sqlite(pool) => sqlite::recorded::read(pool, route, since, limit + 1).await?,
            Reader::Postgres(pool) => postgres::recorded::read(pool, route, since, limit + 1).await?,
        };
        let cut = requests.len() > limit as usize;
        requests.truncate(limit as usize);
        Ok(RecordedPage { requests, cut })
    }

    pub async fn close(self) {
        match self {
            Reader::Sqlite(pool) => pool.close().await,
            Reader::Postgres(pool) => pool.close().await,
        }
    }
}

/// Reads one row of either backend's query: `id`, `created_at`, `deadline_at`, `state`,
/// `stop_reason`, `attempts` (JSON text), `in_flight` and `tombstone` (flags).
/// The times of a stored history's `requeued` entries, oldest first.
fn requeued_at(history: &str) -> Result<Vec<Timestamp>, StoreError> {
    let entries: Vec<HistoryEntry> = serde_json::from_str(history)?;
    let mut at: Vec<Timestamp> = entries.iter().filter(|e| e.action == HistoryAction::Requeued).map(|e| e.at).collect();
    at.sort_unstable();
    Ok(at)
}

pub(crate) fn decode(row: &impl Columns) -> Result<Recorded, StoreError> {
    let corrupt = |what: &str| StoreError::Corrupt(format!("column {what}"));
    let text = |name: &'static str| row.text(name)?.ok_or_else(|| corrupt(name));
    let mut attempts: Vec<Attempt> = serde_json::from_str(&text("attempts")?)?;
    attempts.sort_by_key(|a| a.number);
    Ok(Recorded {
        id: Uuid::parse_str(&text("id")?).map_err(|_| corrupt("id"))?,
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
