//! `idem simulate --history`: a route's recorded requests replayed through its current policy
//! and a candidate one, side by side. Each request's recorded attempts become a script of what
//! the upstream did ([`seen`]); both policies run through the same simulator as `--outcomes`,
//! with all the route's requests interleaved in time order so that they share one retry budget
//! per policy, as they did in the broker, and each tenant's requests its quota. Where a policy sends an attempt the history does not
//! show, an [`Assume`] stands in for the upstream, and the report says how often.
//!
//! Only requests whose execution has ended are replayed; those still running, those never
//! sent (cancelled while queued, say) and tombstones (their attempts are gone) are counted and
//! left out. The circuit breaker is taken to be closed, as in `--outcomes`. A record whose
//! deadline was shorter than the route's (the client shortened it) keeps that shorter deadline
//! under either policy.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::path::Path;
use std::time::{Duration, Instant};

use crate::config::{Candidate, Config, ConfigError, Route, TenantQuotas};
use crate::domain::{BudgetScope, StopReason};
use crate::domain::{State, Tenant, Timestamp};
use crate::policy::{withdraw_from_all, Charge, RetryBudget, RetryPolicy};
use crate::record::Attempt;
use crate::simulate::{Draws, Replay};
use crate::store::recorded::{Reader, Recorded};
use crate::store::StoreError;

mod figures;
mod report;
mod seen;

pub use figures::{Ending, Figures};
pub use seen::{Assume, Unobserved};

use seen::{History, Seen};

/// The start of the history: a duration back from now (`24h`) or an RFC 3339 time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Since {
    pub at: Timestamp,
    pub text: String,
}

