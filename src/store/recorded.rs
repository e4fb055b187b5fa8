//! Recorded history, read for `idem simulate --history`: a route's requests since a time, with
//! their attempts, straight from the store a broker writes to. The reader is read-only and
//! applies no migration, so it can run beside live brokers (and beside a broker of another
//! version) without touching what they share; each backend's SQL lives with that backend.

use super::{postgres, sqlite, StoreError};
use crate::domain::RouteName;
use crate::domain::Timestamp;

pub use super::rows::Recorded;

/// Most requests one read returns: enough for a day of a busy route, few enough to hold and
/// replay in memory. More are reported as cut, never silently dropped.
pub const MAX_RECORDED: u32 = 500_000;

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
    pub async fn recorded(&self, route: &RouteName, since: Timestamp, limit: u32) -> Result<RecordedPage, StoreError> {
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
