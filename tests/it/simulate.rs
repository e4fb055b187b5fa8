//! `idem simulate` through the real binary: the seed article's worked example and every row of
//! its boundary table ("必测边界 / 期望"), each checked in the `--json` output.

use std::io::Write;
use std::process::{Command, Output};

use serde_json::{json, Value};

/// The seed article's policy: 1500 ms budget, 600 ms per try, 100 ms minimum window, three
/// attempts, backoff base 200 ms capped at 800 ms, full jitter.
const SEED: [(&str, &str); 7] = [
    ("deadline", "\"1500ms\""),
    ("per_try_timeout", "\"600ms\""),
    ("min_try", "\"100ms\""),
    ("max_attempts", "3"),
    ("base", "\"200ms\""),
    ("cap", "\"800ms\""),
    ("jitter", "\"full\""),
];

/// A `payments` route with the seed policy, `replay_safe` as given, and `overrides` replacing or
/// adding keys of `[routes.retry]`.
fn config(replay_safe: bool, overrides: &[(&str, &str)]) -> tempfile::NamedTempFile {
    let mut retry: Vec<(&str, &str)> = SEED.to_vec();
    for (key, value) in overrides {
        retry.retain(|(k, _)| k != key);
        retry.push((key, value));
    }
    let retry: String = retry.iter().map(|(k, v)| format!("{k} = {v}\n")).collect();
    let text = format!(
        "[[routes]]\nname = \"payments\"\npath_prefix = \"/payments\"\nupstream = \"http://127.0.0.1:9\"\n\
         replay_safe = {replay_safe}\n[routes.retry]\n{retry}"
    );
    let mut file = tempfile::NamedTempFile::new().expect("a temp file");
    file.write_all(text.as_bytes()).expect("the config written");
    file
}

fn idem(config: &tempfile::NamedTempFile, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_idem"))
        .arg("simulate")
        .arg("--config")
        .arg(config.path())
        .args(["--route", "payments"])
        .args(args)
        .output()
        .expect("idem runs")
}

