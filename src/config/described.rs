//! The effective configuration as `idem check` prints it: every key's value in force, defaults
//! included, so an operator sees what a file means before it runs.

use super::*;

/// A duration as a file spells one: `24h`, `90s`, `250ms`, `1h30m` (not humantime's `1day`).
pub(super) fn span(d: Duration) -> String {
    if d.is_zero() {
        return "0s".into();
    }
    if d.subsec_millis() != 0 || d.as_secs() == 0 {
        return format!("{}ms", d.as_millis());
    }
    let (h, m, s) = (d.as_secs() / 3600, d.as_secs() / 60 % 60, d.as_secs() % 60);
    let mut out = String::new();
    for (n, unit) in [(h, "h"), (m, "m"), (s, "s")] {
        if n > 0 {
            out.push_str(&format!("{n}{unit}"));
        }
    }
    out
}

/// A size as a file spells one: `256MiB`, `512KiB`, `1000B`.
pub(super) fn size(bytes: u64) -> String {
    for (unit, name) in [(1u64 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")] {
        if bytes >= unit && bytes % unit == 0 {
            return format!("{}{name}", bytes / unit);
        }
    }
    format!("{bytes}B")
}

/// The effective configuration, as `idem check` prints it.
pub fn describe(c: &Config) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let h = span;
    let _ = writeln!(out, "config ok");
    let _ = writeln!(out, "listen        {}", c.server.listen);
    let _ = writeln!(out, "admin_listen  {}", c.server.admin_listen);
    let _ = writeln!(out, "limits        {}", c.server.limits.describe());
    let listener = |tls: &Option<ListenerTls>| match tls {
        Some(tls) => format!("{} (re-read on reload)", tls.cert.display()),
        None => "off".to_string(),
    };
    let _ = writeln!(out, "tls           data {}; admin {}", listener(&c.server.tls), listener(&c.server.admin_tls));
    let forwarded = match (&c.server.forwarded, c.server.forwarded.trusted_proxies.is_empty()) {
        (f, _) if !f.enabled => "off".to_string(),
        (_, true) => "on, no trusted proxy".to_string(),
        (f, false) => {
            let proxies: Vec<String> = f.trusted_proxies.iter().map(ToString::to_string).collect();
            format!("on, trusting {}", proxies.join(", "))
        }
    };
    let _ = writeln!(
        out,
        "serving       drain {} (after {} of failing readiness on SIGTERM); access log {}; forwarded {forwarded}",
        h(c.server.drain),
        h(c.server.drain_readiness),
        if c.server.access_log { "on" } else { "off" }
    );
    let _ = writeln!(out, "store         {} (retention {})", c.store.url, h(c.store.retention));
    let survives = match c.store.sync {
        crate::config::Durability::Full => "every commit synced to disk: survives a power loss",
        crate::config::Durability::Normal => {
            "survives a crash of the process; the last commits may be lost on power loss"
        }
    };
    let _ = writeln!(out, "store sync    {} ({survives})", c.store.sync);
    let _ = writeln!(
        out,
        "auth          {} tenant(s); admin token {}",
        c.auth.tenants.len(),
        if c.auth.admin_token.is_some() { "required (read from the environment)" } else { "not required" }
    );
    let quota = |b: Option<BudgetLimits>| match b {
        Some(b) => format!("{}% of first attempts + {}/s", b.ratio * 100.0, b.min_per_sec),
        None => "none".to_string(),
    };
    let _ = writeln!(out, "tenant quota  {} (retries per tenant, over all routes)", quota(c.auth.tenant_retry_budget));
    for t in c.auth.tenants.iter().filter(|t| t.retry_budget != c.auth.tenant_retry_budget) {
        let _ = writeln!(out, "  tenant {}: {}", t.name, quota(t.retry_budget));
    }
    for u in &c.upstreams {
        let _ = writeln!(
            out,
            "upstream {}  {} (budget {}, shared by its routes, with their breaker)",
            u.name,
            u.url,
            quota(Some(u.budget))
        );
    }
    let _ = writeln!(
        out,
        "worker        concurrency {}, lease {}, max_takeovers {}, send_window {}, clock_margin {}",
        c.worker.concurrency,
        h(c.worker.lease),
        c.worker.max_takeovers,
        h(c.worker.send_window),
        h(c.worker.clock_margin)
    );
    let _ = match &c.telemetry.otlp_endpoint {
        Some(endpoint) => writeln!(
            out,
            "telemetry     OTLP/HTTP to {endpoint} as {:?}, sampling {}",
            c.telemetry.service_name, c.telemetry.sampling_ratio
        ),
        None => writeln!(out, "telemetry     off (spans in the logs only)"),
    };
    for r in &c.routes {
        let p = &r.retry;
        let methods: Vec<&str> = r.methods.iter().map(Method::as_str).collect();
        let via = r.upstream_name.as_ref().map(|n| format!(" (upstream {n})")).unwrap_or_default();
        let _ = writeln!(out, "\nroute {}  {} -> {}{via}", r.name, r.path_prefix, r.upstream);
        if let Some(mcp) = &r.mcp {
            let _ = writeln!(
                out,
                "  kind mcp: tools/call recorded by annotations; in-flight wait {}; replay-safe policy_version {}",
                h(mcp.in_flight_wait),
                mcp.replay_safe_version
            );
            for (tool, rule) in &mcp.tools {
                let said = |v: Option<bool>| v.map_or("by annotation".to_string(), |v| v.to_string());
                let _ = writeln!(
                    out,
                    "    tool {tool:?}: recorded {}, replay_safe {}",
                    said(rule.recorded),
                    said(rule.replay_safe)
                );
            }
        }
        let _ = writeln!(out, "  policy_version {}", r.policy_version);
        if let Some(tls) = &r.upstream_tls {
            let _ = writeln!(out, "  upstream tls: {}", tls.describe());
        }
        let _ = writeln!(
            out,
            "  keyed methods {}; replay_safe {}; forward key {}; max_body {}; max_stored_body {}; max_concurrency {}",
            methods.join(","),
            r.replay_safe,
            r.forward_idempotency_key,
            size(r.max_body as u64),
            size(r.max_stored_body as u64),
            r.max_concurrency
        );
        let _ = writeln!(
            out,
            "  retry: {} attempts within {} (per try {}, min {}); backoff {:?} jitter, base {}, cap {}; stream idle {}",
            p.max_attempts,
            h(p.deadline),
            h(p.per_try_timeout),
            h(p.min_try),
            p.jitter,
            h(p.base),
            h(p.cap),
            h(p.stream_idle_timeout)
        );
        let _ = writeln!(
            out,
            "  not_processed {:?}; ambiguous {:?}; budget {}% of first attempts + {}/s",
            p.not_processed,
            p.ambiguous,
            p.budget_ratio * 100.0,
            p.budget_min_per_sec
        );
        if let Some(canary) = &r.canary {
            let k = &canary.retry;
            let limit = |v: Option<f64>| v.map_or("off".to_string(), |v| v.to_string());
            let _ = writeln!(
                out,
                "  canary {}% by {}, policy_version {}: {} attempts within {} (per try {}, min {}); {:?} jitter, base {}, cap {}",
                canary.percent,
                if canary.by == CanaryBy::Tenant { "tenant" } else { "key" },
                canary.policy_version,
                k.max_attempts,
                h(k.deadline),
                h(k.per_try_timeout),
                h(k.min_try),
                k.jitter,
                h(k.base),
                h(k.cap)
            );
            let _ = writeln!(
                out,
                "    stops by itself after {} canary requests if amplification is over {} or final success drops by over {}",
                canary.stop.min_requests,
                limit(canary.stop.amplification_over),
                limit(canary.stop.final_success_drop)
            );
        }
        let c = &r.circuit;
        let _ = writeln!(
            out,
            "  circuit: opens after {} failures in a row for {} (up to {}), {} trial(s) half-open",
            c.failures,
            h(c.open_for),
            h(c.max_open_for),
            c.trials
        );
        let credentials: Vec<&str> = r.upstream_headers.keys().map(|n| n.as_str()).collect();
        let _ = writeln!(
            out,
            "  upstream credentials: headers [{}] (values from the environment); client's Authorization {}; key {}",
            credentials.join(", "),
            if r.forward_authorization { "forwarded" } else { "not forwarded" },
            if r.require_key { "required" } else { "optional (keyless requests proxied unrecorded)" }
        );
        if let Some(probe) = &r.probe {
            let _ = writeln!(out, "  probe {} {} after {}", probe.method, probe.path, h(probe.settle));
        }
        if let Some(name) = &r.deadline_header {
            let _ = writeln!(
                out,
                "  deadline header: {name} (each attempt's milliseconds sent upstream; a client's may shorten the deadline)"
            );
        }
        match &r.attempt_header {
            Some(name) => {
                let _ =
                    writeln!(out, "  attempt header: {name} (each attempt's record, claim and number sent upstream)");
            }
            None => {
                let _ = writeln!(out, "  attempt header: off");
            }
        }
    }
    out
}
