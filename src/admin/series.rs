//! The series of `/admin/stats`, assembled from the store's aggregates: pure arithmetic, no I/O
//! and no clock, so every curve is tested here row by row.
//!
//! Each request is counted in the step it arrived in, with everything that became of it: its
//! attempts (so a step's amplification is what its requests cost the upstream), whether it
//! succeeded at once or after a retry, why it stopped and how long it took. Replays and 409s
//! come from the per-second answer counters; the reconciliation queue's depth is its depth at
//! the end of each step, rebuilt from when records entered and left it.

use std::collections::BTreeMap;

use serde_json::{json, Map, Value};

use crate::domain::Timestamp;
use crate::store::stats::{StatsRows, StatsSpan, UnknownSpell};

/// One route's series, a value per step.
#[derive(Debug, Clone, Default, PartialEq)]
pub(super) struct RouteSeries {
    requests: Vec<u64>,
    attempts: Vec<u64>,
    settled: Vec<u64>,
    succeeded: Vec<u64>,
    first_try: Vec<u64>,
    budget_stopped: Vec<u64>,
    deadline_stopped: Vec<u64>,
    replays: Vec<u64>,
    conflicts: Vec<u64>,
    unknown_depth: Vec<u64>,
    /// Settled requests by duration (ms, two significant figures), for the percentiles.
    took: Vec<BTreeMap<u64, u64>>,
}

impl RouteSeries {
    fn new(points: usize) -> RouteSeries {
        let zeros = vec![0; points];
        RouteSeries {
            requests: zeros.clone(),
            attempts: zeros.clone(),
            settled: zeros.clone(),
            succeeded: zeros.clone(),
            first_try: zeros.clone(),
            budget_stopped: zeros.clone(),
            deadline_stopped: zeros.clone(),
            replays: zeros.clone(),
            conflicts: zeros.clone(),
            unknown_depth: zeros,
            took: vec![BTreeMap::new(); points],
        }
    }
}

/// Sorts the store's rows into a series per route of `routes` (rows of other routes are left
/// out). `now` is when the queue's depth of the last step is read.
pub(super) fn assemble(
    span: &StatsSpan,
    now: Timestamp,
    routes: &[&str],
    rows: &StatsRows,
) -> Vec<(String, RouteSeries)> {
    let points = span.points() as usize;
    let mut series: Vec<(String, RouteSeries)> =
        routes.iter().map(|r| (r.to_string(), RouteSeries::new(points))).collect();
    let index: BTreeMap<&str, usize> = routes.iter().enumerate().map(|(i, r)| (*r, i)).collect();
    let of = |route: &str| index.get(route).copied();
    for c in &rows.buckets {
        let (Some(r), true) = (of(&c.route), c.step < points) else { continue };
        let s = &mut series[r].1;
        let i = c.step;
        s.requests[i] += c.requests;
        s.attempts[i] += c.attempts;
        s.settled[i] += c.settled;
        s.succeeded[i] += c.succeeded;
        s.first_try[i] += c.first_try;
        s.budget_stopped[i] += c.budget_stopped;
        s.deadline_stopped[i] += c.deadline_stopped;
        if let Some(took) = c.took_ms {
            *s.took[i].entry(took).or_default() += c.settled;
        }
    }
    for a in &rows.answers {
        let (Some(r), true) = (of(&a.route), a.step < points) else { continue };
        series[r].1.replays[a.step] += a.replays;
        series[r].1.conflicts[a.step] += a.conflicts;
    }
    let samples = depth_sample_times(span, now);
    for (route, s) in &mut series {
        let spells = rows.unknown.iter().filter(|u| u.route.as_str() == route);
        s.unknown_depth = depth(&samples, spells);
    }
    series
}

/// When each step's queue depth is read: at its end, or `now` for the step still filling.
fn depth_sample_times(span: &StatsSpan, now: Timestamp) -> Vec<Timestamp> {
    (0..span.points()).map(|i| span.step_end(i).min(now)).collect()
}

