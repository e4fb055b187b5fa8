//! The SQLite store's SQL for `/admin/stats`: three aggregate reads on the read pool, and the
//! per-second answer counters, added through the one writing connection.

use rusqlite::{params, Connection};
use sqlx::sqlite::SqlitePool;

use crate::domain::HistoryAction;
use crate::domain::RouteName;
use crate::domain::Timestamp;
use crate::store::stats::{answer, bucket, side, spell, Side, StatsRows, StatsSpan};
use crate::store::{AddAnswerCounts, StoreError};

/// Requests by route, step of arrival and duration rounded down to two significant figures
/// (`substr(…, 1, 2)` and zeros for the other digits). The range on `created_at` is served by
/// `records_listing`; the attempts are counted from the stored list, plus one in flight.
const BUCKETS: &str = "
SELECT route, step,
       CAST(substr(took, 1, 2) || substr('0000000000000000000', 1, MAX(length(took) - 2, 0)) AS INTEGER) AS took_ms,
       COUNT(*) AS requests,
       SUM(attempts) AS attempts,
       SUM(stop_reason IS NOT NULL) AS settled,
       SUM(stop_reason = 'success') AS succeeded,
       SUM(stop_reason = 'success' AND attempts = 1) AS first_try,
       SUM(stop_reason IN ('retry_budget', 'tenant_budget', 'upstream_budget')) AS budget_stopped,
       SUM(stop_reason = 'deadline') AS deadline_stopped
FROM (
    SELECT route, stop_reason, (created_at - ?1) / ?3 AS step,
           json_array_length(attempts) + (in_flight_number IS NOT NULL) AS attempts,
           CASE WHEN stop_reason IS NOT NULL THEN CAST(MAX(0, COALESCE(
               json_extract(attempts, '$[#-1].started_at') + json_extract(attempts, '$[#-1].duration_ms'),
               updated_at) - created_at) AS TEXT) END AS took
    FROM records
    WHERE created_at >= ?1 AND created_at < ?2 AND (?4 IS NULL OR route = ?4)
)
GROUP BY route, step, took_ms";

/// Records that went to the reconciliation queue (`records_went_unknown`) and were still there,
/// or left it, during the span.
const UNKNOWN: &str = "
SELECT route,
       COALESCE(json_extract(attempts, '$[#-1].started_at') + json_extract(attempts, '$[#-1].duration_ms'),
                updated_at) AS entered,
       CASE WHEN state = 'unknown' THEN NULL ELSE updated_at END AS left_at
FROM records
WHERE stop_reason = 'unsafe_replay' AND created_at < ?2
  AND (state = 'unknown' OR updated_at >= ?1) AND (?3 IS NULL OR route = ?3)";

const ANSWERS: &str = "
SELECT route, (second_start - ?1) / ?3 AS step, SUM(replays) AS replays, SUM(conflicts) AS conflicts
FROM answer_counts
WHERE second_start >= ?1 AND second_start < ?2 AND (?4 IS NULL OR route = ?4)
GROUP BY route, step";

/// Settled requests of a route since a time, by the policy version of their attempts; the range
/// on `created_at` is served by `records_listing`. A key freed and sent again is one record but
/// two executions: each `requeued` entry of its history counts as one more request.
const SIDES: &str = "
SELECT policy_version,
       SUM(1 + (SELECT COUNT(*) FROM json_each(history) WHERE json_extract(value, '$.action') = ?3))
           AS requests,
       SUM(json_array_length(attempts)) AS attempts,
       SUM(stop_reason = 'success') AS succeeded
FROM records
WHERE created_at >= ?2 AND route = ?1 AND stop_reason IS NOT NULL AND policy_version IS NOT NULL
GROUP BY policy_version";

pub(super) async fn sides(reads: &SqlitePool, route: &RouteName, since: Timestamp) -> Result<Vec<Side>, StoreError> {
    let requeued = HistoryAction::Requeued.to_string();
    let rows = sqlx::query(SIDES).bind(route).bind(since).bind(requeued).fetch_all(reads).await?;
    rows.iter().map(side).collect()
}

pub(super) async fn read(reads: &SqlitePool, span: &StatsSpan) -> Result<StatsRows, StoreError> {
    let route = span.route.as_deref();
    let buckets =
        sqlx::query(BUCKETS).bind(span.start).bind(span.end).bind(span.step_ms()).bind(route).fetch_all(reads).await?;
    let unknown = sqlx::query(UNKNOWN).bind(span.start).bind(span.end).bind(route).fetch_all(reads).await?;
    let answers =
        sqlx::query(ANSWERS).bind(span.start).bind(span.end).bind(span.step_ms()).bind(route).fetch_all(reads).await?;
    Ok(StatsRows {
        buckets: buckets.iter().filter_map(|row| bucket(span, row).transpose()).collect::<Result<_, _>>()?,
        unknown: unknown.iter().map(spell).collect::<Result<_, _>>()?,
        answers: answers.iter().filter_map(|row| answer(span, row).transpose()).collect::<Result<_, _>>()?,
    })
}

/// Adds one node's counts to the per-second counters and forgets those before `forget_before`
/// (the primary key starts with the second, so that is a range at the table's head).
pub(super) fn add_answer_counts(conn: &Connection, add: AddAnswerCounts) -> Result<(), StoreError> {
    let AddAnswerCounts { counts, forget_before } = add;
    let mut add = conn.prepare_cached(
        "INSERT INTO answer_counts (second_start, route, replays, conflicts) VALUES (?1, ?2, ?3, ?4)
         ON CONFLICT (second_start, route) DO UPDATE SET
             replays = replays + excluded.replays, conflicts = conflicts + excluded.conflicts",
    )?;
    for c in counts {
        add.execute(params![c.second, c.route, c.replays as i64, c.conflicts as i64])?;
    }
    conn.prepare_cached("DELETE FROM answer_counts WHERE second_start < ?1")?.execute([forget_before])?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use sqlx::Row;

    /// However large the table, the stats read a window's records through an index: the ones
    /// that arrived in it, or the few that went to the reconciliation queue.
    #[tokio::test]
    async fn the_stats_queries_read_through_indexes() {
        let dir = tempfile::TempDir::new().unwrap();
        let url = format!("sqlite://{}", dir.path().join("idem.db").display());
        let store = super::super::SqliteStore::open(&url, crate::config::Durability::Full).await.unwrap();
        for (sql, index) in [
            (BUCKETS, "USING INDEX records_listing (created_at>? AND created_at<?)"),
            (UNKNOWN, "USING INDEX records_went_unknown (created_at<?)"),
            (ANSWERS, "USING PRIMARY KEY (second_start>? AND second_start<?)"),
            (SIDES, "USING INDEX records_listing (created_at>?)"),
        ] {
            let plan = sqlx::query(&format!("EXPLAIN QUERY PLAN {sql}"))
                .fetch_all(&store.reads)
                .await
                .unwrap()
                .iter()
                .map(|row| row.get::<String, _>("detail"))
                .collect::<Vec<_>>()
                .join("\n");
            assert!(plan.contains(index), "{sql}\nis planned as\n{plan}");
        }
    }
}