impl Since {
    pub fn parse(text: &str, now: Timestamp) -> Result<Since, String> {
        let trimmed = text.trim();
        let at = if let Ok(ago) = humantime::parse_duration(trimmed) {
            now - ago
        } else if let Ok(time) = humantime::parse_rfc3339_weak(trimmed) {
            match time.duration_since(std::time::UNIX_EPOCH) {
                Ok(d) => Timestamp::EPOCH + d,
                Err(_) => return Err(format!("`{text}` is before 1970")),
            }
        } else {
            return Err(format!(
                "`{text}` is neither a duration back from now (24h, 90m) nor an RFC 3339 time (2026-05-01T12:00:00Z)"
            ));
        };
        if at > now {
            return Err(format!("`{text}` is in the future"));
        }
        Ok(Since { at, text: trimmed.to_string() })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum HistoryError {
    #[error("no route named `{route}` in the config (routes: {known})")]
    UnknownRoute { route: String, known: String },
    #[error("cannot read the candidate {path}")]
    CandidateUnreadable { path: String, source: std::io::Error },
    #[error("the candidate {path} is not valid")]
    Candidate { path: String, source: ConfigError },
    #[error("cannot read the history from the store")]
    Store(#[from] StoreError),
}

/// What to replay and how.
pub struct Request<'a> {
    pub config: &'a Config,
    pub route: &'a str,
    pub since: &'a Since,
    pub candidate: &'a Path,
    pub draws: &'a Draws,
    pub assume: Assume,
    /// At most this many requests, the oldest.
    pub limit: u32,
    pub as_json: bool,
}

/// A recorded request ready to replay.
struct Replayable {
    tenant: Tenant,
    /// From the first request's arrival.
    offset: Duration,
    seen: Vec<Seen>,
    /// The deadline it was given, from its arrival.
    deadline: Duration,
    recorded: Ending,
}

/// Requests read but not replayed, by why.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LeftOut {
    /// Their execution has not ended: in progress, queued, or waiting to retry.
    pub running: u64,
    /// Ended without an attempt: cancelled while queued, their credential gone, their
    /// deadline spent in the queue.
    pub never_sent: u64,
    /// Past retention: a tombstone keeps no attempts.
    pub past_retention: u64,
}

/// One policy's replay of the whole history.
pub struct Replayed {
    pub policy: RetryPolicy,
    pub replay_safe: bool,
    pub tenants: TenantQuotas,
    pub figures: Figures,
    pub unobserved: Unobserved,
    /// Jitter draws taken.
    pub draws: usize,
}

/// What the history holds, and both replays.
pub struct Comparison {
    pub route: String,
    pub source: Source,
    pub first_arrival: Option<Timestamp>,
    pub left_out: LeftOut,
    pub recorded: Figures,
    pub current: Replayed,
    pub candidate: Replayed,
    pub candidate_form: &'static str,
    pub assume: Assume,
    pub draws: Draws,
}

/// `idem simulate --history`: reads the route's history from the config's store (read-only)
/// and returns the comparison as a table or as one JSON document.
pub async fn command(request: Request<'_>) -> Result<String, HistoryError> {
    let Some(route) = request.config.route_named(request.route) else {
        let known = request.config.routes.iter().map(|r| r.name.as_str()).collect::<Vec<_>>().join(", ");
        return Err(HistoryError::UnknownRoute { route: request.route.to_string(), known });
    };
    let path = request.candidate.display().to_string();
    let text = std::fs::read_to_string(request.candidate)
        .map_err(|source| HistoryError::CandidateUnreadable { path: path.clone(), source })?;
    let quotas = request.config.tenant_quotas();
    let candidate = Candidate::parse(&text, route, &quotas)
        .map_err(|source| HistoryError::Candidate { path: path.clone(), source })?;
    let reader = Reader::open(&request.config.store.url).await?;
    let page = reader.recorded(&route.name, request.since.at, request.limit).await;
    reader.close().await;
    let page = page?;
    let source = Source { since: request.since.clone(), cut: page.cut, candidate_file: path };
    let comparison = compare(route, &quotas, &candidate, page.requests, source, request.draws, request.assume);
    Ok(if request.as_json {
        let mut text = serde_json::to_string_pretty(&report::json(&comparison)).unwrap_or_default();
        text.push('\n');
        text
    } else {
        report::human(&comparison)
    })
}

/// Where the history came from, for the report.
pub struct Source {
    pub since: Since,
    /// More requests matched than the limit; the latest were not read.
    pub cut: bool,
    pub candidate_file: String,
}

/// Replays `history` through the route's policy (its tenants under `quotas`) and the candidate's.
pub fn compare(
    route: &Route,
    quotas: &TenantQuotas,
    candidate: &Candidate,
    history: Vec<Recorded>,
    source: Source,
    draws: &Draws,
    assume: Assume,
) -> Comparison {
    let first_arrival = history.first().map(|r| r.created_at);
    let (requests, left_out) = prepare(history);
    let recorded = Figures::of(requests.iter().map(|r| r.recorded));
    let deadline = route.retry.deadline;
    let current = replay(&requests, (&route.retry, route.replay_safe, quotas), deadline, draws, assume);
    let candidate_run =
        replay(&requests, (&candidate.retry, candidate.replay_safe, &candidate.tenants), deadline, draws, assume);
    Comparison {
        route: route.name.to_string(),
        source,
        first_arrival,
        left_out,
        recorded,
        current,
        candidate: candidate_run,
        candidate_form: candidate.form,
        assume,
        draws: draws.clone(),
    }
}

fn prepare(history: Vec<Recorded>) -> (Vec<Replayable>, LeftOut) {
    let mut left_out = LeftOut::default();
    let first = history.first().map_or(Timestamp::EPOCH, |r| r.created_at);
    let mut requests = Vec::with_capacity(history.len());
    for r in history {
        let ended = r.stop_reason.is_some() && !r.in_flight && r.state != State::InProgress;
        if r.tombstone {
            left_out.past_retention += 1;
        } else if !ended {
            left_out.running += 1;
        } else {
            // A key freed and sent again is one record but several executions, each from its
            // own arrival; the deadline's length is the latest one's.
            let arrivals: Vec<Timestamp> = std::iter::once(r.created_at).chain(r.requeued_at.iter().copied()).collect();
            let latest = arrivals[arrivals.len() - 1];
            let deadline = r.deadline_at - latest;
            for (i, &arrival) in arrivals.iter().enumerate() {
                let next = arrivals.get(i + 1).copied().unwrap_or(Timestamp::MAX);
                let attempts: Vec<Attempt> =
                    r.attempts.iter().filter(|a| a.started_at >= arrival && a.started_at < next).cloned().collect();
                if attempts.is_empty() {
                    left_out.never_sent += 1;
                    continue;
                }
                // Only the latest execution's stop reason is stored; the earlier ones freed the key.
                let stop = if arrival == latest { r.stop_reason } else { None };
                let last = attempts.last().map_or(arrival, |a| a.started_at + Duration::from_millis(a.duration_ms));
                let recorded = Ending { attempts: attempts.len() as u32, stop, elapsed: last - arrival };
                let cancelled = stop == Some(StopReason::Cancelled);
                requests.push(Replayable {
                    tenant: r.tenant.clone(),
                    offset: arrival - first,
                    seen: seen::script(arrival, &attempts, cancelled),
                    deadline,
                    recorded,
                });
            }
        }
    }
    // Executions of requeued keys start later than their records: the replay steps in time order.
    requests.sort_by_key(|r| r.offset);
    (requests, left_out)
}

/// Every request through `policy`, interleaved in time order: each step is taken when it
/// falls due, whichever request it belongs to, so the shared retry budget sees deposits and
/// withdrawals in the order they would happen. Ties go to the earlier request.
fn replay(
    requests: &[Replayable],
    (policy, replay_safe, quotas): (&RetryPolicy, bool, &TenantQuotas),
    route_deadline: Duration,
    draws: &Draws,
    assume: Assume,
) -> Replayed {
    // A deadline shorter than the route's was the client's; it holds whatever the policy.
    let policies: Vec<RetryPolicy> = requests
        .iter()
        .map(|r| match r.deadline < route_deadline {
            true => RetryPolicy { deadline: policy.deadline.min(r.deadline), ..policy.clone() },
            false => policy.clone(),
        })
        .collect();
    let origin = Instant::now();
    let mut budget = RetryBudget::new(policy.budget_ratio, policy.budget_min_per_sec, origin);
    let mut tenants: HashMap<&Tenant, RetryBudget> = HashMap::new();
    let mut draw = draws.source();
    let mut unobserved = Unobserved::default();
    let mut replays: Vec<Replay> = requests
        .iter()
        .zip(&policies)
        .map(|(r, p)| {
            Replay::new(p, replay_safe, origin + r.offset, r.seen.first().map_or(Duration::ZERO, |s| s.start))
        })
        .collect();
    let mut due: BinaryHeap<Reverse<(Duration, usize)>> = replays
        .iter()
        .enumerate()
        .filter_map(|(i, r)| r.next_at().map(|at| Reverse((requests[i].offset + at, i))))
        .collect();
    while let Some(Reverse((_, i))) = due.pop() {
        let mut upstream = History { seen: &requests[i].seen, assume, unobserved: &mut unobserved };
        let tenant = &requests[i].tenant;
        let quota = quotas
            .of(tenant)
            .map(|q| tenants.entry(tenant).or_insert_with(|| RetryBudget::new(q.ratio, q.min_per_sec, origin)));
        replays[i].step(&mut upstream, &mut Charged { route: &mut budget, tenant: quota }, &mut draw);
        if let Some(at) = replays[i].next_at() {
            due.push(Reverse((requests[i].offset + at, i)));
        }
    }
    let traces: Vec<_> = replays.into_iter().map(|r| r.trace(Vec::new())).collect();
    Replayed {
        policy: policy.clone(),
        replay_safe,
        tenants: quotas.clone(),
        figures: Figures::of(traces.iter().map(Ending::of)),
        unobserved,
        draws: traces.iter().map(|t| t.draws.len()).sum(),
    }
}

/// One request's retries, charged to its route's budget and its tenant's quota, as the broker
/// charges them.
struct Charged<'a> {
    route: &'a mut RetryBudget,
    tenant: Option<&'a mut RetryBudget>,
}

impl Charge for Charged<'_> {
    fn first_attempt(&mut self, now: Instant) {
        self.route.deposit(now);
        if let Some(tenant) = self.tenant.as_deref_mut() {
            tenant.deposit(now);
        }
    }

    fn retry(&mut self, now: Instant) -> Result<(), BudgetScope> {
        let mut budgets = vec![(BudgetScope::Route, &mut *self.route)];
        if let Some(tenant) = self.tenant.as_deref_mut() {
            budgets.push((BudgetScope::Tenant, tenant));
        }
        withdraw_from_all(&mut budgets, now)
    }
}

#[cfg(test)]
mod tests;
