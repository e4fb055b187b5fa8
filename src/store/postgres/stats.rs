//! The PostgreSQL store's SQL for `/admin/stats`: the same three aggregates as the SQLite
//! store's, and the per-second answer counters, added by one statement per batch.

use sqlx::postgres::PgPool;

use crate::domain::HistoryAction;
use crate::domain::RouteName;
use crate::domain::Timestamp;
use crate::store::stats::{answer, bucket, side, spell, AnswerCount, Side, StatsRows, StatsSpan};
use crate::store::StoreError;

/// Requests by route, step of arrival and duration rounded down to two significant figures
/// (`rpad(left(…, 2), …, '0')`). The range on `created_at` is served by `records_listing`; the
/// attempts are counted from the stored list, plus one in flight.
const BUCKETS: &str = "
SELECT route, step,
       CASE WHEN stop_reason_set THEN rpad(left(took::text, 2), length(took::text), '0')::bigint END AS took_ms,
       COUNT(*) AS requests,
       SUM(attempts)::bigint AS attempts,
       COUNT(*) FILTER (WHERE stop_reason IS NOT NULL) AS settled,
       COUNT(*) FILTER (WHERE stop_reason = 'success') AS succeeded,
       COUNT(*) FILTER (WHERE stop_reason = 'success' AND attempts = 1) AS first_try,
       COUNT(*) FILTER (WHERE stop_reason IN ('retry_budget', 'tenant_budget', 'upstream_budget')) AS budget_stopped,
       COUNT(*) FILTER (WHERE stop_reason = 'deadline') AS deadline_stopped
FROM (
    SELECT route, stop_reason, stop_reason IS NOT NULL AS stop_reason_set, (created_at - $1) / $3 AS step,
           jsonb_array_length(attempts) + CASE WHEN in_flight_number IS NULL THEN 0 ELSE 1 END AS attempts,
           GREATEST(0, COALESCE((attempts -> -1 ->> 'started_at')::bigint + (attempts -> -1 ->> 'duration_ms')::bigint,
                                updated_at) - created_at) AS took
    FROM records
    WHERE created_at >= $1 AND created_at < $2 AND ($4::text IS NULL OR route = $4)
) AS arrived
GROUP BY route, step, 3";

/// Records that went to the reconciliation queue (`records_went_unknown`) and were still there,
/// or left it, during the span.
const UNKNOWN: &str = "
SELECT route,
       COALESCE((attempts -> -1 ->> 'started_at')::bigint + (attempts -> -1 ->> 'duration_ms')::bigint,
                updated_at) AS entered,
       CASE WHEN state = 'unknown' THEN NULL ELSE updated_at END AS left_at
FROM records
WHERE stop_reason = 'unsafe_replay' AND created_at < $2
  AND (state = 'unknown' OR updated_at >= $1) AND ($3::text IS NULL OR route = $3)";

const ANSWERS: &str = "
SELECT route, (second_start - $1) / $3 AS step, SUM(replays)::bigint AS replays, SUM(conflicts)::bigint AS conflicts
FROM answer_counts
WHERE second_start >= $1 AND second_start < $2 AND ($4::text IS NULL OR route = $4)
GROUP BY route, step";

/// Adds a batch in one statement; a second counted by several nodes gets each one's share.
const ADD: &str = "
INSERT INTO answer_counts (second_start, route, replays, conflicts)
SELECT * FROM UNNEST($1::bigint[], $2::text[], $3::bigint[], $4::bigint[])
ON CONFLICT (second_start, route) DO UPDATE SET
    replays = answer_counts.replays + excluded.replays,
    conflicts = answer_counts.conflicts + excluded.conflicts";

/// Settled requests of a route since a time, by the policy version of their attempts. A key
/// freed and sent again is one record but two executions: each `requeued` entry of its history
/// counts as one more request.
const SIDES: &str = "
SELECT policy_version,
       SUM(1 + (SELECT COUNT(*) FROM jsonb_array_elements(history) AS h WHERE h ->> 'action' = $3))::bigint
           AS requests,
       SUM(jsonb_array_length(attempts))::bigint AS attempts,
       COUNT(*) FILTER (WHERE stop_reason = 'success') AS succeeded