/// How many records were in the queue at each of `samples` (ascending): those that had entered
/// by then and not yet left.
fn depth<'a>(samples: &[Timestamp], spells: impl Iterator<Item = &'a UnknownSpell>) -> Vec<u64> {
    let mut change = vec![0i64; samples.len() + 1];
    for spell in spells {
        let from = samples.partition_point(|&t| t < spell.entered);
        let until = spell.left.map_or(samples.len(), |left| samples.partition_point(|&t| t < left));
        if from < until {
            change[from] += 1;
            change[until] -= 1;
        }
    }
    let mut depth = 0i64;
    change[..samples.len()]
        .iter()
        .map(|c| {
            depth += c;
            depth.max(0) as u64
        })
        .collect()
}

/// The `q`-quantile (nearest rank) of a histogram of values and their counts.
pub(super) fn quantile(histogram: &BTreeMap<u64, u64>, q: f64) -> Option<u64> {
    let total: u64 = histogram.values().sum();
    if total == 0 {
        return None;
    }
    let rank = ((q.clamp(0.0, 1.0) * total as f64).ceil() as u64).max(1);
    let mut seen = 0;
    histogram.iter().find_map(|(value, n)| {
        seen += n;
        (seen >= rank).then_some(*value)
    })
}

/// `part / whole`, rounded for display; `None` (drawn as a gap) when there is no whole.
fn ratio(part: u64, whole: u64) -> Option<f64> {
    (whole > 0).then(|| (part as f64 / whole as f64 * 10_000.0).round() / 10_000.0)
}

/// The curves, each a series per route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Curve {
    /// Logical requests: records created.
    Requests,
    /// Physical attempts those requests made.
    Attempts,
    Amplification,
    FirstTrySuccess,
    FinalSuccess,
    /// Requests that succeeded only after a retry.
    RetrySalvaged,
    BudgetStopped,
    DeadlineStopped,
    Replays,
    /// 409 `request-in-progress` answers.
    Conflicts,
    UnknownDepth,
    P50,
    P99,
    /// Requests whose execution has stopped: what the rates are fractions of.
    Settled,
}

impl Curve {
    /// In the order the answer lists them.
    pub(super) const ALL: [Curve; 14] = [
        Curve::Requests,
        Curve::Attempts,
        Curve::Amplification,
        Curve::FirstTrySuccess,
        Curve::FinalSuccess,
        Curve::RetrySalvaged,
        Curve::BudgetStopped,
        Curve::DeadlineStopped,
        Curve::Replays,
        Curve::Conflicts,
        Curve::UnknownDepth,
        Curve::P50,
        Curve::P99,
        Curve::Settled,
    ];

    pub(super) fn name(self) -> &'static str {
        match self {
            Curve::Requests => "requests",
            Curve::Attempts => "attempts",
            Curve::Amplification => "amplification",
            Curve::FirstTrySuccess => "first_try_success",
            Curve::FinalSuccess => "final_success",
            Curve::RetrySalvaged => "retry_salvaged",
            Curve::BudgetStopped => "budget_stopped",
            Curve::DeadlineStopped => "deadline_stopped",
            Curve::Replays => "replays",
            Curve::Conflicts => "conflicts",
            Curve::UnknownDepth => "unknown_depth",
            Curve::P50 => "p50_ms",
            Curve::P99 => "p99_ms",
            Curve::Settled => "settled",
        }
    }
}

/// The counts behind one point of every curve: a step's, or the whole window's.
struct Figures<'a> {
    requests: u64,
    attempts: u64,
    settled: u64,
    succeeded: u64,
    first_try: u64,
    budget_stopped: u64,
    deadline_stopped: u64,
    replays: u64,
    conflicts: u64,
    unknown_depth: u64,
    took: &'a BTreeMap<u64, u64>,
}