/// The `--json` document of a run that must succeed.
fn simulate(replay_safe: bool, overrides: &[(&str, &str)], outcomes: &str, draw: Option<&str>) -> Value {
    let config = config(replay_safe, overrides);
    let mut args = vec!["--json", "--outcomes", outcomes];
    if let Some(draw) = draw {
        args.extend(["--draw", draw]);
    }
    let out = idem(&config, &args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("one JSON document")
}

fn steps(doc: &Value) -> &Vec<Value> {
    doc["steps"].as_array().expect("steps")
}

fn kinds(doc: &Value) -> Vec<&str> {
    steps(doc).iter().map(|s| s["step"].as_str().unwrap_or("?")).collect()
}

/// Only these fields of `row` are compared, so each check names what it is about.
fn assert_row(row: &Value, expected: Value) {
    for (key, value) in expected.as_object().expect("an object") {
        assert_eq!(&row[key], value, "`{key}` of {row:#}");
    }
}

#[test]
fn the_worked_example_ends_at_1300_ms_with_the_articles_rows() {
    let doc = simulate(true, &[], "400ms:503 retry-after=300ms, 700ms:200, 100ms:200", Some("0.5"));
    let rows = steps(&doc);
    assert_eq!(rows.len(), 4, "{doc:#}");
    // First attempt: 400 ms, within its 600 ms limit, a 503 asking for 300 ms.
    assert_row(
        &rows[0],
        json!({"step": "attempt", "attempt": 1, "limit_ms": 600, "observed": "503",
        "class": "not_executed", "retry_after_ms": 300, "cost_ms": 400, "elapsed_ms": 400, "decision": "retryable"}),
    );
    // First wait: max(100, 300) = 300; 800 ms are left after it.
    assert_row(
        &rows[1],
        json!({"step": "wait", "before_attempt": 2, "draw": 0.5, "backoff_ms": 100,
        "retry_after_ms": 300, "wait_ms": 300, "cost_ms": 300, "elapsed_ms": 700, "decision": "retry", "waited": true}),
    );
    // Second attempt: min(700, 600) = 600, a timeout; the scripted success is never seen.
    assert_row(
        &rows[2],
        json!({"step": "attempt", "attempt": 2, "limit_ms": 600, "observed": "timeout",
        "late": true, "class": "ambiguous", "cost_ms": 600, "elapsed_ms": 1300, "decision": "retryable"}),
    );
    // The second wait is only planned: 200 ms left cannot hold it plus the 100 ms window.
    assert_row(
        &rows[3],
        json!({"step": "wait", "before_attempt": 3, "draw": 0.5, "backoff_ms": 200,
        "wait_ms": 200, "cost_ms": 0, "elapsed_ms": 1300, "decision": "stop", "stop_reason": "deadline",
        "waited": false}),
    );
    assert_row(
        &doc,
        json!({"stop_reason": "deadline", "final_state": "not_started", "elapsed_ms": 1300,
        "attempts": 2, "draws": [0.5, 0.5], "unused_outcomes": ["100ms:200"], "script_exhausted": false}),
    );
}

#[test]
fn a_401_stops_after_one_attempt_without_waiting() {
    // No --draw: a run that drew would list its random draws.
    let doc = simulate(false, &[], "100ms:401, 100ms:200", None);
    assert_eq!(kinds(&doc), ["attempt"]);
    assert_row(&steps(&doc)[0], json!({"observed": "401", "class": "final", "decision": "stop"}));
    assert_row(
        &doc,
        json!({"stop_reason": "final_response", "final_state": "done", "attempts": 1,
        "elapsed_ms": 100, "draws": []}),
    );
}

#[test]
fn a_possibly_executed_answer_on_a_route_that_is_not_replay_safe_stops_unsafe_replay() {
    // In Idem a 503 means "not executed" by default (not_processed = [429, 503]), so the article's
    // 503 is played by a 504, ambiguous by default...
    let doc = simulate(false, &[], "100ms:504, 100ms:200", None);
    assert_eq!(kinds(&doc), ["attempt"]);
    assert_row(&doc, json!({"stop_reason": "unsafe_replay", "final_state": "unknown", "attempts": 1}));
    // ...or by a 503 on a route that lists it as ambiguous.
    let overrides = [("not_processed", "[429]"), ("ambiguous", "[502, 503, 504]")];
    let doc = simulate(false, &overrides, "100ms:503, 100ms:200", None);
    assert_row(&steps(&doc)[0], json!({"observed": "503", "class": "ambiguous"}));
    assert_row(&doc, json!({"stop_reason": "unsafe_replay", "final_state": "unknown", "attempts": 1}));
}

#[test]
fn a_response_after_the_per_try_limit_is_a_timeout_and_its_late_retry_after_is_not_used() {
    let doc = simulate(true, &[], "700ms:503 retry-after=1s, 100ms:200", Some("0.5"));
    assert_eq!(kinds(&doc), ["attempt", "wait", "attempt"]);
    let rows = steps(&doc);
    assert_row(&rows[0], json!({"observed": "timeout", "late": true, "retry_after_ms": null, "cost_ms": 600}));
    // Had the late 1 s Retry-After been read, this wait would be 1000 ms.
    assert_row(&rows[1], json!({"retry_after_ms": null, "backoff_ms": 100, "wait_ms": 100}));
    assert_row(&doc, json!({"stop_reason": "success", "final_state": "done", "elapsed_ms": 800}));
}

#[test]
fn a_retry_after_beyond_the_remaining_budget_stops_at_once_without_waiting_or_sending() {
    let doc = simulate(true, &[], "400ms:503 retry-after=3, 100ms:200", Some("0.5"));
    assert_eq!(kinds(&doc), ["attempt", "wait"]);
    // Not shortened, not slept: the clock stays at 400 ms.
    assert_row(
        &steps(&doc)[1],
        json!({"retry_after_ms": 3000, "wait_ms": 3000, "waited": false, "cost_ms": 0,
        "elapsed_ms": 400, "decision": "stop", "stop_reason": "retry_after_beyond_deadline"}),
    );
    assert_row(
        &doc,
        json!({"stop_reason": "retry_after_beyond_deadline", "attempts": 1, "elapsed_ms": 400,
        "unused_outcomes": ["100ms:200"], "final_state": "not_started"}),
    );
}

#[test]
fn a_success_exactly_at_the_deadline_is_a_deadline_stop_not_a_success() {
    // 400 ms, a 500 ms wait, then a success after exactly the 600 ms left: at 1500 ms.
    let doc = simulate(true, &[], "400ms:503 retry-after=500ms, 600ms:200", Some("0.5"));
    assert_eq!(kinds(&doc), ["attempt", "wait", "attempt"]);
    assert_row(
        &steps(&doc)[2],
        json!({"observed": "200", "late": false, "class": "success", "elapsed_ms": 1500,
        "decision": "stop", "stop_reason": "deadline"}),
    );
    // It executed, so the record keeps the response; the client is not told it succeeded.
    assert_row(&doc, json!({"stop_reason": "deadline", "final_state": "done", "elapsed_ms": 1500}));
}

#[test]
fn a_cancel_stops_without_a_retry() {
    let doc = simulate(true, &[], "100ms:cancel, 100ms:200", None);
    assert_eq!(kinds(&doc), ["attempt"]);
    assert_row(
        &doc,
        json!({"stop_reason": "cancelled", "attempts": 1, "draws": [], "final_state": "not_started",
        "unused_outcomes": ["100ms:200"]}),
    );
    // On a route that is not replay-safe, a cancelled attempt whose answer nobody saw may have
    // executed; one that answered "not executed" leaves the key free.
    let doc = simulate(false, &[], "100ms:cancel, 100ms:200", None);
    assert_row(&doc, json!({"stop_reason": "cancelled", "final_state": "unknown"}));
    let doc = simulate(false, &[], "100ms:503 cancel, 100ms:200", None);
    assert_row(&doc, json!({"stop_reason": "cancelled", "final_state": "not_started", "attempts": 1}));
}

#[test]
fn a_single_attempt_policy_neither_draws_nor_waits() {
    let doc = simulate(true, &[("max_attempts", "1")], "100ms:503, 100ms:200", None);
    assert_eq!(kinds(&doc), ["attempt"]);
    assert_row(
        &doc,
        json!({"stop_reason": "attempt_cap", "draws": [], "elapsed_ms": 100, "attempts": 1,
        "final_state": "not_started"}),
    );
}

#[test]
fn invalid_input_is_refused_with_the_problem_named() {
    let seed = config(true, &[]);
    let cases: [(&[&str], &str); 6] = [
        (&["--outcomes", "true:200"], "`true` is a boolean"),
        (&["--outcomes", "400ms:503 retry-after=false"], "`false` is a boolean"),
        (&["--outcomes", "-400ms:200"], "`-400ms` is negative"),
        (&["--outcomes", "100ms:200", "--draw", "NaN"], "draw `NaN`: not a finite number"),
        (&["--outcomes", "100ms:200,,100ms:200"], "outcome 2 is empty"),
        (&["--outcomes", "100ms:ok"], "unknown result `ok`"),
    ];
    for (args, problem) in cases {
        let out = idem(&seed, args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} was accepted");
        assert!(stderr.contains(problem), "{args:?}: {stderr}");
        assert!(out.stdout.is_empty(), "{args:?} printed a trace");
    }
    // A boolean where the config wants milliseconds is refused too, naming the key.
    let out = idem(&config(true, &[("deadline", "true")]), &["--outcomes", "100ms:200"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("deadline"), "{out:?}");
}

#[test]
fn random_draws_are_printed_and_reproduce_the_run() {
    let outcomes = "10ms:503, 10ms:503, 10ms:200";
    let random = simulate(true, &[], outcomes, None);
    assert_eq!(random["draws_random"], true);
    let draws: Vec<String> = random["draws"].as_array().unwrap().iter().map(|d| d.to_string()).collect();
    assert_eq!(draws.len(), 2, "{random:#}");
    let replayed = simulate(true, &[], outcomes, Some(&draws.join(",")));
    assert_eq!(replayed["steps"], random["steps"]);
    assert_eq!(replayed["elapsed_ms"], random["elapsed_ms"]);
}

#[test]
fn a_script_that_runs_out_is_noted_and_is_not_a_stop_reason() {
    let doc = simulate(false, &[], "400ms:503", Some("0.5"));
    assert_row(
        &doc,
        json!({"stop_reason": null, "script_exhausted": true, "final_state": "in_progress",
        "attempts": 1, "elapsed_ms": 500}),
    );
    assert!(doc["summary"][0].as_str().unwrap().starts_with("script exhausted"), "{doc:#}");
}

#[test]
fn the_human_table_has_one_aligned_row_per_step_then_the_stop_and_the_state() {
    let config = config(true, &[]);
    let out = idem(&config, &["--outcomes", "400ms:503 retry-after=300ms, 700ms:200, 100ms:200", "--draw", "0.5"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines[0].starts_with("route payments: deadline 1500 ms, per_try_timeout 600 ms"), "{text}");
    assert_eq!(lines[1], "");
    let header = lines[2];
    assert!(header.starts_with("step ") && header.ends_with("  decision"), "{text}");
    let column = header.find("decision").unwrap();
    let rows = &lines[3..7];
    let starts = ["retryable: 503", "retry: 800 ms left", "retryable: no answer within 600 ms", "stop (deadline)"];
    for (row, start) in rows.iter().zip(starts) {
        assert_eq!(row.get(column..).map(|d| d.starts_with(start)), Some(true), "{row:?} in\n{text}");
    }
    assert!(rows[0].starts_with("attempt 1, limit 600 ms: 503 after 400 ms"), "{text}");
    assert!(rows[3].starts_with("planned wait before attempt 3") && rows[3].contains("  0 ms   1300 ms  "), "{text}");
    assert_eq!(lines[7], "");
    assert_eq!(lines[8], "stop: deadline after 2 attempt(s), at 1300 ms");
    assert!(lines[9].starts_with("state: not_started"), "{text}");
    assert_eq!(&lines[10..], ["never used: 100ms:200", "draws: 0.5, 0.5"]);
}

#[test]
fn an_unknown_route_is_refused_naming_the_routes_there_are() {
    let out = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["simulate", "--route", "mail", "--outcomes", "1ms:200", "--config"])
        .arg(config(true, &[]).path())
        .output()
        .expect("idem runs");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no route named `mail` in the config (routes: payments)"));
}

/// A shell on the host has the config but not the service's secrets: the commands that do not
/// serve read the config anyway, `check` names each missing variable, and `serve` still refuses.
#[test]
fn commands_that_do_not_serve_run_without_the_services_secrets() {
    let plain = config(true, &[]);
    let text = std::fs::read_to_string(plain.path()).unwrap().replace(
        "[[routes]]\n",
        "[auth]\nadmin_token_env = \"IDEM_TEST_UNSET_TOKEN\"\n[[routes]]\n\
         upstream_headers_env = { \"x-api-key\" = \"IDEM_TEST_UNSET_KEY\" }\n",
    );
    let mut file = tempfile::NamedTempFile::new().expect("a temp file");
    file.write_all(text.as_bytes()).expect("the config written");
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_idem"))
            .args(args)
            .arg("--config")
            .arg(file.path())
            .env_remove("IDEM_TEST_UNSET_TOKEN")
            .env_remove("IDEM_TEST_UNSET_KEY")
            .output()
            .expect("idem runs")
    };

    // `idem check` reads the file without the secrets, and then fails naming each unset one:
    // `idem serve` would refuse the config on this host until they are set.
    let check = run(&["check"]);
    assert!(!check.status.success());
    assert!(String::from_utf8_lossy(&check.stdout).starts_with("config ok"));
    let refused = String::from_utf8_lossy(&check.stderr);
    for var in ["IDEM_TEST_UNSET_TOKEN", "IDEM_TEST_UNSET_KEY"] {
        assert!(refused.contains(&format!("{var} is not set")), "{refused}");
    }

    let simulated = run(&["simulate", "--route", "payments", "--outcomes", "1ms:200", "--json"]);
    assert!(simulated.status.success(), "{}", String::from_utf8_lossy(&simulated.stderr));
    let doc: Value = serde_json::from_slice(&simulated.stdout).expect("one JSON document");
    assert_eq!(doc["final_state"], "done", "{doc:#}");

    let served = run(&["serve"]);
    assert!(!served.status.success());
    assert!(String::from_utf8_lossy(&served.stderr).contains("IDEM_TEST_UNSET_TOKEN"));
}
