//! How a history comparison is shown: a table with what was recorded, the current policy and
//! the candidate side by side, or one JSON document with the same figures.

use std::fmt::Write;
use std::time::Duration;

use serde_json::{json, Value};

use super::{Comparison, Figures, Replayed, Unobserved};
use crate::config::{BudgetLimits, TenantQuotas};
use crate::policy::RetryPolicy;
use crate::simulate::report::jitter_name;

fn ms(d: Duration) -> u64 {
    d.as_millis() as u64
}

fn policy_line(p: &RetryPolicy, replay_safe: bool) -> String {
    format!(
        "max_attempts {}, deadline {} ms, per_try_timeout {} ms, min_try {} ms, backoff base {} ms cap {} ms \
         ({} jitter), not_processed {:?}, ambiguous {:?}, budget {}% of first attempts + {}/s, replay_safe {replay_safe}",
        p.max_attempts,
        ms(p.deadline),
        ms(p.per_try_timeout),
        ms(p.min_try),
        ms(p.base),
        ms(p.cap),
        jitter_name(p.jitter),
        p.not_processed,
        p.ambiguous,
        p.budget_ratio * 100.0,
        p.budget_min_per_sec
    )
}

fn count(f: &Figures, n: u64) -> String {
    match f.share(n) {
        Some(share) => format!("{n} ({:.1}%)", share * 100.0),
        None => n.to_string(),
    }
}

fn time(d: Option<Duration>) -> String {
    d.map_or_else(|| "-".into(), |d| format!("{} ms", ms(d)))
}

fn rows(c: &Comparison) -> Vec<(&'static str, [String; 3])> {
    let columns = [&c.recorded, &c.current.figures, &c.candidate.figures];
    let each = |f: &dyn Fn(&Figures) -> String| columns.map(f);
    let unobserved = |r: &Replayed| r.unobserved.total().to_string();
    vec![
        ("logical requests", each(&|f| f.requests.to_string())),
        ("physical attempts", each(&|f| f.attempts.to_string())),
        ("amplification", each(&|f| f.amplification().map_or_else(|| "-".into(), |a| format!("{a:.2}")))),
        ("first-try success", each(&|f| count(f, f.first_try))),
        ("final success", each(&|f| count(f, f.succeeded))),
        ("retry salvage", each(&|f| count(f, f.salvaged))),
        ("budget-stopped", each(&|f| count(f, f.budget_stopped))),
        ("deadline-stopped", each(&|f| count(f, f.deadline_stopped))),
        ("p50 end-to-end", each(&|f| time(f.p50))),
        ("p99 end-to-end", each(&|f| time(f.p99))),
        ("unobserved attempts", ["-".into(), unobserved(&c.current), unobserved(&c.candidate)]),
    ]
}

fn unobserved_line(which: &str, u: &Unobserved) -> String {
    format!(
        "{which}: {} unobserved attempt(s): {} beyond the recorded attempts, {} later than recorded, {} with a \
         longer limit than a recorded timeout",
        u.total(),
        u.beyond,
        u.later,
        u.longer_limit
    )
}

fn draws_text(c: &Comparison) -> String {
    c.draws.values().iter().map(|d| d.to_string()).collect::<Vec<_>>().join(",")
}

pub(super) fn human(c: &Comparison) -> String {
    let mut out = String::new();
    let replayed = c.recorded.requests;
    let l = &c.left_out;
    let _ =
        writeln!(out, "route {}: requests since {} ({})", c.route, c.source.since.at.rfc3339(), c.source.since.text);
    let _ = writeln!(
        out,
        "{replayed} replayed; left out: {} still running, {} never sent, {} past retention{}",
        l.running,
        l.never_sent,
        l.past_retention,
        if c.source.cut {
            "; the latest requests were not read (over the limit: narrow --since or raise --limit)"
        } else {
            ""
        }
    );
    let _ = writeln!(out, "current:   {}", policy_line(&c.current.policy, c.current.replay_safe));
    let _ = writeln!(out, "candidate: {}", policy_line(&c.candidate.policy, c.candidate.replay_safe));
    let _ = writeln!(out, "           from {}, read as {}", c.source.candidate_file, c.candidate_form);
    if c.current.tenants != c.candidate.tenants {
        let _ = writeln!(out, "tenant quotas, current:   {}", quotas_line(&c.current.tenants));
        let _ = writeln!(out, "tenant quotas, candidate: {}", quotas_line(&c.candidate.tenants));
    }
    out.push('\n');
    let table = rows(c);
    let widths: Vec<usize> =
        (0..3).map(|i| table.iter().map(|(_, v)| v[i].chars().count()).chain([9]).max().unwrap_or(9)).collect();
    let label = table.iter().map(|(l, _)| l.len()).max().unwrap_or(0);
    let _ = writeln!(
        out,
        "{:<label$}  {:>w0$}  {:>w1$}  {:>w2$}",
        "",
        "recorded",
        "current",
        "candidate",
        w0 = widths[0],
        w1 = widths[1],
        w2 = widths[2]
    );
    for (name, [a, b, d]) in &table {
        let _ = writeln!(
            out,
            "{name:<label$}  {a:>w0$}  {b:>w1$}  {d:>w2$}",
            w0 = widths[0],
            w1 = widths[1],
            w2 = widths[2]
        );
    }
    out.push('\n');
    let _ = writeln!(out, "assumption ({}): {}", c.assume.name(), c.assume.describe());
    let _ = writeln!(out, "{}", unobserved_line("current", &c.current.unobserved));
    let _ = writeln!(out, "{}", unobserved_line("candidate", &c.candidate.unobserved));
    let _ = writeln!(
        out,
        "draws: {} (jitter, in time order across requests; the last repeats); the circuit is taken to be closed",
        draws_text(c)
    );
    out
}

