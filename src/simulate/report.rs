//! How a simulation is shown: a table for people, one JSON document for tools. Both carry the
//! same rows and the same reasons.

use std::fmt::Write;
use std::time::Duration;

use serde_json::{json, Value};

use super::{final_state, AttemptStep, End, Scripted, Step, Trace, Verdict, WaitStep};
use crate::domain::{AttemptError, Class, State, StopReason};
use crate::policy::{Jitter, Observed, RetryPolicy};

fn ms(d: Duration) -> u64 {
    d.as_millis() as u64
}

fn show(d: Duration) -> String {
    format!("{} ms", ms(d))
}

fn observed_name(o: Observed) -> String {
    match (&o, o.error()) {
        (Observed::Response(status), _) => status.to_string(),
        (_, error) => error.map_or("broken", AttemptError::script_word).into(),
    }
}

pub(super) fn jitter_name(j: Jitter) -> &'static str {
    match j {
        Jitter::Full => "full",
        Jitter::Equal => "equal",
        Jitter::Decorrelated => "decorrelated",
        Jitter::None => "none",
    }
}

/// What a step was, in words.
fn event(step: &Step) -> String {
    match step {
        Step::Attempt(a) => attempt_event(a),
        Step::Wait(w) => wait_event(w),
        Step::NotStarted { number, .. } => format!("attempt {number} not started"),
    }
}

fn attempt_event(a: &AttemptStep) -> String {
    let mut text = format!("attempt {}, limit {}: ", a.number, show(a.limit));
    if a.late {
        let scripted = match a.outcome.result {
            Scripted::Status(status) => status.to_string(),
            Scripted::Timeout => "timeout".into(),
            Scripted::ConnectFailed => "connect failure".into(),
            Scripted::Broken => "broken connection".into(),
        };
        let _ = write!(
            text,
            "timeout at {} (the scripted {scripted} after {} comes too late",
            show(a.limit),
            show(a.outcome.after)
        );
        text.push_str(if a.outcome.retry_after.is_some() { ", its Retry-After unseen)" } else { ")" });
    } else {
        let _ = write!(text, "{} after {}", observed_name(a.observed), show(a.cost));
        if let Some(ra) = a.retry_after {
            let _ = write!(text, ", Retry-After {}", show(ra));
        }
    }
    if a.outcome.cancel {
        text.push_str("; the caller cancels meanwhile");
    }
    text
}

fn wait_event(w: &WaitStep) -> String {
    let planned = if w.verdict == Verdict::Retry { "" } else { "planned " };
    let draw = w.draw.map_or_else(|| "no draw".to_string(), |d| format!("draw {d}"));
    let mut text = format!("{planned}wait before attempt {}: ", w.before);
    match w.retry_after {
        Some(ra) if ra > w.backoff => {
            let _ = write!(text, "Retry-After {} over backoff {} ({draw})", show(ra), show(w.backoff));
        }
        Some(ra) => {
            let _ = write!(text, "backoff {} ({draw}) over Retry-After {}", show(w.backoff), show(ra));
        }
        None => {
            let _ = write!(text, "backoff {} ({draw})", show(w.backoff));
        }
    }
    text
}