impl Figures<'_> {
    /// Rates are over the settled requests, so that requests still running do not pull a step
    /// down; amplification counts their attempts so far.
    fn value(&self, curve: Curve) -> Value {
        match curve {
            Curve::Requests => json!(self.requests),
            Curve::Attempts => json!(self.attempts),
            Curve::Amplification => json!(ratio(self.attempts, self.requests)),
            Curve::FirstTrySuccess => json!(ratio(self.first_try, self.settled)),
            Curve::FinalSuccess => json!(ratio(self.succeeded, self.settled)),
            Curve::RetrySalvaged => json!(self.succeeded.saturating_sub(self.first_try)),
            Curve::BudgetStopped => json!(self.budget_stopped),
            Curve::DeadlineStopped => json!(self.deadline_stopped),
            Curve::Replays => json!(self.replays),
            Curve::Conflicts => json!(self.conflicts),
            Curve::UnknownDepth => json!(self.unknown_depth),
            Curve::P50 => json!(quantile(self.took, 0.5)),
            Curve::P99 => json!(quantile(self.took, 0.99)),
            Curve::Settled => json!(self.settled),
        }
    }
}

impl RouteSeries {
    fn at(&self, i: usize) -> Figures<'_> {
        Figures {
            requests: self.requests[i],
            attempts: self.attempts[i],
            settled: self.settled[i],
            succeeded: self.succeeded[i],
            first_try: self.first_try[i],
            budget_stopped: self.budget_stopped[i],
            deadline_stopped: self.deadline_stopped[i],
            replays: self.replays[i],
            conflicts: self.conflicts[i],
            unknown_depth: self.unknown_depth[i],
            took: &self.took[i],
        }
    }

    /// The series as `/admin/stats` shows them, and `totals`: the same curves over the whole
    /// window (the queue's depth as it is now).
    pub(super) fn to_json(&self) -> Value {
        let steps: Vec<Figures> = (0..self.requests.len()).map(|i| self.at(i)).collect();
        let sum = |v: &Vec<u64>| v.iter().sum::<u64>();
        let mut took = BTreeMap::new();
        for (value, count) in self.took.iter().flatten() {
            *took.entry(*value).or_default() += count;
        }
        let whole = Figures {
            requests: sum(&self.requests),
            attempts: sum(&self.attempts),
            settled: sum(&self.settled),
            succeeded: sum(&self.succeeded),
            first_try: sum(&self.first_try),
            budget_stopped: sum(&self.budget_stopped),
            deadline_stopped: sum(&self.deadline_stopped),
            replays: sum(&self.replays),
            conflicts: sum(&self.conflicts),
            unknown_depth: self.unknown_depth.last().copied().unwrap_or(0),
            took: &took,
        };
        let mut series = Map::new();
        let mut totals = Map::new();
        for curve in Curve::ALL {
            series.insert(curve.name().into(), steps.iter().map(|f| f.value(curve)).collect());
            totals.insert(curve.name().into(), whole.value(curve));
        }
        json!({"series": series, "totals": totals})
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::stats::{Answers, Bucket};
    use std::time::Duration;

    #[test]
    fn quantiles_are_nearest_rank_over_the_histogram() {
        let h: BTreeMap<u64, u64> = [(10, 50), (20, 49), (900, 1)].into();
        assert_eq!(quantile(&h, 0.5), Some(10));
        assert_eq!(quantile(&h, 0.51), Some(20));
        assert_eq!(quantile(&h, 0.99), Some(20));
        assert_eq!(quantile(&h, 1.0), Some(900));
        assert_eq!(quantile(&BTreeMap::new(), 0.5), None);
        assert_eq!(quantile(&[(7, 1)].into(), 0.0), Some(7));
    }

    fn at(ms: i64) -> Timestamp {
        Timestamp::from_millis(ms)
    }

    fn spell(entered: i64, left: Option<i64>) -> UnknownSpell {
        UnknownSpell { route: "payments".into(), entered: at(entered), left: left.map(at) }
    }

    #[test]
    fn the_queue_depth_counts_records_entered_and_not_yet_left_at_each_step_end() {
        let samples = [10, 20, 30, 35].map(at);
        let spells = [
            spell(5, None),      // there throughout
            spell(10, Some(20)), // entered at the first sample, gone by the second
            spell(21, Some(31)), // between the second and third, gone by the fourth
            spell(36, None),     // after the last sample
            spell(12, Some(15)), // in and out between two samples: never seen
        ];
        assert_eq!(depth(&samples, spells.iter()), [2, 1, 2, 1]);
        assert_eq!(depth(&[], spells.iter()), Vec::<u64>::new());
    }

    fn bucket(route: &str, step: usize, took_ms: Option<u64>, requests: u64, attempts: u64) -> Bucket {
        Bucket {
            route: route.into(),
            step,
            took_ms,
            requests,
            attempts,
            settled: requests,
            succeeded: 0,
            first_try: 0,
            budget_stopped: 0,
            deadline_stopped: 0,
        }
    }

    #[test]
    fn rows_are_sorted_into_steps_per_configured_route_and_curves_computed_from_them() {
        let span = StatsSpan { start: at(0), end: at(30_000), step: Duration::from_secs(10), route: None };
        let rows = StatsRows {
            buckets: vec![
                // Step 0 of payments: 4 requests; 1 succeeded at once, 2 after a retry, 1 was
                // stopped by the budget, in two duration groups.
                Bucket { succeeded: 1, first_try: 1, ..bucket("payments", 0, Some(12), 1, 1) },
                Bucket { succeeded: 2, budget_stopped: 1, ..bucket("payments", 0, Some(340), 3, 5) },
                // Step 2: one still running (not settled), one that ran into its deadline.
                Bucket { settled: 0, ..bucket("payments", 2, None, 1, 1) },
                Bucket { deadline_stopped: 1, ..bucket("payments", 2, Some(1000), 1, 1) },
                Bucket { succeeded: 1, first_try: 1, ..bucket("ledger", 1, Some(5), 1, 1) },
                bucket("removed-route", 0, Some(5), 9, 9),
            ],
            unknown: vec![spell(15_000, None), UnknownSpell { route: "ledger".into(), ..spell(1, Some(2)) }],
            answers: vec![
                Answers { route: "payments".into(), step: 1, replays: 3, conflicts: 1 },
                Answers { route: "ledger".into(), step: 2, replays: 2, conflicts: 0 },
            ],
        };
        let series = assemble(&span, at(25_000), &["payments", "ledger"], &rows);
        assert_eq!(series.iter().map(|(r, _)| r.as_str()).collect::<Vec<_>>(), ["payments", "ledger"]);
        let payments = series[0].1.to_json();
        let s = &payments["series"];
        assert_eq!(s["requests"], json!([4, 0, 2]));
        assert_eq!(s["attempts"], json!([6, 0, 2]));
        assert_eq!(s["amplification"], json!([1.5, null, 1.0]));
        assert_eq!(s["first_try_success"], json!([0.25, null, 0.0]));
        assert_eq!(s["final_success"], json!([0.75, null, 0.0]));
        assert_eq!(s["retry_salvaged"], json!([2, 0, 0]));
        assert_eq!(s["budget_stopped"], json!([1, 0, 0]));
        assert_eq!(s["deadline_stopped"], json!([0, 0, 1]));
        assert_eq!(s["settled"], json!([4, 0, 1]));
        assert_eq!(s["replays"], json!([0, 3, 0]));
        assert_eq!(s["conflicts"], json!([0, 1, 0]));
        assert_eq!(s["unknown_depth"], json!([0, 1, 1]));
        assert_eq!(s["p50_ms"], json!([340, null, 1000]));
        assert_eq!(s["p99_ms"], json!([340, null, 1000]));
        let t = &payments["totals"];
        assert_eq!((t["requests"].clone(), t["attempts"].clone()), (json!(6), json!(8)));
        assert_eq!(t["amplification"], json!(1.3333));
        assert_eq!(t["final_success"], json!(0.6));
        assert_eq!(t["p50_ms"], json!(340));
        assert_eq!(t["unknown_depth"], json!(1));
        let names: Vec<&String> = s.as_object().unwrap().keys().collect();
        assert_eq!(names, Curve::ALL.map(Curve::name).iter().collect::<Vec<_>>());

        let ledger = series[1].1.to_json();
        assert_eq!(ledger["series"]["amplification"], json!([null, 1.0, null]));
        assert_eq!(ledger["series"]["replays"], json!([0, 0, 2]));
        assert_eq!(ledger["totals"]["unknown_depth"], json!(0));
    }
}
