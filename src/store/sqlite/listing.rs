//! The SQLite store's operator listings and its count of records by phase. No index holds every
//! record by state (docs/performance.md#fewer-b-trees-per-write): each listing of a state reads
//! the index that holds the records in it, named with `INDEXED BY` so that the plan cannot
//! wander onto a walk of the whole table (and a statement fails loudly if its index is gone).
//!
//! | listing        | read through                                                        |
//! |----------------|---------------------------------------------------------------------|
//! | every state    | `records_listing` (created_at, id), from the cursor on              |
//! | `done`         | the same, skipping the others                                       |
//! | `unknown`      | `records_listing_unknown` (created_at, id)                          |
//! | `not_started`  | `records_queued` (created_at) and `records_free` (created_at, id), merged |
//! | `in_progress`  | `records_leases`: every record in progress read, the page sorted    |

use sqlx::sqlite::SqlitePool;

use crate::domain::{Phase, State};
use crate::store::{decode, page, ListFilter, Page, StoreError};

/// The records after the cursor (`?1`, `?2`) in `$index`, of the route (`?3`) and tenant (`?4`)
/// if given, oldest first, `?5` of them; `$state` (`… AND`) keeps those of a state.
macro_rules! after_cursor {
    ($index:literal, $state:literal) => {
        concat!(
            "SELECT * FROM records INDEXED BY ",
            $index,
            " WHERE ",
            $state,
            " (created_at, id) > (?1, ?2) AND (?3 IS NULL OR route = ?3) AND (?4 IS NULL OR tenant = ?4)
             ORDER BY created_at, id LIMIT ?5"
        )
    };
}

const EVERY_STATE: &str = after_cursor!("records_listing", "");
/// Most records are done: the walk skips few.
const DONE: &str = after_cursor!("records_listing", "state = 'done' AND");
const UNKNOWN: &str = after_cursor!("records_listing_unknown", "state = 'unknown' AND");
/// Every record in progress holds a lease: as many as the work in flight. They are all read,
/// and the page's worth sorted (SQLite's sorter keeps only `LIMIT` rows).
const IN_PROGRESS: &str = after_cursor!("records_leases", "state = 'in_progress' AND");
/// Queued and free records, each from its own index, a page of each merged. `records_queued`
/// holds `created_at` alone: its range starts at the cursor's time, and ties are sorted by id.
const NOT_STARTED: &str = concat!(
    "SELECT * FROM (SELECT * FROM (",
    after_cursor!("records_queued", "state = 'not_started' AND queued = 1 AND created_at >= ?1 AND"),
    ") UNION ALL SELECT * FROM (",
    after_cursor!("records_free", "state = 'not_started' AND queued = 0 AND"),
    ")) ORDER BY created_at, id LIMIT ?5"
);

/// The statement that lists records of `state` (of every state for `None`).
pub(super) fn statement(state: Option<State>) -> &'static str {
    match state {
        None => EVERY_STATE,
        Some(State::Done) => DONE,
        Some(State::Unknown) => UNKNOWN,
        Some(State::InProgress) => IN_PROGRESS,
        Some(State::NotStarted) => NOT_STARTED,
    }
}

pub(super) async fn list(reads: &SqlitePool, filter: &ListFilter) -> Result<Page, StoreError> {
    let limit = filter.limit.clamp(1, 1000);
    // With no cursor, from before the first record: no creation time is `i64::MIN`.
    let (after_at, after_id) = match filter.cursor {
        Some(c) => (c.created_at.as_millis(), c.id.to_string()),
        None => (i64::MIN, String::new()),
    };
    let rows = sqlx::query(statement(filter.state))
        .bind(after_at)
        .bind(after_id)
        .bind(filter.route.as_deref())
        .bind(filter.tenant.as_deref())
        .bind(limit as i64 + 1)
        .fetch_all(reads)
        .await?;
    page(rows.iter().map(decode).collect::<Result<Vec<_>, _>>()?, limit)
}

/// The records of each rare phase, each counted in the partial index that holds that phase
/// alone, and the whole table, which SQLite counts from its smallest index's pages without
/// reading their entries; `done` is what is left. One statement reads one snapshot, so the
/// figures add up.
pub(super) const COUNT: &str = "
SELECT (SELECT COUNT(*) FROM records) AS records,
       (SELECT COUNT(*) FROM records INDEXED BY records_queued
        WHERE state = 'not_started' AND queued = 1) AS queued,
       (SELECT COUNT(*) FROM records INDEXED BY records_free
        WHERE state = 'not_started' AND queued = 0) AS free,
       (SELECT COUNT(*) FROM records INDEXED BY records_leases WHERE state = 'in_progress') AS in_progress,
       (SELECT COUNT(*) FROM records INDEXED BY records_unknown WHERE state = 'unknown') AS unknown";

pub(super) async fn count_by_phase(reads: &SqlitePool) -> Result<Vec<(Phase, u64)>, StoreError> {
    let row = sqlx::query(COUNT).fetch_one(reads).await?;
    crate::store::listing::phases_of(&row)
}

#[cfg(test)]
mod tests {
    use super::*;
    use sqlx::Row;

    /// Every listing and the count read through the indexes named above: an index that a
    /// later migration drops fails these plans here rather than an operator's listing.
    #[tokio::test]
    async fn listings_and_the_count_read_through_their_indexes() {
        let dir = tempfile::TempDir::new().unwrap();
        let url = format!("sqlite://{}", dir.path().join("idem.db").display());
        let store = super::super::SqliteStore::open(&url, crate::config::Durability::Full).await.unwrap();
        let plan = |sql: String| {
            let reads = store.reads.clone();
            async move {
                sqlx::query(&format!("EXPLAIN QUERY PLAN {sql}"))
                    .fetch_all(&reads)
                    .await
                    .unwrap()
                    .iter()
                    .map(|row| row.get::<String, _>("detail"))
                    .collect::<Vec<_>>()
                    .join("\n")
            }
        };
        for (state, wanted) in [
            (None, vec!["SEARCH records USING INDEX records_listing ((created_at,id)>(?,?))"]),
            (Some(State::Done), vec!["SEARCH records USING INDEX records_listing ((created_at,id)>(?,?))"]),
            (Some(State::Unknown), vec!["SEARCH records USING INDEX records_listing_unknown ((created_at,id)>(?,?))"]),
            (Some(State::InProgress), vec!["records USING INDEX records_leases", "TEMP B-TREE FOR ORDER BY"]),
            (
                Some(State::NotStarted),
                vec![
                    "SEARCH records USING INDEX records_queued (created_at>?)",
                    "MERGE (UNION ALL)",
                    "SEARCH records USING INDEX records_free ((created_at,id)>(?,?))",
                ],
            ),
        ] {
            let sql = statement(state);
            let plan = plan(sql.to_string()).await;
            for wanted in wanted {
                assert!(plan.contains(wanted), "{sql}\nis planned as\n{plan}\nwithout {wanted}");
            }
            assert!(!plan.contains("SCAN records\n") && !plan.ends_with("SCAN records"), "{plan}");
        }
        let counted = plan(COUNT.to_string()).await;
        for index in ["records_queued", "records_free", "records_leases", "records_unknown"] {
            assert!(counted.contains(&format!("USING COVERING INDEX {index}")), "{counted}");
        }
    }
}