fn figures(f: &Figures) -> Value {
    json!({
        "requests": f.requests,
        "attempts": f.attempts,
        "amplification": f.amplification(),
        "first_try_success": f.first_try,
        "final_success": f.succeeded,
        "retry_salvage": f.salvaged,
        "budget_stopped": f.budget_stopped,
        "deadline_stopped": f.deadline_stopped,
        "p50_ms": f.p50.map(ms),
        "p99_ms": f.p99.map(ms),
        "stop_reasons": f.stops,
    })
}

fn quota_text(q: Option<BudgetLimits>) -> String {
    q.map_or("none".into(), |q| format!("{}% of first attempts + {}/s", q.ratio * 100.0, q.min_per_sec))
}

fn quotas_line(t: &TenantQuotas) -> String {
    let mut parts = vec![format!("every tenant {}", quota_text(t.default))];
    parts.extend(
        t.listed.iter().filter(|(_, q)| **q != t.default).map(|(name, q)| format!("{name} {}", quota_text(*q))),
    );
    parts.join("; ")
}

fn quota_json(q: Option<BudgetLimits>) -> Value {
    q.map_or(Value::Null, |q| json!({"retry_budget_ratio": q.ratio, "retry_budget_min_per_sec": q.min_per_sec}))
}

fn replayed(r: &Replayed) -> Value {
    let p = &r.policy;
    json!({
        "policy": {
            "max_attempts": p.max_attempts,
            "deadline_ms": ms(p.deadline),
            "per_try_timeout_ms": ms(p.per_try_timeout),
            "min_try_ms": ms(p.min_try),
            "base_ms": ms(p.base),
            "cap_ms": ms(p.cap),
            "jitter": jitter_name(p.jitter),
            "not_processed": p.not_processed,
            "ambiguous": p.ambiguous,
            "budget_ratio": p.budget_ratio,
            "budget_min_per_sec": p.budget_min_per_sec,
        },
        "replay_safe": r.replay_safe,
        "tenant_quotas": {
            "default": quota_json(r.tenants.default),
            "tenants": r.tenants.listed.iter().map(|(name, q)| (name.clone(), quota_json(*q))).collect::<serde_json::Map<_, _>>(),
        },
        "figures": figures(&r.figures),
        "unobserved_attempts": {
            "total": r.unobserved.total(),
            "beyond_recorded": r.unobserved.beyond,
            "later_than_recorded": r.unobserved.later,
            "longer_limit_than_recorded_timeout": r.unobserved.longer_limit,
        },
        "draws_taken": r.draws,
    })
}

pub(super) fn json(c: &Comparison) -> Value {
    let mut candidate = replayed(&c.candidate);
    if let Value::Object(fields) = &mut candidate {
        fields.insert("file".into(), c.source.candidate_file.clone().into());
        fields.insert("form".into(), c.candidate_form.into());
    }
    json!({
        "route": c.route,
        "since": c.source.since.at.rfc3339(),
        "since_given": c.source.since.text,
        "first_arrival": c.first_arrival.map(crate::domain::Timestamp::rfc3339),
        "replayed": c.recorded.requests,
        "left_out": {
            "running": c.left_out.running,
            "never_sent": c.left_out.never_sent,
            "past_retention": c.left_out.past_retention,
        },
        "cut": c.source.cut,
        "assumption": { "name": c.assume.name(), "text": c.assume.describe() },
        "draw": c.draws.values(),
        "circuit": "taken to be closed",
        "recorded": figures(&c.recorded),
        "current": replayed(&c.current),
        "candidate": candidate,
    })
}