/// Why the step's decision was what it was.
fn reason(step: &Step, policy: &RetryPolicy) -> String {
    let left = |at: Duration| show(policy.deadline.saturating_sub(at));
    match step {
        Step::NotStarted { elapsed, reason, .. } => match reason {
            StopReason::Deadline => {
                format!("{} left, less than min_try {}", left(*elapsed), show(policy.min_try))
            }
            other => other.as_str().replace('_', " "),
        },
        Step::Attempt(a) => {
            let what = match (a.observed, a.late) {
                (Observed::Response(status), _) => status.to_string(),
                (_, true) => format!("no answer within {}", show(a.limit)),
                (o, false) => observed_name(o),
            };
            match a.verdict {
                Verdict::Stop(StopReason::Cancelled) => {
                    "the caller cancelled during the attempt: nothing more is sent".into()
                }
                Verdict::Stop(StopReason::Deadline) => format!(
                    "it ended at {}, at the {} deadline or past it{}",
                    show(a.elapsed),
                    show(policy.deadline),
                    if a.class == Class::Success { ": too late to count as a success" } else { "" }
                ),
                Verdict::Stop(StopReason::Success) => format!("{what}: success"),
                Verdict::Stop(StopReason::FinalResponse) => format!("{what} is final: it executed"),
                Verdict::Stop(StopReason::UnsafeReplay) => {
                    format!("{what}: it may have executed, and the route is not replay-safe: never sent again")
                }
                Verdict::Stop(StopReason::AttemptCap) => {
                    format!("{what}; attempt {} of max_attempts {}", a.number, policy.max_attempts)
                }
                Verdict::Stop(other) => format!("{what}; {}", other.as_str().replace('_', " ")),
                Verdict::Retryable | Verdict::Retry => match (a.class, a.observed) {
                    (Class::NotExecuted, Observed::Response(_)) => format!("{what} is in not_processed: not executed"),
                    (Class::NotExecuted, _) => format!("{what}: nothing was sent"),
                    (_, Observed::Response(_)) => {
                        format!("{what} is in ambiguous: it may have executed; the route is replay-safe")
                    }
                    _ => format!("{what}: it may have executed; the route is replay-safe"),
                },
            }
        }
        Step::Wait(w) => match w.verdict {
            Verdict::Stop(StopReason::RetryAfterBeyondDeadline) => format!(
                "Retry-After {} is never shortened, and {} left cannot hold it plus min_try {}: nothing more is sent",
                show(w.retry_after.unwrap_or_default()),
                left(w.elapsed),
                show(policy.min_try)
            ),
            Verdict::Stop(StopReason::Deadline) => format!(
                "{} left cannot hold the {} wait plus min_try {}",
                left(w.elapsed),
                show(w.wait),
                show(policy.min_try)
            ),
            Verdict::Stop(StopReason::RetryBudget) => format!(
                "the route's retry budget is spent (budget_ratio {}, budget_min_per_sec {})",
                policy.budget_ratio, policy.budget_min_per_sec
            ),
            Verdict::Stop(other) => other.as_str().replace('_', " "),
            Verdict::Retry | Verdict::Retryable => {
                format!("{} left after it, at least min_try {}", left(w.elapsed), show(policy.min_try))
            }
        },
    }
}

fn decision_name(v: Verdict) -> &'static str {
    match v {
        Verdict::Retryable => "retryable",
        Verdict::Retry => "retry",
        Verdict::Stop(_) => "stop",
    }
}

fn verdict_of(step: &Step) -> Verdict {
    match step {
        Step::Attempt(a) => a.verdict,
        Step::Wait(w) => w.verdict,
        Step::NotStarted { reason, .. } => Verdict::Stop(*reason),
    }
}

fn cost_and_time(step: &Step) -> (Duration, Duration) {
    match step {
        Step::Attempt(a) => (a.cost, a.elapsed),
        Step::Wait(w) => (w.cost, w.elapsed),
        Step::NotStarted { elapsed, .. } => (Duration::ZERO, *elapsed),
    }
}

fn policy_line(name: &str, p: &RetryPolicy, replay_safe: bool) -> String {
    format!(
        "route {name}: deadline {}, per_try_timeout {}, min_try {}, max_attempts {}, backoff base {} cap {} \
         ({} jitter), replay_safe {replay_safe}; a quiet route (retry budget fresh, circuit closed)",
        show(p.deadline),
        show(p.per_try_timeout),
        show(p.min_try),
        p.max_attempts,
        show(p.base),
        show(p.cap),
        jitter_name(p.jitter)
    )
}

fn end_lines(t: &Trace) -> Vec<String> {
    let mut lines = Vec::new();
    match t.end {
        End::Stopped { reason, .. } => {
            lines.push(format!("stop: {} after {} attempt(s), at {}", reason.as_str(), t.attempts, show(t.elapsed)));
        }
        End::ScriptExhausted { next } => lines.push(format!(
            "script exhausted: the policy would send attempt {next} at {}, but the script has no outcome for it \
             (not a stop reason: add outcomes to see more)",
            show(t.elapsed)
        )),
    }
    let meaning = match final_state(t.end) {
        State::Done => "done (the last response is stored and replayed to duplicates)",
        State::Unknown => "unknown (it may have executed: reconciliation, never sent again automatically)",
        State::NotStarted => "not_started, free (the key's next request executes afresh)",
        State::InProgress => "in_progress (the execution has not ended)",
    };
    lines.push(format!("state: {meaning}"));
    if !t.unused.is_empty() {
        let unused: Vec<_> = t.unused.iter().map(|o| o.text.as_str()).collect();
        lines.push(format!("never used: {}", unused.join(", ")));
    }
    lines
}

