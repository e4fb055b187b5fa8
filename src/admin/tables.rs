//! The operator CLI's readable tables (`idem requests`, `idem switch`, `idem reload`): what the
//! admin API answered, laid out for a person; `--json` prints the API's own instead.

use std::fmt::Write;

use serde_json::{json, Value};

pub(super) fn render_reload(v: &Value) -> String {
    let routes: Vec<String> = v["routes"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|r| format!("{} {}", text(&r["name"]), text(&r["policy_version"])))
        .collect();
    let changes = &v["changes"];
    let count = |k: &str| changes[k].as_array().map_or(0, Vec::len);
    format!(
        "applied (loaded at {}): {} route(s) added, {} changed, {} removed, settings changed: {}\nroutes: {}\n",
        text(&v["loaded_at"]),
        count("added"),
        count("changed"),
        count("removed"),
        changes["settings"].as_array().map_or_else(
            || "none".into(),
            |s| {
                let s: Vec<String> = s.iter().map(text).collect();
                if s.is_empty() {
                    "none".into()
                } else {
                    s.join(", ")
                }
            }
        ),
        routes.join(", ")
    )
}

pub(super) fn render_switch(v: &Value) -> String {
    let mut out = render_switches(&json!({"items": [v]}));
    if v["replaced"].is_object() {
        let _ = writeln!(out, "replaces {} (set by {})", text(&v["replaced"]["id"]), text(&v["replaced"]["actor"]));
    }
    out
}

pub(super) fn render_switches(v: &Value) -> String {
    let empty = vec![];
    let items = v["items"].as_array().unwrap_or(&empty);
    if items.is_empty() {
        return if v["history"] == json!(true) { "no switch was ever set\n" } else { "no switch is on\n" }.into();
    }
    let mut out = String::new();
    for s in items {
        let _ = writeln!(
            out,
            "{}  {:<8} {:<12} {:<12} set {} by {}{}",
            text(&s["id"]),
            text(&s["status"]),
            text(&s["scope"]),
            text(&s["action"]),
            text(&s["set_at"]),
            text(&s["actor"]),
            s["expires_at"].as_str().map(|at| format!(", expires {at}")).unwrap_or_default()
        );
        let _ = writeln!(out, "    why: {}", text(&s["reason"]));
        if let Some(c) = s["cleared"].as_object() {
            let _ = writeln!(out, "    cleared {} by {}: {}", text(&c["at"]), text(&c["actor"]), text(&c["reason"]));
        }
    }
    out
}

pub(super) fn text(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

pub(super) fn clip(s: &str, width: usize) -> String {
    if s.chars().count() <= width {
        s.to_string()
    } else {
        let mut out: String = s.chars().take(width.saturating_sub(1)).collect();
        out.push('…');
        out
    }
}

pub(super) fn render_list(v: &Value) -> String {
    let empty = vec![];
    let items = v["items"].as_array().unwrap_or(&empty);
    let rows: Vec<[String; 8]> = items
        .iter()
        .map(|r| {
            [
                text(&r["id"]),
                text(&r["state"]),
                text(&r["route"]),
                text(&r["tenant"]),
                clip(&text(&r["key"]), 24),
                r["attempts"].as_array().map_or(0, Vec::len).to_string(),
                text(&r["stop_reason"]),
                text(&r["created_at"]),
            ]
        })
        .collect();
    let header = ["ID", "STATE", "ROUTE", "TENANT", "KEY", "ATTEMPTS", "STOP", "CREATED"];
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let line = |cells: Vec<&str>, out: &mut String| {
        let padded: Vec<String> = cells.iter().zip(&widths).map(|(c, w)| format!("{c:<w$}")).collect();
        let _ = writeln!(out, "{}", padded.join("  ").trim_end());
    };
    line(header.to_vec(), &mut out);
    for row in &rows {
        line(row.iter().map(String::as_str).collect(), &mut out);
    }
    match v["next_cursor"].as_str() {
        Some(c) => {
            let _ = writeln!(out, "\n{} shown; more with --cursor {c}", rows.len());
        }
        None => {
            let _ = writeln!(out, "\n{} shown", rows.len());
        }
    }
    out
}

pub(super) fn render_bulk(v: &Value) -> String {
    let mut out = String::new();
    let more = if v["more"] == json!(true) { " (more match beyond the limit)" } else { "" };
    if v["dry_run"] == json!(true) {
        let _ = writeln!(out, "dry run: {} record(s) match{more}; nothing was changed", text(&v["count"]));
        if v["sample"].as_array().is_some_and(|s| !s.is_empty()) {
            let _ = writeln!(out);
            out.push_str(&render_list(&json!({"items": v["sample"]})));
        }
        return out;
    }
    let empty = vec![];
    let refused = v["refused"].as_array().unwrap_or(&empty);
    let _ = writeln!(
        out,
        "applied to {} of {} record(s){more}; {} refused",
        text(&v["applied"]),
        text(&v["matched"]),
        refused.len()
    );
    for r in refused {
        let _ = writeln!(out, "  {}  {}", text(&r["id"]), text(&r["reason"]));
    }
    if v["stopped"] == json!(true) {
        let _ = writeln!(out, "stopped early: the store could not take the rest; run it again");
    }
    out
}

pub(super) fn render_record(r: &Value) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "record    {}", text(&r["id"]));
    let _ =
        writeln!(out, "state     {}{}", text(&r["state"]), if r["queued"] == json!(true) { " (queued)" } else { "" });
    let _ = writeln!(
        out,
        "request   {} {}  (route {}, tenant {})",
        text(&r["method"]),
        text(&r["path"]),
        text(&r["route"]),
        text(&r["tenant"])
    );
    if let Some(tool) = r["tool"].as_str() {
        let _ = writeln!(out, "tool      {tool} (an MCP tools/call)");
    }
    let _ = writeln!(out, "key       {}", text(&r["key"]));
    let _ = writeln!(out, "stop      {}", text(&r["stop_reason"]));
    let _ = writeln!(out, "created   {}   updated {}", text(&r["created_at"]), text(&r["updated_at"]));
    let empty = vec![];
    let attempts = r["attempts"].as_array().unwrap_or(&empty);
    let _ = writeln!(out, "\nattempts  {}", attempts.len());
    for a in attempts {
        let what = a.get("status").map(text).or_else(|| a.get("error").map(text)).unwrap_or_else(|| "-".into());
        let policy = a.get("policy_version").map(|v| format!("  policy {}", text(v))).unwrap_or_default();
        let _ = writeln!(
            out,
            "  #{:<3} {}  after wait {:>6} ms  took {:>6} ms  {:<13} {}{}",
            text(&a["number"]),
            text(&a["started_at"]),
            text(&a["wait_ms"]),
            text(&a["duration_ms"]),
            text(&a["outcome"]),
            what,
            policy
        );
    }
    if let Some(resp) = r.get("response") {
        let body = resp.get("body").map(text).unwrap_or_else(|| "(binary body)".into());
        let _ = writeln!(out, "\nresponse  {}  {}", text(&resp["status"]), clip(&body, 200));
    }
    if let Some(history) = r["history"].as_array().filter(|h| !h.is_empty()) {
        let _ = writeln!(out, "\nhistory");
        for h in history {
            let note = h.get("note").map(|n| format!("  — {}", text(n))).unwrap_or_default();
            let _ = writeln!(out, "  {}  {:<12} {}{}", text(&h["at"]), text(&h["actor"]), text(&h["action"]), note);
        }
    }
    out
}
