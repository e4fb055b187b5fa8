//! The PostgreSQL store's operator listings and its count of records by phase. No index holds
//! every record by state (docs/performance.md#fewer-b-trees-per-write): each listing of a state
//! names that state as a constant, so that the planner can prove the predicate of the partial
//! index holding it, in a generic plan as in a custom one.
//!
//! | listing        | read through                                                        |
//! |----------------|---------------------------------------------------------------------|
//! | every state    | `records_listing` (created_at, id), from the cursor on              |
//! | `done`         | the same, skipping the others                                       |
//! | `unknown`      | `records_listing_unknown` (created_at, id)                          |
//! | `not_started`  | `records_queued` (created_at) and `records_free` (created_at, id), merged |
//! | `in_progress`  | `records_leases`: every record in progress read, the page sorted    |

use std::sync::LazyLock;

use sqlx::PgPool;
use uuid::Uuid;

use super::rows::COLUMNS;
use crate::domain::{Phase, State};
use crate::store::{decode, page, ListFilter, Page, StoreError};

/// The records after the cursor (`$1`, `$2`), of the route (`$3`) and tenant (`$4`) if given,
/// of `state` (`… AND`), oldest first, `$5` of them, ordered by `order`. Each row also carries
/// its id as a uuid (`order_id`), for a merge to order by.
fn after_cursor(state: &str, order: &str) -> String {
    format!(
        "SELECT {COLUMNS}, records.id AS order_id FROM records
         WHERE {state} (created_at, records.id) > ($1, $2::uuid)
           AND ($3::text IS NULL OR route = $3) AND ($4::text IS NULL OR tenant = $4)
         ORDER BY {order} LIMIT $5"
    )
}

static EVERY_STATE: LazyLock<String> = LazyLock::new(|| after_cursor("", "created_at, records.id"));
/// Most records are done: the walk of `records_listing` skips few.
static DONE: LazyLock<String> = LazyLock::new(|| after_cursor("state = 'done' AND", "created_at, records.id"));
static UNKNOWN: LazyLock<String> = LazyLock::new(|| after_cursor("state = 'unknown' AND", "created_at, records.id"));
/// Every record in progress holds a lease: as many as the work in flight. They are all read
/// and the page's worth sorted. Ordered by `created_at + 0`, which no index gives, or the
/// planner could walk `records_listing` from the cursor on, filtering, hoping to meet a page of
/// them soon — and read every record created since, as in-progress ones are the newest.
static IN_PROGRESS: LazyLock<String> =
    LazyLock::new(|| after_cursor("state = 'in_progress' AND", "created_at + 0, records.id"));
/// Queued and free records, each from its own index, a page of each merged. `records_queued`
/// holds `created_at` alone: its range starts at the cursor's time, and ties are sorted by id.
static NOT_STARTED: LazyLock<String> = LazyLock::new(|| {
    format!(
        "({}) UNION ALL ({}) ORDER BY created_at, order_id LIMIT $5",
        after_cursor("state = 'not_started' AND queued AND created_at >= $1 AND", "created_at, records.id"),
        after_cursor("state = 'not_started' AND NOT queued AND", "created_at, records.id"),
    )
});

/// The statement that lists records of `state` (of every state for `None`).
pub(super) fn statement(state: Option<State>) -> &'static str {
    match state {
        None => &EVERY_STATE,
        Some(State::Done) => &DONE,
        Some(State::Unknown) => &UNKNOWN,
        Some(State::InProgress) => &IN_PROGRESS,
        Some(State::NotStarted) => &NOT_STARTED,
    }
}

pub(super) async fn list(pool: &PgPool, filter: &ListFilter) -> Result<Page, StoreError> {
    let limit = filter.limit.clamp(1, 1000);
    // With no cursor, from before the first record: no creation time is `i64::MIN`.
    let (after_at, after_id) = match filter.cursor {
        Some(c) => (c.created_at.as_millis(), c.id),
        None => (i64::MIN, Uuid::nil()),
    };
    let rows = sqlx::query(statement(filter.state))
        .bind(after_at)
        .bind(after_id.to_string())
        .bind(filter.route.as_deref())
        .bind(filter.tenant.as_deref())
        .bind(i64::from(limit) + 1)
        .fetch_all(pool)
        .await?;
    page(rows.iter().map(decode).collect::<Result<Vec<_>, _>>()?, limit)
}

/// The records of each rare phase, each counted in the partial index that holds that phase
/// alone, and the whole table, counted from its primary key; `done` is what is left. One
/// statement reads one snapshot, so the figures add up.
pub(super) const COUNT: &str = "
SELECT (SELECT count(*) FROM records) AS records,
       (SELECT count(*) FROM records WHERE state = 'not_started' AND queued) AS queued,
       (SELECT count(*) FROM records WHERE state = 'not_started' AND NOT queued) AS free,
       (SELECT count(*) FROM records WHERE state = 'in_progress') AS in_progress,
       (SELECT count(*) FROM records WHERE state = 'unknown') AS unknown";

pub(super) async fn count_by_phase(pool: &PgPool) -> Result<Vec<(Phase, u64)>, StoreError> {
    let row = sqlx::query(COUNT).fetch_one(pool).await?;
    crate::store::listing::phases_of(&row)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every listing and the count read through their indexes, never the whole table, with a
    /// generic plan (the one a connection's cached statement ends up with) and sequential scans
    /// priced out: a query no index can serve would still scan.
    async fn plan(sql: String, conn: &mut sqlx::PgConnection) -> String {
        let plan: Vec<String> = sqlx::query_scalar(&format!("EXPLAIN {sql}")).fetch_all(conn).await.unwrap();
        plan.join("\n")
    }

    #[tokio::test]
    async fn listings_and_the_count_read_through_their_indexes() {
        let Some(scratch) = super::super::tests::scratch_store("idem_listing_plans").await else { return };
        let store = &scratch.store;
        let mut conn = store.pool.acquire().await.unwrap();
        sqlx::query("SET enable_seqscan = off").execute(&mut *conn).await.unwrap();
        sqlx::query("SET plan_cache_mode = force_generic_plan").execute(&mut *conn).await.unwrap();
        for (i, (state, indexes)) in [
            (None, vec!["records_listing"]),
            (Some(State::Done), vec!["records_listing"]),
            (Some(State::Unknown), vec!["records_listing_unknown"]),
            (Some(State::InProgress), vec!["records_leases"]),
            (Some(State::NotStarted), vec!["records_queued", "records_free"]),
        ]
        .into_iter()
        .enumerate()
        {
            let sql = statement(state);
            sqlx::query(&format!("PREPARE listing_{i} (int8, text, text, text, int8) AS {sql}"))
                .execute(&mut *conn)
                .await
                .unwrap();
            let plan = plan(format!("EXECUTE listing_{i}(1, '{}', NULL, NULL, 51)", Uuid::nil()), &mut *conn).await;
            for index in indexes {
                assert!(plan.contains(&format!(" {index} ")), "{sql}\nis planned as\n{plan}\nwithout {index}");
            }
            assert!(!plan.contains("Seq Scan"), "{sql}\nis planned as\n{plan}");
        }
        let counted = plan(COUNT.to_string(), &mut *conn).await;
        for index in ["records_queued", "records_free", "records_leases"] {
            assert!(counted.contains(&format!(" {index} ")), "{counted}");
        }
        drop(conn);
        scratch.remove().await;
    }
}