/// The trace as a table, one row per step, then the stop, the state and the draws.
pub fn human(t: &Trace, route: &str, policy: &RetryPolicy, replay_safe: bool, random: bool) -> String {
    let rows: Vec<[String; 4]> = t
        .steps
        .iter()
        .map(|s| {
            let (cost, time) = cost_and_time(s);
            let decision = match verdict_of(s) {
                Verdict::Stop(r) => format!("stop ({})", r.as_str()),
                v => decision_name(v).to_string(),
            };
            [event(s), show(cost), show(time), format!("{decision}: {}", reason(s, policy))]
        })
        .collect();
    let width = rows.iter().map(|r| r[0].chars().count()).chain(["step".len()]).max().unwrap_or(0);
    let mut out = policy_line(route, policy, replay_safe);
    let _ = write!(out, "\n\n{:<width$}  {:>8}  {:>8}  decision\n", "step", "cost", "time");
    for [event, cost, time, decision] in rows {
        let _ = writeln!(out, "{event:<width$}  {cost:>8}  {time:>8}  {decision}");
    }
    out.push('\n');
    for line in end_lines(t) {
        out.push_str(&line);
        out.push('\n');
    }
    let draws: Vec<String> = t.draws.iter().map(|d| d.to_string()).collect();
    match (draws.is_empty(), random) {
        (true, _) => out.push_str("draws: none\n"),
        (false, false) => {
            let _ = writeln!(out, "draws: {}", draws.join(", "));
        }
        (false, true) => {
            let _ = writeln!(out, "draws (random): {0}; reproduce with --draw {0}", draws.join(","));
        }
    }
    out
}

/// The trace as one JSON document.
pub fn json(t: &Trace, route: &str, policy: &RetryPolicy, replay_safe: bool, random: bool) -> Value {
    let steps: Vec<Value> = t
        .steps
        .iter()
        .map(|s| {
            let (cost, time) = cost_and_time(s);
            let verdict = verdict_of(s);
            let mut row = match s {
                Step::Attempt(a) => json!({
                    "step": "attempt",
                    "attempt": a.number,
                    "limit_ms": ms(a.limit),
                    "scripted": a.outcome.text,
                    "observed": observed_name(a.observed),
                    "late": a.late,
                    "class": a.class.as_str(),
                    "retry_after_ms": a.retry_after.map(ms),
                    "cancelled": a.outcome.cancel,
                }),
                Step::Wait(w) => json!({
                    "step": "wait",
                    "before_attempt": w.before,
                    "draw": w.draw,
                    "backoff_ms": ms(w.backoff),
                    "retry_after_ms": w.retry_after.map(ms),
                    "wait_ms": ms(w.wait),
                    "waited": w.verdict == Verdict::Retry,
                }),
                Step::NotStarted { number, .. } => json!({ "step": "not_started", "attempt": number }),
            };
            let stop = match verdict {
                Verdict::Stop(r) => Some(r.as_str()),
                _ => None,
            };
            if let Value::Object(fields) = &mut row {
                fields.insert("event".into(), event(s).into());
                fields.insert("cost_ms".into(), ms(cost).into());
                fields.insert("elapsed_ms".into(), ms(time).into());
                fields.insert("decision".into(), decision_name(verdict).into());
                fields.insert("stop_reason".into(), stop.into());
                fields.insert("reason".into(), reason(s, policy).into());
            }
            row
        })
        .collect();
    let (stop, exhausted) = match t.end {
        End::Stopped { reason, .. } => (Some(reason.as_str()), false),
        End::ScriptExhausted { .. } => (None, true),
    };
    json!({
        "route": route,
        "replay_safe": replay_safe,
        "policy": {
            "deadline_ms": ms(policy.deadline),
            "per_try_timeout_ms": ms(policy.per_try_timeout),
            "min_try_ms": ms(policy.min_try),
            "max_attempts": policy.max_attempts,
            "base_ms": ms(policy.base),
            "cap_ms": ms(policy.cap),
            "jitter": jitter_name(policy.jitter),
        },
        "steps": steps,
        "stop_reason": stop,
        "script_exhausted": exhausted,
        "final_state": final_state(t.end).as_str(),
        "elapsed_ms": ms(t.elapsed),
        "attempts": t.attempts,
        "draws": t.draws,
        "draws_random": random,
        "unused_outcomes": t.unused.iter().map(|o| o.text.as_str()).collect::<Vec<_>>(),
        "summary": end_lines(t),
    })
}