FROM records
WHERE created_at >= $2 AND route = $1 AND stop_reason IS NOT NULL AND policy_version IS NOT NULL
GROUP BY policy_version";

pub(super) async fn sides(pool: &PgPool, route: &RouteName, since: Timestamp) -> Result<Vec<Side>, StoreError> {
    let requeued = HistoryAction::Requeued.to_string();
    let rows = sqlx::query(SIDES).bind(route).bind(since).bind(requeued).fetch_all(pool).await?;
    rows.iter().map(side).collect()
}

pub(super) async fn read(pool: &PgPool, span: &StatsSpan) -> Result<StatsRows, StoreError> {
    let route = span.route.as_deref();
    let buckets =
        sqlx::query(BUCKETS).bind(span.start).bind(span.end).bind(span.step_ms()).bind(route).fetch_all(pool).await?;
    let unknown = sqlx::query(UNKNOWN).bind(span.start).bind(span.end).bind(route).fetch_all(pool).await?;
    let answers =
        sqlx::query(ANSWERS).bind(span.start).bind(span.end).bind(span.step_ms()).bind(route).fetch_all(pool).await?;
    Ok(StatsRows {
        buckets: buckets.iter().filter_map(|row| bucket(span, row).transpose()).collect::<Result<_, _>>()?,
        unknown: unknown.iter().map(spell).collect::<Result<_, _>>()?,
        answers: answers.iter().filter_map(|row| answer(span, row).transpose()).collect::<Result<_, _>>()?,
    })
}

/// Adds one node's counts and forgets counters before `forget_before`, in one transaction.
pub(super) async fn add_answer_counts(
    pool: &PgPool,
    counts: Vec<AnswerCount>,
    forget_before: Timestamp,
) -> Result<(), StoreError> {
    let mut tx = pool.begin().await?;
    if !counts.is_empty() {
        let seconds: Vec<Timestamp> = counts.iter().map(|c| c.second).collect();
        let routes: Vec<&crate::domain::RouteName> = counts.iter().map(|c| &c.route).collect();
        let replays: Vec<i64> = counts.iter().map(|c| c.replays as i64).collect();
        let conflicts: Vec<i64> = counts.iter().map(|c| c.conflicts as i64).collect();
        sqlx::query(ADD).bind(seconds).bind(routes).bind(replays).bind(conflicts).execute(&mut *tx).await?;
    }
    sqlx::query("DELETE FROM answer_counts WHERE second_start < $1").bind(forget_before).execute(&mut *tx).await?;
    tx.commit().await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The stats read a window's records through an index — the ones that arrived in it
    /// (`records_listing`), or those that went to the reconciliation queue
    /// (`records_went_unknown`, whose predicate the query must imply) — never the whole table.
    /// With sequential scans priced out, a query that no index can serve would still scan.
    #[tokio::test]
    async fn the_stats_queries_read_through_indexes() {
        let Some(scratch) = super::super::tests::scratch_store("idem_stats_plans").await else { return };
        let store = &scratch.store;

        let mut conn = store.pool.acquire().await.unwrap();
        sqlx::query("SET enable_seqscan = off").execute(&mut *conn).await.unwrap();
        let statements = [
            (BUCKETS, "int8, int8, int8, text", "records_listing"),
            (UNKNOWN, "int8, int8, text", "records_went_unknown"),
            (ANSWERS, "int8, int8, int8, text", "answer_counts_pkey"),
        ];
        for (i, (sql, types, index)) in statements.into_iter().enumerate() {
            sqlx::query(&format!("PREPARE stats_{i} ({types}) AS {sql}")).execute(&mut *conn).await.unwrap();
            let args = types.split(", ").map(|t| if t == "text" { "NULL" } else { "1" }).collect::<Vec<_>>().join(", ");
            let plan: Vec<String> =
                sqlx::query_scalar(&format!("EXPLAIN EXECUTE stats_{i}({args})")).fetch_all(&mut *conn).await.unwrap();
            let plan = plan.join("\n");
            assert!(plan.contains(index) && !plan.contains("Seq Scan"), "{sql}\nis planned as\n{plan}");
        }
        drop(conn);
        scratch.remove().await;
    }
}
