//! Operator listings: which records, in what order, a page at a time.

use uuid::Uuid;

use super::StoreError;
use crate::domain::{Phase, RouteName, State, Tenant, Timestamp};
use crate::record::Record;

/// Which records an operator listing shows, oldest first (a queue is worked from its head);
/// `cursor` continues a listing after the last record shown.
#[derive(Debug, Clone, Default)]
pub struct ListFilter {
    pub state: Option<State>,
    pub route: Option<RouteName>,
    pub tenant: Option<Tenant>,
    pub limit: u32,
    pub cursor: Option<Cursor>,
}

/// A position in a listing: the last record shown (listings are ordered by creation, then id).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cursor {
    pub created_at: Timestamp,
    pub id: Uuid,
}

impl Cursor {
    pub fn of(record: &Record) -> Cursor {
        Cursor { created_at: record.created_at, id: record.id.0 }
    }

    /// An opaque token for clients: `<created_at>.<id>`.
    pub fn encode(&self) -> String {
        format!("{}.{}", self.created_at, self.id.simple())
    }

    pub fn decode(token: &str) -> Option<Cursor> {
        let (at, id) = token.split_once('.')?;
        Some(Cursor { created_at: Timestamp::from_millis(at.parse().ok()?), id: Uuid::parse_str(id).ok()? })
    }
}

#[derive(Debug, Clone)]
pub struct Page {
    pub items: Vec<Record>,
    pub next_cursor: Option<Cursor>,
}

/// A page of `limit` records from rows fetched with `limit + 1`: the extra row only says that
/// more follow.
pub fn page(mut items: Vec<Record>, limit: u32) -> Result<Page, StoreError> {
    let more = items.len() > limit as usize;
    items.truncate(limit as usize);
    let next_cursor = if more { items.last().map(Cursor::of) } else { None };
    Ok(Page { items, next_cursor })
}

/// The count of every phase, from a row of both stores' count statement (`records`, `queued`,
/// `free`, `in_progress`, `unknown`, read in one snapshot): `done` is what is left.
pub(crate) fn phases_of<R>(row: &R) -> Result<Vec<(Phase, u64)>, StoreError>
where
    R: sqlx::Row,
    for<'a> &'a str: sqlx::ColumnIndex<R>,
    i64: for<'r> sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    let count = |name: &str| -> Result<u64, StoreError> {
        u64::try_from(row.try_get::<i64, _>(name)?).map_err(|_| StoreError::Corrupt(format!("count of {name}")))
    };
    phases(count("records")?, count("queued")?, count("free")?, count("in_progress")?, count("unknown")?)
}

/// The count of every phase, from the count of all records and of each phase but `done`.
fn phases(
    records: u64,
    queued: u64,
    free: u64,
    in_progress: u64,
    unknown: u64,
) -> Result<Vec<(Phase, u64)>, StoreError> {
    let others = queued + free + in_progress + unknown;
    let done = records.checked_sub(others).ok_or_else(|| {
        StoreError::Corrupt(format!("{records} records, of which {others} are not done, counted in one snapshot"))
    })?;
    Ok(vec![
        (Phase::Queued, queued),
        (Phase::Free, free),
        (Phase::InProgress, in_progress),
        (Phase::Done, done),
        (Phase::Unknown, unknown),
    ])
}
