//! `/metrics` after a scripted run: the numbers must add up. The broker is a process of its own
//! (`idem serve`), so its recorder sees this run alone, not the other tests' brokers.

use std::time::Duration;

use crate::common::process::{node_config, Node};
use crate::common::{keyed_post, send, Backend, Db, Gate, JsonOf, Reply, TestConfig, Upstream};

/// Sums the samples of `name` whose labels contain every `label="value"` pair given.
fn sample(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let (metric, rest) = series.split_once('{').unwrap_or((series, ""));
            (metric == name && labels.iter().all(|(k, v)| rest.contains(&format!("{k}=\"{v}\""))))
                .then(|| value.parse::<f64>().ok())
                .flatten()
        })
        .sum()
}

#[tokio::test]
async fn the_metrics_add_up_after_a_scripted_run() {
    let upstream = Upstream::start().await;
    let db = Db::new(Backend::Sqlite).await;
    let config = node_config(
        &db.url,
        TestConfig::new(&upstream.url()).tables("[routes.retry]\nbase = \"10ms\"\ncap = \"20ms\"\n"),
    )
    .body();
    let broker = Node::start("metered", &config).await;
    let body = r#"{"amount":1}"#;

    upstream.script("salvaged", vec![Reply::status(503), Reply::status(201)]);
    upstream.script("unknown", vec![Reply::status(504)]);
    upstream.script("refused", vec![Reply::status(400)]);
    upstream.script("exhausted", vec![Reply::status(503), Reply::status(503), Reply::status(503)]);
    for key in ["first", "salvaged", "unknown", "refused", "exhausted"] {
        send(broker.post("/payments", key, body)).await;
    }
    // A replay, a key reused with another body, and a duplicate while in progress.
    send(broker.post("/payments", "first", body)).await;
    send(broker.post("/payments", "first", r#"{"amount":2}"#)).await.assert_problem(422, "idempotency-key-reused");
    let slow = broker.post("/payments?delay_ms=500", "slow", body);
    let slow = tokio::spawn(async move { send(slow).await });
    upstream.await_hits("slow", 1).await;
    send(broker.post("/payments?delay_ms=500", "slow", body)).await.assert_problem(409, "request-in-progress");
    slow.await.unwrap();

    let text = broker.metrics().await;
    let route = [("route", "payments")];
    let m = |name: &str, extra: &[(&str, &str)]| {
        let labels: Vec<(&str, &str)> = route.iter().chain(extra).copied().collect();
        sample(&text, name, &labels)
    };

    // The binary this is: its version, and the commit `idem --version` names.
    assert_eq!(sample(&text, "idem_build_info", &[("version", env!("CARGO_PKG_VERSION"))]), 1.0, "{text}");
    let version = std::process::Command::new(env!("CARGO_BIN_EXE_idem")).arg("--version").output().unwrap();
    let version = String::from_utf8(version.stdout).unwrap();
    let commit = version.trim().rsplit_once('(').and_then(|(_, c)| c.strip_suffix(')')).expect("idem X (commit)");
    assert_eq!(sample(&text, "idem_build_info", &[("commit", commit)]), 1.0, "{version}");

    // The process's own figures, as dashboards expect them: memory, CPU, descriptors, start.
    assert!(sample(&text, "process_resident_memory_bytes", &[]) > 1e6, "{text}");
    // (Whole seconds: the metrics facade's counters count in integers.)
    assert!(text.lines().any(|l| l.starts_with("process_cpu_seconds_total ")), "{text}");
    let (open, max) = (sample(&text, "process_open_fds", &[]), sample(&text, "process_max_fds", &[]));
    assert!(open >= 3.0 && max >= open, "{open} of {max}");
    let started = sample(&text, "process_start_time_seconds", &[]);
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64();
    assert!(started > now - 3600.0 && started <= now, "{started} vs {now}");

    // Logical requests: six executions; physical attempts: one per stored attempt.
    assert_eq!(m("idem_requests_total", &[]), 6.0, "{text}");
    let mut stored_attempts = 0;
    for key in ["first", "salvaged", "unknown", "refused", "exhausted", "slow"] {
        stored_attempts += broker.record(key).await.unwrap()["attempts"].as_array().unwrap().len();
    }
    assert_eq!(stored_attempts, 1 + 2 + 1 + 1 + 3 + 1);
    assert_eq!(m("idem_attempts_total", &[]), stored_attempts as f64);
    assert_eq!(m("idem_attempts_total", &[("class", "not_executed")]), 4.0);
    assert_eq!(m("idem_attempts_total", &[("class", "ambiguous")]), 1.0);

    assert_eq!(m("idem_success_total", &[]), 3.0);
    assert_eq!(m("idem_first_try_success_total", &[]), 2.0);
    assert_eq!(m("idem_retry_salvaged_total", &[]), 1.0);
    assert_eq!(m("idem_stops_total", &[("reason", "unsafe_replay")]), 1.0);
    assert_eq!(m("idem_stops_total", &[("reason", "final_response")]), 1.0);
    assert_eq!(m("idem_stops_total", &[("reason", "attempt_cap")]), 1.0);
    assert_eq!(m("idem_stops_total", &[]), 6.0);

    assert_eq!(m("idem_answers_total", &[("kind", "replay")]), 1.0);
    assert_eq!(m("idem_answers_total", &[("kind", "key_reused")]), 1.0);
    assert_eq!(m("idem_answers_total", &[("kind", "in_progress")]), 1.0);

    // The reconciliation queue depth and the records by state.
    assert_eq!(sample(&text, "idem_records", &[("phase", "unknown")]), 1.0);
    assert_eq!(sample(&text, "idem_records", &[("phase", "done")]), 4.0);
    assert_eq!(sample(&text, "idem_records", &[("phase", "free")]), 1.0);
    assert_eq!(sample(&text, "idem_circuit_state", &[]), 0.0);

    // Durations: one request observation per execution, one attempt observation per attempt.
    assert_eq!(m("idem_request_duration_seconds_count", &[]), 6.0);
    assert_eq!(m("idem_attempt_duration_seconds_count", &[]), stored_attempts as f64);

    // A new key's way through, stage by stage: each of the six executions went out at once and
    // was waited for, so each stage saw six; the duplicates saw none. The stages follow each
    // other within the whole way (`answered`), so together they take no more than it.
    let stage =
        |name: &str, part: &str| sample(&text, &format!("idem_new_key_stage_seconds_{part}"), &[("stage", name)]);
    let stages = ["read", "admission_commit", "to_send", "upstream", "to_outcome", "outcome_commit"];
    for name in stages.iter().chain(&["answered"]) {
        assert_eq!(stage(name, "count"), 6.0, "{name}: {text}");
    }
    let parts: f64 = stages.iter().map(|name| stage(name, "sum")).sum();
    assert!(parts > 0.0 && parts <= stage("answered", "sum"), "{parts} against {}: {text}", stage("answered", "sum"));
    // The upstream's stage holds the upstream's own time: "slow" took 500 ms there.
    assert!(stage("upstream", "sum") >= 0.5, "{text}");

    // Every attempt is counted under the version of the policy it was sent under.
    let routes: serde_json::Value = broker.http.get(format!("{}/_idem/routes", broker.url)).json_of().await;
    let version = routes["routes"][0]["policy_version"].as_str().unwrap().to_string();
    assert_eq!(m("idem_attempts_total", &[("policy_version", &version)]), stored_attempts as f64);
    assert_eq!(m("idem_attempt_duration_seconds_count", &[("policy_version", &version)]), stored_attempts as f64);
    // The SQLite writer's commits: six new keys, each with two writes (its admission and its
    // outcome), so at least six commits carrying at least twelve writes; and the commit times
    // in buckets fitted to a disk flush, finer than the millisecond the other durations start at.
    let commits = sample(&text, "idem_store_commit_seconds_count", &[]);
    assert!(commits >= 6.0, "{text}");
    assert!(sample(&text, "idem_store_commit_writes_sum", &[]) >= 12.0, "{text}");
    assert!(text.contains("idem_store_commit_seconds_bucket{le=\"0.0001\"}"), "{text}");
    let loaded_at = sample(&text, "idem_config_loaded_at_seconds", &[]);
    assert!(loaded_at > 1.7e9, "{text}");
    exposition_is_valid(&text);

    // Reloads, counted by result, and the loaded-at time of the configuration in force.
    let reload = || async { broker.http.post(format!("{}/admin/config/reload", broker.admin)).send().await.unwrap() };
    broker.write_config(&config.replace(
        "[routes.retry]",
        "[routes.retry]
max_attempts = 0",
    ));
    assert_eq!(reload().await.status(), 422);
    broker.write_config(&config.replace(
        "[routes.retry]",
        "[routes.retry]
max_attempts = 4",
    ));
    assert_eq!(reload().await.status(), 200);
    upstream.script("after", vec![Reply::status(503), Reply::status(201)]);
    assert_eq!(send(broker.post("/payments", "after", body)).await.status, 201);
    let text = broker.metrics().await;
    assert_eq!(sample(&text, "idem_config_reloads_total", &[("result", "refused")]), 1.0, "{text}");
    assert_eq!(sample(&text, "idem_config_reloads_total", &[("result", "applied")]), 1.0, "{text}");
    assert!(sample(&text, "idem_config_loaded_at_seconds", &[]) >= loaded_at, "{text}");
    let routes: serde_json::Value = broker.http.get(format!("{}/_idem/routes", broker.url)).json_of().await;
    let new = routes["routes"][0]["policy_version"].as_str().unwrap();
    assert_ne!(new, version);
    assert_eq!(sample(&text, "idem_attempts_total", &[("policy_version", new)]), 2.0, "{text}");
    assert_eq!(sample(&text, "idem_attempts_total", &[("policy_version", &version)]), stored_attempts as f64);
    exposition_is_valid(&text);

    // An emergency switch: its gauge, and the attempt it held back.
    let set = broker
        .http
        .post(format!("{}/admin/switches", broker.admin))
        .json(&serde_json::json!({"scope": "payments", "action": "retries_off", "reason": "storm"}));
    assert_eq!(send(set).await.status, 201);
    upstream.script("switched", vec![Reply::status(503), Reply::status(201)]);
    assert_eq!(send(broker.post("/payments", "switched", body)).await.status, 503);
    let text = broker.metrics().await;
    let on = [("scope", "payments"), ("action", "retries_off")];
    assert_eq!(sample(&text, "idem_switch_active", &on), 1.0, "{text}");
    assert_eq!(sample(&text, "idem_switch_active", &[("scope", "all")]), 0.0);
    let held = [("route", "payments"), ("action", "retries_off")];
    assert_eq!(sample(&text, "idem_switch_held_total", &held), 1.0, "{text}");
    assert_eq!(sample(&text, "idem_stops_total", &[("reason", "retries_off")]), 1.0);
    exposition_is_valid(&text);

    // A request answered before its outcome (`respond-async`) has no way to the answer to time:
    // none of its stages counts. The two executions since the first count ("after", "switched").
    let accepted = send(broker.post("/payments", "async", body).header("prefer", "respond-async")).await;
    assert_eq!(accepted.status, 202);
    let done = async {
        while broker.record("async").await.unwrap()["state"] != "done" {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), done).await.expect("async was not done within 10 s");
    // Nor has a request whose client left before the answer: its execution ends and is stored,
    // but no answer is built, so none of its stages counts either. The upstream holds its answer
    // until the broker has seen the client's connection close (on a connection of its own).
    let gate = Gate::closed();
    upstream.script("left", vec![Reply::status(201).held_by(&gate)]);
    let leaving = keyed_post(&reqwest::Client::new(), &broker.url, "/payments", "left", body);
    let leaving = tokio::spawn(async move { leaving.send().await });
    upstream.await_hits("left", 1).await;
    let open = |text: &str| sample(text, "idem_connections", &[("listener", "data")]);
    let with_it = open(&broker.metrics().await);
    leaving.abort();
    let until = std::time::Instant::now() + Duration::from_secs(10);
    while open(&broker.metrics().await) >= with_it {
        assert!(std::time::Instant::now() < until, "the broker never saw the client's connection close");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    gate.open();
    broker.await_record("left", Duration::from_secs(10), |v| v["state"] == "done").await;
    let text = broker.metrics().await;
    for name in stages.iter().chain(&["answered"]) {
        let counted = sample(&text, "idem_new_key_stage_seconds_count", &[("stage", name)]);
        assert_eq!(counted, 8.0, "{name}: {text}");
    }
}

/// Every family has HELP and TYPE, as a real exposition-format parser reads them, and
/// `promtool check metrics` agrees (it must be installed under CI; `.ci/run` does).
fn exposition_is_valid(text: &str) {
    let lines = text.lines().map(|l| Ok(l.to_string()));
    let scrape = prometheus_parse::Scrape::parse(lines).expect("/metrics parses as the Prometheus text format");
    let families: std::collections::BTreeSet<String> = scrape
        .samples
        .iter()
        .map(|s| s.metric.trim_end_matches("_bucket").trim_end_matches("_sum").trim_end_matches("_count").to_string())
        .collect();
    assert!(families.len() >= 10, "{families:?}");
    for family in &families {
        assert!(scrape.docs.get(family).is_some_and(|h| !h.is_empty()), "no HELP for {family}:\n{text}");
        assert!(text.contains(&format!("# TYPE {family} ")), "no TYPE for {family}");
    }

    let promtool = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn();
    let mut promtool = match promtool {
        Ok(child) => child,
        Err(_) if std::env::var_os("CI").is_none() => {
            eprintln!("skipped promtool check metrics: promtool is not installed (Debian's prometheus package)");
            return;
        }
        Err(e) => panic!("promtool must run under CI: {e}"),
    };
    use std::io::Write;
    promtool.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let out = promtool.wait_with_output().unwrap();
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && said.trim().is_empty(), "promtool check metrics: {said}");
}
