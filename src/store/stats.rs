//! What the store answers for `/admin/stats`: aggregates each backend computes with its own SQL,
//! small enough to send whatever the traffic (one row per route, step and rounded duration),
//! which `admin::stats` assembles into series. Every node reads the same tables, so every node
//! answers for the whole cluster.

use std::time::Duration;

use crate::domain::{PolicyVersion, RouteName, Timestamp};
use crate::store::{Columns, StoreError};

/// Replays and 409s counted in memory by one node over one second, added to the store's
/// per-second counters (which sum what every node adds).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AnswerCount {
    pub route: RouteName,
    /// The start of the second, in ms since the epoch (a multiple of 1000).
    pub second: Timestamp,
    pub replays: u64,
    pub conflicts: u64,
}

/// Which records and counters the stats cover: `[start, end)` in steps of `step`, all whole
/// seconds so that the per-second counters fall into whole steps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatsSpan {
    pub start: Timestamp,
    pub end: Timestamp,
    pub step: Duration,
    /// One route, or all of them.
    pub route: Option<RouteName>,
}

/// Requests of one route that arrived in one step and, when `took_ms` is set, settled after
/// taking that long (to two significant figures: enough for percentiles, few enough groups).
/// Counts are over the requests of the group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bucket {
    pub route: RouteName,
    /// The step's index in the span.
    pub step: usize,
    /// From arrival to the end of the last attempt; `None` for requests not settled yet.
    pub took_ms: Option<u64>,
    pub requests: u64,
    /// Attempts stored with those records, and any in flight.
    pub attempts: u64,
    /// Requests whose execution has stopped (with any stop reason).
    pub settled: u64,
    pub succeeded: u64,
    pub first_try: u64,
    pub budget_stopped: u64,
    pub deadline_stopped: u64,
}

/// A record's time in the reconciliation queue: from the end of its last attempt to when it
/// was settled (`None`: it is still there).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownSpell {
    pub route: RouteName,
    pub entered: Timestamp,
    pub left: Option<Timestamp>,
}

/// Replays and 409s of one route in one step, summed over nodes and seconds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answers {
    pub route: RouteName,
    pub step: usize,
    pub replays: u64,
    pub conflicts: u64,
}

impl StatsSpan {
    /// The step in milliseconds, as the queries bucket times by it (at least 1).
    pub fn step_ms(&self) -> i64 {
        i64::try_from(self.step.as_millis()).unwrap_or(i64::MAX).max(1)
    }

    /// How many steps the span holds.
    pub fn points(&self) -> i64 {
        (self.end.as_millis() - self.start.as_millis()).max(0) / self.step_ms()
    }

    /// The end of step `i` (counted from 0).
    pub fn step_end(&self, i: i64) -> Timestamp {
        Timestamp::from_millis(self.start.as_millis().saturating_add((i + 1).saturating_mul(self.step_ms())))
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StatsRows {
    pub buckets: Vec<Bucket>,
    pub unknown: Vec<UnknownSpell>,
    pub answers: Vec<Answers>,
}

/// A step index read back from the database, checked to lie in the span.
pub(crate) fn step_index(span: &StatsSpan, index: i64) -> Option<usize> {
    (0..span.points()).contains(&index).then_some(index as usize)
}

/// A count read back from the database: never negative.
pub(crate) fn count(n: Option<i64>) -> u64 {
    n.unwrap_or(0).max(0) as u64
}

/// A bucket row of either backend: the requests of one route that arrived in one step.
pub(crate) fn bucket(span: &StatsSpan, row: &impl Columns) -> Result<Option<Bucket>, StoreError> {
    let n = |name: &str| -> Result<u64, StoreError> { Ok(count(row.integer(name)?)) };
    let Some(step) = step_index(span, required(row, "step")?) else { return Ok(None) };
    Ok(Some(Bucket {
        route: route(row)?,
        step,
        took_ms: row.integer("took_ms")?.map(|t| t.max(0) as u64),
        requests: n("requests")?,
        attempts: n("attempts")?,
        settled: n("settled")?,
        succeeded: n("succeeded")?,
        first_try: n("first_try")?,
        budget_stopped: n("budget_stopped")?,
        deadline_stopped: n("deadline_stopped")?,
    }))
}

/// A spell of one record in the unknown queue.
pub(crate) fn spell(row: &impl Columns) -> Result<UnknownSpell, StoreError> {
    Ok(UnknownSpell {
        route: route(row)?,
        entered: Timestamp::from_millis(required(row, "entered")?),
        left: row.time("left_at")?,
    })
}

/// The replays and 409s of one route in one step.
pub(crate) fn answer(span: &StatsSpan, row: &impl Columns) -> Result<Option<Answers>, StoreError> {
    let Some(step) = step_index(span, required(row, "step")?) else { return Ok(None) };
    Ok(Some(Answers {
        route: route(row)?,
        step,
        replays: count(row.integer("replays")?),
        conflicts: count(row.integer("conflicts")?),
    }))
}

fn required(row: &impl Columns, name: &str) -> Result<i64, StoreError> {
    row.integer(name)?.ok_or_else(|| StoreError::Corrupt(format!("column {name}")))
}

fn route(row: &impl Columns) -> Result<RouteName, StoreError> {
    let name = row.text("route")?.ok_or_else(|| StoreError::Corrupt("column route".into()))?;
    Ok(RouteName::from(name.as_str()))
}

/// The settled requests of one policy version (see [`crate::store::Store::sides`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Side {
    pub policy_version: PolicyVersion,
    pub requests: crate::policy::Cohort,
}

pub(crate) fn side(row: &impl Columns) -> Result<Side, StoreError> {
    let n = |name: &str| -> Result<u64, StoreError> { Ok(count(row.integer(name)?)) };
    Ok(Side {
        policy_version: PolicyVersion::from(row.text("policy_version")?.unwrap_or_default().as_str()),
        requests: crate::policy::Cohort {
            requests: n("requests")?,
            attempts: n("attempts")?,
            succeeded: n("succeeded")?,
        },
    })
}
